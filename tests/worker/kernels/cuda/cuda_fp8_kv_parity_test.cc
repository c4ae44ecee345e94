// CUDA vs CPU parity of an FP8 KV cache (KvLayerView::dtype kF8E4M3): float8 e4m3fn codes without a
// scale, written with E4M3Encode and read with E4M3Decode (kernels/shared/fp8_math.h) by both backends
// (the CUDA kernels through worker/kernels/cuda/kv_cache.cuh). Skipped without a device (label gpu).
//
//   * KvWrite leaves exactly the CPU backend's bytes in both caches, the rows it writes and the rest,
//     for values over the whole e4m3 range and its edges (ties, subnormals, underflow to zero,
//     saturation at +-448, infinities, NaN, -0).
//   * KvWrite with RoPE fused: the keys' codes are those of the rotated keys. The two backends'
//     rotations agree to f32 rounding (their cosf/sinf differ, as for an f32 cache in
//     cuda_fused_parity_test.cc), not always bit for bit, and a last-bit difference can move a code
//     across a rounding boundary. So every GPU code is E4M3Encode of the GPU's own rotated value,
//     and equals the CPU's code wherever the two rotated values are the same f32 (v and the
//     unrotated tail everywhere); and the fused op writes the bytes of Rope then KvWrite on the GPU.
//   * Attention over the same codes multiplies the same f32 values on both backends: the f32
//     tolerance of the 16-bit cache cases (cuda_parity_test.cc). Decode rows of several sequences
//     deep in their contexts (keys split over blocks and merged in the launch), and prefill rows (at
//     least 16 per sequence: with a bf16 cache the tensor-core path; an FP8 cache stays on the CUDA
//     cores), over every key walk: 16-byte loads of 16 codes (head_dim 64, 128, 256), the scalar
//     chunked walk (72) and the per-key walk (320).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "common/tensor/dtype.h"
#include "tests/worker/kernels/cuda/cuda_parity_fixture.h"
#include "worker/kernels/backend.h"
#include "worker/kernels/shared/fp8_math.h"

namespace shardserve::kernels {
namespace {

// The codes both backends' KvWrite store for `values`.
std::vector<uint8_t> Encode(const std::vector<float>& values) {
  std::vector<uint8_t> codes(values.size());
  for (size_t i = 0; i < values.size(); ++i) codes[i] = E4M3Encode(values[i]);
  return codes;
}

// Values over e4m3's whole range: random signs and magnitudes 2^u, u uniform in [-12, 10): below
// half the smallest subnormal (zero), subnormals, normals, and beyond 448 (saturated). With `edges`,
// every 5th value is one of the edge values below instead, in turn.
std::vector<float> WideValues(size_t n, uint32_t seed, bool edges) {
  const float inf = std::numeric_limits<float>::infinity();
  const float edge_values[] = {
      0.f, -0.f, 448.f, -448.f, 464.f, 1e6f, -inf, inf, std::numeric_limits<float>::quiet_NaN(),
      1.0625f,                                      // halfway between 1 and 1.125: 1 (even)
      1.1875f,                                      // halfway between 1.125 and 1.25: 1.25 (even)
      std::ldexp(1.5f, -9),                         // halfway between subnormals 1 and 2 (x 2^-9): 2
      std::ldexp(1.0f, -10),                        // halfway between 0 and 2^-9: 0
      std::nextafter(std::ldexp(1.0f, -10), 1.0f),  // just above it: 2^-9
      std::ldexp(7.5f, -9),                         // between the largest subnormal and 2^-6: 2^-6
      std::nextafter(std::ldexp(1.0f, -6), 0.0f),   // just below the smallest normal
      std::ldexp(1.0f, -130),                       // an f32 denormal: 0
      -240.f, 440.f};
  constexpr size_t kEdgeCount = sizeof(edge_values) / sizeof(edge_values[0]);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> exponent(-12.f, 10.f);
  std::bernoulli_distribution negative(0.5);
  std::vector<float> v(n);
  size_t next_edge = 0;
  for (size_t i = 0; i < n; ++i) {
    const float x = std::exp2(exponent(rng));
    v[i] = negative(rng) ? -x : x;
    if (edges && i % 5 == 0) v[i] = edge_values[next_edge++ % kEdgeCount];
  }
  return v;
}

// A parameterised case's name: its PrintTo.
template <typename Case>
std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  return ::testing::PrintToString(info.param);
}

std::string CodeString(uint8_t code) {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "0x%02x (%g)", static_cast<unsigned>(code), static_cast<double>(E4M3Decode(code)));
  return buf;
}

// got == want byte for byte; otherwise how many differ, and the first.
void ExpectSameCodes(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t differing = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i] && differing++ == 0) first = i;
  }
  EXPECT_EQ(differing, 0u) << what << ": " << differing << " of " << got.size() << " bytes differ, the first at "
                           << first << ": " << CodeString(got[first]) << " where " << CodeString(want[first]);
}

// The element index in a cache of each row of the batch: [tokens] (row r's elements follow).
std::vector<int64_t> CacheRowStarts(const PagedLayout& layout, int64_t block_size, int64_t row) {
  std::vector<int64_t> starts(static_cast<size_t>(layout.tokens));
  for (const AttnSeq& s : layout.seqs) {
    for (int32_t i = 0; i < s.q_len; ++i) {
      const int64_t pos = int64_t{s.pos_begin} + i;
      const int64_t block = layout.table[static_cast<size_t>(s.table_begin + pos / block_size)];
      starts[static_cast<size_t>(s.q_begin + i)] = (block * block_size + pos % block_size) * row;
    }
  }
  return starts;
}

// `cache` after a KvWrite of `values` ([tokens, row]) into the rows at `starts`.
std::vector<uint8_t> Written(std::vector<uint8_t> cache, const std::vector<float>& values,
                             const std::vector<int64_t>& starts, int64_t row) {
  for (size_t t = 0; t < starts.size(); ++t) {
    for (int64_t e = 0; e < row; ++e) {
      cache[static_cast<size_t>(starts[t] + e)] = E4M3Encode(values[t * static_cast<size_t>(row) + e]);
    }
  }
  return cache;
}

TEST_F(CudaParityTest, Fp8KvCacheIsTakenByBothBackends) {
  for (Op op : {Op::kKvWrite, Op::kAttention}) {
    EXPECT_TRUE(backend(kGpu).SupportsOp(op, DType::kF8E4M3)) << OpName(op);
    EXPECT_TRUE(backend(kRef).SupportsOp(op, DType::kF8E4M3)) << OpName(op);
  }
  // Multi-head latent attention is not on the GPU, in any dtype.
  EXPECT_FALSE(backend(kGpu).SupportsOp(Op::kMlaKvWrite, DType::kF8E4M3));
  EXPECT_FALSE(backend(kGpu).SupportsOp(Op::kMlaAttention, DType::kF8E4M3));
}

// A prefill from position 0, decode steps deep in their contexts and a chunk continuing a cached
// prefix, each sequence's blocks its own (shuffled; some blocks no table names). The caches start
// with random codes, so the bytes no row is written to are compared too.
TEST_F(CudaParityTest, Fp8KvWriteStoresTheCpuCodes) {
  constexpr int64_t kBlock = 8, kBlocks = 16, kKvHeads = 2, kHeadDim = 64;
  const auto paged = MirrorPaged(LayOutPaged({{0, 11}, {40, 1}, {17, 6}, {7, 1}}, kBlock, kBlocks, 301));
  ASSERT_LE(paged.host.table.size(), static_cast<size_t>(kBlocks));  // distinct blocks
  const int64_t row = kKvHeads * kHeadDim;
  const size_t cache_bytes = static_cast<size_t>(kBlocks * kBlock * row);
  const std::vector<float> k = WideValues(static_cast<size_t>(paged.host.tokens * row), 302, true);
  const std::vector<float> v = WideValues(static_cast<size_t>(paged.host.tokens * row), 303, true);
  const std::vector<uint8_t> k0 = Encode(RandomFloats(cache_bytes, 304, -2.f, 2.f));
  const std::vector<uint8_t> v0 = Encode(RandomFloats(cache_bytes, 305, -2.f, 2.f));
  auto dk = Mirror(k);
  auto dv = Mirror(v);
  auto ck = Mirror(k0);
  auto cv = Mirror(v0);
  RunBoth([&](Backend& b, int s) {
    return b.KvWrite({.k = dk.at(s), .v = dv.at(s), .paged = paged.at(s), .tokens = paged.host.tokens,
                      .cache = {ck.at(s), cv.at(s), kBlocks, kBlock, kKvHeads, kHeadDim, DType::kF8E4M3}});
  });
  const std::vector<int64_t> starts = CacheRowStarts(paged.host, kBlock, row);
  ExpectSameCodes(Read(ck, kGpu), Read(ck, kRef), "k cache, GPU vs CPU");
  ExpectSameCodes(Read(cv, kGpu), Read(cv, kRef), "v cache, GPU vs CPU");
  // And both are the codes of the values, where they belong (not, say, both left untouched).
  ExpectSameCodes(Read(ck, kGpu), Written(k0, k, starts, row), "k cache, GPU vs E4M3Encode");
  ExpectSameCodes(Read(cv, kGpu), Written(v0, v, starts, row), "v cache, GPU vs E4M3Encode");
}

// ---- KvWrite with rope ---------------------------------------------------------------------------

struct Fp8RopeWriteCase {
  std::vector<int32_t> seq_lens;  // the batch's sequences, in row order
  int64_t q_heads, kv_heads, head_dim, rotary_dim;
};

void PrintTo(const Fp8RopeWriteCase& c, std::ostream* os) {
  int64_t tokens = 0;
  for (int32_t n : c.seq_lens) tokens += n;
  *os << "t" << tokens << "_seqs" << c.seq_lens.size() << "_q" << c.q_heads << "_kv" << c.kv_heads << "_d"
      << c.head_dim << "_rot" << c.rotary_dim;
}

class CudaFp8RopeKvWriteParityTest : public CudaParityTest, public ::testing::WithParamInterface<Fp8RopeWriteCase> {};

TEST_P(CudaFp8RopeKvWriteParityTest, StoresTheCodesOfTheRotatedKeys) {
  const Fp8RopeWriteCase c = GetParam();
  constexpr int64_t kBlock = 8, kBlocks = 64;
  // Sequence s starts at position 5 + 13 s, as in cuda_fused_parity_test.cc.
  std::vector<SeqSpec> specs;
  std::vector<int32_t> positions;
  for (size_t s = 0; s < c.seq_lens.size(); ++s) {
    const int32_t pos_begin = 5 + 13 * static_cast<int32_t>(s);
    specs.push_back({pos_begin, c.seq_lens[s]});
    for (int32_t j = 0; j < c.seq_lens[s]; ++j) positions.push_back(pos_begin + j);
  }
  const auto paged = MirrorPaged(LayOutPaged(specs, kBlock, kBlocks, 310));
  ASSERT_LE(paged.host.table.size(), static_cast<size_t>(kBlocks));  // distinct blocks
  const int64_t tokens = paged.host.tokens;
  const int64_t rot = c.rotary_dim > 0 ? c.rotary_dim : c.head_dim;
  std::vector<float> inv_freq(static_cast<size_t>(rot / 2));
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    inv_freq[i] = 1.0f / std::pow(10000.0f, static_cast<float>(2 * i) / static_cast<float>(rot));
  }
  const int64_t row = c.kv_heads * c.head_dim;
  const size_t cache_bytes = static_cast<size_t>(kBlocks * kBlock * row);
  const std::vector<float> q0 = RandomFloats(static_cast<size_t>(tokens * c.q_heads * c.head_dim), 311);
  // Finite keys (a rotation mixes two of them); the values take the edges too.
  const std::vector<float> k0 = WideValues(static_cast<size_t>(tokens * row), 312, false);
  const std::vector<float> v = WideValues(static_cast<size_t>(tokens * row), 313, true);
  const std::vector<uint8_t> ck0 = Encode(RandomFloats(cache_bytes, 314, -2.f, 2.f));
  const std::vector<uint8_t> cv0 = Encode(RandomFloats(cache_bytes, 315, -2.f, 2.f));
  auto pos = Mirror(positions);
  auto freq = Mirror(inv_freq);
  auto dv = Mirror(v);
  struct Run {
    Mirrored<float> q, k;
    Mirrored<uint8_t> ck, cv;
  };
  auto fresh = [&]() { return Run{Mirror(q0), Mirror(k0), Mirror(ck0), Mirror(cv0)}; };
  auto params = [&](Run& r, int s) {
    KvWriteParams write{.k = r.k.at(s), .v = dv.at(s), .paged = paged.at(s), .tokens = tokens,
                        .cache = {r.ck.at(s), r.cv.at(s), kBlocks, kBlock, c.kv_heads, c.head_dim, DType::kF8E4M3}};
    write.rope = RopeParams{.q = r.q.at(s), .k = r.k.at(s), .positions = pos.at(s), .inv_freq = freq.at(s),
                            .tokens = tokens, .q_heads = c.q_heads, .kv_heads = c.kv_heads, .head_dim = c.head_dim,
                            .rotary_dim = c.rotary_dim};
    return write;
  };
  Run fused = fresh();
  RunBoth([&](Backend& b, int s) { return b.KvWrite(params(fused, s)); });
  ExpectMirrorsClose(fused.q);
  ExpectMirrorsClose(fused.k);
  const std::vector<int64_t> starts = CacheRowStarts(paged.host, kBlock, row);
  const std::vector<float> gpu_k = Read(fused.k, kGpu);
  const std::vector<float> cpu_k = Read(fused.k, kRef);
  const std::vector<uint8_t> gpu_ck = Read(fused.ck, kGpu);
  const std::vector<uint8_t> cpu_ck = Read(fused.ck, kRef);
  // Each backend's key codes are those of its own rotated keys, in the right places.
  ExpectSameCodes(gpu_ck, Written(ck0, gpu_k, starts, row), "k cache, GPU vs E4M3Encode of the GPU's keys");
  ExpectSameCodes(cpu_ck, Written(ck0, cpu_k, starts, row), "k cache, CPU vs E4M3Encode of the CPU's keys");
  // The GPU's codes are the CPU's wherever the rotated keys are the same f32.
  std::vector<bool> may_differ(cache_bytes, false);
  int64_t keys_differing = 0, codes_differing = 0;
  for (size_t t = 0; t < starts.size(); ++t) {
    for (int64_t e = 0; e < row; ++e) {
      const size_t i = t * static_cast<size_t>(row) + static_cast<size_t>(e);
      if (std::memcmp(&gpu_k[i], &cpu_k[i], sizeof(float)) != 0) {
        const size_t at = static_cast<size_t>(starts[t] + e);
        may_differ[at] = true;
        ++keys_differing;
        codes_differing += gpu_ck[at] != cpu_ck[at] ? 1 : 0;
        EXPECT_LT(e % c.head_dim, rot) << "an unrotated element differs: token " << t << ", element " << e;
      }
    }
  }
  std::vector<uint8_t> cpu_ck_where_same = cpu_ck;
  for (size_t i = 0; i < cache_bytes; ++i) {
    if (may_differ[i]) cpu_ck_where_same[i] = gpu_ck[i];
  }
  ExpectSameCodes(gpu_ck, cpu_ck_where_same, "k cache, GPU vs CPU where the rotated keys agree");
  RecordProperty("rotated_keys_differing", static_cast<int>(keys_differing));
  RecordProperty("key_codes_differing", static_cast<int>(codes_differing));
  ExpectSameCodes(Read(fused.cv, kGpu), Read(fused.cv, kRef), "v cache, GPU vs CPU");
  ExpectSameCodes(Read(fused.cv, kGpu), Written(cv0, v, starts, row), "v cache, GPU vs E4M3Encode");

  // The fused op against Rope then KvWrite on the GPU: the same bytes everywhere.
  Run separate = fresh();
  Backend& gpu = backend(kGpu);
  KvWriteParams write = params(separate, kGpu);
  ASSERT_TRUE(gpu.Rope(*write.rope).ok());
  write.rope.reset();
  ASSERT_TRUE(gpu.KvWrite(write).ok());
  ASSERT_TRUE(gpu.Synchronize().ok());
  ExpectSameCodes(Read(separate.ck, kGpu), gpu_ck, "k cache, separate vs fused");
  ExpectSameCodes(Read(separate.cv, kGpu), Read(fused.cv, kGpu), "v cache, separate vs fused");
}

// Decode steps of several sequences and a prefill chunk of 9, multi-head and GQA, whole and partial
// rotation (the unrotated tail is stored by its own loop).
INSTANTIATE_TEST_SUITE_P(Shapes, CudaFp8RopeKvWriteParityTest,
                         ::testing::Values(Fp8RopeWriteCase{{1, 1, 1, 5}, 8, 2, 64, 0},
                                           Fp8RopeWriteCase{{9, 1}, 4, 4, 128, 96},
                                           Fp8RopeWriteCase{{2, 1}, 6, 1, 64, 48},
                                           Fp8RopeWriteCase{{16}, 32, 8, 128, 0}),
                         CaseName<Fp8RopeWriteCase>);

// ---- Attention -----------------------------------------------------------------------------------

struct Fp8AttentionCase {
  bool prefill;  // kPrefillBatch; else one decode row in each of four sequences
  int64_t q_heads, kv_heads, head_dim, sliding_window;
};

void PrintTo(const Fp8AttentionCase& c, std::ostream* os) {
  *os << (c.prefill ? "prefill" : "decode") << "_q" << c.q_heads << "_kv" << c.kv_heads << "_d" << c.head_dim
      << "_window" << c.sliding_window;
}

class CudaFp8AttentionParityTest : public CudaParityTest, public ::testing::WithParamInterface<Fp8AttentionCase> {};

TEST_P(CudaFp8AttentionParityTest, MatchesCpuOverTheSameCodes) {
  const Fp8AttentionCase c = GetParam();
  constexpr int64_t kBlock = 16;
  // Decode: rows at positions 299, 1000, 2047 and 2899 (their tables need 392 blocks of the 256:
  // later ones reuse ids, which attention, reading only, does not mind). Prefill: distinct blocks.
  const int32_t blocks = c.prefill ? 16 : 256;
  const auto paged =
      MirrorPaged(c.prefill ? LayOutPaged(kPrefillBatch, kBlock, blocks, 320)
                            : LayOutPaged({{299, 1}, {1000, 1}, {2047, 1}, {2899, 1}}, kBlock, blocks, 321));
  const int64_t tokens = paged.host.tokens;
  const size_t cache_bytes = static_cast<size_t>(blocks * kBlock * c.kv_heads * c.head_dim);
  // Scores of a few units, so the softmax is neither flat nor one-hot.
  auto ck = Mirror(Encode(RandomFloats(cache_bytes, 322, -2.f, 2.f)));
  auto cv = Mirror(Encode(RandomFloats(cache_bytes, 323)));
  auto q = Mirror(RandomFloats(static_cast<size_t>(tokens * c.q_heads * c.head_dim), 324, -2.f, 2.f));
  auto out = Mirror(std::vector<float>(static_cast<size_t>(tokens * c.q_heads * c.head_dim)));
  auto params = [&](int s) {
    return AttentionParams{.q = q.at(s), .out = out.at(s), .paged = paged.at(s), .tokens = tokens,
                           .q_heads = c.q_heads,
                           .cache = {ck.at(s), cv.at(s), blocks, kBlock, c.kv_heads, c.head_dim, DType::kF8E4M3},
                           .scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim)),
                           .sliding_window = c.sliding_window};
  };
  // The point of the decode cases: the plan splits the keys (on GPUs of at least 65 multiprocessors,
  // such as the A100, H100 and H200, every decode case here does).
  if (!c.prefill) {
    ASSERT_GT(backend(kGpu).AttentionShapeKey(params(kGpu)), 1);
  }
  RunBoth([&](Backend& b, int s) { return b.Attention(params(s)); });
  ExpectMirrorsClose(out);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaFp8AttentionParityTest,
                         ::testing::Values(Fp8AttentionCase{false, 32, 4, 128, 0},     // GQA 8
                                           Fp8AttentionCase{false, 16, 2, 64, 0},
                                           Fp8AttentionCase{false, 8, 2, 256, 0},
                                           Fp8AttentionCase{false, 16, 2, 128, 1000},  // a window
                                           Fp8AttentionCase{false, 8, 8, 128, 0},      // no GQA
                                           Fp8AttentionCase{false, 8, 2, 72, 0},       // scalar chunked walk
                                           Fp8AttentionCase{false, 4, 1, 320, 0},      // per-key walk
                                           Fp8AttentionCase{true, 8, 2, 64, 0},
                                           Fp8AttentionCase{true, 16, 2, 128, 0},
                                           Fp8AttentionCase{true, 8, 2, 256, 0},
                                           Fp8AttentionCase{true, 8, 1, 128, 24},
                                           Fp8AttentionCase{true, 4, 4, 64, 20}),
                         CaseName<Fp8AttentionCase>);

}  // namespace
}  // namespace shardserve::kernels

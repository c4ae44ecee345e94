// CUDA parity of the fused ops (part of cuda_parity_test; fixture in cuda_parity_fixture.h):
//   * the gated LinearGroup (LinearGroupParams::gated): one GEMV launch for gate, up and the
//     activation up to kGemv16MaxTokens (8) tokens, GEMMs and the SiluMul kernel above;
//   * KvWrite with rope (KvWriteParams::rope): Rope and the cache write in one kernel;
//   * the normed LinearGroup (LinearGroupParams::norm): the norm inside the decode GEMV.
// Each is checked twice: against the CPU oracle within the tolerances of its neighbours in
// cuda_parity_test.cc, and against the separate CUDA ops it replaces, bit for bit (the fused kernels
// run the same dots, sums and row math, so a decode step's results must not move by a bit).
#include <cmath>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "common/tensor/dtype.h"
#include "tests/worker/kernels/cuda/cuda_parity_fixture.h"
#include "worker/kernels/backend.h"

namespace shardserve::kernels {
namespace {

// The `bytes` bytes at device pointer `p` of backend `b`, for exact comparisons.
std::vector<uint8_t> DeviceBytes(Backend& b, const void* p, size_t bytes) {
  std::vector<uint8_t> host(bytes);
  EXPECT_TRUE(b.CopyToHost(host.data(), p, bytes).ok());
  return host;
}


// ---- Gated LinearGroup ---------------------------------------------------------------------------

struct GatedCase {
  DType dtype;
  int64_t tokens, in, out;
  bool bias;
  GateActivation act;
};

void PrintTo(const GatedCase& c, std::ostream* os) {
  *os << DTypeName(c.dtype) << "_t" << c.tokens << "_in" << c.in << "_out" << c.out << (c.bias ? "_bias" : "")
      << (c.act == GateActivation::kSilu ? "_silu" : c.act == GateActivation::kGeluTanh ? "_gelu" : "_clamped");
}

std::string GatedName(const ::testing::TestParamInfo<GatedCase>& info) { return ::testing::PrintToString(info.param); }

class CudaGatedLinearParityTest : public CudaParityTest, public ::testing::WithParamInterface<GatedCase> {};

TEST_P(CudaGatedLinearParityTest, MatchesCpuAndTheSeparateCudaOpsBitForBit) {
  const GatedCase c = GetParam();
  const std::vector<uint16_t> wg16 = Narrow(c.dtype, RandomFloats(c.out * c.in, 201));
  const std::vector<uint16_t> wu16 = Narrow(c.dtype, RandomFloats(c.out * c.in, 202));
  auto x = Mirror(RandomFloats(c.tokens * c.in, 200, -2.f, 2.f));
  auto wg = Mirror(Widen(c.dtype, wg16));
  auto wu = Mirror(Widen(c.dtype, wu16));
  auto wg_narrow = Mirror(wg16);
  auto wu_narrow = Mirror(wu16);
  auto bg = Mirror(RandomFloats(c.out, 203));
  auto bu = Mirror(RandomFloats(c.out, 204));
  const std::vector<float> garbage = RandomFloats(c.tokens * c.out, 205);
  auto gate = Mirror(garbage);
  auto up = Mirror(garbage);
  auto group = [&](int s, float* gate_y, float* up_y) {
    LinearGroupParams g{.x = x.at(s), .tokens = c.tokens, .in = c.in, .num_parts = 2};
    const bool narrow = s == kGpu;
    g.parts[0] = {.w = narrow ? WeightView(c.dtype, wg_narrow.at(s)) : WeightView(wg.at(s)),
                  .bias = c.bias ? bg.at(s) : nullptr, .y = gate_y, .out = c.out};
    g.parts[1] = {.w = narrow ? WeightView(c.dtype, wu_narrow.at(s)) : WeightView(wu.at(s)),
                  .bias = c.bias ? bu.at(s) : nullptr, .y = up_y, .out = c.out};
    return g;
  };
  RunBoth([&](Backend& b, int s) {
    LinearGroupParams g = group(s, gate.at(s), up.at(s));
    g.gated = c.act;
    return b.LinearGroup(g);
  });
  if (c.tokens <= 8) {
    ExpectMirrorsClose(gate);
  } else {
    ExpectMirrorsClose(gate, 2e-2f, 1e-5);  // the GEMM rounds x to 16 bits (cuda_parity_test.cc)
  }

  // The separate CUDA ops on the same inputs: the plain LinearGroup, then SiluMul.
  auto gate_ref = Mirror(garbage);
  auto up_ref = Mirror(garbage);
  Backend& gpu = backend(kGpu);
  ASSERT_TRUE(gpu.LinearGroup(group(kGpu, gate_ref.at(kGpu), up_ref.at(kGpu))).ok());
  ASSERT_TRUE(gpu.SiluMul({.gate = gate_ref.at(kGpu), .up = up_ref.at(kGpu), .out = gate_ref.at(kGpu),
                           .n = c.tokens * c.out, .act = c.act})
                  .ok());
  ASSERT_TRUE(gpu.Synchronize().ok());
  const size_t bytes = static_cast<size_t>(c.tokens * c.out) * sizeof(float);
  EXPECT_EQ(DeviceBytes(gpu, gate.at(kGpu), bytes), DeviceBytes(gpu, gate_ref.at(kGpu), bytes));
}

// tokens 1, 2, 3 and 8 take the gated GEMV (its 1-, 2-, 4- and 8-row instantiations), 9 the GEMMs
// and the SiluMul kernel; in = 264 the GEMV's 16-byte loads, in = 131 (odd) its scalar path.
constexpr GateActivation kSilu = GateActivation::kSilu, kGelu = GateActivation::kGeluTanh;
constexpr GateActivation kClamped = GateActivation::kClampedSwiglu;  // GPT-OSS's experts
INSTANTIATE_TEST_SUITE_P(Shapes, CudaGatedLinearParityTest,
                         ::testing::Values(GatedCase{DType::kBF16, 1, 264, 300, false, kSilu},
                                           GatedCase{DType::kF16, 1, 131, 65, true, kGelu},
                                           GatedCase{DType::kBF16, 2, 131, 33, true, kSilu},
                                           GatedCase{DType::kF16, 2, 264, 70, false, kSilu},
                                           GatedCase{DType::kBF16, 3, 264, 129, true, kGelu},
                                           GatedCase{DType::kF16, 3, 131, 9, false, kSilu},
                                           GatedCase{DType::kBF16, 8, 264, 80, true, kSilu},
                                           GatedCase{DType::kF16, 8, 131, 257, true, kGelu},
                                           GatedCase{DType::kBF16, 9, 264, 80, true, kGelu},
                                           GatedCase{DType::kF16, 9, 131, 33, false, kSilu},
                                           GatedCase{DType::kBF16, 1, 264, 96, true, kClamped},
                                           GatedCase{DType::kBF16, 9, 264, 80, true, kClamped}),
                         GatedName);

// ---- Normed LinearGroup --------------------------------------------------------------------------

struct NormedCase {
  DType dtype;
  int64_t tokens, in, out;
  bool gated;
};

void PrintTo(const NormedCase& c, std::ostream* os) {
  *os << DTypeName(c.dtype) << "_t" << c.tokens << "_in" << c.in << "_out" << c.out << (c.gated ? "_gated" : "_qkv");
}

std::string NormedName(const ::testing::TestParamInfo<NormedCase>& info) {
  return ::testing::PrintToString(info.param);
}

class CudaNormedLinearParityTest : public CudaParityTest, public ::testing::WithParamInterface<NormedCase> {};

// The normed form (LinearGroupParams::norm): against the CPU (the default: RmsNorm, then the group),
// and against the CUDA RmsNorm kernel followed by the plain group, bit for bit (the GEMV computes
// the norm kernels' inverse RMS with their reduction and multiplies their normalised values).
TEST_P(CudaNormedLinearParityTest, MatchesCpuAndRmsNormThenTheGroupBitForBit) {
  const NormedCase c = GetParam();
  const int parts = c.gated ? 2 : 3;
  std::vector<std::vector<uint16_t>> w16;
  for (int i = 0; i < parts; ++i) w16.push_back(Narrow(c.dtype, RandomFloats(c.out * c.in, 301 + i)));
  // A residual stream of uneven scale per token, and a norm weight around 1.
  std::vector<float> xs = RandomFloats(c.tokens * c.in, 300, -2.f, 2.f);
  for (int64_t t = 0; t < c.tokens; ++t) {
    for (int64_t i = 0; i < c.in; ++i) xs[static_cast<size_t>(t * c.in + i)] *= static_cast<float>(1 + 3 * t);
  }
  auto x = Mirror(xs);
  auto nw = Mirror(RandomFloats(c.in, 310, 0.5f, 1.5f));
  std::vector<Mirrored<float>> w, bias;
  std::vector<Mirrored<uint16_t>> w_narrow;
  for (int i = 0; i < parts; ++i) {
    w.push_back(Mirror(Widen(c.dtype, w16[static_cast<size_t>(i)])));
    w_narrow.push_back(Mirror(w16[static_cast<size_t>(i)]));
    bias.push_back(Mirror(RandomFloats(c.out, 320 + i)));
  }
  const std::vector<float> garbage = RandomFloats(c.tokens * c.out, 330);
  std::vector<Mirrored<float>> y, y_ref;
  for (int i = 0; i < parts; ++i) {
    y.push_back(Mirror(garbage));
    y_ref.push_back(Mirror(garbage));
  }
  auto scratch = Mirror(RandomFloats(c.tokens * c.in, 340));
  auto group = [&](int s, const float* xin, std::vector<Mirrored<float>>& ys) {
    LinearGroupParams g{.x = xin, .tokens = c.tokens, .in = c.in, .num_parts = parts};
    for (int i = 0; i < parts; ++i) {
      const size_t k = static_cast<size_t>(i);
      g.parts[k] = {.w = s == kGpu ? WeightView(c.dtype, w_narrow[k].at(s)) : WeightView(w[k].at(s)),
                    .bias = bias[k].at(s), .y = ys[k].at(s), .out = c.out,
                    // q accumulates into its y (as the residual-adding products do), k and v do not.
                    .accumulate = !c.gated && i == 0};
    }
    if (c.gated) g.gated = GateActivation::kSilu;
    return g;
  };
  RunBoth([&](Backend& b, int s) {
    LinearGroupParams g = group(s, x.at(s), y);
    g.norm = LinearGroupParams::Norm{.weight = nw.at(s), .eps = 1e-5f, .scratch = scratch.at(s)};
    return b.LinearGroup(g);
  });
  const int checked = c.gated ? 1 : parts;  // the gated form's parts[1].y is scratch
  for (int i = 0; i < checked; ++i) {
    SCOPED_TRACE(i);
    if (c.tokens <= 8) {
      ExpectMirrorsClose(y[static_cast<size_t>(i)]);
    } else {
      ExpectMirrorsClose(y[static_cast<size_t>(i)], 2e-2f, 1e-5);  // the GEMM rounds x to 16 bits
    }
  }

  // The separate CUDA ops: the RmsNorm kernel into a buffer, then the plain group over it.
  Backend& gpu = backend(kGpu);
  auto normed = Mirror(RandomFloats(c.tokens * c.in, 350));
  ASSERT_TRUE(gpu.RmsNorm({.x = x.at(kGpu), .weight = nw.at(kGpu), .y = normed.at(kGpu), .tokens = c.tokens,
                           .hidden = c.in, .eps = 1e-5f})
                  .ok());
  ASSERT_TRUE(gpu.LinearGroup(group(kGpu, normed.at(kGpu), y_ref)).ok());
  ASSERT_TRUE(gpu.Synchronize().ok());
  const size_t bytes = static_cast<size_t>(c.tokens * c.out) * sizeof(float);
  for (int i = 0; i < checked; ++i) {
    const size_t k = static_cast<size_t>(i);
    EXPECT_EQ(DeviceBytes(gpu, y[k].at(kGpu), bytes), DeviceBytes(gpu, y_ref[k].at(kGpu), bytes)) << "part " << i;
  }
}

// tokens 1, 2, 3 and 8: the normed GEMV's 1-, 2-, 4- and 8-row instances (16-byte loads for in a
// multiple of 8, the scalar walk for in = 131); 9 and 40: the GEMMs over x normalised and rounded in
// one kernel (RmsNormTo16), bit for bit the RmsNorm kernel and then the cast.
// in = 64: two row warps of the norm's reduction; 2048 and 4104: its full 8 (4104: more than 16
// elements per row thread); 9000: past the register norm kernel (RmsNormKernel's loop).
INSTANTIATE_TEST_SUITE_P(Shapes, CudaNormedLinearParityTest,
                         ::testing::Values(NormedCase{DType::kBF16, 1, 2048, 96, false},
                                           NormedCase{DType::kBF16, 1, 2048, 80, true},
                                           NormedCase{DType::kF16, 1, 64, 40, false},
                                           NormedCase{DType::kBF16, 1, 131, 33, true},
                                           NormedCase{DType::kF16, 2, 4104, 24, true},
                                           NormedCase{DType::kBF16, 3, 264, 129, false},
                                           NormedCase{DType::kF16, 8, 131, 17, false},
                                           NormedCase{DType::kBF16, 8, 9000, 8, true},
                                           NormedCase{DType::kBF16, 9, 264, 40, true},
                                           NormedCase{DType::kF16, 40, 2048, 64, false},
                                           NormedCase{DType::kBF16, 40, 9000, 16, false}),
                         NormedName);

// ---- KvWrite with rope ---------------------------------------------------------------------------

struct RopeWriteCase {
  DType cache;                     // kF32, kBF16 or kF16
  std::vector<int32_t> seq_lens;   // the batch's sequences, in row order; their sum is the tokens
  int64_t q_heads, kv_heads, head_dim, rotary_dim;
};

void PrintTo(const RopeWriteCase& c, std::ostream* os) {
  int64_t tokens = 0;
  for (int32_t n : c.seq_lens) tokens += n;
  *os << DTypeName(c.cache) << "_t" << tokens << "_seqs" << c.seq_lens.size() << "_q" << c.q_heads << "_kv"
      << c.kv_heads << "_d" << c.head_dim << "_rot" << c.rotary_dim;
}

std::string RopeWriteName(const ::testing::TestParamInfo<RopeWriteCase>& info) {
  return ::testing::PrintToString(info.param);
}

class CudaRopeKvWriteParityTest : public CudaParityTest, public ::testing::WithParamInterface<RopeWriteCase> {};

TEST_P(CudaRopeKvWriteParityTest, MatchesCpuAndRopeThenKvWriteBitForBit) {
  const RopeWriteCase c = GetParam();
  constexpr int64_t kBlockSize = 8;
  // Sequence s starts at position 5 + 13 s (decode steps deep in a context, prefills crossing
  // blocks); each has its own blocks, in shuffled order.
  std::vector<AttnSeq> host_seqs;
  std::vector<int32_t> positions;
  int32_t rows = 0, entries = 0;
  for (size_t s = 0; s < c.seq_lens.size(); ++s) {
    const int32_t pos_begin = 5 + 13 * static_cast<int32_t>(s);
    const int32_t blocks = static_cast<int32_t>((pos_begin + c.seq_lens[s] + kBlockSize - 1) / kBlockSize);
    host_seqs.push_back({.q_begin = rows, .q_len = c.seq_lens[s], .pos_begin = pos_begin, .table_begin = entries,
                         .table_len = blocks});
    for (int32_t j = 0; j < c.seq_lens[s]; ++j) positions.push_back(pos_begin + j);
    rows += c.seq_lens[s];
    entries += blocks;
  }
  const int64_t tokens = rows, num_blocks = entries + 3;
  const std::vector<int32_t> host_table =
      DistinctRows(static_cast<int32_t>(num_blocks), static_cast<size_t>(entries), 210);
  const int64_t rot = c.rotary_dim > 0 ? c.rotary_dim : c.head_dim;
  std::vector<float> inv_freq(static_cast<size_t>(rot / 2));
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    inv_freq[i] = 1.0f / std::pow(10000.0f, static_cast<float>(2 * i) / static_cast<float>(rot));
  }
  const int64_t row = c.kv_heads * c.head_dim;
  const size_t cache_elems = static_cast<size_t>(num_blocks * kBlockSize * row);
  const std::vector<float> q0 = RandomFloats(tokens * c.q_heads * c.head_dim, 211);
  const std::vector<float> k0 = RandomFloats(tokens * row, 212);
  auto seqs = Mirror(host_seqs);
  auto table = Mirror(host_table);
  auto pos = Mirror(positions);
  auto freq = Mirror(inv_freq);
  auto v = Mirror(RandomFloats(tokens * row, 213));
  // Two runs on the GPU (fused, and Rope then KvWrite) and one on the CPU (fused, f32 cache).
  struct Run {
    Mirrored<float> q, k, ck, cv;
  };
  auto fresh = [&]() {
    // f32 caches of cache_elems hold any cache dtype's elements.
    return Run{Mirror(q0), Mirror(k0), Mirror(RandomFloats(cache_elems, 214)), Mirror(RandomFloats(cache_elems, 215))};
  };
  auto params = [&](Run& r, int s, DType dtype) {
    const RopeParams rope{.q = r.q.at(s), .k = r.k.at(s), .positions = pos.at(s), .inv_freq = freq.at(s),
                          .tokens = tokens, .q_heads = c.q_heads, .kv_heads = c.kv_heads, .head_dim = c.head_dim,
                          .rotary_dim = c.rotary_dim};
    KvWriteParams write{.k = r.k.at(s), .v = v.at(s),
                        .paged = {.seqs = seqs.at(s), .host_seqs = host_seqs.data(),
                                  .num_seqs = static_cast<int64_t>(host_seqs.size()), .block_table = table.at(s),
                                  .host_block_table = host_table.data(),
                                  .table_entries = static_cast<int64_t>(host_table.size())},
                        .tokens = tokens,
                        .cache = {r.ck.at(s), r.cv.at(s), num_blocks, kBlockSize, c.kv_heads, c.head_dim, dtype}};
    write.rope = rope;
    return write;
  };
  Run fused = fresh();
  RunBoth([&](Backend& b, int s) { return b.KvWrite(params(fused, s, s == kRef ? DType::kF32 : c.cache)); });
  ExpectMirrorsClose(fused.q);
  ExpectMirrorsClose(fused.k);
  if (c.cache == DType::kF32) {
    ExpectMirrorsClose(fused.ck);
    ExpectMirrorsClose(fused.cv, 0.f);  // copies: exact
  }

  Run separate = fresh();
  Backend& gpu = backend(kGpu);
  KvWriteParams write = params(separate, kGpu, c.cache);
  ASSERT_TRUE(gpu.Rope(*write.rope).ok());
  write.rope.reset();
  ASSERT_TRUE(gpu.KvWrite(write).ok());
  ASSERT_TRUE(gpu.Synchronize().ok());
  const size_t cache_bytes = cache_elems * sizeof(float);  // the whole buffers, untouched parts included
  EXPECT_EQ(DeviceBytes(gpu, fused.q.at(kGpu), q0.size() * sizeof(float)),
            DeviceBytes(gpu, separate.q.at(kGpu), q0.size() * sizeof(float)));
  EXPECT_EQ(DeviceBytes(gpu, fused.k.at(kGpu), k0.size() * sizeof(float)),
            DeviceBytes(gpu, separate.k.at(kGpu), k0.size() * sizeof(float)));
  EXPECT_EQ(DeviceBytes(gpu, fused.ck.at(kGpu), cache_bytes), DeviceBytes(gpu, separate.ck.at(kGpu), cache_bytes));
  EXPECT_EQ(DeviceBytes(gpu, fused.cv.at(kGpu), cache_bytes), DeviceBytes(gpu, separate.cv.at(kGpu), cache_bytes));
}

// Batches of 1, 2, 3, 8 and 9 tokens (decode steps of several sequences, and prefill chunks), every
// cache dtype, multi-head and GQA, whole and partial rotation.
INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaRopeKvWriteParityTest,
    ::testing::Values(RopeWriteCase{DType::kF32, {1}, 8, 2, 64, 0},
                      RopeWriteCase{DType::kBF16, {1, 1}, 4, 4, 128, 0},
                      RopeWriteCase{DType::kF16, {2, 1}, 6, 1, 64, 48},
                      RopeWriteCase{DType::kBF16, {1, 1, 1, 5}, 8, 2, 64, 32},
                      RopeWriteCase{DType::kF32, {4, 1, 4}, 4, 2, 96, 0},
                      RopeWriteCase{DType::kF16, {9}, 32, 8, 128, 0}),
    RopeWriteName);

TEST_F(CudaParityTest, FusedFormsRejectBadParamsAndTheBackendStaysHealthy) {
  Backend& gpu = backend(kGpu);
  auto f = Mirror(RandomFloats(64, 220));
  float* p = f.at(kGpu);
  LinearGroupParams g{.x = p, .tokens = 1, .in = 4, .num_parts = 2, .gated = GateActivation::kSilu};
  g.parts[0] = {.w = p, .y = p + 8, .out = 4};
  g.parts[1] = {.w = p, .y = p + 16, .out = 3};
  EXPECT_EQ(gpu.LinearGroup(g).code(), absl::StatusCode::kInvalidArgument);
  std::vector<AttnSeq> host_seqs = {{.q_begin = 1, .q_len = 1, .pos_begin = 0, .table_begin = 0, .table_len = 1}};
  auto seqs = Mirror(host_seqs);
  const std::vector<int32_t> host_table = {0};
  auto table = Mirror(host_table);
  auto positions = Mirror(std::vector<int32_t>{0, 1});
  KvWriteParams w{.k = p, .v = p + 8,
                  .paged = {.seqs = seqs.at(kGpu), .host_seqs = host_seqs.data(), .num_seqs = 1,
                            .block_table = table.at(kGpu), .host_block_table = host_table.data(), .table_entries = 1},
                  .tokens = 2, .cache = {p + 32, p + 48, 1, 8, 1, 2}};
  w.rope = RopeParams{.q = p + 24, .k = p, .positions = positions.at(kGpu), .inv_freq = p, .tokens = 2,
                      .q_heads = 1, .kv_heads = 1, .head_dim = 2};
  const absl::Status st = gpu.KvWrite(w);  // row 0 belongs to no sequence
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_TRUE(gpu.Synchronize().ok());
}

}  // namespace
}  // namespace shardserve::kernels

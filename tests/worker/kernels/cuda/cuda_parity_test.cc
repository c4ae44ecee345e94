// CUDA vs CPU parity for every op of backend.h, in the manner of llama.cpp's test-backend-ops:
// the same random inputs (fixed seeds) go through both backends, created through the registry, and
// the CUDA result must match the CPU oracle within a tolerance relative to the largest reference
// magnitude. Tests that need a device skip without one (label gpu). The fixture is in
// cuda_parity_fixture.h; MoE ops are in cuda_moe_parity_test.cc, the fused forms (gated LinearGroup,
// KvWrite with rope) in cuda_fused_parity_test.cc.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "common/tensor/dtype.h"
#include "tests/worker/kernels/cuda/cuda_parity_fixture.h"
#include "worker/kernels/backend.h"
#include "worker/kernels/registry.h"

namespace shardserve::kernels {
namespace {

TEST_F(CudaParityTest, Embedding) {
  const int64_t vocab = 50, hidden = 72, tokens = 13;
  auto table = Mirror(RandomFloats(vocab * hidden, 1));
  auto ids = Mirror(RandomInts(tokens, 2, 0, vocab - 1));
  auto out = Mirror(std::vector<float>(tokens * hidden));
  RunBoth([&](Backend& b, int s) {
    return b.Embedding({.table = table.at(s), .ids = ids.at(s), .out = out.at(s), .tokens = tokens, .vocab = vocab,
                        .hidden = hidden});
  });
  ExpectMirrorsClose(out, 0.f);  // a copy: exact
}

struct LinearCase {
  int64_t tokens, in, out;
  bool accumulate, bias;
};

// Readable names in gtest and ctest output, e.g. "t37_in96_out80_acc_bias".
void PrintTo(const LinearCase& c, std::ostream* os) {
  *os << "t" << c.tokens << "_in" << c.in << "_out" << c.out << (c.accumulate ? "_acc" : "") << (c.bias ? "_bias" : "");
}

template <typename Case>
std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  return ::testing::PrintToString(info.param);
}

class CudaLinearParityTest : public CudaParityTest, public ::testing::WithParamInterface<LinearCase> {};

TEST_P(CudaLinearParityTest, MatchesCpu) {
  const LinearCase c = GetParam();
  auto x = Mirror(RandomFloats(c.tokens * c.in, 10));
  auto w = Mirror(RandomFloats(c.out * c.in, 11));
  auto bias = Mirror(RandomFloats(c.out, 12));
  auto y = Mirror(RandomFloats(c.tokens * c.out, 13));  // nonzero, so accumulate matters
  RunBoth([&](Backend& b, int s) {
    return b.Linear({.x = x.at(s), .w = w.at(s), .bias = c.bias ? bias.at(s) : nullptr, .y = y.at(s),
                     .tokens = c.tokens, .in = c.in, .out = c.out, .accumulate = c.accumulate});
  });
  ExpectMirrorsClose(y);
}

// tokens = 1 and <= 8 take the CPU's small-batch kernels; 37 takes its sgemm.
INSTANTIATE_TEST_SUITE_P(Shapes, CudaLinearParityTest,
                         ::testing::Values(LinearCase{1, 64, 48, false, false}, LinearCase{1, 256, 33, true, true},
                                           LinearCase{37, 96, 80, true, true}, LinearCase{37, 300, 129, false, true},
                                           LinearCase{5, 17, 7, true, false}, LinearCase{4, 0, 6, true, true},
                                           LinearCase{3, 0, 6, false, true}),
                         CaseName<LinearCase>);

// 16-bit weights: the GPU multiplies the bf16/f16 matrix, the CPU oracle the same values widened
// to f32 (exact), so both compute the same products. Up to kGemv16MaxTokens (8) tokens the GPU's
// GEMV keeps the activations f32 (f32 tolerance); above, its tensor-core GEMM rounds them to the
// weights' type, about 2^-9 relative for bf16 per product: max error 2e-2 of the largest output
// and nmse 1e-5 (random data of this size lands near 3e-3 and 1e-6).
struct Linear16Case {
  DType dtype;
  int64_t tokens, in, out;
  bool accumulate, bias;
};

void PrintTo(const Linear16Case& c, std::ostream* os) {
  *os << DTypeName(c.dtype) << "_t" << c.tokens << "_in" << c.in << "_out" << c.out << (c.accumulate ? "_acc" : "")
      << (c.bias ? "_bias" : "");
}

class CudaLinear16ParityTest : public CudaParityTest, public ::testing::WithParamInterface<Linear16Case> {};

TEST_P(CudaLinear16ParityTest, MatchesCpuOnWidenedWeights) {
  const Linear16Case c = GetParam();
  ASSERT_TRUE(backend(kGpu).SupportsOp(Op::kLinear, c.dtype));
  const std::vector<uint16_t> w16 = Narrow(c.dtype, RandomFloats(c.out * c.in, 11));
  auto x = Mirror(RandomFloats(c.tokens * c.in, 10));
  auto w = Mirror(Widen(c.dtype, w16));
  auto w_narrow = Mirror(w16);
  auto bias = Mirror(RandomFloats(c.out, 12));
  auto y = Mirror(RandomFloats(c.tokens * c.out, 13));
  RunBoth([&](Backend& b, int s) {
    const WeightView view = s == kRef ? WeightView(w.at(s)) : WeightView(c.dtype, w_narrow.at(s));
    return b.Linear({.x = x.at(s), .w = view, .bias = c.bias ? bias.at(s) : nullptr, .y = y.at(s), .tokens = c.tokens,
                     .in = c.in, .out = c.out, .accumulate = c.accumulate});
  });
  if (c.tokens <= 8) {
    ExpectMirrorsClose(y);
  } else {
    ExpectMirrorsClose(y, 2e-2f, 1e-5);
  }
}

// in = 4096 and 264 take the GEMV's 16-byte loads, in = 100 and 17 its scalar path; 9 and more
// tokens the tensor-core GEMM.
INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaLinear16ParityTest,
    ::testing::Values(Linear16Case{DType::kBF16, 1, 4096, 300, false, false},
                      Linear16Case{DType::kBF16, 8, 264, 33, true, true},
                      Linear16Case{DType::kBF16, 3, 100, 65, true, false},
                      Linear16Case{DType::kF16, 1, 17, 7, false, true},
                      Linear16Case{DType::kF16, 5, 4096, 129, true, true},
                      Linear16Case{DType::kBF16, 9, 264, 80, false, true},
                      Linear16Case{DType::kBF16, 130, 1024, 257, true, true},
                      Linear16Case{DType::kF16, 64, 300, 129, false, false}),
    CaseName<Linear16Case>);

// LinearGroup on the GPU: one GEMV launch over three parts (3 tokens; in = 264 takes the 16-byte
// loads) and, at 20 tokens, one rounding of x for the three GEMMs; against the CPU's Linear per
// part on the widened weights. Part sizes differ so that rows cross part boundaries inside blocks.
TEST_F(CudaParityTest, LinearGroupMatchesCpu) {
  for (const int64_t tokens : {int64_t{3}, int64_t{20}}) {
    SCOPED_TRACE(absl::StrCat(tokens, " tokens"));
    const int64_t in = 264;
    const int64_t outs[3] = {70, 9, 33};
    auto x = Mirror(RandomFloats(tokens * in, 40));
    std::vector<Mirrored<float>> wide, y;
    std::vector<Mirrored<uint16_t>> narrow;
    for (int i = 0; i < 3; ++i) {
      const std::vector<uint16_t> w16 = Narrow(DType::kBF16, RandomFloats(outs[i] * in, 41 + i));
      wide.push_back(Mirror(Widen(DType::kBF16, w16)));
      narrow.push_back(Mirror(w16));
      y.push_back(Mirror(RandomFloats(tokens * outs[i], 50 + i)));
    }
    auto bias = Mirror(RandomFloats(outs[1], 60));
    RunBoth([&](Backend& b, int s) {
      LinearGroupParams g{.x = x.at(s), .tokens = tokens, .in = in, .num_parts = 3};
      for (int i = 0; i < 3; ++i) {
        g.parts[static_cast<size_t>(i)] = {
            .w = s == kRef ? WeightView(wide[static_cast<size_t>(i)].at(s))
                           : WeightView(DType::kBF16, narrow[static_cast<size_t>(i)].at(s)),
            .bias = i == 1 ? bias.at(s) : nullptr,
            .y = y[static_cast<size_t>(i)].at(s),
            .out = outs[i],
            .accumulate = i == 2};
      }
      return b.LinearGroup(g);
    });
    for (auto& m : y) {
      if (tokens <= 8) {
        ExpectMirrorsClose(m);
      } else {
        ExpectMirrorsClose(m, 2e-2f, 1e-5);
      }
    }
  }
}

TEST_F(CudaParityTest, EmbeddingOfNarrowTablesWidensExactly) {
  const int64_t vocab = 50, hidden = 300, tokens = 13;
  const std::vector<float> table = RandomFloats(vocab * hidden, 1);
  auto ids = Mirror(RandomInts(tokens, 2, 0, vocab - 1));
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    ASSERT_TRUE(backend(kGpu).SupportsOp(Op::kEmbedding, dtype));
    auto t = Mirror(Narrow(dtype, table));
    auto out = Mirror(std::vector<float>(tokens * hidden));
    RunBoth([&](Backend& b, int s) {
      return b.Embedding({.table = WeightView(dtype, t.at(s)), .ids = ids.at(s), .out = out.at(s), .tokens = tokens,
                          .vocab = vocab, .hidden = hidden});
    });
    ExpectMirrorsClose(out, 0.f);  // widening is exact on both
  }
}

TEST_F(CudaParityTest, ReserveSizesTheScratchAndOpsBeyondItStillRun) {
  ASSERT_TRUE(backend(kGpu).Reserve({.max_tokens = 16, .max_linear_in = 64}).ok());
  // 40 x 256 activations exceed the reservation: the op grows the scratch first.
  const int64_t tokens = 40, in = 256, out = 32;
  const std::vector<uint16_t> w16 = Narrow(DType::kBF16, RandomFloats(out * in, 5));
  auto x = Mirror(RandomFloats(tokens * in, 6));
  auto w = Mirror(Widen(DType::kBF16, w16));
  auto wn = Mirror(w16);
  auto y = Mirror(std::vector<float>(tokens * out));
  RunBoth([&](Backend& b, int s) {
    const WeightView view = s == kRef ? WeightView(w.at(s)) : WeightView::Bf16(wn.at(s));
    return b.Linear({.x = x.at(s), .w = view, .y = y.at(s), .tokens = tokens, .in = in, .out = out});
  });
  ExpectMirrorsClose(y, 2e-2f, 1e-5);
}

TEST_F(CudaParityTest, OpsWithoutWeightsTakeOnlyF32) {
  EXPECT_TRUE(backend(kGpu).SupportsOp(Op::kRmsNorm, DType::kF32));
  EXPECT_FALSE(backend(kGpu).SupportsOp(Op::kRmsNorm, DType::kBF16));
  EXPECT_FALSE(backend(kGpu).SupportsOp(Op::kSiluMul, DType::kF16));
  // Attention's dtype is its KV cache's, which may be 16-bit.
  EXPECT_TRUE(backend(kGpu).SupportsOp(Op::kAttention, DType::kBF16));
  EXPECT_FALSE(backend(kGpu).SupportsOp(Op::kAttention, DType::kQ8));
}

TEST_F(CudaParityTest, RmsNormInPlaceAndOutOfPlace) {
  const int64_t tokens = 7, hidden = 1000;  // not a multiple of the block size
  auto x = Mirror(RandomFloats(tokens * hidden, 20, -3.f, 3.f));
  auto weight = Mirror(RandomFloats(hidden, 21, 0.5f, 1.5f));
  auto y = Mirror(std::vector<float>(tokens * hidden));
  RunBoth([&](Backend& b, int s) {
    return b.RmsNorm({.x = x.at(s), .weight = weight.at(s), .y = y.at(s), .tokens = tokens, .hidden = hidden,
                      .eps = 1e-5f});
  });
  ExpectMirrorsClose(y);
  RunBoth([&](Backend& b, int s) {
    return b.RmsNorm({.x = x.at(s), .weight = weight.at(s), .y = x.at(s), .tokens = tokens, .hidden = hidden});
  });
  ExpectMirrorsClose(x);
}

TEST_F(CudaParityTest, AddRmsNorm) {
  const int64_t tokens = 9, hidden = 1000;
  auto x = Mirror(RandomFloats(tokens * hidden, 90, -3.f, 3.f));
  auto y = Mirror(RandomFloats(tokens * hidden, 91, -3.f, 3.f));
  auto weight = Mirror(RandomFloats(hidden, 92, 0.5f, 1.5f));
  auto out = Mirror(std::vector<float>(tokens * hidden));
  RunBoth([&](Backend& b, int s) {
    return b.AddRmsNorm({.x = x.at(s), .y = y.at(s), .weight = weight.at(s), .out = out.at(s), .tokens = tokens,
                         .hidden = hidden, .eps = 1e-5f});
  });
  ExpectMirrorsClose(x, 0.f);  // one f32 add per element: exact
  ExpectMirrorsClose(out);
}

TEST_F(CudaParityTest, ArgmaxRows) {
  // Long rows (more columns than threads), ties planted at two columns, padding past the width.
  const int64_t rows = 7, width = 32003, stride = 32008;
  std::vector<float> x = RandomFloats(rows * stride, 95);
  for (int64_t r = 0; r < rows; ++r) {
    x[r * stride + 100 + r] = 2.f;
    x[r * stride + 30000 - r] = 2.f;  // the same maximum later: the earlier column wins
    x[r * stride + width + 1] = 5.f;  // padding: never read
  }
  auto dx = Mirror(x);
  auto out = Mirror(std::vector<int32_t>(rows, -1));
  RunBoth([&](Backend& b, int s) {
    return b.ArgmaxRows({.x = dx.at(s), .out = out.at(s), .rows = rows, .width = width, .stride = stride});
  });
  EXPECT_EQ(Read(out, kGpu), Read(out, kRef));
  for (int64_t r = 0; r < rows; ++r) EXPECT_EQ(Read(out, kRef)[r], 100 + r);
}

// Sampling on the device draws the CPU's ids: argmax rows, top-k, top-p, min-p, ties at the top,
// rows of -inf but a few, a tiny temperature, over a 32k and a 152k vocabulary with padding. The
// logits are random (their weights' sums differ between backends only in the order of the sum, so
// a draw would have to land within ~1e-15 of a boundary to differ).
TEST_F(CudaParityTest, SampleRowsDrawsTheCpuIds) {
  EXPECT_TRUE(backend(kGpu).SupportsOp(Op::kSampleRows, DType::kF32));
  const RowSamplingParams kinds[] = {
      {.temperature = 0.0f},                                    // argmax
      {.temperature = 1.0f},                                    // the full softmax
      {.temperature = 0.8f, .top_k = 50},
      {.temperature = 1.2f, .top_p = 0.9f},
      {.temperature = 1.0f, .top_k = 1},                        // argmax
      {.temperature = 0.7f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f},
      {.temperature = 2.0f, .min_p = 0.2f},
      {.temperature = 1e-30f},                                  // only the largest weigh
      {.temperature = 1.0f, .top_k = 200000},                   // top_k beyond the row
      {.temperature = 1.5f, .top_p = 0.3f},
  };
  constexpr int kKinds = static_cast<int>(std::size(kinds));
  for (const int64_t width : {int64_t{32000}, int64_t{151936}}) {
    const int64_t rows = 2 * kKinds, stride = width + 8;
    std::vector<float> x = RandomFloats(rows * stride, static_cast<uint32_t>(width), -4.0f, 4.0f);
    for (int64_t r = 0; r < rows; ++r) {
      float* row = x.data() + r * stride;
      if (r % 3 == 0) {  // a tie at the top
        row[r + 10] = 9.0f;
        row[width - 1 - r] = 9.0f;
      }
      if (r % 4 == 1) {  // all -inf but a few
        for (int64_t j = 0; j < width; ++j) row[j] = -INFINITY;
        row[r] = 1.0f;
        row[width / 2] = 1.5f;
        row[width - 2] = 0.5f;
      }
      for (int64_t j = width; j < stride; ++j) row[j] = 100.0f;  // padding: never read
    }
    auto dx = Mirror(x);
    auto out = Mirror(std::vector<int32_t>(rows, -1));
    for (uint64_t step = 0; step < 8; ++step) {
      std::vector<RowSamplingParams> params(rows);
      for (int64_t r = 0; r < rows; ++r) {
        params[r] = kinds[r % kKinds];
        params[r].seed = static_cast<uint64_t>(1000 + r);
        params[r].step = step;
      }
      auto dparams = Mirror(params);
      RunBoth([&](Backend& b, int s) {
        return b.SampleRows({.x = dx.at(s), .params = dparams.at(s), .host_params = params.data(), .out = out.at(s),
                             .rows = rows, .width = width, .stride = stride});
      });
      const std::vector<int32_t> want = Read(out, kRef);
      EXPECT_EQ(Read(out, kGpu), want) << "width " << width << " step " << step;
      for (int32_t id : want) {
        EXPECT_GE(id, 0);
        EXPECT_LT(id, width);
      }
    }
  }
}

TEST_F(CudaParityTest, SampleRowsRejectsBadParameters) {
  std::vector<RowSamplingParams> params(2);
  params[1].min_p = 2.0f;
  auto dparams = Mirror(params);
  auto dx = Mirror(std::vector<float>(8, 0.0f));
  auto out = Mirror(std::vector<int32_t>(2, -1));
  const absl::Status st = backend(kGpu).SampleRows({.x = dx.at(kGpu), .params = dparams.at(kGpu),
                                                    .host_params = params.data(), .out = out.at(kGpu), .rows = 2,
                                                    .width = 4, .stride = 4});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_TRUE(backend(kGpu).Synchronize().ok());  // still healthy
}

// Whole-head RoPE at two position scales, and Phi-3's partial RoPE (48 of 64 dims) with
// longrope's attention factor on cos and sin.
TEST_F(CudaParityTest, Rope) {
  const int64_t tokens = 9, q_heads = 4, kv_heads = 2, head_dim = 64;
  auto positions = Mirror(RandomInts(tokens, 30, 0, 5000));
  struct Variant {
    int64_t rotary_dim;
    float position_scale, scale;
  };
  for (const Variant& v : {Variant{head_dim, 1.0f, 1.0f}, Variant{head_dim, 0.25f, 1.0f}, Variant{48, 1.0f, 1.19f}}) {
    SCOPED_TRACE(::testing::Message() << "rotary_dim " << v.rotary_dim << " position_scale " << v.position_scale);
    std::vector<float> inv_freq(static_cast<size_t>(v.rotary_dim / 2));
    for (size_t i = 0; i < inv_freq.size(); ++i) {
      inv_freq[i] = 1.0f / std::pow(10000.0f, static_cast<float>(2 * i) / static_cast<float>(v.rotary_dim));
    }
    auto freq = Mirror(inv_freq);
    auto q = Mirror(RandomFloats(tokens * q_heads * head_dim, 31));
    auto k = Mirror(RandomFloats(tokens * kv_heads * head_dim, 32));
    RunBoth([&](Backend& b, int s) {
      return b.Rope({.q = q.at(s), .k = k.at(s), .positions = positions.at(s), .inv_freq = freq.at(s),
                     .tokens = tokens, .q_heads = q_heads, .kv_heads = kv_heads, .head_dim = head_dim,
                     .position_scale = v.position_scale, .rotary_dim = v.rotary_dim, .scale = v.scale});
    });
    ExpectMirrorsClose(q);
    ExpectMirrorsClose(k);
  }
}

// Three sequences of different lengths in one batch: a prefill from position 0, a decode step deep
// in its context, and a prefill chunk that continues a cached prefix. The paged cache has blocks of
// 8 tokens; each sequence's table names shuffled, non-contiguous blocks.
const std::vector<AttnSeq> kSeqs = {
    {.q_begin = 0, .q_len = 11, .pos_begin = 0, .table_begin = 0, .table_len = 2},
    {.q_begin = 11, .q_len = 1, .pos_begin = 40, .table_begin = 2, .table_len = 6},
    {.q_begin = 12, .q_len = 6, .pos_begin = 17, .table_begin = 8, .table_len = 3},
};
const std::vector<int32_t> kTable = {13, 2, 7, 0, 15, 9, 4, 11, 5, 14, 1};
constexpr int64_t kSeqTokens = 18;
constexpr int64_t kNumBlocks = 16, kBlockSize = 8;

// kSeqs and kTable as the op's PagedSeqs, with the given backend's copies.
PagedSeqs Paged(const AttnSeq* seqs, const int32_t* table) {
  return {.seqs = seqs, .host_seqs = kSeqs.data(), .num_seqs = static_cast<int64_t>(kSeqs.size()),
          .block_table = table, .host_block_table = kTable.data(), .table_entries = static_cast<int64_t>(kTable.size())};
}

TEST_F(CudaParityTest, KvWrite) {
  const KvLayerView shape{.num_blocks = kNumBlocks, .block_size = kBlockSize, .kv_heads = 2, .head_dim = 16};
  const int64_t row = shape.kv_heads * shape.head_dim;
  const int64_t cache_elems = shape.num_blocks * shape.block_size * row;
  auto seqs = Mirror(kSeqs);
  auto table = Mirror(kTable);
  auto k = Mirror(RandomFloats(kSeqTokens * row, 40));
  auto v = Mirror(RandomFloats(kSeqTokens * row, 41));
  auto ck = Mirror(RandomFloats(cache_elems, 42));
  auto cv = Mirror(RandomFloats(cache_elems, 43));
  RunBoth([&](Backend& b, int s) {
    KvLayerView cache = shape;
    cache.k = ck.at(s);
    cache.v = cv.at(s);
    return b.KvWrite({.k = k.at(s), .v = v.at(s), .paged = Paged(seqs.at(s), table.at(s)), .tokens = kSeqTokens,
                      .cache = cache});
  });
  ExpectMirrorsClose(ck, 0.f);  // copies: exact
  ExpectMirrorsClose(cv, 0.f);
}

// A bf16/f16 cache: KvWrite rounds each f32 to nearest even, Attention reads the rounded values
// widened. The oracle: the CPU backend's f32 cache holding the same rounded values. Both then
// multiply the same numbers: f32 tolerance.
TEST_F(CudaParityTest, NarrowKvCacheRoundsOnWriteAndAttentionReadsIt) {
  const int64_t q_heads = 8, kv_heads = 2, d = 64;
  const KvLayerView shape{.num_blocks = kNumBlocks, .block_size = kBlockSize, .kv_heads = kv_heads, .head_dim = d};
  const int64_t row = kv_heads * d;
  const int64_t cache_elems = shape.num_blocks * shape.block_size * row;
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    ASSERT_TRUE(backend(kGpu).SupportsOp(Op::kKvWrite, dtype));
    ASSERT_TRUE(backend(kGpu).SupportsOp(Op::kAttention, dtype));
    EXPECT_FALSE(backend(kRef).SupportsOp(Op::kKvWrite, dtype));
    auto round = [&](const std::vector<float>& x) { return Widen(dtype, Narrow(dtype, x)); };
    const std::vector<float> k = RandomFloats(kSeqTokens * row, 70, -2.f, 2.f);
    const std::vector<float> v = RandomFloats(kSeqTokens * row, 71);
    auto seqs = Mirror(kSeqs);
    auto table = Mirror(kTable);
    // The CPU gets the rounded values; the GPU the f32 ones, which its KvWrite rounds.
    Mirrored<float> kk, vv;
    kk = Mirror(round(k));
    vv = Mirror(round(v));
    auto k_gpu = Mirror(k);
    auto v_gpu = Mirror(v);
    auto ck = Mirror(std::vector<float>(cache_elems));  // f32 on the CPU; the GPU uses half of it
    auto cv = Mirror(std::vector<float>(cache_elems));
    auto q = Mirror(RandomFloats(kSeqTokens * q_heads * d, 72, -2.f, 2.f));
    auto out = Mirror(std::vector<float>(kSeqTokens * q_heads * d));
    RunBoth([&](Backend& b, int s) {
      KvLayerView cache = shape;
      cache.k = ck.at(s);
      cache.v = cv.at(s);
      cache.dtype = s == kRef ? DType::kF32 : dtype;
      const float* kin = s == kRef ? kk.at(s) : k_gpu.at(s);
      const float* vin = s == kRef ? vv.at(s) : v_gpu.at(s);
      const PagedSeqs paged = Paged(seqs.at(s), table.at(s));
      if (absl::Status st = b.KvWrite({.k = kin, .v = vin, .paged = paged, .tokens = kSeqTokens, .cache = cache});
          !st.ok()) {
        return st;
      }
      return b.Attention({.q = q.at(s), .out = out.at(s), .paged = paged, .tokens = kSeqTokens, .q_heads = q_heads,
                          .cache = cache, .scale = 1.0f / std::sqrt(static_cast<float>(d))});
    });
    ExpectMirrorsClose(out);
  }
}

struct AttentionCase {
  int64_t q_heads, kv_heads, head_dim, sliding_window;
};

void PrintTo(const AttentionCase& c, std::ostream* os) {
  *os << "q" << c.q_heads << "_kv" << c.kv_heads << "_d" << c.head_dim << "_window" << c.sliding_window;
}

class CudaAttentionParityTest : public CudaParityTest, public ::testing::WithParamInterface<AttentionCase> {};

TEST_P(CudaAttentionParityTest, MatchesCpu) {
  const AttentionCase c = GetParam();
  const KvLayerView shape{.num_blocks = kNumBlocks, .block_size = kBlockSize, .kv_heads = c.kv_heads,
                          .head_dim = c.head_dim};
  const int64_t cache_elems = shape.num_blocks * shape.block_size * shape.kv_heads * shape.head_dim;
  auto seqs = Mirror(kSeqs);
  auto table = Mirror(kTable);
  // Scores of a few units, so the softmax is neither flat nor one-hot.
  auto q = Mirror(RandomFloats(kSeqTokens * c.q_heads * c.head_dim, 50, -2.f, 2.f));
  auto ck = Mirror(RandomFloats(cache_elems, 51, -2.f, 2.f));
  auto cv = Mirror(RandomFloats(cache_elems, 52));
  auto out = Mirror(std::vector<float>(kSeqTokens * c.q_heads * c.head_dim));
  RunBoth([&](Backend& b, int s) {
    KvLayerView cache = shape;
    cache.k = ck.at(s);
    cache.v = cv.at(s);
    return b.Attention({.q = q.at(s), .out = out.at(s), .paged = Paged(seqs.at(s), table.at(s)),
                        .tokens = kSeqTokens, .q_heads = c.q_heads,
                        .cache = cache, .scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim)),
                        .sliding_window = c.sliding_window});
  });
  ExpectMirrorsClose(out);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaAttentionParityTest,
                         ::testing::Values(AttentionCase{8, 2, 64, 0}, AttentionCase{8, 2, 64, 8},
                                           AttentionCase{4, 4, 128, 0}, AttentionCase{6, 1, 80, 5},
                                           AttentionCase{2, 1, 16, 1}),
                         CaseName<AttentionCase>);

// Decode rows with long contexts: few blocks for the machine, so the kernel splits the keys of each
// row over several blocks and merges the splits (attention.cuh). Groups of 12 query heads per kv
// head take two head blocks (8 + 4); head_dim 256 fewer heads per block.
struct LongAttentionCase {
  int64_t q_heads, kv_heads, head_dim, sliding_window;
};

void PrintTo(const LongAttentionCase& c, std::ostream* os) {
  *os << "q" << c.q_heads << "_kv" << c.kv_heads << "_d" << c.head_dim << "_window" << c.sliding_window;
}

class CudaLongAttentionParityTest : public CudaParityTest, public ::testing::WithParamInterface<LongAttentionCase> {};

TEST_P(CudaLongAttentionParityTest, SplitKeysMatchCpu) {
  const LongAttentionCase c = GetParam();
  constexpr int64_t kBlock = 16, kBlocks = 256;  // 4096 positions
  // Three decode rows (one token each) at positions 300, 1000 and 2047, and a 3-token chunk at 2500.
  // The tables need 367 blocks of the 256: later rows reuse ids, which attention (it only reads)
  // does not mind.
  const auto paged = MirrorPaged(LayOutPaged({{300, 1}, {1000, 1}, {2047, 1}, {2500, 3}}, kBlock, kBlocks, 77));
  const int64_t tokens = paged.host.tokens;
  const KvLayerView shape{.num_blocks = kBlocks, .block_size = kBlock, .kv_heads = c.kv_heads, .head_dim = c.head_dim};
  const int64_t cache_elems = kBlocks * kBlock * c.kv_heads * c.head_dim;
  auto q = Mirror(RandomFloats(tokens * c.q_heads * c.head_dim, 60, -2.f, 2.f));
  auto ck = Mirror(RandomFloats(cache_elems, 61, -2.f, 2.f));
  auto cv = Mirror(RandomFloats(cache_elems, 62));
  auto out = Mirror(std::vector<float>(tokens * c.q_heads * c.head_dim));
  RunBoth([&](Backend& b, int s) {
    KvLayerView cache = shape;
    cache.k = ck.at(s);
    cache.v = cv.at(s);
    return b.Attention({.q = q.at(s), .out = out.at(s), .paged = paged.at(s), .tokens = tokens, .q_heads = c.q_heads,
                        .cache = cache, .scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim)),
                        .sliding_window = c.sliding_window});
  });
  ExpectMirrorsClose(out);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaLongAttentionParityTest,
                         ::testing::Values(LongAttentionCase{16, 2, 128, 0}, LongAttentionCase{24, 2, 64, 0},
                                           LongAttentionCase{8, 2, 256, 0}, LongAttentionCase{8, 8, 128, 500},
                                           LongAttentionCase{4, 1, 96, 0}),
                         CaseName<LongAttentionCase>);

// Prefill rows on tensor cores (attention.cuh, "Prefill on tensor cores": a bf16 cache, head_dim 64
// or 128, a sequence of at least 16 new rows): a 100-token prompt (two tiles of 64 rows, the second
// partial), a 37-token chunk continuing a cached prefix of 50, and a 1-token prompt in the same
// batch, over shuffled blocks of 16 positions. The oracle is the CPU backend's f32 cache holding the
// same bf16 values: the kernel's split operands keep it within f32 tolerance. With a window, a chunk
// size and soft-capping too (each changes which keys a row sees, or its scores).
struct PrefillAttentionCase {
  int64_t q_heads, kv_heads, head_dim, sliding_window, chunk_size;
  float softcap;
  bool sinks = false;  // a sink logit per head (GraniteSWA)
};

void PrintTo(const PrefillAttentionCase& c, std::ostream* os) {
  *os << "q" << c.q_heads << "_kv" << c.kv_heads << "_d" << c.head_dim << "_window" << c.sliding_window << "_chunk"
      << c.chunk_size << "_softcap" << static_cast<int>(c.softcap) << (c.sinks ? "_sinks" : "");
}

class CudaPrefillAttentionParityTest : public CudaParityTest,
                                       public ::testing::WithParamInterface<PrefillAttentionCase> {};

TEST_P(CudaPrefillAttentionParityTest, MatchesCpu) {
  const PrefillAttentionCase c = GetParam();
  constexpr int64_t kBlock = 16, kBlocks = 16;
  // Tables: 7 blocks (112 positions), 6 (96) and 1, distinct.
  const auto paged = MirrorPaged(LayOutPaged(kPrefillBatch, kBlock, kBlocks, 91));
  const int64_t tokens = paged.host.tokens;  // 138
  const KvLayerView shape{.num_blocks = kBlocks, .block_size = kBlock, .kv_heads = c.kv_heads, .head_dim = c.head_dim};
  const size_t cache_elems = static_cast<size_t>(kBlocks * kBlock * c.kv_heads * c.head_dim);
  const std::vector<uint16_t> k16 = Narrow(DType::kBF16, RandomFloats(cache_elems, 92, -2.f, 2.f));
  const std::vector<uint16_t> v16 = Narrow(DType::kBF16, RandomFloats(cache_elems, 93));
  auto ck16 = Mirror(k16);
  auto cv16 = Mirror(v16);
  auto ck = Mirror(Widen(DType::kBF16, k16));
  auto cv = Mirror(Widen(DType::kBF16, v16));
  auto q = Mirror(RandomFloats(static_cast<size_t>(tokens * c.q_heads * c.head_dim), 94, -2.f, 2.f));
  auto out = Mirror(std::vector<float>(static_cast<size_t>(tokens * c.q_heads * c.head_dim)));
  auto sinks = Mirror(RandomFloats(static_cast<size_t>(c.q_heads), 95, -2.f, 2.f));
  RunBoth([&](Backend& b, int s) {
    KvLayerView cache = shape;
    cache.k = s == kRef ? static_cast<void*>(ck.at(s)) : static_cast<void*>(ck16.at(s));
    cache.v = s == kRef ? static_cast<void*>(cv.at(s)) : static_cast<void*>(cv16.at(s));
    cache.dtype = s == kRef ? DType::kF32 : DType::kBF16;
    return b.Attention({.q = q.at(s), .out = out.at(s), .paged = paged.at(s), .tokens = tokens, .q_heads = c.q_heads,
                        .cache = cache, .scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim)),
                        .sliding_window = c.sliding_window, .chunk_size = c.chunk_size, .softcap = c.softcap,
                        .sinks = c.sinks ? sinks.at(s) : nullptr});
  });
  ExpectMirrorsClose(out);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaPrefillAttentionParityTest,
                         ::testing::Values(PrefillAttentionCase{8, 2, 64, 0, 0, 0.f},
                                           PrefillAttentionCase{16, 2, 128, 0, 0, 0.f},
                                           PrefillAttentionCase{4, 4, 64, 20, 0, 0.f},
                                           PrefillAttentionCase{8, 1, 128, 0, 32, 0.f},
                                           PrefillAttentionCase{8, 2, 64, 24, 0, 5.f},
                                           PrefillAttentionCase{8, 2, 64, 24, 0, 0.f, true},
                                           PrefillAttentionCase{16, 2, 128, 0, 0, 0.f, true}),
                         CaseName<PrefillAttentionCase>);

TEST_F(CudaParityTest, SiluMulInPlace) {
  const int64_t n = 1001;
  auto gate = Mirror(RandomFloats(n, 60, -6.f, 6.f));
  auto up = Mirror(RandomFloats(n, 61));
  RunBoth([&](Backend& b, int s) { return b.SiluMul({.gate = gate.at(s), .up = up.at(s), .out = gate.at(s), .n = n}); });
  ExpectMirrorsClose(gate);
}

TEST_F(CudaParityTest, GeluTanhMulAndScaleWithSoftCap) {
  const int64_t n = 1001;
  auto gate = Mirror(RandomFloats(n, 62, -6.f, 6.f));
  auto up = Mirror(RandomFloats(n, 63));
  RunBoth([&](Backend& b, int s) {
    return b.SiluMul({.gate = gate.at(s), .up = up.at(s), .out = gate.at(s), .n = n, .act = GateActivation::kGeluTanh});
  });
  ExpectMirrorsClose(gate);
  auto x = Mirror(RandomFloats(n, 64, -50.f, 50.f));
  RunBoth([&](Backend& b, int s) { return b.Scale({.x = x.at(s), .n = n, .scale = 0.7f, .softcap = 5.f}); });
  ExpectMirrorsClose(x);
}

TEST_F(CudaParityTest, ClampedSwigluMul) {
  const int64_t n = 1001;
  auto gate = Mirror(RandomFloats(n, 65, -12.f, 12.f));  // past both clamps (+-7)
  auto up = Mirror(RandomFloats(n, 66, -12.f, 12.f));
  RunBoth([&](Backend& b, int s) {
    return b.SiluMul({.gate = gate.at(s), .up = up.at(s), .out = gate.at(s), .n = n,
                      .act = GateActivation::kClampedSwiglu});
  });
  ExpectMirrorsClose(gate);
}

// Gemma-2's soft-capped scores, Llama-4's chunked layers and GraniteSWA's sinks, each alone and
// with a window.
TEST_F(CudaParityTest, SoftCappedAndChunkedAttentionMatchesCpu) {
  const KvLayerView shape{.num_blocks = kNumBlocks, .block_size = kBlockSize, .kv_heads = 2, .head_dim = 64};
  const int64_t q_heads = 8;
  const int64_t cache_elems = shape.num_blocks * shape.block_size * shape.kv_heads * shape.head_dim;
  auto seqs = Mirror(kSeqs);
  auto table = Mirror(kTable);
  auto q = Mirror(RandomFloats(kSeqTokens * q_heads * shape.head_dim, 53, -2.f, 2.f));
  auto ck = Mirror(RandomFloats(cache_elems, 54, -2.f, 2.f));
  auto cv = Mirror(RandomFloats(cache_elems, 55));
  auto out = Mirror(std::vector<float>(kSeqTokens * q_heads * shape.head_dim));
  auto sinks = Mirror(RandomFloats(q_heads, 56, -2.f, 2.f));
  struct Variant {
    float scale, softcap;
    int64_t chunk;
    bool sinks;
  };
  for (const Variant& v : {Variant{0.25f, 3.f, 0, false}, Variant{0.125f, 0.f, 4, false}, Variant{0.25f, 0.f, 0, true}}) {
    for (int64_t window : {int64_t{0}, int64_t{5}}) {
      SCOPED_TRACE(::testing::Message() << "softcap " << v.softcap << " chunk " << v.chunk << " window " << window
                                        << (v.sinks ? " sinks" : ""));
      RunBoth([&](Backend& b, int s) {
        KvLayerView cache = shape;
        cache.k = ck.at(s);
        cache.v = cv.at(s);
        return b.Attention({.q = q.at(s), .out = out.at(s), .paged = Paged(seqs.at(s), table.at(s)),
                            .tokens = kSeqTokens, .q_heads = q_heads, .cache = cache, .scale = v.scale,
                            .sliding_window = window, .chunk_size = v.chunk, .softcap = v.softcap,
                            .sinks = v.sinks ? sinks.at(s) : nullptr});
      });
      ExpectMirrorsClose(out);
    }
  }
}

TEST_F(CudaParityTest, ScaleRows) {
  const int64_t tokens = 6, width = 513;
  auto x = Mirror(RandomFloats(tokens * width, 102));
  auto scales = Mirror(RandomFloats(tokens, 103, -3.f, 3.f));
  RunBoth([&](Backend& b, int s) {
    return b.ScaleRows({.x = x.at(s), .scales = scales.at(s), .tokens = tokens, .width = width});
  });
  ExpectMirrorsClose(x);
}

TEST_F(CudaParityTest, Add) {
  const int64_t n = 1001;
  auto x = Mirror(RandomFloats(n, 70));
  auto y = Mirror(RandomFloats(n, 71));
  RunBoth([&](Backend& b, int s) { return b.Add({.x = x.at(s), .y = y.at(s), .n = n}); });
  ExpectMirrorsClose(x);
}

TEST_F(CudaParityTest, GatherRows) {
  const int64_t src_rows = 20, width = 300, count = 9;
  auto src = Mirror(RandomFloats(src_rows * width, 80));
  auto rows = Mirror(RandomInts(count, 81, 0, src_rows - 1));  // repeats allowed
  auto dst = Mirror(std::vector<float>(count * width));
  RunBoth([&](Backend& b, int s) {
    return b.GatherRows({.src = src.at(s), .rows = rows.at(s), .dst = dst.at(s), .count = count,
                         .src_rows = src_rows, .width = width});
  });
  ExpectMirrorsClose(dst, 0.f);
}

TEST_F(CudaParityTest, ScatterAddRows) {
  const int64_t dst_rows = 20, width = 300, count = 9;
  auto src = Mirror(RandomFloats(count * width, 90));
  auto rows = Mirror(DistinctRows(dst_rows, count, 91));
  auto scales = Mirror(RandomFloats(count, 92, 0.f, 1.f));
  auto dst = Mirror(RandomFloats(dst_rows * width, 93));
  RunBoth([&](Backend& b, int s) {
    return b.ScatterAddRows({.src = src.at(s), .rows = rows.at(s), .scales = scales.at(s), .dst = dst.at(s),
                             .count = count, .dst_rows = dst_rows, .width = width});
  });
  ExpectMirrorsClose(dst);
}

TEST_F(CudaParityTest, SigmoidScaleRows) {
  const int64_t tokens = 6, width = 513;
  auto x = Mirror(RandomFloats(tokens * width, 100));
  auto gate = Mirror(RandomFloats(tokens, 101, -5.f, 5.f));
  RunBoth([&](Backend& b, int s) {
    return b.SigmoidScaleRows({.x = x.at(s), .gate = gate.at(s), .tokens = tokens, .width = width});
  });
  ExpectMirrorsClose(x);
}

// Zero-sized shapes are no-ops that succeed without a launch (a launch with an empty grid would
// fail) and leave the output alone.
TEST_F(CudaParityTest, ZeroSizedOpsSucceed) {
  Backend& gpu = backend(kGpu);
  auto f = Mirror(std::vector<float>{7.f, 8.f});
  auto i = Mirror(std::vector<int32_t>{0});
  const std::vector<AttnSeq> host_seqs = {{.q_begin = 0, .q_len = 0, .pos_begin = 3, .table_begin = 0, .table_len = 1}};
  auto seqs = Mirror(host_seqs);
  float* p = f.at(kGpu);
  const KvLayerView cache{.k = p, .v = p, .num_blocks = 1, .block_size = 8, .kv_heads = 1, .head_dim = 1};
  const std::vector<int32_t> host_table = {0};  // the contents of `i`
  const PagedSeqs one{.seqs = seqs.at(kGpu), .host_seqs = host_seqs.data(), .num_seqs = 1, .block_table = i.at(kGpu),
                      .host_block_table = host_table.data(), .table_entries = 1};
  PagedSeqs none = one;
  none.num_seqs = 0;
  EXPECT_TRUE(gpu.Embedding({.table = p, .ids = i.at(kGpu), .out = p, .tokens = 0, .vocab = 1, .hidden = 1}).ok());
  EXPECT_TRUE(gpu.Linear({.x = p, .w = p, .y = p + 1, .tokens = 0, .in = 4, .out = 4}).ok());  // y must not alias x
  EXPECT_TRUE(gpu.RmsNorm({.x = p, .weight = p, .y = p, .tokens = 0, .hidden = 4}).ok());
  EXPECT_TRUE(gpu.Rope({.q = p, .k = p, .positions = i.at(kGpu), .inv_freq = p, .tokens = 0, .q_heads = 1,
                        .kv_heads = 1, .head_dim = 2})
                  .ok());
  EXPECT_TRUE(gpu.KvWrite({.k = p, .v = p, .paged = one, .tokens = 0, .cache = cache})
                  .ok());
  EXPECT_TRUE(gpu.Attention({.q = p, .out = p, .paged = one, .tokens = 0, .q_heads = 1, .cache = cache})
                  .ok());
  EXPECT_TRUE(gpu.Attention({.q = p, .out = p, .paged = none, .tokens = 0, .q_heads = 1, .cache = cache})
                  .ok());
  EXPECT_TRUE(gpu.SiluMul({.gate = p, .up = p, .out = p, .n = 0}).ok());
  EXPECT_TRUE(gpu.Add({.x = p, .y = p, .n = 0}).ok());
  EXPECT_TRUE(gpu.GatherRows({.src = p, .rows = i.at(kGpu), .dst = p, .count = 0, .src_rows = 1, .width = 1}).ok());
  EXPECT_TRUE(gpu.ScatterAddRows({.src = p, .rows = i.at(kGpu), .scales = p, .dst = p, .count = 0, .dst_rows = 1,
                                  .width = 1})
                  .ok());
  EXPECT_TRUE(gpu.SigmoidScaleRows({.x = p, .gate = p, .tokens = 0, .width = 1}).ok());
  EXPECT_TRUE(gpu.Synchronize().ok());
  EXPECT_EQ(Read(f, kGpu), (std::vector<float>{7.f, 8.f}));
}

TEST_F(CudaParityTest, InvalidParamsAreRejectedAndBackendStaysHealthy) {
  Backend& gpu = backend(kGpu);
  auto x = Mirror(RandomFloats(4, 110));
  const absl::Status st = gpu.Add({.x = x.at(kGpu), .y = nullptr, .n = 4});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_TRUE(gpu.Synchronize().ok());
}

TEST_F(CudaParityTest, AllocateZeroFillsAndReportsOutOfMemory) {
  Backend& gpu = backend(kGpu);
  auto buf = gpu.Allocate(1000 * sizeof(float));
  ASSERT_TRUE(buf.ok()) << buf.status();
  std::vector<float> host(1000, 1.f);
  ASSERT_TRUE(gpu.CopyToHost(host.data(), buf->as<float>(), host.size() * sizeof(float)).ok());
  EXPECT_EQ(host, std::vector<float>(1000, 0.f));
  // More than any device has: out of memory is reported, and the backend stays usable.
  auto huge = gpu.Allocate(size_t{1} << 50);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  EXPECT_TRUE(gpu.Synchronize().ok());
}

TEST_F(CudaParityTest, DeviceErrorMakesBackendUnhealthy) {
  // A fresh backend, so the fixture's stays healthy for other tests in this process.
  auto made = CreateBackend({.kind = DeviceKind::kCuda, .device_index = 0});
  ASSERT_TRUE(made.ok()) << made.status();
  Backend& gpu = **made;
  const float src[4] = {1, 2, 3, 4};
  // A null destination: the runtime rejects the copy (cudaErrorInvalidValue, not sticky, so the
  // rest of this process's tests still have a working device).
  const absl::Status st = gpu.CopyToDevice(nullptr, src, sizeof(src));
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  const absl::Status later = gpu.Synchronize();
  EXPECT_EQ(later.code(), absl::StatusCode::kFailedPrecondition) << later;
  EXPECT_NE(std::string(later.message()).find("backend unhealthy after"), std::string::npos) << later;
}

// Runs on every machine: asking for a device that is not there is an error, not a crash.
TEST(CudaRegistryTest, MissingDeviceIsFailedPrecondition) {
  ASSERT_TRUE(CudaCompiledIn());
  auto made = CreateBackend({.kind = DeviceKind::kCuda, .device_index = CudaDeviceCount()});
  EXPECT_EQ(made.status().code(), absl::StatusCode::kFailedPrecondition) << made.status();
}

}  // namespace
}  // namespace shardserve::kernels

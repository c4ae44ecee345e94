// The CPU backend against straightforward double-precision references.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/tensor/dtype.h"
#include "tests/testing/status_matchers.h"
#include "tests/worker/kernels/random_values.h"
#include "worker/kernels/cpu/gemv.h"
#include "worker/kernels/cpu/softmax.h"
#include "worker/kernels/registry.h"

namespace shardserve::kernels {
namespace {

using ::shardserve::testing::StatusIs;
using ::testing::HasSubstr;

// Round-to-nearest-even bfloat16 bits of each value (finite inputs), as checkpoints store them.
std::vector<uint16_t> ToBf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const uint32_t b = std::bit_cast<uint32_t>(v[i]);
    out[i] = static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
  }
  return out;
}

std::vector<float> Widen(const std::vector<uint16_t>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = std::bit_cast<float>(uint32_t{v[i]} << 16);
  return out;
}

void ExpectClose(const std::vector<float>& ref, const std::vector<float>& got, float rel, const std::string& what) {
  ASSERT_EQ(ref.size(), got.size());
  float max_ref = 1e-6f, max_err = 0.f;
  for (size_t i = 0; i < ref.size(); ++i) {
    max_ref = std::max(max_ref, std::fabs(ref[i]));
    max_err = std::max(max_err, std::fabs(ref[i] - got[i]));
  }
  EXPECT_LE(max_err, rel * max_ref) << what;
}

class CpuBackendTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_OK_AND_ASSIGN(b_, CreateBackend({})); }
  std::unique_ptr<Backend> b_;
};

struct LinearShape {
  int64_t tokens, in, out;
};

class LinearTest : public CpuBackendTest, public ::testing::WithParamInterface<LinearShape> {};

TEST_P(LinearTest, MatchesReferenceWithBiasAndAccumulate) {
  const auto [tokens, in, out] = GetParam();
  const auto x = Random(static_cast<size_t>(tokens * in), 1);
  const auto w = Random(static_cast<size_t>(out * in), 2);
  const auto bias = Random(static_cast<size_t>(out), 3);
  const auto y0 = Random(static_cast<size_t>(tokens * out), 4);
  for (bool accumulate : {false, true}) {
    for (bool with_bias : {false, true}) {
      std::vector<float> ref = y0, got = y0;
      cpu::ReferenceLinear(x.data(), w.data(), with_bias ? bias.data() : nullptr, ref.data(), tokens, in, out,
                           accumulate);
      ASSERT_TRUE(b_->Linear({.x = x.data(), .w = w.data(), .bias = with_bias ? bias.data() : nullptr,
                              .y = got.data(), .tokens = tokens, .in = in, .out = out, .accumulate = accumulate})
                      .ok());
      ExpectClose(ref, got, 1e-5f, absl::StrCat("tokens ", tokens, " in ", in, " out ", out, " acc ", accumulate,
                                                " bias ", with_bias));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, LinearTest,
                         // Each kernel the backend picks and the token counts where it switches: the
                         // stream up to 3 tokens (AVX2) or 2 (AVX-512), the blocked kernel up to 48
                         // (AVX2) or 128 (AVX-512), sgemm above; with rows and tokens left over from
                         // the tiles and `in` not a multiple of the vector width.
                         ::testing::Values(LinearShape{1, 64, 64}, LinearShape{1, 37, 13}, LinearShape{2, 37, 13},
                                           LinearShape{3, 768, 35}, LinearShape{4, 64, 8}, LinearShape{5, 37, 13},
                                           LinearShape{7, 100, 7}, LinearShape{8, 100, 7}, LinearShape{9, 64, 33},
                                           LinearShape{16, 2048, 11}, LinearShape{40, 172, 64},
                                           LinearShape{48, 100, 9}, LinearShape{49, 64, 5}, LinearShape{128, 70, 6},
                                           LinearShape{129, 70, 6}, LinearShape{1, 5, 1}, LinearShape{6, 5, 3}));

// Each body of the blocked kernel called directly, whatever the backend would pick on this CPU,
// against the reference: tile remainders in rows (out % 4, % 3 ...) and tokens (tokens % 3, % 6,
// % 8), `in` not a multiple of the vector width (8 or 16), row subranges, bias and accumulate.
enum class BlockedVariant { kAvx2, kAvx512 };

struct BlockedCase {
  int64_t tokens, in, out, row_begin, row_end;
};

// Empty products, `in` = 0, an empty row range, single rows; tile remainders; `in` % 16 != 0; row
// subranges.
const std::vector<BlockedCase> kBlockedCases = {
    {0, 16, 5, 0, 5}, {7, 0, 6, 0, 6}, {5, 20, 8, 4, 4}, {1, 5, 1, 0, 1}, {1, 37, 13, 0, 13},
    {128, 70, 6, 0, 6}, {2, 16, 4, 0, 4}, {3, 17, 7, 0, 7}, {4, 64, 8, 0, 8}, {5, 37, 13, 0, 13},
    {6, 48, 12, 0, 12}, {7, 100, 7, 0, 7}, {8, 100, 9, 0, 9}, {9, 64, 33, 0, 33}, {11, 76, 23, 5, 18},
    {13, 15, 10, 1, 10}, {16, 2048, 11, 0, 11}, {16, 768, 26, 3, 25}, {17, 33, 30, 0, 30}, {23, 31, 6, 2, 5},
    {25, 129, 17, 0, 17}, {40, 172, 64, 0, 64}, {48, 100, 9, 0, 9}, {64, 257, 19, 7, 19}, {6, 5, 3, 0, 3},
    {12, 3, 5, 4, 5},
};

class BlockedLinearTest : public ::testing::TestWithParam<std::tuple<BlockedVariant, BlockedCase>> {
 protected:
  void SetUp() override {
    if (std::get<0>(GetParam()) == BlockedVariant::kAvx512 && !cpu::HaveAvx512()) {
      GTEST_SKIP() << "this CPU lacks AVX-512F/VL/BW: the AVX-512 kernel is not tested here";
    }
  }
  void Run(const float* x, const float* w, const float* bias, float* y, int64_t tokens, int64_t in, int64_t out,
           bool accumulate, int64_t row_begin, int64_t row_end) const {
    if (std::get<0>(GetParam()) == BlockedVariant::kAvx512) {
      cpu::BlockedLinearAvx512(x, w, bias, y, tokens, in, out, accumulate, row_begin, row_end);
    } else {
      cpu::BlockedLinearAvx2(x, w, bias, y, tokens, in, out, accumulate, row_begin, row_end);
    }
  }
};

TEST_P(BlockedLinearTest, MatchesReferenceAndWritesOnlyItsRows) {
  const auto [tokens, in, out, row_begin, row_end] = std::get<1>(GetParam());
  const auto x = Random(static_cast<size_t>(tokens * in), 11);
  const auto w = Random(static_cast<size_t>(out * in), 12);
  const auto bias = Random(static_cast<size_t>(out), 13);
  const auto y0 = Random(static_cast<size_t>(tokens * out), 14);
  for (bool accumulate : {false, true}) {
    for (bool with_bias : {false, true}) {
      const float* b = with_bias ? bias.data() : nullptr;
      std::vector<float> ref = y0, got = y0;
      cpu::ReferenceLinear(x.data(), w.data(), b, ref.data(), tokens, in, out, accumulate);
      Run(x.data(), w.data(), b, got.data(), tokens, in, out, accumulate, row_begin, row_end);
      const std::string what = absl::StrCat("tokens ", tokens, " in ", in, " out ", out, " rows [", row_begin, ", ",
                                            row_end, ") acc ", accumulate, " bias ", with_bias);
      float max_ref = 1e-6f, max_err = 0.f;
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t o = 0; o < out; ++o) {
          const size_t i = static_cast<size_t>(t * out + o);
          if (o < row_begin || o >= row_end) {
            ASSERT_EQ(got[i], y0[i]) << what << ": token " << t << " row " << o << " is outside the range";
          } else {
            max_ref = std::max(max_ref, std::fabs(ref[i]));
            max_err = std::max(max_err, std::fabs(ref[i] - got[i]));
          }
        }
      }
      EXPECT_LE(max_err, 1e-5f * max_ref) << what;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, BlockedLinearTest,
    ::testing::Combine(::testing::Values(BlockedVariant::kAvx2, BlockedVariant::kAvx512),
                       ::testing::ValuesIn(kBlockedCases)),
    [](const ::testing::TestParamInfo<BlockedLinearTest::ParamType>& p) {
      const auto& c = std::get<1>(p.param);
      return absl::StrCat(std::get<0>(p.param) == BlockedVariant::kAvx512 ? "Avx512" : "Avx2", "_t", c.tokens,
                          "_in", c.in, "_out", c.out, "_rows", c.row_begin, "to", c.row_end);
    });

// Each bfloat16 kernel called directly over the same cases: against ReferenceLinearBf16, and against
// the f32 kernel of the same kind on the widened weights. Widening is exact and the vector
// arithmetic is the same, but the compiler may contract the scalar tails (in % 8) into FMAs
// differently in the two instantiations, so the second check allows a few ulps.
enum class Bf16Variant { kSmall, kBlockedAvx2, kBlockedAvx512 };

class Bf16KernelTest : public ::testing::TestWithParam<std::tuple<Bf16Variant, BlockedCase>> {
 protected:
  void SetUp() override {
    if (std::get<0>(GetParam()) == Bf16Variant::kBlockedAvx512 && !cpu::HaveAvx512()) {
      GTEST_SKIP() << "this CPU lacks AVX-512F/VL/BW: the AVX-512 kernel is not tested here";
    }
  }
  void Run(const float* x, const uint16_t* w, const float* bias, float* y, int64_t tokens, int64_t in, int64_t out,
           bool accumulate, int64_t row_begin, int64_t row_end) const {
    switch (std::get<0>(GetParam())) {
      case Bf16Variant::kSmall:
        cpu::SmallBatchLinearBf16(x, w, bias, y, tokens, in, out, accumulate, row_begin, row_end);
        break;
      case Bf16Variant::kBlockedAvx2:
        cpu::BlockedLinearBf16Avx2(x, w, bias, y, tokens, in, out, accumulate, row_begin, row_end);
        break;
      case Bf16Variant::kBlockedAvx512:
        cpu::BlockedLinearBf16Avx512(x, w, bias, y, tokens, in, out, accumulate, row_begin, row_end);
        break;
    }
  }
  void RunF32(const float* x, const float* w, const float* bias, float* y, int64_t tokens, int64_t in, int64_t out,
              bool accumulate, int64_t row_begin, int64_t row_end) const {
    switch (std::get<0>(GetParam())) {
      case Bf16Variant::kSmall:
        cpu::SmallBatchLinear(x, w, bias, y, tokens, in, out, accumulate, row_begin, row_end);
        break;
      case Bf16Variant::kBlockedAvx2:
        cpu::BlockedLinearAvx2(x, w, bias, y, tokens, in, out, accumulate, row_begin, row_end);
        break;
      case Bf16Variant::kBlockedAvx512:
        cpu::BlockedLinearAvx512(x, w, bias, y, tokens, in, out, accumulate, row_begin, row_end);
        break;
    }
  }
};

TEST_P(Bf16KernelTest, MatchesReferenceAndF32KernelOnWidenedWeights) {
  const auto [tokens, in, out, row_begin, row_end] = std::get<1>(GetParam());
  const auto x = Random(static_cast<size_t>(tokens * in), 21);
  const auto w16 = ToBf16(Random(static_cast<size_t>(out * in), 22));
  const auto w = Widen(w16);
  const auto bias = Random(static_cast<size_t>(out), 23);
  const auto y0 = Random(static_cast<size_t>(tokens * out), 24);
  for (bool accumulate : {false, true}) {
    for (bool with_bias : {false, true}) {
      const float* b = with_bias ? bias.data() : nullptr;
      std::vector<float> ref = y0, got = y0, f32 = y0;
      cpu::ReferenceLinearBf16(x.data(), w16.data(), b, ref.data(), tokens, in, out, accumulate);
      Run(x.data(), w16.data(), b, got.data(), tokens, in, out, accumulate, row_begin, row_end);
      RunF32(x.data(), w.data(), b, f32.data(), tokens, in, out, accumulate, row_begin, row_end);
      const std::string what = absl::StrCat("tokens ", tokens, " in ", in, " out ", out, " rows [", row_begin, ", ",
                                            row_end, ") acc ", accumulate, " bias ", with_bias);
      float max_ref = 1e-6f, max_err = 0.f, max_f32_err = 0.f;
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t o = 0; o < out; ++o) {
          const size_t i = static_cast<size_t>(t * out + o);
          if (o < row_begin || o >= row_end) {
            ASSERT_EQ(got[i], y0[i]) << what << ": token " << t << " row " << o << " is outside the range";
          } else {
            max_ref = std::max(max_ref, std::fabs(ref[i]));
            max_err = std::max(max_err, std::fabs(ref[i] - got[i]));
            max_f32_err = std::max(max_f32_err, std::fabs(f32[i] - got[i]));
          }
        }
      }
      EXPECT_LE(max_err, 1e-5f * max_ref) << what;
      EXPECT_LE(max_f32_err, 1e-6f * max_ref) << what << ": against the f32 kernel on the widened weights";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, Bf16KernelTest,
    ::testing::Combine(::testing::Values(Bf16Variant::kSmall, Bf16Variant::kBlockedAvx2, Bf16Variant::kBlockedAvx512),
                       ::testing::ValuesIn(kBlockedCases)),
    [](const ::testing::TestParamInfo<Bf16KernelTest::ParamType>& p) {
      const auto& c = std::get<1>(p.param);
      const Bf16Variant v = std::get<0>(p.param);
      return absl::StrCat(v == Bf16Variant::kSmall ? "Small" : v == Bf16Variant::kBlockedAvx2 ? "Avx2" : "Avx512",
                          "_t", c.tokens, "_in", c.in, "_out", c.out, "_rows", c.row_begin, "to", c.row_end);
    });

TEST(Bf16Test, WidenBf16IsExactOverEveryLength) {
  const auto w16 = ToBf16(Random(67, 31));
  const auto ref = Widen(w16);
  for (int64_t n = 0; n <= 67; ++n) {
    std::vector<float> got(67, -7.f);
    cpu::WidenBf16(w16.data(), got.data(), n);
    for (int64_t i = 0; i < 67; ++i) {
      ASSERT_EQ(got[static_cast<size_t>(i)], i < n ? ref[static_cast<size_t>(i)] : -7.f) << "n " << n << " i " << i;
    }
  }
  EXPECT_EQ(cpu::Bf16ToFloat(0x3F80), 1.0f);
  EXPECT_EQ(cpu::Bf16ToFloat(0xC040), -3.0f);
}

// The backend's Linear with bfloat16 weights at token counts in every range its dispatch uses
// (stream, blocked, sgemm on widened row blocks; out = 300 with in = 2048 takes several blocks),
// against the reference.
class LinearBf16Test : public CpuBackendTest, public ::testing::WithParamInterface<LinearShape> {};

TEST_P(LinearBf16Test, MatchesReferenceWithBiasAndAccumulate) {
  const auto [tokens, in, out] = GetParam();
  ASSERT_TRUE(b_->SupportsOp(Op::kLinear, DType::kBF16));
  // One spare element each, so that no pointer is null at 0 tokens or in = 0.
  const auto x = Random(static_cast<size_t>(tokens * in + 1), 41);
  const auto w16 = ToBf16(Random(static_cast<size_t>(out * in + 1), 42));
  const auto bias = Random(static_cast<size_t>(out), 43);
  const auto y0 = Random(static_cast<size_t>(tokens * out + 1), 44);
  for (bool accumulate : {false, true}) {
    for (bool with_bias : {false, true}) {
      std::vector<float> ref = y0, got = y0;
      cpu::ReferenceLinearBf16(x.data(), w16.data(), with_bias ? bias.data() : nullptr, ref.data(), tokens, in, out,
                               accumulate);
      ASSERT_TRUE(b_->Linear({.x = x.data(), .w = WeightView::Bf16(w16.data()), .bias = with_bias ? bias.data() : nullptr,
                              .y = got.data(), .tokens = tokens, .in = in, .out = out, .accumulate = accumulate})
                      .ok());
      ExpectClose(ref, got, 1e-5f, absl::StrCat("tokens ", tokens, " in ", in, " out ", out, " acc ", accumulate,
                                                " bias ", with_bias));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, LinearBf16Test,
                         ::testing::Values(LinearShape{0, 37, 13}, LinearShape{1, 64, 64}, LinearShape{1, 37, 13},
                                           LinearShape{2, 37, 13}, LinearShape{3, 768, 35}, LinearShape{8, 100, 7},
                                           LinearShape{16, 2048, 11}, LinearShape{48, 100, 9},
                                           LinearShape{49, 64, 5}, LinearShape{128, 70, 6}, LinearShape{129, 70, 6},
                                           LinearShape{129, 2048, 300}, LinearShape{300, 37, 13},
                                           LinearShape{300, 2048, 300}, LinearShape{130, 5, 1},
                                           LinearShape{300, 0, 4}));

TEST_F(CpuBackendTest, LinearRejectsMissingAndUnsupportedWeights) {
  float buf[4] = {}, y[4] = {};
  const uint16_t w16[4] = {};
  EXPECT_THAT(b_->Linear({.x = buf, .y = y, .tokens = 1, .in = 1, .out = 1}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("null weights")));
  // The CPU backend multiplies f32 and bf16 weights; f16 ones are widened at load, never passed.
  EXPECT_FALSE(b_->SupportsOp(Op::kLinear, DType::kF16));
  EXPECT_THAT(b_->Linear({.x = buf, .w = WeightView::F16(w16), .y = y, .tokens = 1, .in = 1, .out = 1}),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("cpu: Linear does not take F16 weights")));
  EXPECT_EQ(y[0], 0.f);
}

TEST_F(CpuBackendTest, AddRmsNormEqualsAddThenRmsNorm) {
  const int64_t tokens = 5, hidden = 37;
  const auto x0 = Random(static_cast<size_t>(tokens * hidden), 81);
  const auto y = Random(static_cast<size_t>(tokens * hidden), 82);
  const auto weight = Random(static_cast<size_t>(hidden), 83);
  std::vector<float> x_fused = x0, out_fused(x0.size()), x_apart = x0, out_apart(x0.size());
  ASSERT_TRUE(b_->AddRmsNorm({.x = x_fused.data(), .y = y.data(), .weight = weight.data(), .out = out_fused.data(),
                              .tokens = tokens, .hidden = hidden, .eps = 1e-5f})
                  .ok());
  ASSERT_TRUE(b_->Add({.x = x_apart.data(), .y = y.data(), .n = tokens * hidden}).ok());
  ASSERT_TRUE(b_->RmsNorm({.x = x_apart.data(), .weight = weight.data(), .y = out_apart.data(), .tokens = tokens,
                           .hidden = hidden, .eps = 1e-5f})
                  .ok());
  EXPECT_EQ(x_fused, x_apart);  // the same formulas in the same order: bit for bit
  EXPECT_EQ(out_fused, out_apart);
  EXPECT_THAT(b_->AddRmsNorm({.x = x_fused.data(), .y = y.data(), .weight = weight.data(), .out = x_fused.data(),
                              .tokens = tokens, .hidden = hidden}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must not alias")));
}

TEST_F(CpuBackendTest, ArgmaxRowsTakesTheFirstMaximumOfEachRowsColumns) {
  const float inf = std::numeric_limits<float>::infinity();
  // 3 rows of stride 5, width 4 (the fifth column is padding, never read).
  const std::vector<float> x = {1.f, 3.f, 3.f, -2.f, 99.f,     // tie: column 1
                                -inf, -inf, -inf, -inf, 99.f,  // all -inf: column 0
                                -5.f, -4.f, -6.f, -3.5f, 99.f};
  int32_t out[3] = {-1, -1, -1};
  ASSERT_TRUE(b_->ArgmaxRows({.x = x.data(), .out = out, .rows = 3, .width = 4, .stride = 5}).ok());
  EXPECT_EQ(out[0], 1);
  EXPECT_EQ(out[1], 0);
  EXPECT_EQ(out[2], 3);
  EXPECT_THAT(b_->ArgmaxRows({.x = x.data(), .out = out, .rows = 1, .width = 6, .stride = 5}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("width 6")));
}

TEST_F(CpuBackendTest, KvCacheIsF32OrFp8) {
  // CPU ranks keep an f32 cache, or FP8 codes when asked (Model's KvCacheDType asks SupportsOp); a
  // 16-bit view is refused.
  EXPECT_TRUE(b_->SupportsOp(Op::kKvWrite, DType::kF8E4M3));
  EXPECT_TRUE(b_->SupportsOp(Op::kAttention, DType::kF8E4M3));
  EXPECT_FALSE(b_->SupportsOp(Op::kMlaKvWrite, DType::kF8E4M3));
  EXPECT_FALSE(b_->SupportsOp(Op::kKvWrite, DType::kBF16));
  EXPECT_FALSE(b_->SupportsOp(Op::kAttention, DType::kF16));
  float buf[8] = {};
  const AttnSeq seq{.q_begin = 0, .q_len = 1, .pos_begin = 0, .table_begin = 0, .table_len = 1};
  const int32_t block = 0;
  const PagedSeqs paged{.seqs = &seq, .host_seqs = &seq, .num_seqs = 1, .block_table = &block,
                        .host_block_table = &block, .table_entries = 1};
  const KvLayerView cache{.k = buf, .v = buf + 4, .num_blocks = 1, .block_size = 2, .kv_heads = 1, .head_dim = 2,
                          .dtype = DType::kBF16};
  EXPECT_THAT(b_->KvWrite({.k = buf, .v = buf, .paged = paged, .tokens = 1, .cache = cache}),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("KvWrite does not take BF16")));
}

TEST_F(CpuBackendTest, EmbeddingWidensEveryTableDtype) {
  const std::vector<float> table = {0.5f, -1.25f, 3.0f, 2.0f, -0.75f, 8.0f};  // [3, 2], exact in bf16 and f16
  std::vector<uint16_t> bf16, f16;
  for (float v : table) {
    bf16.push_back(FloatToBFloat16(v));
    f16.push_back(FloatToHalf(v));
  }
  const int32_t ids[3] = {2, 0, 2};
  for (const WeightView& view : {WeightView(table.data()), WeightView::Bf16(bf16.data()), WeightView::F16(f16.data())}) {
    ASSERT_TRUE(b_->SupportsOp(Op::kEmbedding, view.dtype));
    std::vector<float> out(6, 0.f);
    ASSERT_TRUE(b_->Embedding({.table = view, .ids = ids, .out = out.data(), .tokens = 3, .vocab = 3, .hidden = 2}).ok());
    EXPECT_EQ(out, (std::vector<float>{-0.75f, 8.0f, 0.5f, -1.25f, -0.75f, 8.0f})) << DTypeName(view.dtype);
  }
}

// A paged cache filled from per-sequence contiguous K/V: sequence s's position j lives in block
// tables[s][j / block_size] at row j % block_size. Block ids are shuffled, so neighbouring
// positions of a sequence are not neighbours in memory.
struct PagedFixture {
  int64_t kv_heads = 2, d = 8, block_size = 3, num_blocks = 0;
  std::vector<std::vector<float>> k_seq, v_seq;  // per sequence [ctx, kv_heads, d]
  std::vector<std::vector<int32_t>> tables;
  std::vector<int32_t> flat;                     // tables concatenated
  std::vector<float> k_cache, v_cache;           // [num_blocks, block_size, kv_heads, d]

  int64_t row() const { return kv_heads * d; }

  PagedFixture(const std::vector<int64_t>& ctx_lens, uint32_t seed, int64_t head_dim = 8, int64_t heads = 2)
      : kv_heads(heads), d(head_dim) {
    int64_t blocks = 0;
    for (int64_t len : ctx_lens) blocks += (len + block_size - 1) / block_size;
    num_blocks = blocks + 3;  // some blocks belong to nobody
    std::vector<int32_t> ids(static_cast<size_t>(num_blocks));
    for (int32_t i = 0; i < num_blocks; ++i) ids[static_cast<size_t>(i)] = i;
    std::shuffle(ids.begin(), ids.end(), std::mt19937(seed));
    k_cache = Random(static_cast<size_t>(num_blocks * block_size * row()), seed + 1);  // garbage elsewhere
    v_cache = Random(k_cache.size(), seed + 2);
    size_t next = 0;
    for (size_t s = 0; s < ctx_lens.size(); ++s) {
      const int64_t len = ctx_lens[s];
      k_seq.push_back(Random(static_cast<size_t>(len * row()), seed + 10 + static_cast<uint32_t>(s)));
      v_seq.push_back(Random(static_cast<size_t>(len * row()), seed + 20 + static_cast<uint32_t>(s)));
      std::vector<int32_t> table;
      for (int64_t j = 0; j < (len + block_size - 1) / block_size; ++j) table.push_back(ids[next++]);
      for (int64_t j = 0; j < len; ++j) {
        const int64_t dst = (table[static_cast<size_t>(j / block_size)] * block_size + j % block_size) * row();
        std::copy_n(k_seq[s].begin() + j * row(), row(), k_cache.begin() + dst);
        std::copy_n(v_seq[s].begin() + j * row(), row(), v_cache.begin() + dst);
      }
      tables.push_back(table);
    }
    for (const auto& t : tables) flat.insert(flat.end(), t.begin(), t.end());
  }
  // Table entry range of sequence s in `flat`.
  int32_t begin(size_t s) const {
    int32_t b = 0;
    for (size_t i = 0; i < s; ++i) b += static_cast<int32_t>(tables[i].size());
    return b;
  }
  int32_t len(size_t s) const { return static_cast<int32_t>(tables[s].size()); }
  KvLayerView view() { return {k_cache.data(), v_cache.data(), num_blocks, block_size, kv_heads, d}; }
  PagedSeqs paged(const std::vector<AttnSeq>& seqs) const {
    return {.seqs = seqs.data(), .host_seqs = seqs.data(), .num_seqs = static_cast<int64_t>(seqs.size()),
            .block_table = flat.data(), .host_block_table = flat.data(),
            .table_entries = static_cast<int64_t>(flat.size())};
  }
};

// Naive double-precision attention over sequence s's contiguous K/V.
std::vector<float> ReferenceAttention(const PagedFixture& f, const std::vector<AttnSeq>& seqs, const std::vector<float>& q,
                                      int64_t q_heads, float scale, int64_t window, double softcap = 0.0,
                                      int64_t chunk = 0, const float* sinks = nullptr) {
  const int64_t d = f.d, row = f.row();
  std::vector<float> ref(q.size());
  for (size_t si = 0; si < seqs.size(); ++si) {
    const AttnSeq& s = seqs[si];
    for (int64_t i = 0; i < s.q_len; ++i) {
      const int64_t t = s.q_begin + i, pos = s.pos_begin + i;
      for (int64_t h = 0; h < q_heads; ++h) {
        const int64_t g = h / (q_heads / f.kv_heads);
        std::vector<double> sc;
        double m = -1e300;
        std::vector<int64_t> keys;
        for (int64_t j = 0; j <= pos; ++j) {
          if (window > 0 && pos - j >= window) continue;
          if (chunk > 0 && j / chunk != pos / chunk) continue;
          double dot = 0;
          for (int64_t e = 0; e < d; ++e) {
            dot += double{q[static_cast<size_t>((t * q_heads + h) * d + e)]} *
                   f.k_seq[si][static_cast<size_t>(j * row + g * d + e)];
          }
          const double score = softcap > 0 ? softcap * std::tanh(dot * scale / softcap) : dot * scale;
          sc.push_back(score);
          m = std::max(m, score);
          keys.push_back(j);
        }
        double sum = 0;
        for (double& x : sc) sum += (x = std::exp(x - m));
        if (sinks != nullptr) sum += std::exp(double{sinks[h]} - m);  // a logit with no value
        for (int64_t e = 0; e < d; ++e) {
          double acc = 0;
          for (size_t j = 0; j < keys.size(); ++j) {
            acc += sc[j] / sum * f.v_seq[si][static_cast<size_t>(keys[j] * row + g * d + e)];
          }
          ref[static_cast<size_t>((t * q_heads + h) * d + e)] = static_cast<float>(acc);
        }
      }
    }
  }
  return ref;
}

// Two sequences of a PagedFixture({8, 10}, ...): one prefilling 5 tokens from position 3, one
// decoding at position 9 (6 query tokens in all).
std::vector<AttnSeq> PrefillAndDecode(const PagedFixture& f) {
  return {{.q_begin = 0, .q_len = 5, .pos_begin = 3, .table_begin = f.begin(0), .table_len = f.len(0)},
          {.q_begin = 5, .q_len = 1, .pos_begin = 9, .table_begin = f.begin(1), .table_len = f.len(1)}};
}

TEST_F(CpuBackendTest, PagedAttentionMatchesContiguousReferenceWithSlidingWindowAndGqa) {
  // Three sequences: one prefilling 5 tokens from position 3, one decoding at position 9, one
  // decoding at position 0; blocks of 3 tokens, shuffled.
  PagedFixture f({8, 10, 1}, 5);
  const int64_t q_heads = 4;
  const std::vector<AttnSeq> seqs = {
      {.q_begin = 0, .q_len = 5, .pos_begin = 3, .table_begin = f.begin(0), .table_len = f.len(0)},
      {.q_begin = 5, .q_len = 1, .pos_begin = 9, .table_begin = f.begin(1), .table_len = f.len(1)},
      {.q_begin = 6, .q_len = 1, .pos_begin = 0, .table_begin = f.begin(2), .table_len = f.len(2)}};
  const int64_t tokens = 7;
  const auto q = Random(static_cast<size_t>(tokens * q_heads * f.d), 7);
  for (int64_t window : {int64_t{0}, int64_t{4}}) {
    std::vector<float> out(q.size());
    ASSERT_TRUE(b_->Attention({.q = q.data(), .out = out.data(), .paged = f.paged(seqs), .tokens = tokens,
                               .q_heads = q_heads, .cache = f.view(), .scale = 0.35f, .sliding_window = window})
                    .ok());
    ExpectClose(ReferenceAttention(f, seqs, q, q_heads, 0.35f, window), out, 1e-5f, absl::StrCat("window ", window));
  }
}

TEST_F(CpuBackendTest, SoftCappedAttentionMatchesReference) {
  // Gemma-2: scaled scores are soft-capped before the softmax; scale 1.5 makes them reach well
  // past the cap 2, so the capped and uncapped results differ.
  PagedFixture f({8, 10}, 5);
  const int64_t q_heads = 4;
  const std::vector<AttnSeq> seqs = PrefillAndDecode(f);
  const int64_t tokens = 6;
  const auto q = Random(static_cast<size_t>(tokens * q_heads * f.d), 9);
  for (int64_t window : {int64_t{0}, int64_t{4}}) {
    std::vector<float> out(q.size());
    ASSERT_TRUE(b_->Attention({.q = q.data(), .out = out.data(), .paged = f.paged(seqs), .tokens = tokens,
                               .q_heads = q_heads, .cache = f.view(), .scale = 1.5f, .sliding_window = window,
                               .softcap = 2.0f})
                    .ok());
    ExpectClose(ReferenceAttention(f, seqs, q, q_heads, 1.5f, window, 2.0), out, 1e-5f, absl::StrCat("window ", window));
    const std::vector<float> uncapped = ReferenceAttention(f, seqs, q, q_heads, 1.5f, window);
    float diff = 0.f;
    for (size_t i = 0; i < out.size(); ++i) diff = std::max(diff, std::fabs(out[i] - uncapped[i]));
    EXPECT_GT(diff, 1e-2f) << "the cap does not change the result: the test would not see it missing";
  }
}

TEST_F(CpuBackendTest, AttentionSinksMatchReference) {
  // GraniteSWA: one more logit per head in the softmax's denominator. Sinks around the scores'
  // size (scale 0.35 on scores of a few units), one far above them (its head attends to almost
  // nothing) and one far below (as if absent).
  PagedFixture f({8, 10}, 5);
  const int64_t q_heads = 4;
  const std::vector<AttnSeq> seqs = PrefillAndDecode(f);
  const int64_t tokens = 6;
  const auto q = Random(static_cast<size_t>(tokens * q_heads * f.d), 10);
  const std::vector<float> sinks = {0.5f, -1.0f, 30.0f, -100.0f};
  for (int64_t window : {int64_t{0}, int64_t{4}}) {
    std::vector<float> out(q.size());
    ASSERT_TRUE(b_->Attention({.q = q.data(), .out = out.data(), .paged = f.paged(seqs), .tokens = tokens,
                               .q_heads = q_heads, .cache = f.view(), .scale = 0.35f, .sliding_window = window,
                               .sinks = sinks.data()})
                    .ok());
    const std::string what = absl::StrCat("window ", window);
    ExpectClose(ReferenceAttention(f, seqs, q, q_heads, 0.35f, window, 0.0, 0, sinks.data()), out, 1e-5f, what);
    const std::vector<float> plain = ReferenceAttention(f, seqs, q, q_heads, 0.35f, window);
    for (int64_t h = 0; h < q_heads; ++h) {
      float diff = 0.f, size = 0.f;
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t e = 0; e < f.d; ++e) {
          const size_t i = static_cast<size_t>((t * q_heads + h) * f.d + e);
          diff = std::max(diff, std::fabs(out[i] - plain[i]));
          size = std::max(size, std::fabs(out[i]));
        }
      }
      if (h == 3) {
        EXPECT_LT(diff, 1e-6f) << what << ": a sink far below the scores takes nothing";
      } else if (h == 2) {
        EXPECT_LT(size, 1e-6f) << what << ": a sink far above the scores takes everything";
      } else {
        EXPECT_GT(diff, 1e-2f) << what << ", head " << h << ": the sink does not change the result";
      }
    }
  }
}

TEST_F(CpuBackendTest, ChunkedAttentionMatchesReference) {
  // Llama-4: keys only from the query's chunk. Chunks of 4: the prefill from position 3 crosses
  // from chunk 0 into chunk 1 (position 4 sees itself only), the decode at 9 sees 8 and 9.
  PagedFixture f({8, 10}, 5);
  const int64_t q_heads = 4;
  const std::vector<AttnSeq> seqs = PrefillAndDecode(f);
  const int64_t tokens = 6;
  const auto q = Random(static_cast<size_t>(tokens * q_heads * f.d), 11);
  for (int64_t window : {int64_t{0}, int64_t{3}}) {
    std::vector<float> out(q.size());
    ASSERT_TRUE(b_->Attention({.q = q.data(), .out = out.data(), .paged = f.paged(seqs), .tokens = tokens,
                               .q_heads = q_heads, .cache = f.view(), .scale = 0.35f, .sliding_window = window,
                               .chunk_size = 4})
                    .ok());
    ExpectClose(ReferenceAttention(f, seqs, q, q_heads, 0.35f, window, 0.0, 4), out, 1e-5f,
                absl::StrCat("window ", window));
    const std::vector<float> unchunked = ReferenceAttention(f, seqs, q, q_heads, 0.35f, window);
    float diff = 0.f;
    for (size_t i = 0; i < out.size(); ++i) diff = std::max(diff, std::fabs(out[i] - unchunked[i]));
    EXPECT_GT(diff, 1e-2f) << "chunks change nothing: the test would not see them missing";
  }
  EXPECT_THAT(b_->Attention({.q = q.data(), .out = std::vector<float>(q.size()).data(), .paged = f.paged(seqs),
                             .tokens = tokens, .q_heads = q_heads, .cache = f.view(), .chunk_size = -1}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("negative chunk size")));
}

TEST_F(CpuBackendTest, GeluTanhMulAndScaleWithSoftCap) {
  const std::vector<float> gate = {-3.f, -1.f, -0.25f, 0.f, 0.5f, 1.f, 2.5f};
  const std::vector<float> up = {1.f, 2.f, -1.f, 3.f, 0.5f, 1.f, -2.f};
  std::vector<float> out(gate.size());
  ASSERT_TRUE(b_->SiluMul({.gate = gate.data(), .up = up.data(), .out = out.data(),
                           .n = static_cast<int64_t>(gate.size()), .act = GateActivation::kGeluTanh})
                  .ok());
  for (size_t i = 0; i < gate.size(); ++i) {
    const double x = gate[i];
    const double gelu = 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / std::numbers::pi) * (x + 0.044715 * x * x * x)));
    EXPECT_NEAR(out[i], gelu * up[i], 1e-6) << i;
  }
  // torch.nn.functional.gelu(torch.tensor(1.0), approximate="tanh") = 0.8411920070648193.
  EXPECT_NEAR(out[5], 0.8411920070648193, 1e-6);
  std::vector<float> x = {-40.f, -1.f, 0.f, 0.3f, 7.f, 100.f};
  std::vector<float> y = x;
  ASSERT_TRUE(b_->Scale({.x = y.data(), .n = static_cast<int64_t>(y.size()), .scale = 0.5f, .softcap = 3.f}).ok());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(y[i], 3.0 * std::tanh(0.5 * x[i] / 3.0), 1e-6) << i;
  std::vector<float> z = x;
  ASSERT_TRUE(b_->Scale({.x = z.data(), .n = static_cast<int64_t>(z.size()), .scale = 8.f}).ok());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(z[i], 8.f * x[i]) << i;
  EXPECT_FALSE(b_->Scale({.x = z.data(), .n = 1, .scale = 1.f, .softcap = -1.f}).ok());
  EXPECT_FALSE(b_->Scale({.x = nullptr, .n = 1}).ok());
}

// GPT-OSS's experts: min(gate, 7) sigmoid(1.702 min(gate, 7)) (clamp(up, -7, 7) + 1), against a
// double-precision reference on both sides of each clamp; NaN stays NaN, as torch.clamp keeps it.
TEST_F(CpuBackendTest, ClampedSwigluMul) {
  const std::vector<float> gate = {-9.f, -3.f, -0.5f, 0.f, 0.75f, 6.5f, 7.f, 7.5f, 30.f, 2.f, 2.f, 2.f};
  const std::vector<float> up = {1.f, -2.f, 0.5f, 3.f, -1.f, 6.9f, -7.f, 8.f, -30.f, 12.f, -12.f, -1.f};
  std::vector<float> out(gate.size());
  ASSERT_TRUE(b_->SiluMul({.gate = gate.data(), .up = up.data(), .out = out.data(),
                           .n = static_cast<int64_t>(gate.size()), .act = GateActivation::kClampedSwiglu})
                  .ok());
  for (size_t i = 0; i < gate.size(); ++i) {
    const double g = std::min<double>(gate[i], 7.0);
    const double u = std::clamp<double>(up[i], -7.0, 7.0);
    EXPECT_NEAR(out[i], g / (1.0 + std::exp(-1.702 * g)) * (u + 1.0), 2e-6 * std::max(1.0, std::fabs(g * (u + 1.0))))
        << i;
  }
  EXPECT_EQ(out[11], 0.f);  // up = -1: the +1 cancels it
  EXPECT_NEAR(out[8], 7.0 / (1.0 + std::exp(-1.702 * 7.0)) * -6.0, 1e-5);  // both clamps
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(GatedProduct(GateActivation::kClampedSwiglu, nan, 1.f)));
  EXPECT_TRUE(std::isnan(GatedProduct(GateActivation::kClampedSwiglu, 1.f, nan)));
}

TEST_F(CpuBackendTest, PagedKvWriteThenAttentionMatchesContiguousReference) {
  // The cache starts with garbage; KvWrite fills each sequence's positions through its shuffled
  // table (a prefill across block boundaries and a decode at a block's first row), then attention
  // reads them back.
  PagedFixture f({7, 4}, 11);
  const int64_t row = f.row(), q_heads = 2;
  std::fill(f.k_cache.begin(), f.k_cache.end(), 1e3f);
  std::fill(f.v_cache.begin(), f.v_cache.end(), -1e3f);
  const std::vector<AttnSeq> seqs = {
      {.q_begin = 0, .q_len = 7, .pos_begin = 0, .table_begin = f.begin(0), .table_len = f.len(0)},
      {.q_begin = 7, .q_len = 4, .pos_begin = 0, .table_begin = f.begin(1), .table_len = f.len(1)}};
  std::vector<float> k, v;
  for (size_t s = 0; s < 2; ++s) {
    k.insert(k.end(), f.k_seq[s].begin(), f.k_seq[s].end());
    v.insert(v.end(), f.v_seq[s].begin(), f.v_seq[s].end());
  }
  const int64_t tokens = 11;
  ASSERT_TRUE(b_->KvWrite({.k = k.data(), .v = v.data(), .paged = f.paged(seqs), .tokens = tokens, .cache = f.view()})
                  .ok());
  for (size_t s = 0; s < 2; ++s) {
    for (int64_t j = 0; j < static_cast<int64_t>(f.k_seq[s].size()) / row; ++j) {
      const int64_t at = (f.tables[s][static_cast<size_t>(j / f.block_size)] * f.block_size + j % f.block_size) * row;
      for (int64_t e = 0; e < row; ++e) {
        ASSERT_EQ(f.k_cache[static_cast<size_t>(at + e)], f.k_seq[s][static_cast<size_t>(j * row + e)]);
        ASSERT_EQ(f.v_cache[static_cast<size_t>(at + e)], f.v_seq[s][static_cast<size_t>(j * row + e)]);
      }
    }
  }
  const auto q = Random(static_cast<size_t>(tokens * q_heads * f.d), 12);
  std::vector<float> out(q.size());
  ASSERT_TRUE(b_->Attention({.q = q.data(), .out = out.data(), .paged = f.paged(seqs), .tokens = tokens,
                             .q_heads = q_heads, .cache = f.view(), .scale = 0.2f})
                  .ok());
  ExpectClose(ReferenceAttention(f, seqs, q, q_heads, 0.2f, 0), out, 1e-5f, "after KvWrite");
}

// An FP8 KV cache: KvWrite stores each value as common/tensor's FloatToE4M3 code (written
// independently of the kernels' encoder) and touches no other byte; Attention over those codes
// equals the f32 reference over the e4m3-rounded keys and values, with GQA, a sliding window, a
// later step that mixes a decode with a chunk, and a fused RoPE write; and the rounding is real (the f32 reference over the exact values differs).
TEST_F(CpuBackendTest, Fp8KvWriteThenAttentionIsAttentionOverTheRoundedValues) {
  PagedFixture f({9, 5}, 23);
  const int64_t row = f.row(), q_heads = 4;
  // Values up to ~3 sigma of 2 (codes up to 8), and a few beyond 448 that must saturate.
  for (auto* seq : {&f.k_seq, &f.v_seq}) {
    for (auto& values : *seq) {
      for (float& x : values) x *= 2.0f;
    }
  }
  f.k_seq[0][3] = 1000.0f;
  f.v_seq[1][5] = -600.0f;
  std::vector<float> k, v;
  for (size_t s = 0; s < 2; ++s) {
    k.insert(k.end(), f.k_seq[s].begin(), f.k_seq[s].end());
    v.insert(v.end(), f.v_seq[s].begin(), f.v_seq[s].end());
  }
  const std::vector<AttnSeq> seqs = {
      {.q_begin = 0, .q_len = 9, .pos_begin = 0, .table_begin = f.begin(0), .table_len = f.len(0)},
      {.q_begin = 9, .q_len = 5, .pos_begin = 0, .table_begin = f.begin(1), .table_len = f.len(1)}};
  const int64_t tokens = 14;
  const size_t cache_bytes = static_cast<size_t>(f.num_blocks * f.block_size * row);
  std::vector<uint8_t> k_codes(cache_bytes, 0xab), v_codes(cache_bytes, 0xab);
  const KvLayerView fp8{.k = k_codes.data(), .v = v_codes.data(), .num_blocks = f.num_blocks,
                        .block_size = f.block_size, .kv_heads = f.kv_heads, .head_dim = f.d,
                        .dtype = DType::kF8E4M3};
  ASSERT_TRUE(b_->KvWrite({.k = k.data(), .v = v.data(), .paged = f.paged(seqs), .tokens = tokens, .cache = fp8}).ok());
  std::vector<bool> written(cache_bytes, false);
  for (size_t s = 0; s < 2; ++s) {
    for (int64_t j = 0; j < static_cast<int64_t>(f.k_seq[s].size()) / row; ++j) {
      const int64_t at = (f.tables[s][static_cast<size_t>(j / f.block_size)] * f.block_size + j % f.block_size) * row;
      for (int64_t e = 0; e < row; ++e) {
        const size_t i = static_cast<size_t>(at + e), src = static_cast<size_t>(j * row + e);
        ASSERT_EQ(k_codes[i], FloatToE4M3(f.k_seq[s][src])) << "k of sequence " << s << " position " << j;
        ASSERT_EQ(v_codes[i], FloatToE4M3(f.v_seq[s][src])) << "v of sequence " << s << " position " << j;
        written[i] = true;
      }
    }
  }
  for (size_t i = 0; i < cache_bytes; ++i) {
    if (!written[i]) {
      ASSERT_TRUE(k_codes[i] == 0xab && v_codes[i] == 0xab) << "byte " << i << " of no position";
    }
  }
  // k_seq[0][3] (1000: position 0, element 3) saturated.
  EXPECT_EQ(E4M3ToFloat(k_codes[static_cast<size_t>(f.tables[0][0] * f.block_size * row + 3)]), 448.0f);

  // The reference reads the rounded values (as f32); the same fixture with them in place.
  PagedFixture rounded = f;
  PagedFixture exact = f;
  for (auto* seq : {&rounded.k_seq, &rounded.v_seq}) {
    for (auto& values : *seq) {
      for (float& x : values) x = E4M3ToFloat(FloatToE4M3(x));
    }
  }
  const auto q = Random(static_cast<size_t>(tokens * q_heads * f.d), 24);
  for (int64_t window : {int64_t{0}, int64_t{4}}) {
    std::vector<float> out(q.size());
    ASSERT_TRUE(b_->Attention({.q = q.data(), .out = out.data(), .paged = f.paged(seqs), .tokens = tokens,
                               .q_heads = q_heads, .cache = fp8, .scale = 0.3f, .sliding_window = window})
                    .ok());
    ExpectClose(ReferenceAttention(rounded, seqs, q, q_heads, 0.3f, window), out, 1e-5f,
                absl::StrCat("fp8 cache, window ", window));
    const std::vector<float> unrounded = ReferenceAttention(exact, seqs, q, q_heads, 0.3f, window);
    float worst = 0.0f;
    for (size_t i = 0; i < out.size(); ++i) worst = std::max(worst, std::abs(out[i] - unrounded[i]));
    EXPECT_GT(worst, 1e-3f) << "the cache must hold rounded values, window " << window;
  }
  // A later step over the same cache: sequence 0 decodes at its last position (one query: its rows
  // are decoded block by block) beside sequence 1's chunk of two queries at positions 3 and 4 (a
  // prefill: its rows decoded once for both).
  const std::vector<AttnSeq> later = {
      {.q_begin = 0, .q_len = 1, .pos_begin = 8, .table_begin = f.begin(0), .table_len = f.len(0)},
      {.q_begin = 1, .q_len = 2, .pos_begin = 3, .table_begin = f.begin(1), .table_len = f.len(1)}};
  const auto q_later = Random(static_cast<size_t>(3 * q_heads * f.d), 25);
  for (int64_t window : {int64_t{0}, int64_t{4}}) {
    std::vector<float> out(q_later.size());
    ASSERT_TRUE(b_->Attention({.q = q_later.data(), .out = out.data(), .paged = f.paged(later), .tokens = 3,
                               .q_heads = q_heads, .cache = fp8, .scale = 0.3f, .sliding_window = window})
                    .ok());
    ExpectClose(ReferenceAttention(rounded, later, q_later, q_heads, 0.3f, window), out, 1e-5f,
                absl::StrCat("fp8 cache, later step, window ", window));
  }

  // RoPE fused with the write stores the codes of the rotated keys: those of Rope, then KvWrite.
  std::vector<uint8_t> k_fused(cache_bytes, 0xab), v_fused(cache_bytes, 0xab);
  KvLayerView fused_view = fp8;
  fused_view.k = k_fused.data();
  fused_view.v = v_fused.data();
  std::vector<int32_t> positions;
  for (const AttnSeq& sq : seqs) {
    for (int64_t i = 0; i < sq.q_len; ++i) positions.push_back(static_cast<int32_t>(sq.pos_begin + i));
  }
  std::vector<float> q_rope = q, k_rope = k;
  std::vector<float> inv_freq(static_cast<size_t>(f.d / 2));
  for (size_t i = 0; i < inv_freq.size(); ++i) inv_freq[i] = std::pow(10000.0f, -2.0f * static_cast<float>(i) / f.d);
  const RopeParams rope{.q = q_rope.data(), .k = k_rope.data(), .positions = positions.data(),
                        .inv_freq = inv_freq.data(), .tokens = tokens, .q_heads = q_heads, .kv_heads = f.kv_heads,
                        .head_dim = f.d};
  ASSERT_TRUE(b_->KvWrite({.k = k_rope.data(), .v = v.data(), .paged = f.paged(seqs), .tokens = tokens,
                           .cache = fused_view, .rope = rope})
                  .ok());
  std::vector<float> q_sep = q, k_sep = k;
  RopeParams separate = rope;
  separate.q = q_sep.data();
  separate.k = k_sep.data();
  ASSERT_TRUE(b_->Rope(separate).ok());
  std::vector<uint8_t> k_ref(cache_bytes, 0xab), v_ref(cache_bytes, 0xab);
  KvLayerView ref_view = fp8;
  ref_view.k = k_ref.data();
  ref_view.v = v_ref.data();
  ASSERT_TRUE(b_->KvWrite({.k = k_sep.data(), .v = v.data(), .paged = f.paged(seqs), .tokens = tokens,
                           .cache = ref_view})
                  .ok());
  EXPECT_EQ(k_fused, k_ref);
  EXPECT_EQ(v_fused, v_ref);
  EXPECT_NE(k_fused, k_codes);  // the rotation changed the keys
}

// The attention softmax's exponential: within 2 units in the last place of e^x over softmax's
// inputs (x <= 0: 200,001 points from 0 to -87, and -2^p from p = -40 to 5), exactly 1 at 0, 0 far
// below, NaN for NaN; and the softmax within float rounding of a double-precision one at lengths
// around its 8-wide steps.
TEST(CpuSoftmaxTest, ExpAndSoftmaxMatchDoublePrecision) {
  double worst_ulps = 0.0;
  float worst_x = 0.0f;
  std::vector<float> xs;
  for (int k = 0; k <= 200000; ++k) xs.push_back(-87.0f * static_cast<float>(k) / 200000.0f);
  for (int p2 = -40; p2 <= 5; ++p2) {
    for (float f : {1.0f, 1.37f, 1.99f}) xs.push_back(-std::ldexp(f, p2));
  }
  for (float x : xs) {
    const float want = std::exp(x);
    const double ulp = static_cast<double>(want - std::nextafter(want, 0.0f));  // the spacing below want
    const double ulps = std::abs(static_cast<double>(cpu::ExpNonPositive(x)) - std::exp(static_cast<double>(x))) / ulp;
    if (ulps > worst_ulps) {
      worst_ulps = ulps;
      worst_x = x;
    }
  }
  EXPECT_LE(worst_ulps, 2.0) << "at x = " << worst_x;
  EXPECT_EQ(cpu::ExpNonPositive(0.0f), 1.0f);
  EXPECT_EQ(cpu::ExpNonPositive(-100.0f), 0.0f);
  EXPECT_EQ(cpu::ExpNonPositive(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_TRUE(std::isnan(cpu::ExpNonPositive(std::numeric_limits<float>::quiet_NaN())));

  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{8}, int64_t{9}, int64_t{17}, int64_t{253}}) {
    std::vector<float> x = Random(static_cast<size_t>(n), 40 + static_cast<uint32_t>(n));
    for (float& v : x) v *= 6.0f;
    x[static_cast<size_t>(n / 2)] = -200.0f;  // a weight of (nearly) nothing
    const std::vector<double> in(x.begin(), x.end());
    double m = in.at(0);
    for (double v : in) m = std::max(m, v);
    double sum = 0.0;
    for (double v : in) sum += std::exp(v - m);
    cpu::SoftmaxInPlace(x.data(), n);
    double got_sum = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      const size_t u = static_cast<size_t>(j);
      // Relative error: float's x - max (relative 2^-24 of |x - max| in the exponent), 2 units in
      // the last place from e^x, and a few from the sum and the division.
      const double want = std::exp(in[u] - m) / sum;
      // Below e^-87 (under float's smallest normal), 0.
      EXPECT_NEAR(x[u], want, 6e-8 * (8.0 + std::abs(in[u] - m)) * want + 1e-37) << "n " << n << " element " << j;
      got_sum += x[u];
    }
    EXPECT_NEAR(got_sum, 1.0, 1e-6) << "n " << n;
  }
}

// A prefill or chunk (several queries of a sequence in one call) scores its keys in tiles across
// keys; a decode step (one query) scores them one dot product at a time. The two must give the
// same bits, or a sequence's tokens would depend on how its prompt was chunked: every query of a
// prefill equals the same query run alone, for head sizes below, at and past the 16-wide partial
// sums (with a tail), 6 and 8 query heads (weighted sums 1 or 4 heads at a time, 8 elements at a
// time and one by one), with GQA, sliding and chunked windows, soft-capping, and an FP8 cache.
TEST_F(CpuBackendTest, APrefillIsBitIdenticalToItsQueriesRunOneAtATime) {
  for (const auto& [d, q_heads] :
       {std::pair<int64_t, int64_t>{8, 8}, {16, 6}, {20, 8}, {40, 6}, {64, 8}, {72, 6}, {128, 8}}) {
    PagedFixture f({37, 21}, 31, d, 2);
    std::vector<uint8_t> k_codes(f.k_cache.size()), v_codes(f.v_cache.size());
    for (size_t i = 0; i < k_codes.size(); ++i) {
      k_codes[i] = FloatToE4M3(2.0f * f.k_cache[i]);
      v_codes[i] = FloatToE4M3(2.0f * f.v_cache[i]);
    }
    KvLayerView fp8 = f.view();
    fp8.k = k_codes.data();
    fp8.v = v_codes.data();
    fp8.dtype = DType::kF8E4M3;
    // Sequence 0's whole prompt; sequence 1's chunk of 13 queries after 8 cached positions.
    const std::vector<AttnSeq> seqs = {
        {.q_begin = 0, .q_len = 37, .pos_begin = 0, .table_begin = f.begin(0), .table_len = f.len(0)},
        {.q_begin = 37, .q_len = 13, .pos_begin = 8, .table_begin = f.begin(1), .table_len = f.len(1)}};
    const int64_t tokens = 50;
    const auto q = Random(static_cast<size_t>(tokens * q_heads * d), 32);
    const auto sinks = Random(static_cast<size_t>(q_heads), 33);
    struct Case {
      int64_t window, chunk;
      float softcap;
      bool fp8;
      bool sinks = false;
    };
    for (const Case& c : {Case{0, 0, 0.f, false}, Case{5, 0, 0.f, false}, Case{0, 16, 0.f, false},
                          Case{0, 0, 2.f, false}, Case{0, 0, 0.f, true}, Case{7, 0, 0.f, true},
                          Case{5, 0, 0.f, false, true}}) {
      const std::string what = absl::StrCat("head_dim ", d, ", ", q_heads, " heads, window ", c.window, ", chunk ", c.chunk,
                                            ", softcap ", c.softcap, c.fp8 ? ", fp8 cache" : ", f32 cache",
                                            c.sinks ? ", sinks" : "");
      const KvLayerView cache = c.fp8 ? fp8 : f.view();
      AttentionParams prefill{.q = q.data(), .paged = f.paged(seqs), .tokens = tokens, .q_heads = q_heads,
                              .cache = cache, .scale = 0.25f, .sliding_window = c.window,
                              .chunk_size = c.chunk, .softcap = c.softcap,
                              .sinks = c.sinks ? sinks.data() : nullptr};
      std::vector<float> together(q.size());
      prefill.out = together.data();
      ASSERT_TRUE(b_->Attention(prefill).ok()) << what;
      for (const AttnSeq& sq : seqs) {
        for (int64_t i = 0; i < sq.q_len; ++i) {
          const int64_t t = sq.q_begin + i;
          const std::vector<AttnSeq> one = {{.q_begin = 0, .q_len = 1, .pos_begin = static_cast<int32_t>(sq.pos_begin + i),
                                             .table_begin = sq.table_begin, .table_len = sq.table_len}};
          std::vector<float> alone(static_cast<size_t>(q_heads * d));
          AttentionParams step = prefill;
          step.q = q.data() + t * q_heads * d;
          step.out = alone.data();
          step.paged = f.paged(one);
          step.tokens = 1;
          ASSERT_TRUE(b_->Attention(step).ok()) << what;
          for (int64_t e = 0; e < q_heads * d; ++e) {
            ASSERT_EQ(std::bit_cast<uint32_t>(alone[static_cast<size_t>(e)]),
                      std::bit_cast<uint32_t>(together[static_cast<size_t>(t * q_heads * d + e)]))
                << what << ": token " << t << " element " << e << " (" << alone[static_cast<size_t>(e)] << " vs "
                << together[static_cast<size_t>(t * q_heads * d + e)] << ")";
          }
        }
      }
      // And the prefill is attention: within float rounding of the double-precision reference.
      if (!c.fp8) {
        ExpectClose(ReferenceAttention(f, seqs, q, q_heads, 0.25f, c.window, c.softcap, c.chunk, prefill.sinks),
                    together, 1e-5f, what);
      }
    }
  }
}

TEST_F(CpuBackendTest, PagedAttentionWithOneBlockPerSequenceEqualsSlotLayout) {
  // block_size = the context length: each sequence's table has one block, which is exactly the
  // old [slots, max_len] layout; outputs must not change by a single bit when the blocks are split.
  PagedFixture big({12, 12}, 21);
  const int64_t q_heads = 4;
  const std::vector<AttnSeq> seqs = {{.q_begin = 0, .q_len = 12, .pos_begin = 0, .table_begin = 0, .table_len = 4},
                                     {.q_begin = 12, .q_len = 1, .pos_begin = 11, .table_begin = 4, .table_len = 4}};
  const auto q = Random(static_cast<size_t>(13 * q_heads * big.d), 22);
  std::vector<float> paged_out(q.size());
  ASSERT_TRUE(b_->Attention({.q = q.data(), .out = paged_out.data(), .paged = big.paged(seqs), .tokens = 13,
                             .q_heads = q_heads, .cache = big.view(), .scale = 0.3f})
                  .ok());
  // The same data as [2 slots, 12 positions].
  std::vector<float> kc, vc;
  for (size_t s = 0; s < 2; ++s) {
    kc.insert(kc.end(), big.k_seq[s].begin(), big.k_seq[s].end());
    vc.insert(vc.end(), big.v_seq[s].begin(), big.v_seq[s].end());
  }
  const std::vector<int32_t> slots = {0, 1};
  const std::vector<AttnSeq> slot_seqs = {{.q_begin = 0, .q_len = 12, .pos_begin = 0, .table_begin = 0, .table_len = 1},
                                          {.q_begin = 12, .q_len = 1, .pos_begin = 11, .table_begin = 1, .table_len = 1}};
  std::vector<float> slot_out(q.size());
  ASSERT_TRUE(b_->Attention({.q = q.data(), .out = slot_out.data(),
                             .paged = {.seqs = slot_seqs.data(), .host_seqs = slot_seqs.data(), .num_seqs = 2,
                                       .block_table = slots.data(), .host_block_table = slots.data(),
                                       .table_entries = 2},
                             .tokens = 13, .q_heads = q_heads,
                             .cache = {kc.data(), vc.data(), 2, 12, big.kv_heads, big.d}, .scale = 0.3f})
                  .ok());
  EXPECT_EQ(paged_out, slot_out);
}

TEST_F(CpuBackendTest, RopeUsesFloatAnglesOfPositionTimesInvFreq) {
  std::vector<float> q = {1, 0, 0, 0}, k = {0, 1, 0, 0};
  const std::vector<int32_t> pos = {3};
  const std::vector<float> inv = {0.5f, 0.25f};
  ASSERT_TRUE(b_->Rope({.q = q.data(), .k = k.data(), .positions = pos.data(), .inv_freq = inv.data(), .tokens = 1,
                        .q_heads = 1, .kv_heads = 1, .head_dim = 4})
                  .ok());
  EXPECT_NEAR(q[0], std::cos(1.5f), 1e-6);
  EXPECT_NEAR(q[2], std::sin(1.5f), 1e-6);
  EXPECT_NEAR(k[1], std::cos(0.75f), 1e-6);
  EXPECT_NEAR(k[3], std::sin(0.75f), 1e-6);
}

TEST_F(CpuBackendTest, PartialRopeRotatesTheFirstRotaryDimsScaled) {
  // head_dim 6, rotary_dim 4: pairs (0, 2) and (1, 3) rotate with cos and sin times 1.5; elements
  // 4 and 5 pass through.
  std::vector<float> q = {1, 0, 0, 0, 7, 8}, k = {0, 1, 0, 0, -7, -8};
  const std::vector<int32_t> pos = {3};
  const std::vector<float> inv = {0.5f, 0.25f};
  ASSERT_TRUE(b_->Rope({.q = q.data(), .k = k.data(), .positions = pos.data(), .inv_freq = inv.data(), .tokens = 1,
                        .q_heads = 1, .kv_heads = 1, .head_dim = 6, .rotary_dim = 4, .scale = 1.5f})
                  .ok());
  EXPECT_NEAR(q[0], 1.5f * std::cos(1.5f), 1e-6);
  EXPECT_NEAR(q[2], 1.5f * std::sin(1.5f), 1e-6);
  EXPECT_NEAR(k[1], 1.5f * std::cos(0.75f), 1e-6);
  EXPECT_NEAR(k[3], 1.5f * std::sin(0.75f), 1e-6);
  EXPECT_EQ(q[4], 7.f);
  EXPECT_EQ(q[5], 8.f);
  EXPECT_EQ(k[4], -7.f);
  EXPECT_EQ(k[5], -8.f);
  for (int64_t bad : {int64_t{3}, int64_t{8}, int64_t{-2}}) {
    EXPECT_THAT(b_->Rope({.q = q.data(), .k = k.data(), .positions = pos.data(), .inv_freq = inv.data(),
                          .tokens = 1, .q_heads = 1, .kv_heads = 1, .head_dim = 6, .rotary_dim = bad}),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rotary_dim"))) << bad;
  }
}

TEST_F(CpuBackendTest, GatherScatterAndSigmoidScale) {
  const std::vector<float> src = {1, 2, 3, 4, 5, 6};  // 3 rows x 2
  const std::vector<int32_t> rows = {2, 0};
  std::vector<float> g(4);
  ASSERT_TRUE(b_->GatherRows({.src = src.data(), .rows = rows.data(), .dst = g.data(), .count = 2, .src_rows = 3,
                              .width = 2})
                  .ok());
  EXPECT_EQ(g, (std::vector<float>{5, 6, 1, 2}));
  std::vector<float> dst(6, 1.f);
  const std::vector<float> scales = {2.f, 0.5f};
  ASSERT_TRUE(b_->ScatterAddRows({.src = g.data(), .rows = rows.data(), .scales = scales.data(), .dst = dst.data(),
                                  .count = 2, .dst_rows = 3, .width = 2})
                  .ok());
  EXPECT_EQ(dst, (std::vector<float>{1.5f, 2.f, 1.f, 1.f, 11.f, 13.f}));
  std::vector<float> x = {2, 4};
  const std::vector<float> gate = {0.f};
  ASSERT_TRUE(b_->SigmoidScaleRows({.x = x.data(), .gate = gate.data(), .tokens = 1, .width = 2}).ok());
  EXPECT_EQ(x, (std::vector<float>{1, 2}));
  std::vector<float> rows3 = {1, 2, 3, 4, 5, 6};
  const std::vector<float> row_scales = {2.f, 0.f, -0.5f};
  ASSERT_TRUE(b_->ScaleRows({.x = rows3.data(), .scales = row_scales.data(), .tokens = 3, .width = 2}).ok());
  EXPECT_EQ(rows3, (std::vector<float>{2, 4, 0, 0, -2.5f, -3}));
  EXPECT_THAT(b_->ScaleRows({.x = rows3.data(), .tokens = 1, .width = 2}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ScaleRows: null pointer")));
}

TEST_F(CpuBackendTest, OpsRejectInvalidParamsWithoutTouchingMemory) {
  EXPECT_THAT(b_->Linear({}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("Linear: null pointer")));
  float buf[4] = {};
  EXPECT_THAT(b_->Linear({.x = buf, .w = buf, .y = buf, .tokens = 1, .in = 1, .out = 1}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("aliases")));
  EXPECT_THAT(b_->Rope({.q = buf, .k = buf, .positions = reinterpret_cast<int32_t*>(buf), .inv_freq = buf,
                        .head_dim = 3}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("head_dim must be even")));
  // Positions [4, 5) need block 2 of blocks of 2 tokens; the table has two entries.
  const AttnSeq bad = {.q_begin = 0, .q_len = 1, .pos_begin = 4, .table_begin = 0, .table_len = 2};
  const int32_t table[2] = {0, 1};
  const PagedSeqs paged{.seqs = &bad, .host_seqs = &bad, .num_seqs = 1, .block_table = table,
                        .host_block_table = table, .table_entries = 2};
  EXPECT_THAT(b_->KvWrite({.k = buf, .v = buf, .paged = paged, .tokens = 1, .cache = {buf, buf, 2, 2, 1, 1}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("too few for positions up to 5")));
  const AttnSeq ok_len = {.q_begin = 0, .q_len = 1, .pos_begin = 3, .table_begin = 0, .table_len = 2};
  const int32_t out_of_range[2] = {0, 7};
  EXPECT_THAT(b_->Attention({.q = buf, .out = buf,
                             .paged = {.seqs = &ok_len, .host_seqs = &ok_len, .num_seqs = 1,
                                       .block_table = out_of_range, .host_block_table = out_of_range,
                                       .table_entries = 2},
                             .tokens = 1, .q_heads = 1, .cache = {buf, buf, 2, 2, 1, 1}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("block 1 has id 7, outside [0, 2)")));
  const AttnSeq past_table = {.q_begin = 0, .q_len = 1, .pos_begin = 0, .table_begin = 1, .table_len = 2};
  EXPECT_THAT(b_->KvWrite({.k = buf, .v = buf,
                           .paged = {.seqs = &past_table, .host_seqs = &past_table, .num_seqs = 1,
                                     .block_table = table, .host_block_table = table, .table_entries = 2},
                           .tokens = 1, .cache = {buf, buf, 2, 2, 1, 1}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("block table entries out of range")));
}

}  // namespace
}  // namespace shardserve::kernels

namespace shardserve::kernels {
namespace {

// LinearGroup (the default every backend inherits, and the CPU backend's) is bit for bit a Linear
// per part: f32 and bf16 parts, biases, accumulation, a part with no rows.
TEST(LinearGroupTest, EqualsALinearPerPart) {
  auto backend = CreateBackend({});
  ASSERT_TRUE(backend.ok());
  Backend& b = **backend;
  const int64_t tokens = 5, in = 96;
  const std::vector<float> x = Random(static_cast<size_t>(tokens * in), 1);
  const std::vector<float> wq = Random(static_cast<size_t>(64 * in), 2);
  const std::vector<uint16_t> wk = ToBf16(Random(static_cast<size_t>(16 * in), 3));
  const std::vector<float> bias = Random(16, 4);
  const std::vector<float> start = Random(static_cast<size_t>(tokens * 16), 5);
  std::vector<float> q(static_cast<size_t>(tokens * 64), -1.f), k = start, empty(1, 7.f);
  std::vector<float> q_ref = q, k_ref = start;
  LinearGroupParams g{.x = x.data(), .tokens = tokens, .in = in, .num_parts = 3};
  g.parts[0] = {.w = {DType::kF32, wq.data()}, .y = q.data(), .out = 64};
  g.parts[1] = {.w = {DType::kBF16, wk.data()}, .bias = bias.data(), .y = k.data(), .out = 16, .accumulate = true};
  g.parts[2] = {.w = {DType::kF32, wq.data()}, .y = empty.data(), .out = 0};
  ASSERT_TRUE(b.LinearGroup(g).ok());
  ASSERT_TRUE(b.Linear({.x = x.data(), .w = {DType::kF32, wq.data()}, .y = q_ref.data(), .tokens = tokens, .in = in,
                        .out = 64})
                  .ok());
  ASSERT_TRUE(b.Linear({.x = x.data(), .w = {DType::kBF16, wk.data()}, .bias = bias.data(), .y = k_ref.data(),
                        .tokens = tokens, .in = in, .out = 16, .accumulate = true})
                  .ok());
  EXPECT_EQ(q, q_ref);
  EXPECT_EQ(k, k_ref);
  EXPECT_EQ(empty[0], 7.f);
}

TEST(LinearGroupTest, RejectsBadGroupsNamingThePart) {
  auto backend = CreateBackend({});
  ASSERT_TRUE(backend.ok());
  std::vector<float> x(8), w(8), y(4), z(4);
  LinearGroupParams g{.x = x.data(), .tokens = 2, .in = 4, .num_parts = 0};
  EXPECT_THAT((*backend)->LinearGroup(g), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("0 parts")));
  g.num_parts = 5;
  EXPECT_THAT((*backend)->LinearGroup(g), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("1 to 4")));
  g.num_parts = 2;
  g.parts[0] = {.w = {DType::kF32, w.data()}, .y = y.data(), .out = 2};
  g.parts[1] = {.w = {DType::kF32, nullptr}, .y = z.data(), .out = 2};
  EXPECT_THAT((*backend)->LinearGroup(g), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("part 1")));
  g.parts[1] = {.w = {DType::kF32, w.data()}, .y = y.data(), .out = 2};
  EXPECT_THAT((*backend)->LinearGroup(g),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("parts 0 and 1 write the same y")));
}

}  // namespace
}  // namespace shardserve::kernels

namespace shardserve::kernels {
namespace {

// ---- Multi-head latent attention ops -------------------------------------------------------------

TEST_F(CpuBackendTest, HeadLinearMultipliesEachHeadByItsMatrixAtOffsets) {
  const int64_t tokens = 5, heads = 3, in = 4, out = 6, xw = 7, xo = 2, yw = 9, yo = 1;
  const auto x = Random(static_cast<size_t>(tokens * heads * xw), 31);
  const auto w = Random(static_cast<size_t>(heads * out * in), 32);
  std::vector<float> y = Random(static_cast<size_t>(tokens * heads * yw), 33);
  const std::vector<float> before = y;
  ASSERT_TRUE(b_->SupportsOp(Op::kHeadLinear, DType::kF32));
  ASSERT_TRUE(b_->HeadLinear({.x = x.data(), .w = w.data(), .y = y.data(), .tokens = tokens, .heads = heads,
                              .in = in, .out = out, .x_width = xw, .x_offset = xo, .y_width = yw, .y_offset = yo,
                              .accumulate = true})
                  .ok());
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t c = 0; c < yw; ++c) {
        const size_t at = static_cast<size_t>((t * heads + h) * yw + c);
        if (c < yo || c >= yo + out) {
          EXPECT_EQ(y[at], before[at]) << "column " << c << " outside the output is untouched";
          continue;
        }
        double ref = before[at];
        for (int64_t i = 0; i < in; ++i) {
          ref += double{x[static_cast<size_t>((t * heads + h) * xw + xo + i)]} *
                 w[static_cast<size_t>((h * out + (c - yo)) * in + i)];
        }
        EXPECT_NEAR(y[at], ref, 1e-5) << t << " " << h << " " << c;
      }
    }
  }
  // bf16 weights: the f32 result of the widened weights.
  const auto w16 = ToBf16(w);
  const auto wide = Widen(w16);
  std::vector<float> y32(y.size()), y16(y.size());
  HeadLinearParams p{.x = x.data(), .w = wide.data(), .y = y32.data(), .tokens = tokens, .heads = heads, .in = in,
                     .out = out, .x_width = xw, .x_offset = xo, .y_width = yw, .y_offset = yo};
  ASSERT_TRUE(b_->HeadLinear(p).ok());
  p.w = WeightView::Bf16(w16.data());
  p.y = y16.data();
  ASSERT_TRUE(b_->HeadLinear(p).ok());
  EXPECT_EQ(y16, y32);
  // Columns past the row and aliasing are refused.
  p.x_offset = 4;
  EXPECT_THAT(b_->HeadLinear(p), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("out of range")));
  p.x_offset = xo;
  p.y = const_cast<float*>(x.data());
  EXPECT_THAT(b_->HeadLinear(p), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("aliases")));
}

TEST_F(CpuBackendTest, MlaKvWriteThenAttentionMatchesContiguousReference) {
  // Two sequences (a 5-token prefill and a 3-token chunk after 4 cached positions) over shuffled
  // blocks of 3 rows; every head reads the one latent + RoPE-key row per position.
  const int64_t lat = 6, rope = 4, heads = 3, bs = 3, blocks = 8;
  std::vector<float> cache(static_cast<size_t>(blocks * bs * (lat + rope)), 1e3f);
  const MlaCacheView view{.data = cache.data(), .num_blocks = blocks, .block_size = bs, .latent_dim = lat,
                          .rope_dim = rope};
  const std::vector<int32_t> table = {5, 2, 7, 0, 3};  // seq 0: blocks 5, 2; seq 1: 7, 0, 3
  const std::vector<AttnSeq> seqs = {{.q_begin = 0, .q_len = 5, .pos_begin = 0, .table_begin = 0, .table_len = 2},
                                     {.q_begin = 5, .q_len = 3, .pos_begin = 4, .table_begin = 2, .table_len = 3}};
  const PagedSeqs paged{.seqs = seqs.data(), .host_seqs = seqs.data(), .num_seqs = 2, .block_table = table.data(),
                        .host_block_table = table.data(), .table_entries = 5};
  // Sequence 1's first 4 positions, written by an earlier step.
  const auto early_lat = Random(4 * lat, 41), early_rope = Random(4 * rope, 42);
  const std::vector<AttnSeq> early = {{.q_begin = 0, .q_len = 4, .pos_begin = 0, .table_begin = 2, .table_len = 2}};
  ASSERT_TRUE(b_->MlaKvWrite({.latent = early_lat.data(), .rope = early_rope.data(),
                              .paged = {.seqs = early.data(), .host_seqs = early.data(), .num_seqs = 1,
                                        .block_table = table.data(), .host_block_table = table.data(),
                                        .table_entries = 5},
                              .tokens = 4, .cache = view})
                  .ok());
  const int64_t tokens = 8;
  const auto latent = Random(tokens * lat, 43), rope_k = Random(tokens * rope, 44);
  ASSERT_TRUE(b_->MlaKvWrite({.latent = latent.data(), .rope = rope_k.data(), .paged = paged, .tokens = tokens,
                              .cache = view})
                  .ok());
  const auto q_lat = Random(static_cast<size_t>(tokens * heads * lat), 45);
  const auto q_rope = Random(static_cast<size_t>(tokens * heads * rope), 46);
  std::vector<float> out(static_cast<size_t>(tokens * heads * lat));
  const float scale = 0.3f, rope_scale = 1.7f;
  ASSERT_TRUE(b_->MlaAttention({.q_latent = q_lat.data(), .q_rope = q_rope.data(), .out = out.data(),
                                .paged = paged, .tokens = tokens, .q_heads = heads, .cache = view, .scale = scale,
                                .rope_scale = rope_scale})
                  .ok());
  // The reference: each sequence's rows in position order, no cache.
  auto row = [&](int s, int64_t pos, bool rope_part) -> const float* {
    if (s == 1 && pos < 4) {
      return rope_part ? &early_rope[static_cast<size_t>(pos * rope)] : &early_lat[static_cast<size_t>(pos * lat)];
    }
    const int64_t t = s == 0 ? pos : 5 + pos - 4;
    return rope_part ? &rope_k[static_cast<size_t>(t * rope)] : &latent[static_cast<size_t>(t * lat)];
  };
  std::vector<float> ref(out.size());
  for (int s = 0; s < 2; ++s) {
    for (int32_t i = 0; i < seqs[s].q_len; ++i) {
      const int64_t t = seqs[s].q_begin + i, pos = seqs[s].pos_begin + i;
      for (int64_t h = 0; h < heads; ++h) {
        std::array<double, 8> sc{};  // positions <= 7
        for (int64_t j = 0; j <= pos; ++j) {
          double d = 0, r = 0;
          const float* ql = &q_lat[static_cast<size_t>((t * heads + h) * lat)];
          const float* qr = &q_rope[static_cast<size_t>((t * heads + h) * rope)];
          for (int64_t e = 0; e < lat; ++e) d += double{ql[e]} * row(s, j, false)[e];
          for (int64_t e = 0; e < rope; ++e) r += double{qr[e]} * row(s, j, true)[e];
          sc[static_cast<size_t>(j)] = scale * (d + rope_scale * r);
        }
        double m = -1e300, sum = 0;
        for (int64_t j = 0; j <= pos; ++j) m = std::max(m, sc[static_cast<size_t>(j)]);
        for (int64_t j = 0; j <= pos; ++j) sum += (sc[static_cast<size_t>(j)] = std::exp(sc[static_cast<size_t>(j)] - m));
        for (int64_t e = 0; e < lat; ++e) {
          double acc = 0;
          for (int64_t j = 0; j <= pos; ++j) acc += sc[static_cast<size_t>(j)] / sum * row(s, j, false)[e];
          ref[static_cast<size_t>((t * heads + h) * lat + e)] = static_cast<float>(acc);
        }
      }
    }
  }
  ExpectClose(ref, out, 1e-5f, "MLA attention");
  // A block id outside the cache is refused before anything is read.
  const std::vector<int32_t> bad_table = {5, 9, 7, 0, 3};
  EXPECT_THAT(b_->MlaAttention({.q_latent = q_lat.data(), .q_rope = q_rope.data(), .out = out.data(),
                                .paged = {.seqs = seqs.data(), .host_seqs = seqs.data(), .num_seqs = 2,
                                          .block_table = bad_table.data(), .host_block_table = bad_table.data(),
                                          .table_entries = 5},
                                .tokens = tokens, .q_heads = heads, .cache = view}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outside [0, 8)")));
  EXPECT_FALSE(b_->SupportsOp(Op::kMlaAttention, DType::kBF16));
}

}  // namespace
}  // namespace shardserve::kernels

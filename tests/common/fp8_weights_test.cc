// FP8 weights read as f32: block and per-tensor scales applied to whole tensors and to row/column
// slices that start and end inside blocks, other dtypes passed through, and every validation
// error naming the tensor.
#include "common/fp8/fp8_weights.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "tests/testing/safetensors_file.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace shardserve {
namespace {

using ::shardserve::testing::StatusIs;
using ::shardserve::testing::StoredTensor;
using ::shardserve::testing::TempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;

std::string File(const std::vector<StoredTensor>& tensors) { return testing::SafetensorsFile(tensors); }
std::string Floats(const std::vector<float>& v) { return testing::F32Bytes(v); }

// e4m3fn codes with their values, worked out by hand (sign | exponent (bias 7) | 3 mantissa bits).
struct Code {
  uint8_t code;
  double value;
};
constexpr Code kCodes[] = {
    {0x00, 0.0},   {0x38, 1.0},       {0x40, 2.0},  {0x3C, 1.5},   {0x30, 0.5},         {0x7E, 448.0},
    {0xB8, -1.0},  {0xC4, -3.0},      {0x4B, 5.5},  {0x5A, 20.0},  {0x01, 0.001953125}, {0x08, 0.015625},
    {0xF0, -128.0}};
constexpr int kNumCodes = sizeof(kCodes) / sizeof(kCodes[0]);

// The test weight: 5 x 7, blocks of 2 rows x 3 columns, so 3 x 3 blocks whose last row and last
// column are short (5 = 2 + 2 + 1, 7 = 3 + 3 + 1).
constexpr int64_t kRows = 5, kCols = 7, kBlockRows = 2, kBlockCols = 3;
const Code& CodeAt(int64_t r, int64_t c) { return kCodes[(r * kCols + c) % kNumCodes]; }
// Block scales, none a power of two but some.
const std::vector<float> kScales = {0.0013f, 0.25f, 3.0f, 0.71f, 1e-3f, 2.5f, 0.0021f, 7.0f, 0.37f};

std::string WeightBytes() {
  std::string b;
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t c = 0; c < kCols; ++c) b.push_back(static_cast<char>(CodeAt(r, c).code));
  }
  return b;
}

// The dequantized element (r, c) as the reader must compute it: the f32 product of the value and
// its block's scale (the double product of two floats is exact, so one rounding, as in f32).
float Expected(int64_t r, int64_t c) {
  const float scale = kScales[static_cast<size_t>((r / kBlockRows) * 3 + c / kBlockCols)];
  return static_cast<float>(CodeAt(r, c).value * static_cast<double>(scale));
}

Fp8Quantization Blocks(int64_t rows = kBlockRows, int64_t cols = kBlockCols) {
  Fp8Quantization q;
  q.block_rows = rows;
  q.block_cols = cols;
  return q;
}

class Fp8WeightsTest : public ::testing::Test {
 protected:
  // Writes `tensors` as the checkpoint and opens it.
  void Open(const std::vector<StoredTensor>& tensors) {
    dir_.Write("model.safetensors", File(tensors));
    ASSERT_OK_AND_ASSIGN(ckpt_, Checkpoint::Open(dir_.path()));
  }
  // The standard block-quantized weight "w" with its scales, plus an F32 and a BF16 tensor.
  void OpenBlockCheckpoint() {
    const uint16_t bf16[2] = {0x3f80, 0xc000};  // 1, -2
    Open({{"w", "F8_E4M3", {kRows, kCols}, WeightBytes()},
          {"w_scale_inv", "F32", {3, 3}, Floats(kScales)},
          {"f", "F32", {2}, Floats({0.5f, -4.f})},
          {"b", "BF16", {2}, std::string(reinterpret_cast<const char*>(bf16), 4)}});
  }
  // Expects `t` to be rows [r0, r1) x cols [c0, c1) of the dequantized weight.
  static void ExpectSlice(const HostTensor& t, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
    ASSERT_EQ(t.shape(), (Shape{r1 - r0, c1 - c0}));
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = c0; c < c1; ++c) {
        EXPECT_EQ(t.data()[(r - r0) * (c1 - c0) + (c - c0)], Expected(r, c)) << "element [" << r << ", " << c << "]";
      }
    }
  }

  TempDir dir_;
  std::unique_ptr<Checkpoint> ckpt_;
};

TEST_F(Fp8WeightsTest, EveryElementGetsTheScaleOfItsBlock) {
  OpenBlockCheckpoint();
  ASSERT_OK_AND_ASSIGN(HostTensor t, ReadWeight(*ckpt_, Blocks(), "w", {kRows, kCols}));
  ExpectSlice(t, 0, kRows, 0, kCols);
  // Spot checks written out: [0, 5] is 0x7E (448) in block (0, 1), scale 0.25; [4, 6] is the
  // short corner block (2, 2), code index 34 % 13 = 8 (5.5), scale 0.37.
  EXPECT_EQ(t.data()[5], 112.f);
  EXPECT_EQ(t.data()[4 * kCols + 6], static_cast<float>(5.5 * static_cast<double>(0.37f)));
}

TEST_F(Fp8WeightsTest, EveryRowRangeIncludingOnesCuttingThroughBlocks) {
  OpenBlockCheckpoint();
  for (int64_t r0 = 0; r0 <= kRows; ++r0) {
    for (int64_t r1 = r0; r1 <= kRows; ++r1) {
      SCOPED_TRACE(::testing::Message() << "rows [" << r0 << ", " << r1 << ")");
      ASSERT_OK_AND_ASSIGN(HostTensor t, ReadWeightRows(*ckpt_, Blocks(), "w", {kRows, kCols}, r0, r1));
      ExpectSlice(t, r0, r1, 0, kCols);
    }
  }
}

TEST_F(Fp8WeightsTest, EveryColumnRangeIncludingOnesCuttingThroughBlocks) {
  OpenBlockCheckpoint();
  for (int64_t c0 = 0; c0 <= kCols; ++c0) {
    for (int64_t c1 = c0; c1 <= kCols; ++c1) {
      SCOPED_TRACE(::testing::Message() << "cols [" << c0 << ", " << c1 << ")");
      ASSERT_OK_AND_ASSIGN(HostTensor t, ReadWeightCols(*ckpt_, Blocks(), "w", {kRows, kCols}, c0, c1));
      ExpectSlice(t, 0, kRows, c0, c1);
    }
  }
}

TEST_F(Fp8WeightsTest, Bf16BlockScales) {
  // 0x3FA0 = 1.25, 0x4040 = 3.0, ...: scales exactly representable in bf16.
  const std::vector<uint16_t> bits = {0x3FA0, 0x4040, 0x3E80, 0x3F00, 0x4120, 0x3C00, 0x3D80, 0x4000, 0x3F40};
  Open({{"w", "F8_E4M3", {kRows, kCols}, WeightBytes()},
        {"w_scale_inv", "BF16", {3, 3}, std::string(reinterpret_cast<const char*>(bits.data()), 18)}});
  ASSERT_OK_AND_ASSIGN(HostTensor t, ReadWeight(*ckpt_, Blocks(), "w", {kRows, kCols}));
  // [1, 4]: code index 11 (0.015625) in block (0, 1), bf16 0x4040 = 3.
  EXPECT_EQ(t.data()[1 * kCols + 4], 0.046875f);
  // [4, 0]: code index 28 % 13 = 2 (2.0) in block (2, 0), bf16 0x3D80 = 0.0625.
  EXPECT_EQ(t.data()[4 * kCols + 0], 0.125f);
}

struct PerTensorCase {
  std::string name;
  std::string scale_name;  // "w_scale_inv" or "w_scale"
  std::string dtype;
  Shape shape;
  std::string bytes;
  float scale;
};

void PrintTo(const PerTensorCase& c, std::ostream* os) { *os << c.name; }

class PerTensorTest : public Fp8WeightsTest, public ::testing::WithParamInterface<PerTensorCase> {};

TEST_P(PerTensorTest, OneScaleForTheWholeTensorAndEverySlice) {
  const PerTensorCase& p = GetParam();
  Open({{"w", "F8_E4M3", {kRows, kCols}, WeightBytes()}, {p.scale_name, p.dtype, p.shape, p.bytes}});
  const Fp8Quantization per_tensor;  // no weight_block_size
  ASSERT_OK_AND_ASSIGN(HostTensor whole, ReadWeight(*ckpt_, per_tensor, "w", {kRows, kCols}));
  ASSERT_OK_AND_ASSIGN(HostTensor rows, ReadWeightRows(*ckpt_, per_tensor, "w", {kRows, kCols}, 1, 4));
  ASSERT_OK_AND_ASSIGN(HostTensor cols, ReadWeightCols(*ckpt_, per_tensor, "w", {kRows, kCols}, 2, 7));
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t c = 0; c < kCols; ++c) {
      const float want = static_cast<float>(CodeAt(r, c).value * static_cast<double>(p.scale));
      EXPECT_EQ(whole.data()[r * kCols + c], want);
      if (r >= 1 && r < 4) {
        EXPECT_EQ(rows.data()[(r - 1) * kCols + c], want);
      }
      if (c >= 2) {
        EXPECT_EQ(cols.data()[r * 5 + (c - 2)], want);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Spellings, PerTensorTest,
    ::testing::Values(PerTensorCase{"ScaleInvScalar", "w_scale_inv", "F32", {}, Floats({0.0042f}), 0.0042f},
                      PerTensorCase{"ScaleOneElement", "w_scale", "F32", {1}, Floats({0.37f}), 0.37f},
                      PerTensorCase{"ScaleInvOneByOne", "w_scale_inv", "F32", {1, 1}, Floats({3.5f}), 3.5f},
                      PerTensorCase{"Bf16Scale", "w_scale", "BF16", {}, std::string("\xa0\x3f", 2), 1.25f}),
    [](const auto& test_info) { return test_info.param.name; });

TEST_F(Fp8WeightsTest, OtherDtypesAreReadAsStoredWithOrWithoutAnFp8Config) {
  OpenBlockCheckpoint();
  for (const std::optional<Fp8Quantization>& q : {std::optional<Fp8Quantization>(Blocks()),
                                                  std::optional<Fp8Quantization>()}) {
    ASSERT_OK_AND_ASSIGN(HostTensor f, ReadWeight(*ckpt_, q, "f", {2}));
    EXPECT_EQ(f.data()[1], -4.f);
    ASSERT_OK_AND_ASSIGN(HostTensor b, ReadWeightRows(*ckpt_, q, "b", {2}, 1, 2));
    EXPECT_EQ(b.data()[0], -2.f);
  }
}

// Errors: each names the checkpoint and the weight.

TEST_F(Fp8WeightsTest, Fp8WeightWithoutAnFp8ConfigIsRejected) {
  OpenBlockCheckpoint();
  EXPECT_THAT(ReadWeight(*ckpt_, std::nullopt, "w", {kRows, kCols}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(dir_.path()), HasSubstr("\"w\" is stored as F8_E4M3"),
                             HasSubstr("no quantization_config"))));
}

TEST_F(Fp8WeightsTest, Fp8TensorThatIsNotAMatrixIsRejected) {
  Open({{"v", "F8_E4M3", {4}, std::string(4, '\x38')}, {"v_scale_inv", "F32", {}, Floats({1.f})}});
  EXPECT_THAT(ReadWeight(*ckpt_, Fp8Quantization(), "v", {4}),
              StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("\"v\""), HasSubstr("must be 2-D"))));
}

TEST_F(Fp8WeightsTest, MissingBlockScalesAreNotFoundNamingTheScaleTensor) {
  Open({{"w", "F8_E4M3", {kRows, kCols}, WeightBytes()}, {"w_scale", "F32", {3, 3}, Floats(kScales)}});
  EXPECT_THAT(ReadWeightRows(*ckpt_, Blocks(), "w", {kRows, kCols}, 0, 2),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr("FP8 weight \"w\" has no scale tensor \"w_scale_inv\""),
                             HasSubstr("weight_block_size [2, 3]"))));
}

TEST_F(Fp8WeightsTest, MissingPerTensorScaleIsNotFoundNamingBothSpellings) {
  Open({{"w", "F8_E4M3", {kRows, kCols}, WeightBytes()}});
  EXPECT_THAT(ReadWeight(*ckpt_, Fp8Quantization(), "w", {kRows, kCols}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"w\" has no scale tensor (\"w_scale_inv\" or \"w_scale\")")));
}

TEST_F(Fp8WeightsTest, BothPerTensorSpellingsAreAmbiguous) {
  Open({{"w", "F8_E4M3", {kRows, kCols}, WeightBytes()},
        {"w_scale", "F32", {}, Floats({1.f})},
        {"w_scale_inv", "F32", {}, Floats({2.f})}});
  EXPECT_THAT(ReadWeight(*ckpt_, Fp8Quantization(), "w", {kRows, kCols}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("has both \"w_scale_inv\" and \"w_scale\"")));
}

TEST_F(Fp8WeightsTest, ScalesInAnotherDtypeAreRejected) {
  Open({{"w", "F8_E4M3", {kRows, kCols}, WeightBytes()}, {"w_scale_inv", "F16", {3, 3}, std::string(18, '\0')}});
  EXPECT_THAT(ReadWeight(*ckpt_, Blocks(), "w", {kRows, kCols}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"w\" has scale tensor \"w_scale_inv\" stored as F16; expected F32 or BF16")));
}

TEST_F(Fp8WeightsTest, BlockScalesOfTheWrongShapeAreRejected) {
  // Shaped as if the blocks were not rounded up ([5/2, 7/3]).
  Open({{"w", "F8_E4M3", {kRows, kCols}, WeightBytes()},
        {"w_scale_inv", "F32", {2, 2}, Floats({1.f, 1.f, 1.f, 1.f})}});
  EXPECT_THAT(ReadWeightCols(*ckpt_, Blocks(), "w", {kRows, kCols}, 0, 3),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"w\" [5, 7] has scale tensor \"w_scale_inv\" of shape [2, 2]; weight_block_size "
                                 "[2, 3] needs [3, 3]")));
}

TEST_F(Fp8WeightsTest, ABlockSizeThatDisagreesWithTheScalesIsRejected) {
  OpenBlockCheckpoint();
  // Rows and columns of the block swapped: [3, 2] blocks need [2, 4] scales.
  EXPECT_THAT(ReadWeight(*ckpt_, Blocks(3, 2), "w", {kRows, kCols}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("weight_block_size [3, 2] needs [2, 4]")));
  // Per-tensor config on a block-quantized checkpoint.
  EXPECT_THAT(ReadWeight(*ckpt_, Fp8Quantization(), "w", {kRows, kCols}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"w_scale_inv\" of shape [3, 3]; a per-tensor scale (no weight_block_size) has "
                                 "shape [], [1] or [1, 1]")));
}

struct BadScaleCase {
  std::string name;
  float value;
  std::string shown;
};

void PrintTo(const BadScaleCase& c, std::ostream* os) { *os << c.name; }

class BadScaleTest : public Fp8WeightsTest, public ::testing::WithParamInterface<BadScaleCase> {};

TEST_P(BadScaleTest, IsRejectedNamingItsBlock) {
  std::vector<float> scales = kScales;
  scales[7] = GetParam().value;  // block (2, 1): outside the rows read below, still checked
  Open({{"w", "F8_E4M3", {kRows, kCols}, WeightBytes()}, {"w_scale_inv", "F32", {3, 3}, Floats(scales)}});
  EXPECT_THAT(ReadWeightRows(*ckpt_, Blocks(), "w", {kRows, kCols}, 0, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("FP8 weight \"w\" has scale " + GetParam().shown + " at block [2, 1] in "
                                       "\"w_scale_inv\""),
                             HasSubstr("finite and > 0"))));
}

INSTANTIATE_TEST_SUITE_P(Values, BadScaleTest,
                         ::testing::Values(BadScaleCase{"Zero", 0.f, "0"}, BadScaleCase{"Negative", -0.5f, "-0.5"},
                                           BadScaleCase{"NaN", std::numeric_limits<float>::quiet_NaN(), "nan"},
                                           BadScaleCase{"Infinite", std::numeric_limits<float>::infinity(), "inf"}),
                         [](const auto& test_info) { return test_info.param.name; });

TEST_F(Fp8WeightsTest, BadPerTensorScaleIsRejected) {
  Open({{"w", "F8_E4M3", {kRows, kCols}, WeightBytes()}, {"w_scale", "F32", {}, Floats({-1.f})}});
  EXPECT_THAT(ReadWeight(*ckpt_, Fp8Quantization(), "w", {kRows, kCols}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"w\" has scale -1 in \"w_scale\"")));
}

TEST_F(Fp8WeightsTest, NaNCodesInTheSliceReadAreRejectedWithTheirPosition) {
  for (const char nan : {'\x7f', '\xff'}) {
    std::string bytes = WeightBytes();
    bytes[3 * kCols + 5] = nan;
    TempDir dir;
    dir.Write("model.safetensors", File({{"w", "F8_E4M3", {kRows, kCols}, bytes},
                                         {"w_scale_inv", "F32", {3, 3}, Floats(kScales)}}));
    ASSERT_OK_AND_ASSIGN(auto ckpt, Checkpoint::Open(dir.path()));
    const auto is_nan_error = StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr("FP8 weight \"w\" holds a NaN code (0x7f or 0xff) at [3, 5]"));
    EXPECT_THAT(ReadWeight(*ckpt, Blocks(), "w", {kRows, kCols}), is_nan_error);
    EXPECT_THAT(ReadWeightRows(*ckpt, Blocks(), "w", {kRows, kCols}, 2, 4), is_nan_error);
    EXPECT_THAT(ReadWeightCols(*ckpt, Blocks(), "w", {kRows, kCols}, 4, 7), is_nan_error);
    // Slices without it (another rank's) read fine.
    EXPECT_TRUE(ReadWeightRows(*ckpt, Blocks(), "w", {kRows, kCols}, 0, 3).ok());
    EXPECT_TRUE(ReadWeightCols(*ckpt, Blocks(), "w", {kRows, kCols}, 0, 5).ok());
  }
}

TEST_F(Fp8WeightsTest, CheckpointErrorsComeFirst) {
  OpenBlockCheckpoint();
  EXPECT_THAT(ReadWeight(*ckpt_, Blocks(), "w", {kCols, kRows}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"w\" has shape [5, 7] but the model config")));
  EXPECT_THAT(ReadWeightRows(*ckpt_, Blocks(), "w", {kRows, kCols}, 3, 6),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("out of bounds")));
  EXPECT_THAT(ReadWeight(*ckpt_, Blocks(), "nope", {1}), StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"nope\"")));
}

}  // namespace
}  // namespace shardserve

// The FP8 math CUDA's kernels run (kernels/shared/fp8_math.h), on the CPU: every e4m3 code decodes
// to common/tensor's E4M3ToFloat bit for bit, and a slice read by common/fp8's ReadFp8Slice (codes +
// the scale blocks it overlaps), dequantized by Fp8DequantizeRow, is ReadWeightRows /
// ReadWeightCols bit for bit, for random block-wise and per-tensor matrices and slices that start
// and end inside blocks. Also the validation of F8_E4M3 Linear weights.
#include "worker/kernels/shared/fp8_math.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/fp8/fp8_weights.h"
#include "common/tensor/dtype.h"
#include "tests/testing/safetensors_file.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "worker/kernels/backend.h"

namespace shardserve::kernels {
namespace {

using ::shardserve::testing::StatusIs;
using ::shardserve::testing::StoredTensor;
using ::shardserve::testing::TempDir;
using ::testing::HasSubstr;

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

// The device's encoder (an FP8 KV cache's writes) against common/tensor's FloatToE4M3, itself
// checked against the e4m3 table in tests/common/dtype_test.cc: every code's value, the midpoints
// between neighbouring codes and a float either side of each (ties to even), the saturation edge,
// zero, infinities and NaN of both signs, every f32 exponent, and random bit patterns.
TEST(Fp8MathTest, EncodeIsCommonTensorsFloatToE4M3) {
  std::vector<float> inputs = {0.0f, -0.0f, 448.0f, -448.0f, 464.0f, 480.0f, 1e30f, -1e30f,
                               std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                               std::numeric_limits<float>::denorm_min(), 0.0009765625f /* 2^-10: a tie to 0 */,
                               0.0029296875f /* 1.5 x 2^-9: a tie to even (2) */};
  for (int c = 0; c < 256; ++c) {
    const float v = E4M3Decode(static_cast<uint8_t>(c));
    if (std::isnan(v)) continue;
    inputs.push_back(v);
    const float next = E4M3Decode(static_cast<uint8_t>((c & 0x80) | std::min((c & 0x7f) + 1, 0x7e)));
    const float mid = 0.5f * (v + next);
    inputs.insert(inputs.end(),
                  {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f), std::nextafter(mid, -1e9f)});
  }
  for (uint32_t e = 0; e < 256; ++e) {
    for (uint32_t m : {0u, 1u, 0x7ffffu, 0x80000u, 0x80001u, 0x400000u, 0x7fffffu}) {
      inputs.push_back(FromBits((e << 23) | m));
      inputs.push_back(FromBits(0x80000000u | (e << 23) | m));
    }
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) inputs.push_back(FromBits(static_cast<uint32_t>(rng())));
  for (int i = 0; i < 200000; ++i) inputs.push_back(std::uniform_real_distribution<float>(-500.0f, 500.0f)(rng));
  for (const float f : inputs) {
    ASSERT_EQ(E4M3Encode(f), FloatToE4M3(f)) << "input bits 0x" << std::hex << Bits(f) << " = " << f;
  }
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    EXPECT_EQ(E4M3Encode(E4M3Decode(static_cast<uint8_t>(c))), c) << c;
  }
}

TEST(Fp8MathTest, EveryCodeDecodesAsCommonTensorBitForBit) {
  int nans = 0;
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<uint8_t>(c);
    EXPECT_EQ(Bits(E4M3Decode(code)), Bits(E4M3ToFloat(code))) << "code 0x" << std::hex << c;
    nans += std::isnan(E4M3Decode(code)) ? 1 : 0;
  }
  EXPECT_EQ(nans, 2);  // 0x7f and 0xff
  // A few values worked out by hand: the largest normal, the smallest subnormal, -0.
  EXPECT_EQ(E4M3Decode(0x7e), 448.0f);
  EXPECT_EQ(E4M3Decode(0x01), 0.001953125f);
  EXPECT_EQ(Bits(E4M3Decode(0x80)), 0x80000000u);
}

// A random F8_E4M3 matrix [kRows, kCols] "w" with random positive scales, block-wise
// (`block_rows` x `block_cols`) or per tensor (0 x 0), written as a checkpoint.
constexpr int64_t kRows = 70, kCols = 52;

class Fp8SliceTest : public ::testing::Test {
 protected:
  void Write(int64_t block_rows, int64_t block_cols, uint32_t seed) {
    std::mt19937 rng(seed);
    std::string codes(static_cast<size_t>(kRows * kCols), '\0');
    for (char& c : codes) {
      uint8_t v = static_cast<uint8_t>(rng() & 0xffu);
      if ((v & 0x7fu) == 0x7fu) v = 0x3f;  // no NaN codes
      c = static_cast<char>(v);
    }
    std::uniform_real_distribution<float> scale(1e-4f, 4.0f);
    std::vector<float> scales;
    Shape scale_shape;
    if (block_rows > 0) {
      scale_shape = {(kRows + block_rows - 1) / block_rows, (kCols + block_cols - 1) / block_cols};
      fp8_->block_rows = block_rows;
      fp8_->block_cols = block_cols;
    }
    for (int64_t i = 0; i < (block_rows > 0 ? NumElements(scale_shape) : 1); ++i) scales.push_back(scale(rng));
    dir_.Write("model.safetensors",
               testing::SafetensorsFile({{"w", "F8_E4M3", {kRows, kCols}, codes},
                                         {"w_scale_inv", "F32", scale_shape, testing::F32Bytes(scales)}}));
    ASSERT_OK_AND_ASSIGN(ckpt_, Checkpoint::Open(dir_.path()));
  }

  // Rows [r0, r1) x columns [c0, c1) dequantized through ReadFp8Slice + the shared functions must
  // equal common/fp8's reading of the same slice, bit for bit.
  void ExpectSliceMatches(int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
    SCOPED_TRACE(::testing::Message() << "rows [" << r0 << ", " << r1 << ") cols [" << c0 << ", " << c1 << ")");
    ASSERT_OK_AND_ASSIGN(Fp8Slice s, ReadFp8Slice(*ckpt_, fp8_, "w", {kRows, kCols}, r0, r1, c0, c1));
    ASSERT_EQ(s.rows, r1 - r0);
    ASSERT_EQ(s.cols, c1 - c0);
    const Fp8ScaleGrid grid{.scales = s.scales.data(), .block_rows = s.block_rows, .block_cols = s.block_cols,
                            .grid_cols = s.grid_cols, .row_offset = s.row_offset, .col_offset = s.col_offset};
    ASSERT_TRUE(grid.Valid(s.cols));
    // The grid holds exactly the blocks the slice overlaps.
    EXPECT_EQ(static_cast<int64_t>(s.scales.size()),
              (s.row_offset + s.rows + s.block_rows - 1) / s.block_rows * s.grid_cols);
    const bool whole_rows = c0 == 0 && c1 == kCols;
    ASSERT_OK_AND_ASSIGN(HostTensor want, whole_rows ? ReadWeightRows(*ckpt_, fp8_, "w", {kRows, kCols}, r0, r1)
                                                     : ReadWeightCols(*ckpt_, fp8_, "w", {kRows, kCols}, c0, c1));
    std::vector<float> row(static_cast<size_t>(s.cols));
    for (int64_t r = 0; r < s.rows; ++r) {
      Fp8DequantizeRow(s.codes.data(), grid, r, s.cols, row.data());
      const float* w = want.data() + (whole_rows ? r : r0 + r) * s.cols;
      for (int64_t c = 0; c < s.cols; ++c) {
        ASSERT_EQ(Bits(row[static_cast<size_t>(c)]), Bits(w[c])) << "at [" << r0 + r << ", " << c0 + c << "]";
      }
    }
  }

  TempDir dir_;
  std::unique_ptr<Checkpoint> ckpt_;
  std::optional<Fp8Quantization> fp8_ = Fp8Quantization{};
};

TEST_F(Fp8SliceTest, BlockWiseSlicesStartingAndEndingInsideBlocksDequantizeAsCommonFp8) {
  // 70 x 52 in blocks of 16 x 12: ragged last blocks (70 = 4 x 16 + 6, 52 = 4 x 12 + 4); slices cut
  // blocks at both ends, align with them, or are empty.
  for (uint32_t seed : {1u, 2u, 3u}) {
    Write(16, 12, seed);
    ExpectSliceMatches(0, kRows, 0, kCols);
    ExpectSliceMatches(5, 37, 0, kCols);
    ExpectSliceMatches(32, 64, 0, kCols);
    ExpectSliceMatches(69, 70, 0, kCols);
    ExpectSliceMatches(0, kRows, 7, 30);
    ExpectSliceMatches(0, kRows, 24, 52);
    ExpectSliceMatches(0, kRows, 51, 52);
  }
}

TEST_F(Fp8SliceTest, PerTensorSlicesHaveOneScale) {
  Write(0, 0, 7);
  ExpectSliceMatches(0, kRows, 0, kCols);
  ExpectSliceMatches(13, 41, 0, kCols);
  ExpectSliceMatches(0, kRows, 9, 33);
  ASSERT_OK_AND_ASSIGN(Fp8Slice s, ReadFp8Slice(*ckpt_, fp8_, "w", {kRows, kCols}, 13, 41, 0, kCols));
  EXPECT_EQ(s.scales.size(), 1u);
}

TEST_F(Fp8SliceTest, ErrorsNameTheTensor) {
  Write(16, 12, 5);
  EXPECT_THAT(ReadFp8Slice(*ckpt_, fp8_, "w_scale_inv", {5, 5}, 0, 5, 0, 5).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"w_scale_inv\" is not stored as F8_E4M3")));
  EXPECT_THAT(ReadFp8Slice(*ckpt_, fp8_, "w", {kRows, kCols}, 0, 4, 10, 60).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("columns [10, 60) are not a range")));
  // A NaN code is named by its position in the full matrix, as ReadWeight* name it.
  auto tensors = testing::ReadSafetensorsFile(dir_.path() + "/model.safetensors");
  ASSERT_TRUE(tensors.ok());
  (*tensors)[0].bytes[static_cast<size_t>(40 * kCols + 3)] = '\xff';
  TempDir other;
  other.Write("model.safetensors", testing::SafetensorsFile(*tensors));
  ASSERT_OK_AND_ASSIGN(auto ckpt, Checkpoint::Open(other.path()));
  EXPECT_THAT(ReadFp8Slice(*ckpt, fp8_, "w", {kRows, kCols}, 32, 48, 0, kCols).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("holds a NaN code (0x7f or 0xff) at [40, 3]")));
}

TEST(Fp8LinearParamsTest, F8WeightsNeedAValidScaleGrid) {
  std::vector<float> x(8), y(8), scales(4, 1.0f);
  std::vector<uint8_t> codes(16);
  LinearParams p{.x = x.data(), .y = y.data(), .tokens = 2, .in = 4, .out = 4};
  p.w = WeightView::F8E4M3(codes.data(), {.scales = scales.data(), .block_rows = 2, .block_cols = 2, .grid_cols = 2});
  EXPECT_TRUE(p.Validate().ok());
  for (Fp8ScaleGrid bad : {Fp8ScaleGrid{.scales = nullptr, .block_rows = 2, .block_cols = 2, .grid_cols = 2},
                           Fp8ScaleGrid{.scales = scales.data(), .block_rows = 0, .block_cols = 2, .grid_cols = 2},
                           Fp8ScaleGrid{.scales = scales.data(), .block_rows = 2, .block_cols = 2, .grid_cols = 1},
                           Fp8ScaleGrid{.scales = scales.data(), .block_rows = 2, .block_cols = 2, .grid_cols = 2,
                                        .row_offset = 2}}) {
    p.w.fp8 = bad;
    EXPECT_THAT(p.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("F8_E4M3 weights without")));
  }
}

}  // namespace
}  // namespace shardserve::kernels

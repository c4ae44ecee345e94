#include "common/tensor/dtype.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "tests/testing/status_matchers.h"

namespace shardserve {
namespace {

using ::shardserve::testing::StatusIs;
using ::testing::HasSubstr;

TEST(DTypeTest, HalfRoundTripsEveryFiniteValue) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t v = static_cast<uint16_t>(h);
    const float f = HalfToFloat(v);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f))));
      continue;
    }
    EXPECT_EQ(FloatToHalf(f), v) << "half 0x" << std::hex << h;
  }
}

TEST(DTypeTest, HalfKnownValues) {
  EXPECT_EQ(HalfToFloat(0x3c00), 1.0f);
  EXPECT_EQ(HalfToFloat(0xc000), -2.0f);
  EXPECT_EQ(HalfToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_TRUE(std::isinf(HalfToFloat(0x7c00)));
  EXPECT_EQ(FloatToHalf(1e6f), 0x7c00);                    // overflow -> inf
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie rounds to even
}

TEST(DTypeTest, BFloat16IsTheHighHalfOfFloatWithRounding) {
  EXPECT_EQ(BFloat16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  EXPECT_EQ(BFloat16ToFloat(FloatToBFloat16(3.140625f)), 3.140625f);
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(DTypeTest, ConvertToFloatHandlesUnalignedInput) {
  unsigned char bytes[7] = {0};
  const uint16_t vals[3] = {0x3c00, 0x4000, 0xbc00};
  std::memcpy(bytes + 1, vals, 6);
  float out[3];
  ConvertToFloat(DType::kF16, bytes + 1, 3, out);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], 2.0f);
  EXPECT_EQ(out[2], -1.0f);
}

TEST(DTypeTest, ParseNamesTheUnsupportedDtype) {
  EXPECT_EQ(*ParseDType("BF16"), DType::kBF16);
  EXPECT_EQ(*ParseDType("F8_E4M3"), DType::kF8E4M3);
  EXPECT_THAT(ParseDType("F8_E5M2"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("F8_E5M2")));
  // kQ8 is a kernel weight format, never a checkpoint's.
  EXPECT_THAT(ParseDType("Q8"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("Q8")));
}

TEST(DTypeTest, QuantizationNamesRoundTrip) {
  for (Quantization q : {Quantization::kNone, Quantization::kInt8}) EXPECT_EQ(*ParseQuantization(QuantizationName(q)), q);
  EXPECT_EQ(*ParseQuantization(""), Quantization::kNone);
  EXPECT_THAT(ParseQuantization("int4"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("int4")));
}

// e4m3fn values from the OCP FP8 specification's table: bias 7, no infinities, S.1111.111 NaN.
TEST(DTypeTest, E4M3KnownValues) {
  EXPECT_EQ(E4M3ToFloat(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(E4M3ToFloat(0x80)));
  EXPECT_EQ(E4M3ToFloat(0x38), 1.0f);         // 0.0111.000
  EXPECT_EQ(E4M3ToFloat(0xb8), -1.0f);
  EXPECT_EQ(E4M3ToFloat(0x7e), 448.0f);       // largest finite: 0.1111.110 = 1.75 * 2^8
  EXPECT_EQ(E4M3ToFloat(0x78), 256.0f);       // 0.1111.000 is a number, not infinity
  EXPECT_EQ(E4M3ToFloat(0x08), 0.015625f);    // smallest normal 2^-6
  EXPECT_EQ(E4M3ToFloat(0x01), 0.001953125f); // smallest subnormal 2^-9
  EXPECT_EQ(E4M3ToFloat(0x07), 7 * 0.001953125f);
  EXPECT_EQ(E4M3ToFloat(0x3c), 1.5f);
  EXPECT_TRUE(std::isnan(E4M3ToFloat(0x7f)));
  EXPECT_TRUE(std::isnan(E4M3ToFloat(0xff)));
  // Every non-NaN code is finite and the codes are ordered by magnitude.
  float prev = -1.0f;
  for (int v = 0; v < 0x7f; ++v) {
    const float f = E4M3ToFloat(static_cast<uint8_t>(v));
    EXPECT_GT(f, prev) << v;
    EXPECT_EQ(E4M3ToFloat(static_cast<uint8_t>(v | 0x80)), -f) << v;
    prev = f;
  }
  const uint8_t bytes[2] = {0x38, 0xc0};  // 1, -2
  float out[2];
  ConvertToFloat(DType::kF8E4M3, bytes, 2, out);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -2.0f);
}

}  // namespace
}  // namespace shardserve

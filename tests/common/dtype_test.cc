#include "common/tensor/dtype.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "tests/testing/status_matchers.h"

namespace shardserve {
namespace {

using ::shardserve::testing::IsOk;
using ::shardserve::testing::StatusIs;
using ::testing::AllOf;
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

uint16_t Bf16At(const unsigned char* bytes, size_t i) {
  uint16_t v;
  std::memcpy(&v, bytes + 2 * i, 2);
  return v;
}

// ConvertFromFloat to BF16 against known encodings: ties (the low 16 bits exactly 0x8000) go to the
// even neighbour, values past the largest finite bf16's half-way point overflow to inf, NaN stays
// NaN (quieted), -0 keeps its sign, subnormals round like any other value. Each is placed at every
// offset of the 16-value vector body and of the scalar tail, into an unaligned destination.
TEST(DTypeTest, ConvertFromFloatRoundsToNearestEvenBFloat16) {
  const std::vector<std::pair<uint32_t, uint16_t>> known = {
      {0x3f800000u, 0x3f80}, {0x3f808000u, 0x3f80}, {0x3f818000u, 0x3f82}, {0x3f808001u, 0x3f81},
      {0x3f807fffu, 0x3f80}, {0xbf808001u, 0xbf81}, {0x80000000u, 0x8000}, {0x7f7fffffu, 0x7f80},
      {0x7f7f7fffu, 0x7f7f}, {0x7f800000u, 0x7f80}, {0xff800000u, 0xff80}, {0x7f800001u, 0x7fc0},
      {0xffc00000u, 0xffc0}, {0x00018000u, 0x0002}, {0x00008000u, 0x0000}, {0xff7fffffu, 0xff80},
  };
  for (size_t offset = 0; offset < 20; ++offset) {
    std::vector<float> in(offset + known.size(), 0.f);
    for (size_t k = 0; k < known.size(); ++k) in[offset + k] = std::bit_cast<float>(known[k].first);
    std::vector<unsigned char> out(2 * in.size() + 1, 0xab);
    ASSERT_THAT(ConvertFromFloat(DType::kBF16, in.data(), in.size(), out.data() + 1), IsOk());
    EXPECT_EQ(out[0], 0xab);
    for (size_t k = 0; k < known.size(); ++k) {
      ASSERT_EQ(Bf16At(out.data() + 1, offset + k), known[k].second)
          << "offset " << offset << ", float bits 0x" << std::hex << known[k].first;
      ASSERT_EQ(FloatToBFloat16(in[offset + k]), known[k].second) << "float bits 0x" << std::hex << known[k].first;
    }
  }
}

// Random bit patterns (NaNs and infinities among them) over every length up to 67: ConvertFromFloat
// writes what the one-value encoder does and nothing past `count`, and ConvertToFloat reads back
// exactly the float each bf16 stands for, from an unaligned source.
TEST(DTypeTest, BFloat16ConversionsAgreeWithTheOneValueFunctionsOverEveryLength) {
  std::vector<float> many(67);
  uint32_t x = 12345;
  for (float& f : many) {
    x = x * 1664525u + 1013904223u;
    f = std::bit_cast<float>(x);
  }
  for (size_t n = 0; n <= many.size(); ++n) {
    std::vector<unsigned char> coded(2 * many.size() + 1, 0xab);
    ASSERT_THAT(ConvertFromFloat(DType::kBF16, many.data(), n, coded.data() + 1), IsOk());
    std::vector<float> back(many.size(), -7.f);
    ConvertToFloat(DType::kBF16, coded.data() + 1, n, back.data());
    for (size_t i = 0; i < many.size(); ++i) {
      if (i >= n) {
        ASSERT_EQ(coded[1 + 2 * i], 0xab) << "n " << n << " i " << i;
        ASSERT_EQ(back[i], -7.f) << "n " << n << " i " << i;
        continue;
      }
      const uint16_t want = FloatToBFloat16(many[i]);
      ASSERT_EQ(Bf16At(coded.data() + 1, i), want) << "n " << n << " i " << i;
      ASSERT_EQ(std::bit_cast<uint32_t>(back[i]), static_cast<uint32_t>(want) << 16) << "n " << n << " i " << i;
    }
  }
}

TEST(DTypeTest, ConvertFromFloatCopiesF32AndRefusesTheRest) {
  const float in[3] = {1.5f, -2.0f, 3.25f};
  float out[3] = {0, 0, 0};
  ASSERT_THAT(ConvertFromFloat(DType::kF32, in, 3, out), IsOk());
  EXPECT_EQ(out[0], 1.5f);
  EXPECT_EQ(out[2], 3.25f);
  unsigned char untouched[4] = {7, 7, 7, 7};
  EXPECT_THAT(ConvertFromFloat(DType::kF16, in, 2, untouched),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cannot write F16 from float")));
  EXPECT_EQ(untouched[0], 7);
}

TEST(DTypeTest, ParseNamesTheUnsupportedDtype) {
  EXPECT_EQ(*ParseDType("BF16"), DType::kBF16);
  EXPECT_EQ(*ParseDType("F8_E4M3"), DType::kF8E4M3);
  EXPECT_THAT(ParseDType("F8_E5M2"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("F8_E5M2")));
  // kQ8 is a kernel weight format, never a checkpoint's.
  EXPECT_THAT(ParseDType("Q8"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("Q8")));
  // MXFP4's blocks and scales: raw bytes, read as their values; other integer dtypes stay refused.
  EXPECT_EQ(*ParseDType("U8"), DType::kU8);
  EXPECT_EQ(DTypeName(DType::kU8), "U8");
  EXPECT_EQ(DTypeSize(DType::kU8), 1u);
  const unsigned char bytes[3] = {0, 127, 255};
  float values[3];
  ConvertToFloat(DType::kU8, bytes, 3, values);
  EXPECT_THAT(values, ::testing::ElementsAre(0.f, 127.f, 255.f));
  EXPECT_THAT(ParseDType("I8"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("I8")));
}

TEST(DTypeTest, QuantizationNamesRoundTrip) {
  for (Quantization q : {Quantization::kNone, Quantization::kInt8}) EXPECT_EQ(*ParseQuantization(QuantizationName(q)), q);
  EXPECT_EQ(*ParseQuantization(""), Quantization::kNone);
  EXPECT_THAT(ParseQuantization("int4"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("int4")));
}

TEST(DTypeTest, KvCacheFormatNamesRoundTrip) {
  for (KvCacheFormat f : {KvCacheFormat::kAuto, KvCacheFormat::kFp8E4M3}) {
    EXPECT_EQ(*ParseKvCacheFormat(KvCacheFormatName(f)), f);
  }
  EXPECT_EQ(*ParseKvCacheFormat(""), KvCacheFormat::kAuto);
  EXPECT_EQ(*ParseKvCacheFormat("fp8"), KvCacheFormat::kFp8E4M3);
  EXPECT_THAT(ParseKvCacheFormat("fp8_e5m2"),
              StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("fp8_e5m2"), HasSubstr("fp8_e4m3"))));
}

// e4m3fn values from the OCP FP8 specification's table: bias 7, no infinities, S.1111.111 NaN.
TEST(DTypeTest, HiddenWireDtypeNamesParse) {
  ASSERT_OK_AND_ASSIGN(DType f32, ParseHiddenWireDtype("f32"));
  EXPECT_EQ(f32, DType::kF32);
  ASSERT_OK_AND_ASSIGN(DType bf16, ParseHiddenWireDtype("BF16"));
  EXPECT_EQ(bf16, DType::kBF16);
  EXPECT_THAT(ParseHiddenWireDtype("fp8"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"fp8\" is not a hidden-state wire dtype (f32 or bf16)")));
  EXPECT_FALSE(ParseHiddenWireDtype("").ok());
}

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

// The finite e4m3 code nearest to x, by search over all 254 of them (ties: the even code, i.e. the
// one whose mantissa ends in 0); the reference FloatToE4M3 is checked against.
uint8_t NearestFiniteE4M3(float x) {
  int best = -1;
  double best_d = 0;
  for (int c = 0; c < 256; ++c) {
    const float v = E4M3ToFloat(static_cast<uint8_t>(c));
    if (std::isnan(v) || std::signbit(v) != std::signbit(x)) continue;
    const double d = std::fabs(static_cast<double>(v) - static_cast<double>(x));
    if (best < 0 || d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return static_cast<uint8_t>(best);
}

TEST(DTypeTest, E4M3EncoderRoundTripsEveryCode) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    const float f = E4M3ToFloat(code);
    if (std::isnan(f)) {
      EXPECT_EQ(FloatToE4M3(std::copysign(f, (c & 0x80) != 0 ? -1.0f : 1.0f)), code) << c;
    } else {
      EXPECT_EQ(FloatToE4M3(f), code) << c << " = " << f;
    }
  }
}

TEST(DTypeTest, E4M3EncoderRoundsHalfwayToEvenAndNearestOtherwise) {
  // Between every two neighbouring positive codes (subnormal, normal, across binades): the midpoint
  // goes to the even code, anything off the midpoint to the nearer one; and the same negated.
  for (int c = 0; c < 0x7e; ++c) {
    const float lo = E4M3ToFloat(static_cast<uint8_t>(c)), hi = E4M3ToFloat(static_cast<uint8_t>(c + 1));
    const float mid = (lo + hi) / 2;  // exact: a power-of-two step
    const uint8_t even = static_cast<uint8_t>((c & 1) == 0 ? c : c + 1);
    EXPECT_EQ(FloatToE4M3(mid), even) << c;
    EXPECT_EQ(FloatToE4M3(-mid), even | 0x80) << c;
    EXPECT_EQ(FloatToE4M3(std::nextafter(mid, 0.0f)), c) << c;
    EXPECT_EQ(FloatToE4M3(std::nextafter(mid, 1e9f)), c + 1) << c;
    EXPECT_EQ(FloatToE4M3(-std::nextafter(mid, 1e9f)), (c + 1) | 0x80) << c;
  }
}

TEST(DTypeTest, E4M3EncoderSaturatesAndKeepsNanAndSignedZero) {
  for (float big : {448.0f, 449.0f, 463.9f, 464.0f, 480.0f, 1e6f, std::numeric_limits<float>::max(),
                    std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(FloatToE4M3(big), 0x7e) << big;
    EXPECT_EQ(FloatToE4M3(-big), 0xfe) << big;
  }
  EXPECT_EQ(FloatToE4M3(std::numeric_limits<float>::quiet_NaN()), 0x7f);
  EXPECT_EQ(FloatToE4M3(-std::numeric_limits<float>::quiet_NaN()), 0xff);
  EXPECT_EQ(FloatToE4M3(0.0f), 0x00);
  EXPECT_EQ(FloatToE4M3(-0.0f), 0x80);
  EXPECT_EQ(FloatToE4M3(std::numeric_limits<float>::denorm_min()), 0x00);  // far below 2^-10
  EXPECT_EQ(FloatToE4M3(0.0009765625f), 0x00);                             // 2^-10: halfway to 0x01, even
  EXPECT_EQ(FloatToE4M3(0.0009766f), 0x01);
}

TEST(DTypeTest, E4M3EncoderPicksTheNearestCodeOfRandomValues) {
  // Log-uniform magnitudes over the whole range (2^-12 .. 2^9) and both signs, against the search.
  uint64_t s = 0x2545f4914f6cdd1dull;
  for (int i = 0; i < 20000; ++i) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    const float mag = std::ldexp(1.0f + static_cast<float>(s >> 41) * 0x1.0p-23f, static_cast<int>(s % 21) - 12);
    const float x = (s >> 40 & 1) != 0 ? -mag : mag;
    const uint8_t want = std::fabs(x) >= 448.0f ? static_cast<uint8_t>((x < 0 ? 0x80 : 0) | 0x7e) : NearestFiniteE4M3(x);
    ASSERT_EQ(FloatToE4M3(x), want) << x;
  }
}

}  // namespace
}  // namespace shardserve

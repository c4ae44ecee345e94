// The MXFP4 expert reader against values worked out by hand: e2m1 codes (sign | 2 exponent bits |
// 1 mantissa bit) in both nibbles, e8m0 scales below, at and above 2^0, and the errors it must
// give for checkpoints that are not MXFP4 as GPT-OSS stores it.
#include "common/fp8/mxfp4_weights.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "tests/testing/safetensors_file.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace shardserve {
namespace {

using ::shardserve::testing::StatusIs;
using ::shardserve::testing::StoredTensor;
using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(Mxfp4Test, E2M1CodesAreTheirValues) {
  const float expected[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                              -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(E2M1ToFloat(static_cast<uint8_t>(c)), expected[c]) << c;
    EXPECT_EQ(std::signbit(E2M1ToFloat(static_cast<uint8_t>(c))), c >= 8) << c;
    // The high nibble is not part of the code.
    EXPECT_EQ(E2M1ToFloat(static_cast<uint8_t>(c | 0xA0)), expected[c]) << c;
  }
}

// 2 experts x 3 rows x 64 columns: 2 blocks of 32 per row. Element (e, r, c) has code
// (e * 7 + r * 5 + c) % 16 and the scale byte of its block, 127 + (e + r + block) % 5 - 2: 2^-2 to 2^2.
constexpr int64_t kExperts = 2, kRows = 3, kCols = 64, kGroups = kCols / 32;
uint8_t CodeOf(int64_t e, int64_t r, int64_t c) { return static_cast<uint8_t>((e * 7 + r * 5 + c) % 16); }
int ExponentOf(int64_t e, int64_t r, int64_t g) { return static_cast<int>((e + r + g) % 5) - 2; }

std::vector<StoredTensor> Tensors() {
  std::string blocks, scales;
  for (int64_t e = 0; e < kExperts; ++e) {
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t c = 0; c < kCols; c += 2) {
        blocks.push_back(static_cast<char>(CodeOf(e, r, c) | (CodeOf(e, r, c + 1) << 4)));
      }
      for (int64_t g = 0; g < kGroups; ++g) scales.push_back(static_cast<char>(127 + ExponentOf(e, r, g)));
    }
  }
  return {{"w_blocks", "U8", {kExperts, kRows, kGroups, 16}, blocks},
          {"w_scales", "U8", {kExperts, kRows, kGroups}, scales}};
}

std::unique_ptr<Checkpoint> Open(const testing::TempDir& dir, const std::vector<StoredTensor>& tensors) {
  const std::string path = dir.Write("model.safetensors", testing::SafetensorsFile(tensors));
  auto ckpt = Checkpoint::OpenFile(path);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status();
  return ckpt.ok() ? std::move(*ckpt) : nullptr;
}

TEST(Mxfp4Test, ExpertsAreTheirCodesTimesTheirBlockScales) {
  testing::TempDir dir;
  std::unique_ptr<Checkpoint> ckpt = Open(dir, Tensors());
  ASSERT_NE(ckpt, nullptr);
  for (int64_t e = 0; e < kExperts; ++e) {
    ASSERT_OK_AND_ASSIGN(HostTensor t, ReadMxfp4Expert(*ckpt, "w", kExperts, kRows, kCols, e));
    ASSERT_EQ(t.shape(), (Shape{kRows, kCols}));
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t c = 0; c < kCols; ++c) {
        const float want = E2M1ToFloat(CodeOf(e, r, c)) * std::exp2f(static_cast<float>(ExponentOf(e, r, c / 32)));
        ASSERT_EQ(t.data()[r * kCols + c], want) << e << " " << r << " " << c;
      }
    }
  }
}

TEST(Mxfp4Test, ExtremeScalesStayExactOrOverflowAsTransformersDoes) {
  // Scale byte 0 is 2^-127 (a subnormal for the larger codes' products, still exact), 254 is 2^127.
  std::vector<StoredTensor> t = Tensors();
  t[1].bytes[0] = 0;
  t[1].bytes[1] = static_cast<char>(254);
  testing::TempDir dir;
  std::unique_ptr<Checkpoint> ckpt = Open(dir, t);
  ASSERT_NE(ckpt, nullptr);
  ASSERT_OK_AND_ASSIGN(HostTensor w, ReadMxfp4Expert(*ckpt, "w", kExperts, kRows, kCols, 0));
  for (int64_t c = 0; c < 32; ++c) {
    EXPECT_EQ(w.data()[c], std::ldexp(E2M1ToFloat(CodeOf(0, 0, c)), -127)) << c;
    EXPECT_EQ(w.data()[32 + c], std::ldexp(E2M1ToFloat(CodeOf(0, 0, 32 + c)), 127)) << c;  // 6 x 2^127 = inf
  }
}

TEST(Mxfp4Test, RefusesWhatIsNotMxfp4) {
  testing::TempDir dir;
  {
    std::unique_ptr<Checkpoint> ckpt = Open(dir, Tensors());
    ASSERT_NE(ckpt, nullptr);
    EXPECT_THAT(ReadMxfp4Expert(*ckpt, "w", kExperts, kRows, 48, 0),
                StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("\"w\""), HasSubstr("multiple of 32"))));
    EXPECT_THAT(ReadMxfp4Expert(*ckpt, "w", kExperts, kRows + 1, kCols, 0),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("w_blocks")));
    EXPECT_THAT(ReadMxfp4Expert(*ckpt, "v", kExperts, kRows, kCols, 0),
                StatusIs(absl::StatusCode::kNotFound, HasSubstr("v_blocks")));
  }
  std::vector<StoredTensor> t = Tensors();
  t[1].bytes[3] = static_cast<char>(255);  // expert 0, row 1, block 1
  {
    testing::TempDir nan_dir;
    std::unique_ptr<Checkpoint> ckpt = Open(nan_dir, t);
    ASSERT_NE(ckpt, nullptr);
    EXPECT_THAT(ReadMxfp4Expert(*ckpt, "w", kExperts, kRows, kCols, 0),
                StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("w_scales\"[0, 1, 1]"), HasSubstr("NaN"))));
    // The other expert reads.
    EXPECT_TRUE(ReadMxfp4Expert(*ckpt, "w", kExperts, kRows, kCols, 1).ok());
  }
  t = Tensors();
  t[1].dtype = "F16";  // the same bytes, another dtype
  t[1].shape = {kExperts, kRows, 1};
  testing::TempDir f16_dir;
  std::unique_ptr<Checkpoint> ckpt = Open(f16_dir, t);
  ASSERT_NE(ckpt, nullptr);
  EXPECT_THAT(ReadMxfp4Expert(*ckpt, "w", kExperts, kRows, kCols, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("w_scales"), HasSubstr("U8 expected"))));
}

}  // namespace
}  // namespace shardserve

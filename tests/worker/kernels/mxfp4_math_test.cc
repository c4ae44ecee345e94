// MXFP4 weights kept as stored (DType::kMxfp4), on the CPU. The shared math the CUDA kernels run
// (kernels/shared/mxfp4_math.h) decodes every code with every scale byte to common/fp8's value bit
// for bit; a matrix read by common/fp8's ReadMxfp4ExpertCodes decodes, row by row, to what
// ReadMxfp4Expert (the dequantizing loader's reader) gives; the CPU kernels decode to the same
// values (AVX2's shuffle too) and their products match a double-precision reference over those
// weights, in every path (fused decode GEMV, blocked kernel and sgemm on widened chunks), with bias
// and accumulation; the backend validates the weights.
#include "worker/kernels/shared/mxfp4_math.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/fp8/mxfp4_weights.h"
#include "common/tensor/dtype.h"
#include "tests/testing/safetensors_file.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "tests/worker/kernels/random_values.h"
#include "worker/kernels/backend.h"
#include "worker/kernels/cpu/mxfp4.h"
#include "worker/kernels/registry.h"

namespace shardserve::kernels {
namespace {

using ::shardserve::testing::StatusIs;
using ::testing::HasSubstr;

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

TEST(Mxfp4MathTest, EveryCodeWithEveryScaleIsCommonFp8sValue) {
  for (int s = 0; s < 255; ++s) {
    for (int c = 0; c < 16; ++c) {
      const float want = std::ldexp(E2M1ToFloat(static_cast<uint8_t>(c)), s - 127);
      const float got = E2M1Decode(static_cast<uint8_t>(c | 0x50)) * E8M0Scale(static_cast<uint8_t>(s));
      ASSERT_EQ(Bits(got), Bits(want)) << "code " << c << " scale byte " << s;
    }
  }
  EXPECT_TRUE(std::isnan(E8M0Scale(255)));
  EXPECT_EQ(E8M0Scale(127), 1.0f);
  EXPECT_EQ(E8M0Scale(0), std::ldexp(1.0f, -127));  // subnormal, exact
  EXPECT_TRUE(std::isinf(E2M1Decode(7) * E8M0Scale(254)));
}

// A random MXFP4 matrix [rows, cols] as stored: any code, and scale bytes over the whole range but
// 255 (every 7th block takes an extreme one, 0 or 254, whose products are subnormal or infinite
// when `extremes`).
struct Matrix {
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> codes, scales;
};

Matrix RandomMatrix(int64_t rows, int64_t cols, uint32_t seed, bool extremes) {
  std::mt19937 rng(seed);
  Matrix m{rows, cols, std::vector<uint8_t>(static_cast<size_t>(rows * cols / 2)),
           std::vector<uint8_t>(static_cast<size_t>(rows * cols / kMxfp4Block))};
  for (uint8_t& b : m.codes) b = static_cast<uint8_t>(rng() & 0xffu);
  for (size_t i = 0; i < m.scales.size(); ++i) {
    // 2^-6 .. 2^1: products of a few hundred terms stay far from f32's range.
    m.scales[i] = static_cast<uint8_t>(121 + rng() % 8);
    if (extremes && i % 7 == 3) m.scales[i] = (i / 7) % 2 == 0 ? 0 : 254;
  }
  return m;
}

std::vector<float> Dequantized(const Matrix& m) {
  std::vector<float> w(static_cast<size_t>(m.rows * m.cols));
  for (int64_t r = 0; r < m.rows; ++r) Mxfp4DequantizeRow(m.codes.data(), m.scales.data(), r, m.cols, w.data() + r * m.cols);
  return w;
}

TEST(Mxfp4MathTest, RowsDecodeToTheLoadersValues) {
  const Matrix m = RandomMatrix(5, 96, 11, true);
  // Stored as one expert of a stacked [2, 5, 96] checkpoint tensor (expert 1 is m).
  std::string blocks(static_cast<size_t>(m.rows * m.cols / 2), '\x00'), scales(m.scales.size(), '\x7f');
  blocks.append(m.codes.begin(), m.codes.end());
  scales.append(m.scales.begin(), m.scales.end());
  const int64_t groups = m.cols / kMxfp4Block;
  testing::TempDir dir;
  const std::string path = dir.Write("model.safetensors",
                                     testing::SafetensorsFile({{"w_blocks", "U8", {2, m.rows, groups, 16}, blocks},
                                                               {"w_scales", "U8", {2, m.rows, groups}, scales}}));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::OpenFile(path));
  ASSERT_OK_AND_ASSIGN(const Mxfp4Matrix stored, ReadMxfp4ExpertCodes(*ckpt, "w", 2, m.rows, m.cols, 1));
  EXPECT_EQ(stored.codes, m.codes);
  EXPECT_EQ(stored.scales, m.scales);
  ASSERT_OK_AND_ASSIGN(const HostTensor loaded, ReadMxfp4Expert(*ckpt, "w", 2, m.rows, m.cols, 1));
  const std::vector<float> w = Dequantized(m);
  std::vector<float> widened(w.size());
  cpu::Mxfp4DequantizeRows(m.codes.data(), m.scales.data(), m.cols, 0, m.rows, widened.data());
  for (int64_t r = 0; r < m.rows; ++r) {
    for (int64_t c = 0; c < m.cols; ++c) {
      const size_t i = static_cast<size_t>(r * m.cols + c);
      ASSERT_EQ(Bits(w[i]), Bits(loaded.data()[i])) << r << " " << c;
      ASSERT_EQ(Bits(Mxfp4At(m.codes.data(), m.scales.data(), m.cols, r, c)), Bits(w[i])) << r << " " << c;
      ASSERT_EQ(Bits(stored.At(r, c)), Bits(w[i])) << r << " " << c;
      // The CPU kernels' decoder: the same value (AVX2 gives +0 for the code -0).
      ASSERT_EQ(widened[i], w[i]) << r << " " << c;
    }
  }
  // A row range starting inside the matrix.
  std::vector<float> tail(static_cast<size_t>(2 * m.cols));
  cpu::Mxfp4DequantizeRows(m.codes.data(), m.scales.data(), m.cols, 3, 5, tail.data());
  EXPECT_TRUE(std::equal(tail.begin(), tail.end(), w.begin() + 3 * m.cols));
}

struct LinearCase {
  int64_t tokens, in, out;
  bool bias, accumulate;
};

class Mxfp4LinearTest : public ::testing::TestWithParam<LinearCase> {};

// The CPU backend's Linear on kMxfp4 weights against the double reference over the same weights
// (and ReferenceLinearMxfp4 against a plain double sum over the dequantized matrix): 1-4 tokens take
// the fused GEMV, 5 and 33 the blocked kernel on widened rows, 300 sgemm (with a [700, 512] matrix
// widened in two chunks).
TEST_P(Mxfp4LinearTest, MatchesTheDoubleReference) {
  const LinearCase c = GetParam();
  const Matrix m = RandomMatrix(c.out, c.in, 7 + static_cast<uint32_t>(c.tokens), false);
  const std::vector<float> x = Random(static_cast<size_t>(c.tokens * c.in), 8);
  const std::vector<float> bias = Random(static_cast<size_t>(c.out), 9);
  const std::vector<float> y0 = Random(static_cast<size_t>(c.tokens * c.out), 10);
  const float* b = c.bias ? bias.data() : nullptr;

  std::vector<float> want = y0;
  cpu::ReferenceLinearMxfp4(x.data(), m.codes.data(), m.scales.data(), b, want.data(), c.tokens, c.in, c.out,
                            c.accumulate);
  const std::vector<float> w = Dequantized(m);
  for (int64_t t = 0; t < c.tokens; ++t) {
    for (int64_t o = 0; o < c.out; ++o) {
      double s = b != nullptr ? b[o] : 0.0;
      for (int64_t k = 0; k < c.in; ++k) s += static_cast<double>(w[o * c.in + k]) * x[t * c.in + k];
      const double plain = (c.accumulate ? y0[t * c.out + o] : 0.0f) + static_cast<float>(s);
      ASSERT_NEAR(want[t * c.out + o], plain, 1e-5 * (1 + std::abs(plain)));
    }
  }

  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> backend, CreateBackend({}));
  std::vector<float> y = y0;
  const absl::Status st = backend->Linear({.x = x.data(), .w = WeightView::Mxfp4(m.codes.data(), m.scales.data()),
                                           .bias = b, .y = y.data(), .tokens = c.tokens, .in = c.in, .out = c.out,
                                           .accumulate = c.accumulate});
  ASSERT_TRUE(st.ok()) << st;
  double max_ref = 0;
  for (float v : want) max_ref = std::max(max_ref, static_cast<double>(std::abs(v)));
  for (size_t i = 0; i < y.size(); ++i) {
    ASSERT_NEAR(y[i], want[i], 2e-5 * max_ref) << "element " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, Mxfp4LinearTest,
                         ::testing::Values(LinearCase{1, 64, 7, false, false}, LinearCase{1, 2880, 33, true, false},
                                           LinearCase{2, 96, 40, true, true}, LinearCase{3, 128, 17, false, true},
                                           LinearCase{4, 512, 65, true, false}, LinearCase{5, 256, 37, true, true},
                                           LinearCase{33, 96, 70, false, false},
                                           LinearCase{300, 512, 700, true, true}),
                         [](const ::testing::TestParamInfo<LinearCase>& param) {
                           const LinearCase& c = param.param;
                           return "t" + std::to_string(c.tokens) + "_in" + std::to_string(c.in) + "_out" +
                                  std::to_string(c.out) + (c.bias ? "_bias" : "") + (c.accumulate ? "_acc" : "");
                         });

TEST(Mxfp4LinearValidationTest, RefusesWeightsWithoutScalesOrWhole32ColumnBlocks) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> backend, CreateBackend({}));
  EXPECT_TRUE(backend->SupportsOp(Op::kLinear, DType::kMxfp4));
  EXPECT_FALSE(backend->SupportsOp(Op::kEmbedding, DType::kMxfp4));
  const Matrix m = RandomMatrix(2, 64, 3, false);
  std::vector<float> x(64, 1.0f), y(2, 5.0f);
  EXPECT_THAT(backend->Linear({.x = x.data(), .w = WeightView::Mxfp4(m.codes.data(), nullptr), .y = y.data(),
                               .tokens = 1, .in = 64, .out = 2}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("MXFP4 weights without scales")));
  EXPECT_THAT(backend->Linear({.x = x.data(), .w = WeightView::Mxfp4(m.codes.data(), m.scales.data()), .y = y.data(),
                               .tokens = 1, .in = 48, .out = 2}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("multiple of 32, got 48")));
  EXPECT_EQ(y, std::vector<float>(2, 5.0f));  // untouched
  EXPECT_EQ(Mxfp4MatrixBytes(2880, 2880), 2880 * 2880 / 2 + 2880 * 90);
  EXPECT_EQ(DTypeName(DType::kMxfp4), "MXFP4");
  EXPECT_FALSE(ParseDType("MXFP4").ok());  // never a checkpoint dtype
}

}  // namespace
}  // namespace shardserve::kernels

#include "worker/kernels/shared/row_math.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace shardserve::kernels {
namespace {

TEST(RowMathTest, RmsNormMatchesTheFormula) {
  const std::vector<float> x = {1.f, -2.f, 3.f, 0.5f};
  const std::vector<float> w = {1.f, 0.5f, 2.f, -1.f};
  std::vector<float> y(4);
  RmsNormRow(x.data(), w.data(), y.data(), 4, 1e-5f);
  const double ms = (1 + 4 + 9 + 0.25) / 4.0;
  const double inv = 1.0 / std::sqrt(ms + 1e-5);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(y[i], w[i] * x[i] * inv, 1e-6);
}

TEST(RowMathTest, RopeRotatesHalvesAndPreservesNorm) {
  std::vector<float> head = {1.f, 2.f, 3.f, 4.f};  // pairs (1,3) and (2,4)
  const float c[2] = {std::cos(0.3f), std::cos(1.1f)};
  const float s[2] = {std::sin(0.3f), std::sin(1.1f)};
  RopeHead(head.data(), c, s, 4);
  EXPECT_NEAR(head[0], 1 * c[0] - 3 * s[0], 1e-6);
  EXPECT_NEAR(head[2], 3 * c[0] + 1 * s[0], 1e-6);
  EXPECT_NEAR(head[1], 2 * c[1] - 4 * s[1], 1e-6);
  EXPECT_NEAR(head[3], 4 * c[1] + 2 * s[1], 1e-6);
  EXPECT_NEAR(head[0] * head[0] + head[2] * head[2], 10.0, 1e-5);
}

TEST(RowMathTest, SoftmaxIsStableForLargeLogits) {
  std::vector<float> x = {1000.f, 1001.f, 999.f};
  SoftmaxRow(x.data(), 3);
  EXPECT_NEAR(x[0] + x[1] + x[2], 1.0, 1e-6);
  EXPECT_NEAR(x[1] / x[0], std::exp(1.0), 1e-4);
}

TEST(RowMathTest, RouteTopKPicksLargestAndRenormalises) {
  const float logits[5] = {0.1f, 2.f, -1.f, 1.5f, 2.f};
  float probs[5];
  int experts[2];
  float weights[2];
  RouteTopK(logits, probs, 5, 2, /*renormalize=*/false, experts, weights);
  EXPECT_EQ(experts[0], 1);  // tie with 4: lower index first
  EXPECT_EQ(experts[1], 4);
  EXPECT_NEAR(weights[0], probs[1], 1e-7);
  EXPECT_LT(weights[0] + weights[1], 1.0f);
  RouteTopK(logits, probs, 5, 2, /*renormalize=*/true, experts, weights);
  EXPECT_NEAR(weights[0] + weights[1], 1.0f, 1e-6);
  EXPECT_NEAR(weights[0], 0.5f, 1e-6);
}

}  // namespace
}  // namespace shardserve::kernels

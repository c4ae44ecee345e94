#include "worker/kernels/shared/moe_math.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

namespace shardserve::kernels {
namespace {

TEST(GroupByExpertTest, GroupsChoicesByExpertInTokenOrder) {
  // 4 tokens x top-2 over 5 experts; expert 3 is chosen by nobody.
  const std::vector<int32_t> experts = {2, 0, 0, 4, 2, 1, 4, 0};
  const std::vector<float> weights = {.6f, .4f, .7f, .3f, .5f, .5f, .9f, .1f};
  std::vector<int32_t> offsets(6), rows(8), fill(5);
  std::vector<float> scales(8);
  GroupByExpert(experts.data(), weights.data(), 4, 2, 5, offsets.data(), rows.data(), scales.data(), fill.data());
  EXPECT_EQ(offsets, (std::vector<int32_t>{0, 3, 4, 6, 6, 8}));
  EXPECT_EQ(rows, (std::vector<int32_t>{0, 1, 3, 2, 0, 2, 1, 3}));
  EXPECT_EQ(scales, (std::vector<float>{.4f, .7f, .1f, .5f, .6f, .5f, .3f, .9f}));
}

TEST(GroupByExpertTest, UngroupingRestoresEveryChoice) {
  // Random routings: every (token, choice) appears exactly once, under its expert, with its weight.
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    const int tokens = 1 + static_cast<int>(rng() % 40), k = 1 + static_cast<int>(rng() % 4);
    const int num_experts = k + static_cast<int>(rng() % 9);
    std::vector<int32_t> experts(static_cast<size_t>(tokens * k));
    std::vector<float> weights(experts.size());
    for (size_t i = 0; i < experts.size(); ++i) {
      experts[i] = static_cast<int32_t>(rng() % static_cast<uint32_t>(num_experts));
      weights[i] = static_cast<float>(i) + 0.5f;  // distinct: identifies the choice
    }
    std::vector<int32_t> offsets(static_cast<size_t>(num_experts + 1)), rows(experts.size()),
        fill(static_cast<size_t>(num_experts));
    std::vector<float> scales(experts.size());
    GroupByExpert(experts.data(), weights.data(), tokens, k, num_experts, offsets.data(), rows.data(), scales.data(),
                  fill.data());
    std::vector<int> seen(experts.size(), 0);
    for (int e = 0; e < num_experts; ++e) {
      for (int32_t at = offsets[e]; at < offsets[e + 1]; ++at) {
        const int choice = static_cast<int>(scales[at]);  // weights[i] = i + 0.5
        ASSERT_EQ(experts[choice], e);
        ASSERT_EQ(rows[at], choice / k);
        if (at > offsets[e]) {
          ASSERT_LE(rows[at - 1], rows[at]);  // token order within an expert
        }
        ++seen[choice];
      }
    }
    EXPECT_EQ(offsets[num_experts], tokens * k);
    for (int s : seen) ASSERT_EQ(s, 1);
  }
}

}  // namespace
}  // namespace shardserve::kernels

namespace shardserve::kernels {
namespace {

float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// 8 experts in 4 groups of 2, 2 groups kept, top-2. Scores s = sigmoid(logit); the bias moves the
// choice: group scores (sum of the group's two biased scores) pick groups 3 and 1 although expert 0
// has the largest unbiased score, and inside them the biased order picks experts 6 and 7 (expert 2
// has a larger score than 3 but a negative bias); the weights are the unbiased scores.
TEST(MoeMathTest, RouteSigmoidGroupedUsesTheBiasOnlyToChoose) {
  const float logits[8] = {3.0f, -3.0f, 1.0f, 0.5f, -1.0f, -1.0f, 0.8f, 0.7f};
  const float bias[8] = {0.f, 0.f, -0.5f, 0.2f, 0.f, 0.f, 0.3f, 0.3f};
  float scratch[8 + 4];
  int experts[2];
  float weights[2];
  RouteSigmoidGrouped(logits, bias, scratch, 8, 2, 4, 2, /*renormalize=*/false, /*scaling=*/1.0f, experts, weights);
  // Biased group scores: g0 = s(3) + s(-3) = 1.0, g1 = s(1) - 0.5 + s(0.5) + 0.2 = 1.054,
  // g2 = 2 s(-1) = 0.538, g3 = s(0.8) + s(0.7) + 0.6 = 1.958: groups 3 and 1.
  EXPECT_EQ(experts[0], 6);  // s(0.8) + 0.3 = 0.990
  EXPECT_EQ(experts[1], 7);  // s(0.7) + 0.3 = 0.968 > s(0.5) + 0.2 = 0.822 > s(1) - 0.5 = 0.231
  EXPECT_FLOAT_EQ(weights[0], Sigmoid(0.8f));
  EXPECT_FLOAT_EQ(weights[1], Sigmoid(0.7f));
  // Renormalised, then scaled.
  RouteSigmoidGrouped(logits, bias, scratch, 8, 2, 4, 2, /*renormalize=*/true, /*scaling=*/2.5f, experts, weights);
  EXPECT_NEAR(weights[0] + weights[1], 2.5f, 1e-6);
  EXPECT_NEAR(weights[0] / weights[1], Sigmoid(0.8f) / Sigmoid(0.7f), 1e-6);
  // One group: plain top-k on the biased scores; without a bias expert 0 wins.
  RouteSigmoidGrouped(logits, nullptr, scratch, 8, 2, 1, 1, false, 1.0f, experts, weights);
  EXPECT_EQ(experts[0], 0);
  EXPECT_EQ(experts[1], 2);
}

}  // namespace
}  // namespace shardserve::kernels

namespace shardserve::kernels {
namespace {

// Softmax of `logits` computed in double, for the expected weights.
std::vector<double> Softmax(const float* logits, int n) {
  double m = logits[0], sum = 0;
  for (int i = 1; i < n; ++i) m = std::max(m, static_cast<double>(logits[i]));
  std::vector<double> p(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) sum += p[static_cast<size_t>(i)] = std::exp(logits[i] - m);
  for (double& v : p) v /= sum;
  return p;
}

// DeepSeek-V2's group_limited_greedy: 8 experts in 4 groups of 2, the 2 groups with the largest best
// score kept, top-3 inside them. Group bests: g0 = expert 0 (logit 2.0), g1 = expert 2 (1.9),
// g2 = expert 5 (2.1), g3 = expert 6 (0.5): groups 2 and 0 are kept, so expert 2 (the third largest
// score overall) is out and expert 4 (logit 1.5, in group 2) is chosen instead. Weights: the
// softmax over all 8 experts, not renormalised, times the scaling factor.
TEST(MoeMathTest, RouteSoftmaxGroupLimitedChoosesWithinTheBestGroups) {
  const float logits[8] = {2.0f, -1.0f, 1.9f, 1.8f, 1.5f, 2.1f, 0.5f, 0.4f};
  const std::vector<double> p = Softmax(logits, 8);
  float scratch[8 + 8];  // num_experts + n_group, for up to 8 groups
  int experts[3];
  float weights[3];
  RouteSoftmaxGroupLimited(logits, scratch, 8, 3, 4, 2, /*scaling=*/16.0f, experts, weights);
  EXPECT_EQ(experts[0], 5);
  EXPECT_EQ(experts[1], 0);
  EXPECT_EQ(experts[2], 4);
  EXPECT_NEAR(weights[0], 16.0 * p[5], 1e-5);
  EXPECT_NEAR(weights[1], 16.0 * p[0], 1e-5);
  EXPECT_NEAR(weights[2], 16.0 * p[4], 1e-5);
  // "greedy" (one group): the 3 largest of all, expert 2 included, scaled by 1.
  RouteSoftmaxGroupLimited(logits, scratch, 8, 3, 1, 1, 1.0f, experts, weights);
  EXPECT_EQ(experts[0], 5);
  EXPECT_EQ(experts[1], 0);
  EXPECT_EQ(experts[2], 2);
  EXPECT_NEAR(weights[2], p[2], 1e-6);
  EXPECT_LT(weights[0] + weights[1] + weights[2], 1.0f);  // never renormalised
  // One expert per group (8 groups), 3 kept: the top-3 groups are the top-3 experts.
  RouteSoftmaxGroupLimited(logits, scratch, 8, 2, 8, 3, 1.0f, experts, weights);
  EXPECT_EQ(experts[0], 5);
  EXPECT_EQ(experts[1], 0);
}

}  // namespace
}  // namespace shardserve::kernels

#include "worker/kernels/shared/moe_math.h"

#include <gtest/gtest.h>

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

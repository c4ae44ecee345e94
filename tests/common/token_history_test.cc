#include "common/sampling/token_history.h"

#include <map>
#include <random>

#include "gtest/gtest.h"

namespace shardserve {
namespace {

TEST(TokenHistoryTest, DistinctIdsAscendingWithGeneratedCounts) {
  TokenHistory h({7, 3, 7, 1}, /*with_prompt=*/true);
  EXPECT_EQ(h.ids(), (std::vector<int32_t>{1, 3, 7}));
  EXPECT_EQ(h.counts(), (std::vector<int32_t>{0, 0, 0}));
  h.AddGenerated(3);
  h.AddGenerated(5);
  h.AddGenerated(3);
  h.AddGenerated(0);
  EXPECT_EQ(h.ids(), (std::vector<int32_t>{0, 1, 3, 5, 7}));
  EXPECT_EQ(h.counts(), (std::vector<int32_t>{1, 0, 2, 1, 0}));
  // Without the prompt, only generated tokens.
  TokenHistory g({7, 3}, /*with_prompt=*/false);
  EXPECT_TRUE(g.ids().empty());
  g.AddGenerated(7);
  EXPECT_EQ(g.ids(), (std::vector<int32_t>{7}));
  EXPECT_EQ(g.counts(), (std::vector<int32_t>{1}));
}

// Against a plain count of a random sequence.
TEST(TokenHistoryTest, MatchesACountOfTheSequence) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<int32_t> id(0, 50);
  std::vector<int32_t> prompt(40);
  for (int32_t& t : prompt) t = id(rng);
  TokenHistory h(prompt, true);
  std::map<int32_t, int32_t> want;
  for (int32_t t : prompt) want.emplace(t, 0);
  for (int i = 0; i < 300; ++i) {
    const int32_t t = id(rng);
    h.AddGenerated(t);
    ++want[t];
  }
  ASSERT_EQ(h.ids().size(), want.size());
  size_t i = 0;
  for (const auto& [t, n] : want) {
    EXPECT_EQ(h.ids()[i], t);
    EXPECT_EQ(h.counts()[i], n);
    ++i;
  }
}

}  // namespace
}  // namespace shardserve

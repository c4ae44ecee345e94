#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "coordinator/sim/workload.h"
#include "tests/testing/status_matchers.h"

namespace shardserve::sim {
namespace {

using ::shardserve::testing::StatusIs;
using ::testing::HasSubstr;

TEST(WorkloadTest, PoissonArrivalsHaveTheMeanRate) {
  auto w = MakePoissonWorkload({.rate = 50, .duration_s = 200, .prompt_tokens = {10, 20}, .output_tokens = {5, 5}});
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_NEAR(static_cast<double>(w->size()) / 200, 50, 50 * 0.05);
  for (size_t i = 0; i < w->size(); ++i) {
    if (i > 0) {
      EXPECT_GE((*w)[i].arrival_s, (*w)[i - 1].arrival_s);
    }
    EXPECT_GE((*w)[i].prompt_tokens, 10);
    EXPECT_LE((*w)[i].prompt_tokens, 20);
    EXPECT_EQ((*w)[i].output_tokens, 5);
  }
}

TEST(WorkloadTest, ASeedFixesTheWorkload) {
  auto a = MakePoissonWorkload({.rate = 5, .requests = 100, .seed = 3});
  auto b = MakePoissonWorkload({.rate = 5, .requests = 100, .seed = 3});
  auto c = MakePoissonWorkload({.rate = 5, .requests = 100, .seed = 4});
  ASSERT_EQ(a->size(), 100u);
  EXPECT_EQ((*a)[99].arrival_s, (*b)[99].arrival_s);
  EXPECT_NE((*a)[99].arrival_s, (*c)[99].arrival_s);
}

TEST(WorkloadTest, RejectsBadOptions) {
  EXPECT_THAT(MakePoissonWorkload({.rate = 0}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rate")));
  EXPECT_THAT(MakePoissonWorkload({.rate = 1, .prompt_tokens = {5, 4}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("prompt_tokens")));
}

TEST(WorkloadTest, ParsesATrace) {
  auto t = ParseTrace("# arrival prompt output\n0.5 100 20\n\n0.25,50,10\n1\t7\t3\n");
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->size(), 3u);
  EXPECT_DOUBLE_EQ((*t)[0].arrival_s, 0.25);
  EXPECT_EQ((*t)[0].prompt_tokens, 50);
  EXPECT_EQ((*t)[2].output_tokens, 3);
  EXPECT_THAT(ParseTrace("0 1 1\n1 0 5\n"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("line 2")));
  EXPECT_THAT(ParseTrace("x 1 1\n"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("line 1")));
}

TEST(WorkloadTest, PercentilesAreNearestRank) {
  std::vector<double> v;
  for (int i = 1; i <= 100; ++i) v.push_back(i);
  EXPECT_EQ(Percentile(v, 0.5), 50);
  EXPECT_EQ(Percentile(v, 0.99), 99);
  EXPECT_EQ(Percentile(v, 1.0), 100);
  EXPECT_EQ(Percentile({3.0}, 0.99), 3.0);
  EXPECT_EQ(Percentile({}, 0.5), 0);
}

}  // namespace
}  // namespace shardserve::sim

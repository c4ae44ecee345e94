// ExplainPlan: the search recorded as data. It must agree with MakePlan (same code path), and its
// reasons must name the figures that decided each layout.
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "common/model_spec/model_spec.h"
#include "common/plan/plan.h"
#include "coordinator/planner/planner.h"
#include "tests/coordinator/planner/model_100m.h"
#include "tests/testing/status_matchers.h"

namespace shardserve {
namespace {

using ::shardserve::testing::IsOk;
using ::shardserve::testing::StatusIs;
using ::testing::HasSubstr;

constexpr int64_t kMB = 1'000'000;
constexpr int64_t kGB = 1'000'000'000;

using ::shardserve::testing::k100MKvBytesPerToken;
using ::shardserve::testing::k100MWeightBytes;
using ::shardserve::testing::Model100M;

WorkerInventory Worker(const std::string& id, int64_t free_bytes) {
  return WorkerInventory{id, "node-" + id, {{DeviceKind::kCpu, 0, free_bytes + kGB, free_bytes}}};
}

TEST(PlanExplanationTest, RecordsEveryLayoutTriedWithItsReasonAndChoosesMakePlansPlan) {
  // a holds the model; b and c hold only part of it. The search: pp=1 with 3 replicas cannot fit
  // by total memory, with 2 the pipeline on b does not fit, with 1 (on a) it does.
  const std::vector<WorkerInventory> workers = {Worker("a", 1 * kGB), Worker("b", 400 * kMB), Worker("c", 400 * kMB)};
  absl::StatusOr<PlanExplanation> ex = ExplainPlan(Model100M(), workers, PlanPolicy{});
  ASSERT_THAT(ex, IsOk());
  EXPECT_EQ(ex->model_weight_bytes, k100MWeightBytes);
  EXPECT_EQ(ex->min_kv_tokens, 1024);
  EXPECT_EQ(ex->eligible_workers, 3);
  ASSERT_EQ(ex->layouts.size(), 3u);

  const LayoutEvaluation& three = ex->layouts[0];
  EXPECT_EQ(three.pp, 1);
  EXPECT_EQ(three.replicas, 3);
  EXPECT_EQ(three.verdict, LayoutVerdict::kTooLittleMemory);
  EXPECT_EQ(three.available_bytes, 1800 * kMB);
  EXPECT_EQ(three.needed_bytes, 3 * (k100MWeightBytes + 1024 * k100MKvBytesPerToken));
  EXPECT_THAT(three.reason, HasSubstr("the 3 largest workers have 1.8 GB"));

  const LayoutEvaluation& two = ex->layouts[1];
  EXPECT_EQ(two.replicas, 2);
  EXPECT_EQ(two.verdict, LayoutVerdict::kNoPartitionFits);
  ASSERT_EQ(two.stages.size(), 1u);
  EXPECT_EQ(two.stages[0].worker_id, "b");  // the smaller of the two replicas' workers
  EXPECT_FALSE(two.stages[0].fits);
  EXPECT_EQ(two.stages[0].weight_bytes_per_rank, k100MWeightBytes);
  EXPECT_EQ(two.stages[0].room_per_rank, 400 * kMB);
  EXPECT_THAT(two.reason, HasSubstr("worker \"b\" (tp=1, layers 0..12 + embedding + lm_head): 536.4 MB of weights per "
                                    "rank > 400.0 MB free per rank"));

  const LayoutEvaluation& one = ex->layouts[2];
  EXPECT_EQ(one.replicas, 1);
  EXPECT_EQ(one.verdict, LayoutVerdict::kChosen);
  ASSERT_EQ(one.stages.size(), 1u);
  const StageEvaluation& st = one.stages[0];
  EXPECT_EQ(st.worker_id, "a");
  EXPECT_TRUE(st.fits);
  EXPECT_EQ(st.weight_bytes_per_rank, k100MWeightBytes);
  EXPECT_EQ(st.room_per_rank, 1 * kGB);
  EXPECT_EQ(st.kv_tokens, static_cast<int64_t>(0.9 * static_cast<double>(kGB - k100MWeightBytes) /
                                               static_cast<double>(k100MKvBytesPerToken)));
  EXPECT_EQ(st.kv_bytes_per_rank, st.kv_tokens * k100MKvBytesPerToken);

  // The explanation's plan is MakePlan's, stage for stage.
  absl::StatusOr<Plan> plan = MakePlan(Model100M(), workers, PlanPolicy{});
  ASSERT_THAT(plan, IsOk());
  ASSERT_THAT(ex->plan, IsOk());
  EXPECT_EQ(PlanToString(*ex->plan), PlanToString(*plan));
  ASSERT_EQ(plan->replicas.size(), 1u);
  EXPECT_EQ(plan->replicas[0].stages[0].worker_id, st.worker_id);
  EXPECT_EQ(plan->replicas[0].stages[0].kv_tokens, st.kv_tokens);
}

TEST(PlanExplanationTest, APipelineThatCannotBeSplitSaysWhereTheLayersRunOut) {
  // pp = 2 on a (400 MB) and b (230 MB): a takes as many layers as fit next to the embedding; b
  // cannot hold the rest with the lm_head.
  const std::vector<WorkerInventory> workers = {Worker("a", 400 * kMB), Worker("b", 230 * kMB)};
  PlanPolicy policy;
  policy.pp = 2;
  absl::StatusOr<PlanExplanation> ex = ExplainPlan(Model100M(), workers, policy);
  ASSERT_THAT(ex, IsOk());
  ASSERT_EQ(ex->layouts.size(), 1u);
  const LayoutEvaluation& l = ex->layouts[0];
  EXPECT_EQ(l.verdict, LayoutVerdict::kNoPartitionFits);
  ASSERT_EQ(l.stages.size(), 2u);
  EXPECT_TRUE(l.stages[0].fits);
  EXPECT_EQ(l.stages[0].layer_begin, 0);
  EXPECT_FALSE(l.stages[1].fits);
  EXPECT_EQ(l.stages[1].layer_begin, l.stages[0].layer_end);
  EXPECT_EQ(l.stages[1].layer_end, 12);
  EXPECT_THAT(l.reason, HasSubstr(absl::StrCat("the first 1 stage holds at most layers 0..", l.stages[0].layer_end,
                                               ", so worker \"b\"")));
  EXPECT_GT(l.stages[1].weight_bytes_per_rank + l.stages[1].min_kv_bytes_per_rank, l.stages[1].room_per_rank);
  // And MakePlan fails the same way.
  EXPECT_THAT(ex->plan, StatusIs(absl::StatusCode::kResourceExhausted, ::testing::_));
  EXPECT_THAT(MakePlan(Model100M(), workers, policy), StatusIs(absl::StatusCode::kResourceExhausted, ::testing::_));
}

TEST(PlanExplanationTest, ErrorsBeforeTheSearchAreReturnedAsMakePlanReturnsThem) {
  PlanPolicy policy;
  policy.tp = -1;
  EXPECT_THAT(ExplainPlan(Model100M(), {Worker("a", kGB)}, policy), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_THAT(ExplainPlan(Model100M(), {}, PlanPolicy{}), StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
}

TEST(PlanExplanationTest, AgreesWithMakePlanOnRandomInventories) {
  std::mt19937 rng(24);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<WorkerInventory> workers;
    const int n = 1 + static_cast<int>(rng() % 6);
    for (int w = 0; w < n; ++w) {
      workers.push_back(Worker(absl::StrCat("w", w), static_cast<int64_t>(100 + rng() % 900) * kMB));
    }
    const absl::StatusOr<Plan> plan = MakePlan(Model100M(), workers, PlanPolicy{});
    const absl::StatusOr<PlanExplanation> ex = ExplainPlan(Model100M(), workers, PlanPolicy{});
    ASSERT_THAT(ex, IsOk());
    ASSERT_EQ(ex->plan.ok(), plan.ok()) << trial;
    if (plan.ok()) {
      EXPECT_EQ(PlanToString(*ex->plan), PlanToString(*plan)) << trial;
      ASSERT_FALSE(ex->layouts.empty());
      EXPECT_EQ(ex->layouts.back().verdict, LayoutVerdict::kChosen);
      EXPECT_EQ(ex->layouts.back().pp, static_cast<int>(plan->replicas[0].stages.size()));
      EXPECT_EQ(ex->layouts.back().replicas, static_cast<int>(plan->replicas.size()));
    } else {
      EXPECT_EQ(ex->plan.status(), plan.status()) << trial;
      for (const LayoutEvaluation& l : ex->layouts) EXPECT_NE(l.verdict, LayoutVerdict::kChosen);
    }
  }
}

}  // namespace
}  // namespace shardserve

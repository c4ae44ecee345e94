#include "common/plan/plan.h"

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/model_spec/model_spec.h"
#include "tests/testing/status_matchers.h"

namespace shardserve {
namespace {

using ::shardserve::testing::IsOk;
using ::shardserve::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

ModelSpec Llama(int64_t heads, int64_t kv_heads, int64_t intermediate) {
  ModelSpec s;
  s.vocab_size = 100;
  s.hidden_size = heads * 16;
  s.head_dim = 16;
  s.num_heads = heads;
  s.num_kv_heads = kv_heads;
  s.intermediate_size = intermediate;
  s.num_layers = 2;
  s.max_position_embeddings = 64;
  return s;
}

TEST(FormatBytesTest, DecimalUnitsWithOneDecimal) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(999), "999 B");
  EXPECT_EQ(FormatBytes(1000), "1.0 KB");
  EXPECT_EQ(FormatBytes(12345), "12.3 KB");
  EXPECT_EQ(FormatBytes(3'200'000'000), "3.2 GB");
  EXPECT_EQ(FormatBytes(999'960'000), "1.0 GB");  // rounds up into the next unit, never "1000.0 MB"
  EXPECT_EQ(FormatBytes(-2'000'000), "-2.0 MB");
  EXPECT_EQ(FormatBytes(std::numeric_limits<int64_t>::min()), "-9.2 EB");
}

TEST(DeviceKindNameTest, Names) {
  EXPECT_EQ(DeviceKindName(DeviceKind::kCpu), "cpu");
  EXPECT_EQ(DeviceKindName(DeviceKind::kCuda), "cuda");
}

TEST(ValidateTensorParallelSizeTest, DividesHeadsAndWidths) {
  EXPECT_THAT(ValidateTensorParallelSize(Llama(8, 8, 64), 1), IsOk());
  EXPECT_THAT(ValidateTensorParallelSize(Llama(8, 8, 64), 8), IsOk());
  EXPECT_THAT(ValidateTensorParallelSize(Llama(8, 8, 64), 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(">= 1")));
  EXPECT_THAT(ValidateTensorParallelSize(Llama(4, 4, 64), 3),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_attention_heads (4)")));
  EXPECT_THAT(ValidateTensorParallelSize(Llama(8, 8, 36), 8),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("intermediate_size (36)")));
}

TEST(ValidateTensorParallelSizeTest, KvHeadsReplicatedOrSplit) {
  EXPECT_THAT(ValidateTensorParallelSize(Llama(8, 2, 64), 4), IsOk());  // 2 kv heads divide 4 ranks
  EXPECT_THAT(ValidateTensorParallelSize(Llama(8, 2, 64), 8), IsOk());
  EXPECT_THAT(ValidateTensorParallelSize(Llama(8, 4, 64), 2), IsOk());  // 2 ranks divide 4 kv heads
  // 12 heads, 6 kv heads, tp 4: 4 divides 12 but neither 6 % 4 nor 4 % 6 is 0.
  EXPECT_THAT(ValidateTensorParallelSize(Llama(12, 6, 64), 4),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_key_value_heads (6)")));
}

TEST(ValidateTensorParallelSizeTest, ExpertWidths) {
  ModelSpec s = Llama(8, 8, 64);
  s.moe.num_experts = 4;
  s.moe.top_k = 2;
  s.moe.expert_intermediate_size = 6;
  s.moe.sparse_layers = std::vector<bool>(static_cast<size_t>(s.num_layers), true);
  // At least as many experts as ranks: whole experts (expert parallel), any expert width.
  EXPECT_THAT(ValidateTensorParallelSize(s, 2), IsOk());
  EXPECT_THAT(ValidateTensorParallelSize(s, 4), IsOk());
  // Fewer experts than ranks: every expert is split, so tp must divide its width.
  EXPECT_THAT(ValidateTensorParallelSize(s, 8),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expert intermediate size (6)")));
  s.moe.expert_intermediate_size = 8;
  s.moe.shared_expert_intermediate_size = 10;
  EXPECT_THAT(ValidateTensorParallelSize(s, 4),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shared expert intermediate size (10)")));
}

Plan TwoStagePlan() {
  Plan plan;
  plan.max_seq_len = 1024;
  Pipeline& p = plan.replicas.emplace_back();
  StageSpec a;
  a.worker_id = "worker-a";
  a.node_name = "node-a";
  a.layer_begin = 0;
  a.layer_end = 7;
  a.has_embedding = true;
  a.tp = 2;
  a.device_kind = DeviceKind::kCuda;
  a.devices = {0, 1};
  a.predicted_weight_bytes_per_rank = 300'000'000;
  a.kv_bytes_per_rank = 50'000'000;
  a.kv_tokens = 4096;
  a.cost_share = 0.5;
  StageSpec b = a;
  b.worker_id = "worker-b";
  b.node_name = "node-b";
  b.layer_begin = 7;
  b.layer_end = 12;
  b.has_embedding = false;
  b.has_lm_head = true;
  p.stages = {a, b};
  LayerExperts le;
  le.layer = 3;
  le.experts = {{"worker-a", 0, 0, false}, {"worker-a", 1, 1, false}, {"worker-c", 0, 0, true}};
  p.experts = {le};
  plan.expert_hosts.push_back({"worker-c", "node-c", DeviceKind::kCpu, 0, 1, 6'000'000});
  return plan;
}

TEST(PipelineTest, NumRemoteExperts) { EXPECT_EQ(TwoStagePlan().replicas[0].NumRemoteExperts(), 1); }

TEST(PlanToStringTest, ShowsStagesExpertsAndHosts) {
  const std::string text = PlanToString(TwoStagePlan());
  EXPECT_THAT(text, AllOf(HasSubstr("1 replica x 2 stages"), HasSubstr("max_seq_len 1024"),
                          HasSubstr("KV capacity 4096 tokens"), HasSubstr("1 remote experts"), HasSubstr("worker-a"),
                          HasSubstr("node-b"), HasSubstr("[0, 7)"), HasSubstr("[7, 12)"), HasSubstr("cuda:0,1"),
                          HasSubstr("300.0 MB"), HasSubstr("50.0 MB"), HasSubstr("0.500"), HasSubstr("expert hosts:"),
                          HasSubstr("worker-c"), HasSubstr("cpu:0"), HasSubstr("6.0 MB")));
  // One header line and one row per stage, columns aligned.
  EXPECT_THAT(text, HasSubstr("  stage  worker    node    layers"));
}

TEST(PlanToStringTest, EmptyPlan) { EXPECT_EQ(PlanToString(Plan{}), "plan: 0 replicas x 0 stages, max_seq_len 0\n"); }

}  // namespace
}  // namespace shardserve

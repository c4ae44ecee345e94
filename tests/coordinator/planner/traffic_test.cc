// EstimateTraffic against figures worked out by hand from the definitions in traffic.h.
#include "coordinator/planner/traffic.h"

#include <gtest/gtest.h>

namespace shardserve {
namespace {

ModelSpec Spec() {
  ModelSpec spec;
  spec.hidden_size = 1000;  // a 4,000-byte f32 row
  spec.vocab_size = 1001;
  spec.num_layers = 6;
  spec.moe.num_experts = 4;
  spec.moe.top_k = 2;
  return spec;
}

StageSpec Stage(int64_t begin, int64_t end, int tp, double share) {
  StageSpec st;
  st.layer_begin = begin;
  st.layer_end = end;
  st.tp = tp;
  st.cost_share = share;
  return st;
}

TEST(TrafficTest, TensorParallelPipelineAndSpillFiguresFollowTheDefinitions) {
  Plan plan;
  Pipeline p;
  p.stages = {Stage(0, 2, 2, 0.25), Stage(2, 6, 4, 0.75)};
  p.stages[0].has_embedding = true;
  p.stages[1].has_lm_head = true;
  // Layer 1 (stage 0): one of its four experts on an expert host; layer 4 (stage 1): none.
  p.experts = {{.layer = 1, .experts = {{}, {}, {.remote = true}, {}}}, {.layer = 4, .experts = {{}, {}, {}, {}}}};
  plan.replicas = {p};
  const std::vector<PipelineTraffic> t = EstimateTraffic(Spec(), plan);
  ASSERT_EQ(t.size(), 1u);
  ASSERT_EQ(t[0].stages.size(), 2u);
  // Stage 0: 2 layers x 2 all-reduces x 2 (2 - 1) / 2 x 4,000 bytes; a row to stage 1; expected
  // 2 (top_k) x 1/4 (remote) x 2 (there and back) x 4,000 bytes to the expert host.
  EXPECT_EQ(t[0].stages[0].tp_all_reduce_bytes, 2 * 2 * 4000);
  EXPECT_EQ(t[0].stages[0].logits_all_gather_bytes, 0);
  EXPECT_EQ(t[0].stages[0].next_stage_bytes, 4000);
  EXPECT_DOUBLE_EQ(t[0].stages[0].remote_expert_bytes, 4000.0);
  // Stage 1: 4 layers x 2 x 2 (4 - 1) / 4 x 4,000 = 48,000; logits: 3 slices of ceil(1001 / 4) =
  // 251 floats.
  EXPECT_EQ(t[0].stages[1].tp_all_reduce_bytes, 4 * 2 * 6000);
  EXPECT_EQ(t[0].stages[1].logits_all_gather_bytes, 3 * 251 * 4);
  EXPECT_EQ(t[0].stages[1].next_stage_bytes, 0);
  EXPECT_DOUBLE_EQ(t[0].stages[1].remote_expert_bytes, 0.0);
  // Two stages: idle half the time one micro-batch at a time; pipelined, the 0.75 stage sets the
  // pace and the 0.25 one idles 2/3 of it: average 1 - 1 / (2 x 0.75) = 1/3.
  EXPECT_DOUBLE_EQ(t[0].bubble_one_micro_batch, 0.5);
  EXPECT_NEAR(t[0].bubble_pipelined, 1.0 / 3.0, 1e-12);
}

TEST(TrafficTest, OneRankOneStageMovesNothing) {
  Plan plan;
  plan.replicas = {Pipeline{.stages = {Stage(0, 6, 1, 1.0)}}};
  plan.replicas[0].stages[0].has_lm_head = true;
  const std::vector<PipelineTraffic> t = EstimateTraffic(Spec(), plan);
  ASSERT_EQ(t.size(), 1u);
  const StageTraffic& x = t[0].stages.at(0);
  EXPECT_EQ(x.tp_all_reduce_bytes + x.logits_all_gather_bytes + x.next_stage_bytes, 0);
  EXPECT_EQ(t[0].bubble_one_micro_batch, 0.0);
  EXPECT_EQ(t[0].bubble_pipelined, 0.0);
}

}  // namespace
}  // namespace shardserve

// The coordinator's pipelining decisions, priced with the simulator's roofline (PipelineCost) for
// the layouts the policy must get right: the 100M model on two CPU stages of one machine (one
// micro-batch: a split reads the weights again through the same bus, and the cores do not
// compute two stages at once), the same stages on two machines, and a 70B model on two 8 x H100
// nodes, where pipelining pays once attention or compute, not the weight reads, sets a step's time.
#include "coordinator/sim/pipeline_cost.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log/log.h"
#include "coordinator/scheduler/pipelining.h"
#include "tests/coordinator/planner/model_100m.h"
#include "tests/coordinator/sim/llama_70b.h"
#include "tests/testing/status_matchers.h"

namespace shardserve::sim {
namespace {

using ::shardserve::coordinator::ChooseMicroBatches;
using ::shardserve::coordinator::DescribePipelining;
using ::shardserve::coordinator::PipeliningChoice;
using ::shardserve::coordinator::StepWork;
using ::shardserve::testing::StatusIs;
using ::testing::HasSubstr;

// `n` stages splitting the model's layers evenly, stage s on machine nodes[s].
std::vector<StageSpec> Stages(const ModelSpec& spec, const std::vector<std::string>& nodes, DeviceKind kind, int tp) {
  std::vector<StageSpec> out;
  const int64_t n = static_cast<int64_t>(nodes.size());
  for (int64_t s = 0; s < n; ++s) {
    StageSpec st{.worker_id = absl::StrCat("w", s), .node_name = nodes[static_cast<size_t>(s)],
                 .layer_begin = spec.num_layers * s / n, .layer_end = spec.num_layers * (s + 1) / n,
                 .has_embedding = s == 0, .has_lm_head = s + 1 == n, .tp = tp, .device_kind = kind};
    for (int d = 0; d < tp; ++d) st.devices.push_back(d);
    out.push_back(st);
  }
  return out;
}

std::vector<StepWork> Decodes(int n, int64_t context) {
  return std::vector<StepWork>(static_cast<size_t>(n), StepWork{.pos_begin = context, .tokens = 1, .sample = true});
}

TEST(PipelineCostTest, TwoCpuStagesOfOneMachineSplitSixteenDecodesWhenEachHasItsOwnCores) {
  const ModelSpec spec = testing::Model100M();
  absl::StatusOr<std::unique_ptr<PipelineCost>> cost =
      PipelineCost::Make(spec, Stages(spec, {"host", "host"}, DeviceKind::kCpu, 1), 4, 4, DefaultPipelineProfiles());
  ASSERT_TRUE(cost.ok()) << cost.status();
  EXPECT_EQ((*cost)->SharedGroup(0), (*cost)->SharedGroup(1));
  EXPECT_GE((*cost)->SharedGroup(0), 0);
  // 16 decodes of the 100M model are compute-bound at 110 GFLOP/s; by default each stage computes
  // on cores of its own, so a split lets both work while only the reads share the bus.
  const PipeliningChoice c = ChooseMicroBatches(**cost, Decodes(16, 64), 2, 64);
  EXPECT_EQ(c.micro_batches, 2);
  EXPECT_GT(c.gain, coordinator::kMinPipeliningGain);
  EXPECT_LT(c.gain, 2.0);  // the bus still reads the weights twice
  EXPECT_THAT(DescribePipelining(c, (*cost)->Describe()),
              HasSubstr("2 micro-batches for 16 running sequences (2 CPU stages on one machine"));
  // One client: nothing to split.
  EXPECT_EQ(ChooseMicroBatches(**cost, Decodes(1, 64), 2, 64).micro_batches, 1);
}

TEST(PipelineCostTest, TwoCpuStagesSharingOneMachinesCoresKeepOneMicroBatchForSixteenDecodes) {
  const ModelSpec spec = testing::Model100M();
  PipelineProfiles profiles = DefaultPipelineProfiles();
  profiles.cpu_parallelism.compute = 1.0;  // the stages' arithmetic takes turns on the same cores
  absl::StatusOr<std::unique_ptr<PipelineCost>> cost =
      PipelineCost::Make(spec, Stages(spec, {"host", "host"}, DeviceKind::kCpu, 1), 4, 4, profiles);
  ASSERT_TRUE(cost.ok()) << cost.status();
  const PipeliningChoice c = ChooseMicroBatches(**cost, Decodes(16, 64), 2, 64);
  EXPECT_EQ(c.micro_batches, 1);
  // The reads of a split pass the bus twice; its arithmetic needs the same cores: no real gain.
  EXPECT_LT(c.best_split_gain, coordinator::kMinPipeliningGain);
  EXPECT_THAT(DescribePipelining(c, (*cost)->Describe()),
              HasSubstr("1 micro-batch for 16 running sequences (2 CPU stages on one machine"));
}

TEST(PipelineCostTest, TwoCpuStagesOnTwoMachinesSplitSixteenDecodes) {
  const ModelSpec spec = testing::Model100M();
  absl::StatusOr<std::unique_ptr<PipelineCost>> cost =
      PipelineCost::Make(spec, Stages(spec, {"a", "b"}, DeviceKind::kCpu, 1), 4, 4, DefaultPipelineProfiles());
  ASSERT_TRUE(cost.ok()) << cost.status();
  EXPECT_EQ((*cost)->SharedGroup(0), -1);
  // At 110 GFLOP/s, 16 tokens of a stage's 6 layers take longer to compute than its weights to read
  // (12.4 ms against 5.7), so two machines working at once gain, though each micro-batch reads the
  // weights (and the last stage its lm_head) again and a CPU op takes its reads plus its arithmetic.
  const PipeliningChoice c = ChooseMicroBatches(**cost, Decodes(16, 64), 2, 64);
  EXPECT_EQ(c.micro_batches, 2);
  EXPECT_GT(c.gain, 1.2);
  EXPECT_LT(c.gain, 1.6);
  EXPECT_THAT(DescribePipelining(c, (*cost)->Describe()), HasSubstr("2 micro-batches for 16 running sequences (2 CPU stages on 2 machines"));
}

TEST(PipelineCostTest, GpuStagesAcrossNodesPipelineLargeBatchesOfLongContexts) {
  const ModelSpec spec = testing::Llama70B();
  absl::StatusOr<std::unique_ptr<PipelineCost>> cost =
      PipelineCost::Make(spec, Stages(spec, {"node-0", "node-1"}, DeviceKind::kCuda, 8), 2, 2, DefaultPipelineProfiles());
  ASSERT_TRUE(cost.ok()) << cost.status();
  EXPECT_EQ((*cost)->SharedGroup(0), -1);
  EXPECT_EQ((*cost)->SharedGroup(1), -1);
  // 256 sequences of 2,000 tokens: their KV reads and FLOPs, not the weights, set the step time,
  // and neither is multiplied by a split.
  const PipeliningChoice decode = ChooseMicroBatches(**cost, Decodes(256, 2000), 2, 8192);
  EXPECT_EQ(decode.micro_batches, 2);
  EXPECT_THAT(DescribePipelining(decode, (*cost)->Describe()), HasSubstr("2 CUDA stages on 2 machines"));
  // Prefill chunks are compute-bound: split too.
  const std::vector<StepWork> prefill(4, StepWork{.pos_begin = 0, .tokens = 2048, .sample = true});
  EXPECT_EQ(ChooseMicroBatches(**cost, prefill, 2, 8192).micro_batches, 2);
}

TEST(PipelineCostTest, GpuStagesAcrossNodesKeepOneMicroBatchOfFewShortDecodes) {
  const ModelSpec spec = testing::Llama70B();
  absl::StatusOr<std::unique_ptr<PipelineCost>> cost =
      PipelineCost::Make(spec, Stages(spec, {"node-0", "node-1"}, DeviceKind::kCuda, 8), 2, 2, DefaultPipelineProfiles());
  ASSERT_TRUE(cost.ok()) << cost.status();
  // 8 short sequences: each stage's step is its weight reads whatever the batch, so a split only
  // reads them twice as often.
  const PipeliningChoice c = ChooseMicroBatches(**cost, Decodes(8, 100), 2, 8192);
  EXPECT_EQ(c.micro_batches, 1);
  EXPECT_TRUE(c.weight_bound);
  EXPECT_THAT(DescribePipelining(c, (*cost)->Describe()), HasSubstr("stages bound by weight reads"));
}

TEST(PipelineCostTest, RejectsBadStagesAndProfiles) {
  const ModelSpec spec = testing::Model100M();
  EXPECT_THAT(PipelineCost::Make(spec, {}, 4, 4, DefaultPipelineProfiles()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no stage")));
  std::vector<StageSpec> bad = Stages(spec, {"a"}, DeviceKind::kCpu, 1);
  bad[0].layer_end = spec.num_layers + 1;
  EXPECT_THAT(PipelineCost::Make(spec, bad, 4, 4, DefaultPipelineProfiles()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layers [0, 13)")));
  PipelineProfiles profiles = DefaultPipelineProfiles();
  profiles.cpu_parallelism.memory = 0.5;
  EXPECT_THAT(PipelineCost::Make(spec, Stages(spec, {"a"}, DeviceKind::kCpu, 1), 4, 4, profiles).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cpu_parallelism")));
}

}  // namespace
}  // namespace shardserve::sim

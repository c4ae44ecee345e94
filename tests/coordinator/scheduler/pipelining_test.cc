// The pipelining policy over a fake cost model whose stage times are simple formulas, so that each
// expected round time is computed here by hand: one micro-batch costs the sum of the stages; a
// split is paced by its busiest stage, or by the machine its stages share.
#include "coordinator/scheduler/pipelining.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

namespace shardserve::coordinator {
namespace {

using ::testing::HasSubstr;

// Each stage: `weights` seconds of weight reads per micro-batch whatever its size (memory-bound),
// plus `per_token` seconds of compute per token, plus a fixed hop.
class FakeCost final : public PipelineCostModel {
 public:
  FakeCost(int stages, double weights, double per_token, bool shared, HostParallelism parallelism = {})
      : stages_(stages), weights_(weights), per_token_(per_token), shared_(shared), parallelism_(parallelism) {}
  int num_stages() const override { return stages_; }
  StageSeconds Stage(int, absl::Span<const StepWork> work) const override {
    double tokens = 0;
    for (const StepWork& w : work) tokens += static_cast<double>(w.tokens);
    return {.total = weights_ + per_token_ * tokens, .memory = weights_, .compute = per_token_ * tokens};
  }
  double Hop(int, int64_t) const override { return kHop; }
  int SharedGroup(int) const override { return shared_ ? 0 : -1; }
  HostParallelism Parallelism(int) const override { return parallelism_; }
  std::string Describe() const override { return shared_ ? "2 stages on one machine" : "2 stages on 2 machines"; }

  static constexpr double kHop = 1e-4;

 private:
  int stages_;
  double weights_, per_token_;
  bool shared_;
  HostParallelism parallelism_;
};

std::vector<StepWork> Decodes(int n) { return std::vector<StepWork>(n, StepWork{.pos_begin = 40, .tokens = 1, .sample = true}); }

TEST(PipeliningTest, OneMicroBatchTakesTheSumOfTheStagesAndHops) {
  const FakeCost cost(2, 0.010, 0.001, /*shared=*/false);
  const RoundPrediction r = PredictRound(cost, Decodes(16), 1, 256);
  EXPECT_EQ(r.tokens, 16);
  EXPECT_DOUBLE_EQ(r.seconds, 2 * (0.010 + 0.016) + 2 * FakeCost::kHop);
}

TEST(PipeliningTest, ASplitOnSeparateMachinesIsPacedByTheBusiestStage) {
  const FakeCost cost(2, 0.010, 0.001, /*shared=*/false);
  const RoundPrediction r = PredictRound(cost, Decodes(16), 2, 256);
  // Each stage runs both micro-batches of 8, 2 x (10 ms + 8 ms); one micro-batch's way through
  // both stages and hops is as long, plus the hops.
  EXPECT_DOUBLE_EQ(r.seconds, 2 * (0.010 + 0.008) + 2 * FakeCost::kHop);
  EXPECT_FALSE(r.host_bound);
  // Three micro-batches on two stages: each stage's three are longer than one micro-batch's way.
  const FakeCost two(2, 0.010, 0.001, /*shared=*/false);
  EXPECT_DOUBLE_EQ(PredictRound(two, Decodes(18), 3, 256).seconds, 3 * (0.010 + 0.006));
}

TEST(PipeliningTest, ASplitOnASharedMachineIsPacedByItsBusAndCores) {
  const FakeCost cost(2, 0.010, 0.001, /*shared=*/true, {.memory = 1.0, .compute = 1.0});
  const RoundPrediction r = PredictRound(cost, Decodes(16), 2, 256);
  // Reads: 2 stages x 2 micro-batches x 10 ms; arithmetic: 16 ms per stage, and the hop between
  // the stages of each micro-batch. The bus is the tighter.
  EXPECT_DOUBLE_EQ(r.seconds, std::max(4 * 0.010, 2 * 0.016 + 2 * FakeCost::kHop));
  EXPECT_TRUE(r.host_bound);
  // Compute-bound stages on cores that do not run two at once.
  const FakeCost cores(2, 0.002, 0.001, /*shared=*/true, {.memory = 2.0, .compute = 1.0});
  EXPECT_DOUBLE_EQ(PredictRound(cores, Decodes(16), 2, 256).seconds, 2 * 0.016 + 2 * FakeCost::kHop);
}

TEST(PipeliningTest, TheBudgetCutsAPrefillChunk) {
  const FakeCost cost(2, 0.010, 0.001, /*shared=*/false);
  std::vector<StepWork> work = Decodes(4);
  work.push_back(StepWork{.pos_begin = 0, .tokens = 100, .sample = true});
  EXPECT_EQ(PredictRound(cost, work, 1, 64).tokens, 64);
  // Two micro-batches of at most 3 sequences: 3 decodes; the last decode and the prefill cut to 63.
  EXPECT_EQ(PredictRound(cost, work, 2, 64).tokens, 3 + 1 + 63);
}

TEST(PipeliningTest, WeightBoundStagesOnASharedMachineKeepOneMicroBatch) {
  // Weight reads dominate (a decode step of 16 costs barely more than one of 8).
  const FakeCost cost(2, 0.010, 0.0001, /*shared=*/true, {.memory = 1.3, .compute = 1.0});
  const PipeliningChoice c = ChooseMicroBatches(cost, Decodes(16), 2, 256);
  EXPECT_EQ(c.micro_batches, 1);
  EXPECT_TRUE(c.weight_bound);
  EXPECT_TRUE(c.shared_host);
  EXPECT_LT(c.best_split_gain, 1.0);
  const std::string text = DescribePipelining(c, cost.Describe());
  EXPECT_THAT(text, HasSubstr("1 micro-batch for 16 running sequences"));
  EXPECT_THAT(text, HasSubstr("shared memory bus"));
  EXPECT_THAT(text, HasSubstr("2 stages on one machine"));
}

TEST(PipeliningTest, ComputeBoundStagesOnSeparateMachinesSplit) {
  const FakeCost cost(2, 0.002, 0.001, /*shared=*/false);
  const PipeliningChoice c = ChooseMicroBatches(cost, Decodes(16), 2, 256);
  EXPECT_EQ(c.micro_batches, 2);
  EXPECT_FALSE(c.weight_bound);
  // One: 2 x 18 ms + hops; two: 2 x (2 + 8) ms + hops.
  EXPECT_NEAR(c.gain, (2 * 0.018 + 2 * FakeCost::kHop) / (2 * 0.010 + 2 * FakeCost::kHop), 1e-9);
  EXPECT_THAT(DescribePipelining(c, cost.Describe()), HasSubstr("2 micro-batches for 16 running sequences"));
}

TEST(PipeliningTest, WeightBoundStagesOnSeparateMachinesGainTooLittleToSplit) {
  // A split reads every weight twice per round: the stages work at once for no more tokens.
  const FakeCost cost(2, 0.010, 0.00001, /*shared=*/false);
  EXPECT_EQ(ChooseMicroBatches(cost, Decodes(16), 2, 256).micro_batches, 1);
}

TEST(PipeliningTest, ComputeBoundStagesSharingOneMachineWithoutParallelismKeepOne) {
  const FakeCost cost(2, 0.0001, 0.001, /*shared=*/true, {.memory = 1.3, .compute = 1.0});
  const PipeliningChoice c = ChooseMicroBatches(cost, Decodes(16), 2, 256);
  EXPECT_EQ(c.micro_batches, 1);
  EXPECT_FALSE(c.weight_bound);
  EXPECT_THAT(DescribePipelining(c, cost.Describe()), HasSubstr("sharing one machine's cores and memory bus gain too little"));
}

TEST(PipeliningTest, OneSequenceOrDepthOneNeverSplits) {
  const FakeCost cost(2, 0.002, 0.001, /*shared=*/false);
  EXPECT_EQ(ChooseMicroBatches(cost, Decodes(1), 2, 256).micro_batches, 1);
  EXPECT_EQ(ChooseMicroBatches(cost, Decodes(16), 1, 256).micro_batches, 1);
  const PipeliningChoice idle = ChooseMicroBatches(cost, {}, 2, 256);
  EXPECT_EQ(idle.micro_batches, 1);
  EXPECT_THAT(DescribePipelining(idle, cost.Describe()), HasSubstr("idle now"));
}

TEST(PipeliningTest, NearTheBreakEvenPointTheCurrentSplitStays) {
  // A split predicts 1.07x: less than kMinPipeliningGain either way.
  const FakeCost cost(2, 0.010, 0.0001, /*shared=*/false);
  const double one = 2 * (0.010 + 0.0016) + 2 * FakeCost::kHop;
  const double two = 2 * (0.010 + 0.0008) + 2 * FakeCost::kHop;
  ASSERT_GT(one / two, 1.0);
  ASSERT_LT(one / two, kMinPipeliningGain);
  EXPECT_EQ(ChooseMicroBatches(cost, Decodes(16), 2, 256, /*current=*/1).micro_batches, 1);
  const PipeliningChoice stay = ChooseMicroBatches(cost, Decodes(16), 2, 256, /*current=*/2);
  EXPECT_EQ(stay.micro_batches, 2);
  EXPECT_NEAR(stay.gain, one / two, 1e-9);
}

TEST(PipeliningTest, DeeperPipelinesSplitFurtherOnlyForEnoughGain) {
  // Four compute-bound stages on four machines: each step of the split pays.
  const FakeCost cost(4, 0.001, 0.001, /*shared=*/false);
  EXPECT_EQ(ChooseMicroBatches(cost, Decodes(32), 4, 256).micro_batches, 4);
  // Weight reads dominate: no split gains 10%.
  const FakeCost weights(4, 0.010, 0.00001, /*shared=*/false);
  EXPECT_EQ(ChooseMicroBatches(weights, Decodes(32), 4, 256).micro_batches, 1);
}

}  // namespace
}  // namespace shardserve::coordinator

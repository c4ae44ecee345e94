// Multi-step decoding chosen per replica (coordinator/scheduler/decode_steps.h): the rule, the
// tuner's averages and hysteresis, and the scheduler asking for what the tuner chose, driven by
// its caller (StepDriver::kCaller) with answers that report chosen call and compute times. The
// expected step counts are worked out by hand from the rule: the smallest k with
// overhead <= k * compute / 4, at most 16 and at most 20 ms of compute per call.
#include "coordinator/scheduler/decode_steps.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "coordinator/scheduler/scheduler.h"
#include "tests/testing/fake_clock.h"

namespace shardserve::coordinator {
namespace {

using ::testing::HasSubstr;

absl::Duration Ms(double ms) { return absl::Microseconds(ms * 1000); }

TEST(AutoDecodeStepsTest, SmallStepsWithALargeOverheadGetSeveralStepsPerCall) {
  // 0.2 ms <= k * 0.1 ms / 4 from k = 8 on (exactly on the boundary).
  EXPECT_EQ(AutoDecodeSteps(Ms(0.2), Ms(0.1)), 8);
  // 0.21 ms against 0.08 ms: k >= 10.5, so 11.
  EXPECT_EQ(AutoDecodeSteps(Ms(0.21), Ms(0.08)), 11);
  // A quarter of one step's compute or less: one step.
  EXPECT_EQ(AutoDecodeSteps(Ms(0.025), Ms(0.1)), 1);
  EXPECT_EQ(AutoDecodeSteps(absl::ZeroDuration(), Ms(0.1)), 1);
}

TEST(AutoDecodeStepsTest, LargeGpuLikeStepsGetOneStepPerCall) {
  EXPECT_EQ(AutoDecodeSteps(Ms(0.3), Ms(10)), 1);
  EXPECT_EQ(AutoDecodeSteps(Ms(2), Ms(10)), 1);  // 2 ms <= 2.5 ms
}

TEST(AutoDecodeStepsTest, AtMostSixteenStepsAndTwentyMillisecondsOfComputePerCall) {
  EXPECT_EQ(AutoDecodeSteps(Ms(1), Ms(0.01)), kMaxAutoDecodeSteps);  // the rule asks for 400
  // 10 ms against 2.5 ms asks for 16, but 20 ms hold 8 steps of 2.5 ms.
  EXPECT_EQ(AutoDecodeSteps(Ms(10), Ms(2.5)), 8);
  // 5 ms against 3 ms asks for 7 (6.67 rounded up); 20 ms hold 6 of 3 ms.
  EXPECT_EQ(AutoDecodeSteps(Ms(5), Ms(3)), 6);
  // Steps longer than 20 ms: one per call, whatever the overhead.
  EXPECT_EQ(AutoDecodeSteps(Ms(50), Ms(25)), 1);
}

TEST(AutoDecodeStepsTest, NothingMeasuredMeansOneStep) {
  EXPECT_EQ(AutoDecodeSteps(Ms(1), absl::ZeroDuration()), 1);
}

// `calls` calls of `steps` steps, each with `overhead` of serving overhead around `per_step` of
// compute per step.
void Feed(DecodeStepsTuner& t, int calls, double overhead_ms, double per_step_ms, int32_t steps) {
  for (int i = 0; i < calls; ++i) t.Observe(Ms(overhead_ms + per_step_ms * steps), Ms(per_step_ms * steps), steps);
}

TEST(DecodeStepsTunerTest, StaysAtOneUntilEnoughCallsAreTimed) {
  DecodeStepsTuner t(kAutoDecodeStepsPerCall);
  EXPECT_TRUE(t.automatic());
  Feed(t, DecodeStepsTuner::kMinTimedCalls - 1, 0.2, 0.1, 1);
  EXPECT_EQ(t.steps(), 1);
  EXPECT_EQ(t.Describe(), "1 (auto: measuring, 7 of 8 decode calls timed so far)");
  Feed(t, 1, 0.2, 0.1, 1);
  EXPECT_EQ(t.steps(), 8);
  EXPECT_EQ(t.Describe(), "8 (auto: serving overhead 0.20 ms per call against 0.10 ms of compute per step)");
  EXPECT_NEAR(absl::ToDoubleMilliseconds(t.overhead_per_call()), 0.2, 1e-9);
  EXPECT_NEAR(absl::ToDoubleMilliseconds(t.compute_per_step()), 0.1, 1e-9);
}

TEST(DecodeStepsTunerTest, CallsWithoutAComputeTimeAreNotCounted) {
  DecodeStepsTuner t(kAutoDecodeStepsPerCall);
  for (int i = 0; i < 20; ++i) t.Observe(Ms(0.3), absl::ZeroDuration(), 1);
  EXPECT_EQ(t.timed_calls(), 0);
  EXPECT_EQ(t.steps(), 1);
}

TEST(DecodeStepsTunerTest, ComputePerStepIsTheCallsComputeOverItsSteps) {
  DecodeStepsTuner t(kAutoDecodeStepsPerCall);
  // Calls of 4 steps: 0.4 ms of compute each, 0.2 ms of overhead.
  Feed(t, DecodeStepsTuner::kMinTimedCalls, 0.2, 0.1, 4);
  EXPECT_NEAR(absl::ToDoubleMilliseconds(t.compute_per_step()), 0.1, 1e-9);
  EXPECT_NEAR(absl::ToDoubleMilliseconds(t.overhead_per_call()), 0.2, 1e-9);
  EXPECT_EQ(t.steps(), 8);
}

TEST(DecodeStepsTunerTest, LongStepsStayAtOne) {
  DecodeStepsTuner t(kAutoDecodeStepsPerCall);
  Feed(t, 50, 0.3, 10, 1);
  EXPECT_EQ(t.steps(), 1);
  EXPECT_EQ(t.Describe(), "1 (auto: serving overhead 0.30 ms per call against 10.00 ms of compute per step)");
}

TEST(DecodeStepsTunerTest, SaysWhenACapHolds) {
  DecodeStepsTuner compute(kAutoDecodeStepsPerCall);
  Feed(compute, 20, 10, 2.5, 1);
  EXPECT_EQ(compute.steps(), 8);
  EXPECT_THAT(compute.Describe(), HasSubstr("; at most 20ms of compute per call)"));
  DecodeStepsTuner count(kAutoDecodeStepsPerCall);
  Feed(count, 20, 1, 0.01, 1);
  EXPECT_EQ(count.steps(), kMaxAutoDecodeSteps);
  EXPECT_THAT(count.Describe(), HasSubstr("; at most 16 steps per call)"));
}

TEST(DecodeStepsTunerTest, SmallChangesDoNotMoveItAndLargeOnesDo) {
  DecodeStepsTuner t(kAutoDecodeStepsPerCall);
  Feed(t, 40, 0.2, 0.1, 1);
  ASSERT_EQ(t.steps(), 8);
  // 10% more overhead: the rule alone would say 9 (0.22 / 0.025 = 8.8), but within the band 8 stays.
  Feed(t, 200, 0.22, 0.1, 8);
  EXPECT_NEAR(absl::ToDoubleMilliseconds(t.overhead_per_call()), 0.22, 1e-6);
  EXPECT_EQ(AutoDecodeSteps(t.overhead_per_call(), t.compute_per_step()), 9);
  EXPECT_EQ(t.steps(), 8);
  EXPECT_THAT(t.Describe(), HasSubstr("8 (auto: serving overhead 0.22 ms per call against 0.10 ms of compute per "
                                      "step; the rule gives 9 now, within the 15% margin kept before a change)"));
  // Three times the overhead: past the band even with 15% less of it and 15% more compute
  // (0.51 / 0.115 * 4 = 17.7), so the rule's 16 (the cap; 0.6 / 0.025 = 24).
  Feed(t, 200, 0.6, 0.1, 8);
  EXPECT_EQ(t.steps(), 16);
  // The steps grow 40-fold (a larger batch): one step per call (0.6 <= 4 ms / 4), since even
  // 15% more overhead and 15% less compute ask for one (0.69 / 3.4 * 4 = 0.81).
  Feed(t, 200, 0.6, 4.0, 1);
  EXPECT_EQ(t.steps(), 1);
}

TEST(DecodeStepsTunerTest, AFixedNumberNeverMoves) {
  DecodeStepsTuner t(4);
  EXPECT_FALSE(t.automatic());
  EXPECT_EQ(t.steps(), 4);
  Feed(t, 50, 0.3, 10, 4);  // would be 1 in auto
  EXPECT_EQ(t.steps(), 4);
  Feed(t, 200, 1, 0.01, 4);  // would be 16 in auto
  EXPECT_EQ(t.steps(), 4);
  EXPECT_EQ(t.Describe(), "4 (fixed by --decode_steps_per_call; serving overhead 1.00 ms per call against 0.01 ms of "
                          "compute per step)");
  EXPECT_EQ(DecodeStepsTuner(1).Describe(), "1 (fixed by --decode_steps_per_call)");
}

// ---- The scheduler --------------------------------------------------------------------------

class NullSink final : public SequenceSink {
 public:
  void OnTokens(absl::Span<const int32_t> t, absl::Span<const TokenLogprobs> /*logprobs*/) override {
    tokens += static_cast<int64_t>(t.size());
  }
  void OnEnd(const SequenceEnd& e) override { end = e; }
  int64_t tokens = 0;
  std::optional<SequenceEnd> end;
};

// A scheduler driven by the test (kCaller), one replica of `stages` stages, whose answers report
// `overhead_ms` of serving overhead per call and `per_step_ms` of compute per decode step.
class SchedulerAutoStepsTest : public ::testing::Test {
 protected:
  void Start(int32_t decode_steps_per_call, int32_t stages = 1, int32_t pipeline_depth = 1) {
    SchedulerOptions o;
    o.limits = {.vocab_size = 100, .max_seq_len = 1024};
    o.clock = &clock_;
    o.step_driver = StepDriver::kCaller;
    o.decode_steps_per_call = decode_steps_per_call;
    scheduler_ = std::make_unique<Scheduler>(o);
    ASSERT_TRUE(scheduler_->AddReplica(0, nullptr, {.max_slots = 8, .pipeline_depth = pipeline_depth, .kv_blocks = 512, .stages = stages}).ok());
  }

  std::shared_ptr<NullSink> Submit(SamplingOptions sampling = {}, bool logprobs = false) {
    auto sink = std::make_shared<NullSink>();
    SequenceRequest r{.prompt = {1, 2, 3}, .max_tokens = 500, .ignore_eos = true};
    r.sampling = std::move(sampling);
    r.logprobs = logprobs;
    EXPECT_TRUE(scheduler_->Submit(std::move(r), sink).ok());
    return sink;
  }

  // Runs `calls` micro-batches; returns their decode_steps, in order.
  std::vector<int32_t> Run(int calls, double overhead_ms, double per_step_ms) {
    std::vector<int32_t> steps;
    for (int i = 0; i < calls; ++i) {
      std::optional<StepInput> in = scheduler_->BeginStep(0);
      if (!in.has_value()) break;
      StepOutput out;
      bool logprobs = false;
      for (const StepSequenceInput& s : in->sequences) {
        for (int32_t j = 0; s.sample && j < in->decode_steps; ++j) out.token_ids.push_back(5);
        logprobs = logprobs || (s.sample && s.logprobs);
      }
      // When one sequence asks for logprobs, every token has an entry (empty for the others).
      if (logprobs) out.logprobs.resize(out.token_ids.size());
      out.compute_time = Ms(per_step_ms * in->decode_steps);
      scheduler_->EndStep(0, in->step_id, out, out.compute_time + Ms(overhead_ms));
      steps.push_back(in->decode_steps);
    }
    return steps;
  }

  ReplicaStats Stats() const { return scheduler_->Stats().replicas.at(0); }

  testing::FakeClock clock_;
  std::unique_ptr<Scheduler> scheduler_;
};

TEST_F(SchedulerAutoStepsTest, ShortStepsWithALargeOverheadGetSeveralStepsPerCall) {
  Start(kAutoDecodeStepsPerCall);
  Submit();
  // The prefill, then 8 timed decode calls of one step; then 0.2 ms against 0.1 ms gives 8.
  const std::vector<int32_t> steps = Run(20, 0.2, 0.1);
  ASSERT_EQ(steps.size(), 20u);
  EXPECT_EQ(std::vector<int32_t>(steps.begin(), steps.begin() + 9), std::vector<int32_t>(9, 1));
  EXPECT_EQ(std::vector<int32_t>(steps.begin() + 9, steps.end()), std::vector<int32_t>(11, 8));
  EXPECT_EQ(Stats().decode_steps, 8);
  EXPECT_EQ(Stats().decode_steps_why,
            "8 (auto: serving overhead 0.20 ms per call against 0.10 ms of compute per step)");
}

TEST_F(SchedulerAutoStepsTest, LongStepsGetOneStepPerCall) {
  Start(kAutoDecodeStepsPerCall);
  Submit();
  for (int32_t k : Run(40, 0.3, 10)) EXPECT_EQ(k, 1);
  EXPECT_EQ(Stats().decode_steps, 1);
  EXPECT_THAT(Stats().decode_steps_why, HasSubstr("1 (auto: serving overhead 0.30 ms per call against 10.00 ms"));
}

TEST_F(SchedulerAutoStepsTest, ACallComputesAtMostTwentyMilliseconds) {
  Start(kAutoDecodeStepsPerCall);
  Submit();
  // 10 ms of overhead against 2.5 ms steps asks for 16; 20 ms of compute hold 8.
  const std::vector<int32_t> steps = Run(20, 10, 2.5);
  EXPECT_EQ(steps.back(), 8);
  EXPECT_EQ(Stats().decode_steps, 8);
}

TEST_F(SchedulerAutoStepsTest, IneligibleBatchesStillGetOneStep) {
  Start(kAutoDecodeStepsPerCall);
  auto penalised = Submit(SamplingOptions{.presence_penalty = 0.5f});
  const std::vector<int32_t> alone = Run(20, 0.2, 0.1);
  for (int32_t k : alone) EXPECT_EQ(k, 1);
  EXPECT_EQ(Stats().decode_steps, 8);  // chosen, but not for this batch
  // A plain sequence beside one that wants logprobs: the batch takes one step at a time too.
  Submit();
  Submit({}, /*logprobs=*/true);
  for (int32_t k : Run(20, 0.2, 0.1)) EXPECT_EQ(k, 1);
  EXPECT_FALSE(penalised->end.has_value());
}

TEST_F(SchedulerAutoStepsTest, TheRemainingTokensStillCapTheSteps) {
  Start(kAutoDecodeStepsPerCall);
  auto sink = std::make_shared<NullSink>();
  ASSERT_TRUE(
      scheduler_->Submit(SequenceRequest{.prompt = {1, 2, 3}, .max_tokens = 13, .ignore_eos = true}, sink).ok());
  // Prefill (token 1), 8 one-step decodes (tokens 2-9), then the 4 tokens left in one call.
  const std::vector<int32_t> steps = Run(20, 0.2, 0.1);
  EXPECT_EQ(steps, (std::vector<int32_t>{1, 1, 1, 1, 1, 1, 1, 1, 1, 4}));
  ASSERT_TRUE(sink->end.has_value());
  EXPECT_EQ(sink->tokens, 13);
}

TEST_F(SchedulerAutoStepsTest, AnExplicitNumberKeepsFixedSteps) {
  Start(4);
  Submit();
  const std::vector<int32_t> steps = Run(30, 0.3, 10);  // auto would stay at 1
  EXPECT_EQ(steps.front(), 1);  // the prefill
  for (size_t i = 1; i < steps.size(); ++i) EXPECT_EQ(steps[i], 4) << i;
  EXPECT_THAT(Stats().decode_steps_why, HasSubstr("4 (fixed by --decode_steps_per_call"));
  Start(1);
  Submit();
  for (int32_t k : Run(30, 0.2, 0.1)) EXPECT_EQ(k, 1);  // auto would take 8
  EXPECT_EQ(Stats().decode_steps, 1);
}

TEST_F(SchedulerAutoStepsTest, ReplicasOfSeveralStagesTakeOneStep) {
  Start(kAutoDecodeStepsPerCall, /*stages=*/2);
  Submit();
  for (int32_t k : Run(30, 0.2, 0.1)) EXPECT_EQ(k, 1);
  EXPECT_EQ(Stats().decode_steps, 1);
  EXPECT_EQ(Stats().decode_steps_why,
            "1 (several decode steps per call need a 1-stage replica; this one has 2 stages)");
}

// With two micro-batches in flight on one stage, each call also waits for the other's compute:
// that is not serving overhead, and such calls are not timed. Calls that run alone are.
TEST_F(SchedulerAutoStepsTest, CallsThatOverlapAnotherAreNotTimed) {
  Start(kAutoDecodeStepsPerCall, /*stages=*/1, /*pipeline_depth=*/2);
  Submit();
  Submit();
  auto answer = [&](const StepInput& in, double took_ms) {
    StepOutput out;
    for (const StepSequenceInput& s : in.sequences) {
      for (int32_t j = 0; s.sample && j < in.decode_steps; ++j) out.token_ids.push_back(5);
    }
    out.compute_time = Ms(0.1 * in.decode_steps);
    scheduler_->EndStep(0, in.step_id, out, Ms(took_ms));
  };
  // Both prefills, then 20 rounds of two overlapping decode calls of one sequence each, every call
  // taking 5 ms (the other's compute and its own): none is timed.
  for (int round = 0; round < 21; ++round) {
    std::optional<StepInput> a = scheduler_->BeginStep(0);
    std::optional<StepInput> b = scheduler_->BeginStep(0);
    ASSERT_TRUE(a.has_value() && b.has_value()) << round;
    ASSERT_EQ(a->sequences.size(), 1u);
    answer(*a, 5);
    answer(*b, 5);
  }
  EXPECT_EQ(Stats().decode_steps, 1);
  EXPECT_EQ(Stats().decode_steps_why, "1 (auto: measuring, 0 of 8 decode calls timed so far)");
  // One call in flight at a time (the other sequence's batch is built after the answer): timed.
  for (int i = 0; i < 8; ++i) {
    std::optional<StepInput> in = scheduler_->BeginStep(0);
    ASSERT_TRUE(in.has_value());
    answer(*in, 0.1 * in->decode_steps + 0.2);
  }
  EXPECT_EQ(Stats().decode_steps, 8);
  EXPECT_EQ(Stats().decode_steps_why,
            "8 (auto: serving overhead 0.20 ms per call against 0.10 ms of compute per step)");
}

TEST(SchedulerOptionsTest, DecodeStepsPerCallZeroIsAutoAndNegativeIsRefused) {
  SchedulerOptions o;
  o.limits = {.vocab_size = 100, .max_seq_len = 64};
  EXPECT_EQ(o.decode_steps_per_call, kAutoDecodeStepsPerCall);  // the default
  EXPECT_TRUE(o.Validate().ok());
  o.decode_steps_per_call = -1;
  EXPECT_EQ(o.Validate().message(), "decode_steps_per_call must be in [0, 64] (0 = auto), got -1");
  o.decode_steps_per_call = kMaxDecodeStepsPerCall + 1;
  EXPECT_EQ(o.Validate().message(), "decode_steps_per_call must be in [0, 64] (0 = auto), got 65");
}

}  // namespace
}  // namespace shardserve::coordinator

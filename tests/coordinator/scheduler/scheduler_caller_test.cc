// The scheduler driven by its caller (StepDriver::kCaller): no threads; BeginStep builds the
// micro-batches a step loop would, at most pipeline_depth open per replica, and EndStep applies
// their answers on the calling thread. The simulator (coordinator/sim) drives it this way.
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

class RecordingSink final : public SequenceSink {
 public:
  void OnTokens(absl::Span<const int32_t> t, absl::Span<const TokenLogprobs> /*logprobs*/) override {
    tokens.insert(tokens.end(), t.begin(), t.end());
  }
  void OnEnd(const SequenceEnd& e) override { end = e; }
  std::vector<int32_t> tokens;
  std::optional<SequenceEnd> end;
};

SchedulerOptions CallerOptions(const Clock* clock) {
  SchedulerOptions o;
  o.limits = {.vocab_size = 100, .max_seq_len = 64};
  o.clock = clock;
  o.step_driver = StepDriver::kCaller;
  return o;
}

SequenceRequest Request(int32_t max_tokens) {
  return SequenceRequest{.prompt = {1, 2, 3}, .max_tokens = max_tokens, .ignore_eos = true};
}

StepOutput Answer(const StepInput& in, int32_t token) {
  StepOutput out;
  for (const auto& s : in.sequences) {
    if (s.sample) out.token_ids.push_back(token);
  }
  return out;
}

TEST(SchedulerCallerTest, RunsTheStepsTheCallerDrives) {
  testing::FakeClock clock;
  Scheduler scheduler(CallerOptions(&clock));
  ASSERT_TRUE(scheduler.AddReplica(0, nullptr, {.max_slots = 4, .pipeline_depth = 1, .kv_blocks = 16}).ok());
  auto sink = std::make_shared<RecordingSink>();
  ASSERT_TRUE(scheduler.Submit(Request(2), sink).ok());
  std::optional<StepInput> prefill = scheduler.BeginStep(0);
  ASSERT_TRUE(prefill.has_value());
  ASSERT_EQ(prefill->sequences.size(), 1u);
  EXPECT_EQ(prefill->sequences[0].token_ids, (std::vector<int32_t>{1, 2, 3}));
  // pipeline_depth = 1: nothing more until it ends.
  EXPECT_FALSE(scheduler.BeginStep(0).has_value());
  scheduler.EndStep(0, prefill->step_id, Answer(*prefill, 7), absl::Milliseconds(5));
  EXPECT_EQ(sink->tokens, (std::vector<int32_t>{7}));
  std::optional<StepInput> decode = scheduler.BeginStep(0);
  ASSERT_TRUE(decode.has_value());
  EXPECT_EQ(decode->sequences[0].token_ids, (std::vector<int32_t>{7}));
  scheduler.EndStep(0, decode->step_id, Answer(*decode, 8), absl::Milliseconds(5));
  EXPECT_EQ(sink->tokens, (std::vector<int32_t>{7, 8}));
  ASSERT_TRUE(sink->end.has_value());
  EXPECT_TRUE(sink->end->status.ok());
  EXPECT_EQ(sink->end->reason, FinishReason::kLength);
  EXPECT_FALSE(scheduler.BeginStep(0).has_value());  // no work left
  EXPECT_EQ(scheduler.Stats().replicas[0].kv_blocks_used, 0);
}

TEST(SchedulerCallerTest, KeepsPipelineDepthMicroBatchesOpen) {
  testing::FakeClock clock;
  Scheduler scheduler(CallerOptions(&clock));
  ASSERT_TRUE(scheduler.AddReplica(0, nullptr, {.max_slots = 4, .pipeline_depth = 2, .kv_blocks = 16}).ok());
  std::vector<std::shared_ptr<RecordingSink>> sinks;
  for (int i = 0; i < 4; ++i) {
    sinks.push_back(std::make_shared<RecordingSink>());
    ASSERT_TRUE(scheduler.Submit(Request(3), sinks.back()).ok());
  }
  std::optional<StepInput> a = scheduler.BeginStep(0);
  std::optional<StepInput> b = scheduler.BeginStep(0);
  ASSERT_TRUE(a.has_value() && b.has_value());
  EXPECT_EQ(a->sequences.size(), 2u);  // ceil(4 running / depth 2)
  EXPECT_EQ(b->sequences.size(), 2u);
  EXPECT_FALSE(scheduler.BeginStep(0).has_value());
  // Answers may come back in any order; an unknown step id is ignored.
  scheduler.EndStep(0, 999, StepOutput{}, absl::ZeroDuration());
  scheduler.EndStep(0, b->step_id, Answer(*b, 5), absl::ZeroDuration());
  EXPECT_TRUE(scheduler.BeginStep(0).has_value());
}

TEST(SchedulerCallerTest, RemovingAReplicaFailsItsOpenMicroBatchesOver) {
  testing::FakeClock clock;
  Scheduler scheduler(CallerOptions(&clock));
  ASSERT_TRUE(scheduler.AddReplica(0, nullptr, {.max_slots = 4, .pipeline_depth = 1, .kv_blocks = 16}).ok());
  auto sink = std::make_shared<RecordingSink>();
  ASSERT_TRUE(scheduler.Submit(Request(2), sink).ok());
  ASSERT_TRUE(scheduler.AddReplica(1, nullptr, {.max_slots = 4, .pipeline_depth = 1, .kv_blocks = 16}).ok());
  std::optional<StepInput> open = scheduler.BeginStep(0);
  ASSERT_TRUE(open.has_value());
  scheduler.RemoveReplica(0, absl::UnavailableError("worker died"));
  scheduler.EndStep(0, open->step_id, Answer(*open, 7), absl::ZeroDuration());  // dropped
  EXPECT_TRUE(sink->tokens.empty());
  EXPECT_FALSE(sink->end.has_value());
  std::optional<StepInput> again = scheduler.BeginStep(1);  // recomputed on replica 1
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->sequences[0].token_ids, (std::vector<int32_t>{1, 2, 3}));
}

// A constraint of one state allowing every token, that decides the EOS ids or not.
class EveryToken final : public TokenConstraint {
 public:
  explicit EveryToken(bool decides_eos) : decides_eos_(decides_eos) {}
  int32_t StartState() const override { return 0; }
  std::shared_ptr<const std::string> AllowedMask(int32_t) const override { return mask_; }
  int32_t Advance(int32_t, int32_t) const override { return 0; }
  bool IsFinished(int32_t) const override { return false; }
  bool DecidesEos() const override { return decides_eos_; }

 private:
  const bool decides_eos_;
  std::shared_ptr<const std::string> mask_ = std::make_shared<const std::string>(13, '\xff');
};

TEST(SchedulerCallerTest, MinTokensSuppressesEosUnderAConstraintThatDoesNotDecideIt) {
  testing::FakeClock clock;
  SchedulerOptions options = CallerOptions(&clock);
  options.eos_token_ids = {2};
  Scheduler scheduler(options);
  ASSERT_TRUE(scheduler.AddReplica(0, nullptr, {.max_slots = 4, .kv_blocks = 16}).ok());
  for (const bool decides : {false, true}) {
    SCOPED_TRACE(decides ? "structured output" : "allowed_token_ids");
    SequenceRequest r{.prompt = {1, 2, 3}, .max_tokens = 4, .stop_token_ids = {9}, .min_tokens = 2};
    r.constraint = std::make_shared<EveryToken>(decides);
    auto sink = std::make_shared<RecordingSink>();
    ASSERT_TRUE(scheduler.Submit(r, sink).ok());
    std::optional<StepInput> in = scheduler.BeginStep(0);
    ASSERT_TRUE(in.has_value());
    ASSERT_EQ(in->sequences.size(), 1u);
    EXPECT_NE(in->sequences[0].allowed_token_mask, nullptr);
    // The stop ids always; the EOS ids only when the constraint leaves them to the stop rules
    // (ascending).
    const std::vector<int32_t> suppressed = decides ? std::vector<int32_t>{9} : std::vector<int32_t>{2, 9};
    EXPECT_EQ(in->sequences[0].suppress_token_ids, suppressed);
    scheduler.EndStep(0, in->step_id, Answer(*in, 5), absl::ZeroDuration());
    // Past min_tokens an EOS stops the sequence either way.
    for (int step = 0; step < 3 && !sink->end.has_value(); ++step) {
      std::optional<StepInput> next = scheduler.BeginStep(0);
      ASSERT_TRUE(next.has_value());
      scheduler.EndStep(0, next->step_id, Answer(*next, step == 0 ? 5 : 2), absl::ZeroDuration());
    }
    ASSERT_TRUE(sink->end.has_value());
    EXPECT_EQ(sink->end->reason, FinishReason::kStop);
    EXPECT_EQ(sink->tokens, (std::vector<int32_t>{5, 5, 2}));
  }
}

// Each step of a sequence with bad words carries the bans its output's tail calls for, and the
// sequence never decodes several steps in one call (its next bans depend on each token).
TEST(SchedulerCallerTest, EachStepCarriesTheBadWordBansOfItsOutputSoFar) {
  testing::FakeClock clock;
  SchedulerOptions o = CallerOptions(&clock);
  o.eos_token_ids = {2};
  o.decode_steps_per_call = 8;
  Scheduler scheduler(o);
  ASSERT_TRUE(scheduler.AddReplica(0, nullptr, {.max_slots = 4, .kv_blocks = 16, .stages = 1}).ok());
  SequenceRequest r{.prompt = {1, 3}, .max_tokens = 4, .ignore_eos = true};
  r.bad_words = {{3, 4}, {7}};
  auto sink = std::make_shared<RecordingSink>();
  ASSERT_TRUE(scheduler.Submit(r, sink).ok());
  const std::vector<int32_t> answers = {3, 5, 3, 6};
  const std::vector<std::vector<int32_t>> expected = {{7}, {4, 7}, {7}, {4, 7}};  // the prompt's 3 does not count
  for (size_t step = 0; step < answers.size(); ++step) {
    std::optional<StepInput> in = scheduler.BeginStep(0);
    ASSERT_TRUE(in.has_value());
    ASSERT_EQ(in->sequences.size(), 1u);
    EXPECT_EQ(in->sequences[0].suppress_token_ids, expected[step]) << "step " << step;
    EXPECT_LE(in->decode_steps, 1);
    StepOutput out;
    out.token_ids.push_back(answers[step]);
    scheduler.EndStep(0, in->step_id, out, absl::ZeroDuration());
  }
  ASSERT_TRUE(sink->end.has_value());
  EXPECT_EQ(sink->tokens, answers);
  // Without bad words the same sequence decodes several steps per call.
  r.bad_words.clear();
  ASSERT_TRUE(scheduler.Submit(r, std::make_shared<RecordingSink>()).ok());
  std::optional<StepInput> prefill = scheduler.BeginStep(0);
  ASSERT_TRUE(prefill.has_value());
  EXPECT_THAT(prefill->sequences[0].suppress_token_ids, ::testing::IsEmpty());
  scheduler.EndStep(0, prefill->step_id, Answer(*prefill, 5), absl::ZeroDuration());
  std::optional<StepInput> decode = scheduler.BeginStep(0);
  ASSERT_TRUE(decode.has_value());
  EXPECT_GT(decode->decode_steps, 1);
}

TEST(SchedulerCallerTest, ThreadDrivenSchedulersRefuseBeginStep) {
  SchedulerOptions o;
  o.limits = {.vocab_size = 100, .max_seq_len = 64};
  Scheduler scheduler(o);
  EXPECT_FALSE(scheduler.AddReplica(0, nullptr, {.kv_blocks = 16}).ok());  // kThreads needs a client
  EXPECT_FALSE(scheduler.BeginStep(0).has_value());
}

// Two stages, each taking `*weights` seconds of weight reads per micro-batch plus `per_token`
// seconds per token; on one machine without parallelism when `*shared`. The test owns the
// pointed-to values and changes them between steps (kCaller: one thread).
class SwitchableCost final : public PipelineCostModel {
 public:
  SwitchableCost(const double* weights, const bool* shared) : weights_(weights), shared_(shared) {}
  int num_stages() const override { return 2; }
  StageSeconds Stage(int, absl::Span<const StepWork> work) const override {
    double tokens = 0;
    for (const StepWork& w : work) tokens += static_cast<double>(w.tokens);
    return {.total = *weights_ + 0.001 * tokens, .memory = *weights_, .compute = 0.001 * tokens};
  }
  double Hop(int, int64_t) const override { return 1e-4; }
  int SharedGroup(int) const override { return *shared_ ? 0 : -1; }
  HostParallelism Parallelism(int) const override { return {.memory = 1.3, .compute = 1.0}; }
  std::string Describe() const override { return "2 test stages"; }

 private:
  const double* weights_;
  const bool* shared_;
};

// Replica 0 of depth 2 priced by SwitchableCost(weights, shared), running 4 requests of
// `max_tokens`; returns their sinks.
std::vector<std::shared_ptr<RecordingSink>> StartFourOnACostedReplica(Scheduler& scheduler, const double* weights,
                                                                    const bool* shared, int32_t max_tokens) {
  std::vector<std::shared_ptr<RecordingSink>> sinks;
  const absl::Status added = scheduler.AddReplica(
      0, nullptr,
      {.max_slots = 4, .pipeline_depth = 2, .pipeline_cost = std::make_shared<SwitchableCost>(weights, shared),
       .kv_blocks = 16});
  EXPECT_TRUE(added.ok()) << added;
  for (int i = 0; i < 4; ++i) {
    sinks.push_back(std::make_shared<RecordingSink>());
    EXPECT_TRUE(scheduler.Submit(Request(max_tokens), sinks.back()).ok());
  }
  return sinks;
}

TEST(SchedulerCallerTest, ACostModelFavouringOneMicroBatchKeepsTheRunningSetTogether) {
  testing::FakeClock clock;
  Scheduler scheduler(CallerOptions(&clock));
  const double weights = 0.050;  // weight-bound
  const bool shared = true;
  StartFourOnACostedReplica(scheduler, &weights, &shared, 3);
  std::optional<StepInput> a = scheduler.BeginStep(0);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->sequences.size(), 4u);
  EXPECT_FALSE(scheduler.BeginStep(0).has_value());  // one micro-batch in flight at most
  const ReplicaStats stats = scheduler.Stats().replicas[0];
  EXPECT_EQ(stats.micro_batches, 1);
  EXPECT_THAT(stats.pipelining, ::testing::HasSubstr("1 micro-batch for 4 running sequences (2 test stages"));
  scheduler.EndStep(0, a->step_id, Answer(*a, 5), absl::ZeroDuration());
  std::optional<StepInput> next = scheduler.BeginStep(0);
  ASSERT_TRUE(next.has_value());
  EXPECT_EQ(next->sequences.size(), 4u);
}

TEST(SchedulerCallerTest, ACostModelFavouringASplitSplitsAndTheGroupsMergeWhenItNoLongerPays) {
  testing::FakeClock clock;
  Scheduler scheduler(CallerOptions(&clock));
  double weights = 0.001;  // compute-bound
  bool shared = false;     // on separate machines
  const std::vector<std::shared_ptr<RecordingSink>> sinks = StartFourOnACostedReplica(scheduler, &weights, &shared, 4);
  std::optional<StepInput> a = scheduler.BeginStep(0);
  std::optional<StepInput> b = scheduler.BeginStep(0);
  ASSERT_TRUE(a.has_value() && b.has_value());
  EXPECT_EQ(a->sequences.size(), 2u);
  EXPECT_EQ(b->sequences.size(), 2u);
  EXPECT_EQ(scheduler.Stats().replicas[0].micro_batches, 2);
  EXPECT_THAT(scheduler.Stats().replicas[0].pipelining, ::testing::HasSubstr("2 micro-batches"));
  // The stages turn weight-bound on one machine: the next build keeps one micro-batch in flight,
  // so `a`'s sequences wait for `b`'s and the two groups step together from then on.
  weights = 0.050;
  shared = true;
  scheduler.EndStep(0, a->step_id, Answer(*a, 5), absl::ZeroDuration());
  EXPECT_FALSE(scheduler.BeginStep(0).has_value());
  EXPECT_EQ(scheduler.Stats().replicas[0].micro_batches, 1);
  scheduler.EndStep(0, b->step_id, Answer(*b, 5), absl::ZeroDuration());
  std::optional<StepInput> merged = scheduler.BeginStep(0);
  ASSERT_TRUE(merged.has_value());
  EXPECT_EQ(merged->sequences.size(), 4u);
  for (const auto& sink : sinks) EXPECT_EQ(sink->tokens, (std::vector<int32_t>{5}));
}

TEST(SchedulerCallerTest, WithoutACostModelTheSplitIsThePipelineDepth) {
  testing::FakeClock clock;
  Scheduler scheduler(CallerOptions(&clock));
  ASSERT_TRUE(scheduler.AddReplica(0, nullptr, {.max_slots = 4, .pipeline_depth = 3, .kv_blocks = 16}).ok());
  const ReplicaStats stats = scheduler.Stats().replicas[0];
  EXPECT_EQ(stats.micro_batches, 3);
  EXPECT_THAT(stats.pipelining, ::testing::HasSubstr("3 micro-batches in flight at most (fixed pipeline depth)"));
}

}  // namespace
}  // namespace shardserve::coordinator

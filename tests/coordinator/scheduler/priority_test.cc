// SchedulingPolicy (scheduler.h "Priorities"), driven step by step by the caller
// (StepDriver::kCaller), so that the order of admissions and preemptions is exact: with kPriority
// a replica admits its waiting sequences by (priority, arrival) and preempts the worst-ranked
// running one; with kFcfs it keeps arrival order and refuses a priority other than 0.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <vector>

#include "coordinator/scheduler/scheduler.h"
#include "tests/testing/fake_clock.h"
#include "tests/testing/preemption_counter.h"

namespace shardserve::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

class EndSink final : public SequenceSink {
 public:
  void OnTokens(absl::Span<const int32_t> /*tokens*/, absl::Span<const TokenLogprobs> /*logprobs*/) override {}
  void OnEnd(const SequenceEnd& e) override { end = e; }
  std::optional<SequenceEnd> end;
};

SchedulerOptions Options(const Clock* clock, SchedulingPolicy policy) {
  SchedulerOptions o;
  o.limits = {.vocab_size = 100, .max_seq_len = 64};
  o.clock = clock;
  o.step_driver = StepDriver::kCaller;
  o.policy = policy;
  return o;
}

SequenceRequest Request(int32_t first_token, int32_t priority, int32_t max_tokens) {
  return SequenceRequest{.prompt = {first_token, first_token + 1, first_token + 2},
                         .max_tokens = max_tokens,
                         .ignore_eos = true,
                         .priority = priority};
}

StepOutput Answer(const StepInput& in) {
  StepOutput out;
  for (const auto& s : in.sequences) {
    if (s.sample) out.token_ids.push_back(9);
  }
  return out;
}

TEST(SchedulingPolicyTest, NamesParseBothWays) {
  EXPECT_EQ(ParseSchedulingPolicy("fcfs"), SchedulingPolicy::kFcfs);
  EXPECT_EQ(ParseSchedulingPolicy("priority"), SchedulingPolicy::kPriority);
  EXPECT_EQ(ParseSchedulingPolicy("lifo"), std::nullopt);
  EXPECT_EQ(ParseSchedulingPolicy(""), std::nullopt);
  EXPECT_EQ(SchedulingPolicyName(SchedulingPolicy::kFcfs), "fcfs");
  EXPECT_EQ(SchedulingPolicyName(SchedulingPolicy::kPriority), "priority");
}

TEST(SchedulingPolicyTest, FcfsRefusesAPriorityNamingTheField) {
  testing::FakeClock clock;
  Scheduler scheduler(Options(&clock, SchedulingPolicy::kFcfs));
  ASSERT_TRUE(scheduler.AddReplica(0, nullptr, {.max_slots = 4, .kv_blocks = 16}).ok());
  absl::StatusOr<SequenceId> refused = scheduler.Submit(Request(1, 3, 2), std::make_shared<EndSink>());
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RequestFieldOf(refused.status()), "priority");
  EXPECT_THAT(refused.status().message(), HasSubstr("priority is 3"));
  EXPECT_THAT(refused.status().message(), HasSubstr("--scheduling_policy=priority"));
  EXPECT_TRUE(scheduler.Submit(Request(1, 0, 2), std::make_shared<EndSink>()).ok());
}

// The prompts' first tokens of the sequences each step prefills from position 0, step by step,
// until the replica has no work.
std::vector<int32_t> PrefillOrder(Scheduler& scheduler) {
  std::vector<int32_t> order;
  while (std::optional<StepInput> in = scheduler.BeginStep(0)) {
    for (const StepSequenceInput& s : in->sequences) {
      if (s.pos_begin == 0) order.push_back(s.token_ids[0]);
    }
    scheduler.EndStep(0, in->step_id, Answer(*in), absl::Milliseconds(1));
  }
  return order;
}

TEST(SchedulingPolicyTest, PriorityAdmitsWaitingRequestsByPriorityThenArrival) {
  testing::FakeClock clock;
  Scheduler scheduler(Options(&clock, SchedulingPolicy::kPriority));
  ASSERT_TRUE(scheduler.AddReplica(0, nullptr, {.max_slots = 1, .kv_blocks = 16}).ok());
  // The first takes the only slot at once; the others wait, and one token each ends them.
  for (auto [first, priority] : {std::pair(10, 0), std::pair(20, 5), std::pair(30, 1), std::pair(40, 1),
                                 std::pair(50, -2), std::pair(60, 5)}) {
    ASSERT_TRUE(scheduler.Submit(Request(first, priority, 1), std::make_shared<EndSink>()).ok());
  }
  EXPECT_THAT(PrefillOrder(scheduler), ElementsAre(10, 50, 30, 40, 20, 60));
}

TEST(SchedulingPolicyTest, FcfsAdmitsWaitingRequestsInArrivalOrder) {
  testing::FakeClock clock;
  Scheduler scheduler(Options(&clock, SchedulingPolicy::kFcfs));
  ASSERT_TRUE(scheduler.AddReplica(0, nullptr, {.max_slots = 1, .kv_blocks = 16}).ok());
  for (int32_t first : {10, 20, 30, 40}) {
    ASSERT_TRUE(scheduler.Submit(Request(first, 0, 1), std::make_shared<EndSink>()).ok());
  }
  EXPECT_THAT(PrefillOrder(scheduler), ElementsAre(10, 20, 30, 40));
}

// Two sequences, the worse-ranked admitted first, on a KV cache of 6 blocks of 2 tokens: both
// prefill their 3-token prompts (2 blocks each) and decode into a third block each; the next
// block either needs is not there, so one of them is preempted. `low` is admitted first (priority
// 5 under kPriority, 0 under kFcfs), `high` second (priority 0).
struct Contest {
  SequenceId low = 0, high = 0;
  std::vector<uint64_t> survivors;  // the members of the first step without both
  bool low_ended_first = false;
  int preempted = 0;
};

Contest RunContest(SchedulingPolicy policy) {
  testing::FakeClock clock;
  ::shardserve::testing::PreemptionCounter count;
  SchedulerOptions options = Options(&clock, policy);
  options.observer = &count;
  Scheduler scheduler(options);
  Contest c;
  EXPECT_TRUE(
      scheduler.AddReplica(0, nullptr, {.max_slots = 2, .kv_blocks = 6, .kv_block_size = 2, .prefix_caching = false})
          .ok());
  const int32_t low_priority = policy == SchedulingPolicy::kPriority ? 5 : 0;  // fcfs takes only 0
  auto low_sink = std::make_shared<EndSink>();
  auto high_sink = std::make_shared<EndSink>();
  c.low = *scheduler.Submit(Request(1, low_priority, 8), low_sink);
  c.high = *scheduler.Submit(Request(4, 0, 8), high_sink);
  while (std::optional<StepInput> in = scheduler.BeginStep(0)) {
    if (c.survivors.empty() && in->sequences.size() == 1) c.survivors.push_back(in->sequences[0].sequence_id);
    scheduler.EndStep(0, in->step_id, Answer(*in), absl::Milliseconds(1));
    if (low_sink->end.has_value() && !high_sink->end.has_value()) c.low_ended_first = true;
  }
  EXPECT_TRUE(low_sink->end.has_value() && low_sink->end->status.ok());
  EXPECT_TRUE(high_sink->end.has_value() && high_sink->end->status.ok());
  c.preempted = count.preempted();
  return c;
}

TEST(SchedulingPolicyTest, PriorityPreemptsTheWorseRankedSequenceEvenWhenItWasAdmittedFirst) {
  const Contest c = RunContest(SchedulingPolicy::kPriority);
  EXPECT_GE(c.preempted, 1);
  EXPECT_THAT(c.survivors, ElementsAre(c.high));
  EXPECT_FALSE(c.low_ended_first);
}

TEST(SchedulingPolicyTest, FcfsPreemptsTheNewestSequence) {
  const Contest c = RunContest(SchedulingPolicy::kFcfs);
  EXPECT_GE(c.preempted, 1);
  EXPECT_THAT(c.survivors, ElementsAre(c.low));
  EXPECT_TRUE(c.low_ended_first);
}

TEST(SchedulingPolicyTest, APreemptedSequenceWaitsAheadOfWorseRankedArrivalsButBehindBetterOnes) {
  // The contest's KV cache and slots, and behind it two more requests that arrive while both run:
  // one of priority 9 and one of priority -1. The preempted `low` (priority 5) goes back to the
  // queue between them: the -1 request is admitted before it, the 9 request after it.
  testing::FakeClock clock;
  Scheduler scheduler(Options(&clock, SchedulingPolicy::kPriority));
  ASSERT_TRUE(
      scheduler.AddReplica(0, nullptr, {.max_slots = 2, .kv_blocks = 6, .kv_block_size = 2, .prefix_caching = false})
          .ok());
  ASSERT_TRUE(scheduler.Submit(Request(1, 5, 8), std::make_shared<EndSink>()).ok());
  ASSERT_TRUE(scheduler.Submit(Request(4, 0, 8), std::make_shared<EndSink>()).ok());
  std::vector<int32_t> order;  // first prompt token of every prefill from position 0
  bool submitted = false;
  while (std::optional<StepInput> in = scheduler.BeginStep(0)) {
    for (const StepSequenceInput& s : in->sequences) {
      if (s.pos_begin == 0) order.push_back(s.token_ids[0]);
    }
    scheduler.EndStep(0, in->step_id, Answer(*in), absl::Milliseconds(1));
    if (!submitted) {
      ASSERT_TRUE(scheduler.Submit(Request(30, 9, 1), std::make_shared<EndSink>()).ok());
      ASSERT_TRUE(scheduler.Submit(Request(40, -1, 1), std::make_shared<EndSink>()).ok());
      submitted = true;
    }
  }
  // 4 and 1 first (one step, its prefill chunks in rank order); then 4 preempts 1, and once 4
  // ends: 40, the recomputed 1, then 30.
  EXPECT_THAT(order, ElementsAre(4, 1, 40, 1, 30));
}

}  // namespace
}  // namespace shardserve::coordinator

// Resumed sequences (SequenceRequest::resumed) in the scheduler, driven by the caller so that every
// step's input can be read: the resumed tokens are prefilled after the prompt and never delivered
// again, the next token samples with the index it would have had, the penalty history and
// min_tokens count them, and the end comes as it would have. ReplayResumed's checks, with a small
// constraint of our own.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "coordinator/scheduler/scheduler.h"
#include "tests/testing/fake_clock.h"
#include "tests/testing/status_matchers.h"

namespace shardserve::coordinator {
namespace {

using ::shardserve::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

class RecordingSink final : public SequenceSink {
 public:
  void OnTokens(absl::Span<const int32_t> t, absl::Span<const TokenLogprobs> /*logprobs*/) override {
    tokens.insert(tokens.end(), t.begin(), t.end());
  }
  void OnPromptLogprobs(absl::Span<const TokenLogprobs> l) override { prompt_logprobs += static_cast<int>(l.size()); }
  void OnEnd(const SequenceEnd& e) override { end = e; }
  std::vector<int32_t> tokens;
  int prompt_logprobs = 0;
  std::optional<SequenceEnd> end;
};

constexpr int32_t kEos = 2;

SchedulerOptions Options(const Clock* clock) {
  SchedulerOptions o;
  o.limits = {.vocab_size = 100, .max_seq_len = 64};
  o.clock = clock;
  o.step_driver = StepDriver::kCaller;
  o.eos_token_ids = {kEos};
  return o;
}

StepOutput Answer(const StepInput& in, int32_t token) {
  StepOutput out;
  for (const auto& s : in.sequences) {
    if (s.sample) out.token_ids.push_back(token);
  }
  return out;
}

// Text over the digits: token 10 + d spells digit d; the output must be exactly three digits,
// then EOS. States count the digits so far (3 = complete, 4 = EOS taken).
class ThreeDigits final : public TokenConstraint {
 public:
  int32_t StartState() const override { return 0; }
  std::shared_ptr<const std::string> AllowedMask(int32_t state) const override {
    auto mask = std::make_shared<std::string>(100 / 8 + 1, '\0');
    auto allow = [&](int32_t t) { (*mask)[static_cast<size_t>(t / 8)] |= static_cast<char>(1 << (t % 8)); };
    if (state < 3) {
      for (int32_t t = 10; t < 20; ++t) allow(t);
    } else if (state == 3) {
      allow(kEos);
    }
    return mask;
  }
  int32_t Advance(int32_t state, int32_t token) const override {
    if (state < 3 && token >= 10 && token < 20) return state + 1;
    if (state == 3 && token == kEos) return 4;
    return -1;
  }
  bool IsFinished(int32_t state) const override { return state == 4; }
};

TEST(SchedulerResumeTest, PrefillsTheResumedTokensAndSamplesWithTheNextIndex) {
  testing::FakeClock clock;
  Scheduler scheduler(Options(&clock));
  ASSERT_TRUE(scheduler.AddReplica(0, nullptr, {.max_slots = 4, .pipeline_depth = 1, .kv_blocks = 16}).ok());
  auto sink = std::make_shared<RecordingSink>();
  SequenceRequest r{.prompt = {1, 5, 6}, .max_tokens = 6, .min_tokens = 5, .prompt_logprobs = true};
  r.sampling = {.temperature = 0.7f, .seed = 9, .frequency_penalty = 0.5f, .repetition_penalty = 1.3f};
  r.resumed = {7, 7, 8};
  ASSERT_TRUE(scheduler.Submit(r, sink).ok());
  std::optional<StepInput> prefill = scheduler.BeginStep(0);
  ASSERT_TRUE(prefill.has_value());
  ASSERT_EQ(prefill->sequences.size(), 1u);
  const StepSequenceInput& in = prefill->sequences[0];
  EXPECT_THAT(in.token_ids, ElementsAre(1, 5, 6, 7, 7, 8));
  EXPECT_TRUE(in.sample);
  EXPECT_EQ(in.sample_index, 3u);
  EXPECT_EQ(in.sampling.seed, 9u);
  // The resumed tokens were generated: 7 twice, 8 once (the prompt's ids count 0).
  EXPECT_THAT(in.penalty_token_ids, ElementsAre(1, 5, 6, 7, 8));
  EXPECT_THAT(in.penalty_token_counts, ElementsAre(0, 0, 0, 2, 1));
  EXPECT_THAT(in.suppress_token_ids, ElementsAre(kEos));  // 3 < min_tokens = 5
  EXPECT_TRUE(in.prompt_logprob_targets.empty());         // sent with the first attempt's tokens
  scheduler.EndStep(0, prefill->step_id, Answer(*prefill, 9), absl::Milliseconds(1));
  std::optional<StepInput> decode = scheduler.BeginStep(0);
  ASSERT_TRUE(decode.has_value());
  EXPECT_EQ(decode->sequences[0].sample_index, 4u);
  EXPECT_THAT(decode->sequences[0].suppress_token_ids, ElementsAre(kEos));  // 4 < 5
  scheduler.EndStep(0, decode->step_id, Answer(*decode, 11), absl::Milliseconds(1));
  decode = scheduler.BeginStep(0);
  ASSERT_TRUE(decode.has_value());
  EXPECT_TRUE(decode->sequences[0].suppress_token_ids.empty());  // 5 tokens: EOS may come
  scheduler.EndStep(0, decode->step_id, Answer(*decode, 12), absl::Milliseconds(1));
  // Only the new tokens are delivered; max_tokens counted the resumed ones.
  EXPECT_THAT(sink->tokens, ElementsAre(9, 11, 12));
  EXPECT_EQ(sink->prompt_logprobs, 0);
  ASSERT_TRUE(sink->end.has_value());
  EXPECT_EQ(sink->end->reason, FinishReason::kLength);
  EXPECT_EQ(sink->end->completion_tokens, 6);
  EXPECT_EQ(sink->end->prompt_tokens, 3);
}

TEST(SchedulerResumeTest, TheConstraintGoesOnFromTheResumedState) {
  testing::FakeClock clock;
  Scheduler scheduler(Options(&clock));
  ASSERT_TRUE(scheduler.AddReplica(0, nullptr, {.max_slots = 4, .pipeline_depth = 1, .kv_blocks = 16}).ok());
  auto sink = std::make_shared<RecordingSink>();
  SequenceRequest r{.prompt = {1}, .max_tokens = 10, .constraint = std::make_shared<ThreeDigits>()};
  r.resumed = {13, 14};
  ASSERT_TRUE(scheduler.Submit(r, sink).ok());
  std::optional<StepInput> step = scheduler.BeginStep(0);
  ASSERT_TRUE(step.has_value());
  ASSERT_NE(step->sequences[0].allowed_token_mask, nullptr);
  EXPECT_EQ(*step->sequences[0].allowed_token_mask, *ThreeDigits().AllowedMask(2));  // two digits so far
  scheduler.EndStep(0, step->step_id, Answer(*step, 15), absl::Milliseconds(1));
  step = scheduler.BeginStep(0);
  ASSERT_TRUE(step.has_value());
  EXPECT_EQ(*step->sequences[0].allowed_token_mask, *ThreeDigits().AllowedMask(3));  // only EOS
  scheduler.EndStep(0, step->step_id, Answer(*step, kEos), absl::Milliseconds(1));
  EXPECT_THAT(sink->tokens, ElementsAre(15, kEos));
  ASSERT_TRUE(sink->end.has_value());
  EXPECT_EQ(sink->end->reason, FinishReason::kStop);
}

TEST(SchedulerResumeTest, ReplayResumedSaysWhereTheTokensLeaveTheRequest) {
  const RequestLimits limits{.vocab_size = 100, .max_seq_len = 64};
  const std::vector<int32_t> eos = {kEos};
  SequenceRequest r{.prompt = {1}, .max_tokens = 3, .stop_token_ids = {50}};
  auto replay = [&](std::vector<int32_t> tokens) {
    r.resumed = std::move(tokens);
    return ReplayResumed(r, eos, limits);
  };
  ASSERT_TRUE(replay({}).ok());
  EXPECT_FALSE(replay({}).value().ended.has_value());
  EXPECT_FALSE(replay({7, 8}).value().ended.has_value());
  EXPECT_EQ(replay({7, 8, 9}).value().ended, FinishReason::kLength);
  EXPECT_EQ(replay({7, kEos}).value().ended, FinishReason::kStop);
  EXPECT_EQ(replay({50}).value().ended, FinishReason::kStop);
  EXPECT_THAT(replay({7, 100}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("resume.token_ids[1] = 100 is outside")));
  EXPECT_THAT(replay({7, 8, 9, 10}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("4 tokens, more than max_tokens = 3")));
  EXPECT_THAT(replay({kEos, 8}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ends the request, yet more tokens follow")));
  r.ignore_eos = true;
  EXPECT_FALSE(replay({kEos, 8}).value().ended.has_value());
  // The context full ends it too (max_seq_len 4: prompt 1 + 3).
  EXPECT_EQ(ReplayResumed(SequenceRequest{.prompt = {1}, .max_tokens = 5, .resumed = {7, 8, 9}}, eos,
                          {.vocab_size = 100, .max_seq_len = 4})
                .value()
                .ended,
            FinishReason::kLength);

  SequenceRequest c{.prompt = {1}, .max_tokens = 10, .constraint = std::make_shared<ThreeDigits>()};
  c.resumed = {13, 14, 15};
  ASSERT_TRUE(ReplayResumed(c, eos, limits).ok());
  EXPECT_EQ(ReplayResumed(c, eos, limits)->constraint_state, 3);
  EXPECT_FALSE(ReplayResumed(c, eos, limits)->ended.has_value());
  c.resumed = {13, 14, 15, kEos};
  EXPECT_EQ(ReplayResumed(c, eos, limits)->ended, FinishReason::kStop);
  c.resumed = {13, 40};
  EXPECT_THAT(ReplayResumed(c, eos, limits).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("resume.token_ids[1] = 40 is not allowed there")));
}

TEST(SchedulerResumeTest, SubmitRefusesResumedTokensThatAlreadyEndTheRequest) {
  testing::FakeClock clock;
  Scheduler scheduler(Options(&clock));
  ASSERT_TRUE(scheduler.AddReplica(0, nullptr, {.max_slots = 4, .pipeline_depth = 1, .kv_blocks = 16}).ok());
  SequenceRequest r{.prompt = {1}, .max_tokens = 2, .resumed = {7, 8}};
  EXPECT_THAT(scheduler.Submit(r, std::make_shared<RecordingSink>()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("already end the request (length)")));
}

}  // namespace
}  // namespace shardserve::coordinator

// The rules on a sequence's next token (next_token.h): bad words' bans after the output's tail,
// min_tokens' suppression, a constraint's mask, and the bans lifted where they would leave nothing
// to sample; the same rules in ReplayResumed (the steps' are in scheduler_caller_test.cc).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "coordinator/scheduler/next_token.h"
#include "tests/testing/status_matchers.h"

namespace shardserve::coordinator {
namespace {

using ::shardserve::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr int32_t kEos = 2;
constexpr int64_t kVocab = 16;

std::vector<int32_t> Bans(const std::vector<std::vector<int32_t>>& words, const std::vector<int32_t>& output) {
  std::vector<int32_t> out;
  AppendBadWordBans(words, output, &out);
  return out;
}

TEST(BadWordBansTest, BanTheLastTokenOfEveryWordWhosePrefixEndsTheOutput) {
  const std::vector<std::vector<int32_t>> words = {{7}, {3, 4}, {5, 3, 4, 9}, {6, 8}};
  EXPECT_THAT(Bans(words, {}), ElementsAre(7));  // a one-token word from the start
  EXPECT_THAT(Bans(words, {1, 3}), ElementsAre(7, 4));
  EXPECT_THAT(Bans(words, {5, 3, 4}), ElementsAre(7, 9));
  EXPECT_THAT(Bans(words, {3, 4}), ElementsAre(7));  // {5, 3, 4} is not all there
  EXPECT_THAT(Bans(words, {6}), ElementsAre(7, 8));
  EXPECT_THAT(Bans(words, {6, 1}), ElementsAre(7));  // only the tail counts
  EXPECT_THAT(Bans({{}}, {1}), IsEmpty());
}

// Allows exactly `allowed` in every state.
class Only final : public TokenConstraint {
 public:
  explicit Only(std::vector<int32_t> allowed) : mask_(std::make_shared<std::string>(kVocab / 8, '\0')) {
    for (int32_t t : allowed) (*mask_)[static_cast<size_t>(t / 8)] |= static_cast<char>(1 << (t % 8));
  }
  int32_t StartState() const override { return 0; }
  std::shared_ptr<const std::string> AllowedMask(int32_t) const override { return mask_; }
  int32_t Advance(int32_t, int32_t token) const override {
    return ((static_cast<unsigned char>((*mask_)[static_cast<size_t>(token / 8)]) >> (token % 8)) & 1) ? 0 : -1;
  }
  bool IsFinished(int32_t) const override { return false; }
  bool DecidesEos() const override { return false; }

 private:
  std::shared_ptr<std::string> mask_;
};

TEST(NextTokenRulesTest, MinTokensAndBadWordsSuppressSortedAndDistinct) {
  SequenceRequest r{.prompt = {1}, .max_tokens = 8, .stop_token_ids = {9, 4}, .min_tokens = 2};
  r.bad_words = {{4}, {3, 11}, {12}};
  const std::vector<int32_t> eos = {kEos};
  NextTokenRules rules = NextTokenRulesOf(r, eos, kVocab, std::vector<int32_t>{3}, 0);
  EXPECT_THAT(rules.suppress, ElementsAre(kEos, 4, 9, 11, 12));
  EXPECT_EQ(rules.mask, nullptr);
  EXPECT_FALSE(rules.Allows(11));
  EXPECT_TRUE(rules.Allows(3));
  // Past min_tokens only the bans stay.
  rules = NextTokenRulesOf(r, eos, kVocab, std::vector<int32_t>{5, 3}, 0);
  EXPECT_THAT(rules.suppress, ElementsAre(4, 11, 12));
  r.ignore_eos = true;
  rules = NextTokenRulesOf(r, eos, kVocab, std::vector<int32_t>{}, 0);
  EXPECT_THAT(rules.suppress, ElementsAre(4, 9, 12));
}

TEST(NextTokenRulesTest, BansThatWouldLeaveNothingToSampleAreLifted) {
  SequenceRequest r{.prompt = {1}, .max_tokens = 8};
  for (int32_t t = 0; t < kVocab; ++t) {
    if (t != 5) r.bad_words.push_back({t});
  }
  r.bad_words.push_back({6, 5});
  NextTokenRules rules = NextTokenRulesOf(r, {}, kVocab, std::vector<int32_t>{1}, 0);
  EXPECT_EQ(rules.suppress.size(), static_cast<size_t>(kVocab - 1));  // all but 5
  EXPECT_TRUE(rules.Allows(5));
  // After 6, token 5 is banned too: nothing would be left, so this step has no bans.
  rules = NextTokenRulesOf(r, {}, kVocab, std::vector<int32_t>{6}, 0);
  EXPECT_THAT(rules.suppress, IsEmpty());
  // min_tokens' suppression is not lifted with them.
  r.stop_token_ids = {9};
  r.min_tokens = 3;
  rules = NextTokenRulesOf(r, {}, kVocab, std::vector<int32_t>{6}, 0);
  EXPECT_THAT(rules.suppress, ElementsAre(9));
}

TEST(NextTokenRulesTest, BansAreLiftedWhenTheyCoverWhatTheConstraintAllows) {
  SequenceRequest r{.prompt = {1}, .max_tokens = 8};
  r.constraint = std::make_shared<Only>(std::vector<int32_t>{3, 10});
  r.bad_words = {{3}, {7, 10}};
  NextTokenRules rules = NextTokenRulesOf(r, {}, kVocab, std::vector<int32_t>{}, 0);
  ASSERT_NE(rules.mask, nullptr);
  EXPECT_THAT(rules.suppress, ElementsAre(3));
  EXPECT_FALSE(rules.Allows(3));
  EXPECT_TRUE(rules.Allows(10));
  EXPECT_FALSE(rules.Allows(11));  // the mask's
  // After 7 both allowed tokens would be banned.
  rules = NextTokenRulesOf(r, {}, kVocab, std::vector<int32_t>{7}, 0);
  EXPECT_THAT(rules.suppress, IsEmpty());
  EXPECT_TRUE(rules.Allows(3));
}

TEST(NextTokenRulesTest, ResumedTokensAreReplayedAgainstTheBans) {
  SequenceRequest r{.prompt = {1}, .max_tokens = 8};
  r.bad_words = {{3, 4}};
  const RequestLimits limits{.vocab_size = kVocab, .max_seq_len = 32};
  r.resumed = {3, 5, 4, 3};
  EXPECT_TRUE(ReplayResumed(r, {kEos}, limits).ok());
  r.resumed = {5, 3, 4};
  EXPECT_THAT(ReplayResumed(r, {kEos}, limits).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("resume.token_ids[2] = 4 could not have been generated there")));
  // min_tokens holds the EOS back too, even as the last token.
  r.bad_words.clear();
  r.min_tokens = 3;
  r.resumed = {5, kEos};
  EXPECT_THAT(ReplayResumed(r, {kEos}, limits).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("resume.token_ids[1] = 2 could not")));
  r.resumed = {5, 6, 7, kEos};  // three tokens before it
  ASSERT_OK_AND_ASSIGN(ResumedState state, ReplayResumed(r, {kEos}, limits));
  EXPECT_EQ(state.ended, FinishReason::kStop);
}

TEST(NextTokenRulesTest, ValidationNamesBadWords) {
  const RequestLimits limits{.vocab_size = kVocab, .max_seq_len = 32};
  SequenceRequest r{.prompt = {1}, .max_tokens = 8};
  r.bad_words = {{3}, {}};
  EXPECT_THAT(ValidateSequenceRequest(r, limits),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bad_words: token sequence 1 has 0 tokens")));
  r.bad_words = {{3, 16}};
  EXPECT_THAT(ValidateSequenceRequest(r, limits),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("holds 16, outside the vocabulary")));
  r.bad_words = {std::vector<int32_t>(kMaxBadWordTokens + 1, 3)};
  EXPECT_FALSE(ValidateSequenceRequest(r, limits).ok());
  r.bad_words.assign(kMaxBadWordSequences + 1, {3});
  EXPECT_THAT(ValidateSequenceRequest(r, limits),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at most 512")));
  EXPECT_EQ(RequestFieldOf(ValidateSequenceRequest(r, limits)), "bad_words");
  r.bad_words = {{3, 4}};
  EXPECT_TRUE(ValidateSequenceRequest(r, limits).ok());
}

}  // namespace
}  // namespace shardserve::coordinator

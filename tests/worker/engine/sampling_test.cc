#include "worker/engine/sampling.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <vector>

#include "tests/testing/status_matchers.h"

namespace shardserve::engine {
namespace {

using ::shardserve::testing::IsOk;
using ::shardserve::testing::StatusIs;
using ::testing::HasSubstr;

TEST(SamplingTest, GreedyPicksTheFirstLargestLogit) {
  Sampler s;
  const std::vector<float> logits = {0.1f, 2.0f, -1.f, 2.0f};
  EXPECT_EQ(s.Sample(logits, {}, 0), 1);
  EXPECT_EQ(s.Sample(logits, {.temperature = 1.0f, .top_k = 1}, 7), 1);
}

TEST(SamplingTest, TopKNeverPicksOutsideTheKLargest) {
  Sampler s;
  const std::vector<float> logits = {1.f, 5.f, 4.f, 0.f, 3.f};
  for (uint64_t step = 0; step < 500; ++step) {
    const int32_t t = s.Sample(logits, {.temperature = 5.0f, .top_k = 2, .seed = 11}, step);
    EXPECT_TRUE(t == 1 || t == 2) << t;
  }
}

TEST(SamplingTest, TopPKeepsTheSmallestPrefixReachingP) {
  Sampler s;
  // probabilities ~ {0.643, 0.237, 0.087, 0.032}: top_p 0.7 keeps ids 0 and 1 only.
  const std::vector<float> logits = {3.f, 2.f, 1.f, 0.f};
  std::map<int32_t, int> seen;
  for (uint64_t step = 0; step < 2000; ++step) ++seen[s.Sample(logits, {.temperature = 1.0f, .top_p = 0.7f}, step)];
  EXPECT_EQ(seen.count(2), 0u);
  EXPECT_EQ(seen.count(3), 0u);
  // Renormalised over {0, 1}: P(0) = e / (e + 1) = 0.731.
  EXPECT_NEAR(seen[0] / 2000.0, 0.731, 0.04);
}

TEST(SamplingTest, FrequenciesFollowTheSoftmaxAtTheTemperature) {
  Sampler s;
  const std::vector<float> logits = {0.f, std::log(3.0f)};  // p = {0.25, 0.75} at T = 1
  int ones = 0;
  const int n = 4000;
  for (int i = 0; i < n; ++i) ones += s.Sample(logits, {.temperature = 1.0f, .seed = 3}, static_cast<uint64_t>(i));
  EXPECT_NEAR(ones / static_cast<double>(n), 0.75, 0.03);
  // At T = 2 the odds are sqrt(3): p(1) = 0.634.
  ones = 0;
  for (int i = 0; i < n; ++i) ones += s.Sample(logits, {.temperature = 2.0f, .seed = 3}, static_cast<uint64_t>(i));
  EXPECT_NEAR(ones / static_cast<double>(n), 0.634, 0.03);
}

TEST(SamplingTest, SameSeedAndStepGiveTheSameTokenDifferentSeedsDiffer) {
  Sampler a, b;
  std::vector<float> logits(100);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>(i % 7);
  int differ = 0;
  for (uint64_t step = 0; step < 50; ++step) {
    const SamplingParams p{.temperature = 1.0f, .seed = 42};
    EXPECT_EQ(a.Sample(logits, p, step), b.Sample(logits, p, step));
    differ += a.Sample(logits, p, step) != a.Sample(logits, {.temperature = 1.0f, .seed = 43}, step);
  }
  EXPECT_GT(differ, 10);
}

TEST(SamplingTest, UniformIsInUnitInterval) {
  for (uint64_t i = 0; i < 1000; ++i) {
    const double u = SamplingUniform(i * 7919, i);
    EXPECT_GE(u, 0.0);
    EXPECT_LT(u, 1.0);
  }
}

TEST(SamplingTest, ValidateNamesTheBadField) {
  EXPECT_THAT(SamplingParams{}.Validate(), IsOk());
  EXPECT_THAT(SamplingParams{.temperature = -0.5f}.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("temperature")));
  EXPECT_THAT(SamplingParams{.temperature = NAN}.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("temperature")));
  EXPECT_THAT(SamplingParams{.top_k = -1}.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("top_k")));
  EXPECT_THAT(SamplingParams{.top_p = 1.5f}.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("top_p")));
  EXPECT_THAT(SamplingParams{.top_p = 0.f}.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("top_p")));
  EXPECT_THAT(SamplingParams{.min_p = 1.5f}.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("min_p")));
  const SamplingParams too_big{.logit_bias = {{3, 101.f}}};
  EXPECT_THAT(too_big.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("logit_bias for token 3")));
  const SamplingParams negative_id{.logit_bias = {{-1, 1.f}}};
  EXPECT_THAT(negative_id.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("logit_bias")));
  EXPECT_THAT(SamplingParams{.suppress_ids = {-2}}.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("suppressed")));
}

TEST(SamplingTest, LogitBiasAndSuppressionChangeTheArgmaxAndAreNotGreedyOnTheDevice) {
  Sampler s;
  const std::vector<float> logits = {0.f, 3.f, 1.f, 2.f};
  EXPECT_TRUE(SamplingParams{}.IsGreedy());
  const SamplingParams bias{.logit_bias = {{2, 2.5f}}};
  EXPECT_FALSE(bias.IsGreedy());
  EXPECT_EQ(s.Sample(logits, bias, 0), 2);  // 1 + 2.5 > 3
  const SamplingParams banned{.suppress_ids = {1, 99}};  // out-of-row ids are ignored
  EXPECT_FALSE(banned.IsGreedy());
  EXPECT_EQ(s.Sample(logits, banned, 0), 3);
  // With a temperature, a suppressed token is never drawn, and a -100 bias makes one negligible.
  for (uint64_t step = 0; step < 500; ++step) {
    EXPECT_NE(s.Sample(logits, {.temperature = 3.0f, .seed = 5, .suppress_ids = {1}}, step), 1);
    EXPECT_NE(s.Sample(logits, {.temperature = 1.0f, .seed = 5, .logit_bias = {{1, -100.f}}}, step), 1);
  }
}

// Structured output's mask: packed bits over the vocabulary; masked tokens are never chosen, the
// request is never a device argmax, and logprobs (computed from the raw row) are unaffected.
TEST(SamplingTest, AllowedTokenMaskRestrictsTheChoice) {
  Sampler s;
  const std::vector<float> logits = {0.f, 3.f, 1.f, 2.f, 0.5f, 0.f, 0.f, 0.f, 4.f, 0.f};  // 10 ids: two mask bytes
  // Allowed: ids 2, 3 and 9 (bit 1 of the second byte).
  const std::string mask = {static_cast<char>(0b00001100), static_cast<char>(0b00000010)};
  const SamplingParams greedy{.allowed_token_mask = mask};
  EXPECT_FALSE(greedy.IsGreedy());
  EXPECT_EQ(s.Sample(logits, greedy, 0), 3);
  std::map<int32_t, int> seen;
  for (uint64_t step = 0; step < 1000; ++step) {
    ++seen[s.Sample(logits, {.temperature = 2.0f, .seed = 3, .allowed_token_mask = mask}, step)];
  }
  EXPECT_EQ(seen.size(), 3u);
  EXPECT_GT(seen[2], 0);
  EXPECT_GT(seen[3], 0);
  EXPECT_GT(seen[9], 0);
  // Ids past the end of the mask are not allowed: a one-byte mask allowing nothing below 8 but
  // id 4 leaves id 8 (the argmax) out.
  EXPECT_EQ(s.Sample(logits, {.allowed_token_mask = std::string(1, static_cast<char>(0b00010000))}, 0), 4);
  // The mask composes with suppression and bias (still -inf for the masked ones).
  EXPECT_EQ(s.Sample(logits, {.logit_bias = {{8, 100.f}}, .suppress_ids = {3}, .allowed_token_mask = mask}, 0), 2);
  // A mask allowing nothing in the row is ignored rather than leaving nothing to draw.
  EXPECT_EQ(s.Sample(logits, {.allowed_token_mask = std::string(2, '\0')}, 0), 8);
  // Logprobs are those of the raw logits, whatever the mask.
  const TokenLogprobs lp = ComputeLogprobs(logits, 3, 1);
  ASSERT_EQ(lp.top_ids.size(), 1u);
  EXPECT_EQ(lp.top_ids[0], 8);
}

TEST(SamplingTest, MinPDropsTokensBelowAFractionOfTheMostLikely) {
  Sampler s;
  // p ~ {0.643, 0.237, 0.087, 0.032}: min_p 0.3 keeps ids with p >= 0.193: 0 and 1.
  const std::vector<float> logits = {3.f, 2.f, 1.f, 0.f};
  std::map<int32_t, int> seen;
  for (uint64_t step = 0; step < 2000; ++step) ++seen[s.Sample(logits, {.temperature = 1.0f, .min_p = 0.3f}, step)];
  EXPECT_EQ(seen.count(2), 0u);
  EXPECT_EQ(seen.count(3), 0u);
  EXPECT_NEAR(seen[0] / 2000.0, 0.731, 0.04);
  // min_p 0 keeps everything: id 3 (p 0.032) shows up.
  seen.clear();
  for (uint64_t step = 0; step < 2000; ++step) ++seen[s.Sample(logits, {.temperature = 1.0f}, step)];
  EXPECT_GT(seen[3], 20);
}

TEST(SamplingTest, LogprobsAreTheLogSoftmaxOfTheRawLogits) {
  const std::vector<float> logits = {1.f, 3.f, 3.f, -2.f, 0.5f};
  double z = 0;
  for (float l : logits) z += std::exp(static_cast<double>(l));
  const TokenLogprobs lp = ComputeLogprobs(logits, 4, 3);
  EXPECT_NEAR(lp.logprob, 0.5 - std::log(z), 1e-6);
  ASSERT_EQ(lp.top_ids, (std::vector<int32_t>{1, 2, 0}));  // ties: lower id first
  ASSERT_EQ(lp.top_logprobs.size(), 3u);
  EXPECT_NEAR(lp.top_logprobs[0], 3.0 - std::log(z), 1e-6);
  EXPECT_EQ(lp.top_logprobs[0], lp.top_logprobs[1]);
  EXPECT_NEAR(lp.top_logprobs[2], 1.0 - std::log(z), 1e-6);
  EXPECT_TRUE(ComputeLogprobs(logits, 0, 0).top_ids.empty());
  EXPECT_EQ(ComputeLogprobs(logits, 0, 99).top_ids.size(), logits.size());  // clamped to the row
  // Large logits do not overflow.
  const std::vector<float> big = {1000.f, 999.f};
  EXPECT_NEAR(ComputeLogprobs(big, 1, 0).logprob, -1.0 - std::log1p(std::exp(-1.0)), 1e-6);
}

}  // namespace
}  // namespace shardserve::engine

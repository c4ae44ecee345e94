#include "worker/engine/sampling.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
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

// The penalties as vLLM defines them, on a row small enough to work out by hand.
TEST(SamplingTest, PenaltiesFollowTheirDefinitions) {
  const std::vector<float> logits = {2.f, -1.f, 0.5f, 4.f, -3.f};
  // Token 0 and 1 in the prompt only, 2 generated twice, 3 generated once; 4 never seen.
  SamplingParams p{.repetition_penalty = 1.25f,
                   .frequency_penalty = 0.5f,
                   .presence_penalty = 0.75f,
                   .history_ids = {0, 1, 2, 3},
                   .history_counts = {0, 0, 2, 1}};
  ASSERT_TRUE(p.Validate().ok());
  EXPECT_FALSE(p.IsGreedy());
  const std::vector<float> got = AdjustedLogits(logits, p);
  EXPECT_FLOAT_EQ(got[0], 2.f / 1.25f);                       // positive: divided
  EXPECT_FLOAT_EQ(got[1], -1.f * 1.25f);                      // negative: multiplied
  EXPECT_FLOAT_EQ(got[2], 0.5f / 1.25f - 2 * 0.5f - 0.75f);   // repetition, then frequency x2, presence
  EXPECT_FLOAT_EQ(got[3], 4.f / 1.25f - 0.5f - 0.75f);
  EXPECT_FLOAT_EQ(got[4], -3.f);                              // untouched
  // Logit bias comes first: a bias that makes token 4 positive is then divided.
  p.logit_bias = {{4, 5.f}};
  p.history_ids = {4};
  p.history_counts = {0};
  EXPECT_FLOAT_EQ(AdjustedLogits(logits, p)[4], 2.f / 1.25f);
  // Greedy sampling takes the argmax of the penalized row: a large presence penalty moves it off
  // the repeated token 3.
  Sampler s;
  EXPECT_EQ(s.Sample(logits, {}, 0), 3);
  EXPECT_EQ(s.Sample(logits, {.presence_penalty = 2.f, .history_ids = {3}, .history_counts = {1}}, 0), 0);
  // A prompt-only token is not touched by frequency or presence penalties.
  EXPECT_EQ(s.Sample(logits, {.presence_penalty = 2.f, .history_ids = {3}, .history_counts = {0}}, 0), 3);
  // Negative penalties encourage repetition.
  EXPECT_EQ(s.Sample(logits, {.frequency_penalty = -2.f, .history_ids = {0}, .history_counts = {2}}, 0), 0);
}

TEST(SamplingTest, PenaltyValidationNamesTheField) {

  EXPECT_THAT(SamplingParams{.repetition_penalty = 0.f}.Validate().message(), HasSubstr("repetition_penalty"));
  EXPECT_THAT(SamplingParams{.repetition_penalty = 2.5f}.Validate().message(), HasSubstr("repetition_penalty"));
  EXPECT_THAT(SamplingParams{.frequency_penalty = -2.5f}.Validate().message(), HasSubstr("frequency_penalty"));
  EXPECT_THAT(SamplingParams{.presence_penalty = 3.f}.Validate().message(), HasSubstr("presence_penalty"));
  EXPECT_THAT((SamplingParams{.history_ids = {1, 2}, .history_counts = {1}}.Validate().message()),
              HasSubstr("2 ids but 1 counts"));
  EXPECT_THAT((SamplingParams{.history_ids = {2, 2}, .history_counts = {1, 1}}.Validate().message()),
              HasSubstr("ascending"));
  EXPECT_THAT((SamplingParams{.history_ids = {2}, .history_counts = {-1}}.Validate().message()),
              HasSubstr("negative"));
}

// The definition, written plainly: every candidate sorted (descending logit, ties lower id), cut
// to top_k, softmax at the temperature, the smallest prefix reaching top_p, those at least min_p
// times the most likely, and the draw walking that order.
int32_t ReferenceSample(const std::vector<float>& logits, const SamplingParams& p, uint64_t step) {
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  size_t keep = p.top_k > 0 ? std::min<size_t>(order.size(), static_cast<size_t>(p.top_k)) : order.size();
  std::vector<double> w(keep);
  double total = 0;
  for (size_t i = 0; i < keep; ++i) {
    total += w[i] = std::exp((static_cast<double>(logits[order[i]]) - logits[order[0]]) * (1.0 / p.temperature));
  }
  if (p.top_p < 1.0f) {
    double cum = 0;
    for (size_t i = 0; i < keep; ++i) {
      cum += w[i];
      if (cum >= p.top_p * total) {
        keep = i + 1;
        break;
      }
    }
  }
  if (p.min_p > 0.0f) {
    size_t cut = 1;
    while (cut < keep && w[cut] >= p.min_p * w[0]) ++cut;
    keep = cut;
  }
  total = 0;
  for (size_t i = 0; i < keep; ++i) total += w[i];
  const double u = SamplingUniform(p.seed, step) * total;
  double cum = 0;
  for (size_t i = 0; i < keep; ++i) {
    cum += w[i];
    if (u < cum) return order[i];
  }
  return order[keep - 1];
}

// The sampler sorts only the prefix its walk reaches; it must pick what the plain definition
// picks, over vocabularies, distributions (peaked to flat, with ties) and options.
TEST(SamplingTest, PartialSortingPicksWhatTheFullSortPicks) {
  std::mt19937 rng(5);
  Sampler s;
  int checked = 0;
  for (int vocab : {2, 7, 100, 1000, 5000}) {
    for (float spread : {0.5f, 3.f, 12.f}) {
      std::normal_distribution<float> logit(0.f, spread);
      std::vector<float> row(static_cast<size_t>(vocab));
      for (float& l : row) l = std::round(logit(rng) * 4.f) / 4.f;  // quarter steps: many ties
      for (const SamplingParams& base : std::vector<SamplingParams>{
               {.temperature = 1.0f}, {.temperature = 0.7f, .top_p = 0.9f}, {.temperature = 1.3f, .top_k = 40},
               {.temperature = 1.0f, .top_k = 300, .top_p = 0.5f}, {.temperature = 0.9f, .min_p = 0.05f},
               {.temperature = 2.0f, .top_p = 0.99f, .min_p = 0.01f}, {.temperature = 0.2f, .top_p = 0.3f}}) {
        for (uint64_t step = 0; step < 40; ++step) {
          SamplingParams p = base;
          p.seed = 17 + static_cast<uint64_t>(vocab);
          ASSERT_EQ(s.Sample(row, p, step), ReferenceSample(row, p, step))
              << "vocab " << vocab << " spread " << spread << " T " << p.temperature << " top_k " << p.top_k
              << " top_p " << p.top_p << " min_p " << p.min_p << " step " << step;
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 5 * 3 * 7 * 40);
}

}  // namespace
}  // namespace shardserve::engine

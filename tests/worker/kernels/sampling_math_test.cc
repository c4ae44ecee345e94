// kernels/shared/sampling_math.h and sampling_host.h on the host: the uniform, the candidate cut
// and the draw at their edges (ties, top_p = 1, min_p = 0 and 1, top_k beyond the row, rows of
// -inf, a tiny temperature). Expected values are worked out by hand in the comments, or come from
// an independent implementation (the uniform's, from splitmix64's published outputs and Python).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <vector>

#include "worker/kernels/shared/sampling_host.h"
#include "worker/kernels/shared/sampling_math.h"

namespace shardserve::kernels {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(SamplingMathTest, SplitMixMatchesItsPublishedOutputs) {
  // The first two outputs of Vigna's splitmix64 generator seeded with 0.
  EXPECT_EQ(SplitMix64(0), 0xe220a8397b1dcdafull);
  EXPECT_EQ(SplitMix64(0x9e3779b97f4a7c15ull), 0x6e789e6aa1b965f4ull);
}

TEST(SamplingMathTest, UniformOfSeedAndStepMatchesAnIndependentImplementation) {
  // 53-bit numerators from a Python implementation of the same definition.
  EXPECT_EQ(SamplingUniformOf(0, 0), 5876733520225071.0 * 0x1.0p-53);
  EXPECT_EQ(SamplingUniformOf(42, 7), 466803804666104.0 * 0x1.0p-53);
  EXPECT_EQ(SamplingUniformOf(123456789, 1000), 6595845551038054.0 * 0x1.0p-53);
  for (uint64_t i = 0; i < 10000; ++i) {
    const double u = SamplingUniformOf(i * 7919, i);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
  }
}

TEST(SamplingMathTest, ArgmaxRowsAndCandidateCounts) {
  EXPECT_TRUE(SamplesArgmax(0.0f, 0));
  EXPECT_TRUE(SamplesArgmax(0.8f, 1));
  EXPECT_FALSE(SamplesArgmax(0.8f, 2));
  EXPECT_EQ(SamplingCandidates(0, 10), 10);   // no limit
  EXPECT_EQ(SamplingCandidates(3, 10), 3);
  EXPECT_EQ(SamplingCandidates(10, 10), 10);
  EXPECT_EQ(SamplingCandidates(50, 10), 10);  // k beyond the row
}

TEST(SamplingMathTest, CandidateWeightIsTheSoftmaxNumerator) {
  EXPECT_EQ(CandidateWeight(3.0f, 3.0, 1.0), 1.0);  // the largest weighs exactly 1
  EXPECT_DOUBLE_EQ(CandidateWeight(1.0f, 3.0, 0.5), std::exp(-1.0));
  EXPECT_EQ(CandidateWeight(-kInf, 3.0, 2.0), 0.0);
  // A tiny temperature leaves only the largest with weight.
  EXPECT_EQ(CandidateWeight(2.999f, 3.0, 1.0 / 1e-30), 0.0);
}

// Weights 1, 1/2, 1/4, 1/4 at temperature 1: probabilities 1/2, 1/4, 1/8, 1/8, so cumulative
// boundaries at 0.5, 0.75 and 0.875.
const float kQuarters[] = {std::log(4.0f), std::log(2.0f), 0.0f, 0.0f};

int64_t Pick(const float* sorted, int64_t count, float top_p, float min_p, double inv_t, double u) {
  SortedLogitArray a{sorted};
  double total = 0.0;
  for (int64_t i = 0; i < count; ++i) total += CandidateWeight(sorted[i], sorted[0], inv_t);
  return PickSortedCandidate(a, count, total, top_p, min_p, inv_t, u);
}

TEST(SamplingMathTest, DrawFollowsTheCumulativeWeights) {
  EXPECT_EQ(Pick(kQuarters, 4, 1.0f, 0.0f, 1.0, 0.0), 0);
  EXPECT_EQ(Pick(kQuarters, 4, 1.0f, 0.0f, 1.0, 0.49), 0);
  EXPECT_EQ(Pick(kQuarters, 4, 1.0f, 0.0f, 1.0, 0.51), 1);
  EXPECT_EQ(Pick(kQuarters, 4, 1.0f, 0.0f, 1.0, 0.74), 1);
  EXPECT_EQ(Pick(kQuarters, 4, 1.0f, 0.0f, 1.0, 0.76), 2);
  EXPECT_EQ(Pick(kQuarters, 4, 1.0f, 0.0f, 1.0, 0.9), 3);
  EXPECT_EQ(Pick(kQuarters, 4, 1.0f, 0.0f, 1.0, 1.0 - 0x1.0p-53), 3);
  // top_k 2 (count 2): probabilities 2/3, 1/3.
  EXPECT_EQ(Pick(kQuarters, 2, 1.0f, 0.0f, 1.0, 0.66), 0);
  EXPECT_EQ(Pick(kQuarters, 2, 1.0f, 0.0f, 1.0, 0.67), 1);
}

TEST(SamplingMathTest, ADrawPastTheEndTakesTheLastCandidateWithWeight) {
  // `total` a little above the walk's own sum (summed in another order, as a device reduction
  // does): a draw near 1 ends past the last cumulative boundary. The candidates after the first
  // two weigh 0 (-inf logits, as a logit_bias of -100 or a constraint mask leaves them), so the
  // draw takes the second, never one of probability 0.
  const float sorted[] = {1.0f, 0.0f, -kInf, -kInf};
  SortedLogitArray a{sorted};
  const double total = (1.0 + std::exp(-1.0)) * (1.0 + 1e-12);
  EXPECT_EQ(PickSortedCandidate(a, 4, total, 1.0f, 0.0f, 1.0, 1.0 - 0x1.0p-53), 1);
  // A tiny temperature: every candidate but the first weighs 0.
  const float close[] = {3.0f, 2.999f, 2.998f};
  SortedLogitArray b{close};
  EXPECT_EQ(PickSortedCandidate(b, 3, 1.0 + 1e-12, 1.0f, 0.0f, 1.0 / 1e-30, 1.0 - 0x1.0p-53), 0);
}

TEST(SamplingMathTest, TopPKeepsTheSmallestPrefixReachingIt) {
  // top_p 0.5: the first candidate alone reaches half the weight.
  EXPECT_EQ(Pick(kQuarters, 4, 0.5f, 0.0f, 1.0, 0.99), 0);
  // top_p 0.6: two candidates (weights 1 and 1/2), drawn 2/3 : 1/3.
  EXPECT_EQ(Pick(kQuarters, 4, 0.6f, 0.0f, 1.0, 0.66), 0);
  EXPECT_EQ(Pick(kQuarters, 4, 0.6f, 0.0f, 1.0, 0.99), 1);
  // top_p 0.8: three candidates (0.875 of the weight), drawn 4/7 : 2/7 : 1/7.
  EXPECT_EQ(Pick(kQuarters, 4, 0.8f, 0.0f, 1.0, 0.99), 2);
  // A tiny top_p still keeps one candidate.
  EXPECT_EQ(Pick(kQuarters, 4, 1e-6f, 0.0f, 1.0, 0.99), 0);
}

TEST(SamplingMathTest, MinPDropsTheLightCandidates) {
  // min_p 0.3: weights >= 0.3 stay (1 and 1/2).
  EXPECT_EQ(Pick(kQuarters, 4, 1.0f, 0.3f, 1.0, 0.99), 1);
  // min_p 0.49: the weight 1/2 (just under, as the logits are rounded to float) stays.
  EXPECT_EQ(Pick(kQuarters, 4, 1.0f, 0.49f, 1.0, 0.99), 1);
  EXPECT_EQ(Pick(kQuarters, 4, 1.0f, 0.51f, 1.0, 0.99), 0);
  // min_p 1 with the top tied: both tied candidates stay (a weight equal to the floor is kept).
  const float tied[] = {1.0f, 1.0f, 0.0f};
  EXPECT_EQ(Pick(tied, 3, 1.0f, 1.0f, 1.0, 0.49), 0);
  EXPECT_EQ(Pick(tied, 3, 1.0f, 1.0f, 1.0, 0.51), 1);
  // After top_p: min_p cuts the prefix top_p kept (three candidates, then 1/4 < 0.3 goes).
  EXPECT_EQ(Pick(kQuarters, 4, 0.8f, 0.3f, 1.0, 0.99), 1);
}

TEST(SamplingMathTest, HostSamplerOnRowsOfInfinities) {
  HostRowSampler s;
  // All -inf but one: that one, whatever the draw.
  const std::vector<float> one = {-kInf, -kInf, 2.0f, -kInf};
  const std::vector<float> none = {-kInf, -kInf, -kInf};
  for (uint64_t step = 0; step < 50; ++step) {
    const double u = SamplingUniformOf(5, step);
    EXPECT_EQ(s.Sample(one.data(), 4, 1.0f, 0, 0.9f, 0.1f, u), 2);
    EXPECT_EQ(s.Sample(one.data(), 4, 3.0f, 3, 1.0f, 0.0f, u), 2);
    // Everything suppressed: nothing to weigh, the first token (as the argmax would be).
    EXPECT_EQ(s.Sample(none.data(), 3, 1.0f, 0, 1.0f, 0.0f, u), 0);
  }
}

TEST(SamplingMathTest, HostSamplerTiesTopKBeyondTheRowAndTinyTemperature) {
  HostRowSampler s;
  const std::vector<float> row = {1.0f, 3.0f, 3.0f, 2.999f, -1.0f};
  std::set<int32_t> tiny_seen;
  int k2_low = 0;
  for (uint64_t step = 0; step < 400; ++step) {
    const double u = SamplingUniformOf(9, step);
    // top_k beyond the row is no limit.
    EXPECT_EQ(s.Sample(row.data(), 5, 1.0f, 50, 1.0f, 0.0f, u), s.Sample(row.data(), 5, 1.0f, 0, 1.0f, 0.0f, u));
    // top_k 2 on a tie at the top: the two tied tokens, each about half the time.
    const int32_t k2 = s.Sample(row.data(), 5, 2.0f, 2, 1.0f, 0.0f, u);
    ASSERT_TRUE(k2 == 1 || k2 == 2) << k2;
    k2_low += k2 == 1;
    // A tiny temperature: only the tied largest ones have weight.
    tiny_seen.insert(s.Sample(row.data(), 5, 1e-30f, 0, 1.0f, 0.0f, u));
  }
  EXPECT_EQ(tiny_seen, (std::set<int32_t>{1, 2}));
  EXPECT_GT(k2_low, 150);
  EXPECT_LT(k2_low, 250);
  // Temperature 0 and top_k 1: the first largest.
  EXPECT_EQ(s.Sample(row.data(), 5, 0.0f, 0, 1.0f, 0.0f, 0.99), 1);
  EXPECT_EQ(s.Sample(row.data(), 5, 5.0f, 1, 1.0f, 0.0f, 0.99), 1);
}

}  // namespace
}  // namespace shardserve::kernels

// The per-row arithmetic of token sampling, shared by the CPU Sampler (engine/sampling.h), the CPU
// backend's SampleRows and the CUDA SampleRows kernel, so that CPU tests cover the formulas the
// device runs.
//
// A row is sampled in three parts:
//   1. Its candidates: the tokens in descending logit order (ties: lower id first), cut to top_k.
//      How they get sorted is the caller's business: the CPU sorts lazily only the prefix the walk
//      below reaches; the device sorts each row with CUB's segmented radix sort (stable, so ties
//      keep the lower id first, and -0.0 equals +0.0 as the CPU comparison has it).
//   2. The total weight of the candidates, sum of CandidateWeight over them (in double): a
//      sequential sum on the CPU, a block reduction on the device (so the two differ in the order
//      of the sum only).
//   3. PickSortedCandidate: the top-p cut, the min-p cut and the draw with SamplingUniform, a walk
//      down the sorted candidates from the top.
// Rows with temperature 0 or top_k 1 are their argmax instead (SamplesArgmax), and a row whose
// largest logit is infinite (every token suppressed, or an overflow) takes its first candidate.
//
// Every function is SHARDSERVE_HD, allocates nothing and has no failure mode: callers validate the
// parameters (temperature finite and >= 0, top_k >= 0, top_p in (0, 1], min_p in [0, 1]).
#ifndef SHARDSERVE_WORKER_KERNELS_SHARED_SAMPLING_MATH_H_
#define SHARDSERVE_WORKER_KERNELS_SHARED_SAMPLING_MATH_H_

#include <cmath>
#include <cstdint>

#include "worker/kernels/shared/row_math.h"  // SHARDSERVE_HD

namespace shardserve::kernels {

// Sebastiano Vigna's splitmix64 finaliser: a bijective 64-bit mix.
SHARDSERVE_HD uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The uniform number in [0, 1) for the `step`-th sampled token of a sequence seeded `seed`: 53
// random bits, so it depends on (seed, step) alone, never on the batch or the layout.
SHARDSERVE_HD double SamplingUniformOf(uint64_t seed, uint64_t step) {
  const uint64_t r = SplitMix64(SplitMix64(seed) ^ (step * 0xd1b54a32d192ed03ull));
  return static_cast<double>(r >> 11) * 0x1.0p-53;
}

// Whether a row with these parameters is simply its argmax (the first largest logit).
SHARDSERVE_HD bool SamplesArgmax(float temperature, int32_t top_k) { return temperature == 0.0f || top_k == 1; }

// How many of a row's `n` tokens are candidates: top_k when 0 < top_k < n, else all of them.
SHARDSERVE_HD int64_t SamplingCandidates(int32_t top_k, int64_t n) { return (top_k > 0 && top_k < n) ? top_k : n; }

// The unnormalised probability of a candidate: exp((logit - max_logit) / temperature), in double,
// with inv_temperature = 1.0 / temperature (a float temperature > 0 makes it finite). The largest
// candidate weighs exactly 1; a -inf logit weighs 0.
SHARDSERVE_HD double CandidateWeight(float logit, double max_logit, double inv_temperature) {
  return exp((static_cast<double>(logit) - max_logit) * inv_temperature);
}

// Steps 3 of the file comment: the index (in [0, count)) of the chosen candidate.
//   sorted(i): the i-th candidate's logit, for i in [0, count), in descending order; called in
//     increasing i from 0 within each of the three walks (the CPU's accessor sorts on demand).
//   count >= 1; total: the sum of CandidateWeight over the `count` candidates; uniform in [0, 1).
// Top-p keeps the smallest prefix whose weight reaches top_p * total (at least one candidate; off
// at top_p = 1). Min-p then drops the candidates lighter than min_p times the first (a suffix;
// off at 0). The draw takes the first candidate whose cumulative weight exceeds uniform times the
// kept weight, or, when rounding leaves the draw past the end (`total` summed in another order
// than the walk, as the CUDA kernel's block reduction does), the last kept one of non-zero weight:
// never a candidate of probability 0 (a -inf logit, or one a tiny temperature leaves at 0).
template <typename SortedLogits>
SHARDSERVE_HD int64_t PickSortedCandidate(SortedLogits& sorted, int64_t count, double total, float top_p, float min_p,
                                          double inv_temperature, double uniform) {
  const double max_logit = sorted(0);
  int64_t keep = count;
  if (top_p < 1.0f) {
    const double target = static_cast<double>(top_p) * total;
    double cum = 0.0, kept = 0.0;
    int64_t i = 0;
    for (; i < keep; ++i) {
      const double w = CandidateWeight(sorted(i), max_logit, inv_temperature);
      kept = cum + w;
      if (!(cum + w < target)) break;  // this candidate reaches the target: it is the last kept
      cum += w;
    }
    keep = i + 1 < keep ? i + 1 : keep;
    total = kept;
  }
  if (min_p > 0.0f) {
    const double floor = static_cast<double>(min_p) * CandidateWeight(sorted(0), max_logit, inv_temperature);
    double kept = 0.0;
    int64_t i = 0;
    for (; i < keep; ++i) {
      const double w = CandidateWeight(sorted(i), max_logit, inv_temperature);
      if (i > 0 && w < floor) break;
      kept += w;
    }
    keep = i > 1 ? i : 1;
    total = kept;
  }
  const double u = uniform * total;
  double cum = 0.0;
  int64_t last_weighted = 0;  // the first candidate always weighs 1
  for (int64_t i = 0; i < keep; ++i) {
    const double w = CandidateWeight(sorted(i), max_logit, inv_temperature);
    if (u < cum + w) return i;
    cum += w;
    if (w > 0.0) last_weighted = i;
  }
  return last_weighted;
}

// PickSortedCandidate's accessor over an array already sorted in descending order.
struct SortedLogitArray {
  const float* values;
  SHARDSERVE_HD float operator()(int64_t i) const { return values[i]; }
};

}  // namespace shardserve::kernels

#endif  // SHARDSERVE_WORKER_KERNELS_SHARED_SAMPLING_MATH_H_

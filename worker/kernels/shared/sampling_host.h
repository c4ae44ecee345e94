// The host's way of running sampling_math.h over a row: the candidates are sorted lazily, only as
// far as the walk reaches. Used by the engine's Sampler (after logit_bias, suppression, penalties
// and the mask) and by the CPU backend's SampleRows, so both draw the same ids. Host only (the
// device sorts whole rows instead, see sampling_math.h).
#ifndef SHARDSERVE_WORKER_KERNELS_SHARED_SAMPLING_HOST_H_
#define SHARDSERVE_WORKER_KERNELS_SHARED_SAMPLING_HOST_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "worker/kernels/shared/sampling_math.h"

namespace shardserve::kernels {

// Thread-compatible: one per thread (it keeps scratch space).
class HostRowSampler {
 public:
  // The id drawn from logits[0, n) (n >= 1) with these parameters (validated by the caller) and
  // `uniform` in [0, 1) (SamplingUniformOf(seed, step)).
  int32_t Sample(const float* logits, int64_t n, float temperature, int32_t top_k, float top_p, float min_p,
                 double uniform) {
    if (SamplesArgmax(temperature, top_k)) return static_cast<int32_t>(std::max_element(logits, logits + n) - logits);
    // In an LLM's distribution the walk reaches tens to hundreds of candidates, not the
    // vocabulary: only that prefix is sorted (a partition, then a sort, of a window that grows as
    // needed). The order is a strict total one (ties: lower id), so the prefix is the same
    // whatever the windows.
    order_.resize(static_cast<size_t>(n));
    std::iota(order_.begin(), order_.end(), 0);
    auto by_logit = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
    const int64_t count = SamplingCandidates(top_k, n);
    int64_t sorted = 0;  // order_[0, sorted) are the first `sorted` candidates, in order
    auto sort_prefix = [&](int64_t want) {
      want = std::min(want, count);
      if (want <= sorted) return;
      // Within the candidates: with top_k they are order_[0, count) already.
      if (want < count) std::nth_element(order_.begin() + sorted, order_.begin() + want, order_.begin() + count, by_logit);
      std::sort(order_.begin() + sorted, order_.begin() + want, by_logit);
      sorted = want;
    };
    // The top_k candidates first (in any order), so that the total covers them only.
    if (count < n) std::nth_element(order_.begin(), order_.begin() + count, order_.end(), by_logit);
    sort_prefix(1);
    const double max_logit = logits[order_[0]];
    if (std::isinf(max_logit)) return order_[0];  // every token suppressed: nothing to weigh
    const double inv_t = 1.0 / static_cast<double>(temperature);
    double total = 0.0;
    for (int64_t i = 0; i < count; ++i) total += CandidateWeight(logits[order_[static_cast<size_t>(i)]], max_logit, inv_t);
    auto at = [&](int64_t i) {
      if (i >= sorted) sort_prefix(std::max(i + 1, 2 * std::max<int64_t>(sorted, 32)));
      return logits[order_[static_cast<size_t>(i)]];
    };
    const int64_t chosen = PickSortedCandidate(at, count, total, top_p, min_p, inv_t, uniform);
    at(chosen);  // sorted that far (PickSortedCandidate may return the last kept one without reading it)
    return order_[static_cast<size_t>(chosen)];
  }

 private:
  std::vector<int32_t> order_;
};

}  // namespace shardserve::kernels

#endif  // SHARDSERVE_WORKER_KERNELS_SHARED_SAMPLING_HOST_H_

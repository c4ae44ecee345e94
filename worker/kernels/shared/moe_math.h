// MoE permutation: the routed (token, choice) pairs of a batch grouped by expert, so that each
// expert multiplies one contiguous run of rows (one GEMM per expert, or one grouped GEMM per
// layer), and the un-permutation that adds each row back to its token with its routing weight
// (the ScatterAddRows op). SHARDSERVE_HD, allocation-free, no failure mode: callers check that
// every expert id is in [0, num_experts).
#ifndef SHARDSERVE_WORKER_KERNELS_SHARED_MOE_MATH_H_
#define SHARDSERVE_WORKER_KERNELS_SHARED_MOE_MATH_H_

#include <cstdint>

#include "worker/kernels/shared/row_math.h"

namespace shardserve::kernels {

// A stable counting sort of the tokens x k choices by expert. experts, weights: [tokens, k] (token
// t's j-th choice and its weight). Writes offsets [num_experts + 1] (expert e's rows are
// [offsets[e], offsets[e + 1])), rows [tokens * k] (the token of each grouped row) and scales
// [tokens * k] (its weight); within an expert, rows keep token order. fill: scratch [num_experts].
SHARDSERVE_HD void GroupByExpert(const int32_t* experts, const float* weights, int tokens, int k, int num_experts,
                                 int32_t* offsets, int32_t* rows, float* scales, int32_t* fill) {
  for (int e = 0; e <= num_experts; ++e) offsets[e] = 0;
  for (int i = 0; i < tokens * k; ++i) ++offsets[experts[i] + 1];
  for (int e = 0; e < num_experts; ++e) offsets[e + 1] += offsets[e];
  for (int e = 0; e < num_experts; ++e) fill[e] = offsets[e];
  for (int t = 0; t < tokens; ++t) {
    for (int j = 0; j < k; ++j) {
      const int at = fill[experts[t * k + j]]++;
      rows[at] = t;
      scales[at] = weights[t * k + j];
    }
  }
}

}  // namespace shardserve::kernels

#endif  // SHARDSERVE_WORKER_KERNELS_SHARED_MOE_MATH_H_

// MoE permutation: the routed (token, choice) pairs of a batch grouped by expert, so that each
// expert multiplies one contiguous run of rows (one GEMM per expert, or one grouped GEMM per
// layer), and the un-permutation that adds each row back to its token with its routing weight
// (a ScatterAddRows per expert, or one MoeCombine: FindGroupedRow, TokenGroupedRows and
// CombineElement, which the CUDA kernel runs and the CPU tests check against the scatters bit for
// bit), plus the token tiles of the grouped GEMV. SHARDSERVE_HD, allocation-free, no failure mode:
// callers check that every expert id is in [0, num_experts).
#ifndef SHARDSERVE_WORKER_KERNELS_SHARED_MOE_MATH_H_
#define SHARDSERVE_WORKER_KERNELS_SHARED_MOE_MATH_H_

#include <cmath>
#include <cstdint>

#include "worker/kernels/shared/moe_routing.h"
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

// One row range of the grouped rows (an expert's [begin, begin + count)), as the combine reads it.
struct GroupRange {
  int32_t begin = 0;
  int32_t count = 0;
};

// The grouped row of `token` among rows[begin, begin + count), or -1 when the token is not routed
// to that group. rows ascend within a group (GroupByExpert keeps token order, and a token picks an
// expert at most once), so this is a binary search.
SHARDSERVE_HD int32_t FindGroupedRow(const int32_t* rows, GroupRange group, int32_t token) {
  int32_t lo = group.begin, hi = group.begin + group.count;  // the answer is in [lo, hi)
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo) / 2;
    if (rows[mid] < token) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo < group.begin + group.count && rows[lo] == token ? lo : -1;
}

// The grouped rows of `token` in group order (ascending experts: the order of the per-expert
// scatters the combine replaces): writes found[0 .. n) and returns n (<= num_groups). groups:
// [num_groups]. The CUDA combine finds the same rows, one group per thread, and compacts them in
// this order.
SHARDSERVE_HD int TokenGroupedRows(const int32_t* rows, const GroupRange* groups, int num_groups, int32_t token,
                                   int32_t* found) {
  int n = 0;
  for (int g = 0; g < num_groups; ++g) {
    const int32_t at = FindGroupedRow(rows, groups[g], token);
    if (at >= 0) found[n++] = at;
  }
  return n;
}

// acc + s * x rounded once (a fused multiply-add), as the CPU backend's ScatterAddRows loop computes
// it: that loop is built for x86-64-v3 (FMA) and g++ contracts `dst += s * src` into one fma in C++
// modes (its default -ffp-contract=fast), and nvcc contracts the CUDA scatter likewise. Spelled out
// here so that the combine does not depend on what a compiler chooses to contract.
SHARDSERVE_HD float FusedMulAdd(float acc, float s, float x) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(s, x, acc);
#else
  return std::fma(s, x, acc);
#endif
}

// Element e of one token's combined MoE output: acc (the hidden state's element) plus each of its
// grouped rows found[0 .. n) times its routing weight (scales null: weight 1, Llama-4's weighted
// inputs), added one after the other in the order given, which is the sum a ScatterAddRows per
// expert computes. src: [grouped rows, width]; scales: [grouped rows] or null.
SHARDSERVE_HD float CombineElement(float acc, const float* src, const float* scales, const int32_t* found, int n,
                                   int64_t width, int64_t e) {
  for (int j = 0; j < n; ++j) {
    const float s = scales != nullptr ? scales[found[j]] : 1.0f;
    acc = FusedMulAdd(acc, s, src[int64_t{found[j]} * width + e]);
  }
  return acc;
}

// The token tiles of a grouped GEMV: a group of `count` rows is multiplied `tile` rows at a time
// (the rows one pass over a weight row serves); tile t covers rows [begin + t * tile, begin +
// t * tile + GemvTileRows(count, tile, t)).
SHARDSERVE_HD int32_t GemvTiles(int32_t count, int32_t tile) { return (count + tile - 1) / tile; }
SHARDSERVE_HD int32_t GemvTileRows(int32_t count, int32_t tile, int32_t t) {
  const int32_t left = count - t * tile;
  return left < tile ? left : tile;
}

// Llama-4's routing of one token (transformers' Llama4Router): the k largest router logits (ties:
// lower expert first), each weighted by sigmoid(logit). The engine multiplies each chosen
// expert's input by its weight and sums the outputs unweighted. experts, weights: [k].
SHARDSERVE_HD void RouteSigmoidTopK(const float* logits, int num_experts, int k, int* experts, float* weights) {
  TopKIndices(logits, num_experts, k, experts);
  for (int j = 0; j < k; ++j) weights[j] = 1.0f / (1.0f + expf(-logits[experts[j]]));
}

// Expert groups (DeepSeek): keeps the topk_group groups with the largest group_score (ties: lower
// group first) and sets `values` of every expert of the other groups to -inf. group_score:
// [n_group] (overwritten: +inf for the kept groups); values: [n_group * per_group].
SHARDSERVE_HD void KeepBestGroups(float* group_score, int n_group, int topk_group, int per_group, float* values) {
  for (int j = 0; j < topk_group; ++j) {
    int best = -1;
    for (int g = 0; g < n_group; ++g) {
      if (group_score[g] != INFINITY && (best < 0 || group_score[g] > group_score[best])) best = g;
    }
    group_score[best] = INFINITY;
  }
  for (int g = 0; g < n_group; ++g) {
    if (group_score[g] == INFINITY) continue;
    for (int e = g * per_group; e < (g + 1) * per_group; ++e) values[e] = -INFINITY;
  }
}

// DeepSeek-V3's routing of one token (transformers' DeepseekV3TopkRouter): scores =
// sigmoid(logits); experts are chosen by biased = scores + bias: the experts split into n_group
// groups of num_experts / n_group (>= 2), a group's score is the sum of its two largest biased
// scores, the topk_group best groups are kept (ties: lower group first), and the k largest biased
// scores among their experts are chosen (ties: lower expert first). The weights are the chosen
// experts' unbiased scores, divided by their sum (+ 1e-20) when `renormalize`, times `scaling`.
// scratch: [num_experts + n_group]; experts, weights: [k].
SHARDSERVE_HD void RouteSigmoidGrouped(const float* logits, const float* bias, float* scratch, int num_experts,
                                       int k, int n_group, int topk_group, bool renormalize, float scaling,
                                       int* experts, float* weights) {
  float* biased = scratch;                // [num_experts]; -inf once its group is dropped
  float* group_score = scratch + num_experts;  // [n_group]; -inf once kept
  const int per_group = num_experts / n_group;
  for (int e = 0; e < num_experts; ++e) {
    biased[e] = 1.0f / (1.0f + expf(-logits[e])) + (bias != nullptr ? bias[e] : 0.0f);
  }
  for (int g = 0; g < n_group; ++g) {
    float a = -INFINITY, b = -INFINITY;  // the two largest of the group
    for (int e = g * per_group; e < (g + 1) * per_group; ++e) {
      if (biased[e] > a) {
        b = a;
        a = biased[e];
      } else if (biased[e] > b) {
        b = biased[e];
      }
    }
    group_score[g] = a + b;
  }
  KeepBestGroups(group_score, n_group, topk_group, per_group, biased);
  TopKIndices(biased, num_experts, k, experts);
  float total = 0.f;
  for (int j = 0; j < k; ++j) {
    weights[j] = 1.0f / (1.0f + expf(-logits[experts[j]]));
    total += weights[j];
  }
  const float denom = renormalize ? total + 1e-20f : 1.0f;
  for (int j = 0; j < k; ++j) weights[j] = weights[j] / denom * scaling;
}

// DeepSeek-V2's routing of one token (transformers' DeepseekV2TopkRouter): scores =
// softmax(logits); with n_group > 1 ("group_limited_greedy") the experts split into n_group groups
// of num_experts / n_group, a group's score is its largest score, and only the topk_group best
// groups (ties: lower group first) keep their experts; the k largest remaining scores are chosen
// (ties: lower expert first). n_group 1 is "greedy": the k largest of all. The weights are the
// chosen scores times `scaling`, never renormalised. scratch: [num_experts + n_group]; experts,
// weights: [k]; k <= topk_group * num_experts / n_group.
SHARDSERVE_HD void RouteSoftmaxGroupLimited(const float* logits, float* scratch, int num_experts, int k, int n_group,
                                            int topk_group, float scaling, int* experts, float* weights) {
  float* probs = scratch;                      // [num_experts]
  float* group_score = scratch + num_experts;  // [n_group]; +inf once kept
  for (int e = 0; e < num_experts; ++e) probs[e] = logits[e];
  SoftmaxRow(probs, num_experts);
  const int per_group = num_experts / n_group;
  if (n_group > 1) {
    for (int g = 0; g < n_group; ++g) {
      float best = -INFINITY;
      for (int e = g * per_group; e < (g + 1) * per_group; ++e) best = probs[e] > best ? probs[e] : best;
      group_score[g] = best;
    }
    // transformers zeroes the dropped experts' scores instead: every kept score is above 0 and at
    // least k experts are kept, so the choice is the same.
    KeepBestGroups(group_score, n_group, topk_group, per_group, probs);
  }
  TopKIndices(probs, num_experts, k, experts);
  for (int j = 0; j < k; ++j) weights[j] = probs[experts[j]] * scaling;
}

// The floats of scratch RouteToken needs for `r`.
SHARDSERVE_HD int RouteTokenScratch(const MoeRouting& r) {
  const bool grouped =
      r.scoring == MoeRouteScoring::kSigmoidGrouped || r.scoring == MoeRouteScoring::kSoftmaxGroupLimited;
  return r.num_experts + (grouped ? r.n_group : 0);
}

// One token's routing by `r` (validated by the caller): its top_k experts (each in
// [0, num_experts), distinct) and their weights, by the rule r.scoring names. logits:
// [num_experts]; bias: [num_experts] or null (kSigmoidGrouped only); scratch:
// [RouteTokenScratch(r)]; experts, weights: [top_k]. The one dispatch the CPU backend's MoeRoute
// and the CUDA kernel share.
SHARDSERVE_HD void RouteToken(const MoeRouting& r, const float* logits, const float* bias, float* scratch,
                              int* experts, float* weights) {
  switch (r.scoring) {
    case MoeRouteScoring::kSoftmaxTopK:
      RouteTopK(logits, scratch, r.num_experts, r.top_k, r.renormalize, experts, weights);
      return;
    case MoeRouteScoring::kSigmoidTopK:
      RouteSigmoidTopK(logits, r.num_experts, r.top_k, experts, weights);
      return;
    case MoeRouteScoring::kSigmoidGrouped:
      RouteSigmoidGrouped(logits, bias, scratch, r.num_experts, r.top_k, r.n_group, r.topk_group, r.renormalize,
                          r.scaling, experts, weights);
      return;
    case MoeRouteScoring::kSoftmaxGroupLimited:
      RouteSoftmaxGroupLimited(logits, scratch, r.num_experts, r.top_k, r.n_group, r.topk_group, r.scaling, experts,
                               weights);
      return;
  }
}

}  // namespace shardserve::kernels

#endif  // SHARDSERVE_WORKER_KERNELS_SHARED_MOE_MATH_H_

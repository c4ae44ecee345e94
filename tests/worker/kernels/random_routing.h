// A random MoE routing for the kernel tests: each of `tokens` tokens picks `k` distinct experts
// among the first `used` of `num_experts` with random weights, grouped by expert with GroupByExpert
// as MoeRoute lays them out (GroupRouting, also for tests that pick their experts otherwise).
#ifndef SHARDSERVE_TESTS_WORKER_KERNELS_RANDOM_ROUTING_H_
#define SHARDSERVE_TESTS_WORKER_KERNELS_RANDOM_ROUTING_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "worker/kernels/shared/moe_math.h"

namespace shardserve::kernels {

struct Routing {
  std::vector<int32_t> offsets, rows;  // [num_experts + 1], [tokens * k]
  std::vector<float> scales;           // [tokens * k]
};

// Each token's k experts and weights ([tokens * k] each) grouped by expert with GroupByExpert.
inline Routing GroupRouting(const std::vector<int32_t>& experts, const std::vector<float>& weights, int tokens, int k,
                            int num_experts) {
  Routing r{.offsets = std::vector<int32_t>(static_cast<size_t>(num_experts + 1)),
            .rows = std::vector<int32_t>(experts.size()),
            .scales = std::vector<float>(experts.size())};
  std::vector<int32_t> fill(static_cast<size_t>(num_experts));
  GroupByExpert(experts.data(), weights.data(), tokens, k, num_experts, r.offsets.data(), r.rows.data(),
                r.scales.data(), fill.data());
  return r;
}

// used <= 0: every expert may be picked.
inline Routing RandomRouting(std::mt19937& rng, int tokens, int k, int num_experts, int used = 0) {
  if (used <= 0) used = num_experts;
  std::vector<int32_t> experts(static_cast<size_t>(tokens * k));
  std::vector<float> weights(experts.size());
  std::uniform_real_distribution<float> weight(0.01f, 1.0f);
  std::vector<int32_t> all(static_cast<size_t>(used));
  std::iota(all.begin(), all.end(), 0);
  for (int t = 0; t < tokens; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    for (int j = 0; j < k; ++j) {
      experts[static_cast<size_t>(t * k + j)] = all[static_cast<size_t>(j)];
      weights[static_cast<size_t>(t * k + j)] = weight(rng);
    }
  }
  return GroupRouting(experts, weights, tokens, k, num_experts);
}

}  // namespace shardserve::kernels

#endif  // SHARDSERVE_TESTS_WORKER_KERNELS_RANDOM_ROUTING_H_

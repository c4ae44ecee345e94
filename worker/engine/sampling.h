// Token sampling from one row of logits: greedy, temperature, top-k, top-p, seeded.
//
// Sampling is reproducible and independent of batching: the random number for a sequence's n-th
// sampled token depends only on (seed, n), so a request gets the same tokens alone or in any batch,
// on any layout.
#ifndef SHARDSERVE_WORKER_ENGINE_SAMPLING_H_
#define SHARDSERVE_WORKER_ENGINE_SAMPLING_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace shardserve::engine {

struct SamplingParams {
  float temperature = 0.0f;  // 0 = greedy (argmax, lowest id on ties)
  int32_t top_k = 0;         // 0 = no limit
  float top_p = 1.0f;        // in (0, 1]
  uint64_t seed = 0;
  // Whether sampling picks the argmax (temperature 0 or top_k 1), which the device can do alone.
  bool IsGreedy() const { return temperature == 0.0f || top_k == 1; }
  // InvalidArgument naming the field: temperature < 0 or not finite, top_k < 0, top_p outside (0, 1].
  absl::Status Validate() const;
};

// Thread-compatible: one Sampler per thread (it keeps scratch space).
class Sampler {
 public:
  // `logits` must be non-empty. `step` is the index of the token being sampled in its sequence's
  // output (0 for the first generated token).
  int32_t Sample(absl::Span<const float> logits, const SamplingParams& params, uint64_t step);

 private:
  std::vector<int32_t> order_;
  std::vector<float> probs_;
};

// The uniform number in [0, 1) used for (seed, step). Exposed for tests.
double SamplingUniform(uint64_t seed, uint64_t step);

}  // namespace shardserve::engine

#endif  // SHARDSERVE_WORKER_ENGINE_SAMPLING_H_

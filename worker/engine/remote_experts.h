// Experts of a MoE layer that live on another worker (expert spill). The engine knows only this
// interface; the worker's service layer implements it with Expert.Compute calls
// (proto/shardserve/v1/expert.proto), and tests implement it in process.
#ifndef SHARDSERVE_WORKER_ENGINE_REMOTE_EXPERTS_H_
#define SHARDSERVE_WORKER_ENGINE_REMOTE_EXPERTS_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace shardserve::engine {

// Consecutive rows of a call's input that go through one expert.
struct ExpertRows {
  int32_t expert = 0;
  int32_t rows = 0;
};

// One call in flight. Wait() blocks until the outputs are written (or the call failed).
class RemoteExpertCall {
 public:
  virtual ~RemoteExpertCall() = default;
  virtual absl::Status Wait() = 0;
};

// Thread-safe: several stages (or ranks) may call at once.
class RemoteExperts {
 public:
  virtual ~RemoteExperts() = default;
  // Starts computing, for MoE layer `layer`, each group's expert on its rows of `x` ([sum of rows,
  // hidden]), writing the unweighted expert outputs to the same rows of `y`. Returns at once so
  // that the caller can compute its local experts meanwhile; `x` and `y` must stay valid until
  // Wait() returns; call Wait() before destroying the call.
  virtual std::unique_ptr<RemoteExpertCall> Start(int64_t layer, absl::Span<const ExpertRows> groups,
                                                  absl::Span<const float> x, absl::Span<float> y) = 0;
};

}  // namespace shardserve::engine

#endif  // SHARDSERVE_WORKER_ENGINE_REMOTE_EXPERTS_H_

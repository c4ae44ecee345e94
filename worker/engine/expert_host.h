// ExpertHost: whole experts of MoE layers held by a worker that runs no stage of its own, computed
// for stages whose workers could not hold them (expert spill; the planner decides who hosts what).
// Each expert lives on one device; calls for experts on one device are serialised, calls for
// different devices run in parallel.
#ifndef SHARDSERVE_WORKER_ENGINE_EXPERT_HOST_H_
#define SHARDSERVE_WORKER_ENGINE_EXPERT_HOST_H_

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/model_spec/model_spec.h"
#include "common/safetensors/safetensors.h"
#include "worker/engine/remote_experts.h"
#include "worker/engine/weights.h"
#include "worker/kernels/backend.h"

namespace shardserve::engine {

struct HostedExpertSpec {
  int64_t layer = 0;
  int64_t expert = 0;
  int device = 0;  // CUDA ordinal, or a CPU device index (all CPU devices share the host)
};

class ExpertHost {
 public:
  // Loads every listed expert whole onto its device. InvalidArgument for an empty list, a layer
  // that is not a MoE layer, an expert id out of range or an expert listed twice;
  // ResourceExhausted when a device runs out of memory.
  static absl::StatusOr<std::unique_ptr<ExpertHost>> Create(const ModelSpec& spec, const Checkpoint& ckpt,
                                                            const std::vector<HostedExpertSpec>& experts,
                                                            kernels::DeviceKind kind, int cpu_threads,
                                                            Quantization quantize = Quantization::kNone);
  ~ExpertHost();

  // Thread-safe. Computes each group's expert of MoE layer `layer` on its rows of x ([sum of rows,
  // hidden]) into the same rows of y (unweighted outputs). NotFound for an expert this host does
  // not hold; InvalidArgument for groups that disagree with the sizes of x or y.
  absl::Status Compute(int64_t layer, absl::Span<const ExpertRows> groups, absl::Span<const float> x,
                       absl::Span<float> y);

  int64_t num_experts() const { return static_cast<int64_t>(experts_.size()); }
  size_t weight_bytes() const { return weight_bytes_; }

 private:
  struct Device;
  struct Entry {
    Device* device;
    MlpWeights weights;
  };
  explicit ExpertHost(const ModelSpec& spec);

  const ModelSpec spec_;
  std::map<int, std::unique_ptr<Device>> devices_;        // by device index
  std::map<std::pair<int64_t, int64_t>, Entry> experts_;  // by (layer, expert)
  size_t weight_bytes_ = 0;
};

// RemoteExperts served by an ExpertHost in the same process (tests, and the single-process
// reference of a spilled layout). The host must outlive it.
class InProcessRemoteExperts final : public RemoteExperts {
 public:
  explicit InProcessRemoteExperts(ExpertHost* host) : host_(host) {}
  std::unique_ptr<RemoteExpertCall> Start(int64_t layer, absl::Span<const ExpertRows> groups,
                                          absl::Span<const float> x, absl::Span<float> y) override;

 private:
  ExpertHost* host_;
};

}  // namespace shardserve::engine

#endif  // SHARDSERVE_WORKER_ENGINE_EXPERT_HOST_H_

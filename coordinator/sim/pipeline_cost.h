// PipelineCost: the scheduler's pipelining policy (coordinator/scheduler/pipelining.h) priced with
// the simulator's roofline (cost_model.h), so that the coordinator and `shardserve simulate` use
// one cost model. The coordinator makes one per serving replica when --pipeline_depth is 0.
//
// Per stage: StageCostModel with the GPU profile for a CUDA stage, the CPU profile otherwise.
// Hops: HopSeconds over `same_node` between stages on one machine (node_name), `network` between
// machines; the hop back to the coordinator counts as a network hop. Shared machines: the CPU
// stages of one machine (node_name) share its memory bus and cores: one group per machine with at
// least two CPU stages, of parallelism cpu_parallelism (each capped at its number of stages); a
// GPU stage has its own memory and compute.
//
// Thread-safety: immutable after Make; every method is const and thread-safe.
#ifndef SHARDSERVE_COORDINATOR_SIM_PIPELINE_COST_H_
#define SHARDSERVE_COORDINATOR_SIM_PIPELINE_COST_H_

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/model_spec/model_spec.h"
#include "common/plan/plan.h"
#include "coordinator/scheduler/pipelining.h"
#include "coordinator/sim/cost_model.h"
#include "coordinator/sim/device_profile.h"

namespace shardserve::sim {

struct PipelineProfiles {
  DeviceProfile cpu;      // a CPU stage's ranks
  DeviceProfile gpu;      // a CUDA stage's ranks
  LinkProfile network;    // between machines
  LinkProfile same_node;  // between stages on one machine
  double hop_overhead_s = 100e-6;  // software cost of one stage hop (ARCHITECTURE.md: ~100 us)
  // How much faster the CPU stages of one machine run all at once than one after the other, >= 1
  // each (capped at the number of those stages). Memory: ARCHITECTURE.md measures 38-43 GB/s of
  // reads with two threads against 28-34 with one. Compute: each stage's ranks are assumed to have
  // cores of their own (a worker is sized one core per CPU rank), so the stages' arithmetic runs
  // side by side: on an otherwise idle 2-core development machine, two stages of the 100M model
  // pipelined gave 1.30x the throughput of one micro-batch at a time (serving_bench.py, 16
  // clients). A machine busy with other work gains less (0.6-0.9x was measured under a load
  // average of 6); such a deployment should lower this or fix --pipeline_depth.
  // shardserve-bench-cpu-profile measures a machine's figures with the engine's own kernels (the
  // idle development machine: 1.31 for reads, 1.93 for arithmetic).
  coordinator::HostParallelism cpu_parallelism{.memory = 1.3, .compute = std::numeric_limits<double>::infinity()};
  // InvalidArgument naming the field when a link figure is not positive or a parallelism < 1
  // (the device profiles are checked by PipelineCost::Make, for the kinds its stages use).
  absl::Status Validate() const;
};

// The coordinator's defaults: the CPU figures of `shardserve simulate` (30 GB/s and 110 GFLOP/s
// per rank, 20 us per layer, 300 us per step), the "h100" GPU profile, "ib" between machines and
// "loopback" within one.
PipelineProfiles DefaultPipelineProfiles();

class PipelineCost final : public coordinator::PipelineCostModel {
 public:
  // `stages`: one replica's pipeline, in order (layer ranges inside `spec`, tp >= 1, node_name
  // and device_kind set). bytes_per_param / kv_bytes_per_element as the planner resolved them.
  // InvalidArgument for no stage, a bad layer range or tp, invalid profiles, or a device profile
  // of a kind some stage uses without positive bandwidth and FLOP rate.
  static absl::StatusOr<std::unique_ptr<PipelineCost>> Make(const ModelSpec& spec, std::vector<StageSpec> stages,
                                                            int64_t bytes_per_param, int64_t kv_bytes_per_element,
                                                            const PipelineProfiles& profiles);

  int num_stages() const override { return static_cast<int>(stages_.size()); }
  coordinator::StageSeconds Stage(int stage, absl::Span<const coordinator::StepWork> work) const override;
  double Hop(int stage, int64_t tokens) const override;
  int SharedGroup(int stage) const override { return shared_group_[static_cast<size_t>(stage)]; }
  coordinator::HostParallelism Parallelism(int group) const override { return parallelism_[static_cast<size_t>(group)]; }
  std::string Describe() const override { return description_; }

 private:
  PipelineCost() = default;

  std::vector<StageCostModel> stages_;
  std::vector<LinkProfile> next_link_;  // per stage: to the next stage (the last: to the coordinator)
  std::vector<int> shared_group_;                       // per stage
  std::vector<coordinator::HostParallelism> parallelism_;  // per group
  int64_t hidden_ = 0;
  int64_t activation_bytes_ = 4;
  double hop_overhead_s_ = 0;
  std::string description_;
};

}  // namespace shardserve::sim

#endif  // SHARDSERVE_COORDINATOR_SIM_PIPELINE_COST_H_

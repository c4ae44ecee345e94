#include "coordinator/sim/pipeline_cost.h"

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"

namespace shardserve::sim {
namespace {

absl::Status Positive(const std::string& field, double value) {
  if (value > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, " must be > 0, got ", value));
}

// The figures the cost model divides by.
absl::Status ValidateDevice(const std::string& name, const DeviceProfile& d) {
  if (absl::Status st = Positive(name + ".memory_bytes_per_s", d.memory_bytes_per_s); !st.ok()) return st;
  if (absl::Status st = Positive(name + ".flops_per_s", d.flops_per_s); !st.ok()) return st;
  return Positive(name + ".intra_node.bytes_per_s", d.intra_node.bytes_per_s);
}

}  // namespace

absl::Status PipelineProfiles::Validate() const {
  if (absl::Status st = Positive("network.bytes_per_s", network.bytes_per_s); !st.ok()) return st;
  if (absl::Status st = Positive("same_node.bytes_per_s", same_node.bytes_per_s); !st.ok()) return st;
  if (hop_overhead_s < 0) return absl::InvalidArgumentError(absl::StrCat("hop_overhead_s must be >= 0, got ", hop_overhead_s));
  if (!(cpu_parallelism.memory >= 1) || !(cpu_parallelism.compute >= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("cpu_parallelism must be >= 1, got memory ", cpu_parallelism.memory,
                                                   " and compute ", cpu_parallelism.compute));
  }
  return absl::OkStatus();
}

PipelineProfiles DefaultPipelineProfiles() {
  PipelineProfiles p;
  p.cpu = CpuProfile(30e9, 110e9, 20e-6, 300e-6);
  p.gpu = *GpuProfile("h100");
  p.network = *NetworkProfile("ib");
  p.same_node = *NetworkProfile("loopback");
  return p;
}

absl::StatusOr<std::unique_ptr<PipelineCost>> PipelineCost::Make(const ModelSpec& spec, std::vector<StageSpec> stages,
                                                                 int64_t bytes_per_param, int64_t kv_bytes_per_element,
                                                                 const PipelineProfiles& profiles) {
  if (absl::Status st = profiles.Validate(); !st.ok()) return st;
  if (stages.empty()) return absl::InvalidArgumentError("the pipeline has no stage");
  if (bytes_per_param < 1 || kv_bytes_per_element < 1) {
    return absl::InvalidArgumentError(absl::StrCat("bytes_per_param (", bytes_per_param, ") and kv_bytes_per_element (",
                                                   kv_bytes_per_element, ") must be >= 1"));
  }
  auto cost = std::unique_ptr<PipelineCost>(new PipelineCost());
  cost->hidden_ = spec.hidden_size;
  cost->hop_overhead_s_ = profiles.hop_overhead_s;
  std::map<std::string, std::vector<size_t>> cpu_stages_by_node;
  std::set<std::string> nodes;
  int cpu = 0, gpu = 0;
  for (size_t s = 0; s < stages.size(); ++s) {
    const StageSpec& st = stages[s];
    if (st.tp < 1 || st.layer_begin < 0 || st.layer_begin >= st.layer_end || st.layer_end > spec.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat("stage ", s, " has layers [", st.layer_begin, ", ", st.layer_end,
                                                     ") and tp ", st.tp, ", not a slice of the model's ",
                                                     spec.num_layers, " layers"));
    }
    const bool cuda = st.device_kind == DeviceKind::kCuda;
    (cuda ? gpu : cpu) += 1;
    const DeviceProfile& device = cuda ? profiles.gpu : profiles.cpu;
    if (absl::Status v = ValidateDevice(cuda ? "gpu" : "cpu", device); !v.ok()) return v;
    cost->activation_bytes_ = device.activation_bytes;
    cost->stages_.emplace_back(spec, st, device, bytes_per_param, kv_bytes_per_element);
    const bool next_here = s + 1 < stages.size() && stages[s + 1].node_name == st.node_name;
    cost->next_link_.push_back(next_here ? profiles.same_node : profiles.network);
    if (!cuda) cpu_stages_by_node[st.node_name].push_back(s);
    nodes.insert(st.node_name);
  }
  cost->shared_group_.assign(stages.size(), -1);
  for (const auto& [node, members] : cpu_stages_by_node) {
    if (members.size() < 2) continue;
    const int group = static_cast<int>(cost->parallelism_.size());
    const double n = static_cast<double>(members.size());
    cost->parallelism_.push_back({.memory = std::min(profiles.cpu_parallelism.memory, n),
                                  .compute = std::min(profiles.cpu_parallelism.compute, n),
                                  .overlap = profiles.cpu.overlap_memory_and_compute});
    for (size_t s : members) cost->shared_group_[s] = group;
  }
  const std::string kinds = cpu > 0 && gpu > 0 ? absl::StrCat(cpu, " CPU and ", gpu, " CUDA stages")
                            : gpu > 0          ? absl::StrCat(gpu, gpu == 1 ? " CUDA stage" : " CUDA stages")
                                               : absl::StrCat(cpu, cpu == 1 ? " CPU stage" : " CPU stages");
  cost->description_ =
      absl::StrCat(kinds, nodes.size() == 1 ? (stages.size() == 1 ? "" : " on one machine")
                                            : absl::StrCat(" on ", nodes.size(), " machines"));
  return cost;
}

coordinator::StageSeconds PipelineCost::Stage(int stage, absl::Span<const coordinator::StepWork> work) const {
  const StageTime t = stages_[static_cast<size_t>(stage)].Cost(work);
  return {.total = t.Total(), .memory = t.memory_demand, .compute = t.compute_demand + t.collectives + t.overhead};
}

double PipelineCost::Hop(int stage, int64_t tokens) const {
  return HopSeconds(tokens, hidden_, activation_bytes_, next_link_[static_cast<size_t>(stage)], hop_overhead_s_);
}

}  // namespace shardserve::sim

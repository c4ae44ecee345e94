#include "common/plan/plan.h"

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace shardserve {
namespace {

// The same wording as the engine's ShardLayout::Make, so that the planner and the worker reject
// a tp for the same reason.
absl::Status NotDivisible(absl::string_view what, int64_t n, int tp) {
  return absl::InvalidArgumentError(
      absl::StrCat("tensor parallel size ", tp, " does not divide ", what, " (", n, "); choose a tp that divides it"));
}

// Left-aligned columns separated by two spaces; every row has the header's column count.
std::string FormatTable(const std::vector<std::vector<std::string>>& rows, absl::string_view indent) {
  std::vector<size_t> width;
  for (const auto& row : rows) {
    width.resize(std::max(width.size(), row.size()), 0);
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  std::string out;
  for (const auto& row : rows) {
    std::string line(indent);
    for (size_t c = 0; c < row.size(); ++c) {
      absl::StrAppend(&line, row[c]);
      if (c + 1 < row.size()) line.append(width[c] - row[c].size() + 2, ' ');
    }
    absl::StrAppend(&out, line, "\n");
  }
  return out;
}

std::string DeviceList(DeviceKind kind, const std::vector<int>& devices) {
  return absl::StrCat(DeviceKindName(kind), ":", absl::StrJoin(devices, ","));
}

}  // namespace

absl::string_view DeviceKindName(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kCpu: return "cpu";
    case DeviceKind::kCuda: return "cuda";
  }
  return "unknown";
}

int64_t Pipeline::NumRemoteExperts() const {
  int64_t n = 0;
  for (const LayerExperts& layer : experts) {
    for (const ExpertLocation& e : layer.experts) n += e.remote ? 1 : 0;
  }
  return n;
}

absl::Status ValidateTensorParallelSize(const ModelSpec& spec, int tp) {
  if (tp < 1) return absl::InvalidArgumentError(absl::StrCat("tensor parallel size must be >= 1, got ", tp));
  if (spec.num_heads % tp != 0) return NotDivisible("num_attention_heads", spec.num_heads, tp);
  if (spec.num_kv_heads <= 0 || (spec.num_kv_heads % tp != 0 && tp % spec.num_kv_heads != 0)) {
    return NotDivisible("num_key_value_heads", spec.num_kv_heads, tp);
  }
  if (spec.intermediate_size % tp != 0) return NotDivisible("intermediate_size", spec.intermediate_size, tp);
  if (spec.IsMoe()) {
    const bool expert_parallel = spec.moe.num_experts >= tp && tp > 1;
    if (!expert_parallel && spec.moe.expert_intermediate_size % tp != 0) {
      return NotDivisible("the expert intermediate size", spec.moe.expert_intermediate_size, tp);
    }
    if (spec.moe.shared_expert_intermediate_size % tp != 0) {
      return NotDivisible("the shared expert intermediate size", spec.moe.shared_expert_intermediate_size, tp);
    }
  }
  return absl::OkStatus();
}

std::string FormatBytes(int64_t bytes) {
  static constexpr const char* kUnits[] = {"KB", "MB", "GB", "TB", "PB", "EB"};
  const char* sign = bytes < 0 ? "-" : "";
  // Magnitude as unsigned so that INT64_MIN is well defined.
  const uint64_t mag = bytes < 0 ? 0 - static_cast<uint64_t>(bytes) : static_cast<uint64_t>(bytes);
  if (mag < 1000) return absl::StrCat(sign, mag, " B");
  double v = static_cast<double>(mag) / 1000.0;
  size_t unit = 0;
  while (v >= 999.95 && unit + 1 < std::size(kUnits)) {
    v /= 1000.0;
    ++unit;
  }
  return absl::StrFormat("%s%.1f %s", sign, v, kUnits[unit]);
}

std::string PlanToString(const Plan& plan) {
  const size_t stages = plan.replicas.empty() ? 0 : plan.replicas.front().stages.size();
  std::string out =
      absl::StrCat("plan: ", plan.replicas.size(), plan.replicas.size() == 1 ? " replica" : " replicas", " x ", stages,
                   stages == 1 ? " stage" : " stages", ", max_seq_len ", plan.max_seq_len, "\n");
  for (size_t r = 0; r < plan.replicas.size(); ++r) {
    const Pipeline& p = plan.replicas[r];
    const int64_t kv = p.stages.empty() ? 0 : p.stages.front().kv_tokens;
    absl::StrAppend(&out, "replica ", r, ": KV capacity ", kv, " tokens");
    const int64_t remote = p.NumRemoteExperts();
    if (remote > 0) absl::StrAppend(&out, ", ", remote, " remote experts");
    absl::StrAppend(&out, "\n");
    std::vector<std::vector<std::string>> rows = {{"stage", "worker", "node", "layers", "embed", "lm_head", "tp",
                                                   "devices", "weights/rank", "kv/rank", "kv tokens", "cost"}};
    for (size_t s = 0; s < p.stages.size(); ++s) {
      const StageSpec& st = p.stages[s];
      rows.push_back({absl::StrCat(s), st.worker_id, st.node_name,
                      absl::StrCat("[", st.layer_begin, ", ", st.layer_end, ")"), st.has_embedding ? "yes" : "-",
                      st.has_lm_head ? "yes" : "-", absl::StrCat(st.tp), DeviceList(st.device_kind, st.devices),
                      FormatBytes(st.predicted_weight_bytes_per_rank), FormatBytes(st.kv_bytes_per_rank),
                      absl::StrCat(st.kv_tokens), absl::StrFormat("%.3f", st.cost_share)});
    }
    absl::StrAppend(&out, FormatTable(rows, "  "));
    if (!p.experts.empty()) {
      // Per stage: how many (layer, expert) pairs are local and remote.
      std::vector<std::vector<std::string>> erows = {{"experts", "stage", "moe layers", "local", "remote"}};
      for (size_t s = 0; s < p.stages.size(); ++s) {
        const StageSpec& st = p.stages[s];
        int64_t layers = 0, local = 0, remote_here = 0;
        for (const LayerExperts& le : p.experts) {
          if (le.layer < st.layer_begin || le.layer >= st.layer_end) continue;
          ++layers;
          for (const ExpertLocation& e : le.experts) (e.remote ? remote_here : local) += 1;
        }
        if (layers == 0) continue;
        erows.push_back({"", absl::StrCat(s), absl::StrCat(layers), absl::StrCat(local), absl::StrCat(remote_here)});
      }
      absl::StrAppend(&out, FormatTable(erows, "  "));
    }
  }
  if (!plan.expert_hosts.empty()) {
    absl::StrAppend(&out, "expert hosts:\n");
    std::vector<std::vector<std::string>> rows = {{"worker", "node", "device", "experts", "weights"}};
    for (const ExpertHostSpec& h : plan.expert_hosts) {
      rows.push_back({h.worker_id, h.node_name, absl::StrCat(DeviceKindName(h.device_kind), ":", h.device),
                      absl::StrCat(h.num_experts), FormatBytes(h.predicted_weight_bytes)});
    }
    absl::StrAppend(&out, FormatTable(rows, "  "));
  }
  return out;
}

}  // namespace shardserve

#include "coordinator/sim/report.h"

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace shardserve::sim {
namespace {

using nlohmann::json;

json ToJson(const LatencySummary& s) {
  return {{"p50", s.p50}, {"p90", s.p90}, {"p99", s.p99}, {"mean", s.mean}, {"max", s.max}, {"count", s.count}};
}

json ToJson(const WindowStats& w) {
  return {{"begin_s", w.begin_s},   {"end_s", w.end_s},   {"arrived", w.arrived},
          {"completed", w.completed}, {"failed", w.failed}, {"output_tokens_per_s", w.output_tokens_per_s},
          {"ttft_s", ToJson(w.ttft_s)}, {"itl_s", ToJson(w.itl_s)}, {"e2e_s", ToJson(w.e2e_s)}};
}

json ToJsonObject(const SimResult& r) {
  json stages = json::array();
  for (const StageUse& s : r.stages) {
    stages.push_back({{"replica", s.replica}, {"stage", s.stage}, {"busy_fraction", s.busy_fraction},
                      {"mean_decode_step_s", s.mean_decode_step_s}});
  }
  json faults = json::array();
  for (const FaultReport& f : r.faults) {
    faults.push_back({{"worker", f.fault.worker},
                      {"at_s", f.fault.at_s},
                      {"replicas_removed", f.replicas_removed},
                      {"failovers", f.failovers},
                      {"failed", f.failed},
                      {"replan", f.replan},
                      {"before", ToJson(f.before)},
                      {"after", ToJson(f.after)}});
  }
  return {{"layout", r.layout},
          {"plan", PlanToString(r.plan)},
          {"kv_blocks", r.kv_blocks},
          {"kv_block_size", r.kv_block_size},
          {"requests", r.requests},
          {"completed", r.completed},
          {"rejected", r.rejected},
          {"failed", r.failed},
          {"unfinished", r.unfinished},
          {"duration_s", r.duration_s},
          {"requests_per_s", r.requests_per_s},
          {"output_tokens_per_s", r.output_tokens_per_s},
          {"ttft_s", ToJson(r.ttft_s)},
          {"itl_s", ToJson(r.itl_s)},
          {"e2e_s", ToJson(r.e2e_s)},
          {"kv_use", {{"mean", r.kv_use_mean}, {"peak", r.kv_use_peak}}},
          {"preemptions", r.preemptions},
          {"failovers", r.failovers},
          {"steps", r.steps},
          {"stages", stages},
          {"decode_steps", r.decode_steps},
          {"faults", faults}};
}

std::string Ms(double s) { return absl::StrFormat("%.1f ms", s * 1e3); }

std::string LatencyRow(const char* name, const LatencySummary& s) {
  return absl::StrFormat("  %-5s p50 %10s  p90 %10s  p99 %10s  mean %10s  max %10s\n", name, Ms(s.p50), Ms(s.p90),
                         Ms(s.p99), Ms(s.mean), Ms(s.max));
}

std::string WindowLine(const char* name, const WindowStats& w) {
  return absl::StrFormat(
      "    %-6s [%.1f s, %.1f s): %d arrived, %d completed, %d failed; %.0f output tok/s; ttft p99 %s, itl p99 %s\n",
      name, w.begin_s, w.end_s, w.arrived, w.completed, w.failed, w.output_tokens_per_s, Ms(w.ttft_s.p99),
      Ms(w.itl_s.p99));
}

}  // namespace

std::string ResultToJson(const SimResult& r) { return ToJsonObject(r).dump(); }

std::string ResultToTable(const SimResult& r) {
  std::string out = absl::StrCat("layout: ", r.layout, "\n", PlanToString(r.plan), "\n\n");
  std::string blocks;
  for (size_t i = 0; i < r.kv_blocks.size(); ++i) absl::StrAppend(&blocks, i == 0 ? "" : ", ", r.kv_blocks[i]);
  absl::StrAppend(&out, "KV cache per replica: ", blocks, " blocks of ", r.kv_block_size, " tokens\n");
  absl::StrAppendFormat(&out,
                        "requests: %d (%d completed, %d rejected, %d failed, %d unfinished) in %.2f s of virtual time\n",
                        r.requests, r.completed, r.rejected, r.failed, r.unfinished, r.duration_s);
  absl::StrAppendFormat(&out, "throughput: %.2f requests/s, %.1f output tokens/s\n", r.requests_per_s,
                        r.output_tokens_per_s);
  absl::StrAppend(&out, LatencyRow("ttft", r.ttft_s), LatencyRow("itl", r.itl_s), LatencyRow("e2e", r.e2e_s));
  absl::StrAppendFormat(&out, "KV use: mean %.0f%%, peak %.0f%%; preemptions %d; failovers %d; micro-batches %d\n",
                        r.kv_use_mean * 100, r.kv_use_peak * 100, r.preemptions, r.failovers, r.steps);
  absl::StrAppend(&out, "stages (busy fraction, mean decode micro-batch):\n");
  for (const StageUse& s : r.stages) {
    absl::StrAppendFormat(&out, "  replica %d stage %d: %.2f busy, %s\n", s.replica, s.stage, s.busy_fraction,
                          Ms(s.mean_decode_step_s));
  }
  for (const std::string& line : r.decode_steps) absl::StrAppend(&out, "decode steps per call: ", line, "\n");
  for (const FaultReport& f : r.faults) {
    absl::StrAppendFormat(&out, "fault: %s at %.1f s: ", f.fault.worker, f.fault.at_s);
    if (f.replicas_removed.empty()) {
      absl::StrAppend(&out, "hosts no stage, no effect\n");
    } else {
      std::string ids;
      for (int id : f.replicas_removed) absl::StrAppend(&ids, ids.empty() ? "" : ",", id);
      absl::StrAppendFormat(&out, "replica %s removed, %d sequences failed over, %d failed\n", ids, f.failovers,
                            f.failed);
    }
    absl::StrAppend(&out, WindowLine("before", f.before), WindowLine("after", f.after),
                    "    re-plan of the survivors: ", f.replan, "\n");
  }
  return out;
}

std::string SweepToJson(const SweepResult& s, const Slo& slo) {
  json tried = json::array();
  for (const SweepCandidate& c : s.tried) {
    tried.push_back({{"tp", c.tp},
                     {"pp", c.pp},
                     {"replicas", c.replicas},
                     {"workers", c.workers},
                     {"devices", c.devices},
                     {"meets", c.meets},
                     {"why", c.why},
                     {"ttft_p99_s", c.result.ttft_s.p99},
                     {"itl_p99_s", c.result.itl_s.p99},
                     {"e2e_p99_s", c.result.e2e_s.p99},
                     {"output_tokens_per_s", c.result.output_tokens_per_s}});
  }
  json out = {{"slo", SloToString(slo)}, {"tried", tried}, {"best", nullptr}};
  if (s.best.has_value()) out["best"] = ToJsonObject(s.tried[*s.best].result);
  return out.dump();
}

std::string SweepToTable(const SweepResult& s, const Slo& slo) {
  std::string out = absl::StrCat("SLO: ", SloToString(slo), "\n");
  absl::StrAppendFormat(&out, "%-4s %-4s %-8s %-7s %-7s %-10s %-10s %-10s %-12s %s\n", "TP", "PP", "REPLICAS",
                        "WORKERS", "DEVICES",
                        "TTFT_P99", "ITL_P99", "E2E_P99", "OUT_TOK/S", "SLO");
  for (const SweepCandidate& c : s.tried) {
    absl::StrAppendFormat(&out, "%-4d %-4d %-8d %-7d %-7d %-10s %-10s %-10s %-12.0f %s\n", c.tp, c.pp, c.replicas,
                          c.workers, c.devices, Ms(c.result.ttft_s.p99), Ms(c.result.itl_s.p99), Ms(c.result.e2e_s.p99),
                          c.result.output_tokens_per_s, c.meets ? "meets" : absl::StrCat("misses: ", c.why));
  }
  if (!s.best.has_value()) {
    absl::StrAppend(&out, "\nno layout tried meets the SLO\n");
    return out;
  }
  const SweepCandidate& b = s.tried[*s.best];
  absl::StrAppendFormat(&out, "\ncheapest layout meeting the SLO: tp=%d pp=%d replicas=%d (%d workers, %d devices)\n\n",
                        b.tp, b.pp, b.replicas, b.workers, b.devices);
  absl::StrAppend(&out, ResultToTable(b.result));
  return out;
}

}  // namespace shardserve::sim

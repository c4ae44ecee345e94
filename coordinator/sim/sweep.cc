#include "coordinator/sim/sweep.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "coordinator/planner/planner.h"

namespace shardserve::sim {

absl::StatusOr<Slo> ParseSlo(absl::string_view text) {
  Slo slo;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    std::vector<absl::string_view> kv = absl::StrSplit(part, absl::MaxSplits('=', 1));
    double scale = 1;
    absl::string_view value = kv.size() == 2 ? kv[1] : "";
    if (absl::ConsumeSuffix(&value, "ms")) {
      scale = 1e-3;
    } else {
      absl::ConsumeSuffix(&value, "s");
    }
    double v = 0;
    if (kv.size() != 2 || !absl::SimpleAtod(value, &v) || !(v > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--slo: \"", part, "\" is not NAME=VALUE with a positive VALUE in s or ms"));
    }
    v *= scale;
    if (kv[0] == "ttft_p99") {
      slo.ttft_p99_s = v;
    } else if (kv[0] == "itl_p99") {
      slo.itl_p99_s = v;
    } else if (kv[0] == "e2e_p99") {
      slo.e2e_p99_s = v;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--slo: unknown bound \"", kv[0], "\" (ttft_p99, itl_p99, e2e_p99)"));
    }
  }
  return slo;
}

std::string SloToString(const Slo& slo) {
  std::vector<std::string> parts;
  if (slo.ttft_p99_s > 0) parts.push_back(absl::StrFormat("ttft_p99<=%.0fms", slo.ttft_p99_s * 1e3));
  if (slo.itl_p99_s > 0) parts.push_back(absl::StrFormat("itl_p99<=%.1fms", slo.itl_p99_s * 1e3));
  if (slo.e2e_p99_s > 0) parts.push_back(absl::StrFormat("e2e_p99<=%.2fs", slo.e2e_p99_s));
  return parts.empty() ? "every request completes" : absl::StrJoin(parts, ", ");
}

bool MeetsSlo(const SimResult& r, const Slo& slo, std::string* why) {
  auto miss = [why](std::string text) {
    if (why != nullptr) *why = std::move(text);
    return false;
  };
  if (r.rejected + r.failed + r.unfinished > 0) {
    return miss(absl::StrCat(r.rejected + r.failed + r.unfinished, " requests rejected, failed or unfinished"));
  }
  if (slo.ttft_p99_s > 0 && r.ttft_s.p99 > slo.ttft_p99_s) {
    return miss(absl::StrFormat("ttft p99 %.0f ms", r.ttft_s.p99 * 1e3));
  }
  if (slo.itl_p99_s > 0 && r.itl_s.p99 > slo.itl_p99_s) {
    return miss(absl::StrFormat("itl p99 %.1f ms", r.itl_s.p99 * 1e3));
  }
  if (slo.e2e_p99_s > 0 && r.e2e_s.p99 > slo.e2e_p99_s) {
    return miss(absl::StrFormat("e2e p99 %.2f s", r.e2e_s.p99));
  }
  return true;
}

absl::StatusOr<SweepResult> Sweep(const ModelSpec& spec, const std::vector<WorkerInventory>& workers,
                                  const std::vector<SimRequest>& workload, const SimOptions& options, const Slo& slo,
                                  const SweepOptions& sweep) {
  SweepResult out;
  size_t max_devices = 0;
  for (const WorkerInventory& w : workers) max_devices = std::max(max_devices, w.devices.size());
  const int max_pp = static_cast<int>(std::min<int64_t>(
      {static_cast<int64_t>(sweep.max_pp), spec.num_layers, static_cast<int64_t>(workers.size())}));
  for (int tp = 1; tp <= static_cast<int>(max_devices); tp *= 2) {
    if (!ValidateTensorParallelSize(spec, tp).ok()) continue;
    for (int pp = 1; pp <= max_pp; ++pp) {
      SimOptions o = options;
      o.policy.tp = tp;
      o.policy.pp = pp;
      o.policy.replicas = 0;
      absl::StatusOr<Plan> most = MakePlan(spec, workers, o.policy);
      if (!most.ok()) continue;
      // Bisection over the replica count: the fewest in [1, max] that meet the SLO.
      std::map<int, size_t> probed;  // replicas -> index in out.tried
      auto probe = [&](int replicas) -> absl::StatusOr<bool> {
        o.policy.replicas = replicas;
        absl::StatusOr<SimResult> r = Simulate(spec, workers, workload, o);
        if (!r.ok()) {
          if (absl::IsInvalidArgument(r.status()) && r.status().message().find("replicas") != std::string::npos) {
            return false;
          }
          if (absl::IsResourceExhausted(r.status())) return false;
          return r.status();
        }
        SweepCandidate c{.tp = tp, .pp = pp, .replicas = replicas};
        for (const Pipeline& p : r->plan.replicas) {
          c.workers += std::ssize(p.stages);
          for (const StageSpec& s : p.stages) c.devices += s.tp;
        }
        std::set<std::string> hosts;
        for (const ExpertHostSpec& h : r->plan.expert_hosts) hosts.insert(h.worker_id);
        c.workers += std::ssize(hosts);
        c.devices += std::ssize(r->plan.expert_hosts);
        c.meets = MeetsSlo(*r, slo, &c.why);
        c.result = *std::move(r);
        probed[replicas] = out.tried.size();
        out.tried.push_back(std::move(c));
        return out.tried.back().meets;
      };
      int lo = 1, hi = static_cast<int>(most->replicas.size());
      absl::StatusOr<bool> top = probe(hi);
      if (!top.ok()) return top.status();
      if (!*top) continue;  // even the most replicas miss it
      while (lo < hi) {
        const int mid = lo + (hi - lo) / 2;
        absl::StatusOr<bool> ok = probe(mid);
        if (!ok.ok()) return ok.status();
        if (*ok) {
          hi = mid;
        } else {
          lo = mid + 1;
        }
      }
      const SweepCandidate& found = out.tried[probed.at(hi)];
      auto key = [](const SweepCandidate& c) { return std::make_tuple(c.workers, c.devices, c.result.ttft_s.p99); };
      if (!out.best.has_value() || key(found) < key(out.tried[*out.best])) out.best = probed.at(hi);
    }
  }
  return out;
}

}  // namespace shardserve::sim

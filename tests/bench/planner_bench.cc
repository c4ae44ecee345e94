// shardserve-bench-planner: the control plane at scale (issue 24, part 4). Places a 235B-class MoE
// (tests/sim/models/moe-235b: 94 layers, 128 experts top-8, Qwen2-MoE-shaped) on 1,000 nodes of
// mixed devices (80 GB and 24 GB GPUs; nodes of 8 and 4 GPUs), and prints how long MakePlan takes
// beside the 1 s budget, and then a re-plan after one node of the plan dies. Checks every memory
// constraint of the plan: on every stage, weights + KV per rank fit the room of each of its
// devices. Exits 1 when a constraint is broken (the time is reported, not enforced: this machine
// is shared).
//
//   ./build/bin/shardserve-bench-planner [--model=tests/sim/models/moe-235b] [--nodes=1000]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "common/model_spec/model_spec.h"
#include "common/plan/plan.h"
#include "coordinator/planner/planner.h"

ABSL_FLAG(std::string, model, "tests/sim/models/moe-235b", "model directory (config.json)");
ABSL_FLAG(int, nodes, 1000, "nodes in the inventory");
ABSL_FLAG(int64_t, max_seq_len, 4096, "longest sequence");

namespace shardserve {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

// A fleet of four kinds of nodes, interleaved: 8 x 80 GB, 8 x 24 GB, 4 x 80 GB, 4 x 24 GB, with
// 90% of each device offered (as shardserve-worker's --gpu_memory_utilization).
std::vector<WorkerInventory> Fleet(int nodes) {
  struct Kind {
    int gpus;
    int64_t bytes;
  };
  const Kind kinds[] = {{8, 80 * kGiB}, {8, 24 * kGiB}, {4, 80 * kGiB}, {4, 24 * kGiB}};
  std::vector<WorkerInventory> out;
  for (int n = 0; n < nodes; ++n) {
    const Kind& k = kinds[n % 4];
    WorkerInventory w{.worker_id = absl::StrCat("node-", n), .node_name = absl::StrCat("node-", n)};
    for (int d = 0; d < k.gpus; ++d) {
      w.devices.push_back({.kind = DeviceKind::kCuda, .index = d, .total_bytes = k.bytes,
                           .free_bytes = k.bytes * 9 / 10});
    }
    out.push_back(std::move(w));
  }
  return out;
}

double Seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Every stage's weights + KV per rank within each of its devices' free bytes; -1 when none broken,
// else the count of broken stages.
int BrokenConstraints(const Plan& plan, const std::vector<WorkerInventory>& workers) {
  std::map<std::string, const WorkerInventory*> by_id;
  for (const WorkerInventory& w : workers) by_id[w.worker_id] = &w;
  int broken = 0;
  for (const Pipeline& p : plan.replicas) {
    for (const StageSpec& s : p.stages) {
      const WorkerInventory& w = *by_id.at(s.worker_id);
      for (int d : s.devices) {
        if (s.predicted_weight_bytes_per_rank + s.kv_bytes_per_rank > w.devices[static_cast<size_t>(d)].free_bytes) {
          ++broken;
        }
      }
    }
  }
  return broken;
}

int Run() {
  absl::StatusOr<ModelSpec> spec = LoadModelSpec(absl::GetFlag(FLAGS_model));
  if (!spec.ok()) {
    std::fprintf(stderr, "%s\n", spec.status().ToString().c_str());
    return 1;
  }
  std::vector<WorkerInventory> workers = Fleet(absl::GetFlag(FLAGS_nodes));
  PlanPolicy policy;
  policy.max_seq_len = absl::GetFlag(FLAGS_max_seq_len);
  auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<Plan> plan = MakePlan(*spec, workers, policy);
  const double first = Seconds(std::chrono::steady_clock::now() - t0);
  if (!plan.ok()) {
    std::fprintf(stderr, "%s\n", plan.status().ToString().c_str());
    return 1;
  }
  int64_t stages = 0;
  for (const Pipeline& p : plan->replicas) stages += std::ssize(p.stages);
  std::printf("model %s (%.1fB parameters), %zu nodes, %zu GPUs\n", absl::GetFlag(FLAGS_model).c_str(),
              static_cast<double>(spec->NumParameters()) / 1e9, workers.size(),
              [&] { size_t n = 0; for (const auto& w : workers) n += w.devices.size(); return n; }());
  std::printf("plan: %zu replicas x %zu stages (%lld stages), %zu expert hosts\n", plan->replicas.size(),
              plan->replicas.front().stages.size(), static_cast<long long>(stages), plan->expert_hosts.size());
  const int broken = BrokenConstraints(*plan, workers);
  std::printf("memory constraints: %s\n", broken == 0 ? "all met" : absl::StrCat(broken, " BROKEN").c_str());
  std::printf("MakePlan: %.3f s (budget 1 s: %.2fx of it)\n", first, first / 1.0);
  // A node of the plan dies: re-plan the others.
  const std::string dead = plan->replicas.front().stages.front().worker_id;
  std::erase_if(workers, [&](const WorkerInventory& w) { return w.worker_id == dead; });
  t0 = std::chrono::steady_clock::now();
  absl::StatusOr<Plan> replan = MakePlan(*spec, workers, policy);
  const double second = Seconds(std::chrono::steady_clock::now() - t0);
  if (!replan.ok()) {
    std::fprintf(stderr, "re-plan: %s\n", replan.status().ToString().c_str());
    return 1;
  }
  const int broken2 = BrokenConstraints(*replan, workers);
  std::printf("re-plan without %s: %zu replicas, %.3f s (budget 1 s: %.2fx of it); memory constraints: %s\n",
              dead.c_str(), replan->replicas.size(), second, second / 1.0,
              broken2 == 0 ? "all met" : absl::StrCat(broken2, " BROKEN").c_str());
  return broken + broken2 == 0 ? 0 : 1;
}

}  // namespace
}  // namespace shardserve

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return shardserve::Run();
}

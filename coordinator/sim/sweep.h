// Sweep: tries layouts (tp x pp x replicas) of a model on an inventory with the simulator and
// finds the cheapest one that meets a latency SLO at the workload: the fewest workers (nodes)
// used, then the fewest devices, then the lowest TTFT p99.
//
// For each tp the workers allow (ValidateTensorParallelSize) and each pp from 1 up to
// SweepOptions::max_pp, the planner is asked for the most replicas that fit; the fewest replicas
// that meet the SLO are then found by bisection (more replicas never hurt latency here: the load
// spreads further), each probe one simulation. Layouts the planner refuses are skipped.
//
// Thread-safety: pure functions.
#ifndef SHARDSERVE_COORDINATOR_SIM_SWEEP_H_
#define SHARDSERVE_COORDINATOR_SIM_SWEEP_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "coordinator/sim/simulator.h"

namespace shardserve::sim {

// Upper bounds in seconds; 0 = not constrained. Every request must also complete (none rejected
// or failed).
struct Slo {
  double ttft_p99_s = 0;
  double itl_p99_s = 0;
  double e2e_p99_s = 0;
};

// "ttft_p99=500ms,itl_p99=50ms,e2e_p99=20s": values in s (default) or ms. InvalidArgument naming
// the part otherwise.
absl::StatusOr<Slo> ParseSlo(absl::string_view text);
std::string SloToString(const Slo& slo);

// Whether `r` meets `slo`; when not, `why` (non-null) says which bound it misses first.
bool MeetsSlo(const SimResult& r, const Slo& slo, std::string* why);

struct SweepOptions {
  int max_pp = 8;
};

struct SweepCandidate {
  int tp = 0, pp = 0, replicas = 0;
  int64_t workers = 0;  // workers the plan uses (stages and expert hosts)
  int64_t devices = 0;  // devices the plan uses (sum of tp over stages, plus expert-host devices)
  bool meets = false;
  std::string why;  // the bound missed, when !meets
  SimResult result;
};

struct SweepResult {
  std::vector<SweepCandidate> tried;  // every simulated layout, in the order tried
  std::optional<size_t> best;         // index into tried: the cheapest meeting the SLO (see above)
};

// Errors: those of Simulate for the options themselves; a layout the planner refuses is skipped.
absl::StatusOr<SweepResult> Sweep(const ModelSpec& spec, const std::vector<WorkerInventory>& workers,
                                  const std::vector<SimRequest>& workload, const SimOptions& options, const Slo& slo,
                                  const SweepOptions& sweep = {});

}  // namespace shardserve::sim

#endif  // SHARDSERVE_COORDINATOR_SIM_SWEEP_H_

// Workloads for the simulator: a list of requests (arrival time, prompt and output lengths), from
// a Poisson process or from a trace file; and the percentiles the results are reported with.
//
// Thread-safety: plain values; the functions are pure (MakePoissonWorkload is deterministic for a
// given seed).
#ifndef SHARDSERVE_COORDINATOR_SIM_WORKLOAD_H_
#define SHARDSERVE_COORDINATOR_SIM_WORKLOAD_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardserve::sim {

struct SimRequest {
  double arrival_s = 0;       // seconds from the start of the run
  int32_t prompt_tokens = 1;  // >= 1
  int32_t output_tokens = 1;  // >= 1: generated exactly (no EOS in a simulation)
};

// An inclusive range of lengths, drawn uniformly; min == max for a fixed length.
struct LengthRange {
  int32_t min = 1;
  int32_t max = 1;
};

struct PoissonOptions {
  double rate = 1;           // mean requests per second, > 0
  double duration_s = 60;    // arrivals in [0, duration_s), > 0 (unless requests > 0)
  int64_t requests = 0;      // when > 0: exactly this many arrivals (duration_s is ignored)
  LengthRange prompt_tokens{32, 32};
  LengthRange output_tokens{64, 64};
  uint64_t seed = 1;
};

// Arrivals of a Poisson process (exponential gaps), in time order. InvalidArgument naming the
// field for a non-positive rate or duration or an empty / non-positive length range.
absl::StatusOr<std::vector<SimRequest>> MakePoissonWorkload(const PoissonOptions& options);

// A trace: one request per line, "ARRIVAL_SECONDS PROMPT_TOKENS OUTPUT_TOKENS" separated by
// spaces, tabs or commas; blank lines and lines starting with '#' are skipped. Returned sorted by
// arrival. InvalidArgument naming the line for a malformed one (negative time, lengths < 1).
absl::StatusOr<std::vector<SimRequest>> ParseTrace(absl::string_view text);

// The q-quantile (q in [0, 1]) of `values`, nearest rank (the smallest value with at least a
// fraction q of the values at or below it), as `shardserve bench` reports them, so that predicted
// and measured figures compare; 0 for an empty input. Takes a copy to sort.
double Percentile(std::vector<double> values, double q);

}  // namespace shardserve::sim

#endif  // SHARDSERVE_COORDINATOR_SIM_WORKLOAD_H_

// How simulation results are printed: a readable table (`shardserve simulate`) or one JSON object
// (`--json`). Pure formatting.
//
// JSON fields of a result: layout, plan (the planner's table as text), kv_blocks (per replica),
// kv_block_size, requests, completed, rejected, failed, unfinished, duration_s, requests_per_s,
// output_tokens_per_s, ttft_s / itl_s / e2e_s ({p50, p90, p99, mean, max, count}), kv_use
// ({mean, peak}: blocks held / capacity), preemptions, failovers, steps, stages ([{replica,
// stage, busy_fraction, mean_decode_step_s}]), faults ([{worker, at_s, replicas_removed,
// failovers, failed, replan, before, after}], the windows with arrived, completed, failed,
// output_tokens_per_s and the three latency summaries). A sweep: slo, tried ([{tp, pp, replicas,
// devices, meets, why, ttft_p99_s, itl_p99_s, e2e_p99_s, output_tokens_per_s}]) and best (a
// result, or null).
#ifndef SHARDSERVE_COORDINATOR_SIM_REPORT_H_
#define SHARDSERVE_COORDINATOR_SIM_REPORT_H_

#include <string>

#include "coordinator/sim/simulator.h"
#include "coordinator/sim/sweep.h"

namespace shardserve::sim {

std::string ResultToTable(const SimResult& result);
std::string ResultToJson(const SimResult& result);
std::string SweepToTable(const SweepResult& sweep, const Slo& slo);
std::string SweepToJson(const SweepResult& sweep, const Slo& slo);

}  // namespace shardserve::sim

#endif  // SHARDSERVE_COORDINATOR_SIM_REPORT_H_

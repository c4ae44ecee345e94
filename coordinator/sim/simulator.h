// Simulate: a discrete-event simulation of a shardserve cluster on virtual time, built from the
// real control plane. The real planner (coordinator/planner) places the model on the inventory;
// the real Scheduler (coordinator/scheduler), driven with StepDriver::kCaller and a virtual
// Clock, admits, batches, preempts and fails over the requests of a workload; only the workers
// are simulated: each micro-batch the scheduler builds takes, on each stage of its pipeline, the
// time the cost model (cost_model.h) gives it, and a stage runs one micro-batch at a time, so up
// to pipeline_depth micro-batches overlap on different stages as in the real cluster.
//
// Replicas get what the coordinator gives them (coordinator/cluster/cluster.cc): KV blocks from
// PipelineKvBlocks, capped at max_slots whole sequences of max_seq_len and raised to one; up to
// one micro-batch per stage, split per step by the pipelining policy, unless a depth is set. (The
// policy prices CPU stages of one machine as sharing it; the simulation gives every stage its own
// device: CPU stages of one machine are the exception, below.)
//
// Shared machines: CPU stages whose workers have the same node_name (of any replicas) share that
// machine's memory bus and cores. A micro-batch that starts on such a stage is priced at the
// expected number of the machine's stages computing at once during it: 1 + for each other stage,
// the part of its (alone) duration that stage's micro-batches already under way or committed
// overlap; StageCostModel gives every op the ShareOfHost of that concurrency under
// cpu_parallelism. A micro-batch's time is fixed when it starts, so one that started alone is
// not slowed afterwards by one that starts beside it (in a steady pipeline each sees the other
// busy, so both are slowed alike).
// Requests never stop early (ignore_eos): each generates exactly its output_tokens.
//
// Faults: at a fault's time, every replica with a stage on the failed worker (matched by
// worker_id or node_name) is removed from the scheduler (RemoveReplica with Unavailable): its
// sequences fail over to the other replicas, or fail when none can take them. The surviving
// replicas keep serving; the coordinator's later re-plan of the surviving workers (and the
// reload it causes) is not simulated, but its layout is reported (FaultReport::replan).
//
// Determinism: the event order is fixed (time, then insertion order) and the scheduler runs on
// the calling thread, so the same inputs give the same result.
//
// Thread-safety: Simulate is a pure function of its arguments (it uses no global state) and may
// run on several threads at once.
#ifndef SHARDSERVE_COORDINATOR_SIM_SIMULATOR_H_
#define SHARDSERVE_COORDINATOR_SIM_SIMULATOR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_spec/model_spec.h"
#include "common/plan/plan.h"
#include "coordinator/scheduler/pipelining.h"
#include "coordinator/sim/device_profile.h"
#include "coordinator/sim/pipeline_cost.h"
#include "coordinator/sim/workload.h"

namespace shardserve::sim {

struct SimFault {
  std::string worker;  // worker_id or node_name
  double at_s = 0;     // virtual seconds from the start of the run
};

struct SimOptions {
  PlanPolicy policy;
  // The coordinator's serving options (the flags of shardserve-coordinator of the same names).
  int32_t max_slots = 8;
  int32_t kv_block_size = 16;
  int64_t max_step_tokens = 256;
  // Micro-batches in flight per replica; 0 = auto, as the coordinator: up to its stage count, split
  // per step by the pipelining policy (scheduler/pipelining.h) priced with these profiles.
  int32_t pipeline_depth = 0;
  // Decode steps a 1-stage replica runs per call for eligible decode batches (the coordinator's
  // --decode_steps_per_call): 0 = auto, as the coordinator (scheduler/decode_steps.h, fed with the
  // simulated calls' times and the stages' simulated compute); 1 = one step per call.
  int32_t decode_steps_per_call = 0;
  int64_t max_queued = 1024;
  bool prefix_caching = false;  // simulated prompts share nothing, so the cache only costs time
  // Device profiles: `gpu` for workers with CUDA devices, `cpu` for the others.
  DeviceProfile gpu;
  DeviceProfile cpu;
  LinkProfile network;             // between workers and to the coordinator
  double hop_overhead_s = 100e-6;  // software cost of one stage hop (gRPC stream message)
  // How much faster the CPU stages of one machine run together than one after the other (each
  // >= 1): the simulated machines. tests/bench/sim_calibration.py measures this machine's with
  // two processes running the probe's kernels at once.
  coordinator::HostParallelism cpu_parallelism = PipelineProfiles{}.cpu_parallelism;
  // What the simulated coordinator's pipelining policy assumes about them (the real coordinator's
  // default, which it has no flag to change).
  coordinator::HostParallelism policy_cpu_parallelism = PipelineProfiles{}.cpu_parallelism;
  std::vector<SimFault> faults;
  // Closed loop (as `shardserve bench --concurrency=N` without --rate): when > 0, the workload's
  // arrival times are ignored; this many clients start at time 0 and each sends the next request
  // of the workload as soon as its previous one has ended.
  int32_t closed_loop_clients = 0;
  // Stop at this virtual time even if requests are left (0: when every request has ended, or at
  // 10 x the last arrival + 600 s, whichever comes first); unfinished requests are reported.
  double max_time_s = 0;
};

struct LatencySummary {
  double p50 = 0, p90 = 0, p99 = 0, mean = 0, max = 0;
  int64_t count = 0;
};

// Requests that arrived in [begin_s, end_s).
struct WindowStats {
  double begin_s = 0, end_s = 0;
  int64_t arrived = 0;
  int64_t completed = 0;
  int64_t failed = 0;  // rejected at Submit or failed later
  // Output tokens generated in the window's time span (by any request) / its length.
  double output_tokens_per_s = 0;
  LatencySummary ttft_s, itl_s, e2e_s;
};

struct FaultReport {
  SimFault fault;
  std::vector<int> replicas_removed;  // empty: the worker hosts no stage
  int64_t failovers = 0;              // sequences moved to another replica
  int64_t failed = 0;                 // sequences that failed because no replica could take them
  WindowStats before, after;          // arrivals between the previous fault (or 0) and this one, and after
  std::string replan;                 // the planner's layout for the surviving workers, or its error
};

struct StageUse {
  int replica = 0, stage = 0;
  double busy_fraction = 0;  // of the run's time, computing (not waiting)
  // Mean time of one decode-only micro-batch on this stage (0 when it ran none).
  double mean_decode_step_s = 0;
};

struct SimResult {
  Plan plan;
  std::string layout;  // "tp=8 pp=2 replicas=3", replicas listed when they differ
  std::vector<int64_t> kv_blocks;  // per replica, as given to the scheduler
  int32_t kv_block_size = 0;
  int64_t requests = 0;
  int64_t completed = 0;
  int64_t rejected = 0;    // refused at Submit (queue full, too long)
  int64_t failed = 0;      // accepted, then failed (no replica left)
  int64_t unfinished = 0;  // still running when the run stopped at max_time_s
  double duration_s = 0;   // run start to the last request's end
  double requests_per_s = 0;       // completed / duration
  double output_tokens_per_s = 0;  // output tokens of completed requests / duration
  LatencySummary ttft_s, itl_s, e2e_s, queue_s;
  double kv_use_mean = 0;  // KV blocks held / capacity, averaged over steps and replicas
  double kv_use_peak = 0;
  int64_t preemptions = 0;
  int64_t failovers = 0;
  int64_t steps = 0;
  std::vector<StageUse> stages;
  // Per replica, at the end of the run: "replica R: <decode steps per call, and why>", as
  // `shardserve status` prints it.
  std::vector<std::string> decode_steps;
  std::vector<FaultReport> faults;
};

// Runs the simulation. Errors: the planner's (InvalidArgument, ResourceExhausted, ...) and
// InvalidArgument for out-of-range options (naming the field) or an empty workload.
absl::StatusOr<SimResult> Simulate(const ModelSpec& spec, const std::vector<WorkerInventory>& workers,
                                   const std::vector<SimRequest>& workload, const SimOptions& options);

// "tp=8 pp=2 replicas=3" for a plan whose replicas share one tp; "pp=2 replicas=2 (tp 8,4)" otherwise.
std::string LayoutName(const Plan& plan);

}  // namespace shardserve::sim

#endif  // SHARDSERVE_COORDINATOR_SIM_SIMULATOR_H_

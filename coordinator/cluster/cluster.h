// Cluster: the coordinator's control loop — from registered workers to serving replicas.
//
//   waiting for workers --(expected_workers alive)--> plan (MakePlan) --> assign (Worker.Assign to
//   every stage worker) --> loading --(all stages of a replica READY for their assignment)-->
//   the replica serves (Scheduler::AddReplica) ...
//
// Readiness: the cluster becomes ready once every assigned worker has settled (READY for its
// assignment, FAILED, or dead) and at least one replica is serving; from then on it stays ready
// while any replica serves. A replica whose stage worker fails, dies or re-registers stops serving
// (Scheduler::RemoveReplica fails its running requests with Unavailable, naming the worker and
// why; with Options::admit_while_recovering the scheduler parks them instead, see
// scheduler.h "Recovery"). A worker that restarts (registers again with the same node name and
// address, whatever state it reports) is given its old stage again, and the replica serves again
// once it is READY.
//
// Spares: when a stage's worker is dead or gone and has not come back, an idle registered worker
// that is in no stage of the plan and has the stage's devices (same kind and indices, at least as
// much memory as the planned worker's) takes the stage: it is assigned the same layers, and the
// previous stage is re-assigned to send to it. Expert hosts are only taken back by their worker.
//
// Reconciliation: a live worker that holds or loads an assignment (LOADING, READY or FAILED) but
// is in no stage of the plan (it came back after a spare took its stage, or it serves an earlier
// plan) is told to drop it (Worker.Release) and becomes idle: a spare.
//
// Drain (Drain(), for Admin.DrainWorker, Registry.Drain and the CLI's `shardserve drain`): the
// worker's replica takes no new work (Scheduler::DrainReplica); when another replica serves, the
// replica stops serving at once and its sequences fail over there (recomputed, exact); otherwise
// its sequences run to their end for at most the drain's timeout (new requests park meanwhile,
// and those still running at the timeout park: scheduler.h "Recovery"). Then the stage is taken
// from the worker (a spare takes it when there is one; the drained worker is never given a stage
// again) and the worker is released (Worker.Release: it becomes idle, and may exit).
//
// Adoption (a coordinator restart without reloading): before planning, the cluster looks at what
// the live workers reported when they registered (WorkerRegistration::held, with state READY or
// LOADING for it). When they hold complete replicas — stages 0..n-1 of one replica number, contiguous layers
// covering the model, each stage sending to the next one's registered address, the same KV cache
// size on every stage, remote experts on READY expert hosts — of this coordinator's model with its
// settings (model path, quantization, kv_block_size, max_seq_len, max_step_tokens, a KV size
// within --kv_blocks, and --tp / --pp / --replicas where fixed), those replicas ARE the plan: no
// Worker.Assign is sent, the stages keep their assignment ids, and a replica serves as soon as its
// workers are registered. Otherwise (nothing held, or nothing complete and compatible) the planner
// plans as usual; workers whose held stage is then no stage of the plan are released, and one that
// is assigned the same weights again keeps them (worker_server.h). Adopted replicas are numbered
// 0..R-1 in the order of the numbers the workers report. Assignment ids carry the registry's
// incarnation ("plan-<incarnation>-N/..."), so that an id a new coordinator makes never equals one
// a worker holds from an earlier run.
//
// Expert hosts (workers that hold spilled experts and run no stage) are assigned like stage workers;
// every replica needs all of them. Not done (yet): re-planning the layout when workers join or
// leave for good (a spare takes one stage as planned).
//
// Threads: Start() runs the loop on its own thread, which wakes on every registry change and at
// least every Options::poll_interval. Tick() runs one pass; tests may call it instead of Start().
// Worker.Assign calls and replica changes happen on that thread with no lock held. All public
// methods are thread-safe.
#ifndef SHARDSERVE_COORDINATOR_CLUSTER_CLUSTER_H_
#define SHARDSERVE_COORDINATOR_CLUSTER_CLUSTER_H_

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/concurrency/clock.h"
#include "common/model_spec/model_spec.h"
#include "common/plan/plan.h"
#include "coordinator/client/worker_client.h"
#include "coordinator/registry/registry.h"
#include "coordinator/scheduler/replica_client.h"
#include "coordinator/scheduler/scheduler.h"
#include "coordinator/sim/pipeline_cost.h"

namespace shardserve::coordinator {

// Where a serving replica is reached: the ReplicaClient factory's input.
struct ReplicaEndpoint {
  int replica = 0;
  std::string stage0_address;  // the first stage's worker (Stage.StepStream)
  std::string last_address;    // the last stage's worker (Stage.AnswerStream); = stage0_address with one stage
  std::vector<std::string> worker_ids;  // per stage
  int32_t max_slots = 0;       // running sequences at once (a scheduling limit)
  int64_t kv_blocks = 0;       // KV cache blocks, the same ids on every stage (their minimum)
  int32_t kv_block_size = 0;   // tokens per block
  // Per stage: its layers, devices and machine, for the pipelining policy. Stages on one machine
  // (the same node_name, or workers listening on the same host) carry one node_name.
  std::vector<StageSpec> stages;
};

// The most sequences a replica runs at once when ClusterOptions::max_slots is 0 (vLLM's default
// max_num_seqs).
inline constexpr int32_t kMaxAutoSlots = 256;

// The running sequences of a replica whose KV cache has `kv_blocks` blocks, when max_slots is
// sized from the KV budget: as many whole sequences of `blocks_per_sequence` blocks as fit, in
// [1, kMaxAutoSlots] (so a replica never preempts for want of blocks while all run at full length).
int32_t SlotsForKvBlocks(int64_t kv_blocks, int64_t blocks_per_sequence);

// Makes the client of a replica that is about to serve. Called on the cluster's thread.
using ReplicaClientFactory = std::function<absl::StatusOr<std::unique_ptr<ReplicaClient>>(const ReplicaEndpoint&)>;

struct ClusterOptions {
  std::string model_path;    // sent to workers as given
  int expected_workers = 1;  // plan once this many workers are registered and alive, >= 1
  PlanPolicy policy;         // policy.max_seq_len must be resolved (> 0)
  // Running sequences per replica, >= 1, or 0: sized from the KV budget (SlotsForKvBlocks: as many
  // whole contexts as the replica's KV blocks hold, at most kMaxAutoSlots). The KV cache may hold
  // fewer; it never gets more blocks than max_slots (or kMaxAutoSlots) whole sequences
  // (ceil(max_seq_len / kv_block_size) blocks each) could use.
  int32_t max_slots = 0;
  int32_t max_step_tokens = 256;
  // Micro-batches in flight per replica, >= 0. 0 = auto: up to its number of stages, split per
  // step by the scheduler's pipelining policy priced with `pipelining` (sim::PipelineCost over
  // the replica's stages, their device kinds and machines; scheduler/pipelining.h).
  int32_t pipeline_depth = 0;
  sim::PipelineProfiles pipelining = sim::DefaultPipelineProfiles();  // with pipeline_depth 0; valid
  bool prefix_caching = true;  // ReplicaOptions::prefix_caching
  // How every stage sends hidden states to the next one and to expert hosts (--hidden_wire_dtype):
  // kF32 or kBF16, in each stage's assignment.
  DType hidden_wire_dtype = DType::kF32;
  int32_t kv_block_size = 16;  // tokens per KV cache block, in [1, 65536]
  // At most this many KV blocks per replica (0 = what the plan's KV budget holds); at least one
  // whole sequence (ceil(max_seq_len / kv_block_size) blocks) is always allocated.
  int64_t max_kv_blocks = 0;
  absl::Duration poll_interval = absl::Milliseconds(100);  // loop wake-up bound
  absl::Duration assign_retry = absl::Seconds(1);          // between failed Assign (and Release) attempts
  // Admit requests while no replica serves after one has (AdmissionStatus): the scheduler parks
  // them until a replica recovers (SchedulerOptions::recovery_timeout > 0).
  bool admit_while_recovering = false;
  absl::Status Validate() const;
};

// A worker as the cluster sees it (for the Admin service).
struct ClusterWorkerView {
  WorkerRecord record;
  std::optional<WorkerAssignment> assignment;  // when it holds a stage of the plan
  std::string assign_error;                    // the last failed Worker.Assign, if any
  bool draining = false;                       // Drain() was called for it
};

struct ClusterView {
  bool ready = false;
  std::string reason;  // why not ready; when ready, what is degraded (empty if nothing)
  std::string plan;    // PlanToString of the current plan; empty before planning
  std::vector<ClusterWorkerView> workers;
  std::vector<int> serving_replicas;
};

class Cluster {
 public:
  // Borrows everything (must outlive the Cluster). `options` must be valid (checked).
  Cluster(ClusterOptions options, const ModelSpec* spec, WorkerRegistry* registry, Scheduler* scheduler,
          WorkerClient* workers, ReplicaClientFactory replica_factory, const Clock* clock);
  ~Cluster();  // Stop()

  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  void Start();
  // Stops and joins the loop thread (returns within about poll_interval plus a pending Assign's
  // deadline). Replicas keep serving: stop the Scheduler to stop them. Idempotent.
  void Stop();
  // One pass of the loop: sweep dead workers, then EnsurePlan, AdvanceDrains, ReconcileStages,
  // UpdateServingReplicas and UpdateReadiness (below).
  void Tick();

  // OK when ready; Unavailable with the reason otherwise.
  absl::Status ReadyStatus() const;
  // Whether the front ends take a request now: ReadyStatus(), except that with
  // admit_while_recovering a cluster that has served takes them while it recovers.
  absl::Status AdmissionStatus() const;
  ClusterView View();
  // Plans made so far (successful MakePlan calls that replaced the assignments); 0 before the first.
  int PlansMade() const;
  // Waits (bounded) until ready; returns whether it is.
  bool WaitUntilReady(absl::Duration timeout) const;
  // Drains worker `worker_id` ("Drain" above); returns once the drain is under way (the next Tick
  // carries it out; View() shows `draining`, and the worker turns idle once released). `timeout`
  // bounds how long its sequences may run on when no other replica can take them (> 0).
  // NotFound for an unknown worker; FailedPrecondition for an expert host (not drained yet) or a
  // dead worker; InvalidArgument for a timeout <= 0. Draining a worker twice is OK (the first
  // timeout stands).
  absl::Status Drain(const std::string& worker_id, absl::Duration timeout);
  // Called with the new readiness whenever it changes (from the loop thread, no lock held).
  void SetReadinessCallback(std::function<void(bool)> callback);

 private:
  struct Stage {
    WorkerAssignment assignment;
    std::string worker_id;
    std::string node_name, address;  // to recognise the worker when it restarts
    std::string id_base;             // "plan-N/rR/sS/": the assignment id less its worker
    std::vector<Device> devices;     // the planned worker's (what a spare must have)
    bool assigned = false;           // Worker.Assign succeeded for this worker_id
    std::string assign_error;
    absl::Time next_attempt = absl::InfinitePast();
  };
  struct ReplicaState {
    std::vector<Stage> stages;
    bool serving = false;
    int64_t kv_blocks = 0;  // assigned to every stage
    int64_t blocks_per_sequence = 1;  // ceil(max_seq_len / kv_block_size)
  };

  void Loop();
  // Tick's steps, in order. Each takes mu_ for its bookkeeping and calls workers and the scheduler
  // without it.
  // Plans (or adopts what the workers hold) once enough workers are alive; false while there is no
  // plan (reason_ says why).
  bool EnsurePlan(const std::vector<WorkerRecord>& workers) ABSL_EXCLUSIVE_LOCKS_REQUIRED(tick_mu_)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Starts requested drains and ends those whose sequences have moved (or timed out).
  void AdvanceDrains(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(tick_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // Gives stages whose worker died to its restart or a spare, sends the assignments not yet
  // accepted, and releases live workers that hold no stage of the plan.
  void ReconcileStages(const std::vector<WorkerRecord>& workers, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(tick_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // The pipelining policy's cost model of a replica about to serve (pipeline_depth 0).
  absl::StatusOr<std::shared_ptr<const PipelineCostModel>> PipelineCostFor(const ReplicaEndpoint& endpoint) const;
  // Adds to the scheduler the replicas whose stages are all READY and removes the others.
  void UpdateServingReplicas(const std::vector<WorkerRecord>& workers) ABSL_EXCLUSIVE_LOCKS_REQUIRED(tick_mu_)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Readiness and its reason; tells the readiness callback of a change.
  void UpdateReadiness(const std::vector<WorkerRecord>& workers) ABSL_EXCLUSIVE_LOCKS_REQUIRED(tick_mu_)
      ABSL_LOCKS_EXCLUDED(mu_);
  void PlanLocked(const std::vector<WorkerRecord>& workers) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // "Adoption" above: makes the plan from what the live workers hold when they hold complete
  // replicas this coordinator can serve; returns whether it did (else the planner plans).
  bool AdoptLocked(const std::vector<WorkerRecord>& workers) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The plan text's line on how hidden states travel (--hidden_wire_dtype); empty when nothing
  // travels (every replica one stage, no expert host).
  std::string HiddenWireLineLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why the stage cannot serve (empty when it is READY for its assignment).
  std::string StageProblem(const Stage& stage, const WorkerRecord* record, bool* settled) const;
  // Points `stage` at worker `w` (a restart of its worker, or a spare): a new assignment id, to
  // be assigned.
  void RetargetLocked(Stage& stage, const WorkerRecord& w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes every stage from `worker_id` (a drain): the stage has no worker until one takes it.
  void VacateLocked(const std::string& worker_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `w` has the devices `stage` was planned on.
  static bool CanTake(const Stage& stage, const WorkerRecord& w);

  // Constant after construction.
  const ClusterOptions options_;
  const ModelSpec* const spec_;
  WorkerRegistry* const registry_;
  Scheduler* const scheduler_;
  WorkerClient* const workers_;
  const ReplicaClientFactory replica_factory_;
  const Clock* const clock_;

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool ready_ ABSL_GUARDED_BY(mu_) = false;
  bool was_ready_ ABSL_GUARDED_BY(mu_) = false;  // settled and serving at least once
  std::string reason_ ABSL_GUARDED_BY(mu_) = "starting";
  std::optional<Plan> plan_ ABSL_GUARDED_BY(mu_);
  int plans_made_ ABSL_GUARDED_BY(mu_) = 0;
  std::string plan_text_ ABSL_GUARDED_BY(mu_);
  std::string plan_error_ ABSL_GUARDED_BY(mu_);
  std::string planned_for_ ABSL_GUARDED_BY(mu_);  // the alive worker set of the last failed plan
  std::string adoption_tried_for_ ABSL_GUARDED_BY(mu_);  // the live workers (and what they hold) last tried
  std::vector<ReplicaState> replicas_ ABSL_GUARDED_BY(mu_);
  // Workers serving spilled experts (the plan's expert hosts); every replica needs all of them.
  std::vector<Stage> hosts_ ABSL_GUARDED_BY(mu_);
  std::function<void(bool)> on_readiness_ ABSL_GUARDED_BY(mu_);
  struct DrainState {
    absl::Time deadline;
    bool started = false;  // its replica was told to drain (Scheduler::DrainReplica)
    bool done = false;     // its stage was taken from it
  };
  // Workers being drained or drained, by id (forgotten once their record is gone or dead).
  std::map<std::string, DrainState> draining_ ABSL_GUARDED_BY(mu_);
  int64_t revision_ ABSL_GUARDED_BY(mu_) = 0;  // retargets so far (part of new assignment ids)
  // Workers told to drop what they hold (Worker.Release): when they may be told again.
  std::map<std::string, absl::Time> released_ ABSL_GUARDED_BY(mu_);

  absl::Mutex tick_mu_;  // one Tick at a time (loop thread or a test)
  std::thread thread_;
};

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_CLUSTER_CLUSTER_H_

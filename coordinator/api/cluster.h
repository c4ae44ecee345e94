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
// why). A worker that restarts (registers again with the same node name and address) is given
// its old stage again, and the replica serves again once it is READY.
//
// Expert hosts (workers that hold spilled experts and run no stage) are assigned like stage workers;
// every replica needs all of them. Not done (yet): re-planning when workers join or leave for good.
//
// Threads: Start() runs the loop on its own thread, which wakes on every registry change and at
// least every Options::poll_interval. Tick() runs one pass; tests may call it instead of Start().
// Worker.Assign calls and replica changes happen on that thread with no lock held. All public
// methods are thread-safe.
#ifndef SHARDSERVE_COORDINATOR_API_CLUSTER_H_
#define SHARDSERVE_COORDINATOR_API_CLUSTER_H_

#include <functional>
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

namespace shardserve::coordinator {

// Where a serving replica is reached: the ReplicaClient factory's input.
struct ReplicaEndpoint {
  int replica = 0;
  std::string stage0_address;  // the first stage's worker (Stage.StepStream)
  std::vector<std::string> worker_ids;  // per stage
  int32_t max_slots = 0;       // running sequences at once (a scheduling limit)
  int64_t kv_blocks = 0;       // KV cache blocks, the same ids on every stage (their minimum)
  int32_t kv_block_size = 0;   // tokens per block
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
  int32_t pipeline_depth = 0;  // micro-batches in flight per replica; 0 = its number of stages
  bool prefix_caching = true;  // ReplicaOptions::prefix_caching
  int32_t kv_block_size = 16;  // tokens per KV cache block, in [1, 65536]
  // At most this many KV blocks per replica (0 = what the plan's KV budget holds); at least one
  // whole sequence (ceil(max_seq_len / kv_block_size) blocks) is always allocated.
  int64_t max_kv_blocks = 0;
  absl::Duration poll_interval = absl::Milliseconds(100);  // loop wake-up bound
  absl::Duration assign_retry = absl::Seconds(1);          // between failed Assign attempts
  absl::Status Validate() const;
};

// A worker as the cluster sees it (for the Admin service).
struct ClusterWorkerView {
  WorkerRecord record;
  std::optional<WorkerAssignment> assignment;  // when it holds a stage of the plan
  std::string assign_error;                    // the last failed Worker.Assign, if any
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
  // One pass of the loop: sweep dead workers, plan, assign, add/remove replicas, update readiness.
  void Tick();

  // OK when ready; Unavailable with the reason otherwise.
  absl::Status ReadyStatus() const;
  ClusterView View();
  // Plans made so far (successful MakePlan calls that replaced the assignments); 0 before the first.
  int PlansMade() const;
  // Waits (bounded) until ready; returns whether it is.
  bool WaitUntilReady(absl::Duration timeout) const;
  // Called with the new readiness whenever it changes (from the loop thread, no lock held).
  void SetReadinessCallback(std::function<void(bool)> callback);

 private:
  struct Stage {
    WorkerAssignment assignment;
    std::string worker_id;
    std::string node_name, address;  // to recognise the worker when it restarts
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
  void PlanLocked(const std::vector<WorkerRecord>& workers) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why the stage cannot serve (empty when it is READY for its assignment).
  std::string StageProblem(const Stage& stage, const WorkerRecord* record, bool* settled) const;

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
  std::vector<ReplicaState> replicas_ ABSL_GUARDED_BY(mu_);
  // Workers serving spilled experts (the plan's expert hosts); every replica needs all of them.
  std::vector<Stage> hosts_ ABSL_GUARDED_BY(mu_);
  std::function<void(bool)> on_readiness_ ABSL_GUARDED_BY(mu_);

  absl::Mutex tick_mu_;  // one Tick at a time (loop thread or a test)
  std::thread thread_;
};

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_API_CLUSTER_H_

// WorkerServer: what a worker daemon serves — the Worker service (assignments pushed by the
// coordinator), the Stage service (the data-plane stream from the previous hop), the Expert
// service (experts it hosts for other workers' stages) — and the state its heartbeats report.
// An assignment makes the worker either a pipeline stage or an expert host.
//
// Stage.AnswerStream: the coordinator's return stream, where the last stage writes direct answers
// (stage.proto; answer_routes.h).
//
// Threads: gRPC reactions validate and enqueue. One stage thread runs micro-batches in arrival
// order on the loaded StageRuntime (which owns the rank threads); it does not wait for the next
// stage's answer, which the runtime's link reader relays (pipelining). A short micro-batch that
// finds the stage idle and nothing queued runs on the gRPC thread that read it instead
// (WorkerOptions::stage_inline): one micro-batch runs at a time either way, in arrival order. One
// loader thread at a time loads an assignment. The stage's job queue is bounded: a full queue
// answers the step with RESOURCE_EXHAUSTED.
#ifndef SHARDSERVE_WORKER_SERVICE_WORKER_SERVER_H_
#define SHARDSERVE_WORKER_SERVICE_WORKER_SERVER_H_

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/security/credentials.h>
#include <grpcpp/server.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/concurrency/mutex.h"
#include "common/security/grpc_security.h"
#include "common/tensor/dtype.h"
#include "shardserve/v1/control.grpc.pb.h"
#include "shardserve/v1/expert.grpc.pb.h"
#include "shardserve/v1/stage.grpc.pb.h"
#include "worker/service/answer_routes.h"
#include "worker/service/stream_budget.h"
#include "worker/engine/expert_host.h"
#include "worker/kernels/backend.h"
#include "worker/service/stage_runtime.h"
#include "worker/service/worker_metrics.h"

namespace shardserve::service {

struct WorkerOptions {
  kernels::DeviceKind kind = kernels::DeviceKind::kCpu;
  int cpu_ranks = 1;
  int cpu_threads = 1;
  std::vector<int> cuda_devices;
  size_t max_queued_steps = 64;  // also the Expert.Compute calls that may wait for an expert thread
  // Threads that run Expert.Compute calls (off gRPC's threads); calls on different devices overlap.
  int expert_threads = 2;
  // Bytes of stage-stream messages the worker holds over all its streams before they stop reading
  // (stream_budget.h; --stream_buffer_bytes); a micro-batch that would take them past twice this is
  // refused with RESOURCE_EXHAUSTED. >= 1.
  size_t stream_buffer_bytes = size_t{1} << 30;
  std::chrono::milliseconds expert_call_timeout{30000};  // deadline of a stage's calls to expert hosts
  WorkerMetrics* metrics = nullptr;  // optional, not owned; must outlive the server
  // Bytes each device offers the planner at most (0 = what it has free).
  int64_t memory_per_device = 0;
  // Fraction of each CUDA device's total memory this worker may fill (vLLM's
  // gpu_memory_utilization): a device offers its free memory less the (1 - fraction) x total it
  // keeps back, so that the planner's weights, workspace and KV cache stay under fraction x total
  // whatever else the device holds. In (0, 1]; not applied to CPU ranks.
  double gpu_memory_utilization = 0.9;
  // Credentials of this worker's channels to other workers (the next stage, expert hosts): mutual
  // TLS expecting the `worker` role when the cluster runs TLS. Null = plaintext.
  std::shared_ptr<grpc::ChannelCredentials> peer_credentials;
  // How long the idle stage thread polls for the next micro-batch before it sleeps
  // (common/concurrency/spin.h; --stage_spin_us): a micro-batch arriving within it starts without
  // a thread wake-up. 0 (the default) = sleep at once: where every core is busy (a 2-core machine
  // running a stage and its peers), the poll takes the CPU the awaited threads need, and steps got
  // slower in the pipeline benchmark.
  std::chrono::microseconds stage_spin{0};
  // The longest the idle stage thread polls per wait for a micro-batch that its recent waits say
  // is due (common/concurrency/arrival_forecast.h; --stage_poll_us): it sleeps until shortly
  // before the next micro-batch is likely to come and polls from there, so that the micro-batch
  // finds the core awake, for a bounded share of the wait (at most a quarter; nothing for waits
  // under 300 us, where the core stays awake anyway). 0 = sleep at once.
  std::chrono::microseconds stage_poll{1000};
  // A micro-batch that this stage's last step says takes at most this long runs on the gRPC thread
  // that read it, when the stage is idle and nothing queued is ahead of it (--stage_inline_us;
  // StageRuntime::MayRunOnReader says when else it may not): no hand-off to the stage thread, the
  // one thread wake-up of a hop that a bare round trip does not pay. Longer ones go to the stage
  // thread, so that no gRPC thread computes for long. 0 = every micro-batch goes to the stage thread.
  std::chrono::microseconds stage_inline{1000};
  // Step deltas on the stage streams (common/rpc/step_delta.h, --step_deltas): announce to the
  // upstream hop that this worker decodes them, and code what the stage forwards downstream when
  // the next stage announces it. Off: every micro-batch travels in full, both ways.
  bool step_deltas = true;
};

// The free bytes a CUDA device with `total_bytes` and `free_bytes` offers when this worker may fill
// `utilization` of it: free_bytes less the (1 - utilization) x total_bytes it keeps back, at least 0.
int64_t OfferedGpuBytes(int64_t total_bytes, int64_t free_bytes, double utilization);

// What heartbeats (and registrations) report.
struct WorkerStatusSnapshot {
  v1::WorkerState state = v1::WORKER_STATE_IDLE;
  std::string assignment_id;
  std::string error;
  int64_t kv_blocks = 0;  // with READY: the KV cache blocks allocated
  // The assignment `state` refers to (LOADING, READY, FAILED); absent when IDLE. A registration
  // reports it so that a restarted coordinator can adopt it.
  std::optional<v1::Assignment> assignment;
};

// Whether `a` and `b` ask for the same loaded weights and KV cache: equal in everything but
// assignment_id, replica, stage, num_stages, next_address and hidden_wire_dtype (what a worker can
// change without reloading).
bool SameWeightsAndCache(const v1::Assignment& a, const v1::Assignment& b);
// How stage `a` sends its hidden states (Assignment.hidden_wire_dtype, validated by Assign): kBF16
// or kF32 (also for UNSPECIFIED).
DType HiddenWireDtype(const v1::Assignment& a);

class WorkerServer {
 public:
  explicit WorkerServer(WorkerOptions options);
  ~WorkerServer();  // Shutdown() + join
  WorkerServer(const WorkerServer&) = delete;
  WorkerServer& operator=(const WorkerServer&) = delete;

  // The services to register on the worker's grpc::Server; owned by this object. On a TLS port
  // each call checks its caller's role (security::CheckPeerRole): Worker.Assign only from the
  // coordinator, Stage.StepStream from the coordinator (stage 0) or a worker (the previous stage),
  // Stage.AnswerStream only from the coordinator, Expert.Compute only from workers.
  grpc::Service* worker_service();
  grpc::Service* stage_service();
  grpc::Service* expert_service();

  // Thread-safe.
  WorkerStatusSnapshot Status() const;
  // Waits while an assignment loads (state LOADING), at most `timeout`, and returns the status then
  // (READY or FAILED once a load ended; still LOADING after the timeout). Thread-safe.
  WorkerStatusSnapshot WaitLoaded(absl::Duration timeout) const;
  // The devices this worker offers (for registration): CUDA devices' free memory less what
  // gpu_memory_utilization keeps back, and every device's capped at memory_per_device.
  std::vector<v1::Device> Devices() const;

  // Validates and starts loading `assignment` in the background (replacing the current one once
  // loaded). When the worker is READY for an assignment with the same weights and KV cache
  // (SameWeightsAndCache), nothing is loaded: the loaded stage is kept under the new id (with a new
  // link when the next hop changed, and the new hidden_wire_dtype) and the worker is READY for it
  // on return; the KV cache keeps its contents, which the coordinator never reads before writing
  // (it allocates block ids, and a step attends only to positions its sequence wrote).
  // InvalidArgument naming the bad field; Aborted while an assignment loads.
  absl::Status Assign(const v1::Assignment& assignment);
  // How many assignments were loaded from the checkpoint (kept ones are not counted). Thread-safe.
  int64_t weight_loads() const;
  // Drops the current assignment (Worker.Release): the worker becomes IDLE; micro-batches that
  // arrive later are refused as before any assignment. Aborted while loading.
  absl::Status Release(const std::string& reason);

  WorkerMetrics* metrics() const { return options_.metrics; }
  // WorkerOptions::step_deltas.
  bool step_deltas() const { return options_.step_deltas; }
  // The budget every stage stream of this worker charges (stream_budget.h).
  StreamBudget& stream_budget() { return stream_budget_; }
  // The coordinator's return streams open on this worker (Stage.AnswerStream), where its last
  // stage writes direct answers (answer_routes.h).
  AnswerRoutes& answer_routes() { return answer_routes_; }

  // Expert.Compute: UNAVAILABLE when this worker hosts no experts, NOT_FOUND for an expert it does
  // not host, INVALID_ARGUMENT for a malformed request.
  absl::Status ComputeExperts(const v1::ExpertRequest& request, v1::ExpertResponse* response);

  // A micro-batch for the stage: run on the calling thread when the stage is idle, nothing waits
  // ahead of it and it is short (WorkerOptions::stage_inline), else queued for the stage thread.
  // `done` receives the response (on the thread that ran it, on the next-stage link's reader
  // thread, or inline when the queue is full or the worker is stopping).
  void Enqueue(PooledStepRequest request, std::function<void(v1::StepResponse)> done);
  // Where the stage streams read their micro-batches into (pooled arenas: a steady decode parses
  // without heap allocations, common/rpc/message_pool.h).
  rpc::MessagePool<v1::StepRequest>& request_pool() { return *request_pool_; }

  // Queues an Expert.Compute call for the expert threads, which run ComputeExperts and then
  // `done` (inline instead: RESOURCE_EXHAUSTED when max_queued_steps calls wait, UNAVAILABLE when
  // stopping). `request` and `response` must stay valid until `done` runs.
  void EnqueueExpertCall(const v1::ExpertRequest* request, v1::ExpertResponse* response,
                         std::function<void(const absl::Status&)> done);

  // Stops the stage and loader threads; queued steps are answered with UNAVAILABLE.
  void Shutdown();

 private:
  struct Job {
    PooledStepRequest request;
    std::function<void(v1::StepResponse)> done;
    absl::Time enqueued;  // when it was queued (the stage thread's wait ended)
  };
  struct ExpertCall {
    const v1::ExpertRequest* request = nullptr;
    v1::ExpertResponse* response = nullptr;
    std::function<void(const absl::Status&)> done;
  };
  void StageLoop();
  void ExpertLoop();
  bool Stopping() const;
  void Load(v1::Assignment assignment);
  std::vector<v1::Device> QueryDevices() const;
  absl::StatusOr<std::shared_ptr<StageRuntime>> LoadStage(const v1::Assignment& a);
  // Assign's path for an assignment with the weights and KV cache already loaded: re-labels (and,
  // for a new next hop, re-links) the loaded stage; the replaced runtime goes to `*old`, to be
  // freed by the caller outside the lock. InvalidArgument when the next hop does not fit the stage.
  absl::Status KeepLoadedLocked(const v1::Assignment& a, std::shared_ptr<StageRuntime>* old)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const WorkerOptions options_;
  StreamBudget stream_budget_{options_.stream_buffer_bytes};
  // First blocks of 16 KiB (a decode micro-batch of dozens of sequences); arenas for as many
  // micro-batches as a few streams keep in flight wait for reuse.
  const std::shared_ptr<rpc::MessagePool<v1::StepRequest>> request_pool_ =
      rpc::MessagePool<v1::StepRequest>::Create(size_t{16} << 10, 16);
  AnswerRoutes answer_routes_;  // before the services and runtimes that use it
  std::unique_ptr<grpc::Service> worker_service_;
  std::unique_ptr<grpc::Service> stage_service_;
  std::unique_ptr<grpc::Service> expert_service_;

  mutable Mutex mu_;
  CondVar jobs_cv_;
  std::deque<Job> jobs_ ABSL_GUARDED_BY(mu_);
  // jobs_.size(), readable without mu_: what the idle stage thread polls before it sleeps.
  std::atomic<size_t> queued_jobs_{0};
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // A micro-batch is running (on the stage thread or on a reader thread): one at a time.
  bool stage_busy_ ABSL_GUARDED_BY(mu_) = false;
  // Runtimes replaced while a reader thread ran a micro-batch on them: their last reference is
  // dropped on the stage thread (a runtime's end waits for its link, which a gRPC thread must not).
  std::vector<std::shared_ptr<StageRuntime>> retired_ ABSL_GUARDED_BY(mu_);
  WorkerStatusSnapshot status_ ABSL_GUARDED_BY(mu_);
  mutable CondVar loaded_cv_;  // signalled when a load ends (status_ leaves LOADING)
  std::shared_ptr<StageRuntime> runtime_ ABSL_GUARDED_BY(mu_);  // replaced when a new assignment is loaded
  std::shared_ptr<engine::ExpertHost> expert_host_ ABSL_GUARDED_BY(mu_);  // set instead of runtime_ on expert hosts
  std::thread loader_ ABSL_GUARDED_BY(mu_);  // joined before starting another
  int64_t weight_loads_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread stage_thread_;
  CondVar expert_cv_;
  std::deque<ExpertCall> expert_calls_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> expert_threads_;  // started by the constructor
};

// Builds and starts the gRPC server of a worker daemon on `listen` (HOST:PORT, port 0 = a free
// one), serving `server`'s services on an internal port of `security` (mutual TLS whose callers
// must carry the coordinator or worker role, when TLS is on), with the health service and
// reflection. Sets *port to the bound port. Unavailable when the address cannot be bound.
// `server` must outlive the returned grpc::Server.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartWorkerRpcServer(const std::string& listen,
                                                                   const security::GrpcSecurity& security,
                                                                   WorkerServer& server, int* port);

}  // namespace shardserve::service

#endif  // SHARDSERVE_WORKER_SERVICE_WORKER_SERVER_H_

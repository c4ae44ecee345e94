// Coordinator: the whole coordinator process minus flag parsing and signals — it loads the model's
// ModelSpec (config.json) and tokenizer (when the directory has one) from `model_path`, and serves
// on two gRPC servers:
//   - the public port (`listen`): shardserve.v1.Inference (public API), Admin (operators), the
//     standard grpc.health.v1.Health (NOT_SERVING until the cluster is ready, SERVING while it
//     is) and server reflection; server TLS with optional client certificates when TLS is on.
//   - the control port (`control_listen`): Registry (workers register and heartbeat there);
//     mutual TLS when TLS is on, and only certificates with the worker role get in.
// Its own calls to the workers (Worker.Assign, the stage-0 stream) use mutual TLS and accept only
// workers' certificates.
// With CoordinatorOptions::metrics_listen it also serves Prometheus metrics (coordinator_metrics.h)
// on HTTP GET /metrics at that address.
// With http_listen set it also serves the OpenAI-compatible HTTP API (coordinator/http) from the
// same scheduler.
// Behind them: the WorkerRegistry, the Scheduler and the Cluster control loop (cluster.h).
//
// Tests inject a FakeClock, a fake WorkerClient and an in-process ReplicaClient factory through
// CoordinatorDeps; production uses the real clock and the gRPC clients.
//
// Thread-safety: Shutdown() may be called from any thread, once or more; the accessors return
// objects that are themselves thread-safe.
#ifndef SHARDSERVE_COORDINATOR_SERVER_COORDINATOR_H_
#define SHARDSERVE_COORDINATOR_SERVER_COORDINATOR_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/concurrency/clock.h"
#include "common/http/serving_limits.h"
#include "common/security/api_keys.h"
#include "common/security/grpc_security.h"
#include "common/security/tls_files.h"
#include "coordinator/cluster/cluster.h"
#include "coordinator/client/worker_client.h"
#include "coordinator/registry/registry.h"
#include "coordinator/scheduler/scheduler.h"
#include "coordinator/structured/grammar.h"

namespace grpc {
class Server;
}  // namespace grpc

namespace shardserve {
class MetricsServer;
class Tokenizer;
struct ModelSpec;
}  // namespace shardserve

namespace shardserve::coordinator {

class CoordinatorMetrics;
class InferenceService;
namespace http {
class HttpServer;
}  // namespace http
class RegistryService;
class AdminService;

struct CoordinatorOptions {
  std::string listen = "127.0.0.1:0";          // public API, HOST:PORT; port 0 picks a free port
  std::string control_listen = "127.0.0.1:0";  // worker registration, HOST:PORT; port 0 picks one
  // TLS files (security/tls_files.h); nullopt = plaintext on every port and link.
  std::optional<security::TlsOptions> tls;
  // With tls: serve the public API (gRPC and HTTP) in plaintext all the same, the internal links
  // keeping mutual TLS. Only on a loopback `listen` (and http_listen); InvalidArgument otherwise.
  bool public_plaintext = false;
  // API keys of the public API (gRPC and HTTP; security/api_keys.h): a file path, empty = none.
  std::string api_keys_file;
  std::string model_path;              // required: config.json (+ tokenizer files)
  int expected_workers = 1;            // >= 1
  int tp = 0, pp = 0, replicas = 0;    // >= 0; 0 = let the planner choose
  int64_t max_seq_len = 0;             // 0 = the model's max_position_embeddings
  int32_t max_slots = 0;               // running sequences per replica, >= 1; 0 = from the KV budget (cluster.h)
  int32_t kv_block_size = 16;          // tokens per KV cache block, in [1, 65536]
  int64_t max_kv_blocks = 0;           // KV blocks per replica at most; 0 = what the budget holds
  int32_t max_step_tokens = 256;       // >= 1
  // Decode steps a 1-stage replica may run per call (SchedulerOptions::decode_steps_per_call), in
  // [0, 64]; 1 = one step per call; 0 = auto: each replica chooses from the serving overhead and
  // the compute per step it measures (coordinator/scheduler/decode_steps.h).
  int32_t decode_steps_per_call = 0;
  // Overlapped decode calls on 1-stage replicas (SchedulerOptions::overlap_decode_calls): the next
  // call of a plain decode batch goes while the last one runs.
  bool overlap_decode_calls = true;
  // How replicas order waiting requests and preemptions (SchedulerOptions::policy): fcfs refuses a
  // request priority other than 0.
  SchedulingPolicy scheduling_policy = SchedulingPolicy::kFcfs;
  int64_t max_queued = 1024;           // >= 0
  int32_t pipeline_depth = 0;          // micro-batches in flight per replica, >= 0; 0 = auto (ClusterOptions)
  bool prefix_caching = true;          // reuse cached KV blocks of identical prompt prefixes
  // How workers store the weight matrices (--quantize): sent in every assignment and counted by
  // the planner.
  Quantization quantize = Quantization::kNone;
  // How workers keep the KV cache (--kv_cache_dtype): sent in every stage's assignment and counted
  // by the planner (kFp8E4M3: 1 byte per element).
  KvCacheFormat kv_cache = KvCacheFormat::kAuto;
  // How stages send hidden states to the next one and to expert hosts (--hidden_wire_dtype; kF32
  // or kBF16): sent in every stage's assignment.
  DType hidden_wire_dtype = DType::kF32;
  // The model's name in the HTTP API (/v1/models, replies; requests may name it or model_path).
  // Empty: the model directory's last component.
  std::string served_model_name;
  // How the model writes tool calls in chat (--tool_call_parser): "hermes" (<tool_call> tags,
  // Qwen2.5), "llama3_json" (Llama 3.x), "openai" (GPT-OSS's harmony), "glm45" (GLM-4.5's
  // <arg_key>/<arg_value> calls), or "auto" (detected from the chat template).
  std::string tool_call_parser = "auto";
  // A reasoning model's format (--reasoning_parser; coordinator/frontend/reasoning.h):
  // "deepseek_r1", "qwen3" or "gpt_oss" splits chat answers into reasoning_content and content;
  // "" = none, except for a harmony chat template (GPT-OSS), whose channels are always read.
  std::string reasoning_parser;
  absl::Duration heartbeat_interval = absl::Seconds(1);
  absl::Duration heartbeat_timeout = absl::Seconds(5);
  absl::Duration assign_timeout = absl::Seconds(10);  // deadline of Worker.Assign
  absl::Duration step_timeout = absl::Seconds(60);    // bound on one micro-batch
  // How long a replica's step thread polls for its answer before it sleeps
  // (GrpcReplicaClient::Options::answer_spin); in [0, 100 ms].
  absl::Duration answer_spin = absl::ZeroDuration();
  // The longest a replica's step thread polls per wait for an answer that is due
  // (GrpcReplicaClient::Options::answer_poll); in [0, 100 ms].
  absl::Duration answer_poll = absl::Milliseconds(1);
  // Step deltas on the streams to stage 0 (GrpcReplicaClient::Options::step_deltas).
  bool step_deltas = true;
  // How long requests whose replica broke wait for it (or a spare worker) to recover when no other
  // replica can take them (scheduler.h "Recovery"); requests that arrive meanwhile wait too.
  // 0 = they fail at once with UNAVAILABLE. >= 0.
  absl::Duration recovery_timeout = absl::Seconds(60);
  std::string metrics_listen;  // HOST:PORT of the Prometheus endpoint (port 0 picks one); empty = none
  // OpenAI-compatible HTTP API (coordinator/http): HOST:PORT (port 0 picks a free port); empty = off.
  // HTTPS with `tls` (unless public_plaintext).
  std::string http_listen;
  // The HTTP API's connection budget and timeouts (--http_max_connections, --http_*_timeout_ms, ...;
  // common/http/serving_limits.h) and its request-body cap (--http_max_body_bytes; 413 beyond it,
  // chunked bodies included). The metrics endpoint uses the same limits.
  HttpServingLimits http_limits;
  size_t http_max_body_bytes = 1 << 20;
  // gRPC connection limits of every gRPC server of the coordinator (public and control ports).
  security::GrpcServerLimits grpc_limits;
  // InvalidArgument naming the option (as its flag is spelled) when out of range.
  absl::Status Validate() const;
};

// Test seams; every null member gets the production implementation.
struct CoordinatorDeps {
  const Clock* clock = nullptr;                 // borrowed; must outlive the Coordinator
  std::unique_ptr<WorkerClient> worker_client;  // default: GrpcWorkerClient
  ReplicaClientFactory replica_factory;         // default: GrpcReplicaClient to stage 0
};

class Coordinator {
 public:
  // Loads the model description, builds everything and starts serving. Errors: InvalidArgument
  // for options (or max_seq_len above the model's max_position_embeddings); the errors of
  // LoadModelSpec / LoadTokenizer (a directory without tokenizer files is fine; a broken one is
  // not); Unavailable when the listen address (or metrics_listen) cannot be bound; InvalidArgument
  // for a malformed metrics_listen.
  static absl::StatusOr<std::unique_ptr<Coordinator>> Start(const CoordinatorOptions& options,
                                                            CoordinatorDeps deps = {});
  ~Coordinator();  // Shutdown(5 s)

  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  // Stops the control loop, marks the health service NOT_SERVING, fails every outstanding request
  // with UNAVAILABLE "shutting down", then shuts the gRPC server down, cancelling what is still
  // running at `deadline`. Idempotent.
  void Shutdown(absl::Duration deadline);

  // The public address actually bound ("127.0.0.1:43567").
  const std::string& address() const { return address_; }
  // The control address actually bound (workers' --coordinator).
  const std::string& control_address() const { return control_address_; }
  // The metrics endpoint actually bound ("127.0.0.1:43568"); empty without metrics_listen.
  const std::string& metrics_address() const { return metrics_address_; }
  // The coordinator's metric families (there even without an endpoint).
  CoordinatorMetrics& metrics() { return *metrics_; }
  // The HTTP API's bound address, or "" when --http_listen is off.
  std::string http_address() const;
  Cluster& cluster() { return *cluster_; }
  Scheduler& scheduler() { return *scheduler_; }
  WorkerRegistry& registry() { return *registry_; }

 private:
  Coordinator() = default;

  std::string address_;
  std::string control_address_;
  std::string metrics_address_;
  std::unique_ptr<CoordinatorMetrics> metrics_;  // outlives the scheduler, which reports to it
  std::unique_ptr<ModelSpec> spec_;
  std::unique_ptr<Tokenizer> tokenizer_;  // null when the model has none
  // Structured-output constraints over the tokenizer's vocabulary (null without a tokenizer);
  // shared by the gRPC and HTTP front ends, so each schema is compiled once.
  std::unique_ptr<structured::ConstraintCompiler> constraints_;
  std::unique_ptr<security::ApiKeys> api_keys_;  // null without --api_keys_file
  std::unique_ptr<WorkerClient> worker_client_;
  std::unique_ptr<WorkerRegistry> registry_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<Cluster> cluster_;
  std::unique_ptr<InferenceService> inference_;
  std::unique_ptr<RegistryService> registry_service_;
  std::unique_ptr<AdminService> admin_;
  std::unique_ptr<grpc::Server> server_;          // public port
  std::unique_ptr<grpc::Server> control_server_;  // control port
  std::unique_ptr<http::HttpServer> http_;  // null when --http_listen is off
  // Declared last so it stops first: its scrapes read the registry, scheduler and cluster.
  std::unique_ptr<MetricsServer> metrics_server_;

  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
};

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_SERVER_COORDINATOR_H_

#include "coordinator/server/coordinator.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log/log.h"
#include "common/metrics/metrics_server.h"
#include "common/model_spec/model_spec.h"
#include "common/security/grpc_security.h"
#include "common/tokenizer/tokenizer.h"
#include "coordinator/api/control_service.h"
#include "coordinator/server/coordinator_metrics.h"
#include "coordinator/api/inference_service.h"
#include "coordinator/client/grpc_replica_client.h"
#include "coordinator/client/grpc_worker_client.h"
#include "coordinator/http/http_server.h"
#include "coordinator/frontend/reasoning.h"
#include "coordinator/frontend/tool_calls.h"

namespace shardserve::coordinator {

absl::Status CoordinatorOptions::Validate() const {
  auto bad = [](absl::string_view flag, auto value, absl::string_view want) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, " must be ", want, ", got ", value));
  };
  if (listen.empty()) return absl::InvalidArgumentError("--listen is required (HOST:PORT)");
  if (control_listen.empty()) return absl::InvalidArgumentError("--control_listen is required (HOST:PORT)");
  if (public_plaintext && !security::IsLoopbackAddress(listen)) {
    return absl::InvalidArgumentError("--public_plaintext is only for a loopback --listen (127.0.0.1, ::1, localhost)");
  }
  if (public_plaintext && !http_listen.empty() && !security::IsLoopbackAddress(http_listen)) {
    return absl::InvalidArgumentError(
        "--public_plaintext is only for a loopback --http_listen (127.0.0.1, ::1, localhost)");
  }
  if (model_path.empty()) return absl::InvalidArgumentError("--model is required");
  if (tool_call_parser != "auto" && !frontend::ParseToolCallFormat(tool_call_parser).ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--tool_call_parser must be auto, hermes, llama3_json, openai or glm45, got \"",
                                                   tool_call_parser, "\""));
  }
  if (!reasoning_parser.empty() && !frontend::ParseReasoningFormat(reasoning_parser).ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--reasoning_parser must be deepseek_r1, qwen3, glm45, gpt_oss or empty, got \"",
                                                   reasoning_parser, "\""));
  }
  if (expected_workers < 1) return bad("expected_workers", expected_workers, ">= 1");
  if (tp < 0) return bad("tp", tp, ">= 0");
  if (pp < 0) return bad("pp", pp, ">= 0");
  if (replicas < 0) return bad("replicas", replicas, ">= 0");
  if (max_seq_len < 0) return bad("max_seq_len", max_seq_len, ">= 0");
  if (max_slots < 0) return bad("max_slots", max_slots, ">= 1 (0 = sized from the KV budget)");
  if (kv_block_size < 1 || kv_block_size > 65536) return bad("kv_block_size", kv_block_size, "in [1, 65536]");
  if (max_kv_blocks < 0) return bad("kv_blocks", max_kv_blocks, ">= 0 (0 = what the KV budget holds)");
  if (max_step_tokens < 1) return bad("max_step_tokens", max_step_tokens, ">= 1");
  if (decode_steps_per_call < 0 || decode_steps_per_call > kMaxDecodeStepsPerCall) {
    return bad("decode_steps_per_call", decode_steps_per_call,
               absl::StrCat("in [0, ", kMaxDecodeStepsPerCall, "] (0 = auto)"));
  }
  if (max_queued < 0) return bad("max_queued", max_queued, ">= 0");
  if (pipeline_depth < 0) return bad("pipeline_depth", pipeline_depth, ">= 0");
  if (hidden_wire_dtype != DType::kF32 && hidden_wire_dtype != DType::kBF16) {
    return bad("hidden_wire_dtype", DTypeName(hidden_wire_dtype), "f32 or bf16");
  }
  if (heartbeat_interval <= absl::ZeroDuration()) {
    return bad("heartbeat_interval_ms", absl::FormatDuration(heartbeat_interval), "> 0");
  }
  if (heartbeat_timeout <= heartbeat_interval) {
    return bad("heartbeat_timeout_ms", absl::FormatDuration(heartbeat_timeout), "above --heartbeat_interval_ms");
  }
  if (assign_timeout <= absl::ZeroDuration()) return bad("assign_timeout_ms", absl::FormatDuration(assign_timeout), "> 0");
  if (step_timeout <= absl::ZeroDuration()) return bad("step_timeout_ms", absl::FormatDuration(step_timeout), "> 0");
  if (answer_spin < absl::ZeroDuration() || answer_spin > absl::Milliseconds(100)) {
    return bad("answer_spin_us", absl::FormatDuration(answer_spin), "in [0, 100000]");
  }
  if (answer_poll < absl::ZeroDuration() || answer_poll > absl::Milliseconds(100)) {
    return bad("answer_poll_us", absl::FormatDuration(answer_poll), "in [0, 100000]");
  }
  if (recovery_timeout < absl::ZeroDuration()) {
    return bad("recovery_timeout_ms", absl::FormatDuration(recovery_timeout), ">= 0 (0 = no waiting)");
  }
  if (http_max_body_bytes < 1024) return bad("http_max_body_bytes", http_max_body_bytes, ">= 1024");
  if (absl::Status st = http_limits.Validate("--http_"); !st.ok()) return st;
  return grpc_limits.Validate();
}

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Start(const CoordinatorOptions& options,
                                                                CoordinatorDeps deps) {
  if (absl::Status st = options.Validate(); !st.ok()) return st;
  absl::StatusOr<security::GrpcSecurity> grpc_security =
      security::GrpcSecurity::Create(options.tls, security::Role::kCoordinator);
  if (!grpc_security.ok()) return grpc_security.status();
  const security::GrpcSecurity& sec = *grpc_security;
  const bool public_tls = sec.tls_enabled() && !options.public_plaintext;
  for (const std::string* a : {&options.listen, &options.control_listen, &options.http_listen}) {
    const bool tls = a == &options.control_listen ? sec.tls_enabled() : public_tls;
    if (!a->empty() && !tls && !security::IsLoopbackAddress(*a)) {
      LOG(WARNING) << "*** INSECURE: serving plaintext without authentication on " << *a
                   << ": anyone who reaches it can register workers or use the API. Give --tls_dir (or "
                      "--tls_cert/--tls_key/--tls_ca). ***";
    }
  }
  std::unique_ptr<Coordinator> c(new Coordinator());
  if (!options.api_keys_file.empty()) {
    absl::StatusOr<std::unique_ptr<security::ApiKeys>> keys = security::ApiKeys::Load(options.api_keys_file);
    if (!keys.ok()) return keys.status();
    c->api_keys_ = *std::move(keys);
    LOG(INFO) << "the public API needs an API key (" << c->api_keys_->size() << " key(s) in " << options.api_keys_file
              << ")";
  } else if (!security::IsLoopbackAddress(options.listen)) {
    LOG(WARNING) << "no --api_keys_file: anyone who reaches " << options.listen << " may generate"
                 << (public_tls ? "" : " and call the admin API");
  }
  absl::StatusOr<ModelSpec> spec = LoadModelSpec(options.model_path);
  if (!spec.ok()) return spec.status();
  c->spec_ = std::make_unique<ModelSpec>(*std::move(spec));
  const ModelSpec& model = *c->spec_;
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadTokenizer(options.model_path);
  if (tokenizer.ok()) {
    c->tokenizer_ = *std::move(tokenizer);
    c->constraints_ = std::make_unique<structured::ConstraintCompiler>(structured::VocabularyFromTokenizer(
        *c->tokenizer_, static_cast<int32_t>(std::max<int64_t>(model.vocab_size, c->tokenizer_->vocab_size()))));
  } else if (absl::IsNotFound(tokenizer.status())) {
    LOG(INFO) << options.model_path << " has no tokenizer: only token-id prompts are served";
  } else {
    return tokenizer.status();
  }
  const int64_t max_seq_len = options.max_seq_len > 0 ? options.max_seq_len : model.max_position_embeddings;
  if (max_seq_len > model.max_position_embeddings || max_seq_len < 2) {
    return absl::InvalidArgumentError(absl::StrCat("--max_seq_len must be in [2, ", model.max_position_embeddings,
                                                   "] (max_position_embeddings), got ", max_seq_len));
  }
  // Known before any worker registers: refused at start rather than at every planning attempt.
  if (options.kv_cache == KvCacheFormat::kFp8E4M3 && model.IsMla()) {
    return absl::InvalidArgumentError(
        "--kv_cache_dtype=fp8_e4m3 is not supported for multi-head latent attention (kv_lora_rank > 0, "
        "DeepSeek-V2/V3): its latent cache stays in the checkpoint's dtype; use auto");
  }
  const Clock* clock = deps.clock != nullptr ? deps.clock : RealClock::Get();
  c->metrics_ = std::make_unique<CoordinatorMetrics>();

  c->registry_ = std::make_unique<WorkerRegistry>(
      WorkerRegistry::Options{.heartbeat_interval = options.heartbeat_interval,
                              .heartbeat_timeout = options.heartbeat_timeout},
      clock);
  SchedulerOptions so;
  so.limits = {.vocab_size = model.vocab_size, .max_seq_len = max_seq_len};
  so.max_step_tokens = options.max_step_tokens;
  so.decode_steps_per_call = options.decode_steps_per_call;
  so.overlap_decode_calls = options.overlap_decode_calls;
  so.policy = options.scheduling_policy;
  so.max_queued = options.max_queued;
  so.observer = c->metrics_.get();
  so.recovery_timeout = options.recovery_timeout;
  for (int64_t id : model.eos_token_ids) so.eos_token_ids.push_back(static_cast<int32_t>(id));
  c->scheduler_ = std::make_unique<Scheduler>(so);
  c->worker_client_ = deps.worker_client != nullptr
                          ? std::move(deps.worker_client)
                          : std::make_unique<GrpcWorkerClient>(GrpcWorkerClient::Options{
                                .timeout = options.assign_timeout,
                                .credentials = sec.InternalChannelCredentials(security::Role::kWorker)});
  ReplicaClientFactory factory = deps.replica_factory;
  if (factory == nullptr) {
    factory = [timeout = options.step_timeout, spin = options.answer_spin, poll = options.answer_poll, deltas = options.step_deltas,
               creds = sec.InternalChannelCredentials(security::Role::kWorker)](
                  const ReplicaEndpoint& e) -> absl::StatusOr<std::unique_ptr<ReplicaClient>> {
      // With several stages the last one answers on a return stream of its own (stage.proto).
      std::shared_ptr<grpc::Channel> last;
      if (!e.last_address.empty() && e.last_address != e.stage0_address) {
        last = grpc::CreateChannel(e.last_address, creds);
      }
      return std::make_unique<GrpcReplicaClient>(
          grpc::CreateChannel(e.stage0_address, creds), std::move(last),
          GrpcReplicaClient::Options{
              .address = e.stage0_address, .last_address = e.last_address, .step_timeout = timeout, .answer_spin = spin,
              .answer_poll = poll,
              .step_deltas = deltas});
    };
  }
  ClusterOptions co;
  co.model_path = options.model_path;
  co.expected_workers = options.expected_workers;
  co.policy.tp = options.tp;
  co.policy.pp = options.pp;
  co.policy.replicas = options.replicas;
  co.policy.max_seq_len = max_seq_len;
  co.policy.quantize = options.quantize;
  co.policy.kv_cache = options.kv_cache;
  co.max_slots = options.max_slots;
  co.kv_block_size = options.kv_block_size;
  co.max_kv_blocks = options.max_kv_blocks;
  co.max_step_tokens = options.max_step_tokens;
  co.pipeline_depth = options.pipeline_depth;
  co.prefix_caching = options.prefix_caching;
  co.hidden_wire_dtype = options.hidden_wire_dtype;
  co.admit_while_recovering = options.recovery_timeout > absl::ZeroDuration();
  c->cluster_ = std::make_unique<Cluster>(co, c->spec_.get(), c->registry_.get(), c->scheduler_.get(),
                                          c->worker_client_.get(), std::move(factory), clock);

  c->inference_ = std::make_unique<InferenceService>(
      InferenceServiceOptions{
          .model_path = options.model_path,
          .max_seq_len = max_seq_len,
          .observer = c->metrics_.get(),
          .api_keys = c->api_keys_.get(),
          .constraints = c->constraints_.get(),
          .tool_call_parser = options.tool_call_parser,
          .reasoning_parser = options.reasoning_parser},
      c->spec_.get(), c->tokenizer_.get(), c->scheduler_.get(),
      [cluster = c->cluster_.get()] { return cluster->AdmissionStatus(); });
  c->registry_service_ = std::make_unique<RegistryService>(c->registry_.get(), c->cluster_.get());
  c->admin_ = std::make_unique<AdminService>(options.model_path, c->cluster_.get(), c->scheduler_.get(), clock,
                                             c->api_keys_.get());

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options.listen,
                           public_tls ? sec.PublicServerCredentials() : grpc::InsecureServerCredentials(), &port);
  security::ApplyServerLimits(options.grpc_limits, builder);
  builder.RegisterService(c->inference_.get());
  builder.RegisterService(c->admin_.get());
  c->server_ = builder.BuildAndStart();
  if (c->server_ == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve on --listen=", options.listen));
  }
  c->address_ = absl::StrCat(options.listen.substr(0, options.listen.rfind(':')), ":", port);
  // The control plane on a port of its own: clients of the public API never reach Registry.
  grpc::ServerBuilder control_builder;
  int control_port = 0;
  control_builder.AddListeningPort(options.control_listen, sec.InternalServerCredentials({security::Role::kWorker}),
                                   &control_port);
  // Without max_connection_age's grace: cancelling the calls left on an old connection would cut
  // the workers' heartbeat streams, and a cut stream declares its worker dead.
  security::GrpcServerLimits control_limits = options.grpc_limits;
  control_limits.max_connection_age_grace = absl::ZeroDuration();
  security::ApplyServerLimits(control_limits, control_builder);
  ConfigureControlPort(control_builder);
  control_builder.RegisterService(c->registry_service_.get());
  c->control_server_ = control_builder.BuildAndStart();
  if (c->control_server_ == nullptr || control_port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve on --control_listen=", options.control_listen));
  }
  c->control_address_ =
      absl::StrCat(options.control_listen.substr(0, options.control_listen.rfind(':')), ":", control_port);
  grpc::HealthCheckServiceInterface* health = c->server_->GetHealthCheckService();
  if (health != nullptr) health->SetServingStatus(false);
  c->cluster_->SetReadinessCallback([health](bool ready) {
    if (health != nullptr) health->SetServingStatus(ready);
  });
  if (!options.metrics_listen.empty()) {
    Coordinator* self = c.get();
    absl::StatusOr<std::unique_ptr<MetricsServer>> metrics =
        MetricsServer::Start(
            options.metrics_listen, c->metrics_->registry(),
            [self] {
          ClusterSample sample{.scheduler = self->scheduler_->Stats(),
                               .plans_made = self->cluster_->PlansMade(),
                               .ready = self->cluster_->ReadyStatus().ok()};
          for (const WorkerRecord& w : self->registry_->List()) sample.workers.push_back(w.state);
          self->metrics_->Refresh(sample);
            },
            options.http_limits);
    if (!metrics.ok()) {
      return absl::Status(metrics.status().code(), absl::StrCat("--metrics_listen: ", metrics.status().message()));
    }
    c->metrics_server_ = *std::move(metrics);
    c->metrics_address_ = c->metrics_server_->address();
    LOG(INFO) << "coordinator metrics at " << c->metrics_server_->url();
  }
  if (!options.http_listen.empty()) {
    // The model's name in the HTTP API: the directory's last component ("stories260K").
    const std::string& dir = options.model_path;
    std::string model_id = dir.substr(0, dir.find_last_not_of('/') + 1);
    model_id = model_id.substr(model_id.rfind('/') == std::string::npos ? 0 : model_id.rfind('/') + 1);
    absl::StatusOr<std::unique_ptr<http::HttpServer>> server = http::HttpServer::Start(
        {.listen = options.http_listen,
         .model_id = !options.served_model_name.empty() ? options.served_model_name
                     : model_id.empty()                 ? dir
                                                        : model_id,
         .model_path = dir,
         .max_body_bytes = options.http_max_body_bytes,
         .limits = options.http_limits,
         .observer = c->metrics_.get(),
         .api_keys = c->api_keys_.get(),
         .tls = public_tls ? options.tls : std::nullopt,
         .constraints = c->constraints_.get(),
         .tool_call_parser = options.tool_call_parser,
         .reasoning_parser = options.reasoning_parser},
        c->tokenizer_.get(), c->scheduler_.get(), [cluster = c->cluster_.get()] { return cluster->AdmissionStatus(); });
    if (!server.ok()) return server.status();
    c->http_ = *std::move(server);
  }
  c->cluster_->Start();
  LOG(INFO) << "coordinator serving " << options.model_path << " on " << c->address_ << " (control port "
            << c->control_address_ << ", " << (sec.tls_enabled() ? "TLS" : "plaintext") << "), waiting for "
            << options.expected_workers << " worker(s)";
  return c;
}

Coordinator::~Coordinator() { Shutdown(absl::Seconds(5)); }

std::string Coordinator::http_address() const { return http_ != nullptr ? http_->address() : ""; }

void Coordinator::Shutdown(absl::Duration deadline) {
  {
    absl::MutexLock lock(&shutdown_mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  if (cluster_ != nullptr) cluster_->Stop();
  if (server_ != nullptr && server_->GetHealthCheckService() != nullptr) {
    server_->GetHealthCheckService()->SetServingStatus(false);
  }
  if (scheduler_ != nullptr) scheduler_->Shutdown(absl::UnavailableError("shutting down"));
  if (http_ != nullptr) http_->Stop();  // after the scheduler: requests waiting on it have ended
  if (server_ != nullptr) {
    server_->Shutdown(absl::ToChronoTime(absl::Now() + deadline));
    server_->Wait();
  }
  if (control_server_ != nullptr) {
    control_server_->Shutdown(absl::ToChronoTime(absl::Now() + deadline));
    control_server_->Wait();
  }
}

}  // namespace shardserve::coordinator

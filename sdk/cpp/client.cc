#include "shardserve/client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <set>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "shardserve/v1/control.grpc.pb.h"
#include "shardserve/v1/inference.grpc.pb.h"

namespace shardserve {

struct CancellationToken::State {
  absl::Mutex mu;
  bool cancelled ABSL_GUARDED_BY(mu) = false;
  std::set<grpc::ClientContext*> calls ABSL_GUARDED_BY(mu);  // the calls in flight with this token
};

CancellationToken::CancellationToken() : state_(std::make_shared<State>()) {}

void CancellationToken::Cancel() {
  absl::MutexLock lock(&state_->mu);
  state_->cancelled = true;
  // TryCancel only marks the call; it never calls back into us, so holding the lock is safe.
  for (grpc::ClientContext* ctx : state_->calls) ctx->TryCancel();
}

bool CancellationToken::IsCancelled() const {
  absl::MutexLock lock(&state_->mu);
  return state_->cancelled;
}

namespace {

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  // gRPC's and Abseil's canonical codes have the same numbers.
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

std::string ReasonName(v1::FinishReason r) {
  switch (r) {
    case v1::FINISH_REASON_LENGTH: return "length";
    case v1::FINISH_REASON_STOP: return "stop";
    case v1::FINISH_REASON_CANCELLED: return "cancelled";
    case v1::FINISH_REASON_TOOL_CALLS: return "tool_calls";
    default: return "";  // unset, or a value newer than this client
  }
}

std::string StateName(v1::WorkerState s) {
  std::string name = v1::WorkerState_Name(s);
  const std::string prefix = "WORKER_STATE_";
  if (name.rfind(prefix, 0) == 0) name = name.substr(prefix.size());
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name;
}

// Keeps `ctx` registered with a CancellationToken for the life of a call.
class CallRegistration {
 public:
  CallRegistration(const CancellationToken* token, grpc::ClientContext* ctx)
      : state_(token ? token->StateForClient() : nullptr), ctx_(ctx) {
    if (!state_) return;
    absl::MutexLock lock(&state_->mu);
    cancelled_ = state_->cancelled;
    if (!cancelled_) state_->calls.insert(ctx_);
  }
  ~CallRegistration() {
    if (!state_ || cancelled_) return;
    absl::MutexLock lock(&state_->mu);
    state_->calls.erase(ctx_);
  }
  CallRegistration(const CallRegistration&) = delete;
  CallRegistration& operator=(const CallRegistration&) = delete;

  // True when the token was cancelled before the call started: do not start it.
  bool cancelled_before_start() const { return cancelled_; }

 private:
  std::shared_ptr<CancellationToken::State> state_;
  grpc::ClientContext* ctx_;
  bool cancelled_ = false;
};

absl::Status CancelledBeforeStart() {
  return absl::CancelledError("the call's CancellationToken was cancelled before the call started");
}

// gRPC's duration syntax in service configs: seconds with a fraction, e.g. "0.100s".
std::string GrpcDuration(std::chrono::milliseconds ms) {
  return absl::StrFormat("%d.%03ds", ms.count() / 1000, ms.count() % 1000);
}

// Retry UNAVAILABLE on every method of both services. gRPC retries a call only until the first
// response message arrives (the call is then committed), which is the rule we want for streams.
std::string RetryServiceConfig(const RetryOptions& r) {
  return absl::StrCat(
      R"({"methodConfig":[{"name":[{"service":"shardserve.v1.Inference"},{"service":"shardserve.v1.Admin"}],)",
      R"("retryPolicy":{"maxAttempts":)", r.max_attempts, R"(,"initialBackoff":")", GrpcDuration(r.initial_backoff),
      R"(","maxBackoff":")", GrpcDuration(r.max_backoff), R"(","backoffMultiplier":)",
      absl::StrFormat("%g", r.backoff_multiplier), R"(,"retryableStatusCodes":["UNAVAILABLE"]}}]})");
}

absl::Status ValidateAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  uint32_t port = 0;
  if (address.empty() || colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port == 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("server address \"", address, "\" is not HOST:PORT with a port in 1..65535"));
  }
  return absl::OkStatus();
}

absl::Status ValidateOptions(const ClientOptions& o) {
  if (o.timeout.count() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("ClientOptions.timeout must be > 0 ms, not ", o.timeout.count()));
  }
  const RetryOptions& r = o.retry;
  if (r.max_attempts < 1 || r.max_attempts > 5) {
    return absl::InvalidArgumentError(
        absl::StrCat("ClientOptions.retry.max_attempts must be in 1..5, not ", r.max_attempts));
  }
  if (r.max_resumes < 0 || r.max_resumes > 100) {
    return absl::InvalidArgumentError(
        absl::StrCat("ClientOptions.retry.max_resumes must be in 0..100, not ", r.max_resumes));
  }
  if (r.initial_backoff.count() <= 0 || r.max_backoff < r.initial_backoff) {
    return absl::InvalidArgumentError(absl::StrCat("ClientOptions.retry needs 0 < initial_backoff <= max_backoff, not ",
                                                   r.initial_backoff.count(), " ms and ", r.max_backoff.count(), " ms"));
  }
  if (!(r.backoff_multiplier >= 1.0 && r.backoff_multiplier <= 100.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ClientOptions.retry.backoff_multiplier must be in [1, 100], not ", r.backoff_multiplier));
  }
  if (o.tls.client_cert.empty() != o.tls.client_key.empty()) {
    return absl::InvalidArgumentError("ClientOptions.tls: give both client_cert and client_key, or neither");
  }
  if (!o.tls.enabled && (!o.tls.root_certs.empty() || !o.tls.client_cert.empty() || !o.tls.server_name.empty())) {
    return absl::InvalidArgumentError("ClientOptions.tls has certificates or a server name but tls.enabled is false");
  }
  for (char c : o.bearer_token) {
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError("ClientOptions.bearer_token has a character that is not printable ASCII");
    }
  }
  return absl::OkStatus();
}

GenerateDelta ToDelta(const v1::GenerateResponse& resp) {
  GenerateDelta d;
  d.token_ids.assign(resp.token_ids().begin(), resp.token_ids().end());
  d.text = resp.text();
  d.reasoning_text = resp.reasoning_text();
  d.finished = resp.finish_reason() != v1::FINISH_REASON_UNSPECIFIED;
  d.finish_reason = d.finished ? ReasonName(resp.finish_reason()) : "";
  if (d.finished && d.finish_reason.empty()) d.finish_reason = "unknown";
  d.prompt_tokens = resp.usage().prompt_tokens();
  d.completion_tokens = resp.usage().completion_tokens();
  d.cached_prompt_tokens = resp.usage().cached_prompt_tokens();
  d.request_id = resp.request_id();
  d.index = resp.index();
  for (const v1::ToolCall& c : resp.tool_calls()) {
    d.tool_calls.push_back(ToolCall{.id = c.id(), .name = c.name(), .arguments = c.arguments()});
  }
  for (const v1::TokenLogprobs& lp : resp.logprobs()) {
    d.logprobs.push_back(TokenLogprob{.logprob = lp.logprob(),
                                      .top_ids = {lp.top_ids().begin(), lp.top_ids().end()},
                                      .top_logprobs = {lp.top_logprobs().begin(), lp.top_logprobs().end()}});
  }
  for (const v1::TokenLogprobs& lp : resp.prompt_logprobs()) {
    d.prompt_logprobs.push_back(TokenLogprob{.logprob = lp.logprob(),
                                             .top_ids = {lp.top_ids().begin(), lp.top_ids().end()},
                                             .top_logprobs = {lp.top_logprobs().begin(), lp.top_logprobs().end()}});
  }
  return d;
}

v1::GenerateRequest ToRequest(const Prompt& prompt, const GenerateOptions& o) {
  v1::GenerateRequest req;
  if (prompt.is_chat) {
    v1::ChatMessages* chat = req.mutable_chat();  // selected even when empty: the server names it
    for (const ChatMessage& m : prompt.chat) {
      v1::ChatMessage* out = chat->add_messages();
      out->set_role(m.role);
      out->set_content(m.content);
      out->set_name(m.name);
      for (const ToolCall& c : m.tool_calls) {
        v1::ToolCall* call = out->add_tool_calls();
        call->set_id(c.id);
        call->set_name(c.name);
        call->set_arguments(c.arguments);
      }
      out->set_tool_call_id(m.tool_call_id);
      out->set_reasoning_content(m.reasoning_content);
    }
    chat->set_tools(o.tools);
    switch (o.tool_choice) {
      case ToolChoice::kDefault: break;
      case ToolChoice::kNone: chat->set_tool_choice(v1::TOOL_CHOICE_NONE); break;
      case ToolChoice::kAuto: chat->set_tool_choice(v1::TOOL_CHOICE_AUTO); break;
      case ToolChoice::kRequired: chat->set_tool_choice(v1::TOOL_CHOICE_REQUIRED); break;
      case ToolChoice::kFunction: chat->set_tool_choice(v1::TOOL_CHOICE_FUNCTION); break;
    }
    chat->set_tool_name(o.tool_name);
    chat->set_single_tool_call(o.tool_choice == ToolChoice::kRequired && !o.parallel_tool_calls);
    chat->set_continue_final_message(o.continue_final_message);
    chat->set_template_kwargs(o.chat_template_kwargs);
  } else if (prompt.is_ids) {
    // An empty id list still selects the ids prompt, so the server names the empty prompt.
    req.mutable_token_ids()->mutable_ids()->Add(prompt.ids.begin(), prompt.ids.end());
  } else {
    req.set_text(prompt.text);
  }
  req.set_max_tokens(o.max_tokens);
  req.mutable_sampling()->set_temperature(o.temperature);
  req.mutable_sampling()->set_top_k(o.top_k);
  req.mutable_sampling()->set_top_p(o.top_p);
  req.mutable_sampling()->set_seed(o.seed);
  req.mutable_stop_token_ids()->Add(o.stop_token_ids.begin(), o.stop_token_ids.end());
  req.set_ignore_eos(o.ignore_eos);
  req.set_request_id(o.request_id);
  req.mutable_sampling()->set_min_p(o.min_p);
  for (const auto& [id, bias] : o.logit_bias) (*req.mutable_sampling()->mutable_logit_bias())[id] = bias;
  req.set_min_tokens(o.min_tokens);
  req.set_logprobs(o.logprobs);
  req.set_top_logprobs(o.top_logprobs);
  req.mutable_sampling()->set_presence_penalty(o.presence_penalty);
  req.mutable_sampling()->set_frequency_penalty(o.frequency_penalty);
  req.mutable_sampling()->set_repetition_penalty(o.repetition_penalty);
  req.set_prompt_logprobs(o.prompt_logprobs);
  for (const std::string& s : o.stop) req.add_stop(s);
  req.set_include_stop_str_in_output(o.include_stop_str_in_output);
  req.set_keep_special_tokens(!o.skip_special_tokens);
  req.set_truncate_prompt_tokens(o.truncate_prompt_tokens);
  req.set_priority(o.priority);
  for (int32_t id : o.allowed_token_ids) req.add_allowed_token_ids(id);
  for (const std::string& word : o.bad_words) req.add_bad_words(word);
  if (!o.json_schema.empty()) req.set_json_schema(o.json_schema);
  if (o.json_object) req.set_json_object(true);
  if (!o.regex.empty()) req.set_regex(o.regex);
  req.set_n(o.n);
  return req;
}

// What the calls of one client share (streams keep it alive after the client is gone).
struct Channel {
  Channel(std::shared_ptr<grpc::Channel> channel, ClientOptions o)
      : options(std::move(o)), inference(v1::Inference::NewStub(channel)), admin(v1::Admin::NewStub(channel)) {}

  // Sets the deadline and the bearer token of a call.
  void Prepare(grpc::ClientContext* ctx, const CallOptions& call) const {
    ctx->set_deadline(call.deadline.value_or(std::chrono::system_clock::now() + options.timeout));
    if (!options.bearer_token.empty()) ctx->AddMetadata("authorization", "Bearer " + options.bearer_token);
  }

  // Runs a unary call `fn(ctx)` with the call's deadline, token and cancellation.
  template <typename Fn>
  absl::Status Unary(const CallOptions& call, Fn fn) const {
    grpc::ClientContext ctx;
    Prepare(&ctx, call);
    CallRegistration registration(call.cancellation, &ctx);
    if (registration.cancelled_before_start()) return CancelledBeforeStart();
    return FromGrpc(fn(&ctx));
  }

  const ClientOptions options;
  const std::unique_ptr<v1::Inference::Stub> inference;
  const std::unique_ptr<v1::Admin::Stub> admin;
};

// A Generate call read with the synchronous gRPC API on the caller's thread. When the stream
// breaks with UNAVAILABLE after tokens arrived (n = 1), it resumes: the same request again, with
// the server's request id and the tokens received so far (GenerateRequest.resume), after a backoff,
// at most RetryOptions::max_resumes times in a row without a new token, within the first call's
// deadline. The caller sees each token once. Before any response arrived (gRPC's own retries
// ran out), the request is sent again as it was, under the same limits.
class GrpcGenerateStream final : public GenerateStream {
 public:
  GrpcGenerateStream(std::shared_ptr<const Channel> impl, v1::GenerateRequest request, const CallOptions& call)
      : impl_(std::move(impl)),
        request_(std::move(request)),
        call_{.deadline = call.deadline.value_or(std::chrono::system_clock::now() + impl_->options.timeout),
              .cancellation = call.cancellation} {
    if (!StartCall()) {
      done_ = true;
      status_ = CancelledBeforeStart();
    }
  }

  ~GrpcGenerateStream() override {
    if (done_) return;
    {
      absl::MutexLock lock(&mu_);
      ctx_->TryCancel();
    }
    v1::GenerateResponse ignored;
    while (reader_->Read(&ignored)) {
    }
    reader_->Finish();  // the status of a call we cancelled says nothing new
  }

  std::optional<GenerateDelta> Next() override {
    while (!done_) {
      v1::GenerateResponse resp;
      if (reader_->Read(&resp)) {
        delivered_ = true;
        if (!resp.request_id().empty()) request_id_ = resp.request_id();
        if (resp.token_ids_size() > 0) failed_resumes_ = 0;  // progress
        received_.insert(received_.end(), resp.token_ids().begin(), resp.token_ids().end());
        if (resp.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) finished_ = true;
        return ToDelta(resp);
      }
      const grpc::Status st = reader_->Finish();
      done_ = true;
      if (ShouldResume(st)) {
        if (BackOff()) {
          ++failed_resumes_;
          if (StartCall()) {
            done_ = false;
            continue;
          }
        }
        status_ = absl::CancelledError("the generation was cancelled by the caller while it waited to resume");
      } else if (CancelledByCaller() && st.error_code() == grpc::StatusCode::CANCELLED) {
        status_ = absl::CancelledError("the generation was cancelled by the caller");
      } else {
        status_ = FromGrpc(st);
      }
    }
    return std::nullopt;
  }

  absl::Status status() const override { return status_; }

  void Cancel() override {
    absl::MutexLock lock(&mu_);
    cancelled_by_caller_ = true;
    if (ctx_ != nullptr) ctx_->TryCancel();  // thread-safe in gRPC
  }

 private:
  // A broken stream worth resuming: UNAVAILABLE, not finished, within the limits; after tokens,
  // one choice only. Before anything reached the caller (gRPC's own retries ran out, e.g. while the
  // coordinator restarts) the request is sent again as it was; a response without tokens (prompt
  // logprobs) would come again, so it is not.
  bool ShouldResume(const grpc::Status& st) const {
    if (st.error_code() != grpc::StatusCode::UNAVAILABLE || finished_ ||
        failed_resumes_ >= impl_->options.retry.max_resumes || std::chrono::system_clock::now() >= *call_.deadline) {
      return false;
    }
    return !delivered_ || (!received_.empty() && request_.n() <= 1);
  }

  bool CancelledByCaller() {
    absl::MutexLock lock(&mu_);
    return cancelled_by_caller_;
  }

  // Waits before resume number failed_resumes_ + 1 (exponential, as RetryOptions says, and never
  // past the deadline); false when Cancel came meanwhile.
  bool BackOff() {
    const RetryOptions& r = impl_->options.retry;
    double ms = static_cast<double>(r.initial_backoff.count());
    for (int i = 0; i < failed_resumes_; ++i) ms *= r.backoff_multiplier;
    ms = std::min(ms, static_cast<double>(r.max_backoff.count()));
    const auto until = std::min(*call_.deadline, std::chrono::system_clock::now() +
                                                     std::chrono::milliseconds(static_cast<int64_t>(ms)));
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithDeadline(absl::Condition(&cancelled_by_caller_), absl::FromChrono(until));
    return !cancelled_by_caller_;
  }

  // Starts an attempt: the request, with the tokens received so far when resuming. False when the
  // call's CancellationToken is cancelled.
  bool StartCall() {
    auto ctx = std::make_unique<grpc::ClientContext>();
    impl_->Prepare(ctx.get(), call_);
    auto registration = std::make_unique<CallRegistration>(call_.cancellation, ctx.get());
    if (registration->cancelled_before_start()) return false;
    if (!received_.empty()) {
      if (!request_id_.empty()) request_.set_request_id(request_id_);
      request_.mutable_resume()->mutable_token_ids()->Assign(received_.begin(), received_.end());
    }
    grpc::ClientContext* raw = ctx.get();
    reader_.reset();
    {
      absl::MutexLock lock(&mu_);
      registration_ = std::move(registration);  // unregisters the old context before it goes
      ctx_ = std::move(ctx);
      if (cancelled_by_caller_) ctx_->TryCancel();
    }
    reader_ = impl_->inference->Generate(raw, request_);
    return true;
  }

  const std::shared_ptr<const Channel> impl_;  // keeps the stub alive
  v1::GenerateRequest request_;  // the next attempt's
  const CallOptions call_;       // with the deadline of the first attempt, kept by the others
  std::vector<int32_t> received_;  // every token delivered to the caller
  std::string request_id_;         // the server's
  int failed_resumes_ = 0;         // resumes (or re-sends) in a row without a new token
  bool delivered_ = false;         // a response reached the caller
  bool finished_ = false;          // a finish_reason arrived
  bool done_ = false;
  absl::Status status_;
  absl::Mutex mu_;  // ctx_ and registration_ change on the reading thread; Cancel reads them
  // Declared before reader_ (destroyed after it): gRPC needs the context while the reader lives.
  std::unique_ptr<grpc::ClientContext> ctx_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<CallRegistration> registration_ ABSL_GUARDED_BY(mu_);  // unregisters ctx_
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader_;
  bool cancelled_by_caller_ ABSL_GUARDED_BY(mu_) = false;
};

// The Client of Connect: one gRPC channel, calls on the caller's thread.
class GrpcClient final : public Client {
 public:
  explicit GrpcClient(std::shared_ptr<const Channel> channel) : channel_(std::move(channel)) {}

 protected:
  std::unique_ptr<GenerateStream> DoStartGenerate(const Prompt& prompt, const GenerateOptions& options,
                                                  const CallOptions& call) override {
    return std::make_unique<GrpcGenerateStream>(channel_, ToRequest(prompt, options), call);
  }
  absl::StatusOr<std::vector<int32_t>> DoTokenize(const std::string& text, bool add_special_tokens,
                                                  const CallOptions& call) override;
  absl::StatusOr<ModelInfo> DoGetModelInfo(const CallOptions& call) override;
  absl::StatusOr<ClusterInfo> DoClusterStatus(const CallOptions& call) override;
  absl::Status DoDrainWorker(const std::string& worker_id, std::chrono::milliseconds timeout,
                             const CallOptions& call) override;

 private:
  const std::shared_ptr<const Channel> channel_;
};

absl::StatusOr<std::vector<int32_t>> GrpcClient::DoTokenize(const std::string& text, bool add_special_tokens,
                                                            const CallOptions& call) {
  v1::TokenizeRequest req;
  req.set_text(text);
  req.set_add_special_tokens(add_special_tokens);
  v1::TokenizeResponse resp;
  absl::Status st =
      channel_->Unary(call, [&](grpc::ClientContext* ctx) { return channel_->inference->Tokenize(ctx, req, &resp); });
  if (!st.ok()) return st;
  return std::vector<int32_t>(resp.ids().begin(), resp.ids().end());
}

absl::StatusOr<ModelInfo> GrpcClient::DoGetModelInfo(const CallOptions& call) {
  v1::ModelInfo resp;
  absl::Status st = channel_->Unary(call, [&](grpc::ClientContext* ctx) {
    return channel_->inference->GetModelInfo(ctx, v1::GetModelInfoRequest(), &resp);
  });
  if (!st.ok()) return st;
  ModelInfo info;
  info.model_path = resp.model_path();
  info.architecture = resp.architecture();
  info.vocab_size = resp.vocab_size();
  info.max_position_embeddings = resp.max_position_embeddings();
  info.num_layers = resp.num_layers();
  info.num_parameters = resp.num_parameters();
  info.eos_token_ids.assign(resp.eos_token_ids().begin(), resp.eos_token_ids().end());
  info.has_tokenizer = resp.has_tokenizer();
  return info;
}

absl::Status GrpcClient::DoDrainWorker(const std::string& worker_id, std::chrono::milliseconds timeout,
                                       const CallOptions& call) {
  v1::DrainWorkerRequest req;
  req.set_worker_id(worker_id);
  req.set_timeout_ms(timeout.count());
  v1::DrainWorkerResponse resp;
  return channel_->Unary(call, [&](grpc::ClientContext* ctx) { return channel_->admin->DrainWorker(ctx, req, &resp); });
}

absl::StatusOr<ClusterInfo> GrpcClient::DoClusterStatus(const CallOptions& call) {
  v1::ClusterStatus resp;
  absl::Status st = channel_->Unary(call, [&](grpc::ClientContext* ctx) {
    return channel_->admin->GetClusterStatus(ctx, v1::GetClusterStatusRequest(), &resp);
  });
  if (!st.ok()) return st;
  ClusterInfo info;
  info.ready = resp.ready();
  info.reason = resp.reason();
  info.model_path = resp.model_path();
  info.plan = resp.plan();
  info.running_sequences = resp.running_sequences();
  info.waiting_sequences = resp.waiting_sequences();
  info.total_workers = resp.total_workers();
  info.scheduling_policy = resp.scheduling_policy();
  for (const v1::ReplicaPipelining& p : resp.pipelining()) {
    info.pipelining.push_back(absl::StrCat("replica ", p.replica(), ": ", p.explanation()));
  }
  for (const v1::ReplicaDecodeSteps& d : resp.decode_steps()) {
    info.decode_steps.push_back(absl::StrCat("replica ", d.replica(), ": ", d.explanation()));
  }
  for (const v1::WorkerStatus& w : resp.workers()) {
    WorkerInfo wi{.worker_id = w.worker_id(), .node_name = w.node_name(), .address = w.address(),
                  .state = StateName(w.state()), .error = w.error()};
    wi.metrics_address = w.metrics_address();
    wi.draining = w.draining();
    std::vector<std::string> devs;
    for (const v1::Device& d : w.devices()) {
      devs.push_back(absl::StrCat(d.kind() == v1::DEVICE_KIND_CUDA ? "cuda:" : "cpu:", d.index()));
    }
    wi.devices = absl::StrJoin(devs, ",");
    if (w.has_assignment() && !w.assignment().assignment_id().empty()) {
      const v1::Assignment& a = w.assignment();
      if (a.role() == v1::ASSIGNMENT_ROLE_EXPERT_HOST) {
        // e.g. "experts 0:4,5,6 2:7" (layer:expert ids), for every replica.
        std::map<int32_t, std::vector<int32_t>> by_layer;
        for (const v1::HostedExpert& e : a.hosted_experts()) by_layer[e.layer()].push_back(e.expert());
        std::vector<std::string> parts;
        for (const auto& [layer, experts] : by_layer) parts.push_back(absl::StrCat(layer, ":", absl::StrJoin(experts, ",")));
        wi.assignment = absl::StrCat("experts ", absl::StrJoin(parts, " "));
      } else {
        int64_t remote = 0;
        for (const v1::LayerExperts& le : a.experts()) {
          for (int32_t r : le.ranks()) remote += r < 0 ? 1 : 0;
        }
        wi.assignment = absl::StrCat("replica ", a.replica(), " stage ", a.stage(), "/", a.num_stages(), " layers [",
                                     a.layer_begin(), ", ", a.layer_end(), ")",
                                     remote > 0 ? absl::StrCat(", ", remote, " remote experts") : "");
      }
    }
    info.workers.push_back(std::move(wi));
  }
  return info;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& address, ClientOptions options) {
  if (absl::Status st = ValidateAddress(address); !st.ok()) return st;
  if (absl::Status st = ValidateOptions(options); !st.ok()) return st;
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_ENABLE_RETRIES, options.retry.max_attempts > 1 ? 1 : 0);
  if (options.retry.max_attempts > 1) args.SetServiceConfigJSON(RetryServiceConfig(options.retry));
  // Reconnect soon after a server comes back (gRPC's default backoff grows to two minutes), so
  // that retries and resumes find it.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, static_cast<int>(options.retry.initial_backoff.count()));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, static_cast<int>(options.retry.max_backoff.count()));
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (options.tls.enabled) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls.root_certs;
    ssl.pem_cert_chain = options.tls.client_cert;
    ssl.pem_private_key = options.tls.client_key;
    credentials = grpc::SslCredentials(ssl);
    if (!options.tls.server_name.empty()) args.SetSslTargetNameOverride(options.tls.server_name);
  } else {
    credentials = grpc::InsecureChannelCredentials();
  }
  auto channel = grpc::CreateCustomChannel(address, credentials, args);
  return std::unique_ptr<Client>(new GrpcClient(std::make_shared<Channel>(std::move(channel), std::move(options))));
}

absl::Status Client::GenerateStreaming(const Prompt& prompt, const GenerateOptions& options,
                                       const std::function<bool(const GenerateDelta&)>& on_delta,
                                       const CallOptions& call) {
  std::unique_ptr<GenerateStream> stream = StartGenerate(prompt, options, call);
  while (std::optional<GenerateDelta> d = stream->Next()) {
    if (!on_delta(*d)) {
      stream->Cancel();
      while (stream->Next()) {
      }
      return absl::CancelledError("the generation was cancelled by its callback");
    }
  }
  return stream->status();
}

absl::StatusOr<std::vector<GenerateResult>> Client::GenerateChoices(const Prompt& prompt,
                                                                     const GenerateOptions& options,
                                                                     const CallOptions& call) {
  if (options.n < 1 || options.n > 16) {
    return absl::InvalidArgumentError(absl::StrCat("n must be in [1, 16], got ", options.n));
  }
  std::vector<GenerateResult> results(static_cast<size_t>(options.n));
  std::unique_ptr<GenerateStream> stream = StartGenerate(prompt, options, call);
  for (const GenerateDelta& d : *stream) {
    if (d.index < 0 || d.index >= options.n) {
      stream->Cancel();
      while (stream->Next()) {
      }
      return absl::InternalError(absl::StrCat("the server answered choice ", d.index, " of ", options.n));
    }
    GenerateResult& result = results[static_cast<size_t>(d.index)];
    result.token_ids.insert(result.token_ids.end(), d.token_ids.begin(), d.token_ids.end());
    result.text += d.text;
    result.reasoning_text += d.reasoning_text;
    result.logprobs.insert(result.logprobs.end(), d.logprobs.begin(), d.logprobs.end());
    result.prompt_logprobs.insert(result.prompt_logprobs.end(), d.prompt_logprobs.begin(), d.prompt_logprobs.end());
    result.tool_calls.insert(result.tool_calls.end(), d.tool_calls.begin(), d.tool_calls.end());
    if (!d.request_id.empty()) result.request_id = d.request_id;
    if (d.finished) {
      result.finish_reason = d.finish_reason;
      result.prompt_tokens = d.prompt_tokens;
      result.completion_tokens = d.completion_tokens;
      result.cached_prompt_tokens = d.cached_prompt_tokens;
    }
  }
  if (!stream->status().ok()) return stream->status();
  for (const GenerateResult& result : results) {
    if (result.finish_reason.empty()) {
      return absl::InternalError("the server ended the generation without a finish reason");
    }
  }
  return results;
}

absl::StatusOr<GenerateResult> Client::Generate(const Prompt& prompt, const GenerateOptions& options,
                                                const CallOptions& call) {
  if (options.n != 1) {
    return absl::InvalidArgumentError(absl::StrCat("Generate returns one choice (n = 1, got ", options.n,
                                                   "); use GenerateChoices"));
  }
  absl::StatusOr<std::vector<GenerateResult>> results = GenerateChoices(prompt, options, call);
  if (!results.ok()) return results.status();
  return std::move((*results)[0]);
}

absl::Status Client::DoDrainWorker(const std::string& /*worker_id*/, std::chrono::milliseconds /*timeout*/,
                                   const CallOptions& /*call*/) {
  return absl::UnimplementedError("this client does not drain workers");
}

}  // namespace shardserve

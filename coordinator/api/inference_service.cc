#include "coordinator/api/inference_service.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/log/log.h"
#include "common/status/grpc_raw.h"
#include "coordinator/api/api_auth.h"
#include "common/status/grpc_status.h"
#include "coordinator/api/request_log.h"
#include "coordinator/api/sequence_output.h"
#include "coordinator/api/stop_strings.h"

namespace shardserve::coordinator {
namespace {

v1::FinishReason ToProto(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength: return v1::FINISH_REASON_LENGTH;
    case FinishReason::kStop: return v1::FINISH_REASON_STOP;
    case FinishReason::kCancelled: return v1::FINISH_REASON_CANCELLED;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

// One Generate call's output queue: the SequenceSink the scheduler feeds, and the writer that
// drives the reactor. At most one write is in flight; tokens that arrive meanwhile are merged into
// one pending message. The reactor is used until Finish is called and never after (gRPC deletes it
// in OnDone, which cannot come before Finish).
class GenerateStream final : public SequenceSink {
 public:
  GenerateStream(grpc::ServerWriteReactor<grpc::ByteBuffer>* reactor, Scheduler* scheduler,
                 std::string request_id, std::unique_ptr<StreamDecoder> decoder, std::vector<std::string> stops)
      : reactor_(reactor),
        request_id_(std::move(request_id)),
        canceller_(scheduler),
        text_(std::move(decoder), std::move(stops)) {}

  // The sequence id, once Submit has returned; cancels it now if a cancel came first.
  void Bind(SequenceId id) { canceller_.Bind(id); }

  // The client went away (OnCancel, or a failed write): stop generating.
  void RequestCancel() { canceller_.Cancel(); }  // may call OnEnd on this thread
  // A stop string matched: end the sequence as stopped (logged and counted as such).
  void RequestStop() { canceller_.Cancel(FinishReason::kStop); }

  void OnTokens(absl::Span<const int32_t> tokens, absl::Span<const TokenLogprobs> logprobs) override {
    Action action;
    bool stop_now = false;
    {
      absl::MutexLock lock(&mu_);
      if (text_.stopped()) return;  // a stop string matched; the cancel is on its way
      for (size_t i = 0; i < tokens.size(); ++i) {
        const int32_t id = tokens[i];
        pending_.add_token_ids(id);
        if (i < logprobs.size()) {
          v1::TokenLogprobs* lp = pending_.add_logprobs();
          lp->set_logprob(logprobs[i].logprob);
          lp->mutable_top_ids()->Add(logprobs[i].top_ids.begin(), logprobs[i].top_ids.end());
          lp->mutable_top_logprobs()->Add(logprobs[i].top_logprobs.begin(), logprobs[i].top_logprobs.end());
        }
        if (text_.Add(id, pending_.mutable_text())) {
          stop_now = true;
          break;
        }
      }
      has_pending_ = true;
      action = NextLocked();
    }
    Run(action);
    if (stop_now) RequestStop();  // ends the sequence; OnEnd reports FINISH_REASON_STOP
  }

  void OnEnd(const SequenceEnd& end) override {
    Action action;
    {
      absl::MutexLock lock(&mu_);
      ended_ = true;
      if (text_.stopped() && !broken_) {
        // The sequence was cancelled because a stop string matched: a normal stop for the client.
        pending_.set_finish_reason(v1::FINISH_REASON_STOP);
        pending_.mutable_usage()->set_prompt_tokens(end.prompt_tokens);
        pending_.mutable_usage()->set_completion_tokens(end.completion_tokens);
        pending_.mutable_usage()->set_cached_prompt_tokens(end.cached_prompt_tokens);
        has_pending_ = true;
        final_status_ = grpc::Status::OK;
      } else if (end.status.ok() && end.reason == FinishReason::kCancelled) {
        final_status_ = grpc::Status(grpc::StatusCode::CANCELLED, "the request was cancelled");
        has_pending_ = false;  // nobody is listening
      } else if (end.status.ok()) {
        const FinishReason reason = text_.Finish(pending_.mutable_text()) ? FinishReason::kStop : end.reason;
        pending_.set_finish_reason(ToProto(reason));
        pending_.mutable_usage()->set_prompt_tokens(end.prompt_tokens);
        pending_.mutable_usage()->set_completion_tokens(end.completion_tokens);
        pending_.mutable_usage()->set_cached_prompt_tokens(end.cached_prompt_tokens);
        has_pending_ = true;
        final_status_ = grpc::Status::OK;
      } else {
        final_status_ = ToGrpcStatus(end.status);  // tokens already produced are still sent first
      }
      action = NextLocked();
    }
    Run(action);
  }

  void OnWriteDone(bool ok) {
    Action action;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) broken_ = true;
      action = NextLocked();
    }
    if (!ok) RequestCancel();
    Run(action);
  }

 private:
  enum class Action { kNone, kWrite, kFinish };

  Action NextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing_ || finished_) return Action::kNone;
    if (has_pending_ && !broken_) {
      pending_.set_request_id(request_id_);
      SerializeRawMessage(pending_, &in_flight_);
      pending_.Clear();
      has_pending_ = false;
      writing_ = true;
      return Action::kWrite;
    }
    if (!ended_) return Action::kNone;
    finished_ = true;
    if (broken_ && final_status_.ok()) final_status_ = grpc::Status(grpc::StatusCode::CANCELLED, "write failed");
    return Action::kFinish;
  }

  // Start* outside mu_: gRPC may run a reaction inline.
  void Run(Action action) {
    switch (action) {
      case Action::kNone: return;
      case Action::kWrite: reactor_->StartWrite(&in_flight_); return;
      case Action::kFinish: reactor_->Finish(final_status_); return;  // set before finished_; constant since
    }
  }

  grpc::ServerWriteReactor<grpc::ByteBuffer>* const reactor_;  // valid until Finish
  const std::string request_id_;
  SequenceCanceller canceller_;

  absl::Mutex mu_;
  SequenceText text_ ABSL_GUARDED_BY(mu_);  // the decoder and the text stop strings
  v1::GenerateResponse pending_ ABSL_GUARDED_BY(mu_);
  bool has_pending_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ByteBuffer in_flight_;  // a serialized v1::GenerateResponse, filled under mu_ when no write is in flight; then read by gRPC
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status final_status_;  // written under mu_ before finished_ is set, read once after
};

class GenerateReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  void set_stream(std::shared_ptr<GenerateStream> stream) { stream_ = std::move(stream); }
  void set_lease(std::shared_ptr<security::ApiKeys::Lease> lease) { lease_ = std::move(lease); }
  void OnWriteDone(bool ok) override { stream_->OnWriteDone(ok); }
  void OnCancel() override {
    if (stream_ != nullptr) stream_->RequestCancel();
  }
  void OnDone() override { delete this; }  // gRPC is done with the call; the stream may live on briefly

 private:
  std::shared_ptr<GenerateStream> stream_;  // set before the handler returns
  std::shared_ptr<security::ApiKeys::Lease> lease_;  // the caller's API-key admission, until OnDone
};

}  // namespace

InferenceService::InferenceService(InferenceServiceOptions options, const ModelSpec* spec, const Tokenizer* tokenizer,
                                   Scheduler* scheduler, const Cluster* cluster)
    : options_(std::move(options)), spec_(spec), tokenizer_(tokenizer), scheduler_(scheduler), cluster_(cluster) {}

absl::StatusOr<SequenceRequest> InferenceService::Convert(const v1::GenerateRequest& request) const {
  SequenceRequest r;
  switch (request.prompt_case()) {
    case v1::GenerateRequest::kText: {
      if (tokenizer_ == nullptr) {
        return absl::InvalidArgumentError("prompt.text: model has no tokenizer; send prompt.token_ids instead");
      }
      if (request.text().empty()) return absl::InvalidArgumentError("prompt is empty (prompt.text)");
      absl::StatusOr<std::vector<int32_t>> ids = tokenizer_->Encode(request.text(), /*add_special_tokens=*/true);
      if (!ids.ok()) return absl::InvalidArgumentError(absl::StrCat("prompt.text: ", ids.status().message()));
      r.prompt = *std::move(ids);
      break;
    }
    case v1::GenerateRequest::kTokenIds:
      r.prompt.assign(request.token_ids().ids().begin(), request.token_ids().ids().end());
      break;
    case v1::GenerateRequest::PROMPT_NOT_SET:
      return absl::InvalidArgumentError("prompt is empty: set prompt.text or prompt.token_ids");
  }
  r.max_tokens = request.max_tokens();
  r.sampling = {.temperature = request.sampling().temperature(),
                .top_k = request.sampling().top_k(),
                .top_p = request.sampling().top_p() == 0.0f ? 1.0f : request.sampling().top_p(),
                .seed = request.sampling().seed(),
                .min_p = request.sampling().min_p()};
  for (const auto& [id, bias] : request.sampling().logit_bias()) r.sampling.logit_bias.emplace_back(id, bias);
  std::sort(r.sampling.logit_bias.begin(), r.sampling.logit_bias.end());
  r.stop_token_ids.assign(request.stop_token_ids().begin(), request.stop_token_ids().end());
  r.ignore_eos = request.ignore_eos();
  r.min_tokens = request.min_tokens();
  r.logprobs = request.logprobs();
  r.top_logprobs = request.top_logprobs();
  if (request.constraint_case() != v1::GenerateRequest::CONSTRAINT_NOT_SET) {
    structured::ConstraintSpec spec;
    std::string field;
    switch (request.constraint_case()) {
      case v1::GenerateRequest::kJsonSchema:
        spec = {structured::ConstraintKind::kJsonSchema, request.json_schema()};
        field = "json_schema";
        break;
      case v1::GenerateRequest::kJsonObject:
        if (!request.json_object()) return absl::InvalidArgumentError("json_object: must be true when set");
        spec = {structured::ConstraintKind::kJsonObject, ""};
        field = "json_object";
        break;
      case v1::GenerateRequest::kRegex:
        spec = {structured::ConstraintKind::kRegex, request.regex()};
        field = "regex";
        break;
      case v1::GenerateRequest::CONSTRAINT_NOT_SET:
        break;
    }
    if (options_.constraints == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": structured output needs a model with a tokenizer"));
    }
    absl::StatusOr<std::shared_ptr<const TokenConstraint>> c = options_.constraints->Compile(spec);
    if (!c.ok()) return absl::InvalidArgumentError(absl::StrCat(field, ": ", c.status().message()));
    r.constraint = *std::move(c);
  }
  if (request.stop_size() > 0) {
    if (tokenizer_ == nullptr) return absl::InvalidArgumentError("stop: model has no tokenizer, so text stop strings cannot be matched");
    const std::vector<std::string> stops(request.stop().begin(), request.stop().end());
    if (absl::Status st = ValidateStopStrings(stops, "stop"); !st.ok()) return st;
  }
  r.request_id = request.request_id().empty() ? absl::StrCat("req-", next_request_.fetch_add(1))
                                              : request.request_id();
  const absl::Status valid =
      ValidateSequenceRequest(r, {.vocab_size = spec_->vocab_size, .max_seq_len = options_.max_seq_len});
  if (!valid.ok()) return valid;
  return r;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* InferenceService::Generate(grpc::CallbackServerContext* ctx,
                                                                       const grpc::ByteBuffer* raw_request) {
  auto* reactor = new GenerateReactor();
  v1::GenerateRequest parsed;
  if (grpc::Status st = ParseRawRequest(*raw_request, &parsed); !st.ok()) {
    ReportRejected(options_.observer, FromGrpcStatus(st));
    reactor->Finish(st);
    return reactor;
  }
  const v1::GenerateRequest* request = &parsed;
  absl::StatusOr<std::shared_ptr<security::ApiKeys::Lease>> lease =
      AdmitCall(options_.api_keys, *ctx, security::ApiRole::kUser);
  if (!lease.ok()) {
    ReportRejected(options_.observer, lease.status());
    reactor->Finish(ToGrpcStatus(lease.status()));
    return reactor;
  }
  reactor->set_lease(*std::move(lease));
  absl::StatusOr<SequenceRequest> seq = Convert(*request);
  if (seq.ok()) {
    if (absl::Status ready = cluster_->ReadyStatus(); !ready.ok()) seq = ready;
  }
  if (!seq.ok()) {
    ReportRejected(options_.observer, seq.status());
    reactor->Finish(ToGrpcStatus(seq.status()));
    return reactor;
  }
  std::unique_ptr<StreamDecoder> decoder;
  if (tokenizer_ != nullptr) decoder = tokenizer_->NewStreamDecoder(/*skip_special_tokens=*/true);
  const std::string request_id = seq->request_id;
  auto stream = std::make_shared<GenerateStream>(reactor, scheduler_, request_id, std::move(decoder),
                                                 std::vector<std::string>(request->stop().begin(), request->stop().end()));
  reactor->set_stream(stream);
  absl::StatusOr<SequenceId> id = SubmitWithLog(*scheduler_, *std::move(seq), stream);
  if (!id.ok()) {
    reactor->Finish(ToGrpcStatus(id.status()));
    return reactor;
  }
  stream->Bind(*id);
  return reactor;
}

grpc::ServerUnaryReactor* InferenceService::Tokenize(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                                     grpc::ByteBuffer* response) {
  return RawUnary<v1::TokenizeRequest, v1::TokenizeResponse>(
      ctx, request, response,
      [&](const v1::TokenizeRequest& req, v1::TokenizeResponse* resp) { return DoTokenize(ctx, req, resp); });
}

grpc::ServerUnaryReactor* InferenceService::GetModelInfo(grpc::CallbackServerContext* ctx,
                                                         const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return RawUnary<v1::GetModelInfoRequest, v1::ModelInfo>(
      ctx, request, response,
      [&](const v1::GetModelInfoRequest& /*req*/, v1::ModelInfo* resp) { return DoGetModelInfo(ctx, resp); });
}

grpc::Status InferenceService::DoTokenize(grpc::CallbackServerContext* ctx, const v1::TokenizeRequest& request,
                                          v1::TokenizeResponse* response) {
  auto lease = AdmitCall(options_.api_keys, *ctx, security::ApiRole::kUser);
  if (!lease.ok()) return ToGrpcStatus(lease.status());
  if (tokenizer_ == nullptr) return ToGrpcStatus(absl::InvalidArgumentError("model has no tokenizer"));
  absl::StatusOr<std::vector<int32_t>> ids = tokenizer_->Encode(request.text(), request.add_special_tokens());
  if (!ids.ok()) return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat("text: ", ids.status().message())));
  response->mutable_ids()->Add(ids->begin(), ids->end());
  return grpc::Status::OK;
}

grpc::Status InferenceService::DoGetModelInfo(grpc::CallbackServerContext* ctx, v1::ModelInfo* response) {
  auto lease = AdmitCall(options_.api_keys, *ctx, security::ApiRole::kUser);
  if (!lease.ok()) return ToGrpcStatus(lease.status());
  response->set_model_path(options_.model_path);
  response->set_architecture(std::string(ArchitectureName(spec_->arch)));
  response->set_vocab_size(spec_->vocab_size);
  response->set_max_position_embeddings(options_.max_seq_len);
  response->set_num_layers(spec_->num_layers);
  response->set_num_parameters(spec_->NumParameters());
  for (int64_t id : spec_->eos_token_ids) response->add_eos_token_ids(static_cast<int32_t>(id));
  response->set_has_tokenizer(tokenizer_ != nullptr);
  return grpc::Status::OK;
}

}  // namespace shardserve::coordinator

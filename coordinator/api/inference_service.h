// InferenceService: the public API (proto/shardserve/v1/inference.proto) on the callback API.
//
// Generate: the handler parses the request into a frontend::AdmissionRequest (GenerateRequest's
// own rules: a prompt is set, 0 means unset), and frontend::Admission validates it
// (INVALID_ARGUMENT naming the field as this API spells it), tokenizes or renders the prompt,
// checks that the cluster takes requests (Cluster::AdmissionStatus: UNAVAILABLE with the reason)
// and replays a resume; the handler then submits the sequences to the Scheduler
// (RESOURCE_EXHAUSTED when the queue is full). From then on the scheduler's threads push tokens
// into the call's own small queue (GenerateStream, with one SequenceSink per choice of
// GenerateRequest.n, submitted through ChoiceGroup), which coalesces them
// into at most one pending message per choice while a write is in flight; OnWriteDone starts the
// next write, the choices taking turns. Text deltas come from the tokenizer's StreamDecoder, through a
// StopStringMatcher for the request's text stop strings: a match truncates the text, cancels the
// sequence in the scheduler and ends the call with FINISH_REASON_STOP. With a reasoning parser,
// a chat answer the model writes freely (AdmittedRequest::reasoning) is split as it streams into
// reasoning_text and text (frontend::ReasoningStreamer), and tool calls are parsed from the
// content alone. The last message carries finish_reason, usage and the parsed tool calls. A
// client that cancels, disconnects or passes its deadline (OnCancel, or a failed write) cancels
// its sequence, which frees its slot; the call finishes once the scheduler has ended the
// sequence. No reaction blocks.
// A resume (GenerateRequest.resume, n = 1) keeps no state here: its tokens go through the
// choice's text (decoder and stop strings) unsent, so that the text that follows is the unbroken
// stream's, and to the scheduler as SequenceRequest::resumed; when they already end the request
// (ReplayResumed, or a stop string in their text) the final message goes out at once and nothing
// is submitted.
//
// Tokenize and GetModelInfo answer from constant data.
#ifndef SHARDSERVE_COORDINATOR_API_INFERENCE_SERVICE_H_
#define SHARDSERVE_COORDINATOR_API_INFERENCE_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "common/model_spec/model_spec.h"
#include "common/tokenizer/tokenizer.h"
#include "common/security/api_keys.h"
#include "coordinator/scheduler/scheduler.h"
#include "coordinator/scheduler/scheduler_observer.h"
#include "coordinator/structured/grammar.h"
#include "shardserve/v1/inference.grpc.pb.h"

namespace shardserve::coordinator {
namespace frontend {
class Admission;
}  // namespace frontend

struct InferenceServiceOptions {
  std::string model_path;
  int64_t max_seq_len = 0;  // the context served (resolved)
  // Told of the requests the service refuses before the scheduler sees them (borrowed; may be
  // null; must outlive the service). The scheduler reports its own refusals.
  SchedulerObserver* observer = nullptr;
  // API keys (borrowed, may be null = none): every call needs a key with the user role (api_auth.h).
  security::ApiKeys* api_keys = nullptr;
  // Compiles GenerateRequest.constraint (borrowed, may be null: structured output is then refused
  // with INVALID_ARGUMENT; must outlive the service).
  structured::ConstraintCompiler* constraints = nullptr;
  // How the model writes tool calls: "hermes", "llama3_json", "openai", "glm45" or "auto" (from the chat template);
  // see coordinator/frontend/tool_calls.h. An unknown name is read as auto.
  std::string tool_call_parser = "auto";
  // A reasoning model's format (--reasoning_parser: "deepseek_r1", "qwen3" or "gpt_oss";
  // coordinator/frontend/reasoning.h): chat answers the model writes freely come back split into
  // GenerateResponse.reasoning_text and text. "" (or an unknown name) leaves them whole, except
  // for a harmony chat template (GPT-OSS), whose channels are always read.
  std::string reasoning_parser;
};

// Raw (bytes) methods, parsed by the service: a request that is not a message is INVALID_ARGUMENT
// (common/status/grpc_raw.h), where gRPC's typed handlers would answer UNIMPLEMENTED.
using InferenceBase = v1::Inference::WithRawCallbackMethod_Generate<v1::Inference::WithRawCallbackMethod_Tokenize<
    v1::Inference::WithRawCallbackMethod_GetModelInfo<v1::Inference::CallbackService>>>;

class InferenceService final : public InferenceBase {
 public:
  // Borrows everything; all must outlive the service (and every call it serves: shut the gRPC
  // server down first). `tokenizer` may be null (the model has none). `ready` says whether the
  // cluster takes requests (Cluster::AdmissionStatus: OK, or UNAVAILABLE with the reason); it is
  // asked on gRPC threads, after a request is found valid.
  InferenceService(InferenceServiceOptions options, const ModelSpec* spec, const Tokenizer* tokenizer,
                   Scheduler* scheduler, std::function<absl::Status()> ready);
  ~InferenceService() override;

  using InferenceBase::Generate;
  using InferenceBase::GetModelInfo;
  using InferenceBase::Tokenize;
  // Streams v1::GenerateResponse messages (serialized by the service).
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Generate(grpc::CallbackServerContext* ctx,
                                                       const grpc::ByteBuffer* request) override;
  // INVALID_ARGUMENT "model has no tokenizer", or the tokenizer's own error (e.g. invalid UTF-8).
  grpc::ServerUnaryReactor* Tokenize(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;

 private:
  grpc::Status DoTokenize(grpc::CallbackServerContext* ctx, const v1::TokenizeRequest& request,
                          v1::TokenizeResponse* response);
  grpc::Status DoGetModelInfo(grpc::CallbackServerContext* ctx, v1::ModelInfo* response);

  const InferenceServiceOptions options_;
  const ModelSpec* const spec_;
  const Tokenizer* const tokenizer_;
  Scheduler* const scheduler_;
  // GenerateRequest -> the scheduler's request, once parsed (frontend/admission.h); asks `ready`
  // whether the cluster takes requests.
  const std::unique_ptr<frontend::Admission> admission_;
  std::atomic<uint64_t> next_request_ = 1;  // for request ids the server makes
};

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_API_INFERENCE_SERVICE_H_

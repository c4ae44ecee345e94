#include "coordinator/api/inference_service.h"

#include <algorithm>
#include <functional>
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
#include "coordinator/frontend/admission.h"
#include "coordinator/frontend/chat_prompt.h"
#include "coordinator/frontend/choices.h"
#include "coordinator/frontend/reasoning.h"
#include "coordinator/frontend/request_log.h"
#include "coordinator/frontend/sequence_output.h"
#include "coordinator/frontend/tool_calls.h"

namespace shardserve::coordinator {
namespace {

using frontend::ChoiceCanceller;
using frontend::ChoiceGroup;
using frontend::ReportRejected;
using frontend::SequenceText;

v1::FinishReason ToProto(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength: return v1::FINISH_REASON_LENGTH;
    case FinishReason::kStop: return v1::FINISH_REASON_STOP;
    case FinishReason::kCancelled: return v1::FINISH_REASON_CANCELLED;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

// One Generate call's output queue: the SequenceSinks the scheduler feeds (one per choice), and
// the writer that drives the reactor. At most one write is in flight; tokens that arrive
// meanwhile are merged into one pending message per choice, and the choices take turns. The
// reactor is used until Finish is called and never after (gRPC deletes it in OnDone, which cannot
// come before Finish).
class GenerateStream final : public std::enable_shared_from_this<GenerateStream> {
 public:
  // `admitted` gives the choices (n), their text stop strings, the format in which tool calls are
  // parsed from each choice's content (none: not parsed), and whether each choice's text is split
  // into reasoning and content first (none: not split).
  GenerateStream(grpc::ServerWriteReactor<grpc::ByteBuffer>* reactor, const frontend::AdmittedRequest& admitted,
                 const std::function<std::unique_ptr<StreamDecoder>()>& new_decoder)
      : reactor_(reactor),
        request_id_(admitted.sequence.request_id),
        num_choices_(static_cast<size_t>(admitted.n)),
        tools_(admitted.tool_calls),
        tool_functions_(admitted.tools) {
    for (int i = 0; i < admitted.n; ++i) {
      Choice& c = choices_.emplace_back(new_decoder(), admitted.stop, admitted.include_stop);
      if (admitted.reasoning.has_value()) c.reasoning.emplace(*admitted.reasoning, admitted.harmony_opened);
    }
  }

  // One SequenceSink per choice, for ChoiceGroup::Submit.
  std::vector<std::shared_ptr<SequenceSink>> Sinks() {
    std::vector<std::shared_ptr<SequenceSink>> sinks;
    for (size_t i = 0; i < num_choices_; ++i) sinks.push_back(std::make_shared<ChoiceSink>(shared_from_this(), i));
    return sinks;
  }
  // The submitted choices, to cancel them.
  void Bind(std::shared_ptr<ChoiceGroup> group) { canceller_.Bind(std::move(group)); }

  // Resume (n = 1): feeds the tokens the client already has through choice 0's text, so that the
  // text sent from now on is what the unbroken stream would have sent after them. Before Sinks.
  void Replay(absl::Span<const int32_t> tokens) {
    absl::MutexLock lock(&mu_);
    Choice& c = choices_[0];
    std::string text;  // the client has it already
    for (int32_t token : tokens) {
      if (c.text.Add(token, &text)) break;
    }
    // Only the split's state and the content for the calls are kept: the client has both parts.
    if (!c.reasoning.has_value()) {
      if (tools_.has_value()) c.all_text.append(text);
      return;
    }
    const frontend::ReasoningSplit split = c.reasoning->Add(text);
    if (tools_.has_value()) c.all_text.append(split.content);
  }
  // Whether a stop string matched in the replayed tokens' text.
  bool ReplayStopped() {
    absl::MutexLock lock(&mu_);
    return choices_[0].text.stopped();
  }
  // Ends choice 0 without submitting it (its resumed tokens already end it): the final message.
  void EndWithoutSubmitting(const SequenceEnd& end) { OnEnd(0, end); }

  // The client went away (OnCancel, or a failed write): stop generating every choice.
  void RequestCancel() { canceller_.CancelAll(); }  // may call OnEnd on this thread

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
  struct Choice {
    Choice(std::unique_ptr<StreamDecoder> decoder, std::vector<std::string> stops, bool include_stop)
        : text(std::move(decoder), std::move(stops), include_stop) {}
    SequenceText text;  // the decoder and the text stop strings
    // With a reasoning split: the text's next part goes to pending.reasoning_text or pending.text.
    std::optional<frontend::ReasoningStreamer> reasoning;
    v1::GenerateResponse pending;
    bool has_pending = false;
    bool ended = false;
    grpc::Status status;  // how it ended
    std::string all_text;  // with tools_: the whole content, parsed for calls at the end
    std::string piece;     // with a reasoning split: one delivery's text, before the split
    // Tokens delivered after the one that completed a stop string (several decode steps per call
    // deliver them together): not returned, and not counted in the usage.
    int32_t past_stop = 0;
  };

  class ChoiceSink final : public SequenceSink {
   public:
    ChoiceSink(std::shared_ptr<GenerateStream> stream, size_t index) : stream_(std::move(stream)), index_(index) {}
    void OnPromptLogprobs(absl::Span<const TokenLogprobs> logprobs) override {
      stream_->OnPromptLogprobs(index_, logprobs);
    }
    void OnTokens(absl::Span<const int32_t> tokens, absl::Span<const TokenLogprobs> logprobs) override {
      stream_->OnTokens(index_, tokens, logprobs);
    }
    void OnEnd(const SequenceEnd& end) override { stream_->OnEnd(index_, end); }

   private:
    const std::shared_ptr<GenerateStream> stream_;
    const size_t index_;
  };

  static void AddLogprobs(const TokenLogprobs& l, v1::TokenLogprobs* lp) {
    lp->set_logprob(l.logprob);
    lp->mutable_top_ids()->Add(l.top_ids.begin(), l.top_ids.end());
    lp->mutable_top_logprobs()->Add(l.top_logprobs.begin(), l.top_logprobs.end());
  }

  // The choice's next piece of text, into `out`'s reasoning_text or text (through the reasoning
  // split, when there is one), and its content into all_text for the calls.
  void AppendText(Choice& c, absl::string_view text, v1::GenerateResponse& out) const {
    if (text.empty()) return;
    if (!c.reasoning.has_value()) {
      absl::StrAppend(out.mutable_text(), text);
      if (tools_.has_value()) absl::StrAppend(&c.all_text, text);
      return;
    }
    AppendSplit(c, c.reasoning->Add(text), out);
  }
  void AppendSplit(Choice& c, const frontend::ReasoningSplit& split, v1::GenerateResponse& out) const {
    out.mutable_reasoning_text()->append(split.reasoning);
    out.mutable_text()->append(split.content);
    if (tools_.has_value()) c.all_text.append(split.content);
  }
  // The end of a choice's text: what the reasoning split held back, then the calls parsed from the
  // whole content (FINISH_REASON_TOOL_CALLS when the choice stopped and made some).
  void FinishText(Choice& c, size_t index) const {
    if (c.reasoning.has_value()) AppendSplit(c, c.reasoning->Finish(), c.pending);
    if (!tools_.has_value()) return;
    const frontend::ParsedOutput parsed = frontend::ParseToolCalls(*tools_, c.all_text, tool_functions_);
    for (size_t k = 0; k < parsed.calls.size(); ++k) {
      v1::ToolCall* call = c.pending.add_tool_calls();
      call->set_id(absl::StrCat("call_", request_id_, "_", index, "_", k));
      call->set_name(parsed.calls[k].name);
      call->set_arguments(parsed.calls[k].arguments);
    }
    if (!parsed.calls.empty() && c.pending.finish_reason() == v1::FINISH_REASON_STOP) {
      c.pending.set_finish_reason(v1::FINISH_REASON_TOOL_CALLS);
    }
  }

  void OnPromptLogprobs(size_t index, absl::Span<const TokenLogprobs> logprobs) {
    Action action;
    {
      absl::MutexLock lock(&mu_);
      Choice& c = choices_[index];
      for (const TokenLogprobs& l : logprobs) AddLogprobs(l, c.pending.add_prompt_logprobs());
      c.has_pending = true;
      action = NextLocked();
    }
    Run(action);
  }

  void OnTokens(size_t index, absl::Span<const int32_t> tokens, absl::Span<const TokenLogprobs> logprobs) {
    Action action;
    bool stop_now = false;
    {
      absl::MutexLock lock(&mu_);
      Choice& c = choices_[index];
      if (c.text.stopped()) {  // a stop string matched; the cancel is on its way
        c.past_stop += static_cast<int32_t>(tokens.size());
        return;
      }
      // Without a reasoning split the text is decoded straight into the pending message; with one,
      // into the choice's scratch string first, which the split then divides.
      std::string* text = c.reasoning.has_value() ? &c.piece : c.pending.mutable_text();
      const size_t from = text->size();
      for (size_t i = 0; i < tokens.size(); ++i) {
        c.pending.add_token_ids(tokens[i]);
        if (i < logprobs.size()) AddLogprobs(logprobs[i], c.pending.add_logprobs());
        if (c.text.Add(tokens[i], text)) {
          stop_now = true;
          c.past_stop += static_cast<int32_t>(tokens.size() - i - 1);
          break;
        }
      }
      if (c.reasoning.has_value()) {
        AppendSplit(c, c.reasoning->Add(c.piece), c.pending);
        c.piece.clear();  // keeps its capacity for the next delivery
      } else if (tools_.has_value()) {
        c.all_text.append(*text, from);
      }
      c.has_pending = true;
      action = NextLocked();
    }
    Run(action);
    // A stop string matched: end the choice as stopped (logged and counted as such); OnEnd then
    // reports FINISH_REASON_STOP.
    if (stop_now) canceller_.Stop(index);
  }

  void OnEnd(size_t index, const SequenceEnd& end) {
    Action action;
    {
      absl::MutexLock lock(&mu_);
      Choice& c = choices_[index];
      c.ended = true;
      auto finish = [&](FinishReason reason) {
        c.pending.set_finish_reason(ToProto(reason));
        c.pending.mutable_usage()->set_prompt_tokens(end.prompt_tokens);
        c.pending.mutable_usage()->set_completion_tokens(end.completion_tokens -
                                                         (c.text.stopped() ? std::min(c.past_stop, end.completion_tokens) : 0));
        c.pending.mutable_usage()->set_cached_prompt_tokens(end.cached_prompt_tokens);
        c.has_pending = true;
      };
      if (c.text.stopped() && !broken_) {
        finish(FinishReason::kStop);  // cancelled because a stop string matched: a normal stop
        FinishText(c, index);
      } else if (end.status.ok() && end.reason == FinishReason::kCancelled) {
        c.status = grpc::Status(grpc::StatusCode::CANCELLED, "the request was cancelled");
        c.has_pending = false;  // nobody is listening
      } else if (end.status.ok()) {
        std::string tail;
        const bool stopped = c.text.Finish(&tail);
        AppendText(c, tail, c.pending);
        finish(stopped ? FinishReason::kStop : end.reason);
        FinishText(c, index);
      } else {
        c.status = ToGrpcStatus(end.status);  // tokens already produced are still sent first
      }
      action = NextLocked();
    }
    Run(action);
  }

  enum class Action { kNone, kWrite, kFinish };

  Action NextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing_ || finished_) return Action::kNone;
    if (!broken_) {
      // The choices take turns, starting after the last one written.
      for (size_t k = 0; k < choices_.size(); ++k) {
        const size_t i = (next_ + k) % choices_.size();
        Choice& c = choices_[i];
        if (!c.has_pending) continue;
        c.pending.set_request_id(request_id_);
        if (choices_.size() > 1) c.pending.set_index(static_cast<int32_t>(i));
        SerializeRawMessage(c.pending, &in_flight_);
        c.pending.Clear();
        c.has_pending = false;
        next_ = i + 1;
        writing_ = true;
        return Action::kWrite;
      }
    }
    for (const Choice& c : choices_) {
      if (!c.ended) return Action::kNone;
    }
    finished_ = true;
    // The first failed choice's error; else cancelled when one was; else OK.
    final_status_ = grpc::Status::OK;
    for (const Choice& c : choices_) {
      if (!c.status.ok() && c.status.error_code() != grpc::StatusCode::CANCELLED) {
        final_status_ = c.status;
        break;
      }
      if (!c.status.ok() && final_status_.ok()) final_status_ = c.status;
    }
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
  const size_t num_choices_;  // choices_.size(), fixed at construction
  const std::optional<frontend::ToolCallFormat> tools_;
  const std::vector<frontend::ToolFunction> tool_functions_;  // the request's tools (kGlm45's argument types)

  absl::Mutex mu_;
  std::vector<Choice> choices_ ABSL_GUARDED_BY(mu_);  // fixed size
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;              // the choice whose turn it is to be written
  ChoiceCanceller canceller_;
  grpc::ByteBuffer in_flight_;  // a serialized v1::GenerateResponse, filled under mu_ when no write is in flight; then read by gRPC
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
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

// GenerateRequest.chat as admission takes it (the tools arrive as JSON text).
absl::StatusOr<frontend::ChatInput> ChatFromProto(const v1::ChatMessages& chat) {
  // JSON text nested too deeply is refused before it is parsed.
  for (const auto& [field, text] : {std::pair<const char*, const std::string*>{"tools", &chat.tools()},
                                    {"template_kwargs", &chat.template_kwargs()}}) {
    if (frontend::JsonNestingDepth(*text) > frontend::kMaxJsonDepth) {
      return absl::InvalidArgumentError(absl::StrCat("prompt.chat.", field, ": nests more than ",
                                                     frontend::kMaxJsonDepth, " levels of arrays and objects"));
    }
  }
  frontend::ChatInput in;
  for (const v1::ChatMessage& m : chat.messages()) {
    frontend::ChatTurn& turn = in.turns.emplace_back(frontend::ChatTurn{.role = m.role(), .content = m.content()});
    if (!m.name().empty()) turn.name = m.name();
    if (!m.tool_call_id().empty()) turn.tool_call_id = m.tool_call_id();
    if (!m.reasoning_content().empty()) turn.reasoning = m.reasoning_content();
    for (const v1::ToolCall& call : m.tool_calls()) {
      nlohmann::ordered_json c;
      c["id"] = call.id();
      c["type"] = "function";
      c["function"] = {{"name", call.name()}, {"arguments", call.arguments()}};
      turn.tool_calls.push_back(std::move(c));
    }
  }
  if (!chat.tools().empty()) {
    in.tools = nlohmann::ordered_json::parse(chat.tools(), nullptr, /*allow_exceptions=*/false);
    if (!in.tools.is_array()) {
      return absl::InvalidArgumentError("prompt.chat.tools: must be the JSON text of an array of tools");
    }
    for (size_t i = 0; i < in.tools.size(); ++i) {
      absl::StatusOr<frontend::ToolFunction> f =
          frontend::ParseToolDefinition(in.tools[i], absl::StrCat("prompt.chat.tools[", i, "]"));
      if (!f.ok()) return f.status();
      in.functions.push_back(*std::move(f));
    }
    if (in.tools.empty()) in.tools = nullptr;
  }
  const v1::ToolChoice choice = chat.tool_choice();
  if (choice == v1::TOOL_CHOICE_UNSPECIFIED) {
    in.tool_choice = in.tools.is_null() ? frontend::ToolChoice::kNone : frontend::ToolChoice::kAuto;
  } else if (choice == v1::TOOL_CHOICE_NONE) {
    in.tool_choice = frontend::ToolChoice::kNone;
  } else if (choice == v1::TOOL_CHOICE_AUTO) {
    in.tool_choice = frontend::ToolChoice::kAuto;
  } else if (choice == v1::TOOL_CHOICE_REQUIRED) {
    in.tool_choice = frontend::ToolChoice::kRequired;
  } else if (choice == v1::TOOL_CHOICE_FUNCTION) {
    in.tool_choice = frontend::ToolChoice::kNamed;
    in.tool_name = chat.tool_name();
  } else {
    return absl::InvalidArgumentError(absl::StrCat("prompt.chat.tool_choice: unknown value ", static_cast<int>(choice)));
  }
  if (!chat.template_kwargs().empty()) {
    in.template_kwargs = nlohmann::ordered_json::parse(chat.template_kwargs(), nullptr, /*allow_exceptions=*/false);
    if (!in.template_kwargs.is_object()) {
      return absl::InvalidArgumentError("prompt.chat.template_kwargs: must be the JSON text of an object");
    }
  }
  in.parallel_tool_calls = !chat.single_tool_call();
  in.continue_final_message = chat.continue_final_message();
  in.add_generation_prompt = !chat.continue_final_message();
  return in;
}

// `request` as admission takes it: GenerateRequest's own rules (a prompt is set, 0 means unset,
// json_object is true when set) are applied here, the rest by frontend::Admission.
absl::StatusOr<frontend::AdmissionRequest> FromProto(const v1::GenerateRequest& request, std::string request_id) {
  frontend::AdmissionRequest a;
  switch (request.prompt_case()) {
    case v1::GenerateRequest::kText:
      a.prompt = request.text();
      break;
    case v1::GenerateRequest::kTokenIds:
      a.prompt = std::vector<int32_t>(request.token_ids().ids().begin(), request.token_ids().ids().end());
      break;
    case v1::GenerateRequest::kChat: {
      absl::StatusOr<frontend::ChatInput> chat = ChatFromProto(request.chat());
      if (!chat.ok()) return chat.status();
      a.prompt = *std::move(chat);
      break;
    }
    case v1::GenerateRequest::PROMPT_NOT_SET:
      return absl::InvalidArgumentError("prompt is empty: set prompt.text, prompt.token_ids or prompt.chat");
  }
  a.max_tokens = request.max_tokens();
  SequenceRequest& r = a.sequence;
  r.request_id = std::move(request_id);
  const v1::SamplingParams& s = request.sampling();
  r.sampling = {.temperature = s.temperature(),
                .top_k = s.top_k(),
                .top_p = s.top_p() == 0.0f ? 1.0f : s.top_p(),
                .seed = s.seed(),
                .min_p = s.min_p(),
                .presence_penalty = s.presence_penalty(),
                .frequency_penalty = s.frequency_penalty(),
                .repetition_penalty = s.repetition_penalty() == 0.0f ? 1.0f : s.repetition_penalty()};
  for (const auto& [id, bias] : s.logit_bias()) r.sampling.logit_bias.emplace_back(id, bias);
  r.stop_token_ids.assign(request.stop_token_ids().begin(), request.stop_token_ids().end());
  r.ignore_eos = request.ignore_eos();
  r.min_tokens = request.min_tokens();
  r.logprobs = request.logprobs();
  r.top_logprobs = request.top_logprobs();
  r.prompt_logprobs = request.prompt_logprobs();
  r.resumed.assign(request.resume().token_ids().begin(), request.resume().token_ids().end());
  r.priority = request.priority();
  a.stop.assign(request.stop().begin(), request.stop().end());
  a.include_stop = request.include_stop_str_in_output();
  if (request.truncate_prompt_tokens() != 0) a.truncate_prompt_tokens = request.truncate_prompt_tokens();
  a.allowed_token_ids.assign(request.allowed_token_ids().begin(), request.allowed_token_ids().end());
  a.bad_words.assign(request.bad_words().begin(), request.bad_words().end());
  a.skip_special_tokens = !request.keep_special_tokens();
  a.n = request.n() == 0 ? 1 : request.n();
  auto constrain = [&a](structured::ConstraintKind kind, const std::string& text, const char* field) {
    a.constraint.emplace();
    a.constraint->spec.kind = kind;
    a.constraint->spec.text = text;
    a.constraint->field = field;
  };
  switch (request.constraint_case()) {
    case v1::GenerateRequest::kJsonSchema:
      constrain(structured::ConstraintKind::kJsonSchema, request.json_schema(), "json_schema");
      break;
    case v1::GenerateRequest::kJsonObject:
      if (!request.json_object()) return absl::InvalidArgumentError("json_object: must be true when set");
      constrain(structured::ConstraintKind::kJsonObject, "", "json_object");
      break;
    case v1::GenerateRequest::kRegex:
      constrain(structured::ConstraintKind::kRegex, request.regex(), "regex");
      break;
    case v1::GenerateRequest::CONSTRAINT_NOT_SET:
      break;
  }
  return a;
}

}  // namespace

InferenceService::InferenceService(InferenceServiceOptions options, const ModelSpec* spec, const Tokenizer* tokenizer,
                                   Scheduler* scheduler, std::function<absl::Status()> ready)
    : options_(std::move(options)),
      spec_(spec),
      tokenizer_(tokenizer),
      scheduler_(scheduler),
      admission_(std::make_unique<frontend::Admission>(frontend::AdmissionOptions{
          .tokenizer = tokenizer,
          .model_path = options_.model_path,
          .constraints = options_.constraints,
          .tool_call_parser = options_.tool_call_parser,
          .reasoning = frontend::ReasoningFormatOf(options_.reasoning_parser),
          .limits = {.vocab_size = spec->vocab_size, .max_seq_len = options_.max_seq_len},
          .eos_token_ids = scheduler->options().eos_token_ids,
          .ready = std::move(ready),
          .observer = options_.observer})) {}

InferenceService::~InferenceService() = default;

grpc::ServerWriteReactor<grpc::ByteBuffer>* InferenceService::Generate(grpc::CallbackServerContext* ctx,
                                                                       const grpc::ByteBuffer* raw_request) {
  auto* reactor = new GenerateReactor();
  auto refuse = [&](const absl::Status& status) {
    ReportRejected(options_.observer, status);
    reactor->Finish(ToGrpcStatus(status));
    return reactor;
  };
  v1::GenerateRequest request;
  if (grpc::Status st = ParseRawRequest(*raw_request, &request); !st.ok()) {
    ReportRejected(options_.observer, FromGrpcStatus(st));
    reactor->Finish(st);
    return reactor;
  }
  absl::StatusOr<std::shared_ptr<security::ApiKeys::Lease>> lease =
      AdmitCall(options_.api_keys, *ctx, security::ApiRole::kUser);
  if (!lease.ok()) return refuse(lease.status());
  reactor->set_lease(*std::move(lease));
  std::string id = request.request_id().empty() ? absl::StrCat("req-", next_request_.fetch_add(1)) : request.request_id();
  absl::StatusOr<frontend::AdmissionRequest> parsed = FromProto(request, std::move(id));
  if (!parsed.ok()) return refuse(parsed.status());
  // Admit reports its own refusals.
  absl::StatusOr<frontend::AdmittedRequest> admitted = admission_->Admit(*std::move(parsed), frontend::GrpcFieldNames());
  if (!admitted.ok()) {
    reactor->Finish(ToGrpcStatus(admitted.status()));
    return reactor;
  }
  SequenceRequest& seq = admitted->sequence;
  const Tokenizer* tokenizer = tokenizer_;
  // Each choice's text is decoded as the continuation of the prompt, one decoder cloned per choice.
  const std::unique_ptr<StreamDecoder> primed =
      frontend::ContinuationDecoder(tokenizer, seq.prompt, admitted->skip_special_tokens);
  auto new_decoder = [&primed]() -> std::unique_ptr<StreamDecoder> {
    return primed != nullptr ? primed->Clone() : nullptr;
  };
  auto stream = std::make_shared<GenerateStream>(reactor, *admitted, new_decoder);
  reactor->set_stream(stream);
  if (!seq.resumed.empty()) {
    // Resume: the client has these tokens and their text. When they already end the request, the
    // answer is the final message at once, as the unbroken stream would have ended.
    stream->Replay(seq.resumed);
    if (admitted->resumed_end.has_value() || stream->ReplayStopped()) {
      stream->EndWithoutSubmitting(SequenceEnd{.reason = admitted->resumed_end.value_or(FinishReason::kStop),
                                               .prompt_tokens = static_cast<int32_t>(seq.prompt.size()),
                                               .completion_tokens = static_cast<int32_t>(seq.resumed.size())});
      return reactor;
    }
  }
  absl::StatusOr<std::shared_ptr<ChoiceGroup>> group = ChoiceGroup::Submit(*scheduler_, std::move(seq), stream->Sinks());
  if (!group.ok()) {
    reactor->Finish(ToGrpcStatus(group.status()));
    return reactor;
  }
  stream->Bind(*std::move(group));
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

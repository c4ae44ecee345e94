// Admission: the one step between a client's request, whichever API it came through, and the
// scheduler. Each front end parses its own wire format into an AdmissionRequest (the gRPC
// Inference service from shardserve.v1.GenerateRequest, the HTTP API from OpenAI's JSON) and
// writes its own output; everything between is here:
//   * the prompt: text tokenized with the model's special tokens, token ids as given, or chat
//     messages rendered with the model's chat template (ChatPrompt) with the request's tools;
//   * tool calling: the tool choice checked against the tools, and for a required or named call
//     the constraint that forces one (tool_calls.h);
//   * reasoning: whether a chat answer is split into the model's reasoning and its content
//     (reasoning.h): only when the model writes it freely;
//   * structured output: the request's constraint compiled (structured/grammar.h);
//   * text stop strings, bad words (tokenized, bad_words.h), the number of choices (n), the
//     default max_tokens (the rest of the context), and every check of ValidateSequenceRequest;
//   * resume: the tokens the client already has, replayed (ReplayResumed);
//   * readiness: whether the cluster takes requests now (Cluster::AdmissionStatus), asked last,
//     so that an invalid request is told what is wrong with it even while the cluster starts.
//
// Errors name the request field as the caller's API spells it (FieldNames): the gRPC API says
// "sampling.top_p", the HTTP API "top_p". An error's message starts with the field (or names it),
// and the field is attached to the status (RequestFieldOf, the HTTP API's "param").
#ifndef SHARDSERVE_COORDINATOR_FRONTEND_ADMISSION_H_
#define SHARDSERVE_COORDINATOR_FRONTEND_ADMISSION_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/tokenizer/tokenizer.h"
#include "coordinator/frontend/chat_prompt.h"
#include "coordinator/frontend/reasoning.h"
#include "coordinator/frontend/tool_calls.h"
#include "coordinator/scheduler/scheduler_observer.h"
#include "coordinator/scheduler/sequence.h"
#include "coordinator/structured/grammar.h"
#include "nlohmann/json.hpp"

namespace shardserve::coordinator::frontend {

// How one API spells the request fields that admission's errors name.
struct FieldNames {
  absl::string_view prompt_text;  // a text prompt
  absl::string_view chat;         // chat messages
  absl::string_view tools;        // the chat's tools; an entry is tools + "[i]"
  absl::string_view tool_choice;
  absl::string_view stop;         // text stop strings; an entry is stop + "[i]"
  absl::string_view n;            // the number of choices
  absl::string_view resume;       // the resumed tokens
  absl::string_view truncate_prompt_tokens;
  absl::string_view allowed_token_ids;  // an entry is allowed_token_ids + "[i]"
  absl::string_view bad_words;          // an entry is bad_words + "[i]"
  absl::string_view chat_template_kwargs;
  RequestFieldNames sequence;     // the fields ValidateSequenceRequest names
};

// shardserve.v1.GenerateRequest's names: "prompt.text", "prompt.chat.tools", "sampling.top_p", ...
const FieldNames& GrpcFieldNames();
// The OpenAI-compatible HTTP API's names: "prompt", "tools", "top_p", ...; with `chat` those of
// /v1/chat/completions (the prompt is "messages", top_logprobs is "top_logprobs"), else those of
// /v1/completions (top_logprobs is "logprobs").
const FieldNames& OpenAiFieldNames(bool chat);

// A chat prompt and the tools it offers.
struct ChatInput {
  std::vector<ChatTurn> turns;
  // The tools as the chat template sees them: an array of OpenAI tool objects, or null for none.
  nlohmann::ordered_json tools;
  // Their functions, one per entry of `tools` and in its order (each checked by
  // ParseToolDefinition, which the front end calls naming its own field).
  std::vector<ToolFunction> functions;
  // The API's default when the client says nothing: kAuto with tools, kNone without.
  ToolChoice tool_choice = ToolChoice::kNone;
  std::string tool_name;  // with kNamed
  bool parallel_tool_calls = true;
  // ChatPrompt::Render's flags: a new assistant turn is started (the default), or the final
  // message is left open for the model to continue.
  bool add_generation_prompt = true;
  bool continue_final_message = false;
  // vLLM's chat_template_kwargs: more template variables, a JSON object or null; checked here
  // (TemplateKwargs::Parse).
  nlohmann::ordered_json template_kwargs = nullptr;
};

// A structured-output constraint the request asks for, and the request field that asked for it
// ("json_schema", "response_format", "guided_regex", ...).
struct ConstraintInput {
  structured::ConstraintSpec spec;
  std::string field;
};

// What both APIs can ask for, once parsed from their wire formats.
struct AdmissionRequest {
  // Text (tokenized with the model's special tokens), token ids (used as given), or chat.
  std::variant<std::string, std::vector<int32_t>, ChatInput> prompt;
  // Unset: the rest of the context after the prompt. Values beyond int32 are clamped to it (and
  // then refused as too large).
  std::optional<int64_t> max_tokens;
  // vLLM's truncate_prompt_tokens: a longer prompt keeps only its last k tokens (k >= 1), or with
  // -1 its last ones that fit the context beside max_tokens (beside one token when max_tokens is
  // unset). Unset: the prompt as it is. Other values are refused.
  std::optional<int64_t> truncate_prompt_tokens;
  // Taken as given: request_id, sampling (top_p and repetition_penalty already mapped from an
  // API's "unset"; logit_bias in any order), stop_token_ids, ignore_eos, min_tokens, logprobs,
  // top_logprobs, prompt_logprobs and resumed. Its prompt, max_tokens and constraint are Admit's
  // to set.
  SequenceRequest sequence;
  std::vector<std::string> stop;  // text stop strings
  // How the answer's text is made (SequenceText, ContinuationDecoder): a matched stop string ends
  // it (vLLM's include_stop_str_in_output); special tokens are left out (vLLM's skip_special_tokens).
  bool include_stop = false;
  bool skip_special_tokens = true;
  int n = 1;                      // choices, in [1, kMaxChoices]
  std::optional<ConstraintInput> constraint;
  // vLLM's allowed_token_ids (empty = any token): every sampled token is one of them
  // (allowed_tokens.h); not with a constraint or an enforced tool call.
  std::vector<int32_t> allowed_token_ids;
  // vLLM's bad_words: text the output never holds (bad_words.h); needs a tokenizer.
  std::vector<std::string> bad_words;
};

// An admitted request: what the front end submits (ChoiceGroup::Submit) and how it reads the
// output.
struct AdmittedRequest {
  SequenceRequest sequence;       // valid (ValidateSequenceRequest); logit_bias sorted by token id
  int n = 1;
  std::vector<std::string> stop;  // valid (ValidateStopStrings)
  bool prompt_truncated = false;  // truncate_prompt_tokens dropped the prompt's first tokens
  bool include_stop = false;      // as AdmissionRequest's
  bool skip_special_tokens = true;
  // Set for a chat whose answers are parsed for tool calls (tools and a tool choice other than
  // none): the format the model writes them in.
  std::optional<ToolCallFormat> tool_calls;
  // With tool_calls: the request's tools, which type the arguments of kGlm45's calls.
  std::vector<ToolFunction> tools;
  // Set for a chat whose answers are split into reasoning and content (AdmissionOptions::reasoning):
  // one the model writes freely. A constraint (structured output, allowed_token_ids, an enforced
  // tool call) shapes the text from its first token, so it holds no reasoning block, and a
  // continued message (continue_final_message) may already be past one: those are not split.
  // With kHarmony the answer is decoded with its special tokens (skip_special_tokens false: the
  // split reads them and drops them), and the model's <|call|> is a stop id.
  std::optional<ReasoningFormat> reasoning;
  // With kHarmony: the header of the message the prompt opened, empty when it opened none. A
  // harmony chat with structured output has its prompt open the final channel
  // ("<|channel|>final"), and one with a named tool choice a call of that function, so that the
  // constraint shapes only that message's text; the answer is split from inside it.
  std::string harmony_opened;
  // With resumed tokens that already end the request (ReplayResumed): how it ended. The front end
  // then answers at once and submits nothing.
  std::optional<FinishReason> resumed_end;
};

struct AdmissionOptions {
  const Tokenizer* tokenizer = nullptr;  // borrowed, may be null (only token-id prompts then)
  std::string model_path;                // the model directory, for its chat template
  // Compiles constraints (borrowed, may be null: constraints and enforced tool calls are then
  // refused).
  structured::ConstraintCompiler* constraints = nullptr;
  // How the model writes tool calls: "hermes", "llama3_json", "openai", "glm45", or anything else for "auto" (detected
  // from the chat template; tool_calls.h).
  std::string tool_call_parser = "auto";
  // A reasoning model's format (--reasoning_parser); none: answers are not split, except for a
  // model whose chat template writes GPT-OSS's harmony format (harmony::UsesHarmony): its channels
  // are always read (kHarmony), since its raw answer is markup.
  std::optional<ReasoningFormat> reasoning;
  RequestLimits limits;                // the scheduler's
  std::vector<int32_t> eos_token_ids;  // the model's, for resumes (ReplayResumed)
  // OK when the cluster takes requests, else the reason (Unavailable); null: always ready.
  std::function<absl::Status()> ready;
  // Told of every request Admit refuses (borrowed, may be null).
  SchedulerObserver* observer = nullptr;
};

class Admission {
 public:
  // Borrows the tokenizer, compiler and observer of `options`; they (and `ready`'s captures) must
  // outlive the Admission. Never fails: a model without a chat template is refused chat in Admit.
  explicit Admission(AdmissionOptions options);
  ~Admission();

  Admission(const Admission&) = delete;
  Admission& operator=(const Admission&) = delete;

  // The scheduler's request for `request`. InvalidArgument naming the field (spelled by `names`)
  // when the request is invalid: no tokenizer for a text prompt, stop strings or constraints; a
  // prompt the tokenizer or the chat template refuses; a tool choice without tools, naming a
  // function that is not among them, or forcing a call together with a constraint; two tools of
  // one name; a constraint or tool schema the compiler refuses; invalid stop strings; bad words
  // without a tokenizer or refused by BadWordSequences; n outside [1, kMaxChoices]; a resume with
  // n > 1 or tokens ReplayResumed refuses; anything ValidateSequenceRequest refuses. Then `ready`'s error (Unavailable). Every refusal is logged
  // and reported to the observer (ReportRejected). Thread-safe.
  absl::StatusOr<AdmittedRequest> Admit(AdmissionRequest request, const FieldNames& names) const;

  // How the model writes tool calls (the option, or detected from the chat template).
  ToolCallFormat tool_format() const { return tool_format_; }
  // How chat answers are split (the option, or kHarmony for a harmony template); none: not split.
  std::optional<ReasoningFormat> reasoning() const { return reasoning_; }

 private:
  absl::StatusOr<AdmittedRequest> Check(AdmissionRequest request, const FieldNames& names) const;
  // Renders `chat` into `*sequence`'s prompt and, for a required or named call, its constraint
  // (which cannot be combined with the request's own `constraint`).
  // `*harmony_opened`: the header of the message a harmony prompt was made to open (else empty).
  absl::Status AdmitChat(const ChatInput& chat, const std::optional<ConstraintInput>& constraint,
                         const FieldNames& names, SequenceRequest* sequence, std::string* harmony_opened) const;
  // request.allowed_token_ids (non-empty) checked and made sequence->constraint.
  absl::Status AdmitAllowedTokens(const AdmissionRequest& request, const FieldNames& names,
                                  SequenceRequest* sequence) const;

  const AdmissionOptions options_;
  const std::unique_ptr<ChatPrompt> chat_prompt_;
  ToolCallFormat tool_format_ = ToolCallFormat::kHermes;
  std::optional<ReasoningFormat> reasoning_;
  bool harmony_template_ = false;  // the chat template writes the harmony format
  std::optional<int32_t> harmony_call_id_;  // with kHarmony: the tokenizer's <|call|>, if it has one
};

}  // namespace shardserve::coordinator::frontend

#endif  // SHARDSERVE_COORDINATOR_FRONTEND_ADMISSION_H_

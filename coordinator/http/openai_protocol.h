// The OpenAI wire format of the coordinator's HTTP API: strict parsing of /v1/completions and
// /v1/chat/completions request bodies, the JSON of responses and stream chunks, server-sent-event
// framing, and OpenAI-shaped error bodies. Pure functions, no I/O.
//
// Parsing is strict, as the API promises: a body that is not a JSON object, an unknown field, a
// field of the wrong type, or a value out of range is InvalidArgument whose message names the
// field; the field is also attached to the status (ParamOf) for the error body's "param". Fields
// OpenAI defines but this server does not implement are accepted only with their neutral value
// (n = 1, echo = false, presence_penalty = 0, ...) and refused otherwise.
#ifndef SHARDSERVE_COORDINATOR_HTTP_OPENAI_PROTOCOL_H_
#define SHARDSERVE_COORDINATOR_HTTP_OPENAI_PROTOCOL_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "coordinator/frontend/tool_calls.h"
#include "nlohmann/json.hpp"

namespace shardserve::coordinator::http {

// What both endpoints share.
struct SamplingFields {
  std::string model;                  // empty when absent
  std::optional<int64_t> max_tokens;  // >= 1 when set
  double temperature = 1.0;           // [0, 2]; OpenAI's default is 1
  double top_p = 1.0;                 // (0, 1]
  int64_t top_k = 0;                  // >= 0 (an extension, as in vLLM); 0 = no limit
  std::optional<int64_t> seed;
  std::vector<std::string> stop;      // a string or an array of strings
  bool stream = false;
  bool include_usage = false;         // stream_options.include_usage
  // Extensions as vLLM spells them:
  double min_p = 0.0;                 // [0, 1]; 0 = off
  double presence_penalty = 0.0;      // [-2, 2] (OpenAI's range); 0 = off
  double frequency_penalty = 0.0;     // [-2, 2]; 0 = off
  double repetition_penalty = 1.0;    // (0, 2] (vLLM's extension); 1 = off
  int64_t min_tokens = 0;             // >= 0
  std::vector<int64_t> stop_token_ids;
  std::vector<int64_t> allowed_token_ids;  // non-empty when given; ids checked against the vocabulary later
  std::vector<std::string> bad_words;      // vLLM's: checked and tokenized at admission
  bool ignore_eos = false;
  bool include_stop_str_in_output = false;  // a matched stop string ends the text
  std::optional<int64_t> truncate_prompt_tokens;  // -1 or >= 1 (frontend::AdmissionRequest's)
  bool skip_special_tokens = true;          // false: special tokens are spelled in the text
  int32_t priority = 0;                     // the scheduling rank (SequenceRequest::priority)
  // OpenAI's logit_bias: {"token id": bias in [-100, 100]}, ids checked against the vocabulary later.
  std::vector<std::pair<int64_t, double>> logit_bias;
  // Completions: "logprobs": N (0..20); chat: "logprobs": true with "top_logprobs": N (0..20).
  bool logprobs = false;
  int64_t top_logprobs = 0;
  int64_t n = 1;                   // choices, [1, 16]
  std::optional<int64_t> best_of;  // [n, 16]: generate this many, answer the n most likely (not streamed)
  // response_format: {"type": "text"} (the default), {"type": "json_object"}, or {"type":
  // "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ..., "description": ...}}
  // (the schema is kept as JSON text; it is enforced whatever "strict" says).
  // vLLM's extras set it too (one of them at most, and not with response_format): guided_json (a
  // schema object or its text) = kJsonSchema, guided_regex = kRegex, guided_choice (non-empty
  // strings) = kChoice, the output being exactly one of them.
  enum class ResponseFormat { kText, kJsonObject, kJsonSchema, kRegex, kChoice };
  ResponseFormat response_format = ResponseFormat::kText;
  std::string json_schema;                 // with kJsonSchema
  std::string regex;                       // with kRegex
  std::vector<std::string> choices;        // with kChoice
  std::string format_param;                // the request field that set response_format (for errors)
};

// One generated token's log-probabilities as the API reports them.
// Tokens are spelled where they stand: the text each adds after the tokens before it (" there"
// after "Once upon a time,", where decoding the token alone drops SentencePiece's leading space),
// so that the entries' texts concatenate to the answer's. A token that adds no text of its own (a
// special token, or one that only begins a character whose last byte comes later) is spelled
// decoded alone ("</s>", U+FFFD) and adds no characters.
struct LogprobEntry {
  std::string token;
  double logprob = 0;
  bool has_logprob = true;  // false for an echoed prompt's first token (null in the JSON)
  std::vector<std::pair<std::string, double>> top;  // the most likely tokens, most likely first
  // Characters (code points) the token adds to the text: completions' text_offset advances by it.
  int64_t text_chars = 0;
};

// One prompt of a completions request: exactly one is set, a text or token ids.
struct CompletionPrompt {
  std::optional<std::string> text;
  std::vector<int64_t> ids;
};

// Prompts one completions request may carry (OpenAI's "prompt": a list of strings or of token-id
// lists); each has its own n choices.
inline constexpr size_t kMaxPrompts = 64;

struct CompletionRequest {
  SamplingFields fields;
  // 1 to kMaxPrompts prompts: "prompt" as a string, an array of token ids, an array of strings or
  // an array of token-id arrays. Choice k of prompt p is the answer's choice p * n + k.
  std::vector<CompletionPrompt> prompts;
  // The answer's text starts with the prompt's (and its logprobs with the prompt tokens').
  bool echo = false;
};

struct ChatMessage {
  std::string role;     // system, user, assistant, tool or developer
  std::string content;  // a string, or the text parts of a content array joined (null: "")
  std::optional<std::string> name;
  // An assistant message's calls: [{"id", "type": "function", "function": {"name", "arguments"
  // (JSON text)}}], validated; null when absent.
  nlohmann::ordered_json tool_calls;
  std::optional<std::string> tool_call_id;  // a tool message's answer to this call
  // An assistant message's reasoning_content (also read as vLLM's "reasoning"), as this server
  // returned it: given back to the chat template (frontend::ChatTurn::reasoning).
  std::optional<std::string> reasoning;
};

struct ChatRequest {
  SamplingFields fields;
  std::vector<ChatMessage> messages;  // non-empty
  // OpenAI's tools: the entries as given (for the chat template) and their functions (each
  // validated by ParseToolDefinition; distinct names, and the tool choice against them, are
  // frontend::Admission's to check).
  nlohmann::ordered_json tools;  // null when absent
  std::vector<frontend::ToolFunction> tool_functions;
  // tool_choice: "none", "auto", "required" or {"type": "function", "function": {"name": ...}}
  // (kNamed, tool_name); the default is auto with tools, none without.
  frontend::ToolChoice tool_choice = frontend::ToolChoice::kNone;
  std::string tool_name;
  bool parallel_tool_calls = true;
  // vLLM's: end the prompt where the assistant's answer starts (the default), or leave the final
  // message open for the model to continue ("prefill"; then add_generation_prompt must be false).
  bool add_generation_prompt = true;
  bool continue_final_message = false;
  // vLLM's chat_template_kwargs: more variables for the chat template (a JSON object; null when
  // absent), checked at admission (frontend::TemplateKwargs::Parse).
  nlohmann::ordered_json chat_template_kwargs;
};

// vLLM's /tokenize and /detokenize bodies.
// vLLM's /tokenize: a prompt, or chat messages rendered with the model's chat template.
struct TokenizeRequest {
  std::string model;
  std::optional<std::string> prompt;                 // exactly one of prompt and messages
  std::optional<std::vector<ChatMessage>> messages;
  // vLLM's defaults: true for a prompt; false for messages (the template writes the BOS itself).
  std::optional<bool> add_special_tokens;
  bool add_generation_prompt = true;  // messages: end where the assistant's answer starts
  bool continue_final_message = false;  // messages: end right after the final message's content
  nlohmann::ordered_json chat_template_kwargs;  // messages: more template variables (null: none)
};
struct DetokenizeRequest {
  std::string model;
  std::vector<int64_t> tokens;      // required (may be empty)
};

// Request bodies. InvalidArgument naming the field (see above).
absl::StatusOr<CompletionRequest> ParseCompletionRequest(absl::string_view body);
absl::StatusOr<ChatRequest> ParseChatRequest(absl::string_view body);
absl::StatusOr<TokenizeRequest> ParseTokenizeRequest(absl::string_view body);
absl::StatusOr<DetokenizeRequest> ParseDetokenizeRequest(absl::string_view body);

// An InvalidArgument status that carries the request field `param` (for the error body). The
// field is the one the scheduler's and admission's errors carry (InvalidRequestField in
// coordinator/scheduler/sequence.h), so ParamOf finds theirs too.
absl::Status InvalidParam(absl::string_view param, absl::string_view message);
// `status` with the request field `param` attached.
absl::Status WithParam(absl::Status status, absl::string_view param);
// The field attached by InvalidParam, WithParam or InvalidRequestField, or "".
std::string ParamOf(const absl::Status& status);

// An error reply: its HTTP status and OpenAI body.
struct ApiError {
  int http_status = 500;
  nlohmann::ordered_json body;  // {"error": {"message", "type", "param", "code"}}
};
// By status code: InvalidArgument/FailedPrecondition/OutOfRange -> 400 invalid_request_error;
// NotFound -> 404; ResourceExhausted -> 429; Unavailable -> 503; others -> 500 server_error.
ApiError ErrorFromStatus(const absl::Status& status);
// An error with an explicit HTTP status, type and code (code may be empty: null).
ApiError MakeError(int http_status, absl::string_view type, absl::string_view message, absl::string_view code = "");

// One server-sent event carrying `data`: "data: <data>\n\n".
std::string SseEvent(absl::string_view data);
// The stream's terminator: "data: [DONE]\n\n".
std::string SseDone();

// Identity of one response, shared by all its chunks.
struct ResponseMeta {
  std::string id;       // "cmpl-..." or "chatcmpl-..."
  int64_t created = 0;  // Unix seconds
  std::string model;
};

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t cached_tokens = 0;  // of prompt_tokens, found in the prefix cache (prompt_tokens_details)
};

// finish_reason: "stop" or "length"; empty for none (JSON null). `logprobs`, when given, fills the
// choice's "logprobs" (null otherwise): for completions {"tokens", "token_logprobs",
// "top_logprobs" (one {token: logprob} object per token), "text_offset" (from `text_offset`, the
// offset of the first token in the whole completion; in characters, as OpenAI counts them)}; for
// chat {"content": [{"token", "logprob",
// "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}.
nlohmann::ordered_json CompletionResponse(const ResponseMeta& meta, absl::string_view text,
                                          absl::string_view finish_reason, const Usage& usage,
                                          const std::vector<LogprobEntry>* logprobs = nullptr);
// `index` is the choice's (OpenAI's n).
nlohmann::ordered_json CompletionChunk(const ResponseMeta& meta, absl::string_view text,
                                       absl::string_view finish_reason,
                                       const std::vector<LogprobEntry>* logprobs = nullptr, int64_t text_offset = 0,
                                       int index = 0);
nlohmann::ordered_json ChatResponse(const ResponseMeta& meta, absl::string_view content,
                                    absl::string_view finish_reason, const Usage& usage,
                                    const std::vector<LogprobEntry>* logprobs = nullptr);
// A chat delta: `role` (first chunk) and/or `content`; both empty gives {} (the final chunk).
nlohmann::ordered_json ChatChunk(const ResponseMeta& meta, absl::string_view role,
                                 const std::optional<std::string>& content, absl::string_view finish_reason,
                                 const std::vector<LogprobEntry>* logprobs = nullptr, int index = 0);

// One choice of a whole answer with several (OpenAI's n); its "index" is its place in the list.
struct ChoiceOutput {
  std::string text;
  std::string finish_reason;
  const std::vector<LogprobEntry>* logprobs = nullptr;  // null: not asked (JSON null)
  // Chat: the calls parsed from the text (message.tool_calls, with ids from tool_call_ids); with
  // calls, an empty text is "content": null.
  std::vector<frontend::ParsedToolCall> tool_calls;
  std::vector<std::string> tool_call_ids;  // [tool_calls.size()]
  // Chat with a reasoning parser: the reasoning split off `text` (message.reasoning_content, null
  // when empty); unset without a parser (no such field).
  std::optional<std::string> reasoning;
};

// A chat delta carrying reasoning (delta.reasoning_content), as vLLM streams it.
nlohmann::ordered_json ReasoningChunk(const ResponseMeta& meta, absl::string_view reasoning, int index);

// A chat delta carrying one tool call, as OpenAI streams them: the first (with_header) has the
// call's index, id, type and name with empty arguments; later ones the index and an arguments
// fragment.
nlohmann::ordered_json ToolCallChunk(const ResponseMeta& meta, int choice_index, int call_index,
                                     const std::string* id, const std::string* name, absl::string_view arguments);
nlohmann::ordered_json CompletionResponse(const ResponseMeta& meta, const std::vector<ChoiceOutput>& choices,
                                          const Usage& usage);
nlohmann::ordered_json ChatResponse(const ResponseMeta& meta, const std::vector<ChoiceOutput>& choices,
                                    const Usage& usage);
// The usage-only chunk sent last when stream_options.include_usage is set ("choices": []).
nlohmann::ordered_json UsageChunk(const ResponseMeta& meta, absl::string_view object, const Usage& usage);

// The JSON text of `j` (invalid UTF-8 in strings is replaced, never thrown on).
std::string Dump(const nlohmann::ordered_json& j);

}  // namespace shardserve::coordinator::http

#endif  // SHARDSERVE_COORDINATOR_HTTP_OPENAI_PROTOCOL_H_

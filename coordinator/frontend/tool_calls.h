// Tool calling for chat: the tools a request offers, how a model writes a call to one, the
// constraint that forces such a call (tool_choice "required" or a named function), and the parser
// that turns generated text back into OpenAI's message.tool_calls.
//
// Four output formats are known:
//   * kHermes (Qwen2.5, Hermes, ...): each call is
//       <tool_call>
//       {"name": "get_weather", "arguments": {"city": "Paris"}}
//       </tool_call>
//     and several calls follow each other (separated by a newline); text before them is content.
//   * kLlama3Json (Llama-3.1/3.2 Instruct): the whole answer is one JSON object
//       {"name": "get_weather", "parameters": {"city": "Paris"}}
//     optionally after "<|python_tag|>"; several calls are separated by ";".
//   * kHarmony (GPT-OSS): calls are harmony messages to functions.NAME, which the gpt_oss reasoning
//     split (reasoning.h) hands on in the content as harmony::CallText writes them:
//       <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>
//     A required or named call cannot be enforced in this format (ToolCallRegex refuses it).
//   * kGlm45 (GLM-4.5, GLM-4.6): each call is
//       <tool_call>get_weather
//       <arg_key>city</arg_key>
//       <arg_value>Paris</arg_value>
//       </tool_call>
//     one <arg_key>/<arg_value> pair per argument, a string argument written as it is and any other
//     as JSON (as GLM-4.5's chat template writes them); the tool's parameters schema says which is
//     which (a value without one is JSON when it parses as JSON). Text before the calls is content.
//     A required or named call cannot be enforced in this format (ToolCallRegex refuses it).
// The format comes from --tool_call_parser, or is detected from the chat template's text
// (DetectToolCallFormat).
//
// Parsing never fails: text that is not a well-formed call (broken JSON, a missing name, arguments
// that are not an object, an unterminated tag) is plain content, with no calls.
//
// Pure functions and a per-choice streamer; thread-compatible.
#ifndef SHARDSERVE_COORDINATOR_FRONTEND_TOOL_CALLS_H_
#define SHARDSERVE_COORDINATOR_FRONTEND_TOOL_CALLS_H_

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "coordinator/structured/json_schema.h"
#include "nlohmann/json.hpp"

namespace shardserve::coordinator::frontend {

enum class ToolCallFormat { kHermes, kLlama3Json, kHarmony, kGlm45 };

// "hermes" (also "qwen"), "llama3_json" (also "llama"), "openai" (vLLM's name for GPT-OSS's; also
// "harmony") or "glm45" (vLLM's name for GLM-4.5's; also "glm4_moe"); InvalidArgument naming the
// choices.
absl::StatusOr<ToolCallFormat> ParseToolCallFormat(absl::string_view name);
absl::string_view ToolCallFormatName(ToolCallFormat format);

// The format a chat template teaches its model: kHarmony for a harmony template
// (harmony::UsesHarmony), kGlm45 when it mentions <arg_key>, kHermes when it mentions <tool_call>,
// kLlama3Json when it asks
// for {"name": ..., "parameters": ...} (Llama 3.x), kHermes otherwise.
ToolCallFormat DetectToolCallFormat(absl::string_view chat_template);

// One function of a request's `tools`.
struct ToolFunction {
  std::string name;                   // [A-Za-z0-9_-]{1,64}, as OpenAI requires
  nlohmann::ordered_json parameters;  // a JSON Schema of the arguments object (an object schema)
};

// What the request asks of tool calls (OpenAI's tool_choice).
enum class ToolChoice {
  kNone,      // tools are shown to the model, its output is never parsed as calls
  kAuto,      // the model decides; its output is parsed
  kRequired,  // the model must call one or more tools (constrained)
  kNamed,     // the model must call this one function (constrained)
};

// Validates one entry of `tools` ({"type": "function", "function": {"name", "description",
// "parameters", "strict"}}); InvalidArgument naming `field` ("tools[2].function.name").
absl::StatusOr<ToolFunction> ParseToolDefinition(const nlohmann::ordered_json& tool, const std::string& field);

// The most calls a constrained answer holds (tool_choice required with parallel calls).
inline constexpr int kMaxParallelCalls = 8;

// The regex (ByteDfa syntax) of output that is only tool calls in `format`: a call to `named` (when
// set, and exactly one call), or else to any of `tools` (one call, or 1..kMaxParallelCalls with
// `parallel` in kHermes; kLlama3Json calls one tool at a time). Arguments are compact JSON valid against each tool's parameters schema, with the
// limits of `options`. InvalidArgument naming the tool whose schema is unsupported, and for
// kHarmony (its calls come after the model's reasoning, which no regex of ours shapes) and kGlm45
// (its arguments are tagged text, not JSON).
absl::StatusOr<std::string> ToolCallRegex(ToolCallFormat format, const std::vector<ToolFunction>& tools,
                                          const std::optional<std::string>& named, bool parallel,
                                          const structured::JsonRegexOptions& options = {});

// kHarmony's named call: the regex of its arguments alone (compact JSON valid against the function's
// parameters schema), which the prompt's opened message to that function holds. InvalidArgument
// as ToolCallRegex's.
absl::StatusOr<std::string> HarmonyArgumentsRegex(const std::vector<ToolFunction>& tools, const std::string& named,
                                                  const structured::JsonRegexOptions& options = {});

struct ParsedToolCall {
  std::string name;
  std::string arguments;  // the arguments object as compact JSON text
};

struct ParsedOutput {
  std::string content;                // the text that is not a call (trimmed when there are calls)
  std::vector<ParsedToolCall> calls;  // empty: the text is plain content
};

// Splits a complete output into content and calls (see the file comment). `tools`, the request's,
// type kGlm45's argument values; the other formats ignore them.
ParsedOutput ParseToolCalls(ToolCallFormat format, absl::string_view text, const std::vector<ToolFunction>& tools = {});

// A streamed choice's text with tools on: content passes through as it comes, except what may be
// the start of a call, which is held back until the output ends and then parsed whole.
class ToolCallStreamer {
 public:
  explicit ToolCallStreamer(ToolCallFormat format, std::vector<ToolFunction> tools = {})
      : format_(format), tools_(std::move(tools)) {}

  // Adds final text; returns the content that can be sent now.
  std::string Add(absl::string_view text);
  // The output has ended: what was held back, parsed (its content is what is left to send).
  ParsedOutput Finish();

 private:
  ToolCallFormat format_;
  std::vector<ToolFunction> tools_;  // ParseToolCalls's
  std::string held_;         // text not yet sent: a possible call, or the start of one
  bool in_call_ = false;     // a call has started: hold everything to the end
  bool seen_text_ = false;   // non-blank content has been sent (Llama 3 calls start the answer)
};

}  // namespace shardserve::coordinator::frontend

#endif  // SHARDSERVE_COORDINATOR_FRONTEND_TOOL_CALLS_H_

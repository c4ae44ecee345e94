// ChatPrompt: chat messages turned into prompt token ids with the model's chat template
// (tokenizer_config.json's "chat_template", or chat_template.jinja), rendered as transformers'
// apply_chat_template(messages, add_generation_prompt=True) does and tokenized without adding
// special tokens. Shared by the HTTP API (/v1/chat/completions) and the gRPC Inference service
// (GenerateRequest.chat).
//
// Thread-safety: immutable after construction; Render may be called from many threads.
#ifndef SHARDSERVE_COORDINATOR_FRONTEND_CHAT_PROMPT_H_
#define SHARDSERVE_COORDINATOR_FRONTEND_CHAT_PROMPT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tokenizer/tokenizer.h"
#include "common/chat_template/jinja.h"
#include "nlohmann/json.hpp"

namespace shardserve::coordinator::frontend {

struct ChatTurn {
  std::string role;  // system, user, assistant, tool or developer
  std::string content;
  std::optional<std::string> name;
  // An assistant turn's calls, as OpenAI's message.tool_calls (null: none). The template sees each
  // function.arguments parsed into an object when it is JSON text of one (as the tool-calling
  // templates of Llama 3.1 and Qwen2.5 expect), as given otherwise.
  nlohmann::ordered_json tool_calls;
  std::optional<std::string> tool_call_id;  // a tool turn's call
  // An assistant turn's reasoning, as a reasoning parser gave it (message.reasoning_content): the
  // template sees it as `reasoning_content` (Qwen3's templates read that) and as `thinking`
  // (GPT-OSS's: it keeps a call's reasoning in the conversation until a final answer follows).
  std::optional<std::string> reasoning;
};

// InvalidArgument naming the message ("messages[1].role") for a role outside the five above, for
// reasoning on another role than assistant, or for no messages at all.
absl::Status ValidateChatTurns(const std::vector<ChatTurn>& messages);

// Most variables one request's chat_template_kwargs may set.
inline constexpr size_t kMaxTemplateKwargs = 64;

// vLLM's chat_template_kwargs, checked once where a request is taken in: a value of this type
// holds no variable the server sets itself, so a ChatPrompt renders it as it stands.
class TemplateKwargs {
 public:
  TemplateKwargs() = default;  // none

  // InvalidArgument (the message names no field: the caller adds its own) when `kwargs` is neither
  // null (none) nor a JSON object, has more than kMaxTemplateKwargs entries, or sets a variable the
  // server sets from the request itself (messages, tools, add_generation_prompt, bos_token,
  // eos_token).
  static absl::StatusOr<TemplateKwargs> Parse(nlohmann::ordered_json kwargs);

  const nlohmann::ordered_json& json() const { return kwargs_; }  // null, or an object

 private:
  nlohmann::ordered_json kwargs_ = nullptr;
};

// How a chat is rendered, beside its messages.
struct ChatRenderOptions {
  // The template's `tools`: an array of OpenAI tool objects, or null for none.
  nlohmann::ordered_json tools = nullptr;
  // The template's flag of that name (true: the prompt ends where the assistant's answer starts).
  bool add_generation_prompt = true;
  // With add_generation_prompt false: the rendered text is cut right after the final message's
  // content, so that the model continues that message (as transformers'
  // apply_chat_template(continue_final_message=True)).
  bool continue_final_message = false;
  // vLLM's chat_template_kwargs: more variables for the template (e.g. Qwen3's enable_thinking).
  TemplateKwargs template_kwargs;
};

// How deep JSON text nests its arrays and objects (brackets inside strings do not count), found
// without recursion: the front ends refuse request JSON deeper than kMaxJsonDepth before parsing
// it, since copying or rendering a parsed value recurses once per level.
size_t JsonNestingDepth(absl::string_view text);
inline constexpr size_t kMaxJsonDepth = 64;


class ChatPrompt {
 public:
  // `tokenizer` (borrowed; may be null) of the model in `model_dir` (for messages). Never fails: a
  // model without a tokenizer or a template, or with a template the Jinja subset cannot parse,
  // gives a ChatPrompt whose Render says so.
  ChatPrompt(const Tokenizer* tokenizer, const std::string& model_dir);

  // The prompt's ids; InvalidArgument when chat cannot be served (why), when the messages are
  // invalid (ValidateChatTurns), when the template refuses them (its raise_exception message),
  // or, with
  // continue_final_message, when add_generation_prompt is set too, the final message's content is
  // empty, or the template does not write it out.
  absl::StatusOr<std::vector<int32_t>> Render(const std::vector<ChatTurn>& messages,
                                              const ChatRenderOptions& options = {}) const;
  // The prompt's text (what Render tokenizes).
  absl::StatusOr<std::string> RenderText(const std::vector<ChatTurn>& messages,
                                         const ChatRenderOptions& options = {}) const;

  // The template's source ("" when there is none).
  const std::string& template_source() const { return template_source_; }

 private:
  const Tokenizer* tokenizer_;
  std::optional<jinja::JinjaTemplate> template_;
  std::string template_source_;
  absl::Status error_;  // why chat is not served, when template_ is empty
  std::string bos_token_, eos_token_;
};

}  // namespace shardserve::coordinator::frontend

#endif  // SHARDSERVE_COORDINATOR_FRONTEND_CHAT_PROMPT_H_

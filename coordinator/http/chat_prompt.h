// ChatPrompt: chat messages turned into prompt token ids with the model's chat template
// (tokenizer_config.json's "chat_template", or chat_template.jinja), rendered as transformers'
// apply_chat_template(messages, add_generation_prompt=True) does and tokenized without adding
// special tokens. Shared by the HTTP API (/v1/chat/completions) and the gRPC Inference service
// (GenerateRequest.chat).
//
// Thread-safety: immutable after construction; Render may be called from many threads.
#ifndef SHARDSERVE_COORDINATOR_HTTP_CHAT_PROMPT_H_
#define SHARDSERVE_COORDINATOR_HTTP_CHAT_PROMPT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tokenizer/tokenizer.h"
#include "common/chat_template/jinja.h"

namespace shardserve::coordinator::http {

struct ChatTurn {
  std::string role;  // system, user, assistant, tool or developer
  std::string content;
  std::optional<std::string> name;
};

// InvalidArgument naming the message ("messages[1].role") for a role outside the five above, or
// for no messages at all.
absl::Status ValidateChatTurns(const std::vector<ChatTurn>& messages);

class ChatPrompt {
 public:
  // `tokenizer` (borrowed; may be null) of the model in `model_dir` (for messages). Never fails: a
  // model without a tokenizer or a template, or with a template the Jinja subset cannot parse,
  // gives a ChatPrompt whose Render says so.
  ChatPrompt(const Tokenizer* tokenizer, const std::string& model_dir);

  // The prompt's ids; InvalidArgument when chat cannot be served (why), when the messages are
  // invalid (ValidateChatTurns), or when the template refuses them (its raise_exception message).
  absl::StatusOr<std::vector<int32_t>> Render(const std::vector<ChatTurn>& messages) const;

 private:
  const Tokenizer* tokenizer_;
  std::optional<jinja::JinjaTemplate> template_;
  absl::Status error_;  // why chat is not served, when template_ is empty
  std::string bos_token_, eos_token_;
};

}  // namespace shardserve::coordinator::http

#endif  // SHARDSERVE_COORDINATOR_HTTP_CHAT_PROMPT_H_

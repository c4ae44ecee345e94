#include "coordinator/http/chat_prompt.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log/log.h"

namespace shardserve::coordinator::http {

absl::Status ValidateChatTurns(const std::vector<ChatTurn>& messages) {
  if (messages.empty()) return absl::InvalidArgumentError("messages is empty");
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& role = messages[i].role;
    if (role != "system" && role != "user" && role != "assistant" && role != "tool" && role != "developer") {
      return absl::InvalidArgumentError(absl::StrCat("messages[", i, "].role must be system, user, assistant, tool or developer, got '",
                                                     role, "'"));
    }
  }
  return absl::OkStatus();
}

ChatPrompt::ChatPrompt(const Tokenizer* tokenizer, const std::string& model_dir) : tokenizer_(tokenizer) {
  if (tokenizer == nullptr) {
    error_ = absl::InvalidArgumentError(
        absl::StrCat("the model ", model_dir, " has no tokenizer, so chat messages cannot be served"));
    return;
  }
  if (!tokenizer->chat_template().has_value()) {
    error_ = absl::InvalidArgumentError(absl::StrCat(
        "the model has no chat template: ", model_dir,
        "/tokenizer_config.json has no \"chat_template\" (and there is no chat_template.jinja); send a plain prompt (/v1/completions, or GenerateRequest.text)"));
    return;
  }
  absl::StatusOr<jinja::JinjaTemplate> t = jinja::JinjaTemplate::Parse(*tokenizer->chat_template());
  if (!t.ok()) {
    LOG(WARNING) << "the chat template of " << model_dir << " cannot be used: " << t.status();
    error_ = absl::InvalidArgumentError(
        absl::StrCat("the chat template of ", model_dir, " is not supported: ", t.status().message()));
    return;
  }
  template_ = *std::move(t);
  if (std::optional<int32_t> bos = tokenizer->bos_id(); bos.has_value()) {
    bos_token_ = tokenizer->IdToPiece(*bos).value_or("");
  }
  if (!tokenizer->eos_ids().empty()) eos_token_ = tokenizer->IdToPiece(tokenizer->eos_ids()[0]).value_or("");
}

absl::StatusOr<std::vector<int32_t>> ChatPrompt::Render(const std::vector<ChatTurn>& messages) const {
  if (!template_.has_value()) return error_;
  if (absl::Status st = ValidateChatTurns(messages); !st.ok()) return st;
  nlohmann::ordered_json context;
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (const ChatTurn& m : messages) {
    nlohmann::ordered_json msg;
    msg["role"] = m.role;
    msg["content"] = m.content;
    if (m.name.has_value()) msg["name"] = *m.name;
    list.push_back(std::move(msg));
  }
  context["messages"] = std::move(list);
  context["bos_token"] = bos_token_;
  context["eos_token"] = eos_token_;
  context["add_generation_prompt"] = true;
  absl::StatusOr<std::string> prompt = template_->Render(context);
  if (!prompt.ok()) return absl::InvalidArgumentError(prompt.status().message());
  absl::StatusOr<std::vector<int32_t>> ids = tokenizer_->Encode(*prompt, /*add_special_tokens=*/false);
  if (!ids.ok()) return absl::InvalidArgumentError(ids.status().message());
  return ids;
}

}  // namespace shardserve::coordinator::http

#include "coordinator/frontend/chat_prompt.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/log/log.h"

namespace shardserve::coordinator::frontend {

absl::Status ValidateChatTurns(const std::vector<ChatTurn>& messages) {
  if (messages.empty()) return absl::InvalidArgumentError("messages is empty");
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& role = messages[i].role;
    if (role != "system" && role != "user" && role != "assistant" && role != "tool" && role != "developer") {
      return absl::InvalidArgumentError(absl::StrCat("messages[", i, "].role must be system, user, assistant, tool or developer, got '",
                                                     role, "'"));
    }
    if (messages[i].reasoning.has_value() && role != "assistant") {
      return absl::InvalidArgumentError(
          absl::StrCat("messages[", i, "].reasoning_content: only an assistant message carries reasoning"));
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
  template_source_ = *tokenizer->chat_template();
  if (std::optional<int32_t> bos = tokenizer->bos_id(); bos.has_value()) {
    bos_token_ = tokenizer->IdToPiece(*bos).value_or("");
  }
  if (!tokenizer->eos_ids().empty()) eos_token_ = tokenizer->IdToPiece(tokenizer->eos_ids()[0]).value_or("");
}

namespace {

// The rendered chat `text` cut right after the last place it writes `content` (the final
// message's): with the content's trailing whitespace where the template kept it, without where it
// trimmed it.
absl::StatusOr<std::string> CutAfterFinalMessage(const std::string& text, absl::string_view content) {
  const absl::string_view core = absl::StripAsciiWhitespace(content);
  if (core.empty()) {
    return absl::InvalidArgumentError("continue_final_message needs a final message with content to continue");
  }
  const size_t at = text.rfind(core.data(), std::string::npos, core.size());
  if (at == std::string::npos) {
    return absl::InvalidArgumentError(
        "continue_final_message: the chat template does not write the final message's content out as given, so "
        "there is no place to continue it from");
  }
  const absl::string_view rest = absl::StripLeadingAsciiWhitespace(content);  // the content from `core` on
  const bool kept = absl::string_view(text).substr(at, rest.size()) == rest;
  return text.substr(0, at + (kept ? rest.size() : core.size()));
}

}  // namespace

size_t JsonNestingDepth(absl::string_view text) {
  size_t depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      deepest = std::max(deepest, ++depth);
    } else if ((c == '}' || c == ']') && depth > 0) {
      --depth;
    }
  }
  return deepest;
}

absl::StatusOr<TemplateKwargs> TemplateKwargs::Parse(nlohmann::ordered_json kwargs) {
  TemplateKwargs out;
  if (kwargs.is_null()) return out;
  if (!kwargs.is_object()) return absl::InvalidArgumentError("must be a JSON object of template variables");
  if (kwargs.size() > kMaxTemplateKwargs) {
    return absl::InvalidArgumentError(
        absl::StrCat("sets ", kwargs.size(), " variables; at most ", kMaxTemplateKwargs, " are taken"));
  }
  for (const char* reserved : {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}) {
    if (kwargs.contains(reserved)) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", reserved, "' is set by the server from the request, not by the template's arguments"));
    }
  }
  out.kwargs_ = std::move(kwargs);
  return out;
}

absl::StatusOr<std::string> ChatPrompt::RenderText(const std::vector<ChatTurn>& messages,
                                                   const ChatRenderOptions& options) const {
  if (!template_.has_value()) return error_;
  if (absl::Status st = ValidateChatTurns(messages); !st.ok()) return st;
  if (options.continue_final_message && options.add_generation_prompt) {
    return absl::InvalidArgumentError("continue_final_message cannot be combined with add_generation_prompt");
  }
  nlohmann::ordered_json context = options.template_kwargs.json().is_null() ? nlohmann::ordered_json::object()
                                                                             : options.template_kwargs.json();
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (const ChatTurn& m : messages) {
    nlohmann::ordered_json msg;
    msg["role"] = m.role;
    msg["content"] = m.content;
    if (m.name.has_value()) msg["name"] = *m.name;
    if (!m.tool_calls.is_null()) {
      nlohmann::ordered_json calls = m.tool_calls;
      for (nlohmann::ordered_json& c : calls) {
        if (!c.is_object() || !c.contains("function") || !c["function"].is_object()) continue;
        nlohmann::ordered_json& f = c["function"];
        if (!f.contains("arguments") || !f["arguments"].is_string()) continue;
        const std::string text = f["arguments"].get<std::string>();
        nlohmann::ordered_json args = nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
        if (args.is_object()) f["arguments"] = std::move(args);
      }
      msg["tool_calls"] = std::move(calls);
    }
    if (m.tool_call_id.has_value()) msg["tool_call_id"] = *m.tool_call_id;
    if (m.reasoning.has_value()) {
      msg["reasoning_content"] = *m.reasoning;
      msg["thinking"] = *m.reasoning;
    }
    list.push_back(std::move(msg));
  }
  context["messages"] = std::move(list);
  if (!options.tools.is_null()) context["tools"] = options.tools;
  context["bos_token"] = bos_token_;
  context["eos_token"] = eos_token_;
  context["add_generation_prompt"] = options.add_generation_prompt;
  absl::StatusOr<std::string> prompt = template_->Render(context);
  if (!prompt.ok()) return absl::InvalidArgumentError(prompt.status().message());
  if (options.continue_final_message) return CutAfterFinalMessage(*prompt, messages.back().content);
  return prompt;
}

absl::StatusOr<std::vector<int32_t>> ChatPrompt::Render(const std::vector<ChatTurn>& messages,
                                                        const ChatRenderOptions& options) const {
  absl::StatusOr<std::string> prompt = RenderText(messages, options);
  if (!prompt.ok()) return prompt.status();
  absl::StatusOr<std::vector<int32_t>> ids = tokenizer_->Encode(*prompt, /*add_special_tokens=*/false);
  if (!ids.ok()) return absl::InvalidArgumentError(ids.status().message());
  return ids;
}

}  // namespace shardserve::coordinator::frontend

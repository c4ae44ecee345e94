#include "coordinator/frontend/admission.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "coordinator/frontend/allowed_tokens.h"
#include "coordinator/frontend/bad_words.h"
#include "coordinator/frontend/choices.h"
#include "coordinator/frontend/harmony.h"
#include "coordinator/frontend/request_log.h"
#include "coordinator/frontend/stop_strings.h"

namespace shardserve::coordinator::frontend {
namespace {

// An InvalidArgument about `field`: "<field><message...>", the field attached.
template <typename... Parts>
absl::Status Invalid(absl::string_view field, const Parts&... message) {
  return InvalidRequestField(field, absl::StrCat(field, message...));
}

// `status` (from a helper that does not know the field) as an error about `field`.
absl::Status InvalidBecause(absl::string_view field, const absl::Status& status) {
  return Invalid(field, ": ", status.message());
}

}  // namespace

const FieldNames& GrpcFieldNames() {
  static const FieldNames names{.prompt_text = "prompt.text",
                                .chat = "prompt.chat",
                                .tools = "prompt.chat.tools",
                                .tool_choice = "prompt.chat.tool_choice",
                                .stop = "stop",
                                .n = "n",
                                .resume = "resume.token_ids",
                                .truncate_prompt_tokens = "truncate_prompt_tokens",
                                .allowed_token_ids = "allowed_token_ids",
                                .bad_words = "bad_words",
                                .chat_template_kwargs = "prompt.chat.template_kwargs",
                                .sequence = {}};
  return names;
}

const FieldNames& OpenAiFieldNames(bool chat) {
  auto make = [](bool for_chat) {
    return FieldNames{.prompt_text = "prompt",
                      .chat = "messages",
                      .tools = "tools",
                      .tool_choice = "tool_choice",
                      .stop = "stop",
                      .n = "n",
                      .resume = "resume",
                      .truncate_prompt_tokens = "truncate_prompt_tokens",
                      .allowed_token_ids = "allowed_token_ids",
                      .bad_words = "bad_words",
                      .chat_template_kwargs = "chat_template_kwargs",
                      .sequence = {.prompt = for_chat ? "messages" : "prompt",
                                   .prompt_ids = "prompt",
                                   .max_tokens = "max_tokens",
                                   .temperature = "temperature",
                                   .top_k = "top_k",
                                   .top_p = "top_p",
                                   .min_p = "min_p",
                                   .logit_bias = "logit_bias",
                                   .repetition_penalty = "repetition_penalty",
                                   .frequency_penalty = "frequency_penalty",
                                   .presence_penalty = "presence_penalty",
                                   .stop_token_ids = "stop_token_ids",
                                   .min_tokens = "min_tokens",
                                   .top_logprobs = for_chat ? "top_logprobs" : "logprobs",
                                   .bad_words = "bad_words"}};
  };
  static const FieldNames completions = make(false);
  static const FieldNames chat_names = make(true);
  return chat ? chat_names : completions;
}

Admission::Admission(AdmissionOptions options)
    : options_(std::move(options)),
      chat_prompt_(std::make_unique<ChatPrompt>(options_.tokenizer, options_.model_path)) {
  absl::StatusOr<ToolCallFormat> format = ParseToolCallFormat(options_.tool_call_parser);
  tool_format_ = format.ok() ? *format : DetectToolCallFormat(chat_prompt_->template_source());
  reasoning_ = options_.reasoning;
  harmony_template_ = harmony::UsesHarmony(chat_prompt_->template_source());
  if (!reasoning_.has_value() && harmony_template_) {
    reasoning_ = ReasoningFormat::kHarmony;
  }
  if (reasoning_ == ReasoningFormat::kHarmony && options_.tokenizer != nullptr) {
    harmony_call_id_ = options_.tokenizer->PieceToId(std::string_view(harmony::kCall.data(), harmony::kCall.size()));
  }
}

Admission::~Admission() = default;

absl::StatusOr<AdmittedRequest> Admission::Admit(AdmissionRequest request, const FieldNames& names) const {
  absl::StatusOr<AdmittedRequest> admitted = Check(std::move(request), names);
  if (!admitted.ok()) ReportRejected(options_.observer, admitted.status());
  return admitted;
}

absl::Status Admission::AdmitChat(const ChatInput& chat, const std::optional<ConstraintInput>& constraint,
                                  const FieldNames& names, SequenceRequest* sequence,
                                  std::string* harmony_opened) const {
  if (chat.tool_choice != ToolChoice::kNone && chat.tools.is_null()) {
    return Invalid(names.tool_choice, ": needs ", names.tools);
  }
  for (size_t i = 0; i < chat.functions.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (chat.functions[j].name == chat.functions[i].name) {
        return Invalid(absl::StrCat(names.tools, "[", i, "]"), ": two tools are named '", chat.functions[i].name, "'");
      }
    }
  }
  const bool forced = chat.tool_choice == ToolChoice::kRequired || chat.tool_choice == ToolChoice::kNamed;
  std::optional<std::string> named;
  if (chat.tool_choice == ToolChoice::kNamed) {
    named = chat.tool_name;
    if (std::none_of(chat.functions.begin(), chat.functions.end(),
                     [&](const ToolFunction& f) { return f.name == chat.tool_name; })) {
      return Invalid(names.tool_choice, ": no tool is named '", chat.tool_name, "' in ", names.tools);
    }
  }
  // In harmony, a shaped answer goes in a message the prompt opens (AdmittedRequest::harmony_opened):
  // structured output in the final channel, a named call in a commentary message to its function.
  const bool harmony = reasoning_ == ReasoningFormat::kHarmony && harmony_template_ && tool_format_ == ToolCallFormat::kHarmony &&
                       chat.add_generation_prompt && !chat.continue_final_message;
  if (chat.tool_choice == ToolChoice::kRequired && tool_format_ == ToolCallFormat::kHarmony) {
    return Invalid(names.tool_choice, ": \"required\" cannot be enforced in GPT-OSS's harmony format (the model "
                   "names the function after its reasoning); name one function, or use \"auto\"");
  }
  if ((chat.tool_choice == ToolChoice::kRequired || chat.tool_choice == ToolChoice::kNamed) &&
      tool_format_ == ToolCallFormat::kGlm45) {
    return Invalid(names.tool_choice, ": calls in GLM-4.5's format (<arg_key>/<arg_value> pairs) cannot be "
                   "enforced; use \"auto\" (the model chooses) or \"none\"");
  }
  if (chat.tool_choice == ToolChoice::kNamed && tool_format_ == ToolCallFormat::kHarmony && !harmony) {
    return Invalid(names.tool_choice, ": a named tool call is enforced in the harmony format only where the prompt "
                   "opens a new assistant message (add_generation_prompt, not continue_final_message)");
  }
  if (forced && constraint.has_value()) {
    return Invalid(names.tool_choice, ": a required or named tool call cannot be combined with ", constraint->field);
  }
  absl::StatusOr<TemplateKwargs> kwargs = TemplateKwargs::Parse(chat.template_kwargs);
  if (!kwargs.ok()) return InvalidBecause(names.chat_template_kwargs, kwargs.status());
  absl::StatusOr<std::vector<int32_t>> ids =
      chat_prompt_->Render(chat.turns, {.tools = chat.tools,
                                        .add_generation_prompt = chat.add_generation_prompt,
                                        .continue_final_message = chat.continue_final_message,
                                        .template_kwargs = *std::move(kwargs)});
  if (!ids.ok()) return InvalidBecause(names.chat, ids.status());
  sequence->prompt = *std::move(ids);
  if (harmony && (forced || constraint.has_value())) {
    *harmony_opened = forced ? absl::StrCat(harmony::kChannel, "commentary to=functions.", *named, " <|constrain|>json")
                             : absl::StrCat(harmony::kChannel, "final");
    absl::StatusOr<std::vector<int32_t>> opened =
        options_.tokenizer->Encode(absl::StrCat(*harmony_opened, harmony::kMessage), /*add_special_tokens=*/false);
    if (!opened.ok()) return InvalidBecause(names.chat, opened.status());
    sequence->prompt.insert(sequence->prompt.end(), opened->begin(), opened->end());
  }
  if (!forced) return absl::OkStatus();
  // A required or named call: the answer is constrained to calls.
  if (options_.constraints == nullptr) {
    return Invalid(names.tool_choice, ": enforcing tool calls needs a model with a tokenizer");
  }
  absl::StatusOr<std::string> regex =
      tool_format_ == ToolCallFormat::kHarmony
          ? HarmonyArgumentsRegex(chat.functions, *named)
          : ToolCallRegex(tool_format_, chat.functions, named, chat.parallel_tool_calls);
  if (!regex.ok()) return InvalidBecause(names.tools, regex.status());
  absl::StatusOr<std::shared_ptr<const TokenConstraint>> c =
      options_.constraints->Compile({structured::ConstraintKind::kRegex, *regex});
  if (!c.ok()) return InvalidBecause(names.tools, c.status());
  sequence->constraint = *std::move(c);
  return absl::OkStatus();
}

absl::Status Admission::AdmitAllowedTokens(const AdmissionRequest& request, const FieldNames& names,
                                           SequenceRequest* sequence) const {
  const std::vector<int32_t>& ids = request.allowed_token_ids;
  const absl::string_view field = names.allowed_token_ids;
  if (sequence->constraint != nullptr) {
    return Invalid(field, " cannot be combined with ",
                   request.constraint.has_value() ? absl::string_view(request.constraint->field)
                                                  : absl::string_view(names.tool_choice));
  }
  if (ids.size() > kMaxAllowedTokenIds) {
    return Invalid(field, " holds ", ids.size(), " ids; at most ", kMaxAllowedTokenIds, " are taken");
  }
  const int64_t vocab = options_.limits.vocab_size;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab) {
      return Invalid(absl::StrCat(field, "[", i, "]"), " = ", ids[i], " is outside the vocabulary [0, ", vocab, ")");
    }
  }
  // Until min_tokens, the stop ids (and the EOS ids unless ignore_eos) cannot be sampled: some
  // allowed id must be neither.
  if (sequence->min_tokens > 0 && std::all_of(ids.begin(), ids.end(), [&](int32_t id) {
        return IsStopToken(*sequence, options_.eos_token_ids, id);
      })) {
    return Invalid(field, " holds only stop and EOS ids, which min_tokens = ", sequence->min_tokens,
                   " keeps from being sampled");
  }
  sequence->constraint = AllowedTokens(ids, vocab);
  return absl::OkStatus();
}

absl::StatusOr<AdmittedRequest> Admission::Check(AdmissionRequest request, const FieldNames& names) const {
  AdmittedRequest out;
  SequenceRequest& r = out.sequence;
  r = std::move(request.sequence);
  if (const auto* text = std::get_if<std::string>(&request.prompt)) {
    if (options_.tokenizer == nullptr) {
      return Invalid(names.prompt_text, ": the model has no tokenizer; send the prompt as token ids");
    }
    if (text->empty()) return Invalid(names.prompt_text, ": the prompt is empty");
    absl::StatusOr<std::vector<int32_t>> ids = options_.tokenizer->Encode(*text, /*add_special_tokens=*/true);
    if (!ids.ok()) return InvalidBecause(names.prompt_text, ids.status());
    r.prompt = *std::move(ids);
  } else if (auto* ids = std::get_if<std::vector<int32_t>>(&request.prompt)) {
    r.prompt = std::move(*ids);  // checked against the vocabulary by ValidateSequenceRequest
  } else {
    const ChatInput& chat = std::get<ChatInput>(request.prompt);
    if (absl::Status st = AdmitChat(chat, request.constraint, names, &r, &out.harmony_opened); !st.ok()) return st;
    if (!chat.tools.is_null() && chat.tool_choice != ToolChoice::kNone) {
      out.tool_calls = tool_format_;
      out.tools = chat.functions;
    }
  }
  if (request.truncate_prompt_tokens.has_value()) {
    const int64_t k = *request.truncate_prompt_tokens;
    if (k == 0 || k < -1) {
      return Invalid(names.truncate_prompt_tokens, " must be -1 (what fits the context) or >= 1, got ", k);
    }
    // -1: what the context leaves beside max_tokens (a larger max_tokens is refused below).
    const int64_t keep = k > 0 ? k : options_.limits.max_seq_len - std::max<int64_t>(request.max_tokens.value_or(1), 1);
    if (keep >= 1 && static_cast<int64_t>(r.prompt.size()) > keep) {
      r.prompt.erase(r.prompt.begin(), r.prompt.end() - keep);
      out.prompt_truncated = true;
    }
  }
  if (request.constraint.has_value()) {
    const ConstraintInput& c = *request.constraint;
    if (options_.constraints == nullptr) {
      return Invalid(c.field, ": structured output needs a model with a tokenizer");
    }
    absl::StatusOr<std::shared_ptr<const TokenConstraint>> compiled = options_.constraints->Compile(c.spec);
    if (!compiled.ok()) return InvalidBecause(c.field, compiled.status());
    r.constraint = *std::move(compiled);
  }
  if (!request.allowed_token_ids.empty()) {
    if (absl::Status st = AdmitAllowedTokens(request, names, &r); !st.ok()) return st;
  }
  if (!request.stop.empty()) {
    if (options_.tokenizer == nullptr) {
      return Invalid(names.stop, ": the model has no tokenizer, so text stop strings cannot be matched");
    }
    if (absl::Status st = ValidateStopStrings(request.stop, names.stop); !st.ok()) {
      return WithRequestField(st, names.stop);
    }
  }
  if (!request.bad_words.empty()) {
    if (options_.tokenizer == nullptr) {
      return Invalid(names.bad_words, ": the model has no tokenizer, so bad words cannot be spelled in tokens");
    }
    absl::StatusOr<std::vector<std::vector<int32_t>>> banned =
        BadWordSequences(*options_.tokenizer, request.bad_words, names.bad_words);
    if (!banned.ok()) return banned.status();
    r.bad_words = *std::move(banned);
  }
  out.stop = std::move(request.stop);
  out.include_stop = request.include_stop;
  out.skip_special_tokens = request.skip_special_tokens;
  if (request.n < 1 || request.n > kMaxChoices) {
    return Invalid(names.n, " must be in [1, ", kMaxChoices, "], got ", request.n);
  }
  out.n = request.n;
  if (!r.resumed.empty() && request.n > 1) {
    return Invalid(names.resume, ": only a request with n = 1 can be resumed, got ", names.n, " = ", request.n);
  }
  const int64_t prompt_len = static_cast<int64_t>(r.prompt.size());
  const int64_t max_tokens = request.max_tokens.value_or(options_.limits.max_seq_len - prompt_len);
  r.max_tokens = static_cast<int32_t>(
      std::clamp<int64_t>(max_tokens, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()));
  std::sort(r.sampling.logit_bias.begin(), r.sampling.logit_bias.end());
  if (const auto* chat = std::get_if<ChatInput>(&request.prompt);
      chat != nullptr && r.constraint == nullptr && !chat->continue_final_message) {
    out.reasoning = reasoning_;
  }
  if (!out.harmony_opened.empty()) out.reasoning = ReasoningFormat::kHarmony;  // shaped inside the opened message
  if (out.reasoning == ReasoningFormat::kHarmony) {
    out.skip_special_tokens = false;  // the split reads the markup, and drops it
    if (harmony_call_id_.has_value() &&
        std::find(r.stop_token_ids.begin(), r.stop_token_ids.end(), *harmony_call_id_) == r.stop_token_ids.end()) {
      r.stop_token_ids.push_back(*harmony_call_id_);  // a call ends the answer; the client runs it
    }
  }
  // GLM-4.5's call tags may be special tokens of its tokenizer: the parser must see them (as vLLM's
  // glm45 parser asks of its requests).
  if (out.tool_calls == ToolCallFormat::kGlm45) out.skip_special_tokens = false;
  if (absl::Status st = ValidateSequenceRequest(r, options_.limits, names.sequence); !st.ok()) return st;
  if (options_.ready) {
    if (absl::Status st = options_.ready(); !st.ok()) return st;
  }
  if (!r.resumed.empty()) {
    absl::StatusOr<ResumedState> resumed = ReplayResumed(r, options_.eos_token_ids, options_.limits);
    if (!resumed.ok()) return WithRequestField(resumed.status(), names.resume);  // it names resume.token_ids[i]
    out.resumed_end = resumed->ended;
  }
  return out;
}

}  // namespace shardserve::coordinator::frontend

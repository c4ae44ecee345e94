#include "coordinator/scheduler/sequence.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "coordinator/scheduler/next_token.h"

namespace shardserve::coordinator {

absl::string_view FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength: return "length";
    case FinishReason::kStop: return "stop";
    case FinishReason::kCancelled: return "cancelled";
  }
  return "?";
}

namespace {
constexpr absl::string_view kRequestFieldPayload = "type.shardserve/request.field";
}  // namespace

absl::Status WithRequestField(absl::Status status, absl::string_view field) {
  if (!field.empty()) status.SetPayload(kRequestFieldPayload, absl::Cord(field));
  return status;
}

absl::Status InvalidRequestField(absl::string_view field, absl::string_view message) {
  return WithRequestField(absl::InvalidArgumentError(message), field);
}

std::string RequestFieldOf(const absl::Status& status) {
  const auto field = status.GetPayload(kRequestFieldPayload);
  return field.has_value() ? std::string(*field) : "";
}

absl::Status ValidateSequenceRequest(const SequenceRequest& r, const RequestLimits& limits,
                                     const RequestFieldNames& names) {
  // Every error names its field first, as the caller's API spells it.
  auto invalid = [](absl::string_view field, auto&&... message) {
    return InvalidRequestField(field, absl::StrCat(field, message...));
  };
  if (r.prompt.empty()) return invalid(names.prompt, " is empty");
  for (size_t i = 0; i < r.prompt.size(); ++i) {
    if (r.prompt[i] < 0 || r.prompt[i] >= limits.vocab_size) {
      return invalid(names.prompt_ids, "[", i, "] = ", r.prompt[i], " is outside the vocabulary [0, ",
                     limits.vocab_size, ")");
    }
  }
  const int64_t prompt = static_cast<int64_t>(r.prompt.size());
  if (prompt >= limits.max_seq_len) {
    return invalid(names.prompt, " is too long: ", prompt, " tokens, and the context is ", limits.max_seq_len,
                   " tokens (max_seq_len), which leaves no room to generate");
  }
  if (r.max_tokens < 1) return invalid(names.max_tokens, " must be >= 1, got ", r.max_tokens);
  if (prompt + r.max_tokens > limits.max_seq_len) {
    return invalid(names.max_tokens, " is too large: the prompt (", prompt, " tokens) + ", names.max_tokens, " (",
                   r.max_tokens, ") = ", prompt + r.max_tokens, " exceeds the context of ", limits.max_seq_len,
                   " tokens; ", names.max_tokens, " can be at most ", limits.max_seq_len - prompt);
  }
  const SamplingOptions& s = r.sampling;
  if (!std::isfinite(s.temperature) || s.temperature < 0.0f) {
    return invalid(names.temperature, " must be a finite number >= 0, got ", s.temperature);
  }
  if (s.top_k < 0) return invalid(names.top_k, " must be >= 0, got ", s.top_k);
  if (!(s.top_p > 0.0f && s.top_p <= 1.0f)) {
    return invalid(names.top_p, " must be in (0, 1] (0 means unset), got ", s.top_p);
  }
  for (size_t i = 0; i < r.stop_token_ids.size(); ++i) {
    const int32_t id = r.stop_token_ids[i];
    if (id < 0 || id >= limits.vocab_size) {
      return invalid(names.stop_token_ids, "[", i, "] = ", id, " is outside the vocabulary [0, ", limits.vocab_size,
                     ")");
    }
  }
  if (!(s.min_p >= 0.0f && s.min_p <= 1.0f)) return invalid(names.min_p, " must be in [0, 1], got ", s.min_p);
  if (s.logit_bias.size() > kMaxLogitBias) {
    return invalid(names.logit_bias, " has ", s.logit_bias.size(), " entries; at most ", kMaxLogitBias,
                   " are allowed");
  }
  for (const auto& [id, bias] : s.logit_bias) {
    if (id < 0 || id >= limits.vocab_size) {
      return invalid(names.logit_bias, " token ", id, " is outside the vocabulary [0, ", limits.vocab_size, ")");
    }
    if (!(bias >= -100.0f && bias <= 100.0f)) {
      return invalid(names.logit_bias, " for token ", id, " must be in [-100, 100], got ", bias);
    }
  }
  if (!(s.repetition_penalty > 0.0f && s.repetition_penalty <= 2.0f)) {
    return invalid(names.repetition_penalty, " must be in (0, 2] (0 means unset), got ", s.repetition_penalty);
  }
  if (!(s.frequency_penalty >= -2.0f && s.frequency_penalty <= 2.0f)) {
    return invalid(names.frequency_penalty, " must be in [-2, 2], got ", s.frequency_penalty);
  }
  if (!(s.presence_penalty >= -2.0f && s.presence_penalty <= 2.0f)) {
    return invalid(names.presence_penalty, " must be in [-2, 2], got ", s.presence_penalty);
  }
  if (r.min_tokens < 0 || r.min_tokens > r.max_tokens) {
    return invalid(names.min_tokens, " must be in [0, ", names.max_tokens, " = ", r.max_tokens, "], got ",
                   r.min_tokens);
  }
  if (r.top_logprobs < 0 || r.top_logprobs > kMaxTopLogprobs) {
    return invalid(names.top_logprobs, " must be in [0, ", kMaxTopLogprobs, "], got ", r.top_logprobs);
  }
  if (r.bad_words.size() > kMaxBadWordSequences) {
    return invalid(names.bad_words, " makes ", r.bad_words.size(), " token sequences; at most ", kMaxBadWordSequences,
                   " are taken");
  }
  for (size_t i = 0; i < r.bad_words.size(); ++i) {
    const std::vector<int32_t>& word = r.bad_words[i];
    if (word.empty() || word.size() > kMaxBadWordTokens) {
      return invalid(names.bad_words, ": token sequence ", i, " has ", word.size(), " tokens; it must have 1 to ",
                     kMaxBadWordTokens);
    }
    for (int32_t id : word) {
      if (id < 0 || id >= limits.vocab_size) {
        return invalid(names.bad_words, ": token sequence ", i, " holds ", id, ", outside the vocabulary [0, ",
                       limits.vocab_size, ")");
      }
    }
  }
  return absl::OkStatus();
}

bool IsStopToken(const SequenceRequest& r, absl::Span<const int32_t> eos_token_ids, int32_t token) {
  return std::find(r.stop_token_ids.begin(), r.stop_token_ids.end(), token) != r.stop_token_ids.end() ||
         (!r.ignore_eos && std::find(eos_token_ids.begin(), eos_token_ids.end(), token) != eos_token_ids.end());
}

absl::StatusOr<ResumedState> ReplayResumed(const SequenceRequest& r, absl::Span<const int32_t> eos_token_ids,
                                           const RequestLimits& limits) {
  const std::vector<int32_t>& tokens = r.resumed;
  if (std::ssize(tokens) > r.max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("resume.token_ids has ", tokens.size(),
                                                   " tokens, more than max_tokens = ", r.max_tokens));
  }
  ResumedState state;
  if (r.constraint != nullptr) state.constraint_state = r.constraint->StartState();
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int32_t token = tokens[i];
    if (token < 0 || token >= limits.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("resume.token_ids[", i, "] = ", token,
                                                     " is outside the vocabulary [0, ", limits.vocab_size, ")"));
    }
    // min_tokens' suppression and the bad words' bans (the constraint's mask is Advance's to check).
    if (static_cast<int64_t>(i) < r.min_tokens || !r.bad_words.empty()) {
      const NextTokenRules rules = NextTokenRulesOf(r, eos_token_ids, limits.vocab_size,
                                                    absl::MakeConstSpan(tokens.data(), i), state.constraint_state);
      if (std::binary_search(rules.suppress.begin(), rules.suppress.end(), token)) {
        return absl::InvalidArgumentError(
            absl::StrCat("resume.token_ids[", i, "] = ", token, " could not have been generated there: min_tokens (",
                         r.min_tokens, ") or bad_words forbid it after the tokens before it"));
      }
    }
    bool stop = IsStopToken(r, eos_token_ids, token);
    if (r.constraint != nullptr) {
      state.constraint_state = r.constraint->Advance(state.constraint_state, token);
      if (state.constraint_state < 0) {
        return absl::InvalidArgumentError(absl::StrCat("resume.token_ids[", i, "] = ", token,
                                                       " is not allowed there by the output constraint"));
      }
      stop = stop || r.constraint->IsFinished(state.constraint_state);
    }
    if (stop && i + 1 < tokens.size()) {
      return absl::InvalidArgumentError(absl::StrCat("resume.token_ids[", i, "] = ", token,
                                                     " ends the request, yet more tokens follow it"));
    }
    if (stop) state.ended = FinishReason::kStop;
  }
  if (!state.ended.has_value() && !tokens.empty() &&
      (std::ssize(tokens) >= r.max_tokens ||
       static_cast<int64_t>(r.prompt.size() + tokens.size()) >= limits.max_seq_len)) {
    state.ended = FinishReason::kLength;
  }
  return state;
}

}  // namespace shardserve::coordinator

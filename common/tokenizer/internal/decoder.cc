#include "common/tokenizer/internal/decoder.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status/macros.h"
#include "common/tokenizer/internal/byte_level.h"
#include "common/tokenizer/internal/string_view.h"

namespace shardserve::tokenizer_internal {
namespace {

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// ByteLevel's per-token rule: the token's bytes when every character is in the byte map, else the
// token's own UTF-8 (e.g. an added token spelled outside the map).
void AppendTokenBytes(std::string_view token, std::string* out) {
  const size_t mark = out->size();
  if (!ByteLevelToBytes(token, out)) {
    out->resize(mark);
    out->append(token);
  }
}

// Strip: removes up to `start` leading and `stop` trailing copies of the character `content`.
std::string StripToken(std::string_view token, std::string_view content, size_t start, size_t stop) {
  size_t b = 0;
  for (size_t i = 0; i < start && token.substr(b).starts_with(content); ++i) b += content.size();
  size_t e = token.size();
  for (size_t i = 0; i < stop && e >= b + content.size() && token.substr(0, e).ends_with(content); ++i) {
    e -= content.size();
  }
  return std::string(token.substr(b, e - b));
}

// Metaspace: the replacement becomes a space, or disappears in the first token (unless the
// prepend scheme is "never").
std::string MetaspaceToken(std::string_view token, std::string_view replacement, bool drop) {
  std::string out;
  out.reserve(token.size());
  size_t pos = 0;
  while (true) {
    const size_t hit = token.find(replacement, pos);
    if (hit == std::string_view::npos) break;
    out.append(token.substr(pos, hit - pos));
    if (!drop) out.push_back(' ');
    pos = hit + replacement.size();
  }
  out.append(token.substr(pos));
  return out;
}

}  // namespace

int ByteFallbackValue(std::string_view token) {
  if (token.size() != 6 || !token.starts_with("<0x") || token[5] != '>') return -1;
  const int hi = HexDigit(token[3]);
  const int lo = HexDigit(token[4]);
  if (hi < 0 || lo < 0) return -1;
  return hi * 16 + lo;
}

absl::Status DecoderChain::AddSteps(const Json& j, const JsonWhere& where) {
  ASSIGN_OR_RETURN(std::string type, JsonType(j, where));
  if (type == "Sequence") {
    const Json* list = JsonMember(j, "decoders");
    if (list == nullptr || !list->is_array()) return where.Child("decoders").Error("is missing or not a list");
    size_t i = 0;
    for (const Json& e : *list) RETURN_IF_ERROR(AddSteps(e, where.Child("decoders").Index(i++)));
    return absl::OkStatus();
  }
  Step step;
  step.after_fuse = !steps_.empty() && (steps_.back().after_fuse || steps_.back().kind == Kind::kFuse ||
                                        steps_.back().kind == Kind::kByteLevel);
  if (type == "ByteLevel") {
    step.kind = Kind::kByteLevel;
    byte_level_ = true;
  } else if (type == "ByteFallback") {
    step.kind = Kind::kByteFallback;
  } else if (type == "Fuse") {
    step.kind = Kind::kFuse;
  } else if (type == "Replace") {
    step.kind = Kind::kReplace;
    ASSIGN_OR_RETURN(step.replace, ReplaceRule::Parse(j, where));
  } else if (type == "Strip") {
    step.kind = Kind::kStrip;
    ASSIGN_OR_RETURN(step.pattern, JsonString(j, "content", where));
    size_t len = 0;
    if (step.pattern.empty() || (DecodeUtf8Char(step.pattern, &len), len != step.pattern.size())) {
      return where.Child("content").Error("is not a single character");
    }
    ASSIGN_OR_RETURN(int64_t start, JsonIntOr(j, "start", 0, 0, 1 << 20, where));
    ASSIGN_OR_RETURN(int64_t stop, JsonIntOr(j, "stop", 0, 0, 1 << 20, where));
    step.start = static_cast<size_t>(start);
    step.stop = static_cast<size_t>(stop);
  } else if (type == "Metaspace") {
    step.kind = Kind::kMetaspace;
    ASSIGN_OR_RETURN(step.pattern, JsonStringOr(j, "replacement", "\xE2\x96\x81", where));
    if (step.pattern.empty()) return where.Child("replacement").Error("is empty");
    ASSIGN_OR_RETURN(bool add_prefix_space, JsonBoolOr(j, "add_prefix_space", true, where));
    ASSIGN_OR_RETURN(std::string scheme,
                     JsonStringOr(j, "prepend_scheme", add_prefix_space ? "always" : "never", where));
    if (scheme != "always" && scheme != "never" && scheme != "first") {
      return where.Child("prepend_scheme").Error(absl::StrCat("is \"", scheme, "\", not always/never/first"));
    }
    step.prepend = scheme != "never";
  } else {
    return where.Unsupported(absl::StrCat("is a \"", type,
                                          "\" decoder, which is not supported (supported: Sequence, ByteLevel, "
                                          "ByteFallback, Fuse, Replace, Strip, Metaspace)"));
  }
  steps_.push_back(std::move(step));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DecoderChain>> DecoderChain::FromJson(const Json& j, const JsonWhere& where) {
  auto chain = std::unique_ptr<DecoderChain>(new DecoderChain());
  if (j.is_null()) {
    chain->null_decoder_ = true;
  } else {
    RETURN_IF_ERROR(chain->AddSteps(j, where));
  }
  return chain;
}

absl::StatusOr<std::string> DecoderChain::Decode(std::vector<std::string> tokens) const {
  if (null_decoder_) return absl::StrJoin(tokens, " ");
  for (const Step& step : steps_) {
    switch (step.kind) {
      case Kind::kByteLevel: {
        std::string bytes;
        for (const std::string& t : tokens) AppendTokenBytes(t, &bytes);
        tokens.assign(1, Utf8Lossy(bytes));
        break;
      }
      case Kind::kByteFallback: {
        std::vector<std::string> out;
        std::string run;
        size_t run_tokens = 0;
        auto flush = [&]() {
          if (run_tokens == 0) return;
          if (ValidateUtf8(run).ok()) {
            out.push_back(run);
          } else {
            for (size_t i = 0; i < run_tokens; ++i) out.emplace_back(kUtf8Replacement);
          }
          run.clear();
          run_tokens = 0;
        };
        for (std::string& t : tokens) {
          const int b = ByteFallbackValue(t);
          if (b >= 0) {
            run.push_back(static_cast<char>(b));
            ++run_tokens;
          } else {
            flush();
            out.push_back(std::move(t));
          }
        }
        flush();
        tokens.swap(out);
        break;
      }
      case Kind::kFuse:
        tokens.assign(1, absl::StrJoin(tokens, ""));
        break;
      case Kind::kReplace:
        for (std::string& token : tokens) {
          ASSIGN_OR_RETURN(token, step.replace.Apply(token));
        }
        break;
      case Kind::kStrip:
        for (std::string& t : tokens) t = StripToken(t, step.pattern, step.start, step.stop);
        break;
      case Kind::kMetaspace:
        for (size_t i = 0; i < tokens.size(); ++i) {
          tokens[i] = MetaspaceToken(tokens[i], step.pattern, i == 0 && step.prepend);
        }
        break;
    }
  }
  return absl::StrJoin(tokens, "");
}

DecoderChain::Stream::Stream(const DecoderChain* chain)
    : chain_(chain),
      states_(chain->steps_.size()),
      assembler_(chain->byte_level_ ? InvalidUtf8Policy::kMaximalSubpart : InvalidUtf8Policy::kPerByte) {}

absl::Status DecoderChain::Stream::Feed(std::string_view token, std::string* out) {
  if (chain_->null_decoder_) {
    if (tokens_++ > 0) out->push_back(' ');
    assembler_.Append(token, out);
    return absl::OkStatus();
  }
  ++tokens_;
  std::string text(token);
  bool breaks_run = false;  // a token that ends a run of <0xXX> bytes
  for (size_t k = 0; k < chain_->steps_.size(); ++k) {
    const Step& step = chain_->steps_[k];
    StepState& state = states_[k];
    const bool first = step.after_fuse ? true : state.count == 0;  // "token 0" of this step
    switch (step.kind) {
      case Kind::kByteLevel: {
        std::string bytes;
        AppendTokenBytes(text, &bytes);
        text.swap(bytes);
        break;
      }
      case Kind::kByteFallback: {
        const int b = ByteFallbackValue(text);
        if (b >= 0) {
          text.assign(1, static_cast<char>(b));
        } else {
          breaks_run = true;
        }
        break;
      }
      case Kind::kFuse:
        break;
      case Kind::kReplace: {
        // A lone raw byte is not UTF-8 and cannot hold a UTF-8 pattern; skip it.
        if (!ValidateUtf8(text).ok()) break;
        ASSIGN_OR_RETURN(text, step.replace.Apply(text));
        break;
      }
      case Kind::kStrip:
        if (!step.after_fuse) {
          text = StripToken(text, step.pattern, step.start, step.stop);
        } else if (!state.strip_done) {
          size_t b = 0;
          while (state.stripped < step.start && std::string_view(text).substr(b).starts_with(step.pattern)) {
            b += step.pattern.size();
            ++state.stripped;
          }
          text.erase(0, b);
          if (!text.empty() || state.stripped >= step.start) state.strip_done = true;
        }
        break;
      case Kind::kMetaspace:
        text = MetaspaceToken(text, step.pattern, first && step.prepend);
        break;
    }
    ++state.count;
  }
  if (breaks_run) assembler_.Break(out);
  assembler_.Append(text, out);
  return absl::OkStatus();
}

void DecoderChain::Stream::Finish(std::string* out) {
  assembler_.Break(out);
  states_.assign(chain_->steps_.size(), StepState());
  tokens_ = 0;
}

}  // namespace shardserve::tokenizer_internal

#include "coordinator/frontend/reasoning.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace shardserve::coordinator::frontend {
namespace {

constexpr absl::string_view kStartTag = "<think>";
constexpr absl::string_view kEndTag = "</think>";

// The length of the longest tail of `text` that is a proper prefix of `tag`.
size_t PartialTagTail(absl::string_view text, absl::string_view tag) {
  for (size_t n = std::min(text.size(), tag.size() - 1); n > 0; --n) {
    if (absl::StartsWith(tag, text.substr(text.size() - n))) return n;
  }
  return 0;
}

}  // namespace

absl::StatusOr<ReasoningFormat> ParseReasoningFormat(absl::string_view name) {
  if (name == "deepseek_r1") return ReasoningFormat::kDeepSeekR1;
  if (name == "qwen3") return ReasoningFormat::kQwen3;
  return absl::InvalidArgumentError(absl::StrCat("unknown reasoning parser \"", name, "\"; use deepseek_r1 or qwen3"));
}

std::optional<ReasoningFormat> ReasoningFormatOf(absl::string_view name) {
  absl::StatusOr<ReasoningFormat> format = ParseReasoningFormat(name);
  if (!format.ok()) return std::nullopt;
  return *format;
}

void ReasoningStreamer::Drain(ReasoningSplit& out) {
  if (part_ == Part::kStart) {
    if (absl::StartsWith(held_, kStartTag)) {
      held_.erase(0, kStartTag.size());
      part_ = Part::kReasoning;
    } else if (absl::StartsWith(kStartTag, held_)) {
      return;  // may still be the opening tag
    } else {
      part_ = format_ == ReasoningFormat::kDeepSeekR1 ? Part::kReasoning : Part::kContent;
    }
  }
  if (part_ == Part::kReasoning) {
    const size_t end = held_.find(kEndTag.data(), 0, kEndTag.size());
    if (end == std::string::npos) {
      const size_t keep = PartialTagTail(held_, kEndTag);
      out.reasoning.append(held_, 0, held_.size() - keep);
      held_.erase(0, held_.size() - keep);
      return;
    }
    out.reasoning.append(held_, 0, end);
    held_.erase(0, end + kEndTag.size());
    part_ = Part::kContent;
  }
  out.content += held_;
  held_.clear();
}

ReasoningSplit ReasoningStreamer::Add(absl::string_view text) {
  ReasoningSplit out;
  held_.append(text.data(), text.size());
  Drain(out);
  return out;
}

ReasoningSplit ReasoningStreamer::Finish() {
  ReasoningSplit out;
  if (part_ == Part::kStart) {
    part_ = format_ == ReasoningFormat::kDeepSeekR1 ? Part::kReasoning : Part::kContent;
  }
  (part_ == Part::kReasoning ? out.reasoning : out.content) += held_;
  held_.clear();
  return out;
}

ReasoningSplit SplitReasoning(ReasoningFormat format, absl::string_view text) {
  ReasoningStreamer streamer(format);
  ReasoningSplit out = streamer.Add(text);
  ReasoningSplit rest = streamer.Finish();
  out.reasoning += rest.reasoning;
  out.content += rest.content;
  return out;
}

}  // namespace shardserve::coordinator::frontend

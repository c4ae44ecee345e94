#include "coordinator/frontend/reasoning.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "coordinator/frontend/harmony.h"

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
  if (name == "qwen3" || name == "glm45") return ReasoningFormat::kQwen3;
  if (name == "gpt_oss" || name == "openai_gptoss" || name == "harmony") return ReasoningFormat::kHarmony;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown reasoning parser \"", name, "\"; use deepseek_r1, qwen3 (also glm45) or gpt_oss"));
}

std::optional<ReasoningFormat> ReasoningFormatOf(absl::string_view name) {
  absl::StatusOr<ReasoningFormat> format = ParseReasoningFormat(name);
  if (!format.ok()) return std::nullopt;
  return *format;
}

void ReasoningStreamer::Drain(ReasoningSplit& out) {
  if (part_ == Part::kStart) {
    // Whitespace may come before the tag (GLM-4.5 writes "\n<think>" after its assistant tag).
    const absl::string_view t = absl::StripLeadingAsciiWhitespace(held_);
    if (absl::StartsWith(t, kStartTag)) {
      held_.erase(0, held_.size() - t.size() + kStartTag.size());
      part_ = Part::kReasoning;
    } else if (absl::StartsWith(kStartTag, t)) {
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

ReasoningStreamer::ReasoningStreamer(ReasoningFormat format, absl::string_view opened_header) : format_(format) {
  if (format_ == ReasoningFormat::kHarmony && !opened_header.empty()) {
    OpenHarmonyMessage(opened_header);
    harmony_ = Harmony::kBody;
    first_header_ = false;
  }
}

// The longest tail of `text` that may still become one of harmony's special tokens.
size_t PartialHarmonyTail(absl::string_view text) {
  size_t keep = 0;
  for (absl::string_view tag : {harmony::kStart, harmony::kEnd, harmony::kReturn, harmony::kCall}) {
    keep = std::max(keep, PartialTagTail(text, tag));
  }
  return keep;
}

void ReasoningStreamer::OpenHarmonyMessage(absl::string_view header) {
  const harmony::Header h = harmony::ParseHeader(header);
  function_.clear();
  arguments_.clear();
  if (absl::StartsWith(h.recipient, "functions.")) {
    destination_ = Destination::kCall;
    function_ = h.recipient.substr(absl::string_view("functions.").size());
  } else if (!h.recipient.empty() || h.channel == "analysis") {
    destination_ = Destination::kReasoning;  // the model's own thoughts, or a built-in tool's call
  } else {
    destination_ = Destination::kContent;  // final, or a preamble on commentary
  }
  // A second message of the reasoning, or of the content, starts on a line of its own.
  separate_ = (destination_ == Destination::kReasoning && reasoning_told_) ||
              (destination_ == Destination::kContent && content_told_);
}

void ReasoningStreamer::Deliver(ReasoningSplit& out, absl::string_view text) {
  if (text.empty()) return;
  if (separate_) {
    separate_ = false;
    if (destination_ == Destination::kReasoning) out.reasoning += '\n';
    if (destination_ == Destination::kContent) out.content += '\n';
  }
  reasoning_told_ |= destination_ == Destination::kReasoning;
  content_told_ |= destination_ == Destination::kContent;
  switch (destination_) {
    case Destination::kReasoning: out.reasoning.append(text.data(), text.size()); break;
    case Destination::kContent: out.content.append(text.data(), text.size()); break;
    case Destination::kCall: arguments_.append(text.data(), text.size()); break;
  }
}

void ReasoningStreamer::CloseHarmonyMessage(ReasoningSplit& out) {
  if (destination_ == Destination::kCall) {
    out.content += harmony::CallText(function_, arguments_);
    content_told_ = true;
  }
  separate_ = false;
  function_.clear();
  arguments_.clear();
}

void ReasoningStreamer::DrainHarmony(ReasoningSplit& out, bool finish) {
  while (true) {
    switch (harmony_) {
      case Harmony::kPlain:
        out.content += held_;
        held_.clear();
        return;
      case Harmony::kHeader: {
        if (first_header_) {
          // The answer opens with the rest of the header the prompt began ("<|channel|>...", or
          // " to=..." before the channel), or it is not harmony.
          const absl::string_view t = absl::StripLeadingAsciiWhitespace(held_);
          const bool header = absl::StartsWith(t, harmony::kChannel) || absl::StartsWith(harmony::kChannel, t) ||
                              absl::StartsWith(t, "to=") || absl::StartsWith("to=", t);
          if (!header && !t.empty()) {
            harmony_ = Harmony::kPlain;
            continue;
          }
        }
        const size_t at = held_.find(harmony::kMessage.data(), 0, harmony::kMessage.size());
        if (at == std::string::npos || at > kMaxHarmonyHeaderBytes) {
          if (held_.size() > kMaxHarmonyHeaderBytes) {
            harmony_ = Harmony::kPlain;
            continue;
          }
          if (finish) held_.clear();  // the answer stopped inside a header: it says nothing
          return;
        }
        OpenHarmonyMessage(absl::string_view(held_).substr(0, at));
        held_.erase(0, at + harmony::kMessage.size());
        first_header_ = false;
        harmony_ = Harmony::kBody;
        continue;
      }
      case Harmony::kBody: {
        // The message ends at <|end|>, <|return|> or <|call|> (the last two stop the answer, so
        // their text may never come), or where a new one starts.
        size_t at = std::string::npos;
        absl::string_view tag;
        for (absl::string_view t : {harmony::kEnd, harmony::kReturn, harmony::kCall, harmony::kStart}) {
          const size_t p = held_.find(t.data(), 0, t.size());
          if (p < at) {
            at = p;
            tag = t;
          }
        }
        if (at == std::string::npos) {
          const size_t keep = finish ? 0 : PartialHarmonyTail(held_);
          Deliver(out, absl::string_view(held_).substr(0, held_.size() - keep));
          held_.erase(0, held_.size() - keep);
          if (finish) CloseHarmonyMessage(out);
          return;
        }
        Deliver(out, absl::string_view(held_).substr(0, at));
        held_.erase(0, at + (tag == harmony::kStart ? 0 : tag.size()));
        CloseHarmonyMessage(out);
        harmony_ = Harmony::kBetween;
        stray_fresh_ = true;
        continue;
      }
      case Harmony::kBetween: {
        // Only <|start|> belongs here; the special tokens that end an answer (<|return|>, <|call|>,
        // an <|endoftext|> past ignore_eos) and blanks are dropped, other text is content.
        const size_t at = held_.find(harmony::kStart.data(), 0, harmony::kStart.size());
        size_t upto = at;
        if (at == std::string::npos) {
          // Hold back what may still become a special token: from a last "<" not closed by "|>".
          const size_t open = held_.rfind('<');
          upto = !finish && open != std::string::npos && held_.find("|>", open) == std::string::npos ? open
                                                                                                      : held_.size();
        }
        std::string stray = held_.substr(0, upto);
        for (size_t open = stray.find("<|"); open != std::string::npos; open = stray.find("<|", open)) {
          const size_t close = stray.find("|>", open + 2);
          if (close == std::string::npos) break;
          stray.erase(open, close + 2 - open);
        }
        // Stray text is content of its own: on a new line, leading blanks dropped.
        absl::string_view told = stray;
        if (stray_fresh_) told = absl::StripLeadingAsciiWhitespace(told);
        if (!told.empty()) {
          if (stray_fresh_ && content_told_) out.content += '\n';
          out.content.append(told.data(), told.size());
          content_told_ = true;
          stray_fresh_ = false;
        }
        if (at == std::string::npos) {
          held_.erase(0, upto);
          return;
        }
        held_.erase(0, at + harmony::kStart.size());
        harmony_ = Harmony::kHeader;
        continue;
      }
    }
  }
}

ReasoningSplit ReasoningStreamer::Add(absl::string_view text) {
  ReasoningSplit out;
  held_.append(text.data(), text.size());
  if (format_ == ReasoningFormat::kHarmony) {
    DrainHarmony(out, /*finish=*/false);
  } else {
    Drain(out);
  }
  return out;
}

ReasoningSplit ReasoningStreamer::Finish() {
  ReasoningSplit out;
  if (format_ == ReasoningFormat::kHarmony) {
    DrainHarmony(out, /*finish=*/true);
    return out;
  }
  if (part_ == Part::kStart) {
    part_ = format_ == ReasoningFormat::kDeepSeekR1 ? Part::kReasoning : Part::kContent;
  }
  (part_ == Part::kReasoning ? out.reasoning : out.content) += held_;
  held_.clear();
  return out;
}

ReasoningSplit SplitReasoning(ReasoningFormat format, absl::string_view text, absl::string_view opened_header) {
  ReasoningStreamer streamer(format, opened_header);
  ReasoningSplit out = streamer.Add(text);
  ReasoningSplit rest = streamer.Finish();
  out.reasoning += rest.reasoning;
  out.content += rest.content;
  return out;
}

}  // namespace shardserve::coordinator::frontend

// Reasoning models (vLLM's --reasoning-parser): a chat answer's text split into the model's
// reasoning, between <think> and </think>, and the answer's content after it, which the HTTP API
// returns as message.reasoning_content and message.content (and as deltas of each when streamed).
//
// Two formats, as vLLM names them:
//   * deepseek_r1: the answer starts in the reasoning (DeepSeek-R1's chat template opens the
//     <think> block in the prompt; a <think> the model writes first is dropped) and leaves it at
//     the first </think>. Without one, the whole text is reasoning.
//   * qwen3: the answer is reasoning only when it starts with <think> (Qwen3 thinks unless its
//     template's enable_thinking is false), up to the first </think>; else all of it is content.
// The text after </think> is content as it stands.
//
// Not thread-safe: one ReasoningStreamer per choice.
#ifndef SHARDSERVE_COORDINATOR_FRONTEND_REASONING_H_
#define SHARDSERVE_COORDINATOR_FRONTEND_REASONING_H_

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardserve::coordinator::frontend {

enum class ReasoningFormat { kDeepSeekR1, kQwen3 };

// "deepseek_r1" or "qwen3"; InvalidArgument naming the accepted ones otherwise.
absl::StatusOr<ReasoningFormat> ParseReasoningFormat(absl::string_view name);

// The format a --reasoning_parser value names, for a front end's options: none for "" (answers are
// not split), and none for a name ParseReasoningFormat refuses (the options are validated with it
// first).
std::optional<ReasoningFormat> ReasoningFormatOf(absl::string_view name);

struct ReasoningSplit {
  std::string reasoning;
  std::string content;
};

// Splits a text that arrives in pieces. Add returns what can be told so far: it holds back a tail
// that may still become a tag (at most 8 bytes, and only bytes of a tag, so whole UTF-8 pieces
// come out whole); Finish returns what was held back when the text ends.
class ReasoningStreamer {
 public:
  explicit ReasoningStreamer(ReasoningFormat format) : format_(format) {}

  ReasoningSplit Add(absl::string_view text);
  ReasoningSplit Finish();

 private:
  enum class Part { kStart, kReasoning, kContent };
  // Moves held_ (in `part_`) into `out` as far as it can be told.
  void Drain(ReasoningSplit& out);

  ReasoningFormat format_;
  Part part_ = Part::kStart;
  std::string held_;
};

// The split of a whole text (Add, then Finish).
ReasoningSplit SplitReasoning(ReasoningFormat format, absl::string_view text);

}  // namespace shardserve::coordinator::frontend

#endif  // SHARDSERVE_COORDINATOR_FRONTEND_REASONING_H_

// Reasoning models (vLLM's --reasoning-parser): a chat answer's text split into the model's
// reasoning, between <think> and </think>, and the answer's content after it, which the HTTP API
// returns as message.reasoning_content and message.content (and as deltas of each when streamed).
//
// Three formats:
//   * deepseek_r1: the answer starts in the reasoning (DeepSeek-R1's chat template opens the
//     <think> block in the prompt; a <think> the model writes first is dropped) and leaves it at
//     the first </think>. Without one, the whole text is reasoning.
//   * qwen3 (also glm45, vLLM's name for GLM-4.5's): the answer is reasoning only when it starts
//     with <think> (Qwen3 and GLM-4.5 think unless their template's enable_thinking is false), up
//     to the first </think>; else all of it is content.
//     In both, whitespace before a leading <think> goes with the tag, and the text after </think>
//     is content as it stands.
//   * gpt_oss: GPT-OSS's harmony messages (harmony.h), read from text decoded with its special
//     tokens spelled. The analysis channel, and calls to other recipients than the client's
//     functions (GPT-OSS's built-in browser and python tools), are reasoning; the final channel and
//     commentary without a recipient (a preamble) are content; a call to functions.NAME goes into
//     the content as harmony::CallText writes it, for the tool-call parser (format openai). The
//     markup goes; a second message of the reasoning, or of the content, starts on a new line. Text that does not open with a harmony header (the model ignored the format, or
//     a constraint shaped it) is content as it stands.
//
// Not thread-safe: one ReasoningStreamer per choice.
#ifndef SHARDSERVE_COORDINATOR_FRONTEND_REASONING_H_
#define SHARDSERVE_COORDINATOR_FRONTEND_REASONING_H_

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardserve::coordinator::frontend {

enum class ReasoningFormat { kDeepSeekR1, kQwen3, kHarmony };

// "deepseek_r1", "qwen3" (also "glm45"), or "gpt_oss" (also vLLM's "openai_gptoss", and "harmony");
// InvalidArgument naming the accepted ones otherwise.
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
// that may still become a tag (at most 12 bytes, and only bytes of a tag, so whole UTF-8 pieces
// come out whole), and in gpt_oss a message's header until it is complete (up to
// kMaxHarmonyHeaderBytes) and a call until it ends; Finish returns what was held back when the text
// ends.
class ReasoningStreamer {
 public:
  // `opened_header` (gpt_oss only): the prompt already opened a message with this header and its
  // <|message|> ("<|channel|>final" for structured output, a commentary header to one function
  // for a named tool choice), so the text starts in that message's body.
  explicit ReasoningStreamer(ReasoningFormat format, absl::string_view opened_header = "");

  ReasoningSplit Add(absl::string_view text);
  ReasoningSplit Finish();

  // A harmony header longer than this is not one: the text is taken as plain content.
  static constexpr size_t kMaxHarmonyHeaderBytes = 256;

 private:
  enum class Part { kStart, kReasoning, kContent };
  // Where a harmony answer is: in a message's header, in its text, between messages, or in text
  // that is not harmony at all.
  enum class Harmony { kHeader, kBody, kBetween, kPlain };
  enum class Destination { kReasoning, kContent, kCall };
  // Moves held_ (in `part_`) into `out` as far as it can be told.
  void Drain(ReasoningSplit& out);
  // The same for gpt_oss; `finish`: the text has ended, hold nothing back.
  void DrainHarmony(ReasoningSplit& out, bool finish);
  void OpenHarmonyMessage(absl::string_view header);
  void Deliver(ReasoningSplit& out, absl::string_view text);
  void CloseHarmonyMessage(ReasoningSplit& out);

  ReasoningFormat format_;
  Part part_ = Part::kStart;
  std::string held_;
  Harmony harmony_ = Harmony::kHeader;
  bool first_header_ = true;  // the header the prompt opened (it starts after "<|start|>assistant")
  Destination destination_ = Destination::kContent;
  std::string function_;   // a call's function (the recipient after "functions.")
  std::string arguments_;  // a call's text so far
  bool reasoning_told_ = false, content_told_ = false;  // some text has gone to each
  bool separate_ = false;  // the message's first text starts with a newline (a second message)
  bool stray_fresh_ = false;  // no text between these two messages has been told yet
};

// The split of a whole text (Add, then Finish).
ReasoningSplit SplitReasoning(ReasoningFormat format, absl::string_view text, absl::string_view opened_header = "");

}  // namespace shardserve::coordinator::frontend

#endif  // SHARDSERVE_COORDINATOR_FRONTEND_REASONING_H_

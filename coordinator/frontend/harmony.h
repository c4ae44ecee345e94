// GPT-OSS's harmony format, as a chat answer arrives when decoded with its special tokens spelled.
// The prompt ends with "<|start|>assistant", so the answer opens with the rest of a header:
//
//   <|channel|>analysis<|message|>The user asks about...<|end|>
//   <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>
//
// and a call to one of the client's functions is a message on the commentary channel addressed to
// it (the recipient may come before or after the channel):
//
//   <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>
//
// The reasoning split (reasoning.h, format gpt_oss) reads these messages; the tool-call parser
// (tool_calls.h, format openai) reads the calls it hands on, written as CallText writes them.
#ifndef SHARDSERVE_COORDINATOR_FRONTEND_HARMONY_H_
#define SHARDSERVE_COORDINATOR_FRONTEND_HARMONY_H_

#include <string>

#include "absl/strings/string_view.h"

namespace shardserve::coordinator::frontend::harmony {

inline constexpr absl::string_view kStart = "<|start|>";
inline constexpr absl::string_view kChannel = "<|channel|>";
inline constexpr absl::string_view kMessage = "<|message|>";
inline constexpr absl::string_view kEnd = "<|end|>";
inline constexpr absl::string_view kReturn = "<|return|>";  // the end of the answer (an EOS id)
inline constexpr absl::string_view kCall = "<|call|>";      // the end of a call (a stop id of harmony chats)
// The prefix of every call CallText writes.
inline constexpr absl::string_view kCallPrefix = "<|start|>assistant to=functions.";

// Whether a chat template writes the harmony format (it spells <|channel|> and <|message|>).
bool UsesHarmony(absl::string_view chat_template);

// What a message's header says: its channel ("analysis", "commentary", "final"; empty when it has
// none) and its recipient ("functions.get_weather", "browser.search"; empty when none).
struct Header {
  std::string channel;
  std::string recipient;
};
Header ParseHeader(absl::string_view header);

// A call of `function` with `arguments` (the message's text), as the chat template writes one:
// kCallPrefix, the name, "<|channel|>commentary json<|message|>", the arguments, kCall.
std::string CallText(absl::string_view function, absl::string_view arguments);

}  // namespace shardserve::coordinator::frontend::harmony

#endif  // SHARDSERVE_COORDINATOR_FRONTEND_HARMONY_H_

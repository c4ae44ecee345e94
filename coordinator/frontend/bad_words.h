// vLLM's bad_words: words kept out of a request's output, made the token sequences the scheduler
// bans (SequenceRequest::bad_words, coordinator/scheduler/next_token.h). Only these spellings are
// banned: the same word spelled with other tokens can still come.
//
// A word (its leading whitespace dropped) is banned as the model's tokenizer spells it alone, and
// as it spells it after a space when that spelling has as many tokens and starts with another one
// (tokenizers whose tokens carry the space before a word, as GPT-2's and Llama 3's do, spell a word
// in the middle of a text that way). Both are tokenized without special tokens.
#ifndef SHARDSERVE_COORDINATOR_FRONTEND_BAD_WORDS_H_
#define SHARDSERVE_COORDINATOR_FRONTEND_BAD_WORDS_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/tokenizer/tokenizer.h"

namespace shardserve::coordinator::frontend {

// Limits on a request's bad words (the same for the gRPC and the HTTP API).
inline constexpr size_t kMaxBadWords = 256;
inline constexpr size_t kMaxBadWordBytes = 256;

// The token sequences that ban `words`. InvalidArgument naming `field` when there are more than
// kMaxBadWords, and naming field[i] when word i is empty or only whitespace, longer than
// kMaxBadWordBytes, not valid UTF-8 (the tokenizer's error), or spelled with more than
// kMaxBadWordTokens (coordinator/scheduler/sequence.h) tokens.
absl::StatusOr<std::vector<std::vector<int32_t>>> BadWordSequences(const Tokenizer& tokenizer,
                                                                   absl::Span<const std::string> words,
                                                                   absl::string_view field);

}  // namespace shardserve::coordinator::frontend

#endif  // SHARDSERVE_COORDINATOR_FRONTEND_BAD_WORDS_H_

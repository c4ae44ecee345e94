// UTF-8 helpers shared by the tokenizers: validation of input text, and the byte assembler that
// lets a stream decoder emit only complete characters.
//
// "Valid" means well-formed UTF-8 per Unicode: no overlong forms, no surrogates (U+D800..U+DFFF),
// nothing above U+10FFFF.
#ifndef SHARDSERVE_COMMON_TOKENIZER_UTF8_H_
#define SHARDSERVE_COMMON_TOKENIZER_UTF8_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace shardserve {

// U+FFFD REPLACEMENT CHARACTER.
inline constexpr std::string_view kUtf8Replacement = "\xEF\xBF\xBD";

// OK when `text` is valid UTF-8; otherwise InvalidArgument naming the byte offset and value of the
// first byte that is not part of a valid character.
absl::Status ValidateUtf8(std::string_view text);

// Examines the bytes at the start of `s` (non-empty). Returns the length of the valid character
// there (1..4) and sets *complete = true; or, when they are not a complete valid character, returns
// how many leading bytes are a valid *prefix* of one (0 when s[0] cannot start a character) and
// sets *complete = false. A return value equal to s.size() with *complete = false means "might
// still become valid with more bytes".
size_t Utf8PrefixLength(std::string_view s, bool* complete);

// Decodes the character at the start of valid UTF-8 `s` (non-empty) and stores its length.
char32_t DecodeUtf8Char(std::string_view s, size_t* length);

// Appends the UTF-8 encoding of code point `c` (must be <= U+10FFFF and not a surrogate).
void AppendUtf8(char32_t c, std::string* out);

// Replaces every invalid sequence in `bytes` by U+FFFD, one per maximal subpart (Unicode's
// recommended practice; what Rust's String::from_utf8_lossy and Python's errors="replace" do).
std::string Utf8Lossy(std::string_view bytes);

// How a stream marks bytes that can never become a valid character.
enum class InvalidUtf8Policy {
  kPerByte,         // one U+FFFD per invalid byte (SentencePiece, HF ByteFallback)
  kMaximalSubpart,  // one U+FFFD per maximal subpart (HF ByteLevel's from_utf8_lossy)
};

// Accumulates the raw bytes of streamed tokens and releases complete characters.
// Not thread-safe.
class Utf8StreamAssembler {
 public:
  explicit Utf8StreamAssembler(InvalidUtf8Policy policy) : policy_(policy) {}

  // Adds `bytes` and appends to `out` every character that is now complete. Bytes that are a valid
  // prefix of a character stay pending; bytes that can no longer become valid are replaced.
  void Append(std::string_view bytes, std::string* out);

  // Ends a run of bytes: pending bytes can no longer be completed and are replaced.
  void Break(std::string* out);

  bool has_pending() const { return !pending_.empty(); }

 private:
  void Drain(bool final, std::string* out);

  InvalidUtf8Policy policy_;
  std::string pending_;  // at most 3 bytes between calls: a valid, incomplete prefix
};

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_TOKENIZER_UTF8_H_

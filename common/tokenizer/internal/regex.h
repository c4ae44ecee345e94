// Regular expressions of tokenizer.json (Split pre-tokenizers, Replace normalizers), run with PCRE2.
//
// The `tokenizers` library compiles these patterns with Oniguruma (Ruby syntax), whose Unicode
// classes differ from PCRE2's in a few escapes. Compile() rewrites those so the matches agree:
//   \s  Oniguruma: U+0009..U+000D, U+0085 and the Z categories. PCRE2 also matches U+180E.
//   \h  Oniguruma: a hexadecimal digit. PCRE2: horizontal white space.
//   \w  Oniguruma: letters, marks, decimal numbers, connector punctuation. PCRE2 10.42: \p{L},
//       \p{N} and '_'.
// and ^ / $ match at line boundaries, as in Ruby. Look-ahead and look-behind work as in Oniguruma.
// Known gap: Ruby's (?m) (dot matches newline) is PCRE2's (?s); patterns using inline (?m) are not
// translated (no tokenizer we know of uses it).
//
// Thread-safety: a compiled Regex is immutable; FindAll may run on several threads at once.
#ifndef SHARDSERVE_COMMON_TOKENIZER_INTERNAL_REGEX_H_
#define SHARDSERVE_COMMON_TOKENIZER_INTERNAL_REGEX_H_

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace shardserve::tokenizer_internal {

class Regex {
 public:
  // Compiles `pattern` (Oniguruma syntax). InvalidArgument with PCRE2's message and offset when it
  // does not compile.
  static absl::StatusOr<std::unique_ptr<Regex>> Compile(std::string_view pattern);

  // Compiles a literal string (every character matched as itself).
  static absl::StatusOr<std::unique_ptr<Regex>> CompileLiteral(std::string_view literal);

  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Appends the [begin, end) byte ranges of the successive non-overlapping leftmost matches in
  // `text`, which must be valid UTF-8. Empty matches are skipped. Internal error only if PCRE2
  // fails (e.g. out of memory).
  absl::Status FindAll(std::string_view text, std::vector<std::pair<size_t, size_t>>* matches) const;

  // Calls fn(begin, end) for the same matches, in order, without collecting them.
  absl::Status ForEachMatch(std::string_view text, absl::FunctionRef<void(size_t, size_t)> fn) const;

  // The PCRE2 pattern actually compiled, for tests and messages.
  const std::string& pcre2_pattern() const { return pcre2_pattern_; }

 private:
  struct Code;
  Regex() = default;

  std::unique_ptr<Code> code_;
  std::string pcre2_pattern_;
};

// Rewrites an Oniguruma pattern into PCRE2 syntax as described above. Exposed for tests.
std::string TranslateOnigurumaPattern(std::string_view pattern);

}  // namespace shardserve::tokenizer_internal

#endif  // SHARDSERVE_COMMON_TOKENIZER_INTERNAL_REGEX_H_

// tokenizer.json "normalizer": rewrites each stretch of text between added tokens before
// pre-tokenization. Supported types: Prepend, Replace (String or Regex pattern), NFC, NFD, NFKC,
// NFKD (through ICU), Strip, Sequence. Others are Unimplemented.
//
// Thread-safety: immutable after FromJson; Normalize may run on several threads at once.
#ifndef SHARDSERVE_COMMON_TOKENIZER_INTERNAL_NORMALIZER_H_
#define SHARDSERVE_COMMON_TOKENIZER_INTERNAL_NORMALIZER_H_

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tokenizer/internal/json_util.h"
#include "common/tokenizer/internal/replace_rule.h"
#include "common/tokenizer/internal/regex.h"

namespace shardserve::tokenizer_internal {

class Normalizer {
 public:
  // `j` is the "normalizer" value; null gives the identity.
  static absl::StatusOr<std::unique_ptr<Normalizer>> FromJson(const Json& j, const JsonWhere& where);

  bool is_identity() const { return steps_.empty(); }

  // Writes the normalized form of `in` (valid UTF-8) to `out`, which is overwritten.
  absl::Status Normalize(std::string_view in, std::string* out) const;

 private:
  enum class Kind { kPrepend, kReplace, kUnicode, kStrip };
  struct Step {
    Kind kind;
    std::string text;     // kPrepend: the prefix
    ReplaceRule replace;  // kReplace
    int unicode_form = 0;  // kUnicode: 0 NFC, 1 NFD, 2 NFKC, 3 NFKD
    bool strip_left = false;
    bool strip_right = false;
  };
  static absl::Status AddSteps(const Json& j, const JsonWhere& where, std::vector<Step>* steps);
  static absl::Status Apply(const Step& step, std::string_view in, std::string* out);

  std::vector<Step> steps_;
};

// Whether `c` has the Unicode White_Space property (Rust's char::is_whitespace).
bool IsUnicodeWhitespace(char32_t c);

}  // namespace shardserve::tokenizer_internal

#endif  // SHARDSERVE_COMMON_TOKENIZER_INTERNAL_NORMALIZER_H_

// The Hugging Face tokenizers "Replace" component, shared by normalizers and decoders:
// {"type": "Replace", "pattern": {"String": s} | {"Regex": r}, "content": c} replaces every
// non-overlapping match of the pattern, left to right, with c.
#ifndef SHARDSERVE_COMMON_TOKENIZER_INTERNAL_REPLACE_RULE_H_
#define SHARDSERVE_COMMON_TOKENIZER_INTERNAL_REPLACE_RULE_H_

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/tokenizer/internal/json_util.h"
#include "common/tokenizer/internal/regex.h"

namespace shardserve::tokenizer_internal {

struct ReplaceRule {
  std::string pattern;           // the literal string, or the regex source
  std::string content;           // the replacement
  std::unique_ptr<Regex> regex;  // null for a literal pattern

  // Parses the component's JSON object. InvalidArgument naming `where` for a missing or empty
  // pattern, or a regex that does not compile.
  static absl::StatusOr<ReplaceRule> Parse(const Json& j, const JsonWhere& where);
  // `in` with every match replaced.
  absl::StatusOr<std::string> Apply(std::string_view in) const;
};

}  // namespace shardserve::tokenizer_internal

#endif  // SHARDSERVE_COMMON_TOKENIZER_INTERNAL_REPLACE_RULE_H_

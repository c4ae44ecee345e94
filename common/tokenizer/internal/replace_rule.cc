#include "common/tokenizer/internal/replace_rule.h"

#include "common/status/macros.h"

namespace shardserve::tokenizer_internal {

absl::StatusOr<ReplaceRule> ReplaceRule::Parse(const Json& j, const JsonWhere& where) {
  ReplaceRule rule;
  const Json* pattern = JsonMember(j, "pattern");
  if (pattern == nullptr || !pattern->is_object()) return where.Child("pattern").Error("is missing or not an object");
  ASSIGN_OR_RETURN(rule.content, JsonString(j, "content", where));
  if (pattern->contains("String")) {
    ASSIGN_OR_RETURN(rule.pattern, JsonString(*pattern, "String", where.Child("pattern")));
    if (rule.pattern.empty()) return where.Child("pattern.String").Error("is empty");
  } else if (pattern->contains("Regex")) {
    ASSIGN_OR_RETURN(rule.pattern, JsonString(*pattern, "Regex", where.Child("pattern")));
    auto re = Regex::Compile(rule.pattern);
    if (!re.ok()) return where.Child("pattern.Regex").Error(std::string(re.status().message()));
    rule.regex = *std::move(re);
  } else {
    return where.Child("pattern").Error("has neither \"String\" nor \"Regex\"");
  }
  return rule;
}

absl::StatusOr<std::string> ReplaceRule::Apply(std::string_view in) const {
  std::string out;
  size_t pos = 0;
  auto replace = [&](size_t begin, size_t end) {
    out.append(in.data() + pos, begin - pos);
    out.append(content);
    pos = end;
  };
  if (regex == nullptr) {
    for (size_t hit; (hit = in.find(pattern, pos)) != std::string_view::npos;) replace(hit, hit + pattern.size());
  } else {
    std::vector<std::pair<size_t, size_t>> matches;
    RETURN_IF_ERROR(regex->FindAll(in, &matches));
    for (const auto& [b, e] : matches) replace(b, e);
  }
  out.append(in.data() + pos, in.size() - pos);
  return out;
}

}  // namespace shardserve::tokenizer_internal

#include "common/tokenizer/internal/post_processor.h"

#include "absl/strings/str_cat.h"
#include "common/status/macros.h"

namespace shardserve::tokenizer_internal {
namespace {

absl::StatusOr<int32_t> CheckedId(const Json& v, const JsonWhere& where, int64_t id_limit) {
  if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= id_limit ||
      (v.is_number_unsigned() && v.get<uint64_t>() >= static_cast<uint64_t>(id_limit))) {
    return where.Error(absl::StrCat("has id ", v.dump(), ", outside the vocabulary [0, ", id_limit, ")"));
  }
  return static_cast<int32_t>(v.get<int64_t>());
}

// A member of object `j`, or nullptr.
const Json* Member(const Json& j, const std::string& key) {
  if (!j.is_object()) return nullptr;
  auto it = j.find(key);
  return it == j.end() ? nullptr : &*it;
}

absl::StatusOr<SpecialAffixes> ParseTemplate(const Json& j, const JsonWhere& where, int64_t id_limit) {
  const Json* single = Member(j, "single");
  if (single == nullptr || !single->is_array()) return where.Child("single").Error("is missing or not a list");
  const Json* specials = Member(j, "special_tokens");
  SpecialAffixes affixes;
  bool seen_sequence = false;
  for (size_t i = 0; i < single->size(); ++i) {
    const JsonWhere at = where.Child("single").Index(i);
    const Json& piece = single->at(i);
    if (Member(piece, "Sequence") != nullptr) {
      if (seen_sequence) return at.Error("is a second sequence in a single-sequence template");
      seen_sequence = true;
      continue;
    }
    const Json* special = Member(piece, "SpecialToken");
    if (special == nullptr || !special->is_object()) {
      return at.Error("is neither {\"Sequence\": ...} nor {\"SpecialToken\": ...}");
    }
    ASSIGN_OR_RETURN(std::string name, JsonString(*special, "id", at.Child("SpecialToken")));
    const Json* entry = specials == nullptr ? nullptr : Member(*specials, name);
    if (entry == nullptr) return where.Child("special_tokens").Error(absl::StrCat("has no entry \"", name, "\""));
    const JsonWhere entry_where = where.Child("special_tokens").Child(name);
    const Json* ids = Member(*entry, "ids");
    if (ids == nullptr || !ids->is_array()) return entry_where.Child("ids").Error("is missing or not a list");
    for (const Json& id : *ids) {
      ASSIGN_OR_RETURN(int32_t checked, CheckedId(id, entry_where.Child("ids"), id_limit));
      (seen_sequence ? affixes.suffix : affixes.prefix).push_back(checked);
    }
  }
  if (!seen_sequence) return where.Child("single").Error("has no {\"Sequence\": ...} entry");
  return affixes;
}

// "cls": ["<s>", 0], "sep": ["</s>", 2].
absl::StatusOr<int32_t> PairId(const Json& j, const char* key, const JsonWhere& where, int64_t id_limit) {
  const Json* pair = JsonMember(j, key);
  if (pair == nullptr || !pair->is_array() || pair->size() != 2) {
    return where.Child(key).Error("is missing or not [token, id]");
  }
  return CheckedId(pair->at(1), where.Child(key), id_limit);
}

}  // namespace

absl::StatusOr<SpecialAffixes> ParsePostProcessor(const Json& j, const JsonWhere& where, int64_t id_limit) {
  if (j.is_null()) return SpecialAffixes{};
  ASSIGN_OR_RETURN(std::string type, JsonType(j, where));
  if (type == "TemplateProcessing") return ParseTemplate(j, where, id_limit);
  if (type == "ByteLevel") return SpecialAffixes{};
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    ASSIGN_OR_RETURN(int32_t cls, PairId(j, "cls", where, id_limit));
    ASSIGN_OR_RETURN(int32_t sep, PairId(j, "sep", where, id_limit));
    return SpecialAffixes{{cls}, {sep}};
  }
  if (type == "Sequence") {
    const Json* list = JsonMember(j, "processors");
    if (list == nullptr || !list->is_array()) return where.Child("processors").Error("is missing or not a list");
    SpecialAffixes all;
    size_t i = 0;
    for (const Json& e : *list) {
      ASSIGN_OR_RETURN(SpecialAffixes inner, ParsePostProcessor(e, where.Child("processors").Index(i++), id_limit));
      // Each processor wraps the output of the ones before it.
      inner.prefix.insert(inner.prefix.end(), all.prefix.begin(), all.prefix.end());
      all.suffix.insert(all.suffix.end(), inner.suffix.begin(), inner.suffix.end());
      all.prefix = std::move(inner.prefix);
    }
    return all;
  }
  return where.Unsupported(absl::StrCat("is a \"", type,
                                        "\" post-processor, which is not supported (supported: TemplateProcessing, "
                                        "ByteLevel, RobertaProcessing, BertProcessing, Sequence)"));
}

}  // namespace shardserve::tokenizer_internal

#include "common/tokenizer/internal/json_util.h"

#include "absl/strings/str_cat.h"
#include "common/tokenizer/internal/string_view.h"

namespace shardserve::tokenizer_internal {

JsonWhere JsonWhere::Child(std::string_view key) const {
  return JsonWhere{file, path.empty() ? std::string(key) : absl::StrCat(path, ".", AbslView(key))};
}

JsonWhere JsonWhere::Index(size_t i) const { return JsonWhere{file, absl::StrCat(path, "[", i, "]")}; }

absl::Status JsonWhere::Error(std::string_view what) const {
  return absl::InvalidArgumentError(
      absl::StrCat(AbslView(file), ": ", path.empty() ? "the document" : path, " ", AbslView(what)));
}

absl::Status JsonWhere::Unsupported(std::string_view what) const {
  return absl::UnimplementedError(
      absl::StrCat(AbslView(file), ": ", path.empty() ? "the document" : path, " ", AbslView(what)));
}

absl::StatusOr<std::string> JsonString(const Json& obj, std::string_view key, const JsonWhere& where) {
  auto it = obj.find(key);
  if (it == obj.end() || !it->is_string()) return where.Child(key).Error("is missing or not a string");
  return it->get<std::string>();
}

absl::StatusOr<std::string> JsonStringOr(const Json& obj, std::string_view key, std::string_view def,
                                         const JsonWhere& where) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return std::string(def);
  if (!it->is_string()) return where.Child(key).Error("is not a string");
  return it->get<std::string>();
}

absl::StatusOr<bool> JsonBoolOr(const Json& obj, std::string_view key, bool def, const JsonWhere& where) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return def;
  if (!it->is_boolean()) return where.Child(key).Error("is not true or false");
  return it->get<bool>();
}

absl::StatusOr<int64_t> JsonIntOr(const Json& obj, std::string_view key, int64_t def, int64_t min, int64_t max,
                                  const JsonWhere& where) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return def;
  if (!it->is_number_integer()) return where.Child(key).Error("is not an integer");
  if (it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(max)) {
    return where.Child(key).Error(absl::StrCat("is ", it->get<uint64_t>(), ", above ", max));
  }
  const int64_t v = it->get<int64_t>();
  if (v < min || v > max) return where.Child(key).Error(absl::StrCat("is ", v, ", outside [", min, ", ", max, "]"));
  return v;
}

const Json* JsonMember(const Json& obj, std::string_view key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(key);
  return it == obj.end() ? nullptr : &*it;
}

absl::StatusOr<std::string> JsonType(const Json& obj, const JsonWhere& where) {
  // Components nest through "Sequence"; the path grows with each level. A bound keeps a hostile
  // file from exhausting the stack of the recursive parsers.
  constexpr size_t kMaxPathLength = 2000;
  if (where.path.size() > kMaxPathLength) return where.Error("is nested too deeply");
  if (!obj.is_object()) return where.Error("is not a JSON object");
  return JsonString(obj, "type", where);
}

}  // namespace shardserve::tokenizer_internal

// Small helpers for reading tokenizer.json with errors that name the file and the JSON path.
#ifndef SHARDSERVE_COMMON_TOKENIZER_INTERNAL_JSON_UTIL_H_
#define SHARDSERVE_COMMON_TOKENIZER_INTERNAL_JSON_UTIL_H_

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace shardserve::tokenizer_internal {

using Json = nlohmann::json;

// Where a JSON value sits: the file and a path such as "pre_tokenizer.pretokenizers[1]".
struct JsonWhere {
  std::string_view file;
  std::string path;

  JsonWhere Child(std::string_view key) const;
  JsonWhere Index(size_t i) const;
  // InvalidArgument "<file>: <path> <what>".
  absl::Status Error(std::string_view what) const;
  // Unimplemented "<file>: <path> <what>".
  absl::Status Unsupported(std::string_view what) const;
};

// Typed access to a member of object `obj`; errors name the member.
absl::StatusOr<std::string> JsonString(const Json& obj, std::string_view key, const JsonWhere& where);
absl::StatusOr<std::string> JsonStringOr(const Json& obj, std::string_view key, std::string_view def,
                                         const JsonWhere& where);
absl::StatusOr<bool> JsonBoolOr(const Json& obj, std::string_view key, bool def, const JsonWhere& where);
absl::StatusOr<int64_t> JsonIntOr(const Json& obj, std::string_view key, int64_t def, int64_t min, int64_t max,
                                  const JsonWhere& where);
// A member of `obj`, or nullptr when `obj` is not an object or lacks it. (Pointers rather than
// iterators keep g++'s -Wnull-dereference quiet about nlohmann's iterators.)
const Json* JsonMember(const Json& obj, std::string_view key);
// The "type" member of a component object.
absl::StatusOr<std::string> JsonType(const Json& obj, const JsonWhere& where);

}  // namespace shardserve::tokenizer_internal

#endif  // SHARDSERVE_COMMON_TOKENIZER_INTERNAL_JSON_UTIL_H_

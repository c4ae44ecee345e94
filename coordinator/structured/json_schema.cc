#include "coordinator/structured/json_schema.h"

#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace shardserve::structured {
namespace {

using Json = nlohmann::ordered_json;

// One JSON string character: anything but '"', '\' and control characters, or an escape. \u
// escapes exclude the surrogate range, which strict parsers reject when unpaired.
constexpr char kStringChar[] =
    R"((?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u(?:[0-9a-cA-CeEfF][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2})))";

const absl::flat_hash_set<std::string>& Annotations() {
  static const auto* k = new absl::flat_hash_set<std::string>{
      "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly", "writeOnly"};
  return *k;
}

const absl::flat_hash_set<std::string>& Supported() {
  static const auto* k = new absl::flat_hash_set<std::string>{
      "type",     "properties", "required", "additionalProperties", "enum",     "const",    "items", "prefixItems",
      "minItems", "maxItems",   "minLength", "maxLength",           "anyOf",    "oneOf",    "allOf", "$ref",
      "$defs",    "definitions"};
  return *k;
}

std::string Group(const std::vector<std::string>& alternatives) {
  if (alternatives.size() == 1) return alternatives[0];
  return absl::StrCat("(?:", absl::StrJoin(alternatives, "|"), ")");
}

class Compiler {
 public:
  Compiler(const Json& root, const JsonRegexOptions& options) : root_(root), options_(options) {}

  std::string StringRegex(int32_t min, int32_t max) const {
    if (min == 0 && max < 0) return absl::StrCat("\"", kStringChar, "*\"");
    return absl::StrCat("\"", kStringChar, "{", min, ",", max < 0 ? std::string() : absl::StrCat(max), "}\"");
  }
  std::string IntegerRegex() const { return absl::StrCat("-?(?:0|[1-9][0-9]{0,", options_.max_int_digits - 1, "})"); }
  std::string NumberRegex() const {
    return absl::StrCat(IntegerRegex(), "(?:\\.[0-9]{1,", options_.max_fraction_digits, "})?(?:[eE][+-]?[0-9]{1,",
                        options_.max_exponent_digits, "})?");
  }
  std::string AnyValue(int depth) const {
    std::vector<std::string> alts = {StringRegex(0, -1), NumberRegex(), "true", "false", "null"};
    if (depth > 0) {
      alts.push_back(AnyObject(depth));
      const std::string v = AnyValue(depth - 1);
      alts.push_back(absl::StrCat("\\[(?:", v, "(?:,", v, ")*)?\\]"));
    }
    return Group(alts);
  }
  std::string AnyObject(int depth) const {
    const std::string v = AnyValue(depth - 1);
    const std::string member = absl::StrCat(StringRegex(0, -1), ":", v);
    return absl::StrCat("\\{(?:", member, "(?:,", member, ")*)?\\}");
  }

  absl::StatusOr<std::string> Compile(const Json& s, const std::string& where, int ref_depth) {
    if (s.is_boolean()) {
      if (s.get<bool>()) return AnyValue(options_.any_value_depth);
      return Error(where, "the schema false matches nothing");
    }
    if (!s.is_object()) return Error(where, "a schema must be an object or a boolean");
    for (const auto& [key, value] : s.items()) {
      if (!Supported().contains(key) && !Annotations().contains(key)) {
        return absl::InvalidArgumentError(
            absl::StrCat("unsupported JSON Schema keyword \"", key, "\" at ", where.empty() ? "/" : where));
      }
    }
    if (s.contains("$ref")) {
      const Json& ref = s["$ref"];
      if (!ref.is_string()) return Error(where, "$ref must be a string");
      const std::string r = ref.get<std::string>();
      const Json* target = nullptr;
      for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
        const std::string p = prefix;
        if (r.rfind(p, 0) == 0) {
          const std::string name = r.substr(p.size());
          const std::string section = p.substr(2, p.size() - 3);
          if (root_.contains(section) && root_[section].is_object() && root_[section].contains(name)) {
            target = &root_[section][name];
          }
        }
      }
      if (r == "#") target = &root_;
      if (target == nullptr) return Error(where, absl::StrCat("$ref \"", r, "\" does not name an entry of $defs or definitions"));
      if (ref_depth >= options_.max_ref_depth) return Error(where, absl::StrCat("recursive $ref \"", r, "\" is not supported"));
      Json merged = *target;
      if (merged.is_object()) {
        for (const auto& [key, value] : s.items()) {
          if (key != "$ref" && !Annotations().contains(key)) merged[key] = value;
        }
      }
      return Compile(merged, where + "/$ref", ref_depth + 1);
    }
    for (const char* combiner : {"anyOf", "oneOf", "allOf"}) {
      if (!s.contains(combiner)) continue;
      const Json& list = s[combiner];
      const std::string at = absl::StrCat(where, "/", combiner);
      if (!list.is_array() || list.empty()) return Error(at, "must be a non-empty array of schemas");
      if (std::string(combiner) == "allOf" && list.size() != 1) return Error(at, "allOf with more than one schema is not supported");
      Json rest = s;
      rest.erase(combiner);
      std::vector<std::string> alts;
      for (size_t i = 0; i < list.size(); ++i) {
        Json branch = list[i];
        if (branch.is_object()) {
          for (const auto& [key, value] : rest.items()) {
            if (!branch.contains(key)) branch[key] = value;
          }
        } else if (branch.is_boolean() && branch.get<bool>()) {
          branch = rest;
        }
        auto r = Compile(branch, absl::StrCat(at, "/", i), ref_depth);
        if (!r.ok()) return r.status();
        alts.push_back(*std::move(r));
      }
      return Group(alts);
    }
    if (s.contains("const")) return RegexLiteral(s["const"].dump());
    if (s.contains("enum")) {
      const Json& e = s["enum"];
      if (!e.is_array() || e.empty()) return Error(where + "/enum", "must be a non-empty array");
      std::vector<std::string> alts;
      for (const Json& v : e) alts.push_back(RegexLiteral(v.dump()));
      return Group(alts);
    }
    std::vector<std::string> types;
    if (s.contains("type")) {
      const Json& t = s["type"];
      if (t.is_string()) {
        types.push_back(t.get<std::string>());
      } else if (t.is_array() && !t.empty()) {
        for (const Json& x : t) {
          if (!x.is_string()) return Error(where + "/type", "must be a type name or a list of them");
          types.push_back(x.get<std::string>());
        }
      } else {
        return Error(where + "/type", "must be a type name or a list of them");
      }
    } else if (s.contains("properties") || s.contains("required") || s.contains("additionalProperties")) {
      types.push_back("object");
    } else if (s.contains("items") || s.contains("prefixItems") || s.contains("minItems") || s.contains("maxItems")) {
      types.push_back("array");
    } else if (s.contains("minLength") || s.contains("maxLength")) {
      types.push_back("string");
    } else {
      return AnyValue(options_.any_value_depth);
    }
    std::vector<std::string> alts;
    for (const std::string& type : types) {
      absl::StatusOr<std::string> r;
      if (type == "string") {
        r = CompileString(s, where);
      } else if (type == "integer") {
        r = IntegerRegex();
      } else if (type == "number") {
        r = NumberRegex();
      } else if (type == "boolean") {
        r = std::string("(?:true|false)");
      } else if (type == "null") {
        r = std::string("null");
      } else if (type == "object") {
        r = CompileObject(s, where, ref_depth);
      } else if (type == "array") {
        r = CompileArray(s, where, ref_depth);
      } else {
        return Error(where + "/type", absl::StrCat("unknown type \"", type, "\""));
      }
      if (!r.ok()) return r.status();
      alts.push_back(*std::move(r));
    }
    return Group(alts);
  }

 private:
  static absl::Status Error(const std::string& where, absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("JSON Schema at ", where.empty() ? "/" : where, ": ", what));
  }

  absl::StatusOr<int32_t> Count(const Json& s, const char* key, const std::string& where, int32_t dflt, int32_t limit) {
    if (!s.contains(key)) return dflt;
    const Json& v = s[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 0) return Error(absl::StrCat(where, "/", key), "must be an integer >= 0");
    if (v.get<int64_t>() > limit) {
      return Error(absl::StrCat(where, "/", key), absl::StrCat("values above ", limit, " are not supported"));
    }
    return static_cast<int32_t>(v.get<int64_t>());
  }

  absl::StatusOr<std::string> CompileString(const Json& s, const std::string& where) {
    auto min = Count(s, "minLength", where, 0, 1000);
    if (!min.ok()) return min.status();
    auto max = Count(s, "maxLength", where, -1, 1000);
    if (!max.ok()) return max.status();
    if (*max >= 0 && *max < *min) return Error(where, "maxLength < minLength");
    return StringRegex(*min, *max);
  }

  absl::StatusOr<std::string> CompileArray(const Json& s, const std::string& where, int ref_depth) {
    auto min = Count(s, "minItems", where, 0, options_.max_items);
    if (!min.ok()) return min.status();
    auto max = Count(s, "maxItems", where, -1, options_.max_items);
    if (!max.ok()) return max.status();
    if (*max >= 0 && *max < *min) return Error(where, "maxItems < minItems");
    if (s.contains("prefixItems")) {
      const Json& p = s["prefixItems"];
      if (!p.is_array()) return Error(where + "/prefixItems", "must be an array of schemas");
      if (static_cast<int32_t>(p.size()) < *min || (*max >= 0 && static_cast<int32_t>(p.size()) > *max)) {
        return Error(where + "/prefixItems", "a tuple whose length is outside minItems..maxItems is not supported");
      }
      std::vector<std::string> parts;
      for (size_t i = 0; i < p.size(); ++i) {
        auto r = Compile(p[i], absl::StrCat(where, "/prefixItems/", i), ref_depth);
        if (!r.ok()) return r.status();
        parts.push_back(*std::move(r));
      }
      return absl::StrCat("\\[", absl::StrJoin(parts, ","), "\\]");
    }
    std::string item;
    if (s.contains("items")) {
      auto r = Compile(s["items"], where + "/items", ref_depth);
      if (!r.ok()) return r.status();
      item = *std::move(r);
    } else {
      item = AnyValue(options_.any_value_depth - 1);
    }
    if (*max == 0) return std::string("\\[\\]");
    const std::string more_max = *max < 0 ? std::string() : absl::StrCat(*max - 1);
    if (*min == 0) return absl::StrCat("\\[(?:", item, "(?:,", item, "){0,", more_max, "})?\\]");
    return absl::StrCat("\\[", item, "(?:,", item, "){", *min - 1, ",", more_max, "}\\]");
  }

  absl::StatusOr<std::string> CompileObject(const Json& s, const std::string& where, int ref_depth) {
    if (s.contains("additionalProperties") && !s["additionalProperties"].is_boolean() &&
        !s["additionalProperties"].is_object()) {
      return Error(where + "/additionalProperties", "must be a boolean or a schema");
    }
    if (!s.contains("properties")) {
      if (s.contains("required") && s["required"].is_array() && !s["required"].empty()) {
        return Error(where + "/required", "required properties that are not listed in properties");
      }
      // Any object (when extra properties are allowed), or only the empty one.
      const bool closed = s.contains("additionalProperties") && s["additionalProperties"].is_boolean() &&
                          !s["additionalProperties"].get<bool>();
      return closed ? std::string("\\{\\}") : AnyObject(options_.any_value_depth);
    }
    const Json& props = s["properties"];
    if (!props.is_object()) return Error(where + "/properties", "must be an object");
    absl::flat_hash_set<std::string> required;
    if (s.contains("required")) {
      const Json& r = s["required"];
      if (!r.is_array()) return Error(where + "/required", "must be an array of names");
      for (const Json& x : r) {
        if (!x.is_string()) return Error(where + "/required", "must be an array of names");
        if (!props.contains(x.get<std::string>())) {
          return Error(where + "/required", absl::StrCat("\"", x.get<std::string>(), "\" is not in properties"));
        }
        required.insert(x.get<std::string>());
      }
    }
    struct Prop {
      std::string regex;  // "name":value
      bool required;
    };
    std::vector<Prop> list;
    // ordered_json keeps the order of the schema text: properties come out in that order.
    for (const auto& [name, sub] : props.items()) {
      auto v = Compile(sub, absl::StrCat(where, "/properties/", name), ref_depth);
      if (!v.ok()) return v.status();
      list.push_back({absl::StrCat(RegexLiteral(Json(name).dump()), ":", *v), required.contains(name)});
    }
    // tail[i]: the properties from i on, each present one preceded by a comma.
    std::vector<std::string> tail(list.size() + 1);
    for (size_t i = list.size(); i-- > 0;) {
      tail[i] = list[i].required ? absl::StrCat(",", list[i].regex, tail[i + 1])
                                 : absl::StrCat("(?:,", list[i].regex, ")?", tail[i + 1]);
    }
    // The first present property is k: every optional one before it is absent.
    std::vector<std::string> alts;
    bool all_optional = true;
    for (size_t k = 0; k < list.size(); ++k) {
      alts.push_back(absl::StrCat(list[k].regex, tail[k + 1]));
      if (list[k].required) {
        all_optional = false;
        break;
      }
    }
    std::string body = alts.empty() ? std::string() : Group(alts);
    if (all_optional && !body.empty()) body = absl::StrCat("(?:", body, ")?");
    return absl::StrCat("\\{", body, "\\}");
  }

  const Json& root_;
  const JsonRegexOptions& options_;
};

}  // namespace

std::string RegexLiteral(absl::string_view literal) {
  std::string out;
  for (char c : literal) {
    if (absl::string_view("\\^$.|?*+()[]{}/-\"").find(c) != absl::string_view::npos) out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

std::string JsonObjectRegex(const JsonRegexOptions& options) {
  const Json empty;
  return Compiler(empty, options).AnyObject(options.any_value_depth);
}

absl::StatusOr<std::string> JsonSchemaRegex(absl::string_view schema_json, const JsonRegexOptions& options) {
  const Json schema = Json::parse(schema_json, nullptr, /*allow_exceptions=*/false);
  if (schema.is_discarded()) return absl::InvalidArgumentError("JSON Schema: not valid JSON");
  if (!schema.is_object() && !schema.is_boolean()) {
    return absl::InvalidArgumentError("JSON Schema: must be an object or a boolean");
  }
  return Compiler(schema, options).Compile(schema, "", 0);
}

}  // namespace shardserve::structured

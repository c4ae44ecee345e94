// A small JSON Schema validator for tests: checks an instance against the subset of JSON Schema that
// coordinator/structured/json_schema.h compiles (type, properties, required, additionalProperties,
// enum, const, items, prefixItems, minItems, maxItems, minLength, maxLength, anyOf, oneOf, allOf,
// $ref to $defs/definitions). Written independently of the compiler so that it can judge it.
#ifndef SHARDSERVE_TESTS_COORDINATOR_STRUCTURED_JSON_VALIDATOR_H_
#define SHARDSERVE_TESTS_COORDINATOR_STRUCTURED_JSON_VALIDATOR_H_

#include <cmath>
#include <string>

#include "nlohmann/json.hpp"

namespace shardserve::testing_json {

using Json = nlohmann::ordered_json;

inline size_t CodePointCount(const std::string& s) {
  size_t n = 0;
  for (char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

// Empty when `v` validates against `s`; else why not (with the path).
inline std::string Validate(const Json& v, const Json& s, const Json& root, const std::string& path = "$") {
  if (s.is_boolean()) return s.get<bool>() ? "" : path + ": schema false";
  if (s.contains("$ref")) {
    const std::string ref = s["$ref"].get<std::string>();
    for (const std::string prefix : {"#/$defs/", "#/definitions/"}) {
      if (ref.rfind(prefix, 0) == 0) {
        const std::string section = prefix.substr(2, prefix.size() - 3);
        Json target = root[section][ref.substr(prefix.size())];
        for (const auto& [k, x] : s.items()) {
          if (k != "$ref") target[k] = x;
        }
        return Validate(v, target, root, path);
      }
    }
    return path + ": unresolved $ref";
  }
  if (s.contains("anyOf") || s.contains("oneOf")) {
    const Json& list = s.contains("anyOf") ? s["anyOf"] : s["oneOf"];
    int matches = 0;
    for (const Json& b : list) matches += Validate(v, b, root, path).empty();
    if (matches == 0) return path + ": no anyOf/oneOf branch matches";
    if (s.contains("oneOf") && matches > 1) return path + ": several oneOf branches match";
  }
  if (s.contains("allOf")) {
    for (const Json& b : s["allOf"]) {
      std::string e = Validate(v, b, root, path);
      if (!e.empty()) return e;
    }
  }
  if (s.contains("const") && v != s["const"]) return path + ": not the const " + s["const"].dump();
  if (s.contains("enum")) {
    bool found = false;
    for (const Json& e : s["enum"]) found = found || v == e;
    if (!found) return path + ": not in the enum";
  }
  if (s.contains("type")) {
    Json types = s["type"].is_array() ? s["type"] : Json::array({s["type"]});
    bool ok = false;
    for (const Json& t : types) {
      const std::string n = t.get<std::string>();
      ok = ok || (n == "object" && v.is_object()) || (n == "array" && v.is_array()) || (n == "string" && v.is_string()) ||
           (n == "number" && v.is_number()) || (n == "boolean" && v.is_boolean()) || (n == "null" && v.is_null()) ||
           (n == "integer" && (v.is_number_integer() || (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>())));
    }
    if (!ok) return path + ": wrong type for " + s["type"].dump() + ": " + v.dump();
  }
  if (v.is_object()) {
    if (s.contains("required")) {
      for (const Json& r : s["required"]) {
        if (!v.contains(r.get<std::string>())) return path + ": missing required " + r.get<std::string>();
      }
    }
    for (const auto& [k, x] : v.items()) {
      if (s.contains("properties") && s["properties"].contains(k)) {
        std::string e = Validate(x, s["properties"][k], root, path + "." + k);
        if (!e.empty()) return e;
      } else if (s.contains("additionalProperties")) {
        std::string e = Validate(x, s["additionalProperties"], root, path + "." + k);
        if (!e.empty()) return path + ": additional property " + k;
      }
    }
  }
  if (v.is_array()) {
    if (s.contains("minItems") && v.size() < s["minItems"].get<size_t>()) return path + ": too few items";
    if (s.contains("maxItems") && v.size() > s["maxItems"].get<size_t>()) return path + ": too many items";
    size_t first = 0;
    if (s.contains("prefixItems")) {
      for (; first < s["prefixItems"].size() && first < v.size(); ++first) {
        std::string e = Validate(v[first], s["prefixItems"][first], root, path + "[" + std::to_string(first) + "]");
        if (!e.empty()) return e;
      }
    }
    if (s.contains("items")) {
      for (size_t i = first; i < v.size(); ++i) {
        std::string e = Validate(v[i], s["items"], root, path + "[" + std::to_string(i) + "]");
        if (!e.empty()) return e;
      }
    }
  }
  if (v.is_string()) {
    const size_t n = CodePointCount(v.get<std::string>());
    if (s.contains("minLength") && n < s["minLength"].get<size_t>()) return path + ": string too short";
    if (s.contains("maxLength") && n > s["maxLength"].get<size_t>()) return path + ": string too long";
  }
  return "";
}

}  // namespace shardserve::testing_json

#endif  // SHARDSERVE_TESTS_COORDINATOR_STRUCTURED_JSON_VALIDATOR_H_

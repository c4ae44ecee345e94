// JSON Schema (and "any JSON object") to a regular expression for ByteDfa (byte_dfa.h), in the way
// Outlines compiles schemas: the regex matches compact JSON text (no whitespace between tokens)
// that validates against the schema. Object properties come in the order the schema text lists them;
// optional ones (not in "required") may be left out. Numbers, strings and nesting are bounded so
// that the automaton stays finite (see JsonRegexOptions).
//
// Supported keywords: type (a name or a list of names: object, array, string, number, integer,
// boolean, null), properties, required, additionalProperties (false, true or a schema; no extra
// properties are ever generated, which every such schema allows), enum, const, items, prefixItems,
// minItems, maxItems, minLength, maxLength, anyOf, oneOf (generated as anyOf: a value that matches
// several branches is possible), allOf with a single schema, $ref to "#/$defs/..." or
// "#/definitions/..." (not recursive), and the annotations title, description, default, examples,
// $schema, $id, $comment, deprecated, readOnly, writeOnly. Any other keyword is InvalidArgument
// naming it and where it is ("unsupported JSON Schema keyword \"pattern\" at /properties/name").
//
// Pure functions; thread-safe.
#ifndef SHARDSERVE_COORDINATOR_STRUCTURED_JSON_SCHEMA_H_
#define SHARDSERVE_COORDINATOR_STRUCTURED_JSON_SCHEMA_H_

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace shardserve::structured {

struct JsonRegexOptions {
  int32_t max_int_digits = 16;       // digits of an integer part
  int32_t max_fraction_digits = 16;  // digits after the decimal point
  int32_t max_exponent_digits = 2;  // keeps every number within double range
  int32_t any_value_depth = 3;       // nesting of arrays/objects in a value with no schema
  int32_t max_ref_depth = 16;        // $ref expansions along one path
  int32_t max_items = 64;            // the largest minItems/maxItems accepted
};

// The regex of any JSON object (OpenAI's response_format {"type": "json_object"}), nested up to
// any_value_depth levels.
std::string JsonObjectRegex(const JsonRegexOptions& options = {});

// The regex for `schema_json` (a JSON Schema as JSON text). InvalidArgument for text that is not
// JSON, a schema that is not an object or boolean, an unsupported keyword or value (named), a
// recursive $ref, or bounds beyond the options.
absl::StatusOr<std::string> JsonSchemaRegex(absl::string_view schema_json, const JsonRegexOptions& options = {});

// The regex that matches exactly `literal` (every special character escaped).
std::string RegexLiteral(absl::string_view literal);

}  // namespace shardserve::structured

#endif  // SHARDSERVE_COORDINATOR_STRUCTURED_JSON_SCHEMA_H_

// The JSON Schemas of the structured-output tests: nested objects, arrays, enums, numbers, strings
// (with escapes), optional fields, anyOf, $ref. Each must compile; every generated output must
// validate (json_validator.h). Strings and arrays are bounded (maxLength, maxItems) or short by
// nature: the tiny test model writes stories inside an unbounded string and rarely closes it
// within its 512-token context (free-form values are tested with a logit bias instead).
#ifndef SHARDSERVE_TESTS_COORDINATOR_STRUCTURED_TEST_SCHEMAS_H_
#define SHARDSERVE_TESTS_COORDINATOR_STRUCTURED_TEST_SCHEMAS_H_

namespace shardserve::testing_json {

inline constexpr const char* kTestSchemas[] = {
    R"({"type":"object","properties":{"name":{"type":"string","maxLength":12}},"required":["name"],"additionalProperties":false})",
    R"({"type":"object","properties":{"age":{"type":"integer"}},"required":["age"]})",
    R"({"type":"object","properties":{"ok":{"type":"boolean"}},"required":["ok"]})",
    R"({"type":"object","properties":{"x":{"type":"number"},"y":{"type":"number"}},"required":["x","y"]})",
    R"({"type":"object","properties":{"v":{"type":"null"}},"required":["v"]})",
    R"({"type":"object","properties":{"color":{"enum":["red","green","blue"]}},"required":["color"]})",
    R"({"type":"object","properties":{"n":{"enum":[1,2,3.5,null,true]}},"required":["n"]})",
    R"({"type":"object","properties":{"kind":{"const":"point"},"x":{"type":"integer"}},"required":["kind","x"]})",
    R"({"type":"array","items":{"type":"integer"},"maxItems":4})",
    R"({"type":"array","items":{"type":"boolean"},"minItems":2,"maxItems":3})",
    R"({"type":"array","items":{"type":"string","maxLength":5},"minItems":1,"maxItems":3})",
    R"({"type":"object","properties":{"tags":{"type":"array","items":{"enum":["a","b","c"]},"maxItems":5}},"required":["tags"]})",
    R"({"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"string","maxLength":8},"c":{"type":"boolean"}},"required":["b"]})",
    R"({"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"integer"}}})",
    R"({"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"integer"},"c":{"type":"integer"}},"required":["c"]})",
    R"({"type":"object","properties":{"first":{"type":"string","maxLength":6},"last":{"type":"string","maxLength":6},"middle":{"type":"string","maxLength":6}},"required":["first","last"],"additionalProperties":false})",
    R"({"type":"object","properties":{"user":{"type":"object","properties":{"id":{"type":"integer"},"name":{"type":"string","maxLength":10}},"required":["id","name"]}},"required":["user"]})",
    R"({"type":"object","properties":{"a":{"type":"object","properties":{"b":{"type":"object","properties":{"c":{"type":"integer"}},"required":["c"]}},"required":["b"]}},"required":["a"]})",
    R"({"type":"object","properties":{"points":{"type":"array","items":{"type":"object","properties":{"x":{"type":"integer"},"y":{"type":"integer"}},"required":["x","y"]},"maxItems":3}},"required":["points"]})",
    R"({"type":"object","properties":{"matrix":{"type":"array","items":{"type":"array","items":{"type":"integer"},"maxItems":3},"maxItems":3}},"required":["matrix"]})",
    R"({"type":"object","properties":{"value":{"type":["string","null"],"maxLength":4}},"required":["value"]})",
    R"({"type":"object","properties":{"value":{"anyOf":[{"type":"integer"},{"type":"string","maxLength":5}]}},"required":["value"]})",
    R"({"anyOf":[{"type":"object","properties":{"cat":{"type":"string","maxLength":5}},"required":["cat"]},{"type":"object","properties":{"dog":{"type":"integer"}},"required":["dog"]}]})",
    R"({"type":"object","properties":{"id":{"type":"integer"},"status":{"enum":["open","closed","pending"]},"priority":{"type":"integer"}},"required":["id","status"]})",
    R"({"type":"object","properties":{"title":{"type":"string","minLength":1,"maxLength":10},"done":{"type":"boolean"}},"required":["title","done"],"additionalProperties":false})",
    R"({"type":"object","properties":{"price":{"type":"number"},"currency":{"enum":["USD","EUR","JPY"]}},"required":["price","currency"]})",
    R"({"type":"object","properties":{"lat":{"type":"number"},"lon":{"type":"number"},"label":{"type":"string","maxLength":8}},"required":["lat","lon"]})",
    R"({"$defs":{"pt":{"type":"object","properties":{"x":{"type":"integer"},"y":{"type":"integer"}},"required":["x","y"]}},"type":"object","properties":{"from":{"$ref":"#/$defs/pt"},"to":{"$ref":"#/$defs/pt"}},"required":["from","to"]})",
    R"({"definitions":{"name":{"type":"string","maxLength":6}},"type":"array","items":{"$ref":"#/definitions/name"},"maxItems":3})",
    R"({"type":"object","properties":{"quote":{"type":"string","maxLength":16}},"required":["quote"],"description":"strings may hold escapes such as \\n and \\\""})",
    R"({"type":"object","properties":{"path":{"type":"string","maxLength":10},"recursive":{"type":"boolean"}},"required":["path"]})",
    R"({"type":"object","properties":{"a":{"type":"array","items":{"type":"number"},"maxItems":4},"b":{"type":"array","items":{"type":"null"},"maxItems":2}},"required":["a","b"]})",
    R"({"type":"object","properties":{"answer":{"enum":["yes","no"]},"confidence":{"type":"number"}},"required":["answer","confidence"],"additionalProperties":false})",
    R"({"type":"object","properties":{"event":{"type":"object","properties":{"name":{"type":"string","maxLength":8},"year":{"type":"integer"},"tags":{"type":"array","items":{"type":"string","maxLength":4},"maxItems":2}},"required":["name","year"]}},"required":["event"]})",
    R"({"type":"object","properties":{"k1":{"type":"integer"},"k2":{"type":"integer"},"k3":{"type":"integer"},"k4":{"type":"integer"},"k5":{"type":"integer"}},"required":["k1","k5"]})",
    R"({"type":"object","properties":{"empty":{"type":"object","additionalProperties":false}},"required":["empty"]})",
    R"({"type":"object","properties":{"list":{"type":"array","maxItems":0}},"required":["list"]})",
    R"({"type":"array","prefixItems":[{"type":"string","maxLength":3},{"type":"integer"},{"type":"boolean"}]})",
    R"({"type":"object","properties":{"mode":{"anyOf":[{"const":"auto"},{"type":"integer"}]}},"required":["mode"]})",
    R"({"type":"object","properties":{"ids":{"type":"array","items":{"type":"integer"},"minItems":1,"maxItems":5},"total":{"type":"integer"}},"required":["ids","total"]})",
    R"({"type":"object","properties":{"ratio":{"type":"number"},"flag":{"type":["boolean","null"]}},"required":["ratio","flag"]})",
    R"({"type":"object","properties":{"person":{"type":"object","properties":{"name":{"type":"string","maxLength":8},"address":{"type":"object","properties":{"city":{"type":"string","maxLength":8},"zip":{"type":"string","minLength":5,"maxLength":5}},"required":["city"]}},"required":["name","address"]}},"required":["person"]})",
    R"({"type":"object","properties":{"level":{"enum":["debug","info","warn","error"]},"msg":{"type":"string","maxLength":12},"code":{"type":"integer"}},"required":["level","msg"]})",
    R"({"type":"object","properties":{"steps":{"type":"array","items":{"type":"object","properties":{"op":{"enum":["add","sub"]},"arg":{"type":"number"}},"required":["op","arg"],"additionalProperties":false},"minItems":1,"maxItems":3}},"required":["steps"]})",
    R"({"type":"string","maxLength":20})",
    R"({"type":"integer"})",
    R"({"type":"number"})",
    R"({"enum":["alpha","beta","gamma",42,false]})",
    R"({"type":"object","properties":{"data":{}},"required":["data"]})",
    R"({"type":"object","properties":{"meta":{"type":"object","properties":{"k":{"type":"string","maxLength":5}}}},"required":["meta"]})",
    R"({"type":"object","properties":{"items":{"type":"array","items":{"anyOf":[{"type":"integer"},{"type":"null"}]},"maxItems":4}},"required":["items"]})",
    R"({"type":"object","properties":{"unicode":{"type":"string","maxLength":6},"n":{"type":"integer"}},"required":["unicode","n"],"title":"Unicode test"})",
    R"({"type":"object","properties":{"a":{"type":"boolean"},"b":{"type":"boolean"},"c":{"type":"boolean"},"d":{"type":"boolean"}},"required":["a","b","c","d"],"additionalProperties":false})",
    R"({"type":"object","properties":{"score":{"type":"integer"},"grade":{"enum":["A","B","C","D","F"]},"comment":{"type":["string","null"],"maxLength":10}},"required":["score","grade"]})",
    R"({"allOf":[{"type":"object","properties":{"id":{"type":"integer"}},"required":["id"]}]})",
};

}  // namespace shardserve::testing_json

#endif  // SHARDSERVE_TESTS_COORDINATOR_STRUCTURED_TEST_SCHEMAS_H_

// Tool calls: parsing both formats (malformed text degrades to content), the streamer against the
// whole-text parser on every split of the text, the constraint regex (its matches parse back into
// calls whose arguments validate), and format detection from the committed model templates.
#include "coordinator/frontend/tool_calls.h"

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "coordinator/frontend/harmony.h"
#include "coordinator/structured/byte_dfa.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardserve::coordinator::frontend {
namespace {

using Json = nlohmann::ordered_json;
using ::testing::HasSubstr;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(ToolCallsTest, HermesCallsAndContent) {
  const ParsedOutput out = ParseToolCalls(
      ToolCallFormat::kHermes,
      "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"n\": [1, 2]}}\n"
      "</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>");
  ASSERT_EQ(out.calls.size(), 2u);
  EXPECT_EQ(out.calls[0].name, "get_weather");
  EXPECT_EQ(out.calls[0].arguments, R"({"city":"Paris","n":[1,2]})");
  EXPECT_EQ(out.calls[1].name, "get_time");
  EXPECT_EQ(out.calls[1].arguments, "{}");
  EXPECT_EQ(out.content, "Let me check.");
}

TEST(ToolCallsTest, HermesUnterminatedLastCallAndStringArguments) {
  // The model stopped right after the object; arguments written as JSON text are read too.
  const ParsedOutput out = ParseToolCalls(ToolCallFormat::kHermes,
                                          "<tool_call>\n{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}\n");
  ASSERT_EQ(out.calls.size(), 1u);
  EXPECT_EQ(out.calls[0].arguments, R"({"a":1})");
  EXPECT_EQ(out.content, "");
}

TEST(ToolCallsTest, Llama3JsonCalls) {
  ParsedOutput out =
      ParseToolCalls(ToolCallFormat::kLlama3Json, " {\"name\": \"get_weather\", \"parameters\": {\"city\": \"a;}b\"}}");
  ASSERT_EQ(out.calls.size(), 1u);
  EXPECT_EQ(out.calls[0].arguments, R"({"city":"a;}b"})");
  out = ParseToolCalls(ToolCallFormat::kLlama3Json,
                       "<|python_tag|>{\"name\": \"f\", \"parameters\": {}}; {\"name\": \"g\", \"arguments\": {\"x\": 1}}");
  ASSERT_EQ(out.calls.size(), 2u);
  EXPECT_EQ(out.calls[1].name, "g");
  EXPECT_EQ(out.calls[1].arguments, R"({"x":1})");
}

TEST(ToolCallsTest, MalformedTextIsPlainContent) {
  const struct {
    ToolCallFormat format;
    const char* text;
  } cases[] = {
      {ToolCallFormat::kHermes, "no calls here"},
      {ToolCallFormat::kHermes, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": }\n</tool_call>"},
      {ToolCallFormat::kHermes, "<tool_call>\n{\"arguments\": {}}\n</tool_call>"},
      {ToolCallFormat::kHermes, "<tool_call>\n{\"name\": 3, \"arguments\": {}}\n</tool_call>"},
      {ToolCallFormat::kHermes, "<tool_call>\n{\"name\": \"f\", \"arguments\": [1]}\n</tool_call>"},
      {ToolCallFormat::kHermes, "<tool_call>\n[1, 2]\n</tool_call>"},
      {ToolCallFormat::kHermes, "<tool_call>"},
      {ToolCallFormat::kHermes, "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call><tool_call>{"},
      {ToolCallFormat::kHermes, "<tool_call>\n{\"name\": \"\", \"arguments\": {}}\n</tool_call>"},
      {ToolCallFormat::kLlama3Json, "Hello {\"name\": \"f\", \"parameters\": {}}"},
      {ToolCallFormat::kLlama3Json, "{\"name\": \"f\", \"parameters\": {}} and more"},
      {ToolCallFormat::kLlama3Json, "{\"name\": \"f\", \"parameters\": {\"a\": \"unterminated}}"},
      {ToolCallFormat::kLlama3Json, "{\"name\": \"f\"]]]]"},
      {ToolCallFormat::kLlama3Json, "{}"},
      {ToolCallFormat::kLlama3Json, "{\"name\": \"f\", \"parameters\": \"not json\"}"},
      {ToolCallFormat::kLlama3Json, "{\"name\": \"f\", \"parameters\": {}};;"},
      {ToolCallFormat::kLlama3Json, ""},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.text);
    const ParsedOutput out = ParseToolCalls(c.format, c.text);
    EXPECT_TRUE(out.calls.empty());
    EXPECT_EQ(out.content, c.text);
  }
}

TEST(ToolCallsTest, ArbitraryBytesNeverCrash) {
  // Prefixes of well-formed output, and bytes flipped in it: always a result, never a crash.
  const std::string good = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"s\": \"a\\\"b\", \"n\": [1, {\"x\": null}]}}\n</tool_call>";
  const std::string harmony_good = harmony::CallText("f", "{\"s\": \"a\\\"b\", \"n\": [1, {\"x\": null}]}");
  const std::string glm_good =
      "<tool_call>f\n<arg_key>s</arg_key>\n<arg_value>a\"b</arg_value>\n<arg_key>n</arg_key>\n"
      "<arg_value>[1, {\"x\": null}]</arg_value>\n</tool_call>";
  for (ToolCallFormat format :
       {ToolCallFormat::kHermes, ToolCallFormat::kLlama3Json, ToolCallFormat::kHarmony, ToolCallFormat::kGlm45}) {
    const std::string& text = format == ToolCallFormat::kHarmony ? harmony_good
                              : format == ToolCallFormat::kGlm45 ? glm_good
                                                                 : good;
    ASSERT_EQ(ParseToolCalls(format, format == ToolCallFormat::kLlama3Json ? text.substr(12, text.size() - 25) : text)
                  .calls.size(),
              1u);
    for (size_t n = 0; n <= text.size(); ++n) (void)ParseToolCalls(format, text.substr(0, n));
    for (size_t i = 0; i < text.size(); ++i) {
      for (char c : {'{', '}', '"', '\\', '[', ']', '<', '|', '\0', '\xff'}) {
        std::string bad = text;
        bad[i] = c;
        (void)ParseToolCalls(format, bad);
      }
    }
  }
}

// The streamer, fed `text` in pieces split at every pair of points: its content plus its final
// parse must equal the whole-text parse (content may keep the blanks before the calls).
void ExpectStreamerAgrees(ToolCallFormat format, const std::string& text, const std::vector<ToolFunction>& tools = {}) {
  const ParsedOutput whole = ParseToolCalls(format, text, tools);
  for (size_t a = 0; a <= text.size(); ++a) {
    for (size_t b = a; b <= text.size(); b += 3) {
      ToolCallStreamer s(format, tools);
      std::string content = s.Add(text.substr(0, a));
      content += s.Add(text.substr(a, b - a));
      content += s.Add(text.substr(b));
      const ParsedOutput end = s.Finish();
      content += end.content;
      ASSERT_EQ(end.calls.size(), whole.calls.size()) << "split at " << a << ", " << b;
      for (size_t k = 0; k < whole.calls.size(); ++k) {
        EXPECT_EQ(end.calls[k].name, whole.calls[k].name);
        EXPECT_EQ(end.calls[k].arguments, whole.calls[k].arguments);
      }
      if (whole.calls.empty()) {
        ASSERT_EQ(content, text) << "split at " << a << ", " << b;
      } else {
        ASSERT_EQ(std::string(absl::StripAsciiWhitespace(content)), whole.content) << "split at " << a << ", " << b;
      }
    }
  }
}

TEST(ToolCallsTest, StreamerHoldsBackOnlyWhatMayBeACall) {
  ExpectStreamerAgrees(ToolCallFormat::kHermes,
                       "Sure. <tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": \"<tool_call>\"}}\n</tool_call>");
  ExpectStreamerAgrees(ToolCallFormat::kHermes, "a < b and <tool_ but no call");
  ExpectStreamerAgrees(ToolCallFormat::kHermes, "<tool_call>\n{\"name\": broken");
  ExpectStreamerAgrees(ToolCallFormat::kLlama3Json, "  {\"name\": \"f\", \"parameters\": {\"x\": [1]}}");
  ExpectStreamerAgrees(ToolCallFormat::kLlama3Json, "Plain answer {with braces}");
  ExpectStreamerAgrees(ToolCallFormat::kLlama3Json, "<|python_tag|>{\"name\": \"f\", \"parameters\": {}}");
  ExpectStreamerAgrees(ToolCallFormat::kLlama3Json, "<|pyth");

  // Plain text is not held back (beyond a possible tag start).
  ToolCallStreamer hermes(ToolCallFormat::kHermes);
  EXPECT_EQ(hermes.Add("Hello wor"), "Hello wor");
  EXPECT_EQ(hermes.Add("ld <tool"), "ld ");
  EXPECT_EQ(hermes.Add("box>"), "<toolbox>");
  ToolCallStreamer llama(ToolCallFormat::kLlama3Json);
  EXPECT_EQ(llama.Add("  "), "");
  EXPECT_EQ(llama.Add("Hi"), "  Hi");
  EXPECT_EQ(llama.Add(" {x}"), " {x}");
}

// Harmony calls, as the gpt_oss reasoning split hands them on (harmony::CallText).
TEST(ToolCallsTest, HarmonyCallsAndContent) {
  const std::string call = harmony::CallText("get_weather", "{\"city\":\"Paris\",\"n\":[1, 2]}");
  ParsedOutput out = ParseToolCalls(ToolCallFormat::kHarmony, "Checking.\n" + call + "\n" +
                                                                   harmony::CallText("get_time", " {} ") + "\nDone.");
  ASSERT_EQ(out.calls.size(), 2u);
  EXPECT_EQ(out.calls[0].name, "get_weather");
  EXPECT_EQ(out.calls[0].arguments, "{\"city\":\"Paris\",\"n\":[1,2]}");
  EXPECT_EQ(out.calls[1].name, "get_time");
  EXPECT_EQ(out.calls[1].arguments, "{}");
  EXPECT_EQ(out.content, "Checking.\nDone.");
  // Arguments written as the JSON text of an object.
  out = ParseToolCalls(ToolCallFormat::kHarmony, harmony::CallText("f", "\"{\\\"a\\\": 1}\""));
  ASSERT_EQ(out.calls.size(), 1u);
  EXPECT_EQ(out.calls[0].arguments, "{\"a\":1}");
  // Malformed: arguments that are not an object (a call cut off by max_tokens), a bad name, no end.
  for (const std::string& bad : {harmony::CallText("f", "{\"a\":"), harmony::CallText("f", "[1]"),
                                 harmony::CallText("bad name", "{}"), call.substr(0, call.size() - 3)}) {
    SCOPED_TRACE(bad);
    out = ParseToolCalls(ToolCallFormat::kHarmony, "x " + bad);
    EXPECT_TRUE(out.calls.empty());
    EXPECT_EQ(out.content, "x " + bad);
  }
  EXPECT_EQ(ParseToolCalls(ToolCallFormat::kHarmony, "no calls <|start|>").content, "no calls <|start|>");
  ExpectStreamerAgrees(ToolCallFormat::kHarmony, "Sure. " + call);
  ExpectStreamerAgrees(ToolCallFormat::kHarmony, "a <|start|>assistant to=nothing");
  ExpectStreamerAgrees(ToolCallFormat::kHarmony, harmony::CallText("f", "{\"a\":"));
  // Harmony enforces one named call by its arguments alone (the prompt opens the call).
  absl::StatusOr<std::string> regex = ToolCallRegex(ToolCallFormat::kHarmony, {}, std::nullopt, false);
  ASSERT_FALSE(regex.ok());
  EXPECT_THAT(regex.status().message(), HasSubstr("harmony"));
}

std::vector<ToolFunction> WeatherTools() {
  const Json tools = Json::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "description": "d",
      "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"}}, "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "get_time"}}])");
  std::vector<ToolFunction> out;
  for (size_t i = 0; i < tools.size(); ++i) {
    absl::StatusOr<ToolFunction> f = ParseToolDefinition(tools[i], "tools");
    EXPECT_TRUE(f.ok()) << f.status();
    if (f.ok()) out.push_back(*f);
  }
  return out;
}

// GLM-4.5's calls: one <arg_key>/<arg_value> pair per argument, strings as they are and other
// values as JSON, told apart by the tool's parameters schema.
TEST(ToolCallsTest, Glm45CallsAndContent) {
  const std::vector<ToolFunction> tools = WeatherTools();
  ParsedOutput out = ParseToolCalls(ToolCallFormat::kGlm45,
                                    "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
                                    "<arg_value>1984</arg_value>\n<arg_key>unit</arg_key>\n<arg_value>celsius</arg_value>\n"
                                    "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n"
                                    "<tool_call>get_time\n</tool_call>",
                                    tools);
  ASSERT_EQ(out.calls.size(), 2u);
  EXPECT_EQ(out.calls[0].name, "get_weather");
  // city is a string property: "1984" stays a string; days is an integer.
  EXPECT_EQ(out.calls[0].arguments, R"({"city":"1984","unit":"celsius","days":3})");
  EXPECT_EQ(out.calls[1].name, "get_time");
  EXPECT_EQ(out.calls[1].arguments, "{}");
  EXPECT_EQ(out.content, "Let me check.");
  // A string is kept as written, newlines, quotes and JSON-looking text included; a property
  // without a schema is JSON when it parses as JSON, else text.
  out = ParseToolCalls(ToolCallFormat::kGlm45,
                       "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value> {\"a\": 1}\nSaint \"X\"\n"
                       "</arg_value><arg_key>extra</arg_key><arg_value>[1, 2]</arg_value>\n<arg_key>note</arg_key>\n"
                       "<arg_value>plain words</arg_value></tool_call>",
                       tools);
  ASSERT_EQ(out.calls.size(), 1u);
  EXPECT_EQ(Json::parse(out.calls[0].arguments),
            Json::parse(R"({"city": " {\"a\": 1}\nSaint \"X\"\n", "extra": [1, 2], "note": "plain words"})"));
  // A type list with "string", or an enum of strings without a type, is written as text too; a type
  // list without "string" is JSON.
  const Json typed = Json::parse(R"([{"type": "function", "function": {"name": "f", "parameters": {
      "type": "object", "properties": {"a": {"type": ["string", "null"]}, "b": {"enum": ["1", "2"]},
      "c": {"type": ["integer", "null"]}, "d": {"enum": ["x", 2]}}}}}])");
  absl::StatusOr<ToolFunction> f = ParseToolDefinition(typed[0], "tools[0]");
  ASSERT_TRUE(f.ok()) << f.status();
  out = ParseToolCalls(ToolCallFormat::kGlm45,
                       "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>b</arg_key>"
                       "<arg_value>2</arg_value><arg_key>c</arg_key><arg_value>3</arg_value><arg_key>d</arg_key>"
                       "<arg_value>2</arg_value></tool_call>",
                       {*f});
  ASSERT_EQ(out.calls.size(), 1u);
  EXPECT_EQ(out.calls[0].arguments, R"({"a":"1","b":"2","c":3,"d":2})");
  // Without the request's tools (or for a tool it does not name), values are JSON where they parse.
  out = ParseToolCalls(ToolCallFormat::kGlm45,
                       "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>1984</arg_value>\n</tool_call>");
  ASSERT_EQ(out.calls.size(), 1u);
  EXPECT_EQ(out.calls[0].arguments, R"({"city":1984})");
  // Malformed: a bad name, a key without its value, text between the pairs, an unterminated value,
  // an empty key.
  for (const std::string bad :
       {"<tool_call>bad name\n</tool_call>", "<tool_call>f\n<arg_key>a</arg_key>\n</tool_call>",
        "<tool_call>f\n<arg_key>a</arg_key>x<arg_value>1</arg_value></tool_call>",
        "<tool_call>f\n<arg_key>a</arg_key><arg_value>1</arg_value> and <arg_key>b</arg_key><arg_value>2</arg_value>",
        "<tool_call>f\n<arg_key>a</arg_key><arg_value>1</tool_call>",
        "<tool_call>f\n<arg_key> </arg_key><arg_value>1</arg_value></tool_call>"}) {
    SCOPED_TRACE(bad);
    out = ParseToolCalls(ToolCallFormat::kGlm45, "x " + bad, tools);
    EXPECT_TRUE(out.calls.empty());
    EXPECT_EQ(out.content, "x " + bad);
  }
  ExpectStreamerAgrees(ToolCallFormat::kGlm45,
                       "Sure. <tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>\n</tool_call>",
                       tools);
  ExpectStreamerAgrees(ToolCallFormat::kGlm45, "a <arg_key> but <tool_ no call", tools);
  // Calls in this format are not enforced: tool_choice required or named is refused.
  absl::StatusOr<std::string> regex = ToolCallRegex(ToolCallFormat::kGlm45, tools, std::nullopt, false);
  ASSERT_FALSE(regex.ok());
  EXPECT_THAT(regex.status().message(), HasSubstr("GLM-4.5"));
}

TEST(ToolCallsTest, ConstraintRegexMatchesOnlyCallsThatParse) {
  const std::vector<ToolFunction> tools = WeatherTools();
  const std::string weather = R"({"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}})";
  const std::string time = R"({"name":"get_time","arguments":{}})";
  auto hermes = [](const std::string& object) { return "<tool_call>\n" + object + "\n</tool_call>"; };

  absl::StatusOr<std::string> any = ToolCallRegex(ToolCallFormat::kHermes, tools, std::nullopt, /*parallel=*/true);
  ASSERT_TRUE(any.ok()) << any.status();
  absl::StatusOr<structured::ByteDfa> dfa = structured::ByteDfa::Compile(*any);
  ASSERT_TRUE(dfa.ok()) << dfa.status();
  for (const std::string& good : {hermes(weather), hermes(time), hermes(weather) + "\n" + hermes(time)}) {
    EXPECT_TRUE(dfa->FullMatch(good)) << good;
    EXPECT_FALSE(ParseToolCalls(ToolCallFormat::kHermes, good).calls.empty()) << good;
  }
  for (const std::string& bad :
       {std::string("plain"), hermes(R"({"name":"get_weather","arguments":{"city":"Paris"}})"),  // unit required
        hermes(R"({"name":"get_weather","arguments":{"city":"Paris","unit":"kelvin"}})"),
        hermes(R"({"name":"other","arguments":{}})"), weather}) {
    EXPECT_FALSE(dfa->FullMatch(bad)) << bad;
  }

  absl::StatusOr<std::string> one = ToolCallRegex(ToolCallFormat::kHermes, tools, std::nullopt, /*parallel=*/false);
  ASSERT_TRUE(one.ok());
  EXPECT_FALSE(structured::ByteDfa::Compile(*one)->FullMatch(hermes(weather) + "\n" + hermes(time)));

  absl::StatusOr<std::string> named = ToolCallRegex(ToolCallFormat::kLlama3Json, tools, "get_time", true);
  ASSERT_TRUE(named.ok());
  absl::StatusOr<structured::ByteDfa> named_dfa = structured::ByteDfa::Compile(*named);
  ASSERT_TRUE(named_dfa.ok());
  EXPECT_TRUE(named_dfa->FullMatch(R"({"name":"get_time","parameters":{}})"));
  EXPECT_FALSE(named_dfa->FullMatch(R"({"name":"get_weather","parameters":{"city":"a","unit":"celsius"}})"));
  const ParsedOutput parsed = ParseToolCalls(ToolCallFormat::kLlama3Json, R"({"name":"get_time","parameters":{}})");
  ASSERT_EQ(parsed.calls.size(), 1u);
  EXPECT_EQ(parsed.calls[0].name, "get_time");

  EXPECT_FALSE(ToolCallRegex(ToolCallFormat::kHermes, tools, "nope", false).ok());
  EXPECT_FALSE(ToolCallRegex(ToolCallFormat::kHermes, {}, std::nullopt, false).ok());
}

TEST(ToolCallsTest, UnsupportedParametersSchemaNamesTheTool) {
  absl::StatusOr<ToolFunction> f = ParseToolDefinition(
      Json::parse(R"({"type": "function", "function": {"name": "f", "parameters":
                      {"type": "object", "properties": {"s": {"type": "string", "pattern": "a+"}}}}})"),
      "tools[0]");
  ASSERT_TRUE(f.ok()) << f.status();
  absl::StatusOr<std::string> r = ToolCallRegex(ToolCallFormat::kHermes, {*f}, std::nullopt, false);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("tool 'f'"));
  EXPECT_THAT(r.status().message(), HasSubstr("pattern"));
}

TEST(ToolCallsTest, BadToolDefinitionsNameTheField) {
  const struct {
    const char* tool;
    const char* field;
  } cases[] = {
      {R"([])", "tools[3]'"},
      {R"({"type": "web", "function": {"name": "f"}})", "tools[3].type"},
      {R"({"type": "function"})", "tools[3].function"},
      {R"({"type": "function", "function": {"name": "has space"}})", "tools[3].function.name"},
      {R"({"type": "function", "function": {"description": "x"}})", "tools[3].function.name"},
      {R"({"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}})",
       "tools[3].function.parameters"},
      {R"({"type": "function", "function": {"name": "f", "extra": 1}})", "tools[3].function"},
      {R"({"type": "function", "function": {"name": "f"}, "x": 1})", "tools[3]'"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.tool);
    absl::StatusOr<ToolFunction> f = ParseToolDefinition(Json::parse(c.tool), "tools[3]");
    ASSERT_FALSE(f.ok());
    EXPECT_THAT(f.status().message(), HasSubstr(c.field));
  }
}

// Harmony's named call: its arguments alone, valid against the tool's schema.
TEST(ToolCallsTest, HarmonyNamedCallIsItsArguments) {
  absl::StatusOr<std::string> args = HarmonyArgumentsRegex(WeatherTools(), "get_weather");
  ASSERT_TRUE(args.ok()) << args.status();
  absl::StatusOr<structured::ByteDfa> dfa = structured::ByteDfa::Compile(*args);
  ASSERT_TRUE(dfa.ok()) << dfa.status();
  EXPECT_TRUE(dfa->FullMatch(R"({"city":"Paris","unit":"celsius"})"));
  EXPECT_FALSE(dfa->FullMatch(R"({"city":"Paris"})"));  // unit is required
  EXPECT_FALSE(dfa->FullMatch(R"({"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}})"));
  EXPECT_FALSE(HarmonyArgumentsRegex(WeatherTools(), "nope").ok());
}

TEST(ToolCallsTest, FormatFromTheModelTemplatesAndByName) {
  EXPECT_EQ(DetectToolCallFormat(ReadFile("tests/coordinator/http/chat_templates/qwen2.5_instruct.jinja")),
            ToolCallFormat::kHermes);
  EXPECT_EQ(DetectToolCallFormat(ReadFile("tests/coordinator/http/chat_templates/llama3.1_instruct.jinja")),
            ToolCallFormat::kLlama3Json);
  EXPECT_EQ(DetectToolCallFormat("{{ messages }}"), ToolCallFormat::kHermes);
  EXPECT_EQ(*ParseToolCallFormat("llama3_json"), ToolCallFormat::kLlama3Json);
  EXPECT_EQ(*ParseToolCallFormat("hermes"), ToolCallFormat::kHermes);
  EXPECT_EQ(*ParseToolCallFormat("openai"), ToolCallFormat::kHarmony);
  EXPECT_EQ(ToolCallFormatName(ToolCallFormat::kHarmony), "openai");
  EXPECT_EQ(DetectToolCallFormat("{{ '<|start|>' + m.role + '<|channel|>final<|message|>' + m.content }}"),
            ToolCallFormat::kHarmony);
  EXPECT_EQ(*ParseToolCallFormat("glm45"), ToolCallFormat::kGlm45);
  EXPECT_EQ(*ParseToolCallFormat("glm4_moe"), ToolCallFormat::kGlm45);
  EXPECT_EQ(ToolCallFormatName(ToolCallFormat::kGlm45), "glm45");
  // GLM-4.5's template teaches both tags; <arg_key> decides.
  EXPECT_EQ(DetectToolCallFormat("<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>"),
            ToolCallFormat::kGlm45);
  EXPECT_FALSE(ParseToolCallFormat("mistral").ok());
}

}  // namespace
}  // namespace shardserve::coordinator::frontend

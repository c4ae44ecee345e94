#include "coordinator/frontend/tool_calls.h"

#include <algorithm>
#include <functional>
#include <optional>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/frontend/harmony.h"

namespace shardserve::coordinator::frontend {
namespace {

using Json = nlohmann::ordered_json;

constexpr absl::string_view kCallOpen = "<tool_call>";
constexpr absl::string_view kCallClose = "</tool_call>";
constexpr absl::string_view kPythonTag = "<|python_tag|>";
constexpr absl::string_view kArgKeyOpen = "<arg_key>";
constexpr absl::string_view kArgKeyClose = "</arg_key>";
constexpr absl::string_view kArgValueOpen = "<arg_value>";
constexpr absl::string_view kArgValueClose = "</arg_value>";

bool ValidName(absl::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-') return false;
  }
  return true;
}

// The end (one past the closing brace) of the JSON object that starts at text[begin] == '{', or
// npos when it is not closed. Strings and their escapes are skipped; nothing else is checked (the
// object is parsed afterwards).
size_t ObjectEnd(absl::string_view text, size_t begin) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = begin; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      ++depth;
    } else if (c == '}' || c == ']') {
      if (--depth == 0) return i + 1;
      if (depth < 0) return absl::string_view::npos;
    }
  }
  return absl::string_view::npos;
}

// A call's arguments as compact JSON text: an object, or the JSON text of one (as some models write
// them); nullopt for anything else.
std::optional<std::string> ArgumentsText(Json args) {
  if (args.is_string()) args = Json::parse(args.get<std::string>(), nullptr, /*allow_exceptions=*/false);
  if (!args.is_object()) return std::nullopt;
  return args.dump(-1, ' ', false, Json::error_handler_t::replace);
}

// {"name": ..., "arguments" | "parameters": {...}} (ArgumentsText). nullopt for anything else.
std::optional<ParsedToolCall> CallFromJson(absl::string_view text) {
  const Json j = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("name") || !j["name"].is_string()) return std::nullopt;
  const char* key = j.contains("arguments") ? "arguments" : j.contains("parameters") ? "parameters" : nullptr;
  std::optional<std::string> args = ArgumentsText(key != nullptr ? j[key] : Json::object());
  if (!args.has_value()) return std::nullopt;
  ParsedToolCall call;
  call.name = j["name"].get<std::string>();
  if (call.name.empty()) return std::nullopt;
  call.arguments = *std::move(args);
  return call;
}

ParsedOutput Plain(absl::string_view text) { return ParsedOutput{.content = std::string(text), .calls = {}}; }

// Calls between <tool_call> and </tool_call> (the last one may be unterminated: the model stopped
// right after it), each parsed by `call_of`; the text around them is content. Plain content when
// any call does not parse.
ParsedOutput ParseTagged(absl::string_view text,
                         const std::function<std::optional<ParsedToolCall>(absl::string_view)>& call_of) {
  const size_t first = text.find(kCallOpen);
  if (first == absl::string_view::npos) return Plain(text);
  ParsedOutput out;
  std::string rest_content;
  size_t pos = first;
  while (pos != absl::string_view::npos) {
    const size_t body = pos + kCallOpen.size();
    size_t close = text.find(kCallClose, body);
    absl::string_view inner;
    size_t next;
    if (close == absl::string_view::npos) {
      // Unterminated (the model stopped right after the object): the rest must be the object.
      inner = text.substr(body);
      next = text.size();
    } else {
      inner = text.substr(body, close - body);
      next = close + kCallClose.size();
    }
    std::optional<ParsedToolCall> call = call_of(inner);
    if (!call.has_value()) return Plain(text);
    out.calls.push_back(*std::move(call));
    pos = text.find(kCallOpen, next);
    absl::StrAppend(&rest_content, text.substr(next, pos == absl::string_view::npos ? absl::string_view::npos : pos - next));
  }
  const absl::string_view before = absl::StripAsciiWhitespace(text.substr(0, first));
  const absl::string_view after = absl::StripAsciiWhitespace(rest_content);
  out.content = absl::StrCat(before, !before.empty() && !after.empty() ? "\n" : "", after);
  return out;
}

ParsedOutput ParseHermes(absl::string_view text) {
  return ParseTagged(text, [](absl::string_view inner) { return CallFromJson(absl::StripAsciiWhitespace(inner)); });
}

// Whether GLM-4.5 writes the values of `property` (a JSON Schema) as they are: a string type (or
// a type list with "string"), or no type and an enum of strings.
bool WrittenAsString(const Json& property) {
  if (!property.is_object()) return false;
  if (property.contains("type")) {
    const Json& type = property["type"];
    if (type.is_string()) return type == "string";
    if (type.is_array()) return std::find(type.begin(), type.end(), Json("string")) != type.end();
    return false;
  }
  if (!property.contains("enum") || !property["enum"].is_array() || property["enum"].empty()) return false;
  return std::all_of(property["enum"].begin(), property["enum"].end(), [](const Json& v) { return v.is_string(); });
}

// One argument's value as GLM-4.5 writes it: the text itself for a string property of `tool`'s
// schema, else JSON (the text itself when it is not JSON).
Json Glm45Value(const ToolFunction* tool, const std::string& key, absl::string_view raw) {
  if (tool != nullptr && tool->parameters.contains("properties") && tool->parameters["properties"].is_object() &&
      tool->parameters["properties"].contains(key) && WrittenAsString(tool->parameters["properties"][key])) {
    return Json(std::string(raw));
  }
  const absl::string_view t = absl::StripAsciiWhitespace(raw);
  Json value = Json::parse(t.begin(), t.end(), nullptr, /*allow_exceptions=*/false);
  return value.is_discarded() ? Json(std::string(raw)) : value;
}

// The inside of a GLM-4.5 call: the name, then <arg_key>/<arg_value> pairs with nothing but
// whitespace around them. nullopt for anything else.
std::optional<ParsedToolCall> Glm45Call(absl::string_view inner, const std::vector<ToolFunction>& tools) {
  size_t key_at = inner.find(kArgKeyOpen);
  const std::string name(absl::StripAsciiWhitespace(inner.substr(0, key_at)));
  if (!ValidName(name)) return std::nullopt;
  const ToolFunction* tool = nullptr;
  for (const ToolFunction& t : tools) {
    if (t.name == name) tool = &t;
  }
  auto blank = [&](size_t from, size_t to) {
    return absl::StripAsciiWhitespace(inner.substr(from, to - from)).empty();
  };
  Json args = Json::object();
  while (key_at != absl::string_view::npos) {
    const size_t key_end = inner.find(kArgKeyClose, key_at);
    if (key_end == absl::string_view::npos) return std::nullopt;
    const size_t key_begin = key_at + kArgKeyOpen.size();
    const std::string key(absl::StripAsciiWhitespace(inner.substr(key_begin, key_end - key_begin)));
    const size_t value_at = inner.find(kArgValueOpen, key_end);
    if (key.empty() || value_at == absl::string_view::npos || !blank(key_end + kArgKeyClose.size(), value_at)) {
      return std::nullopt;
    }
    const size_t value_begin = value_at + kArgValueOpen.size();
    const size_t value_end = inner.find(kArgValueClose, value_begin);
    if (value_end == absl::string_view::npos) return std::nullopt;
    args[key] = Glm45Value(tool, key, inner.substr(value_begin, value_end - value_begin));
    const size_t after = value_end + kArgValueClose.size();
    key_at = inner.find(kArgKeyOpen, after);
    if (!blank(after, key_at == absl::string_view::npos ? inner.size() : key_at)) return std::nullopt;
  }
  std::optional<std::string> text = ArgumentsText(std::move(args));
  if (!text.has_value()) return std::nullopt;
  return ParsedToolCall{.name = name, .arguments = *std::move(text)};
}

// Calls as harmony::CallText writes them, anywhere in the text; the text between them is content.
ParsedOutput ParseHarmony(absl::string_view text) {
  const size_t first = text.find(harmony::kCallPrefix);
  if (first == absl::string_view::npos) return Plain(text);
  ParsedOutput out;
  std::string content(absl::StripAsciiWhitespace(text.substr(0, first)));
  size_t pos = first;
  while (pos != absl::string_view::npos) {
    const size_t name_at = pos + harmony::kCallPrefix.size();
    const size_t channel = text.find(harmony::kChannel, name_at);
    const size_t message = channel == absl::string_view::npos ? channel : text.find(harmony::kMessage, channel);
    if (message == absl::string_view::npos) return Plain(text);
    const size_t args_at = message + harmony::kMessage.size();
    const size_t end = text.find(harmony::kCall, args_at);
    if (end == absl::string_view::npos) return Plain(text);
    const std::string name(text.substr(name_at, channel - name_at));
    const absl::string_view args_json = absl::StripAsciiWhitespace(text.substr(args_at, end - args_at));
    std::optional<std::string> args =
        ArgumentsText(Json::parse(args_json.begin(), args_json.end(), nullptr, /*allow_exceptions=*/false));
    if (!ValidName(name) || !args.has_value()) return Plain(text);
    out.calls.push_back(ParsedToolCall{.name = name, .arguments = *std::move(args)});
    const size_t next = end + harmony::kCall.size();
    pos = text.find(harmony::kCallPrefix, next);
    const absl::string_view between = absl::StripAsciiWhitespace(
        text.substr(next, pos == absl::string_view::npos ? absl::string_view::npos : pos - next));
    if (!between.empty()) absl::StrAppend(&content, content.empty() ? "" : "\n", between);
  }
  out.content = std::move(content);
  return out;
}

ParsedOutput ParseLlama3(absl::string_view text) {
  absl::string_view t = absl::StripLeadingAsciiWhitespace(text);
  if (absl::StartsWith(t, kPythonTag)) t = absl::StripLeadingAsciiWhitespace(t.substr(kPythonTag.size()));
  if (t.empty() || t[0] != '{') return Plain(text);
  ParsedOutput out;
  size_t pos = 0;
  while (true) {
    const size_t end = ObjectEnd(t, pos);
    if (end == absl::string_view::npos) return Plain(text);
    std::optional<ParsedToolCall> call = CallFromJson(t.substr(pos, end - pos));
    if (!call.has_value()) return Plain(text);
    out.calls.push_back(*std::move(call));
    pos = end;
    while (pos < t.size() && absl::ascii_isspace(static_cast<unsigned char>(t[pos]))) ++pos;
    if (pos == t.size()) break;
    if (t[pos] != ';') return Plain(text);
    ++pos;
    while (pos < t.size() && absl::ascii_isspace(static_cast<unsigned char>(t[pos]))) ++pos;
    if (pos == t.size()) break;
    if (t[pos] != '{') return Plain(text);
  }
  return out;
}

// The regex of a call's arguments to `tool`: compact JSON valid against its parameters schema.
absl::StatusOr<std::string> ArgumentsRegex(const ToolFunction& tool, const structured::JsonRegexOptions& options) {
  absl::StatusOr<std::string> args = structured::JsonSchemaRegex(tool.parameters.dump(), options);
  if (!args.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the parameters of tool '", tool.name, "' cannot be enforced: ", args.status().message()));
  }
  return args;
}

// The longest suffix of `text` that is a proper prefix of `tag`.
size_t PartialTagSuffix(absl::string_view text, absl::string_view tag) {
  for (size_t n = std::min(text.size(), tag.size() - 1); n > 0; --n) {
    if (absl::EndsWith(text, tag.substr(0, n))) return n;
  }
  return 0;
}

}  // namespace

absl::StatusOr<ToolCallFormat> ParseToolCallFormat(absl::string_view name) {
  if (name == "hermes" || name == "qwen") return ToolCallFormat::kHermes;
  if (name == "llama3_json" || name == "llama") return ToolCallFormat::kLlama3Json;
  if (name == "openai" || name == "harmony") return ToolCallFormat::kHarmony;
  if (name == "glm45" || name == "glm4_moe") return ToolCallFormat::kGlm45;
  return absl::InvalidArgumentError(absl::StrCat("unknown tool call format \"", name,
                                                 "\": use hermes (Qwen2.5, Hermes), llama3_json (Llama 3.x), "
                                                 "openai (GPT-OSS) or glm45 (GLM-4.5)"));
}

absl::string_view ToolCallFormatName(ToolCallFormat format) {
  switch (format) {
    case ToolCallFormat::kHermes: return "hermes";
    case ToolCallFormat::kLlama3Json: return "llama3_json";
    case ToolCallFormat::kHarmony: return "openai";
    case ToolCallFormat::kGlm45: return "glm45";
  }
  return "";
}

ToolCallFormat DetectToolCallFormat(absl::string_view chat_template) {
  if (harmony::UsesHarmony(chat_template)) return ToolCallFormat::kHarmony;
  if (absl::StrContains(chat_template, kArgKeyOpen)) return ToolCallFormat::kGlm45;
  if (absl::StrContains(chat_template, kCallOpen)) return ToolCallFormat::kHermes;
  if (absl::StrContains(chat_template, "\"parameters\"") || absl::StrContains(chat_template, kPythonTag)) {
    return ToolCallFormat::kLlama3Json;
  }
  return ToolCallFormat::kHermes;
}

absl::StatusOr<ToolFunction> ParseToolDefinition(const Json& tool, const std::string& field) {
  auto bad = [&](absl::string_view at, absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("'", field, at, "' ", what));
  };
  if (!tool.is_object()) return bad("", "must be an object {\"type\": \"function\", \"function\": {...}}");
  for (const auto& [k, v] : tool.items()) {
    if (k != "type" && k != "function") return bad("", absl::StrCat("has an unknown field '", k, "'"));
  }
  if (!tool.contains("type") || tool["type"] != "function") return bad(".type", "must be \"function\"");
  if (!tool.contains("function") || !tool["function"].is_object()) return bad(".function", "must be an object");
  const Json& f = tool["function"];
  ToolFunction out;
  out.parameters = Json{{"type", "object"}, {"properties", Json::object()}};
  bool has_name = false;
  for (const auto& [k, v] : f.items()) {
    if (k == "name") {
      if (!v.is_string() || !ValidName(v.get<std::string>())) {
        return bad(".function.name", "must be 1 to 64 letters, digits, '_' or '-'");
      }
      out.name = v.get<std::string>();
      has_name = true;
    } else if (k == "description") {
      if (!v.is_string() && !v.is_null()) return bad(".function.description", "must be a string");
    } else if (k == "parameters") {
      if (v.is_null()) continue;
      if (!v.is_object()) return bad(".function.parameters", "must be a JSON Schema object");
      if (v.contains("type") && v["type"] != "object") {
        return bad(".function.parameters", "must describe an object (\"type\": \"object\")");
      }
      out.parameters = v;
    } else if (k == "strict") {
      if (!v.is_boolean() && !v.is_null()) return bad(".function.strict", "must be a boolean");
    } else {
      return bad(".function", absl::StrCat("has an unknown field '", k, "'"));
    }
  }
  if (!has_name) return bad(".function.name", "is required");
  return out;
}

absl::StatusOr<std::string> ToolCallRegex(ToolCallFormat format, const std::vector<ToolFunction>& tools,
                                          const std::optional<std::string>& named, bool parallel,
                                          const structured::JsonRegexOptions& options) {
  if (format == ToolCallFormat::kHarmony) {
    return absl::InvalidArgumentError(
        "calls in GPT-OSS's harmony format are enforced one named function at a time (HarmonyArgumentsRegex): "
        "the model names the function after its reasoning");
  }
  if (format == ToolCallFormat::kGlm45) {
    return absl::InvalidArgumentError(
        "calls in GLM-4.5's format (<arg_key>/<arg_value> pairs) cannot be enforced; use tool_choice \"auto\"");
  }
  const char* args_key = format == ToolCallFormat::kHermes ? "arguments" : "parameters";
  std::vector<std::string> objects;
  for (const ToolFunction& t : tools) {
    if (named.has_value() && t.name != *named) continue;
    absl::StatusOr<std::string> args = ArgumentsRegex(t, options);
    if (!args.ok()) return args.status();
    objects.push_back(absl::StrCat(structured::RegexLiteral(absl::StrCat("{\"name\":\"", t.name, "\",\"", args_key, "\":")),
                                   *args, "\\}"));
  }
  if (objects.empty()) {
    return absl::InvalidArgumentError(named.has_value() ? absl::StrCat("no tool is named '", *named, "'")
                                                        : std::string("there are no tools to call"));
  }
  const std::string object = objects.size() == 1 ? objects[0] : absl::StrCat("(?:", absl::StrJoin(objects, "|"), ")");
  if (format == ToolCallFormat::kLlama3Json) return object;  // Llama 3.1 calls one tool at a time
  const std::string call = absl::StrCat(structured::RegexLiteral(absl::StrCat(kCallOpen, "\n")), object,
                                        structured::RegexLiteral(absl::StrCat("\n", kCallClose)));
  if (!parallel || named.has_value()) return call;
  return absl::StrCat(call, "(?:\\n", call, "){0,", kMaxParallelCalls - 1, "}");
}

absl::StatusOr<std::string> HarmonyArgumentsRegex(const std::vector<ToolFunction>& tools, const std::string& named,
                                                  const structured::JsonRegexOptions& options) {
  for (const ToolFunction& t : tools) {
    if (t.name == named) return ArgumentsRegex(t, options);
  }
  return absl::InvalidArgumentError(absl::StrCat("no tool is named '", named, "'"));
}

ParsedOutput ParseToolCalls(ToolCallFormat format, absl::string_view text, const std::vector<ToolFunction>& tools) {
  switch (format) {
    case ToolCallFormat::kHermes: return ParseHermes(text);
    case ToolCallFormat::kLlama3Json: return ParseLlama3(text);
    case ToolCallFormat::kHarmony: return ParseHarmony(text);
    case ToolCallFormat::kGlm45:
      return ParseTagged(text, [&](absl::string_view inner) { return Glm45Call(inner, tools); });
  }
  return Plain(text);
}

std::string ToolCallStreamer::Add(absl::string_view text) {
  if (in_call_) {
    absl::StrAppend(&held_, text);
    return "";
  }
  switch (format_) {
    case ToolCallFormat::kHermes:
    case ToolCallFormat::kGlm45:
    case ToolCallFormat::kHarmony: {
      const absl::string_view open = format_ == ToolCallFormat::kHarmony ? harmony::kCallPrefix : kCallOpen;
      absl::StrAppend(&held_, text);
      const size_t at = absl::string_view(held_).find(open);
      std::string out;
      if (at != std::string::npos) {
        out = held_.substr(0, at);
        held_.erase(0, at);
        in_call_ = true;
        return out;
      }
      const size_t keep = PartialTagSuffix(held_, open);
      out = held_.substr(0, held_.size() - keep);
      held_.erase(0, held_.size() - keep);
      return out;
    }
    case ToolCallFormat::kLlama3Json: {
      if (seen_text_) return std::string(text);
      absl::StrAppend(&held_, text);
      const absl::string_view t = absl::StripLeadingAsciiWhitespace(held_);
      if (t.empty()) return "";
      if (t[0] == '{' || absl::StartsWith(t, kPythonTag)) {
        in_call_ = true;
        return "";
      }
      if (absl::StartsWith(kPythonTag, t)) return "";  // may still become the tag
      seen_text_ = true;
      return std::exchange(held_, std::string());
    }
  }
  return std::string(text);
}

ParsedOutput ToolCallStreamer::Finish() {
  std::string held = std::exchange(held_, std::string());
  if (!in_call_) return Plain(held);
  return ParseToolCalls(format_, held, tools_);
}

}  // namespace shardserve::coordinator::frontend

// libFuzzer target: the chat-template engine (common/chat_template), Jinja2's syntax as Hugging Face
// templates use it. Any input is a template: it must parse or give an error status, and a parsed
// one must render a fixed chat (messages with a tool call, tools, template variables) or give an
// error status — never a crash, a stack overflow, a hang or unbounded memory (the parser bounds
// nesting; rendering bounds depth, work, and the size of every string and list it makes).
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/time/time.h"
#include "common/chat_template/jinja.h"
#include "nlohmann/json.hpp"

namespace {

const nlohmann::ordered_json& Context() {
  static const nlohmann::ordered_json context = nlohmann::ordered_json::parse(R"({
    "messages": [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": "Weather in Paris? ünï ✓"},
      {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}}]},
      {"role": "tool", "content": "{\"t\": 21}", "tool_call_id": "c1"},
      {"role": "assistant", "content": "Sunny."},
      {"role": "user", "content": "Thanks"}],
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "d",
      "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["a", "b"]},
        "days": {"type": "array", "items": {"type": "integer"}}}, "required": ["city"]}}}],
    "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>", "reasoning_effort": "high"})");
  return context;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string source(reinterpret_cast<const char*>(data), size);
  auto parsed = shardserve::jinja::JinjaTemplate::Parse(source);
  if (!parsed.ok()) return 0;
  // A smaller work budget than a server's (kMaxRenderSteps), so that the busiest template a fuzzer
  // writes ends within its timeout under the sanitizers; the depth and size bounds are the server's.
  (void)parsed->Render(Context(), absl::FromUnixSeconds(1796634303), absl::UTCTimeZone(), /*max_steps=*/200'000);
  return 0;
}

#include "coordinator/http/openai_protocol.h"

#include <map>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardserve::coordinator::http {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Json = nlohmann::ordered_json;

// The 400 error body for `status`, with its message and param checked.
void ExpectInvalid(const absl::Status& status, absl::string_view message_part, absl::string_view param) {
  ASSERT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(status.message(), HasSubstr(message_part));
  const ApiError e = ErrorFromStatus(status);
  EXPECT_EQ(e.http_status, 400);
  EXPECT_EQ(e.body["error"]["type"], "invalid_request_error");
  if (param.empty()) {
    EXPECT_TRUE(e.body["error"]["param"].is_null());
  } else {
    EXPECT_EQ(e.body["error"]["param"], std::string(param));
  }
}

TEST(OpenAiProtocolTest, CompletionWithEveryField) {
  absl::StatusOr<CompletionRequest> r = ParseCompletionRequest(R"({
      "model": "m", "prompt": "Once upon", "max_tokens": 12, "temperature": 0, "top_p": 0.5, "top_k": 4,
      "seed": 7, "stop": ["\n", "The end"], "stream": true, "stream_options": {"include_usage": true},
      "n": 1, "echo": false, "logprobs": null, "user": "u", "presence_penalty": 0, "frequency_penalty": 0.0,
      "best_of": 1, "suffix": null, "logit_bias": {}})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->fields.model, "m");
  ASSERT_EQ(r->prompts.size(), 1u);
  EXPECT_EQ(*r->prompts[0].text, "Once upon");
  EXPECT_EQ(*r->fields.max_tokens, 12);
  EXPECT_EQ(r->fields.temperature, 0);
  EXPECT_EQ(r->fields.top_p, 0.5);
  EXPECT_EQ(r->fields.top_k, 4);
  EXPECT_EQ(*r->fields.seed, 7);
  EXPECT_THAT(r->fields.stop, ElementsAre("\n", "The end"));
  EXPECT_TRUE(r->fields.stream);
  EXPECT_TRUE(r->fields.include_usage);
  EXPECT_EQ(r->fields.presence_penalty, 0);
  EXPECT_FALSE(r->echo);
  EXPECT_TRUE(ParseCompletionRequest(R"({"prompt": "a", "echo": true})")->echo);
  EXPECT_EQ(r->fields.repetition_penalty, 1);

  absl::StatusOr<ChatRequest> ch = ParseChatRequest(R"({"messages": [{"role": "user", "content": "a"}],
      "presence_penalty": -0.5, "frequency_penalty": 1.25, "repetition_penalty": 1.1})");
  ASSERT_TRUE(ch.ok()) << ch.status();
  EXPECT_EQ(ch->fields.presence_penalty, -0.5);
  EXPECT_EQ(ch->fields.frequency_penalty, 1.25);
  EXPECT_EQ(ch->fields.repetition_penalty, 1.1);
}

TEST(OpenAiProtocolTest, LogprobsRequestsAndTheirJson) {
  absl::StatusOr<CompletionRequest> c = ParseCompletionRequest(R"({"prompt": "a", "logprobs": 2})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->fields.logprobs);
  EXPECT_EQ(c->fields.top_logprobs, 2);
  absl::StatusOr<ChatRequest> ch =
      ParseChatRequest(R"({"messages": [{"role": "user", "content": "a"}], "logprobs": true, "top_logprobs": 3})");
  ASSERT_TRUE(ch.ok()) << ch.status();
  EXPECT_TRUE(ch->fields.logprobs);
  EXPECT_EQ(ch->fields.top_logprobs, 3);

  const ResponseMeta meta{.id = "x", .created = 1, .model = "m"};
  // text_offset advances by the characters each token adds to the text ("é" is 2 bytes, 1 character),
  // not by its spelling (a special token adds none).
  const std::vector<LogprobEntry> entries = {
      {.token = "Hé", .logprob = -0.5, .top = {{"Hé", -0.5}, {"Ho", -1.5}}, .text_chars = 2},
      {.token = "</s>", .logprob = -3, .top = {{"</s>", -3}}},
      {.token = "!", .logprob = -2, .top = {{"?", -1}, {"!", -2}}, .text_chars = 1}};
  const auto comp = CompletionResponse(meta, "Hé!", "length", {}, &entries);
  const auto& lp = comp["choices"][0]["logprobs"];
  EXPECT_EQ(Dump(lp["tokens"]), R"(["Hé","</s>","!"])");
  EXPECT_EQ(Dump(lp["token_logprobs"]), "[-0.5,-3.0,-2.0]");
  EXPECT_EQ(Dump(lp["top_logprobs"]), R"([{"Hé":-0.5,"Ho":-1.5},{"</s>":-3.0},{"?":-1.0,"!":-2.0}])");
  EXPECT_EQ(Dump(lp["text_offset"]), "[0,2,2]");
  EXPECT_EQ(Dump(CompletionChunk(meta, "!", "", &entries, 7)["choices"][0]["logprobs"]["text_offset"]), "[7,9,9]");
  const auto chat = ChatResponse(meta, "Hé!", "stop", {}, &entries);
  const auto& content = chat["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 3u);
  EXPECT_EQ(Dump(content[0]), R"({"token":"Hé","logprob":-0.5,"bytes":[72,195,169],"top_logprobs":[)"
                              R"({"token":"Hé","logprob":-0.5,"bytes":[72,195,169]},)"
                              R"({"token":"Ho","logprob":-1.5,"bytes":[72,111]}]})");
  // Not asked: null, as before.
  EXPECT_TRUE(ChatResponse(meta, "Hi!", "stop", {})["choices"][0]["logprobs"].is_null());
}

TEST(OpenAiProtocolTest, SamplingExtensions) {
  absl::StatusOr<ChatRequest> r = ParseChatRequest(R"({"messages": [{"role": "user", "content": "hi"}],
      "min_p": 0.05, "min_tokens": 4, "stop_token_ids": [7, 9], "ignore_eos": true,
      "logit_bias": {"12": -100, "3": 2.5}})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->fields.min_p, 0.05);
  EXPECT_EQ(r->fields.min_tokens, 4);
  EXPECT_THAT(r->fields.stop_token_ids, ElementsAre(7, 9));
  EXPECT_TRUE(r->fields.ignore_eos);
  ASSERT_EQ(r->fields.logit_bias.size(), 2u);
  std::map<int64_t, double> bias(r->fields.logit_bias.begin(), r->fields.logit_bias.end());
  EXPECT_EQ(bias[12], -100);
  EXPECT_EQ(bias[3], 2.5);
}

TEST(OpenAiProtocolTest, TextOptionsAsVllmSpellsThem) {
  absl::StatusOr<CompletionRequest> d = ParseCompletionRequest(R"({"prompt": "a"})");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE(d->fields.include_stop_str_in_output);
  EXPECT_TRUE(d->fields.skip_special_tokens);
  absl::StatusOr<ChatRequest> r = ParseChatRequest(R"({"messages": [{"role": "user", "content": "hi"}],
      "stop": ["x"], "include_stop_str_in_output": true, "skip_special_tokens": false})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->fields.include_stop_str_in_output);
  EXPECT_FALSE(r->fields.skip_special_tokens);
  EXPECT_FALSE(r->fields.ignore_eos);
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "skip_special_tokens": "no"})").status(), "boolean",
                "skip_special_tokens");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "include_stop_str_in_output": 1})").status(), "boolean",
                "include_stop_str_in_output");
  EXPECT_FALSE(d->fields.truncate_prompt_tokens.has_value());
  EXPECT_EQ(ParseCompletionRequest(R"({"prompt": "a", "truncate_prompt_tokens": 5})")->fields.truncate_prompt_tokens,
            5);
  EXPECT_EQ(ParseCompletionRequest(R"({"prompt": "a", "truncate_prompt_tokens": -1})")->fields.truncate_prompt_tokens,
            -1);
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "truncate_prompt_tokens": 0})").status(), "or >= 1, got 0",
                "truncate_prompt_tokens");
  ExpectInvalid(ParseChatRequest(R"({"messages": [{"role": "user", "content": "hi"}], "truncate_prompt_tokens": 1.5})")
                    .status(),
                "integer", "truncate_prompt_tokens");
  EXPECT_EQ(d->fields.priority, 0);
  EXPECT_EQ(ParseCompletionRequest(R"({"prompt": "a", "priority": -3})")->fields.priority, -3);
  EXPECT_EQ(ParseChatRequest(R"({"messages": [{"role": "user", "content": "hi"}], "priority": 7})")->fields.priority,
            7);
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "priority": 1099511627776})").status(), "32 bits",
                "priority");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "priority": "high"})").status(), "integer", "priority");
}

// OpenAI's fields about stored completions and service tiers, at their neutral values: accepted
// (SDKs and frameworks send them), and refused where they ask for what this server does not do.
// An assistant message as OpenAI's clients send back the one they were given: its reasoning is kept
// for the template, refusal and annotations are ignored, audio and function_call refused.
TEST(OpenAiProtocolTest, AnswersSentBackAsMessages) {
  absl::StatusOr<ChatRequest> r = ParseChatRequest(R"({"messages": [{"role": "user", "content": "hi"},
      {"role": "assistant", "content": null, "reasoning_content": "Think.", "refusal": null, "annotations": [],
       "audio": null, "function_call": null,
       "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
      {"role": "assistant", "content": "ok", "reasoning": "vLLM's name"},
      {"role": "assistant", "content": "x", "reasoning_content": null, "refusal": "no"}]})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->messages.size(), 4u);
  EXPECT_EQ(r->messages[1].reasoning, "Think.");
  EXPECT_EQ(r->messages[2].reasoning, "vLLM's name");
  EXPECT_FALSE(r->messages[3].reasoning.has_value());
  ExpectInvalid(ParseChatRequest(R"({"messages": [{"role": "assistant", "content": "a", "reasoning_content": 1}]})")
                    .status(),
                "a string", "messages[0].reasoning_content");
  ExpectInvalid(ParseChatRequest(R"({"messages": [{"role": "assistant", "content": "a", "audio": {"id": "x"}}]})")
                    .status(),
                "not supported", "messages[0].audio");
  ExpectInvalid(ParseChatRequest(R"({"messages": [{"role": "assistant", "content": "a", "function_call": {"name": "f"}}]})")
                    .status(),
                "use tool_calls", "messages[0].function_call");
  ExpectInvalid(ParseChatRequest(R"({"messages": [{"role": "assistant", "content": "a", "refusal": 3}]})").status(),
                "a string or an array", "messages[0].refusal");
}

// OpenAI's reasoning_effort reaches the chat template as its variable of that name.
TEST(OpenAiProtocolTest, ReasoningEffortIsATemplateVariable) {
  absl::StatusOr<ChatRequest> r =
      ParseChatRequest(R"({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "high"})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->chat_template_kwargs, nlohmann::ordered_json::parse(R"({"reasoning_effort": "high"})"));
  r = ParseChatRequest(R"({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low",
                           "chat_template_kwargs": {"x": 1}})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->chat_template_kwargs, nlohmann::ordered_json::parse(R"({"x": 1, "reasoning_effort": "low"})"));
  r = ParseChatRequest(R"({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": null})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->chat_template_kwargs.is_null());
  ExpectInvalid(ParseChatRequest(R"({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "max"})")
                    .status(),
                "\"low\", \"medium\" or \"high\", got \"max\"", "reasoning_effort");
  ExpectInvalid(ParseChatRequest(R"({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": 2})")
                    .status(),
                "got 2", "reasoning_effort");
  ExpectInvalid(ParseChatRequest(R"({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low",
                                     "chat_template_kwargs": {"reasoning_effort": "high"}})")
                    .status(),
                "set twice", "reasoning_effort");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "reasoning_effort": "low"})").status(), "reasoning_effort",
                "reasoning_effort");
}

TEST(OpenAiProtocolTest, StoreMetadataAndServiceTier) {
  for (const char* body : {R"({"prompt": "a", "store": false, "metadata": {"team": "search"}, "service_tier": "auto"})",
                           R"({"prompt": "a", "store": null, "metadata": null, "service_tier": "default"})"}) {
    EXPECT_TRUE(ParseCompletionRequest(body).ok()) << body;
  }
  EXPECT_TRUE(ParseChatRequest(R"({"messages": [{"role": "user", "content": "hi"}], "store": false,
                                  "metadata": {}, "service_tier": "auto"})").ok());
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "store": true})").status(), "does not store", "store");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "store": "no"})").status(), "boolean", "store");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "metadata": {"n": 1}})").status(), "string",
                "metadata.n");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "metadata": []})").status(), "object", "metadata");
  ExpectInvalid(ParseChatRequest(R"({"messages": [{"role": "user", "content": "hi"}], "service_tier": "flex"})")
                    .status(),
                "\"auto\" or \"default\"", "service_tier");
}

TEST(OpenAiProtocolTest, ResponseFormat) {
  absl::StatusOr<ChatRequest> schema = ParseChatRequest(R"({"messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": true, "description": "d",
      "schema": {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}}}})");
  ASSERT_TRUE(schema.ok()) << schema.status();
  EXPECT_EQ(schema->fields.response_format, SamplingFields::ResponseFormat::kJsonSchema);
  // The schema's text keeps its property order (the order generated).
  EXPECT_EQ(schema->fields.json_schema, R"({"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"string"}}})");
  absl::StatusOr<CompletionRequest> object =
      ParseCompletionRequest(R"({"prompt": "a", "response_format": {"type": "json_object"}})");
  ASSERT_TRUE(object.ok()) << object.status();
  EXPECT_EQ(object->fields.response_format, SamplingFields::ResponseFormat::kJsonObject);
  absl::StatusOr<CompletionRequest> text = ParseCompletionRequest(R"({"prompt": "a", "response_format": {"type": "text"}})");
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(text->fields.response_format, SamplingFields::ResponseFormat::kText);
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "response_format": {"type": "xml"}})").status(),
                "must be \"text\", \"json_object\" or \"json_schema\"", "response_format");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "response_format": {"type": "json_schema"}})").status(),
                "'response_format.json_schema' must be an object", "response_format");
  ExpectInvalid(ParseCompletionRequest(
                    R"({"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})")
                    .status(),
                "'response_format.json_schema.schema'", "response_format");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "response_format": {"type": "json_schema",
      "json_schema": {"schema": {}, "extra": 1}}})").status(), "response_format.json_schema.extra", "response_format");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "response_format": "json"})").status(), "an object",
                "response_format");
}

TEST(OpenAiProtocolTest, VllmGuidedFields) {
  absl::StatusOr<CompletionRequest> json = ParseCompletionRequest(R"({"prompt": "a", "guided_json": {"type": "integer"}})");
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_EQ(json->fields.response_format, SamplingFields::ResponseFormat::kJsonSchema);
  EXPECT_EQ(json->fields.json_schema, R"({"type":"integer"})");
  EXPECT_EQ(json->fields.format_param, "guided_json");
  absl::StatusOr<CompletionRequest> regex = ParseCompletionRequest(R"({"prompt": "a", "guided_regex": "[0-9]+"})");
  ASSERT_TRUE(regex.ok()) << regex.status();
  EXPECT_EQ(regex->fields.response_format, SamplingFields::ResponseFormat::kRegex);
  EXPECT_EQ(regex->fields.regex, "[0-9]+");
  absl::StatusOr<ChatRequest> choice = ParseChatRequest(R"({"messages": [{"role": "user", "content": "a"}],
      "guided_choice": ["yes", "no"]})");
  ASSERT_TRUE(choice.ok()) << choice.status();
  EXPECT_EQ(choice->fields.response_format, SamplingFields::ResponseFormat::kChoice);
  EXPECT_THAT(choice->fields.choices, ElementsAre("yes", "no"));
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "guided_regex": "a", "guided_choice": ["b"]})").status(),
                "cannot be combined", "guided_choice");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "guided_regex": "a", "response_format": {"type": "json_object"}})")
                    .status(),
                "cannot be combined", "response_format");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "guided_choice": []})").status(), "non-empty array",
                "guided_choice");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "guided_choice": ["x", ""]})").status(), "non-empty string",
                "guided_choice[1]");
}

TEST(OpenAiProtocolTest, CompletionDefaults) {
  absl::StatusOr<CompletionRequest> r = ParseCompletionRequest(R"({"prompt": [1, 2, 3], "stop": "x"})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->prompts.size(), 1u);
  EXPECT_FALSE(r->prompts[0].text.has_value());
  EXPECT_THAT(r->prompts[0].ids, ElementsAre(1, 2, 3));
  EXPECT_FALSE(r->fields.max_tokens.has_value());
  EXPECT_EQ(r->fields.temperature, 1.0);
  EXPECT_EQ(r->fields.top_p, 1.0);
  EXPECT_FALSE(r->fields.stream);
  EXPECT_THAT(r->fields.stop, ElementsAre("x"));
}

TEST(OpenAiProtocolTest, SeveralPromptsAsStringsOrTokenIdArrays) {
  absl::StatusOr<CompletionRequest> r = ParseCompletionRequest(R"({"prompt": ["Once", "upon a"]})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->prompts.size(), 2u);
  EXPECT_EQ(*r->prompts[0].text, "Once");
  EXPECT_EQ(*r->prompts[1].text, "upon a");
  r = ParseCompletionRequest(R"({"prompt": [[1, 2], [3]]})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->prompts.size(), 2u);
  EXPECT_THAT(r->prompts[0].ids, ElementsAre(1, 2));
  EXPECT_THAT(r->prompts[1].ids, ElementsAre(3));
  r = ParseCompletionRequest(R"({"prompt": ["only"]})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->prompts.size(), 1u);
  EXPECT_EQ(*r->prompts[0].text, "only");
}

TEST(OpenAiProtocolTest, TokenizeAPromptOrChatMessages) {
  absl::StatusOr<TokenizeRequest> r = ParseTokenizeRequest(R"({"prompt": "a"})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r->prompt, "a");
  EXPECT_FALSE(r->messages.has_value());
  EXPECT_FALSE(r->add_special_tokens.has_value());  // vLLM's default for a prompt: true
  r = ParseTokenizeRequest(R"({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": false})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->messages->size(), 1u);
  EXPECT_EQ((*r->messages)[0].content, "hi");
  EXPECT_FALSE(r->add_generation_prompt);
  ExpectInvalid(ParseTokenizeRequest("{}").status(), "exactly one of 'prompt' and 'messages'", "prompt");
  ExpectInvalid(ParseTokenizeRequest(R"({"prompt": "a", "messages": [{"role": "user", "content": "b"}]})").status(),
                "exactly one", "messages");
  ExpectInvalid(ParseTokenizeRequest(R"({"messages": []})").status(), "'messages' is empty", "messages");
  ExpectInvalid(ParseTokenizeRequest(R"({"messages": [{"role": "user"}]})").status(), "content' is required",
                "messages[0].content");
}

TEST(OpenAiProtocolTest, MalformedJson) {
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a",)").status(), "not valid JSON", "");
  ExpectInvalid(ParseCompletionRequest("").status(), "not valid JSON", "");
  ExpectInvalid(ParseCompletionRequest("[1]").status(), "must be a JSON object", "");
  ExpectInvalid(ParseCompletionRequest("{\"prompt\": \"\xff\"}").status(), "not valid JSON", "");
  // A number beyond double's range is a bad request (400), not an internal error.
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "max_tokens": 1e400})").status(), "not valid JSON", "");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "temperature": -1e999})").status(), "not valid JSON", "");
}

TEST(OpenAiProtocolTest, ChatToolsAndToolChoice) {
  absl::StatusOr<ChatRequest> r = ParseChatRequest(R"({"messages": [
      {"role": "user", "content": "a"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
        "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
      {"role": "tool", "content": "42", "tool_call_id": "c1"}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tool_choice, frontend::ToolChoice::kAuto);  // the default with tools
  ASSERT_EQ(r->tool_functions.size(), 1u);
  EXPECT_EQ(r->tool_functions[0].name, "f");
  EXPECT_EQ(r->messages[1].tool_calls.size(), 1u);
  EXPECT_EQ(r->messages[1].content, "");
  EXPECT_EQ(r->messages[2].tool_call_id, "c1");
  EXPECT_TRUE(r->parallel_tool_calls);

  r = ParseChatRequest(R"({"messages": [{"role": "user", "content": "a"}], "parallel_tool_calls": false,
    "tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}],
    "tool_choice": {"type": "function", "function": {"name": "g"}}})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tool_choice, frontend::ToolChoice::kNamed);
  EXPECT_EQ(r->tool_name, "g");
  EXPECT_FALSE(r->parallel_tool_calls);

  r = ParseChatRequest(R"({"messages": [{"role": "user", "content": "a"}]})");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->tool_choice, frontend::ToolChoice::kNone);  // the default without tools
  ExpectInvalid(ParseChatRequest(R"({"messages": [{"role": "user", "tool_calls": []}]})").status(),
                "messages[0].content", "messages[0].content");
  ExpectInvalid(ParseChatRequest(R"({"messages": [{"role": "user", "content": "a", "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]})").status(),
                "assistant", "messages[0].tool_calls");
  ExpectInvalid(ParseChatRequest(R"({"messages": [{"role": "assistant", "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "f", "arguments": {}}}]}]})").status(),
                "arguments", "messages[0].tool_calls[0].function.arguments");
}

TEST(OpenAiProtocolTest, UnknownFields) {
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "bogus": 1})").status(), "unknown field 'bogus'", "bogus");
  // OpenAI's deprecated functions/function_call (superseded by tools) are not taken.
  ExpectInvalid(ParseChatRequest(R"({"messages": [{"role": "user", "content": "a"}], "functions": []})").status(),
                "unknown field 'functions'", "functions");
  // Tools only with the completions endpoint's chat counterpart.
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "tools": []})").status(), "unknown field 'tools'", "tools");
  ExpectInvalid(ParseChatRequest(R"({"messages": [{"role": "user", "content": "a", "x": 1}]})").status(),
                "messages[0].x", "messages[0].x");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "stream_options": {"other": 1}})").status(),
                "stream_options.other", "stream_options");
}

TEST(OpenAiProtocolTest, WrongTypes) {
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "max_tokens": "5"})").status(),
                "'max_tokens' must be an integer, got a string", "max_tokens");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "max_tokens": 5.5})").status(), "must be an integer",
                "max_tokens");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "temperature": "hot"})").status(), "must be a number",
                "temperature");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "stream": 1})").status(), "must be a boolean", "stream");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": 5})").status(),
                "'prompt' must be a string, an array of token ids, or an array of either",
                "prompt");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": [1, "a"]})").status(), "prompt[1]", "prompt[1]");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "stop": [1]})").status(), "stop[0]", "stop[0]");
  ExpectInvalid(ParseChatRequest(R"({"messages": "hi"})").status(), "'messages' must be an array", "messages");
  ExpectInvalid(ParseChatRequest(R"({"messages": [{"role": 1, "content": "a"}]})").status(), "messages[0].role",
                "messages[0].role");
}

TEST(OpenAiProtocolTest, OutOfRangeAndUnsupportedValues) {
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "max_tokens": 0})").status(), "at least 1", "max_tokens");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "temperature": -1})").status(), "[0, 2]", "temperature");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "top_p": 0})").status(), "(0, 1]", "top_p");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "top_k": -1})").status(), "top_k", "top_k");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "n": 17})").status(), "'n' must be in [1, 16]", "n");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "best_of": 0})").status(), "'best_of' must be in [1, 16]",
                "best_of");
  EXPECT_EQ(ParseCompletionRequest(R"({"prompt": "a", "n": 3, "best_of": 5})")->fields.n, 3);
  EXPECT_EQ(*ParseCompletionRequest(R"({"prompt": "a", "n": 3, "best_of": 5})")->fields.best_of, 5);
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "echo": 1})").status(), "boolean", "echo");
  ExpectInvalid(ParseChatRequest(R"({"messages": [{"role": "user", "content": "a"}], "echo": true})").status(),
                "unknown field 'echo'", "echo");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "logprobs": 21})").status(), "[0, 20]", "logprobs");
  ExpectInvalid(ParseChatRequest(R"({"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2})").status(),
                "needs 'logprobs': true", "top_logprobs");
  ExpectInvalid(ParseChatRequest(R"({"messages": [{"role": "user", "content": "a"}], "logprobs": true,
                                    "top_logprobs": 21})").status(), "[0, 20]", "top_logprobs");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "logit_bias": {"x": 1}})").status(), "token ids",
                "logit_bias");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "logit_bias": {"5": 101}})").status(), "[-100, 100]",
                "logit_bias");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "logit_bias": {"5": "up"}})").status(), "number",
                "logit_bias.5");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "min_p": 1.5})").status(), "'min_p' must be in [0, 1]",
                "min_p");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "min_tokens": -1})").status(), "'min_tokens' must be >= 0",
                "min_tokens");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "stop_token_ids": [1, "x"]})").status(), "integer",
                "stop_token_ids[1]");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "ignore_eos": 1})").status(), "boolean", "ignore_eos");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "presence_penalty": 2.5})").status(),
                "'presence_penalty' must be in [-2, 2]", "presence_penalty");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "frequency_penalty": "x"})").status(), "number",
                "frequency_penalty");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": "a", "repetition_penalty": 0})").status(),
                "'repetition_penalty' must be in (0, 2]", "repetition_penalty");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": ""})").status(), "'prompt' is empty", "prompt");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": []})").status(), "'prompt' is empty", "prompt");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": ["a", ""]})").status(), "'prompt[1]' is empty", "prompt");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": [[1], []]})").status(), "'prompt[1]' is empty", "prompt");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": ["a", [1]]})").status(),
                "'prompt[1]' must be a string as 'prompt[0]' is, got an array", "prompt");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": [[1], "a"]})").status(),
                "'prompt[1]' must be an array of token ids as 'prompt[0]' is, got a string", "prompt");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": [[1, "x"]]})").status(), "integer", "prompt[0][1]");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": [1, [2]]})").status(), "integer", "prompt[1]");
  ExpectInvalid(ParseCompletionRequest(R"({"prompt": {"a": 1}})").status(), "a string, an array of token ids",
                "prompt");
  std::string many = R"({"prompt": [)";
  for (size_t i = 0; i <= kMaxPrompts; ++i) many += i == 0 ? R"("a")" : R"(, "a")";
  ExpectInvalid(ParseCompletionRequest(many + "]}").status(), "at most 64 per request", "prompt");
  ExpectInvalid(ParseCompletionRequest(R"({"max_tokens": 3})").status(), "'prompt' is required", "prompt");
  ExpectInvalid(ParseChatRequest(R"({"messages": []})").status(), "'messages' is empty", "messages");
  ExpectInvalid(ParseChatRequest(R"({"messages": [{"role": "robot", "content": "a"}]})").status(), "robot",
                "messages[0].role");
  ExpectInvalid(ParseChatRequest(R"({"messages": [{"role": "user"}]})").status(), "content' is required",
                "messages[0].content");
}

TEST(OpenAiProtocolTest, ChatMessagesWithTextParts) {
  absl::StatusOr<ChatRequest> r = ParseChatRequest(R"({"messages": [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "there"}], "name": "ann"},
      {"role": "assistant", "content": null}], "max_completion_tokens": 9})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->messages.size(), 3u);
  EXPECT_EQ(r->messages[1].content, "Hello, there");
  EXPECT_EQ(*r->messages[1].name, "ann");
  EXPECT_EQ(r->messages[2].content, "");
  EXPECT_EQ(*r->fields.max_tokens, 9);
  ExpectInvalid(ParseChatRequest(R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})")
                    .status(),
                "only text", "messages[0].content[0]");
}

TEST(OpenAiProtocolTest, ErrorStatusMapping) {
  EXPECT_EQ(ErrorFromStatus(absl::UnavailableError("not ready")).http_status, 503);
  EXPECT_EQ(ErrorFromStatus(absl::ResourceExhaustedError("queue full")).http_status, 429);
  EXPECT_EQ(ErrorFromStatus(absl::NotFoundError("no model")).http_status, 404);
  EXPECT_EQ(ErrorFromStatus(absl::InternalError("x")).http_status, 500);
  const ApiError e = ErrorFromStatus(WithParam(absl::NotFoundError("no model"), "model"));
  EXPECT_EQ(Dump(e.body),
            R"({"error":{"message":"no model","type":"invalid_request_error","param":"model","code":"not_found"}})");
}

TEST(OpenAiProtocolTest, SseFraming) {
  EXPECT_EQ(SseEvent(R"({"a":1})"), "data: {\"a\":1}\n\n");
  EXPECT_EQ(SseDone(), "data: [DONE]\n\n");
}

TEST(OpenAiProtocolTest, ResponseShapes) {
  const ResponseMeta meta{.id = "cmpl-1", .created = 1700000000, .model = "m"};
  EXPECT_EQ(Dump(CompletionResponse(meta, "hi", "length",
                                    {.prompt_tokens = 3, .completion_tokens = 2, .cached_tokens = 1})),
            R"({"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"m","choices":[{"index":0,)"
            R"("text":"hi","logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":3,"completion_tokens":2,)"
            R"("total_tokens":5,"prompt_tokens_details":{"cached_tokens":1}}})");
  EXPECT_EQ(Dump(CompletionChunk(meta, "h", "")),
            R"({"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"m","choices":[{"index":0,)"
            R"("text":"h","logprobs":null,"finish_reason":null}]})");
  EXPECT_EQ(Dump(ChatChunk(meta, "assistant", std::string(), ""))
                .find(R"("delta":{"role":"assistant","content":""})") != std::string::npos,
            true);
  EXPECT_NE(Dump(ChatChunk(meta, "", std::nullopt, "stop")).find(R"("delta":{},"logprobs":null,"finish_reason":"stop")"),
            std::string::npos);
  const Json chat = ChatResponse(meta, "yo", "stop", {.prompt_tokens = 1, .completion_tokens = 1});
  EXPECT_EQ(chat["object"], "chat.completion");
  EXPECT_EQ(chat["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(chat["choices"][0]["message"]["content"], "yo");
  const Json usage = UsageChunk(meta, "chat.completion.chunk", {.prompt_tokens = 4, .completion_tokens = 6});
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["total_tokens"], 10);
  // Invalid UTF-8 in generated text never throws.
  EXPECT_NE(Dump(CompletionChunk(meta, "\xff", "")).find("\xEF\xBF\xBD"), std::string::npos);
}

}  // namespace
}  // namespace shardserve::coordinator::http

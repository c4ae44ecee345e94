// Tool calling through the real HttpServer, with a scripted model: a copy of a byte-level test
// tokenizer with Qwen2.5-Instruct's chat template (so "hermes" calls are detected), and a replica
// that samples a given text. Calls are parsed into message.tool_calls (streamed as OpenAI's
// deltas), tool_choice none leaves them as text, malformed calls stay content, and the prompt with
// tools, calls and tool answers is the one jinja2 renders (jinja_golden.json).
#include <httplib.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <unistd.h>

#include "absl/strings/ascii.h"
#include "coordinator/frontend/chat_prompt.h"
#include "coordinator/http/http_server.h"
#include "coordinator/structured/grammar.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/harmony_model.h"
#include "tests/testing/script_replica.h"
#include "tests/testing/temp_dir.h"

namespace shardserve::coordinator::http {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::ordered_json;

using ::shardserve::testing::ReadFileOrEmpty;
using ::shardserve::testing::ScriptReplica;

constexpr char kEnd[] = "@@END@@";  // ends each scripted answer (a stop string of every request)
constexpr char kCall[] =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>";

class HttpToolsTest : public ::testing::Test {
 protected:
  void SetUp() override { std::signal(SIGPIPE, SIG_IGN); }

  // Serves a model whose output is `output` followed by kEnd (repeated), with Qwen2.5's chat
  // template or `chat_template`, and the qwen2 test tokenizer or `tokenizer_json`.
  void Serve(const std::string& output, const std::string& chat_template = "", const std::string& tokenizer_json = "") {
    // One directory per process: ctest runs the tests of this file in parallel processes.
    dir_ = std::filesystem::path(::testing::TempDir()) / ("http_tools_model_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
    if (tokenizer_json.empty()) {
      std::filesystem::copy_file("tests/golden/models/qwen2/tokenizer.json", dir_ / "tokenizer.json",
                                 std::filesystem::copy_options::overwrite_existing);
    } else {
      std::ofstream(dir_ / "tokenizer.json") << tokenizer_json;
    }
    Json config;
    config["chat_template"] = chat_template.empty()
                                  ? ReadFileOrEmpty("tests/coordinator/http/chat_templates/qwen2.5_instruct.jinja")
                                  : chat_template;
    // The harmony tokenizer's answers end at <|return|> (where a constraint lets them end).
    if (!tokenizer_json.empty()) config["eos_token"] = "<|return|>";
    std::ofstream(dir_ / "tokenizer_config.json") << config.dump();
    absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadTokenizer(dir_.string());
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = *std::move(tokenizer);
    compiler_ = std::make_unique<structured::ConstraintCompiler>(
        structured::VocabularyFromTokenizer(*tokenizer_, tokenizer_->vocab_size()));
    absl::StatusOr<std::vector<int32_t>> script = tokenizer_->Encode(output + kEnd, false);
    ASSERT_TRUE(script.ok()) << script.status();
    SchedulerOptions so;
    so.limits = {.vocab_size = tokenizer_->vocab_size(), .max_seq_len = 4096};
    scheduler_ = std::make_unique<Scheduler>(so);
    ASSERT_TRUE(scheduler_->AddReplica(0, std::make_unique<ScriptReplica>(*script), {.max_slots = 4, .kv_blocks = 1024})
                    .ok());
    absl::StatusOr<std::unique_ptr<HttpServer>> server = HttpServer::Start(
        {.listen = "127.0.0.1:0",
         .model_id = "qwen",
         .model_path = dir_.string(),
         .constraints = compiler_.get(),
         .reasoning_parser = reasoning_parser_},
        tokenizer_.get(), scheduler_.get(), [] { return absl::OkStatus(); });
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    client_ = std::make_unique<httplib::Client>("127.0.0.1", server_->port());
    client_->set_read_timeout(30, 0);
  }

  void TearDown() override {
    if (scheduler_ != nullptr) scheduler_->Shutdown(absl::UnavailableError("shutting down"));
    if (server_ != nullptr) server_->Stop();
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  static Json Tools() {
    return Json::parse(R"([
      {"type": "function", "function": {"name": "get_weather", "description": "The weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
      {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}])");
  }

  // A chat request with the tools, `extra` merged in.
  static Json Request(const Json& extra) {
    Json r;
    r["messages"] = Json::array({{{"role", "user"}, {"content", "Weather in Paris?"}}});
    r["tools"] = Tools();
    r["stop"] = Json::array({kEnd});
    r["max_tokens"] = 400;
    for (const auto& [k, v] : extra.items()) r[k] = v;
    return r;
  }

  std::pair<int, Json> Post(const Json& body) {
    httplib::Result r = client_->Post("/v1/chat/completions", body.dump(), "application/json");
    if (!r) return {0, Json()};
    return {r->status, Json::parse(r->body, nullptr, false)};
  }

  // The data events of a streamed request (without [DONE]).
  std::vector<Json> Stream(Json body) {
    body["stream"] = true;
    httplib::Result r = client_->Post("/v1/chat/completions", body.dump(), "application/json");
    std::vector<Json> events;
    if (!r) return events;
    EXPECT_EQ(r->status, 200) << r->body;
    EXPECT_TRUE(r->body.ends_with("data: [DONE]\n\n")) << r->body;
    std::stringstream ss(r->body);
    for (std::string line; std::getline(ss, line);) {
      if (line.rfind("data: {", 0) == 0) events.push_back(Json::parse(line.substr(6)));
    }
    return events;
  }

  std::filesystem::path dir_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<structured::ConstraintCompiler> compiler_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<HttpServer> server_;
  std::unique_ptr<httplib::Client> client_;
  std::string reasoning_parser_;  // the server's, set before Serve
};

TEST_F(HttpToolsTest, AutoParsesTheCallIntoToolCalls) {
  Serve(kCall);
  auto [status, body] = Post(Request(Json::object()));
  ASSERT_EQ(status, 200) << body;
  const Json& choice = body["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  EXPECT_TRUE(choice["message"]["content"].is_null()) << body;
  ASSERT_EQ(choice["message"]["tool_calls"].size(), 1u) << body;
  const Json& call = choice["message"]["tool_calls"][0];
  EXPECT_EQ(call["type"], "function");
  EXPECT_FALSE(call["id"].get<std::string>().empty());
  EXPECT_EQ(call["function"]["name"], "get_weather");
  EXPECT_EQ(Json::parse(call["function"]["arguments"].get<std::string>()),
            Json::parse(R"({"city": "Paris", "unit": "celsius"})"));
}

TEST_F(HttpToolsTest, StreamedCallComesAsDeltasWithIdNameThenArguments) {
  Serve(std::string("Checking.\n") + kCall);
  auto [status, whole] = Post(Request(Json::object()));
  ASSERT_EQ(status, 200) << whole;
  EXPECT_EQ(whole["choices"][0]["message"]["content"], "Checking.");
  const std::vector<Json> events = Stream(Request(Json::object()));
  ASSERT_FALSE(events.empty());
  std::string content, arguments, name, id;
  int headers = 0;
  std::string finish;
  for (const Json& e : events) {
    const Json& c = e["choices"][0];
    const Json& delta = c["delta"];
    if (delta.contains("content")) content += delta["content"].get<std::string>();
    if (delta.contains("tool_calls")) {
      const Json& call = delta["tool_calls"][0];
      EXPECT_EQ(call["index"], 0);
      if (call.contains("id")) {
        ++headers;
        id = call["id"];
        name = call["function"]["name"];
        EXPECT_EQ(call["type"], "function");
        EXPECT_EQ(call["function"]["arguments"], "");
      } else {
        EXPECT_EQ(headers, 1) << "arguments before the call's id and name";
        arguments += call["function"]["arguments"].get<std::string>();
      }
    }
    if (!c["finish_reason"].is_null()) finish = c["finish_reason"];
  }
  EXPECT_EQ(headers, 1);
  EXPECT_EQ(name, "get_weather");
  EXPECT_FALSE(id.empty());
  EXPECT_EQ(arguments, whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]);
  EXPECT_EQ(std::string(absl::StripAsciiWhitespace(content)), "Checking.");
  EXPECT_EQ(finish, "tool_calls");
}

// --reasoning_parser qwen3: the <think> block is message.reasoning_content (streamed as
// reasoning_content deltas), the rest the content, and a call after the block is parsed as usual.
TEST_F(HttpToolsTest, ReasoningIsSplitOffBeforeCallsAreParsed) {
  reasoning_parser_ = "qwen3";
  const std::string reasoning = "\nThe user wants Paris. I <b>should</b> call the tool.\n";
  Serve("<think>" + reasoning + "</think>\n\nChecking.\n" + kCall);
  auto [status, whole] = Post(Request(Json::object()));
  ASSERT_EQ(status, 200) << whole;
  const Json& message = whole["choices"][0]["message"];
  EXPECT_EQ(message["reasoning_content"], reasoning);
  EXPECT_EQ(message["content"], "Checking.");  // the text around a call is trimmed
  ASSERT_EQ(message["tool_calls"].size(), 1u) << whole;
  EXPECT_EQ(message["tool_calls"][0]["function"]["name"], "get_weather");
  std::string streamed_reasoning, content;
  int calls = 0;
  for (const Json& e : Stream(Request(Json::object()))) {
    const Json& delta = e["choices"][0]["delta"];
    if (delta.contains("reasoning_content")) {
      EXPECT_TRUE(content.empty()) << "reasoning after content";
      streamed_reasoning += delta["reasoning_content"].get<std::string>();
    }
    content += delta.value("content", "");
    if (delta.contains("tool_calls") && delta["tool_calls"][0].contains("id")) ++calls;
  }
  EXPECT_EQ(streamed_reasoning, reasoning);
  EXPECT_EQ(std::string(absl::StripAsciiWhitespace(content)), "Checking.");
  EXPECT_EQ(calls, 1);
  // Without the block, everything is content; reasoning_content is null.
  auto [plain_status, plain] = Post(Request({{"tool_choice", "none"}, {"stop", Json::array({"<think>"})}}));
  ASSERT_EQ(plain_status, 200) << plain;
  EXPECT_EQ(plain["choices"][0]["message"]["content"], "");
  EXPECT_TRUE(plain["choices"][0]["message"]["reasoning_content"].is_null()) << plain;
}

// An answer shaped by a constraint (structured output, allowed_token_ids, an enforced call) holds
// no reasoning block: with deepseek_r1 (whose answers start in the reasoning) it stays content, so
// the call in it is still parsed, and the answer has no reasoning_content.
TEST_F(HttpToolsTest, ConstrainedAnswersAreNotSplitForReasoning) {
  reasoning_parser_ = "deepseek_r1";
  Serve(kCall);
  Json every = Json::array();
  for (int32_t t = 0; t < tokenizer_->vocab_size(); ++t) every.push_back(t);
  for (const bool streamed : {false, true}) {
    SCOPED_TRACE(streamed ? "streamed" : "whole");
    int calls = 0;
    bool reasoning = false;
    if (streamed) {
      for (const Json& e : Stream(Request({{"allowed_token_ids", every}}))) {
        const Json& delta = e["choices"][0]["delta"];
        reasoning = reasoning || delta.contains("reasoning_content");
        if (delta.contains("tool_calls") && delta["tool_calls"][0].contains("id")) ++calls;
      }
    } else {
      auto [status, body] = Post(Request({{"allowed_token_ids", every}}));
      ASSERT_EQ(status, 200) << body;
      EXPECT_EQ(body["choices"][0]["finish_reason"], "tool_calls");
      calls = static_cast<int>(body["choices"][0]["message"]["tool_calls"].size());
      reasoning = body["choices"][0]["message"].contains("reasoning_content");
    }
    EXPECT_EQ(calls, 1);
    EXPECT_FALSE(reasoning);
  }
  // A free answer is split: without </think>, deepseek_r1 takes all of it as reasoning.
  auto [status, body] = Post(Request({{"tool_choice", "none"}}));
  ASSERT_EQ(status, 200) << body;
  EXPECT_EQ(body["choices"][0]["message"]["reasoning_content"], kCall);
  EXPECT_EQ(body["choices"][0]["message"]["content"], "");
}

TEST_F(HttpToolsTest, WithoutAReasoningParserThereIsNoReasoningContent) {
  Serve("<think>x</think>y");
  auto [status, body] = Post(Request({{"tool_choice", "none"}}));
  ASSERT_EQ(status, 200) << body;
  EXPECT_EQ(body["choices"][0]["message"]["content"], "<think>x</think>y");
  EXPECT_FALSE(body["choices"][0]["message"].contains("reasoning_content"));
  reasoning_parser_ = "r1";
  EXPECT_FALSE(HttpServer::Start({.listen = "127.0.0.1:0", .reasoning_parser = reasoning_parser_}, nullptr,
                                 scheduler_.get(), [] { return absl::OkStatus(); })
                   .ok());
}

// GPT-OSS's harmony format (a harmony chat template; no --reasoning_parser needed): the analysis
// channel is message.reasoning_content, the final channel the content, a message to
// functions.NAME a tool call (its <|call|> ends the answer), and no markup reaches the client.
TEST_F(HttpToolsTest, HarmonyChannelsBecomeReasoningContentAndCalls) {
  const std::string call =
      "<|channel|>analysis<|message|>The user wants Paris.<|end|><|start|>assistant<|channel|>commentary "
      "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\", \"unit\": \"celsius\"}<|call|>"
      "never reached";
  Serve(call, testing::HarmonyChatTemplate(), testing::HarmonyTokenizerJson());
  auto [status, whole] = Post(Request(Json::object()));
  ASSERT_EQ(status, 200) << whole;
  const Json& message = whole["choices"][0]["message"];
  EXPECT_EQ(message["reasoning_content"], "The user wants Paris.");
  EXPECT_TRUE(message["content"].is_null()) << whole;
  ASSERT_EQ(message["tool_calls"].size(), 1u) << whole;
  EXPECT_EQ(message["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(Json::parse(message["tool_calls"][0]["function"]["arguments"].get<std::string>()),
            Json::parse(R"({"city": "Paris", "unit": "celsius"})"));
  EXPECT_EQ(whole["choices"][0]["finish_reason"], "tool_calls");
  std::string reasoning, content, name;
  for (const Json& e : Stream(Request(Json::object()))) {
    const Json& delta = e["choices"][0]["delta"];
    reasoning += delta.value("reasoning_content", "");
    content += delta.value("content", "");
    if (delta.contains("tool_calls") && delta["tool_calls"][0].contains("id")) {
      name = delta["tool_calls"][0]["function"]["name"];
    }
  }
  EXPECT_EQ(reasoning, "The user wants Paris.");
  EXPECT_EQ(std::string(absl::StripAsciiWhitespace(content)), "");
  EXPECT_EQ(name, "get_weather");
}

// A shaped answer in harmony goes in the message the prompt opens for it: a named tool choice opens
// a call of that function (the constraint shapes its arguments alone), structured output the final
// channel; "required" (any function) cannot be enforced.
TEST_F(HttpToolsTest, HarmonyShapedAnswersGoInTheMessageThePromptOpens) {
  const std::string args = R"({"city":"Paris","unit":"celsius"})";
  Serve(args + "<|return|>", testing::HarmonyChatTemplate(), testing::HarmonyTokenizerJson());
  auto [auto_status, free] = Post(Request({{"max_tokens", 1}}));
  ASSERT_EQ(auto_status, 200) << free;
  const Json named_choice = {{"type", "function"}, {"function", {{"name", "get_weather"}}}};
  auto [status, named] = Post(Request({{"tool_choice", named_choice}}));
  ASSERT_EQ(status, 200) << named;
  const Json& message = named["choices"][0]["message"];
  ASSERT_EQ(message["tool_calls"].size(), 1u) << named;
  EXPECT_EQ(message["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(Json::parse(message["tool_calls"][0]["function"]["arguments"].get<std::string>()), Json::parse(args));
  EXPECT_TRUE(message["content"].is_null()) << named;
  EXPECT_EQ(named["choices"][0]["finish_reason"], "tool_calls");
  // The prompt is the free one and the opened call's header.
  absl::StatusOr<std::vector<int32_t>> opened =
      tokenizer_->Encode("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>", false);
  ASSERT_TRUE(opened.ok());
  EXPECT_EQ(named["usage"]["prompt_tokens"].get<size_t>(), free["usage"]["prompt_tokens"].get<size_t>() + opened->size());
  // Streamed, the same call.
  std::string name, streamed_args;
  for (const Json& e : Stream(Request({{"tool_choice", named_choice}}))) {
    const Json& delta = e["choices"][0]["delta"];
    if (!delta.contains("tool_calls")) continue;
    if (delta["tool_calls"][0].contains("id")) name = delta["tool_calls"][0]["function"]["name"];
    else streamed_args += delta["tool_calls"][0]["function"]["arguments"].get<std::string>();
  }
  EXPECT_EQ(name, "get_weather");
  EXPECT_EQ(Json::parse(streamed_args), Json::parse(args));

  // Structured output: the final channel, so the JSON is the content.
  auto [shaped_status, shaped] = Post(Request({{"tool_choice", "none"}, {"response_format", {{"type", "json_object"}}}}));
  ASSERT_EQ(shaped_status, 200) << shaped;
  EXPECT_EQ(Json::parse(shaped["choices"][0]["message"]["content"].get<std::string>()), Json::parse(args));
  EXPECT_FALSE(shaped["choices"][0]["message"].contains("tool_calls"));
  absl::StatusOr<std::vector<int32_t>> final_header = tokenizer_->Encode("<|channel|>final<|message|>", false);
  ASSERT_TRUE(final_header.ok());
  EXPECT_EQ(shaped["usage"]["prompt_tokens"].get<size_t>(),
            free["usage"]["prompt_tokens"].get<size_t>() + final_header->size());

  auto [required_status, required] = Post(Request({{"tool_choice", "required"}}));
  EXPECT_EQ(required_status, 400) << required;
  EXPECT_EQ(required["error"]["param"], "tool_choice") << required;
}

TEST_F(HttpToolsTest, HarmonyFinalAnswerIsTheContent) {
  Serve("<|channel|>analysis<|message|>Easy: <b>sunny</b>.<|end|><|start|>assistant<|channel|>final<|message|>"
        "It is sunny, 21 °C.<|return|>",
        testing::HarmonyChatTemplate(), testing::HarmonyTokenizerJson());
  for (const Json& extra : {Json::object(), Json{{"tool_choice", "none"}}, Json{{"skip_special_tokens", true}}}) {
    SCOPED_TRACE(extra.dump());
    auto [status, whole] = Post(Request(extra));
    ASSERT_EQ(status, 200) << whole;
    EXPECT_EQ(whole["choices"][0]["message"]["reasoning_content"], "Easy: <b>sunny</b>.");
    EXPECT_EQ(whole["choices"][0]["message"]["content"], "It is sunny, 21 °C.");
    EXPECT_FALSE(whole["choices"][0]["message"].contains("tool_calls"));
    EXPECT_EQ(whole["choices"][0]["finish_reason"], "stop");
  }
  std::string reasoning, content;
  for (const Json& e : Stream(Request(Json::object()))) {
    const Json& delta = e["choices"][0]["delta"];
    if (delta.contains("reasoning_content")) {
      EXPECT_TRUE(content.empty()) << "reasoning after content";
      reasoning += delta["reasoning_content"].get<std::string>();
    }
    content += delta.value("content", "");
  }
  EXPECT_EQ(reasoning, "Easy: <b>sunny</b>.");
  EXPECT_EQ(content, "It is sunny, 21 °C.");
  // A completion of the same model is its raw text, special tokens left out as usual.
  httplib::Result r = client_->Post("/v1/completions",
                                    Json{{"prompt", "Hi"}, {"max_tokens", 400}, {"stop", Json::array({kEnd})}}.dump(),
                                    "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(Json::parse(r->body)["choices"][0]["text"],
            "analysisEasy: <b>sunny</b>.assistantfinalIt is sunny, 21 °C.");
}

// A conversation carries on as OpenAI's clients carry it: the assistant message the server returned
// (reasoning_content, content null, tool_calls, refusal null) comes back with the tool's answer;
// the template sees the reasoning as `reasoning_content` and `thinking`. Only an assistant message
// has reasoning.
TEST_F(HttpToolsTest, ReasoningSentBackReachesTheTemplate) {
  Serve("x", "{% for m in messages %}[{{ m.role }}|{{ m.thinking }}|{{ m.reasoning_content }}|{{ m.content }}]{% endfor %}");
  const Json messages = Json::parse(R"([{"role": "user", "content": "Weather?"},
      {"role": "assistant", "content": null, "reasoning_content": "Need a call.", "refusal": null,
       "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])");
  httplib::Result r = client_->Post("/tokenize", Json{{"messages", messages}}.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  absl::StatusOr<std::string> text =
      tokenizer_->Decode(Json::parse(r->body)["tokens"].get<std::vector<int32_t>>(), false);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "[user|||Weather?][assistant|Need a call.|Need a call.|][tool|||sunny]");
  auto [status, body] = Post(Request({{"messages", messages}, {"tool_choice", "none"}}));
  EXPECT_EQ(status, 200) << body;
  Json bad = messages;
  bad[0]["reasoning_content"] = "users do not reason here";
  auto [bad_status, bad_body] = Post(Request({{"messages", bad}}));
  EXPECT_EQ(bad_status, 400);
  EXPECT_THAT(bad_body["error"]["message"].get<std::string>(), HasSubstr("only an assistant message carries reasoning"));
}

TEST_F(HttpToolsTest, ToolChoiceNoneLeavesTheTextAlone) {
  Serve(kCall);
  auto [status, body] = Post(Request({{"tool_choice", "none"}}));
  ASSERT_EQ(status, 200) << body;
  EXPECT_EQ(body["choices"][0]["message"]["content"], kCall);
  EXPECT_FALSE(body["choices"][0]["message"].contains("tool_calls"));
  EXPECT_EQ(body["choices"][0]["finish_reason"], "stop");
  std::string streamed;
  for (const Json& e : Stream(Request({{"tool_choice", "none"}}))) {
    EXPECT_FALSE(e["choices"][0]["delta"].contains("tool_calls"));
    streamed += e["choices"][0]["delta"].value("content", "");
  }
  EXPECT_EQ(streamed, kCall);
}

TEST_F(HttpToolsTest, PlainAndMalformedOutputStaysContent) {
  const std::string broken = "I will call <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>";
  Serve(broken);
  auto [status, body] = Post(Request(Json::object()));
  ASSERT_EQ(status, 200) << body;
  EXPECT_EQ(body["choices"][0]["message"]["content"], broken);
  EXPECT_FALSE(body["choices"][0]["message"].contains("tool_calls"));
  EXPECT_EQ(body["choices"][0]["finish_reason"], "stop");
  std::string streamed;
  for (const Json& e : Stream(Request(Json::object()))) streamed += e["choices"][0]["delta"].value("content", "");
  EXPECT_EQ(streamed, broken);
}

// The prompt of a conversation with tools, a call (its arguments as OpenAI's JSON text) and the
// tool's answer is what jinja2 renders for the same conversation (arguments as objects).
TEST_F(HttpToolsTest, PromptWithToolsCallsAndAnswersIsJinja2s) {
  Serve("Fine.");
  std::ifstream in("tests/coordinator/http/jinja_golden.json");
  std::stringstream ss;
  ss << in.rdbuf();
  const Json golden = Json::parse(ss.str());
  const Json* golden_case = nullptr;
  for (const Json& c : golden["cases"]) {
    if (c["name"] == "qwen2.5_tool_call_and_answer") golden_case = &c;
  }
  ASSERT_NE(golden_case, nullptr);
  Json messages = (*golden_case)["context"]["messages"];
  for (Json& m : messages) {
    if (!m.contains("tool_calls")) continue;
    for (Json& call : m["tool_calls"]) call["function"]["arguments"] = call["function"]["arguments"].dump();
  }
  Json request = Request({{"messages", messages}, {"max_tokens", 3}});
  request["tools"] = (*golden_case)["context"]["tools"];
  auto [status, body] = Post(request);
  ASSERT_EQ(status, 200) << body;
  absl::StatusOr<std::vector<int32_t>> expected =
      tokenizer_->Encode((*golden_case)["output"].get<std::string>(), /*add_special_tokens=*/false);
  ASSERT_TRUE(expected.ok());
  EXPECT_EQ(body["usage"]["prompt_tokens"], expected->size());
  // The same conversation without its tools is another prompt.
  request.erase("tools");
  auto [status2, body2] = Post(request);
  ASSERT_EQ(status2, 200) << body2;
  EXPECT_NE(body2["usage"]["prompt_tokens"], expected->size());
}

// vLLM's continue_final_message: the prompt ends right after the final (assistant) message's
// content, where with add_generation_prompt false alone the template closes that message.
TEST_F(HttpToolsTest, ContinueFinalMessageLeavesTheAssistantsMessageOpen) {
  Serve("x");
  auto tokenize = [this](const Json& body) {
    httplib::Result r = client_->Post("/tokenize", body.dump(), "application/json");
    EXPECT_TRUE(r);
    return r ? std::make_pair(r->status, Json::parse(r->body, nullptr, false)) : std::make_pair(0, Json());
  };
  for (const std::string started : {"The weather in Paris is", "The weather in Paris is "}) {
    SCOPED_TRACE(started);
    const Json messages = Json::array({{{"role", "user"}, {"content", "Weather in Paris?"}},
                                       {{"role", "assistant"}, {"content", started}}});
    auto [closed_status, closed] = tokenize({{"messages", messages}, {"add_generation_prompt", false}});
    ASSERT_EQ(closed_status, 200) << closed;
    absl::StatusOr<std::string> closed_text = tokenizer_->Decode(closed["tokens"].get<std::vector<int32_t>>(), false);
    ASSERT_TRUE(closed_text.ok());
    const std::string end_of_turn = "<|im_end|>\n";
    ASSERT_TRUE(closed_text->ends_with(started + end_of_turn)) << *closed_text;
    auto [open_status, open] =
        tokenize({{"messages", messages}, {"add_generation_prompt", false}, {"continue_final_message", true}});
    ASSERT_EQ(open_status, 200) << open;
    absl::StatusOr<std::vector<int32_t>> want =
        tokenizer_->Encode(closed_text->substr(0, closed_text->size() - end_of_turn.size()), false);
    ASSERT_TRUE(want.ok());
    EXPECT_EQ(open["tokens"].get<std::vector<int32_t>>(), *want);
    // A chat request continues that prompt.
    Json request = Request({{"messages", messages}, {"max_tokens", 2}, {"add_generation_prompt", false},
                            {"continue_final_message", true}});
    request.erase("tools");
    auto [status, body] = Post(request);
    ASSERT_EQ(status, 200) << body;
    EXPECT_EQ(body["usage"]["prompt_tokens"], want->size());
  }
  // Refused, naming the field: with add_generation_prompt (true by default), with nothing to
  // continue, and for a plain prompt.
  const Json one = Json::array({{{"role", "user"}, {"content", "Hi"}}, {{"role", "assistant"}, {"content", " "}}});
  Json both = Request({{"messages", one}, {"continue_final_message", true}});
  auto [both_status, both_body] = Post(both);
  EXPECT_EQ(both_status, 400);
  EXPECT_EQ(both_body["error"]["param"], "continue_final_message") << both_body;
  Json empty = Request({{"messages", one}, {"continue_final_message", true}, {"add_generation_prompt", false}});
  auto [empty_status, empty_body] = Post(empty);
  EXPECT_EQ(empty_status, 400);
  EXPECT_THAT(empty_body["error"]["message"].get<std::string>(), HasSubstr("a final message with content"));
  auto [plain_status, plain] = tokenize({{"prompt", "Hi"}, {"continue_final_message", true}});
  EXPECT_EQ(plain_status, 400);
  EXPECT_EQ(plain["error"]["param"], "continue_final_message") << plain;
}

// vLLM's chat_template_kwargs: more variables for the template, here a switch in the manner of
// Qwen3's enable_thinking (an empty thinking block when it is false), in /tokenize and in chat.
TEST_F(HttpToolsTest, ChatTemplateKwargsReachTheTemplate) {
  Serve("x",
        "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
        "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
        "{% endif %}");
  const Json messages = Json::array({{{"role", "user"}, {"content", "Hi"}}});
  auto tokenize = [this](const Json& body) {
    httplib::Result r = client_->Post("/tokenize", body.dump(), "application/json");
    EXPECT_TRUE(r);
    return r ? std::make_pair(r->status, Json::parse(r->body, nullptr, false)) : std::make_pair(0, Json());
  };
  auto text_of = [this](const Json& body) {
    return tokenizer_->Decode(body["tokens"].get<std::vector<int32_t>>(), false).value_or("?");
  };
  const std::string head = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
  auto [plain_status, plain] = tokenize({{"messages", messages}});
  ASSERT_EQ(plain_status, 200) << plain;
  EXPECT_EQ(text_of(plain), head);
  auto [on_status, on] = tokenize({{"messages", messages}, {"chat_template_kwargs", {{"enable_thinking", true}}}});
  ASSERT_EQ(on_status, 200) << on;
  EXPECT_EQ(text_of(on), head);
  auto [off_status, off] = tokenize({{"messages", messages}, {"chat_template_kwargs", {{"enable_thinking", false}}}});
  ASSERT_EQ(off_status, 200) << off;
  EXPECT_EQ(text_of(off), head + "<think>\n\n</think>\n\n");
  // A chat request renders its prompt the same way.
  Json request =
      Request({{"messages", messages}, {"max_tokens", 1}, {"chat_template_kwargs", {{"enable_thinking", false}}}});
  request.erase("tools");
  auto [status, body] = Post(request);
  ASSERT_EQ(status, 200) << body;
  EXPECT_EQ(body["usage"]["prompt_tokens"], off["count"]);
  // Refused, naming the field: not an object, a variable the server sets, and for a plain prompt.
  for (const Json& kwargs : {Json(5), Json({{"messages", Json::array()}}), Json({{"add_generation_prompt", false}})}) {
    SCOPED_TRACE(kwargs.dump());
    Json bad = Request({{"messages", messages}, {"chat_template_kwargs", kwargs}});
    bad.erase("tools");
    auto [bad_status, bad_body] = Post(bad);
    EXPECT_EQ(bad_status, 400);
    EXPECT_EQ(bad_body["error"]["param"], "chat_template_kwargs") << bad_body;
    auto [tok_status, tok_body] = tokenize({{"messages", messages}, {"chat_template_kwargs", kwargs}});
    EXPECT_EQ(tok_status, 400);
    EXPECT_EQ(tok_body["error"]["param"], "chat_template_kwargs") << tok_body;
  }
  // Nesting is bounded before the body is parsed (brackets inside strings do not count).
  EXPECT_EQ(frontend::JsonNestingDepth(R"({"a": "[[[{", "b": [[1], {"c": "]\"["}]})"), 3u);
  const std::string deep = R"({"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"a": )" +
                           std::string(100, '[') + std::string(100, ']') + "}}";
  httplib::Result deep_result = client_->Post("/v1/chat/completions", deep, "application/json");
  ASSERT_TRUE(deep_result);
  EXPECT_EQ(deep_result->status, 400);
  EXPECT_NE(deep_result->body.find("nests 102 levels"), std::string::npos) << deep_result->body;
  auto [prompt_status, prompt_body] = tokenize({{"prompt", "Hi"}, {"chat_template_kwargs", {{"a", 1}}}});
  EXPECT_EQ(prompt_status, 400);
  EXPECT_EQ(prompt_body["error"]["param"], "chat_template_kwargs") << prompt_body;
}

// A GLM-4.5-style chat template of our own: it teaches GLM-4.5's call format (so "glm45" calls are
// detected) and writes the tools, the turns and GLM-4.5's role tags.
constexpr char kGlm45Template[] =
    "[gMASK]<sop>{% if tools %}<|system|>\n# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}</tools>\nCall a function as:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n"
    "<arg_value>{arg-value-1}</arg_value>\n</tool_call>{% endif %}{% for m in messages %}<|{{ m.role }}|>\n"
    "{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
constexpr char kGlm45Answer[] =
    "\n<think>Paris it is.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>1984</arg_value>\n"
    "<arg_key>unit</arg_key>\n<arg_value>celsius</arg_value>\n</tool_call>";

// GLM-4.5 (--reasoning_parser glm45; its call format detected from the template): the <think>
// block after the newline is the reasoning, the call's arguments are typed by the tool's schema
// (the string "1984" stays a string), whole and streamed; an enforced call is refused, naming
// tool_choice.
TEST_F(HttpToolsTest, Glm45ReasoningAndTaggedCalls) {
  reasoning_parser_ = "glm45";
  Serve(kGlm45Answer, kGlm45Template);
  auto [status, whole] = Post(Request(Json::object()));
  ASSERT_EQ(status, 200) << whole;
  const Json& choice = whole["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  EXPECT_EQ(choice["message"]["reasoning_content"], "Paris it is.");
  EXPECT_TRUE(choice["message"]["content"].is_null()) << whole;
  ASSERT_EQ(choice["message"]["tool_calls"].size(), 1u) << whole;
  EXPECT_EQ(choice["message"]["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(choice["message"]["tool_calls"][0]["function"]["arguments"], R"({"city":"1984","unit":"celsius"})");
  std::string reasoning, arguments, name;
  for (const Json& e : Stream(Request(Json::object()))) {
    const Json& delta = e["choices"][0]["delta"];
    reasoning += delta.value("reasoning_content", "");
    EXPECT_EQ(std::string(absl::StripAsciiWhitespace(delta.value("content", ""))), "") << e;
    if (!delta.contains("tool_calls")) continue;
    const Json& call = delta["tool_calls"][0];
    if (call.contains("id")) name = call["function"]["name"];
    arguments += call["function"]["arguments"].get<std::string>();
  }
  EXPECT_EQ(reasoning, "Paris it is.");
  EXPECT_EQ(name, "get_weather");
  EXPECT_EQ(arguments, R"({"city":"1984","unit":"celsius"})");
  for (const Json& choice_field : {Json("required"), Json{{"type", "function"}, {"function", {{"name", "get_time"}}}}}) {
    auto [refused, body] = Post(Request({{"tool_choice", choice_field}}));
    EXPECT_EQ(refused, 400) << body;
    EXPECT_EQ(body["error"]["param"], "tool_choice") << body;
    EXPECT_THAT(body["error"]["message"].get<std::string>(), HasSubstr("GLM-4.5")) << body;
  }
  // tool_choice none: the call stays text.
  auto [none_status, none] = Post(Request({{"tool_choice", "none"}}));
  ASSERT_EQ(none_status, 200) << none;
  EXPECT_THAT(none["choices"][0]["message"]["content"].get<std::string>(), HasSubstr("<arg_key>city</arg_key>"));
}

TEST_F(HttpToolsTest, BadToolRequestsAre400NamingTheField) {
  Serve("x");
  const struct {
    Json extra;
    const char* param;
  } cases[] = {
      {{{"tool_choice", "sometimes"}}, "tool_choice"},
      {{{"tool_choice", {{"type", "function"}, {"function", {{"name", "nope"}}}}}}, "tool_choice"},
      {{{"tools", "get_weather"}}, "tools"},
      {{{"tools", Json::array({{{"type", "function"}, {"function", {{"name", "a b"}}}}})}}, "tools[0]"},
      {{{"tools", Json::array({Tools()[0], Tools()[0]})}}, "tools[1]"},
      {{{"tool_choice", "required"}, {"response_format", {{"type", "json_object"}}}}, "tool_choice"},
      {{{"parallel_tool_calls", "yes"}}, "parallel_tool_calls"},
      {{{"messages", Json::array({{{"role", "assistant"}, {"tool_calls", Json::array({{{"id", "1"}}})}}})}},
       "messages[0].tool_calls[0].function"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.extra.dump());
    auto [status, body] = Post(Request(c.extra));
    EXPECT_EQ(status, 400) << body;
    EXPECT_EQ(body["error"]["param"], c.param) << body;
  }
  Json no_tools = Request({{"tool_choice", "auto"}});
  no_tools.erase("tools");
  auto [status, body] = Post(no_tools);
  EXPECT_EQ(status, 400);
  EXPECT_EQ(body["error"]["param"], "tool_choice");
}

}  // namespace
}  // namespace shardserve::coordinator::http

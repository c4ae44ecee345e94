// tool_choice "required" and a named function end to end over HTTP: the model's tool-calling chat
// template (Qwen2.5-Instruct's: hermes <tool_call> tags; Llama-3.1-Instruct's: JSON with
// "parameters"; the format detected from it), the constraint built from the tools' parameter
// schemas, the real engine (stories260K, in-process) sampling at temperature 1 over several
// seeds: every answer must parse into tool_calls whose arguments validate against their tool's
// schema, streamed and not.
#include <httplib.h>

#include <csignal>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/model_spec/model_spec.h"
#include "common/tokenizer/tokenizer.h"
#include "coordinator/http/http_server.h"
#include "coordinator/scheduler/scheduler.h"
#include "coordinator/structured/grammar.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/coordinator/structured/json_validator.h"
#include "tests/testing/engine_replica.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace shardserve::coordinator {
namespace {

using ::shardserve::testing::EngineReplica;
using ::shardserve::testing::EngineReplicaOptions;
using ::shardserve::testing::IsOk;
using testing_json::Json;

constexpr char kModelDir[] = "../shared/models/stories260K";

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

constexpr char kTools[] = R"([
  {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
      "city": {"type": "string", "maxLength": 12},
      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
      "days": {"type": "integer"},
      "where": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                "required": ["lat", "lon"], "additionalProperties": false}},
      "required": ["city", "unit"], "additionalProperties": false}}},
  {"type": "function", "function": {"name": "send_mail", "parameters": {"type": "object", "properties": {
      "to": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 2},
      "urgent": {"type": "boolean"}}, "required": ["to", "urgent"], "additionalProperties": false}}}])";

// The template file under tests/coordinator/http/chat_templates/.
class ToolsHttpTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    std::signal(SIGPIPE, SIG_IGN);
    for (const char* f : {"model.safetensors", "tokenizer.json", "tokenizer.model", "special_tokens_map.json",
                          "generation_config.json"}) {
      dir_.Write(f, ReadAll(absl::StrCat(kModelDir, "/", f)));
    }
    // A longer context than the model's 512 tokens, for the prompts that list the tools (the
    // answers are constrained, so what the model makes of far positions does not matter).
    Json model_config = Json::parse(ReadAll(absl::StrCat(kModelDir, "/config.json")));
    model_config["max_position_embeddings"] = 4096;
    dir_.Write("config.json", model_config.dump());
    Json config = Json::parse(ReadAll(absl::StrCat(kModelDir, "/tokenizer_config.json")));
    config["chat_template"] = ReadAll(absl::StrCat("tests/coordinator/http/chat_templates/", GetParam()));
    dir_.Write("tokenizer_config.json", config.dump());
    ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(dir_.path()));
    ASSERT_OK_AND_ASSIGN(tokenizer_, LoadTokenizer(dir_.path()));
    compiler_ = std::make_unique<structured::ConstraintCompiler>(
        structured::VocabularyFromTokenizer(*tokenizer_, static_cast<int32_t>(spec.vocab_size)));
    SchedulerOptions so;
    so.limits = {.vocab_size = spec.vocab_size, .max_seq_len = spec.max_position_embeddings};
    so.eos_token_ids = tokenizer_->eos_ids();
    scheduler_ = std::make_unique<Scheduler>(so);
    ASSERT_OK_AND_ASSIGN(auto replica, EngineReplica::Create(EngineReplicaOptions{.model_dir = dir_.path()}));
    const ReplicaOptions ro{.max_slots = 4, .kv_blocks = replica->kv_blocks(), .kv_block_size = 16};
    ASSERT_THAT(scheduler_->AddReplica(0, std::move(replica), ro), IsOk());
    absl::StatusOr<std::unique_ptr<http::HttpServer>> server = http::HttpServer::Start(
        {.listen = "127.0.0.1:0", .model_id = "stories", .model_path = dir_.path(), .constraints = compiler_.get()},
        tokenizer_.get(), scheduler_.get(), [] { return absl::OkStatus(); });
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    client_ = std::make_unique<httplib::Client>("127.0.0.1", server_->port());
    client_->set_read_timeout(120, 0);
  }
  void TearDown() override {
    if (scheduler_ != nullptr) scheduler_->Shutdown(absl::UnavailableError("shutting down"));
    if (server_ != nullptr) server_->Stop();
  }

  // No max_tokens: the answer may run to the end of the context (several parallel calls fit).
  static Json Request(const Json& tool_choice, int seed) {
    return {{"messages", Json::array({{{"role", "user"}, {"content", "Lily wants to know the weather."}}})},
            {"tools", Json::parse(kTools)},
            {"tool_choice", tool_choice},
            {"parallel_tool_calls", seed % 2 == 0},
            {"temperature", 1.0},
            {"seed", seed}};
  }

  // Every call names a tool (`only` when set) and its arguments validate against its schema.
  static void ExpectValidCalls(const Json& calls, const std::string& only) {
    ASSERT_TRUE(calls.is_array());
    ASSERT_FALSE(calls.empty());
    const Json tools = Json::parse(kTools);
    for (const Json& call : calls) {
      const std::string name = call["function"]["name"];
      if (!only.empty()) {
        EXPECT_EQ(name, only);
      }
      const Json* schema = nullptr;
      for (const Json& t : tools) {
        if (t["function"]["name"] == name) schema = &t["function"]["parameters"];
      }
      ASSERT_NE(schema, nullptr) << "unknown tool " << name;
      const std::string text = call["function"]["arguments"];
      const Json args = Json::parse(text, nullptr, false);
      ASSERT_FALSE(args.is_discarded()) << text;
      EXPECT_EQ(testing_json::Validate(args, *schema, *schema), "") << text;
      EXPECT_FALSE(call["id"].get<std::string>().empty());
      EXPECT_EQ(call["type"], "function");
    }
  }

  std::pair<int, Json> Post(const Json& body) {
    httplib::Result r = client_->Post("/v1/chat/completions", body.dump(), "application/json");
    if (!r) return {0, Json()};
    return {r->status, Json::parse(r->body, nullptr, false)};
  }

  ::shardserve::testing::TempDir dir_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<structured::ConstraintCompiler> compiler_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<http::HttpServer> server_;
  std::unique_ptr<httplib::Client> client_;
};

TEST_P(ToolsHttpTest, RequiredAndNamedCallsAlwaysParseAndValidate) {
  const Json named = {{"type", "function"}, {"function", {{"name", "send_mail"}}}};
  for (const Json& choice : {Json("required"), named}) {
    for (int seed = 1; seed <= 4; ++seed) {
      SCOPED_TRACE(absl::StrCat(choice.dump(), " seed ", seed));
      auto [status, body] = Post(Request(choice, seed));
      ASSERT_EQ(status, 200) << body;
      const Json& c = body["choices"][0];
      EXPECT_EQ(c["finish_reason"], "tool_calls") << body;
      EXPECT_TRUE(c["message"]["content"].is_null()) << body;
      ExpectValidCalls(c["message"]["tool_calls"], choice.is_object() ? "send_mail" : "");
    }
  }
}

TEST_P(ToolsHttpTest, StreamedRequiredCallEqualsTheWholeAnswer) {
  const Json req = Request("required", 5);
  auto [status, whole] = Post(req);
  ASSERT_EQ(status, 200) << whole;
  Json streamed_req = req;
  streamed_req["stream"] = true;
  httplib::Result r = client_->Post("/v1/chat/completions", streamed_req.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  Json calls = Json::array();
  std::string finish;
  std::istringstream lines(r->body);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("data: {", 0) != 0) continue;
    const Json chunk = Json::parse(line.substr(6));
    const Json& c = chunk["choices"][0];
    if (!c["finish_reason"].is_null()) finish = c["finish_reason"];
    if (!c["delta"].contains("tool_calls")) continue;
    for (const Json& d : c["delta"]["tool_calls"]) {
      const size_t k = d["index"];
      if (d.contains("id")) {
        ASSERT_EQ(k, calls.size());
        calls.push_back({{"id", d["id"]}, {"type", d["type"]}, {"function", d["function"]}});
      } else {
        ASSERT_LT(k, calls.size());
        calls[k]["function"]["arguments"] =
            calls[k]["function"]["arguments"].get<std::string>() + d["function"]["arguments"].get<std::string>();
      }
    }
  }
  EXPECT_EQ(finish, "tool_calls");
  ExpectValidCalls(calls, "");
  const Json& expected = whole["choices"][0]["message"]["tool_calls"];
  ASSERT_EQ(calls.size(), expected.size());
  for (size_t k = 0; k < calls.size(); ++k) {
    EXPECT_EQ(calls[k]["function"], expected[k]["function"]);
  }
}

INSTANTIATE_TEST_SUITE_P(ModelTemplates, ToolsHttpTest,
                         ::testing::Values("qwen2.5_instruct.jinja", "llama3.1_instruct.jinja"),
                         [](const ::testing::TestParamInfo<const char*>& param) {
                           return std::string(param.index == 0 ? "Qwen25Hermes" : "Llama31Json");
                         });

}  // namespace
}  // namespace shardserve::coordinator

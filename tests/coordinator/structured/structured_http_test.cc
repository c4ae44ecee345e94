// response_format end to end over HTTP: the OpenAI front end compiles the schema, the scheduler
// masks, the real engine (stories260K, in-process) samples at temperature 1; the replies' text
// must parse and validate. Chat uses a copy of the model with a minimal chat template.
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
using ::testing::HasSubstr;
using testing_json::Json;

constexpr char kModelDir[] = "../shared/models/stories260K";

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

constexpr char kSchema[] =
    R"({"type":"object","properties":{"name":{"type":"string","maxLength":10},"age":{"type":"integer"},)"
    R"("pets":{"type":"array","items":{"enum":["cat","dog","fish"]},"maxItems":3},"happy":{"type":"boolean"}},)"
    R"("required":["name","age"],"additionalProperties":false})";

class StructuredHttpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::signal(SIGPIPE, SIG_IGN);
    // The model with a chat template that just joins the messages' contents.
    for (const char* f : {"config.json", "model.safetensors", "tokenizer.json", "tokenizer.model",
                          "special_tokens_map.json", "generation_config.json"}) {
      dir_.Write(f, ReadAll(absl::StrCat(kModelDir, "/", f)));
    }
    Json config = Json::parse(ReadAll(absl::StrCat(kModelDir, "/tokenizer_config.json")));
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}";
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

  std::pair<int, Json> Post(const std::string& path, const Json& body) {
    httplib::Result r = client_->Post(path.c_str(), body.dump(), "application/json");
    if (!r) return {0, Json()};
    return {r->status, Json::parse(r->body, nullptr, false)};
  }

  static Json SchemaFormat() {
    return {{"type", "json_schema"},
            {"json_schema", {{"name", "person"}, {"schema", Json::parse(kSchema)}, {"strict", true}}}};
  }

  ::shardserve::testing::TempDir dir_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<structured::ConstraintCompiler> compiler_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<http::HttpServer> server_;
  std::unique_ptr<httplib::Client> client_;
};

TEST_F(StructuredHttpTest, CompletionsWithJsonSchema) {
  const Json schema = Json::parse(kSchema);
  for (int seed = 1; seed <= 4; ++seed) {
    const Json req = {{"prompt", "Once upon a time"}, {"max_tokens", 300}, {"temperature", 1.0},
                      {"seed", seed},                 {"response_format", SchemaFormat()}};
    auto [status, body] = Post("/v1/completions", req);
    ASSERT_EQ(status, 200) << body;
    EXPECT_EQ(body["choices"][0]["finish_reason"], "stop");
    const std::string text = body["choices"][0]["text"];
    const Json v = Json::parse(text, nullptr, false);
    ASSERT_FALSE(v.is_discarded()) << text;
    EXPECT_EQ(testing_json::Validate(v, schema, schema), "") << text;
  }
}

TEST_F(StructuredHttpTest, ChatWithJsonSchemaStreamedAndNot) {
  const Json schema = Json::parse(kSchema);
  const Json messages = Json::array({{{"role", "user"}, {"content", "Tell me about Lily."}}});
  auto [status, body] = Post("/v1/chat/completions", {{"messages", messages}, {"seed", 7}, {"response_format", SchemaFormat()}});
  ASSERT_EQ(status, 200) << body;
  EXPECT_EQ(body["choices"][0]["finish_reason"], "stop");
  const std::string content = body["choices"][0]["message"]["content"];
  const Json v = Json::parse(content, nullptr, false);
  ASSERT_FALSE(v.is_discarded()) << content;
  EXPECT_EQ(testing_json::Validate(v, schema, schema), "") << content;

  // Streamed: the deltas join into the same text (same seed).
  const Json req = {{"messages", messages}, {"seed", 7}, {"stream", true}, {"response_format", SchemaFormat()}};
  httplib::Result r = client_->Post("/v1/chat/completions", req.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  std::string joined;
  std::istringstream lines(r->body);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("data: {", 0) != 0) continue;
    const Json chunk = Json::parse(line.substr(6));
    const Json& delta = chunk["choices"][0]["delta"];
    if (delta.contains("content") && delta["content"].is_string()) joined += delta["content"].get<std::string>();
  }
  EXPECT_EQ(joined, content);
}

TEST_F(StructuredHttpTest, JsonObjectStartsAnObject) {
  auto [status, body] = Post("/v1/completions", {{"prompt", "Once"}, {"max_tokens", 12}, {"seed", 3},
                                                 {"response_format", {{"type", "json_object"}}}});
  ASSERT_EQ(status, 200) << body;
  const std::string text = body["choices"][0]["text"];
  ASSERT_FALSE(text.empty());
  EXPECT_EQ(text[0], '{');
  if (body["choices"][0]["finish_reason"] == "stop") {
    EXPECT_TRUE(Json::parse(text, nullptr, false).is_object()) << text;
  }
  // "text" is the default: no constraint.
  EXPECT_EQ(Post("/v1/completions", {{"prompt", "Once"}, {"max_tokens", 2}, {"response_format", {{"type", "text"}}}}).first, 200);
}

// vLLM's guided_choice, guided_regex and guided_json.
TEST_F(StructuredHttpTest, VllmGuidedFields) {
  for (int seed = 1; seed <= 3; ++seed) {
    auto [status, body] = Post("/v1/completions", {{"prompt", "Once upon a time"}, {"seed", seed}, {"max_tokens", 50},
                                                    {"guided_choice", {"happy", "sad", "a \"big\" dog"}}});
    ASSERT_EQ(status, 200) << body;
    EXPECT_EQ(body["choices"][0]["finish_reason"], "stop");
    EXPECT_THAT(body["choices"][0]["text"].get<std::string>(), ::testing::AnyOf("happy", "sad", "a \"big\" dog"));
  }
  auto [rs, rb] = Post("/v1/completions", {{"prompt", "Once"}, {"seed", 2}, {"max_tokens", 50}, {"guided_regex", "[0-9]{3}-[a-z]{2}"}});
  ASSERT_EQ(rs, 200) << rb;
  EXPECT_THAT(rb["choices"][0]["text"].get<std::string>(), ::testing::MatchesRegex("[0-9]{3}-[a-z]{2}"));
  auto [js, jb] = Post("/v1/completions", {{"prompt", "Once"}, {"seed", 2}, {"max_tokens", 50},
                                           {"guided_json", {{"type", "array"}, {"items", {{"type", "boolean"}}}, {"maxItems", 3}}}});
  ASSERT_EQ(js, 200) << jb;
  const Json v = Json::parse(jb["choices"][0]["text"].get<std::string>(), nullptr, false);
  ASSERT_TRUE(v.is_array()) << jb;
  EXPECT_LE(v.size(), 3u);
  auto [bs, bb] = Post("/v1/completions", {{"prompt", "Once"}, {"guided_regex", "(a"}});
  EXPECT_EQ(bs, 400);
  EXPECT_EQ(bb["error"]["param"], "guided_regex");
}

TEST_F(StructuredHttpTest, UnsupportedSchemasAndFormatsAre400) {
  Json format = SchemaFormat();
  format["json_schema"]["schema"]["properties"]["name"]["pattern"] = "^[A-Z]";
  auto [status, body] = Post("/v1/completions", {{"prompt", "Once"}, {"response_format", format}});
  EXPECT_EQ(status, 400);
  EXPECT_EQ(body["error"]["param"], "response_format");
  EXPECT_THAT(body["error"]["message"].get<std::string>(), HasSubstr("\"pattern\" at /properties/name"));
  auto [s2, b2] = Post("/v1/completions", {{"prompt", "Once"}, {"response_format", {{"type", "yaml"}}}});
  EXPECT_EQ(s2, 400);
  EXPECT_EQ(b2["error"]["param"], "response_format");
  auto [s3, b3] = Post("/v1/completions", {{"prompt", "Once"}, {"response_format", {{"type", "json_schema"}}}});
  EXPECT_EQ(s3, 400);
  EXPECT_THAT(b3["error"]["message"].get<std::string>(), HasSubstr("json_schema"));
  auto [s4, b4] = Post("/v1/completions",
                       {{"prompt", "Once"}, {"response_format", {{"type", "json_object"}, {"strict", true}}}});
  EXPECT_EQ(s4, 400);
  EXPECT_THAT(b4["error"]["message"].get<std::string>(), HasSubstr("response_format.strict"));
}

}  // namespace
}  // namespace shardserve::coordinator

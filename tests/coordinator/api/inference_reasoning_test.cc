// The gRPC Inference service's reasoning split (--reasoning_parser), through a real gRPC channel,
// with a scripted model: a copy of a byte-level test tokenizer with Qwen2.5-Instruct's chat
// template (so "hermes" calls are detected), and a replica that samples a given token script.
// A chat answer the model writes freely streams its <think> block as reasoning_text and the rest
// as text; tool calls are parsed from the content alone; a resume cut inside a tag continues
// exactly; constrained and continued answers, and plain prompts, are not split.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "coordinator/api/inference_service.h"
#include "nlohmann/json.hpp"
#include "shardserve/v1/inference.grpc.pb.h"
#include "coordinator/frontend/harmony.h"
#include "tests/testing/harmony_model.h"
#include "tests/testing/script_replica.h"
#include "tests/testing/temp_dir.h"

namespace shardserve::coordinator {
namespace {

using ::shardserve::testing::ReadFileOrEmpty;
using ::shardserve::testing::ScriptReplica;

constexpr char kEnd[] = "@@END@@";  // ends each scripted answer (a stop string of every request)
constexpr char kCall[] =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
constexpr char kTools[] = R"([{"type": "function", "function": {"name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])";

// What one Generate call streamed.
struct Answer {
  grpc::Status status;
  std::vector<v1::GenerateResponse> messages;
  std::string reasoning, text;  // concatenated
  bool reasoning_after_text = false;  // a message's reasoning came after some text
  int tokens = 0;
};

class InferenceReasoningTest : public ::testing::Test {
 protected:
  // Serves a model whose output is the tokens of `parts`, each encoded on its own, then kEnd
  // (repeated), with Qwen2.5's chat template and the reasoning parser `parser` ("" = none).
  // With `harmony`: the harmony test tokenizer and chat template instead (tests/testing/harmony_model.h).
  // `chat_template` replaces Qwen2.5's when given.
  void Serve(const std::vector<std::string>& parts, const std::string& parser, bool harmony = false,
             const std::string& chat_template = "") {
    dir_ = std::filesystem::path(::testing::TempDir()) / ("inference_reasoning_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
    if (harmony) {
      std::ofstream(dir_ / "tokenizer.json") << testing::HarmonyTokenizerJson();
    } else {
      std::filesystem::copy_file("tests/golden/models/qwen2/tokenizer.json", dir_ / "tokenizer.json",
                                 std::filesystem::copy_options::overwrite_existing);
    }
    nlohmann::json config;
    config["chat_template"] = harmony ? testing::HarmonyChatTemplate()
                              : !chat_template.empty()
                                  ? chat_template
                                  : ReadFileOrEmpty("tests/coordinator/http/chat_templates/qwen2.5_instruct.jinja");
    std::ofstream(dir_ / "tokenizer_config.json") << config.dump();
    absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadTokenizer(dir_.string());
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = *std::move(tokenizer);
    std::vector<int32_t> script;
    part_ends_.clear();
    for (const std::string& part : parts) {
      absl::StatusOr<std::vector<int32_t>> ids = tokenizer_->Encode(part, false);
      ASSERT_TRUE(ids.ok()) << ids.status();
      script.insert(script.end(), ids->begin(), ids->end());
      part_ends_.push_back(script);
    }
    absl::StatusOr<std::vector<int32_t>> end = tokenizer_->Encode(kEnd, false);
    ASSERT_TRUE(end.ok()) << end.status();
    script.insert(script.end(), end->begin(), end->end());
    spec_.vocab_size = tokenizer_->vocab_size();
    SchedulerOptions so;
    so.limits = {.vocab_size = tokenizer_->vocab_size(), .max_seq_len = 4096};
    scheduler_ = std::make_unique<Scheduler>(so);
    // A millisecond per step: the stream's writes keep up, so the answer arrives in pieces.
    auto replica = std::make_unique<ScriptReplica>(script, absl::Milliseconds(1));
    ASSERT_TRUE(scheduler_->AddReplica(0, std::move(replica), {.max_slots = 4, .kv_blocks = 1024}).ok());
    service_ = std::make_unique<InferenceService>(
        InferenceServiceOptions{.model_path = dir_.string(),
                                .max_seq_len = 4096,
                                .reasoning_parser = parser},
        &spec_, tokenizer_.get(), scheduler_.get(), [] { return absl::OkStatus(); });
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = v1::Inference::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
    if (scheduler_ != nullptr) scheduler_->Shutdown(absl::UnavailableError("shutting down"));
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  // A chat request for the weather, with the tools (tool choice auto) unless `tools` is false.
  static v1::GenerateRequest Request(bool tools = true) {
    v1::GenerateRequest req;
    v1::ChatMessage* m = req.mutable_chat()->add_messages();
    m->set_role("user");
    m->set_content("Weather in Paris?");
    if (tools) req.mutable_chat()->set_tools(kTools);
    req.add_stop(kEnd);
    req.set_max_tokens(400);
    return req;
  }

  Answer Generate(const v1::GenerateRequest& req) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader = stub_->Generate(&ctx, req);
    Answer a;
    for (v1::GenerateResponse m; reader->Read(&m);) {
      if (!m.reasoning_text().empty() && !a.text.empty()) a.reasoning_after_text = true;
      a.reasoning += m.reasoning_text();
      a.text += m.text();
      a.tokens += m.token_ids_size();
      a.messages.push_back(m);
    }
    a.status = reader->Finish();
    return a;
  }

  std::filesystem::path dir_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::vector<std::vector<int32_t>> part_ends_;  // the script's tokens up to the end of each part
  ModelSpec spec_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<InferenceService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Inference::Stub> stub_;
};

// The answer's last message ends it with one call: get_weather for Paris.
void ExpectTheWeatherCallEnds(const Answer& a) {
  ASSERT_FALSE(a.messages.empty());
  const v1::GenerateResponse& last = a.messages.back();
  EXPECT_EQ(last.finish_reason(), v1::FINISH_REASON_TOOL_CALLS);
  ASSERT_EQ(last.tool_calls_size(), 1);
  EXPECT_EQ(last.tool_calls(0).name(), "get_weather");
  EXPECT_EQ(nlohmann::json::parse(last.tool_calls(0).arguments()), nlohmann::json({{"city", "Paris"}}));
}

const std::string kReasoning = "\nThe user wants Paris. A <tool_call> would help; I <b>should</b> call it.\n";

// qwen3: the <think> block is reasoning_text, streamed before any text; the call after it is
// parsed from the content, while the <tool_call> mentioned inside the reasoning is not.
TEST_F(InferenceReasoningTest, TheThinkBlockIsReasoningTextAndCallsComeFromTheContent) {
  Serve({"<think>" + kReasoning + "</think>\n\nChecking.\n" + kCall}, "qwen3");
  const Answer a = Generate(Request());
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();
  EXPECT_EQ(a.reasoning, kReasoning);
  EXPECT_EQ(a.text, std::string("\n\nChecking.\n") + kCall);
  EXPECT_FALSE(a.reasoning_after_text);
  EXPECT_GT(a.messages.size(), 2u);  // streamed in pieces, not at the end
  ExpectTheWeatherCallEnds(a);

  // Without tools, the same split; no calls are parsed.
  const Answer plain = Generate(Request(/*tools=*/false));
  ASSERT_TRUE(plain.status.ok()) << plain.status.error_message();
  EXPECT_EQ(plain.reasoning, kReasoning);
  EXPECT_EQ(plain.text, std::string("\n\nChecking.\n") + kCall);
  EXPECT_EQ(plain.messages.back().tool_calls_size(), 0);
  EXPECT_EQ(plain.messages.back().finish_reason(), v1::FINISH_REASON_STOP);
}

// GPT-OSS's harmony format, with no parser named (the template is harmony): the analysis channel
// is reasoning_text, streamed as it comes; the call to functions.get_weather ends the answer at its
// <|call|> and is parsed from the content, which holds it as the split hands it on.
TEST_F(InferenceReasoningTest, HarmonyChannelsAreReasoningTextAndCalls) {
  Serve({"<|channel|>analysis<|message|>The user wants Paris; a long thought.<|end|>",
         "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
         "{\"city\":\"Paris\"}<|call|>",
         "never sent"},
        "", /*harmony=*/true);
  const Answer a = Generate(Request());
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();
  EXPECT_EQ(a.reasoning, "The user wants Paris; a long thought.");
  EXPECT_EQ(a.text, frontend::harmony::CallText("get_weather", "{\"city\":\"Paris\"}"));
  EXPECT_FALSE(a.reasoning_after_text);
  EXPECT_GT(a.messages.size(), 2u);  // streamed in pieces, not at the end
  ExpectTheWeatherCallEnds(a);
  // The tokens end with <|call|>, a stop id of harmony chats.
  EXPECT_EQ(a.tokens, static_cast<int>(part_ends_[1].size()));
}

// Without a parser, the text is as the model wrote it; the call is parsed from all of it.
// GLM-4.5 (--reasoning_parser glm45; a template that teaches its call format): the <think> block
// after the newline is reasoning_text, and the tagged call is parsed with its arguments typed by the
// request's tools (city is a string: "1984" stays one).
TEST_F(InferenceReasoningTest, Glm45ThinkBlockAndTaggedCall) {
  Serve({"\n<think>Paris, surely.</think>\n",
         "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>1984</arg_value>\n</tool_call>"},
        "glm45", /*harmony=*/false,
        "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% endfor %}<|assistant|>"
        "{% if tools %}<tool_call>{name}\n<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>{% endif %}");
  const Answer a = Generate(Request());
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();
  EXPECT_EQ(a.reasoning, "Paris, surely.");
  EXPECT_FALSE(a.reasoning_after_text);
  const v1::GenerateResponse& last = a.messages.back();
  ASSERT_EQ(last.tool_calls_size(), 1);
  EXPECT_EQ(last.tool_calls(0).name(), "get_weather");
  EXPECT_EQ(last.tool_calls(0).arguments(), R"({"city":"1984"})");
  EXPECT_EQ(last.finish_reason(), v1::FINISH_REASON_TOOL_CALLS);
}

TEST_F(InferenceReasoningTest, WithoutAParserTheTextIsWhole) {
  Serve({"<think>x</think>" + std::string(kCall)}, "");
  const Answer a = Generate(Request());
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();
  EXPECT_EQ(a.reasoning, "");
  EXPECT_EQ(a.text, "<think>x</think>" + std::string(kCall));
  EXPECT_EQ(a.messages.back().tool_calls_size(), 1);
}

// deepseek_r1: the answer starts in the reasoning. A resume cut inside </think> continues with the
// content only: the client had the reasoning before the cut, the held-back tag ends it.
TEST_F(InferenceReasoningTest, AResumeCutInsideTheEndTagContinuesWithTheContent) {
  Serve({kReasoning + "</thi", "nk>Checking.\n" + std::string(kCall)}, "deepseek_r1");
  const Answer whole = Generate(Request());
  ASSERT_TRUE(whole.status.ok()) << whole.status.error_message();
  EXPECT_EQ(whole.reasoning, kReasoning);
  EXPECT_EQ(whole.text, "Checking.\n" + std::string(kCall));
  EXPECT_EQ(whole.messages.back().tool_calls_size(), 1);

  v1::GenerateRequest resumed = Request();
  const std::vector<int32_t>& had = part_ends_[0];
  resumed.mutable_resume()->mutable_token_ids()->Add(had.begin(), had.end());
  const Answer rest = Generate(resumed);
  ASSERT_TRUE(rest.status.ok()) << rest.status.error_message();
  EXPECT_EQ(rest.reasoning, "");
  EXPECT_EQ(rest.text, "Checking.\n" + std::string(kCall));
  EXPECT_EQ(rest.tokens + static_cast<int>(had.size()), whole.tokens);
  ASSERT_EQ(rest.messages.back().tool_calls_size(), 1);
  EXPECT_EQ(rest.messages.back().finish_reason(), v1::FINISH_REASON_TOOL_CALLS);
}

// Answers the model does not write freely are not split: deepseek_r1 would otherwise take all of
// them as reasoning (they hold no </think>) and lose their calls. A constraint (here
// allowed_token_ids, which admission treats as every other constraint: a scripted model cannot
// follow an enforced call's grammar) and a continued message keep the text whole.
TEST_F(InferenceReasoningTest, ConstrainedContinuedAndPlainPromptsAreNotSplit) {
  Serve({kCall}, "deepseek_r1");
  const Answer free = Generate(Request());  // the control: a free chat answer is all reasoning
  ASSERT_TRUE(free.status.ok()) << free.status.error_message();
  EXPECT_EQ(free.reasoning, kCall);
  EXPECT_EQ(free.text, "");
  EXPECT_EQ(free.messages.back().tool_calls_size(), 0);

  v1::GenerateRequest allowed = Request();
  for (int32_t t = 0; t < tokenizer_->vocab_size(); ++t) allowed.add_allowed_token_ids(t);
  v1::GenerateRequest continued = Request();
  v1::ChatMessage* start = continued.mutable_chat()->add_messages();
  start->set_role("assistant");
  start->set_content("Let me see.");
  continued.mutable_chat()->set_continue_final_message(true);
  v1::GenerateRequest text = Request(/*tools=*/false);
  text.set_text("Weather in Paris?");
  for (const auto& [name, req] : {std::pair<const char*, const v1::GenerateRequest*>{"allowed_token_ids", &allowed},
                                  {"continue_final_message", &continued},
                                  {"text prompt", &text}}) {
    SCOPED_TRACE(name);
    const Answer a = Generate(*req);
    ASSERT_TRUE(a.status.ok()) << a.status.error_message();
    EXPECT_EQ(a.reasoning, "");
    EXPECT_EQ(a.text, kCall);
    if (req != &text) {
      ASSERT_EQ(a.messages.back().tool_calls_size(), 1);
      EXPECT_EQ(a.messages.back().tool_calls(0).name(), "get_weather");
    }
  }
}

}  // namespace
}  // namespace shardserve::coordinator

// The C++ client against an in-process fake server: the three Generate styles, conversions,
// retry of UNAVAILABLE before the first response and resume after tokens, deadlines, cancellation, the bearer token,
// TLS, and option checks in Connect.
#include "shardserve/client.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <thread>

#include "common/log/log.h"
#include "tests/sdk/fake_inference_server.h"
#include "tests/testing/status_matchers.h"

namespace shardserve {
namespace {

using ::shardserve::testing::FakeInferenceServer;
using ::shardserve::testing::FakeScript;
using ::shardserve::testing::IsOk;
using ::shardserve::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

v1::GenerateResponse Tokens(std::vector<int32_t> ids, std::string text) {
  v1::GenerateResponse r;
  r.mutable_token_ids()->Add(ids.begin(), ids.end());
  r.set_text(std::move(text));
  r.set_request_id("req-7");
  return r;
}

v1::GenerateResponse Last(v1::FinishReason reason, int prompt_tokens, int completion_tokens) {
  v1::GenerateResponse r = Tokens({}, "");
  r.set_finish_reason(reason);
  r.mutable_usage()->set_prompt_tokens(prompt_tokens);
  r.mutable_usage()->set_completion_tokens(completion_tokens);
  return r;
}

FakeScript ThreeTokens() {
  return FakeScript{.responses = {Tokens({10, 11}, "Once"), Tokens({12}, " upon"),
                                  Last(v1::FINISH_REASON_LENGTH, 4, 3)}};
}

ClientOptions FastRetries(int attempts) {
  ClientOptions o;
  o.timeout = std::chrono::seconds(30);
  o.retry = {.max_attempts = attempts, .initial_backoff = std::chrono::milliseconds(10),
             .max_backoff = std::chrono::milliseconds(50)};
  return o;
}

std::unique_ptr<Client> MustConnect(const std::string& address, ClientOptions o = FastRetries(4)) {
  auto client = Client::Connect(address, std::move(o));
  CHECK(client.ok()) << client.status();
  return std::move(*client);
}

std::string ReadTestFile(const std::string& name) {
  std::ifstream f("tests/sdk/testdata/" + name);
  std::stringstream ss;
  ss << f.rdbuf();
  CHECK(!ss.str().empty()) << "cannot read tests/sdk/testdata/" << name;
  return ss.str();
}

TEST(ClientTest, GenerateReturnsTheWholeAnswer) {
  FakeInferenceServer server(ThreeTokens());
  auto client = MustConnect(server.address());
  ASSERT_OK_AND_ASSIGN(GenerateResult r, client->Generate(Prompt::Text("hi"), {.max_tokens = 3}));
  EXPECT_THAT(r.token_ids, ElementsAre(10, 11, 12));
  EXPECT_EQ(r.text, "Once upon");
  EXPECT_EQ(r.finish_reason, "length");
  EXPECT_EQ(r.prompt_tokens, 4);
  EXPECT_EQ(r.completion_tokens, 3);
  EXPECT_EQ(r.request_id, "req-7");
}

// Choices arrive interleaved, each message naming its choice: GenerateChoices gathers each one.
TEST(ClientTest, GenerateChoicesGathersEachChoice) {
  auto of = [](v1::GenerateResponse r, int index) {
    r.set_index(index);
    return r;
  };
  FakeInferenceServer server(FakeScript{.responses = {of(Tokens({10}, "A"), 0), of(Tokens({20, 21}, "Bb"), 1),
                                                      of(Tokens({11}, "a"), 0), of(Last(v1::FINISH_REASON_STOP, 4, 3), 1),
                                                      of(Last(v1::FINISH_REASON_LENGTH, 4, 2), 0)}});
  auto client = MustConnect(server.address());
  ASSERT_OK_AND_ASSIGN(std::vector<GenerateResult> r, client->GenerateChoices(Prompt::Text("hi"), {.n = 2}));
  ASSERT_EQ(r.size(), 2u);
  EXPECT_THAT(r[0].token_ids, ElementsAre(10, 11));
  EXPECT_EQ(r[0].text, "Aa");
  EXPECT_EQ(r[0].finish_reason, "length");
  EXPECT_EQ(r[0].completion_tokens, 2);
  EXPECT_THAT(r[1].token_ids, ElementsAre(20, 21));
  EXPECT_EQ(r[1].text, "Bb");
  EXPECT_EQ(r[1].finish_reason, "stop");
  // A choice the request did not ask for, n out of range, and Generate with n > 1 are errors.
  EXPECT_THAT(client->GenerateChoices(Prompt::Text("hi"), {.n = 1}).status(),
              StatusIs(absl::StatusCode::kInternal, ::testing::_));
  EXPECT_THAT(client->GenerateChoices(Prompt::Text("hi"), {.n = 17}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_THAT(client->Generate(Prompt::Text("hi"), {.n = 2}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
}

// With the server's reasoning parser, each message's reasoning_text comes out on its delta and
// adds up, apart from the text, in the result.
TEST(ClientTest, ReasoningTextAddsUpApartFromTheText) {
  v1::GenerateResponse first = Tokens({10, 11}, "");
  first.set_reasoning_text("Paris is in ");
  v1::GenerateResponse second = Tokens({12, 13}, "It is");
  second.set_reasoning_text("France.");
  v1::GenerateResponse last = Last(v1::FINISH_REASON_STOP, 5, 5);
  last.set_text(" sunny.");
  FakeInferenceServer server(FakeScript{.responses = {first, second, last}});
  auto client = MustConnect(server.address());
  const std::vector<ChatMessage> chat = {{.role = "user", .content = "Weather in Paris?"}};
  std::vector<std::string> reasoning;
  std::unique_ptr<GenerateStream> stream = client->StartGenerate(Prompt::Chat(chat), {});
  for (const GenerateDelta& d : *stream) reasoning.push_back(d.reasoning_text);
  ASSERT_TRUE(stream->status().ok()) << stream->status();
  EXPECT_THAT(reasoning, ElementsAre("Paris is in ", "France.", ""));
  ASSERT_OK_AND_ASSIGN(GenerateResult r, client->Generate(Prompt::Chat(chat), {}));
  EXPECT_EQ(r.reasoning_text, "Paris is in France.");
  EXPECT_EQ(r.text, "It is sunny.");
}

// Tools go out with the chat (calls of earlier turns and the tool answers included); the calls the
// server parsed come back on the last message.
TEST(ClientTest, ToolsGoOutAndToolCallsComeBack) {
  v1::GenerateResponse last = Last(v1::FINISH_REASON_TOOL_CALLS, 30, 2);
  v1::ToolCall* call = last.add_tool_calls();
  call->set_id("call-1");
  call->set_name("get_weather");
  call->set_arguments(R"({"city": "Oslo"})");
  FakeInferenceServer server(FakeScript{.responses = {Tokens({40, 41}, "<tool_call>"), last}});
  auto client = MustConnect(server.address());
  const std::string tools =
      R"([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}])";
  std::vector<ChatMessage> chat = {
      {.role = "user", .content = "Weather in Bergen, then Oslo?"},
      {.role = "assistant",
       .tool_calls = {{.id = "call-0", .name = "get_weather", .arguments = R"({"city": "Bergen"})"}},
       .reasoning_content = "Bergen first."},
      {.role = "tool", .content = "rain", .tool_call_id = "call-0"}};
  ASSERT_OK_AND_ASSIGN(GenerateResult r,
                       client->Generate(Prompt::Chat(chat), {.tools = tools, .tool_choice = ToolChoice::kRequired,
                                                             .parallel_tool_calls = false}));
  EXPECT_EQ(r.finish_reason, "tool_calls");
  ASSERT_EQ(r.tool_calls.size(), 1u);
  EXPECT_EQ(r.tool_calls[0].id, "call-1");
  EXPECT_EQ(r.tool_calls[0].name, "get_weather");
  EXPECT_EQ(r.tool_calls[0].arguments, R"({"city": "Oslo"})");

  const v1::GenerateRequest sent = server.last_generate_request();
  ASSERT_TRUE(sent.has_chat());
  EXPECT_EQ(sent.chat().tools(), tools);
  EXPECT_EQ(sent.chat().tool_choice(), v1::TOOL_CHOICE_REQUIRED);
  EXPECT_TRUE(sent.chat().single_tool_call());
  ASSERT_EQ(sent.chat().messages_size(), 3);
  ASSERT_EQ(sent.chat().messages(1).tool_calls_size(), 1);
  EXPECT_EQ(sent.chat().messages(1).tool_calls(0).id(), "call-0");
  EXPECT_EQ(sent.chat().messages(1).tool_calls(0).arguments(), R"({"city": "Bergen"})");
  EXPECT_EQ(sent.chat().messages(2).tool_call_id(), "call-0");
  EXPECT_EQ(sent.chat().messages(1).reasoning_content(), "Bergen first.");

  // A named function; without tools the chat carries none and the choice stays unspecified.
  ASSERT_TRUE(client->Generate(Prompt::Chat(chat), {.tools = tools, .tool_choice = ToolChoice::kFunction,
                                                    .tool_name = "get_weather"}).ok());
  EXPECT_EQ(server.last_generate_request().chat().tool_choice(), v1::TOOL_CHOICE_FUNCTION);
  EXPECT_EQ(server.last_generate_request().chat().tool_name(), "get_weather");
  EXPECT_FALSE(server.last_generate_request().chat().single_tool_call());
  ASSERT_TRUE(client->Generate(Prompt::Chat(chat), {}).ok());
  EXPECT_EQ(server.last_generate_request().chat().tools(), "");
  EXPECT_EQ(server.last_generate_request().chat().tool_choice(), v1::TOOL_CHOICE_UNSPECIFIED);
}

TEST(ClientTest, LogprobsArriveWithTheirTokens) {
  FakeScript script = ThreeTokens();
  auto add = [](v1::GenerateResponse& r, float lp, std::vector<int32_t> ids, std::vector<float> lps) {
    v1::TokenLogprobs* t = r.add_logprobs();
    t->set_logprob(lp);
    t->mutable_top_ids()->Add(ids.begin(), ids.end());
    t->mutable_top_logprobs()->Add(lps.begin(), lps.end());
  };
  add(script.responses[0], -0.5f, {10, 3}, {-0.5f, -1.5f});
  add(script.responses[0], -0.25f, {11, 4}, {-0.25f, -2.f});
  add(script.responses[1], -3.f, {5, 12}, {-0.1f, -3.f});
  v1::TokenLogprobs* p = script.responses[0].add_prompt_logprobs();
  p->set_logprob(-4.f);
  p->add_top_ids(9);
  p->add_top_logprobs(-1.f);
  FakeInferenceServer server(script);
  auto client = MustConnect(server.address());
  ASSERT_OK_AND_ASSIGN(GenerateResult r, client->Generate(Prompt::Text("hi"), {.max_tokens = 3,
                                                                               .min_p = 0.1f,
                                                                               .logit_bias = {{7, -5.f}},
                                                                               .min_tokens = 2,
                                                                               .logprobs = true,
                                                                               .top_logprobs = 2}));
  EXPECT_THAT(r.token_ids, ElementsAre(10, 11, 12));
  ASSERT_EQ(r.logprobs.size(), 3u);
  EXPECT_EQ(r.logprobs[0].logprob, -0.5f);
  EXPECT_THAT(r.logprobs[1].top_ids, ElementsAre(11, 4));
  EXPECT_THAT(r.logprobs[2].top_logprobs, ElementsAre(-0.1f, -3.f));
  ASSERT_EQ(r.prompt_logprobs.size(), 1u);
  EXPECT_EQ(r.prompt_logprobs[0].logprob, -4.f);
  EXPECT_THAT(r.prompt_logprobs[0].top_ids, ElementsAre(9));
}

TEST(ClientTest, StreamIteratesOverTheDeltasInOrder) {
  FakeInferenceServer server(ThreeTokens());
  auto client = MustConnect(server.address());
  std::unique_ptr<GenerateStream> stream = client->StartGenerate(Prompt::Ids({1, 2}), {.max_tokens = 3});
  std::vector<std::string> texts;
  std::vector<bool> finished;
  for (const GenerateDelta& d : *stream) {
    texts.push_back(d.text);
    finished.push_back(d.finished);
  }
  EXPECT_THAT(stream->status(), IsOk());
  EXPECT_THAT(texts, ElementsAre("Once", " upon", ""));
  EXPECT_THAT(finished, ElementsAre(false, false, true));
  EXPECT_EQ(stream->Next(), std::nullopt);  // stays ended
}

TEST(ClientTest, CallbackReturningFalseCancels) {
  FakeScript script = ThreeTokens();
  script.hold = true;
  FakeInferenceServer server(script);
  auto client = MustConnect(server.address());
  int seen = 0;
  absl::Status st = client->GenerateStreaming(Prompt::Text("hi"), {}, [&](const GenerateDelta&) {
    ++seen;
    return false;
  });
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kCancelled, HasSubstr("callback")));
  EXPECT_EQ(seen, 1);
}

TEST(ClientTest, ServerErrorKeepsItsCodeAndMessage) {
  FakeInferenceServer server(ThreeTokens());
  auto client = MustConnect(server.address());
  EXPECT_THAT(client->Generate(Prompt::Text("hi"), {.max_tokens = 0}),
              StatusIs(absl::StatusCode::kInvalidArgument, "max_tokens must be >= 1, got 0"));
}

TEST(ClientTest, RetriesUnavailableBeforeTheFirstResponse) {
  FakeScript script = ThreeTokens();
  script.unavailable_first = 2;
  FakeInferenceServer server(script);
  auto client = MustConnect(server.address(), FastRetries(4));
  ASSERT_OK_AND_ASSIGN(GenerateResult r, client->Generate(Prompt::Text("hi"), {}));
  EXPECT_THAT(r.token_ids, ElementsAre(10, 11, 12));
  EXPECT_EQ(server.calls(), 3);
}

TEST(ClientTest, RetriesUnaryCallsToo) {
  FakeScript script;
  script.unavailable_first = 1;
  FakeInferenceServer server(script);
  auto client = MustConnect(server.address(), FastRetries(2));
  ASSERT_OK_AND_ASSIGN(std::vector<int32_t> ids, client->Tokenize("ab", true));
  EXPECT_THAT(ids, ElementsAre(1, 'a', 'b'));
  EXPECT_EQ(server.calls(), 2);
}

TEST(ClientTest, RetriesAreBounded) {
  FakeScript script = ThreeTokens();
  script.unavailable_first = 100;
  FakeInferenceServer server(script);
  ClientOptions options = FastRetries(3);
  options.retry.max_resumes = 2;
  auto client = MustConnect(server.address(), options);
  EXPECT_THAT(client->Generate(Prompt::Text("hi"), {}),
              StatusIs(absl::StatusCode::kUnavailable, "fake server: warming up"));
  // gRPC's 3 attempts, then sent again twice (3 attempts each) before giving up.
  EXPECT_EQ(server.calls(), 9);
}

TEST(ClientTest, AGenerateIsSentAgainWhenGrpcRetriesRunOutBeforeAnyResponse) {
  // A coordinator restart longer than gRPC's own retries: the stream is sent again as it was.
  FakeScript script = ThreeTokens();
  script.unavailable_first = 7;
  FakeInferenceServer server(script);
  auto client = MustConnect(server.address(), FastRetries(3));
  ASSERT_OK_AND_ASSIGN(GenerateResult r, client->Generate(Prompt::Text("hi"), {}));
  EXPECT_THAT(r.token_ids, ElementsAre(10, 11, 12));
  EXPECT_EQ(server.calls(), 8);
  ClientOptions never = FastRetries(3);
  never.retry.max_resumes = 0;
  FakeInferenceServer again(script);
  auto strict = MustConnect(again.address(), never);
  EXPECT_THAT(strict->Generate(Prompt::Text("hi"), {}), StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
  EXPECT_EQ(again.calls(), 3);
}

// The stream of a five-message answer, for resume tests: one token per message, with logprobs.
FakeScript FourTokensCut(std::vector<int> cuts) {
  FakeScript script{.responses = {Tokens({10}, "Once"), Tokens({11}, " up"), Tokens({12}, "on a"),
                                  Tokens({13}, " time"), Last(v1::FINISH_REASON_LENGTH, 4, 4)},
                    .cuts = std::move(cuts)};
  for (int i = 0; i < 4; ++i) script.responses[i].add_logprobs()->set_logprob(-0.5f * static_cast<float>(i + 1));
  return script;
}

TEST(ClientTest, ResumesAStreamBrokenAfterTokensAndShowsEachTokenOnce) {
  // Broken after two messages, then after one more: two resumes.
  FakeInferenceServer server(FourTokensCut({2, 1}));
  auto client = MustConnect(server.address(), FastRetries(1));
  std::vector<int32_t> got;
  std::string text;
  std::vector<float> logprobs;
  std::string finish;
  absl::Status st = client->GenerateStreaming(
      Prompt::Text("hi"), {.max_tokens = 4, .temperature = 0.8f, .seed = 42, .logprobs = true},
      [&](const GenerateDelta& d) {
        got.insert(got.end(), d.token_ids.begin(), d.token_ids.end());
        text += d.text;
        for (const TokenLogprob& l : d.logprobs) logprobs.push_back(l.logprob);
        if (d.finished) finish = d.finish_reason;
        return true;
      });
  ASSERT_THAT(st, IsOk());
  EXPECT_THAT(got, ElementsAre(10, 11, 12, 13));
  EXPECT_EQ(text, "Once upon a time");
  EXPECT_THAT(logprobs, ElementsAre(-0.5f, -1.0f, -1.5f, -2.0f));
  EXPECT_EQ(finish, "length");
  const std::vector<v1::GenerateRequest> sent = server.generate_requests();
  ASSERT_EQ(sent.size(), 3u);
  EXPECT_EQ(sent[0].resume().token_ids_size(), 0);
  EXPECT_THAT(sent[1].resume().token_ids(), ElementsAre(10, 11));
  EXPECT_THAT(sent[2].resume().token_ids(), ElementsAre(10, 11, 12));
  for (const v1::GenerateRequest& r : sent) {
    EXPECT_EQ(r.text(), "hi");
    EXPECT_EQ(r.sampling().seed(), 42u);  // the same seed every time
    EXPECT_EQ(r.max_tokens(), 4);
  }
  EXPECT_EQ(sent[1].request_id(), "req-7");  // the id the server answered with
  EXPECT_EQ(sent[2].request_id(), "req-7");
}

TEST(ClientTest, GenerateReturnsTheWholeAnswerAcrossResumes) {
  FakeInferenceServer server(FourTokensCut({1, 0, 0, 2}));  // two resumes get nothing at all
  auto client = MustConnect(server.address(), FastRetries(1));
  absl::StatusOr<GenerateResult> r = client->Generate(Prompt::Text("hi"), {});
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_THAT(r->token_ids, ElementsAre(10, 11, 12, 13));
  EXPECT_EQ(r->text, "Once upon a time");
  EXPECT_EQ(r->logprobs.size(), 4u);
  EXPECT_EQ(r->completion_tokens, 4);
  EXPECT_EQ(server.generate_requests().size(), 5u);
}

TEST(ClientTest, ResumesInARowWithoutATokenAreBounded) {
  FakeInferenceServer server(FourTokensCut({1, 0, 0, 0, 0, 0, 0, 0}));
  ClientOptions options = FastRetries(1);
  options.retry.max_resumes = 3;
  auto client = MustConnect(server.address(), options);
  std::vector<int32_t> got;
  absl::Status st = client->GenerateStreaming(Prompt::Text("hi"), {}, [&](const GenerateDelta& d) {
    got.insert(got.end(), d.token_ids.begin(), d.token_ids.end());
    return true;
  });
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kUnavailable, "fake server: the coordinator restarted"));
  EXPECT_THAT(got, ElementsAre(10));
  EXPECT_EQ(server.calls(), 1 + 3);
}

TEST(ClientTest, NeverResumesWithoutResumesOrWithSeveralChoices) {
  FakeInferenceServer server(FourTokensCut({1, 1}));
  ClientOptions off = FastRetries(4);
  off.retry.max_resumes = 0;
  EXPECT_THAT(MustConnect(server.address(), off)->Generate(Prompt::Text("hi"), {}).status(),
              StatusIs(absl::StatusCode::kUnavailable, "fake server: the coordinator restarted"));
  EXPECT_EQ(server.calls(), 1);
  // n = 2: each choice would need its own resume; the error comes back as it is.
  EXPECT_THAT(MustConnect(server.address())->GenerateChoices(Prompt::Text("hi"), {.n = 2}).status(),
              StatusIs(absl::StatusCode::kUnavailable, "fake server: the coordinator restarted"));
  EXPECT_EQ(server.calls(), 2);
}

TEST(ClientTest, CancelEndsTheWaitBeforeAResume) {
  FakeInferenceServer server(FourTokensCut({1}));
  ClientOptions options = FastRetries(1);
  options.retry.initial_backoff = std::chrono::milliseconds(20000);  // a wait only Cancel can end
  options.retry.max_backoff = std::chrono::milliseconds(20000);
  auto client = MustConnect(server.address(), options);
  std::unique_ptr<GenerateStream> stream = client->StartGenerate(Prompt::Text("hi"), {});
  std::optional<GenerateDelta> first = stream->Next();
  ASSERT_TRUE(first.has_value());
  EXPECT_THAT(first->token_ids, ElementsAre(10));
  std::thread canceller([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    stream->Cancel();
  });
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(stream->Next().has_value());  // the stream broke; Next waits to resume, then is cancelled
  canceller.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_THAT(stream->status(), StatusIs(absl::StatusCode::kCancelled, HasSubstr("cancelled by the caller")));
  EXPECT_EQ(server.calls(), 1);
}

TEST(ClientTest, MaxResumesIsChecked) {
  ClientOptions o;
  o.retry.max_resumes = 101;
  EXPECT_THAT(Client::Connect("127.0.0.1:1", o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_resumes must be in 0..100")));
}

TEST(ClientTest, NoRetryWithOneAttempt) {
  FakeScript script;
  script.unavailable_first = 1;
  FakeInferenceServer server(script);
  auto client = MustConnect(server.address(), FastRetries(1));
  EXPECT_THAT(client->GetModelInfo(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("warming up")));
  EXPECT_EQ(server.calls(), 1);
}

TEST(ClientTest, DeadlineEndsAHeldStream) {
  FakeScript script{.responses = {Tokens({10}, "Once")}, .hold = true};
  FakeInferenceServer server(script);
  auto client = MustConnect(server.address());
  CallOptions call{.deadline = std::chrono::system_clock::now() + std::chrono::milliseconds(300)};
  EXPECT_THAT(client->Generate(Prompt::Text("hi"), {}, call), StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
}

TEST(ClientTest, ClientTimeoutAppliesToEveryCall) {
  FakeScript script{.hold = true};
  FakeInferenceServer server(script);
  ClientOptions o = FastRetries(1);
  o.timeout = std::chrono::milliseconds(200);
  auto client = MustConnect(server.address(), o);
  EXPECT_THAT(client->Generate(Prompt::Text("hi"), {}), StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
}

TEST(ClientTest, CancellationTokenCancelsFromAnotherThread) {
  FakeScript script{.responses = {Tokens({10}, "Once")}, .hold = true};
  FakeInferenceServer server(script);
  auto client = MustConnect(server.address());
  CancellationToken token;
  std::unique_ptr<GenerateStream> stream = client->StartGenerate(Prompt::Text("hi"), {}, {.cancellation = &token});
  std::optional<GenerateDelta> first = stream->Next();
  ASSERT_TRUE(first.has_value()) << stream->status();
  EXPECT_THAT(first->token_ids, ElementsAre(10));
  std::thread canceller([&] { token.Cancel(); });  // while this thread may be blocked in Next()
  EXPECT_EQ(stream->Next(), std::nullopt);  // the server holds the stream: only the cancel ends it
  canceller.join();
  EXPECT_THAT(stream->status(), StatusIs(absl::StatusCode::kCancelled, ::testing::_));
  EXPECT_TRUE(token.IsCancelled());
}

TEST(ClientTest, CancelledTokenFailsLaterCallsWithoutSendingThem) {
  FakeInferenceServer server(ThreeTokens());
  auto client = MustConnect(server.address());
  CancellationToken token;
  token.Cancel();
  EXPECT_THAT(client->Generate(Prompt::Text("hi"), {}, {.cancellation = &token}),
              StatusIs(absl::StatusCode::kCancelled, HasSubstr("before the call started")));
  EXPECT_THAT(client->Tokenize("hi", false, {.cancellation = &token}),
              StatusIs(absl::StatusCode::kCancelled, ::testing::_));
  EXPECT_EQ(server.calls(), 0);
}

TEST(ClientTest, StreamCancelEndsWithCancelled) {
  FakeScript script{.responses = {Tokens({10}, "Once")}, .hold = true};
  FakeInferenceServer server(script);
  auto client = MustConnect(server.address());
  std::unique_ptr<GenerateStream> stream = client->StartGenerate(Prompt::Text("hi"), {});
  ASSERT_TRUE(stream->Next().has_value()) << stream->status();
  stream->Cancel();
  EXPECT_EQ(stream->Next(), std::nullopt);
  EXPECT_THAT(stream->status(), StatusIs(absl::StatusCode::kCancelled, HasSubstr("cancelled by the caller")));
}

TEST(ClientTest, DroppingAnUnfinishedStreamCancelsIt) {
  FakeScript script{.responses = {Tokens({10}, "Once")}, .hold = true};
  FakeInferenceServer server(script);
  auto client = MustConnect(server.address());
  std::unique_ptr<GenerateStream> stream = client->StartGenerate(Prompt::Text("hi"), {});
  ASSERT_TRUE(stream->Next().has_value()) << stream->status();
  client.reset();  // the stream keeps what it needs
  stream.reset();
  EXPECT_TRUE(server.AwaitCancelledGenerates(1, absl::Seconds(10)));
}

TEST(ClientTest, SendsTheBearerToken) {
  FakeInferenceServer server(ThreeTokens());
  ClientOptions o = FastRetries(1);
  o.bearer_token = "s3cret-token";
  auto client = MustConnect(server.address(), o);
  ASSERT_THAT(client->Generate(Prompt::Text("hi"), {}), IsOk());
  EXPECT_EQ(server.last_authorization(), "Bearer s3cret-token");
  auto plain = MustConnect(server.address());
  ASSERT_THAT(plain->Tokenize("x", false), IsOk());
  EXPECT_EQ(server.last_authorization(), "");
}

TEST(ClientTest, ModelInfoAndClusterStatusAreConverted) {
  FakeInferenceServer server(ThreeTokens());
  auto client = MustConnect(server.address());
  ASSERT_OK_AND_ASSIGN(ModelInfo info, client->GetModelInfo());
  EXPECT_EQ(info.architecture, "LlamaForCausalLM");
  EXPECT_EQ(info.vocab_size, 512);
  EXPECT_EQ(info.max_position_embeddings, 256);
  EXPECT_THAT(info.eos_token_ids, ElementsAre(2));
  EXPECT_TRUE(info.has_tokenizer);
  ASSERT_OK_AND_ASSIGN(ClusterInfo cluster, client->ClusterStatus());
  EXPECT_TRUE(cluster.ready);
  EXPECT_EQ(cluster.running_sequences, 3);
  ASSERT_EQ(cluster.workers.size(), 1u);
  EXPECT_EQ(cluster.workers[0].state, "ready");
  EXPECT_EQ(cluster.workers[0].devices, "cuda:1");
  EXPECT_EQ(cluster.workers[0].assignment, "replica 0 stage 0/2 layers [0, 3)");
}

TEST(ClientTest, TlsWithTheRightRootConnects) {
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({ReadTestFile("server.key"), ReadTestFile("server.pem")});
  FakeInferenceServer server(ThreeTokens(), grpc::SslServerCredentials(ssl));
  ClientOptions o = FastRetries(1);
  o.tls = {.enabled = true, .root_certs = ReadTestFile("ca.pem")};
  auto client = MustConnect(server.address(), o);
  ASSERT_OK_AND_ASSIGN(GenerateResult r, client->Generate(Prompt::Text("hi"), {}));
  EXPECT_EQ(r.text, "Once upon");
  // The certificate names localhost too.
  o.tls.server_name = "localhost";
  ASSERT_THAT(MustConnect(server.address(), o)->Tokenize("a", false), IsOk());
}

TEST(ClientTest, TlsRefusesAnUntrustedOrPlaintextPeer) {
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({ReadTestFile("server.key"), ReadTestFile("server.pem")});
  FakeInferenceServer server(ThreeTokens(), grpc::SslServerCredentials(ssl));
  ClientOptions o = FastRetries(1);
  o.tls = {.enabled = true, .root_certs = ReadTestFile("other_ca.pem")};  // not the issuer
  EXPECT_THAT(MustConnect(server.address(), o)->Tokenize("a", false),
              StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
  EXPECT_THAT(MustConnect(server.address(), FastRetries(1))->Tokenize("a", false),
              StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
  EXPECT_EQ(server.calls(), 0);
}

TEST(ClientTest, UnreachableServerIsUnavailable) {
  // Port 1 on loopback refuses connections.
  EXPECT_THAT(MustConnect("127.0.0.1:1", FastRetries(2))->ClusterStatus(),
              StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
}

TEST(ClientTest, ConnectRejectsBadAddressesAndOptions) {
  EXPECT_THAT(Client::Connect("", {}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("HOST:PORT")));
  EXPECT_THAT(Client::Connect("localhost", {}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("HOST:PORT")));
  EXPECT_THAT(Client::Connect("localhost:0", {}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("1..65535")));
  EXPECT_THAT(Client::Connect("localhost:http", {}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("HOST:PORT")));
  EXPECT_THAT(Client::Connect("[::1]:7000", {}), IsOk());

  ClientOptions o;
  o.timeout = std::chrono::milliseconds(0);
  EXPECT_THAT(Client::Connect("h:1", o), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("timeout")));
  o = {};
  o.retry.max_attempts = 6;
  EXPECT_THAT(Client::Connect("h:1", o), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_attempts")));
  o = {};
  o.retry.max_backoff = std::chrono::milliseconds(1);
  EXPECT_THAT(Client::Connect("h:1", o), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_backoff")));
  o = {};
  o.tls = {.enabled = true, .client_cert = "PEM"};
  EXPECT_THAT(Client::Connect("h:1", o), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("client_key")));
  o = {};
  o.tls.root_certs = "PEM";
  EXPECT_THAT(Client::Connect("h:1", o), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tls.enabled")));
  o = {};
  o.bearer_token = "line\nbreak";
  EXPECT_THAT(Client::Connect("h:1", o), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bearer_token")));
}

}  // namespace
}  // namespace shardserve

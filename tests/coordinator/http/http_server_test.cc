// HttpServer over a real Scheduler and a scripted replica (no workers): routes, errors, stop
// strings, and a client that disconnects mid-stream cancelling its sequence.
#include "coordinator/http/http_server.h"

#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <csignal>
#include <map>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/rejection_counter.h"

namespace shardserve::coordinator::http {
namespace {

using ::shardserve::testing::RejectionCounter;
using ::testing::HasSubstr;
using Json = nlohmann::json;

// Samples script[sample_index % size] for every sequence; steps can be held. Counts steps.
class ScriptReplica final : public ReplicaClient {
 public:
  explicit ScriptReplica(std::vector<int32_t> script) : script_(std::move(script)) {}

  absl::StatusOr<StepOutput> Step(const StepInput& input) override {
    absl::MutexLock lock(&mu_);
    ++arrived_;
    mu_.Await(absl::Condition(+[](ScriptReplica* r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu_) {
                                return !r->held_ || r->shut_down_;
                              },
                              this));
    if (shut_down_) return absl::UnavailableError("shut down");
    ++steps_;
    StepOutput out;
    for (const StepSequenceInput& s : input.sequences) {
      // Several decode steps per call: the script's next tokens, as that many calls would give.
      for (int32_t j = 0; s.sample && j < input.decode_steps; ++j) {
        out.token_ids.push_back(script_[(s.sample_index + static_cast<uint64_t>(j)) % script_.size()]);
      }
    }
    mu_.AwaitWithTimeout(absl::Condition(&shut_down_), delay_);  // a slow model
    return out;
  }
  void Shutdown() override {
    absl::MutexLock lock(&mu_);
    shut_down_ = true;
  }
  void Hold(bool held) {
    absl::MutexLock lock(&mu_);
    held_ = held;
  }
  void SetDelay(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    delay_ = d;
  }
  int steps() {
    absl::MutexLock lock(&mu_);
    return steps_;
  }
  // Waits until a step has reached the replica (held or not); false after `timeout`.
  bool WaitForStep(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto arrived = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return arrived_ > 0; };
    return mu_.AwaitWithTimeout(absl::Condition(&arrived), timeout);
  }

 private:
  const std::vector<int32_t> script_;
  absl::Mutex mu_;
  bool held_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::Duration delay_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
  int steps_ ABSL_GUARDED_BY(mu_) = 0;
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
};

constexpr char kModel[] = "tests/golden/models/llama";

class HttpServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::signal(SIGPIPE, SIG_IGN);
    absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadTokenizer(kModel);
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = *std::move(tokenizer);
    absl::StatusOr<std::vector<int32_t>> script = tokenizer_->Encode(" hello world, the end is near.", false);
    ASSERT_TRUE(script.ok());
    script_text_ = " hello world, the end is near.";
    SchedulerOptions so;
    so.limits = {.vocab_size = tokenizer_->vocab_size(), .max_seq_len = 256};
    so.max_queued = max_queued_;  // 0: a request that finds the only slot taken is refused (429)
    so.observer = &ends_;  // the scheduler's reports (request ends), apart from the front end's refusals
    so.decode_steps_per_call = decode_steps_per_call_;
    scheduler_ = std::make_unique<Scheduler>(so);
    auto replica = std::make_unique<ScriptReplica>(*script);
    replica_ = replica.get();
    ASSERT_TRUE(scheduler_->AddReplica(0, std::move(replica), {.max_slots = 1, .kv_blocks = 64, .stages = 1}).ok());
    absl::StatusOr<std::unique_ptr<HttpServer>> server = HttpServer::Start(
        {.listen = "127.0.0.1:0", .model_id = "llama", .model_path = kModel, .max_body_bytes = 4096,
         .observer = &rejections_},
        tokenizer_.get(), scheduler_.get(), [this] {
          absl::MutexLock lock(&ready_mu_);
          return ready_;
        });
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    client_ = std::make_unique<httplib::Client>("127.0.0.1", server_->port());
    client_->set_read_timeout(30, 0);
  }

  void TearDown() override {
    scheduler_->Shutdown(absl::UnavailableError("shutting down"));
    server_->Stop();
  }

  // POSTs `body` to `path`: (status, parsed body).
  std::pair<int, Json> Post(const std::string& path, const std::string& body) {
    httplib::Result r = client_->Post(path.c_str(), body, "application/json");
    if (!r) return {0, Json()};
    return {r->status, Json::parse(r->body, nullptr, false)};
  }

  // POSTs `body` to /v1/completions and reads the answer as it streams: (result, what arrived).
  std::pair<httplib::Result, std::string> PostStreamed(const std::string& body) {
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/completions";
    req.body = body;
    req.set_header("Content-Type", "application/json");
    std::string received;
    req.content_receiver = [&received](const char* data, size_t n, uint64_t, uint64_t) {
      received.append(data, n);
      return true;
    };
    httplib::Result r = client_->send(req);
    return {std::move(r), std::move(received)};
  }

  // Waits until the scheduler has ended `requests` requests in all and holds none.
  bool WaitIdle(int requests, absl::Duration timeout) {
    if (!ends_.WaitEnded(requests, timeout)) return false;
    SchedulerStats s = scheduler_->Stats();
    return s.running == 0 && s.waiting == 0;
  }

  // The tokens of the script up to the one that completes `stop` in its text.
  int TokensThrough(const std::string& stop) {
    absl::StatusOr<std::vector<int32_t>> script = tokenizer_->Encode(script_text_, false);
    EXPECT_TRUE(script.ok());
    for (size_t n = 1; script.ok() && n <= script->size(); ++n) {
      absl::StatusOr<std::string> text = tokenizer_->Decode(absl::MakeConstSpan(script->data(), n), true);
      if (text.ok() && text->find(stop) != std::string::npos) return static_cast<int>(n);
    }
    return -1;
  }

  int32_t decode_steps_per_call_ = 1;  // SchedulerOptions::decode_steps_per_call (set before SetUp)
  int64_t max_queued_ = 0;             // SchedulerOptions::max_queued (set before SetUp)
  RejectionCounter rejections_;
  RejectionCounter ends_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::string script_text_;
  std::unique_ptr<Scheduler> scheduler_;
  ScriptReplica* replica_ = nullptr;
  std::unique_ptr<HttpServer> server_;
  std::unique_ptr<httplib::Client> client_;
  absl::Mutex ready_mu_;
  absl::Status ready_ ABSL_GUARDED_BY(ready_mu_);
};

TEST_F(HttpServerTest, CompletionTextUsageAndLength) {
  auto [status, body] = Post("/v1/completions", R"({"prompt": [1, 2, 3], "max_tokens": 4})");
  ASSERT_EQ(status, 200) << body;
  EXPECT_EQ(body["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(body["usage"]["prompt_tokens"], 3);
  EXPECT_EQ(body["usage"]["completion_tokens"], 4);
  const std::string text = body["choices"][0]["text"];
  EXPECT_FALSE(text.empty());
  EXPECT_THAT(script_text_, HasSubstr(text.substr(1))) << text;  // the script's first tokens
}

// Sequences that find the only slot taken wait for it.
class HttpServerQueueTest : public HttpServerTest {
 protected:
  HttpServerQueueTest() { max_queued_ = 16; }
};

TEST_F(HttpServerTest, APromptThatFindsTheQueueFullRefusesTheRequestAndCancelsTheOthers) {
  // The first prompt takes the only slot; the second finds no room (max_queued 0): 429, and the
  // first is cancelled rather than left running for nobody (its 200 tokens would take 4 s).
  replica_->SetDelay(absl::Milliseconds(20));
  auto [status, body] = Post("/v1/completions", R"({"prompt": [[1, 2], [3]], "max_tokens": 200})");
  EXPECT_EQ(status, 429) << body;
  EXPECT_TRUE(WaitIdle(1, absl::Seconds(2)));
}

TEST_F(HttpServerQueueTest, SeveralPromptsAnswerInPromptOrderEachWithItsChoices) {
  // Three prompts of n = 2: choice k of prompt p is choice p * 2 + k; usage sums over them (the
  // replica takes one sequence at a time, so they queue).
  auto [status, body] = Post("/v1/completions", R"({"prompt": [[1, 2], [3], [4, 5, 6]], "max_tokens": 3, "n": 2})");
  ASSERT_EQ(status, 200) << body;
  ASSERT_EQ(body["choices"].size(), 6u) << body;
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(body["choices"][i]["index"], i);
    EXPECT_EQ(body["choices"][i]["finish_reason"], "length");
  }
  EXPECT_EQ(body["usage"]["prompt_tokens"], 6);
  EXPECT_EQ(body["usage"]["completion_tokens"], 18);
  // Streamed, with text prompts: every choice's chunks, then its end, then the usage and [DONE].
  auto [s, received] = PostStreamed(
      R"({"prompt": ["hi", "ho"], "max_tokens": 4, "stream": true, "stream_options": {"include_usage": true}})");
  ASSERT_TRUE(s);
  EXPECT_EQ(s->status, 200);
  EXPECT_TRUE(received.ends_with("data: [DONE]\n\n")) << received;
  std::map<int, std::string> texts;
  std::map<int, int> ends;
  for (absl::string_view event : absl::StrSplit(received, "\n\n", absl::SkipEmpty())) {
    if (!absl::ConsumePrefix(&event, "data: ") || event == "[DONE]") continue;
    const Json chunk = Json::parse(event);
    if (chunk["choices"].empty()) {
      EXPECT_EQ(chunk["usage"]["completion_tokens"], 8) << chunk;
      continue;
    }
    const int index = chunk["choices"][0]["index"];
    texts[index] += chunk["choices"][0]["text"].get<std::string>();
    if (!chunk["choices"][0]["finish_reason"].is_null()) ++ends[index];
  }
  EXPECT_EQ(ends, (std::map<int, int>{{0, 1}, {1, 1}})) << received;
  EXPECT_EQ(texts[0], texts[1]);  // the replica plays the same script for each
  // A bad prompt refuses the request as a whole, naming it; none of its prompts runs.
  const int ended = 3 * 2 + 2;
  auto [bad, error] = Post("/v1/completions", R"({"prompt": [[1], [1, 100000]]})");
  EXPECT_EQ(bad, 400);
  EXPECT_THAT(error["error"]["message"].get<std::string>(), HasSubstr("prompt[1]: ")) << error;
  EXPECT_EQ(error["error"]["param"], "prompt") << error;
  ASSERT_TRUE(WaitIdle(ended, absl::Seconds(10)));
  EXPECT_EQ(scheduler_->Stats().waiting, 0);
}

TEST_F(HttpServerTest, StopStringTruncatesAndEndsWithStop) {
  auto [status, body] = Post("/v1/completions", R"({"prompt": "hi", "max_tokens": 100, "stop": ["end is"]})");
  ASSERT_EQ(status, 200) << body;
  EXPECT_EQ(body["choices"][0]["finish_reason"], "stop");
  const std::string text = body["choices"][0]["text"];
  EXPECT_EQ(text.find("end"), std::string::npos);
  EXPECT_THAT(text, HasSubstr("world, the"));
  EXPECT_LT(body["usage"]["completion_tokens"].get<int>(), 100);
  EXPECT_EQ(body["usage"]["completion_tokens"].get<int>(), TokensThrough("end is"));
  EXPECT_TRUE(WaitIdle(1, absl::Seconds(10)));
}

// A client's X-Request-Id names the request (the response's id, the request log) and comes back
// in the reply's header; without one, the header carries the id the server made.
TEST_F(HttpServerTest, XRequestIdNamesTheRequest) {
  httplib::Headers headers = {{"X-Request-Id", "gw-42:a/b"}};
  httplib::Result r =
      client_->Post("/v1/completions", headers, R"({"prompt": [1], "max_tokens": 2})", "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(Json::parse(r->body)["id"], "cmpl-gw-42:a/b");
  EXPECT_EQ(r->get_header_value("X-Request-Id"), "gw-42:a/b");
  r = client_->Post("/v1/completions", R"({"prompt": [1], "max_tokens": 2})", "application/json");
  ASSERT_TRUE(r);
  const std::string id = Json::parse(r->body)["id"];
  EXPECT_TRUE(id.starts_with("cmpl-")) << id;
  EXPECT_EQ(r->get_header_value("X-Request-Id"), id);
  for (const std::string& bad : {std::string("has space"), std::string("quote\""), std::string(129, 'x')}) {
    r = client_->Post("/v1/completions", {{"X-Request-Id", bad}}, R"({"prompt": [1], "max_tokens": 2})",
                      "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << bad;
    EXPECT_EQ(Json::parse(r->body)["error"]["param"], "X-Request-Id") << r->body;
  }
  EXPECT_TRUE(WaitIdle(2, absl::Seconds(10)));
}

TEST_F(HttpServerTest, IncludeStopStrInOutputEndsTheTextWithTheStop) {
  auto [status, body] = Post("/v1/completions", R"({"prompt": "hi", "max_tokens": 100, "stop": ["end is"],
                                                    "include_stop_str_in_output": true})");
  ASSERT_EQ(status, 200) << body;
  EXPECT_EQ(body["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(body["choices"][0]["text"], " hello world, the end is");
  EXPECT_EQ(body["usage"]["completion_tokens"].get<int>(), TokensThrough("end is"));
  // Streamed too: the chunks' texts end with it.
  auto [s, received] = PostStreamed(R"({"prompt": "hi", "max_tokens": 100, "stop": ["end is"],
                                        "include_stop_str_in_output": true, "stream": true})");
  ASSERT_TRUE(s);
  std::string text;
  for (absl::string_view line : absl::StrSplit(received, '\n')) {
    if (!absl::ConsumePrefix(&line, "data: ") || line == "[DONE]") continue;
    const Json chunk = Json::parse(line);
    text += chunk["choices"][0]["text"].get<std::string>();
  }
  EXPECT_EQ(text, " hello world, the end is");
  EXPECT_TRUE(WaitIdle(2, absl::Seconds(10)));
}

// With several decode steps per call, the tokens after the one that completes a stop string come
// in the same delivery: they are neither returned nor counted.
class HttpServerMultiStepTest : public HttpServerTest {
 protected:
  HttpServerMultiStepTest() { decode_steps_per_call_ = 8; }
};

TEST_F(HttpServerMultiStepTest, AStopStringInsideACallCountsNoTokenPastIt) {
  auto [status, body] = Post("/v1/completions", R"({"prompt": "hi", "max_tokens": 100, "stop": ["end is"]})");
  ASSERT_EQ(status, 200) << body;
  EXPECT_EQ(body["choices"][0]["finish_reason"], "stop");
  const std::string text = body["choices"][0]["text"];
  EXPECT_EQ(text.find("end"), std::string::npos);
  EXPECT_THAT(text, HasSubstr("world, the"));
  const int through = TokensThrough("end is");
  ASSERT_GT(through, 1);
  EXPECT_NE(through % 8, 1) << "the stop should fall inside a call";
  EXPECT_EQ(body["usage"]["completion_tokens"].get<int>(), through);
  EXPECT_TRUE(WaitIdle(1, absl::Seconds(10)));
  EXPECT_LT(replica_->steps(), through) << "several tokens per call";
}

TEST_F(HttpServerTest, StreamEndsWithDone) {
  httplib::Result r = client_->Post(
      "/v1/chat/completions", R"({"messages": [{"role": "user", "content": "a"}]})", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);  // this model has no chat template
  EXPECT_THAT(r->body, HasSubstr("tokenizer_config.json"));

  auto [s, received] =
      PostStreamed(R"({"prompt": [1], "max_tokens": 6, "stream": true, "stream_options": {"include_usage": true}})");
  ASSERT_TRUE(s);
  EXPECT_EQ(s->status, 200);
  EXPECT_EQ(s->get_header_value("Content-Type"), "text/event-stream");
  EXPECT_TRUE(received.ends_with("data: [DONE]\n\n")) << received;
  EXPECT_THAT(received, HasSubstr(R"("finish_reason":"length")"));
  EXPECT_THAT(received, HasSubstr(R"("usage":{"prompt_tokens":1,"completion_tokens":6,"total_tokens":7,)"
                                  R"("prompt_tokens_details":{"cached_tokens":0}})"));
}

TEST_F(HttpServerTest, ClientDisconnectMidStreamCancelsTheSequence) {
  replica_->SetDelay(absl::Milliseconds(5));
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = R"({"prompt": [1], "max_tokens": 250, "stream": true})";
  int chunks = 0;
  req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) { return ++chunks < 3; };  // then hang up
  (void)client_->send(req);
  EXPECT_EQ(chunks, 3);
  ASSERT_TRUE(WaitIdle(1, absl::Seconds(10)));
  EXPECT_LT(replica_->steps(), 200) << "the sequence ran on after the client left";
  // The slot is free again.
  auto [status, body] = Post("/v1/completions", R"({"prompt": [1], "max_tokens": 2})");
  EXPECT_EQ(status, 200) << body;
}

// A client that gives up on an answer it did not ask to stream (a timeout of its own) frees its
// sequence too: nobody would read the answer.
TEST_F(HttpServerTest, ClientThatHangsUpBeforeAnUnstreamedAnswerCancelsTheSequence) {
  replica_->SetDelay(absl::Milliseconds(10));  // 250 tokens: 2.5 s to the end
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(server_->port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const std::string body = R"({"prompt": [1], "max_tokens": 250, "ignore_eos": true})";
  const std::string request = absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                           "application/json\r\nContent-Length: ", body.size(), "\r\n\r\n", body);
  ASSERT_EQ(send(fd, request.data(), request.size(), 0), static_cast<ssize_t>(request.size()));
  ASSERT_TRUE(replica_->WaitForStep(absl::Seconds(10)));
  absl::SleepFor(absl::Milliseconds(300));
  close(fd);
  const absl::Time closed = absl::Now();
  ASSERT_TRUE(WaitIdle(1, absl::Seconds(10)));
  EXPECT_LT(absl::Now() - closed, absl::Seconds(1.5)) << "the sequence ran on after the client left";
  EXPECT_LT(replica_->steps(), 150) << "the sequence ran on after the client left";
  // The slot is free again, and a client that stays gets its whole answer.
  auto [status, reply] = Post("/v1/completions", R"({"prompt": [1], "max_tokens": 30, "ignore_eos": true})");
  EXPECT_EQ(status, 200) << reply;
  EXPECT_EQ(reply["usage"]["completion_tokens"], 30);
}

TEST_F(HttpServerTest, QueueFullIs429AndNotReadyIs503) {
  replica_->Hold(true);
  std::thread first([this] { (void)Post("/v1/completions", R"({"prompt": [1], "max_tokens": 2})"); });
  EXPECT_TRUE(replica_->WaitForStep(absl::Seconds(10)));  // the first request holds the only slot
  httplib::Client other("127.0.0.1", server_->port());
  httplib::Result r = other.Post("/v1/completions", R"({"prompt": [1], "max_tokens": 2})", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 429) << r->body;
  EXPECT_EQ(Json::parse(r->body)["error"]["type"], "rate_limit_error");
  replica_->Hold(false);
  first.join();
  {
    absl::MutexLock lock(&ready_mu_);
    ready_ = absl::UnavailableError("waiting for 1 worker");
  }
  auto [status, body] = Post("/v1/completions", R"({"prompt": [1], "max_tokens": 2})");
  EXPECT_EQ(status, 503);
  EXPECT_THAT(body["error"]["message"].get<std::string>(), HasSubstr("waiting for 1 worker"));
  EXPECT_EQ(rejections_.count(absl::StatusCode::kUnavailable), 1);  // counted like the gRPC API's
}

// The checks both APIs share (frontend/admission.h) name the field as OpenAI spells it, in the
// message and as the error's "param".
TEST_F(HttpServerTest, SharedChecksNameTheOpenAiField) {
  const struct {
    const char* body;
    const char* param;
    const char* message;
  } cases[] = {
      {R"({"prompt": [1], "logit_bias": {"100000": 1}})", "logit_bias", "logit_bias token 100000 is outside"},
      {R"({"prompt": [1], "max_tokens": 2, "min_tokens": 3})", "min_tokens",
       "min_tokens must be in [0, max_tokens = 2], got 3"},
      {R"({"prompt": [1], "stop_token_ids": [5, 100000]})", "stop_token_ids", "stop_token_ids[1] = 100000 is outside"},
      {R"({"prompt": "Hi", "stop": ["a", ""]})", "stop", "stop[1] is empty"},
  };
  for (const auto& c : cases) {
    auto [status, body] = Post("/v1/completions", c.body);
    EXPECT_EQ(status, 400) << c.body;
    EXPECT_EQ(body["error"]["param"], c.param) << body;
    EXPECT_THAT(body["error"]["message"].get<std::string>(), ::testing::StartsWith(c.message)) << body;
  }
}

TEST_F(HttpServerTest, BadRequestsAnd413And404And405) {
  EXPECT_EQ(Post("/v1/completions", "{").first, 400);
  EXPECT_EQ(Post("/v1/completions", R"({"prompt": [1], "foo": 1})").second["error"]["param"], "foo");
  EXPECT_EQ(Post("/v1/completions", R"({"prompt": [1, 100000]})").first, 400);
  EXPECT_EQ(Post("/v1/completions", R"({"prompt": [1], "max_tokens": 300})").first, 400);
  EXPECT_EQ(rejections_.count(absl::StatusCode::kInvalidArgument), 4);
  auto [big, big_body] = Post("/v1/completions", std::string(5000, ' '));
  EXPECT_EQ(big, 413);
  EXPECT_EQ(big_body["error"]["code"], "request_too_large");
  EXPECT_EQ(Post("/v2/other", "{}").first, 404);
  httplib::Result get = client_->Get("/v1/completions");
  ASSERT_TRUE(get);
  EXPECT_EQ(get->status, 405);
  EXPECT_EQ(get->get_header_value("Allow"), "POST");
  httplib::Result models = client_->Get("/v1/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(Json::parse(models->body)["data"][0]["id"], "llama");
}

}  // namespace
}  // namespace shardserve::coordinator::http

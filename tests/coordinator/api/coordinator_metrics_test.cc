// The coordinator's metrics (coordinator/server/coordinator_metrics.h) and request logs
// (coordinator/frontend/request_log.h): fake scheduler reports and a real Scheduler over a fake
// replica, checked in the Prometheus text a scrape returns; and the Coordinator's endpoint over
// HTTP.
#include "coordinator/server/coordinator_metrics.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/log/log.h"
#include "common/metrics/metrics_server.h"
#include "coordinator/server/coordinator.h"
#include "coordinator/frontend/request_log.h"
#include "prometheus/text_serializer.h"
#include "shardserve/v1/inference.grpc.pb.h"
#include "tests/testing/status_matchers.h"

namespace shardserve::coordinator {
namespace {

using ::shardserve::testing::IsOk;
using ::shardserve::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;

std::string Scrape(const CoordinatorMetrics& metrics) {
  return prometheus::TextSerializer().Serialize(metrics.registry()->Collect());
}

// The value of the series written exactly as `series` (name{labels}) in Prometheus text, or -1.
double Value(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.size() > series.size() && line.substr(0, series.size()) == series && line[series.size()] == ' ') {
      double v = 0;
      if (absl::SimpleAtod(line.substr(series.size() + 1), &v)) return v;
    }
  }
  return -1;
}

// GET http://127.0.0.1:port/path over a plain socket; the whole response, headers included.
std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (fd >= 0 && connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string req = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    if (send(fd, req.data(), req.size(), 0) == static_cast<ssize_t>(req.size())) {
      char buf[4096];
      for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) out.append(buf, static_cast<size_t>(n));
    }
  }
  if (fd >= 0) close(fd);
  return out;
}

TEST(CoordinatorMetricsTest, RequestEndsAreCountedByFinishReasonAndCode) {
  CoordinatorMetrics m;
  RequestReport ok{.replica = 0,
                   .end = {.status = absl::OkStatus(), .reason = FinishReason::kStop, .prompt_tokens = 5,
                           .completion_tokens = 7},
                   .queue_time = absl::Milliseconds(50),
                   .e2e_time = absl::Milliseconds(1500),
                   .time_to_first_token = absl::Milliseconds(200)};
  m.OnRequestEnd(ok);
  m.OnRequestEnd(ok);
  m.OnRequestEnd({.replica = 1,
                  .end = {.status = absl::UnavailableError("replica 1 lost"), .prompt_tokens = 3,
                          .completion_tokens = 1},
                  .queue_time = absl::Milliseconds(10),
                  .e2e_time = absl::Milliseconds(300),
                  .time_to_first_token = std::nullopt});
  m.OnRejected(absl::ResourceExhaustedError("queue full"));
  const std::string t = Scrape(m);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_requests_total{code="OK",finish_reason="stop"})"), 2) << t;
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_requests_total{code="UNAVAILABLE",finish_reason="error"})"), 1);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_requests_total{code="RESOURCE_EXHAUSTED",finish_reason="rejected"})"),
            1);
  EXPECT_EQ(Value(t, "shardserve_coordinator_prompt_tokens_total"), 13);
  EXPECT_EQ(Value(t, "shardserve_coordinator_generated_tokens_total"), 15);
  // The failed request generated nothing that has a first-token time.
  EXPECT_EQ(Value(t, "shardserve_coordinator_time_to_first_token_seconds_count"), 2);
  EXPECT_DOUBLE_EQ(Value(t, "shardserve_coordinator_time_to_first_token_seconds_sum"), 0.4);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_time_to_first_token_seconds_bucket{le="0.1"})"), 0);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_time_to_first_token_seconds_bucket{le="0.25"})"), 2);
  EXPECT_EQ(Value(t, "shardserve_coordinator_e2e_request_latency_seconds_count"), 3);
  EXPECT_DOUBLE_EQ(Value(t, "shardserve_coordinator_e2e_request_latency_seconds_sum"), 3.3);
  EXPECT_EQ(Value(t, "shardserve_coordinator_queue_time_seconds_count"), 3);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_request_generated_tokens_bucket{le="8"})"), 3);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_request_generated_tokens_bucket{le="4"})"), 1);
}

TEST(CoordinatorMetricsTest, StepsAndTokenGapsAreRecordedPerReplica) {
  CoordinatorMetrics m;
  m.OnStep({.replica = 0, .sequences = 3, .prefill_tokens = 20, .decode_tokens = 2,
            .duration = absl::Milliseconds(4), .status = absl::OkStatus()});
  m.OnStep({.replica = 0, .sequences = 3, .prefill_tokens = 0, .decode_tokens = 3,
            .duration = absl::Milliseconds(2), .status = absl::OkStatus()});
  m.OnStep({.replica = 1, .sequences = 1, .prefill_tokens = 0, .decode_tokens = 1,
            .duration = absl::Milliseconds(9), .status = absl::InternalError("stage 1 failed")});
  m.OnInterTokenLatency(absl::Milliseconds(20));
  m.OnInterTokenLatency(absl::Milliseconds(45));
  m.OnPreempted(1);
  m.OnFailover(1);
  m.OnFailover(1);
  m.OnPrefixCacheLookup(0, 40, 32);
  m.OnPrefixCacheLookup(0, 10, 0);
  const std::string t = Scrape(m);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_steps_total{code="OK",replica="0"})"), 2) << t;
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_steps_total{code="INTERNAL",replica="1"})"), 1);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_step_tokens_total{phase="prefill",replica="0"})"), 20);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_step_tokens_total{phase="decode",replica="0"})"), 5);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_batch_sequences_sum{replica="0"})"), 6);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_batch_tokens_bucket{replica="0",le="4"})"), 1);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_batch_tokens_bucket{replica="0",le="32"})"), 2);
  EXPECT_DOUBLE_EQ(Value(t, R"(shardserve_coordinator_step_seconds_sum{replica="0"})"), 0.006);
  EXPECT_EQ(Value(t, "shardserve_coordinator_inter_token_latency_seconds_count"), 2);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_inter_token_latency_seconds_bucket{le="0.025"})"), 1);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_preemptions_total{replica="1"})"), 1);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_failovers_total{replica="1"})"), 2);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_failovers_total{replica="0"})"), 0);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_prefix_cache_queried_tokens_total{replica="0"})"), 50);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_prefix_cache_hit_tokens_total{replica="0"})"), 32);
  // A replica that has stepped has its prefix cache series from the first step (at 0).
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_prefix_cache_hit_tokens_total{replica="1"})"), 0);
}

TEST(CoordinatorMetricsTest, RefreshSetsStateGaugesAndDropsGoneReplicas) {
  CoordinatorMetrics m;
  ClusterSample s;
  s.scheduler.replicas = {{.replica = 0, .max_slots = 8, .running = 3, .waiting = 2, .kv_blocks_used = 40,
                           .kv_blocks_cached = 17, .kv_blocks_total = 128},
                          {.replica = 1, .max_slots = 4, .running = 1, .waiting = 0, .kv_blocks_used = 9,
                           .kv_blocks_total = 64}};
  s.workers = {WorkerState::kReady, WorkerState::kReady, WorkerState::kDead, WorkerState::kLoading};
  s.plans_made = 2;
  s.ready = true;
  m.Refresh(s);
  std::string t = Scrape(m);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_running_sequences{replica="0"})"), 3) << t;
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_waiting_sequences{replica="0"})"), 2);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_slots{replica="1"})"), 4);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_kv_blocks_used{replica="1"})"), 9);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_kv_blocks_capacity{replica="0"})"), 128);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_kv_blocks_cached{replica="0"})"), 17);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_workers{state="ready"})"), 2);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_workers{state="dead"})"), 1);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_workers{state="failed"})"), 0);
  EXPECT_EQ(Value(t, "shardserve_coordinator_workers_up"), 3);
  EXPECT_EQ(Value(t, "shardserve_coordinator_replicas_serving"), 2);
  EXPECT_EQ(Value(t, "shardserve_coordinator_ready"), 1);
  EXPECT_EQ(Value(t, "shardserve_coordinator_plans_total"), 2);

  // Replica 1 stopped serving; one more plan was made.
  s.scheduler.replicas.pop_back();
  s.plans_made = 3;
  s.ready = false;
  m.Refresh(s);
  m.Refresh(s);  // refreshing again changes nothing
  t = Scrape(m);
  EXPECT_THAT(t, Not(HasSubstr(R"(shardserve_coordinator_running_sequences{replica="1"})")));
  EXPECT_THAT(t, Not(HasSubstr(R"(shardserve_coordinator_kv_blocks_capacity{replica="1"})")));
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_running_sequences{replica="0"})"), 3);
  EXPECT_EQ(Value(t, "shardserve_coordinator_replicas_serving"), 1);
  EXPECT_EQ(Value(t, "shardserve_coordinator_ready"), 0);
  EXPECT_EQ(Value(t, "shardserve_coordinator_plans_total"), 3);
}

TEST(CoordinatorMetricsTest, MetricsServerRefreshesBeforeEveryScrape) {
  CoordinatorMetrics m;
  int scrapes = 0;  // touched only by scrapes, which the server serializes
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<MetricsServer> server,
                       MetricsServer::Start("127.0.0.1:0", m.registry(), [&] {
                         ++scrapes;
                         ClusterSample s;
                         s.workers.assign(static_cast<size_t>(scrapes), WorkerState::kReady);
                         m.Refresh(s);
                       }));
  EXPECT_EQ(server->address(), absl::StrCat("127.0.0.1:", server->port()));
  EXPECT_THAT(HttpGet(server->port(), "/metrics"), HasSubstr("\nshardserve_coordinator_workers_up 1\n"));
  const std::string second = HttpGet(server->port(), "/metrics");
  EXPECT_THAT(second, HasSubstr("HTTP/1.1 200 OK"));
  EXPECT_THAT(second, HasSubstr("\nshardserve_coordinator_workers_up 2\n"));
  EXPECT_THAT(HttpGet(server->port(), "/other"), HasSubstr("404"));
  server.reset();
  EXPECT_EQ(scrapes, 2);
}

// Answers every step at once with token 7 for each sequence that samples.
class FakeReplica final : public ReplicaClient {
 public:
  absl::StatusOr<StepOutput> Step(const StepInput& input) override {
    StepOutput out;
    for (const StepSequenceInput& s : input.sequences) {
      if (s.sample) out.token_ids.push_back(7);
    }
    return out;
  }
  void Shutdown() override {}
};

class EndSink final : public SequenceSink {
 public:
  void OnTokens(absl::Span<const int32_t> tokens, absl::Span<const TokenLogprobs> /*logprobs*/) override {
    absl::MutexLock lock(&mu_);
    tokens_ += static_cast<int>(tokens.size());
  }
  void OnEnd(const SequenceEnd& end) override {
    {
      absl::MutexLock lock(&mu_);
      end_ = end;
    }
    done_.Notify();
  }
  SequenceEnd Wait() {
    done_.WaitForNotification();
    absl::MutexLock lock(&mu_);
    return end_;
  }
  int tokens() {
    absl::MutexLock lock(&mu_);
    return tokens_;
  }

 private:
  absl::Mutex mu_;
  int tokens_ ABSL_GUARDED_BY(mu_) = 0;
  SequenceEnd end_ ABSL_GUARDED_BY(mu_);
  absl::Notification done_;
};

// Keeps the lines glog writes while it is registered.
class CapturedLog final : public google::LogSink {
 public:
  CapturedLog() { google::AddLogSink(this); }
  ~CapturedLog() override { google::RemoveLogSink(this); }
  void send(google::LogSeverity /*severity*/, const char* /*full_filename*/, const char* /*base_filename*/,
            int /*line*/, const struct ::tm* /*tm_time*/, const char* message, size_t message_len) override {
    absl::MutexLock lock(&mu_);
    lines_.emplace_back(message, message_len);
  }
  std::vector<std::string> Lines() {
    absl::MutexLock lock(&mu_);
    return lines_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> lines_ ABSL_GUARDED_BY(mu_);
};

TEST(RequestLogTest, ASchedulerReportsEveryRequestToTheMetricsAndTheLog) {
  CoordinatorMetrics m;
  CapturedLog log;
  SchedulerOptions so;
  so.limits = {.vocab_size = 16, .max_seq_len = 64};
  so.observer = &m;
  Scheduler scheduler(so);
  ASSERT_THAT(scheduler.AddReplica(0, std::make_unique<FakeReplica>(), {.max_slots = 2, .kv_blocks = 64}), IsOk());
  std::vector<std::shared_ptr<EndSink>> sinks;
  for (int i = 0; i < 3; ++i) {
    sinks.push_back(std::make_shared<EndSink>());
    SequenceRequest r{.request_id = absl::StrCat("r-", i), .prompt = {1, 2, 3}, .max_tokens = 4};
    ASSERT_THAT(frontend::SubmitWithLog(scheduler, std::move(r), sinks.back()), IsOk());
  }
  // A refused request (a prompt id outside the vocabulary) is logged and counted too.
  SequenceRequest bad{.request_id = "has space\n", .prompt = {99}, .max_tokens = 4};
  EXPECT_THAT(frontend::SubmitWithLog(scheduler, std::move(bad), std::make_shared<EndSink>()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("prompt")));
  for (auto& s : sinks) {
    const SequenceEnd end = s->Wait();
    EXPECT_TRUE(end.status.ok()) << end.status;
    EXPECT_EQ(end.completion_tokens, 4);
    EXPECT_EQ(s->tokens(), 4);  // the wrapped sink received every token
  }
  ClusterSample sample{.scheduler = scheduler.Stats()};
  m.Refresh(sample);
  const std::string t = Scrape(m);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_requests_total{code="OK",finish_reason="length"})"), 3) << t;
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_requests_total{code="INVALID_ARGUMENT",finish_reason="rejected"})"),
            1);
  EXPECT_EQ(Value(t, "shardserve_coordinator_prompt_tokens_total"), 9);
  EXPECT_EQ(Value(t, "shardserve_coordinator_generated_tokens_total"), 12);
  EXPECT_EQ(Value(t, "shardserve_coordinator_time_to_first_token_seconds_count"), 3);
  EXPECT_EQ(Value(t, "shardserve_coordinator_inter_token_latency_seconds_count"), 9);  // 3 gaps per request
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_running_sequences{replica="0"})"), 0);
  // Every sequence gave its KV blocks back.
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_kv_blocks_used{replica="0"})"), 0);
  EXPECT_EQ(Value(t, R"(shardserve_coordinator_kv_blocks_capacity{replica="0"})"), 64);
  EXPECT_GE(Value(t, R"(shardserve_coordinator_steps_total{code="OK",replica="0"})"), 4);
  scheduler.Shutdown(absl::UnavailableError("test over"));

  const std::vector<std::string> lines = log.Lines();
  auto has = [&](const std::string& part) {
    for (const std::string& l : lines) {
      if (l.find(part) != std::string::npos) return true;
    }
    return false;
  };
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(has(absl::StrCat("event=request_start request_id=r-", i, " prompt_tokens=3 max_tokens=4")));
    EXPECT_TRUE(has(absl::StrCat("event=request_end request_id=r-", i,
                                 " status=OK finish_reason=length prompt_tokens=3 cached_prompt_tokens=0 "
                                 "completion_tokens=4 ttft_ms=")));
  }
  // An id with odd characters is quoted and escaped, so it cannot break the line.
  EXPECT_TRUE(has(R"(event=request_rejected request_id="has space\n" status=INVALID_ARGUMENT error=)"));
}

TEST(CoordinatorEndpointTest, ServesMetricsAtTheBoundAddress) {
  CoordinatorOptions o;
  o.model_path = "tests/golden/models/llama";
  o.metrics_listen = "127.0.0.1:0";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Coordinator> c, Coordinator::Start(o));
  const std::string& address = c->metrics_address();
  ASSERT_FALSE(address.empty());
  int port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(address.substr(address.rfind(':') + 1), &port)) << address;
  // No worker has registered, so the cluster is not ready: a request is refused before the
  // scheduler sees it, and counted all the same.
  auto stub = v1::Inference::NewStub(grpc::CreateChannel(c->address(), grpc::InsecureChannelCredentials()));
  v1::GenerateRequest req;
  req.mutable_token_ids()->add_ids(1);
  req.set_max_tokens(2);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  auto reader = stub->Generate(&ctx, req);
  v1::GenerateResponse resp;
  while (reader->Read(&resp)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  const std::string page = HttpGet(port, "/metrics");
  EXPECT_THAT(page, HasSubstr("\nshardserve_coordinator_ready 0\n"));
  EXPECT_THAT(page, HasSubstr("\nshardserve_coordinator_workers_up 0\n"));
  EXPECT_THAT(page, HasSubstr("\nshardserve_coordinator_plans_total 0\n"));
  EXPECT_THAT(page, HasSubstr("\nshardserve_coordinator_requests_total{code=\"UNAVAILABLE\",finish_reason=\"rejected\"} 1\n"));
  c->Shutdown(absl::Seconds(1));
}

TEST(CoordinatorEndpointTest, AMalformedMetricsAddressIsRefused) {
  CoordinatorOptions o;
  o.model_path = "tests/golden/models/llama";
  o.metrics_listen = "nowhere";
  EXPECT_THAT(Coordinator::Start(o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--metrics_listen")));
}

TEST(CoordinatorEndpointTest, NoMetricsAddressWithoutTheOption) {
  CoordinatorOptions o;
  o.model_path = "tests/golden/models/llama";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Coordinator> c, Coordinator::Start(o));
  EXPECT_TRUE(c->metrics_address().empty());
}

}  // namespace
}  // namespace shardserve::coordinator

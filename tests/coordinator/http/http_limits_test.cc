// Slow or hostile HTTP clients cannot stall the coordinator's HTTP API or a /metrics endpoint
// (issue 20, item 6): 64 slow connections (silent, or dribbling a request a byte per second) do not
// delay a normal request beyond 1 s; a 100 MB chunked body is refused with 413 without the
// process's RSS growing past 2x its idle size; a Content-Length body over the cap is 413 too.
#include <arpa/inet.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "common/metrics/metrics_server.h"
#include "coordinator/http/http_server.h"
#include "gtest/gtest.h"
#include "prometheus/counter.h"
#include "prometheus/registry.h"

namespace shardserve::coordinator::http {
namespace {

constexpr int kSlowConnections = 64;

int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (fd >= 0) close(fd);
    return -1;
  }
  return fd;
}

// The chunked bodies the tests send, and how much the process may grow while refusing one: half
// the body, so that a body read whole (or half of it) fails, while the server's and the sending
// thread's own memory (a few MB; some tens under AddressSanitizer) passes.
constexpr size_t kBodyBytes = size_t{100} << 20;
constexpr int64_t kMaxGrowthKiB = static_cast<int64_t>(kBodyBytes / 2 / 1024);

// The process's resident set size in KiB (VmRSS of /proc/self/status).
int64_t RssKiB() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

// kSlowConnections connections to `port` that send `request` one byte per second until destroyed
// (or, with an empty `request`, say nothing).
class SlowClients {
 public:
  SlowClients(int port, std::string request) : request_(std::move(request)) {
    for (int i = 0; i < kSlowConnections; ++i) {
      const int fd = Connect(port);
      EXPECT_GE(fd, 0);
      if (fd < 0) continue;
      (request_.empty() ? silent_ : dribbling_).push_back(fd);
    }
    thread_ = std::thread([this] {
      for (size_t i = 0; !stop_.load(); ++i) {
        for (int fd : dribbling_) send(fd, &request_[i % request_.size()], 1, MSG_NOSIGNAL);
        for (int t = 0; t < 100 && !stop_.load(); ++t) absl::SleepFor(absl::Milliseconds(10));
      }
    });
    // Let the server accept them all and start waiting on them.
    absl::SleepFor(absl::Milliseconds(300));
  }
  ~SlowClients() {
    stop_.store(true);
    thread_.join();
    for (int fd : silent_) close(fd);
    for (int fd : dribbling_) close(fd);
  }

 private:
  const std::string request_;
  std::vector<int> silent_;
  std::vector<int> dribbling_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

class HttpLimitsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::signal(SIGPIPE, SIG_IGN);
    SchedulerOptions so;
    so.limits = {.vocab_size = 512, .max_seq_len = 256};
    scheduler_ = std::make_unique<Scheduler>(so);
    absl::StatusOr<std::unique_ptr<HttpServer>> server =
        HttpServer::Start({.listen = "127.0.0.1:0", .model_id = "m", .model_path = "m", .max_body_bytes = 1 << 20},
                          /*tokenizer=*/nullptr, scheduler_.get(), [] { return absl::OkStatus(); });
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  void TearDown() override {
    scheduler_->Shutdown(absl::UnavailableError("shutting down"));
    server_->Stop();
  }

  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<HttpServer> server_;
};

// The time a fresh client takes for GET `path` on `port` (its status in *status).
absl::Duration TimedGet(int port, const std::string& path, int* status, std::string* body = nullptr) {
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(10, 0);
  client.set_read_timeout(10, 0);
  const absl::Time start = absl::Now();
  httplib::Result r = client.Get(path.c_str());
  const absl::Duration took = absl::Now() - start;
  *status = r ? r->status : 0;
  if (r && body != nullptr) *body = r->body;
  return took;
}

void ExpectNotDelayed(int port, const std::string& path, const std::string& slow_request) {
  SlowClients slow(port, slow_request);
  // Over 3 s, while the slow connections keep at it.
  for (int i = 0; i < 4; ++i) {
    int status = 0;
    std::string body;
    const absl::Duration took = TimedGet(port, path, &status, &body);
    EXPECT_EQ(status, 200) << body;
    EXPECT_LT(took, absl::Seconds(1)) << "request " << i;
    std::cerr << "GET " << path << " " << i << " took " << absl::FormatDuration(took) << "\n";
    absl::SleepFor(absl::Milliseconds(800));
  }
}

std::string DribbledRequest(const std::string& path) {
  return "GET " + path + " HTTP/1.1\r\nHost: x\r\nX-Pad: " + std::string(4000, 'a');
}

TEST_F(HttpLimitsTest, DribblingConnectionsDoNotDelayANormalRequest) {
  ExpectNotDelayed(server_->port(), "/v1/models", DribbledRequest("/v1/models"));
}

TEST_F(HttpLimitsTest, SilentConnectionsDoNotDelayANormalRequest) {
  ExpectNotDelayed(server_->port(), "/v1/models", /*slow_request=*/"");
}

TEST_F(HttpLimitsTest, ContentLengthBodyOverTheCapIs413) {
  httplib::Client client("127.0.0.1", server_->port());
  httplib::Result r = client.Post("/v1/completions", std::string((1 << 20) + 1, ' '), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 413);
  EXPECT_NE(r->body.find("request_too_large"), std::string::npos) << r->body;
}

// Sends a chunked POST of `total` bytes to `path` (from one 64 KiB buffer, so the client side
// holds nothing) while reading the reply; returns the reply's first bytes ("" when none came).
std::string ChunkedPost(int port, const std::string& path, size_t total) {
  const int fd = Connect(port);
  if (fd < 0) return "";
  const std::string head = "POST " + path +
                           " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           "Transfer-Encoding: chunked\r\n\r\n";
  send(fd, head.data(), head.size(), MSG_NOSIGNAL);
  std::thread sender([fd, total] {
    const std::string chunk = "10000\r\n" + std::string(0x10000, ' ') + "\r\n";
    for (size_t sent = 0; sent < total; sent += 0x10000) {
      if (send(fd, chunk.data(), chunk.size(), MSG_NOSIGNAL) < 0) return;  // the server closed
    }
    send(fd, "0\r\n\r\n", 5, MSG_NOSIGNAL);
  });
  std::string reply;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  char buf[4096];
  while (absl::Now() < deadline) {
    pollfd p{.fd = fd, .events = POLLIN, .revents = 0};
    if (poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    reply.append(buf, static_cast<size_t>(n));
  }
  shutdown(fd, SHUT_RDWR);
  sender.join();
  close(fd);
  return reply;
}

TEST_F(HttpLimitsTest, ChunkedBodyOverTheCapIs413WithoutBufferingIt) {
  const int64_t idle = RssKiB();
  ASSERT_GT(idle, 0);
  const std::string reply = ChunkedPost(server_->port(), "/v1/completions", kBodyBytes);
  const int64_t after = RssKiB();
  EXPECT_EQ(reply.rfind("HTTP/1.1 413", 0), 0u) << reply.substr(0, 200);
  EXPECT_NE(reply.find("request_too_large"), std::string::npos) << reply.substr(0, 400);
  EXPECT_LT(after, 2 * idle) << "idle RSS " << idle << " KiB, after " << after << " KiB";
  EXPECT_LT(after - idle, kMaxGrowthKiB) << "idle RSS " << idle << " KiB, after " << after << " KiB";
}

TEST_F(HttpLimitsTest, ChunkedBodyOnAnUnknownRouteIsNotRead) {
  const int64_t idle = RssKiB();
  const std::string reply = ChunkedPost(server_->port(), "/v2/nothing", kBodyBytes);
  EXPECT_EQ(reply.rfind("HTTP/1.1 404", 0), 0u) << reply.substr(0, 200);
  EXPECT_LT(RssKiB() - idle, kMaxGrowthKiB);
}

TEST_F(HttpLimitsTest, ChunkedBodyUnderTheCapIsServed) {
  httplib::Client client("127.0.0.1", server_->port());
  const std::string json = R"({"model": "m", "prompt": [1, 2], "max_tokens": 1, "bogus_field": 1})";
  // A content provider without a length makes the client send it chunked.
  httplib::Result r = client.Post(
      "/v1/completions",
      [&json](size_t /*offset*/, httplib::DataSink& sink) {
        sink.write(json.data(), json.size());
        sink.done();
        return true;
      },
      "application/json");
  ASSERT_TRUE(r);
  // Read whole and parsed: the unknown field is named in a 400.
  EXPECT_EQ(r->status, 400);
  EXPECT_NE(r->body.find("bogus_field"), std::string::npos) << r->body;
}

TEST(MetricsServerLimitsTest, DribblingConnectionsDoNotDelayAScrape) {
  std::signal(SIGPIPE, SIG_IGN);
  auto registry = std::make_shared<prometheus::Registry>();
  prometheus::BuildCounter().Name("shardserve_test_total").Help("a counter").Register(*registry).Add({}).Increment();
  absl::StatusOr<std::unique_ptr<MetricsServer>> server = MetricsServer::Start("127.0.0.1:0", registry);
  ASSERT_TRUE(server.ok()) << server.status();
  ExpectNotDelayed((*server)->port(), "/metrics", DribbledRequest("/metrics"));
  int status = 0;
  std::string body;
  TimedGet((*server)->port(), "/metrics", &status, &body);
  EXPECT_NE(body.find("shardserve_test_total 1"), std::string::npos) << body;
}

TEST(MetricsServerLimitsTest, ChunkedBodyIsNotRead) {
  std::signal(SIGPIPE, SIG_IGN);
  auto registry = std::make_shared<prometheus::Registry>();
  absl::StatusOr<std::unique_ptr<MetricsServer>> server = MetricsServer::Start("127.0.0.1:0", registry);
  ASSERT_TRUE(server.ok()) << server.status();
  const int64_t idle = RssKiB();
  const std::string reply = ChunkedPost((*server)->port(), "/metrics", kBodyBytes);
  EXPECT_EQ(reply.rfind("HTTP/1.1 404", 0), 0u) << reply.substr(0, 200);
  EXPECT_LT(RssKiB() - idle, kMaxGrowthKiB);
}

}  // namespace
}  // namespace shardserve::coordinator::http

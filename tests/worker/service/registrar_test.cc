// Registrar: the backoff between failed registrations (decorrelated jitter, capped), and what a
// worker tells a coordinator when it registers — the same instance id every time, and what it
// holds — against a fake Registry service on 127.0.0.1 (port 0).
#include "worker/service/registrar.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace shardserve::service {
namespace {

using std::chrono::milliseconds;

TEST(RegistrationBackoffTest, GrowsToTheCapWhenTheDrawIsHighAndStaysAtTheBaseWhenLow) {
  RegistrationBackoff high(milliseconds(100), milliseconds(2000), [](int64_t, int64_t hi) { return hi; });
  std::vector<int64_t> got;
  for (int i = 0; i < 6; ++i) got.push_back(high.Next().count());
  EXPECT_EQ(got, (std::vector<int64_t>{300, 900, 2000, 2000, 2000, 2000}));
  high.Reset();
  EXPECT_EQ(high.Next().count(), 300);
  RegistrationBackoff low(milliseconds(100), milliseconds(2000), [](int64_t lo, int64_t) { return lo; });
  for (int i = 0; i < 5; ++i) EXPECT_EQ(low.Next().count(), 100);
}

// Each draw is uniform over [base, 3 x previous] (capped): the bounds handed to the source are
// those, and a real generator spreads the delays (two workers seldom retry at the same instant).
TEST(RegistrationBackoffTest, DrawsAreJitteredWithinBaseAndThreeTimesThePrevious) {
  std::mt19937_64 gen(7);
  int64_t previous = 100;
  std::vector<std::pair<int64_t, int64_t>> bounds;
  RegistrationBackoff b(milliseconds(100), milliseconds(2000), [&](int64_t lo, int64_t hi) {
    bounds.emplace_back(lo, hi);
    return std::uniform_int_distribution<int64_t>(lo, hi)(gen);
  });
  std::vector<int64_t> delays;
  for (int i = 0; i < 200; ++i) {
    const int64_t d = b.Next().count();
    ASSERT_EQ(bounds.back(), (std::pair<int64_t, int64_t>{100, std::min<int64_t>(2000, 3 * previous)}));
    ASSERT_GE(d, 100);
    ASSERT_LE(d, 2000);
    delays.push_back(d);
    previous = d;
  }
  std::sort(delays.begin(), delays.end());
  EXPECT_GT(std::unique(delays.begin(), delays.end()) - delays.begin(), 100) << "delays are spread, not a ladder";
  // The default source (seeded from the system) stays in bounds too.
  RegistrationBackoff real(milliseconds(100), milliseconds(2000));
  for (int i = 0; i < 100; ++i) {
    const int64_t d = real.Next().count();
    ASSERT_GE(d, 100);
    ASSERT_LE(d, 2000);
  }
}

TEST(NewInstanceIdTest, SixteenHexDigitsThatDiffer) {
  const std::string a = NewInstanceId(), b = NewInstanceId();
  EXPECT_THAT(a, ::testing::MatchesRegex("[0-9a-f]{16}"));
  EXPECT_NE(a, b);
}

// A Registry that refuses the first registration (ALREADY_EXISTS, as for a restarted worker whose
// old instance still counts as live), forgets the worker at its first heartbeat (NOT_FOUND, as a
// restarted coordinator does) and records every registration. It has no HeartbeatStream
// (UNIMPLEMENTED), as a coordinator older than the stream: the Registrar sends unary heartbeats.
class FakeRegistry final : public v1::Registry::CallbackService {
 public:
  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* ctx, const v1::RegisterRequest* request,
                                     v1::RegisterResponse* response) override {
    grpc::Status st;
    {
      absl::MutexLock lock(&mu_);
      requests_.push_back(*request);
      if (requests_.size() == 1) {
        st = grpc::Status(grpc::StatusCode::ALREADY_EXISTS, "address held by a live worker");
      } else {
        response->set_worker_id(absl::StrCat("w-", request->instance_id()));
        response->set_heartbeat_interval_ms(50);
      }
    }
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(st);
    return reactor;
  }
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx, const v1::HeartbeatRequest* /*request*/,
                                      v1::HeartbeatResponse* /*response*/) override {
    grpc::Status st;
    {
      absl::MutexLock lock(&mu_);
      if (++heartbeats_ == 1) st = grpc::Status(grpc::StatusCode::NOT_FOUND, "register again");
    }
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(st);
    return reactor;
  }
  // Waits (bounded) for `n` registrations; returns them.
  std::vector<v1::RegisterRequest> WaitForRegistrations(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return requests_.size() >= n; };
    mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(30));
    return requests_;
  }

 private:
  absl::Mutex mu_;
  std::vector<v1::RegisterRequest> requests_ ABSL_GUARDED_BY(mu_);
  int heartbeats_ ABSL_GUARDED_BY(mu_) = 0;
};

TEST(RegistrarTest, RetriesARefusalAndRegistersAgainWithTheSameInstanceAndWhatItHolds) {
  FakeRegistry registry;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&registry);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(port, 0);
  v1::Assignment held;
  held.set_assignment_id("plan-x-1/r0/s0/w-1");
  held.set_layer_end(2);
  v1::RegisterRequest base;
  base.set_node_name("node-a");
  base.set_address("127.0.0.1:9");
  Registrar registrar(absl::StrCat("127.0.0.1:", port), base, [&] {
    return WorkerStatusSnapshot{.state = v1::WORKER_STATE_READY, .assignment_id = held.assignment_id(),
                                .kv_blocks = 8, .assignment = held};
  });
  EXPECT_THAT(registrar.instance_id(), ::testing::MatchesRegex("[0-9a-f]{16}"));
  registrar.Start();
  const std::vector<v1::RegisterRequest> got = registry.WaitForRegistrations(3);
  registrar.Stop();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  ASSERT_GE(got.size(), 3u) << "refused, accepted, then again after NOT_FOUND";
  for (const v1::RegisterRequest& r : got) {
    EXPECT_EQ(r.instance_id(), registrar.instance_id());
    EXPECT_EQ(r.node_name(), "node-a");
    EXPECT_EQ(r.state(), v1::WORKER_STATE_READY);
    EXPECT_EQ(r.held().assignment_id(), "plan-x-1/r0/s0/w-1");
    EXPECT_EQ(r.kv_blocks(), 8);
  }
}

}  // namespace
}  // namespace shardserve::service

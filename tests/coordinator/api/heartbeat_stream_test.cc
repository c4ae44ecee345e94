// Registry.HeartbeatStream end to end on 127.0.0.1 (port 0): the coordinator's RegistryService
// and WorkerRegistry (with a FakeClock, so that only the tests move time) against the worker's
// HeartbeatStreamCall and Registrar. What a stream does to a worker's liveness (heartbeats keep it
// alive; closing the stream kills it at once; silence on an open stream kills it after the
// timeout), the errors that end a stream, and a worker's way back after a coordinator restart.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/api/control_service.h"
#include "coordinator/registry/registry.h"
#include "shardserve/v1/control.grpc.pb.h"
#include "tests/testing/fake_clock.h"
#include "tests/testing/status_matchers.h"
#include "worker/service/heartbeat_stream_call.h"
#include "worker/service/registrar.h"

namespace shardserve::coordinator {
namespace {

using ::shardserve::testing::FakeClock;
using ::testing::HasSubstr;

constexpr absl::Duration kWait = absl::Seconds(30);  // bound on every wait for an event

// A coordinator's control plane: a registry and its Registry service on a port.
class ControlPlane {
 public:
  // Port 0 picks a free one.
  explicit ControlPlane(FakeClock* clock, int port = 0)
      : registry_({.heartbeat_interval = absl::Seconds(1), .heartbeat_timeout = absl::Seconds(5)}, clock),
        service_(&registry_) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort(absl::StrCat("127.0.0.1:", port), grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
  }
  ~ControlPlane() { Stop(); }
  void Stop() {
    if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    server_.reset();
  }

  int port() const { return port_; }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  WorkerRegistry& registry() { return registry_; }

  // Waits (woken by the registry's changes) until `pred(record)` holds for worker `id`, or kWait.
  template <class Pred>
  bool WaitFor(const std::string& id, Pred pred) {
    const absl::Time deadline = absl::Now() + kWait;
    while (absl::Now() < deadline) {
      const uint64_t seen = registry_.version();
      if (std::optional<WorkerRecord> r = registry_.Get(id); r.has_value() && pred(*r)) return true;
      registry_.WaitForChange(seen, absl::Seconds(1));
    }
    return false;
  }

 private:
  WorkerRegistry registry_;
  RegistryService service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

WorkerRegistration Worker(const std::string& instance) {
  return {.node_name = "node-" + instance, .address = "10.0.0.1:7000", .instance_id = instance};
}

v1::HeartbeatRequest Beat(const std::string& id, v1::WorkerState state = v1::WORKER_STATE_IDLE) {
  v1::HeartbeatRequest hb;
  hb.set_worker_id(id);
  hb.set_state(state);
  return hb;
}

class HeartbeatStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_NE(plane_.port(), 0);
    stub_ = v1::Registry::NewStub(grpc::CreateChannel(plane_.address(), grpc::InsecureChannelCredentials()));
  }
  // A synchronous stream (the tests read every answer themselves).
  std::unique_ptr<grpc::ClientReaderWriter<v1::HeartbeatRequest, v1::HeartbeatResponse>> Open(
      grpc::ClientContext* ctx) {
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return stub_->HeartbeatStream(ctx);
  }
  // Writes `hb` and reads its answer; false when the stream has ended instead.
  static bool RoundTrip(grpc::ClientReaderWriter<v1::HeartbeatRequest, v1::HeartbeatResponse>& stream,
                        const v1::HeartbeatRequest& hb) {
    v1::HeartbeatResponse answer;
    return stream.Write(hb) && stream.Read(&answer);
  }
  // The status that ends a stream once its last request was refused.
  static grpc::Status Ended(grpc::ClientReaderWriter<v1::HeartbeatRequest, v1::HeartbeatResponse>& stream) {
    v1::HeartbeatResponse answer;
    while (stream.Read(&answer)) {
    }
    return stream.Finish();
  }

  FakeClock clock_;
  ControlPlane plane_{&clock_};
  std::unique_ptr<v1::Registry::Stub> stub_;
};

TEST_F(HeartbeatStreamTest, HeartbeatsOnTheStreamKeepTheWorkerAliveAndRecordItsState) {
  ASSERT_OK_AND_ASSIGN(const std::string id, plane_.registry().Register(Worker("inst-0001")));
  grpc::ClientContext ctx;
  auto stream = Open(&ctx);
  // 5 beats 2 s apart: 10 s in all, twice the timeout, yet never 5 s silent.
  for (int i = 0; i < 5; ++i) {
    clock_.Advance(absl::Seconds(2));
    v1::HeartbeatRequest hb = Beat(id, v1::WORKER_STATE_READY);
    hb.set_assignment_id("plan-1/r0/s0");
    hb.set_kv_blocks(100 + i);
    ASSERT_TRUE(RoundTrip(*stream, hb)) << "beat " << i;
    EXPECT_THAT(plane_.registry().SweepDead(), ::testing::IsEmpty());
  }
  std::optional<WorkerRecord> r = plane_.registry().Get(id);
  EXPECT_EQ(r->state, WorkerState::kReady);
  EXPECT_EQ(r->assignment_id, "plan-1/r0/s0");
  EXPECT_EQ(r->kv_blocks, 104);
  EXPECT_EQ(r->last_heartbeat, clock_.Now());
  // A graceful close (the worker stopping) is a departure too.
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_TRUE(plane_.WaitFor(id, [](const WorkerRecord& w) { return w.state == WorkerState::kDead; }));
}

TEST_F(HeartbeatStreamTest, AStreamThatClosesMarksItsWorkerDeadAtOnce) {
  ASSERT_OK_AND_ASSIGN(const std::string id, plane_.registry().Register(Worker("inst-0001")));
  grpc::ClientContext ctx;
  auto stream = Open(&ctx);
  ASSERT_TRUE(RoundTrip(*stream, Beat(id, v1::WORKER_STATE_LOADING)));
  ctx.TryCancel();  // what the coordinator sees when the worker's process dies
  // No clock movement: this is not the timeout.
  ASSERT_TRUE(plane_.WaitFor(id, [](const WorkerRecord& w) { return w.state == WorkerState::kDead; }));
  EXPECT_THAT(plane_.registry().Get(id)->error, HasSubstr("heartbeat stream closed"));
  EXPECT_THAT(plane_.registry().Get(id)->error, HasSubstr("last state loading"));
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
}

TEST_F(HeartbeatStreamTest, AWorkerSilentOnAnOpenStreamIsDeadAfterTheTimeoutAndItsNextBeatEndsTheStream) {
  ASSERT_OK_AND_ASSIGN(const std::string id, plane_.registry().Register(Worker("inst-0001")));
  grpc::ClientContext ctx;
  auto stream = Open(&ctx);
  ASSERT_TRUE(RoundTrip(*stream, Beat(id)));
  clock_.Advance(absl::Seconds(5));
  EXPECT_THAT(plane_.registry().SweepDead(), ::testing::IsEmpty());
  clock_.Advance(absl::Milliseconds(1));  // a hung peer: the stream is open, nothing comes
  EXPECT_THAT(plane_.registry().SweepDead(), ::testing::ElementsAre(id));
  EXPECT_THAT(plane_.registry().Get(id)->error, HasSubstr("no heartbeat for 5.001s"));
  // It wakes up: its heartbeat ends the stream with NOT_FOUND, as a unary one would be answered.
  EXPECT_TRUE(stream->Write(Beat(id)));
  const grpc::Status st = Ended(*stream);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(st.error_message(), HasSubstr("register again"));
}

TEST_F(HeartbeatStreamTest, AnUnknownWorkerIsToldToRegisterAgain) {
  grpc::ClientContext ctx;
  auto stream = Open(&ctx);
  EXPECT_TRUE(stream->Write(Beat("w-nobody")));
  const grpc::Status st = Ended(*stream);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(st.error_message(), HasSubstr("unknown worker_id \"w-nobody\"; register again"));
}

TEST_F(HeartbeatStreamTest, AnotherWorkersIdOnTheStreamIsRefusedAndKillsNobody) {
  ASSERT_OK_AND_ASSIGN(const std::string a, plane_.registry().Register(Worker("inst-000a")));
  WorkerRegistration other = Worker("inst-000b");
  other.address = "10.0.0.2:7000";
  ASSERT_OK_AND_ASSIGN(const std::string b, plane_.registry().Register(other));
  grpc::ClientContext ctx;
  auto stream = Open(&ctx);
  ASSERT_TRUE(RoundTrip(*stream, Beat(a)));
  EXPECT_TRUE(stream->Write(Beat(b)));
  const grpc::Status st = Ended(*stream);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("one stream carries one worker's heartbeats"));
  // The coordinator ended the stream, not the worker: both are alive.
  EXPECT_EQ(plane_.registry().NumAlive(), 2);
}

TEST_F(HeartbeatStreamTest, AnUnsupportedStateIsRefused) {
  ASSERT_OK_AND_ASSIGN(const std::string id, plane_.registry().Register(Worker("inst-0001")));
  for (const v1::WorkerState state : {v1::WORKER_STATE_UNSPECIFIED, v1::WORKER_STATE_DEAD}) {
    grpc::ClientContext ctx;
    auto stream = Open(&ctx);
    EXPECT_TRUE(stream->Write(Beat(id, state)));
    const grpc::Status st = Ended(*stream);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << v1::WorkerState_Name(state);
    EXPECT_THAT(st.error_message(), HasSubstr("state"));
  }
}

TEST_F(HeartbeatStreamTest, AnOversizedHeartbeatIsRefused) {
  ASSERT_OK_AND_ASSIGN(const std::string id, plane_.registry().Register(Worker("inst-0001")));
  grpc::ClientContext ctx;
  auto stream = Open(&ctx);
  v1::HeartbeatRequest hb = Beat(id, v1::WORKER_STATE_FAILED);
  hb.set_error(std::string(70 * 1024, 'x'));
  EXPECT_TRUE(stream->Write(hb));
  const grpc::Status st = Ended(*stream);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(st.error_message(), HasSubstr("at most 65536"));
  EXPECT_EQ(plane_.registry().Get(id)->state, WorkerState::kIdle) << "the refused heartbeat was not recorded";
}

TEST_F(HeartbeatStreamTest, MoreThanEightHeartbeatsWithinOneIntervalAreRefused) {
  ASSERT_OK_AND_ASSIGN(const std::string id, plane_.registry().Register(Worker("inst-0001")));
  grpc::ClientContext ctx;
  auto stream = Open(&ctx);
  // Written back to back, answers unread: the coordinator handles all nine within microseconds,
  // far inside its one-second (real time) window.
  for (int i = 0; i < 9; ++i) EXPECT_TRUE(stream->Write(Beat(id)));
  v1::HeartbeatResponse answer;
  int answers = 0;
  while (stream->Read(&answer)) ++answers;
  const grpc::Status st = stream->Finish();
  EXPECT_EQ(answers, 8);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(st.error_message(), HasSubstr("more than 8 heartbeats within one heartbeat interval"));
}

// The worker's side: HeartbeatStreamCall reports answers and the coordinator's status.
TEST_F(HeartbeatStreamTest, TheWorkersCallSeesAnswersAndTheStatusThatEndsTheStream) {
  ASSERT_OK_AND_ASSIGN(const std::string id, plane_.registry().Register(Worker("inst-0001")));
  absl::Mutex mu;
  int answers = 0;
  service::HeartbeatStreamCall call(stub_.get(), [&](absl::Duration round_trip) {
    EXPECT_GE(round_trip, absl::ZeroDuration());
    absl::MutexLock lock(&mu);
    ++answers;
  });
  for (int i = 1; i <= 3; ++i) {
    ASSERT_TRUE(call.Send(Beat(id, v1::WORKER_STATE_LOADING)));
    absl::MutexLock lock(&mu);
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(+[](int* n) { return *n >= 1; }, &answers), kWait));
    answers = 0;
  }
  EXPECT_EQ(call.progress().sent, 3);
  EXPECT_EQ(call.progress().answered, 3);
  EXPECT_EQ(call.progress().oldest_unanswered, absl::InfiniteFuture());
  EXPECT_EQ(plane_.registry().Get(id)->state, WorkerState::kLoading);
  clock_.Advance(absl::Seconds(6));
  ASSERT_THAT(plane_.registry().SweepDead(), ::testing::ElementsAre(id));
  ASSERT_TRUE(call.Send(Beat(id)));
  EXPECT_TRUE(call.WaitEnded(absl::Now() + kWait));
  EXPECT_FALSE(call.Send(Beat(id))) << "nothing is written once the stream has ended";
  const grpc::Status st = call.Close();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(st.error_message(), HasSubstr("declared dead"));
}

// A worker's status as the Registrar reads it; the test changes it.
class WorkerStatus {
 public:
  service::WorkerStatusSnapshot Get() {
    absl::MutexLock lock(&mu_);
    return snapshot_;
  }
  void Set(service::WorkerStatusSnapshot s) {
    absl::MutexLock lock(&mu_);
    snapshot_ = std::move(s);
  }

 private:
  absl::Mutex mu_;
  service::WorkerStatusSnapshot snapshot_ ABSL_GUARDED_BY(mu_){.state = v1::WORKER_STATE_IDLE};
};

v1::RegisterRequest Registration() {
  v1::RegisterRequest r;
  r.set_node_name("node-a");
  r.set_address("127.0.0.1:9");
  return r;
}

// The Registrar heartbeats on a stream: its state reaches the registry with no unary call, and
// its Stop() (the worker leaving) marks it dead at once, which only a closed stream does.
TEST_F(HeartbeatStreamTest, TheRegistrarHeartbeatsOnAStreamAndStoppingItMarksTheWorkerDead) {
  WorkerStatus status;
  service::Registrar registrar(plane_.address(), Registration(), [&] { return status.Get(); });
  const std::string id = "w-" + registrar.instance_id();
  registrar.Start();
  ASSERT_TRUE(plane_.WaitFor(id, [](const WorkerRecord& w) { return w.state == WorkerState::kIdle; }));
  v1::Assignment held;
  held.set_assignment_id("plan-1/r0/s0");
  status.Set({.state = v1::WORKER_STATE_LOADING, .assignment_id = "plan-1/r0/s0", .assignment = held});
  ASSERT_TRUE(plane_.WaitFor(id, [](const WorkerRecord& w) { return w.state == WorkerState::kLoading; }));
  registrar.Stop();
  ASSERT_TRUE(plane_.WaitFor(id, [](const WorkerRecord& w) { return w.state == WorkerState::kDead; }));
  EXPECT_THAT(plane_.registry().Get(id)->error, HasSubstr("heartbeat stream closed"));
}

// A coordinator restart: the new one (same port, empty registry) answers the worker's reopened
// stream with NOT_FOUND; the worker registers again with the same identity and what it holds (so
// the coordinator can adopt it) and heartbeats on a new stream.
TEST_F(HeartbeatStreamTest, AfterACoordinatorRestartTheRegistrarRegistersAgainAndStreamsToTheNewOne) {
  WorkerStatus status;
  v1::Assignment held;
  held.set_assignment_id("plan-1/r0/s0");
  held.set_layer_end(2);
  held.set_device_kind(v1::DEVICE_KIND_CPU);
  held.add_devices(0);
  status.Set({.state = v1::WORKER_STATE_READY, .assignment_id = "plan-1/r0/s0", .kv_blocks = 8, .assignment = held});
  service::Registrar registrar(plane_.address(), Registration(), [&] { return status.Get(); });
  const std::string id = "w-" + registrar.instance_id();
  registrar.Start();
  ASSERT_TRUE(plane_.WaitFor(id, [](const WorkerRecord& w) { return w.state == WorkerState::kReady; }));
  const int port = plane_.port();
  plane_.Stop();  // the coordinator goes away

  FakeClock clock;
  ControlPlane restarted(&clock, port);
  ASSERT_EQ(restarted.port(), port);
  ASSERT_TRUE(restarted.WaitFor(id, [](const WorkerRecord& w) { return w.state == WorkerState::kReady; }));
  std::optional<WorkerRecord> r = restarted.registry().Get(id);
  ASSERT_TRUE(r->registration.held.has_value());
  EXPECT_EQ(r->registration.held->assignment_id, "plan-1/r0/s0");
  EXPECT_EQ(r->registration.instance_id, registrar.instance_id());
  EXPECT_EQ(r->kv_blocks, 8);
  // Its heartbeats come on a stream of the new coordinator: a change of state arrives...
  status.Set({.state = v1::WORKER_STATE_READY, .assignment_id = "plan-1/r0/s0", .kv_blocks = 9, .assignment = held});
  ASSERT_TRUE(restarted.WaitFor(id, [](const WorkerRecord& w) { return w.kv_blocks == 9; }));
  // ... and stopping the worker closes that stream.
  registrar.Stop();
  ASSERT_TRUE(restarted.WaitFor(id, [](const WorkerRecord& w) { return w.state == WorkerState::kDead; }));
  EXPECT_THAT(restarted.registry().Get(id)->error, HasSubstr("heartbeat stream closed"));
}

}  // namespace
}  // namespace shardserve::coordinator

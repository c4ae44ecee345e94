// WorkerRegistry with a FakeClock: registration, heartbeats and states, liveness (heartbeat
// timeout -> dead), re-registration of a restarted worker.
#include "coordinator/registry/registry.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>

#include "absl/strings/str_cat.h"
#include "tests/testing/fake_clock.h"
#include "tests/testing/status_matchers.h"

namespace shardserve::coordinator {
namespace {

using ::shardserve::testing::FakeClock;
using ::shardserve::testing::IsOk;
using ::shardserve::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

WorkerRegistration Worker(const std::string& node, const std::string& address, int cpus = 2) {
  WorkerRegistration r{.node_name = node, .address = address};
  for (int i = 0; i < cpus; ++i) {
    r.devices.push_back(Device{.kind = DeviceKind::kCpu, .index = i, .total_bytes = 1000, .free_bytes = 800});
  }
  return r;
}

class RegistryTest : public ::testing::Test {
 protected:
  FakeClock clock_;
  WorkerRegistry registry_{
      {.heartbeat_interval = absl::Seconds(1), .heartbeat_timeout = absl::Seconds(5), .incarnation = "t"}, &clock_};
};

TEST_F(RegistryTest, RegisterGivesNewIdsInOrderAndStartsIdle) {
  ASSERT_OK_AND_ASSIGN(std::string a, registry_.Register(Worker("node-a", "10.0.0.1:7000")));
  ASSERT_OK_AND_ASSIGN(std::string b, registry_.Register(Worker("node-b", "10.0.0.2:7000", 4)));
  EXPECT_EQ(a, "w-t-1");
  EXPECT_EQ(b, "w-t-2");
  const std::vector<WorkerRecord> all = registry_.List();
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].worker_id, "w-t-1");
  EXPECT_EQ(all[0].state, WorkerState::kIdle);
  EXPECT_EQ(all[1].registration.devices.size(), 4u);
  EXPECT_EQ(all[1].registered_at, clock_.Now());
  EXPECT_EQ(registry_.NumAlive(), 2);
}

// A coordinator restart makes a new registry: ids from the old one must not name its workers
// (a worker still heartbeating under an old id is told to register again, never mistaken for
// the worker that now holds the same number).
TEST_F(RegistryTest, IdsOfAnEarlierRegistryAreUnknownToANewOne) {
  ASSERT_OK_AND_ASSIGN(const std::string old_a, registry_.Register(Worker("node-a", "10.0.0.1:7000")));
  ASSERT_OK_AND_ASSIGN(const std::string old_b, registry_.Register(Worker("node-b", "10.0.0.2:7000")));
  WorkerRegistry restarted({.heartbeat_interval = absl::Seconds(1), .heartbeat_timeout = absl::Seconds(5)}, &clock_);
  EXPECT_THAT(restarted.incarnation(), ::testing::MatchesRegex("[0-9a-f]{8}"));
  // node-b comes back first and takes the first number.
  ASSERT_OK_AND_ASSIGN(const std::string new_b, restarted.Register(Worker("node-b", "10.0.0.2:7000")));
  EXPECT_EQ(new_b, absl::StrCat("w-", restarted.incarnation(), "-1"));
  EXPECT_NE(new_b, old_a);
  EXPECT_THAT(restarted.Heartbeat({.worker_id = old_a, .state = WorkerState::kReady}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("register again")));
  EXPECT_THAT(restarted.Heartbeat({.worker_id = old_b, .state = WorkerState::kIdle}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("register again")));
  EXPECT_THAT(restarted.Heartbeat({.worker_id = new_b, .state = WorkerState::kIdle}), IsOk());
  // Two registries made alike still differ (8 random hex digits each).
  WorkerRegistry another({}, &clock_);
  EXPECT_NE(another.incarnation(), restarted.incarnation());
}

// Workers that come and go (or a flood of bogus registrations) cannot grow the registry: dead
// records stay for dead_retention, then go.
TEST(RegistryRetentionTest, DeadWorkersAreForgottenAfterTheRetention) {
  FakeClock clock;
  WorkerRegistry registry({.heartbeat_interval = absl::Seconds(1), .heartbeat_timeout = absl::Seconds(5),
                           .dead_retention = absl::Minutes(1)},
                          &clock);
  for (int i = 0; i < 2000; ++i) {
    ASSERT_THAT(registry.Register(Worker(absl::StrCat("fake-", i), absl::StrCat("10.1.0.1:", i))), IsOk());
  }
  ASSERT_OK_AND_ASSIGN(const std::string live, registry.Register(Worker("node-a", "10.0.0.1:7000")));
  clock.Advance(absl::Seconds(4));
  ASSERT_THAT(registry.Heartbeat({.worker_id = live, .state = WorkerState::kIdle}), IsOk());
  clock.Advance(absl::Seconds(2));  // the fakes: silent 6 s > 5 s
  EXPECT_EQ(registry.SweepDead().size(), 2000u);
  EXPECT_EQ(registry.List().size(), 2001u);  // still listed: within the retention
  for (int s = 0; s < 60; s += 2) {  // the live worker keeps heartbeating
    clock.Advance(absl::Seconds(2));
    ASSERT_THAT(registry.Heartbeat({.worker_id = live, .state = WorkerState::kIdle}), IsOk());
  }
  const std::vector<WorkerRecord> left = registry.List();
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ(left[0].worker_id, live);
  EXPECT_EQ(registry.NumAlive(), 1);
}

TEST(RegistryOptionsTest, IncarnationIsLettersAndDigits) {
  EXPECT_THAT((WorkerRegistry::Options{.incarnation = "abc-1"}.Validate()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("incarnation")));
  EXPECT_THAT((WorkerRegistry::Options{.incarnation = std::string(17, 'a')}.Validate()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at most 16")));
  EXPECT_THAT((WorkerRegistry::Options{.incarnation = "Run7"}.Validate()), IsOk());
  EXPECT_THAT((WorkerRegistry::Options{.dead_retention = absl::ZeroDuration()}.Validate()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dead_retention")));
}

TEST_F(RegistryTest, RegisterRejectsBadRegistrations) {
  EXPECT_THAT(registry_.Register(Worker("", "x:1")), StatusIs(absl::StatusCode::kInvalidArgument, "node_name is empty"));
  EXPECT_THAT(registry_.Register(Worker("n", "")), StatusIs(absl::StatusCode::kInvalidArgument, "address is empty"));
  WorkerRegistration dup = Worker("n", "x:1");
  dup.devices[1].index = 0;
  EXPECT_THAT(registry_.Register(dup), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("duplicate device cpu:0")));
  WorkerRegistration over = Worker("n", "x:1");
  over.devices[0].free_bytes = 2000;
  EXPECT_THAT(registry_.Register(over), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("devices[0]")));
  EXPECT_THAT(registry_.List(), IsEmpty());
}

TEST_F(RegistryTest, HeartbeatsRecordStateAssignmentErrorAndSlots) {
  ASSERT_OK_AND_ASSIGN(std::string id, registry_.Register(Worker("n", "x:1")));
  const uint64_t v0 = registry_.version();
  ASSERT_THAT(registry_.Heartbeat({.worker_id = id, .state = WorkerState::kLoading, .assignment_id = "p1/r0s0"}),
              IsOk());
  EXPECT_GT(registry_.version(), v0);
  ASSERT_THAT(registry_.Heartbeat(
                  {.worker_id = id, .state = WorkerState::kReady, .assignment_id = "p1/r0s0", .kv_blocks = 6}),
              IsOk());
  std::optional<WorkerRecord> r = registry_.Get(id);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->state, WorkerState::kReady);
  EXPECT_EQ(r->assignment_id, "p1/r0s0");
  EXPECT_EQ(r->kv_blocks, 6);
  // The same heartbeat again changes nothing observable.
  const uint64_t v1 = registry_.version();
  ASSERT_THAT(registry_.Heartbeat(
                  {.worker_id = id, .state = WorkerState::kReady, .assignment_id = "p1/r0s0", .kv_blocks = 6}),
              IsOk());
  EXPECT_EQ(registry_.version(), v1);
  ASSERT_THAT(registry_.Heartbeat({.worker_id = id,
                                   .state = WorkerState::kFailed,
                                   .assignment_id = "p1/r0s0",
                                   .error = "model.safetensors: missing tensor lm_head.weight"}),
              IsOk());
  r = registry_.Get(id);
  EXPECT_EQ(r->state, WorkerState::kFailed);
  EXPECT_EQ(r->error, "model.safetensors: missing tensor lm_head.weight");
  EXPECT_EQ(r->kv_blocks, 0);
}

TEST_F(RegistryTest, HeartbeatFromAnUnknownWorkerIsNotFound) {
  EXPECT_THAT(registry_.Heartbeat({.worker_id = "w-9", .state = WorkerState::kIdle}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("register again")));
  ASSERT_OK_AND_ASSIGN(std::string id, registry_.Register(Worker("n", "x:1")));
  EXPECT_THAT(registry_.Heartbeat({.worker_id = id, .state = WorkerState::kDead}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dead")));
}

TEST_F(RegistryTest, SilentWorkerBecomesDeadAfterTheTimeout) {
  ASSERT_OK_AND_ASSIGN(std::string a, registry_.Register(Worker("a", "x:1")));
  ASSERT_OK_AND_ASSIGN(std::string b, registry_.Register(Worker("b", "x:2")));
  clock_.Advance(absl::Seconds(4));
  ASSERT_THAT(registry_.Heartbeat({.worker_id = b, .state = WorkerState::kIdle}), IsOk());
  clock_.Advance(absl::Seconds(1));  // a: exactly 5 s silent, not yet beyond the timeout
  EXPECT_THAT(registry_.SweepDead(), IsEmpty());
  clock_.Advance(absl::Milliseconds(1));
  const uint64_t v = registry_.version();
  EXPECT_THAT(registry_.SweepDead(), ElementsAre(a));
  EXPECT_GT(registry_.version(), v);
  EXPECT_THAT(registry_.SweepDead(), IsEmpty());  // reported once
  std::optional<WorkerRecord> dead = registry_.Get(a);
  EXPECT_EQ(dead->state, WorkerState::kDead);
  EXPECT_THAT(dead->error, HasSubstr("no heartbeat for 5.001s"));
  EXPECT_EQ(registry_.NumAlive(), 1);
  // A dead worker must register again.
  EXPECT_THAT(registry_.Heartbeat({.worker_id = a, .state = WorkerState::kIdle}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("declared dead")));
}

// A closed heartbeat stream is a death signal, but only the worker's current stream speaks for
// it: not an older stream it has left, nor one from before it registered again.
TEST_F(RegistryTest, AClosedStreamMarksItsWorkerDeadAtOnceOnlyWhileItIsTheWorkersCurrentStream) {
  WorkerRegistration reg = Worker("a", "x:1");
  reg.instance_id = "inst-a-0001";
  ASSERT_OK_AND_ASSIGN(const std::string id, registry_.Register(reg));
  EXPECT_FALSE(registry_.Disconnected(id, 7, "closed")) << "no heartbeat on stream 7 yet";
  ASSERT_THAT(registry_.Heartbeat({.worker_id = id, .state = WorkerState::kLoading, .assignment_id = "p/1", .stream = 7}),
              IsOk());
  ASSERT_THAT(registry_.Heartbeat({.worker_id = id, .state = WorkerState::kLoading, .assignment_id = "p/1", .stream = 8}),
              IsOk());
  EXPECT_FALSE(registry_.Disconnected(id, 7, "closed")) << "it moved to stream 8";
  // A unary heartbeat leaves its stream as it was.
  ASSERT_THAT(registry_.Heartbeat({.worker_id = id, .state = WorkerState::kLoading, .assignment_id = "p/1"}), IsOk());
  EXPECT_FALSE(registry_.Disconnected(id, 0, "closed"));
  EXPECT_FALSE(registry_.Disconnected("w-unknown", 8, "closed"));
  EXPECT_EQ(registry_.Get(id)->state, WorkerState::kLoading);
  const uint64_t v = registry_.version();
  EXPECT_TRUE(registry_.Disconnected(id, 8, "its heartbeat stream closed"));  // no time has passed
  EXPECT_GT(registry_.version(), v);
  std::optional<WorkerRecord> r = registry_.Get(id);
  EXPECT_EQ(r->state, WorkerState::kDead);
  EXPECT_EQ(r->error, "its heartbeat stream closed, last state loading");
  EXPECT_EQ(registry_.NumAlive(), 0);
  EXPECT_FALSE(registry_.Disconnected(id, 8, "closed")) << "already dead";
  EXPECT_THAT(registry_.Heartbeat({.worker_id = id, .state = WorkerState::kIdle, .stream = 8}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("register again")));
  // It registers again (same instance, same id): the stream it had before no longer counts.
  ASSERT_OK_AND_ASSIGN(const std::string again, registry_.Register(reg));
  ASSERT_EQ(again, id);
  EXPECT_FALSE(registry_.Disconnected(id, 8, "closed"));
  EXPECT_EQ(registry_.Get(id)->state, WorkerState::kIdle);
  ASSERT_THAT(registry_.Heartbeat({.worker_id = id, .state = WorkerState::kIdle, .stream = 9}), IsOk());
  EXPECT_TRUE(registry_.Disconnected(id, 9, "closed"));
}

TEST_F(RegistryTest, ReadsApplyTheTimeoutToo) {
  ASSERT_OK_AND_ASSIGN(std::string a, registry_.Register(Worker("a", "x:1")));
  clock_.Advance(absl::Seconds(6));
  EXPECT_EQ(registry_.Get(a)->state, WorkerState::kDead);
  EXPECT_EQ(registry_.NumAlive(), 0);
}

TEST_F(RegistryTest, ALateHeartbeatDeclaresItsOwnWorkerDeadAndLeavesTheOthersToTheSweep) {
  ASSERT_OK_AND_ASSIGN(std::string a, registry_.Register(Worker("a", "x:1")));
  ASSERT_OK_AND_ASSIGN(std::string b, registry_.Register(Worker("b", "x:2")));
  clock_.Advance(absl::Seconds(6));  // both silent beyond the timeout
  const uint64_t v = registry_.version();
  // a's late heartbeat: a is declared dead now (a change), and told to register again.
  EXPECT_THAT(registry_.Heartbeat({.worker_id = a, .state = WorkerState::kIdle}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("declared dead")));
  EXPECT_GT(registry_.version(), v);
  // b is not evaluated by a's heartbeat (O(1) per heartbeat, not a sweep of every worker): the
  // next sweep reports it.
  EXPECT_THAT(registry_.SweepDead(), ElementsAre(b));
}

TEST_F(RegistryTest, ReRegistrationReplacesTheOldRecord) {
  ASSERT_OK_AND_ASSIGN(std::string old_id, registry_.Register(Worker("a", "x:1")));
  ASSERT_OK_AND_ASSIGN(std::string other, registry_.Register(Worker("a", "x:2")));  // same node, other address
  clock_.Advance(absl::Seconds(10));
  ASSERT_EQ(registry_.Get(old_id)->state, WorkerState::kDead);
  ASSERT_OK_AND_ASSIGN(std::string new_id, registry_.Register(Worker("a", "x:1")));
  EXPECT_NE(new_id, old_id);
  EXPECT_FALSE(registry_.Get(old_id).has_value());
  EXPECT_THAT(registry_.Heartbeat({.worker_id = old_id, .state = WorkerState::kIdle}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("unknown worker_id")));
  const std::vector<WorkerRecord> all = registry_.List();
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].worker_id, other);
  EXPECT_EQ(all[1].worker_id, new_id);
  EXPECT_EQ(all[1].state, WorkerState::kIdle);
}

// ---- Identity: instance ids (registry.h) ---------------------------------------------------------

WorkerRegistration Instance(const std::string& node, const std::string& address, const std::string& instance) {
  WorkerRegistration r = Worker(node, address);
  r.instance_id = instance;
  return r;
}

WorkerAssignment Held(const std::string& id) {
  return WorkerAssignment{.assignment_id = id, .model_path = "/m", .layer_begin = 0, .layer_end = 2, .kv_blocks = 8};
}

// The finding: a process registering with a live worker's node name and address once a second
// kept the cluster unavailable. Now it is refused, and the live worker is never disturbed.
TEST_F(RegistryTest, AnImpostorOfALiveWorkerIsRefusedAndTheWorkerKeepsServing) {
  WorkerRegistration real = Instance("node-a", "10.0.0.1:7000", "aaaaaaaa00000001");
  real.state = WorkerState::kReady;
  real.held = Held("plan-1/r0/s0/w-aaaaaaaa00000001");
  real.kv_blocks = 8;
  ASSERT_OK_AND_ASSIGN(const std::string id, registry_.Register(real));
  EXPECT_EQ(id, "w-aaaaaaaa00000001");
  for (int second = 0; second < 20; ++second) {
    // Another instance, and one without any instance id, claim the same node and address.
    EXPECT_THAT(registry_.Register(Instance("node-a", "10.0.0.1:7000", "bbbbbbbb00000002")),
                StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("held by live worker w-aaaaaaaa00000001")));
    EXPECT_THAT(registry_.Register(Worker("node-a", "10.0.0.1:7000")),
                StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("10.0.0.1:7000")));
    // Or only the address, from another node name, with or without an instance id.
    EXPECT_THAT(registry_.Register(Instance("node-x", "10.0.0.1:7000", "cccccccc00000003")),
                StatusIs(absl::StatusCode::kAlreadyExists, ::testing::_));
    EXPECT_THAT(registry_.Register(Worker("node-x", "10.0.0.1:7000")),
                StatusIs(absl::StatusCode::kAlreadyExists, ::testing::_));
    clock_.Advance(absl::Seconds(1));
    ASSERT_THAT(registry_.Heartbeat({.worker_id = id, .state = WorkerState::kReady,
                                     .assignment_id = "plan-1/r0/s0/w-aaaaaaaa00000001", .kv_blocks = 8}),
                IsOk());
  }
  const std::vector<WorkerRecord> all = registry_.List();
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0].worker_id, id);
  EXPECT_EQ(all[0].state, WorkerState::kReady);
  EXPECT_EQ(all[0].kv_blocks, 8);
}

TEST_F(RegistryTest, AnInstanceClaimedAtAnotherAddressWhileLiveIsRefused) {
  ASSERT_THAT(registry_.Register(Instance("node-a", "10.0.0.1:7000", "aaaaaaaa00000001")), IsOk());
  EXPECT_THAT(registry_.Register(Instance("node-a", "10.0.0.9:7000", "aaaaaaaa00000001")),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("instance \"aaaaaaaa00000001\" is held")));
  EXPECT_EQ(registry_.Get("w-aaaaaaaa00000001")->registration.address, "10.0.0.1:7000");
}

// The same process registering again (its response was lost, or it was told "register again")
// keeps its id, its record and, while live, the state its heartbeats reported.
TEST_F(RegistryTest, TheSameInstanceRegisteringAgainKeepsItsIdAndRecord) {
  ASSERT_OK_AND_ASSIGN(const std::string id, registry_.Register(Instance("node-a", "10.0.0.1:7000", "aaaaaaaa00000001")));
  const absl::Time registered = clock_.Now();
  ASSERT_THAT(registry_.Heartbeat({.worker_id = id, .state = WorkerState::kReady, .assignment_id = "x", .kv_blocks = 4}),
              IsOk());
  clock_.Advance(absl::Seconds(2));
  ASSERT_OK_AND_ASSIGN(const std::string again, registry_.Register(Instance("node-a", "10.0.0.1:7000", "aaaaaaaa00000001")));
  EXPECT_EQ(again, id);
  const WorkerRecord r = *registry_.Get(id);
  EXPECT_EQ(r.state, WorkerState::kReady);
  EXPECT_EQ(r.assignment_id, "x");
  EXPECT_EQ(r.registered_at, registered);
  EXPECT_EQ(r.last_heartbeat, clock_.Now());
  EXPECT_EQ(registry_.List().size(), 1u);
  // Declared dead, it comes back under the same id, in the state it reports.
  clock_.Advance(absl::Seconds(6));
  ASSERT_EQ(registry_.Get(id)->state, WorkerState::kDead);
  WorkerRegistration back = Instance("node-a", "10.0.0.1:7000", "aaaaaaaa00000001");
  back.state = WorkerState::kReady;
  back.held = Held("y");
  back.kv_blocks = 8;
  ASSERT_THAT(registry_.Register(back), IsOk());
  EXPECT_EQ(registry_.Get(id)->state, WorkerState::kReady);
  EXPECT_EQ(registry_.Get(id)->assignment_id, "y");
  EXPECT_EQ(registry_.Get(id)->kv_blocks, 8);
  EXPECT_THAT(registry_.Get(id)->error, IsEmpty());
}

// A worker restarted for real (a new process, a new instance id) at the same address is refused
// while its previous instance still counts as live, and accepted, under its own id, once that one
// has been silent for the heartbeat timeout; the old record goes.
TEST_F(RegistryTest, ARealRestartIsAcceptedOnceTheOldInstanceIsDead) {
  ASSERT_OK_AND_ASSIGN(const std::string old_id, registry_.Register(Instance("node-a", "10.0.0.1:7000", "aaaaaaaa00000001")));
  clock_.Advance(absl::Seconds(3));  // it crashed; the new process starts
  EXPECT_THAT(registry_.Register(Instance("node-a", "10.0.0.1:7000", "dddddddd00000004")),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("once the old one has been silent for 5s")));
  clock_.Advance(absl::Seconds(2) + absl::Milliseconds(1));
  ASSERT_OK_AND_ASSIGN(const std::string new_id, registry_.Register(Instance("node-a", "10.0.0.1:7000", "dddddddd00000004")));
  EXPECT_EQ(new_id, "w-dddddddd00000004");
  EXPECT_FALSE(registry_.Get(old_id).has_value());
  EXPECT_THAT(registry_.Heartbeat({.worker_id = old_id, .state = WorkerState::kIdle}),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_EQ(registry_.NumAlive(), 1);
}

// The id comes from the instance, not from the registry or the order of registration: a restarted
// coordinator (a new registry) gives every worker the id it had, whatever order they come back in,
// and takes the assignment and state they report.
TEST_F(RegistryTest, IdentitySurvivesACoordinatorRestartWhateverTheOrder) {
  ASSERT_OK_AND_ASSIGN(const std::string a, registry_.Register(Instance("node-a", "10.0.0.1:7000", "aaaaaaaa00000001")));
  ASSERT_OK_AND_ASSIGN(const std::string b, registry_.Register(Instance("node-b", "10.0.0.2:7000", "bbbbbbbb00000002")));
  WorkerRegistry restarted({.heartbeat_interval = absl::Seconds(1), .heartbeat_timeout = absl::Seconds(5)}, &clock_);
  WorkerRegistration rb = Instance("node-b", "10.0.0.2:7000", "bbbbbbbb00000002");
  rb.state = WorkerState::kReady;
  rb.held = Held("plan-t-1/r0/s1/w-bbbbbbbb00000002");
  rb.kv_blocks = 8;
  ASSERT_OK_AND_ASSIGN(const std::string b2, restarted.Register(rb));
  ASSERT_OK_AND_ASSIGN(const std::string a2, restarted.Register(Instance("node-a", "10.0.0.1:7000", "aaaaaaaa00000001")));
  EXPECT_EQ(a2, a);
  EXPECT_EQ(b2, b);
  const WorkerRecord rec = *restarted.Get(b2);
  EXPECT_EQ(rec.state, WorkerState::kReady);
  EXPECT_EQ(rec.assignment_id, "plan-t-1/r0/s1/w-bbbbbbbb00000002");
  EXPECT_EQ(rec.kv_blocks, 8);
  ASSERT_TRUE(rec.registration.held.has_value());
  EXPECT_EQ(rec.registration.held->layer_end, 2);
}

TEST_F(RegistryTest, RegisterRejectsBadIdentitiesAndHoldings) {
  EXPECT_THAT(registry_.Register(Instance("n", "x:1", "short")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("instance_id")));
  EXPECT_THAT(registry_.Register(Instance("n", "x:1", "bad id with spaces")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("instance_id")));
  WorkerRegistration ready = Instance("n", "x:1", "aaaaaaaa00000001");
  ready.state = WorkerState::kReady;
  EXPECT_THAT(registry_.Register(ready), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("held")));
  WorkerRegistration idle = Instance("n", "x:1", "aaaaaaaa00000001");
  idle.held = Held("z");
  EXPECT_THAT(registry_.Register(idle), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("holds no assignment")));
  WorkerRegistration dead = Instance("n", "x:1", "aaaaaaaa00000001");
  dead.state = WorkerState::kDead;
  EXPECT_THAT(registry_.Register(dead), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dead")));
  WorkerRegistration no_id = Instance("n", "x:1", "aaaaaaaa00000001");
  no_id.state = WorkerState::kLoading;
  no_id.held = Held("");
  EXPECT_THAT(registry_.Register(no_id), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("assignment_id")));
  EXPECT_THAT(registry_.List(), IsEmpty());
}

TEST_F(RegistryTest, WaitForChangeWakesOnRegistration) {
  const uint64_t v = registry_.version();
  EXPECT_FALSE(registry_.WaitForChange(v, absl::ZeroDuration()));
  std::thread t([this] { ASSERT_THAT(registry_.Register(Worker("a", "x:1")), IsOk()); });
  EXPECT_TRUE(registry_.WaitForChange(v, absl::Seconds(60)));
  t.join();
}

TEST(RegistryOptionsTest, Validate) {
  EXPECT_THAT((WorkerRegistry::Options{.heartbeat_interval = absl::ZeroDuration()}.Validate()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("heartbeat_interval")));
  EXPECT_THAT((WorkerRegistry::Options{.heartbeat_interval = absl::Seconds(2), .heartbeat_timeout = absl::Seconds(2)}
                   .Validate()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("heartbeat_timeout")));
  EXPECT_THAT(WorkerRegistry::Options{}.Validate(), IsOk());
}

}  // namespace
}  // namespace shardserve::coordinator

// WorkerRegistry: the coordinator's view of its workers — who registered, with which devices, in
// which state (as their heartbeats report it), and whether they are still alive.
//
// Life of a worker, as the Registry service (proto/shardserve/v1/control.proto) describes it:
//   Register      -> a worker_id, in the state the worker reports (kIdle unless it says it holds
//                    an assignment). Identity, for a registration with an instance_id (what this
//                    project's workers send: random, made once per worker process):
//                     - its worker_id is "w-" + instance_id, so it is the same in every
//                       coordinator run and the planner (which orders workers by id) sees the
//                       same inventory order whatever order the workers register in;
//                     - the same instance registering again (it lost its id: a coordinator
//                       restart, or it was declared dead) keeps its id and record;
//                     - a different instance (or one without an instance_id) that claims the
//                       address of a live worker (heartbeating within heartbeat_timeout) is
//                       refused with AlreadyExists, and both claimants are logged: nobody can
//                       evict a healthy worker by registering in its name. A worker restarted for
//                       real (a new instance) is accepted once the old one is dead; until then it
//                       retries (its Registrar does, forever);
//                     - a dead record at the same address (the previous instance) is dropped.
//                    Without an instance_id (older workers) a new worker_id "w-<incarnation>-N" is
//                    made, and a record with the same (node_name, address) is dropped unless it is
//                    a live worker with an instance_id.
//   Heartbeat     -> records the state the worker reports (kIdle / kLoading / kReady / kFailed with
//                    its error), the assignment_id that state refers to and, when ready, kv_blocks.
//   stream closed -> a worker heartbeating on a stream (WorkerHeartbeat::stream) whose stream
//                    closes (it stopped or died: Disconnected) is kDead at once, unless it has
//                    heartbeated on a newer stream or registered again since.
//   no heartbeat  -> after Options::heartbeat_timeout without a Register or Heartbeat, the worker
//                    is kDead. A dead worker stays listed (operators see it in the cluster status)
//                    until it registers again; its heartbeats get NotFound ("register again").
//
// Liveness is evaluated against the injected Clock whenever the registry is read or swept, so a
// test with a FakeClock controls it completely.
//
// Plain C++ structs only: the Registry service converts protobuf at the edge.
// Thread-safety: every method is thread-safe.
#ifndef SHARDSERVE_COORDINATOR_REGISTRY_REGISTRY_H_
#define SHARDSERVE_COORDINATOR_REGISTRY_REGISTRY_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/concurrency/clock.h"
#include "common/plan/assignment.h"
#include "common/plan/plan.h"

namespace shardserve::coordinator {

// Mirrors shardserve.v1.WorkerState (without UNSPECIFIED).
enum class WorkerState : uint8_t {
  kIdle,     // registered, no assignment
  kLoading,  // loading its assignment
  kReady,    // serving its assignment
  kFailed,   // its assignment failed; WorkerRecord::error says why
  kDead,     // (coordinator view) heartbeats stopped
};

// "idle", "loading", "ready", "failed", "dead".
absl::string_view WorkerStateName(WorkerState state);

// What a worker announces when it registers.
struct WorkerRegistration {
  std::string node_name;        // required
  std::string address;          // required: host:port of its Stage and Worker services
  std::string metrics_address;  // optional
  std::vector<Device> devices;  // may be empty (the planner then cannot use it)
  // The worker process's identity (8 to 64 letters, digits, '-' or '_'); empty: none (see above).
  std::string instance_id;
  // What it holds when it registers, so that a new coordinator can adopt it (cluster.h
  // "Adoption"): its state (not kDead), the assignment that state refers to (required with
  // kLoading, kReady and kFailed; absent with kIdle), the error with kFailed and, with kReady, the
  // KV cache blocks it allocated. `held` stays as registered; later heartbeats update the record's
  // state and assignment_id, so `held` describes what the worker holds only while
  // WorkerRecord::assignment_id equals held->assignment_id.
  WorkerState state = WorkerState::kIdle;
  std::optional<WorkerAssignment> held;
  std::string error;
  int64_t kv_blocks = 0;
  // Where the call came from (the gRPC peer), for the log of a refused claim; informational.
  std::string peer;
};

// One heartbeat. `state` must not be kDead (only the coordinator decides that).
struct WorkerHeartbeat {
  std::string worker_id;
  WorkerState state = WorkerState::kIdle;
  std::string assignment_id;  // the assignment the state refers to ("" = none)
  std::string error;          // with kFailed
  int64_t kv_blocks = 0;      // with kReady: KV cache blocks the stage holds
  // The heartbeat stream it came on: a number the Registry service gives each stream (> 0), so
  // that Disconnected can tell the worker's current stream from an older one; 0 for a unary call
  // (which leaves the worker's stream as it was).
  uint64_t stream = 0;
};

// A snapshot of one worker.
struct WorkerRecord {
  std::string worker_id;
  WorkerRegistration registration;
  WorkerState state = WorkerState::kIdle;
  std::string assignment_id;
  std::string error;  // the worker's error with kFailed; why it was declared dead with kDead
  int64_t kv_blocks = 0;
  absl::Time registered_at;
  absl::Time last_heartbeat;  // the last Register or Heartbeat
};

class WorkerRegistry {
 public:
  struct Options {
    // What workers are told to use (RegisterResponse.heartbeat_interval_ms). > 0.
    absl::Duration heartbeat_interval = absl::Seconds(1);
    // Silence after which a worker is dead. Must exceed heartbeat_interval.
    absl::Duration heartbeat_timeout = absl::Seconds(5);
    // How long a dead worker's record stays (for status and errors that name it) before it is
    // forgotten, so that workers that come and go cannot grow the registry without bound. A
    // forgotten worker's stage still goes back to it when it registers again (same node and
    // address). > 0.
    absl::Duration dead_retention = absl::Minutes(10);
    // Part of every worker id this registry hands out, so that an id from an earlier coordinator
    // run is unknown here (a worker still heartbeating under it is told to register again) instead
    // of naming another worker that registered since. Letters and digits, at most 16. Empty: 8
    // random hex digits, chosen when the registry is made.
    std::string incarnation;
    // InvalidArgument naming the field when the values above are out of range.
    absl::Status Validate() const;
  };

  // `options` must be valid (checked: a programmer error otherwise). `clock` is borrowed and must
  // outlive the registry.
  WorkerRegistry(const Options& options, const Clock* clock);

  WorkerRegistry(const WorkerRegistry&) = delete;
  WorkerRegistry& operator=(const WorkerRegistry&) = delete;

  const Options& options() const { return options_; }
  // options().incarnation, or the one chosen when it was empty.
  const std::string& incarnation() const { return incarnation_; }

  // Adds (or, for the same instance, refreshes) a worker and returns its id: "w-<instance_id>", or
  // without an instance_id "w-<incarnation>-1", "w-<incarnation>-2", ... in registration order
  // (never reused, and never one an earlier registry handed out). The identity rules are at the
  // top of this file. AlreadyExists (logged with both claimants) when the registration claims the
  // address of a live worker of another instance, or the instance of a live worker at another
  // address. InvalidArgument naming the field: empty node_name or address, a malformed
  // instance_id, two devices with the same (kind, index), negative bytes or free_bytes above
  // total_bytes, state kDead, a held assignment missing (or present with kIdle) or without an id.
  absl::StatusOr<std::string> Register(WorkerRegistration registration);

  // Records a heartbeat. NotFound (with "register again") when the worker_id is unknown, was
  // replaced by a newer registration, or was declared dead (or is silent for longer than
  // heartbeat_timeout: it is declared dead now); InvalidArgument for state kDead. O(log N): only
  // this worker's liveness is evaluated; the others' on the next read or sweep.
  absl::Status Heartbeat(const WorkerHeartbeat& heartbeat);

  // Worker `worker_id`'s heartbeat stream `stream` closed (its process stopped, or its connection
  // broke): marks it kDead now, with `reason` as its error, and returns true — unless it is
  // unknown or already dead, or its latest heartbeat came on another stream (or a unary call after
  // a registration: a newer stream may be on its way), which this leaves alone (false).
  bool Disconnected(const std::string& worker_id, uint64_t stream, absl::string_view reason);

  // Marks every worker silent for longer than heartbeat_timeout as kDead, and forgets those dead
  // for longer than dead_retention. Returns the ids that became dead in this call. Reading
  // methods below apply the same rules first.
  std::vector<std::string> SweepDead();

  // All known workers (dead ones within dead_retention included), in registration order.
  std::vector<WorkerRecord> List();
  // One worker; nullopt when unknown.
  std::optional<WorkerRecord> Get(absl::string_view worker_id);
  // Registered workers that are not dead.
  int NumAlive();

  // A counter that increases whenever anything observable changes (register, heartbeat that
  // changes state / assignment / error / kv_blocks, a worker declared dead).
  uint64_t version() const;
  // Blocks until version() != `seen` or `timeout` (real time) passes. Returns whether it changed.
  bool WaitForChange(uint64_t seen, absl::Duration timeout) const;

 private:
  struct Entry {
    WorkerRecord record;
    uint64_t order = 0;  // registration order
    // The stream of its latest streamed heartbeat since it registered (0: none).
    uint64_t stream = 0;
  };
  // Marks silent workers dead; returns their ids.
  std::vector<std::string> SweepLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks `r` (worker `id`) dead when it has been silent for longer than heartbeat_timeout at
  // `now`; returns whether it did. The caller bumps version_.
  bool ExpireLocked(const std::string& id, WorkerRecord& r, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // AlreadyExists when a live record other than `id` has `reg`'s address, or when record `id` is
  // live at another address; logs the refusal with both claimants. Expires silent records first.
  absl::Status CheckClaimLocked(const std::string& id, const WorkerRegistration& reg, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the dead records other than `id` at `address` (earlier instances of a restarted worker).
  void DropDeadAtLocked(const std::string& id, const std::string& address) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after construction.
  const Options options_;
  const std::string incarnation_;
  const Clock* const clock_;  // not owned

  mutable absl::Mutex mu_;
  std::map<std::string, Entry> workers_ ABSL_GUARDED_BY(mu_);  // by worker_id
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t version_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_REGISTRY_REGISTRY_H_

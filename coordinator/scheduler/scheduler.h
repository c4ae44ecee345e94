// Scheduler: admits generation requests, routes each to a data-parallel replica, and runs every
// replica's step loop — continuous batching with chunked prefill across the network, the same
// policy as the single-process engine (worker/engine/generator.h), so that a request gets exactly
// the tokens `shardserve-run` gives it (greedy or seeded sampling: the last stage samples with the
// request's SamplingOptions and sample_index = the token's index in the sequence's output).
//
// ---- Per replica -------------------------------------------------------------------------------
// Each replica has max_slots KV slots (indices [0, max_slots), the same slot on every stage), a
// FIFO of waiting sequences and the running ones. Its step loop (one thread per replica) repeats:
//   1. end the running sequences cancelled since the last step and free their slots;
//   2. admit waiting sequences, in order, while slots are free;
//   3. build a micro-batch under max_step_tokens: first every decoding sequence (one token each,
//      least recently stepped first), then prefill chunks of the others in admission order, each
//      as long as the budget left allows; a chunk that reaches the end of its prompt, and every
//      decode, asks for a sampled token;
//   4. run it (ReplicaClient::Step, outside the lock);
//   5. append the sampled tokens, stream them to the sinks, and end the sequences that hit a stop
//      condition, freeing their slots: a stop id (the request's stop_token_ids, plus the model's
//      EOS ids unless ignore_eos) -> kStop; max_tokens generated or the context (max_seq_len)
//      full -> kLength. A failed step fails the sequences that were in it with its status.
// Pipelining: a replica runs pipeline_depth step loops (threads) over the same state, so up to
// that many micro-batches are in flight at once, each of different sequences (a sequence stays
// "in flight" from the build of its micro-batch until its tokens have been delivered, which also
// keeps each sequence's sink calls in order). A micro-batch takes at most
// ceil(running / pipeline_depth) sequences, so the running set splits into groups that take turns
// through the stages.
//
// ---- Admission and routing ----------------------------------------------------------------------
// Submit validates the request (ValidateSequenceRequest), picks the least-loaded replica (fewest
// (running + waiting) / max_slots; ties: lowest replica id) and queues the sequence there. At
// most max_queued sequences wait for a slot over all replicas; beyond that Submit fails.
//
// ---- Ownership and threads ----------------------------------------------------------------------
// The scheduler owns its ReplicaClients and one thread per replica. Sinks are shared with the
// caller (the public API's stream reactors) and released after their OnEnd. Sink calls are made
// with no scheduler lock held (see SequenceSink).
//
// Thread-safety: all public methods are thread-safe.
#ifndef SHARDSERVE_COORDINATOR_SCHEDULER_SCHEDULER_H_
#define SHARDSERVE_COORDINATOR_SCHEDULER_SCHEDULER_H_

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/concurrency/clock.h"
#include "coordinator/scheduler/replica_client.h"
#include "coordinator/scheduler/scheduler_observer.h"
#include "coordinator/scheduler/sequence.h"

namespace shardserve::coordinator {

struct SchedulerOptions {
  RequestLimits limits;               // vocab_size >= 1, max_seq_len >= 2
  int64_t max_step_tokens = 256;      // tokens per micro-batch over all sequences, >= 1
  int64_t max_queued = 1024;          // sequences waiting for a slot over all replicas, >= 0
  std::vector<int32_t> eos_token_ids;  // the model's EOS ids (stop unless ignore_eos)
  SchedulerObserver* observer = nullptr;  // borrowed, may be null; must outlive the scheduler
  const Clock* clock = nullptr;           // borrowed; null = RealClock
  // InvalidArgument naming the field when a value is out of range.
  absl::Status Validate() const;
};

struct ReplicaOptions {
  int32_t max_slots = 8;  // sequences the replica holds at once (its stages' KV slots), >= 1
  // Micro-batches in flight at once, >= 1: with P pipeline stages, P lets every stage work on a
  // different micro-batch; 1 = one at a time.
  int32_t pipeline_depth = 1;
};

using SequenceId = uint64_t;

struct ReplicaStats {
  int replica = 0;
  int32_t max_slots = 0;
  int64_t running = 0;  // holding a slot
  int64_t waiting = 0;  // queued for a slot
  uint64_t steps = 0;   // micro-batches run so far
};

struct SchedulerStats {
  int64_t running = 0;
  int64_t waiting = 0;
  std::vector<ReplicaStats> replicas;  // by replica id
};

class Scheduler {
 public:
  // `options` must be valid (checked: a programmer error otherwise).
  explicit Scheduler(SchedulerOptions options);
  // Shutdown(Unavailable("shutting down")) when not shut down yet.
  ~Scheduler();

  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Starts serving on a replica: takes ownership of `client` and starts its step loops.
  // AlreadyExists for a replica id in use; InvalidArgument for max_slots < 1, pipeline_depth < 1
  // or a null client;
  // FailedPrecondition after Shutdown.
  absl::Status AddReplica(int replica, std::unique_ptr<ReplicaClient> client, const ReplicaOptions& options);

  // Stops serving on a replica (its worker failed or died): interrupts its step in flight
  // (ReplicaClient::Shutdown), waits for its loop to stop, fails its running sequences with
  // `reason` (which must not be OK) and moves its waiting ones to the other replicas (or fails them
  // with `reason` when none is left). Returns once done; a no-op for an unknown replica or one
  // already being removed. Must not be called from a sink.
  void RemoveReplica(int replica, const absl::Status& reason);

  // Ids of the replicas serving now, ascending.
  std::vector<int> Replicas() const;

  // Queues a request; `sink` (non-null) then receives its output. Errors (the sink is then never
  // called): InvalidArgument from ValidateSequenceRequest; Unavailable when no replica is serving
  // or after Shutdown (with its reason); ResourceExhausted when max_queued sequences are already
  // waiting (the message gives the limit). Refusals are reported to the observer.
  absl::StatusOr<SequenceId> Submit(SequenceRequest request, std::shared_ptr<SequenceSink> sink);

  // Ends a sequence with FinishReason::kCancelled: at once when it is waiting (the sink's OnEnd
  // runs on the calling thread), otherwise at the end of its step in flight or before the next
  // one (on its replica's thread), freeing its slot; no tokens are delivered after the cancel is
  // seen. A no-op for a finished or unknown id. Must not be called with a lock the sink takes.
  void Cancel(SequenceId id);

  // Stops everything: no more requests; every waiting and running sequence fails with `reason`
  // (not OK; the API uses Unavailable "shutting down"); step loops stop (steps in flight are
  // interrupted) and are joined. Idempotent. Must not be called from a sink.
  void Shutdown(const absl::Status& reason);

  SchedulerStats Stats() const;
  const SchedulerOptions& options() const { return options_; }

 private:
  struct Sequence;
  struct Replica;
  struct Event;  // a sink call to make after unlocking
  struct Batch;  // a micro-batch being run

  absl::StatusOr<SequenceId> SubmitImpl(SequenceRequest request, std::shared_ptr<SequenceSink> sink);
  void ReplicaLoop(Replica* replica);
  bool HasWorkLocked(const Replica& r) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks the batch's sequences that are still running as no longer in flight.
  void ReleaseLocked(const Batch& batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EndCancelledLocked(Replica& r, std::vector<Event>& events) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AdmitLocked(Replica& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // At most `max_sequences` sequences.
  Batch BuildBatchLocked(Replica& r, size_t max_sequences) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ApplyLocked(Replica& r, const Batch& batch, const absl::StatusOr<StepOutput>& out, absl::Duration took,
                   std::vector<Event>& events) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes `seq` (running or waiting) and queues its OnEnd.
  void EndLocked(Sequence& seq, SequenceEnd end, std::vector<Event>& events) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The least-loaded replica that is not stopping; nullptr when none.
  Replica* PickReplicaLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static void Deliver(std::vector<Event>& events);

  // Constant after construction.
  const SchedulerOptions options_;
  const Clock* const clock_;

  mutable absl::Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status shutdown_reason_ ABSL_GUARDED_BY(mu_);
  SequenceId next_id_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t num_waiting_ ABSL_GUARDED_BY(mu_) = 0;  // over all replicas
  // Every live sequence (waiting or running). A sequence is erased exactly when its OnEnd is queued.
  absl::flat_hash_map<SequenceId, std::unique_ptr<Sequence>> sequences_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::unique_ptr<Replica>> replicas_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_SCHEDULER_SCHEDULER_H_

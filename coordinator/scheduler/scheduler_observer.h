// SchedulerObserver: what the scheduler reports about requests and micro-batches, for the
// coordinator's metrics (coordinator/server/coordinator_metrics.h). Every front end (gRPC, HTTP)
// submits through the scheduler, so requests are counted once, whatever protocol they came by.
//
// Calls are made from the thread calling Submit / Cancel / RemoveReplica / Shutdown or from a
// replica's step loop, WITH the scheduler's lock held: an implementation must be quick (counter
// and histogram updates), must not block, and must not call back into the Scheduler.
#ifndef SHARDSERVE_COORDINATOR_SCHEDULER_SCHEDULER_OBSERVER_H_
#define SHARDSERVE_COORDINATOR_SCHEDULER_SCHEDULER_OBSERVER_H_

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "coordinator/scheduler/sequence.h"

namespace shardserve::coordinator {

// One accepted request, when it ends (once per request).
struct RequestReport {
  int replica = 0;     // the replica it ended on; -1 when it ended parked (scheduler.h, Recovery)
  SequenceEnd end;     // status (OK or the error that failed it), finish reason, token counts
  absl::Duration queue_time;  // Submit -> first admission to a replica's batch (its whole wait
                              // when it never got in)
  absl::Duration e2e_time;    // Submit -> end
  // Submit -> first generated token; nullopt when none was generated.
  std::optional<absl::Duration> time_to_first_token;
};

// One micro-batch, when its answer has been applied.
struct StepReport {
  int replica = 0;
  int32_t sequences = 0;       // sequences in the micro-batch
  int64_t prefill_tokens = 0;  // prompt (or recompute) tokens
  int64_t decode_tokens = 0;   // one per decoding sequence
  absl::Duration duration;     // ReplicaClient::Step round trip
  absl::Status status;         // the step's result
};

class SchedulerObserver {
 public:
  virtual ~SchedulerObserver() = default;
  // Submit refused the request (InvalidArgument, ResourceExhausted, Unavailable); `status` is
  // what the caller got.
  virtual void OnRejected(const absl::Status& status) = 0;
  // The gap between two consecutive tokens of one sequence (inter-token latency), once per token
  // after the first.
  virtual void OnInterTokenLatency(absl::Duration gap) = 0;
  virtual void OnRequestEnd(const RequestReport& report) = 0;
  virtual void OnStep(const StepReport& report) = 0;
  // A running sequence gave its KV blocks back to make room (it is recomputed later).
  virtual void OnPreempted(int replica) = 0;
  // A sequence left `from_replica` (its pipeline broke, or it was removed) for another replica,
  // where it is recomputed.
  virtual void OnFailover(int from_replica) = 0;
  // A sequence was admitted on a replica with prefix caching on: `cached_tokens` of the
  // `context_tokens` it needs in the KV cache were found cached and are not computed again.
  // Re-admissions after a preemption count too.
  virtual void OnPrefixCacheLookup(int replica, int64_t context_tokens, int64_t cached_tokens) = 0;
};

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_SCHEDULER_SCHEDULER_OBSERVER_H_

// Request logs: one structured line (common/log/fields.h) when a request is submitted, one when
// the scheduler refuses it or when it ends, keyed by its request id. The scheduler puts the same id
// on every StepSequence it sends to the workers, and their logs name it too (request_ids=a,b on a
// step's line), so
//   grep -w req-42 coordinator.log worker-*.log
// follows one request through the coordinator and every stage:
//   event=request_start request_id=req-42 prompt_tokens=12 max_tokens=64
//       [resumed_tokens=17: a resume (GenerateRequest.resume) with that many tokens received]
//   event=request_end request_id=req-42 status=OK finish_reason=stop prompt_tokens=12
//       cached_prompt_tokens=0 completion_tokens=40 ttft_ms=35.2 e2e_ms=812.0
//   event=request_rejected request_id=req-43 status=RESOURCE_EXHAUSTED error="..."
// Every front end (gRPC, HTTP) submits through SubmitWithLog instead of Scheduler::Submit, and
// reports the requests it refuses itself (malformed, cluster not ready) with ReportRejected.
#ifndef SHARDSERVE_COORDINATOR_FRONTEND_REQUEST_LOG_H_
#define SHARDSERVE_COORDINATOR_FRONTEND_REQUEST_LOG_H_

#include <memory>

#include "absl/status/statusor.h"
#include "common/concurrency/clock.h"
#include "coordinator/scheduler/scheduler.h"
#include "coordinator/scheduler/scheduler_observer.h"
#include "coordinator/scheduler/sequence.h"

namespace shardserve::coordinator::frontend {

// Scheduler::Submit(request, sink) with the log lines above: `sink` is wrapped so that its OnEnd
// is logged (with the time to the first token and the whole time, measured on `clock` from this
// call) before it is passed on; OnTokens and OnEnd reach `sink` unchanged. Returns what Submit
// returns. `clock` is borrowed (null = RealClock) and must outlive the request. Thread-safe.
absl::StatusOr<SequenceId> SubmitWithLog(Scheduler& scheduler, SequenceRequest request,
                                         std::shared_ptr<SequenceSink> sink, const Clock* clock = nullptr);

// A request the front end refused before it reached the scheduler (`status`, not OK, is what the
// client gets): logs event=request_rejected and tells `observer` (borrowed; may be null), so that
// the metrics count it with the scheduler's own refusals. Thread-safe.
void ReportRejected(SchedulerObserver* observer, const absl::Status& status);

}  // namespace shardserve::coordinator::frontend

#endif  // SHARDSERVE_COORDINATOR_FRONTEND_REQUEST_LOG_H_

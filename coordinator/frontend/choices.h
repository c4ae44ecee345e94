// ChoiceGroup: the n choices of one request (OpenAI's `n`, GenerateRequest.n) as n sequences of
// the scheduler, shared by the gRPC service and the HTTP API.
//
// Choice 0 is submitted at once; the others when choice 0's prompt is in the KV cache (its first
// token, or its end), so that they find the prompt's full blocks in the prefix cache and compute
// only its last, partial block and their own tokens, instead of n prefills of the whole prompt.
// They start one step later than choice 0. Choice i samples with seed + i (so choice 0 is the
// request alone, and every choice is reproducible); only choice 0 reports prompt logprobs.
#ifndef SHARDSERVE_COORDINATOR_FRONTEND_CHOICES_H_
#define SHARDSERVE_COORDINATOR_FRONTEND_CHOICES_H_

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/frontend/sequence_output.h"
#include "coordinator/scheduler/scheduler.h"

namespace shardserve::coordinator::frontend {

inline constexpr int kMaxChoices = 16;

class ChoiceGroup : public std::enable_shared_from_this<ChoiceGroup> {
 public:
  // Submits (through SubmitWithLog) one choice per sink (1 <= sinks.size() <= kMaxChoices). What
  // the first Submit returns when it fails (nothing is submitted then); a later choice that cannot
  // be submitted gets OnEnd with its error. Each sink then gets its choice's calls as a
  // SequenceSink does. `scheduler` must outlive the group's sequences.
  static absl::StatusOr<std::shared_ptr<ChoiceGroup>> Submit(Scheduler& scheduler, SequenceRequest request,
                                                             std::vector<std::shared_ptr<SequenceSink>> sinks);

  // Ends choice `choice` with `reason` (Scheduler::Cancel), now or as soon as it is submitted. Must
  // not be called with a lock its sink takes (the sink's OnEnd may run on this thread).
  void Cancel(size_t choice, FinishReason reason = FinishReason::kCancelled);
  // Every choice, as cancelled: those not submitted yet never will be.
  void CancelAll();

  size_t size() const { return cancellers_.size(); }

 private:
  class FirstChoiceSink;
  // `rest`: the sinks of choices 1..n-1 (the group never holds choice 0's: a front end holds the
  // group, and the group must not hold the front end's sinks once they are submitted).
  ChoiceGroup(Scheduler& scheduler, size_t n, SequenceRequest request, std::vector<std::shared_ptr<SequenceSink>> rest);
  // Choice 0's prompt is in the cache: submits the others (once).
  void SubmitRest();

  Scheduler& scheduler_;
  std::vector<std::unique_ptr<SequenceCanceller>> cancellers_;  // one per choice
  absl::Mutex mu_;
  SequenceRequest request_ ABSL_GUARDED_BY(mu_);  // the template of choices 1..n-1
  std::vector<std::shared_ptr<SequenceSink>> rest_ ABSL_GUARDED_BY(mu_);  // choices 1.., until submitted
  bool rest_done_ ABSL_GUARDED_BY(mu_) = false;    // submitted, or given up
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;    // CancelAll was called
};

// Cancels or stops the choices of one ChoiceGroup from any thread, whether the call comes before
// the group is known (Submit has not returned yet, while its first tokens already arrive) or after.
// Thread-safe. Like ChoiceGroup::Cancel, never call it with a lock the sinks take.
class ChoiceCanceller {
 public:
  // The submitted group; applies what was asked before.
  void Bind(std::shared_ptr<ChoiceGroup> group);
  // Every choice, as cancelled (the client went away).
  void CancelAll();
  // One choice, as stopped (a stop string matched in its text).
  void Stop(size_t choice);

 private:
  absl::Mutex mu_;
  std::shared_ptr<ChoiceGroup> group_ ABSL_GUARDED_BY(mu_);
  bool cancel_all_ ABSL_GUARDED_BY(mu_) = false;  // asked before Bind
  std::vector<size_t> stops_ ABSL_GUARDED_BY(mu_);  // asked before Bind
};

}  // namespace shardserve::coordinator::frontend

#endif  // SHARDSERVE_COORDINATOR_FRONTEND_CHOICES_H_

// What the front ends (the gRPC Inference service and the HTTP API) share around one submitted
// sequence: turning its tokens into the text a client may see (SequenceText), and cancelling it
// from any thread, whether the cancel comes before or after Submit returned its id
// (SequenceCanceller).
#ifndef SHARDSERVE_COORDINATOR_FRONTEND_SEQUENCE_OUTPUT_H_
#define SHARDSERVE_COORDINATOR_FRONTEND_SEQUENCE_OUTPUT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/tokenizer/tokenizer.h"
#include "coordinator/frontend/stop_strings.h"
#include "coordinator/scheduler/scheduler.h"

namespace shardserve::coordinator::frontend {

// One sequence's text: token ids through the model's StreamDecoder (whole UTF-8 characters), then
// through the request's StopStringMatcher (nothing after a stop string is ever returned, nor the
// stop string itself unless `include_stop`).
// Not thread-safe: its owner serialises the calls.
class SequenceText {
 public:
  // `decoder` may be null (the model has no tokenizer): no text, and no stop string can match.
  SequenceText(std::unique_ptr<StreamDecoder> decoder, std::vector<std::string> stops, bool include_stop = false);

  // Appends to `*out` the text that became final with token `id` (a token without text, e.g. one
  // outside the vocabulary, adds nothing and is logged at VLOG 1). True once a stop string has
  // matched: the text ends right before it, nothing is added after, and the caller should end the
  // sequence.
  bool Add(int32_t id, std::string* out);
  // The sequence ended by itself (length or EOS): appends the text still held back by the decoder
  // and the matcher. True when a stop string matched in it (the text then ends before it).
  bool Finish(std::string* out);

  bool stopped() const { return matcher_.stopped(); }
  bool has_text() const { return decoder_ != nullptr; }
  // The decoder in its state after the tokens added so far (null without a tokenizer): for
  // spelling the next token and its alternatives where they stand (StreamDecoder::Clone).
  const StreamDecoder* decoder() const { return decoder_.get(); }

 private:
  std::unique_ptr<StreamDecoder> decoder_;
  StopStringMatcher matcher_;
};

// A decoder of the text that continues `prompt` (StreamDecoder::Prime: a first word keeps its
// space), skipping special tokens unless `skip_special_tokens` is false (then "</s>" and the like
// are spelled out, as vLLM's skip_special_tokens=false does); null without a tokenizer. A prompt
// id outside the vocabulary (which admission refuses first) is logged at VLOG 1 and the ids before
// it stay fed. Choices of one prompt clone it (StreamDecoder::Clone) rather than decode the prompt
// again.
std::unique_ptr<StreamDecoder> ContinuationDecoder(const Tokenizer* tokenizer, absl::Span<const int32_t> prompt,
                                                   bool skip_special_tokens = true);

// Cancels one sequence from any thread. Thread-safe.
class SequenceCanceller {
 public:
  // `scheduler` must outlive this.
  explicit SequenceCanceller(Scheduler* scheduler) : scheduler_(scheduler) {}

  // The id Submit returned; cancels the sequence at once when Cancel came first.
  void Bind(SequenceId id);
  // Cancels the sequence now, or at Bind, ending it with `reason` (Scheduler::Cancel). Must not be
  // called with a lock that the sequence's sink takes: the scheduler may call the sink's OnEnd on
  // this thread.
  void Cancel(FinishReason reason = FinishReason::kCancelled);

 private:
  Scheduler* const scheduler_;
  absl::Mutex mu_;
  std::optional<SequenceId> id_ ABSL_GUARDED_BY(mu_);
  bool cancel_requested_ ABSL_GUARDED_BY(mu_) = false;
  FinishReason reason_ ABSL_GUARDED_BY(mu_) = FinishReason::kCancelled;
};

}  // namespace shardserve::coordinator::frontend

#endif  // SHARDSERVE_COORDINATOR_FRONTEND_SEQUENCE_OUTPUT_H_

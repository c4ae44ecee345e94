// What the scheduler is asked to generate (SequenceRequest), how it reports back (SequenceSink),
// and the request checks shared by the public API and the scheduler (ValidateSequenceRequest).
// Plain structs: the front ends' admission step (coordinator/frontend/admission.h) builds these
// from a request of either API.
#ifndef SHARDSERVE_COORDINATOR_SCHEDULER_SEQUENCE_H_
#define SHARDSERVE_COORDINATOR_SCHEDULER_SEQUENCE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "coordinator/scheduler/replica_client.h"
#include "coordinator/scheduler/token_constraint.h"

namespace shardserve::coordinator {

inline constexpr size_t kMaxLogitBias = 1024;
inline constexpr int32_t kMaxTopLogprobs = 20;
// SequenceRequest::bad_words: at most this many token sequences, each of 1..kMaxBadWordTokens ids.
inline constexpr size_t kMaxBadWordSequences = 512;
inline constexpr size_t kMaxBadWordTokens = 64;

struct SequenceRequest {
  std::string request_id;              // for logs and replies; may be empty
  std::vector<int32_t> prompt;         // token ids, used exactly as given
  int32_t max_tokens = 0;              // >= 1; prompt + max_tokens <= max_seq_len
  SamplingOptions sampling;            // top_p already mapped from 0 (unset) to 1
  std::vector<int32_t> stop_token_ids;  // end generation after emitting one of these...
  bool ignore_eos = false;              // ...and after the model's EOS ids unless this is set
  // Until this many tokens are generated, stop_token_ids (and the EOS ids unless ignore_eos)
  // cannot be sampled. In [0, max_tokens].
  int32_t min_tokens = 0;
  bool logprobs = false;      // report each generated token's logprobs (SequenceSink::OnTokens)
  int32_t top_logprobs = 0;   // and this many of the most likely tokens', in [0, 20]
  // Report the logprob of every prompt token after the first under the model (and the
  // top_logprobs most likely tokens' at each position) through SequenceSink::OnPromptLogprobs
  // (OpenAI's echo with logprobs). Such a sequence does not use the prefix cache for the prompt
  // positions still owed.
  bool prompt_logprobs = false;
  // Structured output (null = none): every sampled token is one the constraint allows in the
  // sequence's state (token_constraint.h); the EOS ids are allowed exactly where the output is
  // complete, and the sequence ends (kStop) when one is sampled, even with ignore_eos. While the
  // constraint is set, min_tokens does not suppress the EOS ids (the constraint decides), unless
  // it does not decide them (TokenConstraint::DecidesEos: allowed_token_ids).
  std::shared_ptr<const TokenConstraint> constraint;
  // Resume (shardserve.v1.GenerateRequest.resume): tokens this request generated in an earlier
  // attempt, already delivered to the client then. The sequence starts as if it had generated them
  // (context = prompt + resumed; they count against max_tokens and min_tokens, feed the penalty
  // history and advance the constraint; the next token is sampled with sample_index =
  // resumed.size()), and they are never delivered again. At most max_tokens of them; see
  // ReplayResumed.
  std::vector<int32_t> resumed;
  // Scheduling rank under SchedulingPolicy::kPriority (scheduler.h "Priorities"): lower is served
  // first. Must be 0 under kFcfs.
  int32_t priority = 0;
  // vLLM's bad_words, as token sequences (the front end tokenizes each word, with and without a
  // leading space; next_token.h): the output never ends with one of them. While it ends with all
  // but the last token of one, that last token cannot be sampled; a one-token word's token never
  // is. A step where these bans would leave no token to sample (beside min_tokens and the
  // constraint) is sampled without them. Only the generated tokens count, not the prompt.
  std::vector<std::vector<int32_t>> bad_words;
};

// Mirrors shardserve.v1.FinishReason.
enum class FinishReason : uint8_t {
  kLength,     // max_tokens generated, or the context is full
  kStop,       // an EOS id or a stop id was generated (it is part of the output)
  kCancelled,  // Scheduler::Cancel (the client went away)
};

absl::string_view FinishReasonName(FinishReason reason);

// How a sequence ended.
struct SequenceEnd {
  // OK: the sequence finished with `reason`. Otherwise the error that failed it (Unavailable
  // "shutting down" or a lost replica, or the error of the step that failed it); `reason` is then
  // meaningless.
  absl::Status status;
  FinishReason reason = FinishReason::kLength;
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;  // tokens delivered through OnTokens
  int32_t cached_prompt_tokens = 0;  // prompt tokens found in the prefix cache when first admitted
};

// Receives one sequence's output. For every request the scheduler accepts, it calls OnTokens zero
// or more times, then OnEnd exactly once, and nothing after that; calls for one sequence never
// overlap. Calls come from the replica's step-loop thread, or from the thread calling Cancel,
// RemoveReplica or Shutdown (never from Submit), with no scheduler lock held: an implementation
// must not block (hand the data to its own queue), and may call Scheduler::Cancel.
class SequenceSink {
 public:
  virtual ~SequenceSink() = default;
  // New tokens, in order, since the previous call (non-empty); `logprobs` is empty unless the
  // request asked for them, then one entry per token.
  virtual void OnTokens(absl::Span<const int32_t> tokens, absl::Span<const TokenLogprobs> logprobs) = 0;
  // With SequenceRequest::prompt_logprobs: the logprobs of prompt tokens 1, 2, ... in order, in
  // one or more calls (one per prefill chunk) that all come before the first OnTokens; each prompt
  // token's entry exactly once, even when the sequence is recomputed.
  // The default drops them: a sink that wraps another must pass them on.
  virtual void OnPromptLogprobs(absl::Span<const TokenLogprobs> /*logprobs*/) {}
  virtual void OnEnd(const SequenceEnd& end) = 0;
};

// What a request is checked against.
struct RequestLimits {
  int64_t vocab_size = 0;
  int64_t max_seq_len = 0;  // prompt + generated tokens of one sequence
};

// How an API spells the request fields ValidateSequenceRequest names. The defaults are
// shardserve.v1.GenerateRequest's; the OpenAI-compatible HTTP API has its own
// (coordinator/frontend/admission.h), so that each client is told of a field by its own name.
struct RequestFieldNames {
  absl::string_view prompt = "prompt";
  absl::string_view prompt_ids = "prompt.token_ids";  // an index follows: "prompt.token_ids[3]"
  absl::string_view max_tokens = "max_tokens";
  absl::string_view temperature = "sampling.temperature";
  absl::string_view top_k = "sampling.top_k";
  absl::string_view top_p = "sampling.top_p";
  absl::string_view min_p = "sampling.min_p";
  absl::string_view logit_bias = "sampling.logit_bias";
  absl::string_view repetition_penalty = "sampling.repetition_penalty";
  absl::string_view frequency_penalty = "sampling.frequency_penalty";
  absl::string_view presence_penalty = "sampling.presence_penalty";
  absl::string_view stop_token_ids = "stop_token_ids";  // an index follows
  absl::string_view min_tokens = "min_tokens";
  absl::string_view top_logprobs = "top_logprobs";
  absl::string_view bad_words = "bad_words";
};

// An InvalidArgument error about request field `field` (as the caller's API spells it): `message`,
// with `field` attached to the status, where RequestFieldOf finds it (the HTTP API reports it as
// the error's "param"). An empty `field` attaches nothing.
absl::Status InvalidRequestField(absl::string_view field, absl::string_view message);
// `status` with `field` attached (nothing when `field` is empty).
absl::Status WithRequestField(absl::Status status, absl::string_view field);
// The field attached by InvalidRequestField or WithRequestField, or "".
std::string RequestFieldOf(const absl::Status& status);

// InvalidArgument naming the request field (spelled as `names` says, the field attached as
// RequestFieldOf finds it) when: the prompt is empty; a prompt id is outside [0, vocab_size)
// ("prompt.token_ids[3] = 999 is outside ..."); the prompt has max_seq_len tokens or more;
// max_tokens < 1; prompt + max_tokens exceeds max_seq_len; sampling.temperature is negative or
// not finite; sampling.top_k < 0; sampling.top_p is outside (0, 1]; sampling.min_p is outside
// [0, 1]; repetition_penalty outside (0, 2] or frequency_penalty / presence_penalty outside
// [-2, 2]; a logit_bias id is outside the vocabulary or its bias outside [-100, 100] (or more than
// 1024 entries); a stop_token_ids entry is outside the vocabulary; min_tokens is outside [0,
// max_tokens]; top_logprobs is outside [0, 20]; bad_words has more than kMaxBadWordSequences
// sequences, one empty or longer than kMaxBadWordTokens, or an id outside the vocabulary. Pure.
absl::Status ValidateSequenceRequest(const SequenceRequest& request, const RequestLimits& limits,
                                     const RequestFieldNames& names = RequestFieldNames());

// Whether sampling `token` ends `request` by itself: one of its stop_token_ids, or one of the
// model's `eos_token_ids` unless ignore_eos. (A completed constraint ends it too; the caller knows
// the constraint's state.)
bool IsStopToken(const SequenceRequest& request, absl::Span<const int32_t> eos_token_ids, int32_t token);

// Where a request's resumed tokens (SequenceRequest::resumed) leave it.
struct ResumedState {
  int32_t constraint_state = 0;  // with a constraint: its state after the resumed tokens
  // Set when the resumed tokens already end the request, as the uninterrupted run would have
  // ended it: kStop (the last one is a stop id, an EOS id without ignore_eos, or completes the
  // constraint), else kLength (max_tokens of them, or the context is full).
  std::optional<FinishReason> ended;
};

// Replays `request.resumed` as the scheduler would have generated them. InvalidArgument naming
// resume.token_ids[i] when token i is outside [0, vocab_size), when there are more than
// max_tokens, when a token before the last would have ended the request (a stop id, an EOS id of
// `eos_token_ids` without ignore_eos, or a token completing the constraint), or when a token
// could not have been sampled where it comes (NextTokenRulesOf: min_tokens' suppression, a bad
// word's ban, the constraint's mask). Pure (the constraint's caches aside).
absl::StatusOr<ResumedState> ReplayResumed(const SequenceRequest& request, absl::Span<const int32_t> eos_token_ids,
                                           const RequestLimits& limits);

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_SCHEDULER_SEQUENCE_H_

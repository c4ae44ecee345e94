// ReplicaClient: how the scheduler runs one micro-batch on one data-parallel replica (a whole
// pipeline of stages), without knowing about gRPC. The production implementation
// (coordinator/client/grpc_replica_client.h) sends a StepRequest over the Stage.StepStream of the
// replica's stage-0 worker; tests run the engine in-process (tests/testing/engine_replica.h).
//
// The plain structs below mirror shardserve.v1.StepRequest / StepResponse (stage.proto) for the
// first stage, which takes token ids (no hidden states on this edge).
#ifndef SHARDSERVE_COORDINATOR_SCHEDULER_REPLICA_CLIENT_H_
#define SHARDSERVE_COORDINATOR_SCHEDULER_REPLICA_CLIENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace shardserve::coordinator {

// How the last stage picks a token (shardserve.v1.SamplingParams, already validated: temperature
// >= 0 and finite, top_k >= 0, top_p in (0, 1] with 0 already read as 1, min_p in [0, 1], logit
// bias ids in the vocabulary and values in [-100, 100]).
struct SamplingOptions {
  float temperature = 0.0f;  // 0 = greedy
  int32_t top_k = 0;         // 0 = no limit
  float top_p = 1.0f;
  uint64_t seed = 0;
  float min_p = 0.0f;                                   // 0 = off
  std::vector<std::pair<int32_t, float>> logit_bias;    // (token id, bias), sorted by id
  // As vLLM: repetition in (0, 2] (1 = off), frequency and presence in [-2, 2] (0 = off).
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  float repetition_penalty = 1.0f;
  bool HasPenalties() const {
    return presence_penalty != 0.0f || frequency_penalty != 0.0f || repetition_penalty != 1.0f;
  }
};

// shardserve.v1.TokenLogprobs: one generated token's logprob and the most likely tokens'.
struct TokenLogprobs {
  float logprob = 0.0f;
  std::vector<int32_t> top_ids;
  std::vector<float> top_logprobs;
};

// One sequence's part of a micro-batch.
struct StepSequenceInput {
  // The sequence's KV cache blocks, in order (block j holds positions [j * kv_block_size,
  // (j + 1) * kv_block_size)); the same ids on every stage of the replica. Covers at least
  // pos_begin + token_ids.size() positions.
  std::vector<int32_t> block_ids;
  int32_t pos_begin = 0;           // position of the first new token (tokens already cached)
  std::vector<int32_t> token_ids;  // the new tokens: a prefill chunk, or the one token to decode
  bool sample = false;             // sample a token after this chunk (end of prompt, or decode)
  SamplingOptions sampling;        // with sample
  uint64_t sample_index = 0;       // with sample: index of the token in the sequence's output
  std::string request_id;          // for logs only
  // The scheduler's id of the sequence, stable for its life (0 = none): its key in step deltas
  // (common/rpc/step_delta.h), so that a step sends only what changed since its last one.
  uint64_t sequence_id = 0;
  std::vector<int32_t> suppress_token_ids;  // with sample: cannot be chosen this step (min_tokens)
  bool logprobs = false;                    // with sample: return the token's logprobs
  int32_t top_logprobs = 0;                 // and this many of the most likely tokens' (<= 20)
  // With sample and a penalty: the sequence's TokenHistory (common/sampling/token_history.h):
  // distinct ids ascending, and the times each was generated (0: prompt only).
  std::vector<int32_t> penalty_token_ids;
  std::vector<int32_t> penalty_token_counts;
  // Prompt logprobs: empty, or one per token_ids entry: the prompt token after it whose logprob
  // the replica returns in StepOutput::prompt_logprobs (-1: none).
  std::vector<int32_t> prompt_logprob_targets;
  // With sample, structured output: the tokens allowed this step (packed bits over the vocabulary,
  // see shardserve.v1.StepSequence.allowed_token_mask); null = no constraint. Shared with the
  // constraint's cache: never modified.
  std::shared_ptr<const std::string> allowed_token_mask;
  // Overlapped decode calls (StepInput::remember_samples): the one new token is the last the
  // replica sampled for this sequence in the call it ran just before this one (token_ids empty;
  // shardserve.v1.StepSequence.from_previous). A replica that did not sample it there fails the
  // call with Unavailable.
  bool from_previous = false;
  // The new tokens: token_ids.size(), or 1 with from_previous.
  int64_t NumTokens() const { return from_previous ? 1 : static_cast<int64_t>(token_ids.size()); }
};

struct StepInput {
  uint64_t step_id = 0;  // unique per replica; increasing
  std::vector<StepSequenceInput> sequences;
  // Multi-step decoding (shardserve.v1.StepRequest.decode_steps): k > 1 decode steps in one call,
  // for a batch of one-token decodes that all sample plainly, on a 1-stage replica (the scheduler
  // only asks when that holds); block_ids then cover pos_begin + k positions.
  int32_t decode_steps = 1;
  // Overlapped decode calls: the replica remembers the last token it samples for each sequence
  // (by sequence_id), for the from_previous sequences of the call after this one
  // (shardserve.v1.StepSequence.sample_key). Only asked of a 1-stage replica.
  bool remember_samples = false;
};

struct StepOutput {
  // One token per sequence with sample = true, in input order; with decode_steps = k > 1, k per
  // sequence (sequence by sequence, in the order sampled).
  std::vector<int32_t> token_ids;
  // Empty when no sequence asked for logprobs; else one entry per token_ids entry (empty entries
  // for the sequences that did not ask).
  std::vector<TokenLogprobs> logprobs;
  // One entry per prompt_logprob_targets entry >= 0, over the sequences in input order.
  std::vector<TokenLogprobs> prompt_logprobs;
  // The replica's compute for the call (shardserve.v1.StepResponse.compute_us: its last stage's,
  // over all decode_steps), without transit and conversions; zero = not reported. The scheduler
  // tells the serving overhead from it (decode_steps.h).
  absl::Duration compute_time = absl::ZeroDuration();
};

// Contract for implementations:
//  - Step() runs one micro-batch on every stage of the replica and returns the sampled tokens. It
//    blocks the calling thread until the answer arrives, a bounded step timeout passes, or
//    Shutdown() is called: never indefinitely.
//  - Errors fail the micro-batch only; the scheduler fails the sequences that were in it with the
//    status (the stage's own gRPC code and message when a stage reported the failure;
//    Unavailable when the replica cannot be reached or does not answer within the step timeout).
//    Nothing is assumed about the KV contents of those sequences' blocks afterwards. A later Step
//    may succeed (e.g. after the implementation reconnects).
//  - StepOutput::token_ids must have exactly one entry (decode_steps entries) per sequence with
//    sample = true; the scheduler fails the batch with Internal otherwise.
//  - StepOverlapping() is Step() that also runs the caller's `while_waiting` on the calling thread
//    exactly once (also when the step fails), without any lock of the client held: an
//    implementation that sends the micro-batch and then waits for its answer runs it in between,
//    so that the caller's work (the scheduler delivers the previous step's tokens) overlaps the
//    step instead of waking another thread for it. The default runs it first, then Step().
//  - Thread-safety: Step() may be called by several threads at once (pipelined micro-batches of
//    different sequences; at most ReplicaOptions::pipeline_depth, or two overlapped decode calls),
//    and must then run them in the order they are called on each stage; Shutdown() may be called
//    from any thread, at any time, more than once.
//  - Overlapped decode calls (StepInput::remember_samples, StepSequenceInput::from_previous) are
//    only sent to an implementation whose OverlapsDecodeCalls() is true. It runs a call's
//    `while_waiting` (StepOverlapping) only once the call is in its place in the replica's order
//    (sent), so that the caller may let the next call go then, and it gives from_previous
//    sequences the token it sampled for them in the call before.
class ReplicaClient {
 public:
  virtual ~ReplicaClient() = default;

  virtual absl::StatusOr<StepOutput> Step(const StepInput& input) = 0;

  virtual absl::StatusOr<StepOutput> StepOverlapping(const StepInput& input, absl::FunctionRef<void()> while_waiting) {
    while_waiting();
    return Step(input);
  }

  // Whether this implementation takes overlapped decode calls (the contract above).
  virtual bool OverlapsDecodeCalls() const { return false; }

  // Makes a Step in progress return promptly (Unavailable) and every later Step fail at once.
  virtual void Shutdown() = 0;
};

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_SCHEDULER_REPLICA_CLIENT_H_

// Token sampling from one row of logits: greedy, temperature, top-k, top-p, min-p, logit bias and
// suppressed tokens, seeded; and the log-probabilities a request may ask for.
//
// Sampling is reproducible and independent of batching: the random number for a sequence's n-th
// sampled token depends only on (seed, n), so a request gets the same tokens alone or in any batch,
// on any layout.
#ifndef SHARDSERVE_WORKER_ENGINE_SAMPLING_H_
#define SHARDSERVE_WORKER_ENGINE_SAMPLING_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "worker/kernels/shared/sampling_host.h"

namespace shardserve::engine {

struct SamplingParams {
  float temperature = 0.0f;  // 0 = greedy (argmax, lowest id on ties)
  int32_t top_k = 0;         // 0 = no limit
  float top_p = 1.0f;        // in (0, 1]
  uint64_t seed = 0;
  // After temperature, top_k and top_p: candidates less likely than min_p times the most likely
  // one are dropped (0 = off), as vLLM's min_p.
  float min_p = 0.0f;
  // Added to the logits before anything else, as OpenAI's logit_bias: (token id, bias). Ids outside
  // the row are ignored (callers validate them against the vocabulary).
  std::vector<std::pair<int32_t, float>> logit_bias;
  // Tokens that cannot be chosen at this step (their logits count as -inf): the EOS and stop ids
  // while a request has fewer than its min_tokens. Ids outside the row are ignored.
  std::vector<int32_t> suppress_ids;
  // Penalties as vLLM defines them, applied after logit_bias and suppress_ids, in this order:
  // repetition (a token of the prompt or the output: a positive logit divided by it, a negative
  // one multiplied), frequency (minus it times the token's count in the output), presence (minus
  // it once for a token of the output). 1, 0, 0 = off.
  float repetition_penalty = 1.0f;  // (0, 2]
  float frequency_penalty = 0.0f;   // [-2, 2]
  float presence_penalty = 0.0f;    // [-2, 2]
  // The sequence's tokens for the penalties: distinct ids in ascending order, and for each the
  // number of times it was generated (0: it is in the prompt only). Prompt-only ids matter to the
  // repetition penalty alone, so callers may leave them out when it is 1. Ids outside the row are
  // ignored.
  std::vector<int32_t> history_ids;
  std::vector<int32_t> history_counts;
  bool HasPenalties() const {
    return repetition_penalty != 1.0f || frequency_penalty != 0.0f || presence_penalty != 0.0f;
  }
  // Structured output: when non-empty, the only tokens that may be chosen, as packed bits (token t
  // is allowed when (mask[t / 8] >> (t % 8)) & 1; ids past the end are not). The others count as
  // -inf, after logit_bias, suppress_ids and the penalties, before temperature and filtering.
  // Logprobs stay those of the raw logits. A mask that allows nothing leaves the row as it was
  // (the coordinator never sends one).
  std::string allowed_token_mask;
  // Whether sampling reads only the raw logits and temperature, top_k, top_p, min_p and the seed:
  // nothing biased, suppressed, penalized or masked. A device that samples rows (the backend op
  // SampleRows) can then draw the id alone.
  bool IsPlain() const {
    return logit_bias.empty() && suppress_ids.empty() && !HasPenalties() && allowed_token_mask.empty();
  }
  // Whether sampling is the argmax of the raw logits (temperature 0 or top_k 1, and IsPlain()),
  // which the device can do alone.
  bool IsGreedy() const { return (temperature == 0.0f || top_k == 1) && IsPlain(); }
  // InvalidArgument naming the field: temperature < 0 or not finite, top_k < 0, top_p outside
  // (0, 1], min_p outside [0, 1], a logit_bias value not finite or outside [-100, 100], a negative id,
  // a penalty outside its range, history_ids not ascending or not as many as history_counts, a
  // negative count.
  absl::Status Validate() const;
};

// The log-probabilities of one sampled token under the model (log-softmax of the raw logits, in
// double, before temperature, bias or filtering, as vLLM reports them by default).
struct TokenLogprobs {
  float logprob = 0.0f;               // of the chosen token
  std::vector<int32_t> top_ids;       // the top_n most likely tokens, most likely first (ties: lower id)
  std::vector<float> top_logprobs;    // their logprobs
};
inline constexpr int32_t kMaxTopLogprobs = 20;
// `chosen` in [0, logits.size()), top_n in [0, kMaxTopLogprobs] (clamped).
TokenLogprobs ComputeLogprobs(absl::Span<const float> logits, int32_t chosen, int32_t top_n);

// `logits` with params' logit_bias, suppress_ids and penalties applied, as Sampler::Sample sees
// them. Exposed for tests.
std::vector<float> AdjustedLogits(absl::Span<const float> logits, const SamplingParams& params);

// Thread-compatible: one Sampler per thread (it keeps scratch space). The arithmetic after the
// adjustments (temperature, top-k, top-p, min-p, the draw) is kernels/shared/sampling_math.h's,
// which the backends' SampleRows op runs too, so a plain row (SamplingParams::IsPlain) gets the
// same id from Sample as from SampleRows on the CPU backend (and from the CUDA one but for rows
// whose candidates' weights tie within rounding).
class Sampler {
 public:
  // `logits` must be non-empty. `step` is the index of the token being sampled in its sequence's
  // output (0 for the first generated token).
  int32_t Sample(absl::Span<const float> logits, const SamplingParams& params, uint64_t step);

 private:
  kernels::HostRowSampler row_sampler_;
  std::vector<float> adjusted_;  // the row with logit_bias, suppress_ids, penalties and the mask applied
};

// The uniform number in [0, 1) used for (seed, step). Exposed for tests.
double SamplingUniform(uint64_t seed, uint64_t step);

}  // namespace shardserve::engine

#endif  // SHARDSERVE_WORKER_ENGINE_SAMPLING_H_

// TokenHistory: the tokens a sequence's presence, frequency and repetition penalties look at, in
// the form the sampler takes them (engine::SamplingParams::history_ids / history_counts, and
// shardserve.v1.StepSequence.penalty_token_ids / penalty_token_counts): distinct token ids in
// ascending order, each with the number of times it was generated (0: in the prompt only).
//
// Kept up to date one token at a time by whoever owns the sequence (the coordinator's scheduler,
// the one-process generator), so building a step costs a copy of the distinct ids, not a pass over
// the whole context.
#ifndef SHARDSERVE_COMMON_SAMPLING_TOKEN_HISTORY_H_
#define SHARDSERVE_COMMON_SAMPLING_TOKEN_HISTORY_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace shardserve {

class TokenHistory {
 public:
  TokenHistory() = default;
  // `with_prompt`: the prompt's ids are kept (with count 0); only the repetition penalty reads
  // them, so a request without one leaves them out and sends less.
  TokenHistory(absl::Span<const int32_t> prompt, bool with_prompt);

  // One more generated token.
  void AddGenerated(int32_t id);

  const std::vector<int32_t>& ids() const { return ids_; }
  const std::vector<int32_t>& counts() const { return counts_; }

 private:
  std::vector<int32_t> ids_;
  std::vector<int32_t> counts_;
};

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_SAMPLING_TOKEN_HISTORY_H_

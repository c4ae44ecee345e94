// What a request's own rules forbid its next sampled token, beside the model: the stop and EOS ids
// while fewer than min_tokens are generated, the tokens that would complete one of its bad words,
// and the structured-output constraint's mask. The scheduler sends these with each step that
// samples the sequence (StepSequenceInput::suppress_token_ids, allowed_token_mask), and a resume's
// tokens are replayed against the same rules (ReplayResumed), so that a resumed stream holds only
// what the unbroken one could have generated.
#ifndef SHARDSERVE_COORDINATOR_SCHEDULER_NEXT_TOKEN_H_
#define SHARDSERVE_COORDINATOR_SCHEDULER_NEXT_TOKEN_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "coordinator/scheduler/sequence.h"

namespace shardserve::coordinator {

// Appends to `*out` the ids that `bad_words` forbid after `output` (a sequence's generated tokens):
// the last token of every word whose other tokens end `output` (a one-token word's always). Ids
// may repeat. Empty words are skipped.
void AppendBadWordBans(absl::Span<const std::vector<int32_t>> bad_words, absl::Span<const int32_t> output,
                       std::vector<int32_t>* out);

struct NextTokenRules {
  std::vector<int32_t> suppress;  // cannot be chosen: ascending, distinct
  std::shared_ptr<const std::string> mask;  // with a constraint: the only tokens that may be chosen
  // Whether `token` may be chosen under these rules.
  bool Allows(int32_t token) const;
};

// The rules for the token of `request` after `output` (the tokens generated so far), with its
// constraint (if any) in `constraint_state`:
//   * fewer than min_tokens generated: its stop_token_ids, and the EOS ids unless ignore_eos or a
//     constraint that decides them (TokenConstraint::DecidesEos);
//   * the bad words' bans (AppendBadWordBans), unless they would leave no token of
//     [0, vocab_size) that the rest allows: a step is then sampled without them (a request can
//     always go on);
//   * the constraint's mask in its state.
NextTokenRules NextTokenRulesOf(const SequenceRequest& request, absl::Span<const int32_t> eos_token_ids,
                                int64_t vocab_size, absl::Span<const int32_t> output, int32_t constraint_state);

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_SCHEDULER_NEXT_TOKEN_H_

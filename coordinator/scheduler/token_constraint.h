// TokenConstraint: what the scheduler needs from a structured-output constraint (a JSON Schema, any
// JSON object, a regular expression) compiled over the model's vocabulary. The scheduler keeps one
// matcher state per constrained sequence, asks for the allowed-token mask of that state whenever the
// sequence samples, and advances the state with each sampled token. The implementation
// (coordinator/structured/) compiles the constraint; the scheduler knows only this interface.
//
// States are small integers; State 0 is not special. Masks are packed bits over the vocabulary:
// token id t is allowed when (mask[t / 8] >> (t % 8)) & 1 (ids past the mask's end are not).
//
// Thread-safety: implementations are immutable after construction as far as callers can tell
// (internal caches are locked): every method may be called from several threads at once.
#ifndef SHARDSERVE_COORDINATOR_SCHEDULER_TOKEN_CONSTRAINT_H_
#define SHARDSERVE_COORDINATOR_SCHEDULER_TOKEN_CONSTRAINT_H_

#include <cstdint>
#include <memory>
#include <string>

namespace shardserve::coordinator {

class TokenConstraint {
 public:
  virtual ~TokenConstraint() = default;

  // The state before any token is generated.
  virtual int32_t StartState() const = 0;

  // The tokens that may be sampled in `state` (a state returned by StartState or Advance): those
  // whose bytes keep the text a prefix of a match, plus the EOS ids exactly when the text so far is
  // a complete match. The mask is cached per state; the pointer stays valid as long as the
  // constraint lives. Never empty of allowed tokens for a state that Advance returned.
  virtual std::shared_ptr<const std::string> AllowedMask(int32_t state) const = 0;

  // The state after `token` in `state`, or -1 when the token is not allowed there. An EOS id
  // allowed in `state` leads to a state that IsFinished.
  virtual int32_t Advance(int32_t state, int32_t token) const = 0;

  // Whether generation must end in `state` (an EOS was taken).
  virtual bool IsFinished(int32_t state) const = 0;

  // Whether the constraint decides where the EOS ids may come, as structured output does (exactly
  // where the text is complete; sampling one then ends the sequence even with ignore_eos, and
  // min_tokens does not suppress them). False for one that only restricts the tokens
  // (allowed_token_ids): the EOS ids it allows stop the sequence as usual and min_tokens
  // suppresses them, as without a constraint.
  virtual bool DecidesEos() const { return true; }
};

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_SCHEDULER_TOKEN_CONSTRAINT_H_

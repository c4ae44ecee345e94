// vLLM's allowed_token_ids as a TokenConstraint: every sampled token is one of a fixed set of ids.
// Unlike structured output it has a single state and does not decide where the EOS ids may come:
// an EOS id in the set stops the sequence as usual (not with ignore_eos), min_tokens suppresses it
// as usual, and one that is not in the set is never sampled.
#ifndef SHARDSERVE_COORDINATOR_FRONTEND_ALLOWED_TOKENS_H_
#define SHARDSERVE_COORDINATOR_FRONTEND_ALLOWED_TOKENS_H_

#include <cstdint>
#include <memory>

#include "absl/types/span.h"
#include "coordinator/scheduler/token_constraint.h"

namespace shardserve::coordinator::frontend {

// Most ids one request may list (vLLM takes any number; this bounds the work per request).
inline constexpr size_t kMaxAllowedTokenIds = 1 << 20;

// The constraint allowing exactly `ids` (non-empty, each in [0, vocab_size); duplicates are
// harmless): checked by the caller, which names its field.
std::shared_ptr<const TokenConstraint> AllowedTokens(absl::Span<const int32_t> ids, int64_t vocab_size);

}  // namespace shardserve::coordinator::frontend

#endif  // SHARDSERVE_COORDINATOR_FRONTEND_ALLOWED_TOKENS_H_

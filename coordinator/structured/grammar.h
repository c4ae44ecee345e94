// Structured output: constraints (any JSON object, a JSON Schema, a regular expression) compiled
// over a model's vocabulary into TokenConstraints that the scheduler applies as allowed-token masks
// (coordinator/scheduler/token_constraint.h).
//
// How it works: the constraint becomes a regex (json_schema.h), the regex a byte-level DFA
// (byte_dfa.h). The vocabulary is a trie of the tokens' bytes, shared by every constraint. The
// allowed tokens of a DFA state are found by walking the trie and the DFA together (a subtree is cut
// as soon as the DFA has no transition), once per state: the packed mask is then cached, so a
// sequence's per-token cost is a cache lookup plus walking the sampled token's bytes. EOS is allowed
// exactly in accepting states.
//
// Thread-safety: ConstraintCompiler and the constraints it returns may be used from any number of
// threads at once (their caches are locked).
#ifndef SHARDSERVE_COORDINATOR_STRUCTURED_GRAMMAR_H_
#define SHARDSERVE_COORDINATOR_STRUCTURED_GRAMMAR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/tokenizer/tokenizer.h"
#include "coordinator/scheduler/token_constraint.h"
#include "coordinator/structured/byte_dfa.h"
#include "coordinator/structured/json_schema.h"

namespace shardserve::structured {

// The bytes each token id adds to the text in the middle of a sequence.
struct TokenVocabulary {
  // [mask size]: ids whose entry is empty are never allowed by a constraint (special and control
  // tokens, ids the tokenizer lacks, tokens whose decoding does not equal their bytes).
  std::vector<std::string> bytes;
  std::vector<int32_t> eos_ids;  // allowed exactly where the constraint is complete
};

// Derives the vocabulary from `tokenizer`: SentencePiece-style pieces ("▁" is a space, "<0xNN>" a
// byte) or GPT-2 byte-level pieces ("Ġ" is a space), told apart by the vocabulary itself; each
// derived spelling is checked against Tokenizer::Decode (tokens that disagree are left out).
// `mask_size` is the number of ids the model samples from (>= 1; usually the embedding rows).
TokenVocabulary VocabularyFromTokenizer(const Tokenizer& tokenizer, int32_t mask_size);

enum class ConstraintKind : uint8_t {
  kJsonObject,  // any JSON object; text is ignored
  kJsonSchema,  // text is a JSON Schema (the subset of json_schema.h)
  kRegex,       // text is a regex (the syntax of byte_dfa.h), matched against the whole output
};

absl::string_view ConstraintKindName(ConstraintKind kind);

struct ConstraintSpec {
  ConstraintKind kind = ConstraintKind::kJsonObject;
  std::string text;
};

class TokenTrie;

// A compiled constraint. Immutable apart from its mask cache.
class GrammarConstraint final : public coordinator::TokenConstraint {
 public:
  // Borrows nothing: `vocab` and `trie` are shared.
  GrammarConstraint(ByteDfa dfa, std::shared_ptr<const TokenVocabulary> vocab, std::shared_ptr<const TokenTrie> trie);

  int32_t StartState() const override { return dfa_.start(); }
  std::shared_ptr<const std::string> AllowedMask(int32_t state) const override;
  int32_t Advance(int32_t state, int32_t token) const override;
  bool IsFinished(int32_t state) const override { return state == finished_; }

  const ByteDfa& dfa() const { return dfa_; }
  // Masks computed so far (for tests and benchmarks).
  int32_t CachedMasksForTest() const;

 private:
  std::shared_ptr<const std::string> ComputeMask(int32_t state) const;

  // Constant after construction.
  const ByteDfa dfa_;
  const std::shared_ptr<const TokenVocabulary> vocab_;
  const std::shared_ptr<const TokenTrie> trie_;
  const int32_t finished_;  // the state after EOS: num_states()

  mutable absl::Mutex mu_;
  mutable std::vector<std::shared_ptr<const std::string>> masks_ ABSL_GUARDED_BY(mu_);  // [num_states + 1]
};

struct CompilerOptions {
  DfaLimits dfa;
  JsonRegexOptions json;
  size_t max_cached = 256;  // compiled constraints kept (the cache is emptied when full)
  // Memory the cache may hold, counting each constraint at its worst case (its DFA table plus a
  // mask for every state); the cache is emptied when a new constraint would exceed it.
  int64_t max_cached_bytes = int64_t{1} << 30;
};

// Compiles constraints for one vocabulary, once per (kind, text): later requests with the same
// schema share the compiled constraint and its masks.
class ConstraintCompiler {
 public:
  ConstraintCompiler(TokenVocabulary vocab, CompilerOptions options = {});
  ~ConstraintCompiler();

  // InvalidArgument naming what is wrong or unsupported (a JSON Schema keyword, a regex construct,
  // a limit). Errors are not cached.
  absl::StatusOr<std::shared_ptr<const coordinator::TokenConstraint>> Compile(const ConstraintSpec& spec);
  // The same, as the concrete type (tests, benchmarks).
  absl::StatusOr<std::shared_ptr<const GrammarConstraint>> CompileGrammar(const ConstraintSpec& spec);

  const TokenVocabulary& vocabulary() const { return *vocab_; }

 private:
  const CompilerOptions options_;
  const std::shared_ptr<const TokenVocabulary> vocab_;
  const std::shared_ptr<const TokenTrie> trie_;

  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<const GrammarConstraint>> cache_ ABSL_GUARDED_BY(mu_);
  int64_t cached_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // worst-case bytes of cache_'s entries
};

}  // namespace shardserve::structured

#endif  // SHARDSERVE_COORDINATOR_STRUCTURED_GRAMMAR_H_

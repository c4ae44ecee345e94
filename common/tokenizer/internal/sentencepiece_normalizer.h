// SentencePiece's text normalizer, reimplemented (see sentencepiece_model.h for why): the
// precompiled character map (a Darts-clone double-array trie of replacement rules; empty for the
// "identity" rule of Llama-2, Mistral and Mixtral), removal of extra whitespace, the dummy prefix
// and the escaping of ' ' as U+2581. User-defined symbols are matched first and left unnormalized,
// as in sentencepiece::normalizer::Normalizer.
//
// Thread-safety: immutable after Create; all methods may run on several threads at once.
#ifndef SHARDSERVE_COMMON_TOKENIZER_INTERNAL_SENTENCEPIECE_NORMALIZER_H_
#define SHARDSERVE_COMMON_TOKENIZER_INTERNAL_SENTENCEPIECE_NORMALIZER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "common/tokenizer/internal/sentencepiece_model.h"

namespace shardserve::tokenizer_internal {

inline constexpr std::string_view kSpaceSymbol = "\xE2\x96\x81";  // U+2581

// Longest-match lookup of a fixed set of strings (SentencePiece's PrefixMatcher).
class PrefixTrie {
 public:
  explicit PrefixTrie(const std::vector<std::string>& words);
  bool empty() const { return nodes_.size() <= 1; }
  // Length of the longest word that `s` starts with, 0 when none.
  size_t LongestPrefix(std::string_view s) const;

 private:
  std::vector<bool> nodes_;                       // whether a word ends at the node
  absl::flat_hash_map<uint64_t, int32_t> edges_;  // (node << 8 | byte) -> child
};

class SpNormalizer {
 public:
  // `model` supplies the normalizer spec; `user_defined` the symbols matched as units.
  // InvalidArgument naming `label` when the precompiled character map is malformed.
  static absl::StatusOr<std::unique_ptr<SpNormalizer>> Create(const SpModel& model,
                                                              const std::vector<std::string>& user_defined,
                                                              std::string_view label);

  // The normalized form of `input` (valid UTF-8).
  std::string Normalize(std::string_view input) const;

  // Length of the user-defined symbol `s` starts with, 0 when none.
  size_t MatchUserDefined(std::string_view s) const { return user_defined_.LongestPrefix(s); }

 private:
  SpNormalizer(const SpModel& model, const std::vector<std::string>& user_defined);
  // The replacement for the longest rule matching the start of `input`, and how many input bytes
  // it consumes.
  std::pair<std::string_view, size_t> NormalizePrefix(std::string_view input) const;
  // Darts-clone commonPrefixSearch: the value and length of the longest key that `s` starts with.
  bool LongestRule(std::string_view s, uint32_t* value, size_t* length) const;

  bool add_dummy_prefix_;
  bool remove_extra_whitespaces_;
  bool escape_whitespaces_;
  PrefixTrie user_defined_;
  std::vector<uint32_t> trie_;  // double-array units; empty for the identity rule
  std::string replacements_;    // NUL-terminated replacement strings the trie values point into
};

}  // namespace shardserve::tokenizer_internal

#endif  // SHARDSERVE_COMMON_TOKENIZER_INTERNAL_SENTENCEPIECE_NORMALIZER_H_

// tokenizer.json "added_tokens": tokens matched as a whole before the model runs (special tokens
// such as <s> or <|eot_id|>, and plain added tokens). Mirrors AddedVocabulary of the `tokenizers`
// library: leftmost-longest matching, tokens with normalized=false matched on the raw input and
// those with normalized=true on the normalized text (against their normalized spelling), and the
// single_word, lstrip and rstrip options.
//
// Thread-safety: immutable after construction; Split may run on several threads at once.
#ifndef SHARDSERVE_COMMON_TOKENIZER_INTERNAL_ADDED_VOCABULARY_H_
#define SHARDSERVE_COMMON_TOKENIZER_INTERNAL_ADDED_VOCABULARY_H_

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "common/tokenizer/internal/json_util.h"

namespace shardserve::tokenizer_internal {

struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
  bool special = false;
};

// Parses the "added_tokens" list (null or missing gives none). InvalidArgument naming the entry.
absl::StatusOr<std::vector<AddedToken>> ParseAddedTokens(const Json& j, const JsonWhere& where, int64_t max_id);

// A piece of text: an added token (id >= 0) or a stretch of ordinary text [begin, end).
struct Segment {
  int32_t id = -1;
  size_t begin = 0;
  size_t end = 0;
};

// Finds one class of added tokens (all normalized=false, or all normalized=true) in text.
class AddedTokenMatcher {
 public:
  // `patterns[i]` is the spelling to match for `tokens[i]` (the content, or its normalized form).
  AddedTokenMatcher(const std::vector<const AddedToken*>& tokens, const std::vector<std::string>& patterns);

  bool empty() const { return tokens_.empty(); }

  // Splits `text` (valid UTF-8) into segments covering it in order. Ordinary-text segments are
  // never empty.
  void Split(std::string_view text, std::vector<Segment>* out) const;

 private:
  struct Node {
    int32_t token = -1;  // index into tokens_ of the token ending here
  };
  int32_t Child(int32_t node, uint8_t byte) const;

  std::vector<const AddedToken*> tokens_;
  std::vector<Node> nodes_;
  absl::flat_hash_map<uint64_t, int32_t> edges_;  // (node << 8 | byte) -> child
  std::array<bool, 256> first_byte_{};
};

}  // namespace shardserve::tokenizer_internal

#endif  // SHARDSERVE_COMMON_TOKENIZER_INTERNAL_ADDED_VOCABULARY_H_

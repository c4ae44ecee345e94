// tokenizer.json "pre_tokenizer": splits normalized text into the words that BPE encodes one at a
// time. Supported types: Split (String or Regex pattern, every SplitDelimiterBehavior, invert),
// ByteLevel (add_prefix_space, use_regex with GPT-2's pattern; must come last), Metaspace
// (replacement, prepend_scheme / legacy add_prefix_space, split), Digits, Sequence. Others are
// Unimplemented.
//
// Thread-safety: immutable after FromJson; PreTokenize may run on several threads at once.
#ifndef SHARDSERVE_COMMON_TOKENIZER_INTERNAL_PRE_TOKENIZER_H_
#define SHARDSERVE_COMMON_TOKENIZER_INTERNAL_PRE_TOKENIZER_H_

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tokenizer/internal/json_util.h"
#include "common/tokenizer/internal/regex.h"

namespace shardserve::tokenizer_internal {

// GPT-2's pre-tokenizer pattern (ByteLevel with use_regex = true).
inline constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Receives each word: raw bytes with a ByteLevel pre-tokenizer (the byte-level characters are
// implied; BpeModel works on bytes), otherwise normalized UTF-8 text. The view is valid only
// during the call.
using WordSink = absl::FunctionRef<void(std::string_view word)>;

class PreTokenizer {
 public:
  // `j` is the "pre_tokenizer" value; null gives one word per input.
  static absl::StatusOr<std::unique_ptr<PreTokenizer>> FromJson(const Json& j, const JsonWhere& where);

  // Whether the pipeline ends with ByteLevel: words are then raw bytes for byte-level BPE.
  bool byte_level() const { return byte_level_; }

  // Passes the words of `text` (valid UTF-8, already normalized) to `sink`, in order.
  // `at_input_start` says whether `text` begins at offset 0 of the original input (Metaspace's
  // prepend_scheme "first").
  absl::Status PreTokenize(std::string_view text, bool at_input_start, WordSink sink) const;

  // Convenience for tests: the words as strings.
  absl::Status PreTokenizeToVector(std::string_view text, bool at_input_start, std::vector<std::string>* out) const;

 private:
  enum class Kind { kSplit, kMetaspace, kByteLevel };
  enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };
  enum class Prepend { kAlways, kNever, kFirst };
  struct Step {
    Kind kind;
    std::unique_ptr<Regex> regex;  // kSplit; kMetaspace (the replacement); kByteLevel with use_regex
    Behavior behavior = Behavior::kIsolated;
    bool invert = false;
    std::string replacement;  // kMetaspace
    Prepend prepend = Prepend::kAlways;
    bool split = true;              // kMetaspace
    bool add_prefix_space = false;  // kByteLevel
  };
  absl::Status AddSteps(const Json& j, const JsonWhere& where);
  // Runs steps_[k..] on `piece` and passes the resulting words to `sink` (depth first, so no list
  // of all words of a long text is ever built).
  absl::Status Apply(size_t k, std::string_view piece, bool at_start, WordSink sink) const;
  // Splits `piece` with `regex` and `behavior`, running steps_[k..] on each part.
  absl::Status SplitThen(size_t k, const Regex& regex, Behavior behavior, bool invert, std::string_view piece,
                         bool at_start, WordSink sink) const;

  std::vector<Step> steps_;
  bool byte_level_ = false;
};

}  // namespace shardserve::tokenizer_internal

#endif  // SHARDSERVE_COMMON_TOKENIZER_INTERNAL_PRE_TOKENIZER_H_

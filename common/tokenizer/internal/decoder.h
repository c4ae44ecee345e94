// tokenizer.json "decoder": turns token spellings back into text. Supported types: ByteLevel,
// ByteFallback, Fuse, Replace (String or Regex), Strip, Metaspace, Sequence; null joins tokens with
// spaces, as the library does. Others are Unimplemented.
//
// Decode() reproduces the `tokenizers` library exactly, including its treatment of invalid UTF-8:
// ByteLevel replaces each maximal invalid subpart of the whole byte string with U+FFFD; ByteFallback
// turns a run of <0xXX> tokens that is not valid UTF-8 as a whole into one U+FFFD per token.
//
// Stream is the incremental form: it runs each token through the same steps with per-step state
// (the first-token rules of Strip and Metaspace) and releases only complete UTF-8 characters. Its
// output concatenates to Decode()'s whenever the bytes are valid UTF-8. Known differences: for an
// invalid byte run, Stream replaces bytes one at a time as they prove invalid (a ByteFallback run
// mixing valid characters and invalid bytes keeps the valid characters), and a Strip after Fuse
// with stop > 0 (trailing strip; no real tokenizer uses it) is not applied.
//
// Thread-safety: a DecoderChain is immutable; a Stream is not thread-safe and borrows its chain.
#ifndef SHARDSERVE_COMMON_TOKENIZER_INTERNAL_DECODER_H_
#define SHARDSERVE_COMMON_TOKENIZER_INTERNAL_DECODER_H_

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tokenizer/internal/json_util.h"
#include "common/tokenizer/internal/regex.h"
#include "common/tokenizer/internal/replace_rule.h"
#include "common/tokenizer/utf8.h"

namespace shardserve::tokenizer_internal {

class DecoderChain {
 public:
  // `j` is the "decoder" value (null allowed).
  static absl::StatusOr<std::unique_ptr<DecoderChain>> FromJson(const Json& j, const JsonWhere& where);

  // Decodes token spellings to text.
  absl::StatusOr<std::string> Decode(std::vector<std::string> tokens) const;

  class Stream {
   public:
    explicit Stream(const DecoderChain* chain);  // `chain` must outlive the stream

    // Runs one token spelling through the chain; appends the text that is now final to `out`.
    absl::Status Feed(std::string_view token, std::string* out);
    // Flushes held bytes (as U+FFFD) and resets the stream.
    void Finish(std::string* out);

   private:
    struct StepState {
      size_t count = 0;     // tokens seen by this step
      size_t stripped = 0;  // Strip after Fuse: leading characters removed so far
      bool strip_done = false;
    };
    const DecoderChain* chain_;
    std::vector<StepState> states_;
    size_t tokens_ = 0;  // tokens fed since the last Finish
    Utf8StreamAssembler assembler_;
  };

 private:
  enum class Kind { kByteLevel, kByteFallback, kFuse, kReplace, kStrip, kMetaspace };
  struct Step {
    Kind kind;
    std::string pattern;  // kStrip: content; kMetaspace: replacement
    ReplaceRule replace;  // kReplace
    size_t start = 0;  // kStrip
    size_t stop = 0;
    bool prepend = true;      // kMetaspace: prepend_scheme != never
    bool after_fuse = false;  // a Fuse or ByteLevel step comes earlier: tokens arrive as one text
  };
  absl::Status AddSteps(const Json& j, const JsonWhere& where);

  std::vector<Step> steps_;
  bool null_decoder_ = false;  // no decoder: tokens joined by " "
  bool byte_level_ = false;    // has a ByteLevel step (decides the stream's invalid-byte policy)
};

// The byte of a "<0xXX>" token, or -1 for any other spelling.
int ByteFallbackValue(std::string_view token);

}  // namespace shardserve::tokenizer_internal

#endif  // SHARDSERVE_COMMON_TOKENIZER_INTERNAL_DECODER_H_

// Text <-> token ids for Hugging Face checkpoints, exactly as the model's own tokenizer does it.
//
// Two implementations sit behind one interface:
//   * tokenizer.json (the Hugging Face `tokenizers` format) with a BPE model: byte-level BPE as in
//     GPT-2, Llama-3 and Qwen2 (regex pre-tokenizer, GPT-2 byte map), and SentencePiece-style BPE as
//     in Llama-2, Mistral and Mixtral (Metaspace or Prepend/Replace normalizers, byte fallback), with
//     added/special tokens, normalizers (NFC, ...), post-processors and decoders. Reference: the
//     `tokenizers` library running the same file (which is what transformers 4.x, TGI and vLLM use).
//   * tokenizer.model (SentencePiece BPE), read and run natively. Reference: sentencepiece's
//     SentencePieceProcessor, which the tests also run side by side (libsentencepiece itself
//     cannot be linked here: see internal/sentencepiece_model.h).
//
// LoadTokenizer() picks one from a model directory: tokenizer.json when present (what
// transformers' AutoTokenizer gives users by default), else tokenizer.model. The two can differ on
// purpose for the same model: for Llama-2-style files, tokenizer.json keeps every space and splits
// literal special-token text such as "<s>" into the special id, while a SentencePiece model with
// remove_extra_whitespaces collapses runs of spaces and spells "<s>" out character by character
// (see ../shared/models/stories260K/README.md, "Tokenizer").
//
// Thread-safety: a Tokenizer is immutable after loading; every const method may be called from
// several threads at once. A StreamDecoder belongs to one sequence and is not thread-safe.
#ifndef SHARDSERVE_COMMON_TOKENIZER_TOKENIZER_H_
#define SHARDSERVE_COMMON_TOKENIZER_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace shardserve {

enum class TokenizerKind {
  kSentencePiece,  // tokenizer.model (SentencePiece BPE)
  kHfBpe,          // tokenizer.json with a BPE model
};

// Turns the ids of one generated sequence, fed one at a time, into text that is final: it never
// returns part of a UTF-8 character, and it applies the tokenizer's decoding rules that depend on
// position (e.g. SentencePiece drops the space that starts the first word, but not later ones).
//
// For every sequence whose decoded bytes are valid UTF-8, the concatenation of all Next() results
// and Finish() equals Tokenizer::Decode() of the same ids with the same skip_special_tokens. When
// the ids spell invalid UTF-8 (a model emitting stray byte tokens), each invalid byte becomes
// U+FFFD as soon as it is known to be invalid (see the implementations for the exact rule).
//
// Not thread-safe. Made by Tokenizer::NewStreamDecoder(); it borrows the Tokenizer, which must
// outlive it.
class StreamDecoder {
 public:
  virtual ~StreamDecoder() = default;

  // Feeds the next id. Returns the text that became final with it, possibly empty (the first bytes
  // of a multi-byte character, or a skipped special token). InvalidArgument naming the id when it
  // is outside the vocabulary; the decoder's state is then unchanged.
  virtual absl::StatusOr<std::string> Next(int32_t id) = 0;

  // Ends the sequence: returns the text still held back (an incomplete UTF-8 sequence at the end
  // becomes U+FFFD) and resets the decoder, so it can be used for a new sequence.
  virtual std::string Finish() = 0;

  // A decoder in this one's state: what it returns for the next ids is what this one would. Lets
  // a caller spell a token where it stands (a logprob's alternatives) without feeding it here.
  virtual std::unique_ptr<StreamDecoder> Clone() const = 0;

  // Feeds `context`, the ids before the text wanted (a prompt), and drops their text: the ids fed
  // after it decode as the continuation they are. For valid UTF-8, the concatenation of what
  // Next() and Finish() return after Prime(p) is Decode(p + ids) without its first
  // Decode(p).size() bytes, which is how transformers' text-generation pipeline and vLLM cut a
  // completion from its prompt; so a first generated word keeps the space that SentencePiece
  // drops at the start of a text. Bytes of an incomplete character at the end of `context` stay
  // held, and the ids that complete it return the whole character. InvalidArgument naming the id
  // when one is outside the vocabulary (the ids before it have been fed).
  absl::Status Prime(absl::Span<const int32_t> context);
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  virtual TokenizerKind kind() const = 0;
  // The file the tokenizer was loaded from, for messages.
  virtual const std::string& source() const = 0;

  // Encodes `text`, which must be valid UTF-8 (InvalidArgument naming the byte offset of the first
  // invalid byte otherwise). `add_special_tokens` = true behaves like transformers'
  // `tokenizer(text)`: for tokenizer.json it adds what the file's post-processor says (usually a
  // BOS; transformers 5 ignores tokenizer_config's add_bos_token/add_eos_token when a
  // tokenizer.json exists, and so does this); for tokenizer.model it adds BOS when
  // tokenizer_config's add_bos_token is true (the default) and EOS when add_eos_token is true (not
  // the default). false gives the bare ids, like `tokenizer(text, add_special_tokens=False)`.
  virtual absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text, bool add_special_tokens) const = 0;

  // Decodes `ids` like transformers' `tokenizer.decode(ids, skip_special_tokens=...)` (no
  // clean-up of spaces: transformers ignores clean_up_tokenization_spaces for BPE tokenizers).
  // InvalidArgument naming the first id outside the vocabulary. Byte sequences that are not valid
  // UTF-8 become U+FFFD following the reference library's rule.
  virtual absl::StatusOr<std::string> Decode(absl::Span<const int32_t> ids, bool skip_special_tokens) const = 0;

  // A decoder for one streamed sequence; see StreamDecoder. The Tokenizer must outlive it.
  virtual std::unique_ptr<StreamDecoder> NewStreamDecoder(bool skip_special_tokens) const = 0;

  // One past the largest valid id: the number of embedding rows the tokenizer needs. Ids below it
  // may still be unassigned (gaps in a tokenizer.json vocabulary); Decode rejects those too.
  virtual int32_t vocab_size() const = 0;

  // The beginning-of-sequence id (tokenizer_config's bos_token, else the model's own), if any.
  virtual std::optional<int32_t> bos_id() const = 0;

  // Ids that end generation: tokenizer_config's eos_token (else the model's own EOS), followed by
  // any further ids listed as eos_token_id in generation_config.json. May be empty.
  virtual const std::vector<int32_t>& eos_ids() const = 0;

  // The token's spelling in the vocabulary (e.g. "▁Hello", "Ġworld", "<0x0A>", "<s>").
  // InvalidArgument naming the id when it is outside the vocabulary.
  virtual absl::StatusOr<std::string> IdToPiece(int32_t id) const = 0;

  // The id whose spelling is exactly `piece` (added tokens included), if any.
  virtual std::optional<int32_t> PieceToId(std::string_view piece) const = 0;

  // Whether Decode(..., skip_special_tokens=true) drops `id`: added tokens marked special in
  // tokenizer.json; control pieces (<s>, </s>) for SentencePiece, which never prints them at all.
  virtual bool IsSpecial(int32_t id) const = 0;

  // The chat template exactly as shipped (tokenizer_config.json's chat_template, the one named
  // "default" when it is a list, else chat_template.jinja). Not rendered here. nullopt when none.
  virtual const std::optional<std::string>& chat_template() const = 0;
};

// Loads the tokenizer of the model directory `model_dir`: tokenizer.json when present, else
// tokenizer.model. tokenizer_config.json, special_tokens_map.json, generation_config.json and
// chat_template.jinja are read when present. Errors name the file: NotFound when the directory has
// neither tokenizer file; InvalidArgument or DataLoss for a corrupt or truncated file;
// Unimplemented for a tokenizer.json component this implementation does not support (e.g. a
// Unigram or WordPiece model).
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const std::string& model_dir);

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_TOKENIZER_TOKENIZER_H_

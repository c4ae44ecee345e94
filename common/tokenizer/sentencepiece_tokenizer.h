// Tokenizer for SentencePiece BPE tokenizer.model files (Llama-2, Mistral, Mixtral, ...), see
// tokenizer.h for the contract. The model file is read natively (internal/sentencepiece_model.h
// says why libsentencepiece cannot be linked into our processes) and behaves like sentencepiece's
// SentencePieceProcessor, which is the reference:
//   * Encode: SentencePiece's normalizer (precompiled character map, removal of extra whitespace,
//     dummy prefix, "▁" escaping; user-defined symbols kept whole) and its BPE (merge the
//     highest-scoring adjacent pair, leftmost first; unused pieces split back; unknown characters
//     as <0xXX> bytes with byte fallback, else one <unk> per run). Literal "<s>" in the text is
//     spelled out character by character, never turned into the control id, so user text cannot
//     inject control tokens. add_special_tokens adds BOS when tokenizer_config's add_bos_token is
//     true (the default) and EOS when add_eos_token is true (not the default).
//   * Decode: control pieces (<s>, </s>) are never printed, whatever skip_special_tokens says;
//     <unk> prints as the model's unk_surface (" ⁇ "); invalid byte pieces become one U+FFFD each;
//     the "▁" that starts the first word is dropped.
//   * Streaming runs the same per-piece rules, so its output concatenates to Decode()'s exactly,
//     invalid bytes included.
// Unsupported (Unimplemented, naming the file): Unigram/word/char models, a denormalizer,
// treat_whitespace_as_suffix.
#ifndef SHARDSERVE_COMMON_TOKENIZER_SENTENCEPIECE_TOKENIZER_H_
#define SHARDSERVE_COMMON_TOKENIZER_SENTENCEPIECE_TOKENIZER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/tokenizer/tokenizer.h"
#include "common/tokenizer/tokenizer_config.h"

namespace shardserve {

// Loads the SentencePiece model at `path`. Errors name `path`: NotFound when it cannot be read,
// InvalidArgument when it is not a valid model (corrupt or truncated).
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadSentencePieceTokenizer(const std::string& path,
                                                                      const TokenizerConfig& config);

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_TOKENIZER_SENTENCEPIECE_TOKENIZER_H_

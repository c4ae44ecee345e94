// Tokenizer for Hugging Face tokenizer.json files with a BPE model (see tokenizer.h for the
// contract and internal/*.h for each pipeline stage).
//
// Encode runs the `tokenizers` library's pipeline: added tokens with normalized=false are split
// out of the raw text; each remaining stretch is normalized, split on added tokens with
// normalized=true, pre-tokenized into words and BPE-encoded word by word; the post-processor's ids
// are added around the result when add_special_tokens is true.
#ifndef SHARDSERVE_COMMON_TOKENIZER_HF_BPE_TOKENIZER_H_
#define SHARDSERVE_COMMON_TOKENIZER_HF_BPE_TOKENIZER_H_

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/tokenizer/tokenizer.h"
#include "common/tokenizer/tokenizer_config.h"

namespace shardserve {

// Loads tokenizer.json at `path`. `config` supplies bos/eos spellings, generation_config eos ids
// and the chat template (tokenizer_config's add_bos_token/add_eos_token are not used: see
// Tokenizer::Encode). Errors name `path`: NotFound when it cannot be read, InvalidArgument for
// malformed JSON or components, Unimplemented for unsupported components.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadHfBpeTokenizer(const std::string& path, const TokenizerConfig& config);

// Same, from the file's text; `label` names it in messages.
absl::StatusOr<std::unique_ptr<Tokenizer>> ParseHfBpeTokenizer(std::string_view json, std::string_view label,
                                                               const TokenizerConfig& config);

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_TOKENIZER_HF_BPE_TOKENIZER_H_

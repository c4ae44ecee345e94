// The side files of a model directory that shape tokenization: tokenizer_config.json,
// special_tokens_map.json, generation_config.json and chat_template.jinja. All are optional.
#ifndef SHARDSERVE_COMMON_TOKENIZER_TOKENIZER_CONFIG_H_
#define SHARDSERVE_COMMON_TOKENIZER_TOKENIZER_CONFIG_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace shardserve {

struct TokenizerConfig {
  // Set only when tokenizer_config.json has the key with a boolean value (null counts as absent).
  std::optional<bool> add_bos_token;
  std::optional<bool> add_eos_token;
  // Token spellings; tokenizer_config.json first, special_tokens_map.json for those it lacks. A
  // value may be a string or an AddedToken object ({"content": ...}).
  std::optional<std::string> bos_token;
  std::optional<std::string> eos_token;
  // The raw chat template: chat_template.jinja when present (transformers gives it priority), else
  // tokenizer_config.json's chat_template (a string, or the entry named "default" of a list).
  std::optional<std::string> chat_template;
  // generation_config.json's eos_token_id (an integer or a list), not yet checked against a
  // vocabulary.
  std::vector<int64_t> generation_eos_ids;

  // Where the values came from, for messages ("" when the file was absent).
  std::string tokens_source;      // tokenizer_config.json or special_tokens_map.json
  std::string generation_source;  // generation_config.json
};

// The special ids of a loaded vocabulary.
struct SpecialTokenIds {
  std::optional<int32_t> bos;
  std::vector<int32_t> eos;  // the eos token first, then further generation_config ids
};

// Resolves the config's bos/eos spellings with `piece_to_id`; when the config names none, uses
// `model_bos` / `model_eos` (what the tokenizer file itself declares). InvalidArgument naming the
// config file when a named token is not in the vocabulary, or a generation_config id is not below
// `vocab_size`.
absl::StatusOr<SpecialTokenIds> ResolveSpecialTokenIds(
    const TokenizerConfig& config, const std::function<std::optional<int32_t>(std::string_view)>& piece_to_id,
    int32_t vocab_size, std::optional<int32_t> model_bos, std::optional<int32_t> model_eos);

// Parses tokenizer_config.json text into `config` (special_tokens_map.json has the same token
// fields, so it is parsed by the same function with `fill_missing_only` = true). InvalidArgument
// naming `label` for malformed JSON or a field of the wrong type.
absl::Status ParseTokenizerConfigJson(std::string_view json, std::string_view label, bool fill_missing_only,
                                      TokenizerConfig* config);

// Parses generation_config.json text for eos_token_id.
absl::Status ParseGenerationConfigEos(std::string_view json, std::string_view label, TokenizerConfig* config);

// Reads the side files of `model_dir`. Missing files are fine; unreadable or malformed ones give an
// error naming the file.
absl::StatusOr<TokenizerConfig> LoadTokenizerConfig(const std::string& model_dir);

// Reads a whole file. NotFound naming `path` when it cannot be opened.
absl::StatusOr<std::string> ReadTokenizerFile(const std::string& path);

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_TOKENIZER_TOKENIZER_CONFIG_H_

#include "common/tokenizer/tokenizer.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/status/macros.h"
#include "common/tokenizer/hf_bpe_tokenizer.h"
#include "common/tokenizer/sentencepiece_tokenizer.h"
#include "common/tokenizer/tokenizer_config.h"

namespace shardserve {

absl::Status StreamDecoder::Prime(absl::Span<const int32_t> context) {
  for (int32_t id : context) RETURN_IF_ERROR(Next(id).status());
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const std::string& model_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(model_dir, ec)) {
    return absl::NotFoundError(absl::StrCat(model_dir, ": not a directory"));
  }
  const std::string json_path = (fs::path(model_dir) / "tokenizer.json").string();
  const std::string model_path = (fs::path(model_dir) / "tokenizer.model").string();
  const bool has_json = fs::is_regular_file(json_path, ec);
  const bool has_model = fs::is_regular_file(model_path, ec);
  if (!has_json && !has_model) {
    return absl::NotFoundError(
        absl::StrCat(model_dir, ": no tokenizer.json or tokenizer.model (a model directory needs one of them)"));
  }
  ASSIGN_OR_RETURN(TokenizerConfig config, LoadTokenizerConfig(model_dir));
  // tokenizer.json first: it is what transformers' AutoTokenizer (the fast tokenizer) uses.
  if (has_json) return LoadHfBpeTokenizer(json_path, config);
  return LoadSentencePieceTokenizer(model_path, config);
}

}  // namespace shardserve

// Reads a SentencePiece model file (tokenizer.model): a serialized sentencepiece.ModelProto,
// decoded here with a small protobuf wire-format reader so that no protobuf runtime is needed.
//
// Why not libsentencepiece: Debian's libsentencepiece.so bundles protobuf 3.14 and exports its
// symbols; in a process that also links the system libprotobuf 3.21 (every gRPC binary), the
// dynamic linker binds one library's calls to the other's runtime, and the process aborts at
// start-up ("compiled against version 3.14.0 ... not compatible with the installed version").
//
// Only the fields tokenization needs are kept; unknown fields are skipped as protobuf does.
#ifndef SHARDSERVE_COMMON_TOKENIZER_INTERNAL_SENTENCEPIECE_MODEL_H_
#define SHARDSERVE_COMMON_TOKENIZER_INTERNAL_SENTENCEPIECE_MODEL_H_

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace shardserve::tokenizer_internal {

struct SpModel {
  enum class PieceType { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };
  enum class ModelType { kUnigram = 1, kBpe = 2, kWord = 3, kChar = 4 };
  struct Piece {
    std::string piece;
    float score = 0;
    PieceType type = PieceType::kNormal;
  };
  std::vector<Piece> pieces;

  // TrainerSpec (defaults as in sentencepiece_model.proto).
  ModelType model_type = ModelType::kUnigram;
  bool byte_fallback = false;
  bool treat_whitespace_as_suffix = false;
  std::string unk_surface = " \xE2\x81\x87 ";  // " ⁇ "

  // NormalizerSpec.
  std::string normalizer_name;
  std::string precompiled_charsmap;
  bool add_dummy_prefix = true;
  bool remove_extra_whitespaces = true;
  bool escape_whitespaces = true;

  // denormalizer_spec with a non-empty charsmap (decoding would need it).
  bool has_denormalizer = false;
};

// Parses `bytes`. InvalidArgument naming `label` and the byte offset for malformed or truncated
// data, or for a piece without text; the piece types and enum values are checked.
absl::StatusOr<SpModel> ParseSentencePieceModel(std::string_view bytes, std::string_view label);

}  // namespace shardserve::tokenizer_internal

#endif  // SHARDSERVE_COMMON_TOKENIZER_INTERNAL_SENTENCEPIECE_MODEL_H_

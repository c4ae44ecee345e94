#include "common/tokenizer/internal/sentencepiece_model.h"

#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status/macros.h"
#include "common/tokenizer/internal/string_view.h"

namespace shardserve::tokenizer_internal {
namespace {

// Field numbers of sentencepiece_model.proto.
constexpr int kModelPieces = 1;
constexpr int kModelTrainerSpec = 2;
constexpr int kModelNormalizerSpec = 3;
constexpr int kModelDenormalizerSpec = 5;
constexpr int kPiecePiece = 1;
constexpr int kPieceScore = 2;
constexpr int kPieceType = 3;
constexpr int kTrainerModelType = 3;
constexpr int kTrainerTreatWhitespaceAsSuffix = 24;
constexpr int kTrainerByteFallback = 35;
constexpr int kTrainerUnkSurface = 44;
constexpr int kNormalizerName = 1;
constexpr int kNormalizerCharsmap = 2;
constexpr int kNormalizerAddDummyPrefix = 3;
constexpr int kNormalizerRemoveExtraWhitespaces = 4;
constexpr int kNormalizerEscapeWhitespaces = 5;

enum WireType { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

// One field of a message: its number, wire type and value (varint/fixed in `number_value`, bytes
// in `bytes`).
struct Field {
  int number = 0;
  int wire_type = 0;
  uint64_t number_value = 0;
  std::string_view bytes;
};

// Reads the fields of one message held in `data`, which starts at `base` bytes into the file.
class WireReader {
 public:
  WireReader(std::string_view data, size_t base, std::string_view label) : data_(data), base_(base), label_(label) {}

  bool done() const { return pos_ >= data_.size(); }

  absl::StatusOr<Field> Next() {
    Field f;
    const size_t start = pos_;
    ASSIGN_OR_RETURN(uint64_t key, Varint());
    f.number = static_cast<int>(key >> 3);
    f.wire_type = static_cast<int>(key & 7);
    if (f.number <= 0) return Error(start, "has a field number of 0");
    switch (f.wire_type) {
      case kVarint: {
        ASSIGN_OR_RETURN(f.number_value, Varint());
        break;
      }
      case kFixed64:
        if (data_.size() - pos_ < 8) return Error(pos_, "ends inside a 64-bit field");
        std::memcpy(&f.number_value, data_.data() + pos_, 8);
        pos_ += 8;
        break;
      case kFixed32: {
        if (data_.size() - pos_ < 4) return Error(pos_, "ends inside a 32-bit field");
        uint32_t v = 0;
        std::memcpy(&v, data_.data() + pos_, 4);
        f.number_value = v;
        pos_ += 4;
        break;
      }
      case kLengthDelimited: {
        ASSIGN_OR_RETURN(uint64_t len, Varint());
        if (len > data_.size() - pos_) return Error(pos_, "ends inside a length-delimited field");
        f.bytes = data_.substr(pos_, len);
        f.number_value = base_ + pos_;  // where the bytes start, for nested readers
        pos_ += len;
        break;
      }
      default:
        return Error(start, absl::StrCat("has wire type ", f.wire_type, ", which SentencePiece models do not use"));
    }
    return f;
  }

  absl::Status Error(size_t at, std::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(
        AbslView(label_), ": not a valid SentencePiece model (corrupt or truncated?): data at byte offset ", base_ + at,
        " ", AbslView(what)));
  }

 private:
  absl::StatusOr<uint64_t> Varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= data_.size()) return Error(pos_, "ends inside a varint");
      const auto b = static_cast<uint8_t>(data_[pos_++]);
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) return v;
    }
    return Error(pos_, "has a varint longer than 10 bytes");
  }

  std::string_view data_;
  size_t base_;
  std::string_view label_;
  size_t pos_ = 0;
};

absl::Status ExpectWire(const WireReader& r, const Field& f, int wire_type, std::string_view name) {
  if (f.wire_type == wire_type) return absl::OkStatus();
  return r.Error(0, absl::StrCat("has field ", AbslView(name), " with wire type ", f.wire_type));
}

absl::Status ParsePiece(const Field& outer, std::string_view label, SpModel* model) {
  WireReader r(outer.bytes, outer.number_value, label);
  SpModel::Piece piece;
  bool has_text = false;
  while (!r.done()) {
    ASSIGN_OR_RETURN(Field f, r.Next());
    if (f.number == kPiecePiece) {
      RETURN_IF_ERROR(ExpectWire(r, f, kLengthDelimited, "piece"));
      piece.piece = std::string(f.bytes);
      has_text = true;
    } else if (f.number == kPieceScore) {
      RETURN_IF_ERROR(ExpectWire(r, f, kFixed32, "score"));
      const auto bits = static_cast<uint32_t>(f.number_value);
      std::memcpy(&piece.score, &bits, sizeof(float));
    } else if (f.number == kPieceType) {
      RETURN_IF_ERROR(ExpectWire(r, f, kVarint, "type"));
      if (f.number_value < 1 || f.number_value > 6) {
        return r.Error(0, absl::StrCat("has piece type ", f.number_value, " for piece ", model->pieces.size()));
      }
      piece.type = static_cast<SpModel::PieceType>(f.number_value);
    }
  }
  if (!has_text || piece.piece.empty()) {
    return r.Error(0, absl::StrCat("has piece ", model->pieces.size(), " without text"));
  }
  model->pieces.push_back(std::move(piece));
  return absl::OkStatus();
}

absl::Status ParseTrainerSpec(const Field& outer, std::string_view label, SpModel* model) {
  WireReader r(outer.bytes, outer.number_value, label);
  while (!r.done()) {
    ASSIGN_OR_RETURN(Field f, r.Next());
    if (f.number == kTrainerModelType && f.wire_type == kVarint) {
      if (f.number_value < 1 || f.number_value > 4) return r.Error(0, absl::StrCat("has model type ", f.number_value));
      model->model_type = static_cast<SpModel::ModelType>(f.number_value);
    } else if (f.number == kTrainerByteFallback && f.wire_type == kVarint) {
      model->byte_fallback = f.number_value != 0;
    } else if (f.number == kTrainerTreatWhitespaceAsSuffix && f.wire_type == kVarint) {
      model->treat_whitespace_as_suffix = f.number_value != 0;
    } else if (f.number == kTrainerUnkSurface && f.wire_type == kLengthDelimited) {
      model->unk_surface = std::string(f.bytes);
    }
  }
  return absl::OkStatus();
}

absl::Status ParseNormalizerSpec(const Field& outer, std::string_view label, SpModel* model, bool denormalizer) {
  WireReader r(outer.bytes, outer.number_value, label);
  while (!r.done()) {
    ASSIGN_OR_RETURN(Field f, r.Next());
    if (denormalizer) {
      if (f.number == kNormalizerCharsmap && f.wire_type == kLengthDelimited && !f.bytes.empty()) {
        model->has_denormalizer = true;
      }
      continue;
    }
    if (f.number == kNormalizerName && f.wire_type == kLengthDelimited) {
      model->normalizer_name = std::string(f.bytes);
    } else if (f.number == kNormalizerCharsmap && f.wire_type == kLengthDelimited) {
      model->precompiled_charsmap = std::string(f.bytes);
    } else if (f.number == kNormalizerAddDummyPrefix && f.wire_type == kVarint) {
      model->add_dummy_prefix = f.number_value != 0;
    } else if (f.number == kNormalizerRemoveExtraWhitespaces && f.wire_type == kVarint) {
      model->remove_extra_whitespaces = f.number_value != 0;
    } else if (f.number == kNormalizerEscapeWhitespaces && f.wire_type == kVarint) {
      model->escape_whitespaces = f.number_value != 0;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SpModel> ParseSentencePieceModel(std::string_view bytes, std::string_view label) {
  SpModel model;
  WireReader r(bytes, 0, label);
  while (!r.done()) {
    ASSIGN_OR_RETURN(Field f, r.Next());
    const bool nested = f.wire_type == kLengthDelimited;
    if (f.number == kModelPieces && nested) {
      RETURN_IF_ERROR(ParsePiece(f, label, &model));
    } else if (f.number == kModelTrainerSpec && nested) {
      RETURN_IF_ERROR(ParseTrainerSpec(f, label, &model));
    } else if (f.number == kModelNormalizerSpec && nested) {
      RETURN_IF_ERROR(ParseNormalizerSpec(f, label, &model, /*denormalizer=*/false));
    } else if (f.number == kModelDenormalizerSpec && nested) {
      RETURN_IF_ERROR(ParseNormalizerSpec(f, label, &model, /*denormalizer=*/true));
    } else if (f.number <= kModelDenormalizerSpec && f.number != 4 && !nested) {
      return r.Error(0, absl::StrCat("has field ", f.number, " with wire type ", f.wire_type, ", not a message"));
    }
  }
  if (model.pieces.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(AbslView(label), ": not a valid SentencePiece model (no pieces)"));
  }
  return model;
}

}  // namespace shardserve::tokenizer_internal

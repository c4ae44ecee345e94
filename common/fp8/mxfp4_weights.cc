#include "common/fp8/mxfp4_weights.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status/macros.h"

namespace shardserve {
namespace {

constexpr int64_t kBlock = 32;  // columns per scale

absl::Status CheckU8(const Checkpoint& ckpt, const std::string& name) {
  ASSIGN_OR_RETURN(const SafetensorsEntry* e, ckpt.Find(name));
  if (e->dtype != DType::kU8) {
    return absl::InvalidArgumentError(absl::StrCat(ckpt.label(), ": MXFP4 tensor \"", name, "\" is stored as ",
                                                   DTypeName(e->dtype), "; U8 expected"));
  }
  return absl::OkStatus();
}

}  // namespace

float E2M1ToFloat(uint8_t code) {
  static constexpr float kMagnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float m = kMagnitude[code & 7];
  return (code & 8) != 0 ? -m : m;
}

float Mxfp4Matrix::At(int64_t r, int64_t c) const {
  const uint8_t byte = codes[static_cast<size_t>(r * (cols / 2) + c / 2)];
  const int scale_byte = scales[static_cast<size_t>(r * (cols / kBlock) + c / kBlock)];
  return std::ldexp(E2M1ToFloat(static_cast<uint8_t>((c & 1) != 0 ? byte >> 4 : byte)), scale_byte - 127);
}

absl::StatusOr<Mxfp4Matrix> ReadMxfp4ExpertCodes(const Checkpoint& ckpt, const std::string& name, int64_t experts,
                                                 int64_t rows, int64_t cols, int64_t expert) {
  if (cols % kBlock != 0) {
    return absl::InvalidArgumentError(absl::StrCat(ckpt.label(), ": MXFP4 matrix \"", name, "\" has ", cols,
                                                   " input features; MXFP4 needs a multiple of 32"));
  }
  const std::string blocks_name = name + "_blocks";
  const std::string scales_name = name + "_scales";
  RETURN_IF_ERROR(CheckU8(ckpt, blocks_name));
  RETURN_IF_ERROR(CheckU8(ckpt, scales_name));
  const int64_t groups = cols / kBlock;
  // The stored bytes, copied as they are (U8: one byte per element).
  ASSIGN_OR_RETURN(const absl::Span<const uint8_t> blocks,
                   ckpt.RowBytes(blocks_name, {experts, rows, groups, kBlock / 2}, expert, expert + 1));
  ASSIGN_OR_RETURN(const absl::Span<const uint8_t> scales,
                   ckpt.RowBytes(scales_name, {experts, rows, groups}, expert, expert + 1));
  Mxfp4Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.codes.assign(blocks.begin(), blocks.end());
  m.scales.assign(scales.begin(), scales.end());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t scale_byte = m.scales[static_cast<size_t>(r * groups + g)];
      if (scale_byte == 255) {
        return absl::InvalidArgumentError(absl::StrCat(ckpt.label(), ": MXFP4 scale \"", scales_name, "\"[", expert,
                                                       ", ", r, ", ", g, "] is 255 (NaN)"));
      }
    }
  }
  return m;
}

absl::StatusOr<HostTensor> ReadMxfp4Expert(const Checkpoint& ckpt, const std::string& name, int64_t experts,
                                           int64_t rows, int64_t cols, int64_t expert) {
  ASSIGN_OR_RETURN(const Mxfp4Matrix m, ReadMxfp4ExpertCodes(ckpt, name, experts, rows, cols, expert));
  HostTensor out({rows, cols});
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out.data()[r * cols + c] = m.At(r, c);
  }
  return out;
}

}  // namespace shardserve

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

absl::StatusOr<HostTensor> ReadMxfp4Expert(const Checkpoint& ckpt, const std::string& name, int64_t experts,
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
  // Read as f32, each byte is its value 0-255 (exact).
  ASSIGN_OR_RETURN(HostTensor blocks,
                   ckpt.ReadRows(blocks_name, {experts, rows, groups, kBlock / 2}, expert, expert + 1));
  ASSIGN_OR_RETURN(HostTensor scales, ckpt.ReadRows(scales_name, {experts, rows, groups}, expert, expert + 1));
  HostTensor out({rows, cols});
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const auto scale_byte = static_cast<int>(scales.data()[r * groups + g]);
      if (scale_byte == 255) {
        return absl::InvalidArgumentError(absl::StrCat(ckpt.label(), ": MXFP4 scale \"", scales_name, "\"[", expert,
                                                       ", ", r, ", ", g, "] is 255 (NaN)"));
      }
      const float* src = blocks.data() + (r * groups + g) * (kBlock / 2);
      float* dst = out.data() + r * cols + g * kBlock;
      for (int64_t i = 0; i < kBlock / 2; ++i) {
        const auto byte = static_cast<uint8_t>(src[i]);
        dst[2 * i] = std::ldexp(E2M1ToFloat(byte), scale_byte - 127);
        dst[2 * i + 1] = std::ldexp(E2M1ToFloat(static_cast<uint8_t>(byte >> 4)), scale_byte - 127);
      }
    }
  }
  return out;
}

}  // namespace shardserve

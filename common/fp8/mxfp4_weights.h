// Reading the expert matrices of MXFP4 checkpoints (GPT-OSS) as f32. Such a checkpoint stores each
// stacked expert matrix `<name>` [experts, rows, cols] (rows are output features, as nn.Linear
// holds them) as two U8 tensors:
//   - `<name>_blocks` [experts, rows, cols / 32, 16]: the e2m1 codes of 32 consecutive columns,
//     two per byte, the even column in the low nibble and the odd one in the high nibble;
//   - `<name>_scales` [experts, rows, cols / 32]: one e8m0 scale per 32 columns, 2^(byte - 127).
// An e2m1 code is a sign bit over {0, 0.5, 1, 1.5, 2, 3, 4, 6}; an element is its code's value
// times its block's scale, computed exactly in f32 (as transformers' dequantization does).
//
// Validation, before any value is returned; every error names the checkpoint and the tensor:
//   - either tensor missing: NotFound;
//   - either not stored as U8, or not of the shape above: InvalidArgument naming the expected
//     dtype or shape;
//   - cols not a multiple of 32: InvalidArgument;
//   - a scale byte 255 (e8m0's NaN) in the expert read: InvalidArgument naming its position.
//
// Thread-safety: pure functions of a const Checkpoint.
#ifndef SHARDSERVE_COMMON_FP8_MXFP4_WEIGHTS_H_
#define SHARDSERVE_COMMON_FP8_MXFP4_WEIGHTS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/safetensors/safetensors.h"
#include "common/tensor/tensor.h"

namespace shardserve {

// The value of the e2m1 code in the low 4 bits of `code` (the high bits are ignored).
float E2M1ToFloat(uint8_t code);

// One expert's MXFP4 matrix [rows, cols] as stored: rows x cols / 2 code bytes (row-major, two
// codes per byte as above) and rows x cols / 32 scale bytes.
struct Mxfp4Matrix {
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> codes;
  std::vector<uint8_t> scales;
  // Element (r, c): its code's value times its block's scale.
  float At(int64_t r, int64_t c) const;
};

// Expert `expert` of the MXFP4 matrix `name` ([experts, rows, cols] once dequantized) as stored,
// validated as above (no scale byte is 255).
absl::StatusOr<Mxfp4Matrix> ReadMxfp4ExpertCodes(const Checkpoint& ckpt, const std::string& name, int64_t experts,
                                                 int64_t rows, int64_t cols, int64_t expert);

// The same expert as a [rows, cols] f32 tensor.
absl::StatusOr<HostTensor> ReadMxfp4Expert(const Checkpoint& ckpt, const std::string& name, int64_t experts,
                                           int64_t rows, int64_t cols, int64_t expert);

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_FP8_MXFP4_WEIGHTS_H_

// Reading weight matrices of FP8 checkpoints as f32: the F8_E4M3 values times their scales, as
// config.json's quantization_config describes them (common/model_spec's Fp8Quantization: block-wise
// `<name>_scale_inv`, or one `<name>_scale_inv` / `<name>_scale` per tensor). A tensor stored in
// any other dtype is read exactly as Checkpoint::Read / ReadRows / ReadCols read it, so the
// loader can call these for every weight.
//
// A tensor-parallel rank reads a row range (output features) or a column range (input features);
// a slice may start and end inside a scale block, and each element gets the scale of the block
// that holds it in the full matrix. The products are computed in f32 (an e4m3 value has 4
// significant bits, so fp8 x f32 scale is exact to f32 rounding).
//
// Validation, before any value is returned; every error names the checkpoint and the weight:
//   - F8_E4M3 weight but `fp8` empty (config.json has no fp8 quantization_config): InvalidArgument;
//   - F8_E4M3 weight that is not 2-D: InvalidArgument;
//   - scale tensor missing: NotFound naming the scale tensor(s) looked for; per tensor, both
//     `_scale_inv` and `_scale` present: InvalidArgument (ambiguous);
//   - scale dtype other than F32 or BF16: InvalidArgument;
//   - scale shape other than [ceil(out / block_rows), ceil(in / block_cols)] (block-wise) or
//     [], [1], [1, 1] (per tensor): InvalidArgument naming the expected shape;
//   - any scale (of the whole tensor, not only the slice's) NaN, infinite or <= 0: InvalidArgument
//     naming its index;
//   - a NaN code (0x7f / 0xff) among the weight values read: InvalidArgument naming its position
//     in the full matrix;
//   - and the errors of Checkpoint's reads (NotFound weight, shape mismatch, range out of bounds).
//
// Thread-safety: pure functions of a const Checkpoint; safe to call from several threads at once.
#ifndef SHARDSERVE_COMMON_FP8_FP8_WEIGHTS_H_
#define SHARDSERVE_COMMON_FP8_FP8_WEIGHTS_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/model_spec/model_spec.h"
#include "common/safetensors/safetensors.h"
#include "common/tensor/tensor.h"

namespace shardserve {

// The whole tensor `name` as f32; its stored shape must equal `expected_shape`.
absl::StatusOr<HostTensor> ReadWeight(const Checkpoint& ckpt, const std::optional<Fp8Quantization>& fp8,
                                      absl::string_view name, const Shape& expected_shape);

// Rows [row_begin, row_end) (output features of a weight [out, in]) as f32.
absl::StatusOr<HostTensor> ReadWeightRows(const Checkpoint& ckpt, const std::optional<Fp8Quantization>& fp8,
                                          absl::string_view name, const Shape& expected_shape, int64_t row_begin,
                                          int64_t row_end);

// Columns [col_begin, col_end) (input features of a weight [out, in]) as f32.
absl::StatusOr<HostTensor> ReadWeightCols(const Checkpoint& ckpt, const std::optional<Fp8Quantization>& fp8,
                                          absl::string_view name, const Shape& expected_shape, int64_t col_begin,
                                          int64_t col_end);

// A slice of an F8_E4M3 matrix as stored, for backends that keep FP8 weights (worker/engine's
// loader on CUDA): its codes and the scale blocks it overlaps. Element (r, c) of the slice is
// E4M3ToFloat(codes[r * cols + c]) * scales[((r + row_offset) / block_rows) * grid_cols +
// (c + col_offset) / block_cols], the value ReadWeightRows / ReadWeightCols give for it. A
// per-tensor scale is one block covering the slice (block_rows = max(rows, 1), block_cols =
// max(cols, 1), offsets 0); block-wise, the grid holds ceil((row_offset + rows) / block_rows)
// rows of grid_cols = ceil((col_offset + cols) / block_cols) scales.
struct Fp8Slice {
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> codes;  // [rows, cols]
  std::vector<float> scales;   // [grid rows, grid_cols]
  int64_t block_rows = 1, block_cols = 1, grid_cols = 1;
  int64_t row_offset = 0, col_offset = 0;
};

// Rows [row_begin, row_end) x columns [col_begin, col_end) of the F8_E4M3 weight `name` (whose
// stored shape must be `expected_shape`), codes and scales, validated exactly as ReadWeight* (the
// same errors, NaN codes included). InvalidArgument when `name` is not stored as F8_E4M3.
absl::StatusOr<Fp8Slice> ReadFp8Slice(const Checkpoint& ckpt, const std::optional<Fp8Quantization>& fp8,
                                      absl::string_view name, const Shape& expected_shape, int64_t row_begin,
                                      int64_t row_end, int64_t col_begin, int64_t col_end);

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_FP8_FP8_WEIGHTS_H_

// FP8 (float8 e4m3fn) weight math shared by the CPU and CUDA backends: the decode of one code, the
// scale of one element of a scaled F8_E4M3 matrix, and its dequantized value. Every function is
// SHARDSERVE_HD (host and device), allocates nothing and has no failure mode: callers validate the
// grid first (Fp8ScaleGrid::Valid). The values are those of common/fp8's ReadWeight*, bit for bit
// (tests/worker/kernels/fp8_math_test.cc checks every code and random blocks), so a CUDA kernel
// that dequantizes in registers multiplies the f32 weights the CPU backend would.
#ifndef SHARDSERVE_WORKER_KERNELS_SHARED_FP8_MATH_H_
#define SHARDSERVE_WORKER_KERNELS_SHARED_FP8_MATH_H_

#include <cstdint>
#include <cstring>

#include "worker/kernels/shared/row_math.h"  // SHARDSERVE_HD

namespace shardserve::kernels {

// The scales of one F8_E4M3 matrix [rows, cols] as a backend holds it: a slice of a checkpoint's
// matrix whose element (0, 0) lies at (row_offset, col_offset) inside its first scale block.
// Element (r, c) of the slice is scaled by
//   scales[((r + row_offset) / block_rows) * grid_cols + (c + col_offset) / block_cols],
// so `scales` holds the blocks the slice overlaps: [ceil((row_offset + rows) / block_rows),
// grid_cols = ceil((col_offset + cols) / block_cols)] f32 values, row-major. A per-tensor scale is
// one block covering the whole slice (block_rows >= rows, block_cols >= cols, offsets 0).
struct Fp8ScaleGrid {
  const float* scales = nullptr;  // device memory of the backend that holds the matrix
  int64_t block_rows = 0, block_cols = 0;
  int64_t grid_cols = 0;
  int64_t row_offset = 0, col_offset = 0;  // in [0, block_rows) and [0, block_cols)

  // Non-null scales, positive block sizes, offsets inside the first block, and enough grid columns
  // for `cols` columns.
  bool Valid(int64_t cols) const {
    return scales != nullptr && block_rows > 0 && block_cols > 0 && row_offset >= 0 && row_offset < block_rows &&
           col_offset >= 0 && col_offset < block_cols && grid_cols >= (col_offset + cols + block_cols - 1) / block_cols;
  }
};

// The f32 whose bits are `bits` (memcpy on the host, the intrinsic on the device).
SHARDSERVE_HD float Fp8BitsToFloat(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

// float8 e4m3fn `code` as f32, exactly as common/tensor's E4M3ToFloat: sign, 4 exponent bits
// (bias 7), 3 mantissa bits; exponent 0 is subnormal (mantissa x 2^-9); 0x7f and 0xff are NaN
// (the quiet NaN 0x7fc00000, whatever the sign); no infinities. -0 for 0x80.
SHARDSERVE_HD float E4M3Decode(uint8_t code) {
  const uint32_t mag = code & 0x7fu;
  if (mag == 0x7fu) return Fp8BitsToFloat(0x7fc00000u);
  // Normal: exponent e (1..15) becomes the f32 exponent field e - 7 + 127, the mantissa its top 3
  // bits. Subnormal (e = 0): mantissa / 8 x 2^-6, exact in f32 (no f32 denormal is involved).
  const float v = mag < 8u ? static_cast<float>(mag) * 0.001953125f  // 2^-9
                           : Fp8BitsToFloat((((mag >> 3) + 120u) << 23) | ((mag & 7u) << 20));
  return (code & 0x80u) != 0 ? -v : v;
}

// The scale of element (r, c) of the slice `g` describes.
SHARDSERVE_HD float Fp8ScaleAt(const Fp8ScaleGrid& g, int64_t r, int64_t c) {
  return g.scales[((r + g.row_offset) / g.block_rows) * g.grid_cols + (c + g.col_offset) / g.block_cols];
}

// The dequantized weight: the decoded code times its scale, one f32 product (as common/fp8 does).
SHARDSERVE_HD float Fp8Dequantize(uint8_t code, float scale) { return E4M3Decode(code) * scale; }

// Row `r` of the F8_E4M3 matrix `codes` ([rows, cols], row-major) dequantized into out[0, cols).
SHARDSERVE_HD void Fp8DequantizeRow(const uint8_t* codes, const Fp8ScaleGrid& g, int64_t r, int64_t cols,
                                    float* out) {
  const uint8_t* row = codes + r * cols;
  for (int64_t c = 0; c < cols; ++c) out[c] = Fp8Dequantize(row[c], Fp8ScaleAt(g, r, c));
}

}  // namespace shardserve::kernels

#endif  // SHARDSERVE_WORKER_KERNELS_SHARED_FP8_MATH_H_

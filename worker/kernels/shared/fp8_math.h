// FP8 (float8 e4m3fn) math shared by the CPU and CUDA backends: the decode and encode of one code
// (weights, and an FP8 KV cache), the scale of one element of a scaled F8_E4M3 matrix, and its
// dequantized value. Every function is SHARDSERVE_HD (host and device), allocates nothing and has no
// failure mode: callers validate the grid first (Fp8ScaleGrid::Valid). The values are those of
// common/tensor's E4M3ToFloat / FloatToE4M3 and common/fp8's ReadWeight*, bit for bit
// (tests/worker/kernels/fp8_math_test.cc checks every code, the encoder's ties and random floats,
// and random blocks), so a CUDA kernel that dequantizes in registers multiplies the f32 weights the
// CPU backend would, and both backends write an FP8 KV cache's same bytes.
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

// The bits of the f32 `f` (memcpy on the host, the intrinsic on the device).
SHARDSERVE_HD uint32_t Fp8FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
#endif
}

// `f` as float8 e4m3fn, exactly as common/tensor's FloatToE4M3: round to nearest even, magnitudes
// of 448 and above (infinities included) saturate to +-448 (0x7e / 0xfe), NaN becomes 0x7f (0xff
// with the sign bit), the sign of zero is kept. Integer arithmetic only, so the host and the
// device give the same code for every input (an FP8 KV cache written by either backend is the
// same bytes). E4M3Decode(E4M3Encode(E4M3Decode(c))) == E4M3Decode(c) for every non-NaN code.
SHARDSERVE_HD uint8_t E4M3Encode(float f) {
  const uint32_t bits = Fp8FloatBits(f);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t mag = bits & 0x7fffffffu;
  if (mag > 0x7f800000u) return sign | 0x7fu;  // NaN
  if (mag >= 0x43e00000u) return sign | 0x7eu;  // >= 448, infinity included: saturate
  if (mag < 0x3c800000u) {
    // Below the smallest normal (2^-6): the code counts steps of 2^-9. mag's value times 2^9 in
    // integer form: the significand (implicit bit included) shifted right by 23 - 9 - (e - 127)
    // = 141 - e bits, rounded to nearest even on the bits shifted out.
    const uint32_t e = mag >> 23;
    if (e < 117u) return sign;  // below 2^-10, half the smallest step: rounds to zero
    const uint32_t sig = (mag & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 141u - e;  // 21..24
    const uint32_t q = sig >> shift;
    const uint32_t rest = sig & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    const uint32_t up = rest > half || (rest == half && (q & 1u) != 0) ? 1u : 0u;
    return sign | static_cast<uint8_t>(q + up);
  }
  // Normal: keep 3 of the 23 mantissa bits, rounding to nearest even over exponent and mantissa
  // together (a carry moves to the next binade), then rebias the exponent from 127 to 7. Below
  // 448 the result is at most 0x7e.
  const uint32_t rounded = (mag + 0x7ffffu + ((mag >> 20) & 1u)) >> 20;
  return sign | static_cast<uint8_t>(rounded - (120u << 3));
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

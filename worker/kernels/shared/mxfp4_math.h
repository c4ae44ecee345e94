// MXFP4 math shared by the CPU and CUDA backends: the value of one weight of a matrix kept as
// DType::kMxfp4 (an MXFP4 checkpoint's experts as stored, common/tensor/dtype.h). Row r of such a
// matrix [rows, cols] is cols / 2 bytes of e2m1 code pairs (column 2i in the low nibble of byte i,
// column 2i + 1 in the high one) and cols / 32 e8m0 scale bytes; element (r, c) is
//   E2M1Decode(code) x E8M0Scale(scales[r * cols / 32 + c / 32]),
// one exact f32 product (both factors have at most two significant bits; the product may be
// subnormal, or infinite for scale bytes near 254, as ldexp gives). Every function is SHARDSERVE_HD,
// allocates nothing and has no failure mode. The values are those of common/fp8's E2M1ToFloat and
// ReadMxfp4Expert, bit for bit (tests/worker/kernels/mxfp4_math_test.cc checks every code with every
// scale byte), so both backends multiply the weights the dequantizing loader would have kept.
#ifndef SHARDSERVE_WORKER_KERNELS_SHARED_MXFP4_MATH_H_
#define SHARDSERVE_WORKER_KERNELS_SHARED_MXFP4_MATH_H_

#include <cstdint>

#include "worker/kernels/shared/fp8_math.h"  // Fp8BitsToFloat
#include "worker/kernels/shared/row_math.h"  // SHARDSERVE_HD

namespace shardserve::kernels {

inline constexpr int64_t kMxfp4Block = 32;  // columns per scale byte

// The e2m1 code in the low 4 bits of `code` (the high bits are ignored): a sign bit over 2 exponent
// bits (bias 1) and 1 mantissa bit, {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Exponent 0 is subnormal
// (mantissa x 0.5); 0x8 is -0.
SHARDSERVE_HD float E2M1Decode(uint8_t code) {
  const uint32_t mag = code & 7u;
  const uint32_t e = mag >> 1;
  const uint32_t bits = e == 0 ? (mag == 0 ? 0u : 0x3f000000u)  // 0 or 0.5
                               : ((e + 126u) << 23) | ((mag & 1u) << 22);
  return Fp8BitsToFloat(bits | ((code & 8u) << 28));
}

// The e8m0 scale byte `s`: 2^(s - 127), exact (s = 0 is the subnormal 2^-127); 255 is NaN.
SHARDSERVE_HD float E8M0Scale(uint8_t s) {
  if (s == 255) return Fp8BitsToFloat(0x7fc00000u);
  return Fp8BitsToFloat(s == 0 ? 0x00400000u : static_cast<uint32_t>(s) << 23);
}

// Weight (r, c) of an MXFP4 matrix [*, cols]: `codes` and `scales` as the header describes.
SHARDSERVE_HD float Mxfp4At(const uint8_t* codes, const uint8_t* scales, int64_t cols, int64_t r, int64_t c) {
  const uint8_t byte = codes[r * (cols / 2) + c / 2];
  return E2M1Decode(static_cast<uint8_t>((c & 1) != 0 ? byte >> 4 : byte)) *
         E8M0Scale(scales[r * (cols / kMxfp4Block) + c / kMxfp4Block]);
}

// Row `r` of the MXFP4 matrix [*, cols] dequantized into out[0, cols).
SHARDSERVE_HD void Mxfp4DequantizeRow(const uint8_t* codes, const uint8_t* scales, int64_t r, int64_t cols,
                                      float* out) {
  const uint8_t* row = codes + r * (cols / 2);
  const uint8_t* row_scales = scales + r * (cols / kMxfp4Block);
  for (int64_t b = 0; b < cols / kMxfp4Block; ++b) {
    const float scale = E8M0Scale(row_scales[b]);
    for (int64_t i = 0; i < kMxfp4Block / 2; ++i) {
      const uint8_t byte = row[b * (kMxfp4Block / 2) + i];
      out[b * kMxfp4Block + 2 * i] = E2M1Decode(byte) * scale;
      out[b * kMxfp4Block + 2 * i + 1] = E2M1Decode(static_cast<uint8_t>(byte >> 4)) * scale;
    }
  }
}

}  // namespace shardserve::kernels

#endif  // SHARDSERVE_WORKER_KERNELS_SHARED_MXFP4_MATH_H_

// Linear with F8_E4M3 weights and their scales (WeightView::fp8) on CUDA. Internal to
// worker/kernels/cuda: only cuda_backend.cu includes this header.
//
// The weights stay 1 byte each on the device; every path dequantizes them with the shared
// E4M3Decode / Fp8ScaleAt (kernels/shared/fp8_math.h), so each weight is the f32 value the CPU
// backend gets from common/fp8 for the same checkpoint. Two paths, chosen by the backend:
//   * Decode-sized batches (tokens <= kGemvFp8MaxTokens): LaunchGemvFp8 reads each weight row once
//     (16 codes per 16-byte load), dequantizes in registers and multiplies with every token's f32
//     activations, f32 products and sums. Memory-bound: half the bytes of the bf16 GEMV.
//   * Larger batches: LaunchDequantizeFp8Rows writes a chunk of rows as bf16 (the f32 value rounded
//     to nearest even) into the backend's scratch, and the existing 16-bit cuBLAS GEMM (activations
//     rounded to bf16, f32 accumulation) multiplies it; chunk after chunk, so the scratch holds a
//     bounded slice of the matrix, not all of it (the backend uses the scratch Reserve sized when
//     it holds enough rows beside x, so such a step allocates nothing and can be recorded).
// Not done: cuBLASLt FP8 x FP8 GEMMs (compute capability >= 8.9) for per-tensor scales, which
// would also quantize the activations to e4m3.
#ifndef SHARDSERVE_WORKER_KERNELS_CUDA_LINEAR_FP8_CUH_
#define SHARDSERVE_WORKER_KERNELS_CUDA_LINEAR_FP8_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "worker/kernels/shared/fp8_math.h"

namespace shardserve::kernels::cuda {

inline constexpr int64_t kGemvFp8MaxTokens = 8;

// y[t, o] (+)= sum_i x[t, i] * dequantized w[o, i] (+ bias[o]) for t < tokens <= kGemvFp8MaxTokens.
// x: [tokens, in] f32; codes: [out, in] e4m3; scales: as Fp8ScaleGrid describes (valid for `in`);
// bias: [out] or null; y: [tokens, out].
struct GemvFp8Params {
  const float* x = nullptr;
  const uint8_t* codes = nullptr;
  Fp8ScaleGrid scales;
  const float* bias = nullptr;
  float* y = nullptr;
  int64_t tokens = 0, in = 0, out = 0;
  bool accumulate = false;
};
cudaError_t LaunchGemvFp8(const GemvFp8Params& p, cudaStream_t stream);

// dst[r - row_begin, c] = bf16 of the dequantized w[r, c], for rows [row_begin, row_end) of the
// [*, in] matrix `codes` with `scales`. dst: [row_end - row_begin, in] bf16 patterns.
cudaError_t LaunchDequantizeFp8Rows(const uint8_t* codes, const Fp8ScaleGrid& scales, int64_t in, int64_t row_begin,
                                    int64_t row_end, uint16_t* dst, cudaStream_t stream);

}  // namespace shardserve::kernels::cuda

#endif  // SHARDSERVE_WORKER_KERNELS_CUDA_LINEAR_FP8_CUH_

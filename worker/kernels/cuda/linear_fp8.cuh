// Linear with F8_E4M3 weights and their scales (WeightView::fp8) on CUDA. Internal to
// worker/kernels/cuda: only cuda_backend.cu includes this header.
//
// The weights stay 1 byte each on the device; every path dequantizes them with the shared
// E4M3Decode / Fp8ScaleAt (kernels/shared/fp8_math.h), so each weight is the f32 value the CPU
// backend gets from common/fp8 for the same checkpoint. Two paths, chosen by the backend:
//   * Decode-sized batches (tokens <= kGemvFp8MaxTokens): LaunchGemvFp8 reads each weight row once
//     (16 codes per 16-byte load), dequantizes in registers and multiplies with every token's f32
//     activations, f32 products and sums. Memory-bound: half the bytes of the bf16 GEMV. Shaped
//     like the 16-bit GEMV (linear16.cuh): one launch serves a group of products of the same
//     activations (q/k/v, gate/up); kernels for 1, 2, 4 and 8 tokens (a 1-token step's keeps 64
//     registers, so 8 blocks fit a multiprocessor); one wave of blocks whose warps walk several
//     rows, each keeping its next rows on their way into L2; launched under PDL.
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

// The products of one FP8 GEMV launch: up to kMaxParts e4m3 matrices codes[p] ([out[p], in], row
// r scaled as scales[p] describes: valid for `in`) that multiply the same activations, each with
// its own bias (or null), output y[p] ([tokens, out[p]] f32) and accumulate flag. Their rows are
// one index space (kernels/shared/linear_group_math.h), so one grid covers them all.
struct GemvFp8Group {
  static constexpr int kMaxParts = 4;
  int parts = 0;
  const uint8_t* codes[kMaxParts] = {};
  Fp8ScaleGrid scales[kMaxParts] = {};
  const float* bias[kMaxParts] = {};
  float* y[kMaxParts] = {};
  int64_t out[kMaxParts] = {};
  bool accumulate[kMaxParts] = {};
};

// y[p][t, o] (+)= sum_i x[t, i] * dequantized codes[p][o, i] (+ bias[p][o]) for every part p and
// t < tokens <= kGemvFp8MaxTokens. x: [tokens, in] f32, in > 0. Each weight is Fp8Dequantize's
// f32, each lane's products and sums are f32 in a fixed order, so a part's sums do not depend on
// the other parts of its group nor on `multiprocessors` (the device's, sizing one wave of blocks).
// A part whose codes or scale blocks do not allow 16-byte loads (codes not 16-byte aligned,
// block_cols or col_offset not multiples of 16) runs in a second launch with the scalar loads,
// the same sums as alone. Launched under PDL (pdl.cuh): the first weight rows stream into L2
// while the previous kernel runs. cudaErrorInvalidValue for a bad token count or part count, in
// <= 0, an invalid scale grid, or columns beyond the kernel's 32-bit column index.
cudaError_t LaunchGemvFp8(const float* x, const GemvFp8Group& group, int64_t tokens, int64_t in, int multiprocessors,
                          cudaStream_t stream);

// dst[r - row_begin, c] = bf16 of the dequantized w[r, c], for rows [row_begin, row_end) of the
// [*, in] matrix `codes` with `scales`. dst: [row_end - row_begin, in] bf16 patterns.
cudaError_t LaunchDequantizeFp8Rows(const uint8_t* codes, const Fp8ScaleGrid& scales, int64_t in, int64_t row_begin,
                                    int64_t row_end, uint16_t* dst, cudaStream_t stream);

}  // namespace shardserve::kernels::cuda

#endif  // SHARDSERVE_WORKER_KERNELS_CUDA_LINEAR_FP8_CUH_

// Linear with MXFP4 weights (DType::kMxfp4: e2m1 code pairs and e8m0 block scales, as an MXFP4
// checkpoint stores its experts) on CUDA. Internal to worker/kernels/cuda: only cuda_backend.cu
// includes this header.
//
// The weights stay 17/32 of a byte each on the device (gpt-oss-20b's experts: 10 GB instead of
// 38 GB of bf16); every path decodes them with the shared E2M1Decode / E8M0Scale
// (kernels/shared/mxfp4_math.h), so each weight is the f32 value the CPU backend multiplies. Two
// paths, chosen by the backend as for FP8 (linear_fp8.cuh):
//   * Decode-sized batches (tokens <= kGemvMxfp4MaxTokens): LaunchGemvMxfp4, one warp per output
//     row, each lane taking whole 32-weight blocks (one 16-byte load of codes and one scale byte),
//     decoded in registers and multiplied with every token's f32 activations; f32 products and
//     sums in a fixed order per lane. A quarter of the bf16 GEMV's bytes.
//   * Larger batches: LaunchDequantizeMxfp4Rows writes a chunk of rows as bf16 (exact: an MXFP4
//     value has two significant bits) into the backend's scratch for its 16-bit cuBLAS GEMM.
#ifndef SHARDSERVE_WORKER_KERNELS_CUDA_LINEAR_MXFP4_CUH_
#define SHARDSERVE_WORKER_KERNELS_CUDA_LINEAR_MXFP4_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace shardserve::kernels::cuda {

inline constexpr int64_t kGemvMxfp4MaxTokens = 8;

// y[t, o] (+)= sum_c x[t, c] W[o, c] (+ bias[o]) for t < tokens <= kGemvMxfp4MaxTokens and every
// row o < out. codes: [out, in / 2] code pairs (16-byte aligned), scales: [out, in / 32] e8m0
// bytes, x: [tokens, in] f32 (read with 16-byte loads when 16-byte aligned), in a positive multiple
// of 32. `multiprocessors` sizes one wave of blocks. cudaErrorInvalidValue for a bad token count, in
// not a positive multiple of 32 (or beyond 32-bit column indices), or unaligned codes.
cudaError_t LaunchGemvMxfp4(const float* x, const uint8_t* codes, const uint8_t* scales, const float* bias, float* y,
                            int64_t tokens, int64_t in, int64_t out, bool accumulate, int multiprocessors,
                            cudaStream_t stream);

// dst[r - row_begin, c] = bf16 of weight (r, c), for rows [row_begin, row_end) of the [*, in]
// MXFP4 matrix. dst: [row_end - row_begin, in] bf16 patterns.
cudaError_t LaunchDequantizeMxfp4Rows(const uint8_t* codes, const uint8_t* scales, int64_t in, int64_t row_begin,
                                      int64_t row_end, uint16_t* dst, cudaStream_t stream);

}  // namespace shardserve::kernels::cuda

#endif  // SHARDSERVE_WORKER_KERNELS_CUDA_LINEAR_MXFP4_CUH_

// MXFP4 weights (DType::kMxfp4: an MXFP4 checkpoint's matrices as stored, kernels/shared/
// mxfp4_math.h) on the CPU backend: y = x . W^T with the weights decoded in registers.
//
// Every path decodes a weight to the f32 value Mxfp4At gives (an e2m1 code times its block's
// power of two, exact), so the products are those of the same matrix widened to f32; only the
// order of the sums differs between paths (as between the f32 kernels of gemv.h).
//   * Mxfp4SmallBatchLinear (decode steps, tokens <= kMxfp4FusedMaxTokens): each row is read once,
//     32 weights (16 code bytes and a scale byte) at a time, decoded with a byte shuffle (AVX2:
//     twice the e2m1 value is a small integer, looked up 16 codes per instruction, then scaled by
//     half the block's scale) and multiplied with every token. A quarter of bf16's bytes.
//   * Larger batches: Mxfp4DequantizeRows decodes a chunk of rows into f32 scratch, and the caller
//     multiplies it with its f32 kernels (cpu_backend.cc: the blocked kernel or sgemm), chunk after
//     chunk.
#ifndef SHARDSERVE_WORKER_KERNELS_CPU_MXFP4_H_
#define SHARDSERVE_WORKER_KERNELS_CPU_MXFP4_H_

#include <cstdint>

namespace shardserve::kernels::cpu {

// The token counts Mxfp4SmallBatchLinear takes (its accumulators are registers).
inline constexpr int64_t kMxfp4FusedMaxTokens = 4;

// y[t, o] (+)= sum_c x[t, c] W[o, c] (+ bias[o]) for rows o in [row_begin, row_end) and
// t < tokens <= kMxfp4FusedMaxTokens. codes: [out, in / 2] code pairs, scales: [out, in / 32]
// e8m0 bytes; in a multiple of 32; x: [tokens, in]; y: [tokens, out] (not aliasing x).
void Mxfp4SmallBatchLinear(const float* x, const uint8_t* codes, const uint8_t* scales, const float* bias, float* y,
                           int64_t tokens, int64_t in, int64_t out, bool accumulate, int64_t row_begin,
                           int64_t row_end);

// dst[(r - row_begin) * in + c] = Mxfp4At(codes, scales, in, r, c) for rows [row_begin, row_end).
void Mxfp4DequantizeRows(const uint8_t* codes, const uint8_t* scales, int64_t in, int64_t row_begin, int64_t row_end,
                         float* dst);

// The same product as Mxfp4SmallBatchLinear for any token count, with scalar code and a double
// accumulator over Mxfp4At's weights: the reference for tests.
void ReferenceLinearMxfp4(const float* x, const uint8_t* codes, const uint8_t* scales, const float* bias, float* y,
                          int64_t tokens, int64_t in, int64_t out, bool accumulate);

}  // namespace shardserve::kernels::cpu

#endif  // SHARDSERVE_WORKER_KERNELS_CPU_MXFP4_H_

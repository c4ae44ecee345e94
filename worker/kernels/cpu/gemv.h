// Small-batch matrix products for decode: y[t] (+)= W . x[t] (+ bias) for a few tokens, streaming
// W once. Decode is bound by reading W from memory; this kernel walks W row by row as one
// sequential stream, reuses each row from L1 for every token, and uses explicit SIMD (AVX2+FMA
// when compiled for it) with independent accumulators, which reaches a larger fraction of read
// bandwidth than OpenBLAS sgemv.
#ifndef SHARDSERVE_WORKER_KERNELS_CPU_GEMV_H_
#define SHARDSERVE_WORKER_KERNELS_CPU_GEMV_H_

#include <cstdint>

namespace shardserve::kernels::cpu {

// Largest token count SmallBatchLinear is used for; larger batches go to sgemm.
inline constexpr int64_t kSmallBatchMaxTokens = 8;

// x: [tokens, in]; w: [out, in]; bias: [out] or null; y: [tokens, out]. Rows [row_begin, row_end)
// of the output only (callers may split rows across threads).
void SmallBatchLinear(const float* x, const float* w, const float* bias, float* y, int64_t tokens, int64_t in,
                      int64_t out, bool accumulate, int64_t row_begin, int64_t row_end);

// The same product with scalar code and a double accumulator: the reference for tests.
void ReferenceLinear(const float* x, const float* w, const float* bias, float* y, int64_t tokens, int64_t in,
                     int64_t out, bool accumulate);

}  // namespace shardserve::kernels::cpu

#endif  // SHARDSERVE_WORKER_KERNELS_CPU_GEMV_H_

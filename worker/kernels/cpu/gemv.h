// Small-batch matrix products for decode: y[t] (+)= W . x[t] (+ bias) for a few tokens, streaming
// W once. Decode is bound by reading W from memory; this kernel walks W row by row as one
// sequential stream, reuses each row from L1 for every token, and uses explicit SIMD (AVX2+FMA
// when compiled for it) with independent accumulators, which reaches a larger fraction of read
// bandwidth than OpenBLAS sgemv.
#ifndef SHARDSERVE_WORKER_KERNELS_CPU_GEMV_H_
#define SHARDSERVE_WORKER_KERNELS_CPU_GEMV_H_

#include <cstdint>

namespace shardserve::kernels::cpu {

// Token counts each kernel is used for on one thread (measured with shardserve-bench-kernels on
// AVX2 machines): up to kSmallBatchMaxTokens the product is bound by reading W and
// SmallBatchLinear's single stream is fastest; up to kBlockedMaxTokens BlockedLinear beats sgemm,
// which spends much of a small product packing W; larger batches go to sgemm.
inline constexpr int64_t kSmallBatchMaxTokens = 3;
inline constexpr int64_t kBlockedMaxTokens = 48;

// x: [tokens, in]; w: [out, in]; bias: [out] or null; y: [tokens, out]. Rows [row_begin, row_end)
// of the output only (callers may split rows across threads).
void SmallBatchLinear(const float* x, const float* w, const float* bias, float* y, int64_t tokens, int64_t in,
                      int64_t out, bool accumulate, int64_t row_begin, int64_t row_end);

// The same contract as SmallBatchLinear, register-blocked over 4 rows x 3 tokens so that each
// weight load feeds several FMAs: compute-bound batches (a decode step of many sequences, a short
// prefill chunk). Summation order differs from SmallBatchLinear (one accumulator per output).
void BlockedLinear(const float* x, const float* w, const float* bias, float* y, int64_t tokens, int64_t in,
                   int64_t out, bool accumulate, int64_t row_begin, int64_t row_end);

// The same product with scalar code and a double accumulator: the reference for tests.
void ReferenceLinear(const float* x, const float* w, const float* bias, float* y, int64_t tokens, int64_t in,
                     int64_t out, bool accumulate);

}  // namespace shardserve::kernels::cpu

#endif  // SHARDSERVE_WORKER_KERNELS_CPU_GEMV_H_

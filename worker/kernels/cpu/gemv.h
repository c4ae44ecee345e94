// Small-batch matrix products for decode: y[t] (+)= W . x[t] (+ bias) for a few tokens, streaming
// W once. Decode is bound by reading W from memory; this kernel walks W row by row as one
// sequential stream, reuses each row from L1 for every token, and uses explicit SIMD (AVX2+FMA
// when compiled for it) with independent accumulators, which reaches a larger fraction of read
// bandwidth than OpenBLAS sgemv.
#ifndef SHARDSERVE_WORKER_KERNELS_CPU_GEMV_H_
#define SHARDSERVE_WORKER_KERNELS_CPU_GEMV_H_

#include <cstdint>

namespace shardserve::kernels::cpu {

// Token counts each kernel is used for on one thread (measured with shardserve-bench-kernels):
// up to SmallBatchMaxTokens() the product is bound by reading W and SmallBatchLinear's single
// stream is fastest; up to BlockedMaxTokens() BlockedLinear beats sgemm, which spends much of a
// small product packing W; larger batches go to sgemm. Both depend on BlockedLinear's body
// (measured on Zen 4 with the 100M Llama's shapes): the AVX-512 one is within 10% of
// SmallBatchLinear at 2 tokens (ahead where `in` = 2048), ahead from 3, and at 128 tokens still
// 2-14% ahead of single-thread sgemm in medians of 3 runs (level where `in` = 2048 in one run).
inline constexpr int64_t kSmallBatchMaxTokensAvx2 = 3;
inline constexpr int64_t kBlockedMaxTokensAvx2 = 48;
inline constexpr int64_t kSmallBatchMaxTokensAvx512 = 2;
inline constexpr int64_t kBlockedMaxTokensAvx512 = 128;
int64_t SmallBatchMaxTokens();
int64_t BlockedMaxTokens();

// x: [tokens, in]; w: [out, in]; bias: [out] or null; y: [tokens, out]. Rows [row_begin, row_end)
// of the output only (callers may split rows across threads).
void SmallBatchLinear(const float* x, const float* w, const float* bias, float* y, int64_t tokens, int64_t in,
                      int64_t out, bool accumulate, int64_t row_begin, int64_t row_end);

// The same contract as SmallBatchLinear, register-blocked over rows x tokens so that each weight
// load feeds several FMAs: compute-bound batches (a decode step of many sequences, a short
// prefill chunk). Summation order differs from SmallBatchLinear (one accumulator per output).
// Runs BlockedLinearAvx512 where HaveAvx512(), else BlockedLinearAvx2.
void BlockedLinear(const float* x, const float* w, const float* bias, float* y, int64_t tokens, int64_t in,
                   int64_t out, bool accumulate, int64_t row_begin, int64_t row_end);

// The AVX2 (4 rows x 3 tokens of ymm accumulators) and AVX-512 (4 x 6 of zmm) bodies of
// BlockedLinear. The AVX-512 one must only be called where HaveAvx512(); built without compiler
// support for it, it runs the AVX2 one.
void BlockedLinearAvx2(const float* x, const float* w, const float* bias, float* y, int64_t tokens, int64_t in,
                       int64_t out, bool accumulate, int64_t row_begin, int64_t row_end);
void BlockedLinearAvx512(const float* x, const float* w, const float* bias, float* y, int64_t tokens, int64_t in,
                         int64_t out, bool accumulate, int64_t row_begin, int64_t row_end);

// Whether this CPU (and OS) runs AVX-512F/VL/BW code; checked once.
bool HaveAvx512();

// The same product with scalar code and a double accumulator: the reference for tests.
void ReferenceLinear(const float* x, const float* w, const float* bias, float* y, int64_t tokens, int64_t in,
                     int64_t out, bool accumulate);

}  // namespace shardserve::kernels::cpu

#endif  // SHARDSERVE_WORKER_KERNELS_CPU_GEMV_H_

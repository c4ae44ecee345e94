// Small-batch matrix products for decode: y[t] (+)= W . x[t] (+ bias) for a few tokens, streaming
// W once. Decode is bound by reading W from memory; this kernel walks W row by row as one
// sequential stream, reuses each row from L1 for every token, and uses explicit SIMD (AVX2+FMA
// when compiled for it) with independent accumulators, which reaches a larger fraction of read
// bandwidth than OpenBLAS sgemv.
#ifndef SHARDSERVE_WORKER_KERNELS_CPU_GEMV_H_
#define SHARDSERVE_WORKER_KERNELS_CPU_GEMV_H_

#include <bit>
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

// bfloat16 weights: the same products with w as bfloat16 bits ([out, in], the upper 16 bits of
// each f32), widened to f32 in registers; x, y, bias, products and sums stay f32 (no bf16 dot
// instructions, which would round x too). Same contracts as the f32 functions above. Reading half
// the bytes, the memory-bound range of token counts is shorter, so the thresholds differ
// (shardserve-bench-kernels, Zen 4): the stream is ahead only at 1 token (2.2-2.5x the f32 pick,
// ~25 GB/s of weights); the AVX-512 blocked body reaches ~95-105 GF/s from 8 tokens and was still
// level with or ahead of sgemm on widened rows at 256. The AVX2 body is bound by widening (~46
// GF/s at every batch), level with OpenBLAS's AVX2 (Haswell) sgemm at 16 tokens and 20-30% behind
// at 32 (measured with OPENBLAS_CORETYPE=Haswell, not on an AVX2-only CPU).
inline constexpr int64_t kSmallBatchMaxTokensBf16Avx2 = 1;
inline constexpr int64_t kBlockedMaxTokensBf16Avx2 = 16;
inline constexpr int64_t kSmallBatchMaxTokensBf16Avx512 = 1;
inline constexpr int64_t kBlockedMaxTokensBf16Avx512 = 256;
int64_t SmallBatchMaxTokensBf16();
int64_t BlockedMaxTokensBf16();

inline float Bf16ToFloat(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

// dst[i] = Bf16ToFloat(src[i]) for i in [0, n).
void WidenBf16(const uint16_t* src, float* dst, int64_t n);

void SmallBatchLinearBf16(const float* x, const uint16_t* w, const float* bias, float* y, int64_t tokens, int64_t in,
                          int64_t out, bool accumulate, int64_t row_begin, int64_t row_end);
// Runs BlockedLinearBf16Avx512 where HaveAvx512(), else BlockedLinearBf16Avx2 (the same tiles as
// the f32 bodies).
void BlockedLinearBf16(const float* x, const uint16_t* w, const float* bias, float* y, int64_t tokens, int64_t in,
                       int64_t out, bool accumulate, int64_t row_begin, int64_t row_end);
void BlockedLinearBf16Avx2(const float* x, const uint16_t* w, const float* bias, float* y, int64_t tokens,
                           int64_t in, int64_t out, bool accumulate, int64_t row_begin, int64_t row_end);
void BlockedLinearBf16Avx512(const float* x, const uint16_t* w, const float* bias, float* y, int64_t tokens,
                             int64_t in, int64_t out, bool accumulate, int64_t row_begin, int64_t row_end);

// Whether this CPU (and OS) runs AVX-512F/VL/BW code; checked once.
bool HaveAvx512();

// The same product with scalar code and a double accumulator: the reference for tests.
void ReferenceLinear(const float* x, const float* w, const float* bias, float* y, int64_t tokens, int64_t in,
                     int64_t out, bool accumulate);
void ReferenceLinearBf16(const float* x, const uint16_t* w, const float* bias, float* y, int64_t tokens, int64_t in,
                         int64_t out, bool accumulate);

}  // namespace shardserve::kernels::cpu

#endif  // SHARDSERVE_WORKER_KERNELS_CPU_GEMV_H_

#include "worker/kernels/cpu/gemv.h"

#include "common/tensor/dtype.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SHARDSERVE_GEMV_AVX2 1
#endif

namespace shardserve::kernels::cpu {
namespace {

// One weight as f32: the kernels below are written once for f32 and bfloat16 weights.
inline float ToFloat(float v) { return v; }
inline float ToFloat(uint16_t v) { return Bf16ToFloat(v); }

#if SHARDSERVE_GEMV_AVX2
inline float HorizontalSum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 shuf = _mm_movehdup_ps(lo);
  __m128 sums = _mm_add_ps(lo, shuf);
  shuf = _mm_movehl_ps(shuf, sums);
  sums = _mm_add_ss(sums, shuf);
  return _mm_cvtss_f32(sums);
}

// 8 weights as f32; bfloat16 ones are zero-extended to 32 bits and moved to the upper half.
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const uint16_t* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

// Four independent accumulators hide the FMA latency; one row at a time keeps the whole matrix a
// single sequential stream, which the hardware prefetcher follows at full read bandwidth
// (interleaving several rows measured ~45% slower on these machines).
template <typename W>
inline float Dot1(const W* w, const float* x, int64_t n) {
  __m256 a = _mm256_setzero_ps(), b = a, c = a, d = a;
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    a = _mm256_fmadd_ps(Load8(w + k), _mm256_loadu_ps(x + k), a);
    b = _mm256_fmadd_ps(Load8(w + k + 8), _mm256_loadu_ps(x + k + 8), b);
    c = _mm256_fmadd_ps(Load8(w + k + 16), _mm256_loadu_ps(x + k + 16), c);
    d = _mm256_fmadd_ps(Load8(w + k + 24), _mm256_loadu_ps(x + k + 24), d);
  }
  for (; k + 8 <= n; k += 8) a = _mm256_fmadd_ps(Load8(w + k), _mm256_loadu_ps(x + k), a);
  float s = HorizontalSum(_mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d)));
  for (; k < n; ++k) s += ToFloat(w[k]) * x[k];
  return s;
}
#else
// Portable fallback: 8 independent partial sums let the compiler vectorise without -ffast-math.
template <typename W>
inline float Dot1(const W* w, const float* x, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += ToFloat(w[k + j]) * x[k + j];
  }
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; k < n; ++k) s += ToFloat(w[k]) * x[k];
  return s;
}
#endif

inline void Store(float* y, float v, const float* bias, int64_t o, bool accumulate) {
  if (bias != nullptr) v += bias[o];
  y[o] = accumulate ? y[o] + v : v;
}

#if SHARDSERVE_GEMV_AVX2
// R weight rows x T tokens: R*T accumulators (at most 12 of the 16 ymm registers) over the whole
// of `in`, so each loaded weight vector feeds T FMAs and each token vector R. When `prefetch` is
// set, the next block of R rows is requested into L2 while this one computes: the first token
// group of a block would otherwise wait on memory with R interleaved streams, which the hardware
// prefetcher follows poorly.
template <int R, int T, typename W>
inline void Tile(const W* w, const float* x, float* y, const float* bias, int64_t o, int64_t in, int64_t out,
                 bool accumulate, const W* prefetch) {
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  }
  const W* wr = w + o * in;
  // One prefetch per 64-byte line of each row.
  constexpr int64_t kLine = 64 / sizeof(W);
  int64_t k = 0;
  for (; k + 8 <= in; k += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = Load8(wr + r * in + k);
    if (prefetch != nullptr && (k & (kLine - 1)) == 0) {
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(prefetch + r * in + k), _MM_HINT_T1);
    }
    for (int t = 0; t < T; ++t) {
      const __m256 xv = _mm256_loadu_ps(x + t * in + k);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) {
      float v = HorizontalSum(acc[r][t]);
      for (int64_t j = k; j < in; ++j) v += ToFloat(wr[r * in + j]) * x[t * in + j];
      Store(y + t * out, v, bias, o + r, accumulate);
    }
  }
}

template <int R, int T, typename W>
void RowBlock(const float* x, const W* w, const float* bias, float* y, int64_t tokens, int64_t in, int64_t out,
              bool accumulate, int64_t o, const W* prefetch) {
  int64_t t = 0;
  for (; t + T <= tokens; t += T) {
    Tile<R, T, W>(w, x + t * in, y + t * out, bias, o, in, out, accumulate, t == 0 ? prefetch : nullptr);
  }
  const W* pf = t == 0 ? prefetch : nullptr;
  const float* xt = x + t * in;
  float* yt = y + t * out;
  switch (tokens - t) {
    case 5:
      if constexpr (T > 5) Tile<R, 5, W>(w, xt, yt, bias, o, in, out, accumulate, pf);
      break;
    case 4:
      if constexpr (T > 4) Tile<R, 4, W>(w, xt, yt, bias, o, in, out, accumulate, pf);
      break;
    case 3:
      if constexpr (T > 3) Tile<R, 3, W>(w, xt, yt, bias, o, in, out, accumulate, pf);
      break;
    case 2:
      Tile<R, 2, W>(w, xt, yt, bias, o, in, out, accumulate, pf);
      break;
    case 1:
      Tile<R, 1, W>(w, xt, yt, bias, o, in, out, accumulate, pf);
      break;
    default:
      break;
  }
}
#endif

template <typename W>
void SmallBatch(const float* x, const W* w, const float* bias, float* y, int64_t tokens, int64_t in, int64_t out,
                bool accumulate, int64_t row_begin, int64_t row_end) {
  // Each row of w is read from memory once and reused from L1 for every token.
  for (int64_t o = row_begin; o < row_end; ++o) {
    for (int64_t t = 0; t < tokens; ++t) Store(y + t * out, Dot1(w + o * in, x + t * in, in), bias, o, accumulate);
  }
}

template <typename W>
void BlockedAvx2(const float* x, const W* w, const float* bias, float* y, int64_t tokens, int64_t in, int64_t out,
                 bool accumulate, int64_t row_begin, int64_t row_end) {
#if SHARDSERVE_GEMV_AVX2
  // 4 x 3 measured best among 4x3, 3x4, 2x6 and 4x2 at 4-32 tokens (shardserve-bench-kernels).
  constexpr int kR = 4, kT = 3;
  int64_t o = row_begin;
  for (; o + kR <= row_end; o += kR) {
    const W* next = o + 2 * kR <= row_end ? w + (o + kR) * in : nullptr;
    RowBlock<kR, kT>(x, w, bias, y, tokens, in, out, accumulate, o, next);
  }
  for (; o < row_end; ++o) RowBlock<1, kT, W>(x, w, bias, y, tokens, in, out, accumulate, o, nullptr);
#else
  SmallBatch(x, w, bias, y, tokens, in, out, accumulate, row_begin, row_end);
#endif
}

template <typename W>
void Reference(const float* x, const W* w, const float* bias, float* y, int64_t tokens, int64_t in, int64_t out,
               bool accumulate) {
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t o = 0; o < out; ++o) {
      double s = bias != nullptr ? bias[o] : 0.0;
      for (int64_t k = 0; k < in; ++k) s += static_cast<double>(ToFloat(w[o * in + k])) * x[t * in + k];
      y[t * out + o] = accumulate ? y[t * out + o] + static_cast<float>(s) : static_cast<float>(s);
    }
  }
}

}  // namespace

void SmallBatchLinear(const float* x, const float* w, const float* bias, float* y, int64_t tokens, int64_t in,
                      int64_t out, bool accumulate, int64_t row_begin, int64_t row_end) {
  SmallBatch(x, w, bias, y, tokens, in, out, accumulate, row_begin, row_end);
}

void SmallBatchLinearBf16(const float* x, const uint16_t* w, const float* bias, float* y, int64_t tokens, int64_t in,
                          int64_t out, bool accumulate, int64_t row_begin, int64_t row_end) {
  SmallBatch(x, w, bias, y, tokens, in, out, accumulate, row_begin, row_end);
}

void BlockedLinearAvx2(const float* x, const float* w, const float* bias, float* y, int64_t tokens, int64_t in,
                       int64_t out, bool accumulate, int64_t row_begin, int64_t row_end) {
  BlockedAvx2(x, w, bias, y, tokens, in, out, accumulate, row_begin, row_end);
}

void BlockedLinearBf16Avx2(const float* x, const uint16_t* w, const float* bias, float* y, int64_t tokens,
                           int64_t in, int64_t out, bool accumulate, int64_t row_begin, int64_t row_end) {
  BlockedAvx2(x, w, bias, y, tokens, in, out, accumulate, row_begin, row_end);
}

void BlockedLinearBf16(const float* x, const uint16_t* w, const float* bias, float* y, int64_t tokens, int64_t in,
                       int64_t out, bool accumulate, int64_t row_begin, int64_t row_end) {
  if (HaveAvx512()) {
    BlockedLinearBf16Avx512(x, w, bias, y, tokens, in, out, accumulate, row_begin, row_end);
  } else {
    BlockedLinearBf16Avx2(x, w, bias, y, tokens, in, out, accumulate, row_begin, row_end);
  }
}

void WidenBf16(const uint16_t* src, float* dst, int64_t n) {
  ConvertToFloat(DType::kBF16, src, static_cast<size_t>(n), dst);
}

void BlockedLinear(const float* x, const float* w, const float* bias, float* y, int64_t tokens, int64_t in,
                   int64_t out, bool accumulate, int64_t row_begin, int64_t row_end) {
  if (HaveAvx512()) {
    BlockedLinearAvx512(x, w, bias, y, tokens, in, out, accumulate, row_begin, row_end);
  } else {
    BlockedLinearAvx2(x, w, bias, y, tokens, in, out, accumulate, row_begin, row_end);
  }
}

int64_t SmallBatchMaxTokens() { return HaveAvx512() ? kSmallBatchMaxTokensAvx512 : kSmallBatchMaxTokensAvx2; }

int64_t BlockedMaxTokens() { return HaveAvx512() ? kBlockedMaxTokensAvx512 : kBlockedMaxTokensAvx2; }

int64_t SmallBatchMaxTokensBf16() {
  return HaveAvx512() ? kSmallBatchMaxTokensBf16Avx512 : kSmallBatchMaxTokensBf16Avx2;
}

int64_t BlockedMaxTokensBf16() { return HaveAvx512() ? kBlockedMaxTokensBf16Avx512 : kBlockedMaxTokensBf16Avx2; }

void ReferenceLinear(const float* x, const float* w, const float* bias, float* y, int64_t tokens, int64_t in,
                     int64_t out, bool accumulate) {
  Reference(x, w, bias, y, tokens, in, out, accumulate);
}

void ReferenceLinearBf16(const float* x, const uint16_t* w, const float* bias, float* y, int64_t tokens, int64_t in,
                         int64_t out, bool accumulate) {
  Reference(x, w, bias, y, tokens, in, out, accumulate);
}

}  // namespace shardserve::kernels::cpu

#include "worker/kernels/cpu/gemv.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SHARDSERVE_GEMV_AVX2 1
#endif

namespace shardserve::kernels::cpu {
namespace {

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

// Dot products of 4 consecutive rows of w with one vector x, length n.
inline void Dot4(const float* w, int64_t ld, const float* x, int64_t n, float out[4]) {
  const float* w0 = w;
  const float* w1 = w + ld;
  const float* w2 = w + 2 * ld;
  const float* w3 = w + 3 * ld;
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + k);
    const __m256 x1 = _mm256_loadu_ps(x + k + 8);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), x0, a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k), x0, a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k), x0, a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k), x0, a3);
    b0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k + 8), x1, b0);
    b1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k + 8), x1, b1);
    b2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k + 8), x1, b2);
    b3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k + 8), x1, b3);
  }
  for (; k + 8 <= n; k += 8) {
    const __m256 x0 = _mm256_loadu_ps(x + k);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), x0, a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k), x0, a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k), x0, a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k), x0, a3);
  }
  out[0] = HorizontalSum(_mm256_add_ps(a0, b0));
  out[1] = HorizontalSum(_mm256_add_ps(a1, b1));
  out[2] = HorizontalSum(_mm256_add_ps(a2, b2));
  out[3] = HorizontalSum(_mm256_add_ps(a3, b3));
  for (; k < n; ++k) {
    out[0] += w0[k] * x[k];
    out[1] += w1[k] * x[k];
    out[2] += w2[k] * x[k];
    out[3] += w3[k] * x[k];
  }
}

inline float Dot1(const float* w, const float* x, int64_t n) {
  __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    a = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a);
    b = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(x + k + 8), b);
  }
  float s = HorizontalSum(_mm256_add_ps(a, b));
  for (; k < n; ++k) s += w[k] * x[k];
  return s;
}
#else
// Portable fallback: 8 independent partial sums let the compiler vectorise without -ffast-math.
inline float Dot1(const float* w, const float* x, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += w[k + j] * x[k + j];
  }
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; k < n; ++k) s += w[k] * x[k];
  return s;
}

inline void Dot4(const float* w, int64_t ld, const float* x, int64_t n, float out[4]) {
  for (int r = 0; r < 4; ++r) out[r] = Dot1(w + r * ld, x, n);
}
#endif

inline void Store(float* y, float v, const float* bias, int64_t o, bool accumulate) {
  if (bias != nullptr) v += bias[o];
  y[o] = accumulate ? y[o] + v : v;
}

}  // namespace

void SmallBatchLinear(const float* x, const float* w, const float* bias, float* y, int64_t tokens, int64_t in,
                      int64_t out, bool accumulate, int64_t row_begin, int64_t row_end) {
  int64_t o = row_begin;
  for (; o + 4 <= row_end; o += 4) {
    const float* wr = w + o * in;
    for (int64_t t = 0; t < tokens; ++t) {
      float r[4];
      Dot4(wr, in, x + t * in, in, r);
      float* yt = y + t * out;
      for (int j = 0; j < 4; ++j) Store(yt, r[j], bias, o + j, accumulate);
    }
  }
  for (; o < row_end; ++o) {
    for (int64_t t = 0; t < tokens; ++t) Store(y + t * out, Dot1(w + o * in, x + t * in, in), bias, o, accumulate);
  }
}

void ReferenceLinear(const float* x, const float* w, const float* bias, float* y, int64_t tokens, int64_t in,
                     int64_t out, bool accumulate) {
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t o = 0; o < out; ++o) {
      double s = bias != nullptr ? bias[o] : 0.0;
      for (int64_t k = 0; k < in; ++k) s += static_cast<double>(w[o * in + k]) * x[t * in + k];
      y[t * out + o] = accumulate ? y[t * out + o] + static_cast<float>(s) : static_cast<float>(s);
    }
  }
}

}  // namespace shardserve::kernels::cpu

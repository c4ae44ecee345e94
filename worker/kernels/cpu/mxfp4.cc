#include "worker/kernels/cpu/mxfp4.h"

#include "worker/kernels/shared/mxfp4_math.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SHARDSERVE_MXFP4_AVX2 1
#endif

namespace shardserve::kernels::cpu {
namespace {

constexpr int64_t kBlockBytes = kMxfp4Block / 2;  // code bytes per scale

#if SHARDSERVE_MXFP4_AVX2
inline float HorizontalSum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  lo = _mm_add_ps(lo, _mm256_extractf128_ps(v, 1));
  __m128 shuf = _mm_movehdup_ps(lo);
  __m128 sums = _mm_add_ps(lo, shuf);
  shuf = _mm_movehl_ps(shuf, sums);
  return _mm_cvtss_f32(_mm_add_ss(sums, shuf));
}

// The 32 weights of one block, in column order: 16 code bytes (two codes each, the even column
// low) and the block's scale byte. Twice each e2m1 value is an integer in [-12, 12], looked up 16
// codes at a time, widened to f32 and multiplied by half the scale: the exact product Mxfp4At
// gives (both are the one representable value, or the same infinity), for every scale byte but
// 255 (NaN; the loader refuses it); code 8 (-0) becomes +0, equal as a value.
inline void DecodeBlock(const uint8_t* bytes, uint8_t scale_byte, __m256 (&w)[4]) {
  const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m128i nibble = _mm_set1_epi8(0x0f);
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  const __m128i lo = _mm_and_si128(raw, nibble);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nibble);
  const __m128i first = _mm_shuffle_epi8(table, _mm_unpacklo_epi8(lo, hi));   // columns 0-15
  const __m128i second = _mm_shuffle_epi8(table, _mm_unpackhi_epi8(lo, hi));  // columns 16-31
  const __m256 half_scale = _mm256_set1_ps(0.5f * E8M0Scale(scale_byte));
  w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(first)), half_scale);
  w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(first, 8))), half_scale);
  w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(second)), half_scale);
  w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(second, 8))), half_scale);
}

// One row against T tokens. Independent accumulators per token hide the FMA latency: four (one
// per 8 columns of a block) for up to 2 tokens, two for 3 and 4 (which the 16 ymm registers hold
// beside the block's weights).
template <int T>
inline void Row(const uint8_t* codes, const uint8_t* scales, const float* x, int64_t in, float (&sums)[T]) {
  constexpr int kAcc = T <= 2 ? 4 : 2;
  __m256 acc[T][kAcc];
  for (int t = 0; t < T; ++t) {
    for (int i = 0; i < kAcc; ++i) acc[t][i] = _mm256_setzero_ps();
  }
  const int64_t blocks = in / kMxfp4Block;
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 w[4];
    DecodeBlock(codes + b * kBlockBytes, scales[b], w);
    const int64_t c = b * kMxfp4Block;
    for (int t = 0; t < T; ++t) {
      const float* xt = x + t * in + c;
      for (int i = 0; i < 4; ++i) acc[t][i % kAcc] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xt + 8 * i), acc[t][i % kAcc]);
    }
  }
  for (int t = 0; t < T; ++t) {
    __m256 total = acc[t][0];
    for (int i = 1; i < kAcc; ++i) total = _mm256_add_ps(total, acc[t][i]);
    sums[t] = HorizontalSum(total);
  }
}
#else
// Portable: each block decoded by the shared math into 32 floats, then 8 partial sums per token.
template <int T>
inline void Row(const uint8_t* codes, const uint8_t* scales, const float* x, int64_t in, float (&sums)[T]) {
  float acc[T][8] = {};
  float w[kMxfp4Block];
  const int64_t blocks = in / kMxfp4Block;
  for (int64_t b = 0; b < blocks; ++b) {
    Mxfp4DequantizeRow(codes + b * kBlockBytes, scales + b, 0, kMxfp4Block, w);
    for (int t = 0; t < T; ++t) {
      const float* xt = x + t * in + b * kMxfp4Block;
      for (int64_t k = 0; k < kMxfp4Block; k += 8) {
        for (int j = 0; j < 8; ++j) acc[t][j] += w[k + j] * xt[k + j];
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    sums[t] = ((acc[t][0] + acc[t][1]) + (acc[t][2] + acc[t][3])) + ((acc[t][4] + acc[t][5]) + (acc[t][6] + acc[t][7]));
  }
}
#endif

template <int T>
void Rows(const float* x, const uint8_t* codes, const uint8_t* scales, const float* bias, float* y, int64_t in,
          int64_t out, bool accumulate, int64_t row_begin, int64_t row_end) {
  const int64_t row_bytes = in / 2, row_scales = in / kMxfp4Block;
  for (int64_t o = row_begin; o < row_end; ++o) {
    float sums[T];
    Row<T>(codes + o * row_bytes, scales + o * row_scales, x, in, sums);
    for (int t = 0; t < T; ++t) {
      float v = sums[t] + (bias != nullptr ? bias[o] : 0.0f);
      float& dst = y[t * out + o];
      dst = accumulate ? dst + v : v;
    }
  }
}

}  // namespace

void Mxfp4SmallBatchLinear(const float* x, const uint8_t* codes, const uint8_t* scales, const float* bias, float* y,
                           int64_t tokens, int64_t in, int64_t out, bool accumulate, int64_t row_begin,
                           int64_t row_end) {
  switch (tokens) {
    case 1: return Rows<1>(x, codes, scales, bias, y, in, out, accumulate, row_begin, row_end);
    case 2: return Rows<2>(x, codes, scales, bias, y, in, out, accumulate, row_begin, row_end);
    case 3: return Rows<3>(x, codes, scales, bias, y, in, out, accumulate, row_begin, row_end);
    case 4: return Rows<4>(x, codes, scales, bias, y, in, out, accumulate, row_begin, row_end);
    default: return;
  }
}

void Mxfp4DequantizeRows(const uint8_t* codes, const uint8_t* scales, int64_t in, int64_t row_begin, int64_t row_end,
                         float* dst) {
  for (int64_t r = row_begin; r < row_end; ++r) {
#if SHARDSERVE_MXFP4_AVX2
    const uint8_t* row = codes + r * (in / 2);
    const uint8_t* row_scales = scales + r * (in / kMxfp4Block);
    float* out = dst + (r - row_begin) * in;
    for (int64_t b = 0; b < in / kMxfp4Block; ++b) {
      __m256 w[4];
      DecodeBlock(row + b * kBlockBytes, row_scales[b], w);
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + b * kMxfp4Block + 8 * i, w[i]);
    }
#else
    Mxfp4DequantizeRow(codes, scales, r, in, dst + (r - row_begin) * in);
#endif
  }
}

void ReferenceLinearMxfp4(const float* x, const uint8_t* codes, const uint8_t* scales, const float* bias, float* y,
                          int64_t tokens, int64_t in, int64_t out, bool accumulate) {
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t o = 0; o < out; ++o) {
      double s = bias != nullptr ? bias[o] : 0.0;
      for (int64_t c = 0; c < in; ++c) s += static_cast<double>(Mxfp4At(codes, scales, in, o, c)) * x[t * in + c];
      y[t * out + o] = accumulate ? y[t * out + o] + static_cast<float>(s) : static_cast<float>(s);
    }
  }
}

}  // namespace shardserve::kernels::cpu

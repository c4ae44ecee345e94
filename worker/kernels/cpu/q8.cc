#include "worker/kernels/cpu/q8.h"

#include <cmath>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#define SHARDSERVE_Q8_AVX2 1
#endif

namespace shardserve::kernels::cpu {
namespace {

// round(v * inv) clamped to [-127, 127]; NaN (a NaN input) becomes 0.
inline int8_t QuantizeOne(float v, float inv) {
  const float r = std::nearbyint(v * inv);
  if (!(r == r)) return 0;
  return static_cast<int8_t>(r > 127.0f ? 127 : (r < -127.0f ? -127 : static_cast<int>(r)));
}

// Largest |v[k]| for k in [k0, k1). A comparison, not std::fmax (an out-of-line call per element
// here): NaNs are skipped, which QuantizeOne then maps to 0.
inline float BlockMax(const float* v, int64_t k0, int64_t k1) {
  float amax = 0.0f;
  for (int64_t k = k0; k < k1; ++k) {
    const float a = std::fabs(v[k]);
    amax = a > amax ? a : amax;
  }
  return amax;
}

// The scale of a block whose largest magnitude is `amax`, and its reciprocal for quantizing.
inline void BlockScale(float amax, float* scale, float* inv) {
  *scale = amax / 127.0f;
  *inv = amax > 0.0f ? 127.0f / amax : 0.0f;
}

inline size_t QuantIndex(const Q8Layout& l, int64_t row, int64_t col) {
  const int64_t panel = row / kQ8PanelRows, r = row % kQ8PanelRows;
  return static_cast<size_t>(panel * l.in_pad * kQ8PanelRows + (col / 4) * 4 * kQ8PanelRows + r * 4 + col % 4);
}
inline const float* Scales(const uint8_t* packed, const Q8Layout& l) {
  return reinterpret_cast<const float*>(packed + l.scale_offset);
}
inline size_t ScaleIndex(const Q8Layout& l, int64_t row, int64_t block) {
  return static_cast<size_t>(((row / kQ8PanelRows) * l.blocks + block) * kQ8PanelRows + row % kQ8PanelRows);
}

inline void Store(float* y, float v, const float* bias, int64_t o, bool accumulate) {
  if (bias != nullptr) v += bias[o];
  y[o] = accumulate ? y[o] + v : v;
}

}  // namespace

Q8Layout Q8Layout::For(int64_t out, int64_t in) {
  Q8Layout l;
  l.out = out;
  l.in = in;
  l.panels = (out + kQ8PanelRows - 1) / kQ8PanelRows;
  l.blocks = (in + kQ8Block - 1) / kQ8Block;
  l.in_pad = l.blocks * kQ8Block;
  l.quant_bytes = static_cast<size_t>(l.panels * kQ8PanelRows * l.in_pad);
  l.scale_offset = (l.quant_bytes + 63) / 64 * 64;
  l.bytes = l.scale_offset + static_cast<size_t>(l.panels * l.blocks * kQ8PanelRows) * sizeof(float);
  return l;
}

void PackQ8(const float* w, int64_t out, int64_t in, uint8_t* dst) {
  const Q8Layout l = Q8Layout::For(out, in);
  if (l.bytes == 0) return;
  // Padding rows and columns hold q = 0 (stored 128) and s = 0.
  std::memset(dst, 128, l.quant_bytes);
  std::memset(dst + l.quant_bytes, 0, l.bytes - l.quant_bytes);
  auto* scales = reinterpret_cast<float*>(dst + l.scale_offset);
  for (int64_t o = 0; o < out; ++o) {
    const float* row = w + o * in;
    for (int64_t b = 0; b < l.blocks; ++b) {
      const int64_t k0 = b * kQ8Block, k1 = k0 + kQ8Block < in ? k0 + kQ8Block : in;
      float scale, inv;
      BlockScale(BlockMax(row, k0, k1), &scale, &inv);
      scales[ScaleIndex(l, o, b)] = scale;
      for (int64_t k = k0; k < k1; ++k) {
        dst[QuantIndex(l, o, k)] = static_cast<uint8_t>(QuantizeOne(row[k], inv) + 128);
      }
    }
  }
}

float Q8Weight(const uint8_t* packed, int64_t out, int64_t in, int64_t row, int64_t col) {
  const Q8Layout l = Q8Layout::For(out, in);
  const int q = static_cast<int>(packed[QuantIndex(l, row, col)]) - 128;
  return Scales(packed, l)[ScaleIndex(l, row, col / kQ8Block)] * static_cast<float>(q);
}

void QuantizeActivations(const float* x, int64_t tokens, int64_t in, Q8Activations* a) {
  a->tokens = tokens;
  a->blocks = (in + kQ8Block - 1) / kQ8Block;
  a->in_pad = a->blocks * kQ8Block;
  a->q.resize(static_cast<size_t>(tokens * a->in_pad));
  a->scale.resize(static_cast<size_t>(tokens * a->blocks));
  a->comp.resize(static_cast<size_t>(tokens * a->blocks));
  for (int64_t t = 0; t < tokens; ++t) {
    const float* xt = x + t * in;
    int8_t* qt = a->q.data() + t * a->in_pad;
    for (int64_t b = 0; b < a->blocks; ++b) {
      const int64_t k0 = b * kQ8Block, k1 = k0 + kQ8Block < in ? k0 + kQ8Block : in;
      float scale, inv;
      BlockScale(BlockMax(xt, k0, k1), &scale, &inv);
      int32_t sum = 0;
      for (int64_t k = k0; k < k1; ++k) {
        qt[k] = QuantizeOne(xt[k], inv);
        sum += qt[k];
      }
      for (int64_t k = k1; k < k0 + kQ8Block; ++k) qt[k] = 0;
      a->scale[static_cast<size_t>(t * a->blocks + b)] = scale;
      a->comp[static_cast<size_t>(t * a->blocks + b)] = 128 * sum;
    }
  }
}

void Q8LinearReference(const Q8Activations& a, const uint8_t* packed, const float* bias, float* y, int64_t in,
                       int64_t out, bool accumulate) {
  const Q8Layout l = Q8Layout::For(out, in);
  const float* scales = Scales(packed, l);
  for (int64_t t = 0; t < a.tokens; ++t) {
    const int8_t* xq = a.q.data() + t * a.in_pad;
    for (int64_t o = 0; o < out; ++o) {
      float acc = 0.0f;
      for (int64_t b = 0; b < l.blocks; ++b) {
        int32_t dot = 0;
        for (int64_t k = b * kQ8Block; k < (b + 1) * kQ8Block; ++k) {
          dot += (static_cast<int32_t>(packed[QuantIndex(l, o, k)]) - 128) * xq[k];
        }
        const float s = scales[ScaleIndex(l, o, b)] * a.scale[static_cast<size_t>(t * a.blocks + b)];
        acc = std::fma(static_cast<float>(dot), s, acc);
      }
      Store(y + t * out, acc, bias, o, accumulate);
    }
  }
}

#if SHARDSERVE_Q8_AVX2
namespace {

// One 16-row panel x N tokens: per group of 4 columns, the panel's 64 bytes are two ymm halves
// (rows 0-7, 8-15). Without VNNI the products go through vpmaddubsw, whose i16 pair sums would
// saturate on the biased bytes, so the weights are re-signed (q = byte ^ 0x80) and multiplied as
// |q| (unsigned) with the token's bytes carrying q's sign: at most 2 * 127 * 127 per pair.
template <int N>
void PanelAvx2(const Q8Activations& a, int64_t t0, const uint8_t* quants, const float* scales, const Q8Layout& l,
               int64_t panel, const float* bias, float* y, int64_t out, bool accumulate) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 accf[N][2];
  for (int t = 0; t < N; ++t) accf[t][0] = accf[t][1] = _mm256_setzero_ps();
  const uint8_t* wp = quants + panel * l.in_pad * kQ8PanelRows;
  for (int64_t b = 0; b < l.blocks; ++b) {
    __m256i acc[N][2];
    for (int t = 0; t < N; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_si256();
    for (int64_t g = b * (kQ8Block / 4); g < (b + 1) * (kQ8Block / 4); ++g) {
      __m256i ws[2], wabs[2];
      for (int h = 0; h < 2; ++h) {
        ws[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + g * 64 + h * 32)), flip);
        wabs[h] = _mm256_abs_epi8(ws[h]);
      }
      for (int t = 0; t < N; ++t) {
        int32_t x4;
        std::memcpy(&x4, a.q.data() + (t0 + t) * a.in_pad + g * 4, 4);
        const __m256i xb = _mm256_set1_epi32(x4);
        for (int h = 0; h < 2; ++h) {
          const __m256i p16 = _mm256_maddubs_epi16(wabs[h], _mm256_sign_epi8(xb, ws[h]));
          acc[t][h] = _mm256_add_epi32(acc[t][h], _mm256_madd_epi16(p16, ones));
        }
      }
    }
    const float* sw = scales + (panel * l.blocks + b) * kQ8PanelRows;
    for (int t = 0; t < N; ++t) {
      const __m256 sx = _mm256_set1_ps(a.scale[static_cast<size_t>((t0 + t) * a.blocks + b)]);
      for (int h = 0; h < 2; ++h) {
        const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(sw + h * 8), sx);
        accf[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t][h]), s, accf[t][h]);
      }
    }
  }
  const int64_t o0 = panel * kQ8PanelRows;
  for (int t = 0; t < N; ++t) {
    float v[kQ8PanelRows];
    _mm256_storeu_ps(v, accf[t][0]);
    _mm256_storeu_ps(v + 8, accf[t][1]);
    float* yt = y + (t0 + t) * out;
    for (int64_t r = 0; r < kQ8PanelRows && o0 + r < out; ++r) Store(yt, v[r], bias, o0 + r, accumulate);
  }
}

}  // namespace

void Q8LinearAvx2(const Q8Activations& a, const uint8_t* packed, const float* bias, float* y, int64_t in,
                  int64_t out, bool accumulate) {
  const Q8Layout l = Q8Layout::For(out, in);
  const float* scales = Scales(packed, l);
  for (int64_t p = 0; p < l.panels; ++p) {
    int64_t t = 0;
    for (; t + 2 <= a.tokens; t += 2) PanelAvx2<2>(a, t, packed, scales, l, p, bias, y, out, accumulate);
    if (t < a.tokens) PanelAvx2<1>(a, t, packed, scales, l, p, bias, y, out, accumulate);
  }
}
#else
void Q8LinearAvx2(const Q8Activations& a, const uint8_t* packed, const float* bias, float* y, int64_t in,
                  int64_t out, bool accumulate) {
  Q8LinearReference(a, packed, bias, y, in, out, accumulate);
}
#endif

void Q8Linear(const float* x, const uint8_t* packed, const float* bias, float* y, int64_t tokens, int64_t in,
              int64_t out, bool accumulate) {
  if (tokens == 0 || out == 0) return;
  thread_local Q8Activations a;
  QuantizeActivations(x, tokens, in, &a);
  if (HaveAvx512Vnni()) {
    Q8LinearVnni(a, packed, bias, y, in, out, accumulate);
  } else {
    Q8LinearAvx2(a, packed, bias, y, in, out, accumulate);
  }
}

}  // namespace shardserve::kernels::cpu

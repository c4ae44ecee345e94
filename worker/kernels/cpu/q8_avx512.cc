// The AVX-512 VNNI body of Q8Linear. The library is compiled for AVX2; the functions here carry
// their own target attribute and are only called after HaveAvx512Vnni() said yes.
#include <cstring>

#include "worker/kernels/cpu/q8.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define SHARDSERVE_Q8_VNNI 1
#define SHARDSERVE_VNNI_FN __attribute__((target("avx512f,avx512vl,avx512bw,avx512vnni")))
#endif

namespace shardserve::kernels::cpu {

#if SHARDSERVE_Q8_VNNI
namespace {

constexpr int64_t kGroupsPerBlock = kQ8Block / 4;
int64_t kSinglePanelMaxTokens = 2;

// Rows [o0, o0 + 16) of token row yt: v (+ bias) (+ yt), the rows at or past `out` left alone.
SHARDSERVE_VNNI_FN inline void StorePanel(__m512 v, const float* bias, float* yt, int64_t o0, int64_t out,
                                          bool accumulate) {
  const int64_t n = out - o0 < kQ8PanelRows ? out - o0 : kQ8PanelRows;
  const auto m = static_cast<__mmask16>((1u << static_cast<unsigned>(n)) - 1u);
  if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + o0));
  if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, yt + o0));
  _mm512_mask_storeu_ps(yt + o0, m, v);
}

// P panels (16 rows each) x T tokens over the whole row. Per group of 4 columns: one 64-byte load
// per panel and one 4-byte broadcast per token feed P*T vpdpbusd. The int32 sums of a block are
// kept in S interleaved accumulators (independent dependency chains when P*T is small), then
// corrected for the weights' +128 bias, scaled by sw*sx and added into f32 with one FMA.
template <int P, int T, int S>
SHARDSERVE_VNNI_FN inline void Tile(const Q8Activations& a, int64_t t0, const uint8_t* quants, const float* scales,
                                    int64_t blocks, int64_t in_pad, int64_t panel0, const float* bias, float* y,
                                    int64_t out, bool accumulate) {
  __m512 accf[P][T];
  for (int p = 0; p < P; ++p) {
    for (int t = 0; t < T; ++t) accf[p][t] = _mm512_setzero_ps();
  }
  const uint8_t* wp[P];
  for (int p = 0; p < P; ++p) wp[p] = quants + (panel0 + p) * in_pad * kQ8PanelRows;
  const int8_t* xq[T];
  for (int t = 0; t < T; ++t) xq[t] = a.q.data() + (t0 + t) * a.in_pad;
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i acc[P][T][S];
    for (int p = 0; p < P; ++p) {
      for (int t = 0; t < T; ++t) {
        for (int s = 0; s < S; ++s) acc[p][t][s] = _mm512_setzero_si512();
      }
    }
    const int64_t g0 = b * kGroupsPerBlock;
    for (int64_t g = g0; g < g0 + kGroupsPerBlock; g += S) {
      for (int s = 0; s < S; ++s) {
        __m512i wv[P];
        for (int p = 0; p < P; ++p) wv[p] = _mm512_loadu_si512(wp[p] + (g + s) * 64);
        for (int t = 0; t < T; ++t) {
          int32_t x4;
          std::memcpy(&x4, xq[t] + (g + s) * 4, 4);
          const __m512i xb = _mm512_set1_epi32(x4);
          for (int p = 0; p < P; ++p) acc[p][t][s] = _mm512_dpbusd_epi32(acc[p][t][s], wv[p], xb);
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      const size_t tb = static_cast<size_t>((t0 + t) * a.blocks + b);
      const __m512 sx = _mm512_set1_ps(a.scale[tb]);
      const __m512i comp = _mm512_set1_epi32(a.comp[tb]);
      for (int p = 0; p < P; ++p) {
        __m512i dot = acc[p][t][0];
        for (int s = 1; s < S; ++s) dot = _mm512_add_epi32(dot, acc[p][t][s]);
        dot = _mm512_sub_epi32(dot, comp);
        // (The zero-masked conversion: the plain one trips GCC 12's -Wmaybe-uninitialized once inlined.)
        const __m512 sw = _mm512_loadu_ps(scales + ((panel0 + p) * blocks + b) * kQ8PanelRows);
        accf[p][t] = _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(0xFFFF, dot), _mm512_mul_ps(sw, sx), accf[p][t]);
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    for (int p = 0; p < P; ++p) {
      StorePanel(accf[p][t], bias, y + (t0 + t) * out, (panel0 + p) * kQ8PanelRows, out, accumulate);
    }
  }
}

// Tile<P, n, S(n)> for a run-time n in [1, N]: two accumulators per sum when fewer than 4 chains
// would run otherwise.
template <int P, int N>
SHARDSERVE_VNNI_FN inline void TileN(int64_t n, const Q8Activations& a, int64_t t0, const uint8_t* quants,
                                     const float* scales, int64_t blocks, int64_t in_pad, int64_t panel0,
                                     const float* bias, float* y, int64_t out, bool accumulate) {
  if constexpr (N >= 1) {
    if (n == N) {
      constexpr int kS = P * N >= 4 ? 1 : 4 / (P * N);
      Tile<P, N, kS>(a, t0, quants, scales, blocks, in_pad, panel0, bias, y, out, accumulate);
    } else {
      TileN<P, N - 1>(n, a, t0, quants, scales, blocks, in_pad, panel0, bias, y, out, accumulate);
    }
  }
}

// All tokens for panels [panel0, panel0 + P), in the fewest groups of at most T of near-equal
// sizes.
template <int P, int T>
SHARDSERVE_VNNI_FN void Panels(const Q8Activations& a, const uint8_t* quants, const float* scales, int64_t blocks,
                               int64_t in_pad, int64_t panel0, const float* bias, float* y, int64_t out,
                               bool accumulate) {
  const int64_t groups = (a.tokens + T - 1) / T;
  const int64_t base = a.tokens / groups, extra = a.tokens % groups;
  int64_t t = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t n = base + (g < extra ? 1 : 0);
    TileN<P, T>(n, a, t, quants, scales, blocks, in_pad, panel0, bias, y, out, accumulate);
    t += n;
  }
}

}  // namespace

bool HaveAvx512Vnni() {
  static const bool have = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
  }();
  return have;
}

void Q8LinearVnni(const Q8Activations& a, const uint8_t* packed, const float* bias, float* y, int64_t in,
                  int64_t out, bool accumulate) {
  if (a.tokens <= 0) return;
  const Q8Layout l = Q8Layout::For(out, in);
  const auto* scales = reinterpret_cast<const float*>(packed + l.scale_offset);
  constexpr int kP = 2, kT = 4;
  int64_t p = 0;
  if (a.tokens <= kSinglePanelMaxTokens) {
    for (; p < l.panels; ++p) Panels<1, kT>(a, packed, scales, l.blocks, l.in_pad, p, bias, y, out, accumulate);
    return;
  }
  for (; p + kP <= l.panels; p += kP) Panels<kP, kT>(a, packed, scales, l.blocks, l.in_pad, p, bias, y, out, accumulate);
  if (p < l.panels) Panels<1, kT>(a, packed, scales, l.blocks, l.in_pad, p, bias, y, out, accumulate);
}

#else

bool HaveAvx512Vnni() { return false; }

void Q8LinearVnni(const Q8Activations& a, const uint8_t* packed, const float* bias, float* y, int64_t in,
                  int64_t out, bool accumulate) {
  Q8LinearAvx2(a, packed, bias, y, in, out, accumulate);
}

#endif

}  // namespace shardserve::kernels::cpu

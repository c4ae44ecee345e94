// AVX-512 variants of the small-batch Linear kernels. The library is compiled for AVX2 so that the
// binary runs on any x86-64-v3 CPU; the functions here carry their own target attribute and are
// only called after HaveAvx512() said yes.
#include "worker/kernels/cpu/gemv.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define SHARDSERVE_GEMV_AVX512 1
#define SHARDSERVE_AVX512_FN __attribute__((target("avx512f,avx512vl,avx512bw")))
#endif

namespace shardserve::kernels::cpu {

#if SHARDSERVE_GEMV_AVX512
namespace {

inline void Store(float* y, float v, const float* bias, int64_t o, bool accumulate) {
  if (bias != nullptr) v += bias[o];
  y[o] = accumulate ? y[o] + v : v;
}

// Lanes [0, n) set, for the last partial vector of a row (masked lanes are neither read nor
// faulted on).
SHARDSERVE_AVX512_FN inline __mmask16 TailMask(int64_t n) {
  return static_cast<__mmask16>((1u << static_cast<unsigned>(n)) - 1u);
}

// Sum of the 16 lanes. Written with the zero-masked forms of the shuffles: the plain forms (and
// _mm512_reduce_add_ps) go through _mm*_undefined_ps, which GCC 12 reports as -Wuninitialized
// once inlined.
SHARDSERVE_AVX512_FN inline float HorizontalSum(__m512 v) {
  constexpr __mmask16 kAll = 0xFFFF;
  v = _mm512_add_ps(v, _mm512_maskz_shuffle_f32x4(kAll, v, v, 0x4E));  // + the other 256-bit half
  v = _mm512_add_ps(v, _mm512_maskz_shuffle_f32x4(kAll, v, v, 0xB1));  // + the other 128-bit quarter
  __m128 q = _mm512_maskz_extractf32x4_ps(0xF, v, 0);
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

// [sum(a), sum(b), sum(c), sum(d)]: the four reductions share their shuffles, and the four
// outputs of a token in a 4-row tile are neighbours in y, stored as one vector.
SHARDSERVE_AVX512_FN inline __m128 Sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  constexpr __mmask16 kAll = 0xFFFF;
  // 128-bit quarters 0-1 hold a folded to 8 lanes, 2-3 hold b (likewise c and d).
  const __m512 ab =
      _mm512_add_ps(_mm512_maskz_shuffle_f32x4(kAll, a, b, 0x44), _mm512_maskz_shuffle_f32x4(kAll, a, b, 0xEE));
  const __m512 cd =
      _mm512_add_ps(_mm512_maskz_shuffle_f32x4(kAll, c, d, 0x44), _mm512_maskz_shuffle_f32x4(kAll, c, d, 0xEE));
  // Quarter i holds 4 partial sums of the i-th input.
  __m512 q = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(kAll, ab, cd, 0x88),
                           _mm512_maskz_shuffle_f32x4(kAll, ab, cd, 0xDD));
  q = _mm512_add_ps(q, _mm512_maskz_permute_ps(kAll, q, 0xB1));  // pairs within each quarter
  q = _mm512_add_ps(q, _mm512_maskz_permute_ps(kAll, q, 0x4E));  // every lane of quarter i: sum i
  return _mm512_maskz_extractf32x4_ps(0xF, _mm512_maskz_compress_ps(0x1111, q), 0);
}

// 16 weights as f32; bfloat16 ones are zero-extended to 32 bits and moved to the upper half
// (zero-masked forms with all lanes set, for the reason given at HorizontalSum). The masked loads
// read (and fault on) the lanes of `m` only.
SHARDSERVE_AVX512_FN inline __m512 WidenBf16x16(__m256i v) {
  constexpr __mmask16 kAll = 0xFFFF;
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAll, _mm512_maskz_cvtepu16_epi32(kAll, v), 16));
}
SHARDSERVE_AVX512_FN inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
SHARDSERVE_AVX512_FN inline __m512 Load16(const uint16_t* p) {
  return WidenBf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
SHARDSERVE_AVX512_FN inline __m512 MaskLoad16(__mmask16 m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
SHARDSERVE_AVX512_FN inline __m512 MaskLoad16(__mmask16 m, const uint16_t* p) {
  return WidenBf16x16(_mm256_maskz_loadu_epi16(m, p));
}

// R weight rows x T tokens of zmm accumulators over the whole of `in` (R*T + R + 1 of the 32
// registers), so each loaded weight vector feeds T FMAs and each token vector R. The last
// in % 16 columns are one masked step. `prefetch`, when set, is a row block further on, requested
// into L2 one cache line per row per step while this tile computes (every other step for bfloat16
// weights, whose steps are half a line). W is float or uint16_t (bfloat16 bits).
template <int R, int T, typename W>
SHARDSERVE_AVX512_FN inline void Tile(const W* w, const float* x, float* y, const float* bias, int64_t o,
                                      int64_t in, int64_t out, bool accumulate, const W* prefetch) {
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  }
  const W* wr = w + o * in;
  constexpr int64_t kLine = 64 / sizeof(W);
  int64_t k = 0;
  for (; k + 16 <= in; k += 16) {
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = Load16(wr + r * in + k);
    if (prefetch != nullptr && (k & (kLine - 1)) == 0) {
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(prefetch + r * in + k), _MM_HINT_T1);
    }
    for (int t = 0; t < T; ++t) {
      const __m512 xv = _mm512_loadu_ps(x + t * in + k);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  if (k < in) {
    const __mmask16 m = TailMask(in - k);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = MaskLoad16(m, wr + r * in + k);
    for (int t = 0; t < T; ++t) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + t * in + k);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  if constexpr (R == 4) {
    for (int t = 0; t < T; ++t) {
      float* yt = y + t * out + o;
      __m128 v = Sum4(acc[0][t], acc[1][t], acc[2][t], acc[3][t]);
      if (bias != nullptr) v = _mm_add_ps(v, _mm_loadu_ps(bias + o));
      if (accumulate) v = _mm_add_ps(_mm_loadu_ps(yt), v);
      _mm_storeu_ps(yt, v);
    }
  } else {
    for (int t = 0; t < T; ++t) {
      for (int r = 0; r < R; ++r) Store(y + t * out, HorizontalSum(acc[r][t]), bias, o + r, accumulate);
    }
  }
}

// Tile<R, n> for a run-time n in [1, N].
template <int R, int N, typename W>
SHARDSERVE_AVX512_FN inline void TileN(int64_t n, const W* w, const float* x, float* y, const float* bias, int64_t o,
                                       int64_t in, int64_t out, bool accumulate, const W* prefetch) {
  if constexpr (N >= 1) {
    if (n == N) {
      Tile<R, N, W>(w, x, y, bias, o, in, out, accumulate, prefetch);
    } else {
      TileN<R, N - 1, W>(n, w, x, y, bias, o, in, out, accumulate, prefetch);
    }
  }
}

// All tokens for rows [o, o + R): the tokens are split into the fewest groups of at most T, of
// near-equal sizes (8 tokens with T = 6 run as 4 + 4, not 6 + 2), so no group is a thin tile.
// Every group issues the prefetches of a later block, not only the first: the repeats (mostly L2
// hits) measured 1.1-1.5x faster at 8-16 tokens with cold weights than prefetching once, which ran
// at about the sum of the compute and memory times rather than the larger of the two.
template <int R, int T, typename W>
SHARDSERVE_AVX512_FN void RowBlock(const float* x, const W* w, const float* bias, float* y, int64_t tokens,
                                   int64_t in, int64_t out, bool accumulate, int64_t o, const W* prefetch) {
  const int64_t groups = (tokens + T - 1) / T;
  const int64_t base = tokens / groups, extra = tokens % groups;
  int64_t t = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t n = base + (g < extra ? 1 : 0);
    TileN<R, T, W>(n, w, x + t * in, y + t * out, bias, o, in, out, accumulate, prefetch);
    t += n;
  }
}

// RowBlock<r, T> for a run-time r in [1, N] (the rows left after the last full block).
template <int N, int T, typename W>
SHARDSERVE_AVX512_FN void RowBlockN(int64_t r, const float* x, const W* w, const float* bias, float* y,
                                    int64_t tokens, int64_t in, int64_t out, bool accumulate, int64_t o) {
  if constexpr (N >= 1) {
    if (r == N) {
      RowBlock<N, T, W>(x, w, bias, y, tokens, in, out, accumulate, o, nullptr);
    } else {
      RowBlockN<N - 1, T, W>(r, x, w, bias, y, tokens, in, out, accumulate, o);
    }
  }
}

// kAhead: prefetch distance in row blocks.
template <int R, int T, int64_t kAhead, typename W>
SHARDSERVE_AVX512_FN void Blocked(const float* x, const W* w, const float* bias, float* y, int64_t tokens,
                                  int64_t in, int64_t out, bool accumulate, int64_t row_begin, int64_t row_end) {
  if (tokens <= 0) return;
  int64_t o = row_begin;
  for (; o + R <= row_end; o += R) {
    const W* next = o + (kAhead + 1) * R <= row_end ? w + (o + kAhead * R) * in : nullptr;
    RowBlock<R, T, W>(x, w, bias, y, tokens, in, out, accumulate, o, next);
  }
  if (o < row_end) RowBlockN<R - 1, T, W>(row_end - o, x, w, bias, y, tokens, in, out, accumulate, o);
}

}  // namespace

bool HaveAvx512() {
  static const bool have = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw");
  }();
  return have;
}

void BlockedLinearAvx512(const float* x, const float* w, const float* bias, float* y, int64_t tokens, int64_t in,
                         int64_t out, bool accumulate, int64_t row_begin, int64_t row_end) {
  // 4 rows x 6 tokens measured best or level among 4x4, 4x5, 4x6, 6x4, 8x3, 3x8 and 2x12 at 8-64
  // tokens (shardserve-bench-kernels, Zen 4); 3x8 and 2x12 were 20-50% slower (GCC 12 compiles
  // them with a token load per FMA), 8x3 10-25% slower.
  // Prefetch distance: 3 row blocks measured best or level among 1, 2, 3, 4 and 6 at 8-16 tokens.
  Blocked<4, 6, 3>(x, w, bias, y, tokens, in, out, accumulate, row_begin, row_end);
}

void BlockedLinearBf16Avx512(const float* x, const uint16_t* w, const float* bias, float* y, int64_t tokens,
                             int64_t in, int64_t out, bool accumulate, int64_t row_begin, int64_t row_end) {
  // The same tiles; 6 row blocks ahead (the same bytes ahead as the f32 body's 3) measured level
  // with 3 at 4-8 tokens.
  Blocked<4, 6, 6>(x, w, bias, y, tokens, in, out, accumulate, row_begin, row_end);
}

#else

bool HaveAvx512() { return false; }

void BlockedLinearAvx512(const float* x, const float* w, const float* bias, float* y, int64_t tokens, int64_t in,
                         int64_t out, bool accumulate, int64_t row_begin, int64_t row_end) {
  BlockedLinearAvx2(x, w, bias, y, tokens, in, out, accumulate, row_begin, row_end);
}

void BlockedLinearBf16Avx512(const float* x, const uint16_t* w, const float* bias, float* y, int64_t tokens,
                             int64_t in, int64_t out, bool accumulate, int64_t row_begin, int64_t row_end) {
  BlockedLinearBf16Avx2(x, w, bias, y, tokens, in, out, accumulate, row_begin, row_end);
}

#endif

}  // namespace shardserve::kernels::cpu

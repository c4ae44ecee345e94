// The CPU attention's softmax: e^x by a polynomial the compiler vectorizes (libm's expf is one call
// per score, and took ~12% of a small model's prefill), and the row's maximum and sum kept in 8
// partial values. Every element's result depends only on its own input, the row's maximum and
// the row's sum, and each is formed in a fixed order of IEEE operations (fused multiply-adds
// spelled out): the same bits whether the loop runs as vectors or one element at a time.
#ifndef SHARDSERVE_WORKER_KERNELS_CPU_SOFTMAX_H_
#define SHARDSERVE_WORKER_KERNELS_CPU_SOFTMAX_H_

#include <bit>
#include <cmath>
#include <cstdint>

#include "worker/kernels/shared/attention_math.h"

namespace shardserve::kernels::cpu {

// e^x for x <= 0, within 2 units in the last place of the float nearest e^x, 0 below -87 (where
// e^x is under 1.7e-38, the smallest normal float; a softmax weight there is nothing), NaN for NaN.
// x = k ln 2 + r with |r| <= ln 2 / 2 (ln 2 split in two parts so that k ln 2 is exact), e^r by
// the minimax polynomial of degree 6 used by Cephes' expf, 2^k built in the exponent bits.
inline float ExpNonPositive(float in) {
  const bool in_range = in >= -87.0f;  // false below, and for NaN
  const float x = in_range ? in : -87.0f;
  // Round x log2(e) to the nearest integer by adding and removing 1.5 * 2^23.
  const float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = std::fma(k, -0.693359375f, x);
  r = std::fma(k, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  const float y = std::fma(p * r, r, r) + 1.0f;
  const float two_k = std::bit_cast<float>(static_cast<uint32_t>(static_cast<int32_t>(k) + 127) << 23);
  const float e = in_range ? y * two_k : 0.0f;
  return in == in ? e : in;
}

// x[0, n) = softmax(x[0, n)) in place; n >= 1. With `sink` (one logit, ModelSpec::attention_sinks),
// the softmax of x and the sink, the sink's own weight left out.
inline void SoftmaxInPlace(float* x, int64_t n, const float* sink = nullptr) {
  constexpr int kLanes = 8;
  float part[kLanes];
  for (int l = 0; l < kLanes; ++l) part[l] = x[0];
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) part[l] = x[i + l] > part[l] ? x[i + l] : part[l];
  }
  for (; i < n; ++i) part[0] = x[i] > part[0] ? x[i] : part[0];
  float m = part[0];
  for (int l = 1; l < kLanes; ++l) m = part[l] > m ? part[l] : m;
  for (i = 0; i < n; ++i) x[i] = ExpNonPositive(x[i] - m);
  for (int l = 0; l < kLanes; ++l) part[l] = 0.0f;
  for (i = 0; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) part[l] += x[i + l];
  }
  for (int w = kLanes / 2; w >= 1; w /= 2) {
    for (int l = 0; l < w; ++l) part[l] += part[l + w];
  }
  float sum = part[0];
  for (; i < n; ++i) sum += x[i];
  sum += SinkMass(sink, 0, m);
  const float inv = 1.0f / sum;
  for (i = 0; i < n; ++i) x[i] *= inv;
}

}  // namespace shardserve::kernels::cpu

#endif  // SHARDSERVE_WORKER_KERNELS_CPU_SOFTMAX_H_

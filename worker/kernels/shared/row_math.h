// Per-row math shared by the CPU and CUDA backends. Every function is SHARDSERVE_HD (host and
// device), works on one row or one head, allocates nothing and has no failure mode: callers
// validate shapes in their Params::Validate(). The CPU backend calls these in loops, so CPU tests
// cover the exact formulas the CUDA kernels use.
#ifndef SHARDSERVE_WORKER_KERNELS_SHARED_ROW_MATH_H_
#define SHARDSERVE_WORKER_KERNELS_SHARED_ROW_MATH_H_

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define SHARDSERVE_HD __host__ __device__ __forceinline__
#else
#define SHARDSERVE_HD inline
#endif

namespace shardserve::kernels {

// y = x / sqrt(mean(x^2) + eps) * weight, as Hugging Face's LlamaRMSNorm (f32 throughout).
// x, weight, y: [n]. y may alias x.
SHARDSERVE_HD void RmsNormRow(const float* x, const float* weight, float* y, int n, float eps) {
  float ss = 0.f;
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(n) + eps);
  for (int i = 0; i < n; ++i) y[i] = weight[i] * (x[i] * inv);
}

// x += y, then out = RmsNormRow(x, weight): the residual add fused with the next norm. x, y, out,
// weight: [n]; out must not alias x or y.
SHARDSERVE_HD void AddRmsNormRow(float* x, const float* y, const float* weight, float* out, int n, float eps) {
  for (int i = 0; i < n; ++i) x[i] += y[i];
  RmsNormRow(x, weight, out, n, eps);
}

// Rotary embedding of one head in the Hugging Face "rotate_half" layout: element i rotates with
// element i + d/2. head: [d]; cos, sin: [d/2] for this position.
// RopePair rotates the one pair (i, i + d/2), as a GPU thread does.
SHARDSERVE_HD void RopePair(float* head, const float* cos, const float* sin, int d, int i) {
  const int h = d / 2;
  const float a = head[i];
  const float b = head[i + h];
  head[i] = a * cos[i] - b * sin[i];
  head[i + h] = b * cos[i] + a * sin[i];
}

SHARDSERVE_HD void RopeHead(float* head, const float* cos, const float* sin, int d) {
  for (int i = 0; i < d / 2; ++i) RopePair(head, cos, sin, d, i);
}

// In-place numerically stable softmax of x[n].
SHARDSERVE_HD void SoftmaxRow(float* x, int n) {
  float m = x[0];
  for (int i = 1; i < n; ++i) m = x[i] > m ? x[i] : m;
  float sum = 0.f;
  for (int i = 0; i < n; ++i) {
    x[i] = expf(x[i] - m);
    sum += x[i];
  }
  const float inv = 1.0f / sum;
  for (int i = 0; i < n; ++i) x[i] *= inv;
}

SHARDSERVE_HD float Silu(float x) { return x / (1.0f + expf(-x)); }

// PyTorch's gelu(x, approximate="tanh") (Gemma's gelu_pytorch_tanh), in f32.
SHARDSERVE_HD float GeluTanh(float x) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  return 0.5f * x * (1.0f + tanhf(kSqrt2OverPi * (x + 0.044715f * x * x * x)));
}

// The activation of a gated MLP (ModelSpec's Activation), as SiluMul and a gated LinearGroup take
// it (backend.h). Plain data here so that the kernels can name it.
enum class GateActivation : uint8_t {
  kSilu,      // x * sigmoid(x)
  kGeluTanh,  // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), PyTorch's gelu(approximate="tanh")
  // GPT-OSS's experts: with g = min(gate, 7) and u = clamp(up, -7, 7), g sigmoid(1.702 g) (u + 1).
  // The up term is part of the activation here, so GatedProduct applies it.
  kClampedSwiglu,
};

// GPT-OSS's clamped SwiGLU (transformers' GptOssExperts with swiglu_alpha 1.702 and swiglu_limit
// 7): the clamps keep NaN, as torch.clamp does.
inline constexpr float kSwigluAlpha = 1.702f;
inline constexpr float kSwigluLimit = 7.0f;
SHARDSERVE_HD float ClampedSwiglu(float gate, float up) {
  const float g = gate > kSwigluLimit ? kSwigluLimit : gate;
  const float u = up > kSwigluLimit ? kSwigluLimit : (up < -kSwigluLimit ? -kSwigluLimit : up);
  return g * (1.0f / (1.0f + expf(-(g * kSwigluAlpha)))) * (u + 1.0f);
}

// act(gate) * up: one element of a gated MLP's product. The one formula of the SiluMul kernels and
// of CUDA's gated GEMV, so that the fused and the separate ops give the same f32 values.
SHARDSERVE_HD float GatedProduct(GateActivation act, float gate, float up) {
  if (act == GateActivation::kClampedSwiglu) return ClampedSwiglu(gate, up);
  return (act == GateActivation::kGeluTanh ? GeluTanh(gate) : Silu(gate)) * up;
}

// Soft-capping: cap * tanh(x / cap) (Gemma-2's attention scores and final logits); cap > 0.
SHARDSERVE_HD float SoftCap(float x, float cap) { return cap * tanhf(x / cap); }

// The indices of the k largest of values[0 .. n), largest first (ties: lower index first, as
// torch.topk on CPU); k <= n.
SHARDSERVE_HD void TopKIndices(const float* values, int n, int k, int* out) {
  for (int j = 0; j < k; ++j) {
    int best = -1;
    for (int e = 0; e < n; ++e) {
      bool taken = false;
      for (int i = 0; i < j; ++i) taken = taken || out[i] == e;
      if (!taken && (best < 0 || values[e] > values[best])) best = e;
    }
    out[j] = best;
  }
}

// MoE routing of one token: softmax over `num_experts` router logits, then the `k` largest
// probabilities (ties: lower expert index first, as torch.topk on CPU), optionally renormalised to
// sum to 1. probs: scratch [num_experts] (overwritten); experts, weights: [k].
SHARDSERVE_HD void RouteTopK(const float* logits, float* probs, int num_experts, int k, bool renormalize,
                             int* experts, float* weights) {
  for (int e = 0; e < num_experts; ++e) probs[e] = logits[e];
  SoftmaxRow(probs, num_experts);
  TopKIndices(probs, num_experts, k, experts);
  float total = 0.f;
  for (int j = 0; j < k; ++j) {
    weights[j] = probs[experts[j]];
    total += weights[j];
  }
  if (renormalize) {
    for (int j = 0; j < k; ++j) weights[j] /= total;
  }
}

}  // namespace shardserve::kernels

#endif  // SHARDSERVE_WORKER_KERNELS_SHARED_ROW_MATH_H_

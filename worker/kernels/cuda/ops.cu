// f32 CUDA kernels that compute what the CPU backend computes. Per-row formulas come from
// kernels/shared/row_math.h (RopeHead, Silu) or repeat it term for term where the row is split
// across a block (RmsNorm's normalisation, the attention softmax), so the two backends differ only
// in summation order.
#include "worker/kernels/cuda/ops.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "worker/kernels/cuda/kv_cache.cuh"
#include "worker/kernels/cuda/pdl.cuh"
#include "worker/kernels/cuda/row_norm.cuh"
#include "worker/kernels/shared/attention_math.h"
#include "worker/kernels/shared/row_math.h"

namespace shardserve::kernels::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kRowThreads = kRowBlockThreads;  // row kernels: one block per row (row_norm.cuh)
constexpr int kElementThreads = 256;  // elementwise kernels
constexpr int kRopeThreads = 256;     // threads per token, one per rotated pair
constexpr int64_t kMaxGrid = 65535;   // grid-stride beyond this (also the y/z grid limit)

unsigned GridFor(int64_t blocks) { return static_cast<unsigned>(blocks < kMaxGrid ? blocks : kMaxGrid); }

unsigned ElementGrid(int64_t n) { return GridFor((n + kElementThreads - 1) / kElementThreads); }

// Threads per block for a row of `width` elements: enough warps to cover it, at most kRowThreads.
// The norm kernels' reduction is row_norm.cuh's, which the 16-bit GEMV's normed form repeats.
unsigned RowThreads(int64_t width) { return RowBlockThreads(width); }


__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum of `v` over the block; every thread gets the same value (each adds the warp sums in the same
// order). blockDim.x must be a multiple of 32; scratch: [blockDim.x / 32] shared floats.
__device__ float BlockSum(float v, float* scratch) {
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  v = WarpSum(v);
  __syncthreads();  // scratch may still be read from a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < static_cast<int>(blockDim.x / kWarp); ++w) total += scratch[w];
  return total;
}

// dst[i, :] = src[idx[i], :]  (GatherRows; Embedding is in linear16.cu, over every weight dtype).
__global__ void GatherRowsKernel(const float* src, const int32_t* idx, float* dst, int64_t count, int64_t width) {
  pdl::LaunchDependents();
  pdl::Wait();
  for (int64_t i = blockIdx.x; i < count; i += gridDim.x) {
    const float* s = src + int64_t{idx[i]} * width;
    float* d = dst + i * width;
    for (int64_t e = threadIdx.x; e < width; e += blockDim.x) d[e] = s[e];
  }
}

__global__ void BiasAddKernel(const float* bias, float* y, int64_t tokens, int64_t out) {
  pdl::LaunchDependents();
  pdl::Wait();
  const int64_t n = tokens * out;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    y[i] += bias[i % out];
  }
}

// The normalised value as the norm kernels store it: f32, or rounded to nearest even into a 16-bit
// type as linear16.cu's cast does (the normed GEMM path's activations).
__device__ __forceinline__ float StoreAs(float v, float*) { return v; }
__device__ __forceinline__ __nv_bfloat16 StoreAs(float v, __nv_bfloat16*) { return __float2bfloat16_rn(v); }
__device__ __forceinline__ __half StoreAs(float v, __half*) { return __float2half_rn(v); }

// One block per row. The sum of squares is a block reduction; the rest is RmsNormRow's formula.
template <typename TOut>
__global__ void RmsNormKernel(const float* x, const float* weight, TOut* y, int64_t tokens, int64_t hidden,
                              float eps) {
  pdl::LaunchDependents();
  pdl::Wait();
  __shared__ float scratch[kRowThreads / kWarp];
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const float* xr = x + t * hidden;
    TOut* yr = y + t * hidden;
    float ss = 0.f;
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) ss += xr[i] * xr[i];
    ss = BlockSum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / static_cast<float>(hidden) + eps);
    // y may alias x: each thread rewrites only the elements it alone read above.
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) yr[i] = StoreAs(weight[i] * (xr[i] * inv), yr);
  }
}

// RmsNormKernel and AddRmsNormKernel for rows of at most kPer * kRowThreads elements: each thread
// loads its kPer elements (and weights) at once into registers, so a row is read once and its
// loads are all in flight together (a decode step's norms are one row: latency, not bandwidth).
// kAdd: x + y is normalised and written to x_sum (which is x for AddRmsNorm; unused without
// kAdd). out may alias x. TOut: float, or a 16-bit type the values are rounded to (StoreAs).
template <int kPer, bool kAdd, typename TOut = float>
__global__ void __launch_bounds__(kRowThreads)
    RegisterNormKernel(const float* x, float* x_sum, const float* y, const float* weight, TOut* out, int64_t tokens,
                       int64_t hidden, float eps) {
  pdl::LaunchDependents();
  pdl::Wait();
  __shared__ float scratch[kRowThreads / kWarp];
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const float* xr = x + t * hidden;
    float v[kPer], wv[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int64_t i = threadIdx.x + int64_t{k} * blockDim.x;
      v[k] = i < hidden ? xr[i] : 0.f;
      if constexpr (kAdd) v[k] += i < hidden ? y[t * hidden + i] : 0.f;
      wv[k] = i < hidden ? weight[i] : 0.f;
    }
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      ss += v[k] * v[k];
      if constexpr (kAdd) {
        const int64_t i = threadIdx.x + int64_t{k} * blockDim.x;
        if (i < hidden) x_sum[t * hidden + i] = v[k];
      }
    }
    ss = BlockSum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / static_cast<float>(hidden) + eps);
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int64_t i = threadIdx.x + int64_t{k} * blockDim.x;
      if (i < hidden) out[t * hidden + i] = StoreAs(wv[k] * (v[k] * inv), out);
    }
  }
}

// Launches RegisterNormKernel when the row fits in registers; false when it does not.
template <bool kAdd, typename TOut = float>
bool LaunchRegisterNorm(const float* x, float* x_sum, const float* y, const float* weight, TOut* out, int64_t tokens,
                        int64_t hidden, float eps, cudaStream_t stream) {
  const unsigned threads = RowThreads(hidden);
  const int64_t per = (hidden + threads - 1) / threads;
  const unsigned grid = GridFor(tokens);
  if (per <= 4) {
    pdl::Launch(RegisterNormKernel<4, kAdd, TOut>, grid, threads, 0, stream, x, x_sum, y, weight, out, tokens, hidden,
                eps);
  } else if (per <= 8) {
    pdl::Launch(RegisterNormKernel<8, kAdd, TOut>, grid, threads, 0, stream, x, x_sum, y, weight, out, tokens, hidden,
                eps);
  } else if (per <= 16) {
    pdl::Launch(RegisterNormKernel<16, kAdd, TOut>, grid, threads, 0, stream, x, x_sum, y, weight, out, tokens, hidden,
                eps);
  } else if (per <= 32) {
    pdl::Launch(RegisterNormKernel<32, kAdd, TOut>, grid, threads, 0, stream, x, x_sum, y, weight, out, tokens, hidden,
                eps);
  } else {
    return false;
  }
  return true;
}

// RmsNorm into `out` of type TOut (float, __nv_bfloat16 or __half).
template <typename TOut>
cudaError_t LaunchRmsNormAs(const RmsNormParams& p, TOut* out, cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  if (LaunchRegisterNorm<false, TOut>(p.x, nullptr, nullptr, p.weight, out, p.tokens, p.hidden, p.eps, stream)) {
    return cudaGetLastError();
  }
  pdl::Launch(RmsNormKernel<TOut>, GridFor(p.tokens), RowThreads(p.hidden), 0, stream, p.x, p.weight, out, p.tokens,
              p.hidden, p.eps);
  return cudaGetLastError();
}

// One block per row: add y into x (each thread its own elements), then RmsNormKernel's formula.
__global__ void AddRmsNormKernel(float* x, const float* y, const float* weight, float* out, int64_t tokens,
                                 int64_t hidden, float eps) {
  pdl::LaunchDependents();
  pdl::Wait();
  __shared__ float scratch[kRowThreads / kWarp];
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    float* xr = x + t * hidden;
    const float* yr = y + t * hidden;
    float* outr = out + t * hidden;
    float ss = 0.f;
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
      const float v = xr[i] + yr[i];
      xr[i] = v;
      ss += v * v;
    }
    ss = BlockSum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / static_cast<float>(hidden) + eps);
    // Each thread reads back only the elements it wrote above.
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) outr[i] = weight[i] * (xr[i] * inv);
  }
}

// The rotation of one token, as RopeParams describe it (rotary_dim resolved: never 0).
struct RopeArgs {
  float* q;
  float* k;
  const int32_t* positions;
  const float* inv_freq;
  int64_t q_heads, kv_heads, head_dim;
  float position_scale;
  int64_t rotary_dim;
  float scale;
};

RopeArgs RopeArgsOf(const RopeParams& p) {
  return {.q = p.q, .k = p.k, .positions = p.positions, .inv_freq = p.inv_freq, .q_heads = p.q_heads,
          .kv_heads = p.kv_heads, .head_dim = p.head_dim, .position_scale = p.position_scale,
          .rotary_dim = p.rotary_dim > 0 ? p.rotary_dim : p.head_dim, .scale = p.scale};
}

// cos and sin of token t's angles into the block's shared table ([rotary_dim / 2] each; dynamic
// shared memory of RopeSharedBytes), between barriers: the previous token's users are done with it
// before, and every thread sees it after.
__device__ __forceinline__ void FillRopeTable(const RopeArgs& r, int64_t t, float* cos_s, float* sin_s) {
  const int64_t half = r.rotary_dim / 2;
  __syncthreads();
  // float32 angles in the CPU backend's order: (position * position_scale) * inv_freq[i].
  const float pos = static_cast<float>(r.positions[t]) * r.position_scale;
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
    const float angle = pos * r.inv_freq[i];
    cos_s[i] = cosf(angle) * r.scale;
    sin_s[i] = sinf(angle) * r.scale;
  }
  __syncthreads();
}

// One block per token: cos/sin of the token's angles in shared memory, then one thread per pair
// of elements of every head (consecutive threads, consecutive elements).
__global__ void RopeKernel(const RopeArgs r, int64_t tokens) {
  pdl::LaunchDependents();
  pdl::Wait();
  extern __shared__ float rope_smem[];
  const int64_t half = r.rotary_dim / 2;
  float* cos_s = rope_smem;         // [half]
  float* sin_s = rope_smem + half;  // [half]
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    FillRopeTable(r, t, cos_s, sin_s);
    for (int64_t idx = threadIdx.x; idx < (r.q_heads + r.kv_heads) * half; idx += blockDim.x) {
      const int64_t h = idx / half;
      float* head = h < r.q_heads ? r.q + (t * r.q_heads + h) * r.head_dim
                                  : r.k + (t * r.kv_heads + (h - r.q_heads)) * r.head_dim;
      RopePair(head, cos_s, sin_s, static_cast<int>(r.rotary_dim), static_cast<int>(idx % half));
    }
  }
}


// grid.y strides over sequences, grid.x over each sequence's rows; threads over a row's elements.
// T: a cache element type of kv_cache.cuh, each element stored with its ToCache (an FP8 cache: one
// byte per thread, consecutive threads consecutive bytes, so a warp's stores still coalesce).
template <typename T>
__global__ void KvWriteKernel(const float* k, const float* v, const AttnSeq* seqs, int64_t num_seqs,
                              const int32_t* block_table, T* cache_k, T* cache_v, int64_t block_size, int64_t row) {
  pdl::LaunchDependents();
  pdl::Wait();
  for (int64_t s = blockIdx.y; s < num_seqs; s += gridDim.y) {
    const AttnSeq seq = seqs[s];
    const int32_t* table = block_table + seq.table_begin;
    for (int64_t i = blockIdx.x; i < seq.q_len; i += gridDim.x) {
      const int64_t src = (int64_t{seq.q_begin} + i) * row;
      const int64_t dst = PagedCacheRow(table, seq.pos_begin + i, block_size) * row;
      for (int64_t e = threadIdx.x; e < row; e += blockDim.x) {
        cache_k[dst + e] = ToCache<T>(k[src + e]);
        cache_v[dst + e] = ToCache<T>(v[src + e]);
      }
    }
  }
}

// GatedProduct per element (linear16.cu's gated GEMV writes the same formula).
// Rope then KvWrite in one kernel (KvWriteParams::rope). KvWriteKernel's grid (grid.y over
// sequences, grid.x over each sequence's rows; the rows tile [0, tokens), so every token is one
// block's), RopeKernel's block: the token's cos/sin table, then one thread per rotated pair of every
// q and k head (RopePair, as RopeKernel), the thread that rotates a k pair also storing it in the
// cache; then k's unrotated tail (rotary_dim < head_dim) and v are stored. The values are Rope's and
// the cache addressing and rounding (ToCache: an FP8 cache's encoding too) KvWriteKernel's.
template <typename T>
__global__ void RopeKvWriteKernel(const RopeArgs r, const float* v, const AttnSeq* seqs, int64_t num_seqs,
                                  const int32_t* block_table, T* cache_k, T* cache_v, int64_t block_size) {
  pdl::LaunchDependents();
  pdl::Wait();
  extern __shared__ float rope_smem[];
  const int64_t half = r.rotary_dim / 2;
  const int64_t row = r.kv_heads * r.head_dim;
  float* cos_s = rope_smem;         // [half]
  float* sin_s = rope_smem + half;  // [half]
  for (int64_t s = blockIdx.y; s < num_seqs; s += gridDim.y) {
    const AttnSeq seq = seqs[s];
    const int32_t* table = block_table + seq.table_begin;
    for (int64_t i = blockIdx.x; i < seq.q_len; i += gridDim.x) {
      const int64_t t = int64_t{seq.q_begin} + i;
      FillRopeTable(r, t, cos_s, sin_s);
      const int64_t dst = PagedCacheRow(table, seq.pos_begin + i, block_size) * row;
      for (int64_t idx = threadIdx.x; idx < (r.q_heads + r.kv_heads) * half; idx += blockDim.x) {
        const int64_t h = idx / half;
        const int pair = static_cast<int>(idx % half);
        if (h < r.q_heads) {
          RopePair(r.q + (t * r.q_heads + h) * r.head_dim, cos_s, sin_s, static_cast<int>(r.rotary_dim), pair);
        } else {
          const int64_t e = (h - r.q_heads) * r.head_dim;  // the head's first element in a row
          float* head = r.k + t * row + e;
          RopePair(head, cos_s, sin_s, static_cast<int>(r.rotary_dim), pair);
          cache_k[dst + e + pair] = ToCache<T>(head[pair]);
          cache_k[dst + e + pair + half] = ToCache<T>(head[pair + half]);
        }
      }
      for (int64_t e = threadIdx.x; e < row; e += blockDim.x) {
        if (e % r.head_dim >= r.rotary_dim) cache_k[dst + e] = ToCache<T>(r.k[t * row + e]);
        cache_v[dst + e] = ToCache<T>(v[t * row + e]);
      }
    }
  }
}

template <typename T>
void LaunchRopeKvWriteTyped(const KvWriteParams& p, dim3 grid, cudaStream_t stream) {
  pdl::Launch(RopeKvWriteKernel<T>, grid, kRopeThreads, RopeSharedBytes(p.cache.head_dim), stream,
              RopeArgsOf(*p.rope), p.v, p.paged.seqs, p.paged.num_seqs, p.paged.block_table,
              static_cast<T*>(p.cache.k), static_cast<T*>(p.cache.v), p.cache.block_size);
}

template <GateActivation kAct>
__global__ void SiluMulKernel(const float* gate, const float* up, float* out, int64_t n) {
  pdl::LaunchDependents();
  pdl::Wait();
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = GatedProduct(kAct, gate[i], up[i]);
  }
}

__global__ void ScaleKernel(float* x, int64_t n, float scale, float softcap) {
  pdl::LaunchDependents();
  pdl::Wait();
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const float v = x[i] * scale;
    x[i] = softcap > 0.f ? SoftCap(v, softcap) : v;
  }
}

__global__ void AddKernel(float* x, const float* y, int64_t n) {
  pdl::LaunchDependents();
  pdl::Wait();
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    x[i] += y[i];
  }
}

// dst[rows[i], :] += scales[i] * src[i, :]. rows has no duplicates, so blocks never share a row.
__global__ void ScatterAddRowsKernel(const float* src, const int32_t* rows, const float* scales, float* dst,
                                     int64_t count, int64_t width) {
  pdl::LaunchDependents();
  pdl::Wait();
  for (int64_t i = blockIdx.x; i < count; i += gridDim.x) {
    float* d = dst + int64_t{rows[i]} * width;
    const float* s = src + i * width;
    const float sc = scales[i];
    for (int64_t e = threadIdx.x; e < width; e += blockDim.x) d[e] += sc * s[e];
  }
}

__global__ void ScaleRowsKernel(float* x, const float* scales, int64_t tokens, int64_t width) {
  pdl::LaunchDependents();
  pdl::Wait();
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const float s = scales[t];
    float* xr = x + t * width;
    for (int64_t e = threadIdx.x; e < width; e += blockDim.x) xr[e] *= s;
  }
}

__global__ void SigmoidScaleRowsKernel(float* x, const float* gate, int64_t tokens, int64_t width) {
  pdl::LaunchDependents();
  pdl::Wait();
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const float g = 1.0f / (1.0f + expf(-gate[t]));
    float* xr = x + t * width;
    for (int64_t e = threadIdx.x; e < width; e += blockDim.x) xr[e] *= g;
  }
}

// (value, column) pairs: a beats b when larger, or equal at a lower column (std::max_element's
// first maximum).
__device__ __forceinline__ bool Beats(float va, int32_t ia, float vb, int32_t ib) {
  return va > vb || (va == vb && ia < ib);
}

// One block per row. Each thread starts from its first column (so rows of -inf still answer 0,
// as std::max_element does) and keeps the first maximum of its columns; the block then reduces.
__global__ void ArgmaxRowsKernel(const float* x, int32_t* out, int64_t rows, int64_t width, int64_t stride) {
  pdl::LaunchDependents();
  pdl::Wait();
  __shared__ float vals[kRowThreads / kWarp];
  __shared__ int32_t idxs[kRowThreads / kWarp];
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* row = x + r * stride;
    float best = -INFINITY;
    int32_t best_i = INT32_MAX;
    if (threadIdx.x < width) {
      best = row[threadIdx.x];
      best_i = static_cast<int32_t>(threadIdx.x);
    }
    for (int64_t e = threadIdx.x + blockDim.x; e < width; e += blockDim.x) {
      if (row[e] > best) {
        best = row[e];
        best_i = static_cast<int32_t>(e);
      }
    }
    for (int offset = kWarp / 2; offset > 0; offset /= 2) {
      const float v = __shfl_xor_sync(0xffffffffu, best, offset);
      const int32_t i = __shfl_xor_sync(0xffffffffu, best_i, offset);
      if (Beats(v, i, best, best_i)) {
        best = v;
        best_i = i;
      }
    }
    __syncthreads();  // the previous row is done with vals and idxs
    if (lane == 0) {
      vals[warp] = best;
      idxs[warp] = best_i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < static_cast<int>(blockDim.x / kWarp); ++w) {
        if (Beats(vals[w], idxs[w], best, best_i)) {
          best = vals[w];
          best_i = idxs[w];
        }
      }
      out[r] = best_i;
    }
  }
}

}  // namespace

size_t RopeSharedBytes(int64_t head_dim) { return static_cast<size_t>(head_dim) * sizeof(float); }

cudaError_t LaunchBiasAdd(const float* bias, float* y, int64_t tokens, int64_t out, cudaStream_t stream) {
  if (tokens == 0 || out == 0) return cudaSuccess;
  pdl::Launch(BiasAddKernel, ElementGrid(tokens * out), kElementThreads, 0, stream, bias, y, tokens, out);
  return cudaGetLastError();
}

cudaError_t LaunchRmsNorm(const RmsNormParams& p, cudaStream_t stream) { return LaunchRmsNormAs(p, p.y, stream); }

cudaError_t LaunchRmsNormTo16(DType dtype, const RmsNormParams& p, void* dst, cudaStream_t stream) {
  switch (dtype) {
    case DType::kBF16:
      return LaunchRmsNormAs(p, static_cast<__nv_bfloat16*>(dst), stream);
    case DType::kF16:
      return LaunchRmsNormAs(p, static_cast<__half*>(dst), stream);
    case DType::kF32:
    case DType::kF8E4M3:
    case DType::kQ8:
    case DType::kU8:
    case DType::kMxfp4:
      break;
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchAddRmsNorm(const AddRmsNormParams& p, cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  if (LaunchRegisterNorm<true>(p.x, p.x, p.y, p.weight, p.out, p.tokens, p.hidden, p.eps, stream)) {
    return cudaGetLastError();
  }
  pdl::Launch(AddRmsNormKernel, GridFor(p.tokens), RowThreads(p.hidden), 0, stream, p.x, p.y, p.weight, p.out, p.tokens,
              p.hidden, p.eps);
  return cudaGetLastError();
}

cudaError_t LaunchRope(const RopeParams& p, cudaStream_t stream) {
  if (p.tokens == 0 || p.q_heads + p.kv_heads == 0) return cudaSuccess;
  pdl::Launch(RopeKernel, GridFor(p.tokens), kRopeThreads, RopeSharedBytes(p.head_dim), stream, RopeArgsOf(p),
              p.tokens);
  return cudaGetLastError();
}

cudaError_t LaunchKvWrite(const KvWriteParams& p, cudaStream_t stream) {
  const int64_t max_q_len = p.paged.MaxQueryLen();
  if (max_q_len == 0) return cudaSuccess;
  const int64_t row = p.cache.kv_heads * p.cache.head_dim;
  const dim3 grid(GridFor(max_q_len), GridFor(p.paged.num_seqs));
  if (p.rope.has_value()) {
    switch (p.cache.dtype) {
      case DType::kF32:
        LaunchRopeKvWriteTyped<float>(p, grid, stream);
        break;
      case DType::kBF16:
        LaunchRopeKvWriteTyped<__nv_bfloat16>(p, grid, stream);
        break;
      case DType::kF16:
        LaunchRopeKvWriteTyped<__half>(p, grid, stream);
        break;
      case DType::kF8E4M3:
        LaunchRopeKvWriteTyped<E4M3>(p, grid, stream);
        break;
      case DType::kQ8:
      case DType::kU8:
      case DType::kMxfp4:
        return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
  }
  switch (p.cache.dtype) {
    case DType::kF32:
      pdl::Launch(KvWriteKernel<float>, grid, RowThreads(row), 0, stream, p.k, p.v, p.paged.seqs, p.paged.num_seqs,
                  p.paged.block_table, static_cast<float*>(p.cache.k), static_cast<float*>(p.cache.v),
                  p.cache.block_size, row);
      break;
    case DType::kBF16:
      pdl::Launch(KvWriteKernel<__nv_bfloat16>, grid, RowThreads(row), 0, stream, p.k, p.v, p.paged.seqs,
                  p.paged.num_seqs, p.paged.block_table, static_cast<__nv_bfloat16*>(p.cache.k),
                  static_cast<__nv_bfloat16*>(p.cache.v), p.cache.block_size, row);
      break;
    case DType::kF16:
      pdl::Launch(KvWriteKernel<__half>, grid, RowThreads(row), 0, stream, p.k, p.v, p.paged.seqs, p.paged.num_seqs,
                  p.paged.block_table, static_cast<__half*>(p.cache.k), static_cast<__half*>(p.cache.v),
                  p.cache.block_size, row);
      break;
    case DType::kF8E4M3:
      pdl::Launch(KvWriteKernel<E4M3>, grid, RowThreads(row), 0, stream, p.k, p.v, p.paged.seqs, p.paged.num_seqs,
                  p.paged.block_table, static_cast<E4M3*>(p.cache.k), static_cast<E4M3*>(p.cache.v),
                  p.cache.block_size, row);
      break;
    case DType::kQ8:
    case DType::kU8:
    case DType::kMxfp4:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t LaunchSiluMul(const SiluMulParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  if (p.act == GateActivation::kGeluTanh) {
    pdl::Launch(SiluMulKernel<GateActivation::kGeluTanh>, ElementGrid(p.n), kElementThreads, 0, stream, p.gate, p.up,
                p.out, p.n);
  } else if (p.act == GateActivation::kClampedSwiglu) {
    pdl::Launch(SiluMulKernel<GateActivation::kClampedSwiglu>, ElementGrid(p.n), kElementThreads, 0, stream, p.gate,
                p.up, p.out, p.n);
  } else {
    pdl::Launch(SiluMulKernel<GateActivation::kSilu>, ElementGrid(p.n), kElementThreads, 0, stream, p.gate, p.up, p.out,
                p.n);
  }
  return cudaGetLastError();
}

cudaError_t LaunchScale(const ScaleParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  pdl::Launch(ScaleKernel, ElementGrid(p.n), kElementThreads, 0, stream, p.x, p.n, p.scale, p.softcap);
  return cudaGetLastError();
}

cudaError_t LaunchAdd(const AddParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  pdl::Launch(AddKernel, ElementGrid(p.n), kElementThreads, 0, stream, p.x, p.y, p.n);
  return cudaGetLastError();
}

cudaError_t LaunchGatherRows(const GatherRowsParams& p, cudaStream_t stream) {
  if (p.count == 0 || p.width == 0) return cudaSuccess;
  pdl::Launch(GatherRowsKernel, GridFor(p.count), RowThreads(p.width), 0, stream, p.src, p.rows, p.dst, p.count,
              p.width);
  return cudaGetLastError();
}

cudaError_t LaunchScatterAddRows(const ScatterAddRowsParams& p, cudaStream_t stream) {
  if (p.count == 0 || p.width == 0) return cudaSuccess;
  pdl::Launch(ScatterAddRowsKernel, GridFor(p.count), RowThreads(p.width), 0, stream, p.src, p.rows, p.scales, p.dst,
              p.count, p.width);
  return cudaGetLastError();
}

cudaError_t LaunchArgmaxRows(const ArgmaxRowsParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  pdl::Launch(ArgmaxRowsKernel, GridFor(p.rows), kRowThreads, 0, stream, p.x, p.out, p.rows, p.width, p.stride);
  return cudaGetLastError();
}

cudaError_t LaunchScaleRows(const ScaleRowsParams& p, cudaStream_t stream) {
  if (p.tokens == 0 || p.width == 0) return cudaSuccess;
  pdl::Launch(ScaleRowsKernel, GridFor(p.tokens), RowThreads(p.width), 0, stream, p.x, p.scales, p.tokens, p.width);
  return cudaGetLastError();
}

cudaError_t LaunchSigmoidScaleRows(const SigmoidScaleRowsParams& p, cudaStream_t stream) {
  if (p.tokens == 0 || p.width == 0) return cudaSuccess;
  pdl::Launch(SigmoidScaleRowsKernel, GridFor(p.tokens), RowThreads(p.width), 0, stream, p.x, p.gate, p.tokens,
              p.width);
  return cudaGetLastError();
}

}  // namespace shardserve::kernels::cuda

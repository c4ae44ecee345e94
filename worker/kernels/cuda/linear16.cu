// Kernels of linear16.cuh. The weights are read as raw 16-bit patterns and widened with the same
// bit operations the CPU backend uses (bf16: the upper half of an f32), so both backends multiply
// the same f32 values.
#include "worker/kernels/cuda/linear16.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace shardserve::kernels::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kGemvWarps = 4;        // rows per block (one warp per row)
constexpr int kVec = 8;              // 16-bit weights per 16-byte load
constexpr int kElementThreads = 256;
constexpr int64_t kMaxGrid = 65535;

unsigned GridFor(int64_t blocks) { return static_cast<unsigned>(blocks < kMaxGrid ? blocks : kMaxGrid); }

__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

template <DType kType>
__device__ __forceinline__ float Widen(uint16_t bits) {
  if constexpr (kType == DType::kBF16) {
    return __uint_as_float(static_cast<uint32_t>(bits) << 16);
  } else {
    return __half2float(__ushort_as_half(bits));
  }
}

// One warp per output row of the group's rows (grid-stride; part after part). `kVectorized`:
// in % 8 == 0 and every row and activation row 16-byte aligned, so each lane loads 8 weights and
// 2 x float4 per token at once.
template <DType kType, bool kVectorized, int kLoads>
__global__ void __launch_bounds__(kGemvWarps * kWarp)
    Gemv16Kernel(const float* __restrict__ x, const Gemv16Group g, int tokens, int64_t in, int64_t total_rows) {
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  for (int64_t r = int64_t{blockIdx.x} * kGemvWarps + warp; r < total_rows; r += int64_t{gridDim.x} * kGemvWarps) {
    int part = 0;
    int64_t row = r;
    while (part + 1 < g.parts && row >= g.out[part]) row -= g.out[part++];
    const uint16_t* wr = static_cast<const uint16_t*>(g.w[part]) + row * in;
    const int64_t out = g.out[part];
    const float* bias = g.bias[part];
    float* y = g.y[part];
    const bool accumulate = g.accumulate[part];
    float acc[kGemv16MaxTokens];
#pragma unroll
    for (int t = 0; t < kGemv16MaxTokens; ++t) acc[t] = 0.f;
    if constexpr (kVectorized) {
      // kLoads 16-byte weight loads per lane are issued before any is used: a row is a few KiB, so
      // the loads in flight, not the arithmetic, bound the rate.
      constexpr int64_t kStride = int64_t{kWarp} * kVec;
      for (int64_t base = int64_t{lane} * kVec; base < in; base += kLoads * kStride) {
        uint4 raw[kLoads];
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const int64_t e = base + u * kStride;
          raw[u] = e < in ? __ldg(reinterpret_cast<const uint4*>(wr + e)) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const int64_t e = base + u * kStride;
          if (e >= in) break;
          const uint32_t words[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
          float wf[kVec];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            wf[2 * i] = Widen<kType>(static_cast<uint16_t>(words[i] & 0xffffu));
            wf[2 * i + 1] = Widen<kType>(static_cast<uint16_t>(words[i] >> 16));
          }
#pragma unroll
          for (int t = 0; t < kGemv16MaxTokens; ++t) {
            if (t < tokens) {
              const float4 a = *reinterpret_cast<const float4*>(x + t * in + e);
              const float4 b = *reinterpret_cast<const float4*>(x + t * in + e + 4);
              acc[t] += wf[0] * a.x + wf[1] * a.y + wf[2] * a.z + wf[3] * a.w + wf[4] * b.x + wf[5] * b.y +
                        wf[6] * b.z + wf[7] * b.w;
            }
          }
        }
      }
    } else {
      for (int64_t e = lane; e < in; e += kWarp) {
        const float wv = Widen<kType>(wr[e]);
#pragma unroll
        for (int t = 0; t < kGemv16MaxTokens; ++t) {
          if (t < tokens) acc[t] += wv * x[t * in + e];
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kGemv16MaxTokens; ++t) {
      if (t < tokens) {
        const float sum = WarpSum(acc[t]);
        if (lane == 0) {
          float* dst = y + t * out + row;
          const float b = bias != nullptr ? bias[row] : 0.f;
          *dst = (accumulate ? *dst : 0.f) + sum + b;
        }
      }
    }
  }
}

template <DType kType>
__global__ void CastKernel(const float* __restrict__ x, uint16_t* __restrict__ dst, int64_t n) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    if constexpr (kType == DType::kBF16) {
      dst[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x[i]));
    } else {
      dst[i] = __half_as_ushort(__float2half_rn(x[i]));
    }
  }
}

template <DType kType>
__global__ void EmbeddingKernel(const void* table, const int32_t* ids, float* out, int64_t tokens, int64_t hidden) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int64_t row = int64_t{ids[t]} * hidden;
    float* d = out + t * hidden;
    for (int64_t e = threadIdx.x; e < hidden; e += blockDim.x) {
      if constexpr (kType == DType::kF32) {
        d[e] = static_cast<const float*>(table)[row + e];
      } else {
        d[e] = Widen<kType>(static_cast<const uint16_t*>(table)[row + e]);
      }
    }
  }
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <DType kType>
cudaError_t Gemv16(const float* x, const Gemv16Group& g, int64_t tokens, int64_t in, int loads, cudaStream_t stream) {
  int64_t rows = 0;
  bool aligned = in % kVec == 0 && Aligned16(x);
  for (int p = 0; p < g.parts; ++p) {
    rows += g.out[p];
    aligned = aligned && Aligned16(g.w[p]);
  }
  if (rows == 0) return cudaSuccess;
  const unsigned grid = GridFor((rows + kGemvWarps - 1) / kGemvWarps);
  const int t = static_cast<int>(tokens);
  constexpr unsigned kThreads = kGemvWarps * kWarp;
  if (aligned) {
    if (loads == 8) {
      Gemv16Kernel<kType, true, 8><<<grid, kThreads, 0, stream>>>(x, g, t, in, rows);
    } else {
      Gemv16Kernel<kType, true, 4><<<grid, kThreads, 0, stream>>>(x, g, t, in, rows);
    }
  } else {
    Gemv16Kernel<kType, false, 1><<<grid, kThreads, 0, stream>>>(x, g, t, in, rows);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchGemv16(DType dtype, const float* x, const Gemv16Group& group, int64_t tokens, int64_t in, int loads,
                         cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  if (tokens > kGemv16MaxTokens || (loads != 4 && loads != 8) || group.parts < 1 ||
      group.parts > Gemv16Group::kMaxParts) {
    return cudaErrorInvalidValue;
  }
  switch (dtype) {
    case DType::kBF16:
      return Gemv16<DType::kBF16>(x, group, tokens, in, loads, stream);
    case DType::kF16:
      return Gemv16<DType::kF16>(x, group, tokens, in, loads, stream);
    case DType::kF32:
    case DType::kF8E4M3:
    case DType::kQ8:
      break;
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchCastTo16(DType dtype, const float* x, void* dst, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const unsigned grid = GridFor((n + kElementThreads - 1) / kElementThreads);
  auto* d = static_cast<uint16_t*>(dst);
  switch (dtype) {
    case DType::kBF16:
      CastKernel<DType::kBF16><<<grid, kElementThreads, 0, stream>>>(x, d, n);
      return cudaGetLastError();
    case DType::kF16:
      CastKernel<DType::kF16><<<grid, kElementThreads, 0, stream>>>(x, d, n);
      return cudaGetLastError();
    case DType::kF32:
    case DType::kF8E4M3:
    case DType::kQ8:
      break;
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchEmbeddingTyped(DType dtype, const void* table, const int32_t* ids, float* out, int64_t tokens,
                                 int64_t hidden, cudaStream_t stream) {
  if (tokens == 0 || hidden == 0) return cudaSuccess;
  const unsigned threads = hidden >= kElementThreads ? kElementThreads : kWarp;
  switch (dtype) {
    case DType::kF32:
      EmbeddingKernel<DType::kF32><<<GridFor(tokens), threads, 0, stream>>>(table, ids, out, tokens, hidden);
      break;
    case DType::kBF16:
      EmbeddingKernel<DType::kBF16><<<GridFor(tokens), threads, 0, stream>>>(table, ids, out, tokens, hidden);
      break;
    case DType::kF16:
      EmbeddingKernel<DType::kF16><<<GridFor(tokens), threads, 0, stream>>>(table, ids, out, tokens, hidden);
      break;
    case DType::kF8E4M3:
    case DType::kQ8:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace shardserve::kernels::cuda

// Kernels of linear16.cuh. The weights are read as raw 16-bit patterns and widened with the same
// bit operations the CPU backend uses (bf16: the upper half of an f32), so both backends multiply
// the same f32 values.
#include "worker/kernels/cuda/linear16.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "worker/kernels/cuda/gemv16_dots.cuh"

namespace shardserve::kernels::cuda {
namespace {

using gemv16::kVec;
using gemv16::kWarp;
using gemv16::WarpSum;
using gemv16::Widen;
constexpr int kGemvWarps = 4;        // rows per block (one warp per row)
constexpr int kElementThreads = 256;
constexpr int64_t kMaxGrid = 65535;

unsigned GridFor(int64_t blocks) { return static_cast<unsigned>(blocks < kMaxGrid ? blocks : kMaxGrid); }

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
    gemv16::RowDots<kType, kVectorized, kLoads>(wr, x, tokens, in, lane, acc);
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

// Kernels of linear_mxfp4.cuh. The weights are decoded with kernels/shared/mxfp4_math.h, the
// functions the CPU tests check against common/fp8's MXFP4 reader bit for bit.
#include "worker/kernels/cuda/linear_mxfp4.cuh"

#include <cuda_bf16.h>

#include <cstdint>

#include "worker/kernels/cuda/pdl.cuh"
#include "worker/kernels/shared/mxfp4_math.h"

namespace shardserve::kernels::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kGemvWarps = 4;  // rows per block (one warp per row)
constexpr int kBlocksPerSm = 8;
constexpr int kElementThreads = 256;
constexpr int64_t kMaxGrid = 65535;
constexpr int kBlockBytes = static_cast<int>(kMxfp4Block / 2);

unsigned GridFor(int64_t blocks) { return static_cast<unsigned>(blocks < kMaxGrid ? blocks : kMaxGrid); }

__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// One warp per output row (grid-stride over one wave of blocks). Lane l takes the row's scale
// blocks l, l + 32, ...: 16 code bytes in one load, 32 weights decoded in registers, each
// multiplied with kRows tokens' activations (16-byte loads when kVectorX). The first rows are
// asked into L2 before pdl::Wait(), while the previous kernel still runs.
template <int kRows, bool kVectorX>
__global__ void __launch_bounds__(kGemvWarps* kWarp, kBlocksPerSm)
    GemvMxfp4Kernel(const float* __restrict__ x, const uint8_t* __restrict__ codes,
                    const uint8_t* __restrict__ scales, const float* __restrict__ bias, float* __restrict__ y,
                    int tokens, int64_t in, int64_t out, bool accumulate) {
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int64_t first = int64_t{blockIdx.x} * kGemvWarps + warp;
  const int64_t stride = int64_t{gridDim.x} * kGemvWarps;
  const int64_t row_bytes = in / 2;
  const auto blocks = static_cast<uint32_t>(in / kMxfp4Block);
  if (first < out) pdl::PrefetchL2(codes + first * row_bytes, row_bytes, lane);
  pdl::LaunchDependents();
  pdl::Wait();
  for (int64_t r = first; r < out; r += stride) {
    if (r + stride < out) pdl::PrefetchL2(codes + (r + stride) * row_bytes, row_bytes, lane);
    const uint8_t* row = codes + r * row_bytes;
    const uint8_t* row_scales = scales + r * blocks;
    float acc[kRows];
#pragma unroll
    for (int t = 0; t < kRows; ++t) acc[t] = 0.f;
    for (uint32_t b = static_cast<uint32_t>(lane); b < blocks; b += kWarp) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(row + b * kBlockBytes));
      const float scale = E8M0Scale(row_scales[b]);
      const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
      float w[kMxfp4Block];
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const auto byte = static_cast<uint8_t>((words[i / 4] >> (8 * (i % 4))) & 0xffu);
        w[2 * i] = E2M1Decode(byte) * scale;
        w[2 * i + 1] = E2M1Decode(static_cast<uint8_t>(byte >> 4)) * scale;
      }
      const uint32_t c = b * static_cast<uint32_t>(kMxfp4Block);
#pragma unroll
      for (int t = 0; t < kRows; ++t) {
        if (t < tokens) {
          const float* xt = x + t * in + c;
          float sum = 0.f;
          if constexpr (kVectorX) {
#pragma unroll
            for (int q = 0; q < 8; ++q) {
              const float4 v = reinterpret_cast<const float4*>(xt)[q];
              sum += w[4 * q] * v.x + w[4 * q + 1] * v.y + w[4 * q + 2] * v.z + w[4 * q + 3] * v.w;
            }
          } else {
#pragma unroll
            for (int k = 0; k < 32; ++k) sum += w[k] * xt[k];
          }
          acc[t] += sum;
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kRows; ++t) {
      if (t < tokens) {
        const float sum = WarpSum(acc[t]);
        if (lane == 0) {
          float* dst = y + t * out + r;
          const float bv = bias != nullptr ? bias[r] : 0.f;
          *dst = (accumulate ? *dst : 0.f) + sum + bv;
        }
      }
    }
  }
}

// One block per row (grid-stride), its threads over the row's columns.
__global__ void DequantizeMxfp4RowsKernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales,
                                          int64_t in, int64_t row_begin, int64_t rows, uint16_t* __restrict__ dst) {
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const int64_t r = row_begin + i;
    uint16_t* out = dst + i * in;
    for (uint32_t c = threadIdx.x; c < in; c += blockDim.x) {
      out[c] = __bfloat16_as_ushort(__float2bfloat16_rn(Mxfp4At(codes, scales, in, r, c)));
    }
  }
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <int kRows>
cudaError_t LaunchRows(const float* x, const uint8_t* codes, const uint8_t* scales, const float* bias, float* y,
                       int tokens, int64_t in, int64_t out, bool accumulate, int multiprocessors,
                       cudaStream_t stream) {
  constexpr unsigned kThreads = kGemvWarps * kWarp;
  const int64_t wave = int64_t{multiprocessors > 0 ? multiprocessors : 1} * kBlocksPerSm;
  const int64_t blocks = (out + kGemvWarps - 1) / kGemvWarps;
  const unsigned grid = GridFor(blocks < wave ? blocks : wave);
  if (Aligned16(x)) {
    return pdl::Launch(GemvMxfp4Kernel<kRows, true>, grid, kThreads, 0, stream, x, codes, scales, bias, y, tokens, in,
                       out, accumulate);
  }
  return pdl::Launch(GemvMxfp4Kernel<kRows, false>, grid, kThreads, 0, stream, x, codes, scales, bias, y, tokens, in,
                     out, accumulate);
}

}  // namespace

cudaError_t LaunchGemvMxfp4(const float* x, const uint8_t* codes, const uint8_t* scales, const float* bias, float* y,
                            int64_t tokens, int64_t in, int64_t out, bool accumulate, int multiprocessors,
                            cudaStream_t stream) {
  if (tokens == 0 || out == 0) return cudaSuccess;
  if (tokens < 0 || tokens > kGemvMxfp4MaxTokens || out < 0 || in <= 0 || in % kMxfp4Block != 0 ||
      in > int64_t{INT32_MAX} || !Aligned16(codes)) {
    return cudaErrorInvalidValue;
  }
  const int t = static_cast<int>(tokens);
  if (t <= 1) return LaunchRows<1>(x, codes, scales, bias, y, t, in, out, accumulate, multiprocessors, stream);
  if (t <= 2) return LaunchRows<2>(x, codes, scales, bias, y, t, in, out, accumulate, multiprocessors, stream);
  if (t <= 4) return LaunchRows<4>(x, codes, scales, bias, y, t, in, out, accumulate, multiprocessors, stream);
  return LaunchRows<kGemvMxfp4MaxTokens>(x, codes, scales, bias, y, t, in, out, accumulate, multiprocessors, stream);
}

cudaError_t LaunchDequantizeMxfp4Rows(const uint8_t* codes, const uint8_t* scales, int64_t in, int64_t row_begin,
                                      int64_t row_end, uint16_t* dst, cudaStream_t stream) {
  const int64_t rows = row_end - row_begin;
  if (rows == 0) return cudaSuccess;
  if (rows < 0 || in <= 0 || in % kMxfp4Block != 0 || in > int64_t{INT32_MAX}) return cudaErrorInvalidValue;
  DequantizeMxfp4RowsKernel<<<GridFor(rows), kElementThreads, 0, stream>>>(codes, scales, in, row_begin, rows, dst);
  return cudaGetLastError();
}

}  // namespace shardserve::kernels::cuda

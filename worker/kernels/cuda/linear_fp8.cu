// Kernels of linear_fp8.cuh. The weights are dequantized with kernels/shared/fp8_math.h, the
// functions the CPU tests check against common/fp8 bit for bit.
#include "worker/kernels/cuda/linear_fp8.cuh"

#include <cuda_bf16.h>

#include <cstdint>

namespace shardserve::kernels::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kGemvWarps = 4;   // rows per block (one warp per row)
constexpr int kVec = 16;        // e4m3 codes per 16-byte load
constexpr int kLoads = 4;       // 16-byte loads each lane issues before using them
constexpr int kElementThreads = 256;
constexpr int64_t kMaxGrid = 65535;

unsigned GridFor(int64_t blocks) { return static_cast<unsigned>(blocks < kMaxGrid ? blocks : kMaxGrid); }

__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// One warp per output row (grid-stride). `kVectorized`: in % 16 == 0, the codes and x 16-byte
// aligned, and the scale constant over every 16 aligned columns (block_cols and col_offset
// multiples of 16), so each lane loads 16 codes and one scale at once.
template <bool kVectorized>
__global__ void __launch_bounds__(kGemvWarps * kWarp) GemvFp8Kernel(const GemvFp8Params p) {
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int tokens = static_cast<int>(p.tokens);
  const int64_t in = p.in;
  for (int64_t row = int64_t{blockIdx.x} * kGemvWarps + warp; row < p.out; row += int64_t{gridDim.x} * kGemvWarps) {
    const uint8_t* wr = p.codes + row * in;
    // Fp8ScaleAt's index, its row part once per row and its column part in 32 bits (in fits an
    // int: the backend checks), off the loads' critical path.
    const float* scale_row = p.scales.scales + ((row + p.scales.row_offset) / p.scales.block_rows) * p.scales.grid_cols;
    const auto col_offset = static_cast<uint32_t>(p.scales.col_offset);
    const auto block_cols = static_cast<uint32_t>(p.scales.block_cols);
    float acc[kGemvFp8MaxTokens];
#pragma unroll
    for (int t = 0; t < kGemvFp8MaxTokens; ++t) acc[t] = 0.f;
    if constexpr (kVectorized) {
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
          const float scale = scale_row[(static_cast<uint32_t>(e) + col_offset) / block_cols];
          const uint32_t words[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
          float wf[kVec];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int b = 0; b < 4; ++b) {
              wf[4 * i + b] = Fp8Dequantize(static_cast<uint8_t>((words[i] >> (8 * b)) & 0xffu), scale);
            }
          }
#pragma unroll
          for (int t = 0; t < kGemvFp8MaxTokens; ++t) {
            if (t < tokens) {
              const float4* a = reinterpret_cast<const float4*>(p.x + t * in + e);
              float sum = 0.f;
#pragma unroll
              for (int q = 0; q < 4; ++q) {
                const float4 v = a[q];
                sum += wf[4 * q] * v.x + wf[4 * q + 1] * v.y + wf[4 * q + 2] * v.z + wf[4 * q + 3] * v.w;
              }
              acc[t] += sum;
            }
          }
        }
      }
    } else {
      for (int64_t e = lane; e < in; e += kWarp) {
        const float wv = Fp8Dequantize(wr[e], scale_row[(static_cast<uint32_t>(e) + col_offset) / block_cols]);
#pragma unroll
        for (int t = 0; t < kGemvFp8MaxTokens; ++t) {
          if (t < tokens) acc[t] += wv * p.x[t * in + e];
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kGemvFp8MaxTokens; ++t) {
      if (t < tokens) {
        const float sum = WarpSum(acc[t]);
        if (lane == 0) {
          float* dst = p.y + t * p.out + row;
          const float b = p.bias != nullptr ? p.bias[row] : 0.f;
          *dst = (p.accumulate ? *dst : 0.f) + sum + b;
        }
      }
    }
  }
}

// One block per row (grid-stride), its threads over the columns: the scale row once per row, the
// column's block in 32 bits (in fits an int), the value Fp8Dequantize's.
__global__ void DequantizeRowsKernel(const uint8_t* __restrict__ codes, const Fp8ScaleGrid g, int64_t in,
                                     int64_t row_begin, int64_t rows, uint16_t* __restrict__ dst) {
  const auto col_offset = static_cast<uint32_t>(g.col_offset);
  const auto block_cols = static_cast<uint32_t>(g.block_cols);
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const int64_t r = row_begin + i;
    const float* scale_row = g.scales + ((r + g.row_offset) / g.block_rows) * g.grid_cols;
    const uint8_t* src = codes + r * in;
    uint16_t* out = dst + i * in;
    for (uint32_t c = threadIdx.x; c < in; c += blockDim.x) {
      const float w = Fp8Dequantize(src[c], scale_row[(c + col_offset) / block_cols]);
      out[c] = __bfloat16_as_ushort(__float2bfloat16_rn(w));
    }
  }
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

cudaError_t LaunchGemvFp8(const GemvFp8Params& p, cudaStream_t stream) {
  if (p.tokens == 0 || p.out == 0) return cudaSuccess;
  if (p.tokens < 0 || p.tokens > kGemvFp8MaxTokens || p.in <= 0 || !p.scales.Valid(p.in) ||
      p.in + p.scales.col_offset > int64_t{UINT32_MAX} || p.scales.block_cols > int64_t{UINT32_MAX}) {
    return cudaErrorInvalidValue;  // the kernel's column index is 32-bit
  }
  const bool vectorized = p.in % kVec == 0 && Aligned16(p.codes) && Aligned16(p.x) && p.scales.block_cols % kVec == 0 &&
                          p.scales.col_offset % kVec == 0;
  const unsigned grid = GridFor((p.out + kGemvWarps - 1) / kGemvWarps);
  constexpr unsigned kThreads = kGemvWarps * kWarp;
  if (vectorized) {
    GemvFp8Kernel<true><<<grid, kThreads, 0, stream>>>(p);
  } else {
    GemvFp8Kernel<false><<<grid, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t LaunchDequantizeFp8Rows(const uint8_t* codes, const Fp8ScaleGrid& scales, int64_t in, int64_t row_begin,
                                    int64_t row_end, uint16_t* dst, cudaStream_t stream) {
  const int64_t rows = row_end - row_begin;
  if (rows == 0) return cudaSuccess;
  if (rows < 0 || in <= 0 || !scales.Valid(in) || in + scales.col_offset > int64_t{UINT32_MAX} ||
      scales.block_cols > int64_t{UINT32_MAX}) {
    return cudaErrorInvalidValue;
  }
  DequantizeRowsKernel<<<GridFor(rows), kElementThreads, 0, stream>>>(codes, scales, in, row_begin, rows, dst);
  return cudaGetLastError();
}

}  // namespace shardserve::kernels::cuda

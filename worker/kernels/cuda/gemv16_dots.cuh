// The inner loop of the 16-bit GEMV kernels (linear16.cu's Linear GEMV, moe_grouped.cu's grouped
// expert GEMV): one warp multiplies one 16-bit weight row with a few f32 activation rows. Internal
// to worker/kernels/cuda; device code only.
//
// Weights are read as raw 16-bit patterns and widened with the bit operations the CPU backend uses
// (bf16: the upper half of an f32; f16: IEEE half), so both backends multiply the same f32 values.
#ifndef SHARDSERVE_WORKER_KERNELS_CUDA_GEMV16_DOTS_CUH_
#define SHARDSERVE_WORKER_KERNELS_CUDA_GEMV16_DOTS_CUH_

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/tensor/dtype.h"

namespace shardserve::kernels::cuda::gemv16 {

inline constexpr int kWarp = 32;
inline constexpr int kVec = 8;  // 16-bit weights per 16-byte load

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

// acc[r] += this lane's share of dot(wr, x[r]) for r < rows <= kMaxRows (the caller reduces each
// acc[r] over the warp with WarpSum). wr: [in] 16-bit weights of `kType`; x: [rows, in] f32.
// `kVectorized`: in % kVec == 0 and wr and every x row 16-byte aligned, so each lane loads kVec
// weights and 2 x float4 per row at once, with kLoads 16-byte weight loads issued before any is
// used (a row is a few KiB: the loads in flight, not the arithmetic, bound the rate). Otherwise one
// weight per lane per pass. The sums are the same either way up to f32 reassociation.
// `kNorm` (the normed form of LinearGroupParams): each activation x[r][i] is replaced, as it is
// loaded, by nw[i] * (x[r][i] * inv[r]), RmsNormRow's formula with the row's inverse RMS inv[r]
// (row_norm.cuh's RowInvRms): the values an RmsNorm kernel would have written, so the sums are
// those over its output. nw: [in] f32 (16-byte aligned when kVectorized); inv: [rows].
template <DType kType, bool kVectorized, int kLoads, int kMaxRows, bool kNorm = false>
__device__ __forceinline__ void RowDots(const uint16_t* __restrict__ wr, const float* __restrict__ x, int rows,
                                        int64_t in, int lane, float (&acc)[kMaxRows],
                                        const float* __restrict__ nw = nullptr, const float* inv = nullptr) {
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
        const uint32_t words[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
        float wf[kVec];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          wf[2 * i] = Widen<kType>(static_cast<uint16_t>(words[i] & 0xffffu));
          wf[2 * i + 1] = Widen<kType>(static_cast<uint16_t>(words[i] >> 16));
        }
#pragma unroll
        for (int r = 0; r < kMaxRows; ++r) {
          if (r < rows) {
            float4 a = *reinterpret_cast<const float4*>(x + r * in + e);
            float4 b = *reinterpret_cast<const float4*>(x + r * in + e + 4);
            if constexpr (kNorm) {
              const float4 ga = *reinterpret_cast<const float4*>(nw + e);
              const float4 gb = *reinterpret_cast<const float4*>(nw + e + 4);
              const float s = inv[r];
              a = make_float4(ga.x * (a.x * s), ga.y * (a.y * s), ga.z * (a.z * s), ga.w * (a.w * s));
              b = make_float4(gb.x * (b.x * s), gb.y * (b.y * s), gb.z * (b.z * s), gb.w * (b.w * s));
            }
            acc[r] += wf[0] * a.x + wf[1] * a.y + wf[2] * a.z + wf[3] * a.w + wf[4] * b.x + wf[5] * b.y +
                      wf[6] * b.z + wf[7] * b.w;
          }
        }
      }
    }
  } else {
    for (int64_t e = lane; e < in; e += kWarp) {
      const float wv = Widen<kType>(wr[e]);
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r) {
        if (r < rows) {
          if constexpr (kNorm) {
            acc[r] += wv * (nw[e] * (x[r * in + e] * inv[r]));
          } else {
            acc[r] += wv * x[r * in + e];
          }
        }
      }
    }
  }
}

}  // namespace shardserve::kernels::cuda::gemv16

#endif  // SHARDSERVE_WORKER_KERNELS_CUDA_GEMV16_DOTS_CUH_

// How the CUDA kernels reduce a row for RMSNorm, shared by the norm kernels (ops.cu) and the 16-bit
// GEMV's normed form (linear16.cu, LinearGroupParams::norm), so both compute the same inverse RMS
// bit for bit. Internal to worker/kernels/cuda; device code only where marked.
//
// The reduction of a row of `width` f32 values: RowBlockThreads(width) "row threads" (a multiple
// of 32, at most kRowBlockThreads); row thread v sums x[i]^2 for i = v, v + V, v + 2V, ... in that
// order (V = the row thread count), each warp of row threads is summed with the xor butterfly
// (offsets 16, 8, 4, 2, 1), and the warp sums are added in warp order starting from 0. Then
// inv = 1 / sqrt(sum / width + eps) and y[i] = weight[i] * (x[i] * inv), RmsNormRow's formula
// (kernels/shared/row_math.h). A norm kernel runs one row thread per thread; a GEMV block of fewer
// threads runs several row warps per warp (RowInvRms).
#ifndef SHARDSERVE_WORKER_KERNELS_CUDA_ROW_NORM_CUH_
#define SHARDSERVE_WORKER_KERNELS_CUDA_ROW_NORM_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace shardserve::kernels::cuda {

inline constexpr int kRowBlockThreads = 256;
inline constexpr int kRowWarps = kRowBlockThreads / 32;

// Threads for a row of `width` elements: enough warps to cover it, at most kRowBlockThreads.
__host__ __device__ inline unsigned RowBlockThreads(int64_t width) {
  const int64_t warps = (width + 31) / 32;
  const int64_t threads = (warps < 1 ? 1 : warps) * 32;
  return static_cast<unsigned>(threads < kRowBlockThreads ? threads : kRowBlockThreads);
}

__device__ __forceinline__ float RowWarpSum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// inv[t] = the inverse RMS of row t of x ([rows, width]) plus eps, for t < rows <= kMaxRows, summed
// as described above, whatever the block's size (a multiple of 32). partial: [kMaxRows *
// kRowWarps] shared floats; inv: [kMaxRows] shared floats. Every thread of the block must call it
// (it synchronises the block); inv is ready for all of them on return.
template <int kMaxRows>
__device__ __forceinline__ void RowInvRms(const float* __restrict__ x, int rows, int64_t width, float eps,
                                          float* partial, float* inv) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int warp = static_cast<int>(threadIdx.x / 32);
  const int warps = static_cast<int>(blockDim.x / 32);
  const int row_threads = static_cast<int>(RowBlockThreads(width));
  const int row_warps = row_threads / 32;
  for (int t = 0; t < rows; ++t) {
    const float* xr = x + t * width;
    for (int w = warp; w < row_warps; w += warps) {
      float ss = 0.f;
      for (int64_t i = int64_t{w} * 32 + lane; i < width; i += row_threads) ss += xr[i] * xr[i];
      ss = RowWarpSum(ss);
      if (lane == 0) partial[t * kRowWarps + w] = ss;
    }
  }
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < rows) {
    const int t = static_cast<int>(threadIdx.x);
    float total = 0.f;
    for (int w = 0; w < row_warps; ++w) total += partial[t * kRowWarps + w];
    inv[t] = 1.0f / sqrtf(total / static_cast<float>(width) + eps);
  }
  __syncthreads();
}

}  // namespace shardserve::kernels::cuda

#endif  // SHARDSERVE_WORKER_KERNELS_CUDA_ROW_NORM_CUH_

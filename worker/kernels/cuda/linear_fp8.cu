// Kernels of linear_fp8.cuh. The weights are dequantized with kernels/shared/fp8_math.h, the
// functions the CPU tests check against common/fp8 bit for bit.
#include "worker/kernels/cuda/linear_fp8.cuh"

#include <cuda_bf16.h>

#include <cstdint>

#include "worker/kernels/cuda/pdl.cuh"
#include "worker/kernels/shared/linear_group_math.h"

namespace shardserve::kernels::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kGemvWarps = 4;        // rows per block (one warp per row)
constexpr int kVec = 16;             // e4m3 codes per 16-byte load
constexpr int kPrefetchRows = 2;     // weight rows each GEMV warp has on their way into L2
// 16-byte code loads each lane of a GEMV warp issues before using them, and the GEMV blocks of
// 4 warps a multiprocessor holds at once (the registers they may use: the launch bounds; one wave
// of blocks), by the tokens the kernel's accumulators hold. Neither changes the sums.
__host__ __device__ constexpr int LoadsFor(int rows) { return rows == 1 ? 2 : 4; }
__host__ __device__ constexpr int BlocksPerSm(int rows) { return rows == 1 ? 8 : rows == 2 ? 6 : 5; }
constexpr int kElementThreads = 256;
constexpr int64_t kMaxGrid = 65535;

unsigned GridFor(int64_t blocks) { return static_cast<unsigned>(blocks < kMaxGrid ? blocks : kMaxGrid); }

__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// acc[t] += this lane's share of dot(dequantized wr, x[t]) for t < tokens <= kRows (the caller
// reduces each acc[t] over the warp). wr: [in] e4m3 codes of one row; scale_row: that row's scale
// blocks, column c's at (c + col_offset) / block_cols (Fp8ScaleAt's index, its column part in 32
// bits: in <= INT32_MAX, the launcher checks); x: [tokens, in] f32. `kVectorized`: in % 16 == 0,
// wr and x 16-byte aligned, and the scale constant over every 16 aligned columns (block_cols and
// col_offset multiples of 16), so each lane loads 16 codes and one scale at once, kLoads loads in
// flight. Otherwise one code per lane per pass. Each lane visits the same columns in the same
// order whatever kLoads and kRows are, and its products and sums are f32 in a fixed order (per 16
// codes: a partial sum per token, then added to acc[t]), so neither changes a bit of the result.
template <bool kVectorized, int kLoads, int kRows>
__device__ __forceinline__ void RowDotsFp8(const uint8_t* __restrict__ wr, const float* __restrict__ scale_row,
                                           uint32_t col_offset, uint32_t block_cols, const float* __restrict__ x,
                                           int tokens, int64_t in, int lane, float (&acc)[kRows]) {
  if constexpr (kVectorized) {
    constexpr uint32_t kStride = uint32_t{kWarp} * kVec;
    const auto n = static_cast<uint32_t>(in);
    for (uint32_t base = static_cast<uint32_t>(lane) * kVec; base < n; base += kLoads * kStride) {
      uint4 raw[kLoads];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const uint32_t e = base + u * kStride;
        raw[u] = e < n ? __ldg(reinterpret_cast<const uint4*>(wr + e)) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const uint32_t e = base + u * kStride;
        if (e >= n) break;
        const float scale = scale_row[(e + col_offset) / block_cols];
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
        for (int t = 0; t < kRows; ++t) {
          if (t < tokens) {
            const float4* a = reinterpret_cast<const float4*>(x + t * in + e);
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
      for (int t = 0; t < kRows; ++t) {
        if (t < tokens) acc[t] += wv * x[t * in + e];
      }
    }
  }
}

// Pulls weight row r of the group into L2 (nothing past the last row).
__device__ __forceinline__ void PrefetchRow(const GemvFp8Group& g, int64_t r, int64_t total_rows, int64_t in,
                                            int lane) {
  if (r >= total_rows) return;
  const GroupRow at = LocateGroupRow(g.out, g.parts, r);
  pdl::PrefetchL2(g.codes[at.part] + at.row * in, in, lane);
}

// One warp per output row of the group's rows (grid-stride over one wave of blocks; part after
// part), for batches of at most kRows tokens (kRows sizes the accumulators: a 1-token step keeps
// few registers, and so more warps per multiprocessor). Each warp keeps kPrefetchRows rows ahead
// of the one it multiplies on their way into L2; the first ones are asked for before pdl::Wait(),
// while the previous kernel still runs (weights only: nothing an earlier kernel writes).
template <bool kVectorized, int kRows>
__global__ void __launch_bounds__(kGemvWarps* kWarp, BlocksPerSm(kRows))
    GemvFp8Kernel(const float* __restrict__ x, const GemvFp8Group g, int tokens, int64_t in, int64_t total_rows) {
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int64_t first = int64_t{blockIdx.x} * kGemvWarps + warp;
  const int64_t stride = int64_t{gridDim.x} * kGemvWarps;
#pragma unroll
  for (int k = 0; k < kPrefetchRows; ++k) PrefetchRow(g, first + k * stride, total_rows, in, lane);
  pdl::LaunchDependents();
  pdl::Wait();
  for (int64_t r = first; r < total_rows; r += stride) {
    PrefetchRow(g, r + kPrefetchRows * stride, total_rows, in, lane);
    const GroupRow at = LocateGroupRow(g.out, g.parts, r);
    const int64_t row = at.row;
    const uint8_t* wr = g.codes[at.part] + row * in;
    const Fp8ScaleGrid& s = g.scales[at.part];
    // Fp8ScaleAt's index, its row part once per row, off the loads' critical path.
    const float* scale_row = s.scales + ((row + s.row_offset) / s.block_rows) * s.grid_cols;
    float acc[kRows];
#pragma unroll
    for (int t = 0; t < kRows; ++t) acc[t] = 0.f;
    RowDotsFp8<kVectorized, LoadsFor(kRows), kRows>(wr, scale_row, static_cast<uint32_t>(s.col_offset),
                                                    static_cast<uint32_t>(s.block_cols), x, tokens, in, lane, acc);
    const int64_t out = g.out[at.part];
    const float* bias = g.bias[at.part];
    float* y = g.y[at.part];
    const bool accumulate = g.accumulate[at.part];
#pragma unroll
    for (int t = 0; t < kRows; ++t) {
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

// One launch of GemvFp8Kernel with kRows-token accumulators over the `rows` rows of `g`, in at
// most one wave of blocks (each warp then walks several rows and prefetches the next ones).
template <int kRows>
cudaError_t LaunchGemvFp8Rows(const float* x, const GemvFp8Group& g, int tokens, int64_t in, int64_t rows,
                              bool vectorized, int multiprocessors, cudaStream_t stream) {
  constexpr unsigned kThreads = kGemvWarps * kWarp;
  const int64_t wave = int64_t{multiprocessors > 0 ? multiprocessors : 1} * BlocksPerSm(kRows);
  const int64_t blocks = (rows + kGemvWarps - 1) / kGemvWarps;
  const unsigned grid = GridFor(blocks < wave ? blocks : wave);
  if (vectorized) return pdl::Launch(GemvFp8Kernel<true, kRows>, grid, kThreads, 0, stream, x, g, tokens, in, rows);
  return pdl::Launch(GemvFp8Kernel<false, kRows>, grid, kThreads, 0, stream, x, g, tokens, in, rows);
}

// GemvFp8Kernel over every row of `g` (validated parts of > 0 rows, all on the same load path),
// with the accumulators of the fewest tokens that hold `tokens`.
cudaError_t GemvFp8(const float* x, const GemvFp8Group& g, int tokens, int64_t in, bool vectorized,
                    int multiprocessors, cudaStream_t stream) {
  int64_t rows = 0;
  for (int p = 0; p < g.parts; ++p) rows += g.out[p];
  if (tokens <= 1) return LaunchGemvFp8Rows<1>(x, g, tokens, in, rows, vectorized, multiprocessors, stream);
  if (tokens <= 2) return LaunchGemvFp8Rows<2>(x, g, tokens, in, rows, vectorized, multiprocessors, stream);
  if (tokens <= 4) return LaunchGemvFp8Rows<4>(x, g, tokens, in, rows, vectorized, multiprocessors, stream);
  return LaunchGemvFp8Rows<kGemvFp8MaxTokens>(x, g, tokens, in, rows, vectorized, multiprocessors, stream);
}

}  // namespace

cudaError_t LaunchGemvFp8(const float* x, const GemvFp8Group& group, int64_t tokens, int64_t in, int multiprocessors,
                          cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  if (tokens < 0 || tokens > kGemvFp8MaxTokens || in <= 0 || in > int64_t{INT32_MAX} || group.parts < 1 ||
      group.parts > GemvFp8Group::kMaxParts) {
    return cudaErrorInvalidValue;
  }
  // The parts that take the 16-byte loads, and the others: each set is one launch, so every part
  // gets the path (and the sums) it would get alone.
  GemvFp8Group sets[2];  // [0]: 16-byte loads, [1]: scalar loads
  const bool x_vectorized = in % kVec == 0 && Aligned16(x);
  for (int p = 0; p < group.parts; ++p) {
    const Fp8ScaleGrid& s = group.scales[p];
    if (group.out[p] < 0 || !s.Valid(in) || in + s.col_offset > int64_t{UINT32_MAX} ||
        s.block_cols > int64_t{UINT32_MAX}) {
      return cudaErrorInvalidValue;  // the kernel's column index is 32-bit
    }
    if (group.out[p] == 0) continue;
    const bool vectorized = x_vectorized && Aligned16(group.codes[p]) && s.block_cols % kVec == 0 &&
                            s.col_offset % kVec == 0;
    GemvFp8Group& set = sets[vectorized ? 0 : 1];
    const int i = set.parts++;
    set.codes[i] = group.codes[p];
    set.scales[i] = s;
    set.bias[i] = group.bias[p];
    set.y[i] = group.y[p];
    set.out[i] = group.out[p];
    set.accumulate[i] = group.accumulate[p];
  }
  for (int v = 0; v < 2; ++v) {
    if (sets[v].parts == 0) continue;
    if (const cudaError_t err = GemvFp8(x, sets[v], static_cast<int>(tokens), in, v == 0, multiprocessors, stream);
        err != cudaSuccess) {
      return err;
    }
  }
  return cudaSuccess;
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

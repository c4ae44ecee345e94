// Kernels of linear16.cuh. The weights are read as raw 16-bit patterns and widened with the same
// bit operations the CPU backend uses (bf16: the upper half of an f32), so both backends multiply
// the same f32 values.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "worker/kernels/cuda/gemv16_dots.cuh"
#include "worker/kernels/cuda/linear16.cuh"
#include "worker/kernels/cuda/pdl.cuh"
#include "worker/kernels/cuda/row_norm.cuh"
#include "worker/kernels/shared/linear_group_math.h"

namespace shardserve::kernels::cuda {
namespace {

using gemv16::kVec;
using gemv16::kWarp;
using gemv16::WarpSum;
using gemv16::Widen;
constexpr int kGemvWarps = 4;        // rows per block (one warp per row)
constexpr int kPrefetchRows = 2;     // weight rows each GEMV warp has on their way into L2
constexpr int kGemvBlocksPerSm = 8;  // GEMV blocks a multiprocessor holds at once (1-token steps)
// 16-byte weight loads in flight per lane in the normed form: 4, so that its registers (the
// normalisation takes some) stay within the 1-token plain kernel's 64 and kGemvBlocksPerSm holds.
constexpr int kNormLoads = 4;
constexpr int kElementThreads = 256;
constexpr int64_t kMaxGrid = 65535;

unsigned GridFor(int64_t blocks) { return static_cast<unsigned>(blocks < kMaxGrid ? blocks : kMaxGrid); }

// Pulls weight row r of the group into L2 (nothing past the last row).
__device__ __forceinline__ void PrefetchRow(const Gemv16Group& g, int64_t r, int64_t total_rows, int64_t in, int lane) {
  if (r >= total_rows) return;
  const GroupRow at = LocateGroupRow(g.out, g.parts, r);
  pdl::PrefetchL2(static_cast<const uint16_t*>(g.w[at.part]) + at.row * in, in * 2, lane);
}

// One warp per output row of the group's rows (grid-stride; part after part), for batches of at
// most kRows tokens (kRows sizes the accumulators: a 1-token step keeps its registers, and so more
// warps per multiprocessor). `kVectorized`: in % 8 == 0 and every row and activation row 16-byte
// aligned, so each lane loads 8 weights and 2 x float4 per token at once.
// The loads in flight bound the rate, so each warp keeps kPrefetchRows rows ahead of the one it
// multiplies on their way into L2 (prefetches take no registers); the first ones are asked for
// before pdl::Wait(), while the previous kernel still runs. `kNorm`: the normed form (Gemv16Norm):
// the block's threads first compute the tokens' inverse RMS together (row_norm.cuh), then every
// warp normalises the activations as it reads them.
template <DType kType, bool kVectorized, int kLoads, int kRows, bool kNorm>
__global__ void __launch_bounds__(kGemvWarps* kWarp)
    Gemv16Kernel(const float* __restrict__ x, const Gemv16Group g, int tokens, int64_t in, int64_t total_rows,
                 const Gemv16Norm norm) {
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int64_t first = int64_t{blockIdx.x} * kGemvWarps + warp;
  const int64_t stride = int64_t{gridDim.x} * kGemvWarps;
#pragma unroll
  for (int k = 0; k < kPrefetchRows; ++k) PrefetchRow(g, first + k * stride, total_rows, in, lane);
  pdl::LaunchDependents();
  pdl::Wait();
  const float* inv = nullptr;  // the normed form: each token's inverse RMS, in shared memory
  if constexpr (kNorm) {
    __shared__ float partial[kRows * kRowWarps], inv_rms[kRows];
    RowInvRms<kRows>(x, tokens, in, norm.eps, partial, inv_rms);
    inv = inv_rms;
  }
  for (int64_t r = first; r < total_rows; r += stride) {
    PrefetchRow(g, r + kPrefetchRows * stride, total_rows, in, lane);
    const GroupRow at = LocateGroupRow(g.out, g.parts, r);
    const int part = at.part;
    const int64_t row = at.row;
    const uint16_t* wr = static_cast<const uint16_t*>(g.w[part]) + row * in;
    const int64_t out = g.out[part];
    const float* bias = g.bias[part];
    float* y = g.y[part];
    const bool accumulate = g.accumulate[part];
    float acc[kRows];
#pragma unroll
    for (int t = 0; t < kRows; ++t) acc[t] = 0.f;
    gemv16::RowDots<kType, kVectorized, kLoads, kRows, kNorm>(wr, x, tokens, in, lane, acc, norm.weight, inv);
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

// GEMV of the gated form (LinearGroupParams::gated): one warp per output row r (grid-stride), which
// multiplies the gate's row r and then the up's row r with the same activations and writes
// GatedProduct(act, gate, up) once. Each dot is Gemv16Kernel's (the same RowDots instantiation,
// WarpSum and bias add, lane 0's value), and the product is the SiluMul kernels' formula, so y is
// what Gemv16Kernel of the two parts followed by SiluMul writes, bit for bit. The two dots run one
// after the other, so the registers are those of one (a 1-token step keeps Gemv16Kernel's
// occupancy), and the prefetches keep both rows kPrefetchRows rows ahead.
template <DType kType, bool kVectorized, int kLoads, int kRows, bool kNorm>
__global__ void __launch_bounds__(kGemvWarps* kWarp)
    GatedGemv16Kernel(const float* __restrict__ x, const GatedGemv16Params g, int tokens, int64_t in,
                      const Gemv16Norm norm) {
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int64_t first = int64_t{blockIdx.x} * kGemvWarps + warp;
  const int64_t stride = int64_t{gridDim.x} * kGemvWarps;
  const auto* w_gate = static_cast<const uint16_t*>(g.w_gate);
  const auto* w_up = static_cast<const uint16_t*>(g.w_up);
  auto prefetch = [&](int64_t r) {
    if (r >= g.out) return;
    pdl::PrefetchL2(w_gate + r * in, in * 2, lane);
    pdl::PrefetchL2(w_up + r * in, in * 2, lane);
  };
#pragma unroll
  for (int k = 0; k < kPrefetchRows; ++k) prefetch(first + k * stride);
  pdl::LaunchDependents();
  pdl::Wait();
  const float* inv = nullptr;  // the normed form: each token's inverse RMS, in shared memory
  if constexpr (kNorm) {
    __shared__ float partial[kRows * kRowWarps], inv_rms[kRows];
    RowInvRms<kRows>(x, tokens, in, norm.eps, partial, inv_rms);
    inv = inv_rms;
  }
  for (int64_t r = first; r < g.out; r += stride) {
    prefetch(r + kPrefetchRows * stride);
    float acc[kRows];
#pragma unroll
    for (int t = 0; t < kRows; ++t) acc[t] = 0.f;
    gemv16::RowDots<kType, kVectorized, kLoads, kRows, kNorm>(w_gate + r * in, x, tokens, in, lane, acc, norm.weight,
                                                              inv);
    float gate[kRows];
#pragma unroll
    for (int t = 0; t < kRows; ++t) {
      gate[t] = t < tokens ? WarpSum(acc[t]) : 0.f;
      acc[t] = 0.f;
    }
    gemv16::RowDots<kType, kVectorized, kLoads, kRows, kNorm>(w_up + r * in, x, tokens, in, lane, acc, norm.weight,
                                                              inv);
#pragma unroll
    for (int t = 0; t < kRows; ++t) {
      if (t < tokens) {
        const float up = WarpSum(acc[t]);
        if (lane == 0) {
          // Gemv16Kernel's sums without accumulation: (0 + dot) + bias.
          const float bg = g.bias_gate != nullptr ? g.bias_gate[r] : 0.f;
          const float bu = g.bias_up != nullptr ? g.bias_up[r] : 0.f;
          g.y[t * g.out + r] = GatedProduct(g.act, 0.f + gate[t] + bg, 0.f + up + bu);
        }
      }
    }
  }
}

template <DType kType>
__global__ void CastKernel(const float* __restrict__ x, uint16_t* __restrict__ dst, int64_t n) {
  pdl::LaunchDependents();
  pdl::Wait();
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
  pdl::LaunchDependents();
  pdl::Wait();
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

// A norm takes a weight, a finite eps >= 0 and rows of at least one element.
bool NormAccepted(const Gemv16Norm* norm, int64_t in) {
  return norm == nullptr || (norm->weight != nullptr && norm->eps >= 0.f && isfinite(norm->eps) && in > 0);
}

// The normed instances issue kNormLoads weight loads at a time whatever `loads` asks (the same sums
// either way), and exist for that and the scalar walk only.
template <DType kType, int kRows>
cudaError_t LaunchGemv16Rows(const float* x, const Gemv16Group& g, int tokens, int64_t in, int64_t rows, bool aligned,
                             int loads, const Gemv16Norm* norm, unsigned grid, cudaStream_t stream) {
  constexpr unsigned kThreads = kGemvWarps * kWarp;
  if (norm != nullptr) {
    if (!aligned) {
      return pdl::Launch(Gemv16Kernel<kType, false, 1, kRows, true>, grid, kThreads, 0, stream, x, g, tokens, in, rows,
                         *norm);
    }
    return pdl::Launch(Gemv16Kernel<kType, true, kNormLoads, kRows, true>, grid, kThreads, 0, stream, x, g, tokens, in, rows,
                       *norm);
  }
  const Gemv16Norm none;
  if (!aligned) {
    return pdl::Launch(Gemv16Kernel<kType, false, 1, kRows, false>, grid, kThreads, 0, stream, x, g, tokens, in, rows,
                       none);
  }
  if (loads == 8) {
    return pdl::Launch(Gemv16Kernel<kType, true, 8, kRows, false>, grid, kThreads, 0, stream, x, g, tokens, in, rows,
                       none);
  }
  return pdl::Launch(Gemv16Kernel<kType, true, 4, kRows, false>, grid, kThreads, 0, stream, x, g, tokens, in, rows,
                     none);
}

template <DType kType, int kRows>
cudaError_t LaunchGatedGemv16Rows(const float* x, const GatedGemv16Params& g, int tokens, int64_t in, bool aligned,
                                  int loads, const Gemv16Norm* norm, unsigned grid, cudaStream_t stream) {
  constexpr unsigned kThreads = kGemvWarps * kWarp;
  if (norm != nullptr) {
    if (!aligned) {
      return pdl::Launch(GatedGemv16Kernel<kType, false, 1, kRows, true>, grid, kThreads, 0, stream, x, g, tokens, in,
                         *norm);
    }
    return pdl::Launch(GatedGemv16Kernel<kType, true, kNormLoads, kRows, true>, grid, kThreads, 0, stream, x, g, tokens, in,
                       *norm);
  }
  const Gemv16Norm none;
  if (!aligned) {
    return pdl::Launch(GatedGemv16Kernel<kType, false, 1, kRows, false>, grid, kThreads, 0, stream, x, g, tokens, in,
                       none);
  }
  if (loads == 8) {
    return pdl::Launch(GatedGemv16Kernel<kType, true, 8, kRows, false>, grid, kThreads, 0, stream, x, g, tokens, in,
                       none);
  }
  return pdl::Launch(GatedGemv16Kernel<kType, true, 4, kRows, false>, grid, kThreads, 0, stream, x, g, tokens, in,
                     none);
}

// At most one wave of blocks over `rows` output rows (one warp each): each warp then walks several
// rows and prefetches the next ones.
unsigned GemvGrid(int64_t rows, int multiprocessors) {
  const int64_t wave = int64_t{multiprocessors > 0 ? multiprocessors : 1} * kGemvBlocksPerSm;
  const int64_t blocks = (rows + kGemvWarps - 1) / kGemvWarps;
  return GridFor(blocks < wave ? blocks : wave);
}

// The gated GEMV over the Gemv16 paths: the same kRows buckets and alignment test as Gemv16 gives
// the gate and up parts, so each dot is summed as the plain GEMV sums it.
template <DType kType>
cudaError_t GatedGemv16(const float* x, const GatedGemv16Params& g, int64_t tokens, int64_t in, int loads,
                        const Gemv16Norm* norm, int multiprocessors, cudaStream_t stream) {
  if (g.out == 0) return cudaSuccess;
  const bool aligned = in % kVec == 0 && Aligned16(x) && Aligned16(g.w_gate) && Aligned16(g.w_up) &&
                       (norm == nullptr || Aligned16(norm->weight));
  const unsigned grid = GemvGrid(g.out, multiprocessors);
  const int t = static_cast<int>(tokens);
  if (t <= 1) return LaunchGatedGemv16Rows<kType, 1>(x, g, t, in, aligned, loads, norm, grid, stream);
  if (t <= 2) return LaunchGatedGemv16Rows<kType, 2>(x, g, t, in, aligned, loads, norm, grid, stream);
  if (t <= 4) return LaunchGatedGemv16Rows<kType, 4>(x, g, t, in, aligned, loads, norm, grid, stream);
  return LaunchGatedGemv16Rows<kType, kGemv16MaxTokens>(x, g, t, in, aligned, loads, norm, grid, stream);
}

template <DType kType>
cudaError_t Gemv16(const float* x, const Gemv16Group& g, int64_t tokens, int64_t in, int loads, const Gemv16Norm* norm,
                   int multiprocessors, cudaStream_t stream) {
  int64_t rows = 0;
  bool aligned = in % kVec == 0 && Aligned16(x) && (norm == nullptr || Aligned16(norm->weight));
  for (int p = 0; p < g.parts; ++p) {
    rows += g.out[p];
    aligned = aligned && Aligned16(g.w[p]);
  }
  if (rows == 0) return cudaSuccess;
  const unsigned grid = GemvGrid(rows, multiprocessors);
  const int t = static_cast<int>(tokens);
  if (t <= 1) return LaunchGemv16Rows<kType, 1>(x, g, t, in, rows, aligned, loads, norm, grid, stream);
  if (t <= 2) return LaunchGemv16Rows<kType, 2>(x, g, t, in, rows, aligned, loads, norm, grid, stream);
  if (t <= 4) return LaunchGemv16Rows<kType, 4>(x, g, t, in, rows, aligned, loads, norm, grid, stream);
  return LaunchGemv16Rows<kType, kGemv16MaxTokens>(x, g, t, in, rows, aligned, loads, norm, grid, stream);
}

}  // namespace

cudaError_t LaunchGemv16(DType dtype, const float* x, const Gemv16Group& group, int64_t tokens, int64_t in, int loads,
                         int multiprocessors, cudaStream_t stream, const Gemv16Norm* norm) {
  if (tokens == 0) return cudaSuccess;
  if (tokens > kGemv16MaxTokens || (loads != 4 && loads != 8) || group.parts < 1 ||
      group.parts > Gemv16Group::kMaxParts || !NormAccepted(norm, in)) {
    return cudaErrorInvalidValue;
  }
  switch (dtype) {
    case DType::kBF16:
      return Gemv16<DType::kBF16>(x, group, tokens, in, loads, norm, multiprocessors, stream);
    case DType::kF16:
      return Gemv16<DType::kF16>(x, group, tokens, in, loads, norm, multiprocessors, stream);
    case DType::kF32:
    case DType::kF8E4M3:
    case DType::kQ8:
    case DType::kU8:
    case DType::kMxfp4:
      break;
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchGatedGemv16(DType dtype, const float* x, const GatedGemv16Params& gemv, int64_t tokens,
                              int64_t in, int loads, int multiprocessors, cudaStream_t stream, const Gemv16Norm* norm) {
  if (tokens == 0) return cudaSuccess;
  if (tokens > kGemv16MaxTokens || (loads != 4 && loads != 8) || !NormAccepted(norm, in)) {
    return cudaErrorInvalidValue;
  }
  switch (dtype) {
    case DType::kBF16:
      return GatedGemv16<DType::kBF16>(x, gemv, tokens, in, loads, norm, multiprocessors, stream);
    case DType::kF16:
      return GatedGemv16<DType::kF16>(x, gemv, tokens, in, loads, norm, multiprocessors, stream);
    case DType::kF32:
    case DType::kF8E4M3:
    case DType::kQ8:
    case DType::kU8:
    case DType::kMxfp4:
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
      pdl::Launch(CastKernel<DType::kBF16>, grid, kElementThreads, 0, stream, x, d, n);
      return cudaGetLastError();
    case DType::kF16:
      pdl::Launch(CastKernel<DType::kF16>, grid, kElementThreads, 0, stream, x, d, n);
      return cudaGetLastError();
    case DType::kF32:
    case DType::kF8E4M3:
    case DType::kQ8:
    case DType::kU8:
    case DType::kMxfp4:
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
      pdl::Launch(EmbeddingKernel<DType::kF32>, GridFor(tokens), threads, 0, stream, table, ids, out, tokens, hidden);
      break;
    case DType::kBF16:
      pdl::Launch(EmbeddingKernel<DType::kBF16>, GridFor(tokens), threads, 0, stream, table, ids, out, tokens, hidden);
      break;
    case DType::kF16:
      pdl::Launch(EmbeddingKernel<DType::kF16>, GridFor(tokens), threads, 0, stream, table, ids, out, tokens, hidden);
      break;
    case DType::kF8E4M3:
    case DType::kQ8:
    case DType::kU8:
    case DType::kMxfp4:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace shardserve::kernels::cuda

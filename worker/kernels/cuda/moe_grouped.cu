// Kernels of moe_grouped.cuh. 16-bit weights are widened with the CPU backend's bit operations
// (bf16: the upper half of an f32), so both backends multiply the same f32 values.
#include "worker/kernels/cuda/moe_grouped.cuh"

#include <cuda_fp16.h>

#include "worker/kernels/cuda/gemv16_dots.cuh"

namespace shardserve::kernels::cuda {
namespace {

using gemv16::kVec;
using gemv16::kWarp;
using gemv16::WarpSum;
constexpr int kGemvWarps = 4;  // output rows per block (one warp per row)
constexpr int kLoads = 4;      // 16-byte loads a lane keeps in flight
constexpr int kCombineThreads = 256;
constexpr int64_t kMaxGrid = 65535;

static_assert(kCombineThreads >= kMaxLaunchGroups, "the combine searches one group per thread");

unsigned GridFor(int64_t blocks) { return static_cast<unsigned>(blocks < kMaxGrid ? blocks : kMaxGrid); }

// Where a grouped kernel finds group g: a GroupTable passed by value, or the device-offsets form
// (expert ids[g]'s rows [offsets[e], offsets[e + 1]) and weights[g], read on the device).
struct TableGroups {
  GroupTable table;
  __device__ int Count() const { return table.n; }
  __device__ GroupRange Range(int g) const { return table.range[g]; }
  // The GEMV's group for block row `slot`: group `slot` (empty ones were left out on the host).
  __device__ bool Slot(int slot, int /*lane*/, GroupRange& range, const void*& w) const {
    range = table.range[slot];
    w = table.w[slot];
    return true;
  }
};
struct OffsetGroups {
  DeviceGroups groups;
  __device__ int Count() const { return groups.num_held; }
  __device__ GroupRange Range(int g) const {
    const int32_t e = groups.ids[g];
    const int32_t begin = groups.offsets[e];
    return {begin, groups.offsets[e + 1] - begin};
  }
  // The GEMV's group for block row `slot`: the slot-th held expert with rows, found by the whole
  // warp (every lane calls it; 32 experts a pass, a ballot of the non-empty ones), so that the
  // grid needs only as many block rows as there can be non-empty experts (at most the rows), not
  // one per held expert. false: fewer non-empty experts than slot + 1.
  __device__ bool Slot(int slot, int lane, GroupRange& range, const void*& w) const {
    int seen = 0;
    for (int base = 0; base < groups.num_held; base += kWarp) {
      const int g = base + lane;
      const GroupRange mine = g < groups.num_held ? Range(g) : GroupRange{};
      const unsigned busy = __ballot_sync(0xffffffffu, mine.count > 0);
      const int n = __popc(busy);
      if (slot < seen + n) {
        const int rank = __popc(busy & ((1u << lane) - 1u));
        const unsigned hit = __ballot_sync(0xffffffffu, mine.count > 0 && seen + rank == slot);
        const int src = __ffs(static_cast<int>(hit)) - 1;
        range.begin = __shfl_sync(0xffffffffu, mine.begin, src);
        range.count = __shfl_sync(0xffffffffu, mine.count, src);
        w = groups.weights[base + src];
        return true;
      }
      seen += n;
    }
    return false;
  }
};

// blockIdx.y: the group slot (Groups::Slot; a block without a group exits at once); warps stride
// over its output rows; each warp multiplies its weight row with the group's rows a tile at a time
// (GemvTiles / GemvTileRows).
template <DType kType, bool kVectorized, typename Groups>
__global__ void __launch_bounds__(kGemvWarps * kWarp)
    GroupedGemv16Kernel(const float* __restrict__ x, float* __restrict__ y, const Groups groups, int64_t in,
                        int64_t out, bool accumulate) {
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  GroupRange range;
  const void* group_w = nullptr;
  // Every warp finds the block's group itself (no shared memory, no barrier).
  if (!groups.Slot(static_cast<int>(blockIdx.y), lane, range, group_w) || range.count <= 0) return;
  const auto* w = static_cast<const uint16_t*>(group_w);
  const int32_t tiles = GemvTiles(range.count, kGroupedGemvTile);
  for (int64_t o = int64_t{blockIdx.x} * kGemvWarps + warp; o < out; o += int64_t{gridDim.x} * kGemvWarps) {
    const uint16_t* wr = w + o * in;
    for (int32_t t = 0; t < tiles; ++t) {
      const int64_t first = int64_t{range.begin} + int64_t{t} * kGroupedGemvTile;
      const int rows = GemvTileRows(range.count, kGroupedGemvTile, t);
      float acc[kGroupedGemvTile];
#pragma unroll
      for (int r = 0; r < kGroupedGemvTile; ++r) acc[r] = 0.f;
      gemv16::RowDots<kType, kVectorized, kLoads>(wr, x + first * in, rows, in, lane, acc);
#pragma unroll
      for (int r = 0; r < kGroupedGemvTile; ++r) {
        if (r < rows) {
          const float sum = WarpSum(acc[r]);
          if (lane == 0) {
            float* dst = y + (first + r) * out + o;
            *dst = (accumulate ? *dst : 0.f) + sum;
          }
        }
      }
    }
  }
}

__global__ void BuildPointersKernel(const GroupTable table, const float* x, float* y, int64_t in, int64_t out,
                                    const void** pointers, int total, int first) {
  const int g = static_cast<int>(threadIdx.x);
  if (g >= table.n) return;
  pointers[first + g] = table.w[g];
  pointers[total + first + g] = x + int64_t{table.range[g].begin} * in;
  pointers[2 * total + first + g] = y + int64_t{table.range[g].begin} * out;
}

// One block per token (grid-stride). The groups are taken kCombineThreads at a time, in order:
// thread i searches group base + i; a block-wide ordered compaction (warp ballots, then the warps'
// counts) lists the found rows in group order; then the threads stride over the token's columns,
// each adding to the column it added to for the groups before (the same chain of fused adds).
template <typename Groups>
__global__ void __launch_bounds__(kCombineThreads)
    MoeCombineKernel(const float* __restrict__ src, const int32_t* __restrict__ rows, const float* __restrict__ scales,
                     const Groups groups, float* __restrict__ dst, int64_t tokens, int64_t width) {
  __shared__ int32_t found[kCombineThreads];
  __shared__ int warp_counts[kCombineThreads / kWarp];
  const int i = static_cast<int>(threadIdx.x);
  const int lane = i % kWarp;
  const int warp = i / kWarp;
  const int num_groups = groups.Count();
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    for (int base = 0; base < num_groups; base += kCombineThreads) {
      const int g = base + i;
      const int32_t at = g < num_groups ? FindGroupedRow(rows, groups.Range(g), static_cast<int32_t>(t)) : -1;
      const unsigned hits = __ballot_sync(0xffffffffu, at >= 0);
      if (lane == 0) warp_counts[warp] = __popc(hits);
      __syncthreads();
      int before = 0, n = 0;
      for (int k = 0; k < kCombineThreads / kWarp; ++k) {
        before += k < warp ? warp_counts[k] : 0;
        n += warp_counts[k];
      }
      if (at >= 0) found[before + __popc(hits & ((1u << lane) - 1u))] = at;
      __syncthreads();
      float* d = dst + t * width;
      for (int64_t e = i; e < width && n > 0; e += kCombineThreads) {
        d[e] = CombineElement(d[e], src, scales, found, n, width, e);
      }
      __syncthreads();  // found and warp_counts are rewritten for the next groups or token
    }
  }
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// num_groups group slots (block rows). `aligned`: every weight matrix 16-byte aligned.
template <DType kType, typename Groups>
cudaError_t GroupedGemv16(const float* x, float* y, const Groups& groups, int num_groups, bool aligned, int64_t in,
                          int64_t out, bool accumulate, cudaStream_t stream) {
  // Vectorized loads need every activation row and weight row 16-byte aligned: in % 8 == 0 and
  // aligned bases.
  aligned = aligned && in % kVec == 0 && Aligned16(x);
  const dim3 grid(GridFor((out + kGemvWarps - 1) / kGemvWarps), static_cast<unsigned>(num_groups));
  constexpr unsigned kThreads = kGemvWarps * kWarp;
  if (aligned) {
    GroupedGemv16Kernel<kType, true><<<grid, kThreads, 0, stream>>>(x, y, groups, in, out, accumulate);
  } else {
    GroupedGemv16Kernel<kType, false><<<grid, kThreads, 0, stream>>>(x, y, groups, in, out, accumulate);
  }
  return cudaGetLastError();
}

template <typename Groups>
cudaError_t GroupedGemv16Typed(DType dtype, const float* x, float* y, const Groups& groups, int num_groups,
                               bool aligned, int64_t in, int64_t out, bool accumulate, cudaStream_t stream) {
  switch (dtype) {
    case DType::kBF16:
      return GroupedGemv16<DType::kBF16>(x, y, groups, num_groups, aligned, in, out, accumulate, stream);
    case DType::kF16:
      return GroupedGemv16<DType::kF16>(x, y, groups, num_groups, aligned, in, out, accumulate, stream);
    case DType::kF32:
    case DType::kF8E4M3:
    case DType::kQ8:
    case DType::kU8:
    case DType::kMxfp4:
      break;
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t LaunchGroupedGemv16(DType dtype, const float* x, float* y, const GroupTable& table, int64_t in,
                                int64_t out, bool accumulate, cudaStream_t stream) {
  if (table.n == 0 || out == 0) return cudaSuccess;
  if (table.n < 0 || table.n > kMaxLaunchGroups || in <= 0) return cudaErrorInvalidValue;
  bool aligned = true;
  for (int g = 0; g < table.n; ++g) aligned = aligned && Aligned16(table.w[g]);
  return GroupedGemv16Typed(dtype, x, y, TableGroups{table}, table.n, aligned, in, out, accumulate, stream);
}

cudaError_t LaunchGroupedGemv16(DType dtype, const float* x, float* y, const DeviceGroups& groups,
                                bool weights_aligned, int64_t rows, int64_t in, int64_t out, bool accumulate,
                                cudaStream_t stream) {
  if (groups.num_held == 0 || out == 0 || rows == 0) return cudaSuccess;
  if (groups.num_held < 0 || rows < 0 || in <= 0) return cudaErrorInvalidValue;
  // At most one non-empty expert per row: no more slots than that.
  const int64_t slots = rows < groups.num_held ? rows : groups.num_held;
  if (slots > kMaxGrid) return cudaErrorInvalidValue;
  return GroupedGemv16Typed(dtype, x, y, OffsetGroups{groups}, static_cast<int>(slots), weights_aligned, in, out,
                            accumulate, stream);
}

cudaError_t LaunchBuildGroupedPointers(const GroupTable& table, const float* x, float* y, int64_t in, int64_t out,
                                       const void** pointers, int total, int first, cudaStream_t stream) {
  if (table.n == 0) return cudaSuccess;
  if (table.n < 0 || table.n > kMaxLaunchGroups || first + table.n > total) return cudaErrorInvalidValue;
  BuildPointersKernel<<<1, kMaxLaunchGroups, 0, stream>>>(table, x, y, in, out, pointers, total, first);
  return cudaGetLastError();
}

cudaError_t LaunchMoeCombine(const float* src, const int32_t* rows, const float* scales, const GroupTable& table,
                             float* dst, int64_t tokens, int64_t width, cudaStream_t stream) {
  if (table.n == 0 || tokens == 0 || width == 0) return cudaSuccess;
  if (table.n < 0 || table.n > kMaxLaunchGroups) return cudaErrorInvalidValue;
  MoeCombineKernel<<<GridFor(tokens), kCombineThreads, 0, stream>>>(src, rows, scales, TableGroups{table}, dst, tokens,
                                                                    width);
  return cudaGetLastError();
}

cudaError_t LaunchMoeCombine(const float* src, const int32_t* rows, const float* scales, const DeviceGroups& groups,
                             float* dst, int64_t tokens, int64_t width, cudaStream_t stream) {
  if (groups.num_held == 0 || tokens == 0 || width == 0) return cudaSuccess;
  if (groups.num_held < 0) return cudaErrorInvalidValue;
  MoeCombineKernel<<<GridFor(tokens), kCombineThreads, 0, stream>>>(src, rows, scales, OffsetGroups{groups}, dst,
                                                                    tokens, width);
  return cudaGetLastError();
}

}  // namespace shardserve::kernels::cuda

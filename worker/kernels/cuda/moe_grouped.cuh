// The grouped expert products and the combine of a MoE layer on the device. Internal to
// worker/kernels/cuda: only cuda_backend.cu includes this header.
//
// Group tables travel by value, as kernel parameters (at most kMaxLaunchGroups per launch, 2 KiB
// under the classic 4 KiB parameter limit): a launch carries its experts' weight pointers and row
// ranges itself, so nothing is copied from the host and nothing waits. A layer with more active
// experts than kMaxLaunchGroups takes several launches; the sums stay the same (below).
//
//   * LaunchGroupedGemv16: every group's rows times its 16-bit weight matrix in one launch. The
//     grid is (output-row tiles, groups); each warp owns one output row of one group, reads that
//     weight row with 16-byte loads, widens it to f32 and multiplies it with the group's f32
//     activations kGroupedGemvTile rows at a time (f32 products and sums), like LaunchGemv16 does
//     for one matrix. Memory-bound at decode sizes: each expert's weights are read once per tile.
//   * LaunchBuildGroupedPointers: writes the A, B and C pointer arrays cublasGemmGroupedBatchedEx
//     reads from device memory, on the device, in stream order (the previous call's GEMM has
//     read them before they are overwritten), so no host copy precedes a grouped GEMM.
//   * The device-offsets forms (DeviceGroups): the same kernels reading each expert's row range
//     from the offsets MoeRoute left on the device and its weights from a table built at load, so
//     a MoE decode step needs no host copy of the offsets (and can be recorded as a graph).
//   * LaunchMoeCombine: one block per token: each thread binary-searches one group for the
//     token's row (FindGroupedRow), the found rows are compacted in group order, and the threads
//     add them to the token's columns with CombineElement, the arithmetic of a ScatterAddRows per
//     expert: the hidden state bit for bit as the per-expert scatters leave it. Several launches
//     (more than kMaxLaunchGroups groups) add their groups one launch after the other: the same
//     order.
#ifndef SHARDSERVE_WORKER_KERNELS_CUDA_MOE_GROUPED_CUH_
#define SHARDSERVE_WORKER_KERNELS_CUDA_MOE_GROUPED_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "common/tensor/dtype.h"
#include "worker/kernels/shared/moe_math.h"

namespace shardserve::kernels::cuda {

inline constexpr int kMaxLaunchGroups = 128;
// Rows of a group one pass over a weight row serves (registers per lane: one sum per row).
inline constexpr int32_t kGroupedGemvTile = 8;
// The largest group the backend gives the GEMV: up to 4 passes over an expert's weights (the
// later ones mostly from L2). Larger groups have GEMM-sized work (see cuda_backend.cu).
inline constexpr int64_t kGroupedGemvMaxRows = 32;

// One launch's groups: weight matrix g ([out, in]) multiplies rows [range[g].begin,
// range[g].begin + range[g].count) of x into the same rows of y. w is unused by the combine.
struct GroupTable {
  int n = 0;  // <= kMaxLaunchGroups
  const void* w[kMaxLaunchGroups] = {};
  GroupRange range[kMaxLaunchGroups] = {};
};

// The device-offsets form's groups (GroupedLinearParams / MoeCombineParams::device): group i is
// expert ids[i]'s rows [offsets[e], offsets[e + 1]), times weights[i] (unused by the combine), all
// read on the device, so a launch needs nothing from the host but these pointers.
struct DeviceGroups {
  const int32_t* offsets = nullptr;      // [num_experts + 1] device
  const int32_t* ids = nullptr;          // [num_held] device
  const void* const* weights = nullptr;  // [num_held] device, or null (the combine)
  int num_held = 0;
};

// y[r, o] (+)= sum_i x[r, i] * w_g[o, i] for every group g of `table` and row r of its range. x:
// [rows, in] f32; y: [rows, out] f32; weights of `dtype` (kBF16 or kF16). in > 0.
cudaError_t LaunchGroupedGemv16(DType dtype, const float* x, float* y, const GroupTable& table, int64_t in,
                                int64_t out, bool accumulate, cudaStream_t stream);
// The same over `groups` in one launch. The grid has min(num_held, rows) block rows (a non-empty
// expert has at least one of the `rows` rows): block row j finds the j-th held expert with rows
// on the device (a warp ballot over the offsets), and block rows past the last such expert exit at
// once, so a decode step with few active experts launches few idle blocks. `weights_aligned`: every
// weights[i] is 16-byte aligned (the caller checks its host copy). Any group size works; each is
// read once per kGroupedGemvTile rows, so the caller keeps groups small (kGroupedGemvMaxRows).
cudaError_t LaunchGroupedGemv16(DType dtype, const float* x, float* y, const DeviceGroups& groups,
                                bool weights_aligned, int64_t rows, int64_t in, int64_t out, bool accumulate,
                                cudaStream_t stream);

// For each group g < table.n: pointers[first + g] = w_g, pointers[total + first + g] = x + begin_g
// * in, pointers[2 * total + first + g] = y + begin_g * out. pointers: [3 * total] device.
cudaError_t LaunchBuildGroupedPointers(const GroupTable& table, const float* x, float* y, int64_t in, int64_t out,
                                       const void** pointers, int total, int first, cudaStream_t stream);

// dst[t] += the rows of token t in table's groups, in group order, times scales (null: 1). src:
// [count, width]; rows, scales: [count]; dst: [tokens, width].
cudaError_t LaunchMoeCombine(const float* src, const int32_t* rows, const float* scales, const GroupTable& table,
                             float* dst, int64_t tokens, int64_t width, cudaStream_t stream);
// The same over `groups` (any number, kCombineThreads searched at a time, in order) in one launch.
cudaError_t LaunchMoeCombine(const float* src, const int32_t* rows, const float* scales, const DeviceGroups& groups,
                             float* dst, int64_t tokens, int64_t width, cudaStream_t stream);

}  // namespace shardserve::kernels::cuda

#endif  // SHARDSERVE_WORKER_KERNELS_CUDA_MOE_GROUPED_CUH_

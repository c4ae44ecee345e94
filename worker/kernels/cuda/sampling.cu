// SampleRows on the device; the plan is in sampling.cuh.
#include "worker/kernels/cuda/sampling.cuh"

#include <cub/device/device_segmented_radix_sort.cuh>

#include <cmath>

#include "worker/kernels/cuda/ops.cuh"
#include "worker/kernels/cuda/workspace.cuh"
#include "worker/kernels/shared/sampling_math.h"

namespace shardserve::kernels::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kPickThreads = 256;
constexpr int64_t kMaxGrid = 65535;

unsigned GridFor(int64_t blocks) { return static_cast<unsigned>(blocks < kMaxGrid ? blocks : kMaxGrid); }

// The workspace, carved in this order (WorkspaceCarver: each part aligned).
struct Workspace {
  float* keys = nullptr;      // [rows, stride] the sorted logits (a row's first `width`)
  int32_t* ids_in = nullptr;  // [rows, stride] 0 .. width - 1 per sorted row
  int32_t* ids = nullptr;     // [rows, stride] the sorted ids
  int* begin = nullptr;       // [rows] segment offsets
  int* end = nullptr;         // [rows]
  void* temp = nullptr;       // CUB's temporary storage
  size_t temp_bytes = 0;
  size_t total = 0;
};

// The layout for p, with pointers into `base` (or from 0 when base is null, to size it).
Workspace Carve(const SampleRowsParams& p, char* base, size_t temp_bytes) {
  const size_t items = static_cast<size_t>(p.rows * p.stride);
  Workspace w;
  WorkspaceCarver carve(base);
  w.keys = carve.Take<float>(items);
  w.ids_in = carve.Take<int32_t>(items);
  w.ids = carve.Take<int32_t>(items);
  w.begin = carve.Take<int>(static_cast<size_t>(p.rows));
  w.end = carve.Take<int>(static_cast<size_t>(p.rows));
  w.temp = carve.Take<char>(temp_bytes);
  w.temp_bytes = temp_bytes;
  w.total = carve.total();
  return w;
}

cudaError_t SortRows(const SampleRowsParams& p, const Workspace& w, void* temp, size_t& temp_bytes,
                     cudaStream_t stream) {
  return cub::DeviceSegmentedRadixSort::SortPairsDescending(
      temp, temp_bytes, p.x, w.keys, w.ids_in, w.ids, static_cast<int>(p.rows * p.stride), static_cast<int>(p.rows),
      w.begin, w.end, 0, static_cast<int>(sizeof(float) * 8), stream);
}

// One block per row: the row's segment for the sort (empty for an argmax row) and its ids.
__global__ void PrepareSortKernel(const RowSamplingParams* params, int32_t* ids_in, int* begin, int* end, int64_t rows,
                                  int64_t width, int64_t stride) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const RowSamplingParams q = params[r];
    const bool sort = !SamplesArgmax(q.temperature, q.top_k);
    if (threadIdx.x == 0) {
      begin[r] = static_cast<int>(r * stride);
      end[r] = static_cast<int>(r * stride + (sort ? width : 0));
    }
    if (!sort) continue;
    int32_t* ids = ids_in + r * stride;
    for (int64_t j = threadIdx.x; j < width; j += blockDim.x) ids[j] = static_cast<int32_t>(j);
  }
}

__device__ double BlockSumDouble(double v, double* scratch) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  __syncthreads();  // scratch may still be read from the previous row
  if (threadIdx.x % kWarp == 0) scratch[threadIdx.x / kWarp] = v;
  __syncthreads();
  double total = 0.0;
  for (int w = 0; w < static_cast<int>(blockDim.x / kWarp); ++w) total += scratch[w];
  return total;
}

// One block per sampled row (argmax rows keep what ArgmaxRows wrote): the candidates' total weight
// over the block, then thread 0's walk.
__global__ void PickKernel(const RowSamplingParams* params, const float* keys, const int32_t* ids, int32_t* out,
                           int64_t rows, int64_t width, int64_t stride) {
  __shared__ double scratch[kPickThreads / kWarp];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const RowSamplingParams q = params[r];
    if (SamplesArgmax(q.temperature, q.top_k)) continue;
    const float* sorted = keys + r * stride;
    const int32_t* sorted_ids = ids + r * stride;
    const float max_logit = sorted[0];
    if (isinf(max_logit)) {  // every token suppressed: nothing to weigh (as the CPU)
      if (threadIdx.x == 0) out[r] = sorted_ids[0];
      continue;
    }
    const int64_t count = SamplingCandidates(q.top_k, width);
    const double inv_t = 1.0 / static_cast<double>(q.temperature);
    double part = 0.0;
    for (int64_t i = threadIdx.x; i < count; i += blockDim.x) part += CandidateWeight(sorted[i], max_logit, inv_t);
    const double total = BlockSumDouble(part, scratch);
    if (threadIdx.x == 0) {
      const SortedLogitArray candidates{sorted};
      const int64_t chosen = PickSortedCandidate(candidates, count, total, q.top_p, q.min_p, inv_t,
                                                 SamplingUniformOf(q.seed, q.step));
      out[r] = sorted_ids[chosen];
    }
  }
}

}  // namespace

bool SampleRowsNeedsSort(const SampleRowsParams& p) {
  for (int64_t r = 0; r < p.rows; ++r) {
    if (!SamplesArgmax(p.host_params[r].temperature, p.host_params[r].top_k)) return true;
  }
  return false;
}

cudaError_t SampleRowsWorkspaceBytes(const SampleRowsParams& p, size_t* bytes) {
  *bytes = 0;
  if (p.rows == 0 || !SampleRowsNeedsSort(p)) return cudaSuccess;
  const Workspace sizing = Carve(p, nullptr, 0);
  size_t temp_bytes = 0;
  const cudaError_t err = SortRows(p, sizing, nullptr, temp_bytes, nullptr);
  if (err != cudaSuccess) return err;
  *bytes = Carve(p, nullptr, temp_bytes).total;
  return cudaSuccess;
}

cudaError_t LaunchSampleRows(const SampleRowsParams& p, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  cudaError_t err = LaunchArgmaxRows({.x = p.x, .out = p.out, .rows = p.rows, .width = p.width, .stride = p.stride},
                                     stream);
  if (err != cudaSuccess || !SampleRowsNeedsSort(p)) return err;
  const Workspace sizing = Carve(p, nullptr, 0);
  if (workspace == nullptr || workspace_bytes < sizing.total) return cudaErrorInvalidValue;
  const Workspace w = Carve(p, static_cast<char*>(workspace), workspace_bytes - sizing.total);
  PrepareSortKernel<<<GridFor(p.rows), kPickThreads, 0, stream>>>(p.params, w.ids_in, w.begin, w.end, p.rows, p.width,
                                                                  p.stride);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  size_t temp_bytes = w.temp_bytes;
  if ((err = SortRows(p, w, w.temp, temp_bytes, stream)) != cudaSuccess) return err;
  PickKernel<<<GridFor(p.rows), kPickThreads, 0, stream>>>(p.params, w.keys, w.ids, p.out, p.rows, p.width, p.stride);
  return cudaGetLastError();
}

}  // namespace shardserve::kernels::cuda

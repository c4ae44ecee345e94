// MoeRoute on the device; the plan is in moe_route.cuh.
#include "worker/kernels/cuda/moe_route.cuh"

#include <cub/device/device_radix_sort.cuh>

#include <cstdint>

#include "worker/kernels/cuda/workspace.cuh"
#include "worker/kernels/shared/moe_math.h"

namespace shardserve::kernels::cuda {
namespace {

constexpr int kThreads = 128;

unsigned BlocksFor(int64_t threads) { return static_cast<unsigned>((threads + kThreads - 1) / kThreads); }

// The bits that hold every expert id: ceil(log2(num_experts)), at least 1.
int ExpertBits(int num_experts) {
  int bits = 1;
  while ((int64_t{1} << bits) < num_experts) ++bits;
  return bits;
}

// The workspace, carved in this order (WorkspaceCarver: each part aligned).
struct Workspace {
  unsigned* experts = nullptr;         // [n] each choice's expert (the sort's keys; ids are >= 0)
  unsigned* experts_sorted = nullptr;  // [n]
  int32_t* choice = nullptr;           // [n] 0 .. n - 1 (the sort's values)
  int32_t* choice_sorted = nullptr;    // [n]
  float* weights = nullptr;            // [n] each choice's weight
  float* scratch = nullptr;            // [tokens, RouteTokenScratch]
  void* temp = nullptr;                // CUB's temporary storage
  size_t temp_bytes = 0;
  size_t total = 0;
};

// The layout for p, with pointers into `base` (or from 0 when base is null, to size it).
Workspace Carve(const MoeRouteParams& p, char* base, size_t temp_bytes) {
  const size_t n = static_cast<size_t>(p.tokens * p.routing.top_k);
  Workspace w;
  WorkspaceCarver carve(base);
  w.experts = carve.Take<unsigned>(n);
  w.experts_sorted = carve.Take<unsigned>(n);
  w.choice = carve.Take<int32_t>(n);
  w.choice_sorted = carve.Take<int32_t>(n);
  w.weights = carve.Take<float>(n);
  w.scratch = carve.Take<float>(static_cast<size_t>(p.tokens) * static_cast<size_t>(RouteTokenScratch(p.routing)));
  w.temp = carve.Take<char>(temp_bytes);
  w.temp_bytes = temp_bytes;
  w.total = carve.total();
  return w;
}

cudaError_t SortChoices(const MoeRouteParams& p, const Workspace& w, void* temp, size_t& temp_bytes,
                        cudaStream_t stream) {
  return cub::DeviceRadixSort::SortPairs(temp, temp_bytes, w.experts, w.experts_sorted, w.choice, w.choice_sorted,
                                         static_cast<int>(p.tokens * p.routing.top_k), 0,
                                         ExpertBits(p.routing.num_experts), stream);
}

// Step 1: one thread per token.
__global__ void RouteKernel(MoeRouting r, const float* logits, const float* bias, float* scratch, unsigned* experts,
                            int32_t* choice, float* weights, int64_t tokens) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= tokens) return;
  const int k = r.top_k;
  // RouteToken writes ints; the ids are in [0, num_experts), so the sort reads the same bits unsigned.
  int* chosen = reinterpret_cast<int*>(experts) + t * k;
  RouteToken(r, logits + t * r.num_experts, bias, scratch + t * RouteTokenScratch(r), chosen, weights + t * k);
  for (int j = 0; j < k; ++j) choice[t * k + j] = static_cast<int32_t>(t * k + j);
}

// Step 3: one thread per sorted position p in [0, n].
__global__ void FinishKernel(const unsigned* experts_sorted, const int32_t* choice_sorted, const float* weights,
                             int32_t* offsets, int32_t* rows, float* scales, int64_t n, int top_k, int num_experts) {
  const int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (p > n) return;
  const int prev = p == 0 ? -1 : static_cast<int>(experts_sorted[p - 1]);
  const int cur = p == n ? num_experts : static_cast<int>(experts_sorted[p]);
  for (int e = prev + 1; e <= cur; ++e) offsets[e] = static_cast<int32_t>(p);
  if (p == n) return;
  const int32_t c = choice_sorted[p];
  rows[p] = c / top_k;
  scales[p] = weights[c];
}

}  // namespace

cudaError_t MoeRouteWorkspaceBytes(const MoeRouteParams& p, size_t* bytes) {
  *bytes = 0;
  if (p.tokens == 0) return cudaSuccess;
  const Workspace sizing = Carve(p, nullptr, 0);
  size_t temp_bytes = 0;
  const cudaError_t err = SortChoices(p, sizing, nullptr, temp_bytes, nullptr);
  if (err != cudaSuccess) return err;
  *bytes = Carve(p, nullptr, temp_bytes).total;
  return cudaSuccess;
}

cudaError_t LaunchMoeRoute(const MoeRouteParams& p, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const int64_t n = p.tokens * p.routing.top_k;
  cudaError_t err = cudaSuccess;
  Workspace w;
  if (p.tokens > 0) {
    const Workspace sizing = Carve(p, nullptr, 0);
    if (workspace == nullptr || workspace_bytes < sizing.total) return cudaErrorInvalidValue;
    w = Carve(p, static_cast<char*>(workspace), workspace_bytes - sizing.total);
    RouteKernel<<<BlocksFor(p.tokens), kThreads, 0, stream>>>(p.routing, p.logits, p.score_bias, w.scratch, w.experts,
                                                              w.choice, w.weights, p.tokens);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
    size_t temp_bytes = w.temp_bytes;
    if ((err = SortChoices(p, w, w.temp, temp_bytes, stream)) != cudaSuccess) return err;
  }
  // With no tokens, one thread writes the E + 1 zero offsets (the sorted arrays are not read).
  FinishKernel<<<BlocksFor(n + 1), kThreads, 0, stream>>>(w.experts_sorted, w.choice_sorted, w.weights, p.offsets,
                                                          p.rows, p.scales, n, p.routing.top_k, p.routing.num_experts);
  return cudaGetLastError();
}

}  // namespace shardserve::kernels::cuda

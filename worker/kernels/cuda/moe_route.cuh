// MoeRoute on the device: the launcher and the workspace it needs. Internal to
// worker/kernels/cuda: only cuda_backend.cu includes this header.
//
// How a batch is routed (the routing arithmetic is kernels/shared/moe_math.h's RouteToken, as on
// the CPU):
//   1. One thread per token runs RouteToken over its router logits (its scratch in the workspace)
//      and writes its top_k (expert, weight) choices, plus each choice's index t * top_k + j.
//   2. CUB's radix sort (stable) orders the choice indices by expert over the low
//      ceil(log2(num_experts)) bits only: within an expert the indices, hence the tokens, stay
//      ascending, which is GroupByExpert's order.
//   3. One thread per sorted position p in [0, tokens * top_k] writes rows[p] (the token) and
//      scales[p] (the weight) of the choice there, and offsets[e] = p for every expert e whose run
//      starts at p (the experts between the previous position's and this one's): every offset is
//      written exactly once, empty experts included, with no atomics or scan.
//   4. The E + 1 offsets are copied to the host; the only wait of the op.
// Same experts, rows and offsets as the CPU backend for the same logits; the weights agree to the
// rounding of the device's expf.
#ifndef SHARDSERVE_WORKER_KERNELS_CUDA_MOE_ROUTE_CUH_
#define SHARDSERVE_WORKER_KERNELS_CUDA_MOE_ROUTE_CUH_

#include <cuda_runtime.h>

#include <cstddef>

#include "worker/kernels/backend.h"

namespace shardserve::kernels::cuda {

// Sets *bytes to the device workspace LaunchMoeRoute needs for p (validated): the choices, the
// sort's keys and values, the tokens' routing scratch and CUB's temporary storage.
cudaError_t MoeRouteWorkspaceBytes(const MoeRouteParams& p, size_t* bytes);

// Enqueues steps 1-3 on `stream` (the host copy of step 4 is the caller's). workspace: at least
// MoeRouteWorkspaceBytes(p) bytes of device memory, unused by anything queued alongside;
// cudaErrorInvalidValue when it is smaller.
cudaError_t LaunchMoeRoute(const MoeRouteParams& p, void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace shardserve::kernels::cuda

#endif  // SHARDSERVE_WORKER_KERNELS_CUDA_MOE_ROUTE_CUH_

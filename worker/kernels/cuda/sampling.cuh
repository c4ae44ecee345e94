// SampleRows on the device: the launcher and the workspace it needs. Internal to
// worker/kernels/cuda: only cuda_backend.cu includes this header.
//
// How a row is sampled (the arithmetic is kernels/shared/sampling_math.h's, as on the CPU):
//   1. Every row gets its argmax (ArgmaxRows' kernel): the answer for rows with temperature 0 or
//      top_k 1, overwritten below for the others.
//   2. The other rows are sorted whole, descending, with their ids, by CUB's segmented radix sort
//      (stable: ties keep the lower id first; -0.0 and +0.0 compare equal). Argmax rows are empty
//      segments, so they cost nothing. A whole-row sort, not a top-k pre-filter: it is exact for
//      every top_k / top_p / min_p, and at a 150k vocabulary a few rows sort in well under a
//      millisecond; a bounded pre-filter with this sort as its fallback is the next step when
//      batches grow.
//   3. One block per row sums the candidates' weights (a block reduction in double), then one
//      thread walks the sorted candidates (PickSortedCandidate: top-p, min-p, the draw). The walk
//      stops where the draw lands, usually within the first hundred candidates; its worst case
//      (top_p near 1 over a flat row) reads the whole row from one thread.
// The weights' sum is the only arithmetic that differs from the CPU's (its order), so the ids agree
// with the CPU backend except where a draw falls within rounding of a boundary.
#ifndef SHARDSERVE_WORKER_KERNELS_CUDA_SAMPLING_CUH_
#define SHARDSERVE_WORKER_KERNELS_CUDA_SAMPLING_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "worker/kernels/backend.h"

namespace shardserve::kernels::cuda {

// Whether any row of `p` (host_params) needs the sort, i.e. is not an argmax row.
bool SampleRowsNeedsSort(const SampleRowsParams& p);

// Sets *bytes to the device workspace LaunchSampleRows needs for rows x stride logits when a row
// needs the sort (the sorted keys and ids, the segment offsets and CUB's temporary storage); 0
// when none does. rows * stride must fit an int (CUB's item count); the caller checks. Host only:
// queues nothing.
cudaError_t SampleRowsWorkspaceBytes(const SampleRowsParams& p, size_t* bytes);

// Enqueues SampleRows (p already Validate()d). `workspace` holds SampleRowsWorkspaceBytes(p)
// bytes (may be null when that is 0).
cudaError_t LaunchSampleRows(const SampleRowsParams& p, void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace shardserve::kernels::cuda

#endif  // SHARDSERVE_WORKER_KERNELS_CUDA_SAMPLING_CUH_

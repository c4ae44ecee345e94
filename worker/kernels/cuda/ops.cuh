// CUDA kernel launchers for the ops of backend.h. Internal to worker/kernels/cuda: only
// cuda_backend.cu includes this header.
//
// Each Launch* function takes the op's Params struct (already Validate()d, and checked against
// Supports* below where one exists) and a stream, enqueues the op and returns the launch error
// (cudaGetLastError() after the launch). When the op has no work (a zero-sized shape) it returns
// cudaSuccess without launching. No launcher allocates and no kernel needs a workspace: per-block
// scratch lives in shared memory sized from the Params. Shapes may exceed the grid limits: kernels
// loop (grid-stride) over rows, sequences and elements.
#ifndef SHARDSERVE_WORKER_KERNELS_CUDA_OPS_CUH_
#define SHARDSERVE_WORKER_KERNELS_CUDA_OPS_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "worker/kernels/backend.h"

namespace shardserve::kernels::cuda {

// Dynamic shared memory a block may use without opting in (cudaFuncAttributeMaxDynamicSharedMemorySize).
inline constexpr size_t kMaxDynamicSharedBytes = 48 * 1024;

// Dynamic shared memory the Rope kernel needs for `head_dim`. The backend refuses a head_dim whose
// need exceeds kMaxDynamicSharedBytes. (Attention has its own header, attention.cuh.)
size_t RopeSharedBytes(int64_t head_dim);

// y[t, o] += bias[o]. y: [tokens, out]; bias: [out]. The bias half of Linear (cuBLAS does the rest).
cudaError_t LaunchBiasAdd(const float* bias, float* y, int64_t tokens, int64_t out, cudaStream_t stream);
cudaError_t LaunchRmsNorm(const RmsNormParams& p, cudaStream_t stream);
// RmsNorm with its output rounded to `dtype` (kBF16 or kF16, round to nearest even) into dst
// ([tokens, hidden] 16-bit; p.y is not written): bit for bit LaunchRmsNorm and then
// linear16.cuh's LaunchCastTo16, in one pass (the normed form's GEMM path).
cudaError_t LaunchRmsNormTo16(DType dtype, const RmsNormParams& p, void* dst, cudaStream_t stream);
cudaError_t LaunchAddRmsNorm(const AddRmsNormParams& p, cudaStream_t stream);
cudaError_t LaunchRope(const RopeParams& p, cudaStream_t stream);
// KvWrite; with p.rope, Rope and the write in one kernel (needs RopeSharedBytes(head_dim)).
cudaError_t LaunchKvWrite(const KvWriteParams& p, cudaStream_t stream);
cudaError_t LaunchSiluMul(const SiluMulParams& p, cudaStream_t stream);
cudaError_t LaunchScale(const ScaleParams& p, cudaStream_t stream);
cudaError_t LaunchAdd(const AddParams& p, cudaStream_t stream);
cudaError_t LaunchGatherRows(const GatherRowsParams& p, cudaStream_t stream);
cudaError_t LaunchScatterAddRows(const ScatterAddRowsParams& p, cudaStream_t stream);
cudaError_t LaunchSigmoidScaleRows(const SigmoidScaleRowsParams& p, cudaStream_t stream);
cudaError_t LaunchScaleRows(const ScaleRowsParams& p, cudaStream_t stream);
cudaError_t LaunchArgmaxRows(const ArgmaxRowsParams& p, cudaStream_t stream);

}  // namespace shardserve::kernels::cuda

#endif  // SHARDSERVE_WORKER_KERNELS_CUDA_OPS_CUH_

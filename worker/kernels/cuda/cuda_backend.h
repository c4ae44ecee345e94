// The CUDA backend: one device, one stream, one cuBLAS handle; f32 kernels that compute what the
// CPU backend (the oracle) computes, reusing kernels/shared row math. Built only when
// SHARDSERVE_HAVE_CUDA; nothing above worker/kernels includes this header (the registry does).
//
// This header names no CUDA type, so it can be included from code compiled without nvcc.
//
// Contract of the Backend that CreateCudaBackend returns (in addition to backend.h):
//   * Device memory. Allocate() returns zero-filled device memory (cudaMalloc, then a memset that
//     has completed before it returns). The buffer frees itself with cudaFree, which waits for the
//     device; a buffer may outlive the backend that made it.
//   * Ordering. Every op and copy is enqueued on the backend's one non-blocking stream.
//     CopyToDevice returns once the host buffer may be reused (from pageable memory: once the
//     driver has staged it, without waiting for the stream; from page-locked memory: after the
//     copy). CopyToHost returns after the copy has finished, so the host buffer may be read. Ops return once enqueued; their results reach the host through
//     CopyToHost or after Synchronize().
//   * Threads. One thread at a time (the rank thread that owns the device). Every entry point makes
//     the backend's device current on the calling thread (cudaSetDevice), so the backend may be
//     created on one thread and then handed to another.
//   * Numerics. Activations are f32. Weights are f32, bf16 or f16 (SupportsOp): f32 GEMMs run in
//     cuBLAS's default math mode, which never uses TF32 for cublasSgemm; 16-bit weights are widened
//     to f32 in a GEMV for up to 8 tokens, and above that the activations are rounded to the
//     weights' type for a tensor-core GEMM with f32 accumulation (linear16.cuh). GroupedLinear
//     takes the same three dtypes (moe_grouped.cuh: a grouped GEMV while no group has more than 32
//     rows, else rounded activations and a GEMM per group). Reductions are ordered differently
//     from the CPU backend, so results agree within rounding, not bit for bit; MoeCombine is the
//     exception: it adds exactly what a ScatterAddRows per expert adds.
//   * Scratch. The backend owns one scratch buffer (16-bit GEMM activations, split-K attention
//     partials), sized by Reserve(); an op called beyond the reserved limits first drains the
//     stream and grows it, after which graphs recorded earlier answer Aborted to Replay().
//   * Graphs. Capture() records on the backend's stream (cudaStreamCaptureModeThreadLocal); a
//     failure while recording is the recording's, not the device's: the backend stays healthy.
//   * Errors. Params::Validate() failures return InvalidArgument and change nothing. Shapes the
//     kernels cannot launch (a dimension over INT_MAX for cuBLAS, a head_dim too large for the
//     attention kernel's shared memory) return Unimplemented and change nothing. A failing CUDA or
//     cuBLAS call returns Internal naming the call and the library's error, and marks the backend
//     unhealthy: every later call returns FailedPrecondition("backend unhealthy after: <first
//     error>") and the rank should be restarted. Allocate() returns ResourceExhausted (and stays
//     healthy) when the device is out of memory.
#ifndef SHARDSERVE_WORKER_KERNELS_CUDA_CUDA_BACKEND_H_
#define SHARDSERVE_WORKER_KERNELS_CUDA_CUDA_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "worker/kernels/backend.h"

namespace shardserve::kernels {

// Number of CUDA devices visible to this process. 0 when there is no driver, no device or the
// query fails for any other reason; never aborts. Thread-safe.
int CudaBackendDeviceCount();

// Total and free memory of CUDA device `device_index` (cudaMemGetInfo). FailedPrecondition when
// the device does not exist.
absl::Status CudaBackendDeviceMemory(int device_index, int64_t* total_bytes, int64_t* free_bytes);

// Creates a backend for device `device_index` (0-based, as CUDA numbers devices): creates its
// stream, cuBLAS handle and cuBLAS workspace. FailedPrecondition when the device does not exist
// (the message says how many there are); Internal when the driver or cuBLAS refuses (the message
// names the call). Thread-safe; the backend it returns is not (see above).
struct CudaBackendOptions {
  // Programmatic dependent launch of the decode kernels (pdl.cuh: a process-wide setting, used only
  // when every device of the process has compute capability >= 9.0).
  bool pdl = false;
  // Prefill attention on tensor cores where it applies (attention.cuh, "Prefill on tensor cores");
  // false: every attention row on the CUDA-core kernel (for comparisons).
  bool mma_attention = true;
  // The norm of a normed LinearGroup (backend.h) with 16-bit weights inside the decode GEMV
  // (linear16.cuh, Gemv16Norm), or inside the kernel that rounds x for the GEMMs (ops.cuh,
  // LaunchRmsNormTo16); false: an RmsNorm kernel of its own first (for comparisons).
  bool fused_norm = true;
};
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device_index, const CudaBackendOptions& options = {});

}  // namespace shardserve::kernels

#endif  // SHARDSERVE_WORKER_KERNELS_CUDA_CUDA_BACKEND_H_

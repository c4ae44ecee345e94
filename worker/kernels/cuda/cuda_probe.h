// Measured ceilings of a CUDA device, for benchmarks that report their figures as fractions of
// what the same device reaches in the same run (tests/bench/gpu_bench.cc). Built only when
// SHARDSERVE_HAVE_CUDA; names no CUDA type, so code compiled without nvcc may include it.
//
// Every function:
//   * makes `device` current on the calling thread (cudaSetDevice) and leaves it current;
//   * allocates what it needs itself (cudaMalloc) and frees it before returning, also on error;
//   * runs on a stream of its own and synchronizes with it before returning, so it never overlaps
//     another caller's work on the device but does compete with it for the device;
//   * returns FailedPrecondition when `device` does not exist (the message says how many there
//     are), InvalidArgument for a size out of range, ResourceExhausted when the device lacks the
//     memory, and Internal naming the CUDA or cuBLAS call that failed otherwise.
// Thread-safety: safe to call from several threads, though concurrent calls on one device measure
// each other.
#ifndef SHARDSERVE_WORKER_KERNELS_CUDA_CUDA_PROBE_H_
#define SHARDSERVE_WORKER_KERNELS_CUDA_CUDA_PROBE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace shardserve::kernels {

struct CudaDeviceInfo {
  std::string name;           // cudaDeviceProp::name, e.g. "NVIDIA H100 80GB HBM3"
  int compute_major = 0;      // compute capability, e.g. 9.0
  int compute_minor = 0;
  int64_t total_bytes = 0;    // device memory
  int multiprocessors = 0;
};

// Name, compute capability, memory and SM count of `device` (cudaGetDeviceProperties).
absl::StatusOr<CudaDeviceInfo> ProbeCudaDevice(int device);

// Device memory bandwidth in GB/s (1e9 bytes/s): the best of 10 device-to-device copies
// (cudaMemcpyAsync) of `bytes` bytes, timed with CUDA events after one untimed copy, counting the
// bytes read and the bytes written (2 * bytes per copy), as CUDA's bandwidthTest does. Use a size
// well beyond the L2 cache (>= 1 GiB) to measure HBM. InvalidArgument for bytes < 1 MiB.
absl::StatusOr<double> MeasureCopyBandwidthGBps(int device, size_t bytes);

// Tensor-core GEMM rate in TFLOP/s (1e12 flop/s, 2*m*n*k per product): C[m, n] (f32) =
// A[m, k] * B[k, n] with A and B bfloat16, f32 compute (cublasGemmEx, CUBLAS_COMPUTE_32F,
// column-major, default math mode). The best of 3 timings of 10 products each, after one untimed
// product; the inputs are pseudo-random bfloat16 in [-1, 1) (constant or zero operands can run
// faster than real data). InvalidArgument unless 1 <= m, n, k <= 65536.
absl::StatusOr<double> MeasureBf16GemmTflops(int device, int m, int n, int k);

// Makes every CUDA device of the process block the host thread in a wait for the device instead
// of spinning (cudaDeviceScheduleBlockingSync), so that process CPU time counts the host's work.
// Call before anything else uses a device. Internal naming the call when the driver refuses.
absl::Status UseBlockingSync();

}  // namespace shardserve::kernels

#endif  // SHARDSERVE_WORKER_KERNELS_CUDA_CUDA_PROBE_H_

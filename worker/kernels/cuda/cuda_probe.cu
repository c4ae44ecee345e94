// Measured device ceilings; the contract is in cuda_probe.h. The resources of one measurement live
// in a Scope whose destructor releases them, so every error path frees what was made.
#include "worker/kernels/cuda/cuda_probe.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status/macros.h"

namespace shardserve::kernels {
namespace {

absl::Status CudaError(const char* call, cudaError_t e) {
  (void)cudaGetLastError();  // clear a sticky non-fatal error so it is not blamed on a later call
  if (e == cudaErrorMemoryAllocation) {
    return absl::ResourceExhaustedError(absl::StrCat(call, ": ", cudaGetErrorString(e)));
  }
  return absl::InternalError(absl::StrCat(call, ": ", cudaGetErrorName(e), ": ", cudaGetErrorString(e)));
}

#define PROBE_CUDA(call)                              \
  do {                                                \
    const cudaError_t probe_err_ = (call);            \
    if (probe_err_ != cudaSuccess) {                  \
      return CudaError(#call, probe_err_);            \
    }                                                 \
  } while (0)

#define PROBE_CUBLAS(call)                                                                          \
  do {                                                                                              \
    const cublasStatus_t probe_st_ = (call);                                                        \
    if (probe_st_ != CUBLAS_STATUS_SUCCESS) {                                                       \
      return absl::InternalError(absl::StrCat(#call, ": ", cublasGetStatusName(probe_st_), ": ",  \
                                              cublasGetStatusString(probe_st_)));                   \
    }                                                                                               \
  } while (0)

// x[i] = a bfloat16 in [-1, 1) from a hash of (i, seed): finite products, no denormals.
__global__ void FillRandomBf16Kernel(uint16_t* x, size_t n, uint32_t seed) {
  for (size_t i = size_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9e3779b9u ^ static_cast<uint32_t>(i >> 32) ^ seed * 0x85ebca6bu;
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    h *= 0x846ca68bu;
    h ^= h >> 16;
    const float f = static_cast<float>(h >> 8) * (2.0f / 16777216.0f) - 1.0f;
    x[i] = static_cast<uint16_t>(__float_as_uint(f) >> 16);  // truncated to bfloat16
  }
}

cudaError_t FillRandomBf16(uint16_t* x, size_t n, uint32_t seed, cudaStream_t stream) {
  FillRandomBf16Kernel<<<1024, 256, 0, stream>>>(x, n, seed);
  return cudaGetLastError();
}

// What one measurement creates; released in reverse order whatever happened.
struct Scope {
  std::vector<void*> buffers;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  cublasHandle_t blas = nullptr;

  Scope() = default;
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;
  ~Scope() {
    if (stream != nullptr) (void)cudaStreamSynchronize(stream);
    if (blas != nullptr) (void)cublasDestroy(blas);
    if (start != nullptr) (void)cudaEventDestroy(start);
    if (stop != nullptr) (void)cudaEventDestroy(stop);
    for (void* p : buffers) (void)cudaFree(p);
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
    (void)cudaGetLastError();
  }

  absl::StatusOr<void*> Alloc(size_t bytes) {
    void* p = nullptr;
    PROBE_CUDA(cudaMalloc(&p, bytes));
    buffers.push_back(p);
    return p;
  }
  absl::Status Init() {
    PROBE_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    PROBE_CUDA(cudaEventCreate(&start));
    PROBE_CUDA(cudaEventCreate(&stop));
    return absl::OkStatus();
  }
  // Milliseconds between the start and stop events, once stop has completed.
  absl::StatusOr<double> ElapsedMs() {
    PROBE_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    PROBE_CUDA(cudaEventElapsedTime(&ms, start, stop));
    return static_cast<double>(ms);
  }
};

absl::Status UseDevice(int device) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    count = 0;
  }
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device ", device, " does not exist (this machine has ", count, ")"));
  }
  PROBE_CUDA(cudaSetDevice(device));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CudaDeviceInfo> ProbeCudaDevice(int device) {
  RETURN_IF_ERROR(UseDevice(device));
  cudaDeviceProp prop{};
  PROBE_CUDA(cudaGetDeviceProperties(&prop, device));
  CudaDeviceInfo info;
  info.name = prop.name;
  info.compute_major = prop.major;
  info.compute_minor = prop.minor;
  info.total_bytes = static_cast<int64_t>(prop.totalGlobalMem);
  info.multiprocessors = prop.multiProcessorCount;
  return info;
}

absl::StatusOr<double> MeasureCopyBandwidthGBps(int device, size_t bytes) {
  if (bytes < (size_t{1} << 20)) {
    return absl::InvalidArgumentError(absl::StrCat("copy bandwidth needs at least 1 MiB, got ", bytes, " bytes"));
  }
  RETURN_IF_ERROR(UseDevice(device));
  Scope s;
  RETURN_IF_ERROR(s.Init());
  ASSIGN_OR_RETURN(void* src, s.Alloc(bytes));
  ASSIGN_OR_RETURN(void* dst, s.Alloc(bytes));
  // Touch both buffers first so that page mapping is not timed.
  PROBE_CUDA(cudaMemsetAsync(src, 1, bytes, s.stream));
  PROBE_CUDA(cudaMemsetAsync(dst, 0, bytes, s.stream));
  PROBE_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s.stream));
  double best_ms = 0;
  for (int rep = 0; rep < 10; ++rep) {
    PROBE_CUDA(cudaEventRecord(s.start, s.stream));
    PROBE_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s.stream));
    PROBE_CUDA(cudaEventRecord(s.stop, s.stream));
    ASSIGN_OR_RETURN(const double ms, s.ElapsedMs());
    if (rep == 0 || ms < best_ms) best_ms = ms;
  }
  if (best_ms <= 0) return absl::InternalError("copy bandwidth: the device timer measured no time");
  return 2.0 * static_cast<double>(bytes) / (best_ms * 1e-3) / 1e9;
}

absl::StatusOr<double> MeasureBf16GemmTflops(int device, int m, int n, int k) {
  constexpr int kMax = 65536;
  if (m < 1 || n < 1 || k < 1 || m > kMax || n > kMax || k > kMax) {
    return absl::InvalidArgumentError(absl::StrCat("GEMM shape ", m, "x", n, "x", k, " outside [1, ", kMax, "]"));
  }
  RETURN_IF_ERROR(UseDevice(device));
  Scope s;
  RETURN_IF_ERROR(s.Init());
  const size_t mm = static_cast<size_t>(m), nn = static_cast<size_t>(n), kk = static_cast<size_t>(k);
  ASSIGN_OR_RETURN(void* a, s.Alloc(mm * kk * 2));
  ASSIGN_OR_RETURN(void* b, s.Alloc(kk * nn * 2));
  ASSIGN_OR_RETURN(void* c, s.Alloc(mm * nn * 4));
  // Pseudo-random operands: constant or zero ones can run faster than real data does.
  PROBE_CUDA(FillRandomBf16(static_cast<uint16_t*>(a), mm * kk, 1, s.stream));
  PROBE_CUDA(FillRandomBf16(static_cast<uint16_t*>(b), kk * nn, 2, s.stream));
  PROBE_CUBLAS(cublasCreate(&s.blas));
  PROBE_CUBLAS(cublasSetStream(s.blas, s.stream));
  const float alpha = 1.0f, beta = 0.0f;
  auto gemm = [&]() -> absl::Status {
    PROBE_CUBLAS(cublasGemmEx(s.blas, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &alpha, a, CUDA_R_16BF, m, b, CUDA_R_16BF, k,
                              &beta, c, CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(gemm());
  constexpr int kIters = 10;
  double best_ms = 0;
  for (int rep = 0; rep < 3; ++rep) {
    PROBE_CUDA(cudaEventRecord(s.start, s.stream));
    for (int i = 0; i < kIters; ++i) RETURN_IF_ERROR(gemm());
    PROBE_CUDA(cudaEventRecord(s.stop, s.stream));
    ASSIGN_OR_RETURN(const double ms, s.ElapsedMs());
    if (rep == 0 || ms < best_ms) best_ms = ms;
  }
  if (best_ms <= 0) return absl::InternalError("GEMM rate: the device timer measured no time");
  return 2.0 * static_cast<double>(mm * nn * kk) * kIters / (best_ms * 1e-3) / 1e12;
}

absl::Status UseBlockingSync() {
  int count = 0;
  PROBE_CUDA(cudaGetDeviceCount(&count));
  for (int d = 0; d < count; ++d) {
    PROBE_CUDA(cudaSetDevice(d));
    PROBE_CUDA(cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync));
  }
  return absl::OkStatus();
}

}  // namespace shardserve::kernels

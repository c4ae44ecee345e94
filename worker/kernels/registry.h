// Creating backends by device name. The only code that knows which backends were compiled in;
// nothing above worker/kernels includes cpu/ or cuda/ directly.
#ifndef SHARDSERVE_WORKER_KERNELS_REGISTRY_H_
#define SHARDSERVE_WORKER_KERNELS_REGISTRY_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/kernels/backend.h"

namespace shardserve::kernels {

struct BackendOptions {
  DeviceKind kind = DeviceKind::kCpu;
  int device_index = 0;  // CUDA device ordinal
  int cpu_threads = 1;   // BLAS threads for a CPU backend
  bool cuda_pdl = false;  // CUDA: programmatic dependent launch (worker/kernels/cuda/pdl.cuh)
  bool cuda_mma_attention = true;  // CUDA: prefill attention on tensor cores (cuda_backend.h)
  bool cuda_fused_norm = true;     // CUDA: norms inside the decode GEMV (cuda_backend.h)
};

// True when this binary was built with the CUDA backend.
bool CudaCompiledIn();
// Number of CUDA devices visible (0 without CUDA, a driver or a device).
int CudaDeviceCount();

// Total and free bytes of a device: host memory (MemTotal / MemAvailable) for kCpu, the device's
// memory for kCuda. Unimplemented for CUDA in builds without it; FailedPrecondition for a missing
// device.
struct DeviceMemory {
  int64_t total_bytes = 0;
  int64_t free_bytes = 0;
};
absl::StatusOr<DeviceMemory> QueryDeviceMemory(DeviceKind kind, int device_index);

// Creates a backend. Unimplemented when CUDA was not compiled in; FailedPrecondition when the
// CUDA device does not exist (the message says how many there are).
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const BackendOptions& options);

}  // namespace shardserve::kernels

#endif  // SHARDSERVE_WORKER_KERNELS_REGISTRY_H_

#include "worker/kernels/registry.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/memory/host_memory.h"
#include "common/status/macros.h"
#include "worker/kernels/cpu/cpu_backend.h"
#if SHARDSERVE_HAVE_CUDA
#include "worker/kernels/cuda/cuda_backend.h"
#endif

namespace shardserve::kernels {

bool CudaCompiledIn() { return SHARDSERVE_HAVE_CUDA != 0; }

int CudaDeviceCount() {
#if SHARDSERVE_HAVE_CUDA
  return CudaBackendDeviceCount();
#else
  return 0;
#endif
}

absl::StatusOr<DeviceMemory> QueryDeviceMemory(DeviceKind kind, int device_index) {
  DeviceMemory m;
  switch (kind) {
    case DeviceKind::kCpu: {
      // Capped by the process's cgroup limit (a container's): see common/memory/host_memory.h.
      absl::StatusOr<HostMemory> host = QueryHostMemory();
      if (!host.ok()) return host.status();
      m.total_bytes = host->total_bytes;
      m.free_bytes = host->free_bytes;
      return m;
    }
    case DeviceKind::kCuda: {
#if SHARDSERVE_HAVE_CUDA
      RETURN_IF_ERROR(CudaBackendDeviceMemory(device_index, &m.total_bytes, &m.free_bytes));
      return m;
#else
      (void)device_index;
      return absl::UnimplementedError("CUDA devices requested but this binary was built without CUDA");
#endif
    }
  }
  return absl::InvalidArgumentError("unknown device kind");
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const BackendOptions& options) {
  switch (options.kind) {
    case DeviceKind::kCpu:
      return CreateCpuBackend(options.cpu_threads);
    case DeviceKind::kCuda: {
#if SHARDSERVE_HAVE_CUDA
      const int count = CudaDeviceCount();
      if (options.device_index < 0 || options.device_index >= count) {
        return absl::FailedPreconditionError(absl::StrCat("CUDA device ", options.device_index,
                                                          " requested but this machine has ", count,
                                                          " CUDA device(s)"));
      }
      return CreateCudaBackend(options.device_index, {.pdl = options.cuda_pdl,
                                                      .mma_attention = options.cuda_mma_attention,
                                                      .fused_norm = options.cuda_fused_norm});
#else
      return absl::UnimplementedError("CUDA devices requested but this binary was built without CUDA "
                                      "(SHARDSERVE_CUDA=OFF or no nvcc at build time)");
#endif
    }
  }
  return absl::InvalidArgumentError("unknown device kind");
}

}  // namespace shardserve::kernels

#include "worker/kernels/registry.h"

#include "absl/strings/str_cat.h"
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
      return CreateCudaBackend(options.device_index);
#else
      return absl::UnimplementedError("CUDA devices requested but this binary was built without CUDA "
                                      "(SHARDSERVE_CUDA=OFF or no nvcc at build time)");
#endif
    }
  }
  return absl::InvalidArgumentError("unknown device kind");
}

}  // namespace shardserve::kernels

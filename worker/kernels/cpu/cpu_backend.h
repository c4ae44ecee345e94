// The CPU backend: OpenBLAS sgemm for batched matrix products, SIMD small-batch kernels for
// decode, and loops over kernels/shared row math for everything else. It is the numerical oracle
// that every other backend is compared with. Device memory is host memory.
#ifndef SHARDSERVE_WORKER_KERNELS_CPU_CPU_BACKEND_H_
#define SHARDSERVE_WORKER_KERNELS_CPU_CPU_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "worker/kernels/backend.h"

namespace shardserve::kernels {

// `blas_threads` >= 1 sets OpenBLAS's (process-wide) thread count; tensor-parallel CPU ranks use 1.
absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(int blas_threads);

}  // namespace shardserve::kernels

#endif  // SHARDSERVE_WORKER_KERNELS_CPU_CPU_BACKEND_H_

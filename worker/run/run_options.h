// Parsing of shardserve-run's textual options into validated values. Kept out of the main file
// so that tests exercise every error path.
#ifndef SHARDSERVE_WORKER_RUN_RUN_OPTIONS_H_
#define SHARDSERVE_WORKER_RUN_RUN_OPTIONS_H_

#include <cstdint>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"
#include "worker/kernels/registry.h"

namespace shardserve::run {

// "1,2,3" (spaces allowed around ids) -> {1, 2, 3}. InvalidArgument naming the bad element for
// anything that is not a comma-separated list of non-negative 32-bit integers.
absl::StatusOr<std::vector<int32_t>> ParseTokenIds(absl::string_view text);

// Device selection for a worker's ranks:
//   "cpu"          one CPU rank with `threads` BLAS threads
//   "cpu:N"        N CPU ranks (threads), tensor-parallel, single-threaded BLAS each
//   "cuda:all"     one rank per visible CUDA device (`cuda_device_count` of them)
//   "cuda:0,1"     ranks on the listed devices; "cuda" = "cuda:0"
// InvalidArgument naming the bad part; FailedPrecondition for "cuda:all" with no device.
struct DeviceChoice {
  kernels::DeviceKind kind = kernels::DeviceKind::kCpu;
  int cpu_ranks = 1;
  int cpu_threads = 1;
  std::vector<int> cuda_devices;
};
absl::StatusOr<DeviceChoice> ParseDevices(absl::string_view text, int threads, int cuda_device_count);

}  // namespace shardserve::run

#endif  // SHARDSERVE_WORKER_RUN_RUN_OPTIONS_H_

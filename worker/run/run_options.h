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

// Device selection: "cpu" (one rank, `threads` BLAS threads), "cuda" or "cuda:N" (device N).
struct DeviceChoice {
  kernels::BackendOptions backend;
};
absl::StatusOr<DeviceChoice> ParseDevices(absl::string_view text, int threads);

}  // namespace shardserve::run

#endif  // SHARDSERVE_WORKER_RUN_RUN_OPTIONS_H_

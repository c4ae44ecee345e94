// Creating a communicator group for a worker's ranks by device kind. The only code above the
// implementations that knows which communicators were built (NCCL only in CUDA builds).
#ifndef SHARDSERVE_WORKER_COMM_COMM_REGISTRY_H_
#define SHARDSERVE_WORKER_COMM_COMM_REGISTRY_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"

namespace shardserve::comm {

enum class CommKind : uint8_t { kHost, kNccl };

// kHost: `ranks` CPU ranks in this process. kNccl: one rank per CUDA device ordinal in `devices`;
// Unimplemented in builds without CUDA.
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateCommGroup(CommKind kind, int ranks,
                                                                          const std::vector<int>& devices);

}  // namespace shardserve::comm

#endif  // SHARDSERVE_WORKER_COMM_COMM_REGISTRY_H_

// NcclCommunicator: collectives among the GPUs of one worker (one process, one thread per GPU),
// built only with CUDA. Each rank's communicator owns a CUDA stream; a collective is enqueued on it
// and waited for before returning, so the caller must have finished writing the buffer (its
// backend synchronized) before calling. NCCL errors become Internal statuses carrying NCCL's
// message (ncclGetErrorString and ncclGetLastError). No CUDA or NCCL type appears in this header.
#ifndef SHARDSERVE_WORKER_COMM_NCCL_NCCL_COMMUNICATOR_H_
#define SHARDSERVE_WORKER_COMM_NCCL_NCCL_COMMUNICATOR_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"

namespace shardserve::comm {

// One communicator per CUDA device ordinal in `devices` (rank r uses devices[r]), created together
// with ncclCommInitAll. FailedPrecondition when a device does not exist; Internal for NCCL errors.
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateNcclGroup(const std::vector<int>& devices);

}  // namespace shardserve::comm

#endif  // SHARDSERVE_WORKER_COMM_NCCL_NCCL_COMMUNICATOR_H_

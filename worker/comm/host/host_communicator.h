// HostCommunicator: collectives among CPU ranks that are threads of one process, through shared
// memory. Ranks publish their buffer pointers, meet at a barrier, and each rank reduces its own
// slice of the elements across all ranks (in rank order) into a shared scratch buffer, from which
// every rank copies the result.
//
// The barrier spins briefly (a decode step's per-layer collective arrives within microseconds)
// and then sleeps on a futex (std::atomic::wait), so an idle group burns no core.
#ifndef SHARDSERVE_WORKER_COMM_HOST_HOST_COMMUNICATOR_H_
#define SHARDSERVE_WORKER_COMM_HOST_HOST_COMMUNICATOR_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"

namespace shardserve::comm {

// Creates the `size` communicators of one group; element r is rank r's. The group's shared state
// lives as long as any of them. InvalidArgument when size < 1.
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateHostGroup(int size);

}  // namespace shardserve::comm

#endif  // SHARDSERVE_WORKER_COMM_HOST_HOST_COMMUNICATOR_H_

// WorkerClient: how the coordinator pushes an assignment to a worker (Worker.Assign in
// proto/shardserve/v1/control.proto), behind an interface so that tests use a fake.
#ifndef SHARDSERVE_COORDINATOR_CLIENT_WORKER_CLIENT_H_
#define SHARDSERVE_COORDINATOR_CLIENT_WORKER_CLIENT_H_

#include <string>

#include "absl/status/status.h"
#include "common/plan/assignment.h"

namespace shardserve::coordinator {

// Thread-safe: Assign may be called from several threads at once.
class WorkerClient {
 public:
  virtual ~WorkerClient() = default;

  // Sends `assignment` to the worker serving at `address` and returns once the worker has taken
  // it (loading goes on in the background; its progress arrives through heartbeats). Blocks the
  // caller for at most the implementation's deadline. Errors: the call's status, e.g.
  // Unavailable (unreachable), DeadlineExceeded, or the worker's own InvalidArgument.
  virtual absl::Status Assign(const std::string& address, const WorkerAssignment& assignment) = 0;

  // Tells the worker at `address` to drop its assignment and become idle (Worker.Release), for
  // `reason` (logged by the worker). Same deadline and errors as Assign; Aborted while it loads.
  virtual absl::Status Release(const std::string& address, const std::string& reason) = 0;
};

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_CLIENT_WORKER_CLIENT_H_

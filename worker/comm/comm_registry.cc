#include "worker/comm/comm_registry.h"

#include "worker/comm/host/host_communicator.h"
#if SHARDSERVE_HAVE_CUDA
#include "worker/comm/nccl/nccl_communicator.h"
#endif

namespace shardserve::comm {

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateCommGroup(CommKind kind, int ranks,
                                                                          const std::vector<int>& devices) {
  switch (kind) {
    case CommKind::kHost:
      return CreateHostGroup(ranks);
    case CommKind::kNccl:
#if SHARDSERVE_HAVE_CUDA
      return CreateNcclGroup(devices);
#else
      (void)devices;
      return absl::UnimplementedError("NCCL communicators need a build with CUDA (SHARDSERVE_CUDA)");
#endif
  }
  return absl::InvalidArgumentError("unknown communicator kind");
}

}  // namespace shardserve::comm

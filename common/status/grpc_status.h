// Conversion between absl::Status and grpc::Status at service edges. The codes are the same
// numbers (both follow google.rpc.Code); messages pass through unchanged.
#ifndef SHARDSERVE_COMMON_STATUS_GRPC_STATUS_H_
#define SHARDSERVE_COMMON_STATUS_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace shardserve {

// Thread-safe, pure.
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_STATUS_GRPC_STATUS_H_

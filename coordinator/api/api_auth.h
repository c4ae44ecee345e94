// Who may call the public gRPC API (Inference, Admin): one check at the start of every call.
#ifndef SHARDSERVE_COORDINATOR_API_API_AUTH_H_
#define SHARDSERVE_COORDINATOR_API_API_AUTH_H_

#include <memory>

#include "absl/status/statusor.h"
#include "common/security/api_keys.h"

namespace grpc {
class ServerContextBase;
}  // namespace grpc

namespace shardserve::coordinator {

// With `keys` (may be null): the call's "authorization" metadata must hold a key allowed `role`
// (ApiKeys::Admit: UNAUTHENTICATED, PERMISSION_DENIED or RESOURCE_EXHAUSTED otherwise); the lease
// must be kept until the call ends. Without keys, admin calls on a TLS port need a client
// certificate with the admin role (UNAUTHENTICATED without one, PERMISSION_DENIED for another role,
// so that a worker's certificate never reaches the admin API); other calls pass with a null lease.
absl::StatusOr<std::shared_ptr<security::ApiKeys::Lease>> AdmitCall(security::ApiKeys* keys,
                                                                    const grpc::ServerContextBase& ctx,
                                                                    security::ApiRole role);

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_API_API_AUTH_H_

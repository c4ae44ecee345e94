#include "coordinator/api/api_auth.h"

#include <grpcpp/server_context.h>

#include <string>

#include "common/security/grpc_security.h"
#include "common/status/grpc_status.h"

namespace shardserve::coordinator {

absl::StatusOr<std::shared_ptr<security::ApiKeys::Lease>> AdmitCall(security::ApiKeys* keys,
                                                                    const grpc::ServerContextBase& ctx,
                                                                    security::ApiRole role) {
  if (keys != nullptr) {
    std::string authorization;
    const auto& md = ctx.client_metadata();
    if (auto it = md.find("authorization"); it != md.end()) authorization.assign(it->second.data(), it->second.size());
    return keys->Admit(authorization, role);
  }
  if (role == security::ApiRole::kAdmin) {
    if (grpc::Status st = security::CheckPeerRole(ctx, {security::Role::kAdmin}); !st.ok()) return FromGrpcStatus(st);
  }
  return std::shared_ptr<security::ApiKeys::Lease>();
}

}  // namespace shardserve::coordinator

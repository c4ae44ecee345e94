// The coordinator's control-plane services (proto/shardserve/v1/control.proto):
//   RegistryService  Registry.Register / Heartbeat, called by workers; converts to the
//                    WorkerRegistry's structs.
//   AdminService     Admin.GetClusterStatus, for operators and the CLI.
// Both are thin callback-API services: each call converts, calls a thread-safe object that never
// blocks for long (a mutex held briefly), and finishes in the reaction.
#ifndef SHARDSERVE_COORDINATOR_API_CONTROL_SERVICE_H_
#define SHARDSERVE_COORDINATOR_API_CONTROL_SERVICE_H_

#include <string>

#include "common/security/api_keys.h"
#include "coordinator/api/cluster.h"
#include "coordinator/registry/registry.h"
#include "coordinator/scheduler/scheduler.h"
#include "shardserve/v1/control.grpc.pb.h"

namespace shardserve::coordinator {

class RegistryService final : public v1::Registry::CallbackService {
 public:
  // `registry` must outlive the service.
  explicit RegistryService(WorkerRegistry* registry) : registry_(registry) {}

  // INVALID_ARGUMENT naming the field for a bad registration (see WorkerRegistry::Register).
  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* ctx, const v1::RegisterRequest* request,
                                     v1::RegisterResponse* response) override;
  // NOT_FOUND for an unknown or dead worker ("register again"); INVALID_ARGUMENT for state
  // UNSPECIFIED or DEAD.
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx, const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) override;

 private:
  WorkerRegistry* const registry_;
};

class AdminService final : public v1::Admin::CallbackService {
 public:
  // Borrowed; must outlive the service.
  // `api_keys` may be null; every call needs an admin key, or without keys (on a TLS port) a
  // client certificate with the admin role (api_auth.h).
  AdminService(std::string model_path, Cluster* cluster, Scheduler* scheduler, const Clock* clock,
               security::ApiKeys* api_keys = nullptr)
      : model_path_(std::move(model_path)),
        cluster_(cluster),
        scheduler_(scheduler),
        clock_(clock),
        api_keys_(api_keys) {}

  grpc::ServerUnaryReactor* GetClusterStatus(grpc::CallbackServerContext* ctx,
                                             const v1::GetClusterStatusRequest* request,
                                             v1::ClusterStatus* response) override;

 private:
  const std::string model_path_;
  Cluster* const cluster_;
  Scheduler* const scheduler_;
  const Clock* const clock_;
  security::ApiKeys* const api_keys_;
};

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_API_CONTROL_SERVICE_H_

// The coordinator's control-plane services (proto/shardserve/v1/control.proto):
//   RegistryService  Registry.Register / Heartbeat / HeartbeatStream / Drain, called by workers;
//                    converts to the WorkerRegistry's structs (the stream's reactor is in
//                    heartbeat_stream.h).
//   AdminService     Admin.GetClusterStatus and DrainWorker, for operators and the CLI.
// Both are thin callback-API services: each call converts, calls a thread-safe object that never
// blocks for long (a mutex held briefly), and finishes in the reaction.
#ifndef SHARDSERVE_COORDINATOR_API_CONTROL_SERVICE_H_
#define SHARDSERVE_COORDINATOR_API_CONTROL_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <string>

#include <grpcpp/server_builder.h>

#include "common/security/api_keys.h"
#include "coordinator/api/heartbeat_stream.h"
#include "coordinator/cluster/cluster.h"
#include "coordinator/registry/registry.h"
#include "coordinator/scheduler/scheduler.h"
#include "shardserve/v1/control.grpc.pb.h"

namespace shardserve::coordinator {

// Raw (bytes) methods, parsed by the service: a request that is not a message is INVALID_ARGUMENT
// (common/status/grpc_raw.h), where gRPC's typed handlers would answer UNIMPLEMENTED.
// (HeartbeatStream's raw method cannot wrap CallbackService, whose typed one has the same
// signature: the services are composed from the plain Service instead.)
using RegistryBase = v1::Registry::WithRawCallbackMethod_Register<v1::Registry::WithRawCallbackMethod_Heartbeat<
    v1::Registry::WithRawCallbackMethod_HeartbeatStream<v1::Registry::WithCallbackMethod_Drain<v1::Registry::Service>>>>;
using AdminBase = v1::Admin::WithRawCallbackMethod_GetClusterStatus<v1::Admin::CallbackService>;

class RegistryService final : public RegistryBase {
 public:
  // `registry` (and `cluster`, which may be null: Drain is then UNIMPLEMENTED) must outlive the
  // service.
  explicit RegistryService(WorkerRegistry* registry, Cluster* cluster = nullptr)
      : registry_(registry), cluster_(cluster) {}

  // INVALID_ARGUMENT naming the field for a bad registration (see WorkerRegistry::Register).
  using RegistryBase::Heartbeat;
  using RegistryBase::HeartbeatStream;
  using RegistryBase::Register;
  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  // NOT_FOUND for an unknown or dead worker ("register again"); INVALID_ARGUMENT for state
  // UNSPECIFIED or DEAD.
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* response) override;
  // The same heartbeats on one stream per worker (HeartbeatStreamReactor: the stream ends with
  // the status a unary Heartbeat would return on a failure; closing it marks the worker dead).
  // PERMISSION_DENIED at once for a caller without the worker role.
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* HeartbeatStream(grpc::CallbackServerContext* ctx) override;
  // A worker drains itself (Cluster::Drain); only for workers (the worker role on a TLS port).
  grpc::ServerUnaryReactor* Drain(grpc::CallbackServerContext* ctx, const v1::DrainWorkerRequest* request,
                                  v1::DrainWorkerResponse* response) override;

 private:
  grpc::Status DoRegister(grpc::CallbackServerContext* ctx, const v1::RegisterRequest* request,
                          v1::RegisterResponse* response);
  // One heartbeat (the caller's role already checked); `stream` as WorkerHeartbeat::stream.
  grpc::Status DoHeartbeat(const v1::HeartbeatRequest& request, uint64_t stream);
  WorkerRegistry* const registry_;
  Cluster* const cluster_;
  std::atomic<uint64_t> next_stream_{1};
};

// The gRPC arguments of the server that carries RegistryService (the coordinator's control port):
// HTTP/2 BDP probing off. Its messages are a few dozen bytes, so there is no window to size, and
// with it on every heartbeat that arrives on an otherwise quiet connection set off a PING and its
// ack: at 1,000 workers that was a third of the coordinator's heartbeat CPU
// (shardserve-bench-registry). Workers turn it off on their side too (Registrar).
void ConfigureControlPort(grpc::ServerBuilder& builder);

// DrainWorkerRequest -> Cluster::Drain (timeout_ms 0 = 60 s; negative is INVALID_ARGUMENT).
absl::Status DrainFromProto(Cluster& cluster, const v1::DrainWorkerRequest& request);

class AdminService final : public AdminBase {
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

  using AdminBase::GetClusterStatus;
  grpc::ServerUnaryReactor* GetClusterStatus(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                             grpc::ByteBuffer* response) override;
  // Cluster::Drain; needs an admin key (or certificate) like GetClusterStatus.
  grpc::ServerUnaryReactor* DrainWorker(grpc::CallbackServerContext* ctx, const v1::DrainWorkerRequest* request,
                                        v1::DrainWorkerResponse* response) override;

 private:
  // Counts every worker; lists one page of them (GetClusterStatusRequest.max_workers, default 256).
  grpc::Status DoGetClusterStatus(grpc::CallbackServerContext* ctx, const v1::GetClusterStatusRequest& request,
                                  v1::ClusterStatus* response);
  const std::string model_path_;
  Cluster* const cluster_;
  Scheduler* const scheduler_;
  const Clock* const clock_;
  security::ApiKeys* const api_keys_;
};

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_API_CONTROL_SERVICE_H_

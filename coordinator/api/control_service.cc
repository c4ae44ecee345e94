#include "coordinator/api/control_service.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/security/grpc_security.h"
#include "common/status/grpc_raw.h"
#include "common/status/grpc_status.h"
#include "coordinator/api/api_auth.h"
#include "coordinator/client/proto_convert.h"

namespace shardserve::coordinator {
namespace {

v1::WorkerState ToProto(WorkerState state) {
  switch (state) {
    case WorkerState::kIdle: return v1::WORKER_STATE_IDLE;
    case WorkerState::kLoading: return v1::WORKER_STATE_LOADING;
    case WorkerState::kReady: return v1::WORKER_STATE_READY;
    case WorkerState::kFailed: return v1::WORKER_STATE_FAILED;
    case WorkerState::kDead: return v1::WORKER_STATE_DEAD;
  }
  return v1::WORKER_STATE_UNSPECIFIED;
}

absl::StatusOr<WorkerState> FromProto(v1::WorkerState state) {
  switch (state) {
    case v1::WORKER_STATE_IDLE: return WorkerState::kIdle;
    case v1::WORKER_STATE_LOADING: return WorkerState::kLoading;
    case v1::WORKER_STATE_READY: return WorkerState::kReady;
    case v1::WORKER_STATE_FAILED: return WorkerState::kFailed;
    case v1::WORKER_STATE_DEAD: return WorkerState::kDead;
    default: break;  // an open proto enum
  }
  return absl::InvalidArgumentError(absl::StrCat("state: unsupported worker state ", static_cast<int>(state)));
}

}  // namespace

grpc::ServerUnaryReactor* RegistryService::Register(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                                    grpc::ByteBuffer* response) {
  return RawUnary<v1::RegisterRequest, v1::RegisterResponse>(
      ctx, request, response, [&](const v1::RegisterRequest& req, v1::RegisterResponse* resp) {
        return DoRegister(ctx, &req, resp);
      });
}

grpc::ServerUnaryReactor* RegistryService::Heartbeat(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                                     grpc::ByteBuffer* response) {
  return RawUnary<v1::HeartbeatRequest, v1::HeartbeatResponse>(
      ctx, request, response,
      [&](const v1::HeartbeatRequest& req, v1::HeartbeatResponse* /*resp*/) { return DoHeartbeat(ctx, &req); });
}

grpc::ServerUnaryReactor* AdminService::GetClusterStatus(grpc::CallbackServerContext* ctx,
                                                         const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return RawUnary<v1::GetClusterStatusRequest, v1::ClusterStatus>(
      ctx, request, response,
      [&](const v1::GetClusterStatusRequest& /*req*/, v1::ClusterStatus* resp) { return DoGetClusterStatus(ctx, resp); });
}

grpc::Status RegistryService::DoRegister(grpc::CallbackServerContext* ctx, const v1::RegisterRequest* request,
                                         v1::RegisterResponse* response) {
  // Only workers register (on a TLS control port: a certificate with the worker role).
  if (grpc::Status st = security::CheckPeerRole(*ctx, {security::Role::kWorker}); !st.ok()) return st;
  WorkerRegistration reg{.node_name = request->node_name(),
                         .address = request->address(),
                         .metrics_address = request->metrics_address()};
  for (int i = 0; i < request->devices_size(); ++i) {
    absl::StatusOr<Device> d = coordinator::FromProto(request->devices(i));
    if (!d.ok()) {
      return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat("devices[", i, "].", d.status().message())));
    }
    reg.devices.push_back(*d);
  }
  absl::StatusOr<std::string> id = registry_->Register(std::move(reg));
  if (!id.ok()) return ToGrpcStatus(id.status());
  response->set_worker_id(*id);
  response->set_heartbeat_interval_ms(absl::ToInt64Milliseconds(registry_->options().heartbeat_interval));
  return ToGrpcStatus(absl::OkStatus());
}

grpc::Status RegistryService::DoHeartbeat(grpc::CallbackServerContext* ctx, const v1::HeartbeatRequest* request) {
  if (grpc::Status st = security::CheckPeerRole(*ctx, {security::Role::kWorker}); !st.ok()) return st;
  absl::StatusOr<WorkerState> state = FromProto(request->state());
  if (!state.ok()) return ToGrpcStatus(state.status());
  return ToGrpcStatus(registry_->Heartbeat({.worker_id = request->worker_id(),
                                         .state = *state,
                                         .assignment_id = request->assignment_id(),
                                         .error = request->error(),
                                         .kv_blocks = request->kv_blocks()}));
}

grpc::Status AdminService::DoGetClusterStatus(grpc::CallbackServerContext* ctx, v1::ClusterStatus* response) {
  if (auto lease = AdmitCall(api_keys_, *ctx, security::ApiRole::kAdmin); !lease.ok()) {
    return ToGrpcStatus(lease.status());
  }
  const ClusterView view = cluster_->View();
  const SchedulerStats stats = scheduler_->Stats();
  const absl::Time now = clock_->Now();
  response->set_ready(view.ready);
  response->set_reason(view.reason);
  response->set_model_path(model_path_);
  response->set_plan(view.plan);
  response->set_running_sequences(stats.running);
  response->set_waiting_sequences(stats.waiting);
  for (const ClusterWorkerView& w : view.workers) {
    v1::WorkerStatus* out = response->add_workers();
    out->set_worker_id(w.record.worker_id);
    out->set_node_name(w.record.registration.node_name);
    out->set_address(w.record.registration.address);
    out->set_metrics_address(w.record.registration.metrics_address);
    out->set_state(ToProto(w.record.state));
    std::string error = w.record.error;
    if (!w.assign_error.empty()) error = absl::StrCat(error, error.empty() ? "" : "; ", "assign: ", w.assign_error);
    out->set_error(error);
    for (const Device& d : w.record.registration.devices) coordinator::ToProto(d, out->add_devices());
    out->set_last_heartbeat_ms_ago(std::max<int64_t>(0, absl::ToInt64Milliseconds(now - w.record.last_heartbeat)));
    if (w.assignment.has_value()) coordinator::ToProto(*w.assignment, out->mutable_assignment());
  }
  return ToGrpcStatus(absl::OkStatus());
}

}  // namespace shardserve::coordinator

#include "coordinator/api/control_service.h"

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
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
      [&](const v1::HeartbeatRequest& req, v1::HeartbeatResponse* /*resp*/) {
        if (grpc::Status st = security::CheckPeerRole(*ctx, {security::Role::kWorker}); !st.ok()) return st;
        return DoHeartbeat(req, /*stream=*/0);
      });
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* RegistryService::HeartbeatStream(
    grpc::CallbackServerContext* ctx) {
  return new HeartbeatStreamReactor(
      registry_, [this](const v1::HeartbeatRequest& request, uint64_t stream) { return DoHeartbeat(request, stream); },
      next_stream_.fetch_add(1), {.interval = registry_->options().heartbeat_interval},
      security::CheckPeerRole(*ctx, {security::Role::kWorker}));
}

grpc::ServerUnaryReactor* AdminService::GetClusterStatus(grpc::CallbackServerContext* ctx,
                                                         const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return RawUnary<v1::GetClusterStatusRequest, v1::ClusterStatus>(
      ctx, request, response,
      [&](const v1::GetClusterStatusRequest& req, v1::ClusterStatus* resp) { return DoGetClusterStatus(ctx, req, resp); });
}

void ConfigureControlPort(grpc::ServerBuilder& builder) { builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0); }

absl::Status DrainFromProto(Cluster& cluster, const v1::DrainWorkerRequest& request) {
  if (request.worker_id().empty()) return absl::InvalidArgumentError("worker_id is empty");
  if (request.timeout_ms() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("timeout_ms must be >= 0 (0 = 60 s), got ", request.timeout_ms()));
  }
  const absl::Duration timeout = request.timeout_ms() == 0 ? absl::Seconds(60) : absl::Milliseconds(request.timeout_ms());
  return cluster.Drain(request.worker_id(), timeout);
}

grpc::ServerUnaryReactor* RegistryService::Drain(grpc::CallbackServerContext* ctx, const v1::DrainWorkerRequest* request,
                                                 v1::DrainWorkerResponse* /*response*/) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  grpc::Status st = security::CheckPeerRole(*ctx, {security::Role::kWorker});
  if (st.ok()) {
    st = cluster_ == nullptr ? grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "this coordinator does not drain workers")
                             : ToGrpcStatus(DrainFromProto(*cluster_, *request));
  }
  reactor->Finish(st);
  return reactor;
}

grpc::ServerUnaryReactor* AdminService::DrainWorker(grpc::CallbackServerContext* ctx,
                                                    const v1::DrainWorkerRequest* request,
                                                    v1::DrainWorkerResponse* /*response*/) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::Status st = AdmitCall(api_keys_, *ctx, security::ApiRole::kAdmin).status();
  if (st.ok()) st = DrainFromProto(*cluster_, *request);
  reactor->Finish(ToGrpcStatus(st));
  return reactor;
}

grpc::Status RegistryService::DoRegister(grpc::CallbackServerContext* ctx, const v1::RegisterRequest* request,
                                         v1::RegisterResponse* response) {
  // Only workers register (on a TLS control port: a certificate with the worker role).
  if (grpc::Status st = security::CheckPeerRole(*ctx, {security::Role::kWorker}); !st.ok()) return st;
  absl::StatusOr<WorkerState> state = request->state() == v1::WORKER_STATE_UNSPECIFIED
                                          ? absl::StatusOr<WorkerState>(WorkerState::kIdle)
                                          : FromProto(request->state());
  if (!state.ok()) return ToGrpcStatus(state.status());
  WorkerRegistration reg{.node_name = request->node_name(),
                         .address = request->address(),
                         .metrics_address = request->metrics_address(),
                         .instance_id = request->instance_id(),
                         .state = *state,
                         .error = request->error(),
                         .kv_blocks = request->kv_blocks(),
                         .peer = ctx->peer()};
  for (int i = 0; i < request->devices_size(); ++i) {
    absl::StatusOr<Device> d = coordinator::FromProto(request->devices(i));
    if (!d.ok()) {
      return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat("devices[", i, "].", d.status().message())));
    }
    reg.devices.push_back(*d);
  }
  if (request->has_held()) {
    absl::StatusOr<WorkerAssignment> held = coordinator::FromProto(request->held());
    if (!held.ok()) return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat("held.", held.status().message())));
    reg.held = *std::move(held);
  }
  absl::StatusOr<std::string> id = registry_->Register(std::move(reg));
  if (!id.ok()) return ToGrpcStatus(id.status());
  response->set_worker_id(*id);
  response->set_heartbeat_interval_ms(absl::ToInt64Milliseconds(registry_->options().heartbeat_interval));
  return ToGrpcStatus(absl::OkStatus());
}

grpc::Status RegistryService::DoHeartbeat(const v1::HeartbeatRequest& request, uint64_t stream) {
  absl::StatusOr<WorkerState> state = FromProto(request.state());
  if (!state.ok()) return ToGrpcStatus(state.status());
  return ToGrpcStatus(registry_->Heartbeat({.worker_id = request.worker_id(),
                                         .state = *state,
                                         .assignment_id = request.assignment_id(),
                                         .error = request.error(),
                                         .kv_blocks = request.kv_blocks(),
                                         .stream = stream}));
}

grpc::Status AdminService::DoGetClusterStatus(grpc::CallbackServerContext* ctx, const v1::GetClusterStatusRequest& request,
                                              v1::ClusterStatus* response) {
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
  response->set_scheduling_policy(std::string(SchedulingPolicyName(stats.policy)));
  for (const ReplicaStats& r : stats.replicas) {
    v1::ReplicaPipelining* p = response->add_pipelining();
    p->set_replica(r.replica);
    p->set_micro_batches(r.micro_batches);
    p->set_explanation(r.pipelining);
    v1::ReplicaDecodeSteps* d = response->add_decode_steps();
    d->set_replica(r.replica);
    d->set_decode_steps(r.decode_steps);
    d->set_explanation(r.decode_steps_why);
  }
  // Every worker counted; at most one page of them listed, live ones before dead ones (a registry
  // may hold thousands of dead or bogus entries: the reply must stay small).
  constexpr int kDefaultPage = 256;
  constexpr int kMaxPage = 4096;
  if (request.max_workers() < 0) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "max_workers must be >= 0");
  const size_t page = static_cast<size_t>(request.max_workers() == 0 ? kDefaultPage
                                                                     : std::min(request.max_workers(), kMaxPage));
  size_t offset = 0;
  if (!request.page_token().empty() && !absl::SimpleAtoi(request.page_token(), &offset)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "page_token is not one this server gave");
  }
  std::vector<const ClusterWorkerView*> order;
  std::map<WorkerState, int64_t> counts;
  for (const ClusterWorkerView& w : view.workers) {
    order.push_back(&w);
    ++counts[w.record.state];
  }
  std::stable_partition(order.begin(), order.end(),
                        [](const ClusterWorkerView* w) { return w->record.state != WorkerState::kDead; });
  response->set_total_workers(static_cast<int64_t>(order.size()));
  for (const auto& [state, count] : counts) {
    v1::WorkerStateCount* c = response->add_worker_counts();
    c->set_state(ToProto(state));
    c->set_count(count);
  }
  const size_t end = std::min(order.size(), offset + page);
  if (end < order.size()) response->set_next_page_token(absl::StrCat(end));
  for (size_t i = offset; i < end; ++i) {
    const ClusterWorkerView& w = *order[i];
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
    out->set_draining(w.draining);
  }
  return ToGrpcStatus(absl::OkStatus());
}

}  // namespace shardserve::coordinator

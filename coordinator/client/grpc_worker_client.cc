#include "coordinator/client/grpc_worker_client.h"

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status/grpc_status.h"
#include "coordinator/client/proto_convert.h"
#include "shardserve/v1/control.grpc.pb.h"

namespace shardserve::coordinator {

GrpcWorkerClient::GrpcWorkerClient(const Options& options) : options_(options) {}

GrpcWorkerClient::~GrpcWorkerClient() = default;

std::shared_ptr<grpc::Channel> GrpcWorkerClient::ChannelFor(const std::string& address) {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<grpc::Channel>& channel = channels_[address];
  if (channel == nullptr) channel = grpc::CreateChannel(
        address, options_.credentials != nullptr ? options_.credentials : grpc::InsecureChannelCredentials());
  return channel;
}

absl::Status GrpcWorkerClient::Assign(const std::string& address, const WorkerAssignment& assignment) {
  std::unique_ptr<v1::Worker::Stub> stub = v1::Worker::NewStub(ChannelFor(address));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  v1::Assignment request;
  ToProto(assignment, &request);
  v1::AssignResponse response;
  const grpc::Status st = stub->Assign(&ctx, request, &response);
  if (st.ok()) return absl::OkStatus();
  const absl::Status status = FromGrpcStatus(st);
  return absl::Status(status.code(), absl::StrCat("Worker.Assign to ", address, ": ", status.message()));
}

absl::Status GrpcWorkerClient::Release(const std::string& address, const std::string& reason) {
  std::unique_ptr<v1::Worker::Stub> stub = v1::Worker::NewStub(ChannelFor(address));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  v1::ReleaseRequest request;
  request.set_reason(reason);
  v1::ReleaseResponse response;
  const grpc::Status st = stub->Release(&ctx, request, &response);
  if (st.ok()) return absl::OkStatus();
  const absl::Status status = FromGrpcStatus(st);
  return absl::Status(status.code(), absl::StrCat("Worker.Release to ", address, ": ", status.message()));
}

}  // namespace shardserve::coordinator

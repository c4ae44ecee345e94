#include "worker/service/registrar.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/log/log.h"
#include "common/status/grpc_status.h"

namespace shardserve::service {
namespace {

constexpr auto kCallDeadline = std::chrono::seconds(5);

}  // namespace

Registrar::Registrar(const std::string& coordinator_address, v1::RegisterRequest registration,
                     std::function<WorkerStatusSnapshot()> status,
                     std::shared_ptr<grpc::ChannelCredentials> credentials)
    : coordinator_address_(coordinator_address),
      registration_(std::move(registration)),
      status_(std::move(status)),
      stub_(v1::Registry::NewStub(grpc::CreateChannel(
          coordinator_address, credentials != nullptr ? credentials : grpc::InsecureChannelCredentials()))) {}

Registrar::~Registrar() { Stop(); }

void Registrar::Start() { thread_ = std::thread([this] { Loop(); }); }

void Registrar::Stop() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.SignalAll();
  if (thread_.joinable()) thread_.join();
}

std::string Registrar::worker_id() const {
  MutexLock lock(&mu_);
  return worker_id_;
}

bool Registrar::connected() const {
  MutexLock lock(&mu_);
  return connected_;
}

absl::Status Registrar::Drain(std::chrono::milliseconds timeout) {
  const std::string id = worker_id();
  if (id.empty()) return absl::FailedPreconditionError("not registered with the coordinator");
  v1::DrainWorkerRequest request;
  request.set_worker_id(id);
  request.set_timeout_ms(timeout.count());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
  v1::DrainWorkerResponse response;
  return FromGrpcStatus(stub_->Drain(&ctx, request, &response));
}

bool Registrar::Sleep(int64_t ms) {
  MutexLock lock(&mu_);
  const absl::Time until = absl::Now() + absl::Milliseconds(ms);
  while (!stop_ && !cv_.WaitWithDeadline(&mu_, until)) {
  }
  return !stop_;
}

void Registrar::Loop() {
  int64_t backoff_ms = 200;
  int64_t interval_ms = 1000;
  std::string id;
  while (true) {
    {
      MutexLock lock(&mu_);
      if (stop_) return;
    }
    if (id.empty()) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
      v1::RegisterResponse response;
      grpc::Status st = stub_->Register(&ctx, registration_, &response);
      if (!st.ok()) {
        LOG(WARNING) << "registering with the coordinator at " << coordinator_address_ << " failed: "
                     << st.error_message() << "; retrying in " << backoff_ms << " ms";
        if (!Sleep(backoff_ms)) return;
        backoff_ms = std::min<int64_t>(backoff_ms * 2, 5000);
        continue;
      }
      id = response.worker_id();
      interval_ms = std::clamp<int64_t>(response.heartbeat_interval_ms(), 50, 60000);
      backoff_ms = 200;
      {
        MutexLock lock(&mu_);
        worker_id_ = id;
      }
      LOG(INFO) << "registered with the coordinator at " << coordinator_address_ << " as " << id;
    }
    const WorkerStatusSnapshot s = status_();
    v1::HeartbeatRequest hb;
    hb.set_worker_id(id);
    hb.set_state(s.state);
    hb.set_assignment_id(s.assignment_id);
    hb.set_error(s.error);
    hb.set_kv_blocks(s.kv_blocks);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
    v1::HeartbeatResponse response;
    grpc::Status st = stub_->Heartbeat(&ctx, hb, &response);
    if (st.error_code() == grpc::StatusCode::NOT_FOUND) {
      LOG(WARNING) << "the coordinator no longer knows worker " << id << "; registering again";
      id.clear();
      MutexLock lock(&mu_);
      worker_id_.clear();
      continue;
    }
    if (!st.ok()) LOG(WARNING) << "heartbeat failed: " << st.error_message();
    {
      MutexLock lock(&mu_);
      connected_ = st.ok();
    }
    if (!Sleep(interval_ms)) return;
  }
}

}  // namespace shardserve::service

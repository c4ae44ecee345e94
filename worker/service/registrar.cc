#include "worker/service/registrar.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/log/log.h"
#include "common/status/grpc_status.h"

namespace shardserve::service {
namespace {

constexpr auto kCallDeadline = std::chrono::seconds(5);
// Between failed registrations: from 100 ms, growing to at most 2 s (RegistrationBackoff).
constexpr auto kBackoffBase = std::chrono::milliseconds(100);
constexpr auto kBackoffCap = std::chrono::milliseconds(2000);
// gRPC's reconnect backoff on the channel to the coordinator (CoordinatorChannelArguments).
constexpr int kReconnectInitialMs = 200;
constexpr int kReconnectMaxMs = 1000;

v1::RegisterRequest WithInstanceId(v1::RegisterRequest r) {
  if (r.instance_id().empty()) r.set_instance_id(NewInstanceId());
  return r;
}

std::shared_ptr<grpc::Channel> CoordinatorChannel(const std::string& address,
                                                  std::shared_ptr<grpc::ChannelCredentials> credentials) {
  return grpc::CreateCustomChannel(address, credentials != nullptr ? credentials : grpc::InsecureChannelCredentials(),
                                   CoordinatorChannelArguments());
}

}  // namespace

grpc::ChannelArguments CoordinatorChannelArguments() {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, kReconnectInitialMs);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, kReconnectInitialMs);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, kReconnectMaxMs);
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  return args;
}

RegistrationBackoff::RegistrationBackoff(std::chrono::milliseconds base, std::chrono::milliseconds cap, Uniform uniform)
    : base_ms_(base.count()), cap_ms_(cap.count()), uniform_(std::move(uniform)), previous_ms_(base_ms_) {
  CHECK(base_ms_ > 0 && base_ms_ <= cap_ms_) << "backoff base " << base_ms_ << " ms, cap " << cap_ms_ << " ms";
  if (uniform_ == nullptr) {
    uniform_ = [gen = std::make_shared<absl::BitGen>()](int64_t lo, int64_t hi) {
      return absl::Uniform<int64_t>(absl::IntervalClosedClosed, *gen, lo, hi);
    };
  }
}

std::chrono::milliseconds RegistrationBackoff::Next() {
  const int64_t hi = std::min(cap_ms_, previous_ms_ * 3);
  previous_ms_ = std::clamp<int64_t>(uniform_(base_ms_, std::max(hi, base_ms_)), base_ms_, cap_ms_);
  return std::chrono::milliseconds(previous_ms_);
}

void RegistrationBackoff::Reset() { previous_ms_ = base_ms_; }

std::string NewInstanceId() {
  absl::BitGen gen;
  return absl::StrFormat("%016x", absl::Uniform<uint64_t>(gen));
}

Registrar::Registrar(const std::string& coordinator_address, v1::RegisterRequest registration,
                     std::function<WorkerStatusSnapshot()> status,
                     std::shared_ptr<grpc::ChannelCredentials> credentials)
    : coordinator_address_(coordinator_address),
      registration_(WithInstanceId(std::move(registration))),
      status_(std::move(status)),
      stub_(v1::Registry::NewStub(CoordinatorChannel(coordinator_address, std::move(credentials)))) {}

v1::RegisterRequest Registrar::Registration() const {
  v1::RegisterRequest r = registration_;
  const WorkerStatusSnapshot s = status_();
  r.set_state(s.state);
  r.set_error(s.error);
  r.set_kv_blocks(s.kv_blocks);
  if (s.assignment.has_value()) *r.mutable_held() = *s.assignment;
  return r;
}

Registrar::~Registrar() { Stop(); }

void Registrar::Start() { thread_ = std::thread([this] { Loop(); }); }

void Registrar::Stop() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
    if (stream_ != nullptr) stream_->Cancel();
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

v1::HeartbeatRequest Registrar::HeartbeatNow(const std::string& id) const {
  const WorkerStatusSnapshot s = status_();
  v1::HeartbeatRequest hb;
  hb.set_worker_id(id);
  hb.set_state(s.state);
  hb.set_assignment_id(s.assignment_id);
  hb.set_error(s.error);
  hb.set_kv_blocks(s.kv_blocks);
  return hb;
}

grpc::Status Registrar::UnaryHeartbeat(const std::string& id) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
  v1::HeartbeatResponse response;
  return stub_->Heartbeat(&ctx, HeartbeatNow(id), &response);
}

grpc::Status Registrar::StreamHeartbeats(const std::string& id, int64_t interval_ms, bool* answered) {
  HeartbeatStreamCall call(stub_.get(), [this](absl::Duration /*round_trip*/) {
    MutexLock lock(&mu_);
    connected_ = true;
  });
  {
    MutexLock lock(&mu_);
    if (stop_) call.Cancel();
    stream_ = &call;
  }
  const absl::Duration interval = absl::Milliseconds(interval_ms);
  const absl::Duration unanswered_limit = absl::FromChrono(kCallDeadline);
  bool hung = false;
  for (absl::Time next = absl::Now();;) {
    const absl::Time now = absl::Now();
    if (now >= next) {
      const HeartbeatStreamCall::Progress p = call.progress();
      if (now - p.oldest_unanswered > unanswered_limit) {
        hung = true;  // the connection may look open while the coordinator is stuck
        break;
      }
      if (p.answered < p.sent) {
        MutexLock lock(&mu_);
        connected_ = false;  // the previous heartbeat is still unanswered
      }
      call.Send(HeartbeatNow(id));
      next = std::max(next + interval, now);  // after a stall, no burst to catch up
    }
    if (call.WaitEnded(next)) break;
  }
  bool stopped = false;
  {
    MutexLock lock(&mu_);
    stream_ = nullptr;  // Stop() no longer reaches it: it is closed below
    stopped = stop_;
  }
  grpc::Status st = call.Close();
  *answered = call.progress().answered > 0;
  if (stopped) return grpc::Status::OK;
  if (hung) {
    return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                        absl::StrCat("no answer to a heartbeat for ", absl::FormatDuration(unanswered_limit)));
  }
  return st;
}

void Registrar::Loop() {
  RegistrationBackoff backoff(kBackoffBase, kBackoffCap);
  int64_t interval_ms = 1000;
  std::string id;
  bool use_stream = true;  // until a coordinator answers HeartbeatStream with UNIMPLEMENTED
  while (true) {
    {
      MutexLock lock(&mu_);
      if (stop_) return;
    }
    if (id.empty()) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
      v1::RegisterResponse response;
      const v1::RegisterRequest request = Registration();
      grpc::Status st = stub_->Register(&ctx, request, &response);
      if (!st.ok()) {
        const std::chrono::milliseconds delay = backoff.Next();
        LOG(WARNING) << "registering with the coordinator at " << coordinator_address_ << " failed: "
                     << st.error_message() << "; retrying in " << delay.count() << " ms";
        if (!Sleep(delay.count())) return;
        continue;
      }
      id = response.worker_id();
      interval_ms = std::clamp<int64_t>(response.heartbeat_interval_ms(), 50, 60000);
      use_stream = true;  // this coordinator may be newer than the last
      backoff.Reset();
      {
        MutexLock lock(&mu_);
        worker_id_ = id;
      }
      LOG(INFO) << "registered with the coordinator at " << coordinator_address_ << " as " << id << " (instance "
                << request.instance_id() << ", " << v1::WorkerState_Name(request.state())
                << (request.has_held() ? absl::StrCat(" holding ", request.held().assignment_id()) : "") << ")";
    }
    grpc::Status st;
    if (use_stream) {
      bool answered = false;
      st = StreamHeartbeats(id, interval_ms, &answered);
      if (answered) backoff.Reset();
      if (st.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
        LOG(INFO) << "the coordinator at " << coordinator_address_
                  << " has no heartbeat stream; sending unary heartbeats";
        use_stream = false;
        continue;
      }
    } else {
      st = UnaryHeartbeat(id);
    }
    if (st.error_code() == grpc::StatusCode::NOT_FOUND) {
      LOG(WARNING) << "the coordinator no longer knows worker " << id << " (" << st.error_message()
                   << "); registering again";
      id.clear();
      MutexLock lock(&mu_);
      worker_id_.clear();
      continue;
    }
    if (use_stream) {
      {
        MutexLock lock(&mu_);
        if (stop_) return;
        connected_ = false;
      }
      // The stream broke, or the coordinator went away, hung or refused a heartbeat: reopen it
      // after a backoff delay (a coordinator that is back answers NOT_FOUND if it lost this id).
      const std::chrono::milliseconds delay = backoff.Next();
      LOG(WARNING) << "the heartbeat stream to the coordinator at " << coordinator_address_
                   << " ended: " << st.error_message() << " (" << st.error_code() << "); reopening in "
                   << delay.count() << " ms";
      if (!Sleep(delay.count())) return;
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

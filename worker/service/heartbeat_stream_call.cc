#include "worker/service/heartbeat_stream_call.h"

#include <utility>

#include "absl/time/clock.h"
#include "common/log/log.h"

namespace shardserve::service {
namespace {

// Unanswered heartbeats a stream holds before Send refuses more (a coordinator that stopped
// answering: the Registrar gives up on the stream long before).
constexpr size_t kMaxUnanswered = 64;

}  // namespace

HeartbeatStreamCall::HeartbeatStreamCall(v1::Registry::Stub* stub, OnAnswer on_answer)
    : on_answer_(std::move(on_answer)) {
  stub->async()->HeartbeatStream(&ctx_, this);
  // Held until Close(): OnDone (after which nothing may be started) cannot come while the owner
  // may still write.
  AddHold();
  StartRead(&answer_);
  StartCall();
}

HeartbeatStreamCall::~HeartbeatStreamCall() {
  bool open = false;
  {
    MutexLock lock(&mu_);
    open = held_;
  }
  if (open) (void)Close();
}

bool HeartbeatStreamCall::Send(const v1::HeartbeatRequest& heartbeat) {
  const v1::HeartbeatRequest* msg = nullptr;
  {
    MutexLock lock(&mu_);
    if (ended_ || !held_ || unanswered_.size() >= kMaxUnanswered) return false;
    if (writing_) {
      if (!next_.has_value()) {  // a new heartbeat; a replaced one keeps its place (and send time)
        ++sent_;
        unanswered_.push_back(absl::Now());
      }
      next_ = heartbeat;
      return true;
    }
    writing_msg_ = heartbeat;
    writing_ = true;
    ++sent_;
    unanswered_.push_back(absl::Now());
    msg = &writing_msg_;
  }
  // Outside the lock: a reaction may run on this thread. writing_msg_ stays as it is until
  // OnWriteDone clears writing_.
  StartWrite(msg);
  return true;
}

bool HeartbeatStreamCall::WaitEnded(absl::Time deadline) {
  MutexLock lock(&mu_);
  while (!ended_) {
    if (cv_.WaitWithDeadline(&mu_, deadline)) break;
  }
  return ended_;
}

void HeartbeatStreamCall::Cancel() { ctx_.TryCancel(); }

grpc::Status HeartbeatStreamCall::Close() {
  bool ended = false;
  {
    MutexLock lock(&mu_);
    ended = ended_;
  }
  if (!ended) Cancel();
  {
    MutexLock lock(&mu_);
    CHECK(held_) << "HeartbeatStreamCall::Close called twice";
    held_ = false;
  }
  RemoveHold();
  MutexLock lock(&mu_);
  while (!done_) cv_.Wait(&mu_);
  return status_;
}

HeartbeatStreamCall::Progress HeartbeatStreamCall::progress() const {
  MutexLock lock(&mu_);
  return {.sent = sent_,
          .answered = answered_,
          .oldest_unanswered = unanswered_.empty() ? absl::InfiniteFuture() : unanswered_.front(),
          .ended = ended_};
}

void HeartbeatStreamCall::OnWriteDone(bool ok) {
  // A failed write means the stream is gone; the read side reports it (OnReadDone(false)).
  const v1::HeartbeatRequest* msg = nullptr;
  {
    MutexLock lock(&mu_);
    writing_ = false;
    if (!ok || !next_.has_value() || !held_ || ended_) return;
    writing_msg_ = *std::move(next_);
    next_.reset();
    writing_ = true;
    msg = &writing_msg_;
  }
  StartWrite(msg);
}

void HeartbeatStreamCall::OnReadDone(bool ok) {
  if (!ok) {
    MutexLock lock(&mu_);
    ended_ = true;
    cv_.SignalAll();
    return;
  }
  absl::Duration round_trip = absl::ZeroDuration();
  {
    MutexLock lock(&mu_);
    ++answered_;
    if (!unanswered_.empty()) {
      round_trip = absl::Now() - unanswered_.front();
      unanswered_.pop_front();
    }
  }
  if (on_answer_ != nullptr) on_answer_(round_trip);
  StartRead(&answer_);
}

void HeartbeatStreamCall::OnDone(const grpc::Status& status) {
  MutexLock lock(&mu_);
  done_ = true;
  ended_ = true;
  status_ = status;
  cv_.SignalAll();
}

}  // namespace shardserve::service

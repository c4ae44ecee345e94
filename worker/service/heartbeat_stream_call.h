// HeartbeatStreamCall: a worker's side of one Registry.HeartbeatStream call
// (proto/shardserve/v1/control.proto): heartbeats written as messages on one long-lived stream,
// each answered by the coordinator in order. The Registrar keeps one open while registered; the
// registry benchmark runs a thousand.
//
// Use, from one thread (the owner):
//   HeartbeatStreamCall call(stub);        // the call starts at once
//   while (...) {
//     call.Send(heartbeat);                // every interval
//     if (call.WaitEnded(next_beat)) break;  // the coordinator ended it, or it broke
//   }
//   grpc::Status st = call.Close();        // cancels it if still open; waits for the end
// Cancel() may be called from any thread (to stop the owner's wait). The destructor closes the
// call when Close() was not called (and so may wait for it to complete).
//
// Thread-safety: Send, WaitEnded and Close from the owner only; Cancel and progress() from any
// thread.
#ifndef SHARDSERVE_WORKER_SERVICE_HEARTBEAT_STREAM_CALL_H_
#define SHARDSERVE_WORKER_SERVICE_HEARTBEAT_STREAM_CALL_H_

#include <grpcpp/client_context.h>
#include <grpcpp/support/client_callback.h>
#include <grpcpp/support/status.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>

#include "absl/time/time.h"
#include "common/concurrency/mutex.h"
#include "shardserve/v1/control.grpc.pb.h"

namespace shardserve::service {

class HeartbeatStreamCall final : public grpc::ClientBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse> {
 public:
  // Called on a gRPC thread for every answer, with the time since its heartbeat was sent; must
  // not block.
  using OnAnswer = std::function<void(absl::Duration round_trip)>;

  // Starts the call on `stub` (borrowed; must outlive Close()). `on_answer` may be null.
  explicit HeartbeatStreamCall(v1::Registry::Stub* stub, OnAnswer on_answer = nullptr);
  ~HeartbeatStreamCall() override;  // Close() unless called

  HeartbeatStreamCall(const HeartbeatStreamCall&) = delete;
  HeartbeatStreamCall& operator=(const HeartbeatStreamCall&) = delete;

  // Writes `heartbeat`, or, while the previous one is still being written, keeps it to write next
  // (replacing one kept before: only the newest state matters, and it counts once). Returns false
  // without sending when 64 heartbeats are unanswered, or once the stream has ended or Close()
  // began.
  bool Send(const v1::HeartbeatRequest& heartbeat);
  // Waits until the stream has ended (the coordinator finished it, it broke, or it was cancelled)
  // or `deadline` passes; returns whether it has ended.
  bool WaitEnded(absl::Time deadline);
  // Cancels the call; the coordinator sees the stream closed (as when the worker dies).
  void Cancel();
  // Cancels the call if it has not ended, waits for its completion and returns its status:
  // the coordinator's (e.g. NOT_FOUND: register again), or CANCELLED / UNAVAILABLE when it was
  // cancelled or broke. Call at most once.
  grpc::Status Close();

  struct Progress {
    int64_t sent = 0;      // heartbeats written
    int64_t answered = 0;  // answers read
    // When the oldest unanswered heartbeat was sent; InfiniteFuture() when none is unanswered.
    absl::Time oldest_unanswered = absl::InfiniteFuture();
    bool ended = false;
  };
  Progress progress() const;

  void OnWriteDone(bool ok) override;
  void OnReadDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;

 private:
  const OnAnswer on_answer_;
  grpc::ClientContext ctx_;
  v1::HeartbeatResponse answer_;  // the read in flight (reads are serialised)
  mutable Mutex mu_;
  CondVar cv_;
  v1::HeartbeatRequest writing_msg_ ABSL_GUARDED_BY(mu_);  // the write in flight
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<v1::HeartbeatRequest> next_ ABSL_GUARDED_BY(mu_);  // to write when writing_ ends
  std::deque<absl::Time> unanswered_ ABSL_GUARDED_BY(mu_);  // send times, oldest first
  int64_t sent_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t answered_ ABSL_GUARDED_BY(mu_) = 0;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;  // the read side closed: no more answers
  bool held_ ABSL_GUARDED_BY(mu_) = true;    // the hold that keeps OnDone away while we may write
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardserve::service

#endif  // SHARDSERVE_WORKER_SERVICE_HEARTBEAT_STREAM_CALL_H_

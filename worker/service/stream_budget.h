// StreamBudget: the bytes of stage-stream messages one worker holds over all its streams — chunks
// being reassembled and micro-batches queued for, run by, or forwarded from its stage thread until
// they are answered — against a capacity, so that what peers send cannot grow the worker without
// bound (each stream alone is also capped per micro-batch).
//
// How the streams use it (worker_server.cc): every message read is charged; a stream reads on while
// the total is at most the capacity, and above it pauses between micro-batches until answers
// release enough (back-pressure: gRPC's flow control then stops the sender). Chunks of a
// micro-batch being reassembled are read on (a paused stream holds no half micro-batch, so the
// streams cannot wait on each other), but a micro-batch whose chunks take the total above twice
// the capacity is refused with RESOURCE_EXHAUSTED and its remaining chunks are dropped.
//
// Thread-safety: all methods may be called from any thread; callbacks run outside the lock.
#ifndef SHARDSERVE_WORKER_SERVICE_STREAM_BUDGET_H_
#define SHARDSERVE_WORKER_SERVICE_STREAM_BUDGET_H_

#include <cstddef>
#include <functional>
#include <vector>

#include "absl/time/time.h"
#include "common/concurrency/mutex.h"

namespace shardserve::service {

class StreamBudget {
 public:
  explicit StreamBudget(size_t capacity) : capacity_(capacity) {}

  // Adds `bytes` (always; the caller decides what to do when over).
  void Charge(size_t bytes);
  // Takes back bytes charged before; runs the waiting callbacks once the total is at most the
  // capacity.
  void Release(size_t bytes);
  // Runs `resume` once the total is at most the capacity: now, on this thread, when it already is;
  // else from the Release that gets it there.
  void WhenRoom(std::function<void()> resume);

  size_t used() const;
  size_t capacity() const { return capacity_; }
  // Waits until some stream is paused for room (a WhenRoom call is waiting); false when `timeout`
  // passed first. For tests: while nothing is released, a paused stream stays paused.
  bool WaitForPausedStreamForTest(absl::Duration timeout) const;

 private:
  const size_t capacity_;
  mutable Mutex mu_;
  size_t used_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::function<void()>> waiting_ ABSL_GUARDED_BY(mu_);
  mutable CondVar waiting_cv_;  // signalled when a resumption starts waiting
};

}  // namespace shardserve::service

#endif  // SHARDSERVE_WORKER_SERVICE_STREAM_BUDGET_H_

// What the stream clients (stage_stream_client.h, answer_stream_client.h) share at the end of a
// call: the words of its end in their error messages, the wait for gRPC to finish with it, and
// the hand-off of the client's last reference.
#ifndef SHARDSERVE_COMMON_RPC_INTERNAL_CALL_END_H_
#define SHARDSERVE_COMMON_RPC_INTERNAL_CALL_END_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include <grpcpp/grpcpp.h>

#include "absl/time/time.h"
#include "common/concurrency/mutex.h"
#include "common/rpc/internal/reaper.h"

namespace shardserve::rpc::internal {

// Appends how the peer ended the call to `problem` (which may already say what happened first):
// "closed the stream" for OK (when `problem` is empty), else "ended the stream" (likewise) and
// ": CODE: message".
void DescribeEnd(const grpc::Status& status, std::string* problem);

// Waits on `cv`, with `mu` held, until `*done` (guarded by `mu`) is true; false when `timeout`
// passed first (InfiniteDuration: no bound).
bool WaitUntilDone(Mutex* mu, CondVar* cv, const bool* done, absl::Duration timeout)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

// Removes and returns the callback that `waiting` (step_id -> callback) holds for `step_id`; an
// empty one when there is none. The caller holds the lock that guards `waiting`.
template <typename Map>
typename Map::mapped_type TakeWaiting(Map& waiting, uint64_t step_id) {
  typename Map::mapped_type taken;
  auto it = waiting.find(step_id);
  if (it != waiting.end()) {
    taken = std::move(it->second);
    waiting.erase(it);
  }
  return taken;
}

// The last thing a client's OnDone does: marks the call done (`*done`, guarded by `mu`; waking
// WaitUntilDone on `cv`) and hands `*self`, the client's reference to itself, to
// DisposeOffGrpcThreads (reaper.h): it may be the last one.
template <typename Client>
void MarkDoneAndDispose(Mutex* mu, CondVar* cv, bool* done, std::shared_ptr<Client>* self) {
  std::shared_ptr<void> last;
  {
    MutexLock lock(mu);
    *done = true;
    cv->SignalAll();
    last = std::move(*self);
  }
  DisposeOffGrpcThreads(std::move(last));
}

}  // namespace shardserve::rpc::internal

#endif  // SHARDSERVE_COMMON_RPC_INTERNAL_CALL_END_H_

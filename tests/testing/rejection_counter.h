// RejectionCounter: a SchedulerObserver for tests that counts the refusals reported to it
// (OnRejected), by status code, and the requests that ended (OnRequestEnd), so that a test can
// wait for an end without polling; it ignores everything else. Thread-safe. Header-only: a test
// that includes it links the coordinator's scheduler library already.
#ifndef SHARDSERVE_TESTS_TESTING_REJECTION_COUNTER_H_
#define SHARDSERVE_TESTS_TESTING_REJECTION_COUNTER_H_

#include <cstdint>
#include <map>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/scheduler/scheduler_observer.h"

namespace shardserve::testing {

class RejectionCounter final : public coordinator::SchedulerObserver {
 public:
  void OnRejected(const absl::Status& status) override {
    absl::MutexLock lock(&mu_);
    ++by_code_[status.code()];
  }
  void OnInterTokenLatency(absl::Duration) override {}
  void OnRequestEnd(const coordinator::RequestReport&) override {
    absl::MutexLock lock(&mu_);
    ++ended_;
  }
  void OnStep(const coordinator::StepReport&) override {}
  void OnPreempted(int) override {}
  void OnFailover(int) override {}
  void OnPrefixCacheLookup(int, int64_t, int64_t) override {}

  // Refusals with `code` so far.
  int count(absl::StatusCode code) {
    absl::MutexLock lock(&mu_);
    return by_code_[code];
  }
  // Waits until `n` requests have ended (as the scheduler's observer); false after `timeout`.
  bool WaitEnded(int n, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto ended = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ended_ >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&ended), timeout);
  }
  // All refusals so far.
  int total() {
    absl::MutexLock lock(&mu_);
    int n = 0;
    for (const auto& [code, count] : by_code_) n += count;
    return n;
  }

 private:
  absl::Mutex mu_;
  std::map<absl::StatusCode, int> by_code_ ABSL_GUARDED_BY(mu_);
  int ended_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace shardserve::testing

#endif  // SHARDSERVE_TESTS_TESTING_REJECTION_COUNTER_H_

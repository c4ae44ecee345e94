// Mutex, MutexLock and CondVar: a mutex that clang's thread-safety analysis checks (fields marked
// ABSL_GUARDED_BY(mu_), functions ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_); CI compiles every file that
// uses them with clang -Wthread-safety -Werror, see .ci/thread_safety.sh) and that ThreadSanitizer
// sees, because it is a std::mutex underneath (Debian's Abseil is not built with TSan's
// annotations, so absl::Mutex is invisible to the TSan build of the threaded parts).
//
// The names follow absl::Mutex's, so code reads the same on either side of the coordinator/worker
// line. Waiting on a CondVar takes the Mutex it is paired with; write the wait as a loop over the
// condition (`while (!ready_) cv_.Wait(&mu_);`): a predicate lambda would hide the guarded reads
// from the analysis.
#ifndef SHARDSERVE_COMMON_CONCURRENCY_MUTEX_H_
#define SHARDSERVE_COMMON_CONCURRENCY_MUTEX_H_

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace shardserve {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  // Tells the analysis that the caller holds this mutex (no run-time check: std::mutex does not
  // know its owner). For callbacks that run under a lock the analysis cannot follow.
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK() {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds a Mutex for its scope.
class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// A condition variable paired, at each wait, with the Mutex the caller holds. Wakeups may be
// spurious: always wait in a loop over the condition.
class CondVar {
 public:
  void Wait(Mutex* mu) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();  // the caller still holds mu
  }
  // Returns true when the timeout passed (the condition may still have changed: re-check it).
  bool WaitWithTimeout(Mutex* mu, absl::Duration timeout) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (timeout <= absl::ZeroDuration()) return true;
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    const bool timed_out = cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout)) == std::cv_status::timeout;
    lock.release();
    return timed_out;
  }
  bool WaitWithDeadline(Mutex* mu, absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return WaitWithTimeout(mu, deadline - absl::Now());
  }
  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_CONCURRENCY_MUTEX_H_

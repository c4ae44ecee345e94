// Parsed only by .ci/thread_safety.sh, which expects clang to refuse it: a field guarded by a
// mutex read without holding it. If clang ever accepts this file, the analysis checks nothing.
#include "common/concurrency/mutex.h"

namespace shardserve {

class ThreadSafetyProbe {
 public:
  int Unguarded() const { return value_; }  // error: reading value_ requires holding mutex mu_

 private:
  mutable Mutex mu_;
  int value_ ABSL_GUARDED_BY(mu_) = 0;
};

int ThreadSafetyProbeRead() { return ThreadSafetyProbe().Unguarded(); }

}  // namespace shardserve

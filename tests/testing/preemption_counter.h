// PreemptionCounter: a SchedulerObserver for tests that counts preemptions, failovers and the
// prefix cache's lookups (tokens looked up and found cached); it ignores everything else.
// Thread-safe. Header-only: a test that includes it links the coordinator's scheduler library
// already.
#ifndef SHARDSERVE_TESTS_TESTING_PREEMPTION_COUNTER_H_
#define SHARDSERVE_TESTS_TESTING_PREEMPTION_COUNTER_H_

#include <atomic>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "coordinator/scheduler/scheduler_observer.h"

namespace shardserve::testing {

class PreemptionCounter final : public coordinator::SchedulerObserver {
 public:
  void OnRejected(const absl::Status&) override {}
  void OnInterTokenLatency(absl::Duration) override {}
  void OnRequestEnd(const coordinator::RequestReport&) override {}
  void OnStep(const coordinator::StepReport&) override {}
  void OnPreempted(int) override { preempted_.fetch_add(1); }
  void OnFailover(int) override { failovers_.fetch_add(1); }
  void OnPrefixCacheLookup(int, int64_t context_tokens, int64_t cached_tokens) override {
    looked_up_.fetch_add(context_tokens);
    cached_.fetch_add(cached_tokens);
  }
  int preempted() const { return preempted_.load(); }
  int failovers() const { return failovers_.load(); }
  int64_t looked_up_tokens() const { return looked_up_.load(); }
  int64_t cached_tokens() const { return cached_.load(); }

 private:
  std::atomic<int> preempted_{0};
  std::atomic<int> failovers_{0};
  std::atomic<int64_t> looked_up_{0};
  std::atomic<int64_t> cached_{0};
};

}  // namespace shardserve::testing

#endif  // SHARDSERVE_TESTS_TESTING_PREEMPTION_COUNTER_H_

#include "worker/service/stream_budget.h"

#include <algorithm>
#include <utility>

namespace shardserve::service {

void StreamBudget::Charge(size_t bytes) {
  MutexLock lock(&mu_);
  used_ += bytes;
}

void StreamBudget::Release(size_t bytes) {
  std::vector<std::function<void()>> resume;
  {
    MutexLock lock(&mu_);
    used_ -= std::min(bytes, used_);
    if (used_ <= capacity_) resume.swap(waiting_);
  }
  for (auto& r : resume) r();
}

void StreamBudget::WhenRoom(std::function<void()> resume) {
  {
    MutexLock lock(&mu_);
    if (used_ > capacity_) {
      waiting_.push_back(std::move(resume));
      waiting_cv_.SignalAll();
      return;
    }
  }
  resume();
}

bool StreamBudget::WaitForPausedStreamForTest(absl::Duration timeout) const {
  const absl::Time deadline = absl::Now() + timeout;
  MutexLock lock(&mu_);
  while (waiting_.empty()) {
    if (waiting_cv_.WaitWithDeadline(&mu_, deadline)) return !waiting_.empty();
  }
  return true;
}

size_t StreamBudget::used() const {
  MutexLock lock(&mu_);
  return used_;
}

}  // namespace shardserve::service

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
      return;
    }
  }
  resume();
}

size_t StreamBudget::used() const {
  MutexLock lock(&mu_);
  return used_;
}

}  // namespace shardserve::service

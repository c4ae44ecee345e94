#include "worker/comm/host/host_communicator.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/concurrency/mutex.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define SHARDSERVE_CPU_RELAX() _mm_pause()
#else
#define SHARDSERVE_CPU_RELAX() ((void)0)
#endif

namespace shardserve::comm {
namespace {

// How a waiting rank waits. Peers of a decode step arrive within microseconds of each other, and a
// futex sleep + wake costs 25-50 us; worse, a rank that slept arrives late at the next barrier, so
// its peer times out and sleeps in turn, and every barrier of the step pays a wake-up. So a
// waiting rank spins for up to kSpinTime before sleeping on the futex — long enough to cover a
// layer's imbalance. Past kPureSpinIterations it yields the core between checks, so a peer that
// shares the core (more ranks than cores, another busy process) still gets to run.
constexpr auto kSpinTime = std::chrono::microseconds(2000);
constexpr int kPureSpinIterations = 4096;

class Group {
 public:
  explicit Group(int size) : send_(static_cast<size_t>(size)), size_(size) {}

  int size() const { return size_; }

  // Sense-reversing barrier. Returns false when the group was aborted.
  bool Wait() {
    // Load the generation before checking for an abort: Abort() sets the flag before it bumps the
    // generation (both sequentially consistent), so a rank that misses the flag is sure to see
    // the generation change and wake.
    const uint32_t gen = generation_.load();
    if (aborted_.load()) return false;
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == size_) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(gen + 1, std::memory_order_release);
      generation_.notify_all();
      return !aborted_.load(std::memory_order_acquire);
    }
    const auto deadline = std::chrono::steady_clock::now() + kSpinTime;
    for (int i = 1;; ++i) {
      if (generation_.load(std::memory_order_acquire) != gen) return !aborted_.load(std::memory_order_acquire);
      SHARDSERVE_CPU_RELAX();
      if (i % 64 == 0) {
        if (std::chrono::steady_clock::now() > deadline) break;
        if (i > kPureSpinIterations) std::this_thread::yield();
      }
    }
    while (generation_.load(std::memory_order_acquire) == gen) generation_.wait(gen, std::memory_order_acquire);
    return !aborted_.load(std::memory_order_acquire);
  }

  void Abort(const absl::Status& reason) {
    {
      MutexLock lock(&mu_);
      if (abort_reason_.ok()) abort_reason_ = reason.ok() ? absl::InternalError("aborted") : reason;
    }
    aborted_.store(true);
    // Release everyone blocked in a barrier.
    generation_.fetch_add(1);
    generation_.notify_all();
  }

  absl::Status AbortedStatus() {
    MutexLock lock(&mu_);
    return absl::AbortedError(absl::StrCat("host communicator aborted: ", abort_reason_.message()));
  }
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }

  // Per-rank published pointers for the collective in flight.
  std::vector<const float*> send_;
  std::vector<float> scratch_;  // resized only between barriers by rank 0

 private:
  const int size_;
  std::atomic<int> arrived_{0};
  std::atomic<uint32_t> generation_{0};
  std::atomic<bool> aborted_{false};
  Mutex mu_;  // a std::mutex underneath, so the TSan build sees it
  absl::Status abort_reason_ ABSL_GUARDED_BY(mu_);
};

class HostCommunicator final : public Communicator {
 public:
  HostCommunicator(std::shared_ptr<Group> group, int rank) : group_(std::move(group)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }

  absl::Status AllReduceSum(float* data, size_t count) override {
    if (size() == 1) return Check();
    // Phase 1: publish; rank 0 sizes the scratch.
    group_->send_[static_cast<size_t>(rank_)] = data;
    if (rank_ == 0 && group_->scratch_.size() < count) group_->scratch_.resize(count);
    if (!group_->Wait()) return group_->AbortedStatus();
    // Phase 2: reduce my slice of the elements over all ranks, in rank order.
    const auto [begin, end] = Slice(count);
    float* out = group_->scratch_.data();
    const float* first = group_->send_[0];
    std::copy(first + begin, first + end, out + begin);
    for (int r = 1; r < size(); ++r) {
      const float* src = group_->send_[static_cast<size_t>(r)];
      for (size_t i = begin; i < end; ++i) out[i] += src[i];
    }
    if (!group_->Wait()) return group_->AbortedStatus();
    // Phase 3: everyone copies the full result; the last barrier frees the scratch for reuse.
    std::memcpy(data, out, count * sizeof(float));
    if (!group_->Wait()) return group_->AbortedStatus();
    return absl::OkStatus();
  }

  absl::Status AllGather(const float* send, float* recv, size_t count) override {
    group_->send_[static_cast<size_t>(rank_)] = send;
    if (!group_->Wait()) return group_->AbortedStatus();
    for (int r = 0; r < size(); ++r) {
      std::memcpy(recv + static_cast<size_t>(r) * count, group_->send_[static_cast<size_t>(r)], count * sizeof(float));
    }
    if (!group_->Wait()) return group_->AbortedStatus();
    return absl::OkStatus();
  }

  absl::Status ReduceScatterSum(const float* send, float* recv, size_t count) override {
    group_->send_[static_cast<size_t>(rank_)] = send;
    if (!group_->Wait()) return group_->AbortedStatus();
    const size_t offset = static_cast<size_t>(rank_) * count;
    std::memcpy(recv, group_->send_[0] + offset, count * sizeof(float));
    for (int r = 1; r < size(); ++r) {
      const float* src = group_->send_[static_cast<size_t>(r)] + offset;
      for (size_t i = 0; i < count; ++i) recv[i] += src[i];
    }
    if (!group_->Wait()) return group_->AbortedStatus();
    return absl::OkStatus();
  }

  absl::Status Broadcast(float* data, size_t count, int root) override {
    if (root < 0 || root >= size()) {
      return absl::InvalidArgumentError(absl::StrCat("Broadcast: root ", root, " outside [0, ", size(), ")"));
    }
    group_->send_[static_cast<size_t>(rank_)] = data;
    if (!group_->Wait()) return group_->AbortedStatus();
    if (rank_ != root) std::memcpy(data, group_->send_[static_cast<size_t>(root)], count * sizeof(float));
    if (!group_->Wait()) return group_->AbortedStatus();
    return absl::OkStatus();
  }

  absl::Status Barrier() override {
    if (!group_->Wait()) return group_->AbortedStatus();
    return absl::OkStatus();
  }

  void Abort(const absl::Status& reason) override { group_->Abort(reason); }
  // Host collectives complete before they return; there is no device queue to order on.
  bool OrderOnStream(void* /*stream*/) override { return false; }

 private:
  absl::Status Check() { return group_->aborted() ? group_->AbortedStatus() : absl::OkStatus(); }
  std::pair<size_t, size_t> Slice(size_t count) const {
    const size_t n = static_cast<size_t>(size());
    const size_t per = (count + n - 1) / n;
    const size_t begin = std::min(count, per * static_cast<size_t>(rank_));
    return {begin, std::min(count, begin + per)};
  }

  std::shared_ptr<Group> group_;
  const int rank_;
};

}  // namespace

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateHostGroup(int size) {
  if (size < 1 || size > 1024) {
    return absl::InvalidArgumentError(absl::StrCat("host communicator group size must be in [1, 1024], got ", size));
  }
  auto group = std::make_shared<Group>(size);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < size; ++r) comms.push_back(std::make_unique<HostCommunicator>(group, r));
  return comms;
}

}  // namespace shardserve::comm

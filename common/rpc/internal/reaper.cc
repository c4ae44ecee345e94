#include "common/rpc/internal/reaper.h"

#include <thread>
#include <utility>
#include <vector>

#include "common/concurrency/mutex.h"

namespace shardserve::rpc::internal {
namespace {

class Reaper {
 public:
  static Reaper& Get() {
    static Reaper* const reaper = new Reaper();  // never destroyed: its thread may outlive main()
    return *reaper;
  }
  void Dispose(std::shared_ptr<void> object) {
    MutexLock lock(&mu_);
    queue_.push_back(std::move(object));
    cv_.Signal();
  }

 private:
  Reaper() {
    std::thread([this] { Run(); }).detach();
  }
  void Run() {
    for (;;) {
      std::vector<std::shared_ptr<void>> batch;
      {
        MutexLock lock(&mu_);
        while (queue_.empty()) cv_.Wait(&mu_);
        batch.swap(queue_);
      }
      batch.clear();  // destroyed here, without the lock
    }
  }

  Mutex mu_;
  CondVar cv_;
  std::vector<std::shared_ptr<void>> queue_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

void DisposeOffGrpcThreads(std::shared_ptr<void> object) { Reaper::Get().Dispose(std::move(object)); }

}  // namespace shardserve::rpc::internal

#include "common/http/serving_limits.h"

#include <httplib.h>
#include <sys/socket.h>

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/concurrency/mutex.h"

namespace shardserve {
namespace {

// How long a thread with nothing to do waits for work before it leaves.
constexpr absl::Duration kIdleThreadLifetime = absl::Seconds(30);

// cpp-httplib's TaskQueue: threads started when a task finds none idle (up to max_threads), leaving
// after kIdleThreadLifetime without work; at most max_queued tasks wait for a thread, and enqueue
// (called on the accepting thread) blocks while that many wait, so accepting pauses.
class OnDemandThreadPool final : public httplib::TaskQueue {
 public:
  OnDemandThreadPool(int max_threads, int max_queued)
      : max_threads_(static_cast<size_t>(max_threads)), max_queued_(static_cast<size_t>(max_queued)) {}
  ~OnDemandThreadPool() override { shutdown(); }

  void enqueue(std::function<void()> fn) override {
    std::vector<std::thread> finished;
    {
      MutexLock lock(&mu_);
      // Tasks no idle thread will take, with no room for another thread: wait for one to free up.
      while (!shutdown_ && Unserved() >= max_queued_ && live_ >= max_threads_) space_.Wait(&mu_);
      jobs_.push_back(std::move(fn));
      if (Unserved() > 0 && live_ < max_threads_) {
        ++live_;
        std::thread t([this] { Work(); });
        const std::thread::id id = t.get_id();
        threads_.emplace(id, std::move(t));
      } else {
        work_.Signal();
      }
      finished = TakeFinished();
    }
    for (std::thread& t : finished) t.join();
  }

  void shutdown() override {
    std::map<std::thread::id, std::thread> threads;
    {
      MutexLock lock(&mu_);
      shutdown_ = true;
      work_.SignalAll();
      space_.SignalAll();
      threads = std::move(threads_);
      threads_.clear();
    }
    for (auto& [id, t] : threads) {
      if (t.joinable()) t.join();
    }
  }

 private:
  // Tasks waiting that the idle threads will not cover.
  size_t Unserved() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return jobs_.size() > idle_ ? jobs_.size() - idle_ : 0; }

  std::vector<std::thread> TakeFinished() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<std::thread> out;
    for (const std::thread::id id : finished_) {
      auto it = threads_.find(id);
      if (it == threads_.end()) continue;  // shutdown() took it
      out.push_back(std::move(it->second));
      threads_.erase(it);
    }
    finished_.clear();
    return out;
  }

  void Work() ABSL_LOCKS_EXCLUDED(mu_) {
    mu_.Lock();
    while (true) {
      ++idle_;
      const absl::Time idle_until = absl::Now() + kIdleThreadLifetime;
      bool timed_out = false;
      while (!shutdown_ && jobs_.empty() && !timed_out) timed_out = work_.WaitWithDeadline(&mu_, idle_until);
      const bool woke = shutdown_ || !jobs_.empty();
      --idle_;
      if (jobs_.empty()) {
        if (shutdown_ || !woke) break;
        continue;
      }
      std::function<void()> fn = std::move(jobs_.front());
      jobs_.pop_front();
      space_.Signal();
      mu_.Unlock();
      fn();
      fn = nullptr;
      mu_.Lock();
    }
    --live_;
    finished_.push_back(std::this_thread::get_id());
    space_.Signal();
    mu_.Unlock();
  }

  const size_t max_threads_;
  const size_t max_queued_;
  Mutex mu_;
  CondVar work_;   // a task arrived, or shutdown
  CondVar space_;  // a task was taken or a thread left, or shutdown
  std::deque<std::function<void()>> jobs_ ABSL_GUARDED_BY(mu_);
  std::map<std::thread::id, std::thread> threads_ ABSL_GUARDED_BY(mu_);  // started, not yet joined
  std::vector<std::thread::id> finished_ ABSL_GUARDED_BY(mu_);           // returned from Work, to join
  size_t live_ ABSL_GUARDED_BY(mu_) = 0;                                 // threads in Work
  size_t idle_ ABSL_GUARDED_BY(mu_) = 0;                                 // threads waiting for a task
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

absl::Status HttpServingLimits::Validate(const char* what) const {
  if (max_threads < 1) return absl::InvalidArgumentError(absl::StrCat(what, "max_threads must be >= 1"));
  if (max_queued < 0) return absl::InvalidArgumentError(absl::StrCat(what, "max_queued must be >= 0"));
  if (idle_timeout < absl::Seconds(1)) {
    return absl::InvalidArgumentError(absl::StrCat(what, "idle_timeout must be >= 1 s"));
  }
  if (read_timeout <= absl::ZeroDuration() || write_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(what, "read and write timeouts must be > 0"));
  }
  if (max_requests_per_connection < 1) {
    return absl::InvalidArgumentError(absl::StrCat(what, "max_requests_per_connection must be >= 1"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> BindServer(httplib::Server& server, const std::string& host, int port, int backlog) {
  auto fd = std::make_shared<int>(-1);
  server.set_socket_options([fd](int sock) {
    *fd = sock;
    const int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  const int bound = port == 0 ? server.bind_to_any_port(host) : (server.bind_to_port(host, port) ? port : -1);
  if (bound <= 0 || *fd < 0) return absl::UnavailableError(absl::StrCat("cannot listen on ", host, ":", port));
  // listen() again on a listening socket only changes its backlog.
  if (listen(*fd, backlog) != 0) return absl::UnavailableError(absl::StrCat("cannot listen on ", host, ":", port));
  return bound;
}

void ApplyServingLimits(const HttpServingLimits& limits, httplib::Server& server) {
  const int threads = limits.max_threads;
  const int queued = limits.max_queued;
  server.new_task_queue = [threads, queued] { return new OnDemandThreadPool(threads, queued); };
  auto split = [](absl::Duration d, auto set) {
    const int64_t us = std::max<int64_t>(absl::ToInt64Microseconds(d), 1);
    set(static_cast<time_t>(us / 1000000), static_cast<time_t>(us % 1000000));
  };
  split(limits.read_timeout, [&](time_t s, time_t us) { server.set_read_timeout(s, us); });
  split(limits.write_timeout, [&](time_t s, time_t us) { server.set_write_timeout(s, us); });
  server.set_keep_alive_timeout(static_cast<time_t>(absl::ToInt64Seconds(absl::Ceil(limits.idle_timeout, absl::Seconds(1)))));
  server.set_keep_alive_max_count(static_cast<size_t>(limits.max_requests_per_connection));
  server.set_tcp_nodelay(true);
}

}  // namespace shardserve

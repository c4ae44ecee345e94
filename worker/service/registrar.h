// Registrar: keeps a worker registered with the coordinator. It registers (retrying with backoff
// until the coordinator answers), then sends a heartbeat with the worker's state every interval
// the coordinator asked for; a NOT_FOUND heartbeat (the coordinator restarted or declared the
// worker dead) makes it register again. Every call has a deadline.
#ifndef SHARDSERVE_WORKER_SERVICE_REGISTRAR_H_
#define SHARDSERVE_WORKER_SERVICE_REGISTRAR_H_

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "common/concurrency/mutex.h"
#include "shardserve/v1/control.grpc.pb.h"
#include "worker/service/worker_server.h"

namespace shardserve::service {

class Registrar {
 public:
  // `status` is called from the registrar's thread for every heartbeat. `credentials`: of the
  // channel to the coordinator's control port (mutual TLS expecting the coordinator role when the
  // cluster runs TLS); null = plaintext.
  Registrar(const std::string& coordinator_address, v1::RegisterRequest registration,
            std::function<WorkerStatusSnapshot()> status,
            std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr);
  ~Registrar();  // Stop()
  void Start();
  void Stop();
  // The id the coordinator gave; empty while unregistered. Thread-safe.
  std::string worker_id() const;
  // Whether the last heartbeat (or registration) reached the coordinator. Thread-safe.
  bool connected() const;
  // Asks the coordinator to drain this worker (Registry.Drain, `timeout` for its sequences).
  // FailedPrecondition while unregistered; the call's status otherwise. Thread-safe.
  absl::Status Drain(std::chrono::milliseconds timeout);

 private:
  void Loop();
  // Waits up to `ms`, returning false when stopping.
  bool Sleep(int64_t ms);

  const std::string coordinator_address_;
  const v1::RegisterRequest registration_;
  const std::function<WorkerStatusSnapshot()> status_;
  std::unique_ptr<v1::Registry::Stub> stub_;
  mutable Mutex mu_;
  CondVar cv_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::string worker_id_ ABSL_GUARDED_BY(mu_);
  bool connected_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace shardserve::service

#endif  // SHARDSERVE_WORKER_SERVICE_REGISTRAR_H_

// Registrar: keeps a worker registered with the coordinator. It registers, then sends a heartbeat
// with the worker's state every interval the coordinator asked for, as messages on one long-lived
// Registry.HeartbeatStream (HeartbeatStreamCall; a coordinator without it, UNIMPLEMENTED, gets
// unary Heartbeat calls instead). A NOT_FOUND heartbeat (the coordinator restarted or declared the
// worker dead) makes it register again and open a new stream. A stream that breaks (or whose
// heartbeats go unanswered for the call deadline, 5 s: a hung coordinator) is cancelled and
// reopened after a RegistrationBackoff delay; closing it makes the coordinator declare this
// worker dead at once, so Stop() is also how a stopping worker leaves. It never gives up:
// failed registrations are retried forever, after RegistrationBackoff delays (capped, with
// jitter, so that the workers of a cluster do not all call a coordinator that has just come back
// at the same instant). Every call has a deadline, and the channel reconnects at least every
// second or so (gRPC's own reconnect backoff, 2 min at most by default, is capped), so that a
// coordinator that was down for long is found within about a second of its return.
//
// Each registration carries the worker's identity (RegisterRequest.instance_id: random, made
// when the Registrar is made, i.e. once per worker process) and what it holds (the assignment,
// its state, its KV blocks: the `status` callback), so that a restarted coordinator gives it the
// same worker_id and adopts its stage instead of reloading it.
#ifndef SHARDSERVE_WORKER_SERVICE_REGISTRAR_H_
#define SHARDSERVE_WORKER_SERVICE_REGISTRAR_H_

#include <chrono>
#include <functional>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include <grpcpp/support/channel_arguments.h>

#include "absl/status/status.h"
#include "common/concurrency/mutex.h"
#include "shardserve/v1/control.grpc.pb.h"
#include "worker/service/heartbeat_stream_call.h"
#include "worker/service/worker_server.h"

namespace shardserve::service {

// The delays between failed registrations: "decorrelated jitter" — each delay is drawn uniformly
// from [base, 3 x the previous delay], capped at `cap` — so that retries spread out instead of
// arriving in waves, and grow roughly exponentially while the coordinator stays away.
// Not thread-safe (one per registrar thread).
class RegistrationBackoff {
 public:
  // A uniform draw from [lo, hi] (lo <= hi), in milliseconds; injected so tests can fix it.
  using Uniform = std::function<int64_t(int64_t lo, int64_t hi)>;
  // 0 < base <= cap. `uniform` null: a random generator seeded from the system.
  RegistrationBackoff(std::chrono::milliseconds base, std::chrono::milliseconds cap, Uniform uniform = nullptr);
  // The delay before the next attempt, in [base, cap].
  std::chrono::milliseconds Next();
  // After a success: the next failure starts again from `base`.
  void Reset();

 private:
  const int64_t base_ms_, cap_ms_;
  Uniform uniform_;
  int64_t previous_ms_;
};

// The arguments of a worker's channel to the coordinator's control port: reconnect backoff capped
// at about a second (gRPC's own, 1 s growing to 120 s, would keep a worker away for up to two
// minutes after a long coordinator outage), HTTP/2 BDP probing off (tiny messages; with it on,
// each heartbeat answer set off a PING: coordinator/api/control_service.h ConfigureControlPort).
grpc::ChannelArguments CoordinatorChannelArguments();

// A random worker instance id: 16 hex digits.
std::string NewInstanceId();

class Registrar {
 public:
  // `status` is called from the registrar's thread for every heartbeat and registration. An empty
  // registration.instance_id gets NewInstanceId(). `credentials`: of the channel to the
  // coordinator's control port (mutual TLS expecting the coordinator role when the cluster runs
  // TLS); null = plaintext.
  Registrar(const std::string& coordinator_address, v1::RegisterRequest registration,
            std::function<WorkerStatusSnapshot()> status,
            std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr);
  ~Registrar();  // Stop()
  void Start();
  void Stop();
  // This worker's instance id (what every registration carries).
  const std::string& instance_id() const { return registration_.instance_id(); }
  // The id the coordinator gave; empty while unregistered. Thread-safe.
  std::string worker_id() const;
  // Whether the last heartbeat (or registration) reached the coordinator. Thread-safe.
  bool connected() const;
  // Asks the coordinator to drain this worker (Registry.Drain, `timeout` for its sequences).
  // FailedPrecondition while unregistered; the call's status otherwise. Thread-safe.
  absl::Status Drain(std::chrono::milliseconds timeout);

 private:
  void Loop();
  // Heartbeats as `id` on one stream until it ends or Stop(); returns the stream's status (OK on
  // Stop) and sets `answered` when the coordinator answered at least one heartbeat.
  grpc::Status StreamHeartbeats(const std::string& id, int64_t interval_ms, bool* answered);
  // One unary Heartbeat as `id`.
  grpc::Status UnaryHeartbeat(const std::string& id);
  // A heartbeat as `id` with the worker's state now.
  v1::HeartbeatRequest HeartbeatNow(const std::string& id) const;
  // registration_ with what the worker holds now.
  v1::RegisterRequest Registration() const;
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
  HeartbeatStreamCall* stream_ ABSL_GUARDED_BY(mu_) = nullptr;  // the open stream, cancelled by Stop()
  std::thread thread_;
};

}  // namespace shardserve::service

#endif  // SHARDSERVE_WORKER_SERVICE_REGISTRAR_H_

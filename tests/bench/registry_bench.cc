// shardserve-bench-registry: the control plane at 1,000 workers (issue 24, part 4). Two processes:
// the coordinator side (the real WorkerRegistry behind the real Registry gRPC service on
// 127.0.0.1, plus a loop doing what the coordinator's Cluster loop does to the registry every
// poll: SweepDead + List, woken by changes or every 100 ms) and the fleet (N simulated workers, one
// gRPC channel and TCP connection each (--connections to share fewer), registering at once and
// then heartbeating at the default interval, staggered evenly: by default as the Registrar does,
// each on its own Registry.HeartbeatStream (the worker's HeartbeatStreamCall), or with
// --heartbeat=unary one Registry.Heartbeat call per beat, as before the stream existed). Forking
// keeps the coordinator's CPU time apart from the fleet's.
// Prints:
//  - registration: wall time until all N are registered (connections included), per-call p50/p99;
//  - steady state: heartbeats handled per second, the coordinator process's CPU time / wall time
//    (its share of one core), CPU µs per heartbeat (all of the process's CPU: gRPC, the registry
//    and the poll loop, divided by the heartbeats in the window), the round trip p50/p99 the
//    workers see, and WorkerRegistry::Heartbeat alone (µs per call, p50/p99, called directly);
//  - status: the ClusterStatus a GetClusterStatus reply carries for this registry (every worker
//    counted, one default page of 256 listed, and all N listed), its bytes and the time to build it
//    from the registry and encode it (no Cluster or Scheduler here: no assignments, no plan text);
//  - re-plan: --dead workers die (their heartbeat streams are cancelled, as when a worker process
//    dies and its connection closes; with --heartbeat=unary they just go silent) while --hung
//    others stay connected but silent. Printed: the time until the registry declares the dead
//    ones dead (a closed stream: at once; silence: the heartbeat timeout), the time to re-plan
//    (List + inventory + MakePlan of --model on the survivors, each an 8 x 80 GiB node) and their
//    sum, the time from the death to a new plan; then the time until the hung ones are dead
//    (the heartbeat timeout, whatever the transport).
// Figures only; no assertion on time (this machine is shared). Exits non-zero when something
// fails (an RPC error, a worker not declared dead, a plan error).
//
//   ./build/bin/shardserve-bench-registry [--workers=1000] [--steady_s=10] [--heartbeat=stream|unary] [--dead=1]
//       [--hung=0] [--model=tests/sim/models/gpt3-175b]
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/concurrency/abseil_mutex.h"
#include "common/concurrency/clock.h"
#include "common/model_spec/model_spec.h"
#include "common/plan/plan.h"
#include "coordinator/api/control_service.h"
#include "coordinator/client/proto_convert.h"
#include "coordinator/planner/planner.h"
#include "coordinator/registry/registry.h"
#include "shardserve/v1/control.grpc.pb.h"
#include "worker/service/heartbeat_stream_call.h"
#include "worker/service/registrar.h"

ABSL_FLAG(int, workers, 1000, "simulated workers");
ABSL_FLAG(int64_t, heartbeat_interval_ms, 1000, "heartbeat interval (the coordinator's default)");
ABSL_FLAG(int64_t, heartbeat_timeout_ms, 5000, "silence after which a worker is dead (the coordinator's default)");
ABSL_FLAG(double, warmup_s, 2.0, "heartbeating before the steady-state window");
ABSL_FLAG(double, steady_s, 10.0, "steady-state window, seconds");
ABSL_FLAG(int, dead, 1, "workers that die (their heartbeat streams close) before the re-plan");
ABSL_FLAG(int, hung, 0, "workers that stay connected but stop heartbeating (dead after the timeout)");
ABSL_FLAG(std::string, heartbeat, "stream", "stream (Registry.HeartbeatStream, as workers do) or unary (Registry.Heartbeat)");
ABSL_FLAG(int, connections, 0, "gRPC connections the fleet uses, workers spread over them; 0 = one per worker");
ABSL_FLAG(std::string, model, "tests/sim/models/gpt3-175b", "model directory (config.json) for the re-plan");

namespace shardserve {
namespace {

using coordinator::WorkerRecord;
using coordinator::WorkerRegistry;
using coordinator::WorkerState;
using Steady = std::chrono::steady_clock;

constexpr int64_t kGiB = int64_t{1} << 30;
constexpr int kDevicesPerWorker = 8;

double Seconds(Steady::duration d) { return std::chrono::duration<double>(d).count(); }
double Micros(Steady::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1))];
}

double CpuSeconds() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

// One byte or a few doubles over a pipe between the two processes.
void Send(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = write(fd, p, n);
    if (w <= 0) _exit(3);
    p += w;
    n -= static_cast<size_t>(w);
  }
}
void Receive(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = read(fd, p, n);
    if (r <= 0) _exit(3);
    p += r;
    n -= static_cast<size_t>(r);
  }
}
char ReceiveCommand(int fd) {
  char c = 0;
  Receive(fd, &c, 1);
  return c;
}

v1::WorkerState StateProto(WorkerState s) {
  switch (s) {
    case WorkerState::kIdle:
      return v1::WORKER_STATE_IDLE;
    case WorkerState::kLoading:
      return v1::WORKER_STATE_LOADING;
    case WorkerState::kReady:
      return v1::WORKER_STATE_READY;
    case WorkerState::kFailed:
      return v1::WORKER_STATE_FAILED;
    case WorkerState::kDead:
      return v1::WORKER_STATE_DEAD;
  }
  return v1::WORKER_STATE_UNSPECIFIED;
}

// The worker part of a ClusterStatus reply, as AdminService fills it: every worker counted per
// state, `page` of them listed (live ones first).
v1::ClusterStatus StatusReply(WorkerRegistry& registry, size_t page) {
  std::vector<WorkerRecord> workers = registry.List();
  std::stable_partition(workers.begin(), workers.end(),
                        [](const WorkerRecord& w) { return w.state != WorkerState::kDead; });
  v1::ClusterStatus out;
  out.set_total_workers(static_cast<int64_t>(workers.size()));
  int64_t counts[5] = {0, 0, 0, 0, 0};
  for (const WorkerRecord& w : workers) ++counts[static_cast<int>(w.state)];
  for (int s = 0; s < 5; ++s) {
    if (counts[s] == 0) continue;
    v1::WorkerStateCount* c = out.add_worker_counts();
    c->set_state(StateProto(static_cast<WorkerState>(s)));
    c->set_count(counts[s]);
  }
  const absl::Time now = absl::Now();
  for (size_t i = 0; i < workers.size() && i < page; ++i) {
    const WorkerRecord& w = workers[i];
    v1::WorkerStatus* o = out.add_workers();
    o->set_worker_id(w.worker_id);
    o->set_node_name(w.registration.node_name);
    o->set_address(w.registration.address);
    o->set_state(StateProto(w.state));
    o->set_error(w.error);
    for (const Device& d : w.registration.devices) coordinator::ToProto(d, o->add_devices());
    o->set_last_heartbeat_ms_ago(absl::ToInt64Milliseconds(now - w.last_heartbeat));
  }
  return out;
}

// Alive workers as the planner's inventory.
std::vector<WorkerInventory> Inventory(const std::vector<WorkerRecord>& workers) {
  std::vector<WorkerInventory> out;
  for (const WorkerRecord& w : workers) {
    if (w.state == WorkerState::kDead) continue;
    out.push_back({w.worker_id, w.registration.node_name, w.registration.devices});
  }
  return out;
}

// ---- The coordinator process ----------------------------------------------------------------------

int RunCoordinator(int in, int out) {
  const int n = absl::GetFlag(FLAGS_workers);
  RealClock clock;
  WorkerRegistry::Options options;
  options.heartbeat_interval = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_interval_ms));
  options.heartbeat_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_timeout_ms));
  options.incarnation = "bench";
  if (absl::Status st = options.Validate(); !st.ok()) {
    std::fprintf(stderr, "registry options: %s\n", std::string(st.message()).c_str());
    return 2;
  }
  WorkerRegistry registry(options, &clock);
  coordinator::RegistryService service(&registry);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  coordinator::ConfigureControlPort(builder);  // as the coordinator's control port
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) return 2;
  Send(out, &port, sizeof(port));

  // What the Cluster loop does to the registry (coordinator/cluster/cluster.cc, Loop and Tick).
  std::atomic<bool> stop{false};
  std::thread loop([&] {
    while (!stop.load()) {
      const uint64_t seen = registry.version();
      registry.SweepDead();
      (void)registry.List();
      registry.WaitForChange(seen, absl::Milliseconds(100));
    }
  });

  int rc = 0;
  double cpu0 = 0.0;
  Steady::time_point wall0;
  for (char c = ReceiveCommand(in); c != 'Q'; c = ReceiveCommand(in)) {
    if (c == 'S') {  // steady-state window opens
      cpu0 = CpuSeconds();
      wall0 = Steady::now();
      const double ack = 0;
      Send(out, &ack, sizeof(ack));
    } else if (c == 'E') {  // ... and closes: CPU and wall seconds
      const double figures[2] = {CpuSeconds() - cpu0, Seconds(Steady::now() - wall0)};
      Send(out, figures, sizeof(figures));
    } else if (c == 'H') {  // registry alone, status reply, initial plan
      std::vector<WorkerRecord> workers = registry.List();
      std::vector<double> us;
      for (int round = 0; round < 5; ++round) {
        for (const WorkerRecord& w : workers) {
          const Steady::time_point t = Steady::now();
          const absl::Status st = registry.Heartbeat({.worker_id = w.worker_id, .state = WorkerState::kIdle});
          us.push_back(Micros(Steady::now() - t));
          if (!st.ok()) rc = 1;
        }
      }
      std::printf("registry alone: WorkerRegistry::Heartbeat %.2f us p50, %.2f us p99 (%zu direct calls, %zu workers)\n",
                  Percentile(us, 0.5), Percentile(us, 0.99), us.size(), workers.size());
      {  // what the poll loop costs: one SweepDead + List, up to 10 times a second
        std::vector<double> ms;
        for (int i = 0; i < 20; ++i) {
          const Steady::time_point t = Steady::now();
          registry.SweepDead();
          (void)registry.List();
          ms.push_back(Seconds(Steady::now() - t) * 1e3);
        }
        std::printf("poll loop: SweepDead + List of %d workers %.3f ms p50 (at most 10 per s: %.2f%% of one core)\n", n,
                    Percentile(ms, 0.5), Percentile(ms, 0.5));
      }
      std::vector<size_t> pages = {std::min<size_t>(256, static_cast<size_t>(n))};
      if (n > 256) pages.push_back(static_cast<size_t>(n));
      for (const size_t page : pages) {
        std::vector<double> build_ms;
        size_t bytes = 0;
        for (int i = 0; i < 20; ++i) {
          const Steady::time_point t = Steady::now();
          const std::string wire = StatusReply(registry, page).SerializeAsString();
          build_ms.push_back(Seconds(Steady::now() - t) * 1e3);
          bytes = wire.size();
        }
        std::printf("status reply, %zu workers listed of %d: %zu bytes, %.2f ms p50 / %.2f ms max to build and encode\n",
                    std::min(page, static_cast<size_t>(n)), n, bytes, Percentile(build_ms, 0.5),
                    Percentile(build_ms, 1.0));
      }
      std::fflush(stdout);
      Send(out, &rc, sizeof(rc));
    } else if (c == 'K') {  // the fleet is about to kill --dead workers and silence --hung: detect, re-plan
      const int dead = absl::GetFlag(FLAGS_dead);
      const int hung = absl::GetFlag(FLAGS_hung);
      const absl::Duration limit = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_timeout_ms) * 3);
      // Waits (woken by the registry's changes, swept every 10 ms) until at most `alive` are alive.
      auto wait_alive = [&](int alive, Steady::time_point t0) {
        while (registry.NumAlive() > alive && Steady::now() - t0 < absl::ToChronoNanoseconds(limit)) {
          registry.WaitForChange(registry.version(), absl::Milliseconds(10));
        }
        return Seconds(Steady::now() - t0);
      };
      const Steady::time_point t0 = Steady::now();
      const int ack = 0;
      Send(out, &ack, sizeof(ack));
      const double detect_s = wait_alive(n - dead, t0);
      const int alive = registry.NumAlive();
      absl::StatusOr<ModelSpec> spec = LoadModelSpec(absl::GetFlag(FLAGS_model));
      if (!spec.ok()) {
        std::fprintf(stderr, "model: %s\n", std::string(spec.status().message()).c_str());
        rc = 1;
      } else {
        PlanPolicy policy;
        policy.max_seq_len = 2048;
        const Steady::time_point t1 = Steady::now();
        const std::vector<WorkerInventory> inventory = Inventory(registry.List());
        absl::StatusOr<Plan> plan = MakePlan(*spec, inventory, policy);
        const double replan_ms = Seconds(Steady::now() - t1) * 1e3;
        if (!plan.ok()) {
          std::fprintf(stderr, "re-plan: %s\n", std::string(plan.status().message()).c_str());
          rc = 1;
        } else {
          std::printf("after %d worker(s) died (%s): declared dead after %.3f s (heartbeat timeout %.1f s); re-plan of "
                      "%s on the %d survivors (List + inventory + MakePlan): %.1f ms -> %zu replicas x %zu stages; "
                      "death to new plan: %.3f s\n",
                      n - alive, absl::GetFlag(FLAGS_heartbeat) == "stream" ? "heartbeat streams closed" : "silent",
                      detect_s, static_cast<double>(absl::GetFlag(FLAGS_heartbeat_timeout_ms)) / 1e3,
                      absl::GetFlag(FLAGS_model).c_str(), alive, replan_ms, plan->replicas.size(),
                      plan->replicas.empty() ? size_t{0} : plan->replicas[0].stages.size(), detect_s + replan_ms / 1e3);
        }
      }
      if (alive != n - dead && hung == 0) {
        std::fprintf(stderr, "%d workers alive, expected %d\n", alive, n - dead);
        rc = 1;
      }
      if (hung > 0) {
        const double hung_s = wait_alive(n - dead - hung, t0);
        std::printf("%d hung worker(s) (connected, silent) declared dead after %.2f s\n", hung, hung_s);
      }
      if (const int left = registry.NumAlive(); left != n - dead - hung) {
        std::fprintf(stderr, "%d workers alive, expected %d\n", left, n - dead - hung);
        rc = 1;
      }
      std::fflush(stdout);
      Send(out, &rc, sizeof(rc));
    }
  }
  stop = true;
  loop.join();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return rc;
}

// ---- The fleet process ------------------------------------------------------------------------------

struct Fleet {
  std::vector<std::unique_ptr<v1::Registry::Stub>> stubs;  // one channel (connection) per worker
  std::vector<std::string> ids;
  std::unique_ptr<std::atomic<bool>[]> alive;
  // --heartbeat=stream: each worker's heartbeat stream.
  std::vector<std::unique_ptr<service::HeartbeatStreamCall>> streams;
  absl::Mutex mu;
  std::vector<std::pair<Steady::time_point, double>> heartbeat_us ABSL_GUARDED_BY(mu);  // (done at, round trip)
  int errors ABSL_GUARDED_BY(mu) = 0;
  int in_flight ABSL_GUARDED_BY(mu) = 0;
  int skipped ABSL_GUARDED_BY(mu) = 0;  // stream beats not sent: the previous one still being written
};

// An async call's state, freed by its callback.
struct HeartbeatCall {
  grpc::ClientContext ctx;
  v1::HeartbeatRequest request;
  v1::HeartbeatResponse response;
  Steady::time_point start;
};

void SendHeartbeat(Fleet& fleet, size_t i) {
  if (!fleet.streams.empty()) {
    v1::HeartbeatRequest hb;
    hb.set_worker_id(fleet.ids[i]);
    hb.set_state(v1::WORKER_STATE_IDLE);
    if (!fleet.streams[i]->Send(hb)) {
      absl::MutexLock lock(&fleet.mu);
      ++fleet.skipped;
    }
    return;
  }
  auto* call = new HeartbeatCall;
  call->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  call->request.set_worker_id(fleet.ids[i]);
  call->request.set_state(v1::WORKER_STATE_IDLE);
  call->start = Steady::now();
  {
    absl::MutexLock lock(&fleet.mu);
    ++fleet.in_flight;
  }
  fleet.stubs[i]->async()->Heartbeat(&call->ctx, &call->request, &call->response, [&fleet, call](grpc::Status st) {
    const Steady::time_point done = Steady::now();
    absl::MutexLock lock(&fleet.mu);
    --fleet.in_flight;
    if (st.ok()) {
      fleet.heartbeat_us.push_back({done, Micros(done - call->start)});
    } else {
      ++fleet.errors;
    }
    delete call;
  });
}

int RunFleet(int in, int out, pid_t child) {
  const int n = absl::GetFlag(FLAGS_workers);
  int port = 0;
  Receive(in, &port, sizeof(port));
  const std::string target = absl::StrCat("127.0.0.1:", port);
  Fleet fleet;
  fleet.ids.resize(static_cast<size_t>(n));
  fleet.alive = std::make_unique<std::atomic<bool>[]>(static_cast<size_t>(n));
  const int connections = absl::GetFlag(FLAGS_connections) > 0 ? std::min(absl::GetFlag(FLAGS_connections), n) : n;
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int c = 0; c < connections; ++c) {
    grpc::ChannelArguments args = service::CoordinatorChannelArguments();  // as a worker's
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // its own connection, as a real worker has
    channels.push_back(grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args));
  }
  for (int i = 0; i < n; ++i) fleet.stubs.push_back(v1::Registry::NewStub(channels[static_cast<size_t>(i % connections)]));

  // Registration: all at once, as a fleet that starts together.
  struct RegisterCall {
    grpc::ClientContext ctx;
    v1::RegisterRequest request;
    v1::RegisterResponse response;
    Steady::time_point start;
    double us = 0;
    grpc::Status status;
  };
  std::vector<RegisterCall> calls(static_cast<size_t>(n));
  absl::Mutex mu;
  int done = 0;
  const Steady::time_point reg0 = Steady::now();
  for (int i = 0; i < n; ++i) {
    RegisterCall& c = calls[static_cast<size_t>(i)];
    c.ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    c.request.set_node_name(absl::StrCat("node-", i));
    c.request.set_address(absl::StrCat("10.0.", i / 250, ".", i % 250, ":7100"));
    for (int d = 0; d < kDevicesPerWorker; ++d) {
      coordinator::ToProto(Device{DeviceKind::kCuda, d, 80 * kGiB, 72 * kGiB}, c.request.add_devices());
    }
    c.start = Steady::now();
    fleet.stubs[static_cast<size_t>(i)]->async()->Register(&c.ctx, &c.request, &c.response,
                                                            [&c, &mu, &done](grpc::Status st) {
                                                              c.us = Micros(Steady::now() - c.start);
                                                              c.status = std::move(st);
                                                              absl::MutexLock lock(&mu);
                                                              ++done;
                                                            });
  }
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(+[](int* d) { return *d == static_cast<int>(absl::GetFlag(FLAGS_workers)); }, &done));
  }
  const double reg_s = Seconds(Steady::now() - reg0);
  std::vector<double> reg_us;
  int64_t interval_ms = 0;
  for (int i = 0; i < n; ++i) {
    RegisterCall& c = calls[static_cast<size_t>(i)];
    if (!c.status.ok()) {
      std::fprintf(stderr, "register %d: %s\n", i, c.status.error_message().c_str());
      return 1;
    }
    fleet.ids[static_cast<size_t>(i)] = c.response.worker_id();
    fleet.alive[static_cast<size_t>(i)] = true;
    interval_ms = c.response.heartbeat_interval_ms();
    reg_us.push_back(c.us);
  }
  const bool streams = absl::GetFlag(FLAGS_heartbeat) == "stream";
  std::printf("shardserve-bench-registry: %d workers (%d devices each) over %d gRPC connections to the Registry "
              "service on %s; heartbeat interval %lld ms, %s\n",
              n, kDevicesPerWorker, connections, target.c_str(), static_cast<long long>(interval_ms),
              streams ? "one Registry.HeartbeatStream per worker" : "one unary Registry.Heartbeat per beat");
  if (streams) {
    for (int i = 0; i < n; ++i) {
      fleet.streams.push_back(std::make_unique<service::HeartbeatStreamCall>(
          fleet.stubs[static_cast<size_t>(i)].get(), [&fleet](absl::Duration round_trip) {
            const Steady::time_point answered = Steady::now();
            absl::MutexLock lock(&fleet.mu);
            fleet.heartbeat_us.push_back({answered, absl::ToDoubleMicroseconds(round_trip)});
          }));
    }
  }
  std::printf("registration: all %d registered in %.3f s (%.0f per s); per call %.2f ms p50, %.2f ms p99 "
              "(connection setup included)\n",
              n, reg_s, n / reg_s, Percentile(reg_us, 0.5) / 1e3, Percentile(reg_us, 0.99) / 1e3);
  std::fflush(stdout);

  // Heartbeats: worker i at t0 + k x interval + i x interval / n, as the interval tells it.
  std::atomic<bool> stop{false};
  std::thread beats([&] {
    const Steady::duration interval = std::chrono::milliseconds(interval_ms);
    const Steady::time_point t0 = Steady::now();
    for (int64_t k = 0; !stop.load(); ++k) {
      for (int i = 0; i < n && !stop.load(); ++i) {
        std::this_thread::sleep_until(t0 + k * interval + interval * i / n);
        if (fleet.alive[static_cast<size_t>(i)]) SendHeartbeat(fleet, static_cast<size_t>(i));
      }
    }
  });
  auto sleep_s = [](double s) { std::this_thread::sleep_for(std::chrono::duration<double>(s)); };
  sleep_s(absl::GetFlag(FLAGS_warmup_s));

  char cmd = 'S';
  double ack = 0;
  Send(out, &cmd, 1);
  Receive(in, &ack, sizeof(ack));
  const Steady::time_point w0 = Steady::now();
  sleep_s(absl::GetFlag(FLAGS_steady_s));
  cmd = 'E';
  Send(out, &cmd, 1);
  double cpu_wall[2] = {0, 0};
  Receive(in, cpu_wall, sizeof(cpu_wall));
  const Steady::time_point w1 = Steady::now();
  std::vector<double> rtt;
  int errors = 0;
  int skipped = 0;
  {
    absl::MutexLock lock(&fleet.mu);
    skipped = fleet.skipped;
    for (const auto& [at, us] : fleet.heartbeat_us) {
      if (at >= w0 && at <= w1) rtt.push_back(us);
    }
    errors = fleet.errors;
  }
  const double handled = static_cast<double>(rtt.size());
  std::printf("steady state (%.1f s window): %.0f heartbeats/s handled; coordinator process CPU %.3f s over %.3f s "
              "wall = %.2f%% of one core; %.1f us of coordinator CPU per heartbeat (gRPC + registry + poll loop); "
              "round trip seen by workers %.0f us p50, %.0f us p99; %d errors, %d beats skipped\n",
              cpu_wall[1], handled / Seconds(w1 - w0), cpu_wall[0], cpu_wall[1], 100.0 * cpu_wall[0] / cpu_wall[1],
              handled > 0 ? cpu_wall[0] * 1e6 / handled : 0.0, Percentile(rtt, 0.5), Percentile(rtt, 0.99), errors, skipped);
  std::fflush(stdout);

  int rc = errors > 0 ? 1 : 0;
  int child_rc = 0;
  cmd = 'H';
  Send(out, &cmd, 1);
  Receive(in, &child_rc, sizeof(child_rc));
  rc = std::max(rc, child_rc);

  // Workers spread over the fleet: the first --dead die, the next --hung go silent.
  const int dead = absl::GetFlag(FLAGS_dead);
  const int hung = absl::GetFlag(FLAGS_hung);
  cmd = 'K';
  Send(out, &cmd, 1);
  int kill_ack = 0;
  Receive(in, &kill_ack, sizeof(kill_ack));  // the coordinator's clock runs from here
  for (int k = 0; k < dead + hung; ++k) {
    const size_t i = static_cast<size_t>(k * n / (dead + hung));
    fleet.alive[i] = false;
    if (k < dead && streams) fleet.streams[i]->Cancel();
  }
  Receive(in, &child_rc, sizeof(child_rc));
  rc = std::max(rc, child_rc);

  cmd = 'Q';
  Send(out, &cmd, 1);
  stop = true;
  beats.join();
  for (const std::unique_ptr<service::HeartbeatStreamCall>& call : fleet.streams) (void)call->Close();
  {  // let the last heartbeats finish before the stubs go
    absl::MutexLock lock(&fleet.mu);
    fleet.mu.AwaitWithTimeout(absl::Condition(+[](int* f) { return *f == 0; }, &fleet.in_flight), absl::Seconds(15));
  }
  int status = 0;
  waitpid(child, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) rc = 1;
  return rc;
}

}  // namespace
}  // namespace shardserve

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  shardserve::UseReleaseAbseilMutexes();  // as the coordinator does: gRPC locks absl::Mutexes on every message
  if (absl::GetFlag(FLAGS_workers) < 1 || absl::GetFlag(FLAGS_dead) < 0 || absl::GetFlag(FLAGS_hung) < 0 ||
      absl::GetFlag(FLAGS_dead) + absl::GetFlag(FLAGS_hung) >= absl::GetFlag(FLAGS_workers)) {
    std::fprintf(stderr, "--workers must be >= 1, --dead and --hung >= 0 and dead + hung < workers\n");
    return 2;
  }
  if (absl::GetFlag(FLAGS_heartbeat) != "stream" && absl::GetFlag(FLAGS_heartbeat) != "unary") {
    std::fprintf(stderr, "--heartbeat must be stream or unary, got \"%s\"\n", absl::GetFlag(FLAGS_heartbeat).c_str());
    return 2;
  }
  // Two connections per worker (one per process) must fit under the descriptor limit.
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur = lim.rlim_max;
    setrlimit(RLIMIT_NOFILE, &lim);
  }
  // Fork before any gRPC state exists: each process starts its own.
  int to_child[2], to_fleet[2];
  if (pipe(to_child) != 0 || pipe(to_fleet) != 0) return 2;
  const pid_t pid = fork();
  if (pid < 0) return 2;
  if (pid == 0) {
    close(to_child[1]);
    close(to_fleet[0]);
    const int rc = shardserve::RunCoordinator(to_child[0], to_fleet[1]);
    std::fflush(stdout);
    _exit(rc);
  }
  close(to_child[0]);
  close(to_fleet[1]);
  return shardserve::RunFleet(to_fleet[0], to_child[1], pid);
}

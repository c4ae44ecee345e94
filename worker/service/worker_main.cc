// shardserve-worker: one per node. Registers with the coordinator, receives its assignment (a
// pipeline stage), loads its slice of the weights onto its ranks, and serves the stage stream.
//
//   shardserve-worker --coordinator=HOST:PORT --listen=HOST:PORT --devices=cpu:2 --node_name=NODE
//                     [--tls_dir=DIR | --tls_cert=PEM --tls_key=PEM --tls_ca=PEM] [--drain_timeout_s=60]
//
// SIGTERM drains the worker first (Registry.Drain: its requests move to another replica or finish,
// its stage goes to a spare) and exits once the coordinator releases it; SIGINT exits at once.
//
// --coordinator is the coordinator's control port (its --control_listen), not its public API.
// With TLS every link is mutual TLS: this worker presents a certificate with the worker role,
// accepts calls only from peers whose certificate carries the coordinator or worker role, and
// talks only to a coordinator (and workers) whose certificates carry theirs.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <iostream>
#include <string>

#include "common/flags/usage.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/concurrency/abseil_mutex.h"
#include "common/flags/parse.h"
#include "common/log/log.h"
#include "common/memory/malloc_tuning.h"
#include "common/metrics/metrics_server.h"
#include "common/security/grpc_security.h"
#include "common/security/tls_files.h"
#include "worker/kernels/registry.h"
#include "worker/run/run_options.h"
#include "worker/service/convert.h"
#include "worker/service/registrar.h"
#include "worker/service/worker_server.h"

ABSL_FLAG(std::string, coordinator, "", "the coordinator's control address HOST:PORT (its --control_listen)");
ABSL_FLAG(std::string, listen, "127.0.0.1:0", "address to serve on, HOST:PORT (port 0 picks a free port)");
ABSL_FLAG(std::string, advertise, "", "address other processes reach this worker at (default: --listen's host "
                                      "with the bound port)");
ABSL_FLAG(std::string, devices, "cpu", "cpu, cpu:N, cuda:all or cuda:0,1,...");
ABSL_FLAG(int32_t, threads, 1, "BLAS threads of a single CPU rank");
ABSL_FLAG(std::string, node_name, "", "node name (default: the host name)");
ABSL_FLAG(std::string, memory_per_device, "",
          "memory each device offers the planner at most, e.g. 20GiB or 512MB (default: its free memory)");
ABSL_FLAG(std::string, stream_buffer_bytes, "1GiB",
          "stage-stream bytes this worker holds over all its streams before they stop reading (back-pressure); a "
          "micro-batch that would take them past twice this is refused (RESOURCE_EXHAUSTED)");
ABSL_FLAG(int64_t, stage_spin_us, 0,
          "microseconds the idle stage thread polls for the next micro-batch before it sleeps (saves a thread "
          "wake-up per hop where cores are free; 0 = sleep at once), in [0, 100000]");
ABSL_FLAG(int64_t, stage_poll_us, 1000,
          "the longest the idle stage thread polls per wait for a micro-batch its recent waits say is due: it "
          "sleeps until shortly before, then polls, so that the micro-batch finds its core awake (at most a quarter "
          "of a typical wait; none for waits under 300 us; 0 = sleep at once), in [0, 100000]");
ABSL_FLAG(int64_t, stage_inline_us, 1000,
          "a micro-batch that the stage's last step says takes at most this long runs on the gRPC thread that read "
          "it, without a hand-off to the stage thread, when the stage is idle (0 = always hand off), in [0, 100000]");
ABSL_FLAG(bool, step_deltas, true,
          "stage streams carry step deltas (each step sends only what changed of a running sequence, against a "
          "table per stream) where both ends support them; false = every micro-batch in full, both ways");
ABSL_FLAG(bool, keep_heap_blocks, true,
          "serve large blocks from the heap rather than mmap and keep up to 1 GiB of freed memory there for reuse "
          "(glibc's mallopt): a prefill micro-batch's megabytes of hidden states then reuse warm pages instead of "
          "mapping fresh ones every step; false = glibc's defaults");
ABSL_FLAG(double, gpu_memory_utilization, 0.9,
          "fraction of each CUDA device's memory this worker may fill (weights, workspace and the KV cache the "
          "planner sizes from what is left), in (0, 1]");
ABSL_FLAG(std::string, metrics_listen, "", "serve Prometheus metrics at http://HOST:PORT/metrics (port 0 picks one; "
                                           "empty = no metrics)");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain of this worker (its URI SAN spiffe://shardserve/worker)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA certificate(s) of the cluster: every peer must chain to it");
ABSL_FLAG(std::string, tls_dir, "", "directory with tls.crt, tls.key and ca.crt (a Kubernetes TLS Secret); "
                                    "instead of --tls_cert/--tls_key/--tls_ca");
ABSL_FLAG(int32_t, drain_timeout_s, 60,
          "on SIGTERM, ask the coordinator to drain this worker (its sequences move to another replica, or run to "
          "their end for at most this long) and exit once released, or after this long plus 10 s; 0 = exit at once. "
          "SIGINT always exits at once");
ABSL_FLAG(int32_t, tls_refresh_s, 10, "re-read the TLS files this often (seconds): rotated certificates are used "
                                      "by new connections without a restart");

namespace {

volatile std::sig_atomic_t g_stop = 0;  // the signal that asked to stop (0 = none yet)
void OnSignal(int sig) { g_stop = sig; }

}  // namespace

int main(int argc, char** argv) {
  shardserve::UseReleaseAbseilMutexes();  // gRPC locks absl::Mutexes on every message
  shardserve::SetProgramUsage("shardserve worker daemon: --coordinator=HOST:PORT --listen=HOST:PORT --devices=cpu:N");
  absl::ParseCommandLine(argc, argv);
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  using namespace shardserve;
  if (absl::GetFlag(FLAGS_keep_heap_blocks) && !KeepLargeBlocksInTheHeap()) {
    LOG(WARNING) << "--keep_heap_blocks: the allocator refused the settings; it keeps its defaults";
  }
  const std::string coordinator = absl::GetFlag(FLAGS_coordinator);
  if (coordinator.empty()) {
    std::cerr << "shardserve-worker: --coordinator is required\n";
    return 2;
  }
  auto devices = run::ParseDevices(absl::GetFlag(FLAGS_devices), absl::GetFlag(FLAGS_threads), kernels::CudaDeviceCount());
  if (!devices.ok()) {
    std::cerr << "shardserve-worker: " << devices.status() << "\n";
    return 2;
  }
  if (devices->kind == kernels::DeviceKind::kCuda && !kernels::CudaCompiledIn()) {
    std::cerr << "shardserve-worker: CUDA devices requested but this binary was built without CUDA\n";
    return 2;
  }
  int64_t memory_per_device = 0;
  if (const std::string m = absl::GetFlag(FLAGS_memory_per_device); !m.empty()) {
    auto bytes = ParseByteSize(m);
    if (!bytes.ok() || *bytes < 1) {
      std::cerr << "shardserve-worker: --memory_per_device: "
                << (bytes.ok() ? "must be > 0" : std::string(bytes.status().message())) << "\n";
      return 2;
    }
    memory_per_device = *bytes;
  }
  absl::StatusOr<int64_t> stream_buffer_bytes = ParseByteSize(absl::GetFlag(FLAGS_stream_buffer_bytes));
  if (!stream_buffer_bytes.ok() || *stream_buffer_bytes < 1) {
    std::cerr << "shardserve-worker: --stream_buffer_bytes: "
              << (stream_buffer_bytes.ok() ? "must be > 0" : std::string(stream_buffer_bytes.status().message()))
              << "\n";
    return 2;
  }
  const int64_t stage_spin_us = absl::GetFlag(FLAGS_stage_spin_us);
  if (stage_spin_us < 0 || stage_spin_us > 100000) {
    std::cerr << "shardserve-worker: --stage_spin_us must be in [0, 100000], got " << stage_spin_us << "\n";
    return 2;
  }
  const int64_t stage_poll_us = absl::GetFlag(FLAGS_stage_poll_us);
  if (stage_poll_us < 0 || stage_poll_us > 100000) {
    std::cerr << "shardserve-worker: --stage_poll_us must be in [0, 100000], got " << stage_poll_us << "\n";
    return 2;
  }
  const int64_t stage_inline_us = absl::GetFlag(FLAGS_stage_inline_us);
  if (stage_inline_us < 0 || stage_inline_us > 100000) {
    std::cerr << "shardserve-worker: --stage_inline_us must be in [0, 100000], got " << stage_inline_us << "\n";
    return 2;
  }
  const double gpu_memory_utilization = absl::GetFlag(FLAGS_gpu_memory_utilization);
  if (!(gpu_memory_utilization > 0.0 && gpu_memory_utilization <= 1.0)) {
    std::cerr << "shardserve-worker: --gpu_memory_utilization must be in (0, 1], got " << gpu_memory_utilization
              << "\n";
    return 2;
  }
  std::string node = absl::GetFlag(FLAGS_node_name);
  if (node.empty()) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    node = host;
  }
  auto tls = security::TlsOptionsFromFlags(absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                                           absl::GetFlag(FLAGS_tls_ca), absl::GetFlag(FLAGS_tls_dir));
  if (!tls.ok()) {
    std::cerr << "shardserve-worker: " << tls.status().message() << "\n";
    return 2;
  }
  if (tls->has_value()) (*tls)->refresh_interval = absl::Seconds(std::max(1, absl::GetFlag(FLAGS_tls_refresh_s)));
  absl::StatusOr<security::GrpcSecurity> grpc_security = security::GrpcSecurity::Create(*tls, security::Role::kWorker);
  if (!grpc_security.ok()) {
    std::cerr << "shardserve-worker: " << grpc_security.status().message() << "\n";
    return 2;
  }
  const std::string listen = absl::GetFlag(FLAGS_listen);
  if (!grpc_security->tls_enabled() && !security::IsLoopbackAddress(listen)) {
    LOG(WARNING) << "*** INSECURE: serving plaintext without authentication on " << listen
                 << ": anyone who reaches this port can assign this worker, read and write its KV cache. "
                    "Give --tls_dir (or --tls_cert/--tls_key/--tls_ca). ***";
  }
  service::WorkerMetrics metrics;
  std::unique_ptr<MetricsServer> metrics_server;
  if (const std::string m = absl::GetFlag(FLAGS_metrics_listen); !m.empty()) {
    auto started = MetricsServer::Start(m, metrics.registry());
    if (!started.ok()) {
      std::cerr << "shardserve-worker: " << started.status() << "\n";
      return 1;
    }
    metrics_server = *std::move(started);
    LOG(INFO) << "metrics at " << metrics_server->url();
  }
  service::WorkerServer server({.kind = devices->kind,
                                .cpu_ranks = devices->cpu_ranks,
                                .cpu_threads = devices->cpu_threads,
                                .cuda_devices = devices->cuda_devices,
                                .stream_buffer_bytes = static_cast<size_t>(*stream_buffer_bytes),
                                .metrics = &metrics,
                                .memory_per_device = memory_per_device,
                                .gpu_memory_utilization = gpu_memory_utilization,
                                .peer_credentials = grpc_security->InternalChannelCredentials(security::Role::kWorker),
                                .stage_spin = std::chrono::microseconds(stage_spin_us),
                                .stage_poll = std::chrono::microseconds(stage_poll_us),
                                .stage_inline = std::chrono::microseconds(stage_inline_us),
                                .step_deltas = absl::GetFlag(FLAGS_step_deltas)});
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  int port = 0;
  absl::StatusOr<std::unique_ptr<grpc::Server>> rpc_server =
      service::StartWorkerRpcServer(listen, *grpc_security, server, &port);
  if (!rpc_server.ok()) {
    std::cerr << "shardserve-worker: " << rpc_server.status().message() << "\n";
    return 1;
  }
  std::string advertise = absl::GetFlag(FLAGS_advertise);
  if (advertise.empty()) {
    std::string host = listen.substr(0, listen.rfind(':'));
    if (host == "0.0.0.0" || host == "[::]" || host.empty()) host = node;
    advertise = absl::StrCat(host, ":", port);
  }
  LOG(INFO) << "worker " << node << " serving on " << advertise
            << (grpc_security->tls_enabled() ? " (mutual TLS)" : " (plaintext)");
  v1::RegisterRequest reg;
  reg.set_node_name(node);
  reg.set_address(advertise);
  if (metrics_server != nullptr) {
    const std::string m = absl::GetFlag(FLAGS_metrics_listen);
    std::string host = m.substr(0, m.rfind(':'));
    if (host == "0.0.0.0" || host.empty()) host = node;
    reg.set_metrics_address(absl::StrCat(host, ":", metrics_server->port()));
  }
  for (const v1::Device& d : server.Devices()) *reg.add_devices() = d;
  service::Registrar registrar(coordinator, reg, [&server] { return server.Status(); },
                              grpc_security->InternalChannelCredentials(security::Role::kCoordinator));
  registrar.Start();

  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  while (!g_stop) usleep(100 * 1000);
  if (const int drain_s = absl::GetFlag(FLAGS_drain_timeout_s); g_stop == SIGTERM && drain_s > 0 &&
                                                                server.Status().state != v1::WORKER_STATE_IDLE) {
    // Drain: the coordinator moves (or lets finish) this worker's sequences, takes its stage away
    // and releases it (Worker.Release: IDLE). A second SIGTERM, or SIGINT, stops waiting; so does
    // losing the coordinator (it may be stopping too).
    g_stop = 0;
    const absl::Status st = registrar.Drain(std::chrono::seconds(drain_s));
    if (!st.ok()) {
      LOG(WARNING) << "draining this worker failed (" << st << "); stopping at once";
    } else {
      LOG(INFO) << "draining: waiting (at most " << drain_s + 10 << " s) for the coordinator to release this worker";
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(drain_s + 10);
      int unreachable = 0;
      while (!g_stop && server.Status().state != v1::WORKER_STATE_IDLE && std::chrono::steady_clock::now() < deadline &&
             unreachable < 30) {
        unreachable = registrar.connected() ? 0 : unreachable + 1;
        usleep(100 * 1000);
      }
      LOG(INFO) << (server.Status().state == v1::WORKER_STATE_IDLE ? "drained and released" : "drain not finished");
    }
  }
  LOG(INFO) << "shutting down";
  registrar.Stop();
  server.Shutdown();
  (*rpc_server)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  return 0;
}

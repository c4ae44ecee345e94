// shardserve-worker: one per node. Registers with the coordinator, receives its assignment (a
// pipeline stage), loads its slice of the weights onto its ranks, and serves the stage stream.
//
//   shardserve-worker --coordinator=HOST:PORT --listen=HOST:PORT --devices=cpu:2 --node_name=NODE
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <unistd.h>

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
#include "common/flags/parse.h"
#include "common/log/log.h"
#include "common/metrics/metrics_server.h"
#include "worker/kernels/registry.h"
#include "worker/run/run_options.h"
#include "worker/service/convert.h"
#include "worker/service/registrar.h"
#include "worker/service/worker_server.h"

ABSL_FLAG(std::string, coordinator, "", "coordinator address HOST:PORT");
ABSL_FLAG(std::string, listen, "127.0.0.1:0", "address to serve on, HOST:PORT (port 0 picks a free port)");
ABSL_FLAG(std::string, advertise, "", "address other processes reach this worker at (default: --listen's host "
                                      "with the bound port)");
ABSL_FLAG(std::string, devices, "cpu", "cpu, cpu:N, cuda:all or cuda:0,1,...");
ABSL_FLAG(int32_t, threads, 1, "BLAS threads of a single CPU rank");
ABSL_FLAG(std::string, node_name, "", "node name (default: the host name)");
ABSL_FLAG(std::string, memory_per_device, "",
          "memory each device offers the planner at most, e.g. 20GiB or 512MB (default: its free memory)");
ABSL_FLAG(double, gpu_memory_utilization, 0.9,
          "fraction of each CUDA device's memory this worker may fill (weights, workspace and the KV cache the "
          "planner sizes from what is left), in (0, 1]");
ABSL_FLAG(std::string, metrics_listen, "", "serve Prometheus metrics at http://HOST:PORT/metrics (port 0 picks one; "
                                           "empty = no metrics)");

namespace {

volatile std::sig_atomic_t g_stop = 0;
void OnSignal(int) { g_stop = 1; }

}  // namespace

int main(int argc, char** argv) {
  shardserve::SetProgramUsage("shardserve worker daemon: --coordinator=HOST:PORT --listen=HOST:PORT --devices=cpu:N");
  absl::ParseCommandLine(argc, argv);
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  using namespace shardserve;
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
                                .metrics = &metrics,
                                .memory_per_device = memory_per_device,
                                .gpu_memory_utilization = gpu_memory_utilization});
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  const std::string listen = absl::GetFlag(FLAGS_listen);
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(service::kMaxMessageBytes);
  builder.SetMaxSendMessageSize(service::kMaxMessageBytes);
  builder.RegisterService(server.worker_service());
  builder.RegisterService(server.stage_service());
  builder.RegisterService(server.expert_service());
  std::unique_ptr<grpc::Server> rpc_server = builder.BuildAndStart();
  if (rpc_server == nullptr || port == 0) {
    std::cerr << "shardserve-worker: cannot listen on " << listen << "\n";
    return 1;
  }
  std::string advertise = absl::GetFlag(FLAGS_advertise);
  if (advertise.empty()) {
    std::string host = listen.substr(0, listen.rfind(':'));
    if (host == "0.0.0.0" || host == "[::]" || host.empty()) host = node;
    advertise = absl::StrCat(host, ":", port);
  }
  LOG(INFO) << "worker " << node << " serving on " << advertise;
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
  service::Registrar registrar(coordinator, reg, [&server] { return server.Status(); });
  registrar.Start();

  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  while (!g_stop) usleep(100 * 1000);
  LOG(INFO) << "shutting down";
  registrar.Stop();
  server.Shutdown();
  rpc_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  return 0;
}

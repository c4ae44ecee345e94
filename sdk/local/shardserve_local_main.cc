// shardserve-local: a whole cluster on this machine — one coordinator and N workers as separate
// processes on 127.0.0.1 — for demos, tests and development without Kubernetes.
//
//   shardserve-local --model=DIR --workers=2 --devices_per_worker=cpu:2 [--tp --pp --replicas] [--port]
//
// Secure by default: at start it makes a throw-away certificate authority and a certificate per
// process (in a private temporary directory removed at exit), and runs every link between the
// processes with mutual TLS (workers <-> coordinator control port, coordinator -> stage 0,
// stage -> stage, expert calls). The public API listens on 127.0.0.1 only; it is plaintext unless
// --public_tls (then TLS with the same CA, whose path is printed as "tls ca: PATH"; a client
// certificate with the client and admin roles lies beside it, in ../client/tls.crt and tls.key).
// --insecure runs everything in plaintext.
//
// Waits until the cluster is ready, then prints "ready: coordinator at HOST:PORT" on a line of its
// own, then (with --metrics) one "metrics: URL" line per worker and "coordinator metrics: URL"
// (and "http: http://HOST:PORT" with --http_listen), and
// keeps running; SIGINT/SIGTERM stop every process. Exits non-zero (naming the cause) when
// the cluster cannot become ready or a process dies.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/flags/usage.h"
#include "absl/container/flat_hash_map.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/memory/host_memory.h"
#include "common/security/cert_authority.h"
#include "shardserve/client.h"

ABSL_FLAG(std::string, model, "", "model directory (config.json + safetensors [+ tokenizer])");
ABSL_FLAG(int32_t, workers, 1, "worker processes");
ABSL_FLAG(std::string, devices_per_worker, "cpu:1", "each worker's --devices (cpu:N, cuda:all, cuda:0,1)");
ABSL_FLAG(std::string, memory_per_device, "",
          "each worker's --memory_per_device: memory a device offers the planner at most (e.g. 2GiB; default: CPU "
          "ranks get an equal share of the machine's available memory across all workers, CUDA devices their free "
          "memory)");
ABSL_FLAG(double, gpu_memory_utilization, 0.9,
          "each worker's --gpu_memory_utilization: fraction of each CUDA device's memory it may fill (workers that "
          "share a device should split it)");
ABSL_FLAG(int32_t, tp, 0, "tensor-parallel ranks per stage; 0 = auto");
ABSL_FLAG(int32_t, pp, 0, "pipeline stages; 0 = auto");
ABSL_FLAG(int32_t, replicas, 0, "replicas; 0 = auto");
ABSL_FLAG(int32_t, max_seq_len, 0, "longest sequence; 0 = the model's context");
ABSL_FLAG(int32_t, max_slots, 0, "sequences per replica at once (0 = sized from the KV budget, at most 256)");
ABSL_FLAG(int32_t, max_step_tokens, 256, "tokens per step");
ABSL_FLAG(int32_t, decode_steps_per_call, 0,
          "the coordinator's --decode_steps_per_call: decode steps a 1-stage replica runs per call for plain "
          "decodes (multi-step decoding), in [0, 64]; 1 = one step per call; 0 = auto (chosen per replica from the "
          "serving overhead and the compute per step it measures)");
ABSL_FLAG(bool, overlap_decode_calls, true,
          "the coordinator's --overlap_decode_calls: on 1-stage replicas, send the next call of a batch of plain "
          "decodes while the last one runs");
ABSL_FLAG(std::string, scheduling_policy, "fcfs",
          "the coordinator's --scheduling_policy: fcfs (arrival order) or priority (requests' priority first, "
          "lower first)");
ABSL_FLAG(int32_t, pipeline_depth, 0, "micro-batches in flight per replica; 0 = auto (the coordinator's pipelining policy)");
ABSL_FLAG(int32_t, kv_block_size, 16, "tokens per KV cache block");
ABSL_FLAG(bool, prefix_caching, true, "reuse cached KV blocks of identical prompt prefixes");
ABSL_FLAG(std::string, served_model_name, "", "the coordinator's --served_model_name (the model's name in the HTTP API)");
ABSL_FLAG(std::string, tool_call_parser, "auto", "the coordinator's --tool_call_parser (hermes, llama3_json, openai, glm45 or auto)");
ABSL_FLAG(std::string, reasoning_parser, "", "the coordinator's --reasoning_parser (deepseek_r1, qwen3, gpt_oss or empty)");
ABSL_FLAG(std::string, quantize, "none",
          "the coordinator's --quantize: int8 stores the workers' linear projections and lm_head as block int8 "
          "(CPU ranks); none: the checkpoint's dtype");
ABSL_FLAG(std::string, kv_cache_dtype, "auto",
          "the coordinator's --kv_cache_dtype: auto, or fp8 / fp8_e4m3 (the workers keep the KV cache as float8 e4m3)");
ABSL_FLAG(bool, step_deltas, true, "the coordinator's and workers' --step_deltas (steps sent as deltas on the stage streams)");
ABSL_FLAG(int64_t, stage_inline_us, 1000,
          "the workers' --stage_inline_us (a micro-batch whose stage's last step took at most this long runs on the "
          "gRPC thread that read it; 0 = always the stage thread)");
ABSL_FLAG(std::string, hidden_wire_dtype, "f32",
          "the coordinator's --hidden_wire_dtype: f32 (exact) or bf16 (half the bytes per pipeline hop, each value "
          "rounded to bfloat16 once per hop)");
ABSL_FLAG(int64_t, kv_blocks, 0, "KV cache blocks per replica at most; 0 = what the KV budget holds");
ABSL_FLAG(int32_t, port, 0, "coordinator port; 0 = a free port");
ABSL_FLAG(std::string, http_listen, "",
          "serve the OpenAI-compatible HTTP API on HOST:PORT (port 0 = a free port; printed as \"http: URL\"); empty = off");
ABSL_FLAG(int32_t, http_max_connections, 512,
          "the coordinator's --http_max_connections: HTTP connections served at once (threads started on demand)");
ABSL_FLAG(int32_t, http_max_queued_connections, 1024,
          "the coordinator's --http_max_queued_connections: connections waiting for a thread");
ABSL_FLAG(int64_t, http_idle_timeout_ms, 5000, "the coordinator's --http_idle_timeout_ms");
ABSL_FLAG(int64_t, http_read_timeout_ms, 10000, "the coordinator's --http_read_timeout_ms");
ABSL_FLAG(int64_t, http_max_body_bytes, 1 << 20,
          "the coordinator's --http_max_body_bytes: larger HTTP request bodies get 413");
ABSL_FLAG(int32_t, ready_timeout_s, 300, "how long to wait for the cluster to become ready");
ABSL_FLAG(bool, metrics, true,
          "the workers and the coordinator serve Prometheus metrics on free ports (printed after the ready line: "
          "\"metrics: URL\" per worker, then \"coordinator metrics: URL\")");
ABSL_FLAG(bool, insecure, false,
          "run every link in plaintext, without the throw-away CA and mutual TLS (not recommended)");
ABSL_FLAG(bool, public_tls, false,
          "also serve the public API (gRPC, and HTTP with --http_listen) with TLS from the throw-away CA; its "
          "certificate is printed as \"tls ca: PATH\" after the ready line (clients: --tls_ca_file=PATH)");
ABSL_FLAG(std::string, bin_dir, "", "where shardserve-coordinator and shardserve-worker are (default: next to this binary)");

namespace {

// The CPU ranks of --devices=cpu:N (0 for other devices or a malformed value, which the worker
// refuses itself).
int CpuRanks(const std::string& devices) {
  int ranks = 0;
  if (!devices.starts_with("cpu:") || !absl::SimpleAtoi(devices.substr(4), &ranks) || ranks < 1) return 0;
  return ranks;
}

volatile std::sig_atomic_t g_stop = 0;
void OnSignal(int) { g_stop = 1; }

struct Child {
  std::string name;
  pid_t pid = -1;
};

pid_t Spawn(const std::vector<std::string>& argv) {
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid != 0) return pid;
  // Child: die with the launcher.
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() != parent) _exit(1);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  execv(args[0], args.data());
  std::cerr << "shardserve-local: cannot run " << argv[0] << ": " << std::strerror(errno) << "\n";
  _exit(127);
}

// The throw-away CA and one certificate directory per process under a private temporary
// directory: DIR/coordinator and DIR/worker-I, each with tls.crt, tls.key and ca.crt.
bool MakeCertificates(const std::string& dir, int workers) {
  using namespace shardserve::security;
  auto ca = CertificateAuthority::Create("shardserve-local throw-away CA", absl::Hours(24 * 30));
  if (!ca.ok()) {
    std::cerr << "shardserve-local: " << ca.status() << "\n";
    return false;
  }
  auto issue = [&](const std::string& name, Role role) {
    // The names every process is dialed by: clients of the public API check them, and gRPC's TLS
    // servers look for the name a peer sends (logging "No match found for server name" without it).
    CertificateRequest r{
        .common_name = name, .roles = {role}, .dns_names = {"localhost"}, .ip_addresses = {"127.0.0.1"}};
    r.validity = absl::Hours(24 * 30);
    auto leaf = (*ca)->Issue(r);
    absl::Status st = leaf.ok() ? WriteTlsDir(dir + "/" + name, *leaf, (*ca)->cert_pem()) : leaf.status();
    if (!st.ok()) std::cerr << "shardserve-local: " << st << "\n";
    return st.ok();
  };
  if (!issue("coordinator", Role::kCoordinator)) return false;
  // For this launcher's own readiness calls (Admin needs the admin role on a TLS port) and for
  // clients of --public_tls: DIR/client.
  {
    auto leaf = (*ca)->Issue({.common_name = "client", .roles = {Role::kClient, Role::kAdmin},
                              .validity = absl::Hours(24 * 30)});
    absl::Status st = leaf.ok() ? WriteTlsDir(dir + "/client", *leaf, (*ca)->cert_pem()) : leaf.status();
    if (!st.ok()) {
      std::cerr << "shardserve-local: " << st << "\n";
      return false;
    }
  }
  for (int i = 0; i < workers; ++i) {
    if (!issue(absl::StrCat("worker-", i), Role::kWorker)) return false;
  }
  return true;
}

// "exited with code N" or "was killed by signal N (NAME)", from a waitpid status.
std::string HowItEnded(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exited with code ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const char* name = strsignal(WTERMSIG(status));
    return absl::StrCat("was killed by signal ", WTERMSIG(status), name != nullptr ? absl::StrCat(" (", name, ")") : "");
  }
  return absl::StrCat("ended (wait status ", status, ")");
}

// Returns the name of a child that has exited (and reaps it), or empty.
std::string DeadChild(std::vector<Child>& children, int* status) {
  for (Child& c : children) {
    if (c.pid <= 0) continue;
    if (waitpid(c.pid, status, WNOHANG) == c.pid) {
      c.pid = -1;
      return c.name;
    }
  }
  return "";
}

void StopAll(std::vector<Child>& children) {
  for (const Child& c : children) {
    if (c.pid > 0) kill(c.pid, SIGTERM);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (Child& c : children) {
    while (c.pid > 0) {
      if (waitpid(c.pid, nullptr, WNOHANG) == c.pid) {
        c.pid = -1;
      } else if (std::chrono::steady_clock::now() > deadline) {
        kill(c.pid, SIGKILL);
        waitpid(c.pid, nullptr, 0);
        c.pid = -1;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  shardserve::SetProgramUsage("run a shardserve cluster on this machine: --model=DIR --workers=N --devices_per_worker=cpu:M");
  absl::ParseCommandLine(argc, argv);
  const std::string model = absl::GetFlag(FLAGS_model);
  const int workers = absl::GetFlag(FLAGS_workers);
  if (model.empty()) {
    std::cerr << "shardserve-local: --model is required\n";
    return 2;
  }
  if (workers < 1 || workers > 64) {
    std::cerr << "shardserve-local: --workers must be in [1, 64]\n";
    return 2;
  }
  std::string bin_dir = absl::GetFlag(FLAGS_bin_dir);
  if (bin_dir.empty()) {
    std::error_code ec;
    bin_dir = std::filesystem::canonical("/proc/self/exe", ec).parent_path().string();
  }
  // Every listener of the coordinator binds its own port (port 0 picks a free one) and names it in
  // --address_file: a port picked here and bound there later could be taken in between (by another
  // process's outgoing connection, say).
  const int port = absl::GetFlag(FLAGS_port);
  if (port < 0 || port > 65535) {
    std::cerr << "shardserve-local: --port must be in [0, 65535], got " << port << "\n";
    return 2;
  }
  std::string http_listen = absl::GetFlag(FLAGS_http_listen);
  if (!http_listen.empty()) {
    const size_t colon = http_listen.rfind(':');
    int http_port = -1;
    if (colon == std::string::npos || colon == 0 || !absl::SimpleAtoi(http_listen.substr(colon + 1), &http_port) ||
        http_port < 0 || http_port > 65535) {
      std::cerr << "shardserve-local: --http_listen must be HOST:PORT, got \"" << http_listen << "\"\n";
      return 2;
    }
  }
  const bool insecure = absl::GetFlag(FLAGS_insecure);
  const bool public_tls = absl::GetFlag(FLAGS_public_tls);
  if (insecure && public_tls) {
    std::cerr << "shardserve-local: --public_tls needs TLS, which --insecure turns off\n";
    return 2;
  }
  // A private directory, removed at exit: the coordinator's --address_file and, with TLS, the
  // certificates (under tls/).
  char tmpl[] = "/tmp/shardserve-local-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    std::cerr << "shardserve-local: cannot create a private temporary directory: " << std::strerror(errno) << "\n";
    return 1;
  }
  struct RemoveDir {
    std::string dir;
    ~RemoveDir() {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  } remove_run_dir{tmpl};
  const std::string run_dir = tmpl;
  const std::string address_file = run_dir + "/addresses";
  std::string tls_root;
  if (!insecure) {
    tls_root = run_dir + "/tls";
    if (!MakeCertificates(tls_root, workers)) return 1;
  }
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);

  std::vector<Child> children;
  std::vector<std::string> coordinator_argv = {
      bin_dir + "/shardserve-coordinator", absl::StrCat("--listen=127.0.0.1:", port), "--control_listen=127.0.0.1:0",
      "--address_file=" + address_file, "--model=" + model,
      absl::StrCat("--expected_workers=", workers), absl::StrCat("--tp=", absl::GetFlag(FLAGS_tp)),
      absl::StrCat("--pp=", absl::GetFlag(FLAGS_pp)), absl::StrCat("--replicas=", absl::GetFlag(FLAGS_replicas)),
      absl::StrCat("--max_seq_len=", absl::GetFlag(FLAGS_max_seq_len)),
      absl::StrCat("--max_slots=", absl::GetFlag(FLAGS_max_slots)),
      absl::StrCat("--max_step_tokens=", absl::GetFlag(FLAGS_max_step_tokens)),
      absl::StrCat("--decode_steps_per_call=", absl::GetFlag(FLAGS_decode_steps_per_call)),
      absl::StrCat("--overlap_decode_calls=", absl::GetFlag(FLAGS_overlap_decode_calls) ? "true" : "false"),
      absl::StrCat("--pipeline_depth=", absl::GetFlag(FLAGS_pipeline_depth)),
      "--scheduling_policy=" + absl::GetFlag(FLAGS_scheduling_policy),
      absl::StrCat("--kv_block_size=", absl::GetFlag(FLAGS_kv_block_size)),
      absl::StrCat("--kv_blocks=", absl::GetFlag(FLAGS_kv_blocks)),
      absl::StrCat("--prefix_caching=", absl::GetFlag(FLAGS_prefix_caching) ? "true" : "false"),
      "--quantize=" + absl::GetFlag(FLAGS_quantize),
      "--kv_cache_dtype=" + absl::GetFlag(FLAGS_kv_cache_dtype),
      "--hidden_wire_dtype=" + absl::GetFlag(FLAGS_hidden_wire_dtype),
      absl::StrCat("--step_deltas=", absl::GetFlag(FLAGS_step_deltas) ? "true" : "false")};
  if (absl::GetFlag(FLAGS_tool_call_parser) != "auto") {
    coordinator_argv.push_back("--tool_call_parser=" + absl::GetFlag(FLAGS_tool_call_parser));
  }
  if (!absl::GetFlag(FLAGS_reasoning_parser).empty()) {
    coordinator_argv.push_back("--reasoning_parser=" + absl::GetFlag(FLAGS_reasoning_parser));
  }
  if (!absl::GetFlag(FLAGS_served_model_name).empty()) {
    coordinator_argv.push_back("--served_model_name=" + absl::GetFlag(FLAGS_served_model_name));
  }
  if (absl::GetFlag(FLAGS_metrics)) coordinator_argv.push_back("--metrics_listen=127.0.0.1:0");
  if (!http_listen.empty()) coordinator_argv.push_back("--http_listen=" + http_listen);
  for (std::string flag :
       {absl::StrCat("--http_max_connections=", absl::GetFlag(FLAGS_http_max_connections)),
        absl::StrCat("--http_max_queued_connections=", absl::GetFlag(FLAGS_http_max_queued_connections)),
        absl::StrCat("--http_idle_timeout_ms=", absl::GetFlag(FLAGS_http_idle_timeout_ms)),
        absl::StrCat("--http_read_timeout_ms=", absl::GetFlag(FLAGS_http_read_timeout_ms)),
        absl::StrCat("--http_max_body_bytes=", absl::GetFlag(FLAGS_http_max_body_bytes))}) {
    coordinator_argv.push_back(std::move(flag));
  }
  if (!insecure) {
    coordinator_argv.push_back("--tls_dir=" + tls_root + "/coordinator");
    if (!public_tls) coordinator_argv.push_back("--public_plaintext");
  }
  // CPU workers share this machine's memory (its cgroup's, in a container), and each alone would
  // offer its ranks all that is available (the planner would count it once per worker, and place
  // more than fits): unless --memory_per_device says otherwise, every rank of every worker is
  // offered an equal share.
  std::string memory_per_device = absl::GetFlag(FLAGS_memory_per_device);
  const int cpu_ranks = CpuRanks(absl::GetFlag(FLAGS_devices_per_worker));
  if (memory_per_device.empty() && cpu_ranks > 0 && workers > 1) {
    absl::StatusOr<shardserve::HostMemory> host = shardserve::QueryHostMemory();
    if (host.ok() && host->free_bytes > 0) {
      memory_per_device = absl::StrCat(host->free_bytes / (int64_t{workers} * cpu_ranks));
    }
  }
  children.push_back({"coordinator", Spawn(coordinator_argv)});
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(absl::GetFlag(FLAGS_ready_timeout_s));
  int status = 0;
  // The coordinator's addresses: "api", "control" and, when served, "metrics" and "http".
  absl::flat_hash_map<std::string, std::string> addresses;
  while (!addresses.contains("control")) {
    if (g_stop) {
      StopAll(children);
      return 0;
    }
    if (std::string dead = DeadChild(children, &status); !dead.empty()) {
      std::cerr << "shardserve-local: " << dead << " " << HowItEnded(status) << " before the cluster was ready\n";
      StopAll(children);
      return 1;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      std::cerr << "shardserve-local: the coordinator did not start serving within "
                << absl::GetFlag(FLAGS_ready_timeout_s) << " s\n";
      StopAll(children);
      return 1;
    }
    std::ifstream in(address_file);
    for (std::string name, value; in >> name >> value;) addresses[name] = value;
    if (!addresses.contains("control")) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const std::string address = addresses["api"];
  const std::string control_address = addresses["control"];
  for (int i = 0; i < workers; ++i) {
    std::vector<std::string> worker_argv = {bin_dir + "/shardserve-worker", "--coordinator=" + control_address,
                                            "--listen=127.0.0.1:0",
                                            "--devices=" + absl::GetFlag(FLAGS_devices_per_worker),
                                            absl::StrCat("--node_name=local-", i),
                                            // Stopping stops every process: nothing to drain to.
                                            "--drain_timeout_s=0",
                                            absl::StrCat("--step_deltas=", absl::GetFlag(FLAGS_step_deltas) ? "true" : "false"),
                                            absl::StrCat("--stage_inline_us=", absl::GetFlag(FLAGS_stage_inline_us))};
    if (absl::GetFlag(FLAGS_metrics)) worker_argv.push_back("--metrics_listen=127.0.0.1:0");
    if (!memory_per_device.empty()) worker_argv.push_back("--memory_per_device=" + memory_per_device);
    worker_argv.push_back(absl::StrCat("--gpu_memory_utilization=", absl::GetFlag(FLAGS_gpu_memory_utilization)));
    if (!insecure) worker_argv.push_back(absl::StrCat("--tls_dir=", tls_root, "/worker-", i));
    children.push_back({absl::StrCat("worker ", i), Spawn(worker_argv)});
  }
  shardserve::ClientOptions client_options{.timeout = std::chrono::seconds(5)};
  if (public_tls) {
    auto read = [](const std::string& path) {
      std::ifstream in(path);
      std::stringstream s;
      s << in.rdbuf();
      return s.str();
    };
    client_options.tls = {.enabled = true,
                          .root_certs = read(tls_root + "/client/ca.crt"),
                          .client_cert = read(tls_root + "/client/tls.crt"),
                          .client_key = read(tls_root + "/client/tls.key"),
                          .server_name = "localhost"};
  }
  auto client = shardserve::Client::Connect(address, client_options);
  if (!client.ok()) {
    std::cerr << "shardserve-local: " << client.status() << "\n";
    StopAll(children);
    return 1;
  }
  std::string last_reason = "the coordinator did not answer";
  bool ready = false;
  while (!g_stop && !ready) {
    if (std::string dead = DeadChild(children, &status); !dead.empty()) {
      std::cerr << "shardserve-local: " << dead << " " << HowItEnded(status) << " before the cluster was ready\n";
      StopAll(children);
      return 1;
    }
    auto info = (*client)->ClusterStatus();
    if (info.ok()) {
      ready = info->ready;
      last_reason = info->reason;
      for (const auto& w : info->workers) {
        if (w.state == "failed") {
          std::cerr << "shardserve-local: worker " << w.worker_id << " (" << w.node_name << ") failed: " << w.error << "\n";
          StopAll(children);
          return 1;
        }
      }
    }
    if (ready) break;
    if (std::chrono::steady_clock::now() > deadline) {
      std::cerr << "shardserve-local: the cluster was not ready after " << absl::GetFlag(FLAGS_ready_timeout_s)
                << " s: " << last_reason << "\n";
      StopAll(children);
      return 1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  if (ready) {
    std::cout << "ready: coordinator at " << address << std::endl;
    if (addresses.contains("http")) std::cout << "http: http://" << addresses["http"] << std::endl;
    if (public_tls) std::cout << "tls ca: " << tls_root << "/coordinator/ca.crt" << std::endl;
    if (auto info = (*client)->ClusterStatus(); info.ok()) {
      for (const auto& w : info->workers) {
        if (!w.metrics_address.empty()) std::cout << "metrics: http://" << w.metrics_address << "/metrics" << std::endl;
      }
    }
    if (addresses.contains("metrics")) {
      std::cout << "coordinator metrics: http://" << addresses["metrics"] << "/metrics" << std::endl;
    }
  }
  // Once serving, a worker that exits is only reported: the coordinator moves its sequences to the
  // replicas left (as it would on a cluster of machines). The cluster stops when the coordinator
  // or every worker has exited.
  while (!g_stop) {
    if (std::string dead = DeadChild(children, &status); !dead.empty()) {
      const bool coordinator_gone = children.front().pid <= 0;
      const bool workers_gone = std::all_of(children.begin() + 1, children.end(), [](const Child& c) { return c.pid <= 0; });
      if (coordinator_gone || workers_gone) {
        std::cerr << "shardserve-local: " << dead << " " << HowItEnded(status) << "; stopping the cluster\n";
        StopAll(children);
        return 1;
      }
      std::cerr << "shardserve-local: " << dead << " " << HowItEnded(status)
                << "; the coordinator serves on with the workers left\n";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  StopAll(children);
  return 0;
}

// shardserve-coordinator: one per cluster. Waits for --expected_workers workers to register, plans
// the placement, assigns stages, and serves the public API once the cluster is ready.
//
//   shardserve-coordinator --listen=127.0.0.1:7000 --control_listen=127.0.0.1:7001 --model=DIR --expected_workers=2
//                          [--tls_dir=DIR | --tls_cert=PEM --tls_key=PEM --tls_ca=PEM]
//
// Clients use --listen; workers register on --control_listen (their --coordinator).
//
// SIGINT / SIGTERM: stop planning, fail outstanding requests with UNAVAILABLE "shutting down",
// and shut the server down within --shutdown_timeout_ms.
#include <pthread.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "common/flags/usage.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/concurrency/abseil_mutex.h"
#include "common/log/log.h"
#include "common/security/tls_files.h"
#include "coordinator/server/coordinator.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:7000",
          "public API address (Inference, Admin), HOST:PORT (port 0 picks a free port)");
ABSL_FLAG(std::string, control_listen, "127.0.0.1:7001",
          "control-plane address workers register on (their --coordinator), HOST:PORT (port 0 picks a free port)");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain of the coordinator (its URI SAN spiffe://shardserve/coordinator; DNS/IP SANs for "
          "the names clients use)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA certificate(s) of the cluster: workers and client certificates chain to it");
ABSL_FLAG(std::string, tls_dir, "", "directory with tls.crt, tls.key and ca.crt (a Kubernetes TLS Secret); "
                                    "instead of --tls_cert/--tls_key/--tls_ca");
ABSL_FLAG(bool, public_plaintext, false,
          "with TLS: serve the public API (--listen, --http_listen) in plaintext all the same, the control plane "
          "and the links to the workers keeping mutual TLS; only for loopback addresses (shardserve-local)");
ABSL_FLAG(std::string, api_keys_file, "",
          "API keys of the public API (gRPC and HTTP), one per line: NAME user|admin sha256:HEX [rps=R] [burst=B] "
          "[concurrency=C]; empty = no authentication");
ABSL_FLAG(int32_t, tls_refresh_s, 10, "re-read the TLS files this often (seconds): rotated certificates are used "
                                      "by new connections without a restart");
ABSL_FLAG(std::string, model, "", "model directory (config.json, tokenizer files), as the workers also see it");
ABSL_FLAG(int32_t, expected_workers, 1, "plan once this many workers have registered");
ABSL_FLAG(int32_t, tp, 0, "tensor-parallel ranks per stage; 0 = planner's choice");
ABSL_FLAG(int32_t, pp, 0, "pipeline stages per replica; 0 = planner's choice");
ABSL_FLAG(int32_t, replicas, 0, "data-parallel replicas; 0 = as many as fit");
ABSL_FLAG(int64_t, max_seq_len, 0, "tokens per sequence (prompt + output); 0 = the model's max_position_embeddings");
ABSL_FLAG(int32_t, max_slots, 0,
          "running sequences per replica at once (the KV cache may hold fewer); 0 = as many whole contexts as the "
          "replica's KV budget holds, at most 256");
ABSL_FLAG(int32_t, kv_block_size, 16, "tokens per KV cache block, in [1, 65536]");
ABSL_FLAG(int64_t, kv_blocks, 0,
          "KV cache blocks per replica at most (0 = what the KV budget holds); when full, the newest sequences "
          "are preempted and recomputed later");
ABSL_FLAG(int32_t, max_step_tokens, 256, "tokens per micro-batch (prefill chunk budget)");
ABSL_FLAG(bool, overlap_decode_calls, true,
          "overlapped decode calls (asynchronous scheduling) on 1-stage replicas: the next call of a batch of plain "
          "decodes is sent while the last one runs, and the worker feeds each sequence the token it sampled for it "
          "there, so the worker does not idle for the round trip and the scheduler's work between two calls "
          "(workers that do not announce it get ordinary calls)");
ABSL_FLAG(std::string, scheduling_policy, "fcfs",
          "how each replica orders waiting requests and chooses whom to preempt: fcfs (arrival order; a request's "
          "priority must be 0) or priority (a request's priority first, lower values first, then arrival order)");
ABSL_FLAG(int32_t, decode_steps_per_call, 0,
          "multi-step decoding, in [0, 64]: decode steps a 1-stage replica runs per call for a batch of "
          "plain decodes (no penalties, logit_bias, structured output, logprobs or active min_tokens), "
          "feeding each sampled token into the next step itself; tokens past a stop are dropped. "
          "1 = one step per call; 0 = auto: each replica chooses up to 16 from the serving overhead per call "
          "and the compute per step it measures, so that the overhead is at most a quarter of a call's compute "
          "and a call computes at most 20 ms (`shardserve status` says what it chose and why)");
ABSL_FLAG(int64_t, max_queued, 1024, "requests waiting for a slot; beyond it Generate fails with RESOURCE_EXHAUSTED");
ABSL_FLAG(int32_t, pipeline_depth, 0,
          "micro-batches in flight per replica (pipelining); 0 = auto: up to its number of stages, split per step "
          "where a cost model of its stages (device kinds, machines) predicts a gain (`shardserve status` says "
          "why), 1 = one at a time");
ABSL_FLAG(bool, prefix_caching, true,
          "keep full KV cache blocks after their sequences end and reuse them for later requests that start "
          "with the same tokens (their prefill skips those blocks)");
ABSL_FLAG(int64_t, heartbeat_interval_ms, 1000, "heartbeat interval workers are told to use");
ABSL_FLAG(int64_t, heartbeat_timeout_ms, 5000, "a worker silent this long is dead");
ABSL_FLAG(int64_t, assign_timeout_ms, 10000, "deadline of Worker.Assign calls");
ABSL_FLAG(int64_t, step_timeout_ms, 60000,
          "bound on one micro-batch round trip to a replica; a step past it breaks the pipeline like a dead worker");
ABSL_FLAG(int64_t, answer_spin_us, 0,
          "microseconds a replica's step thread polls for its answer before it sleeps (saves a thread wake-up per "
          "step where cores are free; 0 = sleep at once), in [0, 100000]");
ABSL_FLAG(int64_t, answer_poll_us, 1000,
          "the longest a replica's step thread polls per wait for an answer the last round trips say is due: it "
          "sleeps until shortly before, then polls, so that the answer finds its core awake (at most a quarter of a "
          "typical round trip; none for round trips under 300 us; 0 = sleep at once), in [0, 100000]");
ABSL_FLAG(bool, step_deltas, true,
          "send each step to stage 0 as deltas (only what changed of a running sequence, against a table per "
          "stream) when the worker supports them; false = every micro-batch in full");
ABSL_FLAG(int64_t, recovery_timeout_ms, 60000,
          "requests whose replica broke, with no other replica to take them, wait this long for its worker to "
          "come back or a spare worker to take its stage, then are recomputed (0 = fail them at once)");
ABSL_FLAG(int64_t, shutdown_timeout_ms, 5000, "on SIGINT/SIGTERM, cancel calls still running after this");
ABSL_FLAG(std::string, metrics_listen, "",
          "serve Prometheus metrics at http://HOST:PORT/metrics (port 0 picks one; empty = no metrics)");
ABSL_FLAG(std::string, served_model_name, "",
          "the model's name in the HTTP API (/v1/models and replies); empty = the model directory's last component");
ABSL_FLAG(std::string, tool_call_parser, "auto",
          "how the model writes tool calls in chat: hermes (<tool_call>{...}</tool_call>, Qwen2.5), llama3_json "
          "({\"name\": ..., \"parameters\": ...}, Llama 3.x), openai (harmony messages to functions.NAME, GPT-OSS), "
          "glm45 (<tool_call>NAME <arg_key>/<arg_value> pairs, GLM-4.5), or auto (detected from the chat template)");
ABSL_FLAG(std::string, reasoning_parser, "",
          "a reasoning model's format: deepseek_r1 or qwen3 (also glm45) split each chat answer into the model's reasoning "
          "(<think>...</think>, message.reasoning_content) and its content, gpt_oss reads GPT-OSS's harmony "
          "channels (analysis: reasoning; final: content); empty = answers as they are, except that a harmony "
          "chat template's channels are always read");
ABSL_FLAG(std::string, quantize, "none",
          "int8: workers store the linear projections and lm_head as block int8 (64 weights per scale) on "
          "backends that take it (CPU); none: the checkpoint's dtype");
ABSL_FLAG(std::string, kv_cache_dtype, "auto",
          "how workers keep the KV cache: auto (the checkpoint's bf16/f16 on GPUs, f32 on CPU ranks) or fp8 / "
          "fp8_e4m3 (1 byte per element, no scale: values saturate at +-448; twice auto's tokens on GPUs, "
          "four times on CPU ranks); not for multi-head latent attention (DeepSeek)");
ABSL_FLAG(std::string, hidden_wire_dtype, "f32",
          "how the stages send hidden states to the next stage (and rows to the hosts of spilled experts): f32 "
          "(exact: a pipeline computes what one process does) or bf16 (half the bytes per hop, each value rounded "
          "to bfloat16 once per hop); a change is taken without reloading the weights");
ABSL_FLAG(std::string, address_file, "",
          "once serving, write the addresses bound here, one \"api|control|metrics|http HOST:PORT\" line each "
          "(written whole, by rename): how a launcher that passed port 0 learns them; empty = none");
ABSL_FLAG(std::string, http_listen, "",
          "OpenAI-compatible HTTP API address HOST:PORT (port 0 picks a free port); empty = off");

// Limits that keep slow, idle or hostile clients from stalling the servers (README "Limits").
ABSL_FLAG(int32_t, http_max_connections, 512,
          "HTTP API and metrics: connections served at once (one thread each, started on demand; a streamed "
          "request holds its connection's thread)");
ABSL_FLAG(int32_t, http_max_queued_connections, 1024,
          "HTTP API and metrics: accepted connections waiting for a thread; beyond, accepting pauses");
ABSL_FLAG(int64_t, http_idle_timeout_ms, 5000,
          "HTTP: close a connection that sends no request for this long (rounded up to seconds)");
ABSL_FLAG(int64_t, http_read_timeout_ms, 10000, "HTTP: bound on each read of a request");
ABSL_FLAG(int64_t, http_write_timeout_ms, 30000, "HTTP: bound on each write of a reply");
ABSL_FLAG(int32_t, http_max_requests_per_connection, 100, "HTTP: requests per keep-alive connection");
ABSL_FLAG(int64_t, http_max_body_bytes, 1 << 20,
          "HTTP API: larger request bodies get 413 (Content-Length or chunked; never buffered past the cap)");
ABSL_FLAG(int64_t, grpc_keepalive_time_ms, 60000, "gRPC servers: ping a connection after this long without activity");
ABSL_FLAG(int64_t, grpc_keepalive_timeout_ms, 20000, "gRPC servers: close it when the ping is not answered in time");
ABSL_FLAG(int64_t, grpc_min_client_ping_interval_ms, 10000,
          "gRPC servers: clients pinging more often (without data) are sent GOAWAY");
ABSL_FLAG(int64_t, grpc_max_connection_idle_ms, 300000, "gRPC servers: close connections without calls this long; 0 = never");
ABSL_FLAG(int64_t, grpc_max_connection_age_ms, 0,
          "gRPC servers: tell connections older than this to reconnect; 0 = never (long generations and streams "
          "live on one connection)");
ABSL_FLAG(int64_t, grpc_max_connection_age_grace_ms, 0,
          "gRPC servers: cancel calls still running this long after max_connection_age; 0 = never");

namespace {

// --address_file: the addresses bound, written to PATH.tmp and renamed, so that a reader sees the
// whole file or none.
absl::Status WriteAddressFile(const std::string& path, const shardserve::coordinator::Coordinator& c) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << "api " << c.address() << "\ncontrol " << c.control_address() << "\n";
    if (!c.metrics_address().empty()) out << "metrics " << c.metrics_address() << "\n";
    if (!c.http_address().empty()) out << "http " << c.http_address() << "\n";
    out.close();
    if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot rename ", tmp, " to ", path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  shardserve::UseReleaseAbseilMutexes();  // gRPC locks absl::Mutexes on every message
  shardserve::SetProgramUsage(
      "shardserve coordinator: --listen=HOST:PORT --model=DIR --expected_workers=N [--tp --pp --replicas ...]");
  const std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  if (rest.size() > 1) {
    std::cerr << "shardserve-coordinator: unexpected argument \"" << rest[1] << "\"\n";
    return 2;
  }
  using namespace shardserve::coordinator;
  CoordinatorOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.control_listen = absl::GetFlag(FLAGS_control_listen);
  auto tls = shardserve::security::TlsOptionsFromFlags(absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                                                       absl::GetFlag(FLAGS_tls_ca), absl::GetFlag(FLAGS_tls_dir));
  if (!tls.ok()) {
    std::cerr << "shardserve-coordinator: " << tls.status().message() << "\n";
    return 2;
  }
  options.tls = *tls;
  options.public_plaintext = absl::GetFlag(FLAGS_public_plaintext);
  options.api_keys_file = absl::GetFlag(FLAGS_api_keys_file);
  if (options.tls.has_value()) {
    options.tls->refresh_interval = absl::Seconds(std::max(1, absl::GetFlag(FLAGS_tls_refresh_s)));
  }
  options.model_path = absl::GetFlag(FLAGS_model);
  options.expected_workers = absl::GetFlag(FLAGS_expected_workers);
  options.tp = absl::GetFlag(FLAGS_tp);
  options.pp = absl::GetFlag(FLAGS_pp);
  options.replicas = absl::GetFlag(FLAGS_replicas);
  options.max_seq_len = absl::GetFlag(FLAGS_max_seq_len);
  options.max_slots = absl::GetFlag(FLAGS_max_slots);
  options.kv_block_size = absl::GetFlag(FLAGS_kv_block_size);
  options.max_kv_blocks = absl::GetFlag(FLAGS_kv_blocks);
  options.max_step_tokens = absl::GetFlag(FLAGS_max_step_tokens);
  options.decode_steps_per_call = absl::GetFlag(FLAGS_decode_steps_per_call);
  options.overlap_decode_calls = absl::GetFlag(FLAGS_overlap_decode_calls);
  if (std::optional<SchedulingPolicy> policy = ParseSchedulingPolicy(absl::GetFlag(FLAGS_scheduling_policy))) {
    options.scheduling_policy = *policy;
  } else {
    std::cerr << "shardserve-coordinator: --scheduling_policy must be fcfs or priority, got \""
              << absl::GetFlag(FLAGS_scheduling_policy) << "\"\n";
    return 2;
  }
  options.max_queued = absl::GetFlag(FLAGS_max_queued);
  options.pipeline_depth = absl::GetFlag(FLAGS_pipeline_depth);
  options.prefix_caching = absl::GetFlag(FLAGS_prefix_caching);
  options.heartbeat_interval = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_interval_ms));
  options.heartbeat_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_timeout_ms));
  options.assign_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_assign_timeout_ms));
  options.step_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_step_timeout_ms));
  options.answer_spin = absl::Microseconds(absl::GetFlag(FLAGS_answer_spin_us));
  options.answer_poll = absl::Microseconds(absl::GetFlag(FLAGS_answer_poll_us));
  options.step_deltas = absl::GetFlag(FLAGS_step_deltas);
  options.recovery_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_recovery_timeout_ms));
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options.http_listen = absl::GetFlag(FLAGS_http_listen);
  options.served_model_name = absl::GetFlag(FLAGS_served_model_name);
  options.tool_call_parser = absl::GetFlag(FLAGS_tool_call_parser);
  options.reasoning_parser = absl::GetFlag(FLAGS_reasoning_parser);
  options.http_limits = {.max_threads = absl::GetFlag(FLAGS_http_max_connections),
                         .max_queued = absl::GetFlag(FLAGS_http_max_queued_connections),
                         .idle_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_http_idle_timeout_ms)),
                         .read_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_http_read_timeout_ms)),
                         .write_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_http_write_timeout_ms)),
                         .max_requests_per_connection = absl::GetFlag(FLAGS_http_max_requests_per_connection)};
  options.http_max_body_bytes = static_cast<size_t>(std::max<int64_t>(0, absl::GetFlag(FLAGS_http_max_body_bytes)));
  options.grpc_limits = {
      .keepalive_time = absl::Milliseconds(absl::GetFlag(FLAGS_grpc_keepalive_time_ms)),
      .keepalive_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_grpc_keepalive_timeout_ms)),
      .min_client_ping_interval = absl::Milliseconds(absl::GetFlag(FLAGS_grpc_min_client_ping_interval_ms)),
      .max_connection_idle = absl::Milliseconds(absl::GetFlag(FLAGS_grpc_max_connection_idle_ms)),
      .max_connection_age = absl::Milliseconds(absl::GetFlag(FLAGS_grpc_max_connection_age_ms)),
      .max_connection_age_grace = absl::Milliseconds(absl::GetFlag(FLAGS_grpc_max_connection_age_grace_ms))};
  if (absl::StatusOr<shardserve::Quantization> q = shardserve::ParseQuantization(absl::GetFlag(FLAGS_quantize));
      q.ok()) {
    options.quantize = *q;
  } else {
    std::cerr << "shardserve-coordinator: --quantize: " << q.status().message() << "\n";
    return 2;
  }
  if (absl::StatusOr<shardserve::KvCacheFormat> kv =
          shardserve::ParseKvCacheFormat(absl::GetFlag(FLAGS_kv_cache_dtype));
      kv.ok()) {
    options.kv_cache = *kv;
  } else {
    std::cerr << "shardserve-coordinator: --kv_cache_dtype: " << kv.status().message() << "\n";
    return 2;
  }
  if (absl::StatusOr<shardserve::DType> wire = shardserve::ParseHiddenWireDtype(absl::GetFlag(FLAGS_hidden_wire_dtype));
      wire.ok()) {
    options.hidden_wire_dtype = *wire;
  } else {
    std::cerr << "shardserve-coordinator: --hidden_wire_dtype: " << wire.status().message() << "\n";
    return 2;
  }
  const absl::Duration shutdown_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_shutdown_timeout_ms));

  // Block the stop signals in every thread (threads inherit the mask), then wait for them here.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  // A client that closes its HTTP connection mid-write must not kill the process.
  std::signal(SIGPIPE, SIG_IGN);

  absl::StatusOr<std::unique_ptr<Coordinator>> coordinator = Coordinator::Start(options);
  if (!coordinator.ok()) {
    std::cerr << "shardserve-coordinator: " << coordinator.status() << "\n";
    return 1;
  }
  if (const std::string path = absl::GetFlag(FLAGS_address_file); !path.empty()) {
    if (absl::Status st = WriteAddressFile(path, **coordinator); !st.ok()) {
      std::cerr << "shardserve-coordinator: --address_file: " << st.message() << "\n";
      (*coordinator)->Shutdown(shutdown_timeout);
      return 1;
    }
  }
  int signal = 0;
  sigwait(&stop_signals, &signal);
  LOG(INFO) << "signal " << signal << ": shutting down";
  (*coordinator)->Shutdown(shutdown_timeout);
  coordinator->reset();
  LOG(INFO) << "coordinator stopped";
  return 0;
}

// shardserve: the command-line client of a shardserve cluster.
//
//   shardserve generate --server=HOST:PORT --prompt "TEXT" --max_tokens 32 --temperature 0
//   shardserve generate --server=HOST:PORT --prompt_ids 1,2,3 --print_ids
//   shardserve status   --server=HOST:PORT
//   shardserve drain    WORKER --server=HOST:PORT [--drain_timeout_s=60] [--wait=true]
//   (generate, status, drain, bench: --tls_ca_file, --tls_cert_file/--tls_key_file, --bearer_token_file)
//   shardserve plan     --model=DIR --workers=a=cpu:2x8GiB,b=cpu:2x8GiB [--tp --pp --replicas] [--explain] [--json]
//   shardserve bench    --server=HOST:PORT --concurrency 16 --requests 200 --max_tokens 64 [--json]
//   shardserve simulate --model=DIR --workers=n*4=cuda:8x80GiB --rate=100 [--fail=n-0@30] [--sweep --slo=...]
#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "common/flags/usage.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/flags/parse.h"
#include "common/log/log.h"
#include "common/model_spec/model_spec.h"
#include "common/plan/plan.h"
#include "coordinator/planner/planner.h"
#include "coordinator/sim/device_profile.h"
#include "coordinator/sim/report.h"
#include "coordinator/sim/simulator.h"
#include "coordinator/sim/sweep.h"
#include "coordinator/sim/workload.h"
#include "sdk/cli/bench.h"
#include "sdk/cli/cli_parse.h"
#include "sdk/cli/plan_explain.h"
#include "shardserve/client.h"

ABSL_FLAG(std::string, server, "127.0.0.1:7000", "coordinator address HOST:PORT");
ABSL_FLAG(std::string, prompt, "", "prompt text");
ABSL_FLAG(std::string, prompt_ids, "", "prompt token ids, comma-separated, used exactly as given");
ABSL_FLAG(bool, print_ids, false, "print only the generated ids, comma-separated, on one line");
ABSL_FLAG(int32_t, max_tokens, 64, "tokens to generate");
ABSL_FLAG(int32_t, n, 1,
          "generate: independent choices of the prompt (1..16; choice i samples with --seed + i), printed one "
          "per line in choice order after they all end");
ABSL_FLAG(double, temperature, 0.0, "sampling temperature; 0 = greedy");
ABSL_FLAG(int32_t, top_k, 0, "sample from the k most likely tokens; 0 = all");
ABSL_FLAG(double, top_p, 1.0, "nucleus sampling threshold in (0, 1]");
ABSL_FLAG(uint64_t, seed, 0, "sampling seed");
ABSL_FLAG(bool, ignore_eos, false, "do not stop at the model's EOS tokens");
ABSL_FLAG(double, presence_penalty, 0.0, "subtracted once from the logit of every token generated so far; [-2, 2]");
ABSL_FLAG(double, frequency_penalty, 0.0,
          "subtracted from a token's logit once per time it was generated so far; [-2, 2]");
ABSL_FLAG(double, repetition_penalty, 1.0,
          "divides the positive (multiplies the negative) logits of tokens in the prompt or generated; (0, 2]");
ABSL_FLAG(int32_t, priority, 0,
          "generate: the request's scheduling rank on a coordinator with --scheduling_policy=priority (lower "
          "first); must be 0 otherwise");
ABSL_FLAG(std::string, stop, "",
          "generate: a text stop string: the output ends before it (needs a model with a tokenizer); several, or "
          "one starting with '[', as a JSON list of strings: --stop='[\"\\n\\n\", \"END\"]'; empty = none");
ABSL_FLAG(std::string, bad_words, "",
          "generate: comma-separated words the output never holds (vLLM's bad_words; needs a model with a "
          "tokenizer); words with commas as a JSON list of strings: --bad_words='[\"a, b\", \"c\"]'");
ABSL_FLAG(int32_t, timeout_s, 600, "deadline of each call, seconds");
ABSL_FLAG(int32_t, max_resumes, 10,
          "generate: resumes in a row without a new token when the stream breaks with UNAVAILABLE after tokens "
          "arrived (a coordinator restart, a replica failure), 0..100; 0 = never resume");
ABSL_FLAG(int32_t, drain_timeout_s, 60,
          "drain: how long the worker's requests may run on when no other replica can take them");
ABSL_FLAG(bool, wait, true, "drain: wait until the worker is released (idle), at most --drain_timeout_s + 30 s");
ABSL_FLAG(bool, tls, false, "connect with TLS (implied by any --tls_* file)");
ABSL_FLAG(std::string, tls_ca_file, "", "PEM CA certificates to trust; default: the system's roots");
ABSL_FLAG(std::string, tls_cert_file, "", "PEM client certificate chain for mutual TLS (with --tls_key_file)");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file");
ABSL_FLAG(std::string, tls_server_name, "", "name to check the server's certificate against; default: the host");
ABSL_FLAG(std::string, bearer_token_file, "", "file holding a token sent as 'authorization: Bearer TOKEN'");
ABSL_FLAG(std::string, model, "", "plan: model directory (config.json)");
ABSL_FLAG(std::string, workers, "", "plan: workers as NAME=KIND:COUNTxSIZE,... (e.g. a=cuda:8x80GiB)");
ABSL_FLAG(int32_t, tp, 0, "plan: tensor-parallel ranks per stage; 0 = auto");
ABSL_FLAG(int32_t, pp, 0, "plan: pipeline stages; 0 = auto");
ABSL_FLAG(int32_t, replicas, 0, "plan: replicas; 0 = auto");
ABSL_FLAG(bool, explain, false,
          "plan: also print why: every layout the planner evaluated, its per-rank memory and why it was chosen or not");
ABSL_FLAG(int64_t, max_seq_len, 0, "plan: longest sequence; 0 = the model's context");
ABSL_FLAG(int32_t, concurrency, 1, "bench: clients sending back to back, or (with --rate) requests in flight at most");
ABSL_FLAG(int64_t, requests, 0, "bench: requests to send; 0 = until --duration_s");
ABSL_FLAG(double, duration_s, 0, "bench: stop sending after this many seconds; 0 = until --requests are sent");
ABSL_FLAG(double, rate, 0, "bench: open loop, mean requests per second (Poisson arrivals); 0 = closed loop");
ABSL_FLAG(std::string, prompt_tokens, "32", "bench: prompt length in tokens, N or MIN:MAX (uniform)");
ABSL_FLAG(std::string, output_tokens, "", "bench: max_tokens per request as MIN:MAX (uniform); default --max_tokens");
ABSL_FLAG(int32_t, prompt_vocab, 256, "bench: prompt ids are drawn from [1, prompt_vocab)");
ABSL_FLAG(int32_t, shared_prefix_tokens, 0,
          "bench: tokens every prompt starts with (the same for all requests and runs, like a system prompt), "
          "before its own --prompt_tokens");
ABSL_FLAG(bool, json, false, "plan (with the explanation), bench, simulate: print the summary as one JSON object instead of a table");
ABSL_FLAG(std::string, trace, "", "simulate: workload file, one 'ARRIVAL_SECONDS PROMPT_TOKENS OUTPUT_TOKENS' per line");
ABSL_FLAG(std::string, fail, "", "simulate: worker failures as WORKER@SECONDS,...");
ABSL_FLAG(bool, sweep, false, "simulate: try layouts and print the cheapest that meets --slo");
ABSL_FLAG(std::string, slo, "", "simulate --sweep: bounds, e.g. ttft_p99=500ms,itl_p99=50ms,e2e_p99=20s");
ABSL_FLAG(int32_t, max_pp, 8, "simulate --sweep: largest pipeline depth to try");
ABSL_FLAG(std::string, gpu, "h100", "simulate: device profile of CUDA workers (h100, h200, a100, l40s)");
ABSL_FLAG(std::string, network, "ib", "simulate: link between workers (ib, eth, loopback)");
ABSL_FLAG(double, hop_overhead_us, 100, "simulate: software cost of one stage hop, microseconds");
ABSL_FLAG(double, cpu_bandwidth_gbs, 30,
          "simulate: CPU workers' read bandwidth per rank, GB/s (measure it: shardserve-bench-cpu-profile)");
ABSL_FLAG(double, cpu_gflops, 110,
          "simulate: CPU workers' GEMM rate per rank on weights in cache, GFLOP/s (a CPU op takes its reads plus its "
          "arithmetic; measure it: shardserve-bench-cpu-profile)");
ABSL_FLAG(double, cpu_memory_parallelism, 1.3,
          "simulate: how much more CPU stages of one machine read together than one alone (>= 1; measure it: "
          "tests/bench/sim_calibration.py)");
ABSL_FLAG(double, cpu_compute_parallelism, std::numeric_limits<double>::infinity(),
          "simulate: how much more CPU stages of one machine compute together than one alone (>= 1; inf: each "
          "its own cores)");
ABSL_FLAG(bool, one_machine, false,
          "simulate: every worker of --workers runs on one machine (as shardserve-local runs them), so that their "
          "CPU stages share its memory bus and cores");
ABSL_FLAG(double, cpu_layer_overhead_us, 20, "simulate: CPU fixed cost per layer, microseconds");
ABSL_FLAG(double, cpu_step_overhead_us, 300, "simulate: CPU fixed cost per step and stage, microseconds");
ABSL_FLAG(double, gpu_memory_utilization, 0.9,
          "simulate: fraction of each GPU's memory the worker offers the planner (as shardserve-worker)");
ABSL_FLAG(int32_t, max_slots, 256, "simulate: running sequences per replica (shardserve-coordinator --max_slots)");
ABSL_FLAG(int32_t, kv_block_size, 16, "simulate: tokens per KV cache block");
ABSL_FLAG(std::string, kv_cache_dtype, "auto",
          "plan, simulate: how the workers keep the KV cache (the coordinator's --kv_cache_dtype): auto or fp8");
ABSL_FLAG(int32_t, max_step_tokens, 2048, "simulate: tokens per micro-batch (prefill chunk budget)");
ABSL_FLAG(int32_t, decode_steps_per_call, 0,
          "simulate: decode steps a 1-stage replica runs per call for eligible decode batches; 0 = auto, as the "
          "coordinator (from the simulated serving overhead and compute per step); 1 = one step per call");
ABSL_FLAG(int32_t, pipeline_depth, 0, "simulate: micro-batches in flight per replica; 0 = auto, as the coordinator (up to its stage count, split per step by the pipelining policy)");
ABSL_FLAG(int64_t, max_queued, 100000, "simulate: waiting requests over all replicas before refusing more");

namespace shardserve {
namespace {

// The contents of the file a flag names ("" when the flag is empty).
absl::StatusOr<std::string> ReadFlagFile(const std::string& path, const char* flag) {
  if (path.empty()) return std::string();
  std::ifstream f(path, std::ios::binary);
  std::stringstream contents;
  contents << f.rdbuf();
  if (!f || contents.str().empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, ": cannot read \"", path, "\" (or it is empty)"));
  }
  return contents.str();
}

absl::StatusOr<std::unique_ptr<Client>> Connect() {
  ClientOptions o{.timeout = std::chrono::seconds(std::max(1, absl::GetFlag(FLAGS_timeout_s)))};
  auto ca = ReadFlagFile(absl::GetFlag(FLAGS_tls_ca_file), "tls_ca_file");
  auto cert = ReadFlagFile(absl::GetFlag(FLAGS_tls_cert_file), "tls_cert_file");
  auto key = ReadFlagFile(absl::GetFlag(FLAGS_tls_key_file), "tls_key_file");
  auto token = ReadFlagFile(absl::GetFlag(FLAGS_bearer_token_file), "bearer_token_file");
  for (const auto* r : {&ca, &cert, &key, &token}) {
    if (!r->ok()) return r->status();
  }
  o.tls = {.root_certs = *ca, .client_cert = *cert, .client_key = *key,
           .server_name = absl::GetFlag(FLAGS_tls_server_name)};
  o.tls.enabled = absl::GetFlag(FLAGS_tls) || !o.tls.root_certs.empty() || !o.tls.client_cert.empty() ||
                  !o.tls.client_key.empty() || !o.tls.server_name.empty();
  o.bearer_token = std::string(absl::StripAsciiWhitespace(*token));
  o.retry.max_resumes = absl::GetFlag(FLAGS_max_resumes);
  return Client::Connect(absl::GetFlag(FLAGS_server), std::move(o));
}

absl::Status GenerateCommand() {
  const std::string text = absl::GetFlag(FLAGS_prompt);
  const std::string ids = absl::GetFlag(FLAGS_prompt_ids);
  if (text.empty() == ids.empty()) return absl::InvalidArgumentError("give exactly one of --prompt and --prompt_ids");
  Prompt prompt = Prompt::Text(text);
  if (!ids.empty()) {
    auto parsed = ParseTokenIdList(ids, "--prompt_ids");
    if (!parsed.ok()) return parsed.status();
    prompt = Prompt::Ids(*parsed);
  }
  GenerateOptions o{.max_tokens = absl::GetFlag(FLAGS_max_tokens),
                    .temperature = static_cast<float>(absl::GetFlag(FLAGS_temperature)),
                    .top_k = absl::GetFlag(FLAGS_top_k),
                    .top_p = static_cast<float>(absl::GetFlag(FLAGS_top_p)),
                    .seed = absl::GetFlag(FLAGS_seed),
                    .ignore_eos = absl::GetFlag(FLAGS_ignore_eos),
                    .presence_penalty = static_cast<float>(absl::GetFlag(FLAGS_presence_penalty)),
                    .frequency_penalty = static_cast<float>(absl::GetFlag(FLAGS_frequency_penalty)),
                    .repetition_penalty = static_cast<float>(absl::GetFlag(FLAGS_repetition_penalty)),
                    .n = absl::GetFlag(FLAGS_n)};
  o.priority = absl::GetFlag(FLAGS_priority);
  absl::StatusOr<std::vector<std::string>> stop =
      cli::ParseTextList(absl::GetFlag(FLAGS_stop), "--stop", cli::PlainText::kOne);
  if (!stop.ok()) return stop.status();
  o.stop = *std::move(stop);
  absl::StatusOr<std::vector<std::string>> bad_words =
      cli::ParseTextList(absl::GetFlag(FLAGS_bad_words), "--bad_words", cli::PlainText::kCommaSeparated);
  if (!bad_words.ok()) return bad_words.status();
  o.bad_words = *std::move(bad_words);
  auto client = Connect();
  if (!client.ok()) return client.status();
  const bool print_ids = absl::GetFlag(FLAGS_print_ids);
  if (o.n != 1) {
    // Several choices: each printed whole, one per line (its text or ids), with its finish reason.
    absl::StatusOr<std::vector<GenerateResult>> choices = (*client)->GenerateChoices(prompt, o);
    if (!choices.ok()) return choices.status();
    for (size_t i = 0; i < choices->size(); ++i) {
      const GenerateResult& c = (*choices)[i];
      std::cout << (print_ids ? absl::StrJoin(c.token_ids, ",") : c.text) << "\n";
      std::cerr << "choice " << i << " finish_reason: " << c.finish_reason << "\n";
    }
    return absl::OkStatus();
  }
  std::vector<int32_t> all;
  std::string finish;
  std::unique_ptr<GenerateStream> stream = (*client)->StartGenerate(prompt, o);
  for (const GenerateDelta& d : *stream) {
    // Streamed as they come, ids too (the line is the same as printed at once).
    for (int32_t id : d.token_ids) {
      if (print_ids) std::cout << (all.empty() ? "" : ",") << id;
      all.push_back(id);
    }
    if (!print_ids) std::cout << d.text;
    std::cout << std::flush;
    if (d.finished) finish = d.finish_reason;
  }
  if (!stream->status().ok()) {
    if (!all.empty()) std::cout << "\n";  // end the partial line
    return stream->status();
  }
  if (print_ids) {
    std::cout << "\n";
  } else {
    std::cout << "\n";
    std::cerr << "finish_reason: " << finish << "\n";
  }
  return absl::OkStatus();
}

absl::Status StatusCommand() {
  auto client = Connect();
  if (!client.ok()) return client.status();
  auto info = (*client)->ClusterStatus();
  if (!info.ok()) return info.status();
  std::cout << "cluster: " << (info->ready ? "ready" : "not ready") << (info->reason.empty() ? "" : " (" + info->reason + ")")
            << "\nmodel: " << info->model_path << "\nsequences: " << info->running_sequences << " running, "
            << info->waiting_sequences << " waiting\n";
  for (const std::string& line : info->pipelining) std::cout << "pipelining: " << line << "\n";
  for (const std::string& line : info->decode_steps) std::cout << "decode steps per call: " << line << "\n";
  if (!info->scheduling_policy.empty()) std::cout << "scheduling: " << info->scheduling_policy << "\n";
  std::cout << "\n";
  std::vector<std::vector<std::string>> rows = {{"WORKER", "NODE", "ADDRESS", "STATE", "DEVICES", "ASSIGNMENT", "ERROR"}};
  for (const WorkerInfo& w : info->workers) {
    rows.push_back({w.worker_id, w.node_name, w.address, w.state, w.devices, w.assignment, w.error});
  }
  std::vector<size_t> width(rows[0].size(), 0);
  for (const auto& r : rows) {
    for (size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
  }
  for (const auto& r : rows) {
    for (size_t i = 0; i < r.size(); ++i) {
      std::cout << r[i] << (i + 1 < r.size() ? std::string(width[i] - r[i].size() + 2, ' ') : "");
    }
    std::cout << "\n";
  }
  if (info->total_workers > static_cast<int64_t>(info->workers.size())) {
    std::cout << "(" << info->total_workers - static_cast<int64_t>(info->workers.size())
              << " more workers not listed: the coordinator lists live workers first, one page at most)\n";
  }
  if (!info->plan.empty()) std::cout << "\n" << info->plan << "\n";
  return absl::OkStatus();
}

absl::Status DrainCommand(const std::string& worker_id) {
  if (worker_id.empty()) return absl::InvalidArgumentError("usage: shardserve drain WORKER_ID --server=HOST:PORT");
  const int timeout_s = absl::GetFlag(FLAGS_drain_timeout_s);
  if (timeout_s < 1) return absl::InvalidArgumentError(absl::StrCat("--drain_timeout_s must be >= 1, got ", timeout_s));
  auto client = Connect();
  if (!client.ok()) return client.status();
  if (absl::Status st = (*client)->DrainWorker(worker_id, std::chrono::seconds(timeout_s)); !st.ok()) return st;
  std::cout << "draining worker " << worker_id << std::endl;
  if (!absl::GetFlag(FLAGS_wait)) return absl::OkStatus();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s + 30);
  std::string last;
  while (std::chrono::steady_clock::now() < deadline) {
    auto info = (*client)->ClusterStatus();
    if (!info.ok()) return info.status();
    const WorkerInfo* w = nullptr;
    for (const WorkerInfo& x : info->workers) w = x.worker_id == worker_id ? &x : w;
    if (w == nullptr || w->state == "dead") {
      std::cout << "worker " << worker_id << " is gone" << std::endl;
      return absl::OkStatus();
    }
    if (w->state == "idle" && w->assignment.empty()) {
      std::cout << "worker " << worker_id << " drained: it holds nothing and may be stopped" << std::endl;
      return absl::OkStatus();
    }
    last = w->state;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("worker ", worker_id, " was not released within ", timeout_s + 30, " s (it is ", last, ")"));
}

absl::Status BenchCommand() {
  cli::BenchOptions o;
  o.concurrency = absl::GetFlag(FLAGS_concurrency);
  o.requests = absl::GetFlag(FLAGS_requests);
  o.duration_s = absl::GetFlag(FLAGS_duration_s);
  o.rate = absl::GetFlag(FLAGS_rate);
  o.prompt_vocab = absl::GetFlag(FLAGS_prompt_vocab);
  o.shared_prefix_tokens = absl::GetFlag(FLAGS_shared_prefix_tokens);
  o.temperature = static_cast<float>(absl::GetFlag(FLAGS_temperature));
  o.seed = absl::GetFlag(FLAGS_seed);
  o.progress = true;  // on stderr: the summary (or --json) on stdout stays clean
  auto prompt = cli::ParseLengthRange(absl::GetFlag(FLAGS_prompt_tokens), "--prompt_tokens");
  if (!prompt.ok()) return prompt.status();
  o.prompt_tokens = *prompt;
  const std::string output = absl::GetFlag(FLAGS_output_tokens);
  auto out = cli::ParseLengthRange(output.empty() ? absl::StrCat(absl::GetFlag(FLAGS_max_tokens)) : output,
                                   output.empty() ? "--max_tokens" : "--output_tokens");
  if (!out.ok()) return out.status();
  o.output_tokens = *out;
  if (absl::Status st = o.Validate(); !st.ok()) return st;
  auto client = Connect();
  if (!client.ok()) return client.status();
  auto summary = cli::RunBench(**client, o);
  if (!summary.ok()) return summary.status();
  std::cout << (absl::GetFlag(FLAGS_json) ? cli::ToJson(*summary) + "\n" : cli::ToTable(*summary)) << std::flush;
  return absl::OkStatus();
}

// --kv_cache_dtype, parsed; InvalidArgument naming the flag.
absl::StatusOr<KvCacheFormat> KvCacheFormatFlag() {
  absl::StatusOr<KvCacheFormat> f = ParseKvCacheFormat(absl::GetFlag(FLAGS_kv_cache_dtype));
  if (!f.ok()) return absl::InvalidArgumentError(absl::StrCat("--kv_cache_dtype: ", f.status().message()));
  return f;
}

absl::Status PlanCommand() {
  if (absl::GetFlag(FLAGS_model).empty()) return absl::InvalidArgumentError("plan needs --model");
  auto spec = LoadModelSpec(absl::GetFlag(FLAGS_model));
  if (!spec.ok()) return spec.status();
  auto workers = cli::ParseWorkers(absl::GetFlag(FLAGS_workers));
  if (!workers.ok()) return workers.status();
  PlanPolicy policy;
  policy.tp = absl::GetFlag(FLAGS_tp);
  policy.pp = absl::GetFlag(FLAGS_pp);
  policy.replicas = absl::GetFlag(FLAGS_replicas);
  policy.max_seq_len = absl::GetFlag(FLAGS_max_seq_len);
  auto kv_cache = KvCacheFormatFlag();
  if (!kv_cache.ok()) return kv_cache.status();
  policy.kv_cache = *kv_cache;
  const bool json = absl::GetFlag(FLAGS_json);
  if (absl::GetFlag(FLAGS_explain) || json) {
    // The explanation carries MakePlan's own result: one search, one answer.
    auto ex = ExplainPlan(*spec, *workers, policy);
    if (!ex.ok()) return ex.status();
    if (json) {
      std::cout << cli::ExplanationToJson(*ex) << "\n";
      return ex->plan.status();
    }
    if (ex->plan.ok()) std::cout << PlanToString(*ex->plan) << "\n";
    std::cout << cli::ExplanationToText(*ex);
    return ex->plan.status();
  }
  auto plan = MakePlan(*spec, *workers, policy);
  if (!plan.ok()) return plan.status();
  std::cout << PlanToString(*plan) << "\n";
  return absl::OkStatus();
}

absl::Status SimulateCommand() {
  // The real scheduler logs every replica it adds and every sequence that fails over; in a
  // simulation those are results (reported below), not news: keep stderr for errors.
  FLAGS_minloglevel = google::GLOG_ERROR;
  if (absl::GetFlag(FLAGS_model).empty()) return absl::InvalidArgumentError("simulate needs --model");
  auto spec = LoadModelSpec(absl::GetFlag(FLAGS_model));
  if (!spec.ok()) return spec.status();
  auto workers = cli::ParseWorkers(absl::GetFlag(FLAGS_workers));
  if (!workers.ok()) return workers.status();
  // What a GPU worker offers the planner: its memory less what --gpu_memory_utilization keeps back.
  const double util = absl::GetFlag(FLAGS_gpu_memory_utilization);
  if (!(util > 0 && util <= 1)) return absl::InvalidArgumentError("--gpu_memory_utilization must be in (0, 1]");
  for (WorkerInventory& w : *workers) {
    for (Device& d : w.devices) {
      if (d.kind == DeviceKind::kCuda) d.free_bytes = static_cast<int64_t>(static_cast<double>(d.total_bytes) * util);
    }
  }
  // The workload.
  std::vector<sim::SimRequest> workload;
  if (!absl::GetFlag(FLAGS_trace).empty()) {
    auto text = ReadFlagFile(absl::GetFlag(FLAGS_trace), "trace");
    if (!text.ok()) return text.status();
    auto trace = sim::ParseTrace(*text);
    if (!trace.ok()) return trace.status();
    workload = *std::move(trace);
  } else {
    auto prompt = cli::ParseLengthRange(absl::GetFlag(FLAGS_prompt_tokens), "--prompt_tokens");
    if (!prompt.ok()) return prompt.status();
    const std::string output = absl::GetFlag(FLAGS_output_tokens);
    auto out = cli::ParseLengthRange(output.empty() ? absl::StrCat(absl::GetFlag(FLAGS_max_tokens)) : output,
                                     output.empty() ? "--max_tokens" : "--output_tokens");
    if (!out.ok()) return out.status();
    const bool closed = absl::GetFlag(FLAGS_rate) <= 0;
    if (closed && absl::GetFlag(FLAGS_requests) <= 0) {
      return absl::InvalidArgumentError(
          "simulate needs --rate (open loop), --trace, or --requests with --concurrency (closed loop)");
    }
    // Closed loop: the arrival times drawn here are ignored (SimOptions::closed_loop_clients).
    auto poisson = sim::MakePoissonWorkload({.rate = closed ? 1.0 : absl::GetFlag(FLAGS_rate),
                                             .duration_s = absl::GetFlag(FLAGS_duration_s) > 0
                                                               ? absl::GetFlag(FLAGS_duration_s)
                                                               : 60.0,
                                             .requests = absl::GetFlag(FLAGS_requests),
                                             .prompt_tokens = {prompt->min, prompt->max},
                                             .output_tokens = {out->min, out->max},
                                             .seed = absl::GetFlag(FLAGS_seed) == 0 ? 1 : absl::GetFlag(FLAGS_seed)});
    if (!poisson.ok()) return poisson.status();
    workload = *std::move(poisson);
  }
  if (workload.empty()) return absl::InvalidArgumentError("the workload has no requests");
  // The simulated cluster.
  sim::SimOptions o;
  o.policy.tp = absl::GetFlag(FLAGS_tp);
  o.policy.pp = absl::GetFlag(FLAGS_pp);
  o.policy.replicas = absl::GetFlag(FLAGS_replicas);
  o.policy.max_seq_len = absl::GetFlag(FLAGS_max_seq_len);
  auto kv_cache = KvCacheFormatFlag();
  if (!kv_cache.ok()) return kv_cache.status();
  o.policy.kv_cache = *kv_cache;
  o.max_slots = absl::GetFlag(FLAGS_max_slots);
  o.kv_block_size = absl::GetFlag(FLAGS_kv_block_size);
  o.max_step_tokens = absl::GetFlag(FLAGS_max_step_tokens);
  o.pipeline_depth = absl::GetFlag(FLAGS_pipeline_depth);
  o.decode_steps_per_call = absl::GetFlag(FLAGS_decode_steps_per_call);
  o.max_queued = absl::GetFlag(FLAGS_max_queued);
  if (absl::GetFlag(FLAGS_trace).empty() && absl::GetFlag(FLAGS_rate) <= 0) {
    o.closed_loop_clients = std::max(1, absl::GetFlag(FLAGS_concurrency));
  }
  auto gpu = sim::GpuProfile(absl::GetFlag(FLAGS_gpu));
  if (!gpu.ok()) return gpu.status();
  o.gpu = *gpu;
  auto network = sim::NetworkProfile(absl::GetFlag(FLAGS_network));
  if (!network.ok()) return network.status();
  o.network = *network;
  o.hop_overhead_s = absl::GetFlag(FLAGS_hop_overhead_us) * 1e-6;
  o.cpu = sim::CpuProfile(absl::GetFlag(FLAGS_cpu_bandwidth_gbs) * 1e9, absl::GetFlag(FLAGS_cpu_gflops) * 1e9,
                          absl::GetFlag(FLAGS_cpu_layer_overhead_us) * 1e-6,
                          absl::GetFlag(FLAGS_cpu_step_overhead_us) * 1e-6);
  o.cpu_parallelism = {.memory = absl::GetFlag(FLAGS_cpu_memory_parallelism),
                       .compute = absl::GetFlag(FLAGS_cpu_compute_parallelism)};
  if (absl::GetFlag(FLAGS_one_machine)) {
    for (WorkerInventory& w : *workers) w.node_name = "one-machine";
  }
  auto faults = cli::ParseFaults(absl::GetFlag(FLAGS_fail));
  if (!faults.ok()) return faults.status();
  for (const cli::FaultSpec& f : *faults) o.faults.push_back({.worker = f.worker, .at_s = f.at_s});
  const bool json = absl::GetFlag(FLAGS_json);
  if (absl::GetFlag(FLAGS_sweep)) {
    auto slo = sim::ParseSlo(absl::GetFlag(FLAGS_slo));
    if (!slo.ok()) return slo.status();
    auto sweep = sim::Sweep(*spec, *workers, workload, o, *slo, {.max_pp = absl::GetFlag(FLAGS_max_pp)});
    if (!sweep.ok()) return sweep.status();
    std::cout << (json ? sim::SweepToJson(*sweep, *slo) + "\n" : sim::SweepToTable(*sweep, *slo)) << std::flush;
    return absl::OkStatus();
  }
  auto result = sim::Simulate(*spec, *workers, workload, o);
  if (!result.ok()) return result.status();
  std::cout << (json ? sim::ResultToJson(*result) + "\n" : sim::ResultToTable(*result)) << std::flush;
  return absl::OkStatus();
}

}  // namespace
}  // namespace shardserve

int main(int argc, char** argv) {
  shardserve::SetProgramUsage(
      "shardserve generate|status|drain|plan|bench|simulate [flags]\n"
      "  generate --server=HOST:PORT --prompt \"TEXT\" --max_tokens N --temperature 0\n"
      "  status   --server=HOST:PORT\n"
      "  drain    WORKER --server=HOST:PORT [--drain_timeout_s=60] [--wait=true]\n"
      "  (generate, status, drain, bench: --tls_ca_file=PEM [--tls_cert_file --tls_key_file] --bearer_token_file=FILE)\n"
      "  plan     --model=DIR --workers=a=cpu:2x8GiB,b=cuda:8x80GiB [--tp --pp --replicas] [--explain] [--json]\n"
      "  bench    --server=HOST:PORT --concurrency N (--requests N | --duration_s S) [--rate R]\n"
      "           [--prompt_tokens N|MIN:MAX] [--shared_prefix_tokens N] [--max_tokens N | --output_tokens MIN:MAX] [--json]\n"
      "  simulate --model=DIR --workers=n*4=cuda:8x80GiB (--rate R [--requests N | --duration_s S] | --trace FILE |\n"
      "           --concurrency N --requests N)\n"
      "           [--prompt_tokens --output_tokens] [--gpu h100] [--fail WORKER@S,...] [--sweep --slo ttft_p99=500ms] [--json]");
  if (argc >= 2 && std::string_view(argv[1]).starts_with("--help")) {
    absl::ParseCommandLine(argc, argv);  // prints the usage and the flags, and exits
  }
  if (argc < 2 || argv[1][0] == '-') {
    std::cerr << "usage: shardserve generate|status|drain|plan|bench|simulate [flags] (--help for the flags)\n";
    return 2;
  }
  const std::string command = argv[1];
  std::vector<char*> args = {argv[0]};
  for (int i = 2; i < argc; ++i) args.push_back(argv[i]);
  const std::vector<char*> rest = absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  const bool positional = command == "drain";  // shardserve drain WORKER
  if (rest.size() > (positional ? 2u : 1u)) {
    std::cerr << "shardserve: unexpected argument \"" << rest[1] << "\"\n";
    return 2;
  }
  absl::Status st;
  if (command == "generate") st = shardserve::GenerateCommand();
  else if (command == "status") st = shardserve::StatusCommand();
  else if (command == "drain") st = shardserve::DrainCommand(rest.size() > 1 ? rest[1] : "");
  else if (command == "plan") st = shardserve::PlanCommand();
  else if (command == "bench") st = shardserve::BenchCommand();
  else if (command == "simulate") st = shardserve::SimulateCommand();
  else {
    std::cerr << "shardserve: unknown command \"" << command << "\" (generate, status, drain, plan, bench, simulate)\n";
    return 2;
  }
  if (!st.ok()) {
    std::cerr << "shardserve " << command << ": " << st << "\n";
    return 1;
  }
  return 0;
}

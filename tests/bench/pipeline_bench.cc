// The cost of a pipeline hop, measured in one run on this machine:
//   * a bare gRPC bidirectional-stream round trip (echo service) with a decode-sized message
//     (one token's hidden state) and with a prefill-sized one;
//   * the same model decoded in one process and as 2 pipeline stages (two worker servers on
//     127.0.0.1, stage 0 forwarding hidden states to stage 1 over its stream);
// and prints the per-hop overhead beside the bare round trip and the stage compute time, and PP=2
// decode tokens/s as a fraction of one process; then the same 2 stages driven by the coordinator's
// replica client, with the answers relayed through stage 0 and with the last stage answering on its
// return stream (direct answers, stage.proto). The per-hop overhead is the pipeline's step time
// minus what the two stages report as their own compute (their step-time metrics) over the same
// steps, so that run-to-run changes in compute speed do not count as hop cost; the median of
// several rounds is printed. Everything over gRPC runs twice in the same run: plaintext, and with
// mutual TLS on every link (certificates from a throw-away CA, as shardserve-local makes them);
// it prints the TLS cost per hop and the TLS handshakes per decode step (zero: the streams are
// long-lived).
// With --json the lines above go to stderr and stdout gets one JSON object of the same figures
// (tests/gpu/hop.sh records it on a GPU machine's idle cores).
// Usage: shardserve-bench-pipeline [--model=DIR] [--tokens=64] [--json]   (default: the generated 100M model)
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <optional>
#include <thread>
#include <unistd.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "common/concurrency/abseil_mutex.h"
#include "coordinator/client/grpc_replica_client.h"
#include "common/model_spec/model_spec.h"
#include "common/safetensors/safetensors.h"
#include "common/security/cert_authority.h"
#include "common/security/grpc_security.h"
#include "nlohmann/json.hpp"
#include "shardserve/v1/stage.grpc.pb.h"
#include "tests/testing/alloc_counter.h"
#include "tests/testing/random_model.h"
#include "worker/engine/executor.h"
#include "worker/service/convert.h"
#include "worker/service/worker_metrics.h"
#include "worker/service/worker_server.h"

ABSL_FLAG(std::string, model, "", "model directory; empty = the generated 100M model in --scratch");
ABSL_FLAG(std::string, scratch, "/tmp/shardserve-100m", "where the 100M model is generated");
ABSL_FLAG(bool, bf16, false, "generate the 100M model with BF16 weights (use another --scratch)");
ABSL_FLAG(int32_t, tokens, 64, "decode tokens to time");
ABSL_FLAG(int32_t, stage_spin_us, 0, "how long an idle stage thread polls for the next micro-batch (WorkerOptions::stage_spin)");
ABSL_FLAG(int32_t, stage_poll_us, 1000, "the longest an idle stage thread polls per wait for a micro-batch that is due (WorkerOptions::stage_poll)");
ABSL_FLAG(int32_t, stage_inline_us, 1000, "a micro-batch whose stage's last step took at most this long runs on the gRPC thread that read it (WorkerOptions::stage_inline; 0 = always the stage thread)");
ABSL_FLAG(int32_t, answer_poll_us, 1000, "the longest the replica client polls per wait for an answer that is due (GrpcReplicaClient answer_poll)");
ABSL_FLAG(int32_t, answer_spin_us, 0, "how long the replica client polls for an answer (GrpcReplicaClient answer_spin)");
ABSL_FLAG(bool, json, false, "print the figures as one JSON object on stdout (the readable lines go to stderr)");
ABSL_FLAG(bool, write_model_only, false, "write the 100M model into --scratch and exit (for serving_bench.py)");

namespace shardserve {
namespace {

// Sum of the step-time histogram of a worker's metrics (seconds its stage spent computing).
double StepSeconds(const service::WorkerMetrics& m) {
  double sum = 0;
  for (const prometheus::MetricFamily& f : m.registry()->Collect()) {
    if (f.name != "shardserve_worker_step_seconds") continue;
    for (const prometheus::ClientMetric& c : f.metric) sum += c.histogram.sample_sum;
  }
  return sum;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Answers every request with an empty response: the bare cost of a round trip.
class EchoStage final : public v1::Stage::CallbackService {
  class Reactor final : public grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse> {
   public:
    Reactor() { StartRead(&req_); }
    void OnReadDone(bool ok) override {
      if (!ok) {
        Finish(grpc::Status::OK);
        return;
      }
      resp_.set_step_id(req_.step_id());
      StartWrite(&resp_);
    }
    void OnWriteDone(bool ok) override {
      if (ok) {
        StartRead(&req_);
      } else {
        Finish(grpc::Status::OK);
      }
    }
    void OnDone() override { delete this; }

   private:
    v1::StepRequest req_;
    v1::StepResponse resp_;
  };

 public:
  grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>* StepStream(grpc::CallbackServerContext*) override {
    return new Reactor();
  }
};

// Like EchoStage, but the answer is written by another thread (as a worker's stage thread
// answers): the round trip a stage cannot beat without computing on gRPC's own threads.
class HandOffEchoStage final : public v1::Stage::CallbackService {
  class Reactor final : public grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse> {
   public:
    Reactor() {
      thread_ = std::thread([this] {
        std::unique_lock lock(mu_);
        while (true) {
          cv_.wait(lock, [&] { return pending_ || stop_; });
          if (stop_) return;
          pending_ = false;
          lock.unlock();
          StartWrite(&resp_);
          lock.lock();
        }
      });
      StartRead(&req_);
    }
    void OnReadDone(bool ok) override {
      if (!ok) {
        Finish(grpc::Status::OK);
        return;
      }
      resp_.set_step_id(req_.step_id());
      std::lock_guard lock(mu_);
      pending_ = true;
      cv_.notify_one();
    }
    void OnWriteDone(bool ok) override {
      if (ok) {
        StartRead(&req_);
      } else {
        Finish(grpc::Status::OK);
      }
    }
    void OnDone() override {
      {
        std::lock_guard lock(mu_);
        stop_ = true;
        cv_.notify_one();
      }
      thread_.join();
      delete this;
    }

   private:
    v1::StepRequest req_;
    v1::StepResponse resp_;
    std::mutex mu_;
    std::condition_variable cv_;
    bool pending_ = false, stop_ = false;
    std::thread thread_;
  };

 public:
  grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>* StepStream(grpc::CallbackServerContext*) override {
    return new Reactor();
  }
};

std::unique_ptr<grpc::Server> Serve(grpc::Service* a, grpc::Service* b, int* port,
                                    const security::GrpcSecurity& sec) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0",
                           sec.InternalServerCredentials({security::Role::kCoordinator, security::Role::kWorker}), port);
  builder.SetMaxReceiveMessageSize(service::kMaxMessageBytes);
  builder.RegisterService(a);
  if (b != nullptr) builder.RegisterService(b);
  return builder.BuildAndStart();
}

// Mean round trip (s) of `payload` bytes of hidden states on a bidi stream; with `gap`, each round
// trip starts that long after the last (the gap itself is not timed). `allocations`, if given, gets
// the heap allocations per round trip of the whole process (both ends).
double EchoRoundTrip(v1::Stage::Stub& stub, size_t payload, int iters,
                     std::chrono::duration<double> gap = std::chrono::duration<double>(0),
                     double* allocations = nullptr) {
  grpc::ClientContext ctx;
  auto stream = stub.StepStream(&ctx);
  v1::StepRequest req;
  req.mutable_hidden()->set_data(std::string(payload, 'x'));
  v1::StepResponse resp;
  for (int i = 0; i < 20; ++i) {
    stream->Write(req);
    stream->Read(&resp);
  }
  double busy = 0;
  const uint64_t allocations_before = testing::ProcessAllocations();
  for (int i = 0; i < iters; ++i) {
    if (gap.count() > 0) std::this_thread::sleep_for(gap);
    const double t0 = Now();
    req.set_step_id(static_cast<uint64_t>(i));
    stream->Write(req);
    stream->Read(&resp);
    busy += Now() - t0;
  }
  const double dt = busy / iters;
  if (allocations != nullptr) {
    *allocations = static_cast<double>(testing::ProcessAllocations() - allocations_before) / iters;
  }
  stream->WritesDone();
  (void)stream->Finish();
  return dt;
}

// KV blocks of 16 tokens for the one sequence of the benchmark: up to 2048 positions.
constexpr int kBenchBlocks = 128;

v1::StepRequest DecodeStep(uint64_t id, int pos, int32_t token) {
  v1::StepRequest r;
  r.set_step_id(id);
  v1::StepSequence* s = r.add_sequences();
  for (int b = 0; b <= pos / 16; ++b) s->add_block_ids(b);  // block b holds positions [16 b, 16 b + 16)
  s->set_pos_begin(pos);
  s->set_num_tokens(1);
  s->add_token_ids(token);
  s->set_sample(true);
  s->set_sample_index(static_cast<uint64_t>(pos));
  return r;
}

v1::Assignment Stage(const std::string& model, int stage, int begin, int end, const std::string& next) {
  v1::Assignment a;
  a.set_assignment_id(absl::StrCat("bench-", stage));
  a.set_model_path(model);
  a.set_stage(stage);
  a.set_layer_begin(begin);
  a.set_layer_end(end);
  a.set_device_kind(v1::DEVICE_KIND_CPU);
  a.add_devices(0);
  a.set_kv_blocks(kBenchBlocks);
  a.set_kv_block_size(16);
  a.set_max_step_tokens(16);
  a.set_next_address(next);
  return a;
}

int Run() {
  FILE* const text = absl::GetFlag(FLAGS_json) ? stderr : stdout;
  std::string dir = absl::GetFlag(FLAGS_model);
  if (dir.empty()) {
    dir = absl::GetFlag(FLAGS_scratch);
    if (!std::filesystem::exists(dir + "/model.safetensors")) {
      std::fprintf(text, "writing the 100M model to %s ...\n", dir.c_str());
      if (auto st = testing::WriteRandomLlama(dir, testing::HundredMModel(absl::GetFlag(FLAGS_bf16)), 1234); !st.ok()) return 1;
    }
    if (absl::GetFlag(FLAGS_write_model_only)) return 0;
  }
  auto spec = LoadModelSpec(dir);
  if (!spec.ok()) {
    std::fprintf(stderr, "%s\n", spec.status().ToString().c_str());
    return 1;
  }
  const int tokens = absl::GetFlag(FLAGS_tokens);
  if (tokens < 1 || tokens + 4 > kBenchBlocks * 16) {
    std::fprintf(stderr, "--tokens must be in [1, %d]\n", kBenchBlocks * 16 - 4);
    return 1;
  }
  const size_t decode_bytes = static_cast<size_t>(spec->hidden_size) * 4;
  const size_t prefill_bytes = 256 * decode_bytes;

  // The two transports: plaintext, and mutual TLS with a throw-away CA (the worker certificate
  // serves and dials; the client of stage 0 presents the coordinator's).
  const std::string tls_dir = absl::StrCat("/tmp/shardserve-bench-tls-", getpid());
  auto ca = security::CertificateAuthority::Create("bench CA");
  if (!ca.ok()) return 1;
  security::GrpcSecurity plaintext;
  std::optional<security::GrpcSecurity> worker_tls, coordinator_tls;
  for (auto [name, role] : {std::pair{"worker", security::Role::kWorker}, {"coordinator", security::Role::kCoordinator}}) {
    auto leaf = (*ca)->Issue({.common_name = name, .roles = {role}, .dns_names = {"localhost"},
                              .ip_addresses = {"127.0.0.1"}});  // its links dial 127.0.0.1
    if (!leaf.ok() || !security::WriteTlsDir(absl::StrCat(tls_dir, "/", name), *leaf, (*ca)->cert_pem()).ok()) return 1;
    const std::string d = absl::StrCat(tls_dir, "/", name);
    auto sec = security::GrpcSecurity::Create(
        security::TlsOptions{.cert_file = d + "/tls.crt", .key_file = d + "/tls.key", .ca_file = d + "/ca.crt"}, role);
    if (!sec.ok()) {
      std::fprintf(stderr, "%s\n", sec.status().ToString().c_str());
      return 1;
    }
    (role == security::Role::kWorker ? worker_tls : coordinator_tls) = *std::move(sec);
  }
  struct Transport {
    const char* name;
    const security::GrpcSecurity* worker;
    const security::GrpcSecurity* client;
  };
  const Transport transports[] = {{"plaintext", &plaintext, &plaintext}, {"mTLS", &*worker_tls, &*coordinator_tls}};

  // 1. One process (first: its step time sets the idle gap of the bare round trips below).
  auto ckpt = Checkpoint::Open(dir);
  engine::ExecutorOptions eo;
  eo.model.num_kv_blocks = (spec->max_position_embeddings + 15) / 16;  // one sequence of the whole context
  auto one = engine::TpExecutor::Create(*spec, **ckpt, eo);
  if (!one.ok()) {
    std::fprintf(stderr, "%s\n", one.status().ToString().c_str());
    return 1;
  }
  int32_t tok = 1;
  double t0 = 0;
  for (int i = 0; i < tokens + 4; ++i) {
    if (i == 4) t0 = Now();
    auto r = (*one)->Step({engine::StepSequence{.block_ids = engine::WholeContextBlocks((*one)->options(), 0), .pos_begin = i,
                                                .tokens = {tok}}});
    const auto& l = r->logits[0];
    tok = static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
  }
  const double step_one = (Now() - t0) / tokens;
  one->reset();

  // 2. Bare round trips, both transports served at once and timed in interleaved rounds (medians).
  // Back to back, and after an idle gap as long as half a one-process step (what a stage computes
  // between its messages): the peer's threads have gone to sleep, as a stage's peers have.
  const auto gap = std::chrono::duration<double>(step_one / 2);
  double rtt_decode[2], rtt_prefill[2], rtt_handoff[2], rtt_idle[2];
  double rtt_allocs[2];  // heap allocations per bare round trip (decode-sized, both ends)
  {
    EchoStage echo[2];
    HandOffEchoStage handoff[2];
    std::unique_ptr<grpc::Server> servers[4];
    std::unique_ptr<v1::Stage::Stub> echo_stub[2], handoff_stub[2];
    for (int t = 0; t < 2; ++t) {
      const Transport& tr = transports[t];
      int port = 0;
      servers[2 * t] = Serve(&echo[t], nullptr, &port, *tr.worker);
      echo_stub[t] = v1::Stage::NewStub(grpc::CreateChannel(
          absl::StrCat("127.0.0.1:", port), tr.client->InternalChannelCredentials(security::Role::kWorker)));
      servers[2 * t + 1] = Serve(&handoff[t], nullptr, &port, *tr.worker);
      handoff_stub[t] = v1::Stage::NewStub(grpc::CreateChannel(
          absl::StrCat("127.0.0.1:", port), tr.client->InternalChannelCredentials(security::Role::kWorker)));
    }
    std::vector<double> d[2], f[2], h[2], g[2], a[2];
    for (int r = 0; r < 5; ++r) {
      for (int t = 0; t < 2; ++t) {
        d[t].push_back(EchoRoundTrip(*echo_stub[t], decode_bytes, 400, {}, &a[t].emplace_back()));
        f[t].push_back(EchoRoundTrip(*echo_stub[t], prefill_bytes, 40));
        h[t].push_back(EchoRoundTrip(*handoff_stub[t], decode_bytes, 400));
        const int idle_iters = std::max(4, static_cast<int>(0.05 / (gap.count() + 1e-4)));  // ~50 ms of gaps
        g[t].push_back(EchoRoundTrip(*handoff_stub[t], decode_bytes, idle_iters, gap));
      }
    }
    for (int t = 0; t < 2; ++t) {
      rtt_decode[t] = Median(d[t]);
      rtt_prefill[t] = Median(f[t]);
      rtt_handoff[t] = Median(h[t]);
      rtt_idle[t] = Median(g[t]);
      rtt_allocs[t] = Median(a[t]);
    }
    for (auto& server : servers) server->Shutdown();
  }


  // 3. Two stages over gRPC, one pipeline per transport, both loaded at once and timed in
  // interleaved rounds (plaintext, mTLS, plaintext, ...), so that the load of a shared machine
  // falls on both alike; each round's per-hop difference is paired with its neighbour's.
  const int half = static_cast<int>(spec->num_layers / 2);
  constexpr int kRounds = 7;
  struct Pipeline {
    service::WorkerMetrics m0, m1;
    std::unique_ptr<service::WorkerServer> w0, w1;
    std::unique_ptr<grpc::Server> s0, s1;
    std::unique_ptr<v1::Stage::Stub> stub;
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>> stream;
    std::vector<double> step, hop, compute;
    uint64_t step_id = 0;
    // The coordinator's client (callback API): answers relayed through stage 0, and straight from
    // stage 1 on its return stream (stage.proto).
    std::unique_ptr<coordinator::GrpcReplicaClient> relayed, direct;
    std::vector<double> step_relayed, hop_relayed, step_direct, hop_direct;
    // Heap allocations per decode step in the whole process (the client and both stages; the
    // bench's own stream, and the replica client relayed and direct).
    double last_allocations = 0;
    std::vector<double> allocs, allocs_relayed, allocs_direct;
  };
  std::unique_ptr<Pipeline> pipes[2];
  for (int t = 0; t < 2; ++t) {
    const Transport& tr = transports[t];
    auto& p = pipes[t];
    p = std::make_unique<Pipeline>();
    const std::chrono::microseconds stage_spin(absl::GetFlag(FLAGS_stage_spin_us));
    const std::chrono::microseconds stage_poll(absl::GetFlag(FLAGS_stage_poll_us));
    const std::chrono::microseconds stage_inline(absl::GetFlag(FLAGS_stage_inline_us));
    p->w1 = std::make_unique<service::WorkerServer>(service::WorkerOptions{.cpu_ranks = 1,
                                                                           .metrics = &p->m1,
                                                                           .stage_spin = stage_spin,
                                                                           .stage_poll = stage_poll,
                                                                           .stage_inline = stage_inline});
    p->w0 = std::make_unique<service::WorkerServer>(service::WorkerOptions{
        .cpu_ranks = 1,
        .metrics = &p->m0,
        .peer_credentials = tr.worker->InternalChannelCredentials(security::Role::kWorker),
        .stage_spin = stage_spin,
        .stage_poll = stage_poll,
        .stage_inline = stage_inline});
    int p1 = 0, p0 = 0;
    p->s1 = Serve(p->w1->worker_service(), p->w1->stage_service(), &p1, *tr.worker);
    p->s0 = Serve(p->w0->worker_service(), p->w0->stage_service(), &p0, *tr.worker);
    (void)p->w1->Assign(Stage(dir, 1, half, static_cast<int>(spec->num_layers), ""));
    (void)p->w0->Assign(Stage(dir, 0, 0, half, absl::StrCat("127.0.0.1:", p1)));
    for (service::WorkerServer* w : {p->w0.get(), p->w1.get()}) {
      const service::WorkerStatusSnapshot loaded = w->WaitLoaded(absl::Seconds(60));
      if (loaded.state != v1::WORKER_STATE_READY) {
        std::cerr << "a bench stage did not load: " << loaded.error << "\n";
        return 1;
      }
    }
    p->stub = v1::Stage::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", p0),
                                                     tr.client->InternalChannelCredentials(security::Role::kWorker)));
    p->stream = p->stub->StepStream(&p->ctx);
    const std::string a0 = absl::StrCat("127.0.0.1:", p0), a1 = absl::StrCat("127.0.0.1:", p1);
    auto creds = tr.client->InternalChannelCredentials(security::Role::kWorker);
    const absl::Duration answer_spin = absl::Microseconds(absl::GetFlag(FLAGS_answer_spin_us));
    const absl::Duration answer_poll = absl::Microseconds(absl::GetFlag(FLAGS_answer_poll_us));
    p->relayed = std::make_unique<coordinator::GrpcReplicaClient>(
        grpc::CreateChannel(a0, creds), coordinator::GrpcReplicaClient::Options{.address = a0, .answer_spin = answer_spin, .answer_poll = answer_poll});
    p->direct = std::make_unique<coordinator::GrpcReplicaClient>(
        grpc::CreateChannel(a0, creds), grpc::CreateChannel(a1, creds),
        coordinator::GrpcReplicaClient::Options{.address = a0, .last_address = a1, .answer_spin = answer_spin, .answer_poll = answer_poll});
  }
  // One round: `tokens` decode steps over the same positions (the sequence restarts at 0).
  // Times `tokens` decode steps of one sequence (after 4 untimed ones; the sequence restarts at
  // position 0): `step(i, token)` runs the step at position i and returns the sampled token, or -1.
  // Gives {step time, the stages' compute per step} (seconds), or nullopt when a step failed.
  auto timed = [&](Pipeline& p, const std::function<int32_t(int, int32_t)>& step)
      -> std::optional<std::pair<double, double>> {
    int32_t t = 1;
    double start = 0, c0 = 0;
    uint64_t allocations = 0;
    for (int i = 0; i < tokens + 4; ++i) {
      if (i == 4) {
        start = Now();
        c0 = StepSeconds(p.m0) + StepSeconds(p.m1);
        allocations = testing::ProcessAllocations();
      }
      if ((t = step(i, t)) < 0) return std::nullopt;
    }
    p.last_allocations = static_cast<double>(testing::ProcessAllocations() - allocations) / tokens;
    return std::pair{(Now() - start) / tokens, (StepSeconds(p.m0) + StepSeconds(p.m1) - c0) / tokens};
  };
  // One round on the bench's own synchronous stream to stage 0.
  auto round = [&](Pipeline& p) {
    auto r = timed(p, [&p](int i, int32_t t) -> int32_t {
      v1::StepResponse resp;
      p.stream->Write(DecodeStep(p.step_id++, i, t));
      if (!p.stream->Read(&resp) || resp.error_code() != 0 || resp.token_ids_size() != 1) {
        std::fprintf(stderr, "pipeline step failed: %s\n", resp.error_message().c_str());
        return -1;
      }
      return resp.token_ids(0);
    });
    if (!r.has_value()) return false;
    p.step.push_back(r->first);
    p.compute.push_back(r->second);
    p.allocs.push_back(p.last_allocations);
    // Two round trips per step (client -> stage 0 -> stage 1 and the answers back).
    p.hop.push_back((r->first - r->second) / 2.0);
    return true;
  };
  // The same through the coordinator's client; `direct`: stage 1 answers on the return stream, so a
  // step makes three one-way trips (1.5 round trips) instead of four.
  auto client_round = [&](Pipeline& p, bool direct) {
    coordinator::GrpcReplicaClient& client = direct ? *p.direct : *p.relayed;
    auto r = timed(p, [&p, &client](int i, int32_t t) -> int32_t {
      coordinator::StepInput in{.step_id = p.step_id++};
      coordinator::StepSequenceInput& s = in.sequences.emplace_back();
      for (int b = 0; b <= i / 16; ++b) s.block_ids.push_back(b);
      s.pos_begin = i;
      s.token_ids = {t};
      s.sample = true;
      s.sample_index = static_cast<uint64_t>(i);
      absl::StatusOr<coordinator::StepOutput> out = client.Step(in);
      if (!out.ok() || out->token_ids.size() != 1) {
        std::fprintf(stderr, "pipeline step failed: %s\n", out.status().ToString().c_str());
        return -1;
      }
      return out->token_ids[0];
    });
    if (!r.has_value()) return false;
    (direct ? p.step_direct : p.step_relayed).push_back(r->first);
    (direct ? p.allocs_direct : p.allocs_relayed).push_back(p.last_allocations);
    (direct ? p.hop_direct : p.hop_relayed).push_back((r->first - r->second) / (direct ? 1.5 : 2.0));
    return true;
  };
  for (auto& p : pipes) {
    // Warm-up: the links are up after it.
    if (!round(*p) || !client_round(*p, false) || !client_round(*p, true)) return 1;
  }
  for (auto& p : pipes) {
    p->step.clear(), p->hop.clear(), p->compute.clear();
    p->step_relayed.clear(), p->hop_relayed.clear(), p->step_direct.clear(), p->hop_direct.clear();
    p->allocs.clear(), p->allocs_relayed.clear(), p->allocs_direct.clear();
  }
  const int64_t handshakes_before = security::InternalClientHandshakes();
  std::vector<double> hop_diff;
  for (int r = 0; r < kRounds; ++r) {
    for (auto& p : pipes) {
      if (!round(*p)) return 1;
    }
    hop_diff.push_back(pipes[1]->hop.back() - pipes[0]->hop.back());
    for (auto& p : pipes) {
      if (!client_round(*p, false) || !client_round(*p, true)) return 1;
    }
  }
  const double handshakes_per_step =
      static_cast<double>(security::InternalClientHandshakes() - handshakes_before) / (6.0 * kRounds * tokens);
  double step_pp[2], hop[2], compute_pp[2];
  double step_relayed[2], hop_relayed[2], step_direct[2], hop_direct[2];  // through the replica client
  double allocs[2], allocs_relayed[2], allocs_direct[2];
  for (int t = 0; t < 2; ++t) {
    allocs[t] = Median(pipes[t]->allocs);
    allocs_relayed[t] = Median(pipes[t]->allocs_relayed);
    allocs_direct[t] = Median(pipes[t]->allocs_direct);
    step_pp[t] = Median(pipes[t]->step);
    hop[t] = Median(pipes[t]->hop);
    compute_pp[t] = Median(pipes[t]->compute);
    step_relayed[t] = Median(pipes[t]->step_relayed);
    hop_relayed[t] = Median(pipes[t]->hop_relayed);
    step_direct[t] = Median(pipes[t]->step_direct);
    hop_direct[t] = Median(pipes[t]->hop_direct);
    pipes[t]->relayed.reset();
    pipes[t]->direct.reset();
    pipes[t]->stream->WritesDone();
    (void)pipes[t]->stream->Finish();
    pipes[t]->w0->Shutdown();
    pipes[t]->w1->Shutdown();
    pipes[t]->s0->Shutdown();
    pipes[t]->s1->Shutdown();
  }
  const double hop_tls_cost = Median(hop_diff);
  std::filesystem::remove_all(tls_dir);

  std::fprintf(text, "model %s, %lld layers, hidden %lld\n", dir.c_str(), static_cast<long long>(spec->num_layers),
               static_cast<long long>(spec->hidden_size));
  for (int t = 0; t < 2; ++t) {
    std::fprintf(text, "[%s] bare gRPC bidi round trip: %.1f us (%zu B), %.1f us (%zu B) = %.2f GB/s\n",
                 transports[t].name, rtt_decode[t] * 1e6, decode_bytes, rtt_prefill[t] * 1e6, prefill_bytes,
                 prefill_bytes / rtt_prefill[t] / 1e9);
    std::fprintf(text,
                 "[%s] bare round trip answered from another thread: %.1f us (%zu B); after %.2f ms idle: %.1f us\n",
                 transports[t].name, rtt_handoff[t] * 1e6, decode_bytes, gap.count() * 1e3, rtt_idle[t] * 1e6);
    std::fprintf(
        text,
        "[%s] decode step: one process %.2f ms, 2 stages %.2f ms (their compute %.2f ms); per hop %.1f us = "
        "%.2fx the bare round trip, %.2fx the one after idling; stage compute %.2f ms (median of %d rounds of %d "
        "steps)\n",
        transports[t].name, step_one * 1e3, step_pp[t] * 1e3, compute_pp[t] * 1e3, hop[t] * 1e6, hop[t] / rtt_decode[t],
        hop[t] / rtt_idle[t], compute_pp[t] * 1e3 / 2, kRounds, tokens);
    std::fprintf(text, "[%s] decode tok/s: one process %.1f, PP=2 %.1f = %.2f of one process\n", transports[t].name,
                 1 / step_one, 1 / step_pp[t], step_one / step_pp[t]);
    const double hr = hop_relayed[t], hd = hop_direct[t];
    std::fprintf(
        text,
        "[%s] through the coordinator's replica client: decode step %.3f ms with answers relayed through "
        "stage 0 (per hop %.1f us = %.2fx the bare round trip), %.3f ms with the last stage answering directly "
        "(per round trip of its 3 one-way trips %.1f us = %.2fx the bare round trip)\n",
        transports[t].name, step_relayed[t] * 1e3, hr * 1e6, hr / rtt_decode[t],
        step_direct[t] * 1e3, hd * 1e6, hd / rtt_decode[t]);
    if (testing::AllocationsCounted()) {
      std::fprintf(text,
                   "[%s] heap allocations per decode step, whole process (client and both stages): %.1f on the "
                   "bench's stream, %.1f through the replica client relayed, %.1f direct; a bare round trip makes "
                   "%.1f (both ends), so a step's 2 round trips' worth of gRPC is %.1f\n",
                   transports[t].name, allocs[t], allocs_relayed[t], allocs_direct[t], rtt_allocs[t],
                   2 * rtt_allocs[t]);
    }
  }
  std::fprintf(text, "TLS handshakes per decode step once the links are up (both pipelines): %.3f\n",
               handshakes_per_step);
  // The hop includes the stage's own transport work; TLS adds record encryption both ways.
  std::fprintf(text,
               "mTLS cost: per hop %+.1f us (%+.1f%%; median of %d paired rounds), bare round trip %+.1f us (%+.1f%%), "
               "prefill-sized round trip %+.1f%%, decode step %+.1f%%\n",
               hop_tls_cost * 1e6, 100 * hop_tls_cost / hop[0], kRounds, (rtt_decode[1] - rtt_decode[0]) * 1e6,
               100 * (rtt_decode[1] - rtt_decode[0]) / rtt_decode[0],
               100 * (rtt_prefill[1] - rtt_prefill[0]) / rtt_prefill[0], 100 * (step_pp[1] - step_pp[0]) / step_pp[0]);
  if (absl::GetFlag(FLAGS_json)) {
    // The same figures, times in µs or ms as named; ratios against the same run's round trips.
    nlohmann::json doc{{"model", dir},
                       {"layers", spec->num_layers},
                       {"hidden", spec->hidden_size},
                       {"cores", std::thread::hardware_concurrency()},
                       {"tokens", tokens},
                       {"rounds", kRounds},
                       {"idle_gap_ms", gap.count() * 1e3},
                       {"step_one_process_ms", step_one * 1e3},
                       {"tls_handshakes_per_step", handshakes_per_step},
                       {"mtls_hop_cost_us", hop_tls_cost * 1e6}};
    for (int t = 0; t < 2; ++t) {
      const double hr = hop_relayed[t], hd = hop_direct[t];
      doc["transports"][transports[t].name] = {{"round_trip_us", rtt_decode[t] * 1e6},
                                               {"round_trip_after_idle_us", rtt_idle[t] * 1e6},
                                               {"round_trip_other_thread_us", rtt_handoff[t] * 1e6},
                                               {"prefill_round_trip_us", rtt_prefill[t] * 1e6},
                                               {"step_pp2_ms", step_pp[t] * 1e3},
                                               {"stage_compute_ms", compute_pp[t] * 1e3 / 2},
                                               {"hop_us", hop[t] * 1e6},
                                               {"hop_over_round_trip", hop[t] / rtt_decode[t]},
                                               {"hop_over_round_trip_after_idle", hop[t] / rtt_idle[t]},
                                               {"replica_client_step_relayed_ms", step_relayed[t] * 1e3},
                                               {"replica_client_hop_relayed_us", hr * 1e6},
                                               {"replica_client_hop_relayed_over_round_trip", hr / rtt_decode[t]},
                                               {"replica_client_step_direct_ms", step_direct[t] * 1e3},
                                               {"replica_client_direct_round_trip_us", hd * 1e6}};
      if (testing::AllocationsCounted()) {
        doc["transports"][transports[t].name]["allocations_per_step"] = allocs[t];
        doc["transports"][transports[t].name]["allocations_per_round_trip"] = rtt_allocs[t];
        doc["transports"][transports[t].name]["replica_client_allocations_per_step_relayed"] = allocs_relayed[t];
        doc["transports"][transports[t].name]["replica_client_allocations_per_step_direct"] = allocs_direct[t];
      }
    }
    std::printf("%s\n", doc.dump(2).c_str());
  }
  return 0;
}

}  // namespace
}  // namespace shardserve

int main(int argc, char** argv) {
  shardserve::UseReleaseAbseilMutexes();  // gRPC locks absl::Mutexes on every message
  absl::ParseCommandLine(argc, argv);
  return shardserve::Run();
}

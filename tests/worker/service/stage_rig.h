// Helpers for tests that run real workers serving pipeline stages on 127.0.0.1 (port 0), driven
// over gRPC the way the coordinator drives stage 0 (stage_stream_test.cc, direct_answer_test.cc).
#ifndef SHARDSERVE_TESTS_WORKER_SERVICE_STAGE_RIG_H_
#define SHARDSERVE_TESTS_WORKER_SERVICE_STAGE_RIG_H_

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "prometheus/metric_family.h"
#include "shardserve/v1/stage.pb.h"
#include "worker/service/convert.h"
#include "worker/service/worker_metrics.h"
#include "worker/service/worker_server.h"

namespace shardserve::service {

struct RunningWorker {
  std::unique_ptr<WorkerServer> server;
  std::unique_ptr<grpc::Server> rpc;
  std::string address;
};

inline RunningWorker StartWorker(WorkerOptions options) {
  RunningWorker w;
  w.server = std::make_unique<WorkerServer>(std::move(options));
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.SetMaxReceiveMessageSize(kMaxMessageBytes);
  b.RegisterService(w.server->worker_service());
  b.RegisterService(w.server->stage_service());
  b.RegisterService(w.server->expert_service());
  w.rpc = b.BuildAndStart();
  w.address = absl::StrCat("127.0.0.1:", port);
  return w;
}

// The value of counter `family` with (at least) the labels `labels` in a worker's registry;
// nullopt when it has no such child.
inline std::optional<double> CounterValue(const WorkerMetrics& metrics, const std::string& family,
                                          const std::map<std::string, std::string>& labels) {
  for (const prometheus::MetricFamily& f : metrics.registry()->Collect()) {
    if (f.name != family) continue;
    for (const prometheus::ClientMetric& m : f.metric) {
      size_t matched = 0;
      for (const prometheus::ClientMetric::Label& l : m.label) {
        const auto it = labels.find(l.name);
        matched += it != labels.end() && it->second == l.value;
      }
      if (matched == labels.size()) return m.counter.value;
    }
  }
  return std::nullopt;
}

inline RunningWorker StartWorker(int cpu_ranks, WorkerMetrics* metrics = nullptr) {
  return StartWorker(WorkerOptions{.cpu_ranks = cpu_ranks, .metrics = metrics});
}

inline v1::Assignment StageAssignment(const std::string& model, int stage, int layer_begin, int layer_end,
                                      int ranks, const std::string& next) {
  v1::Assignment a;
  a.set_assignment_id(absl::StrCat("test-", stage));
  a.set_model_path(model);
  a.set_stage(stage);
  a.set_layer_begin(layer_begin);
  a.set_layer_end(layer_end);
  a.set_device_kind(v1::DEVICE_KIND_CPU);
  for (int r = 0; r < ranks; ++r) a.add_devices(r);
  a.set_kv_blocks(4 * 8);  // blocks of 16 tokens: 4 sequences of the whole context (128 tokens)
  a.set_kv_block_size(16);
  a.set_max_step_tokens(64);
  a.set_next_address(next);
  return a;
}

// Waits (at most 30 s) until the worker's load ends (READY or FAILED) and returns its status.
inline WorkerStatusSnapshot AwaitLoaded(const WorkerServer& w) { return w.WaitLoaded(absl::Seconds(30)); }

// Starts two one-rank workers serving `model` (2 layers) as a pipeline: *w0 layers [0, 1) forwarding
// to *w1, layers [1, 2); returns once both are READY (a failed test otherwise).
inline void StartTwoStages(const std::string& model, RunningWorker* w0, RunningWorker* w1) {
  *w1 = StartWorker(1);
  *w0 = StartWorker(1);
  ASSERT_TRUE(w1->server->Assign(StageAssignment(model, 1, 1, 2, 1, "")).ok());
  ASSERT_TRUE(w0->server->Assign(StageAssignment(model, 0, 0, 1, 1, w1->address)).ok());
  ASSERT_EQ(AwaitLoaded(*w1->server).state, v1::WORKER_STATE_READY) << w1->server->Status().error;
  ASSERT_EQ(AwaitLoaded(*w0->server).state, v1::WORKER_STATE_READY) << w0->server->Status().error;
}

// A one-sequence micro-batch that samples; sequence `seq` holds blocks [8 * seq, 8 * seq + 8): a whole context of 128 tokens.
inline v1::StepRequest Step(uint64_t id, int seq, int pos, const std::vector<int32_t>& tokens, uint64_t sample_index) {
  v1::StepRequest r;
  r.set_step_id(id);
  v1::StepSequence* s = r.add_sequences();
  for (int b = 0; b < 8; ++b) s->add_block_ids(8 * seq + b);
  s->set_pos_begin(pos);
  s->set_num_tokens(static_cast<int32_t>(tokens.size()));
  for (int32_t t : tokens) s->add_token_ids(t);
  s->set_sample(true);
  s->set_sample_index(sample_index);
  return r;
}

}  // namespace shardserve::service

#endif  // SHARDSERVE_TESTS_WORKER_SERVICE_STAGE_RIG_H_

#include "worker/service/worker_metrics.h"

#include "absl/strings/str_cat.h"
#include "common/metrics/metrics_server.h"

namespace shardserve::service {

WorkerMetrics::WorkerMetrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      step_seconds_(prometheus::BuildHistogram()
                        .Name("shardserve_worker_step_seconds")
                        .Help("Time of one micro-batch on this worker's stage, by stage and phase")
                        .Register(*registry_)),
      step_tokens_(prometheus::BuildCounter()
                       .Name("shardserve_worker_step_tokens_total")
                       .Help("Tokens processed by this worker's stage, by stage and phase")
                       .Register(*registry_)),
      collective_seconds_(prometheus::BuildHistogram()
                              .Name("shardserve_worker_collective_seconds")
                              .Help("Time in collectives between this worker's ranks, by operation and rank")
                              .Register(*registry_)),
      stream_bytes_(prometheus::BuildCounter()
                        .Name("shardserve_worker_stream_bytes_total")
                        .Help("Bytes on stage streams, by direction and peer")
                        .Register(*registry_)),
      stream_messages_(prometheus::BuildCounter()
                           .Name("shardserve_worker_stream_messages_total")
                           .Help("Messages on stage streams, by direction and peer")
                           .Register(*registry_)),
      expert_tokens_(prometheus::BuildCounter()
                         .Name("shardserve_worker_expert_tokens_total")
                         .Help("Tokens routed to each expert of each MoE layer on this stage")
                         .Register(*registry_)),
      weight_bytes_(prometheus::BuildGauge()
                        .Name("shardserve_worker_weight_bytes")
                        .Help("Weight bytes held by each rank")
                        .Register(*registry_)),
      kv_cache_bytes_(prometheus::BuildGauge()
                          .Name("shardserve_worker_kv_cache_bytes")
                          .Help("KV cache bytes held by each rank")
                          .Register(*registry_)),
      load_seconds_(prometheus::BuildGauge()
                        .Name("shardserve_worker_assignment_load_seconds")
                        .Help("Time the current assignment took to load")
                        .Register(*registry_)
                        .Add({})),
      stage_runs_(prometheus::BuildCounter()
                      .Name("shardserve_worker_stage_runs_total")
                      .Help("Micro-batches run by this worker's stage, by thread: reader (the gRPC thread that read "
                            "it, for short steps) or stage (handed to the stage thread)")
                      .Register(*registry_)),
      runs_on_reader_(stage_runs_.Add({{"thread", "reader"}})),
      runs_on_stage_thread_(stage_runs_.Add({{"thread", "stage"}})) {}

void WorkerMetrics::CountStageRun(bool on_reader) {
  (on_reader ? runs_on_reader_ : runs_on_stage_thread_).Increment();
}

void WorkerMetrics::ObserveStep(int stage, bool prefill, double seconds, int64_t tokens) {
  std::pair<prometheus::Histogram*, prometheus::Counter*> children;
  {
    MutexLock lock(&children_mu_);
    auto [it, added] = step_children_.try_emplace({stage, prefill});
    if (added) {
      const prometheus::Labels labels = {{"stage", absl::StrCat(stage)}, {"phase", prefill ? "prefill" : "decode"}};
      it->second = {&step_seconds_.Add(labels, StepBuckets()), &step_tokens_.Add(labels)};
    }
    children = it->second;
  }
  children.first->Observe(seconds);
  children.second->Increment(static_cast<double>(tokens));
}

void WorkerMetrics::ObserveStream(const char* direction, const char* peer, size_t bytes) {
  std::pair<prometheus::Counter*, prometheus::Counter*> children;
  {
    MutexLock lock(&children_mu_);
    auto [it, added] = stream_children_.try_emplace({direction, peer});
    if (added) {
      const prometheus::Labels labels = {{"direction", direction}, {"peer", peer}};
      it->second = {&stream_bytes_.Add(labels), &stream_messages_.Add(labels)};
    }
    children = it->second;
  }
  children.first->Increment(static_cast<double>(bytes));
  children.second->Increment();
}

void WorkerMetrics::SetLoaded(double load_seconds, const std::vector<size_t>& weight_bytes,
                              const std::vector<size_t>& kv_bytes) {
  load_seconds_.Set(load_seconds);
  for (size_t r = 0; r < weight_bytes.size(); ++r) {
    weight_bytes_.Add({{"rank", absl::StrCat(r)}}).Set(static_cast<double>(weight_bytes[r]));
  }
  for (size_t r = 0; r < kv_bytes.size(); ++r) {
    kv_cache_bytes_.Add({{"rank", absl::StrCat(r)}}).Set(static_cast<double>(kv_bytes[r]));
  }
}

void WorkerMetrics::OnCollective(int rank, absl::string_view op, double seconds) {
  prometheus::Histogram* child = nullptr;
  {
    MutexLock lock(&children_mu_);
    auto [it, added] = collective_children_.try_emplace({std::string(op), rank});
    if (added) {
      it->second = &collective_seconds_.Add({{"op", std::string(op)}, {"rank", absl::StrCat(rank)}}, StepBuckets());
    }
    child = it->second;
  }
  child->Observe(seconds);
}

void WorkerMetrics::OnExpertTokens(int64_t layer, int64_t expert, int64_t tokens) {
  prometheus::Counter* child = nullptr;
  {
    MutexLock lock(&children_mu_);
    auto [it, added] = expert_children_.try_emplace({layer, expert});
    if (added) it->second = &expert_tokens_.Add({{"layer", absl::StrCat(layer)}, {"expert", absl::StrCat(expert)}});
    child = it->second;
  }
  child->Increment(static_cast<double>(tokens));
}

}  // namespace shardserve::service

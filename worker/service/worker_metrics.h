// Every metric family a worker exports, declared in one place. Names follow
// shardserve_worker_<what>_<unit>; labels: stage, phase, rank, op, direction, layer, expert.
// Thread-safe: prometheus-cpp metrics are atomic; label children are created under the family's
// own lock. The per-step recorders (ObserveStep, ObserveStream, OnCollective, OnExpertTokens) look
// each label set up once and then reuse its child (a short lock, no label map built, nothing
// allocated), as they run on every micro-batch, message and collective.
#ifndef SHARDSERVE_WORKER_SERVICE_WORKER_METRICS_H_
#define SHARDSERVE_WORKER_SERVICE_WORKER_METRICS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "common/concurrency/mutex.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "worker/engine/step_runner.h"

namespace shardserve::service {

class WorkerMetrics final : public engine::StepObserver {
 public:
  WorkerMetrics();
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // A micro-batch of stage `stage` ran for `seconds`; phase "prefill" when any sequence had more
  // than one new token, else "decode".
  void ObserveStep(int stage, bool prefill, double seconds, int64_t tokens);
  // Stage-stream traffic. direction: "rx" or "tx"; peer: "upstream", "downstream", "coordinator" (the
  // last stage's direct answers on its return stream) or "expert-callers".
  void ObserveStream(const char* direction, const char* peer, size_t bytes);
  // A micro-batch started on this worker's stage: on the gRPC thread that read it (`on_reader`,
  // WorkerOptions::stage_inline) or on the stage thread.
  void CountStageRun(bool on_reader);
  // After an assignment loaded.
  void SetLoaded(double load_seconds, const std::vector<size_t>& weight_bytes, const std::vector<size_t>& kv_bytes);

  // engine::StepObserver
  void OnCollective(int rank, absl::string_view op, double seconds) override;
  void OnExpertTokens(int64_t layer, int64_t expert, int64_t tokens) override;

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Histogram>& step_seconds_;
  prometheus::Family<prometheus::Counter>& step_tokens_;
  prometheus::Family<prometheus::Histogram>& collective_seconds_;
  prometheus::Family<prometheus::Counter>& stream_bytes_;
  prometheus::Family<prometheus::Counter>& stream_messages_;
  prometheus::Family<prometheus::Counter>& expert_tokens_;
  prometheus::Family<prometheus::Gauge>& weight_bytes_;
  prometheus::Family<prometheus::Gauge>& kv_cache_bytes_;
  prometheus::Gauge& load_seconds_;
  prometheus::Family<prometheus::Counter>& stage_runs_;
  prometheus::Counter& runs_on_reader_;
  prometheus::Counter& runs_on_stage_thread_;

  // The children already looked up, by label values (children live as long as their family).
  Mutex children_mu_;
  absl::flat_hash_map<std::pair<int, bool>, std::pair<prometheus::Histogram*, prometheus::Counter*>> step_children_
      ABSL_GUARDED_BY(children_mu_);
  absl::flat_hash_map<std::pair<std::string, std::string>, std::pair<prometheus::Counter*, prometheus::Counter*>>
      stream_children_ ABSL_GUARDED_BY(children_mu_);
  absl::flat_hash_map<std::pair<std::string, int>, prometheus::Histogram*> collective_children_
      ABSL_GUARDED_BY(children_mu_);
  absl::flat_hash_map<std::pair<int64_t, int64_t>, prometheus::Counter*> expert_children_
      ABSL_GUARDED_BY(children_mu_);
};

}  // namespace shardserve::service

#endif  // SHARDSERVE_WORKER_SERVICE_WORKER_METRICS_H_

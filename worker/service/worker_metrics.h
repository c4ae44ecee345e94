// Every metric family a worker exports, declared in one place. Names follow
// shardserve_worker_<what>_<unit>; labels: stage, phase, rank, op, direction, layer, expert.
// Thread-safe: prometheus-cpp metrics are atomic; label children are created under the family's
// own lock.
#ifndef SHARDSERVE_WORKER_SERVICE_WORKER_METRICS_H_
#define SHARDSERVE_WORKER_SERVICE_WORKER_METRICS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

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
  // Stage-stream traffic. direction: "rx" or "tx"; peer: "upstream" or "downstream".
  void ObserveStream(const char* direction, const char* peer, size_t bytes);
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
};

}  // namespace shardserve::service

#endif  // SHARDSERVE_WORKER_SERVICE_WORKER_METRICS_H_

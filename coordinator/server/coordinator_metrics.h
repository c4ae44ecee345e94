// Every metric family the coordinator exports, declared in one place (workers have theirs in
// worker/service/worker_metrics.h). Names follow shardserve_coordinator_<what>_<unit>:
//
//  requests (one count per request, whatever front end it came by)
//   shardserve_coordinator_requests_total{finish_reason,code}  counter
//       finish_reason: length | stop | cancelled (ended normally, code="OK"),
//                      error (failed: code is the gRPC code name, e.g. UNAVAILABLE),
//                      rejected (refused before generating: INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
//                      UNAVAILABLE while the cluster is not ready, ...)
//   shardserve_coordinator_prompt_tokens_total                  counter (ended requests)
//   shardserve_coordinator_generated_tokens_total               counter (tokens delivered)
//   shardserve_coordinator_request_prompt_tokens                histogram, per request
//   shardserve_coordinator_request_generated_tokens             histogram, per request
//   shardserve_coordinator_time_to_first_token_seconds          histogram (Submit -> first token)
//   shardserve_coordinator_inter_token_latency_seconds          histogram (gap between tokens)
//   shardserve_coordinator_e2e_request_latency_seconds          histogram (Submit -> end)
//   shardserve_coordinator_queue_time_seconds                   histogram (Submit -> first admission)
//  micro-batches, by replica
//   shardserve_coordinator_steps_total{replica,code}            counter
//   shardserve_coordinator_step_seconds{replica}                histogram (round trip over the pipeline)
//   shardserve_coordinator_batch_sequences{replica}             histogram (batch size)
//   shardserve_coordinator_batch_tokens{replica}                histogram (tokens per step)
//   shardserve_coordinator_step_tokens_total{replica,phase}     counter; phase: prefill | decode
//   shardserve_coordinator_preemptions_total{replica}           counter
//   shardserve_coordinator_failovers_total{replica}             counter (sequences moved off the replica)
//  prefix cache, by replica (sequences admitted with prefix caching on)
//   shardserve_coordinator_prefix_cache_queried_tokens_total{replica}  counter (context tokens looked up)
//   shardserve_coordinator_prefix_cache_hit_tokens_total{replica}      counter (of those, found cached)
//  state, refreshed by Refresh() (the metrics server calls it before every scrape)
//   shardserve_coordinator_running_sequences{replica}           gauge
//   shardserve_coordinator_waiting_sequences{replica}           gauge
//   shardserve_coordinator_slots{replica}                       gauge (sequences the replica holds at once)
//   shardserve_coordinator_kv_blocks_used{replica}              gauge
//   shardserve_coordinator_kv_blocks_cached{replica}            gauge (kept for prefix reuse, held or not)
//   shardserve_coordinator_kv_blocks_capacity{replica}          gauge (the same on every stage)
//   shardserve_coordinator_workers{state}                       gauge; idle|loading|ready|failed|dead
//   shardserve_coordinator_workers_up                           gauge (registered and heartbeating)
//   shardserve_coordinator_replicas_serving                     gauge
//   shardserve_coordinator_ready                                gauge, 1 when the cluster serves
//   shardserve_coordinator_plans_total                          counter (placement plans made)
//
// Thread-safety: every method is thread-safe. The SchedulerObserver methods only update
// prometheus-cpp metrics (atomics, and a family's own lock the first time a label set is seen), so
// they are quick and never call back into the scheduler, as SchedulerObserver requires.
#ifndef SHARDSERVE_COORDINATOR_SERVER_COORDINATOR_METRICS_H_
#define SHARDSERVE_COORDINATOR_SERVER_COORDINATOR_METRICS_H_

#include <map>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/registry/registry.h"
#include "coordinator/scheduler/scheduler.h"
#include "coordinator/scheduler/scheduler_observer.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace shardserve::coordinator {

// The cluster's state at one moment, as Refresh() reads it.
struct ClusterSample {
  SchedulerStats scheduler;
  std::vector<WorkerState> workers;  // one entry per known worker (dead ones included)
  int plans_made = 0;                // Cluster::PlansMade()
  bool ready = false;
};

class CoordinatorMetrics final : public SchedulerObserver {
 public:
  CoordinatorMetrics();
  CoordinatorMetrics(const CoordinatorMetrics&) = delete;
  CoordinatorMetrics& operator=(const CoordinatorMetrics&) = delete;

  // The registry holding every family above (shared with the MetricsServer that serves it).
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // Sets the state gauges from `sample`. Replicas that are no longer in `sample.scheduler` lose
  // their gauge series (their counters and histograms stay, as Prometheus expects of counters).
  void Refresh(const ClusterSample& sample);

  // SchedulerObserver
  void OnRejected(const absl::Status& status) override;
  void OnInterTokenLatency(absl::Duration gap) override;
  void OnRequestEnd(const RequestReport& report) override;
  void OnStep(const StepReport& report) override;
  void OnPreempted(int replica) override;
  void OnFailover(int from_replica) override;
  void OnPrefixCacheLookup(int replica, int64_t context_tokens, int64_t cached_tokens) override;

 private:
  // A gauge family labelled by replica, whose children follow the replicas that exist.
  struct ReplicaGauges {
    prometheus::Family<prometheus::Gauge>* family = nullptr;
    std::map<int, prometheus::Gauge*> children;
  };
  void SetReplicaGauges(ReplicaGauges& gauges, const std::vector<ReplicaStats>& replicas,
                        double (*value)(const ReplicaStats&)) ABSL_EXCLUSIVE_LOCKS_REQUIRED(refresh_mu_);

  // Constant after construction (prometheus-cpp metrics are themselves thread-safe).
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Counter& prompt_tokens_;
  prometheus::Counter& generated_tokens_;
  prometheus::Histogram& request_prompt_tokens_;
  prometheus::Histogram& request_generated_tokens_;
  prometheus::Histogram& time_to_first_token_;
  prometheus::Histogram& inter_token_latency_;
  prometheus::Histogram& e2e_latency_;
  prometheus::Histogram& queue_time_;
  prometheus::Family<prometheus::Counter>& steps_;
  prometheus::Family<prometheus::Histogram>& step_seconds_;
  prometheus::Family<prometheus::Histogram>& batch_sequences_;
  prometheus::Family<prometheus::Histogram>& batch_tokens_;
  prometheus::Family<prometheus::Counter>& step_tokens_;
  prometheus::Family<prometheus::Counter>& preemptions_;
  prometheus::Family<prometheus::Counter>& failovers_;
  prometheus::Family<prometheus::Counter>& prefix_cache_queried_;
  prometheus::Family<prometheus::Counter>& prefix_cache_hits_;
  prometheus::Family<prometheus::Gauge>& workers_;
  prometheus::Gauge& workers_up_;
  prometheus::Gauge& replicas_serving_;
  prometheus::Gauge& ready_;
  prometheus::Counter& plans_;

  // Refresh() bookkeeping.
  absl::Mutex refresh_mu_;
  ReplicaGauges running_ ABSL_GUARDED_BY(refresh_mu_);
  ReplicaGauges waiting_ ABSL_GUARDED_BY(refresh_mu_);
  ReplicaGauges slots_ ABSL_GUARDED_BY(refresh_mu_);
  ReplicaGauges kv_blocks_used_ ABSL_GUARDED_BY(refresh_mu_);
  ReplicaGauges kv_blocks_cached_ ABSL_GUARDED_BY(refresh_mu_);
  ReplicaGauges kv_blocks_capacity_ ABSL_GUARDED_BY(refresh_mu_);
};

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_SERVER_COORDINATOR_METRICS_H_

#include "coordinator/server/coordinator_metrics.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/metrics/metrics_server.h"

namespace shardserve::coordinator {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

std::string ReplicaLabel(int replica) { return replica < 0 ? std::string("none") : absl::StrCat(replica); }

}  // namespace

CoordinatorMetrics::CoordinatorMetrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      requests_(BuildCounter()
                    .Name("shardserve_coordinator_requests_total")
                    .Help("Requests the scheduler saw, by how they ended (finish_reason) and their gRPC status code")
                    .Register(*registry_)),
      prompt_tokens_(BuildCounter()
                         .Name("shardserve_coordinator_prompt_tokens_total")
                         .Help("Prompt tokens of ended requests")
                         .Register(*registry_)
                         .Add({})),
      generated_tokens_(BuildCounter()
                            .Name("shardserve_coordinator_generated_tokens_total")
                            .Help("Tokens generated and delivered to clients, counted when their request ends")
                            .Register(*registry_)
                            .Add({})),
      request_prompt_tokens_(BuildHistogram()
                                 .Name("shardserve_coordinator_request_prompt_tokens")
                                 .Help("Prompt tokens per ended request")
                                 .Register(*registry_)
                                 .Add({}, CountBuckets())),
      request_generated_tokens_(BuildHistogram()
                                    .Name("shardserve_coordinator_request_generated_tokens")
                                    .Help("Generated tokens per ended request")
                                    .Register(*registry_)
                                    .Add({}, CountBuckets())),
      time_to_first_token_(BuildHistogram()
                               .Name("shardserve_coordinator_time_to_first_token_seconds")
                               .Help("From Submit to the first generated token")
                               .Register(*registry_)
                               .Add({}, LatencyBuckets())),
      inter_token_latency_(BuildHistogram()
                               .Name("shardserve_coordinator_inter_token_latency_seconds")
                               .Help("Gap between two consecutive tokens of one sequence")
                               .Register(*registry_)
                               .Add({}, InterTokenBuckets())),
      e2e_latency_(BuildHistogram()
                       .Name("shardserve_coordinator_e2e_request_latency_seconds")
                       .Help("From Submit to the end of the request")
                       .Register(*registry_)
                       .Add({}, LatencyBuckets())),
      queue_time_(BuildHistogram()
                      .Name("shardserve_coordinator_queue_time_seconds")
                      .Help("From Submit to the first admission into a replica's batch")
                      .Register(*registry_)
                      .Add({}, LatencyBuckets())),
      steps_(BuildCounter()
                 .Name("shardserve_coordinator_steps_total")
                 .Help("Micro-batches run, by replica and gRPC status code")
                 .Register(*registry_)),
      step_seconds_(BuildHistogram()
                        .Name("shardserve_coordinator_step_seconds")
                        .Help("Round trip of one micro-batch through the replica's pipeline")
                        .Register(*registry_)),
      batch_sequences_(BuildHistogram()
                           .Name("shardserve_coordinator_batch_sequences")
                           .Help("Sequences per micro-batch")
                           .Register(*registry_)),
      batch_tokens_(BuildHistogram()
                        .Name("shardserve_coordinator_batch_tokens")
                        .Help("Tokens per micro-batch (prefill chunks plus one per decoding sequence)")
                        .Register(*registry_)),
      step_tokens_(BuildCounter()
                       .Name("shardserve_coordinator_step_tokens_total")
                       .Help("Tokens sent through the pipeline, by replica and phase (prefill, decode)")
                       .Register(*registry_)),
      preemptions_(BuildCounter()
                       .Name("shardserve_coordinator_preemptions_total")
                       .Help("Running sequences that gave their KV blocks back to be recomputed later")
                       .Register(*registry_)),
      failovers_(BuildCounter()
                     .Name("shardserve_coordinator_failovers_total")
                     .Help("Sequences moved off a replica whose pipeline broke or that was removed, to be "
                           "recomputed on another")
                     .Register(*registry_)),
      prefix_cache_queried_(BuildCounter()
                                .Name("shardserve_coordinator_prefix_cache_queried_tokens_total")
                                .Help("Context tokens of admitted sequences looked up in the prefix cache")
                                .Register(*registry_)),
      prefix_cache_hits_(BuildCounter()
                             .Name("shardserve_coordinator_prefix_cache_hit_tokens_total")
                             .Help("Context tokens found in the prefix cache (not computed again)")
                             .Register(*registry_)),
      workers_(BuildGauge()
                   .Name("shardserve_coordinator_workers")
                   .Help("Known workers by state (idle, loading, ready, failed, dead)")
                   .Register(*registry_)),
      workers_up_(BuildGauge()
                      .Name("shardserve_coordinator_workers_up")
                      .Help("Registered workers that are heartbeating (not dead)")
                      .Register(*registry_)
                      .Add({})),
      replicas_serving_(BuildGauge()
                            .Name("shardserve_coordinator_replicas_serving")
                            .Help("Replicas taking requests")
                            .Register(*registry_)
                            .Add({})),
      ready_(BuildGauge()
                 .Name("shardserve_coordinator_ready")
                 .Help("1 while the cluster is ready to serve, else 0")
                 .Register(*registry_)
                 .Add({})),
      plans_(BuildCounter()
                 .Name("shardserve_coordinator_plans_total")
                 .Help("Placement plans made (each one reassigns the workers)")
                 .Register(*registry_)
                 .Add({})) {
  absl::MutexLock lock(&refresh_mu_);
  auto gauge = [this](const char* name, const char* help) {
    return &BuildGauge().Name(name).Help(help).Register(*registry_);
  };
  running_.family = gauge("shardserve_coordinator_running_sequences", "Sequences holding a slot, by replica");
  waiting_.family = gauge("shardserve_coordinator_waiting_sequences", "Sequences queued for a slot, by replica");
  slots_.family = gauge("shardserve_coordinator_slots", "Sequences a replica holds at once");
  kv_blocks_used_.family =
      gauge("shardserve_coordinator_kv_blocks_used", "KV cache blocks held by a replica's sequences");
  kv_blocks_cached_.family = gauge("shardserve_coordinator_kv_blocks_cached",
                                   "KV cache blocks whose contents are kept for prefix reuse (held or not)");
  kv_blocks_capacity_.family =
      gauge("shardserve_coordinator_kv_blocks_capacity", "KV cache blocks of a replica (the same on every stage)");
  // Every state has a series from the start, so that a dashboard shows 0 rather than nothing.
  for (WorkerState s : {WorkerState::kIdle, WorkerState::kLoading, WorkerState::kReady, WorkerState::kFailed,
                        WorkerState::kDead}) {
    workers_.Add({{"state", std::string(WorkerStateName(s))}}).Set(0);
  }
}

void CoordinatorMetrics::SetReplicaGauges(ReplicaGauges& gauges, const std::vector<ReplicaStats>& replicas,
                                          double (*value)(const ReplicaStats&)) {
  std::map<int, prometheus::Gauge*> now;
  for (const ReplicaStats& r : replicas) {
    auto it = gauges.children.find(r.replica);
    prometheus::Gauge* g =
        it != gauges.children.end() ? it->second : &gauges.family->Add({{"replica", ReplicaLabel(r.replica)}});
    g->Set(value(r));
    now[r.replica] = g;
  }
  for (const auto& [replica, g] : gauges.children) {
    if (now.count(replica) == 0) gauges.family->Remove(g);
  }
  gauges.children = std::move(now);
}

void CoordinatorMetrics::Refresh(const ClusterSample& sample) {
  absl::MutexLock lock(&refresh_mu_);
  const std::vector<ReplicaStats>& r = sample.scheduler.replicas;
  SetReplicaGauges(running_, r, [](const ReplicaStats& s) { return static_cast<double>(s.running); });
  SetReplicaGauges(waiting_, r, [](const ReplicaStats& s) { return static_cast<double>(s.waiting); });
  SetReplicaGauges(slots_, r, [](const ReplicaStats& s) { return static_cast<double>(s.max_slots); });
  SetReplicaGauges(kv_blocks_used_, r, [](const ReplicaStats& s) { return static_cast<double>(s.kv_blocks_used); });
  SetReplicaGauges(kv_blocks_cached_, r,
                   [](const ReplicaStats& s) { return static_cast<double>(s.kv_blocks_cached); });
  SetReplicaGauges(kv_blocks_capacity_, r,
                   [](const ReplicaStats& s) { return static_cast<double>(s.kv_blocks_total); });

  std::map<WorkerState, int> by_state = {{WorkerState::kIdle, 0},
                                         {WorkerState::kLoading, 0},
                                         {WorkerState::kReady, 0},
                                         {WorkerState::kFailed, 0},
                                         {WorkerState::kDead, 0}};
  for (WorkerState s : sample.workers) ++by_state[s];
  for (const auto& [state, n] : by_state) {
    workers_.Add({{"state", std::string(WorkerStateName(state))}}).Set(n);
  }
  workers_up_.Set(static_cast<double>(sample.workers.size()) - by_state[WorkerState::kDead]);
  replicas_serving_.Set(static_cast<double>(r.size()));
  ready_.Set(sample.ready ? 1 : 0);
  // A counter only goes up: add what the cluster made since the last refresh.
  const double made = sample.plans_made - plans_.Value();
  if (made > 0) plans_.Increment(made);
}

void CoordinatorMetrics::OnRejected(const absl::Status& status) {
  requests_.Add({{"finish_reason", "rejected"}, {"code", absl::StatusCodeToString(status.code())}}).Increment();
}

void CoordinatorMetrics::OnInterTokenLatency(absl::Duration gap) {
  inter_token_latency_.Observe(absl::ToDoubleSeconds(gap));
}

void CoordinatorMetrics::OnRequestEnd(const RequestReport& report) {
  const SequenceEnd& end = report.end;
  const std::string reason = end.status.ok() ? std::string(FinishReasonName(end.reason)) : "error";
  requests_.Add({{"finish_reason", reason}, {"code", absl::StatusCodeToString(end.status.code())}}).Increment();
  prompt_tokens_.Increment(end.prompt_tokens);
  generated_tokens_.Increment(end.completion_tokens);
  request_prompt_tokens_.Observe(end.prompt_tokens);
  request_generated_tokens_.Observe(end.completion_tokens);
  e2e_latency_.Observe(absl::ToDoubleSeconds(report.e2e_time));
  queue_time_.Observe(absl::ToDoubleSeconds(report.queue_time));
  if (report.time_to_first_token.has_value()) {
    time_to_first_token_.Observe(absl::ToDoubleSeconds(*report.time_to_first_token));
  }
}

void CoordinatorMetrics::OnStep(const StepReport& report) {
  const std::string replica = ReplicaLabel(report.replica);
  steps_.Add({{"replica", replica}, {"code", absl::StatusCodeToString(report.status.code())}}).Increment();
  step_seconds_.Add({{"replica", replica}}, StepBuckets()).Observe(absl::ToDoubleSeconds(report.duration));
  batch_sequences_.Add({{"replica", replica}}, CountBuckets()).Observe(report.sequences);
  batch_tokens_.Add({{"replica", replica}}, CountBuckets())
      .Observe(static_cast<double>(report.prefill_tokens + report.decode_tokens));
  // Create both phases' series and the replica's preemption counter at once, so that rate() over
  // any of them is defined (0) from the first step rather than absent.
  preemptions_.Add({{"replica", replica}});
  failovers_.Add({{"replica", replica}});
  prefix_cache_queried_.Add({{"replica", replica}});
  prefix_cache_hits_.Add({{"replica", replica}});
  step_tokens_.Add({{"replica", replica}, {"phase", "prefill"}}).Increment(static_cast<double>(report.prefill_tokens));
  step_tokens_.Add({{"replica", replica}, {"phase", "decode"}}).Increment(static_cast<double>(report.decode_tokens));
}

void CoordinatorMetrics::OnPreempted(int replica) {
  preemptions_.Add({{"replica", ReplicaLabel(replica)}}).Increment();
}

void CoordinatorMetrics::OnFailover(int from_replica) {
  failovers_.Add({{"replica", ReplicaLabel(from_replica)}}).Increment();
}

void CoordinatorMetrics::OnPrefixCacheLookup(int replica, int64_t context_tokens, int64_t cached_tokens) {
  const std::string label = ReplicaLabel(replica);
  prefix_cache_queried_.Add({{"replica", label}}).Increment(static_cast<double>(context_tokens));
  prefix_cache_hits_.Add({{"replica", label}}).Increment(static_cast<double>(cached_tokens));
}

}  // namespace shardserve::coordinator

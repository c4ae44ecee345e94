#include "coordinator/sim/simulator.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <queue>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/concurrency/clock.h"
#include "coordinator/planner/planner.h"
#include "coordinator/scheduler/scheduler.h"
#include "coordinator/sim/cost_model.h"
#include "coordinator/sim/pipeline_cost.h"

namespace shardserve::sim {
namespace {

using coordinator::ReplicaOptions;
using coordinator::RequestReport;
using coordinator::Scheduler;
using coordinator::SchedulerObserver;
using coordinator::SchedulerOptions;
using coordinator::SequenceEnd;
using coordinator::SequenceRequest;
using coordinator::SequenceSink;
using coordinator::StepInput;
using coordinator::StepOutput;
using coordinator::StepReport;

// Virtual time, set by the event loop. Atomic because Clock promises thread-safety; the
// simulation itself is single-threaded.
class VirtualClock final : public Clock {
 public:
  absl::Time Now() const override { return kEpoch + absl::Nanoseconds(ns_.load(std::memory_order_relaxed)); }
  void Set(double seconds) { ns_.store(static_cast<int64_t>(std::llround(seconds * 1e9)), std::memory_order_relaxed); }
  double seconds() const { return static_cast<double>(ns_.load(std::memory_order_relaxed)) * 1e-9; }

 private:
  static constexpr absl::Time kEpoch = absl::UnixEpoch();
  std::atomic<int64_t> ns_{0};
};

// What happened to one request.
struct RequestRecord {
  double arrival = 0;
  std::optional<double> first_token, admitted;
  double last_token = 0;
  std::optional<double> end;
  bool ok = false;
  bool rejected = false;
  int64_t tokens = 0;
  std::vector<double> gaps;  // inter-token latencies
};

class Sink final : public SequenceSink {
 public:
  // `stopped`: set when the run stops; ends reported after that (Shutdown) are not recorded.
  // `on_end` (may be empty) runs after the end is recorded (a closed-loop client's next request).
  Sink(RequestRecord* record, const VirtualClock* clock, std::vector<double>* token_times, const bool* stopped,
       std::function<void()> on_end)
      : record_(record), clock_(clock), token_times_(token_times), stopped_(stopped), on_end_(std::move(on_end)) {}
  void OnTokens(absl::Span<const int32_t> tokens, absl::Span<const coordinator::TokenLogprobs> /*logprobs*/) override {
    const double now = clock_->seconds();
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (!record_->first_token.has_value()) {
        record_->first_token = now;
      } else {
        record_->gaps.push_back(now - record_->last_token);
      }
      record_->last_token = now;
      ++record_->tokens;
      token_times_->push_back(now);
    }
  }
  void OnEnd(const SequenceEnd& end) override {
    if (*stopped_) return;
    record_->end = clock_->seconds();
    record_->ok = end.status.ok();
    if (on_end_) on_end_();
  }

 private:
  RequestRecord* record_;
  const VirtualClock* clock_;
  std::vector<double>* token_times_;
  const bool* stopped_;
  std::function<void()> on_end_;
};

class Observer final : public SchedulerObserver {
 public:
  void OnRejected(const absl::Status&) override {}
  void OnInterTokenLatency(absl::Duration) override {}
  void OnRequestEnd(const RequestReport&) override {}
  void OnStep(const StepReport&) override { ++steps; }
  void OnPreempted(int) override { ++preemptions; }
  void OnFailover(int) override { ++failovers; }
  void OnPrefixCacheLookup(int, int64_t, int64_t) override {}
  int64_t steps = 0, preemptions = 0, failovers = 0;
};

// A stage's micro-batch, from start to end (virtual seconds).
struct BusySpan {
  double begin = 0, end = 0;
};

// Seconds of [begin, end) that `spans` cover.
double Overlap(const std::deque<BusySpan>& spans, double begin, double end) {
  double covered = 0;
  for (const BusySpan& s : spans) covered += std::max(0.0, std::min(s.end, end) - std::max(s.begin, begin));
  return covered;
}

// One replica's pipeline: the stages' cost models and when each stage is next free.
struct SimPipeline {
  std::vector<StageCostModel> stages;
  std::vector<double> free_at;
  std::vector<int> host_group;             // per stage: its shared machine (index), or -1
  std::vector<std::deque<BusySpan>> spans;  // per stage in a host group: its micro-batches not yet over
  std::vector<std::deque<uint64_t>> waiting;  // per stage: micro-batches that arrived while it was busy
  std::vector<double> busy;
  std::vector<double> decode_time;
  std::vector<int64_t> decode_steps;
  std::vector<std::string> workers, nodes;
  double first_hop_s = 0;  // coordinator -> stage 0 (token ids: no bulk)
  bool removed = false;
};

// A micro-batch between BeginStep and EndStep.
struct Flight {
  uint64_t step_id = 0;
  double started = 0;  // BeginStep's time
  std::vector<SequenceWork> work;
  int64_t tokens = 0, sampled = 0;
  bool decode_only = true;
  int32_t decode_steps = 1;  // decode steps the call runs (multi-step decoding)
  double compute_s = 0;      // the last stage's compute for the call so far
};

// kStageArrive: a micro-batch reaches a stage (it starts there once the stage is free);
// kStageDone: it leaves a stage (for the next one, or back to the coordinator: kStepDone).
enum class EventKind : uint8_t { kArrival, kStageArrive, kStageDone, kStepDone, kFault };

struct Event {
  double t = 0;
  uint64_t order = 0;
  EventKind kind = EventKind::kArrival;
  int64_t index = 0;  // request (arrival), replica (stage and step events), fault
  size_t stage = 0;     // kStageArrive, kStageDone
  uint64_t flight = 0;  // kStageArrive, kStageDone, kStepDone: the micro-batch (key of `flights`)
  bool operator>(const Event& o) const { return t != o.t ? t > o.t : order > o.order; }
};

LatencySummary Summarize(std::vector<double> v) {
  LatencySummary s;
  s.count = std::ssize(v);
  if (v.empty()) return s;
  s.p50 = Percentile(v, 0.50);
  s.p90 = Percentile(v, 0.90);
  s.p99 = Percentile(v, 0.99);
  double sum = 0;
  for (double x : v) {
    sum += x;
    s.max = std::max(s.max, x);
  }
  s.mean = sum / static_cast<double>(v.size());
  return s;
}

WindowStats Window(const std::vector<RequestRecord>& records, const std::vector<double>& token_times, double begin,
                   double end) {
  WindowStats w{.begin_s = begin, .end_s = end};
  std::vector<double> ttft, itl, e2e;
  for (const RequestRecord& r : records) {
    if (r.arrival < begin || r.arrival >= end) continue;
    ++w.arrived;
    if (r.rejected || (r.end.has_value() && !r.ok)) ++w.failed;
    if (r.end.has_value() && r.ok) {
      ++w.completed;
      e2e.push_back(*r.end - r.arrival);
    }
    if (r.first_token.has_value()) ttft.push_back(*r.first_token - r.arrival);
    itl.insert(itl.end(), r.gaps.begin(), r.gaps.end());
  }
  const auto lo = std::lower_bound(token_times.begin(), token_times.end(), begin);
  const auto hi = std::lower_bound(token_times.begin(), token_times.end(), end);
  if (end > begin) w.output_tokens_per_s = static_cast<double>(hi - lo) / (end - begin);
  w.ttft_s = Summarize(std::move(ttft));
  w.itl_s = Summarize(std::move(itl));
  w.e2e_s = Summarize(std::move(e2e));
  return w;
}

absl::Status ValidateOptions(const SimOptions& o) {
  if (o.max_slots < 1) return absl::InvalidArgumentError(absl::StrCat("max_slots must be >= 1, got ", o.max_slots));
  if (o.kv_block_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("kv_block_size must be >= 1, got ", o.kv_block_size));
  }
  if (o.max_step_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_step_tokens must be >= 1, got ", o.max_step_tokens));
  }
  if (o.pipeline_depth < 0) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline_depth must be >= 0, got ", o.pipeline_depth));
  }
  if (o.decode_steps_per_call < 0 || o.decode_steps_per_call > coordinator::kMaxDecodeStepsPerCall) {
    return absl::InvalidArgumentError(absl::StrCat("decode_steps_per_call must be in [0, ",
                                                   coordinator::kMaxDecodeStepsPerCall, "] (0 = auto), got ",
                                                   o.decode_steps_per_call));
  }
  if (o.max_queued < 0) return absl::InvalidArgumentError(absl::StrCat("max_queued must be >= 0, got ", o.max_queued));
  if (!(o.network.bytes_per_s > 0)) return absl::InvalidArgumentError("network.bytes_per_s must be > 0");
  if (!(o.hop_overhead_s >= 0)) return absl::InvalidArgumentError("hop_overhead_s must be >= 0");
  if (!(o.max_time_s >= 0)) return absl::InvalidArgumentError("max_time_s must be >= 0");
  for (const auto& [name, p] : {std::pair{"cpu_parallelism", o.cpu_parallelism},
                                std::pair{"policy_cpu_parallelism", o.policy_cpu_parallelism}}) {
    if (!(p.memory >= 1) || !(p.compute >= 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " must be >= 1, got memory ", p.memory, " and compute ", p.compute));
    }
  }
  for (const SimFault& f : o.faults) {
    if (!(f.at_s >= 0)) return absl::InvalidArgumentError(absl::StrCat("fault of ", f.worker, ": time must be >= 0"));
  }
  return absl::OkStatus();
}

bool UsesCuda(const StageSpec& s) { return s.device_kind == DeviceKind::kCuda; }

}  // namespace

std::string LayoutName(const Plan& plan) {
  if (plan.replicas.empty()) return "empty";
  std::vector<int> tps;
  bool same = true;
  for (const Pipeline& p : plan.replicas) {
    tps.push_back(p.stages.front().tp);
    for (const StageSpec& s : p.stages) same = same && s.tp == plan.replicas.front().stages.front().tp;
  }
  const size_t pp = plan.replicas.front().stages.size();
  if (same) return absl::StrCat("tp=", tps.front(), " pp=", pp, " replicas=", plan.replicas.size());
  return absl::StrCat("pp=", pp, " replicas=", plan.replicas.size(), " (tp ", absl::StrJoin(tps, ","), ")");
}

absl::StatusOr<SimResult> Simulate(const ModelSpec& spec, const std::vector<WorkerInventory>& workers,
                                   const std::vector<SimRequest>& workload, const SimOptions& options) {
  if (absl::Status st = ValidateOptions(options); !st.ok()) return st;
  if (workload.empty()) return absl::InvalidArgumentError("the workload has no requests");
  absl::StatusOr<Plan> plan = MakePlan(spec, workers, options.policy);
  if (!plan.ok()) return plan.status();
  const int64_t bpp = options.policy.bytes_per_param > 0 ? options.policy.bytes_per_param
                                                         : WeightBytesPerParam(spec, workers);
  const int64_t kvb = options.policy.kv_bytes_per_element > 0
                          ? options.policy.kv_bytes_per_element
                          : KvBytesPerElement(spec, workers, options.policy.kv_cache);

  SimResult result;
  result.plan = *plan;
  result.layout = LayoutName(*plan);
  result.kv_block_size = options.kv_block_size;

  VirtualClock clock;
  Observer observer;
  SchedulerOptions so;
  so.limits = {.vocab_size = spec.vocab_size, .max_seq_len = plan->max_seq_len};
  so.max_step_tokens = options.max_step_tokens;
  so.max_queued = options.max_queued;
  so.observer = &observer;
  so.clock = &clock;
  so.step_driver = coordinator::StepDriver::kCaller;
  so.decode_steps_per_call = options.decode_steps_per_call;
  if (absl::Status st = so.Validate(); !st.ok()) return st;
  Scheduler scheduler(so);

  std::vector<SimPipeline> pipelines;
  for (size_t r = 0; r < plan->replicas.size(); ++r) {
    const Pipeline& p = plan->replicas[r];
    SimPipeline sp;
    for (const StageSpec& s : p.stages) {
      sp.stages.emplace_back(spec, s, UsesCuda(s) ? options.gpu : options.cpu, bpp, kvb);
      sp.workers.push_back(s.worker_id);
      sp.nodes.push_back(s.node_name);
    }
    sp.free_at.assign(p.stages.size(), 0.0);
    sp.busy.assign(p.stages.size(), 0.0);
    sp.decode_time.assign(p.stages.size(), 0.0);
    sp.decode_steps.assign(p.stages.size(), 0);
    sp.first_hop_s = HopSeconds(0, spec.hidden_size, 4, options.network, options.hop_overhead_s);
    // As the coordinator does (coordinator/cluster/cluster.cc).
    absl::StatusOr<int64_t> blocks = PipelineKvBlocks(p, plan->max_seq_len, options.kv_block_size);
    if (!blocks.ok()) return blocks.status();
    const int64_t one_sequence = (plan->max_seq_len + options.kv_block_size - 1) / options.kv_block_size;
    const int64_t kv_blocks = std::max(std::min(*blocks, one_sequence * options.max_slots), one_sequence);
    result.kv_blocks.push_back(kv_blocks);
    const int32_t depth =
        options.pipeline_depth > 0 ? options.pipeline_depth : static_cast<int32_t>(p.stages.size());
    // Auto: the coordinator's pipelining policy over the same profiles (cluster.cc does the same).
    std::shared_ptr<const coordinator::PipelineCostModel> cost;
    if (options.pipeline_depth == 0) {
      const PipelineProfiles profiles{.cpu = options.cpu,
                                      .gpu = options.gpu,
                                      .network = options.network,
                                      .same_node = options.network,
                                      .hop_overhead_s = options.hop_overhead_s,
                                      .cpu_parallelism = options.policy_cpu_parallelism};
      absl::StatusOr<std::unique_ptr<PipelineCost>> made = PipelineCost::Make(spec, p.stages, bpp, kvb, profiles);
      if (!made.ok()) return made.status();
      cost = *std::move(made);
    }
    absl::Status st = scheduler.AddReplica(static_cast<int>(r), nullptr,
                                           ReplicaOptions{.max_slots = options.max_slots,
                                                          .pipeline_depth = depth,
                                                          .pipeline_cost = std::move(cost),
                                                          .kv_blocks = kv_blocks,
                                                          .kv_block_size = options.kv_block_size,
                                                          .prefix_caching = options.prefix_caching,
                                                          .stages = static_cast<int32_t>(p.stages.size())});
    if (!st.ok()) return st;
    pipelines.push_back(std::move(sp));
  }
  // Shared machines: the CPU stages of each node_name, when it has at least two.
  std::vector<std::vector<std::pair<size_t, size_t>>> host_groups;  // (replica, stage) per group
  {
    std::map<std::string, std::vector<std::pair<size_t, size_t>>> by_node;
    for (size_t r = 0; r < plan->replicas.size(); ++r) {
      const Pipeline& p = plan->replicas[r];
      pipelines[r].host_group.assign(p.stages.size(), -1);
      pipelines[r].spans.resize(p.stages.size());
      pipelines[r].waiting.resize(p.stages.size());
      for (size_t k = 0; k < p.stages.size(); ++k) {
        if (!UsesCuda(p.stages[k])) by_node[p.stages[k].node_name].emplace_back(r, k);
      }
    }
    for (auto& [node, members] : by_node) {
      if (members.size() < 2) continue;
      for (const auto& [r, k] : members) pipelines[r].host_group[k] = static_cast<int>(host_groups.size());
      host_groups.push_back(std::move(members));
    }
  }
  // A micro-batch of `work` starting at `start` on stage k of pipeline r: its duration, given what
  // the other stages of its machine have under way then (see the header).
  auto stage_seconds = [&](size_t r, size_t k, absl::Span<const SequenceWork> work, double start) {
    SimPipeline& sp = pipelines[r];
    const StageCostModel& model = sp.stages[k];
    const double alone = model.Cost(work).Total();
    const int g = sp.host_group[k];
    if (g < 0 || alone <= 0) return alone;
    double concurrent = 1;
    for (const auto& [r2, k2] : host_groups[static_cast<size_t>(g)]) {
      if (r2 == r && k2 == k) continue;
      std::deque<BusySpan>& spans = pipelines[r2].spans[k2];
      while (!spans.empty() && spans.front().end <= start) spans.pop_front();
      concurrent += Overlap(spans, start, start + alone) / alone;
    }
    const double seconds =
        concurrent > 1 ? model.Cost(work, ShareOfHost(concurrent, options.cpu_parallelism)).Total() : alone;
    sp.spans[k].push_back({start, start + seconds});
    return seconds;
  };

  std::vector<RequestRecord> records(workload.size());
  std::vector<double> token_times;  // every generated token, in time order
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> events;
  uint64_t order = 0;
  const bool closed = options.closed_loop_clients > 0;
  size_t next_request = 0;  // closed loop: the next request a client sends
  auto arrive = [&](size_t i, double t) {
    records[i].arrival = t;
    events.push(Event{.t = t, .order = order++, .kind = EventKind::kArrival, .index = static_cast<int64_t>(i)});
  };
  // Closed loop: a client whose request ended sends the next one at once.
  auto next_of_client = [&]() {
    if (next_request < workload.size()) arrive(next_request++, clock.seconds());
  };
  if (closed) {
    while (next_request < std::min<size_t>(workload.size(), static_cast<size_t>(options.closed_loop_clients))) {
      arrive(next_request++, 0.0);
    }
  } else {
    for (size_t i = 0; i < workload.size(); ++i) arrive(i, workload[i].arrival_s);
  }
  for (size_t f = 0; f < options.faults.size(); ++f) {
    events.push(Event{.t = options.faults[f].at_s, .order = order++, .kind = EventKind::kFault,
                      .index = static_cast<int64_t>(f)});
  }
  double last_arrival = closed ? 0.0 : workload.back().arrival_s;
  const double stop_at = options.max_time_s > 0 ? options.max_time_s
                         : closed               ? 1e9
                                                : last_arrival * 10 + 600;

  bool stopped = false;
  double kv_use_sum = 0;
  int64_t kv_use_samples = 0;
  std::vector<FaultReport> fault_reports;

  // Micro-batches in flight; a stage starts one when it is free (its time is priced then, so that
  // the stages of a shared machine see each other's work under way).
  std::map<uint64_t, Flight> flights;
  uint64_t next_flight = 0;
  // A call of several decode steps (multi-step decoding) runs them one after the other, each
  // sequence one position further each time.
  auto start_on_stage = [&](size_t r, size_t k, uint64_t id) {
    SimPipeline& sp = pipelines[r];
    Flight& f = flights.at(id);
    const double now = clock.seconds();
    double cost = stage_seconds(r, k, f.work, now);
    std::vector<SequenceWork> later = f.work;
    for (int32_t step = 1; step < f.decode_steps; ++step) {
      for (SequenceWork& w : later) ++w.pos_begin;
      cost += stage_seconds(r, k, later, now + cost);
    }
    sp.free_at[k] = now + cost;
    sp.busy[k] += cost;
    if (f.decode_only) {
      sp.decode_time[k] += cost;
      sp.decode_steps[k] += f.decode_steps;
    }
    if (k + 1 == sp.stages.size()) f.compute_s = cost;
    events.push(Event{.t = now + cost, .order = order++, .kind = EventKind::kStageDone,
                      .index = static_cast<int64_t>(r), .stage = k, .flight = id});
  };
  // Starts every micro-batch the scheduler has ready, on every replica.
  auto pump = [&] {
    const double now = clock.seconds();
    for (int r : scheduler.Replicas()) {
      SimPipeline& sp = pipelines[static_cast<size_t>(r)];
      while (std::optional<StepInput> in = scheduler.BeginStep(r)) {
        Flight f{.step_id = in->step_id, .started = now, .decode_steps = std::max<int32_t>(1, in->decode_steps)};
        f.work.reserve(in->sequences.size());
        for (const auto& s : in->sequences) {
          const int64_t n = std::ssize(s.token_ids);
          f.work.push_back({.pos_begin = s.pos_begin, .tokens = n, .sample = s.sample});
          f.tokens += n;
          f.sampled += s.sample ? 1 : 0;
          f.decode_only = f.decode_only && n == 1 && s.sample && s.sample_index > 0;
        }
        const uint64_t id = next_flight++;
        flights.emplace(id, std::move(f));
        events.push(Event{.t = now + sp.first_hop_s, .order = order++, .kind = EventKind::kStageArrive,
                          .index = r, .stage = 0, .flight = id});
      }
    }
  };

  while (!events.empty()) {
    const Event e = events.top();
    if (e.t > stop_at) break;
    events.pop();
    clock.Set(e.t);
    switch (e.kind) {
      case EventKind::kArrival: {
        const SimRequest& w = workload[static_cast<size_t>(e.index)];
        RequestRecord& rec = records[static_cast<size_t>(e.index)];
        SequenceRequest req;
        req.request_id = absl::StrCat("sim-", e.index);
        req.prompt.resize(static_cast<size_t>(w.prompt_tokens));
        // Distinct prompts: no two requests share a KV block's worth of tokens.
        for (int32_t j = 0; j < w.prompt_tokens; ++j) {
          req.prompt[static_cast<size_t>(j)] = static_cast<int32_t>(
              1 + (static_cast<uint64_t>(e.index) * 131 + static_cast<uint64_t>(j) * 7) %
                      static_cast<uint64_t>(std::max<int64_t>(1, spec.vocab_size - 1)));
        }
        req.max_tokens = w.output_tokens;
        req.ignore_eos = true;
        absl::StatusOr<uint64_t> id = scheduler.Submit(
            std::move(req), std::make_shared<Sink>(&rec, &clock, &token_times, &stopped,
                                                   closed ? std::function<void()>(next_of_client) : nullptr));
        if (!id.ok()) {
          rec.rejected = true;
          if (closed) next_of_client();
        }
        break;
      }
      case EventKind::kStageArrive: {
        SimPipeline& sp = pipelines[static_cast<size_t>(e.index)];
        if (sp.free_at[e.stage] <= e.t && sp.waiting[e.stage].empty()) {
          start_on_stage(static_cast<size_t>(e.index), e.stage, e.flight);
        } else {
          sp.waiting[e.stage].push_back(e.flight);
        }
        break;
      }
      case EventKind::kStageDone: {
        const size_t r = static_cast<size_t>(e.index);
        SimPipeline& sp = pipelines[r];
        if (!sp.waiting[e.stage].empty()) {
          const uint64_t next = sp.waiting[e.stage].front();
          sp.waiting[e.stage].pop_front();
          start_on_stage(r, e.stage, next);
        }
        // The next stage gets the hidden states; the last one returns the sampled ids.
        const bool last = e.stage + 1 == sp.stages.size();
        const double hop = HopSeconds(last ? 0 : flights.at(e.flight).tokens, spec.hidden_size,
                                      sp.stages[e.stage].device().activation_bytes, options.network,
                                      options.hop_overhead_s);
        events.push(Event{.t = e.t + hop, .order = order++,
                          .kind = last ? EventKind::kStepDone : EventKind::kStageArrive, .index = e.index,
                          .stage = last ? 0 : e.stage + 1, .flight = e.flight});
        break;
      }
      case EventKind::kStepDone: {
        SimPipeline& sp = pipelines[static_cast<size_t>(e.index)];
        const auto f = flights.find(e.flight);
        const Flight flight = std::move(f->second);
        flights.erase(f);
        if (sp.removed) break;
        StepOutput out;
        out.token_ids.assign(static_cast<size_t>(flight.sampled * flight.decode_steps), 0);
        // As a worker reports it (StepResponse.compute_us), for the automatic decode steps.
        out.compute_time = absl::Seconds(flight.compute_s);
        scheduler.EndStep(static_cast<int>(e.index), flight.step_id, out, absl::Seconds(e.t - flight.started));
        break;
      }
      case EventKind::kFault: {
        const SimFault& f = options.faults[static_cast<size_t>(e.index)];
        FaultReport fr{.fault = f};
        const int64_t failovers_before = observer.failovers;
        int64_t failed_before = 0;
        for (const RequestRecord& r : records) failed_before += (r.end.has_value() && !r.ok) ? 1 : 0;
        for (size_t r = 0; r < pipelines.size(); ++r) {
          SimPipeline& sp = pipelines[r];
          if (sp.removed) continue;
          const bool hit = std::find(sp.workers.begin(), sp.workers.end(), f.worker) != sp.workers.end() ||
                           std::find(sp.nodes.begin(), sp.nodes.end(), f.worker) != sp.nodes.end();
          if (!hit) continue;
          sp.removed = true;
          fr.replicas_removed.push_back(static_cast<int>(r));
          scheduler.RemoveReplica(static_cast<int>(r),
                                  absl::UnavailableError(absl::StrCat("worker ", f.worker, " failed at ", f.at_s, " s")));
        }
        fr.failovers = observer.failovers - failovers_before;
        int64_t failed_after = 0;
        for (const RequestRecord& r : records) failed_after += (r.end.has_value() && !r.ok) ? 1 : 0;
        fr.failed = failed_after - failed_before;
        std::vector<WorkerInventory> survivors;
        for (const WorkerInventory& w : workers) {
          if (w.worker_id != f.worker && w.node_name != f.worker) survivors.push_back(w);
        }
        absl::StatusOr<Plan> replan = MakePlan(spec, survivors, options.policy);
        fr.replan = replan.ok() ? LayoutName(*replan) : std::string(replan.status().message());
        fault_reports.push_back(std::move(fr));
        break;
      }
    }
    pump();
    if (e.kind == EventKind::kStepDone) {
      for (const auto& rs : scheduler.Stats().replicas) {
        if (rs.kv_blocks_total <= 0) continue;
        const double use = static_cast<double>(rs.kv_blocks_used) / static_cast<double>(rs.kv_blocks_total);
        kv_use_sum += use;
        ++kv_use_samples;
        result.kv_use_peak = std::max(result.kv_use_peak, use);
      }
    }
  }
  const double end_time = clock.seconds();
  stopped = true;
  for (const coordinator::ReplicaStats& r : scheduler.Stats().replicas) {
    result.decode_steps.push_back(absl::StrCat("replica ", r.replica, ": ", r.decode_steps_why));
  }
  for (const RequestRecord& r : records) last_arrival = std::max(last_arrival, r.arrival);
  scheduler.Shutdown(absl::CancelledError("the simulation stopped"));

  // Totals.
  std::vector<double> ttft, itl, e2e, queue;
  int64_t output_tokens = 0;
  double last_end = 0;
  for (const RequestRecord& r : records) {
    ++result.requests;
    if (r.rejected) {
      ++result.rejected;
      continue;
    }
    if (r.first_token.has_value()) ttft.push_back(*r.first_token - r.arrival);
    itl.insert(itl.end(), r.gaps.begin(), r.gaps.end());
    if (r.end.has_value() && r.ok) {
      ++result.completed;
      output_tokens += r.tokens;
      e2e.push_back(*r.end - r.arrival);
      last_end = std::max(last_end, *r.end);
    } else if (r.end.has_value()) {
      ++result.failed;
    } else {
      ++result.unfinished;
    }
  }
  result.duration_s = std::max(last_end, last_arrival);
  if (result.duration_s > 0) {
    result.requests_per_s = static_cast<double>(result.completed) / result.duration_s;
    result.output_tokens_per_s = static_cast<double>(output_tokens) / result.duration_s;
  }
  result.ttft_s = Summarize(std::move(ttft));
  result.itl_s = Summarize(std::move(itl));
  result.e2e_s = Summarize(std::move(e2e));
  result.kv_use_mean = kv_use_samples > 0 ? kv_use_sum / static_cast<double>(kv_use_samples) : 0;
  result.preemptions = observer.preemptions;
  result.failovers = observer.failovers;
  result.steps = observer.steps;
  for (size_t r = 0; r < pipelines.size(); ++r) {
    const SimPipeline& sp = pipelines[r];
    for (size_t k = 0; k < sp.stages.size(); ++k) {
      result.stages.push_back(StageUse{
          .replica = static_cast<int>(r),
          .stage = static_cast<int>(k),
          .busy_fraction = result.duration_s > 0 ? sp.busy[k] / result.duration_s : 0,
          .mean_decode_step_s = sp.decode_steps[k] > 0 ? sp.decode_time[k] / static_cast<double>(sp.decode_steps[k]) : 0});
    }
  }
  // Fault windows: arrivals between consecutive faults.
  std::sort(fault_reports.begin(), fault_reports.end(),
            [](const FaultReport& a, const FaultReport& b) { return a.fault.at_s < b.fault.at_s; });
  const double horizon = std::max(result.duration_s, end_time);
  for (size_t f = 0; f < fault_reports.size(); ++f) {
    const double begin = f == 0 ? 0.0 : fault_reports[f - 1].fault.at_s;
    const double at = fault_reports[f].fault.at_s;
    const double next = f + 1 < fault_reports.size() ? fault_reports[f + 1].fault.at_s : horizon;
    fault_reports[f].before = Window(records, token_times, begin, at);
    fault_reports[f].after = Window(records, token_times, at, std::max(at, next));
  }
  result.faults = std::move(fault_reports);
  return result;
}

}  // namespace shardserve::sim

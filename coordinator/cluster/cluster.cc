#include "coordinator/cluster/cluster.h"

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log/log.h"
#include "common/plan/memory_model.h"
#include "coordinator/planner/planner.h"

namespace shardserve::coordinator {
namespace {

// The KV cache bytes each rank of the stage `a` assigns allocates: its kv_blocks blocks of its
// layers, by the memory model with the formats its engine keeps on its device kind.
int64_t KvBytesPerRank(const ModelSpec& spec, const WorkerAssignment& a) {
  const WeightFormats formats = WorkerWeightFormats(spec, a.device_kind == DeviceKind::kCuda, a.quantize, a.kv_cache);
  const int tp = std::max<int>(1, static_cast<int>(a.devices.size()));
  return a.kv_blocks * KvBytesPerBlock(spec, a.layer_end - a.layer_begin, tp, a.kv_block_size, formats);
}

}  // namespace

int32_t SlotsForKvBlocks(int64_t kv_blocks, int64_t blocks_per_sequence) {
  if (blocks_per_sequence < 1) return 1;
  return static_cast<int32_t>(std::clamp<int64_t>(kv_blocks / blocks_per_sequence, 1, kMaxAutoSlots));
}

absl::Status ClusterOptions::Validate() const {
  if (expected_workers < 1) {
    return absl::InvalidArgumentError(absl::StrCat("expected_workers must be >= 1, got ", expected_workers));
  }
  if (policy.max_seq_len < 1) return absl::InvalidArgumentError("max_seq_len must be resolved (> 0)");
  if (max_slots < 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_slots must be >= 1 (0 = from the KV budget), got ", max_slots));
  }
  if (kv_block_size < 1 || kv_block_size > 65536) {
    return absl::InvalidArgumentError(absl::StrCat("kv_block_size must be in [1, 65536], got ", kv_block_size));
  }
  if (hidden_wire_dtype != DType::kF32 && hidden_wire_dtype != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden_wire_dtype must be F32 or BF16, got ", DTypeName(hidden_wire_dtype)));
  }
  if (max_kv_blocks < 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_kv_blocks must be >= 0 (0 = no cap), got ", max_kv_blocks));
  }
  if (max_step_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_step_tokens must be >= 1, got ", max_step_tokens));
  }
  if (pipeline_depth < 0) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline_depth must be >= 0, got ", pipeline_depth));
  }
  if (absl::Status st = pipelining.Validate(); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("pipelining: ", st.message()));
  }
  if (poll_interval <= absl::ZeroDuration()) return absl::InvalidArgumentError("poll_interval must be > 0");
  return absl::OkStatus();
}

Cluster::Cluster(ClusterOptions options, const ModelSpec* spec, WorkerRegistry* registry, Scheduler* scheduler,
                 WorkerClient* workers, ReplicaClientFactory replica_factory, const Clock* clock)
    : options_(std::move(options)),
      spec_(spec),
      registry_(registry),
      scheduler_(scheduler),
      workers_(workers),
      replica_factory_(std::move(replica_factory)),
      clock_(clock) {
  CHECK(options_.Validate().ok()) << options_.Validate();
  CHECK(spec_ != nullptr && registry_ != nullptr && scheduler_ != nullptr && workers_ != nullptr &&
        replica_factory_ != nullptr && clock_ != nullptr);
}

Cluster::~Cluster() { Stop(); }

void Cluster::Start() {
  absl::MutexLock lock(&mu_);
  if (thread_.joinable() || stop_) return;
  thread_ = std::thread([this] { Loop(); });
}

void Cluster::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void Cluster::Loop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
    }
    const uint64_t seen = registry_->version();
    Tick();
    registry_->WaitForChange(seen, options_.poll_interval);
  }
}

void Cluster::SetReadinessCallback(std::function<void(bool)> callback) {
  absl::MutexLock lock(&mu_);
  on_readiness_ = std::move(callback);
}

absl::Status Cluster::ReadyStatus() const {
  absl::MutexLock lock(&mu_);
  if (ready_) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("the cluster is not ready: ", reason_));
}

absl::Status Cluster::AdmissionStatus() const {
  absl::MutexLock lock(&mu_);
  if (ready_ || (options_.admit_while_recovering && was_ready_)) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("the cluster is not ready: ", reason_));
}

bool Cluster::WaitUntilReady(absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ready_; };
  return mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
}

namespace {

// The host of a "host:port" address ("[::1]:5000" -> "::1"); empty when there is none.
std::string AddressHost(const std::string& address) {
  const size_t colon = address.rfind(':');
  std::string host = address.substr(0, colon == std::string::npos ? address.size() : colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return host;
}

// Gives the stages that run on one machine one node_name (the first such stage's): those with the
// same node_name, or whose workers listen on the same host (shardserve-local names its workers
// local-0, local-1, ... on one machine). `hosts[s]` is stage s's address host.
void NameMachines(std::vector<StageSpec>& stages, const std::vector<std::string>& hosts) {
  const size_t n = stages.size();
  // Each stage takes the lowest index it is (transitively) on one machine with.
  std::vector<size_t> machine(n);
  for (size_t s = 0; s < n; ++s) machine[s] = s;
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t s = 0; s < n; ++s) {
      for (size_t t = 0; t < n; ++t) {
        const bool same = stages[s].node_name == stages[t].node_name || (!hosts[s].empty() && hosts[s] == hosts[t]);
        if (same && machine[t] < machine[s]) {
          machine[s] = machine[t];
          changed = true;
        }
      }
    }
  }
  std::vector<std::string> names(n);
  for (size_t s = 0; s < n; ++s) names[s] = stages[machine[s]].node_name;
  for (size_t s = 0; s < n; ++s) stages[s].node_name = names[s];
}

const WorkerRecord* Find(const std::vector<WorkerRecord>& workers, const std::string& id) {
  for (const WorkerRecord& w : workers) {
    if (w.worker_id == id) return &w;
  }
  return nullptr;
}

}  // namespace

void Cluster::PlanLocked(const std::vector<WorkerRecord>& workers) {
  std::vector<WorkerInventory> inventory;
  std::vector<std::string> ids;
  for (const WorkerRecord& w : workers) {
    if (w.state == WorkerState::kDead) continue;
    inventory.push_back({.worker_id = w.worker_id, .node_name = w.registration.node_name,
                         .devices = w.registration.devices});
    ids.push_back(w.worker_id);
  }
  const std::string key = absl::StrJoin(ids, ",");
  if (key == planned_for_) return;  // this set of workers was already found wanting
  planned_for_ = key;
  absl::StatusOr<Plan> plan = MakePlan(*spec_, inventory, options_.policy);
  if (!plan.ok()) {
    plan_error_ = absl::StrCat("planning failed for workers ", key, ": ", plan.status().ToString());
    LOG(WARNING) << plan_error_;
    return;
  }
  plan_error_.clear();
  const int plan_number = ++plans_made_;
  replicas_.clear();
  for (size_t r = 0; r < plan->replicas.size(); ++r) {
    const Pipeline& p = plan->replicas[r];
    ReplicaState rs;
    absl::StatusOr<int64_t> blocks = PipelineKvBlocks(p, plan->max_seq_len, options_.kv_block_size);
    CHECK(blocks.ok()) << blocks.status();  // the plan and the options were validated
    // No more than max_slots whole sequences can ever use (and no more than --kv_blocks), but
    // always one whole sequence (PipelineKvBlocks guarantees it too).
    const int64_t one_sequence = (plan->max_seq_len + options_.kv_block_size - 1) / options_.kv_block_size;
    const int64_t slots = options_.max_slots > 0 ? options_.max_slots : kMaxAutoSlots;
    rs.kv_blocks = std::min(*blocks, one_sequence * slots);
    rs.blocks_per_sequence = one_sequence;
    if (options_.max_kv_blocks > 0) rs.kv_blocks = std::min(rs.kv_blocks, options_.max_kv_blocks);
    rs.kv_blocks = std::max(rs.kv_blocks, one_sequence);
    for (size_t s = 0; s < p.stages.size(); ++s) {
      const StageSpec& spec = p.stages[s];
      const WorkerRecord* w = Find(workers, spec.worker_id);
      CHECK(w != nullptr) << "the planner returned an unknown worker";
      Stage stage;
      stage.worker_id = spec.worker_id;
      stage.node_name = w->registration.node_name;
      stage.address = w->registration.address;
      stage.devices = w->registration.devices;
      stage.id_base = absl::StrCat("plan-", registry_->incarnation(), "-", plan_number, "/r", r, "/s", s, "/");
      WorkerAssignment& a = stage.assignment;
      a.assignment_id = absl::StrCat(stage.id_base, spec.worker_id);
      a.model_path = options_.model_path;
      a.replica = static_cast<int32_t>(r);
      a.stage = static_cast<int32_t>(s);
      a.num_stages = static_cast<int32_t>(p.stages.size());
      a.layer_begin = spec.layer_begin;
      a.layer_end = spec.layer_end;
      a.device_kind = spec.device_kind;
      a.devices = spec.devices;
      a.kv_blocks = rs.kv_blocks;
      a.kv_block_size = options_.kv_block_size;
      a.max_seq_len = static_cast<int32_t>(plan->max_seq_len);
      a.max_step_tokens = options_.max_step_tokens;
      a.quantize = options_.policy.quantize;
      a.kv_cache = options_.policy.kv_cache;
      a.hidden_wire_dtype = options_.hidden_wire_dtype;
      // The planner's expert placement of the stage's MoE layers; remote experts name their host.
      for (const LayerExperts& le : p.experts) {
        if (le.layer < spec.layer_begin || le.layer >= spec.layer_end) continue;
        LayerExpertPlacement& placement = a.experts.emplace_back();
        placement.layer = le.layer;
        for (const ExpertLocation& loc : le.experts) {
          placement.ranks.push_back(loc.remote ? -1 : loc.rank);
          const WorkerRecord* host = loc.remote ? Find(workers, loc.worker_id) : nullptr;
          CHECK(!loc.remote || host != nullptr) << "the planner returned an unknown expert host";
          placement.addresses.push_back(host != nullptr ? host->registration.address : "");
        }
      }
      rs.stages.push_back(std::move(stage));
    }
    for (size_t s = 0; s + 1 < rs.stages.size(); ++s) rs.stages[s].assignment.next_address = rs.stages[s + 1].address;
    replicas_.push_back(std::move(rs));
  }
  // Expert hosts: each loads the experts spilled to it (once, whichever replicas use them).
  hosts_.clear();
  for (const ExpertHostSpec& eh : plan->expert_hosts) {
    if (!hosts_.empty() && hosts_.back().worker_id == eh.worker_id) continue;  // sorted by worker
    const WorkerRecord* w = Find(workers, eh.worker_id);
    CHECK(w != nullptr) << "the planner returned an unknown expert host";
    Stage host;
    host.worker_id = eh.worker_id;
    host.node_name = w->registration.node_name;
    host.address = w->registration.address;
    host.devices = w->registration.devices;
    host.id_base = absl::StrCat("plan-", registry_->incarnation(), "-", plan_number, "/experts/");
    WorkerAssignment& a = host.assignment;
    a.expert_host = true;
    a.assignment_id = absl::StrCat(host.id_base, eh.worker_id);
    a.model_path = options_.model_path;
    a.device_kind = eh.device_kind;
    a.quantize = options_.policy.quantize;
    a.kv_cache = options_.policy.kv_cache;
    std::set<std::pair<int64_t, int32_t>> seen;
    std::set<int> devices;
    for (const Pipeline& p : plan->replicas) {
      for (const LayerExperts& le : p.experts) {
        for (size_t e = 0; e < le.experts.size(); ++e) {
          const ExpertLocation& loc = le.experts[e];
          if (!loc.remote || loc.worker_id != eh.worker_id) continue;
          if (!seen.insert({le.layer, static_cast<int32_t>(e)}).second) continue;
          a.hosted_experts.push_back({.layer = le.layer, .expert = static_cast<int32_t>(e), .device = loc.device});
          devices.insert(loc.device);
        }
      }
    }
    a.devices.assign(devices.begin(), devices.end());
    hosts_.push_back(std::move(host));
  }
  plan_text_ = PlanToString(*plan);
  // What the workers are told to allocate, which the KV capacity above only bounds.
  for (size_t r = 0; r < plan->replicas.size(); ++r) {
    const int64_t tokens = replicas_[r].kv_blocks * options_.kv_block_size;
    int64_t bytes_per_rank = 0;  // the stage holding the most
    for (const Stage& st : replicas_[r].stages) {
      bytes_per_rank = std::max(bytes_per_rank, KvBytesPerRank(*spec_, st.assignment));
    }
    absl::StrAppend(&plan_text_, "replica ", r, ": KV allocated ", replicas_[r].kv_blocks, " blocks x ",
                    options_.kv_block_size, " tokens = ", tokens, " tokens, up to ", FormatBytes(bytes_per_rank),
                    " per rank (at most ", options_.max_slots > 0 ? options_.max_slots : kMaxAutoSlots,
                    options_.max_slots > 0 ? " sequences (max_slots)" : " sequences (max_slots auto)",
                    " x max_seq_len ", plan->max_seq_len,
                    options_.max_kv_blocks > 0 ? absl::StrCat(", --kv_blocks ", options_.max_kv_blocks) : "",
                    ")\n");
  }
  absl::StrAppend(&plan_text_, HiddenWireLineLocked());
  LOG(INFO) << "plan " << plan_number << " for " << key << ":\n" << plan_text_;
  plan_ = *std::move(plan);
}

namespace {

// Why a worker's held assignment cannot be adopted by a coordinator with `options` (empty: it can).
std::string AdoptionMismatch(const WorkerAssignment& a, const ClusterOptions& options) {
  if (a.model_path != options.model_path) return absl::StrCat("model ", a.model_path, " is not ", options.model_path);
  if (a.quantize != options.policy.quantize) return "its weight quantization differs";
  if (a.expert_host) return "";
  if (a.kv_cache != options.policy.kv_cache) {
    return absl::StrCat("its KV cache dtype ", KvCacheFormatName(a.kv_cache), " is not ",
                        KvCacheFormatName(options.policy.kv_cache));
  }
  if (a.kv_block_size != options.kv_block_size) {
    return absl::StrCat("kv_block_size ", a.kv_block_size, " is not ", options.kv_block_size);
  }
  if (a.hidden_wire_dtype != options.hidden_wire_dtype) {
    // Planned afresh: the new assignments keep the loaded weights (Worker.Assign).
    return absl::StrCat("its hidden states travel as ", DTypeName(a.hidden_wire_dtype), ", not ",
                        DTypeName(options.hidden_wire_dtype));
  }
  if (a.max_seq_len != options.policy.max_seq_len) {
    return absl::StrCat("max_seq_len ", a.max_seq_len, " is not ", options.policy.max_seq_len);
  }
  if (a.max_step_tokens != options.max_step_tokens) {
    return absl::StrCat("max_step_tokens ", a.max_step_tokens, " is not ", options.max_step_tokens);
  }
  const int64_t one_sequence = (a.max_seq_len + a.kv_block_size - 1) / std::max(a.kv_block_size, 1);
  if (a.kv_blocks < one_sequence || (options.max_kv_blocks > 0 && a.kv_blocks > options.max_kv_blocks)) {
    return absl::StrCat("kv_blocks ", a.kv_blocks, " is not in [", one_sequence, ", ",
                        options.max_kv_blocks > 0 ? absl::StrCat(options.max_kv_blocks) : "inf", "]");
  }
  if (options.policy.tp > 0 && static_cast<int>(a.devices.size()) != options.policy.tp) {
    return absl::StrCat("tp ", a.devices.size(), " is not ", options.policy.tp);
  }
  if (options.policy.pp > 0 && a.num_stages != options.policy.pp) {
    return absl::StrCat("pp ", a.num_stages, " is not ", options.policy.pp);
  }
  return "";
}

}  // namespace

std::string Cluster::HiddenWireLineLocked() const {
  const bool hops = !hosts_.empty() || std::any_of(replicas_.begin(), replicas_.end(),
                                                   [](const ReplicaState& r) { return r.stages.size() > 1; });
  if (!hops) return "";
  const bool bf16 = options_.hidden_wire_dtype == DType::kBF16;
  return absl::StrCat("hidden states between stages: ",
                      bf16 ? "bf16 (half the bytes; each value rounded once per hop)" : "f32 (exact)",
                      ", --hidden_wire_dtype\n");
}

bool Cluster::AdoptLocked(const std::vector<WorkerRecord>& workers) {
  // What the live workers serve, by the replica number they were told.
  // Tried once per set of live workers and what they hold (the planner may fail too, and the loop
  // comes back every poll interval).
  std::string key;
  for (const WorkerRecord& w : workers) {
    if (w.state != WorkerState::kDead) absl::StrAppend(&key, w.worker_id, "=", w.assignment_id, ";");
  }
  if (key == adoption_tried_for_) return false;
  adoption_tried_for_ = key;
  std::map<int32_t, std::vector<const WorkerRecord*>> by_replica;
  std::map<std::string, const WorkerRecord*> hosts_by_address;
  int holding = 0;
  for (const WorkerRecord& w : workers) {
    if (w.state == WorkerState::kDead || !w.registration.held.has_value()) continue;
    const WorkerAssignment& a = *w.registration.held;
    // READY, or still LOADING it (the coordinator went away while it loaded): the stage serves once
    // READY, as a freshly assigned one would, without the load starting over.
    const bool holds = w.state == WorkerState::kReady || w.state == WorkerState::kLoading;
    if (!holds || w.assignment_id != a.assignment_id) continue;
    ++holding;
    if (std::string why = AdoptionMismatch(a, options_); !why.empty()) {
      LOG(INFO) << "not adopting " << a.assignment_id << " of worker " << w.worker_id << ": " << why;
      continue;
    }
    if (a.expert_host) {
      hosts_by_address[w.registration.address] = &w;
    } else {
      by_replica[a.replica].push_back(&w);
    }
  }
  if (holding == 0) return false;
  // Complete replicas only: stages 0..n-1 once each, contiguous layers covering the model, each
  // sending to the next one's address, remote experts on adopted hosts.
  std::vector<std::vector<const WorkerRecord*>> complete;
  std::set<std::string> used_hosts;
  for (auto& [replica, stages] : by_replica) {
    std::sort(stages.begin(), stages.end(), [](const WorkerRecord* a, const WorkerRecord* b) {
      return a->registration.held->stage < b->registration.held->stage;
    });
    std::string why;
    std::set<std::string> hosts;
    for (size_t s = 0; s < stages.size() && why.empty(); ++s) {
      const WorkerAssignment& a = *stages[s]->registration.held;
      const bool last = s + 1 == stages.size();
      if (a.stage != static_cast<int32_t>(s) || a.num_stages != static_cast<int32_t>(stages.size())) {
        why = absl::StrCat("stage ", s, " of ", stages.size(), " is missing or held twice");
      } else if (a.layer_begin != (s == 0 ? 0 : stages[s - 1]->registration.held->layer_end) ||
                 (last && a.layer_end != spec_->num_layers)) {
        why = absl::StrCat("its layer ranges do not cover the model's ", spec_->num_layers, " layers");
      } else if (a.next_address != (last ? "" : stages[s + 1]->registration.address)) {
        why = absl::StrCat("stage ", s, " sends to ", a.next_address, ", not to stage ", s + 1);
      } else if (a.kv_blocks != stages[0]->registration.held->kv_blocks) {
        why = "its stages hold different KV cache sizes";
      }
      for (const LayerExpertPlacement& le : a.experts) {
        for (const std::string& address : le.addresses) {
          if (address.empty()) continue;
          if (!hosts_by_address.contains(address)) why = absl::StrCat("expert host ", address, " is not adoptable");
          hosts.insert(address);
        }
      }
    }
    if (!why.empty()) {
      LOG(INFO) << "not adopting replica " << replica << ": " << why;
      continue;
    }
    used_hosts.insert(hosts.begin(), hosts.end());
    complete.push_back(stages);
  }
  if (complete.empty() ||
      (options_.policy.replicas > 0 && static_cast<int>(complete.size()) != options_.policy.replicas)) {
    LOG(INFO) << "the workers hold " << complete.size() << " complete replica(s) this coordinator can adopt"
              << (options_.policy.replicas > 0 ? absl::StrCat(" (--replicas ", options_.policy.replicas, ")") : "")
              << ": planning afresh";
    return false;
  }
  const int plan_number = ++plans_made_;
  replicas_.clear();
  hosts_.clear();
  plan_text_ = absl::StrCat("adopted from the workers' reports (plan ", plan_number, "; nothing reloaded)\n");
  auto make_stage = [&](const WorkerRecord& w, std::string id_base) {
    Stage stage;
    stage.worker_id = w.worker_id;
    stage.node_name = w.registration.node_name;
    stage.address = w.registration.address;
    stage.devices = w.registration.devices;
    stage.id_base = std::move(id_base);
    stage.assignment = *w.registration.held;  // its id too: the worker is READY for it already
    stage.assigned = true;
    return stage;
  };
  for (size_t r = 0; r < complete.size(); ++r) {
    ReplicaState rs;
    rs.kv_blocks = complete[r].front()->registration.held->kv_blocks;
    rs.blocks_per_sequence = (options_.policy.max_seq_len + options_.kv_block_size - 1) / options_.kv_block_size;
    for (size_t s = 0; s < complete[r].size(); ++s) {
      const WorkerRecord& w = *complete[r][s];
      Stage stage =
          make_stage(w, absl::StrCat("plan-", registry_->incarnation(), "-", plan_number, "/r", r, "/s", s, "/"));
      stage.assignment.replica = static_cast<int32_t>(r);  // the worker may know it by another number
      absl::StrAppend(&plan_text_, "replica ", r, " stage ", s, ": worker ", w.worker_id, " at ",
                      w.registration.address, ", layers [", stage.assignment.layer_begin, ", ",
                      stage.assignment.layer_end, "), ", stage.assignment.devices.size(), " ",
                      DeviceKindName(stage.assignment.device_kind), " device(s), ", rs.kv_blocks, " KV blocks (",
                      FormatBytes(KvBytesPerRank(*spec_, stage.assignment)), " per rank)\n");
      rs.stages.push_back(std::move(stage));
    }
    replicas_.push_back(std::move(rs));
  }
  for (const std::string& address : used_hosts) {
    const WorkerRecord& w = *hosts_by_address.at(address);
    hosts_.push_back(make_stage(w, absl::StrCat("plan-", registry_->incarnation(), "-", plan_number, "/experts/")));
    absl::StrAppend(&plan_text_, "expert host: worker ", w.worker_id, " at ", address, ", ",
                    w.registration.held->hosted_experts.size(), " experts\n");
  }
  absl::StrAppend(&plan_text_, HiddenWireLineLocked());
  LOG(INFO) << "event=adopted plan=" << plan_number << " replicas=" << replicas_.size() << "\n" << plan_text_;
  plan_error_.clear();
  plan_ = Plan{};
  return true;
}

void Cluster::VacateLocked(const std::string& worker_id) {
  for (ReplicaState& rs : replicas_) {
    for (Stage& stage : rs.stages) {
      if (stage.worker_id != worker_id) continue;
      // No worker: a spare (or a restart at the same node and address) takes it in step 2.
      stage.worker_id.clear();
      stage.assigned = false;
      stage.assign_error.clear();
    }
  }
}

void Cluster::RetargetLocked(Stage& stage, const WorkerRecord& w) {
  stage.worker_id = w.worker_id;
  stage.node_name = w.registration.node_name;
  stage.address = w.registration.address;
  // A new id whenever what the stage must hold changes, so that a heartbeat about the old one is
  // never taken for the new one.
  stage.assignment.assignment_id = absl::StrCat(stage.id_base, w.worker_id, "#", ++revision_);
  stage.assigned = false;
  stage.assign_error.clear();
  stage.next_attempt = absl::InfinitePast();
}

bool Cluster::CanTake(const Stage& stage, const WorkerRecord& w) {
  const DeviceKind kind = stage.assignment.device_kind;
  for (int index : stage.assignment.devices) {
    int64_t planned = 0;
    for (const Device& d : stage.devices) {
      if (d.kind == kind && d.index == index) planned = d.total_bytes;
    }
    bool has = false;
    for (const Device& d : w.registration.devices) has |= d.kind == kind && d.index == index && d.total_bytes >= planned;
    if (!has) return false;
  }
  return true;
}

std::string Cluster::StageProblem(const Stage& stage, const WorkerRecord* w, bool* settled) const {
  const std::string& id = stage.worker_id;
  *settled = true;
  if (id.empty()) return "a stage has no worker (its worker was drained; waiting for a spare)";
  if (w == nullptr) return absl::StrCat("worker ", id, " is gone (it registered again or was forgotten)");
  if (w->state == WorkerState::kDead) return absl::StrCat("worker ", id, " is dead: ", w->error);
  if (!stage.assigned) {
    if (!stage.assign_error.empty()) return absl::StrCat("assigning worker ", id, " failed: ", stage.assign_error);
    *settled = false;
    return absl::StrCat("worker ", id, " is being assigned");
  }
  if (w->assignment_id == stage.assignment.assignment_id) {
    switch (w->state) {
      case WorkerState::kReady: return "";
      case WorkerState::kFailed: return absl::StrCat("worker ", id, " failed to load: ", w->error);
      case WorkerState::kLoading:
      case WorkerState::kIdle:
      case WorkerState::kDead: break;
    }
  }
  *settled = false;
  return absl::StrCat("worker ", id, " is loading");
}

void Cluster::Tick() {
  absl::MutexLock tick(&tick_mu_);
  registry_->SweepDead();
  const std::vector<WorkerRecord> workers = registry_->List();
  const absl::Time now = clock_->Now();
  if (!EnsurePlan(workers)) return;
  AdvanceDrains(now);
  ReconcileStages(workers, now);
  UpdateServingReplicas(workers);
  UpdateReadiness(workers);
}

bool Cluster::EnsurePlan(const std::vector<WorkerRecord>& workers) {
  absl::MutexLock lock(&mu_);
  if (plan_.has_value()) return true;
  int alive = 0;
  for (const WorkerRecord& w : workers) alive += w.state != WorkerState::kDead ? 1 : 0;
  if (alive < options_.expected_workers) {
    reason_ = absl::StrCat("waiting for workers: ", alive, " of ", options_.expected_workers, " registered");
    return false;
  }
  if (!AdoptLocked(workers)) PlanLocked(workers);
  if (plan_.has_value()) return true;
  reason_ = plan_error_;
  return false;
}

void Cluster::AdvanceDrains(absl::Time now) {
  struct DrainJob {
    std::string worker_id;
    int replica;
    bool start, expired;
  };
  std::vector<DrainJob> drains;
  {
    absl::MutexLock lock(&mu_);
    // Which drains can start or end (their scheduler calls happen below, without the lock).
    for (auto& [id, d] : draining_) {
      if (d.done) continue;
      int replica = -1;
      for (size_t r = 0; r < replicas_.size() && replica < 0; ++r) {
        for (const Stage& stage : replicas_[r].stages) replica = stage.worker_id == id ? static_cast<int>(r) : replica;
      }
      if (replica >= 0 && replicas_[static_cast<size_t>(replica)].serving) {
        drains.push_back({id, replica, !d.started, now >= d.deadline});
        d.started = true;
        continue;
      }
      VacateLocked(id);  // not serving (or in no stage): nothing runs there
      d.done = true;
    }
  }
  for (const DrainJob& job : drains) {
    if (job.start) scheduler_->DrainReplica(job.replica);
    const SchedulerStats stats = scheduler_->Stats();
    bool others = false;
    int64_t left = 0;
    for (const ReplicaStats& rs : stats.replicas) {
      if (rs.replica == job.replica) left = rs.running + rs.waiting;
      others |= rs.replica != job.replica && !rs.draining;
    }
    if (!others && left > 0 && !job.expired) continue;  // its sequences run on
    LOG(INFO) << "event=drained worker=" << job.worker_id << " replica=" << job.replica << " sequences_left=" << left
              << (others ? " (moved to another replica)" : job.expired ? " (timeout: they wait for a replica)" : "");
    scheduler_->RemoveReplica(job.replica,
                              absl::UnavailableError(absl::StrCat("replica ", job.replica, " stopped serving: worker ",
                                                                  job.worker_id, " was drained")));
    absl::MutexLock lock(&mu_);
    replicas_[static_cast<size_t>(job.replica)].serving = false;
    VacateLocked(job.worker_id);
    draining_[job.worker_id].done = true;
  }
}

void Cluster::ReconcileStages(const std::vector<WorkerRecord>& workers, absl::Time now) {
  struct AssignJob {
    size_t replica, stage;
    std::string worker_id, address;
    WorkerAssignment assignment;
  };
  std::vector<AssignJob> jobs;
  struct ReleaseJob {
    std::string worker_id, address, assignment_id;
  };
  std::vector<ReleaseJob> releases;
  {
    absl::MutexLock lock(&mu_);
    // A stage whose worker is dead or gone goes back to that worker when it has restarted
    // (same node and address, new id, whatever state it reports), or else to a spare (an idle
    // worker in no stage that has the stage's devices). Expert hosts count as replica
    // replicas_.size(), so that they are assigned with (and before serving starts for) every
    // replica; only their own worker takes them back. Then send the assignments not yet accepted.
    std::set<std::string> in_plan;
    for (const ReplicaState& rs : replicas_) {
      for (const Stage& stage : rs.stages) in_plan.insert(stage.worker_id);
    }
    for (const Stage& host : hosts_) in_plan.insert(host.worker_id);
    for (size_t r = 0; r <= replicas_.size(); ++r) {
      std::vector<Stage>& stages = r < replicas_.size() ? replicas_[r].stages : hosts_;
      for (size_t s = 0; s < stages.size(); ++s) {
        Stage& stage = stages[s];
        const WorkerRecord* w = Find(workers, stage.worker_id);
        if (w == nullptr || w->state == WorkerState::kDead) {
          const WorkerRecord* pick = nullptr;
          for (const WorkerRecord& c : workers) {
            if (c.state != WorkerState::kDead && !in_plan.contains(c.worker_id) && !draining_.contains(c.worker_id) &&
                c.registration.node_name == stage.node_name && c.registration.address == stage.address) {
              pick = &c;
              break;
            }
          }
          const bool restarted = pick != nullptr;
          for (size_t i = 0; pick == nullptr && r < replicas_.size() && i < workers.size(); ++i) {
            const WorkerRecord& c = workers[i];
            if (c.state == WorkerState::kIdle && !in_plan.contains(c.worker_id) && !draining_.contains(c.worker_id) &&
                CanTake(stage, c)) {
              pick = &c;
            }
          }
          if (pick != nullptr) {
            LOG(INFO) << "worker " << pick->worker_id << (restarted ? " (restarted) replaces " : " (a spare) replaces ")
                      << stage.worker_id << " as "
                      << (r < replicas_.size() ? absl::StrCat("replica ", r, " stage ", s) : "expert host");
            const std::string old_address = stage.address;
            in_plan.erase(stage.worker_id);
            in_plan.insert(pick->worker_id);
            RetargetLocked(stage, *pick);
            w = pick;
            if (r < replicas_.size() && s > 0 && stage.address != old_address) {
              // The previous stage sends to the new address: it is assigned again.
              Stage& prev = stages[s - 1];
              prev.assignment.next_address = stage.address;
              if (const WorkerRecord* pw = Find(workers, prev.worker_id); pw != nullptr) {
                RetargetLocked(prev, *pw);
                if (pw->state != WorkerState::kDead) jobs.push_back({r, s - 1, prev.worker_id, prev.address, prev.assignment});
              } else {
                prev.assignment.assignment_id = absl::StrCat(prev.id_base, prev.worker_id, "#", ++revision_);
                prev.assigned = false;
              }
            }
          }
        }
        if (w != nullptr && w->state != WorkerState::kDead && !stage.assigned && now >= stage.next_attempt) {
          jobs.push_back({r, s, stage.worker_id, stage.address, stage.assignment});
        }
      }
    }
    // Reconciliation: live workers in no stage that hold (or load) an assignment drop it.
    for (const WorkerRecord& w : workers) {
      if (w.state == WorkerState::kDead || w.state == WorkerState::kIdle || in_plan.contains(w.worker_id)) continue;
      absl::Time& next = released_[w.worker_id];
      if (now < next) continue;
      next = now + options_.assign_retry;
      releases.push_back({w.worker_id, w.registration.address, w.assignment_id});
    }
    std::erase_if(released_, [&](const auto& e) {
      const WorkerRecord* w = Find(workers, e.first);
      return w == nullptr || w->state == WorkerState::kDead || w->state == WorkerState::kIdle;
    });
    std::erase_if(draining_, [&](const auto& e) {
      const WorkerRecord* w = Find(workers, e.first);
      return w == nullptr || w->state == WorkerState::kDead;
    });
  }
  for (const ReleaseJob& job : releases) {
    LOG(INFO) << "worker " << job.worker_id << " at " << job.address << " holds "
              << (job.assignment_id.empty() ? "an assignment" : job.assignment_id)
              << ", which is no stage of the plan: releasing it";
    const absl::Status st = workers_->Release(job.address, "it holds no stage of the coordinator's plan");
    if (!st.ok()) LOG(WARNING) << "releasing worker " << job.worker_id << " failed: " << st;
  }
  for (AssignJob& job : jobs) {
    LOG(INFO) << "assigning " << job.assignment.assignment_id << " ("
              << (job.assignment.expert_host
                      ? absl::StrCat(job.assignment.hosted_experts.size(), " experts")
                      : absl::StrCat("layers [", job.assignment.layer_begin, ", ", job.assignment.layer_end, ")"))
              << ") to worker " << job.worker_id << " at " << job.address;
    const absl::Status st = workers_->Assign(job.address, job.assignment);
    if (!st.ok()) LOG(WARNING) << "assigning worker " << job.worker_id << " failed: " << st;
    absl::MutexLock lock(&mu_);
    Stage& stage = job.replica < replicas_.size() ? replicas_[job.replica].stages[job.stage] : hosts_[job.stage];
    if (stage.worker_id != job.worker_id) continue;
    stage.assigned = st.ok();
    stage.assign_error = st.ok() ? "" : st.ToString();
    stage.next_attempt = clock_->Now() + options_.assign_retry;
  }
}

absl::StatusOr<std::shared_ptr<const PipelineCostModel>> Cluster::PipelineCostFor(const ReplicaEndpoint& e) const {
  // The bytes the workers hold per weight and KV element, as the planner resolves them for these
  // workers' devices.
  std::vector<WorkerInventory> inventory;
  for (const StageSpec& s : e.stages) {
    WorkerInventory w{.worker_id = s.worker_id, .node_name = s.node_name};
    for (int d : s.devices) w.devices.push_back(Device{.kind = s.device_kind, .index = d});
    inventory.push_back(std::move(w));
  }
  const PlanPolicy& policy = options_.policy;
  const int64_t bpp = policy.quantize == Quantization::kInt8 ? 1
                      : policy.bytes_per_param > 0           ? policy.bytes_per_param
                                                             : WeightBytesPerParam(*spec_, inventory);
  const int64_t kvb = policy.kv_bytes_per_element > 0 ? policy.kv_bytes_per_element
                                                       : KvBytesPerElement(*spec_, inventory, policy.kv_cache);
  absl::StatusOr<std::unique_ptr<sim::PipelineCost>> cost =
      sim::PipelineCost::Make(*spec_, e.stages, bpp, kvb, options_.pipelining);
  if (!cost.ok()) return cost.status();
  return std::shared_ptr<const PipelineCostModel>(*std::move(cost));
}

void Cluster::UpdateServingReplicas(const std::vector<WorkerRecord>& workers) {
  // Replicas whose stages are all READY serve; the others do not.
  struct Change {
    int replica;
    bool add;
    ReplicaEndpoint endpoint;
    std::string reason;
  };
  std::vector<Change> changes;
  {
    absl::MutexLock lock(&mu_);
    for (size_t r = 0; r < replicas_.size(); ++r) {
      ReplicaState& rs = replicas_[r];
      std::vector<std::string> problems;
      ReplicaEndpoint endpoint{.replica = static_cast<int>(r),
                               .max_slots = options_.max_slots,
                               .kv_blocks = rs.kv_blocks,
                               .kv_block_size = options_.kv_block_size};
      for (const Stage& stage : rs.stages) {
        const WorkerRecord* w = Find(workers, stage.worker_id);
        bool settled = false;
        std::string problem = StageProblem(stage, w, &settled);
        if (!problem.empty()) problems.push_back(std::move(problem));
        // The block ids are shared by every stage: the replica has what its smallest stage reports.
        if (w != nullptr && w->kv_blocks > 0) endpoint.kv_blocks = std::min(endpoint.kv_blocks, w->kv_blocks);
        endpoint.worker_ids.push_back(stage.worker_id);
        const WorkerAssignment& a = stage.assignment;
        endpoint.stages.push_back(StageSpec{.worker_id = stage.worker_id,
                                            .node_name = w != nullptr ? w->registration.node_name : stage.node_name,
                                            .layer_begin = a.layer_begin,
                                            .layer_end = a.layer_end,
                                            .has_embedding = endpoint.stages.empty(),
                                            .has_lm_head = endpoint.stages.size() + 1 == rs.stages.size(),
                                            .tp = std::max(1, static_cast<int>(a.devices.size())),
                                            .device_kind = a.device_kind,
                                            .devices = a.devices});
      }
      // Sized from the KV cache the replica really has (its smallest stage's).
      if (options_.max_slots == 0) endpoint.max_slots = SlotsForKvBlocks(endpoint.kv_blocks, rs.blocks_per_sequence);
      for (const Stage& host : hosts_) {
        bool settled = false;
        std::string problem = StageProblem(host, Find(workers, host.worker_id), &settled);
        if (!problem.empty()) problems.push_back(absl::StrCat("expert host: ", problem));
      }
      endpoint.stage0_address = rs.stages.front().address;
      endpoint.last_address = rs.stages.back().address;
      std::vector<std::string> hosts;
      for (const Stage& stage : rs.stages) hosts.push_back(AddressHost(stage.address));
      NameMachines(endpoint.stages, hosts);
      if (problems.empty() && !rs.serving) changes.push_back({endpoint.replica, true, endpoint, ""});
      if (!problems.empty() && rs.serving) {
        changes.push_back({endpoint.replica, false, endpoint,
                           absl::StrCat("replica ", r, " stopped serving: ", absl::StrJoin(problems, "; "))});
      }
    }
  }
  for (Change& c : changes) {
    if (!c.add) {
      scheduler_->RemoveReplica(c.replica, absl::UnavailableError(c.reason));
    } else {
      absl::StatusOr<std::unique_ptr<ReplicaClient>> client = replica_factory_(c.endpoint);
      const int32_t depth = options_.pipeline_depth > 0 ? options_.pipeline_depth
                                                        : static_cast<int32_t>(c.endpoint.worker_ids.size());
      std::shared_ptr<const PipelineCostModel> cost;
      if (options_.pipeline_depth == 0) {
        absl::StatusOr<std::shared_ptr<const PipelineCostModel>> made = PipelineCostFor(c.endpoint);
        if (made.ok()) {
          cost = *std::move(made);
        } else {
          // Not fatal: the replica pipelines to its stage count, as without a policy.
          LOG(WARNING) << "replica " << c.replica << ": no pipelining cost model (" << made.status()
                       << "); up to " << depth << " micro-batches in flight";
        }
      }
      absl::Status st = client.ok() ? scheduler_->AddReplica(c.replica, *std::move(client),
                                                             {.max_slots = c.endpoint.max_slots,
                                                              .pipeline_depth = depth,
                                                              .pipeline_cost = std::move(cost),
                                                              .kv_blocks = c.endpoint.kv_blocks,
                                                              .kv_block_size = c.endpoint.kv_block_size,
                                                              .prefix_caching = options_.prefix_caching,
                                                              .stages = static_cast<int32_t>(c.endpoint.worker_ids.size())})
                                    : client.status();
      if (!st.ok()) {
        LOG(WARNING) << "replica " << c.replica << " cannot serve: " << st;
        continue;
      }
      LOG(INFO) << "replica " << c.replica << " serving (stage 0 at " << c.endpoint.stage0_address << ", "
                << c.endpoint.kv_blocks << " KV blocks of " << c.endpoint.kv_block_size << " tokens, at most "
                << c.endpoint.max_slots << " sequences at once)";
    }
    absl::MutexLock lock(&mu_);
    replicas_[static_cast<size_t>(c.replica)].serving = c.add;
  }
}

void Cluster::UpdateReadiness(const std::vector<WorkerRecord>& workers) {
  std::function<void(bool)> notify;
  bool ready_now = false;
  bool changed = false;
  std::string new_reason;
  {
    absl::MutexLock lock(&mu_);
    int serving = 0;
    int stages = 0, stages_ready = 0;
    bool all_settled = true;
    std::vector<std::string> problems;
    for (size_t r = 0; r <= replicas_.size(); ++r) {
      if (r < replicas_.size()) serving += replicas_[r].serving ? 1 : 0;
      for (const Stage& stage : r < replicas_.size() ? replicas_[r].stages : hosts_) {
        bool settled = false;
        std::string problem = StageProblem(stage, Find(workers, stage.worker_id), &settled);
        all_settled &= settled;
        ++stages;
        stages_ready += problem.empty() ? 1 : 0;
        if (!problem.empty()) problems.push_back(std::move(problem));
      }
    }
    if (all_settled && serving > 0) was_ready_ = true;
    const bool ready = was_ready_ && serving > 0;
    const std::string details = absl::StrJoin(problems, "; ");
    if (ready) {
      new_reason = details;
    } else if (all_settled) {
      new_reason = absl::StrCat("no replica can serve: ", details);
    } else {
      new_reason = absl::StrCat("loading: ", stages_ready, " of ", stages, " workers ready (", details, ")");
    }
    if (ready == ready_) {
      reason_ = new_reason;
    } else {
      notify = on_readiness_;
      ready_now = ready;
      changed = true;
      LOG(INFO) << (ready ? "cluster ready" : "cluster not ready: ") << (ready ? "" : new_reason);
    }
  }
  if (!changed) return;
  // The callback (the health service) hears of the change before readers of ready_ do, so that
  // whoever sees ReadyStatus() OK also sees SERVING.
  if (notify) notify(ready_now);
  absl::MutexLock lock(&mu_);
  ready_ = ready_now;
  reason_ = new_reason;
}

absl::Status Cluster::Drain(const std::string& worker_id, absl::Duration timeout) {
  if (timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("the drain timeout must be > 0, got ", absl::FormatDuration(timeout)));
  }
  const std::optional<WorkerRecord> w = registry_->Get(worker_id);
  if (!w.has_value()) return absl::NotFoundError(absl::StrCat("no worker ", worker_id, " is registered"));
  if (w->state == WorkerState::kDead) {
    return absl::FailedPreconditionError(absl::StrCat("worker ", worker_id, " is dead: nothing to drain"));
  }
  {
    absl::MutexLock lock(&mu_);
    for (const Stage& host : hosts_) {
      if (host.worker_id == worker_id) {
        return absl::FailedPreconditionError(
            absl::StrCat("worker ", worker_id, " is an expert host: expert hosts cannot be drained (yet)"));
      }
    }
    if (draining_.contains(worker_id)) return absl::OkStatus();
    draining_[worker_id] = DrainState{.deadline = clock_->Now() + timeout};
  }
  LOG(INFO) << "event=drain worker=" << worker_id << " timeout=" << absl::FormatDuration(timeout);
  return absl::OkStatus();
}

int Cluster::PlansMade() const {
  absl::MutexLock lock(&mu_);
  return plans_made_;
}

ClusterView Cluster::View() {
  const std::vector<WorkerRecord> workers = registry_->List();
  absl::MutexLock lock(&mu_);
  ClusterView view;
  view.ready = ready_;
  view.reason = reason_;
  view.plan = plan_text_;
  for (const WorkerRecord& w : workers) {
    ClusterWorkerView v{.record = w, .draining = draining_.contains(w.worker_id)};
    auto take = [&](const Stage& stage) {
      if (stage.worker_id != w.worker_id) return;
      v.assignment = stage.assignment;
      v.assign_error = stage.assign_error;
    };
    for (const ReplicaState& rs : replicas_) {
      for (const Stage& stage : rs.stages) take(stage);
    }
    for (const Stage& host : hosts_) take(host);
    view.workers.push_back(std::move(v));
  }
  for (size_t r = 0; r < replicas_.size(); ++r) {
    if (replicas_[r].serving) view.serving_replicas.push_back(static_cast<int>(r));
  }
  return view;
}

}  // namespace shardserve::coordinator

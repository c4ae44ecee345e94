#include "coordinator/planner/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/plan/memory_model.h"
#include "common/status/macros.h"

namespace shardserve {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
// Stage costs are shares of the model (about 1/pp each); differences below this are rounding.
constexpr double kCostEps = 1e-9;
// Models above this many bytes are refused before any int64 arithmetic could overflow.
constexpr double kMaxModelBytes = 1e18;
constexpr int64_t kMaxKvTokens = int64_t{1} << 40;

// ---- Model accounting --------------------------------------------------------------------------

// Unsharded parameter counts, used for the cost model (see planner.h).
struct Params {
  std::vector<int64_t> layer;         // held by the layer (all experts)
  std::vector<int64_t> layer_active;  // read / multiplied per token (top_k experts)
  int64_t embedding = 0;
  int64_t head = 0;  // final norm + lm_head matrix (as if untied)
};

Params CountParams(const ModelSpec& s) {
  const int64_t h = s.hidden_size;
  const int64_t attn = s.AttentionParameters();
  const int64_t dense = 3 * h * s.intermediate_size + (s.mlp_bias ? 2 * s.intermediate_size + h : 0);
  const int64_t expert = 3 * h * s.moe.expert_intermediate_size;
  const int64_t shared = s.moe.shared_expert_intermediate_size > 0
                             ? 3 * h * s.moe.shared_expert_intermediate_size + (s.moe.shared_expert_gate ? h : 0)
                             : 0;
  // The router, and DeepSeek-V3's score-correction bias.
  const int64_t router = s.moe.num_experts * (h + (s.moe.scoring == MoeScoring::kSigmoidGrouped ? 1 : 0));
  Params p;
  for (int64_t l = 0; l < s.num_layers; ++l) {
    if (s.IsSparseLayer(l)) {
      p.layer.push_back(attn + router + s.moe.num_experts * expert + shared);
      p.layer_active.push_back(attn + router + s.moe.top_k * expert + shared);
    } else {
      p.layer.push_back(attn + dense);
      p.layer_active.push_back(attn + dense);
    }
  }
  p.embedding = s.vocab_size * h;
  p.head = s.vocab_size * h + h;
  return p;
}

// Bytes on rank 0 of a stage with `tp` ranks, from the memory model (common/plan/memory_model.h),
// summed over layers so that a stage's figures cost O(1).
struct TpFigures {
  std::vector<int64_t> dense_prefix;   // [layers + 1]: non-expert bytes of layers [0, l)
  std::vector<int64_t> expert_prefix;  // [layers + 1]: bytes of all local experts of [0, l)
  std::vector<int64_t> sparse_prefix;  // [layers + 1]: MoE layers among [0, l)
  int64_t kv_per_token_layer = 0;      // K and V of one layer for one token
  // Routed experts in units of "slots": a slot is what one more expert costs on rank 0 (a whole
  // expert when expert parallel, else a 1/tp slice of one), and it keeps `experts_per_slot` more
  // experts local (tp when expert parallel, else 1). A layer keeping all its experts takes
  // ceil(num_experts / experts_per_slot) slots, DefaultLocalExperts of rank 0.
  int64_t slot_bytes = 0;
  int64_t experts_per_slot = 1;
  int64_t slots_per_layer = 0;
};

TpFigures MakeTpFigures(const ModelSpec& s, int tp, const WeightFormats& formats) {
  const bool ep = IsExpertParallel(s, tp);
  TpFigures f;
  if (s.IsMoe()) {
    f.experts_per_slot = ep ? tp : 1;
    f.slots_per_layer = DefaultLocalExperts(s, tp, 0, ep);
  }
  f.dense_prefix.assign(1, 0);
  f.expert_prefix.assign(1, 0);
  f.sparse_prefix.assign(1, 0);
  for (int64_t l = 0; l < s.num_layers; ++l) {
    const bool sp = s.IsSparseLayer(l);
    const LayerRankBytes b = LayerBytes(s, l, tp, 0, ep, formats);
    if (sp) f.slot_bytes = b.expert;
    f.dense_prefix.push_back(f.dense_prefix.back() + b.matrices + b.f32);
    f.expert_prefix.push_back(f.expert_prefix.back() + (sp ? f.slots_per_layer * b.expert : 0));
    f.sparse_prefix.push_back(f.sparse_prefix.back() + (sp ? 1 : 0));
  }
  f.kv_per_token_layer = KvBytesPerTokenLayer(s, tp, formats);
  return f;
}

// ---- Validation -------------------------------------------------------------------------------

absl::Status SpecError(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("model spec: ", what));
}

absl::Status ValidateSpec(const ModelSpec& s) {
  if (s.num_layers < 1) return SpecError("num_hidden_layers must be >= 1");
  if (s.vocab_size < 1 || s.hidden_size < 1 || s.intermediate_size < 1 || s.head_dim < 1) {
    return SpecError("vocab_size, hidden_size, intermediate_size and head_dim must be >= 1");
  }
  if (s.num_heads < 1 || s.num_kv_heads < 1 || s.num_heads % s.num_kv_heads != 0) {
    return SpecError(
        absl::StrCat("num_key_value_heads (", s.num_kv_heads, ") must divide num_attention_heads (", s.num_heads, ")"));
  }
  if (s.IsMoe()) {
    if (s.moe.top_k < 1 || s.moe.top_k > s.moe.num_experts) {
      return SpecError(absl::StrCat("num_experts_per_tok (", s.moe.top_k, ") must be in [1, ", s.moe.num_experts, "]"));
    }
    if (s.moe.expert_intermediate_size < 1 || s.moe.shared_expert_intermediate_size < 0) {
      return SpecError("the expert intermediate size must be >= 1 (and the shared expert's >= 0)");
    }
    if (static_cast<int64_t>(s.moe.sparse_layers.size()) != s.num_layers) {
      return SpecError(
          absl::StrCat("moe.sparse_layers has ", s.moe.sparse_layers.size(), " entries for ", s.num_layers, " layers"));
    }
  }
  // Guard the int64 arithmetic below with a floating-point estimate.
  double params = static_cast<double>(s.vocab_size) * static_cast<double>(s.hidden_size) * 2.0;
  const double h = static_cast<double>(s.hidden_size);
  double attn = h * static_cast<double>(s.head_dim) * static_cast<double>(2 * s.num_heads + 2 * s.num_kv_heads);
  if (s.IsMla()) {
    const double heads = static_cast<double>(s.num_heads);
    const double q_in = static_cast<double>(s.mla.q_lora_rank > 0 ? s.mla.q_lora_rank : s.hidden_size);
    attn = (h + heads * static_cast<double>(s.mla.qk_head_dim())) * q_in +
           h * static_cast<double>(s.mla.kv_lora_rank + s.mla.qk_rope_head_dim) +
           static_cast<double>(s.mla.kv_lora_rank) * heads *
               static_cast<double>(s.mla.qk_nope_head_dim + s.mla.v_head_dim) +
           heads * static_cast<double>(s.mla.v_head_dim) * h;
  }
  const double per_layer =
      attn +
      3.0 * h * static_cast<double>(s.intermediate_size) +
      static_cast<double>(s.moe.num_experts) * 3.0 * h * static_cast<double>(s.moe.expert_intermediate_size + 1) +
      3.0 * h * static_cast<double>(s.moe.shared_expert_intermediate_size);
  params += per_layer * static_cast<double>(s.num_layers);
  if (params * 8.0 > kMaxModelBytes) return SpecError("the model is too large to plan (over 10^18 bytes)");
  return absl::OkStatus();
}

absl::Status PolicyError(absl::string_view field, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("policy.", field, " ", why));
}

// Checks every policy field; returns max_seq_len with 0 resolved to the model maximum.
absl::StatusOr<int64_t> ValidatePolicy(const ModelSpec& spec, const PlanPolicy& p) {
  if (p.tp < 0) return PolicyError("tp", absl::StrCat("must be >= 0 (0 = auto), got ", p.tp));
  if (p.pp < 0) return PolicyError("pp", absl::StrCat("must be >= 0 (0 = auto), got ", p.pp));
  if (p.replicas < 0) return PolicyError("replicas", absl::StrCat("must be >= 0 (0 = auto), got ", p.replicas));
  if (p.bytes_per_param < 0 || p.bytes_per_param > 8) {
    return PolicyError("bytes_per_param", absl::StrCat("must be in [1, 8] (0 = from the checkpoint), got ",
                                                       p.bytes_per_param));
  }
  if (p.kv_bytes_per_element < 0 || p.kv_bytes_per_element > 8) {
    return PolicyError("kv_bytes_per_element",
                       absl::StrCat("must be in [1, 8] (0 = from the checkpoint), got ", p.kv_bytes_per_element));
  }
  if (p.kv_cache == KvCacheFormat::kFp8E4M3 && spec.IsMla()) {
    return PolicyError("kv_cache", "fp8_e4m3 is not supported for multi-head latent attention (kv_lora_rank > 0): "
                                   "its latent cache stays in the checkpoint's dtype; use auto");
  }
  if (p.reserve_bytes_per_device < 0) {
    return PolicyError("reserve_bytes_per_device", absl::StrCat("must be >= 0, got ", p.reserve_bytes_per_device));
  }
  int64_t max_seq_len = p.max_seq_len;
  if (max_seq_len < 0) {
    return PolicyError("max_seq_len", absl::StrCat("must be >= 0 (0 = model maximum), got ", max_seq_len));
  }
  if (max_seq_len == 0) max_seq_len = spec.max_position_embeddings;
  if (max_seq_len < 1) {
    return PolicyError("max_seq_len", "is 0 and the model has no max_position_embeddings; set it");
  }
  if (spec.max_position_embeddings > 0 && max_seq_len > spec.max_position_embeddings) {
    return PolicyError("max_seq_len", absl::StrCat("(", max_seq_len, ") exceeds the model's max_position_embeddings (",
                                                   spec.max_position_embeddings, ")"));
  }
  if (p.kv_tokens < 0 || p.kv_tokens > kMaxKvTokens) {
    return PolicyError("kv_tokens", absl::StrCat("must be in [0, 2^40] (0 = use kv_fraction), got ", p.kv_tokens));
  }
  if (p.kv_tokens > 0 && p.kv_tokens < max_seq_len) {
    return PolicyError("kv_tokens", absl::StrCat("(", p.kv_tokens, ") is less than max_seq_len (", max_seq_len,
                                                 "): not even one sequence would fit"));
  }
  if (p.kv_tokens == 0 && !(p.kv_fraction > 0.0 && p.kv_fraction <= 1.0)) {
    return PolicyError("kv_fraction", absl::StrCat("must be in (0, 1], got ", p.kv_fraction));
  }
  if (p.tp > 0) {
    if (absl::Status st = ValidateTensorParallelSize(spec, p.tp); !st.ok()) {
      return PolicyError("tp", absl::StrCat("= ", p.tp, ": ", st.message()));
    }
  }
  if (p.pp > spec.num_layers) {
    return PolicyError("pp", absl::StrCat("= ", p.pp, " exceeds num_hidden_layers (", spec.num_layers,
                                          "): every stage needs at least one layer"));
  }
  return max_seq_len;
}

absl::Status ValidateWorkers(const std::vector<WorkerInventory>& sorted) {
  for (size_t w = 0; w < sorted.size(); ++w) {
    const WorkerInventory& wi = sorted[w];
    if (wi.worker_id.empty()) return absl::InvalidArgumentError("workers: a worker has an empty worker_id");
    if (w > 0 && sorted[w - 1].worker_id == wi.worker_id) {
      return absl::InvalidArgumentError(absl::StrCat("workers: duplicate worker_id \"", wi.worker_id, "\""));
    }
    std::set<std::pair<DeviceKind, int>> seen;
    for (const Device& d : wi.devices) {
      const std::string name =
          absl::StrCat("worker \"", wi.worker_id, "\" device ", DeviceKindName(d.kind), ":", d.index);
      if (!seen.insert({d.kind, d.index}).second) {
        return absl::InvalidArgumentError(absl::StrCat(name, " is listed twice"));
      }
      if (d.total_bytes < 0 || d.free_bytes < 0 || d.free_bytes > d.total_bytes) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": free_bytes (", d.free_bytes, ") must be in [0, total_bytes (", d.total_bytes, ")]"));
      }
    }
  }
  return absl::OkStatus();
}

// ---- Workers ------------------------------------------------------------------------------------

// A device a worker would use, with its room for the model.
struct Slot {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;
  int64_t room = 0;
};

// The CUDA devices of a worker when it has any, else its CPU devices; ascending index.
std::vector<Slot> UsableDevices(const WorkerInventory& w, int64_t reserve) {
  const bool cuda =
      std::any_of(w.devices.begin(), w.devices.end(), [](const Device& d) { return d.kind == DeviceKind::kCuda; });
  std::vector<Slot> out;
  for (const Device& d : w.devices) {
    if ((d.kind == DeviceKind::kCuda) != cuda) continue;
    out.push_back({d.kind, d.index, std::max<int64_t>(0, d.free_bytes - reserve)});
  }
  std::sort(out.begin(), out.end(), [](const Slot& a, const Slot& b) { return a.index < b.index; });
  return out;
}

// A worker that can host a stage, with the tp ranks it would use.
struct Candidate {
  const WorkerInventory* worker = nullptr;
  DeviceKind kind = DeviceKind::kCpu;
  int tp = 1;
  std::vector<int> devices;   // ascending; rank r on devices[r]
  int64_t room_per_rank = 0;  // the smallest room among `devices`
  int64_t Capacity() const { return tp * room_per_rank; }
};

// Uses the tp devices with the most room (ties: lower index).
Candidate MakeCandidate(const WorkerInventory& w, std::vector<Slot> slots, int tp) {
  std::stable_sort(slots.begin(), slots.end(), [](const Slot& a, const Slot& b) { return a.room > b.room; });
  slots.resize(static_cast<size_t>(tp));
  Candidate c;
  c.worker = &w;
  c.kind = slots.front().kind;
  c.tp = tp;
  c.room_per_rank = slots.back().room;
  for (const Slot& s : slots) c.devices.push_back(s.index);
  std::sort(c.devices.begin(), c.devices.end());
  return c;
}

// ---- The search ---------------------------------------------------------------------------------

struct StageRange {
  int64_t begin = 0, end = 0;
  bool first = false, last = false;
};

// A stage of a layout being built, before KV is sized.
struct Draft {
  const Candidate* cand = nullptr;
  StageRange range;
  std::vector<int64_t> kept;  // per MoE layer of the range (ascending): experts kept local
  int64_t weights = 0;        // rank 0
  double cost = 0.0;
};

class Planner {
 public:
  Planner(const ModelSpec& spec, const PlanPolicy& policy, int64_t max_seq_len,
          const std::vector<WorkerInventory>& workers, const WeightFormats& formats)
      : spec_(spec), policy_(policy), max_seq_len_(max_seq_len), workers_(workers), formats_(formats) {
    min_tokens_ = policy.kv_tokens > 0 ? policy.kv_tokens : max_seq_len;
    const Params p = CountParams(spec);
    // The embedding is a lookup: it is held (the memory constraint counts it) but a step reads
    // one row per token of it, so it costs no time. The lm_head is read whole by every decode
    // step but runs on one position per sequence, so a prompt token costs it no FLOPs.
    double bytes = static_cast<double>(p.head), flops = 0.0;
    for (size_t l = 0; l < p.layer.size(); ++l) {
      bytes += static_cast<double>(p.layer[l]);
      flops += static_cast<double>(p.layer_active[l]);
    }
    cost_prefix_.assign(1, 0.0);
    for (size_t l = 0; l < p.layer.size(); ++l) {
      cost_prefix_.push_back(cost_prefix_.back() + 0.5 * static_cast<double>(p.layer[l]) / bytes +
                             0.5 * static_cast<double>(p.layer_active[l]) / flops);
    }
    head_cost_ = 0.5 * static_cast<double>(p.head) / bytes;
    expert_bytes_ = WholeExpertBytes(spec, formats);
  }

  void AddTp(int tp) {
    if (figures_.count(tp) == 0) {
      figures_.emplace(tp, MakeTpFigures(spec_, tp, formats_));
    }
  }
  int64_t min_tokens() const { return min_tokens_; }

  // Tries `replicas` pipelines of `pp` stages on the largest of `eligible` (sorted by capacity).
  // When `ev` is set, records the stages of the plan, or why the layout does not fit (ExplainPlan).
  std::optional<Plan> TryLayout(const std::vector<Candidate>& eligible, int pp, int replicas, bool spill,
                                LayoutEvaluation* ev) const;

 private:
  // ExplainPlan: a stage's figures, computed by Fits' own terms.
  StageEvaluation Evaluate(const Candidate& c, const StageRange& r, bool spill) const;
  // ExplainPlan: why Partition found no split for `stages`: each stage takes as many layers as fit
  // (the most any partition could give it, since what a stage needs grows with its range), up to
  // the first stage that cannot hold what is left. Fills ev->stages and ev->reason.
  void ExplainNoPartition(const std::vector<const Candidate*>& stages, bool spill, LayoutEvaluation* ev) const;
  const TpFigures& Figures(int tp) const { return figures_.at(tp); }

  // KV tokens that fit in `free` bytes at `per_token` bytes per token; below min_tokens_ when the
  // stage cannot hold the minimum.
  int64_t KvCapacity(int64_t free, int64_t per_token) const {
    if (free <= 0) return 0;
    if (policy_.kv_tokens > 0) {
      return static_cast<double>(policy_.kv_tokens) * static_cast<double>(per_token) <= static_cast<double>(free)
                 ? policy_.kv_tokens
                 : 0;
    }
    const double t = std::floor(policy_.kv_fraction * static_cast<double>(free) / static_cast<double>(per_token));
    return static_cast<int64_t>(std::min(t, static_cast<double>(kMaxKvTokens)));
  }
  int64_t KvPerToken(const Candidate& c, const StageRange& r) const {
    return (r.end - r.begin) * Figures(c.tp).kv_per_token_layer;
  }

  // Rank-0 weight bytes of a stage without its routed experts.
  int64_t NonExpertWeights(const Candidate& c, const StageRange& r) const {
    const TpFigures& f = Figures(c.tp);
    int64_t w = f.dense_prefix[static_cast<size_t>(r.end)] - f.dense_prefix[static_cast<size_t>(r.begin)];
    const EndBytes e = StageEndBytes(spec_, r.first, r.last, c.tp, formats_);
    return w + e.embedding + e.final_norm + e.lm_head;
  }
  int64_t AllExpertWeights(const Candidate& c, const StageRange& r) const {
    const TpFigures& f = Figures(c.tp);
    return f.expert_prefix[static_cast<size_t>(r.end)] - f.expert_prefix[static_cast<size_t>(r.begin)];
  }

  // Whether the stage holds its weights (without routed experts when spilling) plus the minimum KV.
  bool Fits(const Candidate& c, const StageRange& r, bool spill) const {
    const int64_t w = NonExpertWeights(c, r) + (spill ? 0 : AllExpertWeights(c, r));
    return KvCapacity(c.room_per_rank - w, KvPerToken(c, r)) >= min_tokens_;
  }

  double Cost(const Candidate& c, const StageRange& r) const {
    double cost = cost_prefix_[static_cast<size_t>(r.end)] - cost_prefix_[static_cast<size_t>(r.begin)];
    if (r.last) cost += head_cost_;
    return cost / c.tp;
  }

  std::optional<std::vector<int64_t>> Partition(const std::vector<const Candidate*>& stages, bool spill) const;
  Draft MakeDraft(const Candidate& c, const StageRange& r, bool spill) const;
  bool PlaceRemoteExperts(const std::vector<std::vector<Draft>>& drafts, Plan* plan) const;

  const ModelSpec& spec_;
  const PlanPolicy& policy_;
  const int64_t max_seq_len_;
  const std::vector<WorkerInventory>& workers_;  // sorted by worker_id
  const WeightFormats formats_;                  // the policy's, resolved
  int64_t min_tokens_ = 0;
  std::map<int, TpFigures> figures_;
  std::vector<double> cost_prefix_;  // [layers + 1]
  double head_cost_ = 0.0;
  int64_t expert_bytes_ = 0;  // one whole routed expert
};

// Dynamic program over (stages placed, layers covered): minimise the largest stage cost, then the
// sum of squared costs. Both the memory a stage needs and its cost grow as its range grows to the
// left, which bounds the inner loop.
std::optional<std::vector<int64_t>> Planner::Partition(const std::vector<const Candidate*>& stages, bool spill) const {
  struct Cell {
    double max = kInf;
    double sq = kInf;
    int64_t from = -1;
  };
  const int64_t layers = spec_.num_layers;
  const int64_t pp = static_cast<int64_t>(stages.size());
  std::vector<std::vector<Cell>> best(stages.size() + 1, std::vector<Cell>(static_cast<size_t>(layers) + 1));
  best[0][0] = {0.0, 0.0, 0};
  for (int64_t s = 0; s < pp; ++s) {
    const Candidate& c = *stages[static_cast<size_t>(s)];
    const bool first = s == 0, last = s + 1 == pp;
    const int64_t j_lo = last ? layers : s + 1, j_hi = layers - (pp - 1 - s);
    for (int64_t j = j_lo; j <= j_hi; ++j) {
      Cell& out = best[static_cast<size_t>(s + 1)][static_cast<size_t>(j)];
      for (int64_t i = first ? 0 : j - 1; i >= s; --i) {
        const StageRange r{i, j, first, last};
        if (!Fits(c, r, spill)) break;
        const double cost = Cost(c, r);
        if (cost > out.max + kCostEps) break;
        const Cell& in = best[static_cast<size_t>(s)][static_cast<size_t>(i)];
        if (in.from < 0) continue;
        const double m = std::max(in.max, cost), sq = in.sq + cost * cost;
        if (m < out.max - kCostEps || (m <= out.max + kCostEps && sq < out.sq - kCostEps * kCostEps)) {
          out = {m, sq, i};
        }
      }
    }
  }
  if (best[stages.size()][static_cast<size_t>(layers)].from < 0) return std::nullopt;
  std::vector<int64_t> bounds(stages.size() + 1, 0);
  bounds[stages.size()] = layers;
  for (int64_t s = pp; s > 0; --s) {
    bounds[static_cast<size_t>(s - 1)] =
        best[static_cast<size_t>(s)][static_cast<size_t>(bounds[static_cast<size_t>(s)])].from;
  }
  return bounds;
}

// Decides how many experts of each MoE layer the stage keeps. Without spill: all. With spill:
// the most that fit next to the minimum KV, counted in rank-0 slots (TpFigures); a layer given c
// slots keeps experts [0, min(n, c x experts_per_slot)). Slots fill the stage's MoE layers in
// order, so the spill is concentrated in its last MoE layers: a layer with remote experts costs an
// expert call per step, however many of its experts are remote, while the bytes sent depend only
// on how many experts are remote in all.
Draft Planner::MakeDraft(const Candidate& c, const StageRange& r, bool spill) const {
  Draft d;
  d.cand = &c;
  d.range = r;
  d.cost = Cost(c, r);
  d.weights = NonExpertWeights(c, r);
  const TpFigures& f = Figures(c.tp);
  const int64_t moe_layers =
      f.sparse_prefix[static_cast<size_t>(r.end)] - f.sparse_prefix[static_cast<size_t>(r.begin)];
  if (moe_layers == 0) return d;
  const int64_t n = spec_.moe.num_experts;
  int64_t slots = moe_layers * f.slots_per_layer;
  if (spill) {
    const int64_t per_token = KvPerToken(c, r);
    const double kv_reserve =
        policy_.kv_tokens > 0 ? static_cast<double>(min_tokens_) * static_cast<double>(per_token)
                              : static_cast<double>(min_tokens_) * static_cast<double>(per_token) / policy_.kv_fraction;
    const double room = static_cast<double>(c.room_per_rank - d.weights) - kv_reserve;
    slots = std::min(slots, std::max<int64_t>(0, static_cast<int64_t>(room / static_cast<double>(f.slot_bytes))));
    // Rounding in KvCapacity may need a slot or two less.
    while (slots > 0 && KvCapacity(c.room_per_rank - d.weights - slots * f.slot_bytes, per_token) < min_tokens_) {
      --slots;
    }
  }
  for (int64_t k = 0; k < moe_layers; ++k) {
    const int64_t c_l = std::min(f.slots_per_layer, slots);
    slots -= c_l;
    d.kept.push_back(std::min(n, c_l * f.experts_per_slot));
    d.weights += c_l * f.slot_bytes;
  }
  return d;
}

// Places every expert the drafts do not keep on a device of a worker that hosts no stage.
bool Planner::PlaceRemoteExperts(const std::vector<std::vector<Draft>>& drafts, Plan* plan) const {
  std::set<std::string> stage_workers;
  for (const auto& pipeline : drafts) {
    for (const Draft& d : pipeline) stage_workers.insert(d.cand->worker->worker_id);
  }
  struct HostDevice {
    const WorkerInventory* worker;
    Slot slot;
    int rank;
    int64_t left;
    int64_t experts = 0;
  };
  std::vector<HostDevice> hosts;  // in (worker_id, device index) order
  for (const WorkerInventory& w : workers_) {
    if (stage_workers.count(w.worker_id) > 0) continue;
    const std::vector<Slot> slots = UsableDevices(w, policy_.reserve_bytes_per_device);
    for (size_t i = 0; i < slots.size(); ++i) hosts.push_back({&w, slots[i], static_cast<int>(i), slots[i].room});
  }
  for (size_t r = 0; r < drafts.size(); ++r) {
    Pipeline& pipeline = plan->replicas[r];
    size_t moe_index = 0;  // into pipeline.experts, which lists MoE layers in order
    for (const Draft& d : drafts[r]) {
      for (int64_t kept : d.kept) {
        LayerExperts& le = pipeline.experts[moe_index++];
        for (int64_t e = kept; e < spec_.moe.num_experts; ++e) {
          HostDevice* best = nullptr;
          for (HostDevice& h : hosts) {
            if (h.left >= expert_bytes_ && (best == nullptr || h.left > best->left)) best = &h;
          }
          if (best == nullptr) return false;
          best->left -= expert_bytes_;
          ++best->experts;
          le.experts[static_cast<size_t>(e)] = {best->worker->worker_id, best->rank, best->slot.index, true};
        }
      }
    }
  }
  for (const HostDevice& h : hosts) {
    if (h.experts == 0) continue;
    plan->expert_hosts.push_back(
        {h.worker->worker_id, h.worker->node_name, h.slot.kind, h.slot.index, h.experts, h.experts * expert_bytes_});
  }
  return true;
}

StageEvaluation Planner::Evaluate(const Candidate& c, const StageRange& r, bool spill) const {
  StageEvaluation e;
  e.worker_id = c.worker->worker_id;
  e.tp = c.tp;
  e.layer_begin = r.begin;
  e.layer_end = r.end;
  e.has_embedding = r.first;
  e.has_lm_head = r.last;
  e.weight_bytes_per_rank = NonExpertWeights(c, r) + (spill ? 0 : AllExpertWeights(c, r));
  const int64_t per_token = KvPerToken(c, r);
  const double min_kv = static_cast<double>(min_tokens_) * static_cast<double>(per_token);
  e.min_kv_tokens = min_tokens_;
  e.min_kv_bytes_per_rank = static_cast<int64_t>(std::ceil(policy_.kv_tokens > 0 ? min_kv : min_kv / policy_.kv_fraction));
  e.room_per_rank = c.room_per_rank;
  e.kv_tokens = KvCapacity(c.room_per_rank - e.weight_bytes_per_rank, per_token);
  e.kv_bytes_per_rank = e.kv_tokens * per_token;
  e.fits = Fits(c, r, spill);
  return e;
}

namespace {

std::string LayersText(const StageEvaluation& e) {
  return absl::StrCat("layers ", e.layer_begin, "..", e.layer_end, e.has_embedding ? " + embedding" : "",
                      e.has_lm_head ? " + lm_head" : "");
}

// Why a stage does not fit, in words: weights alone, or weights + the minimum KV, over the room.
std::string NoFitText(const StageEvaluation& e, const PlanPolicy& policy) {
  std::string out = absl::StrCat("worker \"", e.worker_id, "\" (tp=", e.tp, ", ", LayersText(e), "): ");
  if (e.weight_bytes_per_rank > e.room_per_rank) {
    absl::StrAppend(&out, FormatBytes(e.weight_bytes_per_rank), " of weights per rank > ", FormatBytes(e.room_per_rank),
                    " free per rank");
  } else {
    absl::StrAppend(&out, FormatBytes(e.weight_bytes_per_rank), " of weights + ", FormatBytes(e.min_kv_bytes_per_rank),
                    " of KV (", e.min_kv_tokens, " tokens",
                    policy.kv_tokens == 0 && policy.kv_fraction < 1.0 ? absl::StrCat(" at kv_fraction ", policy.kv_fraction)
                                                                     : "",
                    ") per rank > ", FormatBytes(e.room_per_rank), " free per rank");
  }
  return out;
}

}  // namespace

void Planner::ExplainNoPartition(const std::vector<const Candidate*>& stages, bool spill, LayoutEvaluation* ev) const {
  const int64_t layers = spec_.num_layers, pp = static_cast<int64_t>(stages.size());
  int64_t i = 0;
  for (int64_t s = 0; s < pp; ++s) {
    const Candidate& c = *stages[static_cast<size_t>(s)];
    const bool first = s == 0, last = s + 1 == pp;
    int64_t j = layers;
    if (!last) {
      j = i + 1;  // at least one layer: shows the first one that does not fit
      for (int64_t k = i + 1; k <= layers - (pp - 1 - s); ++k) {
        if (!Fits(c, {i, k, first, false}, spill)) break;
        j = k;
      }
    }
    StageEvaluation e = Evaluate(c, {i, j, first, last}, spill);
    const bool fits = e.fits;
    ev->stages.push_back(std::move(e));
    if (!fits) {
      const StageEvaluation& bad = ev->stages.back();
      ev->reason = s == 0 ? NoFitText(bad, policy_)
                          : absl::StrCat("the first ", s, s == 1 ? " stage holds" : " stages hold", " at most layers 0..",
                                         i, ", so ", NoFitText(bad, policy_));
      return;
    }
    i = j;
  }
  // Unreachable when Partition failed (a stage-by-stage fill that fits is a partition); say so.
  ev->reason = "no partition found";
}

std::optional<Plan> Planner::TryLayout(const std::vector<Candidate>& eligible, int pp, int replicas, bool spill,
                                       LayoutEvaluation* ev) const {
  // Deal the largest replicas x pp workers snake-wise, then order each replica's stages by id.
  std::vector<std::vector<const Candidate*>> groups(static_cast<size_t>(replicas));
  for (int k = 0; k < replicas * pp; ++k) {
    const int round = k / replicas, pos = k % replicas;
    groups[static_cast<size_t>(round % 2 == 0 ? pos : replicas - 1 - pos)].push_back(&eligible[static_cast<size_t>(k)]);
  }
  // Partition every group first, the last dealt (the smallest workers) first: when a layout does
  // not fit, it is usually the group of the smallest workers that fails, so the search over
  // replica counts (MakePlan) rejects a layout after one partition instead of one per replica.
  // The partitions do not depend on the order, so neither does the plan.
  std::vector<std::vector<int64_t>> partitions(groups.size());
  for (size_t g = groups.size(); g-- > 0;) {
    std::sort(groups[g].begin(), groups[g].end(),
              [](const Candidate* a, const Candidate* b) { return a->worker->worker_id < b->worker->worker_id; });
    std::optional<std::vector<int64_t>> bounds = Partition(groups[g], spill);
    if (!bounds.has_value()) {
      if (ev != nullptr) {
        ev->verdict = LayoutVerdict::kNoPartitionFits;
        ExplainNoPartition(groups[g], spill, ev);
        for (StageEvaluation& e : ev->stages) e.replica = static_cast<int>(g);
      }
      return std::nullopt;
    }
    partitions[g] = *std::move(bounds);
  }
  Plan plan;
  plan.max_seq_len = max_seq_len_;
  std::vector<std::vector<Draft>> drafts;
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::vector<const Candidate*>& group = groups[g];
    const std::vector<int64_t>* bounds = &partitions[g];
    std::vector<Draft>& ds = drafts.emplace_back();
    Pipeline& pipeline = plan.replicas.emplace_back();
    for (size_t s = 0; s < group.size(); ++s) {
      const StageRange r{(*bounds)[s], (*bounds)[s + 1], s == 0, s + 1 == group.size()};
      const Draft& d = ds.emplace_back(MakeDraft(*group[s], r, spill));
      // Local experts: the engine's default placement, contiguous blocks (expert e of the k kept on
      // rank e x tp / k) when expert parallel, else split over all ranks (rank 0 listed). The rest
      // are filled in by PlaceRemoteExperts.
      const bool ep = IsExpertParallel(spec_, d.cand->tp);
      size_t k = 0;
      for (int64_t l = r.begin; l < r.end; ++l) {
        if (!spec_.IsSparseLayer(l)) continue;
        LayerExperts& le = pipeline.experts.emplace_back();
        le.layer = l;
        le.experts.resize(static_cast<size_t>(spec_.moe.num_experts));
        const int64_t kept = d.kept[k];
        for (int64_t e = 0; e < kept; ++e) {
          const int rank = ep ? static_cast<int>(e * d.cand->tp / kept) : 0;
          le.experts[static_cast<size_t>(e)] = {d.cand->worker->worker_id, rank,
                                                d.cand->devices[static_cast<size_t>(rank)], false};
        }
        ++k;
      }
    }
  }
  if (spill && !PlaceRemoteExperts(drafts, &plan)) {
    if (ev != nullptr) {
      int64_t remote = 0;
      for (const auto& ds : drafts) {
        for (const Draft& d : ds) {
          for (int64_t kept : d.kept) remote += spec_.moe.num_experts - kept;
        }
      }
      ev->verdict = LayoutVerdict::kNoExpertRoom;
      ev->reason = absl::StrCat(remote, " experts (", FormatBytes(expert_bytes_), " each) do not fit on the stages; the ",
                                workers_.size() - static_cast<size_t>(replicas * pp),
                                " workers that host no stage cannot hold them all");
    }
    return std::nullopt;
  }

  // Stage specs, with the pipeline's KV capacity: its tightest stage's.
  for (size_t r = 0; r < drafts.size(); ++r) {
    int64_t kv_tokens = std::numeric_limits<int64_t>::max();
    double total_cost = 0.0;
    for (const Draft& d : drafts[r]) {
      kv_tokens = std::min(kv_tokens, KvCapacity(d.cand->room_per_rank - d.weights, KvPerToken(*d.cand, d.range)));
      total_cost += d.cost;
    }
    for (const Draft& d : drafts[r]) {
      StageSpec st;
      st.worker_id = d.cand->worker->worker_id;
      st.node_name = d.cand->worker->node_name;
      st.layer_begin = d.range.begin;
      st.layer_end = d.range.end;
      st.has_embedding = d.range.first;
      st.has_lm_head = d.range.last;
      st.tp = d.cand->tp;
      st.expert_parallel = IsExpertParallel(spec_, d.cand->tp);
      st.device_kind = d.cand->kind;
      st.devices = d.cand->devices;
      st.predicted_weight_bytes_per_rank = d.weights;
      st.kv_tokens = kv_tokens;
      st.kv_bytes_per_rank = kv_tokens * KvPerToken(*d.cand, d.range);
      st.cost_share = total_cost > 0.0 ? d.cost / total_cost : 0.0;
      if (ev != nullptr) {
        StageEvaluation e = Evaluate(*d.cand, d.range, spill);
        e.replica = static_cast<int>(r);
        e.weight_bytes_per_rank = d.weights;  // with spill: the experts it keeps
        e.kv_tokens = st.kv_tokens;
        e.kv_bytes_per_rank = st.kv_bytes_per_rank;
        e.fits = true;
        for (int64_t kept : d.kept) {
          e.local_experts += kept;
          e.remote_experts += spec_.moe.num_experts - kept;
        }
        ev->stages.push_back(std::move(e));
      }
      plan.replicas[r].stages.push_back(std::move(st));
    }
  }
  return plan;
}

// Weight bytes of the whole model on one rank (tp = 1): its layers with every expert, the
// embedding, the final norm and the lm_head.
int64_t ModelWeightBytes(const ModelSpec& spec, const WeightFormats& formats) {
  const RankShard all{.layer_begin = 0, .layer_end = spec.num_layers, .has_embedding = true, .has_lm_head = true};
  return RankMemoryOf(spec, all, formats).Weights();
}

// KV bytes of one token in every layer on one rank (tp = 1).
int64_t ModelKvBytesPerToken(const ModelSpec& spec, const WeightFormats& formats) {
  return spec.num_layers * KvBytesPerTokenLayer(spec, 1, formats);
}

// What the ResourceExhausted error says: bytes needed vs available, and why no layout fits
// when the total would be enough.
std::string NotEnoughMemory(const ModelSpec& spec, const PlanPolicy& policy, const WeightFormats& formats,
                            int64_t min_tokens,
                            const std::vector<WorkerInventory>& workers, const std::vector<Candidate>& eligible,
                            int pp_lo, int pp_hi, bool tried_spill) {
  const int64_t weights = ModelWeightBytes(spec, formats);
  const double kv_min = static_cast<double>(min_tokens) * static_cast<double>(ModelKvBytesPerToken(spec, formats));
  const int64_t kv = static_cast<int64_t>(std::ceil(policy.kv_tokens > 0 ? kv_min : kv_min / policy.kv_fraction));
  const int replicas = std::max(policy.replicas, 1);
  int64_t available = 0;
  for (const WorkerInventory& w : workers) {
    for (const Slot& s : UsableDevices(w, policy.reserve_bytes_per_device)) available += s.room;
  }
  std::string msg = absl::StrCat("model needs ", FormatBytes(weights + kv), " (", FormatBytes(weights), " weights + ",
                                 FormatBytes(kv), " for the KV of ");
  if (policy.kv_tokens > 0) {
    absl::StrAppend(&msg, policy.kv_tokens, " tokens (policy.kv_tokens))");
  } else {
    absl::StrAppend(&msg, "1 sequence of ", min_tokens, " tokens",
                    policy.kv_fraction < 1.0 ? absl::StrCat(" at kv_fraction ", policy.kv_fraction) : "", ")");
  }
  if (replicas > 1) absl::StrAppend(&msg, " per replica, x", replicas, " replicas");
  absl::StrAppend(&msg, ", workers have ", FormatBytes(available), " free in total");
  if (available >= (weights + kv) * replicas && !eligible.empty()) {
    const Candidate& big = eligible.front();
    absl::StrAppend(&msg, ", but no layout fits (tried pp ", pp_lo, pp_hi > pp_lo ? absl::StrCat("..", pp_hi) : "",
                    tried_spill ? ", with and without expert spill" : "",
                    "): a stage holds whole layers on one worker, and the largest worker (\"", big.worker->worker_id,
                    "\") offers ", big.tp, " x ", FormatBytes(big.room_per_rank));
  }
  return msg;
}

}  // namespace

namespace {

// Whether every worker runs its stage on CUDA devices (it has some).
bool AllCuda(const std::vector<WorkerInventory>& workers) {
  bool all_cuda = !workers.empty();
  for (const WorkerInventory& w : workers) {
    bool cuda = false;
    for (const Device& d : w.devices) cuda = cuda || d.kind == DeviceKind::kCuda;
    all_cuda = all_cuda && cuda;
  }
  return all_cuda;
}

// Whether any worker has a CUDA device (and so runs its stage there).
bool AnyCuda(const std::vector<WorkerInventory>& workers) {
  for (const WorkerInventory& w : workers) {
    for (const Device& d : w.devices) {
      if (d.kind == DeviceKind::kCuda) return true;
    }
  }
  return false;
}

}  // namespace

int64_t WeightBytesPerParam(const ModelSpec& spec, const std::vector<WorkerInventory>& workers) {
  return WorkerWeightFormats(spec, AllCuda(workers), Quantization::kNone).matrix_bytes;
}

int64_t KvBytesPerElement(const ModelSpec& spec, const std::vector<WorkerInventory>& workers, KvCacheFormat kv_cache) {
  return WorkerWeightFormats(spec, AllCuda(workers), Quantization::kNone, kv_cache).kv_bytes;
}

const char* LayoutVerdictName(LayoutVerdict v) {
  switch (v) {
    case LayoutVerdict::kChosen:
      return "chosen";
    case LayoutVerdict::kTooLittleMemory:
      return "too_little_memory";
    case LayoutVerdict::kNoPartitionFits:
      return "no_partition_fits";
    case LayoutVerdict::kNoExpertRoom:
      return "no_expert_room";
  }
  return "?";
}

namespace {

constexpr const char* kSearchOrder =
    "the planner takes the first layout that fits, in this order: all experts on their stage before "
    "any expert spill (a remote expert costs a gRPC round trip per MoE layer per step); then the fewest "
    "pipeline stages (pp ascending: a stage boundary costs a hop per step, and fewer stages leave workers "
    "for replicas); then the most replicas for that pp (replicas descending: throughput). tp is not searched: "
    "each worker uses the largest tp <= its device count that the model divides (or --tp). Inside a layout, "
    "the largest workers are dealt to replicas snake-wise, and the layers are split to minimise the largest "
    "stage cost, then the sum of squared stage costs";

// MakePlan, recording the search in `ex` when it is set.
absl::StatusOr<Plan> PlanImpl(const ModelSpec& spec, const std::vector<WorkerInventory>& workers,
                              const PlanPolicy& requested, PlanExplanation* ex) {
  RETURN_IF_ERROR(ValidateSpec(spec));
  ASSIGN_OR_RETURN(const int64_t max_seq_len, ValidatePolicy(spec, requested));
  PlanPolicy policy = requested;
  // CUDA backends do not take int8 weights (their workers keep the checkpoint's dtype): count int8
  // only when no worker runs on CUDA, so that no stage is under-counted.
  if (policy.quantize == Quantization::kInt8 && AnyCuda(workers)) policy.quantize = Quantization::kNone;
  // The formats the workers keep (memory_model.h), unless the policy fixes the element sizes.
  WeightFormats formats = WorkerWeightFormats(spec, AllCuda(workers), policy.quantize, policy.kv_cache);
  if (policy.bytes_per_param > 0) {
    formats.matrix_bytes = formats.embedding_bytes = formats.tied_embedding_bytes = formats.head_linear_bytes =
        policy.bytes_per_param;
  }
  if (policy.kv_bytes_per_element > 0) formats.kv_bytes = policy.kv_bytes_per_element;
  policy.bytes_per_param = formats.matrix_bytes;
  policy.kv_bytes_per_element = formats.kv_bytes;
  std::vector<WorkerInventory> sorted = workers;
  std::sort(sorted.begin(), sorted.end(),
            [](const WorkerInventory& a, const WorkerInventory& b) { return a.worker_id < b.worker_id; });
  RETURN_IF_ERROR(ValidateWorkers(sorted));

  // Workers that can host a stage, largest capacity first (ties: worker_id).
  std::vector<Candidate> eligible;
  int most_devices = 0;
  const WorkerInventory* most_devices_worker = nullptr;
  for (const WorkerInventory& w : sorted) {
    std::vector<Slot> slots = UsableDevices(w, policy.reserve_bytes_per_device);
    const int count = static_cast<int>(slots.size());
    if (count > most_devices) {
      most_devices = count;
      most_devices_worker = &w;
    }
    if (count == 0) continue;
    int tp = policy.tp;
    if (tp == 0) {
      tp = count;
      while (tp > 1 && !ValidateTensorParallelSize(spec, tp).ok()) --tp;
    }
    if (tp > count) continue;
    eligible.push_back(MakeCandidate(w, std::move(slots), tp));
  }
  if (most_devices_worker == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("no worker has a device to plan on (", sorted.size(), " workers registered)"));
  }
  if (eligible.empty()) {
    return PolicyError(
        "tp", absl::StrCat("= ", policy.tp, ": no worker has ", policy.tp, " devices of one kind (the most is ",
                           most_devices, ", on worker \"", most_devices_worker->worker_id, "\")"));
  }
  std::stable_sort(eligible.begin(), eligible.end(),
                   [](const Candidate& a, const Candidate& b) { return a.Capacity() > b.Capacity(); });
  const int num_eligible = static_cast<int>(eligible.size());
  if (policy.pp > num_eligible) {
    return PolicyError("pp", absl::StrCat("= ", policy.pp, " needs ", policy.pp, " workers, but only ", num_eligible,
                                          " can host a stage"));
  }
  if (policy.replicas > 0 && policy.replicas * std::max(policy.pp, 1) > num_eligible) {
    return PolicyError("replicas",
                       absl::StrCat("= ", policy.replicas, " needs ", policy.replicas * std::max(policy.pp, 1),
                                    " workers (replicas x pp), but only ", num_eligible, " can host a stage"));
  }

  Planner planner(spec, policy, max_seq_len, sorted, formats);
  for (const Candidate& c : eligible) planner.AddTp(c.tp);
  // Lower bound on what one replica needs (tp = 1: nothing replicated) to skip hopeless counts.
  const double replica_need =
      static_cast<double>(ModelWeightBytes(spec, formats)) +
      static_cast<double>(planner.min_tokens()) * static_cast<double>(ModelKvBytesPerToken(spec, formats));
  std::vector<double> capacity_prefix(1, 0.0);
  for (const Candidate& c : eligible)
    capacity_prefix.push_back(capacity_prefix.back() + static_cast<double>(c.Capacity()));
  double all_room = 0.0;
  for (const WorkerInventory& w : sorted) {
    for (const Slot& s : UsableDevices(w, policy.reserve_bytes_per_device)) all_room += static_cast<double>(s.room);
  }

  if (ex != nullptr) {
    ex->bytes_per_param = policy.bytes_per_param;
    ex->kv_bytes_per_element = policy.kv_bytes_per_element;
    ex->max_seq_len = max_seq_len;
    ex->min_kv_tokens = planner.min_tokens();
    ex->kv_fraction = policy.kv_tokens > 0 ? 0.0 : policy.kv_fraction;
    ex->reserve_bytes_per_device = policy.reserve_bytes_per_device;
    ex->int8 = policy.quantize == Quantization::kInt8;
    ex->tp_auto = policy.tp == 0;
    ex->pp_auto = policy.pp == 0;
    ex->replicas_auto = policy.replicas == 0;
    ex->model_weight_bytes = ModelWeightBytes(spec, formats);
    ex->eligible_workers = num_eligible;
    ex->search_order = kSearchOrder;
  }
  const int pp_lo = policy.pp > 0 ? policy.pp : 1;
  const int pp_hi = policy.pp > 0 ? policy.pp : static_cast<int>(std::min<int64_t>(num_eligible, spec.num_layers));
  const bool can_spill = policy.allow_expert_spill && spec.IsMoe();
  for (const bool spill : {false, true}) {
    if (spill && !can_spill) continue;
    for (int pp = pp_lo; pp <= pp_hi; ++pp) {
      const int r_hi = policy.replicas > 0 ? policy.replicas : num_eligible / pp;
      const int r_lo = policy.replicas > 0 ? policy.replicas : 1;
      for (int r = r_hi; r >= r_lo; --r) {
        if (r * pp > num_eligible) continue;
        const double room = spill ? all_room : capacity_prefix[static_cast<size_t>(r * pp)];
        LayoutEvaluation* ev = nullptr;
        if (ex != nullptr) {
          ev = &ex->layouts.emplace_back();
          ev->expert_spill = spill;
          ev->pp = pp;
          ev->replicas = ev->replicas_hi = r;
          ev->tp_min = ev->tp_max = eligible.front().tp;
          const size_t used = spill ? eligible.size() : static_cast<size_t>(r * pp);
          for (size_t k = 0; k < static_cast<size_t>(r * pp) && k < used; ++k) {
            ev->tp_min = std::min(ev->tp_min, eligible[k].tp);
            ev->tp_max = std::max(ev->tp_max, eligible[k].tp);
          }
        }
        if (room < replica_need * r) {
          if (ev != nullptr) {
            // Consecutive replica counts skipped for this reason are one entry, replicas_hi..r, whose
            // figures are those of the last (smallest) count: the closest to fitting.
            LayoutEvaluation* prev = ex->layouts.size() >= 2 ? &ex->layouts[ex->layouts.size() - 2] : nullptr;
            if (prev != nullptr && prev->verdict == LayoutVerdict::kTooLittleMemory && prev->pp == pp &&
                prev->expert_spill == spill && prev->replicas == r + 1) {
              prev->replicas = r;
              prev->tp_min = std::min(prev->tp_min, ev->tp_min);
              prev->tp_max = std::max(prev->tp_max, ev->tp_max);
              ex->layouts.pop_back();
              ev = prev;
            }
            ev->verdict = LayoutVerdict::kTooLittleMemory;
            ev->needed_bytes = static_cast<int64_t>(replica_need * r);
            ev->available_bytes = static_cast<int64_t>(room);
            ev->reason = absl::StrCat(r, r == 1 ? " replica needs" : " replicas need", " at least ",
                                      FormatBytes(ev->needed_bytes), " (", r > 1 ? absl::StrCat(r, " x ") : "",
                                      "the model's weights + the KV of ", planner.min_tokens(),
                                      " tokens, nothing replicated), the ",
                                      spill ? "" : absl::StrCat(r * pp, r * pp == 1 ? " largest worker has " : " largest workers have "),
                                      spill ? "workers have " : "", FormatBytes(ev->available_bytes));
          }
          continue;
        }
        if (std::optional<Plan> plan = planner.TryLayout(eligible, pp, r, spill, ev)) {
          if (ev != nullptr) {
            ev->verdict = LayoutVerdict::kChosen;
            ev->reason = "the first layout in search order whose every stage holds its weights and the minimum KV";
          }
          return std::move(*plan);
        }
      }
    }
  }
  return absl::ResourceExhaustedError(
      NotEnoughMemory(spec, policy, formats, planner.min_tokens(), sorted, eligible, pp_lo, pp_hi, can_spill));
}

}  // namespace

absl::StatusOr<Plan> MakePlan(const ModelSpec& spec, const std::vector<WorkerInventory>& workers,
                              const PlanPolicy& policy) {
  return PlanImpl(spec, workers, policy, nullptr);
}

absl::StatusOr<PlanExplanation> ExplainPlan(const ModelSpec& spec, const std::vector<WorkerInventory>& workers,
                                            const PlanPolicy& policy) {
  PlanExplanation ex;
  ex.plan = PlanImpl(spec, workers, policy, &ex);
  if (ex.plan.ok()) ex.traffic = EstimateTraffic(spec, *ex.plan);
  // Errors before the search (spec, policy, inventory) are errors of the call, as in MakePlan.
  if (!ex.plan.ok() && ex.plan.status().code() != absl::StatusCode::kResourceExhausted) return ex.plan.status();
  return ex;
}

absl::StatusOr<int64_t> PipelineKvBlocks(const Pipeline& pipeline, int64_t max_seq_len, int64_t block_size) {
  if (block_size < 1) return absl::InvalidArgumentError(absl::StrCat("kv block size must be >= 1, got ", block_size));
  if (max_seq_len < 1) return absl::InvalidArgumentError(absl::StrCat("max_seq_len must be >= 1, got ", max_seq_len));
  if (pipeline.stages.empty()) return absl::InvalidArgumentError("the pipeline has no stages");
  int64_t tokens = std::numeric_limits<int64_t>::max();
  for (const StageSpec& st : pipeline.stages) tokens = std::min(tokens, st.kv_tokens);
  const int64_t one_sequence = (max_seq_len + block_size - 1) / block_size;
  const int64_t blocks = std::max(tokens / block_size, one_sequence);
  return std::min<int64_t>(blocks, std::numeric_limits<int32_t>::max());
}

}  // namespace shardserve

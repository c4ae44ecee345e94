#include "sdk/cli/plan_explain.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/plan/plan.h"
#include "nlohmann/json.hpp"

namespace shardserve::cli {
namespace {

std::string Table(const std::vector<std::vector<std::string>>& rows, const std::string& indent) {
  std::vector<size_t> width;
  for (const auto& r : rows) {
    width.resize(std::max(width.size(), r.size()), 0);
    for (size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
  }
  std::string out;
  for (const auto& r : rows) {
    out += indent;
    for (size_t i = 0; i < r.size(); ++i) {
      out += r[i];
      if (i + 1 < r.size()) out += std::string(width[i] - r[i].size() + 2, ' ');
    }
    out += "\n";
  }
  return out;
}

std::string StageRows(const std::vector<StageEvaluation>& stages, bool chosen, int max_replicas,
                      const std::string& indent) {
  std::vector<std::vector<std::string>> rows = {
      {"replica", "worker", "tp", "layers", "weights/rank", "min KV/rank", "KV tokens", "KV/rank", "free/rank",
       "fits", "experts local/remote"}};
  int more = 0;
  const int first_replica = stages.empty() ? 0 : stages.front().replica;
  for (const StageEvaluation& e : stages) {
    if (chosen && e.replica - first_replica >= max_replicas) {
      more = std::max(more, e.replica + 1 - max_replicas);
      continue;
    }
    rows.push_back({absl::StrCat(e.replica), e.worker_id, absl::StrCat(e.tp),
                    absl::StrCat(e.layer_begin, "..", e.layer_end, e.has_embedding ? " +emb" : "",
                                 e.has_lm_head ? " +head" : ""),
                    FormatBytes(e.weight_bytes_per_rank), FormatBytes(e.min_kv_bytes_per_rank), absl::StrCat(e.kv_tokens),
                    FormatBytes(e.kv_bytes_per_rank), FormatBytes(e.room_per_rank), e.fits ? "yes" : "NO",
                    e.local_experts + e.remote_experts > 0 ? absl::StrCat(e.local_experts, "/", e.remote_experts) : "-"});
  }
  std::string out = Table(rows, indent);
  if (more > 0) absl::StrAppend(&out, indent, "(", more, " more replicas; --json lists all)\n");
  return out;
}

// Whether `b` failed as `a` did, only on another worker: same verdict, pp and spill, and the same
// failing stage (tp, layers, bytes). Runs of such layouts (the search stepping down the replica
// count, one smaller worker at a time) are summarised in the text.
bool SameFailure(const LayoutEvaluation& a, const LayoutEvaluation& b) {
  if (a.verdict == LayoutVerdict::kChosen || a.verdict != b.verdict || a.pp != b.pp ||
      a.expert_spill != b.expert_spill || a.stages.size() != b.stages.size()) {
    return false;
  }
  if (a.stages.empty()) return a.reason == b.reason;
  const StageEvaluation& x = a.stages.back();
  const StageEvaluation& y = b.stages.back();
  return x.tp == y.tp && x.layer_begin == y.layer_begin && x.layer_end == y.layer_end &&
         x.weight_bytes_per_rank == y.weight_bytes_per_rank && x.room_per_rank == y.room_per_rank;
}

std::string TrafficText(const PipelineTraffic& t, size_t replicas) {
  std::string out = absl::StrCat("\nTraffic per token", replicas > 1 ? " (replica 0; the others alike)" : "",
                                 " (f32 activations; ring collectives):\n");
  std::vector<std::vector<std::string>> rows = {
      {"stage", "TP all-reduce/rank", "logits all-gather/rank", "to next stage", "to/from expert hosts"}};
  for (size_t s = 0; s < t.stages.size(); ++s) {
    const StageTraffic& x = t.stages[s];
    auto bytes = [](int64_t b) { return b > 0 ? FormatBytes(b) : std::string("-"); };
    rows.push_back({absl::StrCat(s), bytes(x.tp_all_reduce_bytes), bytes(x.logits_all_gather_bytes),
                    bytes(x.next_stage_bytes), bytes(static_cast<int64_t>(x.remote_expert_bytes + 0.5))});
  }
  out += Table(rows, "  ");
  absl::StrAppend(&out, absl::StrFormat("Pipeline bubble: a stage idles %.0f%% of the time with one micro-batch in "
                                        "flight, %.0f%% with one per stage in flight (the default pipeline depth; "
                                        "from the stages' cost shares, hop latency not counted).\n",
                                        100 * t.bubble_one_micro_batch, 100 * t.bubble_pipelined));
  return out;
}

}  // namespace

std::string LayoutName(const LayoutEvaluation& l) {
  return absl::StrCat("tp=", l.tp_min, l.tp_max != l.tp_min ? absl::StrCat("..", l.tp_max) : "", " pp=", l.pp,
                      " replicas=", l.replicas_hi != l.replicas ? absl::StrCat(l.replicas_hi, "..") : "", l.replicas,
                      l.expert_spill ? " (expert spill)" : "");
}

std::string ExplanationToText(const PlanExplanation& ex, int max_replicas) {
  std::string out = "\nWhy this plan (--explain)\n";
  absl::StrAppend(&out, "  model: ", FormatBytes(ex.model_weight_bytes), " of weights on one rank (",
                  ex.int8 ? "int8 matrices, " : "", ex.bytes_per_param, " bytes per weight); KV ",
                  ex.kv_bytes_per_element, " bytes per element; every stage must hold the KV of ", ex.min_kv_tokens,
                  " tokens (max_seq_len ", ex.max_seq_len, ")\n");
  absl::StrAppend(&out, "  memory per rank: the smallest free bytes among a stage's devices, less a reserve of ",
                  FormatBytes(ex.reserve_bytes_per_device), " per device; ",
                  ex.kv_fraction > 0 ? absl::StrFormat("KV gets %.2f of what is left after the weights",
                                                       ex.kv_fraction)
                                     : std::string("KV is the fixed kv_tokens"),
                  "; activations and workspaces are not counted apart from the reserve\n");
  absl::StrAppend(&out, "  workers that can host a stage: ", ex.eligible_workers, "; tp ",
                  ex.tp_auto ? "auto" : "fixed", ", pp ", ex.pp_auto ? "auto" : "fixed", ", replicas ",
                  ex.replicas_auto ? "auto" : "fixed", "\n");
  absl::StrAppend(&out, "  search order: ", ex.search_order, ".\n\nLayouts evaluated, in that order:\n");
  const LayoutEvaluation* chosen = nullptr;
  auto print = [&](size_t i) {
    const LayoutEvaluation& l = ex.layouts[i];
    const bool is_chosen = l.verdict == LayoutVerdict::kChosen;
    if (is_chosen) chosen = &l;
    absl::StrAppend(&out, "  ", i + 1, ". ", LayoutName(l), ": ",
                    is_chosen ? "CHOSEN" : absl::StrCat("does not fit (", LayoutVerdictName(l.verdict), ")"), ": ",
                    l.reason, "\n");
    if (!l.stages.empty()) out += StageRows(l.stages, is_chosen, max_replicas, "       ");
  };
  for (size_t i = 0; i < ex.layouts.size();) {
    size_t j = i + 1;  // [i, j): a run of layouts that failed alike
    while (j < ex.layouts.size() && SameFailure(ex.layouts[i], ex.layouts[j])) ++j;
    print(i);
    if (j - i > 2) {
      absl::StrAppend(&out, "  ", i + 2, "..", j - 1, ". ", j - i - 2, " more layouts (replicas ",
                      ex.layouts[i + 1].replicas_hi, "..", ex.layouts[j - 2].replicas,
                      ") fail the same way, each on its pipeline's smallest worker\n");
    }
    if (j - i > 1) print(j - 1);
    i = j;
  }
  if (ex.layouts.empty()) out += "  (none: no layout was tried)\n";
  if (chosen != nullptr) {
    absl::StrAppend(&out, "\nChosen: ", LayoutName(*chosen), ", because it is the first layout in the search order "
                    "that fits");
    if (ex.layouts.size() > 1) {
      absl::StrAppend(&out, "; the ", ex.layouts.size() - 1, " evaluated before it rank higher (",
                      chosen->expert_spill ? "no expert spill, " : "", "fewer stages or more replicas) but do not fit");
    } else {
      out += "; it is also the first layout the order tries";
    }
    out += ".\n";
    if (!ex.traffic.empty()) out += TrafficText(ex.traffic.front(), ex.traffic.size());
  } else if (!ex.plan.ok()) {
    absl::StrAppend(&out, "\nNo layout fits: ", ex.plan.status().message(), "\n");
  }
  return out;
}

std::string ExplanationToJson(const PlanExplanation& ex) {
  using nlohmann::json;
  auto stage_json = [](const StageEvaluation& e) {
    return json{{"replica", e.replica},
                {"worker_id", e.worker_id},
                {"tp", e.tp},
                {"layer_begin", e.layer_begin},
                {"layer_end", e.layer_end},
                {"has_embedding", e.has_embedding},
                {"has_lm_head", e.has_lm_head},
                {"weight_bytes_per_rank", e.weight_bytes_per_rank},
                {"min_kv_tokens", e.min_kv_tokens},
                {"min_kv_bytes_per_rank", e.min_kv_bytes_per_rank},
                {"kv_tokens", e.kv_tokens},
                {"kv_bytes_per_rank", e.kv_bytes_per_rank},
                {"free_bytes_per_rank", e.room_per_rank},
                {"fits", e.fits},
                {"local_experts", e.local_experts},
                {"remote_experts", e.remote_experts}};
  };
  json layouts = json::array();
  for (const LayoutEvaluation& l : ex.layouts) {
    json stages = json::array();
    for (const StageEvaluation& e : l.stages) stages.push_back(stage_json(e));
    json j{{"layout", LayoutName(l)},  {"tp_min", l.tp_min},  {"tp_max", l.tp_max},
           {"pp", l.pp},               {"replicas", l.replicas}, {"replicas_hi", l.replicas_hi},
           {"expert_spill", l.expert_spill}, {"verdict", LayoutVerdictName(l.verdict)},
           {"reason", l.reason},       {"stages", std::move(stages)}};
    if (l.verdict == LayoutVerdict::kTooLittleMemory) {
      j["needed_bytes"] = l.needed_bytes;
      j["available_bytes"] = l.available_bytes;
    }
    layouts.push_back(std::move(j));
  }
  json explain{{"bytes_per_param", ex.bytes_per_param},
               {"kv_bytes_per_element", ex.kv_bytes_per_element},
               {"max_seq_len", ex.max_seq_len},
               {"min_kv_tokens", ex.min_kv_tokens},
               {"kv_fraction", ex.kv_fraction},
               {"reserve_bytes_per_device", ex.reserve_bytes_per_device},
               {"int8", ex.int8},
               {"model_weight_bytes", ex.model_weight_bytes},
               {"eligible_workers", ex.eligible_workers},
               {"search_order", ex.search_order},
               {"layouts", std::move(layouts)}};
  json traffic = json::array();
  for (const PipelineTraffic& t : ex.traffic) {
    json stages = json::array();
    for (const StageTraffic& x : t.stages) {
      stages.push_back({{"tp_all_reduce_bytes_per_token", x.tp_all_reduce_bytes},
                        {"logits_all_gather_bytes_per_token", x.logits_all_gather_bytes},
                        {"next_stage_bytes_per_token", x.next_stage_bytes},
                        {"remote_expert_bytes_per_token", x.remote_expert_bytes}});
    }
    traffic.push_back({{"stages", std::move(stages)},
                       {"bubble_one_micro_batch", t.bubble_one_micro_batch},
                       {"bubble_pipelined", t.bubble_pipelined}});
  }
  explain["traffic"] = std::move(traffic);
  json out{{"explain", std::move(explain)}, {"plan", nullptr}, {"error", nullptr}};
  if (ex.plan.ok()) {
    json replicas = json::array();
    for (const Pipeline& p : ex.plan->replicas) {
      json stages = json::array();
      for (const StageSpec& st : p.stages) {
        stages.push_back({{"worker_id", st.worker_id},
                          {"layer_begin", st.layer_begin},
                          {"layer_end", st.layer_end},
                          {"tp", st.tp},
                          {"devices", st.devices},
                          {"weight_bytes_per_rank", st.predicted_weight_bytes_per_rank},
                          {"kv_tokens", st.kv_tokens},
                          {"kv_bytes_per_rank", st.kv_bytes_per_rank},
                          {"cost_share", st.cost_share}});
      }
      replicas.push_back({{"stages", std::move(stages)}});
    }
    out["plan"] = {{"max_seq_len", ex.plan->max_seq_len}, {"replicas", std::move(replicas)}};
  } else {
    out["error"] = std::string(ex.plan.status().message());
  }
  return out.dump();
}

}  // namespace shardserve::cli

#include "coordinator/planner/traffic.h"

#include <algorithm>

namespace shardserve {

std::vector<PipelineTraffic> EstimateTraffic(const ModelSpec& spec, const Plan& plan) {
  constexpr int64_t kActivationBytes = 4;  // f32 on the wire and in the collectives
  const int64_t row = spec.hidden_size * kActivationBytes;
  std::vector<PipelineTraffic> out;
  for (const Pipeline& p : plan.replicas) {
    PipelineTraffic t;
    double max_share = 0.0;
    for (size_t s = 0; s < p.stages.size(); ++s) {
      const StageSpec& st = p.stages[s];
      StageTraffic x;
      const int64_t layers = st.layer_end - st.layer_begin;
      if (st.tp > 1) {
        x.tp_all_reduce_bytes = layers * 2 * (2 * (st.tp - 1) * row / st.tp);
        if (st.has_lm_head) {
          x.logits_all_gather_bytes = (st.tp - 1) * ((spec.vocab_size + st.tp - 1) / st.tp) * kActivationBytes;
        }
      }
      if (s + 1 < p.stages.size()) x.next_stage_bytes = row;
      for (const LayerExperts& le : p.experts) {
        if (le.layer < st.layer_begin || le.layer >= st.layer_end || le.experts.empty()) continue;
        const auto remote = std::count_if(le.experts.begin(), le.experts.end(),
                                          [](const ExpertLocation& e) { return e.remote; });
        x.remote_expert_bytes += static_cast<double>(spec.moe.top_k) * static_cast<double>(remote) /
                                 static_cast<double>(le.experts.size()) * 2.0 * static_cast<double>(row);
      }
      t.stages.push_back(x);
      max_share = std::max(max_share, st.cost_share);
    }
    const auto pp = static_cast<double>(p.stages.size());
    if (pp > 0) {
      t.bubble_one_micro_batch = 1.0 - 1.0 / pp;
      t.bubble_pipelined = max_share > 0 ? std::max(0.0, 1.0 - 1.0 / (pp * max_share)) : 0.0;
    }
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace shardserve

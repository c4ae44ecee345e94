#include "coordinator/sim/cost_model.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "common/log/log.h"

namespace shardserve::sim {

StageCostModel::StageCostModel(const ModelSpec& spec, const StageSpec& stage, DeviceProfile device,
                               int64_t bytes_per_param, int64_t kv_bytes_per_element)
    : spec_(spec),
      stage_(stage),
      device_(std::move(device)),
      bytes_per_param_(bytes_per_param),
      kv_bytes_(kv_bytes_per_element) {
  CHECK_GE(stage_.tp, 1);
  CHECK(stage_.layer_begin >= 0 && stage_.layer_begin < stage_.layer_end && stage_.layer_end <= spec_.num_layers);
  const double tp = stage_.tp;
  const double h = static_cast<double>(spec_.hidden_size);
  const double hd = static_cast<double>(spec_.head_dim);
  local_heads_ = static_cast<double>(spec_.num_heads) / tp;
  // KV heads are replicated when there are fewer than ranks (planner.h).
  local_kv_heads_ = std::max(1.0, static_cast<double>(spec_.num_kv_heads) / tp);
  attn_params_ = 2 * h * local_heads_ * hd + 2 * h * local_kv_heads_ * hd;
  if (spec_.IsMla()) attn_params_ = static_cast<double>(spec_.AttentionParameters()) / tp;
  dense_params_ = 3 * h * static_cast<double>(spec_.intermediate_size) / tp;
  expert_params_ = 3 * h * static_cast<double>(spec_.moe.expert_intermediate_size);
  shared_params_ = 3 * h * static_cast<double>(spec_.moe.shared_expert_intermediate_size) / tp;
  router_params_ = h * static_cast<double>(spec_.moe.num_experts);
}

HostShare ShareOfHost(double concurrent, const coordinator::HostParallelism& parallelism) {
  CHECK_GE(concurrent, 1.0);
  CHECK_GE(parallelism.memory, 1.0);
  CHECK_GE(parallelism.compute, 1.0);
  return {.memory = std::min(parallelism.memory, concurrent) / concurrent,
          .compute = std::min(parallelism.compute, concurrent) / concurrent};
}

double StageCostModel::Roofline(double bytes, double flops, const HostShare& share, StageTime& t) const {
  // The demands are the op's alone (the pipelining policy divides them by a parallelism itself).
  const double memory = bytes / (device_.memory_bytes_per_s * device_.memory_efficiency);
  const double compute = flops / (device_.flops_per_s * device_.compute_efficiency);
  t.memory_demand += memory;
  t.compute_demand += compute;
  return device_.overlap_memory_and_compute ? std::max(memory / share.memory, compute / share.compute)
                                             : memory / share.memory + compute / share.compute;
}

StageTime StageCostModel::Cost(absl::Span<const SequenceWork> batch, const HostShare& share) const {
  CHECK(share.memory > 0 && share.memory <= 1 && share.compute > 0 && share.compute <= 1);
  StageTime t;
  double tokens = 0, sampled = 0;
  double kv_read_tokens = 0;   // cached positions read by attention, over the batch
  double attn_pairs = 0;       // (query, key) pairs
  for (const SequenceWork& s : batch) {
    const double n = static_cast<double>(s.tokens);
    const double p = static_cast<double>(s.pos_begin);
    tokens += n;
    sampled += s.sample ? 1 : 0;
    kv_read_tokens += p + n;
    attn_pairs += n * (p + (n + 1) / 2);
  }
  if (tokens == 0) return t;
  const double tp = stage_.tp;
  const double h = static_cast<double>(spec_.hidden_size);
  const double hd = static_cast<double>(spec_.head_dim);
  const double bpp = static_cast<double>(bytes_per_param_);
  // K and V per position (MLA: the latent and the RoPE key).
  const double kv_row = static_cast<double>(spec_.KvValuesPerToken(stage_.tp)) * static_cast<double>(kv_bytes_);
  // Multiply-adds per (query, key) pair and head / 2: q.k and the weighted value (MLA, absorbed:
  // over the latent + RoPE key, then the latent).
  const double pair_width =
      spec_.IsMla() ? static_cast<double>(2 * spec_.mla.kv_lora_rank + spec_.mla.qk_rope_head_dim) / 2 : hd;
  const double act = tokens * h * static_cast<double>(device_.activation_bytes);
  double all_reduce = 0;
  if (stage_.tp > 1) {
    all_reduce = 2 * (tp - 1) / tp * act / device_.intra_node.bytes_per_s + 2 * (tp - 1) * device_.intra_node.latency_s;
  }
  for (int64_t layer = stage_.layer_begin; layer < stage_.layer_end; ++layer) {
    // Attention projections.
    t.weights += Roofline(attn_params_ * bpp, 2 * tokens * attn_params_, share, t);
    // Attention over the cache.
    t.attention += Roofline(kv_read_tokens * kv_row + tokens * kv_row, 4 * attn_pairs * local_heads_ * pair_width, share, t);
    if (spec_.IsSparseLayer(layer)) {
      const double e = static_cast<double>(spec_.moe.num_experts);
      const double k = static_cast<double>(spec_.moe.top_k);
      const double touched = e * (1 - std::pow(1 - k / e, tokens));
      // Expert parallel: experts spread over the ranks; split experts: each rank a 1/tp column slice.
      t.weights += Roofline(touched * expert_params_ * bpp / tp + router_params_ * 4,
                            2 * tokens * (k * expert_params_ / tp + router_params_), share, t);
      if (shared_params_ > 0) t.weights += Roofline(shared_params_ * bpp, 2 * tokens * shared_params_, share, t);
    } else {
      t.weights += Roofline(dense_params_ * bpp, 2 * tokens * dense_params_, share, t);
    }
    t.collectives += 2 * all_reduce;
    t.overhead += device_.layer_overhead_s / share.compute;
  }
  if (stage_.has_lm_head && sampled > 0) {
    const double lm = std::ceil(static_cast<double>(spec_.vocab_size) / tp) * h;
    t.weights += Roofline(lm * bpp, 2 * sampled * lm, share, t);
  }
  t.overhead += device_.step_overhead_s / share.compute;
  return t;
}

double HopSeconds(int64_t tokens, int64_t hidden, int64_t activation_bytes, const LinkProfile& link,
                  double overhead_s) {
  const double bytes = static_cast<double>(tokens) * static_cast<double>(hidden) * static_cast<double>(activation_bytes);
  return link.latency_s + bytes / link.bytes_per_s + overhead_s;
}

}  // namespace shardserve::sim

// libFuzzer target: config.json parsing. Any input must produce a ModelSpec that satisfies the
// invariants the engine relies on, or an error status — never a crash.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "absl/strings/string_view.h"
#include "common/model_spec/model_spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  auto spec = shardserve::ParseModelSpec(text, "fuzz");
  if (spec.ok()) {
    const auto& s = *spec;
    if (s.hidden_size < 1 || s.num_layers < 1 || s.num_heads < 1 || s.num_kv_heads < 1) std::abort();
    if (s.num_heads % s.num_kv_heads != 0 || s.head_dim % 2 != 0) std::abort();
    if (s.IsMoe() && (s.moe.top_k < 1 || s.moe.top_k > s.moe.num_experts ||
                      s.moe.sparse_layers.size() != static_cast<size_t>(s.num_layers))) {
      std::abort();
    }
    for (int64_t id : s.eos_token_ids) {
      if (id < 0 || id >= s.vocab_size) std::abort();
    }
    if (s.IsMla()) {
      // Multi-head latent attention: the sizes the engine divides and indexes by.
      const auto& m = s.mla;
      if (m.qk_rope_head_dim < 2 || m.qk_rope_head_dim % 2 != 0 || m.qk_nope_head_dim < 1 || m.v_head_dim < 1 ||
          m.q_lora_rank < 0 || s.head_dim != m.qk_rope_head_dim || s.num_kv_heads != s.num_heads) {
        std::abort();
      }
      // DeepSeek-V3 scores a group by its two best experts; V2 by its best, and never renormalises.
      const auto& moe = s.moe;
      const bool v2 = moe.scoring == shardserve::MoeScoring::kSoftmaxGroupLimited;
      if (!v2 && moe.scoring != shardserve::MoeScoring::kSigmoidGrouped) std::abort();
      if (v2 && moe.norm_topk_prob) std::abort();
      if (moe.n_group < 1 || moe.num_experts % moe.n_group != 0 || moe.num_experts / moe.n_group < (v2 ? 1 : 2) ||
          moe.topk_group < 1 || moe.topk_group > moe.n_group ||
          moe.top_k > moe.topk_group * (moe.num_experts / moe.n_group)) {
        std::abort();
      }
      if (s.KvValuesPerToken(1) != m.kv_lora_rank + m.qk_rope_head_dim) std::abort();
    }
    // Llama-4: per-layer lists the engine indexes by layer, a chunk size wherever a layer is
    // chunked, and a positive temperature floor (it divides positions).
    const size_t layers = static_cast<size_t>(s.num_layers);
    if ((!s.rope_layers.empty() && s.rope_layers.size() != layers) ||
        (!s.chunked_layers.empty() && (s.chunked_layers.size() != layers || s.attention_chunk_size < 1)) ||
        s.attn_floor_scale < 0.0 || (!s.weight_prefix.empty() && s.weight_prefix != "language_model.")) {
      std::abort();
    }
    if (s.moe.scoring == shardserve::MoeScoring::kSigmoidInput && (!s.IsMoe() || !s.moe.fused_experts)) std::abort();
    // RoPE: an even rotated width within the head; longrope's factor lists cover it.
    const int64_t rot = s.RotaryDim();
    if (rot < 2 || rot % 2 != 0 || rot > s.head_dim) std::abort();
    if (s.rope.type == shardserve::RopeType::kLongrope &&
        (s.rope.short_factor.size() != static_cast<size_t>(rot / 2) ||
         s.rope.long_factor.size() != static_cast<size_t>(rot / 2) || !(s.rope.attention_factor > 0.0))) {
      std::abort();
    }
    if (!(s.AttentionScale() > 0.0) || s.KvValuesPerToken(1) < 1) std::abort();
    (void)s.NumParameters();
  }
  return 0;
}

// The weights one rank holds for its part of a model, loaded from a safetensors checkpoint onto a
// backend. Tensor-parallel slicing (Megatron): q/k/v and gate/up are split by output rows (whole
// heads / FFN columns), o and down by input columns; norms, embeddings and the router are
// replicated, as are Qwen3's per-head q/k norms. Multi-head latent attention (DeepSeek-V3): the
// query and key/value down-projections and their norms are replicated, q_b_proj / q_proj and
// kv_b_proj are split by heads, o_proj by its head columns; the latent KV cache is per rank. Fused checkpoint tensors (Phi-3's qkv_proj and
// gate_up_proj) are sliced into the same per-rank q/k/v and gate/up matrices as separate ones: a
// rank reads its q rows, k rows and v rows (its gate rows and up rows) of the fused matrix.
// Llama-4's fused experts (`experts.gate_up_proj` [experts, hidden, 2 x width], `experts.down_proj`
// [experts, width, hidden], transposed against nn.Linear) become per-expert gate/up/down matrices
// like the others (each rank transposes its slice of one expert at a time), as do GraniteMoe's
// stacked ones (`input_linear` [experts, 2 x width, hidden], `output_linear` [experts, hidden,
// width]). Llama-4's interleaved RoPE pairs are reordered into rotate_half's halves in every head's q and k rows. Tensor names are
// ModelSpec::weight_prefix + the usual names ("language_model." for Llama4ForConditionalGeneration). Each
// rank reads only its slice from the files (Checkpoint::ReadRows/ReadCols).
// Matrices (and the embedding table) stored as bf16 or f16 keep their dtype on backends that
// SupportsOp(kLinear / kEmbedding, dtype) (the round trip through f32 is exact); everything else,
// and every other backend, holds f32. Matrices of an FP8 checkpoint (F8_E4M3 with scales, see
// ModelSpec::fp8) stay F8_E4M3 where the backend SupportsOp(kLinear, kF8E4M3) (CUDA): each rank's
// slice as its codes plus the scale blocks it overlaps (LinearWeight::scales, common/fp8's
// ReadFp8Slice), 1 byte per weight; except matrices whose rows are picked one by one (interleaved
// RoPE heads, MLA's query and RoPE-key rows), which are dequantized. Elsewhere they are
// dequantized on load (common/fp8) and held as bf16 where the backend SupportsOp(kLinear, kBF16),
// rounded to nearest even, else f32. With Quantization::kInt8 the
// matrices of LinearWeight (the projections, experts and lm_head; not the router or the
// shared-expert gate) are quantized per rank slice into kQ8 where the backend SupportsOp(kLinear,
// kQ8), FP8 ones after dequantization.
// An MXFP4 checkpoint's experts (GPT-OSS, ModelSpec::mxfp4) stay MXFP4 (DType::kMxfp4: their code
// bytes and scale bytes as stored, 17/32 of a byte per weight) where the backend SupportsOp(kLinear,
// kMxfp4), with or without int8 (which then quantizes the other matrices): the gate and up rows of the rank's slice, and the down
// projection's columns when the slice is whole 32-column scale blocks (else the down projection is
// dequantized). Elsewhere they are dequantized, as FP8 ones are.
// Granite's residual_multiplier is folded into o_proj and every down projection (dense, expert,
// shared), and 1 / logits_scaling into the final norm's weight.
// Every tensor's dtype and shape are checked against the ModelSpec before use; a mismatch is an
// InvalidArgument naming the file and tensor (FP8 scale errors: see common/fp8/fp8_weights.h).
#ifndef SHARDSERVE_WORKER_ENGINE_WEIGHTS_H_
#define SHARDSERVE_WORKER_ENGINE_WEIGHTS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_spec/model_spec.h"
#include "common/safetensors/safetensors.h"
#include "worker/engine/step_runner.h"
#include "worker/kernels/backend.h"

namespace shardserve::engine {

// What one rank computes, derived from ModelSpec + TpShard. Validate() rejects layouts whose
// sizes do not divide evenly, before anything is loaded.
struct ShardLayout {
  int64_t q_heads = 0;        // local query heads
  int64_t kv_heads = 0;       // local kv heads (replicated when fewer kv heads than ranks)
  int64_t kv_head_begin = 0;  // first global kv head held
  int64_t q_head_begin = 0;
  int64_t ffn = 0;            // local dense MLP width
  int64_t expert_ffn = 0;     // local width of each local expert
  int64_t shared_ffn = 0;     // local width of the shared expert
  // Vocab-parallel lm_head: rows [vocab_begin, vocab_begin + vocab_padded) of the (zero-padded)
  // lm_head; vocab_padded = ceil(vocab / ranks).
  int64_t vocab_begin = 0;
  int64_t vocab_padded = 0;
  // MoE: expert parallel (whole experts, each on the rank expert_owner names) or, with fewer
  // experts than ranks, every expert split tensor-parallel (expert_parallel = false).
  bool expert_parallel = false;
  std::vector<int32_t> expert_owner;  // [num_experts]; only when expert_parallel
  bool IsLocalExpert(int64_t e) const {
    return !expert_parallel || expert_owner[static_cast<size_t>(e)] == rank;
  }
  int rank = 0;
  // Whether an expert owned by `owner` (a rank, or kRemoteExpert) is computed on this rank.
  bool OwnsExpert(int32_t owner) const { return owner != kRemoteExpert && (!expert_parallel || owner == rank); }
  // InvalidArgument naming what the tensor-parallel size does not divide, or a bad placement.
  static absl::StatusOr<ShardLayout> Make(const ModelSpec& spec, TpShard shard,
                                          const std::vector<int32_t>& expert_owner = {},
                                          bool split_experts = false);
};

struct LinearWeight {
  kernels::DeviceBuffer w;  // [out, in] of `dtype`
  kernels::DeviceBuffer b;  // [out] f32, or empty
  int64_t in = 0, out = 0;
  DType dtype = DType::kF32;
  // kF8E4M3: the scale blocks (f32) and their layout; fp8.scales is set by view(). kMxfp4: the
  // e8m0 scale bytes [out, in / 32].
  kernels::DeviceBuffer scales;
  kernels::Fp8ScaleGrid fp8;
  // For kernels::LinearParams::w.
  kernels::WeightView view() const {
    if (dtype == DType::kMxfp4) return kernels::WeightView::Mxfp4(w.as<uint8_t>(), scales.as<uint8_t>());
    if (dtype != DType::kF8E4M3) return {dtype, w.as<void>()};
    kernels::Fp8ScaleGrid grid = fp8;
    grid.scales = scales.as<float>();
    return kernels::WeightView::F8E4M3(w.as<uint8_t>(), grid);
  }
  const float* bias() const { return b.empty() ? nullptr : b.as<float>(); }
};

struct MlpWeights {
  LinearWeight gate, up, down;
};

struct LayerWeights {
  int64_t layer = 0;                 // index in the model
  kernels::DeviceBuffer input_norm;  // [hidden]
  kernels::DeviceBuffer post_norm;   // [hidden]: post_attention_layernorm
  // ModelSpec::sandwich_norms (Gemma-2): pre_feedforward_layernorm and post_feedforward_layernorm
  // ([hidden] each; post_norm then normalises the attention output); else empty.
  kernels::DeviceBuffer pre_ffn_norm, post_ffn_norm;
  LinearWeight q, k, v, o;
  // ModelSpec::qk_norm: the per-head RMSNorm weights of q and k, [head_dim] each; else empty.
  kernels::DeviceBuffer q_norm, k_norm;
  // ModelSpec::attention_sinks: this rank's heads' sink logits, [q_heads] f32; else empty.
  kernels::DeviceBuffer sinks;
  bool sparse = false;
  MlpWeights mlp;                    // dense layers
  LinearWeight router;               // sparse: [experts, hidden], with GPT-OSS's bias [experts]
  std::vector<MlpWeights> experts;   // sparse: one per expert; empty weights for non-local ones
  // Sparse: where each expert is computed, as ModelOptions::layer_experts (the layout's default
  // when the layer is not listed there): a rank, or kRemoteExpert.
  std::vector<int32_t> expert_owner;
  bool has_remote_experts = false;
  bool IsLocalExpert(int64_t e, const ShardLayout& layout) const {
    return layout.OwnsExpert(expert_owner[static_cast<size_t>(e)]);
  }
  bool IsRemoteExpert(int64_t e) const { return expert_owner[static_cast<size_t>(e)] == kRemoteExpert; }
  MlpWeights shared;                 // shared expert (when shared_ffn > 0)
  LinearWeight shared_gate;          // [1, hidden] when ModelSpec::moe.shared_expert_gate (Qwen2-MoE)
  // DeepSeek-V3's e_score_correction_bias [experts], on the device (counted) and on the host,
  // where routing runs.
  kernels::DeviceBuffer score_bias;
  std::vector<float> score_bias_host;

  // Multi-head latent attention (ModelSpec::IsMla; q, k, v above are then empty; o is
  // [hidden, local heads x v_head_dim]). The RoPE rows of q_rope and kv_rope are reordered from
  // DeepSeek's interleaved pairs to rotate_half's halves when rope_interleave (the dot product of
  // q and k is unchanged by one permutation of both), so the Rope op applies.
  LinearWeight q_a;                  // q_a_proj [q_lora_rank, hidden] (q_lora_rank > 0)
  kernels::DeviceBuffer q_a_norm;    // [q_lora_rank]
  LinearWeight q_nope, q_rope;       // q_b_proj's (or q_proj's) rows of the local heads: [heads x nope | rope, in]
  LinearWeight kv_latent, kv_rope;   // kv_a_proj_with_mqa's rows [0, kv_lora_rank) and the RoPE key's
  kernels::DeviceBuffer kv_a_norm;   // [kv_lora_rank]
  // kv_b_proj per local head, for HeadLinear (view() as its WeightView): the key rows transposed,
  // [heads, kv_lora_rank, nope] (absorbed into the query), and the value rows [heads, v, kv_lora_rank].
  LinearWeight w_uk, w_uv;
};

struct ModelWeights {
  kernels::DeviceBuffer embedding;  // [vocab, hidden] of embedding_dtype; first stage (or tied last stage) only
  DType embedding_dtype = DType::kF32;
  kernels::DeviceBuffer final_norm; // [hidden]; last stage only
  // [vocab_padded, hidden]: this rank's rows of the lm_head; when tied on one rank, w is empty and
  // the embedding itself is the matrix (lm_head_view() says which).
  LinearWeight lm_head;
  bool lm_head_is_embedding = false;
  kernels::WeightView embedding_view() const { return {embedding_dtype, embedding.as<void>()}; }
  kernels::WeightView lm_head_view() const { return lm_head_is_embedding ? embedding_view() : lm_head.view(); }
  std::vector<LayerWeights> layers;
  size_t bytes = 0;                 // device bytes held
};

// The dtype a weight stored as `stored` is kept in on `backend` for `op`: an F8_E4M3 weight as
// stored where the backend SupportsOp(op, kF8E4M3), else dequantized as bf16; a bf16 or f16 one as
// stored; each where the backend SupportsOp(op, that dtype); else f32. The loader keeps every tensor by this rule (the memory model's formats follow from it).
DType KeptWeightDType(const kernels::Backend& backend, DType stored, kernels::Op op);
// The embedding table's dtype: KeptWeightDType for kEmbedding, and f32 when the table is also the
// lm_head (`also_lm_head`, tied on one rank) but kLinear would keep another dtype.
DType KeptEmbeddingDType(const kernels::Backend& backend, DType stored, bool also_lm_head);

// Where each expert of MoE layer `layer` is computed on this rank's stage (LayerWeights::expert_owner):
// the placement `layer_experts` gives for the layer (with experts split over all ranks, any local
// expert is owned by 0), else the layout's (expert parallel) or rank 0 for all (split).
std::vector<int32_t> LayerExpertOwners(const ShardLayout& layout, int64_t num_experts,
                                       const std::map<int64_t, std::vector<int32_t>>& layer_experts, int64_t layer);

// Loads the weights of `shard` for layers [layer_begin, layer_end) from `ckpt` onto `backend`
// (which must outlive the result): the embedding when the range starts at layer 0 (or when the
// lm_head is tied to it and the range ends at the last layer), the final norm and lm_head when it
// ends at the last layer. ModelWeights::layers[i] is layer layer_begin + i. `layer_experts` as in
// ModelOptions (validated by the caller): remote experts are not loaded.
absl::StatusOr<ModelWeights> LoadWeights(const ModelSpec& spec, const ShardLayout& layout, TpShard shard,
                                         int64_t layer_begin, int64_t layer_end, const Checkpoint& ckpt,
                                         kernels::Backend& backend,
                                         const std::map<int64_t, std::vector<int32_t>>& layer_experts = {},
                                         Quantization quantize = Quantization::kNone,
                                         const std::function<void(int64_t, int64_t, size_t)>& on_layer = nullptr);

// One whole expert's MLP weights (w1/w3/w2 or gate/up/down, all of it) of MoE layer `layer`, for a
// worker that computes experts for other stages. InvalidArgument for a layer that is not a MoE
// layer or an expert id out of range.
absl::StatusOr<MlpWeights> LoadExpert(const ModelSpec& spec, int64_t layer, int64_t expert, const Checkpoint& ckpt,
                                      kernels::Backend& backend, size_t* bytes,
                                      Quantization quantize = Quantization::kNone);

}  // namespace shardserve::engine

#endif  // SHARDSERVE_WORKER_ENGINE_WEIGHTS_H_

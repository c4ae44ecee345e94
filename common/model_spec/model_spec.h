// ModelSpec: the shape and semantics of a supported model, parsed from a Hugging Face
// `config.json`. Everything downstream (weight loading, the planner, the engine) works from this
// struct and never from JSON. Supported architectures: LlamaForCausalLM, MistralForCausalLM,
// Qwen2ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM,
// Phi3ForCausalLM, DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM
// (and the text part of Gemma3ForConditionalGeneration), Llama4ForCausalLM (and the text model of
// Llama4ForConditionalGeneration), GraniteForCausalLM, GraniteMoeForCausalLM,
// GraniteMoeSharedForCausalLM, GraniteSWAForCausalLM, GraniteMoeSWAForCausalLM, SmolLM3ForCausalLM,
// GptOssForCausalLM (bf16/f32 experts, or MXFP4 ones dequantized at load), Glm4MoeForCausalLM,
// Glm4MoeLiteForCausalLM, SeedOssForCausalLM, Glm4ForCausalLM.
// Anything else — another architecture (Gemma-3n, ...),
// an activation other than SiLU (GELU-tanh for Gemma), an unsupported RoPE scaling type
// (longrope outside Phi-3), a partial rotary factor below 1 outside Phi-3, GLM-4 and GLM-4.5, a DeepSeek routing
// variant we do not implement — is an error that names the field, never a silently wrong model.
#ifndef SHARDSERVE_COMMON_MODEL_SPEC_MODEL_SPEC_H_
#define SHARDSERVE_COMMON_MODEL_SPEC_MODEL_SPEC_H_

#include <cstdint>
#include <optional>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"
#include "common/tensor/dtype.h"

namespace shardserve {

enum class Architecture : uint8_t {
  kLlama, kMistral, kQwen2, kMixtral, kQwen2Moe, kQwen3, kQwen3Moe, kPhi3, kDeepseekV3, kGemma2,
  kLlama4,
  kGemma3,
  kDeepseekV2,
  kGranite,
  kGraniteMoe,
  kSmolLM3,
  kGraniteMoeShared,
  kGraniteSWA,
  kGraniteMoeSWA,
  kGptOss,
  kGlm4Moe,
  kGlm4MoeLite,
  kSeedOss,
  kGlm4,
};

// The activation of the gated MLP: act(gate) * up.
enum class Activation : uint8_t {
  kSilu,      // silu / swish
  kGeluTanh,  // gelu_pytorch_tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
  // GPT-OSS: min(gate, 7) sigmoid(1.702 min(gate, 7)) (clamp(up, -7, 7) + 1), swiglu_alpha 1.702 and
  // swiglu_limit 7 (the only values supported; every released GPT-OSS uses them).
  kClampedSwiglu,
};

absl::string_view ArchitectureName(Architecture arch);

enum class RopeType : uint8_t {
  kDefault,  // inv_freq_i = theta^(-2i/d)
  kLinear,   // positions divided by `factor`
  kLlama3,   // Llama 3.1 frequency-dependent scaling
  // YaRN (DeepSeek-V2, V3, GPT-OSS, and Llama-family rotate-half heads): per-frequency blend of
  // interpolation and extrapolation; cos and sin times attention_factor (MLA: its RoPE part only).
  kYarn,
  // LongRoPE (Phi-3.5, Phi-4-mini; "su" in older configs): inv_freq_i = 1 / (f_i theta^(2i/d)) with
  // f = short_factor while a sequence is at most original_max_position_embeddings long, else
  // long_factor; cos and sin times attention_factor.
  kLongrope,
};

struct RopeSpec {
  RopeType type = RopeType::kDefault;
  double theta = 10000.0;
  double factor = 1.0;                        // linear, llama3
  double low_freq_factor = 1.0;               // llama3
  double high_freq_factor = 4.0;              // llama3
  int64_t original_max_position_embeddings = 0;  // llama3, yarn
  // yarn (transformers' _compute_yarn_parameters): the frequencies between the correction dims of
  // beta_fast and beta_slow rotations are blended; `truncate` rounds those dims outwards.
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  bool truncate = true;
  // yarn: `mscale` and `mscale_all_dim` as in config.json (0 = absent). attention_factor scales
  // the rotated q and k (cos and sin), so their dot product by attention_factor^2: given, or
  // mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else
  // mscale(factor, 1), where mscale(s, m) = 0.1 m ln(s) + 1 for s > 1, else 1.
  double mscale = 0.0;
  double mscale_all_dim = 0.0;
  double attention_factor = 1.0;  // yarn, longrope
  // longrope: the per-frequency divisors, rotary_dim / 2 each (float32, as transformers holds them).
  // Which set rotates a step's new tokens follows transformers' KV-cache generation: the long one
  // when the sequence's length at the end of the step exceeds original_max_position_embeddings;
  // cached keys keep the rotation they were written with.
  std::vector<float> short_factor, long_factor;
  // Phi-3, GLM-4 and GLM-4.5: only the first int(head_dim x partial_rotary_factor) elements of each
  // q and k head rotate (rotate_half over those, or interleaved pairs with rope_interleaved); the
  // rest pass through.
  double partial_rotary_factor = 1.0;
};

// Multi-head latent attention (DeepSeek-V2 and V3, GLM-4.7-Flash). Per token: q = q_b(RmsNorm(q_a(x))) (or q_proj(x)
// when q_lora_rank is 0), per head [qk_nope_head_dim | qk_rope_head_dim]; the key/value latent
// c = RmsNorm(kv_a(x)[:kv_lora_rank]) and one RoPE key shared by every head,
// kv_a(x)[kv_lora_rank:]; per head, k_nope and v are kv_b's rows applied to c. The KV cache holds
// c and the roped key: kv_lora_rank + qk_rope_head_dim values per token and layer, whatever the
// number of heads.
struct MlaSpec {
  int64_t q_lora_rank = 0;  // 0: no query compression (config null)
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  // The RoPE dims of q and k come in interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's
  // layout; V3's rope_interleave, default true; always for V2) instead of rotate_half's halves.
  bool rope_interleave = true;
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
};

// How a MoE router turns its logits into expert choices and weights.
enum class MoeScoring : uint8_t {
  kSoftmax,  // Mixtral, Qwen: softmax over the experts, the top_k probabilities
  // DeepSeek-V3 ("noaux_tc") and GLM-4.5: sigmoid scores; experts are chosen by score + the checkpoint's
  // e_score_correction_bias within the topk_group best of n_group groups (a group's score: the
  // sum of its two best biased scores); the weights are the chosen unbiased scores,
  // renormalised when norm_topk_prob, times routed_scaling_factor.
  kSigmoidGrouped,
  // DeepSeek-V2: softmax scores; with n_group > 1 ("group_limited_greedy") only the experts of
  // the topk_group groups with the largest best score compete, else ("greedy") all; the top_k
  // scores, never renormalised (transformers ignores norm_topk_prob here), times
  // routed_scaling_factor. No score-correction bias.
  kSoftmaxGroupLimited,
  // Llama-4: the top_k router logits are chosen and each chosen expert's weight is the sigmoid
  // of its logit, which scales the expert's *input*; the experts' outputs are summed unscaled
  // (no renormalisation, no routed_scaling_factor).
  kSigmoidInput,
};

// Mixture-of-experts layout. `num_experts == 0` for dense models.
struct MoeSpec {
  int64_t num_experts = 0;
  int64_t top_k = 0;
  MoeScoring scoring = MoeScoring::kSoftmax;
  int64_t n_group = 1;     // kSigmoidGrouped, kSoftmaxGroupLimited: expert groups (divides num_experts)
  int64_t topk_group = 1;  // kSigmoidGrouped, kSoftmaxGroupLimited: groups an expert is chosen from
  double routed_scaling_factor = 1.0;
  // Renormalise the top-k routing weights to sum to 1 (Mixtral always does; Qwen2-MoE and
  // Qwen3-MoE per config).
  bool norm_topk_prob = true;
  int64_t expert_intermediate_size = 0;
  // Shared expert (0 = none): Qwen2-MoE's, with a sigmoid gate [1, hidden] when
  // shared_expert_gate; DeepSeek-V3's (and GLM-4.5's) n_shared_experts x moe_intermediate_size as one
  // ungated MLP;
  // GraniteMoeShared's shared_intermediate_size, ungated, stored as `shared_mlp.input_linear`
  // [2 x width, hidden] (gate rows first) and `shared_mlp.output_linear` [hidden, width] beside
  // the MoE block. Qwen3-MoE has none.
  int64_t shared_expert_intermediate_size = 0;
  bool shared_expert_gate = false;
  // Per layer: true when the layer's MLP is a sparse MoE block (false: dense MLP of width
  // ModelSpec::intermediate_size).
  std::vector<bool> sparse_layers;
  // Llama-4's checkpoint layout: per layer `experts.gate_up_proj` [experts, hidden, 2 x
  // expert_intermediate_size] (gate columns first) and `experts.down_proj` [experts,
  // expert_intermediate_size, hidden], i.e. transposed against nn.Linear; the loader transposes
  // and slices them per rank.
  bool fused_experts = false;
  // GraniteMoe's checkpoint layout: per layer `block_sparse_moe.input_linear` [experts, 2 x
  // expert_intermediate_size, hidden] (gate rows first) and `block_sparse_moe.output_linear`
  // [experts, hidden, expert_intermediate_size]: each expert's matrices as nn.Linear holds them,
  // stacked. The router is `block_sparse_moe.router.layer`. GraniteMoeSWA's checkpoints (written
  // by transformers 5) name them `block_sparse_moe.experts.gate_up_proj`, `experts.down_proj` and
  // `router`, with the same shapes.
  bool stacked_experts = false;
  // GPT-OSS's layout: per layer `mlp.experts.gate_up_proj` [experts, hidden, 2 x
  // expert_intermediate_size] with gate and up in alternating columns (gate j at 2j, up j at 2j + 1),
  // `experts.down_proj` [experts, expert_intermediate_size, hidden] (both transposed against
  // nn.Linear), and their biases `experts.gate_up_proj_bias` [experts, 2 x width] (alternating too)
  // and `experts.down_proj_bias` [experts, hidden]; the router `mlp.router` has a bias. In an MXFP4
  // checkpoint (ModelSpec::mxfp4) the two matrices are `<name>_blocks` and `<name>_scales`, each
  // expert [out, in] as nn.Linear holds it (common/fp8/mxfp4_weights.h). The routing weight of an
  // expert multiplies its output, its down bias included.
  bool interleaved_experts = false;
  bool router_bias = false;
  bool expert_bias = false;
};

// An MXFP4 checkpoint (config.json's `quantization_config` with `quant_method: "mxfp4"`, as GPT-OSS
// is released): the MoE experts' matrices are stored as e2m1 codes with one e8m0 scale per 32
// inputs (MoeSpec::interleaved_experts), everything else in the config's dtype. The loader
// dequantizes the experts (exactly: every MXFP4 value is a bf16 value) and keeps them as it keeps
// bf16 matrices (bf16 where the backend takes it, int8 with --quantize=int8).
struct Mxfp4Quantization {
  // `modules_to_not_convert`, as given; informational.
  std::vector<std::string> modules_not_converted;
};

// An FP8 checkpoint: config.json's `quantization_config` with `quant_method: "fp8"`, as written by
// Hugging Face's fine-grained FP8 (DeepSeek-V3, Qwen3-*-FP8: block scales) and by AutoFP8 / vLLM
// (one scale per tensor). The weight matrices are stored F8_E4M3 (e4m3fn) and everything else in
// the config's dtype; tensors listed in `modules_not_converted` are simply not stored as fp8. The
// dequantized weight is fp8 value x scale, where the scale of a weight `<name>` is:
//   - block-wise (`weight_block_size: [block_rows, block_cols]`): `<name>_scale_inv`, F32 (or BF16)
//     of shape [ceil(out / block_rows), ceil(in / block_cols)]; element (i, j) scales the block of
//     output features [i * block_rows, ...) and input features [j * block_cols, ...), the last
//     blocks of each dimension possibly shorter;
//   - per tensor (no `weight_block_size`): `<name>_scale_inv` or `<name>_scale`, one value of
//     shape [], [1] or [1, 1].
// common/fp8 applies them (ReadWeightRows and friends). Activations are always computed in f32 (the
// weights are dequantized on load), so `activation_scheme` "dynamic" and "static" both load, and the
// input scales of a static checkpoint (`<prefix>.input_scale`) are ignored.
struct Fp8Quantization {
  // Block size along output features (rows) and input features (columns); both 0 for per-tensor
  // scales, both > 0 otherwise.
  int64_t block_rows = 0;
  int64_t block_cols = 0;
  // activation_scheme "static": the checkpoint carries input scales, which are not used.
  bool static_activations = false;
  // `modules_to_not_convert` (Hugging Face) or `ignored_layers` (vLLM), as given; informational.
  std::vector<std::string> modules_not_converted;

  bool IsBlockWise() const { return block_rows > 0; }
};

struct ModelSpec {
  Architecture arch = Architecture::kLlama;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // dense MLP width
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  RopeSpec rope;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // Qwen2 always; Llama with attention_bias
  bool o_bias = false;    // Llama with attention_bias
  bool mlp_bias = false;  // Llama with mlp_bias
  // Qwen3 / Qwen3-MoE (and GLM-4.5 with use_qk_norm): q and k are RMS-normalised per head (weights `self_attn.q_norm` and
  // `self_attn.k_norm`, [head_dim] each, eps rms_norm_eps) after their projections, before RoPE.
  bool qk_norm = false;
  // Phi-3: the checkpoint stores q/k/v as one `self_attn.qkv_proj` [(heads + 2 kv_heads) x
  // head_dim, hidden] and gate/up as one `mlp.gate_up_proj` [2 x intermediate, hidden] (gate
  // rows first). Only the checkpoint's layout differs; the loader slices them per rank.
  bool fused_qkv = false;
  bool fused_gate_up = false;
  // Keys at distance >= sliding_window from the query are masked (Mistral); 0 = no window.
  int64_t sliding_window = 0;
  // Per layer: true when the layer attends within sliding_window (Gemma-2's "sliding_attention"
  // layer_types, by default the even layers). Empty: every layer does (when sliding_window > 0).
  std::vector<bool> sliding_layers;
  Activation activation = Activation::kSilu;
  // Gemma-2: every RMSNorm scales by (1 + weight) (applied to the weights at load), and each
  // layer has four norms: input -> attention -> post_attention_layernorm -> + residual ->
  // pre_feedforward_layernorm -> MLP -> post_feedforward_layernorm -> + residual. GLM-4 has the
  // same four, named post_self_attn_layernorm, post_attention_layernorm (the MLP's input) and
  // post_mlp_layernorm, without the + 1.
  bool norm_plus_one = false;
  bool sandwich_norms = false;
  // The embedding rows are multiplied by this (Gemma-2: sqrt(hidden_size), as a float32 rounded
  // to the checkpoint's dtype as transformers does); 1 = none.
  double embedding_multiplier = 1.0;
  // Gemma-2: the softmax scale is query_pre_attn_scalar^-1/2 instead of head_dim^-1/2 (0 = unset).
  double query_pre_attn_scalar = 0.0;
  // Granite (transformers' GraniteConfig): attention_multiplier is the softmax scale itself
  // (0 = unset); each layer's attention and MLP outputs are multiplied by residual_multiplier
  // before they join the residual stream; the logits are divided by logits_scaling. 1 = none. The
  // loader folds the last two into the weights: o_proj and down_proj (and their biases) scaled by
  // residual_multiplier, the final norm's weight divided by logits_scaling (it feeds only lm_head).
  // Granite's embedding_multiplier is embedding_multiplier above.
  double attention_multiplier = 0.0;
  double residual_multiplier = 1.0;
  double logits_scaling = 1.0;
  // Soft-capping (0 = none): attention scores s -> c tanh(s / c) after scaling and before the
  // mask and softmax; final logits likewise with their own cap. Gemma-3 never caps attention
  // scores (transformers ignores its attn_logit_softcapping).
  double attn_logit_softcapping = 0.0;
  double final_logit_softcapping = 0.0;
  // Gemma-3 (besides the Gemma-2 fields above and qk_norm with the (1 + w) convention): the RoPE of
  // the "sliding_attention" layers (rope_local_base_freq, default RoPE); `rope` is then the
  // "full_attention" layers' (rope_theta and rope_scaling, e.g. linear x8). Unset: one RoPE.
  std::optional<RopeSpec> sliding_rope;
  // Gemma-3: the config is Gemma3ForConditionalGeneration's and `text_config` describes this
  // model, whose decoder weights are stored under "model.language_model." (transformers >= 5) or
  // "language_model.model." (the released checkpoints); the vision tower is not loaded. As in
  // transformers, such a model never soft-caps its logits, and the top-level tie_word_embeddings
  // (default true) decides whether lm_head is the embedding.
  bool multimodal_text = false;
  int64_t bos_token_id = -1;           // -1 = none
  std::vector<int64_t> eos_token_ids;  // may be empty
  // torch_dtype / dtype from config.json when given: every weight tensor must be stored in it
  // (except, in an FP8 checkpoint, the F8_E4M3 matrices and their scales).
  std::optional<DType> dtype;
  // Set for FP8 checkpoints (quantization_config with quant_method "fp8").
  std::optional<Fp8Quantization> fp8;
  // Set for MXFP4 checkpoints (quant_method "mxfp4"; GPT-OSS only).
  std::optional<Mxfp4Quantization> mxfp4;
  MoeSpec moe;
  // DeepSeek-V2 / V3 and GLM-4.7-Flash (kv_lora_rank > 0): multi-head latent attention. head_dim is then
  // qk_rope_head_dim (the RoPE width, as transformers sets it), num_kv_heads == num_heads.
  MlaSpec mla;
  // Prepended to every checkpoint tensor name: "language_model." for the text model of
  // Llama4ForConditionalGeneration (whose config nests it in `text_config`), else empty.
  std::string weight_prefix;
  // Llama-4, SmolLM3 and GraniteSWA. Per layer: false for a NoPE layer (no rotary embedding;
  // `no_rope_layers` entry 0, or `layer_rope_theta` entry 0). Empty: every layer uses RoPE.
  std::vector<bool> rope_layers;
  // GraniteSWA's `layer_rope_theta`: per layer, the theta of its RoPE (`rope` otherwise: its type
  // and scaling); 0 on NoPE layers. Empty: rope.theta (or sliding_rope's) everywhere.
  std::vector<double> layer_rope_theta;
  // GraniteSWA and GPT-OSS (its s_aux): every layer holds `self_attn.sinks` [num_attention_heads], one
  // learned logit per head that joins the softmax's denominator with no value, so that a head can
  // attend to nothing: its output is scaled by sigmoid(logsumexp(scores) - sink).
  bool attention_sinks = false;
  // RoPE rotates interleaved pairs (x0, x1), (x2, x3), ... of each q and k head (Llama-4's
  // complex form; GLM-4's over its rotated part) instead of rotate_half's halves: the loader
  // reorders the q and k rows (and biases) of every head's rotated part into halves, which leaves
  // q . k unchanged, so the Rope op applies.
  bool rope_interleaved = false;
  // Llama-4 use_qk_norm: on RoPE layers, every q and k head is divided by its root mean square
  // (eps rms_norm_eps, no weight) after RoPE.
  bool qk_l2_norm = false;
  // Per layer: true when the layer attends only to keys in the query's chunk of
  // attention_chunk_size positions (floor(key / chunk) == floor(pos / chunk)), Llama-4's
  // "chunked_attention" layers. Empty: none.
  std::vector<bool> chunked_layers;
  int64_t attention_chunk_size = 0;
  // Llama-4 attn_temperature_tuning (0 = off): on NoPE layers each query row at position p is
  // multiplied by log1p(floor((p + 1) / attn_floor_scale)) x attn_temperature_scale + 1 (float32,
  // as transformers computes it).
  double attn_floor_scale = 0.0;
  double attn_temperature_scale = 0.0;

  bool IsMoe() const { return moe.num_experts > 0; }
  // GraniteMoe's layer, with or without GraniteMoeShared's shared expert (GraniteMoeSWA's too).
  bool IsGraniteMoe() const {
    return arch == Architecture::kGraniteMoe || arch == Architecture::kGraniteMoeShared ||
           arch == Architecture::kGraniteMoeSWA;
  }
  // The theta of layer `layer`'s RoPE (meaningless on a NoPE layer).
  double LayerRopeTheta(int64_t layer) const {
    return layer_rope_theta.empty() ? LayerRope(layer).theta : layer_rope_theta[static_cast<size_t>(layer)];
  }
  // The window of layer `layer`'s attention (0 = full attention).
  int64_t LayerSlidingWindow(int64_t layer) const {
    if (sliding_layers.empty()) return sliding_window;
    return sliding_layers[static_cast<size_t>(layer)] ? sliding_window : 0;
  }
  // Whether layer `layer` rotates with sliding_rope (a Gemma-3 sliding layer, even when its window
  // exceeds the context), and the RoPE it rotates with.
  bool UsesSlidingRope(int64_t layer) const {
    return sliding_rope.has_value() && !sliding_layers.empty() && sliding_layers[static_cast<size_t>(layer)];
  }
  const RopeSpec& LayerRope(int64_t layer) const { return UsesSlidingRope(layer) ? *sliding_rope : rope; }
  bool IsMla() const { return mla.kv_lora_rank > 0; }
  // The rotated elements of each q and k head (head_dim unless partial_rotary_factor < 1).
  int64_t RotaryDim() const {
    return static_cast<int64_t>(static_cast<double>(head_dim) * rope.partial_rotary_factor);
  }
  bool LayerUsesRope(int64_t layer) const {
    return rope_layers.empty() || rope_layers[static_cast<size_t>(layer)];
  }
  // The attention chunk of layer `layer` (0 = not chunked).
  int64_t LayerChunkSize(int64_t layer) const {
    return !chunked_layers.empty() && chunked_layers[static_cast<size_t>(layer)] ? attention_chunk_size : 0;
  }
  // Whether layer `layer`'s queries are scaled by position (attn_temperature_tuning on NoPE layers).
  bool LayerTemperatureTuned(int64_t layer) const { return attn_floor_scale > 0.0 && !LayerUsesRope(layer); }
  // Softmax scale of attention scores: 1/sqrt(head_dim) (1/sqrt(query_pre_attn_scalar) when
  // set, attention_multiplier when set), or for MLA 1/sqrt(qk_head_dim) times
  // mscale(factor, mscale_all_dim)^2 under yarn RoPE with mscale_all_dim set (DeepSeek-V2, V3).
  double AttentionScale() const;
  // KV cache values per token per layer on one of `tp` tensor-parallel ranks: K and V of the
  // rank's KV heads (KV heads replicated when fewer than ranks), or for MLA the latent and the
  // RoPE key, kv_lora_rank + qk_rope_head_dim, which every rank holds whole.
  int64_t KvValuesPerToken(int tp = 1) const;
  // Parameters of one layer's attention block, its two norms included (unsharded).
  int64_t AttentionParameters() const;
  bool IsSparseLayer(int64_t layer) const {
    return IsMoe() && moe.sparse_layers[static_cast<size_t>(layer)];
  }
  // Number of parameters (embedding and lm_head counted once when tied); INT64_MAX when the
  // declared sizes overflow int64 (a config.json may declare anything).
  int64_t NumParameters() const;
};

// Parses config.json text. InvalidArgument naming `label` and the offending field for malformed or
// inconsistent values; Unimplemented for well-formed but unsupported models (architecture,
// activation, rope type, partial_rotary_factor < 1 outside Phi-3, GLM-4 and GLM-4.5, longrope
// outside Phi-3 (and there, a rotary dimension that is odd or below 2, or longrope factors that
// are not rotary_dim / 2 positive numbers), Qwen2/Qwen3 sliding windows or layer_types
// other than "full_attention", DeepSeek-V3 values outside what is implemented: scoring_func other
// than "sigmoid", topk_method other than "noaux_tc", moe_layer_freq other than 1, attention_bias,
// num_key_value_heads != num_attention_heads; DeepSeek-V2 likewise, with scoring_func other than
// "softmax", topk_method other than "greedy" / "group_limited_greedy", norm_topk_prob true
// (transformers ignores it, DeepSeek's code renormalises), mlp_bias; GLM-4.7-Flash's attention as
// DeepSeek-V3's; yarn RoPE on Phi-3, Gemma-2, GLM-4 and GLM-4.5; Gemma-2 with a
// hidden_activation other than gelu_pytorch_tanh, use_bidirectional_attention, layer_types other
// than "sliding_attention"/"full_attention", a null sliding_window with sliding layers; Gemma-3
// likewise, and with rope_parameters not keyed by layer type, or a Gemma3ForConditionalGeneration
// config without a text_config object; Llama-4 with
// attention_bias, a quantization_config, layer_types other than "chunked_attention"/"full_attention",
// chunked layers without an attention_chunk_size, a top-level
// tie_word_embeddings true on Llama4ForConditionalGeneration, a rope type other than default,
// linear and llama3; GPT-OSS with swiglu_alpha other than 1.702, swiglu_limit other than 7,
// layer_types other than "sliding_attention"/"full_attention", a null sliding_window with sliding
// layers). A `quantization_config` is InvalidArgument, naming
// the field, unless it is fp8 as described at Fp8Quantization, or mxfp4 on GPT-OSS
// (Mxfp4Quantization): another quant_method (gptq, awq,
// bitsandbytes, compressed-tensors, fbgemm_fp8, ...), an `fmt` other than "e4m3" (e.g. "e5m2"), an
// activation_scheme other than "dynamic"/"static", a weight_block_size that is not two positive
// integers, or a modules_to_not_convert / ignored_layers that is not a list of strings. Pure.
absl::StatusOr<ModelSpec> ParseModelSpec(absl::string_view config_json, absl::string_view label);

// Reads `dir`/config.json, and `dir`/generation_config.json when present (its eos_token_id, which
// may list several ids, overrides config.json's). NotFound when config.json is missing.
absl::StatusOr<ModelSpec> LoadModelSpec(const std::string& dir);

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_MODEL_SPEC_MODEL_SPEC_H_

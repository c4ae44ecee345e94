// ModelSpec: the shape and semantics of a supported model, parsed from a Hugging Face
// `config.json`. Everything downstream (weight loading, the planner, the engine) works from this
// struct and never from JSON. Supported architectures: LlamaForCausalLM, MistralForCausalLM,
// Qwen2ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM. Anything else — another architecture,
// an activation other than SiLU, an unsupported RoPE scaling type — is an error that names the
// field, never a silently wrong model.
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

enum class Architecture : uint8_t { kLlama, kMistral, kQwen2, kMixtral, kQwen2Moe };

absl::string_view ArchitectureName(Architecture arch);

enum class RopeType : uint8_t {
  kDefault,  // inv_freq_i = theta^(-2i/d)
  kLinear,   // positions divided by `factor`
  kLlama3,   // Llama 3.1 frequency-dependent scaling
};

struct RopeSpec {
  RopeType type = RopeType::kDefault;
  double theta = 10000.0;
  double factor = 1.0;                        // linear, llama3
  double low_freq_factor = 1.0;               // llama3
  double high_freq_factor = 4.0;              // llama3
  int64_t original_max_position_embeddings = 0;  // llama3
};

// Mixture-of-experts layout. `num_experts == 0` for dense models.
struct MoeSpec {
  int64_t num_experts = 0;
  int64_t top_k = 0;
  // Renormalise the top-k routing weights to sum to 1 (Mixtral always does; Qwen2-MoE per config).
  bool norm_topk_prob = true;
  int64_t expert_intermediate_size = 0;
  // Qwen2-MoE shared expert (0 = none) and its sigmoid gate [1, hidden].
  int64_t shared_expert_intermediate_size = 0;
  // Per layer: true when the layer's MLP is a sparse MoE block (false: dense MLP of width
  // ModelSpec::intermediate_size).
  std::vector<bool> sparse_layers;
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
  // Keys at distance >= sliding_window from the query are masked (Mistral); 0 = no window.
  int64_t sliding_window = 0;
  int64_t bos_token_id = -1;           // -1 = none
  std::vector<int64_t> eos_token_ids;  // may be empty
  // torch_dtype / dtype from config.json when given: every weight tensor must be stored in it.
  std::optional<DType> dtype;
  MoeSpec moe;

  bool IsMoe() const { return moe.num_experts > 0; }
  bool IsSparseLayer(int64_t layer) const {
    return IsMoe() && moe.sparse_layers[static_cast<size_t>(layer)];
  }
  // Number of parameters (embedding and lm_head counted once when tied); INT64_MAX when the
  // declared sizes overflow int64 (a config.json may declare anything).
  int64_t NumParameters() const;
};

// Parses config.json text. InvalidArgument naming `label` and the offending field for malformed or
// inconsistent values; Unimplemented for well-formed but unsupported models (architecture,
// activation, rope type, Qwen2 sliding window). Pure.
absl::StatusOr<ModelSpec> ParseModelSpec(absl::string_view config_json, absl::string_view label);

// Reads `dir`/config.json, and `dir`/generation_config.json when present (its eos_token_id, which
// may list several ids, overrides config.json's). NotFound when config.json is missing.
absl::StatusOr<ModelSpec> LoadModelSpec(const std::string& dir);

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_MODEL_SPEC_MODEL_SPEC_H_

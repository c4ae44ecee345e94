#include "common/model_spec/model_spec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status/macros.h"
#include "nlohmann/json.hpp"

namespace shardserve {
namespace {

using json = nlohmann::json;

// Reads typed fields of one JSON object, producing errors that name the file and the field.
class Fields {
 public:
  Fields(const json& obj, absl::string_view label) : obj_(obj), label_(label) {}

  absl::Status Error(absl::string_view field, absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(label_, ": field \"", field, "\" ", what));
  }
  bool Has(const char* key) const {
    auto it = obj_.find(key);
    return it != obj_.end() && !it->is_null();
  }
  // A required integer in [min, max].
  absl::StatusOr<int64_t> Int(const char* key, int64_t min, int64_t max) const {
    auto it = obj_.find(key);
    if (it == obj_.end() || it->is_null()) return Error(key, "is missing");
    return IntValue(key, *it, min, max);
  }
  absl::StatusOr<int64_t> IntOr(const char* key, int64_t def, int64_t min, int64_t max) const {
    if (!Has(key)) return def;
    return Int(key, min, max);
  }
  absl::StatusOr<double> NumberOr(const char* key, double def, double min, double max) const {
    if (!Has(key)) return def;
    const json& v = obj_.at(key);
    if (!v.is_number()) return Error(key, "is not a number");
    const double d = v.get<double>();
    if (!(d >= min && d <= max)) return Error(key, absl::StrCat("is ", d, ", outside [", min, ", ", max, "]"));
    return d;
  }
  absl::StatusOr<bool> BoolOr(const char* key, bool def) const {
    if (!Has(key)) return def;
    const json& v = obj_.at(key);
    if (!v.is_boolean()) return Error(key, "is not true or false");
    return v.get<bool>();
  }
  absl::StatusOr<int64_t> IntValue(absl::string_view key, const json& v, int64_t min, int64_t max) const {
    if (!v.is_number_integer()) return Error(key, "is not an integer");
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(max)) {
      return Error(key, absl::StrCat("is ", v.get<uint64_t>(), ", above the limit ", max));
    }
    const int64_t i = v.get<int64_t>();
    if (i < min || i > max) return Error(key, absl::StrCat("is ", i, ", outside [", min, ", ", max, "]"));
    return i;
  }
  const json& obj() const { return obj_; }
  absl::string_view label() const { return label_; }

 private:
  const json& obj_;
  absl::string_view label_;
};

constexpr int64_t kMaxDim = int64_t{1} << 24;     // 16M: no real hidden/vocab size is larger
constexpr int64_t kMaxPositions = int64_t{1} << 24;

absl::StatusOr<Architecture> ParseArchitecture(const json& doc, absl::string_view label) {
  // References, not an iterator: GCC 12 at -O2 with TSan reports a potential null dereference
  // inside the inlined iterator (a false positive that -Werror turns into an error).
  const bool listed = doc.contains("architectures") && doc.at("architectures").is_array() &&
                      !doc.at("architectures").empty() && doc.at("architectures").at(0).is_string();
  if (!listed) {
    return absl::InvalidArgumentError(
        absl::StrCat(label, ": field \"architectures\" is missing or not a list of names"));
  }
  const std::string name = doc.at("architectures").at(0).get<std::string>();
  if (name == "LlamaForCausalLM") return Architecture::kLlama;
  if (name == "MistralForCausalLM") return Architecture::kMistral;
  if (name == "Qwen2ForCausalLM") return Architecture::kQwen2;
  if (name == "MixtralForCausalLM") return Architecture::kMixtral;
  if (name == "Qwen2MoeForCausalLM") return Architecture::kQwen2Moe;
  if (name == "Qwen3ForCausalLM") return Architecture::kQwen3;
  if (name == "Qwen3MoeForCausalLM") return Architecture::kQwen3Moe;
  if (name == "Phi3ForCausalLM") return Architecture::kPhi3;
  if (name == "DeepseekV2ForCausalLM") return Architecture::kDeepseekV2;
  if (name == "DeepseekV3ForCausalLM") return Architecture::kDeepseekV3;
  if (name == "Gemma2ForCausalLM") return Architecture::kGemma2;
  if (name == "Llama4ForCausalLM") return Architecture::kLlama4;
  if (name == "Gemma3ForCausalLM" || name == "Gemma3ForConditionalGeneration") return Architecture::kGemma3;
  if (name == "GraniteForCausalLM") return Architecture::kGranite;
  if (name == "GraniteMoeForCausalLM") return Architecture::kGraniteMoe;
  if (name == "GraniteMoeSharedForCausalLM") return Architecture::kGraniteMoeShared;
  if (name == "GraniteSWAForCausalLM") return Architecture::kGraniteSWA;
  if (name == "GraniteMoeSWAForCausalLM") return Architecture::kGraniteMoeSWA;
  if (name == "SmolLM3ForCausalLM") return Architecture::kSmolLM3;
  if (name == "GptOssForCausalLM") return Architecture::kGptOss;
  if (name == "Glm4MoeForCausalLM") return Architecture::kGlm4Moe;
  if (name == "Glm4MoeLiteForCausalLM") return Architecture::kGlm4MoeLite;
  if (name == "SeedOssForCausalLM") return Architecture::kSeedOss;
  if (name == "Glm4ForCausalLM") return Architecture::kGlm4;
  return absl::UnimplementedError(absl::StrCat(
      label, ": architecture \"", name,
      "\" is not supported (supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
      "MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, Phi3ForCausalLM, "
      "DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, "
      "Gemma3ForConditionalGeneration's text part, "
      "Llama4ForCausalLM, Llama4ForConditionalGeneration, GraniteForCausalLM, GraniteMoeForCausalLM, "
      "GraniteMoeSharedForCausalLM, GraniteSWAForCausalLM, GraniteMoeSWAForCausalLM, SmolLM3ForCausalLM, "
      "GptOssForCausalLM, Glm4MoeForCausalLM, Glm4MoeLiteForCausalLM, SeedOssForCausalLM, Glm4ForCausalLM)"));
}

// RoPE parameters: transformers >= 5 writes `rope_parameters` {rope_type, rope_theta, ...}; older
// configs have top-level `rope_theta` and an optional `rope_scaling` {type|rope_type, ...}.
// A list of positive numbers (longrope's short_factor / long_factor), as float32.
absl::StatusOr<std::vector<float>> PositiveNumbers(const Fields& f, const char* key) {
  if (!f.Has(key)) return f.Error(key, "is missing");
  const json& v = f.obj().at(key);
  if (!v.is_array() || v.empty()) return f.Error(key, "is not a list of numbers");
  std::vector<float> out;
  for (const auto& e : v) {
    if (!e.is_number() || !(e.get<double>() > 0.0) || !(e.get<double>() < 1e30)) {
      return f.Error(key, absl::StrCat("has ", e.dump(), "; every factor must be a positive number"));
    }
    out.push_back(static_cast<float>(e.get<double>()));
  }
  return out;
}

// `default_theta`: the theta of a config without rope_theta (the config class's default_theta);
// `default_partial`: its partial_rotary_factor when neither the top level nor the rope parameters
// state one (Glm4MoeConfig's is 0.5).
absl::Status ParseRope(const json& doc, absl::string_view label, int64_t max_positions, RopeSpec* rope,
                       double default_theta = 10000.0, double default_partial = 1.0) {
  Fields top(doc, label);
  ASSIGN_OR_RETURN(rope->theta, top.NumberOr("rope_theta", default_theta, 1e-3, 1e12));
  // Top level in older configs; transformers >= 5 moves it into the rope parameters (which win).
  ASSIGN_OR_RETURN(rope->partial_rotary_factor, top.NumberOr("partial_rotary_factor", default_partial, 0.0, 1.0));
  const json* params = nullptr;
  std::string field = "rope_scaling";
  if (top.Has("rope_parameters")) {
    params = &doc.at("rope_parameters");
    field = "rope_parameters";
  } else if (top.Has("rope_scaling")) {
    params = &doc.at("rope_scaling");
  }
  if (params == nullptr) return absl::OkStatus();
  if (!params->is_object()) return top.Error(field, "is not an object");
  const std::string sub_label = absl::StrCat(label, " ", field);
  Fields p(*params, sub_label);
  ASSIGN_OR_RETURN(rope->theta, p.NumberOr("rope_theta", rope->theta, 1e-3, 1e12));
  ASSIGN_OR_RETURN(rope->partial_rotary_factor,
                   p.NumberOr("partial_rotary_factor", rope->partial_rotary_factor, 0.0, 1.0));
  std::string type = "default";
  for (const char* key : {"rope_type", "type"}) {
    if (p.Has(key)) {
      if (!params->at(key).is_string()) return p.Error(key, "is not a string");
      type = params->at(key).get<std::string>();
      break;
    }
  }
  if (type == "default") {
    rope->type = RopeType::kDefault;
  } else if (type == "linear") {
    rope->type = RopeType::kLinear;
    ASSIGN_OR_RETURN(rope->factor, p.NumberOr("factor", -1.0, 1e-6, 1e6));
    if (rope->factor < 0) return p.Error("factor", "is missing");
  } else if (type == "llama3") {
    rope->type = RopeType::kLlama3;
    ASSIGN_OR_RETURN(rope->factor, p.NumberOr("factor", -1.0, 1e-6, 1e6));
    if (rope->factor < 0) return p.Error("factor", "is missing");
    ASSIGN_OR_RETURN(rope->low_freq_factor, p.NumberOr("low_freq_factor", 1.0, 1e-6, 1e6));
    ASSIGN_OR_RETURN(rope->high_freq_factor, p.NumberOr("high_freq_factor", 4.0, 1e-6, 1e6));
    // Equal factors (Llama-4 Scout) leave no smoothed band: every frequency is kept or divided.
    if (rope->high_freq_factor < rope->low_freq_factor) {
      return p.Error("high_freq_factor", "must not be less than low_freq_factor");
    }
    ASSIGN_OR_RETURN(rope->original_max_position_embeddings,
                     p.IntOr("original_max_position_embeddings", max_positions, 1, kMaxPositions));
  } else if (type == "yarn") {
    rope->type = RopeType::kYarn;
    ASSIGN_OR_RETURN(rope->original_max_position_embeddings,
                     p.IntOr("original_max_position_embeddings", max_positions, 1, kMaxPositions));
    // transformers: a missing factor is max_position_embeddings / original_max_position_embeddings.
    ASSIGN_OR_RETURN(rope->factor, p.NumberOr("factor", static_cast<double>(max_positions) /
                                                            static_cast<double>(rope->original_max_position_embeddings),
                                              1e-6, 1e6));
    // `beta_fast or 32`, `beta_slow or 1`: a 0 means the default too.
    ASSIGN_OR_RETURN(rope->beta_fast, p.NumberOr("beta_fast", 32.0, 0.0, 1e6));
    ASSIGN_OR_RETURN(rope->beta_slow, p.NumberOr("beta_slow", 1.0, 0.0, 1e6));
    if (rope->beta_fast == 0.0) rope->beta_fast = 32.0;
    if (rope->beta_slow == 0.0) rope->beta_slow = 1.0;
    ASSIGN_OR_RETURN(rope->truncate, p.BoolOr("truncate", true));
    ASSIGN_OR_RETURN(rope->mscale, p.NumberOr("mscale", 0.0, 0.0, 1e6));
    ASSIGN_OR_RETURN(rope->mscale_all_dim, p.NumberOr("mscale_all_dim", 0.0, 0.0, 1e6));
    auto get_mscale = [](double scale, double m) { return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; };
    if (p.Has("attention_factor")) {
      ASSIGN_OR_RETURN(rope->attention_factor, p.NumberOr("attention_factor", 1.0, 1e-6, 1e6));
    } else if (rope->mscale != 0.0 && rope->mscale_all_dim != 0.0) {
      rope->attention_factor = get_mscale(rope->factor, rope->mscale) / get_mscale(rope->factor, rope->mscale_all_dim);
    } else {
      rope->attention_factor = get_mscale(rope->factor, 1.0);
    }
  } else if (type == "longrope" || type == "su") {  // "su": the Phi-3 configs' first name for it
    rope->type = RopeType::kLongrope;
    ASSIGN_OR_RETURN(rope->short_factor, PositiveNumbers(p, "short_factor"));
    ASSIGN_OR_RETURN(rope->long_factor, PositiveNumbers(p, "long_factor"));
    // Phi-3 states it at the top level (its config copies it into the rope parameters).
    ASSIGN_OR_RETURN(int64_t orig, top.IntOr("original_max_position_embeddings", max_positions, 1, kMaxPositions));
    ASSIGN_OR_RETURN(rope->original_max_position_embeddings,
                     p.IntOr("original_max_position_embeddings", orig, 1, kMaxPositions));
    // A missing factor is max_position_embeddings / original_max_position_embeddings; the
    // attention factor, unless given, sqrt(1 + ln(factor) / ln(original)) (1 without scaling).
    ASSIGN_OR_RETURN(rope->factor, p.NumberOr("factor", static_cast<double>(max_positions) /
                                                            static_cast<double>(rope->original_max_position_embeddings),
                                              1e-6, 1e6));
    if (p.Has("attention_factor")) {
      ASSIGN_OR_RETURN(rope->attention_factor, p.NumberOr("attention_factor", 1.0, 1e-6, 1e6));
    } else if (rope->factor <= 1.0) {
      rope->attention_factor = 1.0;
    } else if (rope->original_max_position_embeddings < 2) {
      return p.Error("original_max_position_embeddings", "must be at least 2 (its logarithm divides)");
    } else {
      rope->attention_factor = std::sqrt(
          1.0 + std::log(rope->factor) / std::log(static_cast<double>(rope->original_max_position_embeddings)));
    }
  } else {
    return absl::UnimplementedError(absl::StrCat(sub_label, ": rope type \"", type,
                                                 "\" is not supported (supported: default, linear, llama3, yarn for DeepSeek-V2/V3, longrope for Phi-3)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int64_t>> ParseIds(const Fields& f, const char* key, int64_t vocab) {
  std::vector<int64_t> ids;
  if (!f.Has(key)) return ids;
  const json& v = f.obj().at(key);
  if (v.is_array()) {
    for (const auto& e : v) {
      ASSIGN_OR_RETURN(int64_t id, f.IntValue(key, e, 0, vocab - 1));
      ids.push_back(id);
    }
  } else {
    ASSIGN_OR_RETURN(int64_t id, f.IntValue(key, v, 0, vocab - 1));
    ids.push_back(id);
  }
  return ids;
}

// `layer_types` (transformers >= 4.53), when present: one entry per layer, all "full_attention";
// sliding-window layers mixed with full ones are not supported.
absl::Status CheckFullAttentionLayers(const Fields& f, int64_t num_layers) {
  if (!f.Has("layer_types")) return absl::OkStatus();
  const json& v = f.obj().at("layer_types");
  if (!v.is_array() || static_cast<int64_t>(v.size()) != num_layers) {
    return f.Error("layer_types", absl::StrCat("is not a list of ", num_layers, " layer types"));
  }
  for (const auto& e : v) {
    if (!e.is_string()) return f.Error("layer_types", "is not a list of strings");
    if (e.get<std::string>() != "full_attention") {
      return absl::UnimplementedError(absl::StrCat(f.label(), ": field \"layer_types\" has \"", e.get<std::string>(),
                                                   "\"; only \"full_attention\" layers are supported"));
    }
  }
  return absl::OkStatus();
}

// num_local_experts and num_experts_per_tok, with a config class's defaults for missing ones (a
// default top_k above the experts given is an error naming the field).
absl::Status ParseExpertCounts(const Fields& f, int64_t default_experts, int64_t default_top_k, MoeSpec* moe) {
  ASSIGN_OR_RETURN(moe->num_experts, f.IntOr("num_local_experts", default_experts, 1, 4096));
  ASSIGN_OR_RETURN(moe->top_k, f.IntOr("num_experts_per_tok", default_top_k, 1, moe->num_experts));
  if (moe->top_k > moe->num_experts) {
    return f.Error("num_experts_per_tok", absl::StrCat("is missing, and its default (", default_top_k,
                                                       ") exceeds num_local_experts (", moe->num_experts, ")"));
  }
  return absl::OkStatus();
}

absl::Status ParseMoe(const Fields& f, ModelSpec* spec) {
  MoeSpec& moe = spec->moe;
  if (spec->arch == Architecture::kMixtral || spec->IsGraniteMoe()) {
    // GraniteMoe: the softmax of the top_k router logits, which is Mixtral's softmax over all of
    // them renormalised over the top_k; GraniteMoeConfig's defaults are 8 experts, 2 per token.
    // GraniteMoeShared adds an ungated shared expert of shared_intermediate_size (0 = none, its
    // config's default).
    const bool granite = spec->IsGraniteMoe();
    if (spec->arch == Architecture::kGraniteMoeShared || spec->arch == Architecture::kGraniteMoeSWA) {
      ASSIGN_OR_RETURN(moe.shared_expert_intermediate_size, f.IntOr("shared_intermediate_size", 0, 0, kMaxDim));
    }
    if (granite) {
      RETURN_IF_ERROR(ParseExpertCounts(f, 8, 2, &moe));
    } else {
      ASSIGN_OR_RETURN(moe.num_experts, f.Int("num_local_experts", 1, 4096));
      ASSIGN_OR_RETURN(moe.top_k, f.Int("num_experts_per_tok", 1, moe.num_experts));
    }
    moe.norm_topk_prob = true;
    moe.expert_intermediate_size = spec->intermediate_size;
    moe.sparse_layers.assign(static_cast<size_t>(spec->num_layers), true);
    moe.stacked_experts = granite;
    return absl::OkStatus();
  }
  // Qwen2-MoE and Qwen3-MoE. transformers >= 5 writes Qwen3-MoE's `num_experts` as
  // `num_local_experts`; the released checkpoints say `num_experts`.
  const char* experts_key = "num_experts";
  if (spec->arch == Architecture::kQwen3Moe && !f.Has("num_experts")) experts_key = "num_local_experts";
  ASSIGN_OR_RETURN(moe.num_experts, f.Int(experts_key, 1, 4096));
  if (spec->arch == Architecture::kQwen3Moe && f.Has("num_experts") && f.Has("num_local_experts")) {
    ASSIGN_OR_RETURN(int64_t local, f.Int("num_local_experts", 1, 4096));
    if (local != moe.num_experts) {
      return f.Error("num_local_experts", absl::StrCat("(", local, ") disagrees with num_experts (", moe.num_experts,
                                                       ")"));
    }
  }
  ASSIGN_OR_RETURN(moe.top_k, f.Int("num_experts_per_tok", 1, moe.num_experts));
  ASSIGN_OR_RETURN(moe.norm_topk_prob, f.BoolOr("norm_topk_prob", false));
  ASSIGN_OR_RETURN(moe.expert_intermediate_size, f.Int("moe_intermediate_size", 1, kMaxDim));
  if (spec->arch == Architecture::kQwen2Moe) {
    ASSIGN_OR_RETURN(moe.shared_expert_intermediate_size,
                     f.IntOr("shared_expert_intermediate_size", 0, 0, kMaxDim));
    moe.shared_expert_gate = moe.shared_expert_intermediate_size > 0;
  }  // Qwen3-MoE has no shared expert (transformers ignores the field there too).
  ASSIGN_OR_RETURN(int64_t step, f.IntOr("decoder_sparse_step", 1, 1, spec->num_layers));
  std::vector<bool> dense_only(static_cast<size_t>(spec->num_layers), false);
  if (f.Has("mlp_only_layers")) {
    const auto& v = f.obj().at("mlp_only_layers");
    if (!v.is_array()) return f.Error("mlp_only_layers", "is not a list of layer indices");
    for (const auto& e : v) {
      ASSIGN_OR_RETURN(int64_t layer, f.IntValue("mlp_only_layers", e, 0, spec->num_layers - 1));
      dense_only[static_cast<size_t>(layer)] = true;
    }
  }
  moe.sparse_layers.resize(static_cast<size_t>(spec->num_layers));
  for (int64_t l = 0; l < spec->num_layers; ++l) {
    moe.sparse_layers[static_cast<size_t>(l)] = !dense_only[static_cast<size_t>(l)] && (l + 1) % step == 0;
  }
  return absl::OkStatus();
}

// A string field that, when present, must be `expected` (a variant we implement).
absl::Status ExpectString(const Fields& f, const char* key, absl::string_view expected, absl::string_view what) {
  if (!f.Has(key)) return absl::OkStatus();
  const json& v = f.obj().at(key);
  if (!v.is_string()) return f.Error(key, "is not a string");
  if (v.get<std::string>() != expected) {
    return absl::UnimplementedError(absl::StrCat(f.label(), ": field \"", key, "\" is \"", v.get<std::string>(),
                                                 "\"; only \"", expected, "\" (", what, ") is supported"));
  }
  return absl::OkStatus();
}

// DeepSeek-V2 and V3, and GLM-4.7-Flash (V3's attention): multi-head latent attention (see
// MlaSpec). `arch` names the model in errors; V2 always rotates interleaved pairs (its config has
// no rope_interleave switch).
absl::Status ParseMla(const Fields& f, Architecture arch, ModelSpec* s) {
  const absl::string_view name = arch == Architecture::kDeepseekV2   ? "DeepSeek-V2"
                                 : arch == Architecture::kGlm4MoeLite ? "GLM-4.7-Flash"
                                                                      : "DeepSeek-V3";
  MlaSpec& mla = s->mla;
  if (!f.obj().contains("q_lora_rank")) return f.Error("q_lora_rank", "is missing (null for no query compression)");
  ASSIGN_OR_RETURN(mla.q_lora_rank, f.IntOr("q_lora_rank", 0, 1, kMaxDim));
  ASSIGN_OR_RETURN(mla.kv_lora_rank, f.Int("kv_lora_rank", 1, kMaxDim));
  ASSIGN_OR_RETURN(mla.qk_nope_head_dim, f.Int("qk_nope_head_dim", 1, 65536));
  ASSIGN_OR_RETURN(mla.qk_rope_head_dim, f.Int("qk_rope_head_dim", 2, 65536));
  if (mla.qk_rope_head_dim % 2 != 0) {
    return f.Error("qk_rope_head_dim", absl::StrCat("is ", mla.qk_rope_head_dim, "; RoPE needs an even size"));
  }
  ASSIGN_OR_RETURN(mla.v_head_dim, f.Int("v_head_dim", 1, 65536));
  mla.rope_interleave = true;
  if (arch != Architecture::kDeepseekV2) {
    ASSIGN_OR_RETURN(mla.rope_interleave, f.BoolOr("rope_interleave", true));
  }
  // transformers sets head_dim to the RoPE width whatever config.json says.
  s->head_dim = mla.qk_rope_head_dim;
  if (s->num_kv_heads != s->num_heads) {
    return absl::UnimplementedError(absl::StrCat(
        f.label(), ": field \"num_key_value_heads\" is ", s->num_kv_heads, "; multi-head latent attention expands its "
        "latent to every head, so it must equal num_attention_heads (", s->num_heads, ")"));
  }
  ASSIGN_OR_RETURN(bool attention_bias, f.BoolOr("attention_bias", false));
  if (attention_bias) {
    return absl::UnimplementedError(
        absl::StrCat(f.label(), ": field \"attention_bias\" is true; ", name, " attention without biases only"));
  }
  if (s->rope.type != RopeType::kDefault && s->rope.type != RopeType::kYarn) {
    return absl::UnimplementedError(absl::StrCat(f.label(), ": ", name, " supports rope types default and yarn only"));
  }
  return absl::OkStatus();
}

// The MoE layer layout of DeepSeek-V2 and V3: sparse from first_k_dense_replace on, with
// moe_layer_freq 1 (transformers ignores the field; DeepSeek's own code would skip layers).
absl::Status ParseDeepseekSparseLayers(const Fields& f, int64_t default_dense, ModelSpec* s) {
  ASSIGN_OR_RETURN(int64_t freq, f.IntOr("moe_layer_freq", 1, 1, 4096));
  if (freq != 1) {
    return absl::UnimplementedError(absl::StrCat(f.label(), ": field \"moe_layer_freq\" is ", freq,
                                                 "; only 1 (every layer from first_k_dense_replace on) is supported"));
  }
  ASSIGN_OR_RETURN(int64_t dense, f.IntOr("first_k_dense_replace", default_dense, 0, s->num_layers));
  s->moe.sparse_layers.resize(static_cast<size_t>(s->num_layers));
  for (int64_t l = 0; l < s->num_layers; ++l) s->moe.sparse_layers[static_cast<size_t>(l)] = l >= dense;
  return absl::OkStatus();
}

// The routed and shared experts' sizes, common to DeepSeek-V2 and V3 (n_shared_experts' default
// differs: 2 in DeepseekV2Config, 1 in DeepseekV3Config).
absl::Status ParseDeepseekExperts(const Fields& f, int64_t default_shared, MoeSpec* moe) {
  ASSIGN_OR_RETURN(moe->num_experts, f.Int("n_routed_experts", 1, 4096));
  if (f.Has("num_local_experts")) {
    ASSIGN_OR_RETURN(int64_t local, f.Int("num_local_experts", 1, 4096));
    if (local != moe->num_experts) {
      return f.Error("num_local_experts", absl::StrCat("(", local, ") disagrees with n_routed_experts (",
                                                       moe->num_experts, ")"));
    }
  }
  ASSIGN_OR_RETURN(moe->top_k, f.Int("num_experts_per_tok", 1, moe->num_experts));
  ASSIGN_OR_RETURN(moe->expert_intermediate_size, f.Int("moe_intermediate_size", 1, kMaxDim));
  ASSIGN_OR_RETURN(int64_t shared, f.IntOr("n_shared_experts", default_shared, 0, 1024));
  moe->shared_expert_intermediate_size = shared * moe->expert_intermediate_size;
  moe->shared_expert_gate = false;
  return absl::OkStatus();
}

// DeepSeek-V2: multi-head latent attention and V2's softmax gate (MoeScoring::kSoftmaxGroupLimited).
// Missing optional fields take transformers' DeepseekV2Config defaults; the attention sizes, the
// expert counts and q_lora_rank must be stated, and n_group / topk_group with
// "group_limited_greedy" (transformers has no default for them).
absl::Status ParseDeepseekV2(const Fields& f, ModelSpec* s) {
  RETURN_IF_ERROR(ParseMla(f, Architecture::kDeepseekV2, s));
  MoeSpec& moe = s->moe;
  moe.scoring = MoeScoring::kSoftmaxGroupLimited;
  RETURN_IF_ERROR(ParseDeepseekExperts(f, 2, &moe));
  RETURN_IF_ERROR(ExpectString(f, "scoring_func", "softmax", "softmax scores"));
  std::string method = "greedy";
  if (f.Has("topk_method")) {
    if (!f.obj().at("topk_method").is_string()) return f.Error("topk_method", "is not a string");
    method = f.obj().at("topk_method").get<std::string>();
  }
  if (method == "greedy") {
    // transformers ignores n_group and topk_group here; when stated they are still group counts.
    RETURN_IF_ERROR(f.IntOr("n_group", 1, 1, moe.num_experts).status());
    RETURN_IF_ERROR(f.IntOr("topk_group", 1, 1, moe.num_experts).status());
    moe.n_group = 1;
    moe.topk_group = 1;
  } else if (method == "group_limited_greedy") {
    ASSIGN_OR_RETURN(moe.n_group, f.Int("n_group", 1, moe.num_experts));
    if (moe.num_experts % moe.n_group != 0) {
      return f.Error("n_group", absl::StrCat("(", moe.n_group, ") does not divide n_routed_experts (",
                                             moe.num_experts, ")"));
    }
    ASSIGN_OR_RETURN(moe.topk_group, f.Int("topk_group", 1, moe.n_group));
    const int64_t per_group = moe.num_experts / moe.n_group;
    if (moe.top_k > moe.topk_group * per_group) {
      return f.Error("num_experts_per_tok", absl::StrCat("(", moe.top_k, ") exceeds the ", moe.topk_group * per_group,
                                                         " experts of topk_group (", moe.topk_group, ") groups"));
    }
  } else {
    return absl::UnimplementedError(absl::StrCat(
        f.label(), ": field \"topk_method\" is \"", method,
        "\"; DeepSeek-V2 supports \"greedy\" and \"group_limited_greedy\" (\"noaux_tc\" is DeepSeek-V3's)"));
  }
  ASSIGN_OR_RETURN(moe.norm_topk_prob, f.BoolOr("norm_topk_prob", false));
  if (moe.norm_topk_prob) {
    return absl::UnimplementedError(absl::StrCat(
        f.label(), ": field \"norm_topk_prob\" is true; transformers' DeepSeek-V2 ignores it while DeepSeek's own "
        "code renormalises the top-k weights, so only false (as every released V2 config) is supported"));
  }
  ASSIGN_OR_RETURN(moe.routed_scaling_factor, f.NumberOr("routed_scaling_factor", 1.0, 1e-6, 1e6));
  ASSIGN_OR_RETURN(bool mlp_bias, f.BoolOr("mlp_bias", false));
  if (mlp_bias) {
    return absl::UnimplementedError(
        absl::StrCat(f.label(), ": field \"mlp_bias\" is true; DeepSeek-V2 MLPs without biases only"));
  }
  return ParseDeepseekSparseLayers(f, 0, s);
}

// The defaults of a sigmoid-grouped router's fields (MoeScoring::kSigmoidGrouped): its config
// class's.
struct SigmoidGroupedDefaults {
  int64_t n_group;
  int64_t topk_group;
  double routed_scaling_factor;
};

// DeepSeek-V3's MoE routing, which GLM-4.5 and GLM-4.7-Flash share: routed and shared experts,
// sigmoid scores chosen with e_score_correction_bias within the topk_group best of n_group groups.
// The sparse layers are the caller's.
absl::Status ParseSigmoidGroupedRouting(const Fields& f, const SigmoidGroupedDefaults& d, ModelSpec* s) {
  MoeSpec& moe = s->moe;
  moe.scoring = MoeScoring::kSigmoidGrouped;
  RETURN_IF_ERROR(ParseDeepseekExperts(f, 1, &moe));
  ASSIGN_OR_RETURN(moe.n_group, f.IntOr("n_group", d.n_group, 1, moe.num_experts));
  if (moe.num_experts % moe.n_group != 0) {
    return f.Error("n_group", absl::StrCat("(", moe.n_group, ") does not divide n_routed_experts (", moe.num_experts,
                                           ")"));
  }
  const int64_t per_group = moe.num_experts / moe.n_group;
  if (per_group < 2) {
    return f.Error("n_group", absl::StrCat("(", moe.n_group, ") leaves ", per_group,
                                           " expert per group; a group's score is the sum of its two best"));
  }
  ASSIGN_OR_RETURN(moe.topk_group, f.IntOr("topk_group", d.topk_group, 1, moe.n_group));
  if (moe.topk_group > moe.n_group) {  // only the default can be: a stated value is range-checked
    return f.Error("topk_group", absl::StrCat("is missing, and its default (", moe.topk_group,
                                              ") exceeds n_group (", moe.n_group, ")"));
  }
  if (moe.top_k > moe.topk_group * per_group) {
    return f.Error("num_experts_per_tok", absl::StrCat("(", moe.top_k, ") exceeds the ", moe.topk_group * per_group,
                                                       " experts of topk_group (", moe.topk_group, ") groups"));
  }
  ASSIGN_OR_RETURN(moe.norm_topk_prob, f.BoolOr("norm_topk_prob", true));
  ASSIGN_OR_RETURN(moe.routed_scaling_factor,
                   f.NumberOr("routed_scaling_factor", d.routed_scaling_factor, 1e-6, 1e6));
  return absl::OkStatus();
}

// DeepSeek-V3: multi-head latent attention and its MoE (see MlaSpec, MoeScoring). Missing
// optional fields take transformers' DeepseekV3Config defaults; the attention sizes, the expert
// counts and q_lora_rank (whose default, 1536, no small model has) must be stated.
absl::Status ParseDeepseekV3(const Fields& f, ModelSpec* s) {
  RETURN_IF_ERROR(ParseMla(f, Architecture::kDeepseekV3, s));
  // Fields the released configs carry for DeepSeek's own code; transformers implements exactly
  // these values (and ignores the fields).
  RETURN_IF_ERROR(ExpectString(f, "scoring_func", "sigmoid", "sigmoid scores"));
  RETURN_IF_ERROR(ExpectString(f, "topk_method", "noaux_tc",
                               "grouped top-k on scores plus e_score_correction_bias"));
  RETURN_IF_ERROR(ParseSigmoidGroupedRouting(f, {.n_group = 8, .topk_group = 4, .routed_scaling_factor = 2.5}, s));
  return ParseDeepseekSparseLayers(f, 3, s);
}

// GLM-4.5 (Glm4MoeForCausalLM: GLM-4.5, GLM-4.5-Air, GLM-4.6): Llama-style grouped-query
// attention with biases on q, k and v only (`attention_bias`), per-head q/k RMSNorms before RoPE
// when `use_qk_norm`, RoPE on the first half of each head (partial_rotary_factor, default 0.5), and
// DeepSeek-V3's MoE block. Missing fields take Glm4MoeConfig's defaults (one group, scaling 1,
// one dense layer, one shared expert); the expert counts and sizes must be stated.
absl::Status ParseGlm4Moe(const Fields& f, ModelSpec* s) {
  ASSIGN_OR_RETURN(s->qkv_bias, f.BoolOr("attention_bias", false));
  s->o_bias = false;
  ASSIGN_OR_RETURN(s->qk_norm, f.BoolOr("use_qk_norm", false));
  RETURN_IF_ERROR(ParseSigmoidGroupedRouting(f, {.n_group = 1, .topk_group = 1, .routed_scaling_factor = 1.0}, s));
  return ParseDeepseekSparseLayers(f, 1, s);
}

// GLM-4.7-Flash (Glm4MoeLiteForCausalLM): DeepSeek-V3's multi-head latent attention and GLM-4.5's
// MoE block, whose layers `mlp_layer_types` lists ("dense" / "sparse"; by default layer 0 dense,
// the others sparse: transformers ignores first_k_dense_replace here). Missing routing fields take
// Glm4MoeLiteConfig's defaults (one group, scaling 1.8); the attention sizes and expert counts must
// be stated.
absl::Status ParseGlm4MoeLite(const Fields& f, ModelSpec* s) {
  RETURN_IF_ERROR(ParseMla(f, Architecture::kGlm4MoeLite, s));
  RETURN_IF_ERROR(ParseSigmoidGroupedRouting(f, {.n_group = 1, .topk_group = 1, .routed_scaling_factor = 1.8}, s));
  std::vector<bool>& sparse = s->moe.sparse_layers;
  sparse.assign(static_cast<size_t>(s->num_layers), true);
  sparse[0] = false;
  if (!f.Has("mlp_layer_types")) return absl::OkStatus();
  const json& v = f.obj().at("mlp_layer_types");
  if (!v.is_array() || static_cast<int64_t>(v.size()) != s->num_layers) {
    return f.Error("mlp_layer_types", absl::StrCat("is not a list of ", s->num_layers, " layer types"));
  }
  for (size_t l = 0; l < v.size(); ++l) {
    if (v[l] != "dense" && v[l] != "sparse") {
      return f.Error("mlp_layer_types", absl::StrCat("has ", v[l].dump(), " at layer ", l,
                                                     "; each entry is \"dense\" or \"sparse\""));
    }
    sparse[l] = v[l] == "sparse";
  }
  return absl::OkStatus();
}

// `layer_types` of `num_layers` entries, each `local` (a windowed or chunked layer: true) or
// "full_attention" (false); any other type is Unimplemented, naming it.
absl::StatusOr<std::vector<bool>> LayerTypes(const Fields& f, int64_t num_layers, absl::string_view local) {
  const json& v = f.obj().at("layer_types");
  if (!v.is_array() || static_cast<int64_t>(v.size()) != num_layers) {
    return f.Error("layer_types", absl::StrCat("is not a list of ", num_layers, " layer types"));
  }
  std::vector<bool> flags;
  for (const auto& e : v) {
    if (!e.is_string()) return f.Error("layer_types", "is not a list of strings");
    const std::string type = e.get<std::string>();
    if (type != local && type != "full_attention") {
      return absl::UnimplementedError(absl::StrCat(f.label(), ": field \"layer_types\" has \"", type, "\"; only \"",
                                                   local, "\" and \"full_attention\" are supported"));
    }
    flags.push_back(type == local);
  }
  return flags;
}

// Gemma-3's two RoPEs (transformers' Gemma3TextConfig.convert_rope_params_to_dict): the
// "full_attention" and "sliding_attention" entries of `rope_parameters` (transformers >= 5), or the
// legacy fields — rope_theta (default 1e6) with rope_scaling for the full layers, and
// rope_local_base_freq (default 1e4) for the sliding ones. Default and linear RoPE only.
absl::Status ParseGemma3Rope(const Fields& f, int64_t max_positions, ModelSpec* s) {
  json per_type[2] = {json::object(), json::object()};  // full_attention, sliding_attention
  const char* const kTypes[2] = {"full_attention", "sliding_attention"};
  if (f.Has("rope_parameters")) {
    const json& rp = f.obj().at("rope_parameters");
    if (!rp.is_object()) return f.Error("rope_parameters", "is not an object");
    for (auto it = rp.begin(); it != rp.end(); ++it) {
      if (it.key() != kTypes[0] && it.key() != kTypes[1]) {
        return f.Error("rope_parameters", absl::StrCat("has the key \"", it.key(),
                                                       "\"; Gemma-3 keys its RoPE parameters by layer type "
                                                       "(\"full_attention\", \"sliding_attention\")"));
      }
    }
    for (int i = 0; i < 2; ++i) {
      if (!rp.contains(kTypes[i]) || rp.at(kTypes[i]).is_null()) continue;
      if (!rp.at(kTypes[i]).is_object()) {
        return f.Error("rope_parameters", absl::StrCat("[\"", kTypes[i], "\"] is not an object"));
      }
      per_type[i] = rp.at(kTypes[i]);
    }
  }
  if (f.Has("rope_scaling")) {
    const json& scaling = f.obj().at("rope_scaling");
    if (!scaling.is_object()) return f.Error("rope_scaling", "is not an object");
    per_type[0].update(scaling);
  }
  const char* const kThetaKeys[2] = {"rope_theta", "rope_local_base_freq"};
  const double kThetaDefaults[2] = {1e6, 1e4};
  RopeSpec ropes[2];
  for (int i = 0; i < 2; ++i) {
    if (!per_type[i].contains("rope_theta")) {
      ASSIGN_OR_RETURN(double theta, f.NumberOr(kThetaKeys[i], kThetaDefaults[i], 1e-3, 1e12));
      per_type[i]["rope_theta"] = theta;
    }
    const json wrapped = {{"rope_parameters", per_type[i]}};
    const std::string label = absl::StrCat(f.label(), " (", kTypes[i], " layers)");
    RETURN_IF_ERROR(ParseRope(wrapped, label, max_positions, &ropes[i]));
    if (ropes[i].type != RopeType::kDefault && ropes[i].type != RopeType::kLinear) {
      return absl::UnimplementedError(
          absl::StrCat(label, ": Gemma-3 supports rope types default and linear only"));
    }
  }
  s->rope = ropes[0];
  s->sliding_rope = ropes[1];
  return absl::OkStatus();
}

// Gemma3ForConditionalGeneration: the text model's config is `text_config`, completed with the
// top-level dtype, token ids and quantization that the released configs state only there. Whether
// lm_head is tied is the top-level model's tie_word_embeddings (Gemma3Config's, default true).
absl::StatusOr<json> Gemma3TextConfigOf(const json& doc, absl::string_view label) {
  if (!doc.contains("text_config") || !doc.at("text_config").is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        label, ": field \"text_config\" is missing or not an object (Gemma3ForConditionalGeneration describes "
        "its language model there)"));
  }
  json text = doc.at("text_config");
  for (const char* key : {"torch_dtype", "dtype", "bos_token_id", "eos_token_id", "quantization_config"}) {
    if (doc.contains(key) && !text.contains(key)) text[key] = doc.at(key);
  }
  text["tie_word_embeddings"] = doc.contains("tie_word_embeddings") ? doc.at("tie_word_embeddings") : json(true);
  text["architectures"] = doc.at("architectures");
  return text;
}

// Gemma3TextConfig's defaults for the fields that the common parser requires or defaults
// differently (the released multimodal configs state only what differs from them).
void FillGemma3Defaults(json* c) {
  const std::pair<const char*, json> defaults[] = {
      {"vocab_size", 262208},          {"hidden_size", 2304},          {"intermediate_size", 9216},
      {"num_hidden_layers", 26},       {"num_attention_heads", 8},     {"num_key_value_heads", 4},
      {"head_dim", 256},               {"max_position_embeddings", 131072}, {"bos_token_id", 2},
      {"eos_token_id", 1},             {"tie_word_embeddings", true},
  };
  for (const auto& [key, value] : defaults) {
    if (!c->contains(key)) (*c)[key] = value;
  }
}

// A soft-capping value: absent -> `def`, null -> 0 (none), else a positive number.
absl::StatusOr<double> SoftCap(const Fields& f, const char* key, double def) {
  if (!f.obj().contains(key)) return def;
  if (f.obj().at(key).is_null()) return 0.0;
  ASSIGN_OR_RETURN(double cap, f.NumberOr(key, def, 0.0, 1e9));
  if (cap <= 0.0) return f.Error(key, absl::StrCat("is ", cap, "; a soft-cap must be positive (or null for none)"));
  return cap;
}

// Gemma-2 and Gemma-3 (transformers' Gemma2Config / Gemma3TextConfig, whose defaults apply to
// missing fields): see ModelSpec's Gemma fields.
absl::Status ParseGemma(const Fields& f, ModelSpec* s) {
  const bool gemma3 = s->arch == Architecture::kGemma3;
  s->norm_plus_one = true;
  s->sandwich_norms = true;
  s->activation = Activation::kGeluTanh;
  // transformers reads `hidden_activation` (released configs also carry an unused `hidden_act`).
  if (f.obj().contains("hidden_activation")) {
    const json& act = f.obj().at("hidden_activation");
    if (!act.is_string() || act.get<std::string>() != "gelu_pytorch_tanh") {
      return absl::UnimplementedError(absl::StrCat(f.label(), ": field \"hidden_activation\" is ", act.dump(),
                                                   "; only \"gelu_pytorch_tanh\" is supported"));
    }
  }
  ASSIGN_OR_RETURN(s->qkv_bias, f.BoolOr("attention_bias", false));
  s->o_bias = s->qkv_bias;
  ASSIGN_OR_RETURN(bool bidirectional, f.BoolOr("use_bidirectional_attention", false));
  if (bidirectional) {
    return absl::UnimplementedError(absl::StrCat(
        f.label(), ": field \"use_bidirectional_attention\" is true; only causal attention is supported"));
  }
  ASSIGN_OR_RETURN(s->query_pre_attn_scalar, f.NumberOr("query_pre_attn_scalar", 256.0, 0.0, 1e9));
  if (s->query_pre_attn_scalar <= 0.0) return f.Error("query_pre_attn_scalar", "must be positive");
  ASSIGN_OR_RETURN(s->attn_logit_softcapping, SoftCap(f, "attn_logit_softcapping", gemma3 ? 0.0 : 50.0));
  ASSIGN_OR_RETURN(s->final_logit_softcapping, SoftCap(f, "final_logit_softcapping", gemma3 ? 0.0 : 30.0));
  // transformers' Gemma-3 attention never soft-caps its scores, whatever attn_logit_softcapping says
  // (the released configs say null).
  if (gemma3) s->attn_logit_softcapping = 0.0;
  // Nor does Gemma3ForConditionalGeneration cap its logits (Gemma3ForCausalLM does, when set).
  if (s->multimodal_text) s->final_logit_softcapping = 0.0;
  // Gemma-3: the layers whose index + 1 is not a multiple of sliding_window_pattern slide (5 local
  // : 1 global by default) unless layer_types says otherwise.
  int64_t pattern = 6;
  if (gemma3) {
    ASSIGN_OR_RETURN(pattern, f.IntOr("sliding_window_pattern", 6, 1, 4096));
  }
  // layer_types: given, or "sliding_attention" on even layers (Gemma-2) / by the pattern (Gemma-3).
  if (f.Has("layer_types")) {
    ASSIGN_OR_RETURN(s->sliding_layers, LayerTypes(f, s->num_layers, "sliding_attention"));
  } else if (gemma3) {
    s->sliding_layers.assign(static_cast<size_t>(s->num_layers), false);
    for (int64_t l = 0; l < s->num_layers; ++l) s->sliding_layers[static_cast<size_t>(l)] = (l + 1) % pattern != 0;
  } else {
    s->sliding_layers.assign(static_cast<size_t>(s->num_layers), false);
    for (int64_t l = 0; l < s->num_layers; l += 2) s->sliding_layers[static_cast<size_t>(l)] = true;
  }
  const bool any_sliding = std::find(s->sliding_layers.begin(), s->sliding_layers.end(), true) != s->sliding_layers.end();
  if (f.obj().contains("sliding_window") && f.obj().at("sliding_window").is_null()) {
    if (any_sliding) {
      return absl::UnimplementedError(absl::StrCat(
          f.label(), ": field \"sliding_window\" is null but layer_types has \"sliding_attention\" layers"));
    }
  } else {
    ASSIGN_OR_RETURN(s->sliding_window, f.IntOr("sliding_window", 4096, 1, kMaxPositions));
  }
  if (s->sliding_window >= s->max_position_embeddings) s->sliding_window = 0;  // never reached
  if (!any_sliding) s->sliding_window = 0;
  // transformers: torch.tensor(hidden_size ** 0.5) (float32), cast to the weights' dtype.
  float mult = static_cast<float>(std::sqrt(static_cast<double>(s->hidden_size)));
  if (s->dtype == DType::kBF16) mult = BFloat16ToFloat(FloatToBFloat16(mult));
  if (s->dtype == DType::kF16) mult = HalfToFloat(FloatToHalf(mult));
  s->embedding_multiplier = mult;
  return absl::OkStatus();
}

// Granite: Llama's layer and names with four multipliers (transformers' GraniteConfig, each 1.0
// when missing). They must be finite and positive: zero would erase a layer's output or divide
// the logits by zero, and a negative one has no model behind it.
absl::Status ParseGranite(const Fields& f, ModelSpec* s) {
  const auto multiplier = [&](const char* key) -> absl::StatusOr<double> {
    ASSIGN_OR_RETURN(double v, f.NumberOr(key, 1.0, 0.0, 1e6));
    if (!(v > 0.0)) return f.Error(key, absl::StrCat("is ", v, "; it must be positive"));
    return v;
  };
  ASSIGN_OR_RETURN(s->embedding_multiplier, multiplier("embedding_multiplier"));
  ASSIGN_OR_RETURN(s->attention_multiplier, multiplier("attention_multiplier"));
  ASSIGN_OR_RETURN(s->residual_multiplier, multiplier("residual_multiplier"));
  ASSIGN_OR_RETURN(s->logits_scaling, multiplier("logits_scaling"));
  return absl::OkStatus();
}

// A per-layer list of 0/1 integers (Llama-4's no_rope_layers: 1 = the layer uses RoPE).
absl::StatusOr<std::vector<bool>> LayerFlags(const Fields& f, const char* key, int64_t num_layers) {
  const json& v = f.obj().at(key);
  if (!v.is_array() || static_cast<int64_t>(v.size()) != num_layers) {
    return f.Error(key, absl::StrCat("is not a list of ", num_layers, " entries (one per layer)"));
  }
  std::vector<bool> flags;
  for (const auto& e : v) {
    ASSIGN_OR_RETURN(int64_t flag, f.IntValue(key, e, 0, 1));
    flags.push_back(flag == 1);
  }
  return flags;
}

// RoPE and NoPE layers (Llama-4, SmolLM3): no_rope_layers (1 = RoPE), or, when missing, null or
// empty, every no_rope_layer_interval-th layer (default 4) is NoPE.
absl::Status ParseNoRopeLayers(const Fields& f, ModelSpec* s) {
  const json* listed = f.Has("no_rope_layers") ? &f.obj().at("no_rope_layers") : nullptr;
  if (listed != nullptr && !(listed->is_array() && listed->empty())) {
    ASSIGN_OR_RETURN(s->rope_layers, LayerFlags(f, "no_rope_layers", s->num_layers));
  } else {
    ASSIGN_OR_RETURN(int64_t interval, f.IntOr("no_rope_layer_interval", 4, 1, 4096));
    for (int64_t l = 0; l < s->num_layers; ++l) s->rope_layers.push_back((l + 1) % interval != 0);
  }
  return absl::OkStatus();
}

// Whether any layer of sliding_layers slides; when none does, clears it (one window for all, or
// none).
bool KeepSlidingLayers(ModelSpec* s) {
  if (std::find(s->sliding_layers.begin(), s->sliding_layers.end(), true) != s->sliding_layers.end()) return true;
  s->sliding_layers.clear();
  return false;
}

// A sliding window as long as the context is never reached: no window, and no sliding layers.
void DropUnreachedWindow(ModelSpec* s) {
  if (s->sliding_window < s->max_position_embeddings) return;
  s->sliding_window = 0;
  s->sliding_layers.clear();
}

// The sliding layers of GraniteSWA and GPT-OSS: the "sliding_attention" layers of layer_types, or
// when it is missing every layer l but those with l % period == full_at; they attend within
// sliding_window (default 128; null with sliding layers is refused, as transformers has no window
// to give them).
absl::Status ParseSlidingLayers(const Fields& f, int64_t period, int64_t full_at, ModelSpec* s) {
  if (f.Has("layer_types")) {
    ASSIGN_OR_RETURN(s->sliding_layers, LayerTypes(f, s->num_layers, "sliding_attention"));
  } else {
    for (int64_t l = 0; l < s->num_layers; ++l) s->sliding_layers.push_back(l % period != full_at);
  }
  if (!KeepSlidingLayers(s)) return absl::OkStatus();
  if (f.obj().contains("sliding_window") && !f.Has("sliding_window")) {
    return f.Error("sliding_window", "is null but layer_types has \"sliding_attention\" layers");
  }
  ASSIGN_OR_RETURN(s->sliding_window, f.IntOr("sliding_window", 128, 1, kMaxPositions));
  DropUnreachedWindow(s);
  return absl::OkStatus();
}

// GraniteSWA and GraniteMoeSWA (after ParseGranite): attention sinks on every layer; the
// "sliding_attention" layers of layer_types (by default all but every fourth, from layer 0 on)
// attend within sliding_window (default 128; null with sliding layers is refused, as transformers
// has no window to give them); layer_rope_theta, when set, gives each layer its RoPE theta, 0 for
// a NoPE layer.
absl::Status ParseGraniteSWA(const Fields& f, ModelSpec* s) {
  s->attention_sinks = true;
  if (f.Has("layer_rope_theta")) {
    const json& v = f.obj().at("layer_rope_theta");
    if (!v.is_array() || static_cast<int64_t>(v.size()) != s->num_layers) {
      return f.Error("layer_rope_theta", absl::StrCat("is not a list of ", s->num_layers, " numbers (one per layer)"));
    }
    for (const auto& e : v) {
      // rope_theta's range, or 0.
      const double theta = e.is_number() ? e.get<double>() : -1.0;
      if (theta != 0.0 && !(theta >= 1e-3 && theta <= 1e12)) {
        return f.Error("layer_rope_theta", absl::StrCat("has ", e.dump(), "; each entry must be 0 (no RoPE on that "
                                                                           "layer) or a theta in [1e-3, 1e12]"));
      }
      s->layer_rope_theta.push_back(theta);
      s->rope_layers.push_back(theta > 0.0);
    }
  }
  return ParseSlidingLayers(f, 4, 0, s);  // every fourth layer full, from layer 0
}

// GPT-OSS (transformers' GptOssConfig, whose defaults apply to missing fields): q/k/v and o
// biases (attention_bias, default true) and sinks on every layer; the "sliding_attention" layers of
// layer_types (by default the even ones, from layer 0) attend within sliding_window (default 128, null refused
// as for GraniteSWA); every layer's MLP is a MoE block (MoeSpec::interleaved_experts) of
// num_local_experts (default 128) experts, num_experts_per_tok (default 4) per token, chosen by the
// router's biased logits and weighted by the softmax of the chosen logits (Mixtral's renormalised
// softmax); the experts' activation is the clamped SwiGLU.
absl::Status ParseGptOss(const Fields& f, ModelSpec* s) {
  ASSIGN_OR_RETURN(s->qkv_bias, f.BoolOr("attention_bias", true));
  s->o_bias = s->qkv_bias;
  s->attention_sinks = true;
  ASSIGN_OR_RETURN(double alpha, f.NumberOr("swiglu_alpha", 1.702, -1e6, 1e6));
  ASSIGN_OR_RETURN(double limit, f.NumberOr("swiglu_limit", 7.0, -1e6, 1e6));
  if (alpha != 1.702 || limit != 7.0) {
    return absl::UnimplementedError(absl::StrCat(f.label(), ": swiglu_alpha ", alpha, " and swiglu_limit ", limit,
                                                 "; only 1.702 and 7 (every released GPT-OSS) are supported"));
  }
  s->activation = Activation::kClampedSwiglu;
  MoeSpec& moe = s->moe;
  RETURN_IF_ERROR(ParseExpertCounts(f, 128, 4, &moe));
  moe.norm_topk_prob = true;
  moe.expert_intermediate_size = s->intermediate_size;
  moe.sparse_layers.assign(static_cast<size_t>(s->num_layers), true);
  moe.interleaved_experts = true;
  moe.router_bias = true;
  moe.expert_bias = true;
  return ParseSlidingLayers(f, 2, 1, s);  // the odd layers full
}

// SmolLM3 (transformers' SmolLM3Config): Llama's layer whose NoPE layers skip RoPE; the
// "sliding_attention" layers of layer_types (by default, with use_sliding_window and
// sliding_window set, the NoPE layers) attend within sliding_window. attention_bias covers q, k, v
// and o.
absl::Status ParseSmolLM3(const Fields& f, ModelSpec* s) {
  ASSIGN_OR_RETURN(s->qkv_bias, f.BoolOr("attention_bias", false));
  s->o_bias = s->qkv_bias;
  ASSIGN_OR_RETURN(s->mlp_bias, f.BoolOr("mlp_bias", false));
  RETURN_IF_ERROR(ParseNoRopeLayers(f, s));
  ASSIGN_OR_RETURN(bool use_sw, f.BoolOr("use_sliding_window", false));
  const bool window_set = f.Has("sliding_window");  // present and not null
  if (f.Has("layer_types")) {
    ASSIGN_OR_RETURN(s->sliding_layers, LayerTypes(f, s->num_layers, "sliding_attention"));
  } else {
    for (int64_t l = 0; l < s->num_layers; ++l) {
      s->sliding_layers.push_back(use_sw && window_set && !s->LayerUsesRope(l));
    }
  }
  if (!KeepSlidingLayers(s)) return absl::OkStatus();
  if (!use_sw) {
    // transformers masks such layers by the window in eager and SDPA attention but not in its
    // flash-attention path: no one answer to match.
    return f.Error("use_sliding_window", "is false but layer_types has \"sliding_attention\" layers");
  }
  if (!window_set) {
    return f.Error("sliding_window", "is missing or null but layer_types has \"sliding_attention\" layers");
  }
  ASSIGN_OR_RETURN(s->sliding_window, f.Int("sliding_window", 1, kMaxPositions));
  DropUnreachedWindow(s);
  return absl::OkStatus();
}

// Llama-4's text model (transformers' Llama4TextConfig, whose defaults apply to missing fields):
// see ModelSpec's Llama-4 fields and MoeScoring::kSigmoidInput.
absl::Status ParseLlama4(const Fields& f, ModelSpec* s) {
  ASSIGN_OR_RETURN(bool attention_bias, f.BoolOr("attention_bias", false));
  if (attention_bias) {
    return absl::UnimplementedError(
        absl::StrCat(f.label(), ": field \"attention_bias\" is true; Llama-4 attention without biases only"));
  }
  if (s->rope.type == RopeType::kYarn) {
    return absl::UnimplementedError(absl::StrCat(
        f.label(), ": rope type \"yarn\" is not supported for Llama-4 (supported: default, linear, llama3)"));
  }
  s->rope_interleaved = true;
  const int64_t n = s->num_layers;
  RETURN_IF_ERROR(ParseNoRopeLayers(f, s));
  ASSIGN_OR_RETURN(s->qk_l2_norm, f.BoolOr("use_qk_norm", true));
  // transformers tests the field for truth; released configs write true or an integer.
  bool tuning = true;
  if (f.Has("attn_temperature_tuning")) {
    const json& t = f.obj().at("attn_temperature_tuning");
    if (t.is_boolean()) {
      tuning = t.get<bool>();
    } else if (t.is_number_integer()) {
      tuning = t.get<int64_t>() != 0;
    } else {
      return f.Error("attn_temperature_tuning", "is not true, false or an integer");
    }
  }
  if (tuning) {
    ASSIGN_OR_RETURN(s->attn_floor_scale, f.NumberOr("floor_scale", 8192.0, 1e-6, 1e12));
    ASSIGN_OR_RETURN(s->attn_temperature_scale, f.NumberOr("attn_scale", 0.1, -1e6, 1e6));
  }
  // Chunked local attention: layer_types, or "chunked_attention" on the RoPE layers.
  if (f.Has("layer_types")) {
    ASSIGN_OR_RETURN(s->chunked_layers, LayerTypes(f, n, "chunked_attention"));
  } else {
    for (int64_t l = 0; l < n; ++l) s->chunked_layers.push_back(s->LayerUsesRope(l));
  }
  const bool any_chunked = std::find(s->chunked_layers.begin(), s->chunked_layers.end(), true) != s->chunked_layers.end();
  if (f.obj().contains("attention_chunk_size") && f.obj().at("attention_chunk_size").is_null()) {
    if (any_chunked) {
      return f.Error("attention_chunk_size", "is null but layer_types has \"chunked_attention\" layers");
    }
  } else {
    ASSIGN_OR_RETURN(s->attention_chunk_size, f.IntOr("attention_chunk_size", 8192, 1, kMaxPositions));
  }
  // A chunk no context reaches the end of is full attention.
  if (!any_chunked || s->attention_chunk_size >= s->max_position_embeddings) {
    s->attention_chunk_size = 0;
    s->chunked_layers.clear();
  }

  // MoE: `intermediate_size` is the width of every expert and of the shared expert; dense layers
  // are `intermediate_size_mlp` wide.
  MoeSpec& moe = s->moe;
  moe.scoring = MoeScoring::kSigmoidInput;
  moe.fused_experts = true;
  moe.norm_topk_prob = false;
  moe.expert_intermediate_size = s->intermediate_size;
  moe.shared_expert_intermediate_size = s->intermediate_size;
  moe.shared_expert_gate = false;
  ASSIGN_OR_RETURN(s->intermediate_size, f.IntOr("intermediate_size_mlp", 16384, 1, kMaxDim));
  ASSIGN_OR_RETURN(moe.num_experts, f.IntOr("num_local_experts", 16, 1, 4096));
  ASSIGN_OR_RETURN(moe.top_k, f.IntOr("num_experts_per_tok", 1, 1, moe.num_experts));
  moe.sparse_layers.assign(static_cast<size_t>(n), false);
  if (f.Has("moe_layers")) {
    const json& v = f.obj().at("moe_layers");
    if (!v.is_array()) return f.Error("moe_layers", "is not a list of layer indices");
    for (const auto& e : v) {
      ASSIGN_OR_RETURN(int64_t layer, f.IntValue("moe_layers", e, 0, n - 1));
      moe.sparse_layers[static_cast<size_t>(layer)] = true;
    }
  } else {
    ASSIGN_OR_RETURN(int64_t step, f.IntOr("interleave_moe_layer_step", 1, 1, 4096));
    for (int64_t l = step - 1; l < n; l += step) moe.sparse_layers[static_cast<size_t>(l)] = true;
  }
  if (std::find(moe.sparse_layers.begin(), moe.sparse_layers.end(), true) == moe.sparse_layers.end()) {
    moe = MoeSpec{};  // no MoE layer: a dense model
  }
  return absl::OkStatus();
}

// Llama4ForConditionalGeneration: the text model's config is `text_config`; its weights are those
// of the checkpoint under "language_model." (the vision tower and projector are not loaded).
// Returns the text config with the outer dtype filled in when it has none.
absl::StatusOr<json> Llama4TextConfig(const json& doc, absl::string_view label) {
  Fields top(doc, label);
  if (!top.Has("text_config") || !doc.at("text_config").is_object()) {
    return top.Error("text_config", "is missing or not an object (Llama4ForConditionalGeneration nests its text model there)");
  }
  ASSIGN_OR_RETURN(bool tied, top.BoolOr("tie_word_embeddings", false));
  if (tied) {
    return absl::UnimplementedError(absl::StrCat(
        label, ": field \"tie_word_embeddings\" is true; Llama4ForConditionalGeneration with a tied lm_head is not supported"));
  }
  if (top.Has("quantization_config")) {
    return absl::UnimplementedError(absl::StrCat(
        label, ": field \"quantization_config\": quantized Llama-4 checkpoints are not supported"));
  }
  json text = doc.at("text_config");
  text["architectures"] = json::array({"Llama4ForCausalLM"});
  for (const char* key : {"torch_dtype", "dtype"}) {
    if (!text.contains(key) && doc.contains(key)) text[key] = doc.at(key);
  }
  return text;
}

// Appends the list of module names `key` of a quantization_config, when present.
absl::Status ModuleNames(const Fields& f, const char* key, std::vector<std::string>* names) {
  if (!f.Has(key)) return absl::OkStatus();
  const json& list = f.obj().at(key);
  if (!list.is_array()) return f.Error(key, "is not a list of module names");
  for (const auto& m : list) {
    if (!m.is_string()) return f.Error(key, "is not a list of module names");
    names->push_back(m.get<std::string>());
  }
  return absl::OkStatus();
}

// quantization_config: fp8 (see Fp8Quantization), or mxfp4 on GPT-OSS (Mxfp4Quantization).
// Unknown keys are ignored, as transformers
// does; every key we read is type-checked.
absl::Status ParseQuantization(const json& doc, absl::string_view label, ModelSpec* spec) {
  Fields top(doc, label);
  if (!top.Has("quantization_config")) return absl::OkStatus();
  const json& q = doc.at("quantization_config");
  if (!q.is_object()) return top.Error("quantization_config", "is not an object");
  const std::string sub_label = absl::StrCat(label, " quantization_config");
  Fields f(q, sub_label);
  if (!f.Has("quant_method")) return f.Error("quant_method", "is missing");
  if (!q.at("quant_method").is_string()) return f.Error("quant_method", "is not a string");
  const std::string method = q.at("quant_method").get<std::string>();
  if (method == "mxfp4" && spec->arch == Architecture::kGptOss) {
    Mxfp4Quantization mxfp4;
    RETURN_IF_ERROR(ModuleNames(f, "modules_to_not_convert", &mxfp4.modules_not_converted));
    spec->mxfp4 = std::move(mxfp4);
    return absl::OkStatus();
  }
  if (method != "fp8") {
    return f.Error("quant_method", absl::StrCat("is \"", method,
                                                "\"; only \"fp8\" (e4m3 weights with block or per-tensor "
                                                "scales) is supported, and \"mxfp4\" on GptOssForCausalLM"));
  }
  Fp8Quantization fp8;
  if (f.Has("fmt")) {
    if (!q.at("fmt").is_string()) return f.Error("fmt", "is not a string");
    const std::string fmt = q.at("fmt").get<std::string>();
    if (fmt != "e4m3") return f.Error("fmt", absl::StrCat("is \"", fmt, "\"; only \"e4m3\" is supported"));
  }
  if (f.Has("weight_block_size")) {
    const json& b = q.at("weight_block_size");
    if (!b.is_array() || b.size() != 2) {
      return f.Error("weight_block_size", "is not a list of two integers [rows, cols]");
    }
    ASSIGN_OR_RETURN(fp8.block_rows, f.IntValue("weight_block_size", b[0], 1, kMaxDim));
    ASSIGN_OR_RETURN(fp8.block_cols, f.IntValue("weight_block_size", b[1], 1, kMaxDim));
  }
  if (f.Has("activation_scheme")) {
    const json& a = q.at("activation_scheme");
    if (!a.is_string() || (a.get<std::string>() != "dynamic" && a.get<std::string>() != "static")) {
      return f.Error("activation_scheme", absl::StrCat("is ", a.dump(), "; expected \"dynamic\" or \"static\""));
    }
    fp8.static_activations = a.get<std::string>() == "static";
  }
  for (const char* key : {"modules_to_not_convert", "ignored_layers"}) {
    RETURN_IF_ERROR(ModuleNames(f, key, &fp8.modules_not_converted));
  }
  spec->fp8 = std::move(fp8);
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

absl::string_view ArchitectureName(Architecture arch) {
  switch (arch) {
    case Architecture::kLlama: return "LlamaForCausalLM";
    case Architecture::kMistral: return "MistralForCausalLM";
    case Architecture::kQwen2: return "Qwen2ForCausalLM";
    case Architecture::kMixtral: return "MixtralForCausalLM";
    case Architecture::kQwen2Moe: return "Qwen2MoeForCausalLM";
    case Architecture::kQwen3: return "Qwen3ForCausalLM";
    case Architecture::kQwen3Moe: return "Qwen3MoeForCausalLM";
    case Architecture::kPhi3: return "Phi3ForCausalLM";
    case Architecture::kDeepseekV2: return "DeepseekV2ForCausalLM";
    case Architecture::kDeepseekV3: return "DeepseekV3ForCausalLM";
    case Architecture::kGemma2: return "Gemma2ForCausalLM";
    case Architecture::kLlama4: return "Llama4ForCausalLM";
    case Architecture::kGemma3: return "Gemma3ForCausalLM";
    case Architecture::kGranite: return "GraniteForCausalLM";
    case Architecture::kGraniteMoe: return "GraniteMoeForCausalLM";
    case Architecture::kSmolLM3: return "SmolLM3ForCausalLM";
    case Architecture::kGraniteMoeShared: return "GraniteMoeSharedForCausalLM";
    case Architecture::kGraniteSWA: return "GraniteSWAForCausalLM";
    case Architecture::kGraniteMoeSWA: return "GraniteMoeSWAForCausalLM";
    case Architecture::kGptOss: return "GptOssForCausalLM";
    case Architecture::kGlm4Moe: return "Glm4MoeForCausalLM";
    case Architecture::kGlm4MoeLite: return "Glm4MoeLiteForCausalLM";
    case Architecture::kSeedOss: return "SeedOssForCausalLM";
    case Architecture::kGlm4: return "Glm4ForCausalLM";
  }
  return "?";
}

namespace {

// Saturating int64 arithmetic: a config.json may declare sizes whose product overflows int64
// (the fuzzer found one); the count then saturates at INT64_MAX instead of overflowing.
struct SatInt {
  int64_t v = 0;
  friend SatInt operator+(SatInt a, SatInt b) {
    int64_t r = 0;
    return {__builtin_add_overflow(a.v, b.v, &r) ? (a.v < 0 ? INT64_MIN : INT64_MAX) : r};
  }
  friend SatInt operator*(SatInt a, SatInt b) {
    int64_t r = 0;
    if (!__builtin_mul_overflow(a.v, b.v, &r)) return {r};
    return {(a.v < 0) != (b.v < 0) ? INT64_MIN : INT64_MAX};
  }
};

}  // namespace

double ModelSpec::AttentionScale() const {
  if (attention_multiplier > 0.0) return attention_multiplier;
  if (query_pre_attn_scalar > 0.0) return 1.0 / std::sqrt(query_pre_attn_scalar);
  if (!IsMla()) return 1.0 / std::sqrt(static_cast<double>(head_dim));
  double scale = 1.0 / std::sqrt(static_cast<double>(mla.qk_head_dim()));
  if (rope.type != RopeType::kDefault && rope.mscale_all_dim != 0.0 && rope.factor > 1.0) {
    const double m = 0.1 * rope.mscale_all_dim * std::log(rope.factor) + 1.0;
    scale *= m * m;
  }
  return scale;
}

int64_t ModelSpec::KvValuesPerToken(int tp) const {
  if (IsMla()) return mla.kv_lora_rank + mla.qk_rope_head_dim;
  const int64_t local = tp > 0 && num_kv_heads % tp == 0 ? num_kv_heads / tp : 1;
  return 2 * local * head_dim;
}

int64_t ModelSpec::AttentionParameters() const {
  const SatInt h{hidden_size};
  const SatInt two{2};
  if (IsMla()) {
    const SatInt heads{num_heads};
    const SatInt q_rows = heads * SatInt{mla.qk_head_dim()};
    SatInt attn = two * h;  // input and post-attention norms
    if (mla.q_lora_rank > 0) {
      const SatInt r{mla.q_lora_rank};
      attn = attn + h * r + r + r * q_rows;  // q_a_proj, q_a_layernorm, q_b_proj
    } else {
      attn = attn + h * q_rows;  // q_proj
    }
    const SatInt lat{mla.kv_lora_rank};
    attn = attn + h * (lat + SatInt{mla.qk_rope_head_dim}) + lat;                  // kv_a_proj_with_mqa, kv_a_layernorm
    attn = attn + lat * heads * SatInt{mla.qk_nope_head_dim + mla.v_head_dim};      // kv_b_proj
    attn = attn + heads * SatInt{mla.v_head_dim} * h;                              // o_proj
    return attn.v;
  }
  const SatInt q = SatInt{num_heads} * SatInt{head_dim};
  const SatInt kv = SatInt{num_kv_heads} * SatInt{head_dim};
  SatInt attn = h * q + two * h * kv + q * h + two * h;  // projections + 2 norms
  if (qkv_bias) attn = attn + q + two * kv;
  if (o_bias) attn = attn + h;
  if (qk_norm) attn = attn + two * SatInt{head_dim};  // per-head q and k RMSNorm weights
  if (sandwich_norms) attn = attn + two * h;           // post-attention, post-feedforward norms
  if (attention_sinks) attn = attn + SatInt{num_heads};
  return attn.v;
}

int64_t ModelSpec::NumParameters() const {
  const SatInt h{hidden_size};
  const SatInt two{2}, three{3};
  const SatInt attn{AttentionParameters()};
  SatInt total = SatInt{vocab_size} * h * SatInt{tie_word_embeddings ? 1 : 2} + h;
  for (int64_t l = 0; l < num_layers; ++l) {
    total = total + attn;
    if (IsSparseLayer(l)) {
      total = total + SatInt{moe.num_experts} * (h + three * h * SatInt{moe.expert_intermediate_size});
      // DeepSeek-V3's e_score_correction_bias, GPT-OSS's router bias: one value per expert.
      if (moe.scoring == MoeScoring::kSigmoidGrouped || moe.router_bias) total = total + SatInt{moe.num_experts};
      // GPT-OSS's expert biases: gate, up and down.
      if (moe.expert_bias) {
        total = total + SatInt{moe.num_experts} * (two * SatInt{moe.expert_intermediate_size} + h);
      }
      if (moe.shared_expert_intermediate_size > 0) {
        total = total + three * h * SatInt{moe.shared_expert_intermediate_size} +
                (moe.shared_expert_gate ? h : SatInt{0});
      }
    } else {
      const SatInt inter{intermediate_size};
      total = total + three * h * inter + (mlp_bias ? two * inter + h : SatInt{0});
    }
    if (total.v == INT64_MAX) break;  // saturated: more layers change nothing
  }
  return total.v;
}

absl::StatusOr<ModelSpec> ParseModelSpec(absl::string_view config_json, absl::string_view label) {
  json doc = json::parse(config_json.begin(), config_json.end(), nullptr, false);
  if (doc.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(label, ": not valid JSON"));
  if (!doc.is_object()) return absl::InvalidArgumentError(absl::StrCat(label, ": not a JSON object"));
  std::string text_label;
  std::string weight_prefix;
  if (doc.contains("architectures") && doc.at("architectures").is_array() && !doc.at("architectures").empty() &&
      doc.at("architectures").at(0) == "Llama4ForConditionalGeneration") {
    ASSIGN_OR_RETURN(json text, Llama4TextConfig(doc, label));
    doc = std::move(text);
    text_label = absl::StrCat(label, " text_config");
    label = text_label;
    weight_prefix = "language_model.";
  }
  ModelSpec s;
  s.weight_prefix = weight_prefix;
  ASSIGN_OR_RETURN(s.arch, ParseArchitecture(doc, label));
  // Gemma3ForConditionalGeneration: errors name its text_config (as Llama-4's above).
  if (s.arch == Architecture::kGemma3) {
    if (doc.at("architectures").at(0).get<std::string>() == "Gemma3ForConditionalGeneration") {
      ASSIGN_OR_RETURN(doc, Gemma3TextConfigOf(doc, label));
      s.multimodal_text = true;
      text_label = absl::StrCat(label, " text_config");
      label = text_label;
    }
    FillGemma3Defaults(&doc);
  }
  Fields f(doc, label);
  ASSIGN_OR_RETURN(s.vocab_size, f.Int("vocab_size", 1, kMaxDim));
  ASSIGN_OR_RETURN(s.hidden_size, f.Int("hidden_size", 1, kMaxDim));
  ASSIGN_OR_RETURN(s.intermediate_size, f.Int("intermediate_size", 1, kMaxDim));
  ASSIGN_OR_RETURN(s.num_layers, f.Int("num_hidden_layers", 1, 4096));
  ASSIGN_OR_RETURN(s.num_heads, f.Int("num_attention_heads", 1, 4096));
  ASSIGN_OR_RETURN(s.num_kv_heads, f.IntOr("num_key_value_heads", s.num_heads, 1, s.num_heads));
  if (s.num_heads % s.num_kv_heads != 0) {
    return f.Error("num_key_value_heads", absl::StrCat("(", s.num_kv_heads, ") does not divide num_attention_heads (",
                                                       s.num_heads, ")"));
  }
  if (s.arch == Architecture::kDeepseekV2 || s.arch == Architecture::kDeepseekV3 ||
      s.arch == Architecture::kGlm4MoeLite) {
    s.head_dim = 2;  // qk_rope_head_dim, set by ParseMla (config.json's head_dim is derived)
  } else if (f.Has("head_dim")) {
    ASSIGN_OR_RETURN(s.head_dim, f.Int("head_dim", 2, 65536));
  } else if (s.arch == Architecture::kGemma2 || s.arch == Architecture::kGemma3) {
    s.head_dim = 256;  // Gemma2Config's default, not hidden / heads
  } else if (s.arch == Architecture::kLlama4) {
    s.head_dim = 128;  // Llama4TextConfig's default, not hidden / heads
  } else if (s.arch == Architecture::kGptOss) {
    s.head_dim = 64;  // GptOssConfig's default, not hidden / heads
  } else if (s.arch == Architecture::kSeedOss || s.arch == Architecture::kGlm4) {
    s.head_dim = 128;  // SeedOssConfig's and Glm4Config's default, not hidden / heads
  } else if (s.arch == Architecture::kQwen3) {
    // transformers' Qwen3 defaults a missing head_dim to 128, not hidden / heads: no guessing.
    return f.Error("head_dim", "is missing (Qwen3 configs state it)");
  } else {
    if (s.hidden_size % s.num_heads != 0) {
      return f.Error("hidden_size", "is not divisible by num_attention_heads and no head_dim is given");
    }
    s.head_dim = s.hidden_size / s.num_heads;
  }
  if (s.head_dim % 2 != 0) return f.Error("head_dim", absl::StrCat("is ", s.head_dim, "; RoPE needs an even size"));
  ASSIGN_OR_RETURN(s.max_position_embeddings, f.Int("max_position_embeddings", 1, kMaxPositions));
  ASSIGN_OR_RETURN(s.rms_norm_eps, f.NumberOr("rms_norm_eps", 1e-6, 0.0, 1.0));
  // Gemma2Config, SmolLM3Config and GraniteSWAConfig tie them unless told otherwise.
  const bool tied_by_default =
      s.arch == Architecture::kGemma2 || s.arch == Architecture::kSmolLM3 || s.arch == Architecture::kGraniteSWA;
  ASSIGN_OR_RETURN(s.tie_word_embeddings, f.BoolOr("tie_word_embeddings", tied_by_default));
  const bool gemma = s.arch == Architecture::kGemma2 || s.arch == Architecture::kGemma3;
  if (f.Has("hidden_act") && !gemma) {
    const json& act = doc.at("hidden_act");
    if (!act.is_string() || (act.get<std::string>() != "silu" && act.get<std::string>() != "swish")) {
      return absl::UnimplementedError(absl::StrCat(label, ": field \"hidden_act\" is ", act.dump(),
                                                   "; only \"silu\" is supported"));
    }
  }
  if (s.arch == Architecture::kGemma3) {
    RETURN_IF_ERROR(ParseGemma3Rope(f, s.max_position_embeddings, &s));
    // Gemma-3 rotates whole heads on both layer types (the rope checks below cover s.rope).
    ASSIGN_OR_RETURN(double prf, f.NumberOr("partial_rotary_factor", 1.0, 0.0, 1.0));
    if (prf != 1.0 || (s.sliding_rope.has_value() && s.sliding_rope->partial_rotary_factor != 1.0)) {
      return absl::UnimplementedError(absl::StrCat(label, ": partial_rotary_factor != 1 is not supported for Gemma-3"));
    }
  } else {
    if (s.arch == Architecture::kGptOss && !f.Has("rope_parameters") && !f.Has("rope_scaling")) {
      // GptOssConfig's default RoPE.
      doc["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 32.0}, {"beta_fast", 32.0}, {"beta_slow", 1.0},
                                {"truncate", false}, {"original_max_position_embeddings", 4096}};
    }
    // SmolLM3Config's default_theta is 2e6, GptOssConfig's 150000; Glm4MoeConfig rotates half of
    // each head unless told otherwise.
    double default_theta = 10000.0;
    if (s.arch == Architecture::kSmolLM3) default_theta = 2e6;
    if (s.arch == Architecture::kGptOss) default_theta = 150000.0;
    const double default_partial = s.arch == Architecture::kGlm4Moe || s.arch == Architecture::kGlm4 ? 0.5 : 1.0;
    RETURN_IF_ERROR(ParseRope(doc, label, s.max_position_embeddings, &s.rope, default_theta, default_partial));
  }
  const bool partial_rotary =
      s.arch == Architecture::kPhi3 || s.arch == Architecture::kGlm4Moe || s.arch == Architecture::kGlm4;
  if (s.rope.type == RopeType::kLongrope && s.arch != Architecture::kPhi3) {
    return absl::UnimplementedError(
        absl::StrCat(label, ": rope type \"longrope\" is supported for Phi3ForCausalLM only"));
  }
  if (!partial_rotary) {
    if (s.rope.partial_rotary_factor != 1.0) {
      return absl::UnimplementedError(absl::StrCat(label, ": field \"partial_rotary_factor\" is ",
                                                   s.rope.partial_rotary_factor, "; below 1 it is supported for ",
                                                   "Phi3ForCausalLM, Glm4ForCausalLM and Glm4MoeForCausalLM only "
                                                   "(RoPE over the whole head elsewhere)"));
    }
  } else {
    const int64_t rot = s.RotaryDim();
    if (rot < 2 || rot % 2 != 0) {
      return f.Error("partial_rotary_factor", absl::StrCat("(", s.rope.partial_rotary_factor, ") rotates ", rot,
                                                           " of head_dim ", s.head_dim,
                                                           " elements; RoPE needs an even number, at least 2"));
    }
    if (s.rope.type == RopeType::kLongrope) {
      for (const auto* factors : {&s.rope.short_factor, &s.rope.long_factor}) {
        if (static_cast<int64_t>(factors->size()) != rot / 2) {
          return f.Error(factors == &s.rope.short_factor ? "short_factor" : "long_factor",
                         absl::StrCat("has ", factors->size(), " entries; rotary_dim / 2 = ", rot / 2, " expected"));
        }
      }
    }
  }
  switch (s.arch) {
    case Architecture::kLlama:
    case Architecture::kGranite:
    case Architecture::kGraniteMoe:
    case Architecture::kGraniteMoeShared:
    case Architecture::kGraniteSWA:
    case Architecture::kGraniteMoeSWA: {
      ASSIGN_OR_RETURN(s.qkv_bias, f.BoolOr("attention_bias", false));
      s.o_bias = s.qkv_bias;
      // GraniteMoe's experts have no biases (GraniteMoeConfig has no mlp_bias).
      if (!s.IsGraniteMoe()) {
        ASSIGN_OR_RETURN(s.mlp_bias, f.BoolOr("mlp_bias", false));
      }
      if (s.arch != Architecture::kLlama) RETURN_IF_ERROR(ParseGranite(f, &s));
      if (s.arch == Architecture::kGraniteSWA || s.arch == Architecture::kGraniteMoeSWA) {
        RETURN_IF_ERROR(ParseGraniteSWA(f, &s));
      }
      break;
    }
    case Architecture::kQwen2:
    case Architecture::kQwen2Moe: {
      // Qwen2 always has q/k/v biases; Qwen2-MoE follows its `qkv_bias` (default true).
      s.qkv_bias = true;
      if (s.arch == Architecture::kQwen2Moe) {
        ASSIGN_OR_RETURN(s.qkv_bias, f.BoolOr("qkv_bias", true));
      }
      ASSIGN_OR_RETURN(bool use_sw, f.BoolOr("use_sliding_window", false));
      if (use_sw) {
        return absl::UnimplementedError(
            absl::StrCat(label, ": use_sliding_window=true (per-layer sliding windows) is not supported"));
      }
      break;
    }
    case Architecture::kQwen3:
    case Architecture::kQwen3Moe: {
      // q/k/v and o share `attention_bias`; q and k are normalised per head.
      ASSIGN_OR_RETURN(s.qkv_bias, f.BoolOr("attention_bias", false));
      s.o_bias = s.qkv_bias;
      s.qk_norm = true;
      ASSIGN_OR_RETURN(bool use_sw, f.BoolOr("use_sliding_window", false));
      if (use_sw) {
        return absl::UnimplementedError(
            absl::StrCat(label, ": use_sliding_window=true (per-layer sliding windows) is not supported"));
      }
      RETURN_IF_ERROR(CheckFullAttentionLayers(f, s.num_layers));
      break;
    }
    case Architecture::kPhi3: {
      // Fused checkpoint tensors; every layer attends within `sliding_window` when it is set.
      s.fused_qkv = true;
      s.fused_gate_up = true;
      ASSIGN_OR_RETURN(s.sliding_window, f.IntOr("sliding_window", 0, 0, kMaxPositions));
      DropUnreachedWindow(&s);
      break;
    }
    case Architecture::kMistral:
    case Architecture::kMixtral: {
      ASSIGN_OR_RETURN(s.sliding_window, f.IntOr("sliding_window", 0, 0, kMaxPositions));
      DropUnreachedWindow(&s);
      break;
    }
    case Architecture::kDeepseekV2:
      RETURN_IF_ERROR(ParseDeepseekV2(f, &s));
      break;
    case Architecture::kDeepseekV3:
      RETURN_IF_ERROR(ParseDeepseekV3(f, &s));
      break;
    case Architecture::kLlama4:
      if (f.Has("quantization_config")) {
        return absl::UnimplementedError(absl::StrCat(
            label, ": field \"quantization_config\": quantized Llama-4 checkpoints are not supported"));
      }
      RETURN_IF_ERROR(ParseLlama4(f, &s));
      break;
    case Architecture::kSmolLM3:
      RETURN_IF_ERROR(ParseSmolLM3(f, &s));
      break;
    case Architecture::kGptOss:
      RETURN_IF_ERROR(ParseGptOss(f, &s));
      break;
    case Architecture::kGlm4Moe:
      RETURN_IF_ERROR(ParseGlm4Moe(f, &s));
      break;
    case Architecture::kGlm4MoeLite:
      RETURN_IF_ERROR(ParseGlm4MoeLite(f, &s));
      break;
    case Architecture::kGlm4: {
      // GLM-4 (Glm4ForCausalLM: GLM-4-9B/32B-0414, GLM-Z1): q/k/v biases (attention_bias, default
      // true), none on o; gate and up fused as Phi-3's; Gemma-2's four norms per layer (other
      // names); RoPE on interleaved pairs of each head's first half.
      ASSIGN_OR_RETURN(s.qkv_bias, f.BoolOr("attention_bias", true));
      s.o_bias = false;
      s.fused_gate_up = true;
      s.sandwich_norms = true;
      s.rope_interleaved = true;
      break;
    }
    case Architecture::kSeedOss: {
      // Seed-OSS (ByteDance's Seed-OSS-36B): Llama's layer with q/k/v biases (attention_bias,
      // default true) apart from o's (attention_out_bias, default false); dropout is training-only.
      ASSIGN_OR_RETURN(s.qkv_bias, f.BoolOr("attention_bias", true));
      ASSIGN_OR_RETURN(s.o_bias, f.BoolOr("attention_out_bias", false));
      ASSIGN_OR_RETURN(s.mlp_bias, f.BoolOr("mlp_bias", false));
      break;
    }
    case Architecture::kGemma2:
    case Architecture::kGemma3:
      break;  // after the dtype (the embedding multiplier is rounded to it)
  }
  // YaRN is checked against transformers on MLA (DeepSeek) and on rotate-half heads (GPT-OSS, Qwen3);
  // the Llama-family rotary embedding is the same everywhere else, except on the architectures with
  // a partial rotary factor (Phi-3, GLM-4, GLM-4.5) and on Gemma-2, which stay refused. (Llama-4
  // and Gemma-3 refuse it themselves.)
  if (s.rope.type == RopeType::kYarn && (partial_rotary || s.arch == Architecture::kGemma2)) {
    return absl::UnimplementedError(absl::StrCat(label, ": rope type \"yarn\" is not supported for ",
                                                 ArchitectureName(s.arch),
                                                 " (not checked against transformers there yet)"));
  }
  if (s.arch == Architecture::kMixtral || s.arch == Architecture::kQwen2Moe || s.arch == Architecture::kQwen3Moe ||
      s.IsGraniteMoe()) {
    RETURN_IF_ERROR(ParseMoe(f, &s));
  }
  if (f.Has("bos_token_id")) {
    ASSIGN_OR_RETURN(s.bos_token_id, f.Int("bos_token_id", 0, s.vocab_size - 1));
  }
  ASSIGN_OR_RETURN(s.eos_token_ids, ParseIds(f, "eos_token_id", s.vocab_size));
  for (const char* key : {"torch_dtype", "dtype"}) {
    if (f.Has(key) && doc.at(key).is_string()) {
      std::string d = doc.at(key).get<std::string>();
      if (d == "float32") s.dtype = DType::kF32;
      else if (d == "float16") s.dtype = DType::kF16;
      else if (d == "bfloat16") s.dtype = DType::kBF16;
      else return absl::UnimplementedError(absl::StrCat(label, ": field \"", key, "\" is \"", d,
                                                        "\"; supported: float32, float16, bfloat16"));
    }
  }
  if (gemma) {
    RETURN_IF_ERROR(ParseGemma(f, &s));
    if (s.arch == Architecture::kGemma3) s.qk_norm = true;  // per-head q and k RMSNorm, (1 + w)
  }
  RETURN_IF_ERROR(ParseQuantization(doc, label, &s));
  return s;
}

absl::StatusOr<ModelSpec> LoadModelSpec(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string config_path = (fs::path(dir) / "config.json").string();
  ASSIGN_OR_RETURN(std::string text, ReadFile(config_path));
  ASSIGN_OR_RETURN(ModelSpec spec, ParseModelSpec(text, config_path));
  const std::string gen_path = (fs::path(dir) / "generation_config.json").string();
  std::error_code ec;
  if (fs::exists(gen_path, ec)) {
    ASSIGN_OR_RETURN(std::string gen_text, ReadFile(gen_path));
    json gen = json::parse(gen_text, nullptr, false);
    if (gen.is_discarded() || !gen.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(gen_path, ": not a JSON object"));
    }
    Fields g(gen, gen_path);
    ASSIGN_OR_RETURN(auto eos, ParseIds(g, "eos_token_id", spec.vocab_size));
    if (!eos.empty()) spec.eos_token_ids = std::move(eos);
  }
  return spec;
}

}  // namespace shardserve

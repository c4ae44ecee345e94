#include "common/model_spec/model_spec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "tests/testing/golden.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace shardserve {
namespace {

using ::shardserve::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using json = nlohmann::json;

json LlamaConfig() {
  return json::parse(R"({"architectures":["LlamaForCausalLM"],"vocab_size":100,"hidden_size":64,
    "intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
    "max_position_embeddings":256,"rms_norm_eps":1e-5,"rope_theta":10000.0,"hidden_act":"silu",
    "eos_token_id":2,"bos_token_id":1})");
}

TEST(ModelSpecTest, ParsesEveryGoldenConfig) {
  for (const std::string& name : testing::GoldenModelNames()) {
    auto spec = LoadModelSpec("tests/golden/models/" + name);
    EXPECT_TRUE(spec.ok()) << name << ": " << spec.status();
  }
}

TEST(ModelSpecTest, GoldenConfigsHaveTheExpectedSemantics) {
  ASSERT_OK_AND_ASSIGN(ModelSpec tied, LoadModelSpec("tests/golden/models/llama_tied_llama3rope_bias"));
  EXPECT_TRUE(tied.tie_word_embeddings);
  EXPECT_TRUE(tied.qkv_bias);
  EXPECT_TRUE(tied.o_bias);
  EXPECT_EQ(tied.head_dim, 32);
  EXPECT_EQ(tied.rope.type, RopeType::kLlama3);
  EXPECT_EQ(tied.rope.theta, 500000.0);
  EXPECT_EQ(tied.rope.original_max_position_embeddings, 32);
  ASSERT_OK_AND_ASSIGN(ModelSpec mistral, LoadModelSpec("tests/golden/models/mistral"));
  EXPECT_EQ(mistral.sliding_window, 8);
  ASSERT_OK_AND_ASSIGN(ModelSpec mixtral, LoadModelSpec("tests/golden/models/mixtral"));
  EXPECT_EQ(mixtral.moe.num_experts, 4);
  EXPECT_TRUE(mixtral.moe.norm_topk_prob);
  ASSERT_OK_AND_ASSIGN(ModelSpec qmoe, LoadModelSpec("tests/golden/models/qwen2_moe"));
  EXPECT_FALSE(qmoe.moe.norm_topk_prob);
  EXPECT_THAT(qmoe.moe.sparse_layers, ElementsAre(true, false, true));
  EXPECT_EQ(qmoe.moe.shared_expert_intermediate_size, 64);
  EXPECT_EQ(qmoe.sliding_window, 0);
  ASSERT_OK_AND_ASSIGN(ModelSpec bf16, LoadModelSpec("tests/golden/models/llama_bf16_sharded"));
  EXPECT_EQ(bf16.dtype, DType::kBF16);
  EXPECT_FALSE(bf16.fp8.has_value());
  ASSERT_OK_AND_ASSIGN(ModelSpec block, LoadModelSpec("tests/golden/models/llama_fp8_block"));
  EXPECT_EQ(block.dtype, DType::kBF16);
  ASSERT_TRUE(block.fp8.has_value());
  EXPECT_TRUE(block.fp8->IsBlockWise());
  EXPECT_EQ(block.fp8->block_rows, 32);
  EXPECT_EQ(block.fp8->block_cols, 32);
  EXPECT_FALSE(block.fp8->static_activations);
  EXPECT_THAT(block.fp8->modules_not_converted, ElementsAre("lm_head"));
  ASSERT_OK_AND_ASSIGN(ModelSpec tensor, LoadModelSpec("tests/golden/models/llama_fp8_tensor"));
  ASSERT_TRUE(tensor.fp8.has_value());
  EXPECT_FALSE(tensor.fp8->IsBlockWise());
  EXPECT_TRUE(tensor.fp8->static_activations);
  EXPECT_THAT(tensor.fp8->modules_not_converted, ElementsAre("lm_head"));  // from ignored_layers
}

TEST(ModelSpecTest, Qwen3AndPhi3GoldenConfigs) {
  ASSERT_OK_AND_ASSIGN(ModelSpec qwen3, LoadModelSpec("tests/golden/models/qwen3"));
  EXPECT_EQ(qwen3.arch, Architecture::kQwen3);
  EXPECT_TRUE(qwen3.qk_norm);
  EXPECT_FALSE(qwen3.qkv_bias);
  EXPECT_FALSE(qwen3.o_bias);
  EXPECT_EQ(qwen3.head_dim, 32);  // explicit, != 64 / 4
  EXPECT_FALSE(qwen3.fused_qkv);
  // Projections, two norms and the two [head_dim] q/k norms per layer.
  EXPECT_EQ(qwen3.NumParameters(),
            2 * (64 * 128 + 2 * 64 * 64 + 128 * 64 + 2 * 64 + 2 * 32 + 3 * 64 * 96) + 2 * 256 * 64 + 64);
  ASSERT_OK_AND_ASSIGN(ModelSpec qmoe, LoadModelSpec("tests/golden/models/qwen3_moe"));
  EXPECT_EQ(qmoe.arch, Architecture::kQwen3Moe);
  EXPECT_TRUE(qmoe.qk_norm);
  EXPECT_TRUE(qmoe.qkv_bias);
  EXPECT_TRUE(qmoe.o_bias);
  EXPECT_EQ(qmoe.moe.num_experts, 8);  // written as num_local_experts by transformers 5
  EXPECT_EQ(qmoe.moe.top_k, 2);
  EXPECT_TRUE(qmoe.moe.norm_topk_prob);
  EXPECT_EQ(qmoe.moe.expert_intermediate_size, 16);
  EXPECT_EQ(qmoe.moe.shared_expert_intermediate_size, 0);
  EXPECT_THAT(qmoe.moe.sparse_layers, ElementsAre(true, false, true));
  ASSERT_OK_AND_ASSIGN(ModelSpec phi3, LoadModelSpec("tests/golden/models/phi3"));
  EXPECT_EQ(phi3.arch, Architecture::kPhi3);
  EXPECT_TRUE(phi3.fused_qkv);
  EXPECT_TRUE(phi3.fused_gate_up);
  EXPECT_FALSE(phi3.qk_norm);
  EXPECT_FALSE(phi3.qkv_bias);
  EXPECT_EQ(phi3.sliding_window, 16);
  EXPECT_EQ(phi3.rope.type, RopeType::kDefault);
}

TEST(ModelSpecTest, Qwen3MoeReleasedConfigsSayNumExperts) {
  json c = LlamaConfig();
  c["architectures"] = {"Qwen3MoeForCausalLM"};
  c["num_experts"] = 16;
  c["num_experts_per_tok"] = 4;
  c["moe_intermediate_size"] = 32;
  c["decoder_sparse_step"] = 2;
  c["norm_topk_prob"] = true;
  c["shared_expert_intermediate_size"] = 64;  // not a Qwen3-MoE field: no shared expert
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(c.dump(), "config.json"));
  EXPECT_EQ(s.moe.num_experts, 16);
  EXPECT_EQ(s.moe.shared_expert_intermediate_size, 0);
  EXPECT_THAT(s.moe.sparse_layers, ElementsAre(false, true));
  EXPECT_EQ(s.head_dim, 16);  // Qwen3-MoE falls back to hidden / heads, as transformers does
}

TEST(ModelSpecTest, DeepSeekStyleFp8Config) {
  json c = LlamaConfig();
  c["torch_dtype"] = "bfloat16";
  c["quantization_config"] = json::parse(
      R"({"activation_scheme":"dynamic","fmt":"e4m3","quant_method":"fp8","weight_block_size":[128,64]})");
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(c.dump(), "config.json"));
  ASSERT_TRUE(s.fp8.has_value());
  EXPECT_EQ(s.fp8->block_rows, 128);  // output features
  EXPECT_EQ(s.fp8->block_cols, 64);   // input features
  EXPECT_FALSE(s.fp8->static_activations);
  EXPECT_TRUE(s.fp8->modules_not_converted.empty());
  EXPECT_EQ(s.dtype, DType::kBF16);
}

TEST(ModelSpecTest, PerTensorFp8ConfigWithStaticActivationsAndNulls) {
  // AutoFP8 / vLLM style; null fields mean absent (fmt defaults to e4m3, no block size).
  json c = LlamaConfig();
  c["quantization_config"] = json::parse(
      R"({"quant_method":"fp8","activation_scheme":"static","weight_block_size":null,"fmt":null,
          "modules_to_not_convert":null,"ignored_layers":["lm_head","model.layers.0.mlp.down_proj"]})");
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(c.dump(), "config.json"));
  ASSERT_TRUE(s.fp8.has_value());
  EXPECT_FALSE(s.fp8->IsBlockWise());
  EXPECT_EQ(s.fp8->block_rows, 0);
  EXPECT_TRUE(s.fp8->static_activations);
  EXPECT_THAT(s.fp8->modules_not_converted, ElementsAre("lm_head", "model.layers.0.mlp.down_proj"));
}

TEST(ModelSpecTest, NoQuantizationConfigMeansNoFp8) {
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(LlamaConfig().dump(), "config.json"));
  EXPECT_FALSE(s.fp8.has_value());
  json c = LlamaConfig();
  c["quantization_config"] = nullptr;
  ASSERT_OK_AND_ASSIGN(s, ParseModelSpec(c.dump(), "config.json"));
  EXPECT_FALSE(s.fp8.has_value());
}

TEST(ModelSpecTest, ReadsStories260KWithLegacyRopeKeys) {
  ASSERT_OK_AND_ASSIGN(ModelSpec s, LoadModelSpec("../shared/models/stories260K"));
  EXPECT_EQ(s.arch, Architecture::kLlama);
  EXPECT_EQ(s.head_dim, 8);
  EXPECT_EQ(s.num_kv_heads, 4);
  EXPECT_EQ(s.rope.type, RopeType::kDefault);
  EXPECT_THAT(s.eos_token_ids, ElementsAre(2));
  EXPECT_EQ(s.NumParameters(), 5 * (64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 172 + 128) + 512 * 64 + 64);
}

TEST(ModelSpecTest, LegacyRopeScalingWithTypeKey) {
  json c = LlamaConfig();
  c["rope_scaling"] = {{"type", "linear"}, {"factor", 4.0}};
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(c.dump(), "config.json"));
  EXPECT_EQ(s.rope.type, RopeType::kLinear);
  EXPECT_EQ(s.rope.factor, 4.0);
}

struct BadConfig {
  std::string name;
  std::function<void(json&)> edit;
  absl::StatusCode code;
  std::string message;
};

void PrintTo(const BadConfig& c, std::ostream* os) { *os << c.name; }

// A config whose quantization_config is `quant` (JSON text): InvalidArgument containing `message`.
BadConfig Quant(std::string name, const char* quant, std::string message) {
  const std::string text = quant;
  return {std::move(name), [text](json& c) { c["quantization_config"] = json::parse(text); },
          absl::StatusCode::kInvalidArgument, std::move(message)};
}

class BadConfigTest : public ::testing::TestWithParam<BadConfig> {};

TEST_P(BadConfigTest, IsRejectedNamingTheField) {
  json c = LlamaConfig();
  GetParam().edit(c);
  EXPECT_THAT(ParseModelSpec(c.dump(), "dir/config.json"),
              StatusIs(GetParam().code, ::testing::AllOf(HasSubstr("dir/config.json"), HasSubstr(GetParam().message))));
}

INSTANTIATE_TEST_SUITE_P(
    Configs, BadConfigTest,
    ::testing::Values(
        BadConfig{"UnknownArchitecture", [](json& c) { c["architectures"] = {"GPT2LMHeadModel"}; },
                  absl::StatusCode::kUnimplemented, "\"GPT2LMHeadModel\" is not supported"},
        BadConfig{"NoArchitectures", [](json& c) { c.erase("architectures"); }, absl::StatusCode::kInvalidArgument,
                  "architectures"},
        BadConfig{"MissingHidden", [](json& c) { c.erase("hidden_size"); }, absl::StatusCode::kInvalidArgument,
                  "\"hidden_size\" is missing"},
        BadConfig{"NegativeLayers", [](json& c) { c["num_hidden_layers"] = -1; }, absl::StatusCode::kInvalidArgument,
                  "\"num_hidden_layers\" is -1"},
        BadConfig{"StringVocab", [](json& c) { c["vocab_size"] = "big"; }, absl::StatusCode::kInvalidArgument,
                  "\"vocab_size\" is not an integer"},
        BadConfig{"KvHeadsDoNotDivide", [](json& c) { c["num_key_value_heads"] = 3; },
                  absl::StatusCode::kInvalidArgument, "does not divide"},
        BadConfig{"GeluActivation", [](json& c) { c["hidden_act"] = "gelu"; }, absl::StatusCode::kUnimplemented,
                  "hidden_act"},
        BadConfig{"Llama3WithoutFactor", [](json& c) { c["rope_scaling"] = {{"rope_type", "llama3"}}; },
                  absl::StatusCode::kInvalidArgument, "\"factor\" is missing"},
        BadConfig{"EosOutOfVocab", [](json& c) { c["eos_token_id"] = 100; }, absl::StatusCode::kInvalidArgument,
                  "eos_token_id"},
        BadConfig{"HugeVocab", [](json& c) { c["vocab_size"] = 1e30; }, absl::StatusCode::kInvalidArgument,
                  "vocab_size"},
        BadConfig{"OddHeadDim", [](json& c) { c["head_dim"] = 15; }, absl::StatusCode::kInvalidArgument, "head_dim"},
        BadConfig{"FloatDtype8", [](json& c) { c["torch_dtype"] = "float8_e4m3fn"; },
                  absl::StatusCode::kUnimplemented, "float8_e4m3fn"},
        BadConfig{"QwenSlidingWindow",
                  [](json& c) {
                    c["architectures"] = {"Qwen2ForCausalLM"};
                    c["use_sliding_window"] = true;
                  },
                  absl::StatusCode::kUnimplemented, "use_sliding_window"},
        BadConfig{"Qwen3WithoutHeadDim", [](json& c) { c["architectures"] = {"Qwen3ForCausalLM"}; },
                  absl::StatusCode::kInvalidArgument, "\"head_dim\" is missing"},
        BadConfig{"Qwen3SlidingWindow",
                  [](json& c) {
                    c["architectures"] = {"Qwen3ForCausalLM"};
                    c["head_dim"] = 16;
                    c["use_sliding_window"] = true;
                  },
                  absl::StatusCode::kUnimplemented, "use_sliding_window"},
        BadConfig{"Qwen3SlidingLayerType",
                  [](json& c) {
                    c["architectures"] = {"Qwen3ForCausalLM"};
                    c["head_dim"] = 16;
                    c["layer_types"] = {"full_attention", "sliding_attention"};
                  },
                  absl::StatusCode::kUnimplemented, "\"layer_types\" has \"sliding_attention\""},
        BadConfig{"Qwen3LayerTypesTooShort",
                  [](json& c) {
                    c["architectures"] = {"Qwen3ForCausalLM"};
                    c["head_dim"] = 16;
                    c["layer_types"] = {"full_attention"};
                  },
                  absl::StatusCode::kInvalidArgument, "\"layer_types\" is not a list of 2 layer types"},
        BadConfig{"Qwen3MoeExpertCountsDisagree",
                  [](json& c) {
                    c["architectures"] = {"Qwen3MoeForCausalLM"};
                    c["num_experts"] = 8;
                    c["num_local_experts"] = 4;
                    c["num_experts_per_tok"] = 2;
                    c["moe_intermediate_size"] = 16;
                  },
                  absl::StatusCode::kInvalidArgument, "\"num_local_experts\" (4) disagrees with num_experts (8)"},
        BadConfig{"Qwen3MoeWithoutExpertWidth",
                  [](json& c) {
                    c["architectures"] = {"Qwen3MoeForCausalLM"};
                    c["num_experts"] = 8;
                    c["num_experts_per_tok"] = 2;
                  },
                  absl::StatusCode::kInvalidArgument, "\"moe_intermediate_size\" is missing"},
        BadConfig{"Phi3LongRopeFactorCount",
                  [](json& c) {
                    c["architectures"] = {"Phi3ForCausalLM"};
                    c["rope_scaling"] = {{"type", "longrope"}, {"short_factor", {1.0}}, {"long_factor", {2.0}}};
                  },
                  absl::StatusCode::kInvalidArgument, "\"short_factor\" has 1 entries; rotary_dim / 2 = 8"},
        BadConfig{"LongRopeOnLlama",
                  [](json& c) {
                    c["rope_scaling"] = {{"type", "longrope"}, {"short_factor", {1.0}}, {"long_factor", {2.0}}};
                  },
                  absl::StatusCode::kUnimplemented, "\"longrope\" is supported for Phi3ForCausalLM only"},
        BadConfig{"PartialRotaryOnLlama",
                  [](json& c) { c["rope_parameters"] = {{"rope_type", "default"}, {"partial_rotary_factor", 0.75}}; },
                  absl::StatusCode::kUnimplemented, "\"partial_rotary_factor\" is 0.75"},
        BadConfig{"DeepSeekV2WithoutLatentAttention", [](json& c) { c["architectures"] = {"DeepseekV2ForCausalLM"}; },
                  absl::StatusCode::kInvalidArgument, "\"q_lora_rank\" is missing"},
        BadConfig{"Llama4WithoutTextConfig", [](json& c) { c["architectures"] = {"Llama4ForConditionalGeneration"}; },
                  absl::StatusCode::kInvalidArgument, "\"text_config\" is missing"},
        BadConfig{"Gemma3n", [](json& c) { c["architectures"] = {"Gemma3nForCausalLM"}; },
                  absl::StatusCode::kUnimplemented, "\"Gemma3nForCausalLM\" is not supported"},
        BadConfig{"MixtralWithoutExperts", [](json& c) { c["architectures"] = {"MixtralForCausalLM"}; },
                  absl::StatusCode::kInvalidArgument, "num_local_experts"},
        BadConfig{"TopKAboveExperts",
                  [](json& c) {
                    c["architectures"] = {"MixtralForCausalLM"};
                    c["num_local_experts"] = 2;
                    c["num_experts_per_tok"] = 3;
                  },
                  absl::StatusCode::kInvalidArgument, "num_experts_per_tok"},
        // quantization_config: only fp8 (e4m3), with well-formed fields.
        Quant("QuantGptq", R"({"quant_method":"gptq","bits":4,"group_size":128})",
              "\"quant_method\" is \"gptq\"; only \"fp8\""),
        Quant("QuantAwq", R"({"quant_method":"awq","bits":4})", "\"quant_method\" is \"awq\"; only \"fp8\""),
        Quant("QuantBitsAndBytes", R"({"quant_method":"bitsandbytes","load_in_4bit":true})",
              "\"quant_method\" is \"bitsandbytes\"; only \"fp8\""),
        Quant("QuantCompressedTensors", R"({"quant_method":"compressed-tensors","format":"float-quantized"})",
              "\"quant_method\" is \"compressed-tensors\"; only \"fp8\""),
        Quant("QuantFbgemmFp8", R"({"quant_method":"fbgemm_fp8"})", "\"quant_method\" is \"fbgemm_fp8\""),
        Quant("QuantWithoutMethod", R"({"weight_block_size":[128,128]})",
              "quantization_config: field \"quant_method\" is missing"),
        Quant("QuantMethodNotString", R"({"quant_method":8})", "\"quant_method\" is not a string"),
        Quant("QuantNotObject", R"("fp8")", "field \"quantization_config\" is not an object"),
        Quant("Fp8E5M2", R"({"quant_method":"fp8","fmt":"e5m2"})", "\"fmt\" is \"e5m2\"; only \"e4m3\""),
        Quant("Fp8FmtNotString", R"({"quant_method":"fp8","fmt":4})", "\"fmt\" is not a string"),
        Quant("Fp8BlockZero", R"({"quant_method":"fp8","weight_block_size":[0,128]})",
              "\"weight_block_size\" is 0, outside [1, "),
        Quant("Fp8BlockNegative", R"({"quant_method":"fp8","weight_block_size":[128,-1]})",
              "\"weight_block_size\" is -1, outside [1, "),
        Quant("Fp8BlockOneNumber", R"({"quant_method":"fp8","weight_block_size":128})",
              "\"weight_block_size\" is not a list of two integers"),
        Quant("Fp8BlockThreeNumbers", R"({"quant_method":"fp8","weight_block_size":[1,2,3]})",
              "\"weight_block_size\" is not a list of two integers"),
        Quant("Fp8BlockStrings", R"({"quant_method":"fp8","weight_block_size":["128","128"]})",
              "\"weight_block_size\" is not an integer"),
        Quant("Fp8BlockFraction", R"({"quant_method":"fp8","weight_block_size":[128.5,128]})",
              "\"weight_block_size\" is not an integer"),
        Quant("Fp8ActivationScheme", R"({"quant_method":"fp8","activation_scheme":"per_token"})",
              "\"activation_scheme\" is \"per_token\"; expected \"dynamic\" or \"static\""),
        Quant("Fp8ActivationSchemeNotString", R"({"quant_method":"fp8","activation_scheme":true})",
              "\"activation_scheme\" is true"),
        Quant("Fp8ModulesNotAList", R"({"quant_method":"fp8","modules_to_not_convert":"lm_head"})",
              "\"modules_to_not_convert\" is not a list of module names"),
        Quant("Fp8IgnoredLayersNotStrings", R"({"quant_method":"fp8","ignored_layers":[1]})",
              "\"ignored_layers\" is not a list of module names")),
    [](const auto& test_info) { return test_info.param.name; });

// ---- DeepSeek-V3 ----------------------------------------------------------------------------

json DeepseekConfig() {
  return json::parse(R"({"architectures":["DeepseekV3ForCausalLM"],"vocab_size":100,"hidden_size":64,
    "intermediate_size":96,"moe_intermediate_size":16,"num_hidden_layers":4,"num_attention_heads":4,
    "num_key_value_heads":4,"q_lora_rank":32,"kv_lora_rank":32,"qk_nope_head_dim":16,"qk_rope_head_dim":8,
    "v_head_dim":16,"n_routed_experts":8,"num_experts_per_tok":2,"n_group":4,"topk_group":2,
    "n_shared_experts":1,"routed_scaling_factor":2.5,"norm_topk_prob":true,"first_k_dense_replace":1,
    "max_position_embeddings":256,"rms_norm_eps":1e-6,"hidden_act":"silu","scoring_func":"sigmoid",
    "topk_method":"noaux_tc","moe_layer_freq":1,
    "rope_scaling":{"type":"yarn","factor":40,"beta_fast":32,"beta_slow":1,"mscale":1.0,"mscale_all_dim":1.0,
                    "original_max_position_embeddings":64},"rope_theta":10000})");
}

TEST(ModelSpecTest, DeepseekV3Semantics) {
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(DeepseekConfig().dump(), "c.json"));
  EXPECT_EQ(s.arch, Architecture::kDeepseekV3);
  ASSERT_TRUE(s.IsMla());
  EXPECT_EQ(s.mla.q_lora_rank, 32);
  EXPECT_EQ(s.mla.kv_lora_rank, 32);
  EXPECT_EQ(s.mla.qk_head_dim(), 24);
  EXPECT_EQ(s.head_dim, 8);  // the RoPE width
  EXPECT_TRUE(s.mla.rope_interleave);
  EXPECT_EQ(s.moe.scoring, MoeScoring::kSigmoidGrouped);
  EXPECT_EQ(s.moe.n_group, 4);
  EXPECT_EQ(s.moe.topk_group, 2);
  EXPECT_EQ(s.moe.routed_scaling_factor, 2.5);
  EXPECT_EQ(s.moe.shared_expert_intermediate_size, 16);
  EXPECT_FALSE(s.moe.shared_expert_gate);
  EXPECT_THAT(s.moe.sparse_layers, ElementsAre(false, true, true, true));
  EXPECT_EQ(s.rope.type, RopeType::kYarn);
  EXPECT_EQ(s.rope.attention_factor, 1.0);  // mscale == mscale_all_dim
  // Latent + RoPE key per token and layer, whatever the heads and the tensor-parallel size.
  EXPECT_EQ(s.KvValuesPerToken(1), 40);
  EXPECT_EQ(s.KvValuesPerToken(4), 40);
  const double m = 0.1 * std::log(40.0) + 1.0;
  EXPECT_NEAR(s.AttentionScale(), m * m / std::sqrt(24.0), 1e-12);

  json c = DeepseekConfig();
  c["q_lora_rank"] = nullptr;
  c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"mscale", 1.0}, {"mscale_all_dim", 0.5},
                       {"original_max_position_embeddings", 64}};
  ASSERT_OK_AND_ASSIGN(ModelSpec n, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(n.mla.q_lora_rank, 0);
  EXPECT_NEAR(n.rope.attention_factor, (0.1 * std::log(4.0) + 1.0) / (0.05 * std::log(4.0) + 1.0), 1e-12);
}

TEST(ModelSpecTest, DeepseekGoldenConfigsCountTheirParameters) {
  // The parameter count of the fixtures written by transformers (their safetensors hold exactly
  // these tensors, the score-correction bias included).
  ASSERT_OK_AND_ASSIGN(ModelSpec s, LoadModelSpec("tests/golden/models/deepseek_v3"));
  const int64_t h = 64;
  const int64_t attn = 2 * h + h * 32 + 32 + 32 * 4 * 24 + h * 40 + 32 + 32 * 4 * 32 + 4 * 16 * h;
  const int64_t dense = 3 * h * 96;
  const int64_t moe = 8 * (h + 1) + 8 * 3 * h * 16 + 3 * h * 16;
  EXPECT_EQ(s.NumParameters(), 2 * 256 * h + h + 3 * attn + dense + 2 * moe);
}

struct BadDeepseek {
  std::string name;
  std::function<void(json&)> edit;
  absl::StatusCode code;
  std::string message;
};

void PrintTo(const BadDeepseek& c, std::ostream* os) { *os << c.name; }

class BadDeepseekTest : public ::testing::TestWithParam<BadDeepseek> {};

// Applies `bad`'s edit to config `c`: parsing fails with its code and a message naming the file and
// the field.
void ExpectRejected(json c, const BadDeepseek& bad) {
  bad.edit(c);
  EXPECT_THAT(ParseModelSpec(c.dump(), "dir/config.json"),
              StatusIs(bad.code, ::testing::AllOf(HasSubstr("dir/config.json"), HasSubstr(bad.message))));
}

TEST_P(BadDeepseekTest, IsRejectedNamingTheField) { ExpectRejected(DeepseekConfig(), GetParam()); }

INSTANTIATE_TEST_SUITE_P(
    Configs, BadDeepseekTest,
    ::testing::Values(
        BadDeepseek{"SoftmaxScoring", [](json& c) { c["scoring_func"] = "softmax"; },
                    absl::StatusCode::kUnimplemented, "\"scoring_func\" is \"softmax\""},
        BadDeepseek{"GreedyTopk", [](json& c) { c["topk_method"] = "group_limited_greedy"; },
                    absl::StatusCode::kUnimplemented, "\"topk_method\" is \"group_limited_greedy\""},
        BadDeepseek{"MoeEveryOtherLayer", [](json& c) { c["moe_layer_freq"] = 2; }, absl::StatusCode::kUnimplemented,
                    "\"moe_layer_freq\" is 2"},
        BadDeepseek{"AttentionBias", [](json& c) { c["attention_bias"] = true; }, absl::StatusCode::kUnimplemented,
                    "attention_bias"},
        BadDeepseek{"FewerKvHeads", [](json& c) { c["num_key_value_heads"] = 2; }, absl::StatusCode::kUnimplemented,
                    "num_key_value_heads"},
        BadDeepseek{"QLoraRankMissing", [](json& c) { c.erase("q_lora_rank"); }, absl::StatusCode::kInvalidArgument,
                    "q_lora_rank"},
        BadDeepseek{"KvLoraRankZero", [](json& c) { c["kv_lora_rank"] = 0; }, absl::StatusCode::kInvalidArgument,
                    "kv_lora_rank"},
        BadDeepseek{"OddRopeDim", [](json& c) { c["qk_rope_head_dim"] = 7; }, absl::StatusCode::kInvalidArgument,
                    "qk_rope_head_dim"},
        BadDeepseek{"VHeadDimMissing", [](json& c) { c.erase("v_head_dim"); }, absl::StatusCode::kInvalidArgument,
                    "v_head_dim"},
        BadDeepseek{"GroupsDoNotDivide", [](json& c) { c["n_group"] = 3; }, absl::StatusCode::kInvalidArgument,
                    "\"n_group\" (3) does not divide"},
        BadDeepseek{"OneExpertPerGroup", [](json& c) { c["n_group"] = 8; }, absl::StatusCode::kInvalidArgument,
                    "sum of its two best"},
        BadDeepseek{"TopkGroupAboveGroups", [](json& c) { c["topk_group"] = 5; }, absl::StatusCode::kInvalidArgument,
                    "topk_group"},
        BadDeepseek{"TopKAboveKeptExperts",
                    [](json& c) {
                      c["topk_group"] = 1;
                      c["num_experts_per_tok"] = 3;
                    },
                    absl::StatusCode::kInvalidArgument, "num_experts_per_tok"},
        BadDeepseek{"ScalingNotANumber", [](json& c) { c["routed_scaling_factor"] = "big"; },
                    absl::StatusCode::kInvalidArgument, "routed_scaling_factor"},
        BadDeepseek{"DenseLayersAboveLayers", [](json& c) { c["first_k_dense_replace"] = 5; },
                    absl::StatusCode::kInvalidArgument, "first_k_dense_replace"},
        BadDeepseek{"RopeInterleaveNotBool", [](json& c) { c["rope_interleave"] = "yes"; },
                    absl::StatusCode::kInvalidArgument, "rope_interleave"},
        BadDeepseek{"Llama3Rope",
                    [](json& c) {
                      c["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
                    },
                    absl::StatusCode::kUnimplemented, "default and yarn"},
        BadDeepseek{"YarnBetaNotNumber",
                    [](json& c) { c["rope_scaling"]["beta_fast"] = "fast"; }, absl::StatusCode::kInvalidArgument,
                    "beta_fast"},
        BadDeepseek{"DefaultTopkGroupAboveGroups",
                    [](json& c) {
                      c.erase("topk_group");
                      c["n_group"] = 2;
                    },
                    absl::StatusCode::kInvalidArgument, "its default (4) exceeds n_group (2)"},
        BadDeepseek{"ExpertCountsDisagree", [](json& c) { c["num_local_experts"] = 16; },
                    absl::StatusCode::kInvalidArgument, "num_local_experts"}),
    [](const auto& test_info) { return test_info.param.name; });

// ---- DeepSeek-V2 ----------------------------------------------------------------------------

// DeepSeek-V2-Lite's fields (its released config.json, smaller sizes): greedy softmax routing.
json DeepseekV2LiteConfig() {
  return json::parse(R"({"architectures":["DeepseekV2ForCausalLM"],"vocab_size":100,"hidden_size":64,
    "intermediate_size":96,"moe_intermediate_size":16,"num_hidden_layers":4,"num_attention_heads":4,
    "num_key_value_heads":4,"q_lora_rank":null,"kv_lora_rank":24,"qk_nope_head_dim":16,"qk_rope_head_dim":8,
    "v_head_dim":16,"n_routed_experts":8,"num_experts_per_tok":3,"n_group":1,"topk_group":1,
    "n_shared_experts":2,"routed_scaling_factor":1.0,"norm_topk_prob":false,"first_k_dense_replace":1,
    "max_position_embeddings":256,"rms_norm_eps":1e-6,"hidden_act":"silu","scoring_func":"softmax",
    "topk_method":"greedy","moe_layer_freq":1,"aux_loss_alpha":0.001,"seq_aux":true,"ep_size":1,
    "rope_scaling":{"type":"yarn","factor":40,"beta_fast":32,"beta_slow":1,"mscale":0.707,"mscale_all_dim":0.707,
                    "original_max_position_embeddings":64},"rope_theta":10000})");
}

TEST(ModelSpecTest, DeepseekV2LiteSemantics) {
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(DeepseekV2LiteConfig().dump(), "c.json"));
  EXPECT_EQ(s.arch, Architecture::kDeepseekV2);
  EXPECT_EQ(ArchitectureName(s.arch), "DeepseekV2ForCausalLM");
  ASSERT_TRUE(s.IsMla());
  EXPECT_EQ(s.mla.q_lora_rank, 0);
  EXPECT_EQ(s.mla.kv_lora_rank, 24);
  EXPECT_EQ(s.head_dim, 8);
  EXPECT_TRUE(s.mla.rope_interleave);  // always, whatever the config says
  EXPECT_EQ(s.moe.scoring, MoeScoring::kSoftmaxGroupLimited);
  EXPECT_EQ(s.moe.n_group, 1);
  EXPECT_EQ(s.moe.topk_group, 1);
  EXPECT_EQ(s.moe.top_k, 3);
  EXPECT_FALSE(s.moe.norm_topk_prob);
  EXPECT_EQ(s.moe.routed_scaling_factor, 1.0);
  EXPECT_EQ(s.moe.shared_expert_intermediate_size, 32);
  EXPECT_FALSE(s.moe.shared_expert_gate);
  EXPECT_THAT(s.moe.sparse_layers, ElementsAre(false, true, true, true));
  EXPECT_EQ(s.rope.type, RopeType::kYarn);
  EXPECT_EQ(s.rope.attention_factor, 1.0);  // mscale == mscale_all_dim
  EXPECT_EQ(s.KvValuesPerToken(2), 32);
  const double m = 0.0707 * std::log(40.0) + 1.0;
  EXPECT_NEAR(s.AttentionScale(), m * m / std::sqrt(24.0), 1e-12);
  // No score-correction bias: the router is experts x hidden.
  const int64_t attn = 2 * 64 + 64 * 4 * 24 + 64 * 32 + 24 + 24 * 4 * 32 + 4 * 16 * 64;
  const int64_t moe = 8 * 64 + 8 * 3 * 64 * 16 + 3 * 64 * 32;
  EXPECT_EQ(s.NumParameters(), 2 * 100 * 64 + 64 + 4 * attn + 3 * 64 * 96 + 3 * moe);

  // DeepseekV2Config's defaults: greedy, no dense layers, two shared experts, scaling 1; V2 has
  // no rope_interleave switch (transformers ignores the field).
  json c = DeepseekV2LiteConfig();
  for (const char* key : {"topk_method", "first_k_dense_replace", "n_shared_experts", "routed_scaling_factor",
                          "norm_topk_prob", "n_group", "topk_group", "scoring_func"}) {
    c.erase(key);
  }
  c["rope_interleave"] = false;
  ASSERT_OK_AND_ASSIGN(ModelSpec d, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(d.moe.scoring, MoeScoring::kSoftmaxGroupLimited);
  EXPECT_EQ(d.moe.n_group, 1);
  EXPECT_THAT(d.moe.sparse_layers, ElementsAre(true, true, true, true));
  EXPECT_EQ(d.moe.shared_expert_intermediate_size, 32);
  EXPECT_EQ(d.moe.routed_scaling_factor, 1.0);
  EXPECT_TRUE(d.mla.rope_interleave);
}

TEST(ModelSpecTest, DeepseekV2GroupLimitedSemantics) {
  json c = DeepseekV2LiteConfig();
  c["q_lora_rank"] = 32;
  c["topk_method"] = "group_limited_greedy";
  c["n_group"] = 4;
  c["topk_group"] = 2;
  c["routed_scaling_factor"] = 16.0;
  c["n_shared_experts"] = 0;
  c["rope_scaling"]["mscale"] = 1.0;
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(s.mla.q_lora_rank, 32);
  EXPECT_EQ(s.moe.scoring, MoeScoring::kSoftmaxGroupLimited);
  EXPECT_EQ(s.moe.n_group, 4);
  EXPECT_EQ(s.moe.topk_group, 2);
  EXPECT_EQ(s.moe.routed_scaling_factor, 16.0);
  EXPECT_EQ(s.moe.shared_expert_intermediate_size, 0);
  EXPECT_NEAR(s.rope.attention_factor, (0.1 * std::log(40.0) + 1.0) / (0.0707 * std::log(40.0) + 1.0), 1e-12);
  // One expert per group is fine here: a group's score is its best expert's.
  c["n_group"] = 8;
  c["topk_group"] = 3;
  ASSERT_OK_AND_ASSIGN(ModelSpec one, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(one.moe.n_group, 8);
}

TEST(ModelSpecTest, DeepseekV2GoldenConfigs) {
  ASSERT_OK_AND_ASSIGN(ModelSpec lite, LoadModelSpec("tests/golden/models/deepseek_v2_lite"));
  EXPECT_EQ(lite.moe.scoring, MoeScoring::kSoftmaxGroupLimited);
  EXPECT_EQ(lite.moe.n_group, 1);
  EXPECT_EQ(lite.mla.q_lora_rank, 0);
  ASSERT_OK_AND_ASSIGN(ModelSpec v2, LoadModelSpec("tests/golden/models/deepseek_v2"));
  EXPECT_EQ(v2.moe.n_group, 2);
  EXPECT_EQ(v2.moe.topk_group, 1);
  EXPECT_EQ(v2.moe.top_k, 2);
  EXPECT_EQ(v2.moe.routed_scaling_factor, 2.0);
  EXPECT_EQ(v2.mla.q_lora_rank, 32);
}

class BadDeepseekV2Test : public ::testing::TestWithParam<BadDeepseek> {};

TEST_P(BadDeepseekV2Test, IsRejectedNamingTheField) { ExpectRejected(DeepseekV2LiteConfig(), GetParam()); }

INSTANTIATE_TEST_SUITE_P(
    Configs, BadDeepseekV2Test,
    ::testing::Values(
        BadDeepseek{"SigmoidScoring", [](json& c) { c["scoring_func"] = "sigmoid"; },
                    absl::StatusCode::kUnimplemented, "\"scoring_func\" is \"sigmoid\""},
        BadDeepseek{"NoauxTopk", [](json& c) { c["topk_method"] = "noaux_tc"; }, absl::StatusCode::kUnimplemented,
                    "\"topk_method\" is \"noaux_tc\""},
        BadDeepseek{"TopkMethodNotString", [](json& c) { c["topk_method"] = 3; }, absl::StatusCode::kInvalidArgument,
                    "\"topk_method\" is not a string"},
        BadDeepseek{"RenormalisedTopk", [](json& c) { c["norm_topk_prob"] = true; },
                    absl::StatusCode::kUnimplemented, "\"norm_topk_prob\" is true"},
        BadDeepseek{"MoeEveryOtherLayer", [](json& c) { c["moe_layer_freq"] = 2; }, absl::StatusCode::kUnimplemented,
                    "\"moe_layer_freq\" is 2"},
        BadDeepseek{"AttentionBias", [](json& c) { c["attention_bias"] = true; }, absl::StatusCode::kUnimplemented,
                    "DeepSeek-V2 attention without biases"},
        BadDeepseek{"MlpBias", [](json& c) { c["mlp_bias"] = true; }, absl::StatusCode::kUnimplemented, "mlp_bias"},
        BadDeepseek{"FewerKvHeads", [](json& c) { c["num_key_value_heads"] = 2; }, absl::StatusCode::kUnimplemented,
                    "num_key_value_heads"},
        BadDeepseek{"GreedyWithZeroGroups", [](json& c) { c["n_group"] = 0; }, absl::StatusCode::kInvalidArgument,
                    "\"n_group\" is 0"},
        BadDeepseek{"GreedyWithTopkGroupNotANumber", [](json& c) { c["topk_group"] = "one"; },
                    absl::StatusCode::kInvalidArgument, "\"topk_group\" is not an integer"},
        BadDeepseek{"GroupLimitedWithoutGroups",
                    [](json& c) {
                      c["topk_method"] = "group_limited_greedy";
                      c.erase("n_group");
                    },
                    absl::StatusCode::kInvalidArgument, "\"n_group\" is missing"},
        BadDeepseek{"GroupLimitedWithoutTopkGroup",
                    [](json& c) {
                      c["topk_method"] = "group_limited_greedy";
                      c["n_group"] = 4;
                      c.erase("topk_group");
                    },
                    absl::StatusCode::kInvalidArgument, "\"topk_group\" is missing"},
        BadDeepseek{"GroupsDoNotDivide",
                    [](json& c) {
                      c["topk_method"] = "group_limited_greedy";
                      c["n_group"] = 3;
                    },
                    absl::StatusCode::kInvalidArgument, "\"n_group\" (3) does not divide"},
        BadDeepseek{"TopkGroupAboveGroups",
                    [](json& c) {
                      c["topk_method"] = "group_limited_greedy";
                      c["n_group"] = 2;
                      c["topk_group"] = 3;
                    },
                    absl::StatusCode::kInvalidArgument, "topk_group"},
        BadDeepseek{"TopKAboveKeptExperts",
                    [](json& c) {
                      c["topk_method"] = "group_limited_greedy";
                      c["n_group"] = 4;
                      c["topk_group"] = 1;
                    },
                    absl::StatusCode::kInvalidArgument, "\"num_experts_per_tok\" (3) exceeds the 2 experts"},
        BadDeepseek{"ScalingZero", [](json& c) { c["routed_scaling_factor"] = 0; }, absl::StatusCode::kInvalidArgument,
                    "routed_scaling_factor"},
        BadDeepseek{"SharedExpertsNegative", [](json& c) { c["n_shared_experts"] = -1; },
                    absl::StatusCode::kInvalidArgument, "n_shared_experts"},
        BadDeepseek{"ExpertsMissing", [](json& c) { c.erase("n_routed_experts"); }, absl::StatusCode::kInvalidArgument,
                    "n_routed_experts"},
        BadDeepseek{"QLoraRankMissing", [](json& c) { c.erase("q_lora_rank"); }, absl::StatusCode::kInvalidArgument,
                    "q_lora_rank"},
        BadDeepseek{"LinearRope", [](json& c) { c["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 2.0}}; },
                    absl::StatusCode::kUnimplemented, "DeepSeek-V2 supports rope types default and yarn"},
        BadDeepseek{"DenseLayersAboveLayers", [](json& c) { c["first_k_dense_replace"] = 5; },
                    absl::StatusCode::kInvalidArgument, "first_k_dense_replace"},
        BadDeepseek{"GeluActivation", [](json& c) { c["hidden_act"] = "gelu"; }, absl::StatusCode::kUnimplemented,
                    "hidden_act"}),
    [](const auto& test_info) { return test_info.param.name; });

TEST(ModelSpecTest, NotJsonAndMissingFile) {
  EXPECT_THAT(ParseModelSpec("{nope", "c.json"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not valid JSON")));
  testing::TempDir dir;
  EXPECT_THAT(LoadModelSpec(dir.path()), StatusIs(absl::StatusCode::kNotFound, HasSubstr("config.json")));
}

}  // namespace
}  // namespace shardserve

namespace shardserve {
namespace {

// The fuzzer's finding: sizes whose products overflow int64 saturate instead (no UB).
TEST(ModelSpecTest, NumParametersSaturatesInsteadOfOverflowing) {
  ASSERT_OK_AND_ASSIGN(ModelSpec s, LoadModelSpec("tests/golden/models/llama"));
  const int64_t normal = s.NumParameters();
  EXPECT_GT(normal, 0);
  s.vocab_size = int64_t{1} << 40;
  s.hidden_size = int64_t{1} << 40;
  EXPECT_EQ(s.NumParameters(), INT64_MAX);
}

}  // namespace
}  // namespace shardserve

namespace shardserve {
namespace {

json Gemma2Config() {
  return json::parse(R"({"architectures":["Gemma2ForCausalLM"],"vocab_size":256,"hidden_size":64,
    "intermediate_size":96,"num_hidden_layers":4,"num_attention_heads":4,"num_key_value_heads":2,
    "head_dim":32,"max_position_embeddings":128,"rms_norm_eps":1e-6,"hidden_act":"gelu_pytorch_tanh",
    "hidden_activation":"gelu_pytorch_tanh","query_pre_attn_scalar":24,"attn_logit_softcapping":8.0,
    "final_logit_softcapping":30.0,"sliding_window":8,"eos_token_id":1,"bos_token_id":2})");
}

TEST(Gemma2SpecTest, GoldenConfigHasTheGemmaSemantics) {
  ASSERT_OK_AND_ASSIGN(ModelSpec s, LoadModelSpec("tests/golden/models/gemma2"));
  EXPECT_EQ(s.arch, Architecture::kGemma2);
  EXPECT_EQ(s.head_dim, 32);
  EXPECT_TRUE(s.tie_word_embeddings);
  EXPECT_TRUE(s.norm_plus_one);
  EXPECT_TRUE(s.sandwich_norms);
  EXPECT_EQ(s.activation, Activation::kGeluTanh);
  EXPECT_EQ(s.embedding_multiplier, 8.0);
  EXPECT_EQ(s.query_pre_attn_scalar, 24.0);
  EXPECT_DOUBLE_EQ(s.AttentionScale(), 1.0 / std::sqrt(24.0));
  EXPECT_EQ(s.attn_logit_softcapping, 8.0);
  EXPECT_EQ(s.final_logit_softcapping, 1.5);
  EXPECT_EQ(s.sliding_window, 8);
  EXPECT_THAT(s.sliding_layers, ElementsAre(true, false, true));
  EXPECT_EQ(s.LayerSlidingWindow(0), 8);
  EXPECT_EQ(s.LayerSlidingWindow(1), 0);
  EXPECT_EQ(s.LayerSlidingWindow(2), 8);
  // Tied embedding, 3 layers of q/k/v/o (head_dim 32), a 96-wide MLP and four norms; final norm.
  const int64_t h = 64;
  const int64_t layer = h * 128 + 2 * h * 64 + 128 * h + 3 * h * 96 + 4 * h;
  EXPECT_EQ(s.NumParameters(), 256 * h + h + 3 * layer);
}

TEST(Gemma2SpecTest, DefaultsFollowGemma2Config) {
  json c = Gemma2Config();
  for (const char* key : {"head_dim", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                          "sliding_window", "hidden_activation"}) {
    c.erase(key);
  }
  c["max_position_embeddings"] = 8192;
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(s.head_dim, 256);
  EXPECT_EQ(s.query_pre_attn_scalar, 256.0);
  EXPECT_EQ(s.attn_logit_softcapping, 50.0);
  EXPECT_EQ(s.final_logit_softcapping, 30.0);
  EXPECT_EQ(s.sliding_window, 4096);
  EXPECT_TRUE(s.tie_word_embeddings);
  // layer_types' default: "sliding_attention" on even layers.
  EXPECT_THAT(s.sliding_layers, ElementsAre(true, false, true, false));
  EXPECT_EQ(s.activation, Activation::kGeluTanh);
}

TEST(Gemma2SpecTest, NullSoftCapsAndExplicitLayerTypes) {
  json c = Gemma2Config();
  c["attn_logit_softcapping"] = nullptr;
  c["final_logit_softcapping"] = nullptr;
  c["layer_types"] = {"full_attention", "sliding_attention", "sliding_attention", "full_attention"};
  c["tie_word_embeddings"] = false;
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(s.attn_logit_softcapping, 0.0);
  EXPECT_EQ(s.final_logit_softcapping, 0.0);
  EXPECT_FALSE(s.tie_word_embeddings);
  EXPECT_THAT(s.sliding_layers, ElementsAre(false, true, true, false));
  // No sliding layer: the window is never used.
  c["layer_types"] = {"full_attention", "full_attention", "full_attention", "full_attention"};
  c["sliding_window"] = nullptr;
  ASSERT_OK_AND_ASSIGN(ModelSpec full, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(full.sliding_window, 0);
  EXPECT_EQ(full.LayerSlidingWindow(1), 0);
}

TEST(Gemma2SpecTest, EmbeddingMultiplierIsRoundedToTheCheckpointDtype) {
  json c = Gemma2Config();
  c["hidden_size"] = 3072;  // sqrt = 55.4256..., 55.5 in bfloat16
  c["torch_dtype"] = "bfloat16";
  ASSERT_OK_AND_ASSIGN(ModelSpec bf16, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(bf16.embedding_multiplier, 55.5);
  c["torch_dtype"] = "float32";
  ASSERT_OK_AND_ASSIGN(ModelSpec f32, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(f32.embedding_multiplier, static_cast<double>(static_cast<float>(std::sqrt(3072.0))));
}

json Gemma3TextConfig() {
  return json::parse(R"({"architectures":["Gemma3ForCausalLM"],"model_type":"gemma3_text","vocab_size":256,
    "hidden_size":64,"intermediate_size":96,"num_hidden_layers":6,"num_attention_heads":4,"num_key_value_heads":2,
    "head_dim":32,"max_position_embeddings":128,"rms_norm_eps":1e-6,"hidden_activation":"gelu_pytorch_tanh",
    "query_pre_attn_scalar":24,"sliding_window":8,"eos_token_id":1,"bos_token_id":2,"rope_theta":1000000.0,
    "rope_local_base_freq":10000.0,"rope_scaling":{"rope_type":"linear","factor":8.0}})");
}

struct BadGemma {
  std::string name;
  std::function<void(json&)> edit;
  absl::StatusCode code;
  std::string message;
  bool gemma3 = false;  // edits Gemma3TextConfig() rather than Gemma2Config()
};

void PrintTo(const BadGemma& c, std::ostream* os) { *os << c.name; }

TEST(Gemma3SpecTest, MultimodalModelTiesAndCapsAsTransformersDoes) {
  json text = Gemma3TextConfig();
  text.erase("architectures");
  text["final_logit_softcapping"] = 30.0;  // Gemma3ForConditionalGeneration never applies it
  text["tie_word_embeddings"] = false;     // the top-level field decides
  json c = {{"architectures", {"Gemma3ForConditionalGeneration"}}, {"text_config", text}};
  ASSERT_OK_AND_ASSIGN(ModelSpec tied, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(tied.final_logit_softcapping, 0.0);
  EXPECT_TRUE(tied.tie_word_embeddings);
  c["tie_word_embeddings"] = false;
  ASSERT_OK_AND_ASSIGN(ModelSpec untied, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_FALSE(untied.tie_word_embeddings);
  // The text-only model caps when told to.
  text["architectures"] = {"Gemma3ForCausalLM"};
  ASSERT_OK_AND_ASSIGN(ModelSpec causal, ParseModelSpec(text.dump(), "c.json"));
  EXPECT_EQ(causal.final_logit_softcapping, 30.0);
  EXPECT_FALSE(causal.tie_word_embeddings);
}

class BadGemmaTest : public ::testing::TestWithParam<BadGemma> {};

TEST_P(BadGemmaTest, IsRejectedNamingTheField) {
  json c = GetParam().gemma3 ? Gemma3TextConfig() : Gemma2Config();
  GetParam().edit(c);
  EXPECT_THAT(ParseModelSpec(c.dump(), "dir/config.json"),
              StatusIs(GetParam().code, ::testing::AllOf(HasSubstr("dir/config.json"), HasSubstr(GetParam().message))));
}

INSTANTIATE_TEST_SUITE_P(
    Configs, BadGemmaTest,
    ::testing::Values(
        BadGemma{"ExactGelu", [](json& c) { c["hidden_activation"] = "gelu"; }, absl::StatusCode::kUnimplemented,
                 "\"hidden_activation\" is \"gelu\""},
        BadGemma{"Bidirectional", [](json& c) { c["use_bidirectional_attention"] = true; },
                 absl::StatusCode::kUnimplemented, "use_bidirectional_attention"},
        BadGemma{"ChunkedLayerType",
                 [](json& c) { c["layer_types"] = {"full_attention", "chunked_attention", "full_attention",
                                                   "full_attention"}; },
                 absl::StatusCode::kUnimplemented, "\"layer_types\" has \"chunked_attention\""},
        BadGemma{"LayerTypesLength", [](json& c) { c["layer_types"] = {"full_attention"}; },
                 absl::StatusCode::kInvalidArgument, "\"layer_types\" is not a list of 4 layer types"},
        BadGemma{"NullWindowWithSlidingLayers", [](json& c) { c["sliding_window"] = nullptr; },
                 absl::StatusCode::kUnimplemented, "\"sliding_window\" is null"},
        BadGemma{"ZeroWindow", [](json& c) { c["sliding_window"] = 0; }, absl::StatusCode::kInvalidArgument,
                 "\"sliding_window\" is 0"},
        BadGemma{"NegativeSoftCap", [](json& c) { c["attn_logit_softcapping"] = -1.0; },
                 absl::StatusCode::kInvalidArgument, "\"attn_logit_softcapping\""},
        BadGemma{"ZeroFinalSoftCap", [](json& c) { c["final_logit_softcapping"] = 0; },
                 absl::StatusCode::kInvalidArgument, "a soft-cap must be positive"},
        BadGemma{"StringSoftCap", [](json& c) { c["final_logit_softcapping"] = "30"; },
                 absl::StatusCode::kInvalidArgument, "\"final_logit_softcapping\" is not a number"},
        BadGemma{"ZeroQueryScalar", [](json& c) { c["query_pre_attn_scalar"] = 0; },
                 absl::StatusCode::kInvalidArgument, "query_pre_attn_scalar"},
        BadGemma{"YarnRope", [](json& c) { c["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 2.0}}; },
                 absl::StatusCode::kUnimplemented, "yarn"}),
    [](const auto& test_info) { return test_info.param.name; });

TEST(Gemma3SpecTest, GoldenConfigHasTheGemma3Semantics) {
  ASSERT_OK_AND_ASSIGN(ModelSpec s, LoadModelSpec("tests/golden/models/gemma3"));
  EXPECT_EQ(s.arch, Architecture::kGemma3);
  EXPECT_EQ(ArchitectureName(s.arch), "Gemma3ForCausalLM");
  EXPECT_FALSE(s.multimodal_text);
  EXPECT_EQ(s.head_dim, 32);
  EXPECT_TRUE(s.tie_word_embeddings);
  EXPECT_TRUE(s.norm_plus_one);
  EXPECT_TRUE(s.sandwich_norms);
  EXPECT_TRUE(s.qk_norm);
  EXPECT_EQ(s.activation, Activation::kGeluTanh);
  EXPECT_EQ(s.embedding_multiplier, 8.0);
  EXPECT_DOUBLE_EQ(s.AttentionScale(), 1.0 / std::sqrt(24.0));
  EXPECT_EQ(s.attn_logit_softcapping, 0.0);
  EXPECT_EQ(s.final_logit_softcapping, 0.0);
  EXPECT_EQ(s.sliding_window, 6);
  EXPECT_THAT(s.sliding_layers, ElementsAre(true, false, true));
  // Full layer 1: theta 1e6, linear x8; sliding layers 0 and 2: theta 1e4, unscaled.
  EXPECT_EQ(s.rope.type, RopeType::kLinear);
  EXPECT_EQ(s.rope.theta, 1e6);
  EXPECT_EQ(s.rope.factor, 8.0);
  ASSERT_TRUE(s.sliding_rope.has_value());
  EXPECT_EQ(s.sliding_rope->type, RopeType::kDefault);
  EXPECT_EQ(s.sliding_rope->theta, 1e4);
  EXPECT_FALSE(s.UsesSlidingRope(1));
  EXPECT_TRUE(s.UsesSlidingRope(2));
  EXPECT_EQ(s.LayerRope(0).theta, 1e4);
  EXPECT_EQ(s.LayerRope(1).theta, 1e6);
  EXPECT_THAT(s.eos_token_ids, ElementsAre(2));
  // Gemma-2's layer plus the per-head q and k norms (2 x head_dim).
  const int64_t h = 64;
  const int64_t layer = h * 128 + 2 * h * 64 + 128 * h + 3 * h * 96 + 4 * h + 2 * 32;
  EXPECT_EQ(s.NumParameters(), 256 * h + h + 3 * layer);
}

TEST(Gemma3SpecTest, LegacyRopeFieldsAndTheSlidingWindowPattern) {
  json c = Gemma3TextConfig();
  c["sliding_window_pattern"] = 3;
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_THAT(s.sliding_layers, ElementsAre(true, true, false, true, true, false));
  EXPECT_EQ(s.rope.type, RopeType::kLinear);
  EXPECT_EQ(s.rope.theta, 1e6);
  EXPECT_EQ(s.rope.factor, 8.0);
  ASSERT_TRUE(s.sliding_rope.has_value());
  EXPECT_EQ(s.sliding_rope->type, RopeType::kDefault);
  EXPECT_EQ(s.sliding_rope->theta, 1e4);
  // A window beyond the context is never reached, but the sliding layers keep their own RoPE.
  c["sliding_window"] = 4096;
  ASSERT_OK_AND_ASSIGN(ModelSpec wide, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(wide.LayerSlidingWindow(0), 0);
  EXPECT_TRUE(wide.UsesSlidingRope(0));
  EXPECT_FALSE(wide.UsesSlidingRope(2));
}

TEST(Gemma3SpecTest, DefaultsFollowGemma3TextConfig) {
  json c = Gemma3TextConfig();
  for (const char* key : {"head_dim", "query_pre_attn_scalar", "sliding_window", "hidden_activation", "rope_theta",
                          "rope_local_base_freq", "rope_scaling", "eos_token_id", "bos_token_id"}) {
    c.erase(key);
  }
  c["max_position_embeddings"] = 8192;
  c["attn_logit_softcapping"] = 50.0;  // read, but transformers' Gemma-3 attention never applies it
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(s.head_dim, 256);
  EXPECT_EQ(s.query_pre_attn_scalar, 256.0);
  EXPECT_EQ(s.attn_logit_softcapping, 0.0);
  EXPECT_EQ(s.final_logit_softcapping, 0.0);
  EXPECT_EQ(s.sliding_window, 4096);
  EXPECT_TRUE(s.tie_word_embeddings);
  // 5 local : 1 global.
  EXPECT_THAT(s.sliding_layers, ElementsAre(true, true, true, true, true, false));
  EXPECT_EQ(s.rope.type, RopeType::kDefault);
  EXPECT_EQ(s.rope.theta, 1e6);
  EXPECT_EQ(s.sliding_rope->theta, 1e4);
  EXPECT_EQ(s.bos_token_id, 2);
  EXPECT_THAT(s.eos_token_ids, ElementsAre(1));
}

// gemma-3-27b-it's config.json (committed for the planner tests): a Gemma3ForConditionalGeneration
// whose text_config states only what differs from Gemma3TextConfig's defaults.
TEST(Gemma3SpecTest, MultimodalConfigDescribesItsLanguageModel) {
  ASSERT_OK_AND_ASSIGN(ModelSpec s, LoadModelSpec("tests/sim/models/gemma-3-27b-it"));
  EXPECT_EQ(s.arch, Architecture::kGemma3);
  EXPECT_TRUE(s.multimodal_text);
  EXPECT_EQ(s.vocab_size, 262208);
  EXPECT_EQ(s.hidden_size, 5376);
  EXPECT_EQ(s.num_layers, 62);
  EXPECT_EQ(s.num_heads, 32);
  EXPECT_EQ(s.num_kv_heads, 16);
  EXPECT_EQ(s.head_dim, 128);
  EXPECT_EQ(s.max_position_embeddings, 131072);
  EXPECT_DOUBLE_EQ(s.AttentionScale(), 1.0 / std::sqrt(168.0));
  EXPECT_EQ(s.dtype, DType::kBF16);
  EXPECT_EQ(s.embedding_multiplier, 73.5);  // sqrt(5376) = 73.32..., rounded to bfloat16
  EXPECT_THAT(s.eos_token_ids, ElementsAre(1, 106));
  EXPECT_EQ(s.sliding_window, 1024);
  int64_t full = 0;
  for (int64_t l = 0; l < s.num_layers; ++l) full += s.sliding_layers[static_cast<size_t>(l)] ? 0 : 1;
  EXPECT_EQ(full, 10);  // layers 5, 11, ..., 59
  EXPECT_FALSE(s.sliding_layers[5]);
  EXPECT_TRUE(s.sliding_layers[61]);
  EXPECT_EQ(s.rope.type, RopeType::kLinear);
  EXPECT_EQ(s.rope.factor, 8.0);
  EXPECT_EQ(s.rope.theta, 1e6);
  EXPECT_EQ(s.sliding_rope->theta, 1e4);
  // 27B parameters in the language model (tied embedding).
  EXPECT_GT(s.NumParameters(), 27'000'000'000);
  EXPECT_LT(s.NumParameters(), 27'500'000'000);
}

// A case of BadGemmaTest that edits Gemma3TextConfig().
BadGemma Gemma3Case(BadGemma c) {
  c.gemma3 = true;
  return c;
}

INSTANTIATE_TEST_SUITE_P(
    Gemma3Configs, BadGemmaTest,
    ::testing::Values(
        Gemma3Case({"ExactGelu", [](json& c) { c["hidden_activation"] = "gelu"; }, absl::StatusCode::kUnimplemented,
                   "\"hidden_activation\" is \"gelu\""}),
        Gemma3Case({"Bidirectional", [](json& c) { c["use_bidirectional_attention"] = true; },
                   absl::StatusCode::kUnimplemented, "use_bidirectional_attention"}),
        Gemma3Case({"ZeroPattern", [](json& c) { c["sliding_window_pattern"] = 0; }, absl::StatusCode::kInvalidArgument,
                   "\"sliding_window_pattern\" is 0"}),
        Gemma3Case({"LayerTypesLength", [](json& c) { c["layer_types"] = {"full_attention"}; },
                   absl::StatusCode::kInvalidArgument, "\"layer_types\" is not a list of 6 layer types"}),
        Gemma3Case({"Llama3GlobalRope",
                   [](json& c) { c["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}}; },
                   absl::StatusCode::kUnimplemented,
                   "(full_attention layers): Gemma-3 supports rope types default and linear"}),
        Gemma3Case({"YarnLocalRope",
                   [](json& c) {
                     c["rope_parameters"] = {{"sliding_attention", {{"rope_type", "yarn"}, {"factor", 2.0}}}};
                   },
                   absl::StatusCode::kUnimplemented, "(sliding_attention layers)"}),
        Gemma3Case({"UnkeyedRopeParameters",
                   [](json& c) { c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}}; },
                   absl::StatusCode::kInvalidArgument, "keys its RoPE parameters by layer type"}),
        Gemma3Case({"StringLocalBase", [](json& c) { c["rope_local_base_freq"] = "1e4"; },
                   absl::StatusCode::kInvalidArgument, "\"rope_local_base_freq\" is not a number"}),
        Gemma3Case({"LinearWithoutFactor", [](json& c) { c["rope_scaling"] = {{"rope_type", "linear"}}; },
                   absl::StatusCode::kInvalidArgument, "\"factor\" is missing"}),
        Gemma3Case({"MultimodalWithoutTextConfig",
                   [](json& c) {
                     c = {{"architectures", {"Gemma3ForConditionalGeneration"}}, {"vision_config", json::object()}};
                   },
                   absl::StatusCode::kInvalidArgument, "\"text_config\" is missing"}),
        Gemma3Case({"MultimodalTextFieldNamesTheTextConfig",
                   [](json& c) {
                     json text = c;
                     text.erase("architectures");
                     text["num_key_value_heads"] = 3;
                     c = {{"architectures", {"Gemma3ForConditionalGeneration"}}, {"text_config", text}};
                   },
                   absl::StatusCode::kInvalidArgument, "dir/config.json text_config: field \"num_key_value_heads\""})),
    [](const auto& test_info) { return test_info.param.name; });

}  // namespace
}  // namespace shardserve

namespace shardserve {
namespace {

// A Llama4TextConfig as released configs write it (Scout-like, shrunk).
json Llama4Config() {
  return json::parse(R"({"architectures":["Llama4ForCausalLM"],"vocab_size":256,"hidden_size":64,
    "intermediate_size":16,"intermediate_size_mlp":96,"num_hidden_layers":4,"num_attention_heads":4,
    "num_key_value_heads":2,"head_dim":16,"max_position_embeddings":128,"rms_norm_eps":1e-5,
    "hidden_act":"silu","num_local_experts":8,"num_experts_per_tok":1,"interleave_moe_layer_step":1,
    "attention_chunk_size":8,"use_qk_norm":true,"attn_temperature_tuning":4,"floor_scale":8192,
    "attn_scale":0.1,"rope_theta":500000.0,"rope_scaling":{"factor":16.0,"high_freq_factor":1.0,
    "low_freq_factor":1.0,"original_max_position_embeddings":32,"rope_type":"llama3"},
    "bos_token_id":1,"eos_token_id":[2,3]})");
}

TEST(Llama4SpecTest, GoldenConfigHasTheLlama4Semantics) {
  ASSERT_OK_AND_ASSIGN(ModelSpec s, LoadModelSpec("tests/golden/models/llama4"));
  EXPECT_EQ(s.arch, Architecture::kLlama4);
  EXPECT_EQ(s.weight_prefix, "");
  EXPECT_EQ(s.head_dim, 16);
  EXPECT_TRUE(s.rope_interleaved);
  EXPECT_TRUE(s.qk_l2_norm);
  EXPECT_FALSE(s.qk_norm);
  EXPECT_THAT(s.rope_layers, ElementsAre(true, true, false, true));
  EXPECT_THAT(s.chunked_layers, ElementsAre(true, true, false, true));
  EXPECT_EQ(s.attention_chunk_size, 8);
  EXPECT_EQ(s.LayerChunkSize(1), 8);
  EXPECT_EQ(s.LayerChunkSize(2), 0);
  EXPECT_FALSE(s.LayerTemperatureTuned(1));
  EXPECT_TRUE(s.LayerTemperatureTuned(2));
  EXPECT_EQ(s.attn_floor_scale, 4.0);
  EXPECT_EQ(s.attn_temperature_scale, 0.5);
  EXPECT_EQ(s.rope.type, RopeType::kLlama3);
  EXPECT_EQ(s.rope.low_freq_factor, s.rope.high_freq_factor);
  EXPECT_EQ(s.intermediate_size, 96);
  EXPECT_EQ(s.moe.scoring, MoeScoring::kSigmoidInput);
  EXPECT_TRUE(s.moe.fused_experts);
  EXPECT_EQ(s.moe.num_experts, 8);
  EXPECT_EQ(s.moe.top_k, 2);
  EXPECT_EQ(s.moe.expert_intermediate_size, 16);
  EXPECT_EQ(s.moe.shared_expert_intermediate_size, 16);
  EXPECT_FALSE(s.moe.shared_expert_gate);
  EXPECT_THAT(s.moe.sparse_layers, ElementsAre(false, true, false, true));
  // KV per token: every layer keeps its whole K and V (chunked layers included).
  EXPECT_EQ(s.KvValuesPerToken(), 2 * 2 * 16);
  // Embedding + lm_head, final norm; per layer q/k/v/o and two norms; dense layers 3 x 64 x 96;
  // MoE layers 8 experts (router row + 3 x 64 x 16 each) and a shared expert of 16.
  const int64_t h = 64;
  const int64_t attn = h * 64 + 2 * h * 32 + 64 * h + 2 * h;
  const int64_t dense = 3 * h * 96;
  const int64_t moe = 8 * (h + 3 * h * 16) + 3 * h * 16;
  EXPECT_EQ(s.NumParameters(), 2 * 256 * h + h + 4 * attn + 2 * dense + 2 * moe);
}

TEST(Llama4SpecTest, ConditionalGenerationReadsTheTextConfigAndPrefixesTheWeights) {
  ASSERT_OK_AND_ASSIGN(ModelSpec s, LoadModelSpec("tests/golden/models/llama4_multimodal"));
  EXPECT_EQ(s.arch, Architecture::kLlama4);
  EXPECT_EQ(s.weight_prefix, "language_model.");
  EXPECT_EQ(s.vocab_size, 256);
  EXPECT_EQ(s.num_layers, 3);
  EXPECT_FALSE(s.qk_l2_norm);
  // no_rope_layer_interval 3: layer 2 is NoPE; the RoPE layers are chunked.
  EXPECT_THAT(s.rope_layers, ElementsAre(true, true, false));
  EXPECT_THAT(s.chunked_layers, ElementsAre(true, true, false));
  EXPECT_EQ(s.attention_chunk_size, 16);
  EXPECT_THAT(s.moe.sparse_layers, ElementsAre(true, true, true));
  EXPECT_EQ(s.moe.top_k, 1);

  json outer = json::parse(R"({"architectures":["Llama4ForConditionalGeneration"],"torch_dtype":"bfloat16",
    "vision_config":{"hidden_size":16}})");
  outer["text_config"] = Llama4Config();
  outer["text_config"].erase("architectures");
  ASSERT_OK_AND_ASSIGN(ModelSpec m, ParseModelSpec(outer.dump(), "c.json"));
  EXPECT_EQ(m.weight_prefix, "language_model.");
  EXPECT_EQ(m.dtype, DType::kBF16);  // the outer dtype, the text config having none
  outer["tie_word_embeddings"] = true;
  EXPECT_THAT(ParseModelSpec(outer.dump(), "c.json"),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("\"tie_word_embeddings\" is true")));
  outer["tie_word_embeddings"] = false;
  outer["quantization_config"] = {{"quant_method", "fbgemm_fp8"}};
  EXPECT_THAT(ParseModelSpec(outer.dump(), "c.json"),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("\"quantization_config\"")));
  outer.erase("quantization_config");
  outer["text_config"]["num_hidden_layers"] = "4";
  EXPECT_THAT(ParseModelSpec(outer.dump(), "c.json"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("c.json text_config"), HasSubstr("\"num_hidden_layers\""))));
}

TEST(Llama4SpecTest, RealScoutAndMaverickConfigs) {
  // Scout: every layer MoE (16 experts, top-1), every fourth layer NoPE, the RoPE layers chunked
  // (8192) with q/k norms, llama3 RoPE (factor 8), temperature tuning written as the integer 4.
  ASSERT_OK_AND_ASSIGN(ModelSpec scout, LoadModelSpec("tests/sim/models/llama4-scout-109b"));
  EXPECT_EQ(scout.weight_prefix, "language_model.");
  EXPECT_EQ(scout.num_layers, 48);
  EXPECT_EQ(scout.moe.num_experts, 16);
  EXPECT_EQ(scout.moe.top_k, 1);
  EXPECT_THAT(scout.moe.sparse_layers, ::testing::Each(true));
  for (int64_t l = 0; l < 48; ++l) {
    EXPECT_EQ(scout.LayerUsesRope(l), (l + 1) % 4 != 0) << l;
    EXPECT_EQ(scout.LayerChunkSize(l), (l + 1) % 4 != 0 ? 8192 : 0) << l;
    EXPECT_EQ(scout.LayerTemperatureTuned(l), (l + 1) % 4 == 0) << l;
  }
  EXPECT_TRUE(scout.qk_l2_norm);
  EXPECT_EQ(scout.rope.type, RopeType::kLlama3);
  EXPECT_EQ(scout.rope.factor, 8.0);
  EXPECT_EQ(scout.attn_floor_scale, 8192.0);
  EXPECT_EQ(scout.dtype, DType::kBF16);
  // 17B active of 108B: per layer attention (q/k/v/o, two norms), router, the shared expert and
  // 16 experts of 3 x 5120 x 8192; embedding and lm_head of 202048 x 5120.
  const int64_t h = 5120, expert = 3 * h * 8192;
  const int64_t attn = 2 * h * 5120 + 2 * h * 1024 + 2 * h;
  EXPECT_EQ(scout.NumParameters(), 2 * 202048 * h + h + 48 * (attn + 16 * (h + expert) + expert));
  // Maverick: MoE on odd layers (128 experts), dense layers of 16384, no q/k norm, default RoPE;
  // no_rope_layers is absent, so every fourth layer is NoPE.
  ASSERT_OK_AND_ASSIGN(ModelSpec maverick, LoadModelSpec("tests/sim/models/llama4-maverick-400b"));
  EXPECT_EQ(maverick.moe.num_experts, 128);
  EXPECT_FALSE(maverick.IsSparseLayer(0));
  EXPECT_TRUE(maverick.IsSparseLayer(1));
  EXPECT_EQ(maverick.intermediate_size, 16384);
  EXPECT_FALSE(maverick.qk_l2_norm);
  EXPECT_EQ(maverick.rope.type, RopeType::kDefault);
  EXPECT_FALSE(maverick.LayerUsesRope(3));
  EXPECT_EQ(maverick.KvValuesPerToken(8), 2 * 128);
}

TEST(Llama4SpecTest, DefaultsFollowLlama4TextConfig) {
  json c = Llama4Config();
  for (const char* key : {"head_dim", "intermediate_size_mlp", "num_local_experts", "num_experts_per_tok",
                          "interleave_moe_layer_step", "attention_chunk_size", "use_qk_norm",
                          "attn_temperature_tuning", "floor_scale", "attn_scale"}) {
    c.erase(key);
  }
  c["max_position_embeddings"] = 1 << 20;
  c["num_hidden_layers"] = 8;
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(s.head_dim, 128);
  EXPECT_EQ(s.intermediate_size, 16384);
  EXPECT_EQ(s.moe.num_experts, 16);
  EXPECT_EQ(s.moe.top_k, 1);
  EXPECT_THAT(s.moe.sparse_layers, ::testing::Each(true));
  // Every fourth layer NoPE; the RoPE layers chunked (8192), q/k norms and temperature tuning on.
  EXPECT_THAT(s.rope_layers, ElementsAre(true, true, true, false, true, true, true, false));
  EXPECT_THAT(s.chunked_layers, ElementsAre(true, true, true, false, true, true, true, false));
  EXPECT_EQ(s.attention_chunk_size, 8192);
  EXPECT_TRUE(s.qk_l2_norm);
  EXPECT_EQ(s.attn_floor_scale, 8192.0);
  EXPECT_EQ(s.attn_temperature_scale, 0.1);
}

TEST(Llama4SpecTest, ExplicitLayersAndSwitches) {
  json c = Llama4Config();
  c["no_rope_layers"] = {0, 1, 1, 0};
  c["moe_layers"] = {1, 3};
  c["layer_types"] = {"full_attention", "chunked_attention", "full_attention", "full_attention"};
  c["attn_temperature_tuning"] = false;
  c["use_qk_norm"] = false;
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_THAT(s.rope_layers, ElementsAre(false, true, true, false));
  EXPECT_THAT(s.chunked_layers, ElementsAre(false, true, false, false));
  EXPECT_THAT(s.moe.sparse_layers, ElementsAre(false, true, false, true));
  EXPECT_EQ(s.attn_floor_scale, 0.0);
  EXPECT_FALSE(s.LayerTemperatureTuned(0));
  EXPECT_FALSE(s.qk_l2_norm);
  // A chunk no context reaches, and a model without MoE layers.
  c["attention_chunk_size"] = 128;
  c["moe_layers"] = json::array();
  ASSERT_OK_AND_ASSIGN(ModelSpec full, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(full.LayerChunkSize(1), 0);
  EXPECT_FALSE(full.IsMoe());
  EXPECT_EQ(full.intermediate_size, 96);
  // Null chunk size with no chunked layer.
  c["layer_types"] = {"full_attention", "full_attention", "full_attention", "full_attention"};
  c["attention_chunk_size"] = nullptr;
  EXPECT_TRUE(ParseModelSpec(c.dump(), "c.json").ok());
}

struct BadLlama4 {
  std::string name;
  std::function<void(json&)> edit;
  absl::StatusCode code;
  std::string message;
};

void PrintTo(const BadLlama4& c, std::ostream* os) { *os << c.name; }

class BadLlama4Test : public ::testing::TestWithParam<BadLlama4> {};

TEST_P(BadLlama4Test, IsRejectedNamingTheField) {
  json c = Llama4Config();
  GetParam().edit(c);
  EXPECT_THAT(ParseModelSpec(c.dump(), "dir/config.json"),
              StatusIs(GetParam().code, ::testing::AllOf(HasSubstr("dir/config.json"), HasSubstr(GetParam().message))));
}

INSTANTIATE_TEST_SUITE_P(
    Configs, BadLlama4Test,
    ::testing::Values(
        BadLlama4{"AttentionBias", [](json& c) { c["attention_bias"] = true; }, absl::StatusCode::kUnimplemented,
                  "\"attention_bias\" is true"},
        BadLlama4{"SlidingLayerType",
                  [](json& c) { c["layer_types"] = {"sliding_attention", "full_attention", "full_attention",
                                                    "full_attention"}; },
                  absl::StatusCode::kUnimplemented, "\"layer_types\" has \"sliding_attention\""},
        BadLlama4{"LayerTypesLength", [](json& c) { c["layer_types"] = {"full_attention"}; },
                  absl::StatusCode::kInvalidArgument, "\"layer_types\" is not a list of 4"},
        BadLlama4{"NullChunkWithChunkedLayers", [](json& c) { c["attention_chunk_size"] = nullptr; },
                  absl::StatusCode::kInvalidArgument, "\"attention_chunk_size\" is null"},
        BadLlama4{"ZeroChunk", [](json& c) { c["attention_chunk_size"] = 0; }, absl::StatusCode::kInvalidArgument,
                  "\"attention_chunk_size\" is 0"},
        BadLlama4{"NoRopeLayersLength", [](json& c) { c["no_rope_layers"] = {1, 0}; },
                  absl::StatusCode::kInvalidArgument, "\"no_rope_layers\" is not a list of 4 entries"},
        BadLlama4{"NoRopeLayersValue", [](json& c) { c["no_rope_layers"] = {1, 2, 1, 1}; },
                  absl::StatusCode::kInvalidArgument, "\"no_rope_layers\" is 2"},
        BadLlama4{"MoeLayerOutOfRange", [](json& c) { c["moe_layers"] = {4}; }, absl::StatusCode::kInvalidArgument,
                  "\"moe_layers\" is 4"},
        BadLlama4{"MoeLayersNotAList", [](json& c) { c["moe_layers"] = 1; }, absl::StatusCode::kInvalidArgument,
                  "\"moe_layers\" is not a list"},
        BadLlama4{"TopKAboveExperts", [](json& c) { c["num_experts_per_tok"] = 9; },
                  absl::StatusCode::kInvalidArgument, "\"num_experts_per_tok\" is 9"},
        BadLlama4{"TemperatureTuningString", [](json& c) { c["attn_temperature_tuning"] = "yes"; },
                  absl::StatusCode::kInvalidArgument, "\"attn_temperature_tuning\" is not true"},
        BadLlama4{"ZeroFloorScale", [](json& c) { c["floor_scale"] = 0; }, absl::StatusCode::kInvalidArgument,
                  "\"floor_scale\" is 0"},
        BadLlama4{"YarnRope", [](json& c) { c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 2.0}}; },
                  absl::StatusCode::kUnimplemented, "yarn"},
        BadLlama4{"Fp8", [](json& c) { c["quantization_config"] = {{"quant_method", "fp8"}}; },
                  absl::StatusCode::kUnimplemented, "\"quantization_config\""},
        BadLlama4{"GeluActivation", [](json& c) { c["hidden_act"] = "gelu"; }, absl::StatusCode::kUnimplemented,
                  "\"hidden_act\""}),
    [](const auto& test_info) { return test_info.param.name; });

}  // namespace
}  // namespace shardserve

namespace shardserve {
namespace {

json Phi3Config() {
  return json::parse(R"({"architectures":["Phi3ForCausalLM"],"vocab_size":256,"hidden_size":64,
    "intermediate_size":96,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
    "max_position_embeddings":128,"original_max_position_embeddings":16,"rms_norm_eps":1e-5,
    "rope_theta":10000.0,"partial_rotary_factor":0.75,
    "rope_scaling":{"type":"longrope","short_factor":[1.0,1.5,2.0,2.5,3.0,3.5],
                    "long_factor":[2.0,3.0,4.0,5.0,6.0,7.0]}})");
}

TEST(Phi3RopeSpecTest, GoldenConfigs) {
  ASSERT_OK_AND_ASSIGN(ModelSpec partial, LoadModelSpec("tests/golden/models/phi3_partial_rotary"));
  EXPECT_EQ(partial.rope.partial_rotary_factor, 0.5);
  EXPECT_EQ(partial.RotaryDim(), 8);
  EXPECT_EQ(partial.rope.type, RopeType::kDefault);
  EXPECT_TRUE(partial.tie_word_embeddings);
  ASSERT_OK_AND_ASSIGN(ModelSpec lr, LoadModelSpec("tests/golden/models/phi3_longrope"));
  EXPECT_EQ(lr.rope.type, RopeType::kLongrope);
  EXPECT_EQ(lr.RotaryDim(), 12);
  EXPECT_EQ(lr.rope.original_max_position_embeddings, 12);
  EXPECT_THAT(lr.rope.short_factor, ElementsAre(1.0f, 1.1f, 1.3f, 1.6f, 2.0f, 2.5f));
  EXPECT_THAT(lr.rope.long_factor, ElementsAre(1.0f, 1.5f, 3.0f, 6.0f, 10.0f, 16.0f));
  EXPECT_DOUBLE_EQ(lr.rope.factor, 128.0 / 12.0);
  EXPECT_DOUBLE_EQ(lr.rope.attention_factor, std::sqrt(1.0 + std::log(128.0 / 12.0) / std::log(12.0)));
}

TEST(Phi3RopeSpecTest, LegacySuTypeTopLevelFieldsAndGivenFactors) {
  // Older Phi-3 configs: "su", partial_rotary_factor and original_max_position_embeddings at the
  // top level.
  json c = Phi3Config();
  c["rope_scaling"]["type"] = "su";
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(s.rope.type, RopeType::kLongrope);
  EXPECT_EQ(s.RotaryDim(), 12);
  EXPECT_EQ(s.rope.original_max_position_embeddings, 16);
  EXPECT_DOUBLE_EQ(s.rope.attention_factor, std::sqrt(1.0 + std::log(8.0) / std::log(16.0)));
  // A stated attention factor wins; no scaling (factor 1) means none.
  c["rope_scaling"]["attention_factor"] = 1.25;
  ASSERT_OK_AND_ASSIGN(ModelSpec given, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(given.rope.attention_factor, 1.25);
  c["rope_scaling"].erase("attention_factor");
  c["rope_scaling"]["factor"] = 1.0;
  ASSERT_OK_AND_ASSIGN(ModelSpec unscaled, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(unscaled.rope.attention_factor, 1.0);
}

struct BadPhi3 {
  std::string name;
  std::function<void(json&)> edit;
  absl::StatusCode code;
  std::string message;
};

void PrintTo(const BadPhi3& c, std::ostream* os) { *os << c.name; }

class BadPhi3Test : public ::testing::TestWithParam<BadPhi3> {};

TEST_P(BadPhi3Test, IsRejectedNamingTheField) {
  json c = Phi3Config();
  GetParam().edit(c);
  EXPECT_THAT(ParseModelSpec(c.dump(), "dir/config.json"),
              StatusIs(GetParam().code, ::testing::AllOf(HasSubstr("dir/config.json"), HasSubstr(GetParam().message))));
}

INSTANTIATE_TEST_SUITE_P(
    Configs, BadPhi3Test,
    ::testing::Values(
        BadPhi3{"OddRotaryDim", [](json& c) { c["partial_rotary_factor"] = 0.5625; }, absl::StatusCode::kInvalidArgument,
                "rotates 9 of head_dim 16 elements"},
        BadPhi3{"NoRotaryDim", [](json& c) { c["partial_rotary_factor"] = 0.0; }, absl::StatusCode::kInvalidArgument,
                "rotates 0 of head_dim 16"},
        BadPhi3{"LongFactorCount", [](json& c) { c["rope_scaling"]["long_factor"] = {1.0, 2.0}; },
                absl::StatusCode::kInvalidArgument, "\"long_factor\" has 2 entries; rotary_dim / 2 = 6"},
        BadPhi3{"MissingShortFactor", [](json& c) { c["rope_scaling"].erase("short_factor"); },
                absl::StatusCode::kInvalidArgument, "\"short_factor\" is missing"},
        BadPhi3{"NegativeFactor", [](json& c) { c["rope_scaling"]["short_factor"][2] = -1.0; },
                absl::StatusCode::kInvalidArgument, "\"short_factor\" has -1.0; every factor must be a positive"},
        BadPhi3{"FactorString", [](json& c) { c["rope_scaling"]["long_factor"][0] = "2"; },
                absl::StatusCode::kInvalidArgument, "\"long_factor\" has \"2\""},
        BadPhi3{"FactorsNotAList", [](json& c) { c["rope_scaling"]["long_factor"] = 2.0; },
                absl::StatusCode::kInvalidArgument, "\"long_factor\" is not a list of numbers"},
        BadPhi3{"OriginalOne", [](json& c) { c["original_max_position_embeddings"] = 1; },
                absl::StatusCode::kInvalidArgument, "\"original_max_position_embeddings\" must be at least 2"},
        BadPhi3{"Yarn", [](json& c) { c["rope_scaling"] = {{"type", "yarn"}, {"factor", 2.0}}; },
                absl::StatusCode::kUnimplemented, "yarn"}),
    [](const auto& test_info) { return test_info.param.name; });

// A config in the shape of the released Granite-3.1 8B ones (GraniteForCausalLM; the four
// multipliers at the values those configs carry).
json Granite31Config() {
  return json::parse(R"({"architectures":["GraniteForCausalLM"],"attention_bias":false,"attention_dropout":0.0,
    "attention_multiplier":0.0078125,"bos_token_id":0,"embedding_multiplier":12.0,"eos_token_id":0,
    "hidden_act":"silu","hidden_size":4096,"initializer_range":0.02,"intermediate_size":12800,
    "logits_scaling":16.0,"max_position_embeddings":131072,"mlp_bias":false,"model_type":"granite",
    "num_attention_heads":32,"num_hidden_layers":40,"num_key_value_heads":8,"pad_token_id":0,
    "residual_multiplier":0.22,"rms_norm_eps":1e-05,"rope_scaling":null,"rope_theta":10000000.0,
    "tie_word_embeddings":true,"torch_dtype":"bfloat16","transformers_version":"4.47.0","use_cache":true,
    "vocab_size":49155})");
}

TEST(GraniteSpecTest, ReleasedConfigHasItsMultipliers) {
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(Granite31Config().dump(), "c.json"));
  EXPECT_EQ(s.arch, Architecture::kGranite);
  EXPECT_EQ(ArchitectureName(s.arch), "GraniteForCausalLM");
  EXPECT_EQ(s.embedding_multiplier, 12.0);
  EXPECT_EQ(s.attention_multiplier, 0.0078125);
  EXPECT_EQ(s.residual_multiplier, 0.22);
  EXPECT_EQ(s.logits_scaling, 16.0);
  // The softmax scale is the multiplier itself (head_dim 128 would give 1/sqrt(128)).
  EXPECT_EQ(s.head_dim, 128);
  EXPECT_EQ(s.AttentionScale(), 0.0078125);
  EXPECT_TRUE(s.tie_word_embeddings);
  EXPECT_FALSE(s.qkv_bias);
  EXPECT_EQ(s.rope.theta, 1e7);
  EXPECT_EQ(s.dtype, DType::kBF16);
  // Llama's layer otherwise: no Gemma norms, no soft-caps.
  EXPECT_FALSE(s.norm_plus_one);
  EXPECT_FALSE(s.sandwich_norms);
  EXPECT_EQ(s.final_logit_softcapping, 0.0);
}

TEST(GraniteSpecTest, MissingMultipliersAreOneAsInGraniteConfig) {
  json c = Granite31Config();
  for (const char* key : {"embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"}) {
    c.erase(key);
  }
  c["attention_bias"] = true;
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(s.embedding_multiplier, 1.0);
  EXPECT_EQ(s.AttentionScale(), 1.0);  // GraniteConfig's default, not 1/sqrt(head_dim)
  EXPECT_EQ(s.residual_multiplier, 1.0);
  EXPECT_EQ(s.logits_scaling, 1.0);
  EXPECT_TRUE(s.qkv_bias);
  EXPECT_TRUE(s.o_bias);
  // A Llama config's multipliers stay unset whatever it says: they are Granite's fields.
  json llama = LlamaConfig();
  llama["residual_multiplier"] = 0.5;
  llama["attention_multiplier"] = 0.5;
  ASSERT_OK_AND_ASSIGN(ModelSpec l, ParseModelSpec(llama.dump(), "c.json"));
  EXPECT_EQ(l.residual_multiplier, 1.0);
  EXPECT_EQ(l.AttentionScale(), 1.0 / std::sqrt(16.0));
}

TEST(GraniteSpecTest, MultipliersMustBePositiveNumbers) {
  for (const char* key : {"embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"}) {
    for (const json& bad : {json(0.0), json(-0.5), json("12"), json(2e6)}) {
      json c = Granite31Config();
      c[key] = bad;
      EXPECT_THAT(ParseModelSpec(c.dump(), "dir/config.json"),
                  StatusIs(absl::StatusCode::kInvalidArgument,
                           ::testing::AllOf(HasSubstr("dir/config.json"), HasSubstr(absl::StrCat("\"", key, "\"")))))
          << key << " = " << bad.dump();
    }
  }
}

// GraniteMoe: Granite's multipliers, Mixtral's routing, stacked experts; GraniteMoeConfig's
// defaults for the expert counts.
TEST(GraniteSpecTest, MoeConfigRoutesLikeMixtralOverStackedExperts) {
  json c = Granite31Config();
  c["architectures"] = {"GraniteMoeForCausalLM"};
  c["intermediate_size"] = 512;
  c["num_local_experts"] = 32;
  c["num_experts_per_tok"] = 8;
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(s.arch, Architecture::kGraniteMoe);
  EXPECT_EQ(ArchitectureName(s.arch), "GraniteMoeForCausalLM");
  EXPECT_EQ(s.residual_multiplier, 0.22);
  EXPECT_EQ(s.AttentionScale(), 0.0078125);
  EXPECT_EQ(s.moe.num_experts, 32);
  EXPECT_EQ(s.moe.top_k, 8);
  EXPECT_EQ(s.moe.expert_intermediate_size, 512);
  EXPECT_EQ(s.moe.scoring, MoeScoring::kSoftmax);
  EXPECT_TRUE(s.moe.norm_topk_prob);  // the softmax of the top-k logits
  EXPECT_TRUE(s.moe.stacked_experts);
  EXPECT_FALSE(s.moe.fused_experts);
  EXPECT_EQ(s.moe.shared_expert_intermediate_size, 0);
  EXPECT_THAT(s.moe.sparse_layers, ::testing::Each(true));

  c.erase("num_local_experts");
  c.erase("num_experts_per_tok");
  ASSERT_OK_AND_ASSIGN(ModelSpec d, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(d.moe.num_experts, 8);
  EXPECT_EQ(d.moe.top_k, 2);

  c["num_local_experts"] = 1;
  EXPECT_THAT(ParseModelSpec(c.dump(), "dir/config.json"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("dir/config.json"),
                                        HasSubstr("\"num_experts_per_tok\" is missing"))));
  c["num_experts_per_tok"] = 2;
  EXPECT_THAT(ParseModelSpec(c.dump(), "dir/config.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"num_experts_per_tok\" is 2")));
  c["num_local_experts"] = 4;
  c["residual_multiplier"] = -1;
  EXPECT_THAT(ParseModelSpec(c.dump(), "dir/config.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"residual_multiplier\"")));
}

// GraniteMoeShared: GraniteMoe plus an ungated shared expert of shared_intermediate_size (0, its
// config's default, is none).
TEST(GraniteSpecTest, MoeSharedConfigAddsAnUngatedSharedExpert) {
  json c = Granite31Config();
  c["architectures"] = {"GraniteMoeSharedForCausalLM"};
  c["intermediate_size"] = 512;
  c["num_local_experts"] = 32;
  c["num_experts_per_tok"] = 8;
  c["shared_intermediate_size"] = 1024;
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(s.arch, Architecture::kGraniteMoeShared);
  EXPECT_TRUE(s.IsGraniteMoe());
  EXPECT_EQ(ArchitectureName(s.arch), "GraniteMoeSharedForCausalLM");
  EXPECT_EQ(s.residual_multiplier, 0.22);
  EXPECT_EQ(s.moe.num_experts, 32);
  EXPECT_EQ(s.moe.top_k, 8);
  EXPECT_EQ(s.moe.expert_intermediate_size, 512);
  EXPECT_TRUE(s.moe.stacked_experts);
  EXPECT_EQ(s.moe.shared_expert_intermediate_size, 1024);
  EXPECT_FALSE(s.moe.shared_expert_gate);
  EXPECT_FALSE(s.mlp_bias);

  c.erase("shared_intermediate_size");
  ASSERT_OK_AND_ASSIGN(ModelSpec none, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(none.moe.shared_expert_intermediate_size, 0);
  // The Qwen2-MoE field means nothing here.
  c["shared_expert_intermediate_size"] = 64;
  ASSERT_OK_AND_ASSIGN(none, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(none.moe.shared_expert_intermediate_size, 0);

  c["shared_intermediate_size"] = -1;
  EXPECT_THAT(ParseModelSpec(c.dump(), "dir/config.json"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("dir/config.json"), HasSubstr("\"shared_intermediate_size\""))));
  c["shared_intermediate_size"] = "1024";
  EXPECT_THAT(ParseModelSpec(c.dump(), "dir/config.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"shared_intermediate_size\"")));
}

// GraniteSWA: Granite's multipliers; sinks on every layer; GraniteSWAConfig's defaults: every
// fourth layer full from layer 0, the others sliding within 128, one theta, tied.
TEST(GraniteSpecTest, SwaConfigDefaults) {
  json c = Granite31Config();
  c["architectures"] = {"GraniteSWAForCausalLM"};
  c["num_hidden_layers"] = 6;
  c.erase("tie_word_embeddings");
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(s.arch, Architecture::kGraniteSWA);
  EXPECT_EQ(ArchitectureName(s.arch), "GraniteSWAForCausalLM");
  EXPECT_TRUE(s.attention_sinks);
  EXPECT_EQ(s.residual_multiplier, 0.22);
  EXPECT_EQ(s.AttentionScale(), 0.0078125);
  EXPECT_TRUE(s.tie_word_embeddings);
  EXPECT_EQ(s.sliding_window, 128);
  EXPECT_THAT(s.sliding_layers, ::testing::ElementsAre(false, true, true, true, false, true));
  EXPECT_TRUE(s.layer_rope_theta.empty());
  EXPECT_TRUE(s.rope_layers.empty());
  EXPECT_EQ(s.LayerRopeTheta(3), 1e7);
  EXPECT_FALSE(s.IsMoe());
  // The sinks are parameters: 32 per layer.
  json plain = Granite31Config();
  plain["num_hidden_layers"] = 6;
  ASSERT_OK_AND_ASSIGN(ModelSpec g, ParseModelSpec(plain.dump(), "c.json"));
  EXPECT_EQ(s.AttentionParameters(), g.AttentionParameters() + 32);
}

TEST(GraniteSpecTest, SwaLayerTypesWindowAndThetas) {
  json c = Granite31Config();
  c["architectures"] = {"GraniteSWAForCausalLM"};
  c["num_hidden_layers"] = 4;
  c["layer_types"] = {"full_attention", "sliding_attention", "full_attention", "sliding_attention"};
  c["sliding_window"] = 512;
  c["layer_rope_theta"] = {1e4, 0, 5e5, 0.0};
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(s.sliding_window, 512);
  EXPECT_THAT(s.sliding_layers, ::testing::ElementsAre(false, true, false, true));
  EXPECT_THAT(s.rope_layers, ::testing::ElementsAre(true, false, true, false));
  EXPECT_EQ(s.LayerRopeTheta(0), 1e4);
  EXPECT_EQ(s.LayerRopeTheta(2), 5e5);
  EXPECT_TRUE(s.tie_word_embeddings);  // the config's

  // Only full layers: no window at all, whatever sliding_window says.
  c["layer_types"] = {"full_attention", "full_attention", "full_attention", "full_attention"};
  c["sliding_window"] = nullptr;
  ASSERT_OK_AND_ASSIGN(ModelSpec full, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_TRUE(full.sliding_layers.empty());
  EXPECT_EQ(full.LayerSlidingWindow(1), 0);
  // A window as long as the context is never reached.
  c.erase("layer_types");
  c["sliding_window"] = 131072;
  ASSERT_OK_AND_ASSIGN(ModelSpec wide, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_TRUE(wide.sliding_layers.empty());

  const auto refused = [&](const json& bad, absl::string_view field) {
    EXPECT_THAT(ParseModelSpec(bad.dump(), "dir/config.json"),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         ::testing::AllOf(HasSubstr("dir/config.json"), HasSubstr(absl::StrCat("\"", field, "\"")))))
        << bad.dump();
  };
  json bad = c;
  bad["sliding_window"] = nullptr;  // sliding layers by default, and no window for them
  refused(bad, "sliding_window");
  bad = c;
  bad["layer_rope_theta"] = {1e4, 0, 5e5};
  refused(bad, "layer_rope_theta");
  bad["layer_rope_theta"] = {1e4, 0, -5.0, 1e4};
  refused(bad, "layer_rope_theta");
  bad["layer_rope_theta"] = {1e4, 0, "1e4", 1e4};
  refused(bad, "layer_rope_theta");
  bad["layer_rope_theta"] = 1e4;
  refused(bad, "layer_rope_theta");
  bad = c;
  bad["layer_types"] = {"full_attention", "chunked_attention", "full_attention", "full_attention"};
  EXPECT_THAT(ParseModelSpec(bad.dump(), "c.json"),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("\"chunked_attention\"")));
}

// GraniteMoeSWA: GraniteMoeShared's MoE block under GraniteSWA's attention; untied by default.
TEST(GraniteSpecTest, MoeSwaConfig) {
  json c = Granite31Config();
  c["architectures"] = {"GraniteMoeSWAForCausalLM"};
  c["num_hidden_layers"] = 5;
  c["intermediate_size"] = 512;
  c["shared_intermediate_size"] = 1024;
  c.erase("tie_word_embeddings");
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(s.arch, Architecture::kGraniteMoeSWA);
  EXPECT_TRUE(s.IsGraniteMoe());
  EXPECT_TRUE(s.attention_sinks);
  EXPECT_FALSE(s.tie_word_embeddings);
  EXPECT_EQ(s.moe.num_experts, 8);
  EXPECT_EQ(s.moe.top_k, 2);
  EXPECT_EQ(s.moe.shared_expert_intermediate_size, 1024);
  EXPECT_TRUE(s.moe.stacked_experts);
  EXPECT_THAT(s.sliding_layers, ::testing::ElementsAre(false, true, true, true, false));
}

TEST(GraniteSpecTest, GoldenConfig) {
  ASSERT_OK_AND_ASSIGN(ModelSpec s, LoadModelSpec("tests/golden/models/granite"));
  EXPECT_EQ(s.arch, Architecture::kGranite);
  EXPECT_EQ(s.embedding_multiplier, 4.0);
  EXPECT_EQ(s.AttentionScale(), 0.1);
  EXPECT_EQ(s.residual_multiplier, 0.5);
  EXPECT_EQ(s.logits_scaling, 4.0);
  EXPECT_FALSE(s.tie_word_embeddings);
  EXPECT_TRUE(s.o_bias);
  ASSERT_OK_AND_ASSIGN(ModelSpec moe, LoadModelSpec("tests/golden/models/granite_moe"));
  EXPECT_EQ(moe.arch, Architecture::kGraniteMoe);
  EXPECT_EQ(moe.residual_multiplier, 0.5);
  EXPECT_EQ(moe.moe.num_experts, 8);
  EXPECT_EQ(moe.moe.top_k, 2);
  EXPECT_TRUE(moe.moe.stacked_experts);
  ASSERT_OK_AND_ASSIGN(ModelSpec shared, LoadModelSpec("tests/golden/models/granite_moe_shared"));
  EXPECT_EQ(shared.arch, Architecture::kGraniteMoeShared);
  EXPECT_EQ(shared.moe.shared_expert_intermediate_size, 32);
  EXPECT_EQ(shared.moe.expert_intermediate_size, 16);
  EXPECT_EQ(shared.num_layers, 3);
  ASSERT_OK_AND_ASSIGN(ModelSpec swa, LoadModelSpec("tests/golden/models/granite_swa"));
  EXPECT_EQ(swa.arch, Architecture::kGraniteSWA);
  EXPECT_TRUE(swa.attention_sinks);
  EXPECT_EQ(swa.sliding_window, 4);
  EXPECT_THAT(swa.sliding_layers, ::testing::ElementsAre(false, true, true, false));
  EXPECT_THAT(swa.rope_layers, ::testing::ElementsAre(true, false, true, false));
  EXPECT_EQ(swa.LayerRopeTheta(2), 100.0);
  ASSERT_OK_AND_ASSIGN(ModelSpec moe_swa, LoadModelSpec("tests/golden/models/granite_moe_swa"));
  EXPECT_EQ(moe_swa.arch, Architecture::kGraniteMoeSWA);
  EXPECT_THAT(moe_swa.sliding_layers, ::testing::ElementsAre(false, true, true));
  EXPECT_EQ(moe_swa.moe.shared_expert_intermediate_size, 32);
}

// A config in the shape of the released SmolLM3-3B one: every fourth layer NoPE, no sliding
// window, tied, no biases.
json SmolLM3Config() {
  json c = json::parse(R"({"architectures":["SmolLM3ForCausalLM"],"attention_bias":false,"attention_dropout":0.0,
    "bos_token_id":null,"eos_token_id":128012,"hidden_act":"silu","hidden_size":2048,"intermediate_size":11008,
    "max_position_embeddings":65536,"mlp_bias":false,"model_type":"smollm3","no_rope_layer_interval":4,
    "num_attention_heads":16,"num_hidden_layers":36,"num_key_value_heads":4,"pad_token_id":128004,
    "rms_norm_eps":1e-06,"rope_scaling":null,"rope_theta":5000000.0,"sliding_window":null,
    "tie_word_embeddings":true,"torch_dtype":"bfloat16","use_sliding_window":false,"vocab_size":128256})");
  json flags = json::array();
  for (int l = 0; l < 36; ++l) flags.push_back((l + 1) % 4 != 0 ? 1 : 0);
  c["no_rope_layers"] = flags;
  return c;
}

TEST(SmolLM3SpecTest, NoPELayersFromTheListOrTheInterval) {
  json c = SmolLM3Config();
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(s.arch, Architecture::kSmolLM3);
  EXPECT_EQ(ArchitectureName(s.arch), "SmolLM3ForCausalLM");
  EXPECT_EQ(s.rope.theta, 5e6);
  EXPECT_TRUE(s.tie_word_embeddings);
  EXPECT_FALSE(s.qkv_bias);
  EXPECT_FALSE(s.o_bias);
  EXPECT_FALSE(s.rope_interleaved);  // rotate_half, unlike Llama-4's NoPE model
  EXPECT_FALSE(s.qk_l2_norm);
  EXPECT_EQ(s.attn_floor_scale, 0.0);
  ASSERT_EQ(s.rope_layers.size(), 36u);
  for (int64_t l = 0; l < 36; ++l) {
    EXPECT_EQ(s.LayerUsesRope(l), l % 4 != 3) << l;
    EXPECT_EQ(s.LayerSlidingWindow(l), 0) << l;
  }
  EXPECT_DOUBLE_EQ(s.AttentionScale(), 1.0 / std::sqrt(128.0));

  // Without the list (or with an empty one), every no_rope_layer_interval-th layer is NoPE; a
  // missing rope_theta and tie_word_embeddings take SmolLM3Config's defaults.
  for (json missing : {json(nullptr), json::array()}) {
    c = SmolLM3Config();
    c["no_rope_layers"] = missing;
    c["no_rope_layer_interval"] = 3;
    c.erase("rope_theta");
    c.erase("tie_word_embeddings");
    ASSERT_OK_AND_ASSIGN(ModelSpec d, ParseModelSpec(c.dump(), "c.json"));
    for (int64_t l = 0; l < 36; ++l) EXPECT_EQ(d.LayerUsesRope(l), l % 3 != 2) << l;
    EXPECT_EQ(d.rope.theta, 2e6);
    EXPECT_TRUE(d.tie_word_embeddings);
  }

  c = SmolLM3Config();
  c["no_rope_layers"] = json::array({1, 0});
  EXPECT_THAT(ParseModelSpec(c.dump(), "dir/config.json"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("dir/config.json"), HasSubstr("\"no_rope_layers\""), HasSubstr("36 entries"))));
  c["no_rope_layers"][1] = 2;
  EXPECT_THAT(ParseModelSpec(c.dump(), "dir/config.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"no_rope_layers\"")));
  c = SmolLM3Config();
  c["attention_bias"] = true;
  ASSERT_OK_AND_ASSIGN(ModelSpec b, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_TRUE(b.qkv_bias);
  EXPECT_TRUE(b.o_bias);
  // YaRN, which the model card suggests for contexts past 64K: the rotary embedding is Llama's, as
  // on the qwen3_yarn fixture.
  c["rope_scaling"] = json::parse(R"({"rope_type":"yarn","factor":2.0,"original_max_position_embeddings":65536})");
  ASSERT_OK_AND_ASSIGN(ModelSpec yarn, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(yarn.rope.type, RopeType::kYarn);
  EXPECT_EQ(yarn.rope.original_max_position_embeddings, 65536);
  EXPECT_DOUBLE_EQ(yarn.rope.attention_factor, 0.1 * std::log(2.0) + 1.0);
}

// use_sliding_window: the NoPE layers slide by default (when sliding_window is set), or the
// "sliding_attention" entries of layer_types; a config whose layer_types slide without it (which
// transformers' attention paths treat differently) or without a window is refused.
TEST(SmolLM3SpecTest, SlidingLayersFollowTheConfig) {
  json c = SmolLM3Config();
  c["use_sliding_window"] = true;
  ASSERT_OK_AND_ASSIGN(ModelSpec none, ParseModelSpec(c.dump(), "c.json"));  // sliding_window null
  for (int64_t l = 0; l < 36; ++l) EXPECT_EQ(none.LayerSlidingWindow(l), 0) << l;

  c["sliding_window"] = 4096;
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(c.dump(), "c.json"));
  for (int64_t l = 0; l < 36; ++l) EXPECT_EQ(s.LayerSlidingWindow(l), l % 4 == 3 ? 4096 : 0) << l;

  json types = json::array();
  for (int l = 0; l < 36; ++l) types.push_back(l < 2 ? "sliding_attention" : "full_attention");
  c["layer_types"] = types;
  ASSERT_OK_AND_ASSIGN(ModelSpec t, ParseModelSpec(c.dump(), "c.json"));
  for (int64_t l = 0; l < 36; ++l) EXPECT_EQ(t.LayerSlidingWindow(l), l < 2 ? 4096 : 0) << l;

  c["sliding_window"] = 1 << 20;  // beyond max_position_embeddings: never reached
  ASSERT_OK_AND_ASSIGN(ModelSpec far, ParseModelSpec(c.dump(), "c.json"));
  for (int64_t l = 0; l < 36; ++l) EXPECT_EQ(far.LayerSlidingWindow(l), 0) << l;

  c["sliding_window"] = nullptr;
  EXPECT_THAT(ParseModelSpec(c.dump(), "dir/config.json"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("dir/config.json"), HasSubstr("\"sliding_window\" is missing or null"))));
  c["sliding_window"] = 4096;
  c["use_sliding_window"] = false;
  EXPECT_THAT(ParseModelSpec(c.dump(), "dir/config.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"use_sliding_window\" is false")));
  c["layer_types"][0] = "chunked_attention";
  EXPECT_THAT(ParseModelSpec(c.dump(), "dir/config.json"),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("chunked_attention")));
}

TEST(SmolLM3SpecTest, GoldenConfig) {
  ASSERT_OK_AND_ASSIGN(ModelSpec s, LoadModelSpec("tests/golden/models/smollm3"));
  EXPECT_EQ(s.arch, Architecture::kSmolLM3);
  EXPECT_TRUE(s.tie_word_embeddings);
  EXPECT_TRUE(s.o_bias);
  const std::vector<bool> rope = {true, false, true, false};
  const std::vector<int64_t> windows = {0, 8, 8, 0};
  for (int64_t l = 0; l < 4; ++l) {
    EXPECT_EQ(s.LayerUsesRope(l), rope[static_cast<size_t>(l)]) << l;
    EXPECT_EQ(s.LayerSlidingWindow(l), windows[static_cast<size_t>(l)]) << l;
  }
}

}  // namespace
}  // namespace shardserve

namespace shardserve {
namespace {

// gpt-oss-20b's released config.json (24 layers, 32 experts, MXFP4 experts).
json GptOss20bConfig() {
  json c = {{"architectures", {"GptOssForCausalLM"}},
            {"attention_bias", true},
            {"attention_dropout", 0.0},
            {"eos_token_id", 200002},
            {"experts_per_token", 4},
            {"head_dim", 64},
            {"hidden_act", "silu"},
            {"hidden_size", 2880},
            {"initial_context_length", 4096},
            {"initializer_range", 0.02},
            {"intermediate_size", 2880},
            {"max_position_embeddings", 131072},
            {"model_type", "gpt_oss"},
            {"num_attention_heads", 64},
            {"num_experts_per_tok", 4},
            {"num_hidden_layers", 24},
            {"num_key_value_heads", 8},
            {"num_local_experts", 32},
            {"output_router_logits", false},
            {"pad_token_id", 199999},
            {"quantization_config",
             {{"modules_to_not_convert",
               {"model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"}},
              {"quant_method", "mxfp4"}}},
            {"rms_norm_eps", 1e-05},
            {"rope_scaling",
             {{"beta_fast", 32.0},
              {"beta_slow", 1.0},
              {"factor", 32.0},
              {"original_max_position_embeddings", 4096},
              {"rope_type", "yarn"},
              {"truncate", false}}},
            {"rope_theta", 150000},
            {"router_aux_loss_coef", 0.9},
            {"sliding_window", 128},
            {"swiglu_limit", 7.0},
            {"tie_word_embeddings", false},
            {"use_cache", true},
            {"vocab_size", 201088}};
  json types = json::array();
  for (int l = 0; l < 24; ++l) types.push_back(l % 2 == 0 ? "sliding_attention" : "full_attention");
  c["layer_types"] = types;
  return c;
}

TEST(GptOssSpecTest, Released20bConfig) {
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(GptOss20bConfig().dump(), "c.json"));
  EXPECT_EQ(s.arch, Architecture::kGptOss);
  EXPECT_EQ(ArchitectureName(s.arch), "GptOssForCausalLM");
  EXPECT_EQ(s.head_dim, 64);
  EXPECT_EQ(s.num_kv_heads, 8);
  EXPECT_TRUE(s.qkv_bias);
  EXPECT_TRUE(s.o_bias);
  EXPECT_TRUE(s.attention_sinks);
  EXPECT_EQ(s.activation, Activation::kClampedSwiglu);
  EXPECT_EQ(s.sliding_window, 128);
  ASSERT_EQ(s.sliding_layers.size(), 24u);
  EXPECT_TRUE(s.sliding_layers[0]);
  EXPECT_FALSE(s.sliding_layers[1]);
  EXPECT_EQ(s.LayerSlidingWindow(22), 128);
  EXPECT_EQ(s.LayerSlidingWindow(23), 0);
  EXPECT_EQ(s.rope.type, RopeType::kYarn);
  EXPECT_EQ(s.rope.theta, 150000.0);
  EXPECT_EQ(s.rope.factor, 32.0);
  EXPECT_EQ(s.rope.original_max_position_embeddings, 4096);
  EXPECT_FALSE(s.rope.truncate);
  EXPECT_DOUBLE_EQ(s.rope.attention_factor, 0.1 * std::log(32.0) + 1.0);
  EXPECT_EQ(s.AttentionScale(), 0.125);  // head_dim^-1/2: YaRN scales cos and sin instead
  EXPECT_EQ(s.moe.num_experts, 32);
  EXPECT_EQ(s.moe.top_k, 4);
  EXPECT_EQ(s.moe.expert_intermediate_size, 2880);
  EXPECT_TRUE(s.moe.norm_topk_prob);
  EXPECT_TRUE(s.moe.interleaved_experts);
  EXPECT_TRUE(s.moe.router_bias);
  EXPECT_TRUE(s.moe.expert_bias);
  EXPECT_TRUE(s.IsSparseLayer(0) && s.IsSparseLayer(23));
  ASSERT_TRUE(s.mxfp4.has_value());
  EXPECT_EQ(s.mxfp4->modules_not_converted.size(), 4u);
  EXPECT_FALSE(s.fp8.has_value());
  EXPECT_THAT(s.eos_token_ids, ElementsAre(200002));
  // The model card's 21B parameters.
  EXPECT_GT(s.NumParameters(), int64_t{20'500'000'000});
  EXPECT_LT(s.NumParameters(), int64_t{21'500'000'000});
}

// GptOssConfig's defaults: 128 experts, 4 per token, head_dim 64, YaRN x32 over 4096 positions at
// theta 150000, the even layers sliding within 128, biases on.
TEST(GptOssSpecTest, DefaultsFollowGptOssConfig) {
  json c = {{"architectures", {"GptOssForCausalLM"}}, {"vocab_size", 1000}, {"hidden_size", 256},
            {"intermediate_size", 128},               {"num_hidden_layers", 3}, {"num_attention_heads", 8},
            {"num_key_value_heads", 2},               {"max_position_embeddings", 8192}};
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(s.head_dim, 64);
  EXPECT_EQ(s.moe.num_experts, 128);
  EXPECT_EQ(s.moe.top_k, 4);
  EXPECT_EQ(s.rope.type, RopeType::kYarn);
  EXPECT_EQ(s.rope.theta, 150000.0);
  EXPECT_EQ(s.rope.factor, 32.0);
  EXPECT_EQ(s.rope.original_max_position_embeddings, 4096);
  EXPECT_FALSE(s.rope.truncate);
  EXPECT_THAT(s.sliding_layers, ElementsAre(true, false, true));
  EXPECT_EQ(s.sliding_window, 128);
  EXPECT_TRUE(s.qkv_bias && s.o_bias);
  EXPECT_FALSE(s.tie_word_embeddings);
  EXPECT_FALSE(s.mxfp4.has_value());
  // Without biases and sinks, the block is Mixtral's.
  c["attention_bias"] = false;
  c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}};
  c["num_local_experts"] = 4;
  c["num_experts_per_tok"] = 2;
  ASSERT_OK_AND_ASSIGN(ModelSpec plain, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_FALSE(plain.qkv_bias || plain.o_bias);
  EXPECT_EQ(plain.rope.type, RopeType::kDefault);
  // Parameters: the sinks, the router bias and the experts' biases on top of a Mixtral layer's.
  const int64_t h = 256, experts = 4, width = 128, heads = 8;
  const int64_t embeddings = 2 * 1000 * h + h;
  const int64_t attention = h * heads * 64 * 2 + 2 * h * 2 * 64 + 2 * h + heads;
  const int64_t moe = experts * (h + 3 * h * width) + experts + experts * (2 * width + h);
  EXPECT_EQ(plain.NumParameters(), embeddings + 3 * (attention + moe));
}

TEST(GptOssSpecTest, RefusesWhatIsNotImplemented) {
  json c = GptOss20bConfig();
  c["swiglu_limit"] = 10.0;
  EXPECT_THAT(ParseModelSpec(c.dump(), "c.json"),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("swiglu_limit 10")));
  c = GptOss20bConfig();
  c["swiglu_alpha"] = 1.5;
  EXPECT_THAT(ParseModelSpec(c.dump(), "c.json"),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("swiglu_alpha 1.5")));
  c = GptOss20bConfig();
  c["sliding_window"] = nullptr;
  EXPECT_THAT(ParseModelSpec(c.dump(), "dir/config.json"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("dir/config.json"), HasSubstr("\"sliding_window\""))));
  c = GptOss20bConfig();
  c["layer_types"][3] = "chunked_attention";
  EXPECT_THAT(ParseModelSpec(c.dump(), "c.json"),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("\"chunked_attention\"")));
  // A default top_k above the experts given (GptOssConfig's 4; GraniteMoeConfig's 2).
  c = GptOss20bConfig();
  c["num_local_experts"] = 2;
  c.erase("num_experts_per_tok");
  EXPECT_THAT(ParseModelSpec(c.dump(), "c.json"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("\"num_experts_per_tok\""),
                                        HasSubstr("its default (4) exceeds num_local_experts (2)"))));
  c["architectures"] = {"GraniteMoeForCausalLM"};
  c["num_local_experts"] = 1;
  c.erase("quantization_config");
  c.erase("rope_scaling");
  EXPECT_THAT(ParseModelSpec(c.dump(), "c.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("its default (2) exceeds num_local_experts (1)")));
  c = GptOss20bConfig();
  c["quantization_config"]["modules_to_not_convert"] = "lm_head";
  EXPECT_THAT(ParseModelSpec(c.dump(), "c.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"modules_to_not_convert\"")));
  // MXFP4 is GPT-OSS's layout only; YaRN on rotate-half heads is checked for GPT-OSS (and MLA) only.
  json llama = {{"architectures", {"LlamaForCausalLM"}}, {"vocab_size", 100}, {"hidden_size", 64},
                {"intermediate_size", 128},             {"num_hidden_layers", 2}, {"num_attention_heads", 4},
                {"max_position_embeddings", 256},       {"quantization_config", {{"quant_method", "mxfp4"}}}};
  EXPECT_THAT(ParseModelSpec(llama.dump(), "c.json"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("\"quant_method\" is \"mxfp4\""), HasSubstr("GptOssForCausalLM"))));
  // YaRN on Llama's rotate-half heads parses (qwen3_yarn checks it); Gemma-2 refuses it.
  llama.erase("quantization_config");
  llama["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 64}};
  ASSERT_OK_AND_ASSIGN(ModelSpec yarn, ParseModelSpec(llama.dump(), "c.json"));
  EXPECT_EQ(yarn.rope.type, RopeType::kYarn);
  EXPECT_TRUE(yarn.rope.truncate);  // the default, unlike GPT-OSS's
  llama["architectures"] = {"Gemma2ForCausalLM"};
  EXPECT_THAT(ParseModelSpec(llama.dump(), "c.json"),
              StatusIs(absl::StatusCode::kUnimplemented,
                       ::testing::AllOf(HasSubstr("rope type \"yarn\""), HasSubstr("Gemma2ForCausalLM"))));
}

TEST(GptOssSpecTest, GoldenConfigs) {
  ASSERT_OK_AND_ASSIGN(ModelSpec s, LoadModelSpec("tests/golden/models/gpt_oss"));
  EXPECT_EQ(s.arch, Architecture::kGptOss);
  EXPECT_THAT(s.sliding_layers, ElementsAre(true, false, true, false));
  EXPECT_EQ(s.sliding_window, 4);
  EXPECT_EQ(s.rope.type, RopeType::kYarn);
  EXPECT_FALSE(s.mxfp4.has_value());
  ASSERT_OK_AND_ASSIGN(ModelSpec q, LoadModelSpec("tests/golden/models/gpt_oss_mxfp4"));
  EXPECT_TRUE(q.mxfp4.has_value());
  EXPECT_EQ(q.dtype, DType::kBF16);
  EXPECT_EQ(q.moe.num_experts, 4);
}


// GLM-4.5's shape (tests/sim/models/glm-4.5-355b: the layer counts and widths of its technical
// report in Glm4MoeConfig's fields): 3 dense layers then 89 MoE ones, 96 heads of 128 over 8 KV
// heads, RoPE on half of each head, q/k norms, 160 experts (8 per token) plus a shared one.
TEST(Glm4MoeSpecTest, Glm45Config) {
  ASSERT_OK_AND_ASSIGN(ModelSpec s, LoadModelSpec("tests/sim/models/glm-4.5-355b"));
  EXPECT_EQ(s.arch, Architecture::kGlm4Moe);
  EXPECT_EQ(ArchitectureName(s.arch), "Glm4MoeForCausalLM");
  EXPECT_EQ(s.head_dim, 128);  // stated: hidden / heads would be 53
  EXPECT_EQ(s.num_kv_heads, 8);
  EXPECT_EQ(s.RotaryDim(), 64);
  EXPECT_EQ(s.rope.type, RopeType::kDefault);
  EXPECT_EQ(s.rope.theta, 1e6);
  EXPECT_TRUE(s.qkv_bias);
  EXPECT_FALSE(s.o_bias);
  EXPECT_TRUE(s.qk_norm);
  EXPECT_EQ(s.moe.scoring, MoeScoring::kSigmoidGrouped);
  EXPECT_EQ(s.moe.num_experts, 160);
  EXPECT_EQ(s.moe.top_k, 8);
  EXPECT_EQ(s.moe.n_group, 1);
  EXPECT_EQ(s.moe.topk_group, 1);
  EXPECT_TRUE(s.moe.norm_topk_prob);
  EXPECT_EQ(s.moe.routed_scaling_factor, 2.5);
  EXPECT_EQ(s.moe.expert_intermediate_size, 1536);
  EXPECT_EQ(s.moe.shared_expert_intermediate_size, 1536);
  EXPECT_FALSE(s.moe.shared_expert_gate);
  EXPECT_FALSE(s.IsSparseLayer(2));
  EXPECT_TRUE(s.IsSparseLayer(3) && s.IsSparseLayer(91));
  EXPECT_EQ(s.dtype, DType::kBF16);
  EXPECT_THAT(s.eos_token_ids, ElementsAre(151329, 151336, 151338));
  // The model card's 355B parameters, less the multi-token-prediction layer, which is not served.
  EXPECT_GT(s.NumParameters(), int64_t{348'000'000'000});
  EXPECT_LT(s.NumParameters(), int64_t{356'000'000'000});
}

// A small GLM-4.5 config with only the fields Glm4MoeConfig has no default for.
json Glm4MoeMinimalConfig() {
  return {{"architectures", {"Glm4MoeForCausalLM"}}, {"vocab_size", 1000},       {"hidden_size", 256},
          {"intermediate_size", 512},                {"num_hidden_layers", 3},   {"num_attention_heads", 8},
          {"num_key_value_heads", 2},                {"max_position_embeddings", 4096},
          {"moe_intermediate_size", 64},             {"n_routed_experts", 16},   {"num_experts_per_tok", 4}};
}

// Glm4MoeConfig's defaults: half of each head rotates, one expert group, scaling 1, layer 0 dense,
// one shared expert, no biases, no q/k norms; head_dim hidden / heads.
TEST(Glm4MoeSpecTest, DefaultsFollowGlm4MoeConfig) {
  json c = Glm4MoeMinimalConfig();
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(s.head_dim, 32);
  EXPECT_EQ(s.rope.partial_rotary_factor, 0.5);
  EXPECT_EQ(s.RotaryDim(), 16);
  EXPECT_FALSE(s.qkv_bias || s.o_bias || s.qk_norm);
  EXPECT_EQ(s.moe.n_group, 1);
  EXPECT_EQ(s.moe.topk_group, 1);
  EXPECT_EQ(s.moe.routed_scaling_factor, 1.0);
  EXPECT_TRUE(s.moe.norm_topk_prob);
  EXPECT_THAT(s.moe.sparse_layers, ElementsAre(false, true, true));
  EXPECT_EQ(s.moe.shared_expert_intermediate_size, 64);
  EXPECT_FALSE(s.tie_word_embeddings);
  // The factor may sit in rope_parameters (transformers 5) and win over the top level.
  c["partial_rotary_factor"] = 0.25;
  c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e6}, {"partial_rotary_factor", 1.0}};
  ASSERT_OK_AND_ASSIGN(ModelSpec whole, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(whole.RotaryDim(), 32);
  c.erase("rope_parameters");
  ASSERT_OK_AND_ASSIGN(ModelSpec quarter, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(quarter.RotaryDim(), 8);
  // Without shared experts the MoE block holds the routed ones only.
  c["n_shared_experts"] = 0;
  ASSERT_OK_AND_ASSIGN(ModelSpec unshared, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(unshared.moe.shared_expert_intermediate_size, 0);
  EXPECT_LT(unshared.NumParameters(), quarter.NumParameters());
}

TEST(Glm4MoeSpecTest, RefusesWhatIsNotImplemented) {
  const auto glm = Glm4MoeMinimalConfig;
  json c = glm();
  c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 1024}};
  EXPECT_THAT(ParseModelSpec(c.dump(), "c.json"),
              StatusIs(absl::StatusCode::kUnimplemented,
                       ::testing::AllOf(HasSubstr("rope type \"yarn\""), HasSubstr("Glm4MoeForCausalLM"))));
  c = glm();
  c["n_group"] = 3;
  EXPECT_THAT(ParseModelSpec(c.dump(), "c.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"n_group\" (3) does not divide")));
  c = glm();
  c["num_experts_per_tok"] = 17;
  EXPECT_THAT(ParseModelSpec(c.dump(), "c.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"num_experts_per_tok\"")));
  c = glm();
  c.erase("moe_intermediate_size");
  EXPECT_THAT(ParseModelSpec(c.dump(), "c.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"moe_intermediate_size\"")));
  c = glm();
  c["partial_rotary_factor"] = 0.03;  // 0 of 32 elements
  EXPECT_THAT(ParseModelSpec(c.dump(), "c.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"partial_rotary_factor\"")));
  c = glm();
  c["first_k_dense_replace"] = 4;
  EXPECT_THAT(ParseModelSpec(c.dump(), "c.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"first_k_dense_replace\"")));
  // The other Llama-family models still rotate whole heads.
  c = glm();
  c["architectures"] = {"Qwen3MoeForCausalLM"};
  c["head_dim"] = 32;
  c["num_experts"] = 16;
  c["partial_rotary_factor"] = 0.5;
  EXPECT_THAT(ParseModelSpec(c.dump(), "c.json"),
              StatusIs(absl::StatusCode::kUnimplemented,
                       ::testing::AllOf(HasSubstr("\"partial_rotary_factor\" is 0.5"),
                                        HasSubstr("Glm4MoeForCausalLM"))));
}

TEST(Glm4MoeSpecTest, GoldenConfig) {
  ASSERT_OK_AND_ASSIGN(ModelSpec s, LoadModelSpec("tests/golden/models/glm4_moe"));
  EXPECT_EQ(s.arch, Architecture::kGlm4Moe);
  EXPECT_EQ(s.head_dim, 32);
  EXPECT_EQ(s.RotaryDim(), 16);
  EXPECT_TRUE(s.qkv_bias && s.qk_norm);
  EXPECT_FALSE(s.o_bias);
  EXPECT_THAT(s.moe.sparse_layers, ElementsAre(false, true, true));
  EXPECT_EQ(s.moe.routed_scaling_factor, 2.5);
  EXPECT_EQ(s.moe.shared_expert_intermediate_size, 16);
}


// GLM-4.7-Flash: DeepSeek-V3's attention with GLM-4.5's routing; its sparse layers are
// mlp_layer_types' (by default all but layer 0), whatever first_k_dense_replace says.
TEST(Glm4MoeLiteSpecTest, GoldenConfigAndDefaults) {
  ASSERT_OK_AND_ASSIGN(ModelSpec g, LoadModelSpec("tests/golden/models/glm4_moe_lite"));
  EXPECT_EQ(g.arch, Architecture::kGlm4MoeLite);
  EXPECT_EQ(ArchitectureName(g.arch), "Glm4MoeLiteForCausalLM");
  EXPECT_TRUE(g.IsMla());
  EXPECT_EQ(g.head_dim, 8);  // the RoPE width, as for DeepSeek
  EXPECT_EQ(g.mla.q_lora_rank, 32);
  EXPECT_TRUE(g.mla.rope_interleave);
  EXPECT_THAT(g.moe.sparse_layers, ElementsAre(true, false, true));
  EXPECT_EQ(g.moe.scoring, MoeScoring::kSigmoidGrouped);
  EXPECT_EQ(g.moe.routed_scaling_factor, 1.8);
  EXPECT_EQ(g.moe.shared_expert_intermediate_size, 16);
  json c = {{"architectures", {"Glm4MoeLiteForCausalLM"}},
            {"vocab_size", 1000},
            {"hidden_size", 256},
            {"intermediate_size", 512},
            {"num_hidden_layers", 4},
            {"num_attention_heads", 4},
            {"max_position_embeddings", 4096},
            {"q_lora_rank", 64},
            {"kv_lora_rank", 32},
            {"qk_nope_head_dim", 16},
            {"qk_rope_head_dim", 8},
            {"v_head_dim", 16},
            {"moe_intermediate_size", 64},
            {"n_routed_experts", 16},
            {"num_experts_per_tok", 4},
            {"first_k_dense_replace", 3}};
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_THAT(s.moe.sparse_layers, ElementsAre(false, true, true, true));
  EXPECT_EQ(s.moe.routed_scaling_factor, 1.8);
  EXPECT_EQ(s.moe.n_group, 1);
  EXPECT_TRUE(s.moe.norm_topk_prob);
  EXPECT_EQ(s.moe.shared_expert_intermediate_size, 64);
  c["mlp_layer_types"] = {"dense", "sparse", "dense"};
  EXPECT_THAT(ParseModelSpec(c.dump(), "c.json"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("\"mlp_layer_types\""), HasSubstr("list of 4 layer types"))));
  c["mlp_layer_types"] = {"dense", "sparse", "moe", "sparse"};
  EXPECT_THAT(ParseModelSpec(c.dump(), "c.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("has \"moe\" at layer 2")));
  c.erase("mlp_layer_types");
  c["attention_bias"] = true;
  EXPECT_THAT(ParseModelSpec(c.dump(), "c.json"),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("GLM-4.7-Flash attention without biases")));
  c.erase("attention_bias");
  c.erase("q_lora_rank");
  EXPECT_THAT(ParseModelSpec(c.dump(), "c.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"q_lora_rank\"")));
}


// Seed-OSS: Llama's layer; q/k/v biases by default, o's only with attention_out_bias; head_dim
// 128 unless stated.
TEST(SeedOssSpecTest, DefaultsFollowSeedOssConfig) {
  ASSERT_OK_AND_ASSIGN(ModelSpec g, LoadModelSpec("tests/golden/models/seed_oss"));
  EXPECT_EQ(g.arch, Architecture::kSeedOss);
  EXPECT_EQ(ArchitectureName(g.arch), "SeedOssForCausalLM");
  EXPECT_EQ(g.head_dim, 32);
  EXPECT_TRUE(g.qkv_bias);
  EXPECT_FALSE(g.o_bias || g.mlp_bias);
  EXPECT_EQ(g.rope.theta, 1e7);
  json c = {{"architectures", {"SeedOssForCausalLM"}}, {"vocab_size", 1000},     {"hidden_size", 256},
            {"intermediate_size", 512},                {"num_hidden_layers", 2}, {"num_attention_heads", 4},
            {"max_position_embeddings", 4096}};
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(s.head_dim, 128);  // SeedOssConfig's, not hidden / heads (64)
  EXPECT_TRUE(s.qkv_bias);
  EXPECT_FALSE(s.o_bias);
  c["attention_bias"] = false;
  c["attention_out_bias"] = true;
  c["mlp_bias"] = true;
  ASSERT_OK_AND_ASSIGN(ModelSpec o, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_FALSE(o.qkv_bias);
  EXPECT_TRUE(o.o_bias && o.mlp_bias);
  c["attention_out_bias"] = "yes";
  EXPECT_THAT(ParseModelSpec(c.dump(), "c.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"attention_out_bias\"")));
}


// GLM-4 (dense): Gemma-2's four norms under other names, gate/up fused, interleaved RoPE over half
// of each head; Glm4Config's defaults (head_dim 128, q/k/v biases, factor 0.5) for missing fields.
TEST(Glm4SpecTest, GoldenConfigAndDefaults) {
  ASSERT_OK_AND_ASSIGN(ModelSpec g, LoadModelSpec("tests/golden/models/glm4"));
  EXPECT_EQ(g.arch, Architecture::kGlm4);
  EXPECT_EQ(ArchitectureName(g.arch), "Glm4ForCausalLM");
  EXPECT_EQ(g.RotaryDim(), 16);
  EXPECT_TRUE(g.rope_interleaved && g.sandwich_norms && g.fused_gate_up && g.qkv_bias);
  EXPECT_FALSE(g.o_bias || g.norm_plus_one || g.qk_norm);
  json c = {{"architectures", {"Glm4ForCausalLM"}}, {"vocab_size", 1000},     {"hidden_size", 256},
            {"intermediate_size", 512},             {"num_hidden_layers", 2}, {"num_attention_heads", 4},
            {"num_key_value_heads", 2},             {"max_position_embeddings", 4096}};
  ASSERT_OK_AND_ASSIGN(ModelSpec s, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_EQ(s.head_dim, 128);
  EXPECT_EQ(s.RotaryDim(), 64);
  EXPECT_TRUE(s.qkv_bias);
  c["attention_bias"] = false;
  c["partial_rotary_factor"] = 1.0;
  ASSERT_OK_AND_ASSIGN(ModelSpec whole, ParseModelSpec(c.dump(), "c.json"));
  EXPECT_FALSE(whole.qkv_bias);
  EXPECT_EQ(whole.RotaryDim(), 128);
  c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 2.0}};
  EXPECT_THAT(ParseModelSpec(c.dump(), "c.json"),
              StatusIs(absl::StatusCode::kUnimplemented,
                       ::testing::AllOf(HasSubstr("rope type \"yarn\""), HasSubstr("Glm4ForCausalLM"))));
}

}  // namespace
}  // namespace shardserve

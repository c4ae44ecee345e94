// The cost model's roofline: decode steps are bound by the bytes they read, large prefills by
// FLOPs, tensor parallelism divides both and adds all-reduces.
#include <gtest/gtest.h>

#include "common/log/log.h"
#include "common/model_spec/model_spec.h"
#include "coordinator/sim/cost_model.h"
#include "coordinator/sim/device_profile.h"
#include "tests/testing/status_matchers.h"

namespace shardserve::sim {
namespace {

using ::shardserve::testing::StatusIs;

ModelSpec Llama8B() {
  absl::StatusOr<ModelSpec> spec = ParseModelSpec(R"({
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "hidden_act": "silu"})",
                                                  "8b");
  CHECK(spec.ok()) << spec.status();
  return *spec;
}

StageSpec WholeModel(const ModelSpec& spec, int tp) {
  return StageSpec{.layer_begin = 0, .layer_end = spec.num_layers, .has_embedding = true, .has_lm_head = true,
                   .tp = tp, .device_kind = DeviceKind::kCuda};
}

TEST(CostModelTest, DecodeIsBoundByTheWeightBytes) {
  const ModelSpec spec = Llama8B();
  const DeviceProfile h100 = *GpuProfile("h100");
  const StageCostModel model(spec, WholeModel(spec, 1), h100, 2, 2);
  const SequenceWork one{.pos_begin = 10, .tokens = 1, .sample = true};
  const StageTime t = model.Cost({&one, 1});
  // Every parameter but the embedding, in bf16, at 0.8 of 3.35 TB/s.
  const double bytes = static_cast<double>(spec.NumParameters() - spec.vocab_size * spec.hidden_size) * 2;
  EXPECT_NEAR(t.weights, bytes / (3350e9 * 0.8), bytes / (3350e9 * 0.8) * 0.02);
  EXPECT_EQ(t.collectives, 0);
  // 8 sequences read the weights once: nearly the same step.
  std::vector<SequenceWork> eight(8, one);
  EXPECT_LT(model.Cost(eight).weights, 1.05 * t.weights);
}

TEST(CostModelTest, LargePrefillIsBoundByFlops) {
  const ModelSpec spec = Llama8B();
  const DeviceProfile h100 = *GpuProfile("h100");
  const StageCostModel model(spec, WholeModel(spec, 1), h100, 2, 2);
  const SequenceWork prefill{.pos_begin = 0, .tokens = 4096, .sample = true};
  const double flops = 2.0 * 4096 * static_cast<double>(spec.NumParameters() - 2 * spec.vocab_size * spec.hidden_size);
  EXPECT_NEAR(model.Cost({&prefill, 1}).weights, flops / (989e12 * 0.65), flops / (989e12 * 0.65) * 0.05);
}

TEST(CostModelTest, TensorParallelDividesTheWorkAndAddsAllReduces) {
  const ModelSpec spec = Llama8B();
  const DeviceProfile h100 = *GpuProfile("h100");
  const StageCostModel one(spec, WholeModel(spec, 1), h100, 2, 2);
  const StageCostModel eight(spec, WholeModel(spec, 8), h100, 2, 2);
  const SequenceWork decode{.pos_begin = 1000, .tokens = 1, .sample = true};
  const StageTime t1 = one.Cost({&decode, 1});
  const StageTime t8 = eight.Cost({&decode, 1});
  EXPECT_NEAR(t8.weights, t1.weights / 8, t1.weights / 8 * 0.05);
  EXPECT_GT(t8.collectives, 0);
  // Two all-reduces per layer, each at least 2 x 7 link latencies.
  EXPECT_GE(t8.collectives, 32 * 2 * 14 * h100.intra_node.latency_s);
}

TEST(CostModelTest, AttentionGrowsWithTheContext) {
  const ModelSpec spec = Llama8B();
  const StageCostModel model(spec, WholeModel(spec, 1), *GpuProfile("h100"), 2, 2);
  const SequenceWork short_ctx{.pos_begin = 100, .tokens = 1, .sample = true};
  const SequenceWork long_ctx{.pos_begin = 8000, .tokens = 1, .sample = true};
  EXPECT_GT(model.Cost({&long_ctx, 1}).attention, 50 * model.Cost({&short_ctx, 1}).attention);
}

TEST(CostModelTest, AMoeStepReadsOnlyTheRoutedExperts) {
  absl::StatusOr<ModelSpec> spec = ParseModelSpec(R"({
    "architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
    "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16", "hidden_act": "silu"})",
                                                  "mixtral");
  ASSERT_TRUE(spec.ok()) << spec.status();
  const StageCostModel model(*spec, WholeModel(*spec, 1), *GpuProfile("h100"), 2, 2);
  const SequenceWork one{.pos_begin = 10, .tokens = 1, .sample = true};
  std::vector<SequenceWork> many(64, one);
  // One token touches 2 of 8 experts; 64 tokens touch nearly all of them.
  const double ratio = model.Cost(many).weights / model.Cost({&one, 1}).weights;
  EXPECT_GT(ratio, 2.5);
  EXPECT_LT(ratio, 4.5);
}

TEST(DeviceProfileTest, KnowsTheBuiltInProfiles) {
  EXPECT_DOUBLE_EQ(GpuProfile("H100")->memory_bytes_per_s, 3350e9);
  EXPECT_DOUBLE_EQ(GpuProfile("h200")->memory_bytes_per_s, 4800e9);
  EXPECT_DOUBLE_EQ(GpuProfile("a100")->flops_per_s, 312e12);
  EXPECT_DOUBLE_EQ(GpuProfile("l40s")->memory_bytes_per_s, 864e9);
  EXPECT_THAT(GpuProfile("v100"), StatusIs(absl::StatusCode::kNotFound, ::testing::HasSubstr("h100")));
  EXPECT_THAT(NetworkProfile("token-ring"), StatusIs(absl::StatusCode::kNotFound, ::testing::HasSubstr("ib")));
}

}  // namespace
}  // namespace shardserve::sim

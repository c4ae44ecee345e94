// The cost model's roofline: decode steps are bound by the bytes they read, large prefills by
// FLOPs, tensor parallelism divides both and adds all-reduces.
#include <gtest/gtest.h>

#include <limits>

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

TEST(CostModelTest, ShareOfHostSplitsWhatTheMachineGivesTogether) {
  // Two stages on a bus that reads 1.3x what one stage alone reads: 0.65 each; cores of their own.
  const HostShare two = ShareOfHost(2, {.memory = 1.3, .compute = std::numeric_limits<double>::infinity()});
  EXPECT_DOUBLE_EQ(two.memory, 0.65);
  EXPECT_DOUBLE_EQ(two.compute, 1.0);
  // The other stage busy half the time (1.5 expected at once), one core between them: 1 / 1.5.
  const HostShare half = ShareOfHost(1.5, {.memory = 1.3, .compute = 1.0});
  EXPECT_DOUBLE_EQ(half.memory, 1.3 / 1.5);
  EXPECT_DOUBLE_EQ(half.compute, 1 / 1.5);
  // Less concurrency than the parallelism: no slowdown.
  const HostShare little = ShareOfHost(1.2, {.memory = 1.3, .compute = 2.0});
  EXPECT_DOUBLE_EQ(little.memory, 1.0);
  EXPECT_DOUBLE_EQ(little.compute, 1.0);
  EXPECT_DOUBLE_EQ(ShareOfHost(1, {.memory = 1, .compute = 1}).memory, 1.0);
}

// The first 6 layers of the 100M f32 Llama on a CPU of 30 GB/s and 110 GFLOP/s, 20 us per layer
// and 300 us per step, figures worked by hand. Per layer: attention projections 4 x 768^2 =
// 2,359,296 parameters, MLP 3 x 768 x 2048 = 4,718,592, f32: 28,311,552 bytes, 943.7 us at 30 GB/s.
// A CPU op takes its reads plus its arithmetic; each part stretches by the inverse of its share.
TEST(CostModelTest, ACpuOpTakesItsReadsPlusItsArithmeticEachAtItsShare) {
  absl::StatusOr<ModelSpec> spec = ParseModelSpec(R"({
    "architectures": ["LlamaForCausalLM"], "hidden_size": 768, "intermediate_size": 2048,
    "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 12, "vocab_size": 32000,
    "max_position_embeddings": 1024, "torch_dtype": "float32", "hidden_act": "silu"})",
                                                  "100m");
  ASSERT_TRUE(spec.ok()) << spec.status();
  const StageCostModel model(*spec,
                             StageSpec{.layer_begin = 0, .layer_end = 6, .has_embedding = true, .tp = 1,
                                       .device_kind = DeviceKind::kCpu},
                             CpuProfile(30e9, 110e9, 20e-6, 300e-6), 4, 4);
  const double reads = 6 * 28311552.0 / 30e9;        // 5.662 ms
  const double flop = 6 * 2 * 7077888.0 / 110e9;     // per token: 0.772 ms
  const SequenceWork decode{.pos_begin = 0, .tokens = 1, .sample = false};
  const StageTime alone = model.Cost({&decode, 1});
  EXPECT_NEAR(alone.weights, reads + flop, 1e-9);
  EXPECT_NEAR(alone.overhead, 6 * 20e-6 + 300e-6, 1e-12);
  // Half the bus and half the cores: every part twice as long (the fixed costs are host work).
  const StageTime halved = model.Cost({&decode, 1}, {.memory = 0.5, .compute = 0.5});
  EXPECT_NEAR(halved.weights, 2 * (reads + flop), 1e-9);
  EXPECT_NEAR(halved.overhead, 2 * (6 * 20e-6 + 300e-6), 1e-12);
  // The demands stay the op's alone (the pipelining policy divides them itself).
  EXPECT_DOUBLE_EQ(halved.memory_demand, alone.memory_demand);
  // A 64-token chunk: the same reads, 64 times the arithmetic; each share stretches its own part.
  const SequenceWork chunk{.pos_begin = 0, .tokens = 64, .sample = false};
  EXPECT_NEAR(model.Cost({&chunk, 1}).weights, reads + 64 * flop, 1e-9);
  EXPECT_NEAR(model.Cost({&chunk, 1}, {.memory = 0.5, .compute = 1}).weights, 2 * reads + 64 * flop, 1e-9);
  EXPECT_NEAR(model.Cost({&chunk, 1}, {.memory = 1, .compute = 0.5}).weights, reads + 2 * 64 * flop, 1e-9);
}

// A GPU overlaps reads and arithmetic: an op takes the larger, so a compute-bound prefill does not
// notice half the bandwidth, and a read-bound decode does not notice half the compute.
TEST(CostModelTest, AGpuOpTakesTheLargerOfItsReadsAndArithmetic) {
  const ModelSpec spec = Llama8B();
  const StageCostModel model(spec, WholeModel(spec, 1), *GpuProfile("h100"), 2, 2);
  const SequenceWork prefill{.pos_begin = 0, .tokens = 4096, .sample = true};
  // (Its one sampled token's lm_head is read-bound: within 1%.)
  const double prefill_alone = model.Cost({&prefill, 1}).weights;
  EXPECT_NEAR(model.Cost({&prefill, 1}, {.memory = 0.5, .compute = 1}).weights, prefill_alone, 0.01 * prefill_alone);
  EXPECT_NEAR(model.Cost({&prefill, 1}, {.memory = 1, .compute = 0.5}).weights, 2 * prefill_alone,
              0.01 * prefill_alone);
  const SequenceWork decode{.pos_begin = 10, .tokens = 1, .sample = true};
  EXPECT_DOUBLE_EQ(model.Cost({&decode, 1}, {.memory = 1, .compute = 0.5}).weights, model.Cost({&decode, 1}).weights);
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

// The memory model's own arithmetic (common/plan/memory_model.h), against independent counts: the
// default expert placement against the engine's rule written out, the whole model on one f32 rank
// against ModelSpec::NumParameters, and tensor-parallel ranks against the one-rank model. What the
// engine really allocates is tests/worker/engine/memory_model_test.cc.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/model_spec/model_spec.h"
#include "common/plan/memory_model.h"
#include "common/plan/plan.h"
#include "tests/testing/golden.h"
#include "tests/testing/status_matchers.h"

namespace shardserve {
namespace {

TEST(DefaultLocalExpertsTest, CountsTheExpertsOfTheBalancedBlocks) {
  for (int64_t n = 1; n <= 20; ++n) {
    ModelSpec spec;
    spec.moe.num_experts = n;
    for (int tp = 1; tp <= 8; ++tp) {
      const bool ep = n >= tp && tp > 1;
      int64_t total = 0;
      for (int rank = 0; rank < tp; ++rank) {
        int64_t want = 0;
        for (int64_t e = 0; e < n; ++e) want += !ep || e * tp / n == rank ? 1 : 0;  // expert e on rank e x tp / n
        EXPECT_EQ(DefaultLocalExperts(spec, tp, rank, ep), want) << n << " experts, tp " << tp << ", rank " << rank;
        total += DefaultLocalExperts(spec, tp, rank, ep);
      }
      EXPECT_EQ(total, ep ? n : n * tp);
    }
  }
}

TEST(RankMemoryTest, OneF32RankHoldsEveryParameterAtFourBytes) {
  for (const char* name : {"llama", "mistral", "qwen2", "mixtral", "qwen2_moe", "qwen3", "qwen3_moe", "phi3",
                                   "gemma2", "llama4", "deepseek_v3", "deepseek_v2_lite"}) {
    ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(absl::StrCat("tests/golden/models/", name)));
    const RankShard all{.layer_begin = 0, .layer_end = spec.num_layers, .has_embedding = true, .has_lm_head = true};
    const RankMemory m = RankMemoryOf(spec, all, WeightFormats{});
    EXPECT_EQ(m.Weights(), spec.NumParameters() * 4) << name;
    EXPECT_EQ(m.kv_bytes_per_token, spec.num_layers * spec.KvValuesPerToken(1) * 4) << name;
  }
}

// Split over two ranks, the replicated tensors (norms, routers, the embedding) count twice, the
// rank-0 biases once, and everything else is cut in two: rank 0 + rank 1 = one rank + replicated.
TEST(RankMemoryTest, TwoRanksHoldOneRankPlusTheReplicatedTensors) {
  for (const char* name : {"llama", "qwen2", "mixtral", "qwen2_moe", "qwen3_moe"}) {
    ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(absl::StrCat("tests/golden/models/", name)));
    ASSERT_TRUE(ValidateTensorParallelSize(spec, 2).ok()) << name;
    ASSERT_EQ(spec.vocab_size % 2, 0) << name;
    ASSERT_EQ(spec.num_kv_heads % 2, 0) << name;
    for (bool split : {false, true}) {
      if (split && spec.IsMoe() && spec.moe.expert_intermediate_size % 2 != 0) continue;
      const bool ep = IsExpertParallel(spec, 2, split);
      RankShard shard{.layer_begin = 0, .layer_end = spec.num_layers, .has_embedding = true, .has_lm_head = true,
                      .tp = 2, .expert_parallel = ep};
      const RankMemory r0 = RankMemoryOf(spec, shard, WeightFormats{});
      shard.rank = 1;
      const RankMemory r1 = RankMemoryOf(spec, shard, WeightFormats{});
      const RankShard one{.layer_begin = 0, .layer_end = spec.num_layers, .has_embedding = true, .has_lm_head = true};
      const RankMemory whole = RankMemoryOf(spec, one, WeightFormats{});
      EXPECT_EQ(r0.matrices + r1.matrices, whole.matrices) << name;
      EXPECT_EQ(r0.experts + r1.experts, whole.experts) << name << (split ? " split" : "");
      EXPECT_EQ(r0.lm_head + r1.lm_head, whole.lm_head) << name;
      EXPECT_EQ(r0.embedding, whole.embedding) << name;
      EXPECT_EQ(r1.embedding, whole.embedding) << name;
      EXPECT_EQ(r0.kv_bytes_per_token + r1.kv_bytes_per_token, whole.kv_bytes_per_token) << name;
      // Norms and routers on both ranks; q/k/v biases split; the o_proj and down_proj biases on rank 0.
      int64_t rank0_only = 0;
      if (spec.o_bias) rank0_only += spec.num_layers * spec.hidden_size * 4;
      const int64_t split_biases = spec.qkv_bias ? spec.num_layers * (spec.num_heads + 2 * spec.num_kv_heads) *
                                                       spec.head_dim * 4
                                                 : 0;
      EXPECT_EQ(r0.norms_biases - r1.norms_biases, rank0_only) << name;
      EXPECT_EQ(r0.norms_biases + r1.norms_biases, 2 * whole.norms_biases - split_biases - rank0_only) << name;
    }
  }
}

}  // namespace
}  // namespace shardserve

namespace shardserve {
namespace {

// MXFP4 experts kept as stored: gpt-oss-20b's expert shape (hidden 2880, width 2880 = 90 scale
// blocks) at 17/32 of a byte per weight, whole (tp 1, expert parallel) or split in two (1440
// columns, 45 whole blocks); split in four, a rank's 720 down columns are no whole blocks, so its
// down projection is dequantized (bf16) while gate and up stay MXFP4. Without mxfp4_experts, every
// matrix at matrix_bytes.
TEST(RankMemoryTest, Mxfp4ExpertsAtSeventeenThirtySecondsOfAByte) {
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec("tests/golden/models/gpt_oss_mxfp4"));
  ASSERT_TRUE(spec.mxfp4.has_value());
  spec.hidden_size = 2880;
  spec.moe.expert_intermediate_size = 2880;
  const int64_t h = 2880;
  const int64_t biases_whole = (2 * 2880 + h) * 4;
  const WeightFormats cpu = WorkerWeightFormats(spec, /*cuda=*/false, Quantization::kNone);
  const WeightFormats gpu = WorkerWeightFormats(spec, /*cuda=*/true, Quantization::kNone);
  const WeightFormats int8 = WorkerWeightFormats(spec, /*cuda=*/false, Quantization::kInt8);
  EXPECT_TRUE(cpu.mxfp4_experts);
  EXPECT_TRUE(gpu.mxfp4_experts);
  EXPECT_TRUE(int8.mxfp4_experts);  // int8 leaves 4-bit experts as they are
  const int64_t whole = 3 * (h * 2880 / 2 + h * 2880 / 32);
  EXPECT_EQ(whole, 3 * h * 2880 * 17 / 32);
  for (const WeightFormats& f : {cpu, gpu, int8}) {
    EXPECT_EQ(LayerBytes(spec, 0, 1, 0, false, f).expert, whole + biases_whole);
    EXPECT_EQ(LayerBytes(spec, 0, 2, 1, true, f).expert, whole + biases_whole);  // expert parallel: whole
    EXPECT_EQ(WholeExpertBytes(spec, f), whole + biases_whole);
    // Split in two: rank 1's columns [1440, 2880); its gate and up biases, no down bias.
    EXPECT_EQ(LayerBytes(spec, 0, 2, 1, false, f).expert, whole / 2 + 2 * 1440 * 4);
  }
  // Split in four: gate and up [720, 2880] MXFP4, down [2880, 720] as any projection.
  const int64_t gate_up = 2 * (720 * h / 2 + 720 * h / 32);
  EXPECT_EQ(LayerBytes(spec, 0, 4, 2, false, cpu).expert, gate_up + h * 720 * 2 + 2 * 720 * 4);
  EXPECT_EQ(LayerBytes(spec, 0, 4, 2, false, int8).expert, gate_up + Q8MatrixBytes(h, 720) + 2 * 720 * 4);
  // The whole of gpt-oss-20b's experts: 24 layers x 32, about 10.2 GB (38.2 GB as bf16).
  EXPECT_NEAR(24.0 * 32 * whole / 1e9, 10.15, 0.01);
  WeightFormats dequantized = cpu;
  dequantized.mxfp4_experts = false;
  EXPECT_EQ(WholeExpertBytes(spec, dequantized), 3 * h * 2880 * 2 + biases_whole);
}

}  // namespace
}  // namespace shardserve

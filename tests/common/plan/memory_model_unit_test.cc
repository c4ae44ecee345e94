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

// The random-model generator (tests/testing/random_model.h) writes checkpoints that the spec parser
// and the engine accept: dense Llama and the Mixtral-style MoE that shardserve-bench-gpu uses.
#include "tests/testing/random_model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "common/model_spec/model_spec.h"
#include "common/safetensors/safetensors.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "worker/engine/executor.h"

namespace shardserve {
namespace {

testing::RandomLlamaShape TinyShape(int64_t experts) {
  testing::RandomLlamaShape s;
  s.vocab = 64;
  s.hidden = 32;
  s.intermediate = 16;
  s.layers = 2;
  s.heads = 4;
  s.kv_heads = 2;
  s.max_positions = 64;
  s.bf16 = true;
  s.experts = experts;
  s.experts_per_tok = 2;
  return s;
}

// One greedy step of a 3-token prompt on one CPU rank; the logits must be finite.
void ExpectRuns(const std::string& dir) {
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(dir));
  ASSERT_OK_AND_ASSIGN(auto ckpt, Checkpoint::Open(dir));
  ASSERT_OK_AND_ASSIGN(auto ex, engine::TpExecutor::Create(spec, *ckpt, engine::ExecutorOptions{}));
  ASSERT_OK_AND_ASSIGN(auto r, ex->Step({engine::StepSequence{.block_ids = engine::WholeContextBlocks(ex->options(), 0),
                                                              .tokens = {1, 5, 7}}}));
  ASSERT_EQ(r.logits.size(), 1u);
  ASSERT_EQ(r.logits[0].size(), 64u);
  for (float v : r.logits[0]) ASSERT_TRUE(std::isfinite(v));
}

TEST(RandomModelTest, MixtralShapeLoadsAsMoeAndRuns) {
  testing::TempDir tmp;
  ASSERT_TRUE(testing::WriteRandomLlama(tmp.path(), TinyShape(4), 7).ok());
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(tmp.path()));
  EXPECT_EQ(spec.arch, Architecture::kMixtral);
  EXPECT_EQ(spec.moe.num_experts, 4);
  EXPECT_EQ(spec.moe.top_k, 2);
  EXPECT_EQ(spec.moe.expert_intermediate_size, 16);
  ExpectRuns(tmp.path());
}

TEST(RandomModelTest, DenseShapeLoadsAsLlamaAndRuns) {
  testing::TempDir tmp;
  ASSERT_TRUE(testing::WriteRandomLlama(tmp.path(), TinyShape(0), 7).ok());
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(tmp.path()));
  EXPECT_EQ(spec.arch, Architecture::kLlama);
  EXPECT_FALSE(spec.IsMoe());
  ExpectRuns(tmp.path());
}

TEST(RandomModelTest, TooManyExpertsPerTokenIsInvalidArgument) {
  testing::TempDir tmp;
  testing::RandomLlamaShape s = TinyShape(4);
  s.experts_per_tok = 5;
  EXPECT_EQ(testing::WriteRandomLlama(tmp.path(), s, 7).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shardserve

// Tensor and expert parallelism on CPU ranks: every layout gives the Hugging Face logits within
// the golden tolerance (the FP8 models: their NumPy reference within kFp8GoldenLogitsRtol, see
// tests/testing/golden.h) and the same greedy tokens as one rank; each rank holds only its slice.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/model_spec/model_spec.h"
#include "common/safetensors/safetensors.h"
#include "tests/testing/golden.h"
#include "tests/testing/status_matchers.h"
#include "worker/engine/executor.h"
#include "worker/engine/generator.h"
#include "worker/engine/local_pipeline.h"

namespace shardserve::engine {
namespace {

using ::shardserve::testing::GoldenModel;
using ::shardserve::testing::StatusIs;
using ::testing::HasSubstr;

struct Layout {
  std::string model;
  int ranks;
  std::vector<int32_t> expert_owner;  // empty = default placement
  bool split_experts = false;
  std::string name;
};

void PrintTo(const Layout& l, std::ostream* os) { *os << l.name; }

std::vector<Layout> Layouts() {
  std::vector<Layout> out;
  for (const auto& m : testing::GoldenModelNames()) {
    for (int n : {2, 4}) out.push_back({m, n, {}, false, absl::StrCat(m, "_tp", n)});
  }
  out.push_back({"mixtral", 2, {}, true, "mixtral_tp2_split_experts"});
  out.push_back({"mixtral", 4, {}, true, "mixtral_tp4_split_experts"});
  out.push_back({"mixtral", 2, {1, 1, 1, 0}, false, "mixtral_tp2_experts_1110"});
  out.push_back({"mixtral", 4, {3, 2, 1, 0}, false, "mixtral_tp4_experts_reversed"});
  out.push_back({"qwen2_moe", 2, {0, 0, 0, 0, 0, 0, 0, 1}, false, "qwen2_moe_tp2_experts_7_1"});
  out.push_back({"qwen3_moe", 2, {1, 0, 1, 0, 1, 0, 1, 0}, false, "qwen3_moe_tp2_experts_interleaved"});
  out.push_back({"qwen3_moe", 2, {}, true, "qwen3_moe_tp2_split_experts"});
  // DeepSeek-V3: heads split, the latent cache whole on every rank; experts spread or split.
  out.push_back({"deepseek_v3", 2, {1, 1, 0, 1, 0, 0, 1, 0}, false, "deepseek_v3_tp2_experts_mixed"});
  out.push_back({"deepseek_v3", 2, {}, true, "deepseek_v3_tp2_split_experts"});
  // DeepSeek-V2: softmax routing, greedy (Lite) or within the best groups; experts spread or split.
  out.push_back({"deepseek_v2_lite", 4, {3, 1, 0, 2, 2, 0, 1, 3}, false, "deepseek_v2_lite_tp4_experts_spread"});
  out.push_back({"deepseek_v2_lite", 2, {}, true, "deepseek_v2_lite_tp2_split_experts"});
  out.push_back({"deepseek_v2", 2, {0, 0, 1, 1, 0, 1, 1, 0}, false, "deepseek_v2_tp2_experts_mixed"});
  out.push_back({"deepseek_v2", 4, {}, true, "deepseek_v2_tp4_split_experts"});
  // Llama-4: experts weighted on their input, spread unevenly or split; the shared expert split.
  out.push_back({"llama4", 2, {0, 1, 1, 1, 0, 1, 1, 0}, false, "llama4_tp2_experts_mixed"});
  out.push_back({"llama4", 2, {}, true, "llama4_tp2_split_experts"});
  out.push_back({"llama4_multimodal", 4, {}, true, "llama4_multimodal_tp4_split_experts"});
  return out;
}

absl::StatusOr<std::unique_ptr<TpExecutor>> MakeExecutor(const std::string& dir, int ranks, ModelOptions mo,
                                                         std::unique_ptr<Checkpoint>* ckpt_out = nullptr) {
  auto spec = LoadModelSpec(dir);
  if (!spec.ok()) return spec.status();
  auto ckpt = Checkpoint::Open(dir);
  if (!ckpt.ok()) return ckpt.status();
  ExecutorOptions eo;
  eo.cpu_ranks = ranks;
  eo.model = std::move(mo);
  auto ex = TpExecutor::Create(*spec, **ckpt, eo);
  if (ckpt_out != nullptr) *ckpt_out = *std::move(ckpt);
  return ex;
}

class TensorParallelTest : public ::testing::TestWithParam<Layout> {};

TEST_P(TensorParallelTest, LogitsMatchTransformersAndGreedyTokensMatchOneRank) {
  const Layout& layout = GetParam();
  ASSERT_OK_AND_ASSIGN(GoldenModel golden, testing::LoadGoldenModel(layout.model));
  ModelOptions mo{.max_step_tokens = 4, .expert_owner = layout.expert_owner,
                  .split_experts = layout.split_experts};
  ASSERT_OK_AND_ASSIGN(auto ex, MakeExecutor(golden.dir, layout.ranks, mo));
  ASSERT_EQ(ex->ranks(), layout.ranks);
  // Logits at every prompt position (prefill in one step per case).
  ModelOptions wide = mo;
  wide.max_step_tokens = 64;
  ASSERT_OK_AND_ASSIGN(auto ex_wide, MakeExecutor(golden.dir, layout.ranks, wide));
  const size_t v = static_cast<size_t>(ex_wide->spec().vocab_size);
  int32_t seq = 0;
  for (const auto& c : golden.cases) {
    ASSERT_OK_AND_ASSIGN(StepResult r, ex_wide->Step({StepSequence{.block_ids = WholeContextBlocks(ex_wide->options(), seq++),
                                                                   .tokens = c.prompt_ids,
                                                                   .all_logits = true}}));
    ASSERT_EQ(r.logits[0].size(), c.prompt_ids.size() * v);
    for (size_t p = 0; p < c.prompt_ids.size(); ++p) {
      testing::ExpectLogitsClose(c.logits[p], r.logits[0].data() + p * v, absl::StrCat(layout.name, " position ", p),
                                 golden.logits_rtol);
    }
  }
  // Greedy generation of all cases batched together, with chunked prefill.
  std::vector<GenerationRequest> reqs;
  for (const auto& c : golden.cases) {
    reqs.push_back({.prompt = c.prompt_ids, .max_tokens = static_cast<int32_t>(c.greedy_ids.size())});
  }
  ASSERT_OK_AND_ASSIGN(auto res, Generate(*ex, reqs));
  for (size_t i = 0; i < res.size(); ++i) EXPECT_EQ(res[i].tokens, golden.cases[i].greedy_ids) << layout.name;
}

INSTANTIATE_TEST_SUITE_P(Layouts, TensorParallelTest, ::testing::ValuesIn(Layouts()),
                         [](const auto& test_info) { return test_info.param.name; });

TEST(TensorParallelStoriesTest, GreedyTextIdenticalAcrossRankCounts) {
  ASSERT_OK_AND_ASSIGN(GoldenModel golden, testing::LoadStories260K());
  std::vector<GenerationRequest> reqs;
  for (const auto& c : golden.cases) {
    reqs.push_back({.prompt = c.prompt_ids, .max_tokens = static_cast<int32_t>(c.greedy_ids.size())});
  }
  for (int n : {1, 2, 4}) {
    ASSERT_OK_AND_ASSIGN(auto ex, MakeExecutor(golden.dir, n, {}));
    ASSERT_OK_AND_ASSIGN(auto res, Generate(*ex, reqs));
    for (size_t i = 0; i < res.size(); ++i) EXPECT_EQ(res[i].tokens, golden.cases[i].greedy_ids) << "ranks " << n;
  }
}

struct PipelineLayout {
  std::string model;
  std::vector<int64_t> cuts;  // layer boundaries, e.g. {0, 1, 2}
  int ranks;
  std::string name;
};

void PrintTo(const PipelineLayout& l, std::ostream* os) { *os << l.name; }

class PipelineTest : public ::testing::TestWithParam<PipelineLayout> {};

TEST_P(PipelineTest, StagesChainedGiveTheSameGreedyTokensAndLogits) {
  const PipelineLayout& layout = GetParam();
  ASSERT_OK_AND_ASSIGN(GoldenModel golden, testing::LoadGoldenModel(layout.model));
  std::vector<std::unique_ptr<StepRunner>> stages;
  for (size_t i = 0; i + 1 < layout.cuts.size(); ++i) {
    ModelOptions mo{.max_step_tokens = 16, .layer_begin = layout.cuts[i], .layer_end = layout.cuts[i + 1]};
    ASSERT_OK_AND_ASSIGN(auto ex, MakeExecutor(golden.dir, layout.ranks, mo));
    stages.push_back(std::move(ex));
  }
  ASSERT_OK_AND_ASSIGN(auto pipeline, LocalPipeline::Create(std::move(stages)));
  const auto& c = golden.cases[2];
  ASSERT_OK_AND_ASSIGN(StepResult r, pipeline->Step(
      {StepSequence{.block_ids = WholeContextBlocks(pipeline->options(), 2), .tokens = c.prompt_ids, .all_logits = true}}));
  const size_t v = static_cast<size_t>(pipeline->spec().vocab_size);
  for (size_t p = 0; p < c.prompt_ids.size(); ++p) {
    testing::ExpectLogitsClose(c.logits[p], r.logits[0].data() + p * v, absl::StrCat(layout.name, " position ", p),
                               golden.logits_rtol);
  }
  std::vector<GenerationRequest> reqs;
  for (const auto& gc : golden.cases) {
    reqs.push_back({.prompt = gc.prompt_ids, .max_tokens = static_cast<int32_t>(gc.greedy_ids.size())});
  }
  ASSERT_OK_AND_ASSIGN(auto res, Generate(*pipeline, reqs));
  for (size_t i = 0; i < res.size(); ++i) EXPECT_EQ(res[i].tokens, golden.cases[i].greedy_ids) << layout.name;
}

INSTANTIATE_TEST_SUITE_P(Layouts, PipelineTest,
                         ::testing::Values(PipelineLayout{"llama", {0, 1, 2}, 1, "llama_pp2"},
                                           PipelineLayout{"llama_tied_llama3rope_bias", {0, 1, 2}, 2, "tied_pp2_tp2"},
                                           PipelineLayout{"qwen2_moe", {0, 1, 2, 3}, 1, "qwen2_moe_pp3"},
                                           PipelineLayout{"mixtral", {0, 1, 2}, 2, "mixtral_pp2_tp2"},
                                           PipelineLayout{"qwen3_moe", {0, 2, 3}, 2, "qwen3_moe_pp2_tp2"},
                                           PipelineLayout{"phi3", {0, 1, 2}, 2, "phi3_pp2_tp2"},
                                           PipelineLayout{"deepseek_v3", {0, 2, 3}, 2, "deepseek_v3_pp2_tp2"},
                                           PipelineLayout{"deepseek_v3_noqlora", {0, 1, 2, 3}, 2,
                                                          "deepseek_v3_noqlora_pp3_tp2"},
                                           // DeepSeek-V2: the dense layer and a MoE one, then a MoE one.
                                           PipelineLayout{"deepseek_v2", {0, 2, 3}, 2, "deepseek_v2_pp2_tp2"},
                                           PipelineLayout{"deepseek_v2_lite", {0, 1, 3}, 2, "deepseek_v2_lite_pp2_tp2"},
                                           // Gemma-2: a sliding-window stage, then a full + sliding one.
                                           PipelineLayout{"gemma2", {0, 1, 3}, 2, "gemma2_pp2_tp2"},
                                           // Llama-4: chunked RoPE layers (dense, MoE), then the NoPE
                                           // layer with its temperature and a MoE layer.
                                           PipelineLayout{"llama4", {0, 2, 4}, 2, "llama4_pp2_tp2"},
                                           PipelineLayout{"llama4_multimodal", {0, 1, 2, 3}, 2,
                                                          "llama4_multimodal_pp3_tp2"},
                                           // LongRoPE: each stage picks short or long frequencies alike.
                                           PipelineLayout{"phi3_longrope", {0, 1, 2}, 2, "phi3_longrope_pp2_tp2"},
                                           // Gemma-3: a sliding stage (local RoPE), then the full
                                           // layer (scaled global RoPE) and a sliding one.
                                           PipelineLayout{"gemma3", {0, 1, 3}, 2, "gemma3_pp2_tp2"},
                                           // Granite: the multipliers folded into each stage's
                                           // weights (the o bias on rank 0 only), the logits'
                                           // into the last stage's norm.
                                           PipelineLayout{"granite", {0, 1, 2}, 2, "granite_pp2_tp2"},
                                           PipelineLayout{"granite_moe", {0, 1, 2}, 2, "granite_moe_pp2_tp2"},
                                           // SmolLM3: a RoPE and a NoPE sliding layer, then a RoPE
                                           // sliding and a NoPE full one.
                                           PipelineLayout{"smollm3", {0, 2, 4}, 2, "smollm3_pp2_tp2"},
                                           // GraniteMoeShared: each stage's shared experts scaled
                                           // with its routed ones.
                                           PipelineLayout{"granite_moe_shared", {0, 2, 3}, 2,
                                                          "granite_moe_shared_pp2_tp2"},
                                           // GraniteSWA: each rank's heads with their sinks; a
                                           // full RoPE and a sliding NoPE layer, then a sliding
                                           // layer with its own theta and a full NoPE one.
                                           PipelineLayout{"granite_swa", {0, 2, 4}, 2, "granite_swa_pp2_tp2"},
                                           PipelineLayout{"granite_moe_swa", {0, 1, 3}, 2,
                                                          "granite_moe_swa_pp2_tp2"},
                                           // GPT-OSS: each rank's heads with their sinks and q/k/v
                                           // biases (o's on rank 0), each expert split over the
                                           // ranks with its down bias on rank 0; a sliding and a full
                                           // layer per stage.
                                           PipelineLayout{"gpt_oss", {0, 2, 4}, 2, "gpt_oss_pp2_tp2"},
                                           PipelineLayout{"gpt_oss_mxfp4", {0, 1, 3}, 2,
                                                          "gpt_oss_mxfp4_pp2_tp2"},
                                           // GLM-4.5: the dense layer and a MoE one (each rank's
                                           // heads with their q/k norms and half-rotated RoPE),
                                           // then a MoE one.
                                           PipelineLayout{"glm4_moe", {0, 2, 3}, 2, "glm4_moe_pp2_tp2"},
                                           // GLM-4.7-Flash: a MoE layer (MLA), then the dense
                                           // layer and a MoE one.
                                           PipelineLayout{"glm4_moe_lite", {0, 1, 3}, 2, "glm4_moe_lite_pp2_tp2"},
                                           // Seed-OSS: each rank's q/k/v biases, no o bias.
                                           PipelineLayout{"seed_oss", {0, 1, 2}, 2, "seed_oss_pp2_tp2"},
                                           // GLM-4: each rank's heads with their rotated rows and
                                           // biases reordered, four norms per layer.
                                           PipelineLayout{"glm4", {0, 1, 2}, 2, "glm4_pp2_tp2"}),
                         [](const auto& test_info) { return test_info.param.name; });

TEST(PipelineErrorsTest, StagesMustCoverTheLayersInOrder) {
  std::vector<std::unique_ptr<StepRunner>> stages;
  ASSERT_OK_AND_ASSIGN(auto a, MakeExecutor("tests/golden/models/llama", 1, {.layer_begin = 1, .layer_end = 2}));
  stages.push_back(std::move(a));
  EXPECT_THAT(LocalPipeline::Create(std::move(stages)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("stage 0 starts at layer 1, expected 0")));
  EXPECT_THAT(MakeExecutor("tests/golden/models/llama", 1, {.layer_begin = 1, .layer_end = 5}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer range [1, 5)")));
  ASSERT_OK_AND_ASSIGN(auto second, MakeExecutor("tests/golden/models/llama", 1, {.layer_begin = 1}));
  EXPECT_THAT(second->Step({StepSequence{.block_ids = {0}, .num_tokens = 2}}, std::vector<float>(64)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("hidden states hold 64 values; 2 tokens")));
  ASSERT_OK_AND_ASSIGN(auto first, MakeExecutor("tests/golden/models/llama", 1, {.layer_end = 1}));
  EXPECT_THAT(first->Step({StepSequence{.block_ids = {0}, .num_tokens = 2}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("needs the token ids")));
}

TEST(TensorParallelMemoryTest, EachRankHoldsItsSliceAndTheReplicatedParts) {
  const std::string dir = "tests/golden/models/llama";
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(dir));
  const int64_t h = spec.hidden_size, v = spec.vocab_size, f = 4;
  const int64_t replicated = (v * h + h + spec.num_layers * 2 * h) * f;  // embedding + norms
  const int64_t sharded = (spec.NumParameters() - v * h - h - spec.num_layers * 2 * h) * f;  // incl. lm_head
  ASSERT_OK_AND_ASSIGN(auto one, MakeExecutor(dir, 1, {}));
  EXPECT_EQ(static_cast<int64_t>(one->WeightBytesPerRank()[0]), replicated + sharded);
  for (int n : {2, 4}) {
    ASSERT_OK_AND_ASSIGN(auto ex, MakeExecutor(dir, n, {}));
    const auto bytes = ex->WeightBytesPerRank();
    ASSERT_EQ(bytes.size(), static_cast<size_t>(n));
    // kv heads (2) are replicated at n = 4: each rank then holds one kv head (1/2 of k and v).
    const int64_t kv_bytes = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * h * f;
    const int64_t kv_extra = n > spec.num_kv_heads ? kv_bytes / spec.num_kv_heads - kv_bytes / n : 0;
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(static_cast<int64_t>(bytes[static_cast<size_t>(r)]), replicated + sharded / n + kv_extra)
          << "rank " << r << " of " << n;
    }
  }
}

TEST(TensorParallelMemoryTest, Bf16MatricesStayBf16OnTheCpuBackend) {
  // The same shapes as the f32 llama model; the bf16 checkpoint's matrices (attention, MLP,
  // lm_head) and its embedding table are held as bf16, the norms as f32.
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec("tests/golden/models/llama_bf16_sharded"));
  const int64_t h = spec.hidden_size, v = spec.vocab_size;
  const int64_t norm_params = h + spec.num_layers * 2 * h;
  const int64_t embedding_params = v * h;
  const int64_t matrix_params = spec.NumParameters() - norm_params - embedding_params;
  for (int n : {1, 2}) {
    ASSERT_OK_AND_ASSIGN(auto ex, MakeExecutor("tests/golden/models/llama_bf16_sharded", n, {}));
    ASSERT_OK_AND_ASSIGN(auto f32, MakeExecutor("tests/golden/models/llama", n, {}));
    size_t total = 0, total_f32 = 0;
    for (size_t b : ex->WeightBytesPerRank()) total += b;
    for (size_t b : f32->WeightBytesPerRank()) total_f32 += b;
    // Each rank holds its slice of the matrices; the norms and the embedding are on every rank.
    EXPECT_EQ(static_cast<int64_t>(total), n * (norm_params * 4 + embedding_params * 2) + matrix_params * 2)
        << "ranks " << n;
    EXPECT_EQ(static_cast<int64_t>(total_f32), n * (norm_params + embedding_params) * 4 + matrix_params * 4)
        << "ranks " << n;
  }
}

TEST(TensorParallelMemoryTest, Fp8MatricesAreHeldAsBf16OnTheCpuBackend) {
  // FP8 checkpoints: the F8_E4M3 projections are dequantized and held as bf16 (2 bytes, not the
  // stored 1 byte plus scales); the BF16 embedding and lm_head stay bf16, the norms are f32.
  for (const char* name : {"llama_fp8_block", "llama_fp8_tensor"}) {
    const std::string dir = absl::StrCat("tests/golden/models/", name);
    ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(dir));
    const int64_t h = spec.hidden_size, v = spec.vocab_size;
    const int64_t norm_params = h + spec.num_layers * 2 * h;
    const int64_t embedding_params = v * h;
    const int64_t matrix_params = spec.NumParameters() - norm_params - embedding_params;
    for (int n : {1, 2}) {
      ASSERT_OK_AND_ASSIGN(auto ex, MakeExecutor(dir, n, {}));
      size_t total = 0;
      for (size_t b : ex->WeightBytesPerRank()) total += b;
      EXPECT_EQ(static_cast<int64_t>(total), n * (norm_params * 4 + embedding_params * 2) + matrix_params * 2)
          << name << ", ranks " << n;
    }
  }
}

TEST(TensorParallelErrorsTest, SizeThatDoesNotDivideIsRejectedBeforeAnythingIsLoaded) {
  // The llama spec with the stories260K checkpoint: loading would fail on the first shape, so an
  // error about divisibility proves the check comes first.
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec("tests/golden/models/llama"));
  ASSERT_OK_AND_ASSIGN(auto ckpt, Checkpoint::Open("../shared/models/stories260K"));
  EXPECT_THAT(TpExecutor::Create(spec, *ckpt, {.cpu_ranks = 3}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("does not divide num_attention_heads (4)")));
}

TEST(TensorParallelErrorsTest, BadExpertPlacementsNameTheProblem) {
  EXPECT_THAT(MakeExecutor("tests/golden/models/mixtral", 2, {.expert_owner = {0, 1}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lists 2 experts; the model has 4")));
  EXPECT_THAT(MakeExecutor("tests/golden/models/mixtral", 2, {.expert_owner = {0, 1, 2, 0}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expert 2 on rank 2")));
  EXPECT_THAT(MakeExecutor("tests/golden/models/llama", 2, {.expert_owner = {0}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("without experts")));
}

TEST(TensorParallelErrorsTest, InvalidRequestLeavesTheGroupUsable) {
  ASSERT_OK_AND_ASSIGN(auto ex, MakeExecutor("tests/golden/models/llama", 2, {}));
  EXPECT_THAT(ex->Step({StepSequence{.block_ids = {0}, .tokens = {999}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("token id 999")));
  ASSERT_OK_AND_ASSIGN(auto r, ex->Step({StepSequence{.block_ids = {0}, .tokens = {3, 4}}}));
  EXPECT_EQ(r.logits[0].size(), 256u);
}

}  // namespace
}  // namespace shardserve::engine

// Int8 weights (--quantize=int8) against the transformers references: the logits error at every
// prompt position relative to max|logit| and the greedy tokens' agreement, for every golden model
// at 1 and 2 tensor-parallel ranks and for the trained stories260K, plus the bytes the ranks hold.
// The figures are printed ("int8 <model> tp<N>: ...") for the issue notes; the assertions bound them.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "common/model_spec/model_spec.h"
#include "common/plan/plan.h"
#include "coordinator/planner/planner.h"
#include "common/safetensors/safetensors.h"
#include "tests/testing/engine_fixtures.h"
#include "tests/testing/golden.h"
#include "tests/testing/logit_errors.h"
#include "tests/testing/status_matchers.h"
#include "worker/engine/executor.h"
#include "worker/engine/generator.h"

namespace shardserve::engine {
namespace {

using ::shardserve::testing::GoldenModel;
using ::shardserve::testing::GreedyRequests;

// Logits of int8 weights differ from float ones by the quantization of every weight (half a step
// of its 64-weight block) and of every activation entering a projection: about 0.5% of a dot
// product each for the Gaussian random weights of the tiny golden models (a block's max is ~2.4
// standard deviations). Measured (the printed figures, x86-64 with AVX-512 VNNI): dense golden
// models at most 10.9% of a position's max|logit| (mistral, tp 2) and 1.04% on average; the
// trained stories260K 2.6% and 0.39%. The bounds are those rounded up.
constexpr double kMaxRelError = 0.15;
constexpr double kMeanRelError = 0.015;
constexpr double kStoriesMaxRelError = 0.05;
constexpr double kStoriesMeanRelError = 0.01;
// qwen2_moe's fixture keeps router margins only above 1e-3 (make_golden.py), below the int8 error
// of the router's input: some tokens take another expert, and their logits move far (measured:
// 52% max, 2.8% mean). Its bounds are those measured figures rounded up; the dense ones hold for
// the other MoE models (mixtral, whose routing did not flip), except the DeepSeek-V2 fixtures,
// whose softmax router margins are within reach of the int8 error too: numpy_reference.py's
// forward pass with the projections block-int8 rounded (+ noise of that size) takes another expert
// at one to three (token, layer) pairs of deepseek_v2_lite's prompts (logits move by 8-21% of
// max|logit|; the engine: 17.3% max, 1.24% mean at one rank) and another group at one pair of
// deepseek_v2's (31-34%, 14% without the flip; the engine: 32.8% max, 1.61% mean at two ranks).
// The GPT-OSS fixtures too, with larger activations (the clamped SwiGLU's): numpy_reference.py's
// int8 forward pass moves their logits by 17% and 18% of max|logit| (another expert at 1 of
// gpt_oss_mxfp4's 51 (token, layer) pairs, none of gpt_oss's 68); the engine: 24.6% max, 2.0% mean
// (gpt_oss, two ranks), 17.9% and 0.99% (gpt_oss_mxfp4, one rank, whose MXFP4 experts stay MXFP4:
// only its attention and lm_head are int8). glm4_moe likewise: numpy_reference.py's int8 forward
// pass moves its logits by 29.8% of max|logit|; the engine: 29.8% at one rank, 3.8% at two.
constexpr double kRoutingFlipMaxRelError = 0.6;
constexpr double kRoutingFlipMeanRelError = 0.04;
// smollm3 (four layers, tied small embeddings) is more sensitive to the rounding itself:
// `numpy_reference.py --int8`, which rounds every projection's operands as block int8 without the
// engine, moves its logits by 18.2% of max|logit| (and tracks the engine elsewhere: granite 1.76%
// in both, mistral 8.4% against 10.9%); the engine: 18.4% at one rank, 15.4% at two.
constexpr double kSmolLM3MaxRelError = 0.25;

absl::StatusOr<std::unique_ptr<TpExecutor>> MakeExecutor(const std::string& dir, int ranks, Quantization q,
                                                         std::unique_ptr<Checkpoint>* ckpt) {
  return testing::LoadOnCpuRanks(dir, ranks, ModelOptions{.quantize = q}, ckpt);
}

class Int8GoldenTest : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(Int8GoldenTest, LogitsNearTransformersAndGreedyTokensReported) {
  const auto& [name, ranks] = GetParam();
  ASSERT_OK_AND_ASSIGN(GoldenModel golden, testing::LoadGoldenModel(name));
  std::unique_ptr<Checkpoint> ckpt_f, ckpt_q;
  ASSERT_OK_AND_ASSIGN(auto f32, MakeExecutor(golden.dir, ranks, Quantization::kNone, &ckpt_f));
  ASSERT_OK_AND_ASSIGN(auto int8, MakeExecutor(golden.dir, ranks, Quantization::kInt8, &ckpt_q));
  // The projections are int8: fewer bytes than unquantized (f32, or bf16 for the bf16 and FP8
  // checkpoints; the embedding and norms stay as they were). Int8PlannerTest checks the exact sum.
  const size_t f32_bytes = f32->WeightBytesPerRank()[0], int8_bytes = int8->WeightBytesPerRank()[0];
  EXPECT_LT(int8_bytes, f32_bytes) << name;
  ASSERT_OK_AND_ASSIGN(const testing::GoldenAccuracy a, testing::MeasureGolden(*int8, golden));
  std::printf("int8 %s tp%d: logits max err %.4f, mean err %.5f of max|logit| over %ld positions; greedy "
              "agreement %zu/%zu leading tokens; weights %zu -> %zu bytes per rank\n",
              name.c_str(), ranks, a.err.max_rel, a.err.mean_rel(), static_cast<long>(a.err.positions), a.agree,
              a.total, f32_bytes, int8_bytes);
  const bool flips = name == "qwen2_moe" || name == "deepseek_v2_lite" || name == "deepseek_v2" ||
                     name == "gpt_oss" || name == "gpt_oss_mxfp4" || name == "glm4_moe";
  double max_bound = flips ? kRoutingFlipMaxRelError : kMaxRelError;
  if (name == "smollm3") max_bound = kSmolLM3MaxRelError;
  EXPECT_LE(a.err.max_rel, max_bound) << name;
  EXPECT_LE(a.err.mean_rel(), flips ? kRoutingFlipMeanRelError : kMeanRelError) << name;
  // A first token whose margin exceeds twice the int8 error at that position cannot differ (36 of
  // the 54 cases here qualify); later tokens, and the other first ones, may diverge where a greedy
  // margin is below the error, and the agreement printed above says how far they go.
  const size_t safe_cases = testing::ExpectFirstTokens(a, golden, name);
  std::printf("int8 %s tp%d: %zu of %zu first tokens checked (margin above twice the int8 error)\n", name.c_str(), ranks,
              safe_cases, a.generated.size());
}

std::vector<std::tuple<std::string, int>> Cases() {
  std::vector<std::tuple<std::string, int>> out;
  for (const std::string& name : testing::GoldenModelNames()) {
    out.emplace_back(name, 1);
    out.emplace_back(name, 2);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllGolden, Int8GoldenTest, ::testing::ValuesIn(Cases()),
                         [](const auto& p) {
                           return std::get<0>(p.param) + "_tp" + std::to_string(std::get<1>(p.param));
                         });

// The planner counts int8 matrices as the CPU ranks hold them: its predicted weight bytes of rank 0
// equal what the engine allocated, unquantized and int8, at 1 and 2 ranks.
TEST(Int8PlannerTest, PredictedWeightBytesAreTheBytesTheEngineHolds) {
  for (const std::string name :
       {"llama", "qwen2", "mixtral", "qwen2_moe", "llama_bf16_sharded", "qwen3", "qwen3_moe", "phi3", "deepseek_v3",
        "deepseek_v3_noqlora", "gemma2", "llama4", "llama4_multimodal", "gemma3", "deepseek_v2_lite", "deepseek_v2",
        "granite", "granite_moe", "smollm3", "granite_moe_shared", "granite_swa", "granite_moe_swa", "gpt_oss",
        "gpt_oss_mxfp4", "qwen3_yarn", "glm4_moe", "glm4_moe_lite", "seed_oss", "glm4"}) {
    ASSERT_OK_AND_ASSIGN(GoldenModel golden, testing::LoadGoldenModel(name));
    ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(golden.dir));
    for (int ranks : {1, 2}) {
      for (Quantization q : {Quantization::kNone, Quantization::kInt8}) {
        std::unique_ptr<Checkpoint> ckpt;
        ASSERT_OK_AND_ASSIGN(auto ex, MakeExecutor(golden.dir, ranks, q, &ckpt));
        WorkerInventory w{"w0", "node", {}};
        for (int d = 0; d < ranks; ++d) w.devices.push_back({DeviceKind::kCpu, d, int64_t{1} << 32, int64_t{1} << 31});
        PlanPolicy policy;
        policy.tp = ranks;
        policy.pp = 1;
        policy.replicas = 1;
        policy.quantize = q;
        ASSERT_OK_AND_ASSIGN(Plan plan, MakePlan(spec, {w}, policy));
        EXPECT_EQ(plan.replicas[0].stages[0].predicted_weight_bytes_per_rank,
                  static_cast<int64_t>(ex->WeightBytesPerRank()[0]))
            << name << " tp " << ranks << " " << QuantizationName(q);
      }
    }
  }
}

// The trained model: its text continuations are what users see.
TEST(Int8Stories260KTest, GreedyTextAgreesWithTransformers) {
  if (!std::filesystem::exists(testing::Stories260KDir() + "/model.safetensors")) {
    GTEST_FAIL() << "../shared/models/stories260K is missing: tests need ../shared beside the repository";
  }
  ASSERT_OK_AND_ASSIGN(GoldenModel golden, testing::LoadStories260K());
  std::unique_ptr<Checkpoint> ckpt;
  ASSERT_OK_AND_ASSIGN(auto int8, MakeExecutor(golden.dir, 1, Quantization::kInt8, &ckpt));
  ASSERT_OK_AND_ASSIGN(const testing::GoldenAccuracy a, testing::MeasureGolden(*int8, golden));
  std::printf("int8 stories260K: last-prompt logits max err %.4f, mean err %.5f of max|logit|; greedy agreement "
              "%zu/%zu leading tokens\n",
              a.err.max_rel, a.err.mean_rel(), a.agree, a.total);
  EXPECT_LE(a.err.max_rel, kStoriesMaxRelError);
  EXPECT_LE(a.err.mean_rel(), kStoriesMeanRelError);
  testing::ExpectFirstTokens(a, golden, "stories260K", /*all=*/true);
}

}  // namespace
}  // namespace shardserve::engine

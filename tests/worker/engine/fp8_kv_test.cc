// An FP8 KV cache (--kv_cache_dtype=fp8_e4m3: every cached key and value rounded to float8 e4m3)
// against the transformers references: the logits error at every prompt position relative to
// max|logit| and the greedy tokens' agreement, for every golden model without multi-head latent
// attention at 1 and 2 tensor-parallel ranks and for the trained stories260K, plus the cache's
// bytes. The figures are printed ("fp8 kv <model> tp<N>: ...") for the issue notes; the assertions
// bound them.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "common/model_spec/model_spec.h"
#include "common/safetensors/safetensors.h"
#include "tests/testing/engine_fixtures.h"
#include "tests/testing/golden.h"
#include "tests/testing/logit_errors.h"
#include "tests/testing/recording_backend.h"
#include "tests/testing/status_matchers.h"
#include "worker/engine/executor.h"
#include "worker/engine/generator.h"
#include "worker/kernels/registry.h"

namespace shardserve::engine {
namespace {

using ::shardserve::testing::GoldenModel;
using ::shardserve::testing::GreedyRequests;

// An e4m3 value keeps 3 mantissa bits: a cached key or value moves by up to 1/16 of itself (below
// 2^-6 by up to 2^-10 absolute; scaling the values by 16 first changed none of these figures, so
// the mantissa, not the range, is what costs). Measured (the printed figures, x86-64):
// dense golden models at most 18.4% of a position's max|logit| (phi3_longrope) and 2.2% on average
// (llama4_multimodal's text model); the MoE ones, whose routers then pick other experts for some
// tokens, up to 53.9% (qwen2_moe) and 3.4%; the trained stories260K 9.6% and 1.4% at its last
// prompt positions (perplexity +1.06%: shardserve-bench-perplexity). The bounds are those rounded
// up. They catch a cache that is read wrong (errors of the order of the logits themselves); the
// exact arithmetic is cpu_backend_test's Fp8KvWriteThenAttentionIsAttentionOverTheRoundedValues.
constexpr double kMaxRelError = 0.20;
constexpr double kMeanRelError = 0.025;
constexpr double kMoeMaxRelError = 0.6;
constexpr double kMoeMeanRelError = 0.04;
// gpt_oss's experts have gate/up weights drawn 2.25x the other fixtures' (so that the clamped
// SwiGLU's limits bite), which makes its logits more sensitive to any rounding: 71.5% max, 4.1%
// mean at 1 and 2 ranks (numpy_reference.py --int8 moves them by 17%, the engine's int8 likewise).
constexpr double kGptOssMaxRelError = 0.8;
constexpr double kGptOssMeanRelError = 0.05;
// glm4_moe's router margins go down to 1.2e-3 and its q/k norms keep every cached key near unit
// size, so the rounding moves some tokens to other experts: 69.0% max, 3.9% mean at 1 and 2 ranks.
// transformers' own forward pass with K (after RoPE) and V cast to float8_e4m3fn moves them by the
// same 69.0% (measured with a patched apply_rotary_pos_emb): the error is the fixture's, not the
// engine's.
constexpr double kGlm4MoeMaxRelError = 0.75;
constexpr double kGlm4MoeMeanRelError = 0.05;
constexpr double kStoriesMaxRelError = 0.12;
constexpr double kStoriesMeanRelError = 0.02;

absl::StatusOr<std::unique_ptr<TpExecutor>> MakeExecutor(const std::string& dir, int ranks, KvCacheFormat kv,
                                                         std::unique_ptr<Checkpoint>* ckpt) {
  return testing::LoadOnCpuRanks(dir, ranks, ModelOptions{.kv_cache = kv}, ckpt);
}

class Fp8KvGoldenTest : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(Fp8KvGoldenTest, LogitsNearTransformersAndTheCacheIsAQuarter) {
  const auto& [name, ranks] = GetParam();
  ASSERT_OK_AND_ASSIGN(GoldenModel golden, testing::LoadGoldenModel(name));
  std::unique_ptr<Checkpoint> ckpt_f, ckpt_q;
  ASSERT_OK_AND_ASSIGN(auto f32, MakeExecutor(golden.dir, ranks, KvCacheFormat::kAuto, &ckpt_f));
  ASSERT_OK_AND_ASSIGN(auto fp8, MakeExecutor(golden.dir, ranks, KvCacheFormat::kFp8E4M3, &ckpt_q));
  // CPU ranks keep an f32 cache by default: the FP8 one is a quarter of it, the same blocks.
  EXPECT_EQ(fp8->KvCacheBytesPerRank()[0] * 4, f32->KvCacheBytesPerRank()[0]) << name;
  EXPECT_EQ(fp8->options().num_kv_blocks, f32->options().num_kv_blocks) << name;
  ASSERT_OK_AND_ASSIGN(const testing::GoldenAccuracy a, testing::MeasureGolden(*fp8, golden));
  std::printf("fp8 kv %s tp%d: logits max err %.4f, mean err %.5f of max|logit| over %ld positions; greedy "
              "agreement %zu/%zu leading tokens; KV cache %zu -> %zu bytes per rank\n",
              name.c_str(), ranks, a.err.max_rel, a.err.mean_rel(), static_cast<long>(a.err.positions), a.agree,
              a.total, f32->KvCacheBytesPerRank()[0], fp8->KvCacheBytesPerRank()[0]);
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(golden.dir));
  double max_bound = spec.IsMoe() ? kMoeMaxRelError : kMaxRelError;
  double mean_bound = spec.IsMoe() ? kMoeMeanRelError : kMeanRelError;
  if (name == "gpt_oss") {
    max_bound = kGptOssMaxRelError;
    mean_bound = kGptOssMeanRelError;
  } else if (name == "glm4_moe") {
    max_bound = kGlm4MoeMaxRelError;
    mean_bound = kGlm4MoeMeanRelError;
  }
  EXPECT_LE(a.err.max_rel, max_bound) << name;
  EXPECT_LE(a.err.mean_rel(), mean_bound) << name;
  // The rounding is real: the logits are not the f32 cache's.
  EXPECT_GT(a.err.max_rel, 1e-5) << name;
  const size_t safe_cases = testing::ExpectFirstTokens(a, golden, name);
  std::printf("fp8 kv %s tp%d: %zu of %zu first tokens checked (margin above twice the error)\n", name.c_str(), ranks,
              safe_cases, a.generated.size());
}

// Every golden model but those with multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash:
// their latent cache is refused in FP8, memory_model_test checks the error).
std::vector<std::tuple<std::string, int>> Cases() {
  std::vector<std::tuple<std::string, int>> out;
  for (const std::string& name : testing::GoldenModelNames()) {
    const absl::StatusOr<ModelSpec> spec = LoadModelSpec("tests/golden/models/" + name);
    if (spec.ok() && spec->IsMla()) continue;
    out.emplace_back(name, 1);
    out.emplace_back(name, 2);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllGolden, Fp8KvGoldenTest, ::testing::ValuesIn(Cases()),
                         [](const auto& p) {
                           return std::get<0>(p.param) + "_tp" + std::to_string(std::get<1>(p.param));
                         });

// The trained model, whose keys and values have a trained model's range: its text continuations
// are what users see.
TEST(Fp8KvStories260KTest, GreedyTextAgreesWithTransformers) {
  if (!std::filesystem::exists(testing::Stories260KDir() + "/model.safetensors")) {
    GTEST_FAIL() << "../shared/models/stories260K is missing: tests need ../shared beside the repository";
  }
  ASSERT_OK_AND_ASSIGN(GoldenModel golden, testing::LoadStories260K());
  std::unique_ptr<Checkpoint> ckpt;
  ASSERT_OK_AND_ASSIGN(auto fp8, MakeExecutor(golden.dir, 1, KvCacheFormat::kFp8E4M3, &ckpt));
  ASSERT_OK_AND_ASSIGN(const testing::GoldenAccuracy a, testing::MeasureGolden(*fp8, golden));
  std::printf("fp8 kv stories260K: last-prompt logits max err %.4f, mean err %.5f of max|logit|; greedy agreement "
              "%zu/%zu leading tokens\n",
              a.err.max_rel, a.err.mean_rel(), a.agree, a.total);
  EXPECT_LE(a.err.max_rel, kStoriesMaxRelError);
  EXPECT_LE(a.err.mean_rel(), kStoriesMeanRelError);
  testing::ExpectFirstTokens(a, golden, "stories260K", /*all=*/true);
}

// A backend whose KvWrite or Attention does not take F8_E4M3: an FP8 cache is refused by name,
// before any weight is loaded, where "auto" still loads.
TEST(Fp8KvBackendTest, ABackendWithoutFp8KvCacheOpsIsRefusedByName) {
  const std::string dir = "tests/golden/models/llama";
  auto make = [](bool refuse) {
    absl::StatusOr<std::unique_ptr<kernels::Backend>> cpu = kernels::CreateBackend({});
    EXPECT_TRUE(cpu.ok()) << cpu.status();
    auto rec = std::make_unique<testing::RecordingBackend>(*std::move(cpu));
    rec->RefuseFp8KvCacheForTest(refuse);
    return rec;
  };
  ASSERT_OK_AND_ASSIGN(const ModelSpec spec, LoadModelSpec(dir));
  const std::unique_ptr<testing::RecordingBackend> refusing = make(true);
  EXPECT_THAT(KvCacheDType(spec, *refusing, KvCacheFormat::kFp8E4M3),
              testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                ::testing::HasSubstr("the recording-cpu backend's KvWrite and Attention do not take an "
                                                     "FP8 cache")));
  ASSERT_OK_AND_ASSIGN(const DType automatic, KvCacheDType(spec, *refusing, KvCacheFormat::kAuto));
  EXPECT_EQ(automatic, DType::kF32);
  ASSERT_OK_AND_ASSIGN(const DType fp8, KvCacheDType(spec, *make(false), KvCacheFormat::kFp8E4M3));
  EXPECT_EQ(fp8, DType::kF8E4M3);
  EXPECT_THAT(testing::LoadModel(dir, ModelOptions{.kv_cache = KvCacheFormat::kFp8E4M3}, make(true)).status(),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("do not take an FP8 cache")));
  EXPECT_TRUE(testing::LoadModel(dir, ModelOptions{}, make(true)).ok());
}

}  // namespace
}  // namespace shardserve::engine

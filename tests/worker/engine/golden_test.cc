// The engine against Hugging Face transformers: logits at every prompt position and 32 greedy
// tokens for each tiny golden model (tests/golden/make_golden.py) and for the trained stories260K.
// The FP8 golden models (tests/golden/make_fp8_golden.py) are checked the same way against a
// float64 NumPy reference over their exactly dequantized weights; the engine holds those weights
// rounded to bf16, so their logits get kFp8GoldenLogitsRtol (justified, with the measured error,
// in tests/testing/golden.h) while their greedy tokens must match exactly.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "common/model_spec/model_spec.h"
#include "common/safetensors/safetensors.h"
#include "common/status/macros.h"
#include "nlohmann/json.hpp"
#include "tests/testing/golden.h"
#include "tests/testing/engine_fixtures.h"
#include "tests/testing/safetensors_file.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "worker/engine/generator.h"
#include "worker/engine/model.h"
#include "worker/kernels/registry.h"

namespace shardserve::engine {
namespace {

using ::shardserve::testing::ExpectLogitsClose;
using ::shardserve::testing::GoldenModel;
using ::shardserve::testing::GreedyRequests;

using Loaded = testing::LoadedModel;

absl::StatusOr<Loaded> Load(const std::string& dir, ModelOptions options) {
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> backend, kernels::CreateBackend({}));
  return testing::LoadModel(dir, options, std::move(backend));
}

class GoldenTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(golden_, testing::LoadGoldenModel(GetParam()));
    ASSERT_EQ(golden_.cases.size(), 3u);
  }
  GoldenModel golden_;
};

TEST_P(GoldenTest, LogitsAtEveryPromptPositionMatchTransformers) {
  ASSERT_OK_AND_ASSIGN(Loaded l, Load(golden_.dir, {}));
  int32_t seq = 0;
  for (const auto& c : golden_.cases) {
    ASSERT_EQ(c.logits.size(), c.prompt_ids.size());
    StepSequence s{.block_ids = WholeContextBlocks(l.model->options(), seq++), .pos_begin = 0, .tokens = c.prompt_ids,
                   .all_logits = true};
    ASSERT_OK_AND_ASSIGN(StepResult r, l.model->Step({s}));
    const size_t v = static_cast<size_t>(l.spec.vocab_size);
    ASSERT_EQ(r.logits[0].size(), c.prompt_ids.size() * v);
    for (size_t p = 0; p < c.prompt_ids.size(); ++p) {
      ExpectLogitsClose(c.logits[p], r.logits[0].data() + p * v, absl::StrCat(golden_.name, " position ", p),
                        golden_.logits_rtol);
    }
  }
}

TEST_P(GoldenTest, GreedyTokensMatchTransformersOneRequestAtATime) {
  ASSERT_OK_AND_ASSIGN(Loaded l, Load(golden_.dir, {.num_kv_blocks = 0}));
  const auto reqs = GreedyRequests(golden_);
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_OK_AND_ASSIGN(auto res, Generate(*l.model, {reqs[i]}));
    EXPECT_EQ(res[0].tokens, golden_.cases[i].greedy_ids) << golden_.name << " case " << i;
    EXPECT_EQ(res[0].finish, FinishReason::kLength);
  }
}

TEST_P(GoldenTest, GreedyTokensMatchWhenBatchedWithChunkedPrefill) {
  // Three sequences of different lengths share every step; prompts are prefilled 4 tokens at a
  // time, so chunks, decodes and sequences of other lengths mix in one batch. Blocks of 3 tokens,
  // so chunks and blocks end at different places.
  ASSERT_OK_AND_ASSIGN(Loaded l, Load(golden_.dir, {.kv_block_size = 3, .max_step_tokens = 4}));
  ASSERT_OK_AND_ASSIGN(auto res, Generate(*l.model, GreedyRequests(golden_)));
  for (size_t i = 0; i < res.size(); ++i) {
    EXPECT_EQ(res[i].tokens, golden_.cases[i].greedy_ids) << golden_.name << " case " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(AllArchitectures, GoldenTest, ::testing::ValuesIn(testing::GoldenModelNames()),
                         [](const auto& test_info) { return test_info.param; });

// A Gemma3ForConditionalGeneration checkpoint is served as its language model: the gemma3 fixture's
// tensors renamed as transformers 5 saves a multimodal model ("model.language_model.") and as the
// released checkpoints are ("language_model.model."), beside a vision tower that is not loaded, with
// the fixture's config as the text_config of a multimodal config, give the fixture's logits and
// greedy tokens.
class Gemma3MultimodalTest : public ::testing::TestWithParam<std::string> {};

TEST_P(Gemma3MultimodalTest, TextPartMatchesTheTextOnlyFixture) {
  ASSERT_OK_AND_ASSIGN(GoldenModel golden, testing::LoadGoldenModel("gemma3"));
  ASSERT_OK_AND_ASSIGN(std::vector<testing::StoredTensor> tensors,
                       testing::ReadSafetensorsFile(golden.dir + "/model.safetensors"));
  for (testing::StoredTensor& t : tensors) {
    ASSERT_TRUE(t.name.starts_with("model.")) << t.name;
    t.name = GetParam() + t.name.substr(6);
  }
  // Not a tensor the language model has: never read (a wrong shape would fail the load).
  tensors.push_back({.name = GetParam() == "model.language_model." ? "model.vision_tower.patch.weight"
                                                                   : "vision_tower.patch.weight",
                     .dtype = "F32", .shape = {3}, .bytes = testing::F32Bytes({1, 2, 3})});
  nlohmann::json text = nlohmann::json::parse(testing::ReadFileOrEmpty(golden.dir + "/config.json"));
  text.erase("architectures");
  const nlohmann::json config = {{"architectures", {"Gemma3ForConditionalGeneration"}},
                                 {"model_type", "gemma3"},
                                 {"text_config", text},
                                 {"vision_config", {{"model_type", "siglip_vision_model"}}}};
  testing::TempDir dir;
  dir.Write("config.json", config.dump());
  dir.Write("model.safetensors", testing::SafetensorsFile(tensors));
  ASSERT_OK_AND_ASSIGN(Loaded l, Load(dir.path(), {}));
  EXPECT_TRUE(l.spec.multimodal_text);
  for (size_t i = 0; i < golden.cases.size(); ++i) {
    const auto& c = golden.cases[i];
    StepSequence s{.block_ids = WholeContextBlocks(l.model->options(), static_cast<int32_t>(i)), .pos_begin = 0,
                   .tokens = c.prompt_ids, .all_logits = true};
    ASSERT_OK_AND_ASSIGN(StepResult r, l.model->Step({s}));
    const size_t v = static_cast<size_t>(l.spec.vocab_size);
    for (size_t p = 0; p < c.prompt_ids.size(); ++p) {
      ExpectLogitsClose(c.logits[p], r.logits[0].data() + p * v, absl::StrCat(GetParam(), " position ", p));
    }
  }
  ASSERT_OK_AND_ASSIGN(Loaded fresh, Load(dir.path(), {}));
  ASSERT_OK_AND_ASSIGN(auto res, Generate(*fresh.model, GreedyRequests(golden)));
  for (size_t i = 0; i < res.size(); ++i) EXPECT_EQ(res[i].tokens, golden.cases[i].greedy_ids) << "case " << i;
}

INSTANTIATE_TEST_SUITE_P(Layouts, Gemma3MultimodalTest,
                         ::testing::Values("model.language_model.", "language_model.model."),
                         [](const auto& test_info) {
                           return test_info.param == "model.language_model." ? "Transformers5" : "Released";
                         });

class Stories260KTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(testing::Stories260KDir() + "/model.safetensors")) {
      GTEST_FAIL() << "../shared/models/stories260K is missing: tests need ../shared beside the repository";
    }
    ASSERT_OK_AND_ASSIGN(golden_, testing::LoadStories260K());
  }
  GoldenModel golden_;
};

TEST_F(Stories260KTest, GreedyGenerationMatchesTransformers) {
  ASSERT_OK_AND_ASSIGN(Loaded l, Load(golden_.dir, {}));
  ASSERT_OK_AND_ASSIGN(auto res, Generate(*l.model, GreedyRequests(golden_)));
  for (size_t i = 0; i < res.size(); ++i) {
    EXPECT_EQ(res[i].tokens, golden_.cases[i].greedy_ids) << "case " << i << " \"" << golden_.cases[i].prompt_text
                                                          << "\"";
  }
}

TEST_F(Stories260KTest, LastPromptLogitsMatchTransformers) {
  ASSERT_OK_AND_ASSIGN(Loaded l, Load(golden_.dir, {}));
  for (const auto& c : golden_.cases) {
    ASSERT_EQ(c.last_logits.size(), static_cast<size_t>(l.spec.vocab_size));
    ASSERT_OK_AND_ASSIGN(StepResult r, l.model->Step(
                                           {StepSequence{.block_ids = WholeContextBlocks(l.model->options(), 0),
                                                         .pos_begin = 0,
                                                         .tokens = c.prompt_ids}}));
    ExpectLogitsClose(c.last_logits, r.logits[0].data(), "stories260K \"" + c.prompt_text + "\"");
  }
}

}  // namespace
}  // namespace shardserve::engine

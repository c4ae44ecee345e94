// Model and Generate: input validation and sequence bookkeeping.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/model_spec/model_spec.h"
#include "common/safetensors/safetensors.h"
#include "tests/testing/status_matchers.h"
#include "worker/engine/generator.h"
#include "worker/engine/model.h"
#include "worker/kernels/registry.h"

namespace shardserve::engine {
namespace {

using ::shardserve::testing::IsOk;
using ::shardserve::testing::StatusIs;
using ::testing::HasSubstr;

constexpr char kDir[] = "tests/golden/models/llama";

class ModelTest : public ::testing::Test {
 protected:
  void Make(ModelOptions options) {
    ASSERT_OK_AND_ASSIGN(spec_, LoadModelSpec(kDir));
    ASSERT_OK_AND_ASSIGN(ckpt_, Checkpoint::Open(kDir));
    ASSERT_OK_AND_ASSIGN(backend_, kernels::CreateBackend({}));
    ASSERT_OK_AND_ASSIGN(model_, Model::Create(spec_, *ckpt_, backend_.get(), options));
  }
  void SetUp() override { Make({.max_slots = 2, .max_seq_len = 16, .max_step_tokens = 8}); }

  ModelSpec spec_;
  std::unique_ptr<Checkpoint> ckpt_;
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<Model> model_;
};

TEST_F(ModelTest, RejectsTokenIdsOutsideTheVocabulary) {
  EXPECT_THAT(model_->Step({StepSequence{.slot = 0, .tokens = {5, 256}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("token id 256 is outside the vocabulary")));
  EXPECT_THAT(model_->Step({StepSequence{.slot = 0, .tokens = {-1}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("token id -1")));
}

TEST_F(ModelTest, RejectsBadSlotsPositionsAndBudgets) {
  EXPECT_THAT(model_->Step({}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty")));
  EXPECT_THAT(model_->Step({StepSequence{.slot = 2, .tokens = {5}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("slot 2 outside")));
  EXPECT_THAT(model_->Step({StepSequence{.slot = 0, .tokens = {5}}, StepSequence{.slot = 0, .tokens = {6}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("used twice")));
  EXPECT_THAT(model_->Step({StepSequence{.slot = 0, .pos_begin = 15, .tokens = {5, 6}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceed the context length 16")));
  EXPECT_THAT(model_->Step({StepSequence{.slot = 0, .tokens = std::vector<int32_t>(9, 5)}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_step_tokens = 8")));
  EXPECT_THAT(model_->Step({StepSequence{.slot = 0, .tokens = {}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no tokens")));
}

TEST_F(ModelTest, RejectsBadOptions) {
  EXPECT_THAT(Model::Create(spec_, *ckpt_, backend_.get(), {.max_slots = 0}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_slots")));
  EXPECT_THAT(Model::Create(spec_, *ckpt_, backend_.get(), {.max_seq_len = 129}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_position_embeddings = 128")));
}

TEST_F(ModelTest, RejectsTensorParallelSizesThatDoNotDivideBeforeLoading) {
  EXPECT_THAT(Model::Create(spec_, *ckpt_, backend_.get(), {.shard = {.rank = 0, .size = 3}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("does not divide num_attention_heads (4)")));
}

TEST_F(ModelTest, GenerateValidatesEveryRequestFirst) {
  GenerationRequest ok{.prompt = {3, 4}, .max_tokens = 2};
  EXPECT_THAT(Generate(*model_, {ok, GenerationRequest{.prompt = {}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("request 1: the prompt is empty")));
  EXPECT_THAT(Generate(*model_, {GenerationRequest{.prompt = std::vector<int32_t>(16, 3)}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("context length is 16")));
  EXPECT_THAT(Generate(*model_, {GenerationRequest{.prompt = {3}, .max_tokens = 0}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_tokens")));
  EXPECT_THAT(Generate(*model_, {GenerationRequest{.prompt = {3, 999}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("id 999")));
  GenerationRequest bad_sampling{.prompt = {3}};
  bad_sampling.sampling.top_p = 0.f;
  EXPECT_THAT(Generate(*model_, {bad_sampling}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("top_p")));
}

TEST_F(ModelTest, GenerationStopsAtTheContextLengthAndAtStopIds) {
  ASSERT_OK_AND_ASSIGN(auto res, Generate(*model_, {GenerationRequest{.prompt = {3, 4, 5}, .max_tokens = 100}}));
  EXPECT_EQ(res[0].tokens.size(), 13u);  // 3 + 13 = 16 = context
  EXPECT_EQ(res[0].finish, FinishReason::kLength);
  const int32_t stop = res[0].tokens[4];
  ASSERT_OK_AND_ASSIGN(auto stopped,
                       Generate(*model_, {GenerationRequest{.prompt = {3, 4, 5}, .max_tokens = 100, .stop_ids = {stop}}}));
  const auto first = std::find(res[0].tokens.begin(), res[0].tokens.end(), stop) - res[0].tokens.begin();
  EXPECT_EQ(stopped[0].tokens.size(), static_cast<size_t>(first + 1));
  EXPECT_EQ(stopped[0].finish, FinishReason::kStop);
}

TEST_F(ModelTest, MoreRequestsThanSlotsAllCompleteWithTheirOwnTokens) {
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 5; ++i) reqs.push_back({.prompt = {3 + i, 7, 9 + i}, .max_tokens = 4 + i});
  ASSERT_OK_AND_ASSIGN(auto together, Generate(*model_, reqs));
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_OK_AND_ASSIGN(auto alone, Generate(*model_, {reqs[i]}));
    EXPECT_EQ(together[i].tokens, alone[0].tokens) << "request " << i;
    EXPECT_EQ(together[i].tokens.size(), static_cast<size_t>(reqs[i].max_tokens));
  }
}

TEST(ModelLoadTest, CheckpointShapeThatDisagreesWithConfigNamesTheTensor) {
  // The golden llama config with a larger intermediate size: its MLP weights no longer fit.
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(kDir));
  spec.intermediate_size = 160;
  ASSERT_OK_AND_ASSIGN(auto ckpt, Checkpoint::Open(kDir));
  ASSERT_OK_AND_ASSIGN(auto backend, kernels::CreateBackend({}));
  EXPECT_THAT(Model::Create(spec, *ckpt, backend.get(), {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor \"model.layers.0.mlp.gate_proj.weight\" has shape [128, 64] but the model "
                                 "config implies [160, 64]")));
}

TEST(ModelLoadTest, StoredDtypeThatDisagreesWithConfigNamesTheTensor) {
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(kDir));
  spec.dtype = DType::kBF16;
  ASSERT_OK_AND_ASSIGN(auto ckpt, Checkpoint::Open(kDir));
  ASSERT_OK_AND_ASSIGN(auto backend, kernels::CreateBackend({}));
  EXPECT_THAT(Model::Create(spec, *ckpt, backend.get(), {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is stored as F32 but config.json declares")));
}

TEST(ModelLoadTest, MissingTensorIsNotFoundWithItsName) {
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(kDir));
  spec.num_layers = 3;  // the checkpoint has 2 layers
  ASSERT_OK_AND_ASSIGN(auto ckpt, Checkpoint::Open(kDir));
  ASSERT_OK_AND_ASSIGN(auto backend, kernels::CreateBackend({}));
  EXPECT_THAT(Model::Create(spec, *ckpt, backend.get(), {}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("model.layers.2.input_layernorm.weight")));
}

TEST(BackendRegistryTest, CudaWithoutADeviceIsAClearError) {
  if (kernels::CudaDeviceCount() > 0) GTEST_SKIP() << "this machine has a CUDA device";
  auto backend = kernels::CreateBackend({.kind = kernels::DeviceKind::kCuda});
  ASSERT_FALSE(backend.ok());
  EXPECT_THAT(backend.status().message(), HasSubstr("CUDA"));
}

}  // namespace
}  // namespace shardserve::engine

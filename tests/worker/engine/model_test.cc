// Model and Generate: input validation and sequence bookkeeping.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "common/model_spec/model_spec.h"
#include "common/safetensors/safetensors.h"
#include "tests/testing/status_matchers.h"
#include "worker/engine/generator.h"
#include "worker/engine/model.h"
#include "worker/engine/sampling.h"
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
  // 8 blocks of 4 tokens: two sequences of the whole context (16 tokens) at once.
  void SetUp() override { Make({.num_kv_blocks = 8, .kv_block_size = 4, .max_seq_len = 16, .max_step_tokens = 8}); }

  ModelSpec spec_;
  std::unique_ptr<Checkpoint> ckpt_;
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<Model> model_;
};

TEST_F(ModelTest, RejectsTokenIdsOutsideTheVocabulary) {
  EXPECT_THAT(model_->Step({StepSequence{.block_ids = {0}, .tokens = {5, 256}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("token id 256 is outside the vocabulary")));
  EXPECT_THAT(model_->Step({StepSequence{.block_ids = {0}, .tokens = {-1}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("token id -1")));
}

TEST_F(ModelTest, RejectsBadBlockTablesPositionsAndBudgets) {
  EXPECT_THAT(model_->Step({}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty")));
  EXPECT_THAT(model_->Step({StepSequence{.block_ids = {8}, .tokens = {5}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("KV block 8 is outside [0, 8)")));
  EXPECT_THAT(model_->Step({StepSequence{.block_ids = {-1}, .tokens = {5}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("KV block -1 is outside")));
  // Positions [2, 7) need blocks 0 and 1 of 4 tokens.
  EXPECT_THAT(model_->Step({StepSequence{.block_ids = {0}, .pos_begin = 2, .tokens = {5, 6, 7, 8, 9}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("1 KV blocks of 4 tokens cannot hold positions "
                                                                     "up to 7; 2 needed")));
  EXPECT_THAT(model_->Step({StepSequence{.block_ids = {0}, .tokens = {5}}, StepSequence{.block_ids = {0}, .tokens = {6}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("sequence 1: KV block 0 is written twice")));
  EXPECT_THAT(model_->Step({StepSequence{.block_ids = {3, 3}, .tokens = {5, 6, 7, 8, 9}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("written twice")));
  EXPECT_THAT(model_->Step({StepSequence{.block_ids = {0, 1, 2, 3}, .pos_begin = 15, .tokens = {5, 6}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceed the context length 16")));
  EXPECT_THAT(model_->Step({StepSequence{.block_ids = {0, 1, 2}, .tokens = std::vector<int32_t>(9, 5)}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_step_tokens = 8")));
  EXPECT_THAT(model_->Step({StepSequence{.block_ids = {0}, .tokens = {}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no tokens")));
}

TEST_F(ModelTest, SequencesMayReadABlockTheyShareButNotWriteIt) {
  // Two sequences with the same first block (a shared prefix), each writing its own second block.
  ASSERT_TRUE(model_->Step({StepSequence{.block_ids = {0}, .tokens = {3, 4, 5, 6}}}).ok());
  EXPECT_TRUE(model_->Step({StepSequence{.block_ids = {0, 1}, .pos_begin = 4, .tokens = {7}},
                            StepSequence{.block_ids = {0, 2}, .pos_begin = 4, .tokens = {8}}})
                  .ok());
}

TEST_F(ModelTest, LogitsDoNotDependOnWhichBlocksHoldTheSequence) {
  const std::vector<int32_t> prompt = {3, 9, 4, 1, 5, 9, 2, 6, 5, 3};
  auto run = [&](const std::vector<int32_t>& blocks) -> std::vector<std::vector<float>> {
    std::vector<std::vector<float>> logits;
    // A prefill in two chunks that end mid-block, then two decodes.
    auto a = model_->Step({StepSequence{.block_ids = blocks, .tokens = {prompt.begin(), prompt.begin() + 6}}});
    EXPECT_TRUE(a.ok()) << a.status();
    auto b = model_->Step({StepSequence{.block_ids = blocks, .pos_begin = 6, .tokens = {prompt.begin() + 6, prompt.end()}}});
    EXPECT_TRUE(b.ok()) << b.status();
    logits.push_back(b->logits[0]);
    for (int32_t pos = 10; pos < 12; ++pos) {
      auto d = model_->Step({StepSequence{.block_ids = blocks, .pos_begin = pos, .tokens = {7}}});
      EXPECT_TRUE(d.ok()) << d.status();
      logits.push_back(d->logits[0]);
    }
    return logits;
  };
  const auto contiguous = run({0, 1, 2});
  const auto shuffled = run({6, 3, 7, 1});  // an unused extra entry is allowed
  EXPECT_EQ(contiguous, shuffled);
}

TEST_F(ModelTest, RejectsBadOptions) {
  EXPECT_THAT(Model::Create(spec_, *ckpt_, backend_.get(), {.num_kv_blocks = -1}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_kv_blocks")));
  EXPECT_THAT(Model::Create(spec_, *ckpt_, backend_.get(), {.kv_block_size = 0}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("kv_block_size must be in [1, 65536], got 0")));
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
  // 8 blocks of 4 tokens hold 32 tokens; a sequence is at most the context (16 tokens), so a
  // smaller cache is needed to refuse one.
  Make({.num_kv_blocks = 2, .kv_block_size = 4, .max_seq_len = 16, .max_step_tokens = 8});
  EXPECT_THAT(Generate(*model_, {GenerationRequest{.prompt = {3, 4, 5}, .max_tokens = 6}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the prompt (3 tokens) and max_tokens (6) need 3 KV blocks of 4 tokens; the model has 2")));
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

TEST(ModelLoadTest, MultiHeadLatentAttentionCachesTheLatentAndTheRopeKeyPerToken) {
  // deepseek_v3: kv_lora_rank 32 + qk_rope_head_dim 8 values per token and layer, on every rank,
  // whatever its 4 heads of (16 + 8) key and 16 value dims would take expanded.
  const std::string dir = "tests/golden/models/deepseek_v3";
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(dir));
  ASSERT_OK_AND_ASSIGN(auto ckpt, Checkpoint::Open(dir));
  ASSERT_OK_AND_ASSIGN(auto backend, kernels::CreateBackend({}));
  ASSERT_OK_AND_ASSIGN(auto model, Model::Create(spec, *ckpt, backend.get(),
                                                 {.num_kv_blocks = 8, .kv_block_size = 4, .max_seq_len = 32}));
  EXPECT_EQ(model->kv_cache_bytes(), size_t{8} * 4 * (32 + 8) * sizeof(float) * 3);
  EXPECT_EQ(spec.KvValuesPerToken(2), 40);
}

TEST(BackendRegistryTest, CudaWithoutADeviceIsAClearError) {
  if (kernels::CudaDeviceCount() > 0) GTEST_SKIP() << "this machine has a CUDA device";
  auto backend = kernels::CreateBackend({.kind = kernels::DeviceKind::kCuda});
  ASSERT_FALSE(backend.ok());
  EXPECT_THAT(backend.status().message(), HasSubstr("CUDA"));
}

TEST_F(ModelTest, GreedySequencesGetTheArgmaxInsteadOfTheLogits) {
  // The same step twice on two caches: with logits, and greedy (the argmax computed by the backend).
  const std::vector<int32_t> prompt = {5, 17, 3};
  ASSERT_OK_AND_ASSIGN(StepResult full, model_->Step({StepSequence{.block_ids = {0}, .tokens = prompt},
                                                      StepSequence{.block_ids = {1}, .tokens = {9}}}));
  ASSERT_OK_AND_ASSIGN(StepResult greedy,
                       model_->Step({StepSequence{.block_ids = {2}, .tokens = prompt, .greedy = true},
                                     StepSequence{.block_ids = {3}, .tokens = {9}}}));
  const std::vector<float>& l = full.logits[0];
  EXPECT_EQ(greedy.sampled_ids[0], std::max_element(l.begin(), l.end()) - l.begin());
  EXPECT_TRUE(greedy.logits[0].empty());
  EXPECT_EQ(greedy.sampled_ids[1], -1);  // not greedy: its logits as before
  EXPECT_EQ(greedy.logits[1], full.logits[1]);
}

TEST_F(ModelTest, SampledSequencesGetTheDrawWhereTheBackendSamplesRows) {
  const std::vector<int32_t> prompt = {5, 17, 3};
  const kernels::RowSamplingParams sampling{.temperature = 1.3f, .top_k = 40, .top_p = 0.95f, .min_p = 0.02f,
                                            .seed = 77, .step = 4};
  // CPU ranks leave sampling to the caller, as before: the logits come back.
  ASSERT_OK_AND_ASSIGN(StepResult host,
                       model_->Step({StepSequence{.block_ids = {0}, .tokens = prompt, .sampling = sampling}}));
  EXPECT_EQ(host.sampled_ids[0], -1);
  ASSERT_EQ(host.logits[0].size(), static_cast<size_t>(spec_.vocab_size));
  // With SampleRows (forced on the CPU backend): the id the Sampler draws from those logits.
  Make({.num_kv_blocks = 8, .kv_block_size = 4, .max_seq_len = 16, .max_step_tokens = 8,
        .sample_rows_on_cpu_for_test = true});
  const SamplingParams params{.temperature = 1.3f, .top_k = 40, .top_p = 0.95f, .seed = 77, .min_p = 0.02f};
  Sampler sampler;
  for (uint64_t step = 0; step < 20; ++step) {
    kernels::RowSamplingParams at_step = sampling;
    at_step.step = step;
    ASSERT_OK_AND_ASSIGN(StepResult device,
                         model_->Step({StepSequence{.block_ids = {1}, .tokens = {9}},
                                       StepSequence{.block_ids = {0}, .tokens = prompt, .sampling = at_step},
                                       StepSequence{.block_ids = {2}, .tokens = {4}, .greedy = true}}));
    EXPECT_EQ(device.sampled_ids[0], -1);  // neither greedy nor sampled: its logits
    EXPECT_FALSE(device.logits[0].empty());
    EXPECT_EQ(device.sampled_ids[1], sampler.Sample(host.logits[0], params, step)) << "step " << step;
    EXPECT_TRUE(device.logits[1].empty());
    EXPECT_GE(device.sampled_ids[2], 0);  // greedy rows still get their argmax
  }
}

TEST_F(ModelTest, GenerationDrawsTheSameTokensWhenTheBackendSamples) {
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 4; ++i) {
    GenerationRequest r{.prompt = {3, static_cast<int32_t>(4 + i), 5}, .max_tokens = 10};
    r.sampling = {.temperature = 0.7f + 0.3f * static_cast<float>(i), .top_k = i == 0 ? 0 : 20 * i,
                  .top_p = i == 3 ? 1.0f : 0.9f, .seed = static_cast<uint64_t>(100 + i), .min_p = i == 2 ? 0.05f : 0.0f};
    reqs.push_back(r);
  }
  reqs.push_back({.prompt = {7, 8}, .max_tokens = 10});  // greedy, in the same batches
  ASSERT_OK_AND_ASSIGN(auto on_host, Generate(*model_, reqs));
  Make({.num_kv_blocks = 8, .kv_block_size = 4, .max_seq_len = 16, .max_step_tokens = 8,
        .sample_rows_on_cpu_for_test = true});
  ASSERT_OK_AND_ASSIGN(auto on_backend, Generate(*model_, reqs));
  ASSERT_EQ(on_host.size(), on_backend.size());
  bool any_not_greedy = false;
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(on_backend[i].tokens, on_host[i].tokens) << "request " << i;
    if (i < 4) {
      ASSERT_OK_AND_ASSIGN(auto greedy, Generate(*model_, {{.prompt = reqs[i].prompt, .max_tokens = 10}}));
      any_not_greedy = any_not_greedy || greedy[0].tokens != on_host[i].tokens;
    }
  }
  EXPECT_TRUE(any_not_greedy);  // the draws mattered
}

// RunDecodeSteps: after a prefill, 8 decode steps in one call give the tokens of single steps
// (Generate), for a sampled row drawn on the host and by the backend (whose `step` must move on
// with the steps), beside a greedy row.
TEST_F(ModelTest, DecodeStepsGiveTheTokensOfSingleSteps) {
  const std::vector<GenerationRequest> reqs = {
      {.prompt = {3, 4, 5}, .max_tokens = 9, .sampling = {.temperature = 0.9f, .top_k = 20, .seed = 5}},
      {.prompt = {7, 8}, .max_tokens = 9}};
  ASSERT_OK_AND_ASSIGN(auto expected, Generate(*model_, reqs));
  const SamplingParams sampled = reqs[0].sampling;
  ASSERT_OK_AND_ASSIGN(auto greedy_draws, Generate(*model_, {{.prompt = reqs[0].prompt, .max_tokens = 9}}));
  EXPECT_NE(expected[0].tokens, greedy_draws[0].tokens) << "the draws should matter";
  for (const bool backend_samples : {false, true}) {
    SCOPED_TRACE(backend_samples ? "the backend samples" : "the host samples");
    Make({.num_kv_blocks = 8, .kv_block_size = 4, .max_seq_len = 16, .max_step_tokens = 8,
          .sample_rows_on_cpu_for_test = backend_samples});
    Sampler sampler;
    // Sequence 0's j-th token of a call is token `base + j` of its output.
    auto pick_at = [&sampler, &sampled](uint64_t base) {
      return [&sampler, &sampled, base](size_t i, int32_t j, const StepResult& r) -> int32_t {
        if (r.sampled_ids[i] >= 0) return r.sampled_ids[i];
        return sampler.Sample(r.logits[i], i == 0 ? sampled : SamplingParams{}, base + static_cast<uint64_t>(j));
      };
    };
    std::vector<StepSequence> batch = {
        StepSequence{.block_ids = WholeContextBlocks(model_->options(), 0),
                     .tokens = reqs[0].prompt,
                     .sampling = kernels::RowSamplingParams{.temperature = sampled.temperature,
                                                            .top_k = sampled.top_k,
                                                            .top_p = sampled.top_p,
                                                            .seed = sampled.seed}},
        StepSequence{.block_ids = WholeContextBlocks(model_->options(), 1), .tokens = reqs[1].prompt, .greedy = true}};
    ASSERT_OK_AND_ASSIGN(StepResult prefill, model_->Step(batch));
    std::vector<std::vector<int32_t>> got(2);
    for (size_t i = 0; i < 2; ++i) {
      got[i].push_back(pick_at(0)(i, 0, prefill));
      batch[i].pos_begin = static_cast<int32_t>(batch[i].tokens.size());
      batch[i].tokens = {got[i][0]};
    }
    batch[0].sampling->step = 1;
    ASSERT_OK_AND_ASSIGN(std::vector<int32_t> ids, RunDecodeSteps(*model_, batch, 8, pick_at(1)));
    ASSERT_EQ(ids.size(), 16u);
    for (size_t i = 0; i < 2; ++i) {
      got[i].insert(got[i].end(), ids.begin() + static_cast<std::ptrdiff_t>(8 * i),
                    ids.begin() + static_cast<std::ptrdiff_t>(8 * i + 8));
      EXPECT_EQ(got[i], expected[i].tokens) << "sequence " << i;
    }
  }
}

TEST_F(ModelTest, DecodeStepsRefuseWhatTheyCannotRun) {
  auto pick = [](size_t, int32_t, const StepResult& r) { return r.sampled_ids[0]; };
  // 14 positions from position 3 need 5 blocks of 4 tokens (max_seq_len 16: blocks 0-3 are one).
  EXPECT_THAT(RunDecodeSteps(*model_, {StepSequence{.block_ids = {0, 1, 2, 3}, .pos_begin = 3, .tokens = {5},
                                                    .greedy = true}},
                             14, pick),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("KV blocks")));
  EXPECT_THAT(RunDecodeSteps(*model_, {StepSequence{.block_ids = {0, 1}, .tokens = {5, 6}, .greedy = true}}, 2, pick),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exactly one given token")));
  EXPECT_THAT(RunDecodeSteps(*model_, {StepSequence{.block_ids = {0}, .tokens = {5}, .greedy = true}}, 0, pick),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(">= 1")));
  // A stage without the embedding.
  Make({.num_kv_blocks = 8, .kv_block_size = 4, .max_seq_len = 16, .max_step_tokens = 8, .layer_begin = 1});
  EXPECT_THAT(RunDecodeSteps(*model_, {StepSequence{.block_ids = {0, 1}, .tokens = {5}, .greedy = true}}, 2, pick),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("every layer")));
}

}  // namespace
}  // namespace shardserve::engine

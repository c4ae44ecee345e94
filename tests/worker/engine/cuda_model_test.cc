// Whole models on a CUDA device against Hugging Face transformers (label gpu; skipped without a
// device): every golden model's logits at every prompt position and its greedy tokens, one
// request at a time and batched with chunked prefill, as golden_test.cc does on the CPU. f32
// checkpoints hold the golden tolerance and give identical tokens; the bf16 checkpoint runs its
// prefill GEMMs with bf16 activations (see worker/kernels/cuda/linear16.cuh), so its logits get a
// bf16 tolerance, and it must occupy bf16 bytes on the device. The FP8 checkpoints declare
// bfloat16 too; CUDA keeps their matrices as e4m3 codes + scales (1 byte per weight, counted
// below), which its prefill GEMMs dequantize to bf16 and multiply with bf16 activations, so they
// get the same treatment (a float64 NumPy model of bf16 weights and bf16 GEMM inputs puts their
// 11-token prefill 6.6e-3 of max |logit| off, the bf16 checkpoint 1.0e-2, both within the 2e-2
// used here; decode steps multiply the exact f32 weights).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/model_spec/model_spec.h"
#include "common/status/macros.h"
#include "common/safetensors/safetensors.h"
#include "tests/testing/golden.h"
#include "tests/testing/engine_fixtures.h"
#include "tests/testing/random_model.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/status_matchers.h"
#include "worker/engine/executor.h"
#include "worker/engine/generator.h"
#include "worker/engine/model.h"
#include "worker/engine/sampling.h"
#include "worker/kernels/registry.h"

namespace shardserve::engine {
namespace {

using ::shardserve::testing::ExpectLogitsClose;
using ::shardserve::testing::ExpertTokens;
using ::shardserve::testing::GoldenModel;
using ::shardserve::testing::GreedyRequests;

using Loaded = testing::LoadedModel;

absl::StatusOr<Loaded> LoadOnCuda(const std::string& dir, ModelOptions options) {
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> backend,
                   kernels::CreateBackend({.kind = kernels::DeviceKind::kCuda, .device_index = 0}));
  return testing::LoadModel(dir, options, std::move(backend));
}

bool IsBf16Checkpoint(const ModelSpec& spec) { return spec.dtype.has_value() && *spec.dtype == DType::kBF16; }

// max |got - ref| <= rtol * max |ref|.
void ExpectLogitsWithin(const std::vector<float>& ref, const float* got, float rtol, const std::string& where) {
  float max_ref = 0.f, worst = 0.f;
  for (size_t i = 0; i < ref.size(); ++i) {
    max_ref = std::max(max_ref, std::fabs(ref[i]));
    worst = std::max(worst, std::fabs(got[i] - ref[i]));
  }
  EXPECT_LE(worst, rtol * max_ref) << where;
}

class CudaGoldenTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    ASSERT_OK_AND_ASSIGN(golden_, testing::LoadGoldenModel(GetParam()));
  }
  GoldenModel golden_;
};

TEST_P(CudaGoldenTest, LogitsAtEveryPromptPositionMatchTransformers) {
  ASSERT_OK_AND_ASSIGN(Loaded l, LoadOnCuda(golden_.dir, {}));
  const bool bf16 = IsBf16Checkpoint(l.spec);
  int32_t seq = 0;
  for (const auto& c : golden_.cases) {
    StepSequence s{.block_ids = WholeContextBlocks(l.model->options(), seq++), .pos_begin = 0, .tokens = c.prompt_ids,
                   .all_logits = true};
    ASSERT_OK_AND_ASSIGN(StepResult r, l.model->Step({s}));
    const size_t v = static_cast<size_t>(l.spec.vocab_size);
    ASSERT_EQ(r.logits[0].size(), c.prompt_ids.size() * v);
    for (size_t p = 0; p < c.prompt_ids.size(); ++p) {
      const std::string where = absl::StrCat(golden_.name, " position ", p, " of ", c.prompt_ids.size());
      if (bf16) {
        ExpectLogitsWithin(c.logits[p], r.logits[0].data() + p * v, 2e-2f, where);
      } else {
        ExpectLogitsClose(c.logits[p], r.logits[0].data() + p * v, where, golden_.logits_rtol);
      }
    }
  }
}

TEST_P(CudaGoldenTest, GreedyTokensMatchTransformersAloneAndBatched) {
  ASSERT_OK_AND_ASSIGN(Loaded alone, LoadOnCuda(golden_.dir, {}));
  if (IsBf16Checkpoint(alone.spec)) GTEST_SKIP() << "bf16 activations in prefill: tokens may differ at near-ties";
  const auto reqs = GreedyRequests(golden_);
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_OK_AND_ASSIGN(auto res, Generate(*alone.model, {reqs[i]}));
    EXPECT_EQ(res[0].tokens, golden_.cases[i].greedy_ids) << golden_.name << " case " << i;
  }
  ASSERT_OK_AND_ASSIGN(Loaded batched, LoadOnCuda(golden_.dir, {.kv_block_size = 3, .max_step_tokens = 4}));
  ASSERT_OK_AND_ASSIGN(auto res, Generate(*batched.model, reqs));
  for (size_t i = 0; i < res.size(); ++i) {
    EXPECT_EQ(res[i].tokens, golden_.cases[i].greedy_ids) << golden_.name << " batched case " << i;
  }
}

// The golden models CUDA ranks run: all but multi-head latent attention (DeepSeek-V2, V3), which the
// CUDA backend refuses (CudaMlaTest).
std::vector<std::string> CudaGoldenModelNames() {
  std::vector<std::string> names;
  for (const std::string& name : testing::GoldenModelNames()) {
    absl::StatusOr<ModelSpec> spec = LoadModelSpec(absl::StrCat("tests/golden/models/", name));
    if (!spec.ok() || !spec->IsMla()) names.push_back(name);
  }
  return names;
}

INSTANTIATE_TEST_SUITE_P(AllArchitectures, CudaGoldenTest, ::testing::ValuesIn(CudaGoldenModelNames()),
                         [](const auto& test_info) { return test_info.param; });

TEST(CudaMlaTest, MultiHeadLatentAttentionIsRefusedWithAClearError) {
  if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (const auto& [model, arch] : {std::pair<std::string, std::string>{"deepseek_v3", "DeepseekV3ForCausalLM"},
                                    {"deepseek_v2", "DeepseekV2ForCausalLM"},
                                    {"glm4_moe_lite", "Glm4MoeLiteForCausalLM"}}) {
    absl::StatusOr<Loaded> l = LoadOnCuda("tests/golden/models/" + model, {});
    ASSERT_FALSE(l.ok()) << model;
    EXPECT_EQ(l.status().code(), absl::StatusCode::kUnimplemented) << model;
    EXPECT_THAT(std::string(l.status().message()),
                ::testing::HasSubstr("multi-head latent attention (" + arch + ") is not implemented"));
  }
}

// A CUDA rank draws plain sampled sequences on the device (SampleRows): the same ids as the host
// Sampler on the logits the same step returns without `sampling`.
TEST(CudaSamplingTest, DeviceDrawsWhatTheHostSamplerDrawsFromTheSameLogits) {
  if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ASSERT_OK_AND_ASSIGN(Loaded l, LoadOnCuda("tests/golden/models/llama", {}));
  const std::vector<int32_t> prompt = {5, 17, 3, 44};
  ASSERT_OK_AND_ASSIGN(StepResult host,
                       l.model->Step({StepSequence{.block_ids = WholeContextBlocks(l.model->options(), 0),
                                                   .tokens = prompt}}));
  ASSERT_EQ(host.sampled_ids[0], -1);
  const SamplingParams kinds[] = {{.temperature = 1.0f, .seed = 3},
                                  {.temperature = 0.8f, .top_k = 20, .top_p = 0.9f, .seed = 4},
                                  {.temperature = 1.5f, .seed = 5, .min_p = 0.1f}};
  Sampler sampler;
  for (const SamplingParams& p : kinds) {
    for (uint64_t step = 0; step < 10; ++step) {
      StepSequence s{.block_ids = WholeContextBlocks(l.model->options(), 1), .tokens = prompt};
      s.sampling = kernels::RowSamplingParams{.temperature = p.temperature, .top_k = p.top_k, .top_p = p.top_p,
                                              .min_p = p.min_p, .seed = p.seed, .step = step};
      ASSERT_OK_AND_ASSIGN(StepResult device, l.model->Step({s}));
      EXPECT_TRUE(device.logits[0].empty());
      EXPECT_EQ(device.sampled_ids[0], sampler.Sample(host.logits[0], p, step)) << "seed " << p.seed << " step " << step;
    }
  }
}

TEST(CudaWeightsTest, Bf16CheckpointOccupiesBf16BytesOnTheDevice) {
  if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  // Matrices and the embedding in bf16 (2 bytes), norms in f32: the byte count of the CPU test
  // tensor_parallel_test.cc, on the device.
  const std::string dir = "tests/golden/models/llama_bf16_sharded";
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(dir));
  ASSERT_OK_AND_ASSIGN(auto ckpt, Checkpoint::Open(dir));
  const int64_t h = spec.hidden_size;
  const int64_t norm_params = h + spec.num_layers * 2 * h;
  const int64_t other_params = spec.NumParameters() - norm_params;
  ASSERT_OK_AND_ASSIGN(auto ex, TpExecutor::Create(spec, *ckpt,
                                                   {.kind = kernels::DeviceKind::kCuda, .cuda_devices = {0}}));
  ASSERT_EQ(ex->WeightBytesPerRank().size(), 1u);
  EXPECT_EQ(static_cast<int64_t>(ex->WeightBytesPerRank()[0]), norm_params * 4 + other_params * 2);
}

// A Mixtral-shaped model small enough to generate per test: 8 experts, 2 per token, 2 layers.
testing::RandomLlamaShape SmallMoeShape() {
  testing::RandomLlamaShape shape;
  shape.vocab = 128;
  shape.hidden = 256;
  shape.intermediate = 128;
  shape.layers = 2;
  shape.heads = 4;
  shape.kv_heads = 2;
  shape.max_positions = 512;
  shape.experts = 8;
  shape.experts_per_tok = 2;
  return shape;
}

// A Mixtral-shaped checkpoint stored in bf16 or f16 (the real MoE checkpoints' dtypes): its experts
// stay 16-bit on the device and run grouped (GroupedLinear's grouped GEMV for decode-sized groups,
// a GEMM per expert for a long prefill's) with one MoeCombine per layer; the logits must follow
// the CPU backend's (the same 16-bit weights, per-expert Linear and ScatterAddRows) within the
// 16-bit activation tolerance of the bf16 golden checks above.
TEST(CudaMoeTest, SixteenBitExpertsRunGroupedAndFollowTheCpu) {
  if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (const bool f16 : {false, true}) {
    SCOPED_TRACE(f16 ? "f16" : "bf16");
    testing::TempDir tmp;
    testing::RandomLlamaShape shape = SmallMoeShape();
    shape.bf16 = !f16;
    shape.f16 = f16;
    ASSERT_THAT(testing::WriteRandomLlama(tmp.path(), shape, 16), ::shardserve::testing::IsOk());
    ASSERT_OK_AND_ASSIGN(Loaded gpu, LoadOnCuda(tmp.path(), {}));
    ASSERT_TRUE(gpu.backend->SupportsOp(kernels::Op::kGroupedLinear, f16 ? DType::kF16 : DType::kBF16));
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<kernels::Backend> cpu_backend, kernels::CreateBackend({}));
    ASSERT_OK_AND_ASSIGN(Loaded cpu, testing::LoadModel(tmp.path(), {}, std::move(cpu_backend)));
    // A 240-token prefill (about 60 rows per expert: the GEMM regime) beside a 5-token one, then
    // decode steps of both (a few rows per expert: the grouped GEMV).
    std::vector<int32_t> long_prompt(240);
    for (size_t i = 0; i < long_prompt.size(); ++i) long_prompt[i] = static_cast<int32_t>((i * 37 + 11) % 128);
    std::vector<StepSequence> batch = {
        {.block_ids = WholeContextBlocks(gpu.model->options(), 0), .pos_begin = 0, .tokens = long_prompt},
        {.block_ids = WholeContextBlocks(gpu.model->options(), 1), .pos_begin = 0, .tokens = {3, 9, 27, 81, 115}}};
    for (int step = 0; step < 4; ++step) {
      ASSERT_OK_AND_ASSIGN(StepResult want, cpu.model->Step(batch));
      ASSERT_OK_AND_ASSIGN(StepResult got, gpu.model->Step(batch));
      ASSERT_EQ(got.logits.size(), want.logits.size());
      for (size_t q = 0; q < want.logits.size(); ++q) {
        ExpectLogitsWithin(want.logits[q], got.logits[q].data(), 2e-2f,
                           absl::StrCat("step ", step, " sequence ", q));
      }
      for (size_t q = 0; q < batch.size(); ++q) {
        batch[q].pos_begin += static_cast<int32_t>(batch[q].tokens.size());
        batch[q].tokens = {static_cast<int32_t>((step * 13 + static_cast<int>(q) * 29) % 128)};
      }
    }
  }
}

// The device path of MoE layers (ModelOptions::moe_device_offsets): with 16-bit experts a decode
// step routes without copying the offsets to the host, runs the grouped GEMV and the combine over
// the device offsets, and is recorded as a CUDA graph and replayed. The logits must equal those of
// the same model run op by op with the host copy of the offsets (the same kernels on the same
// groups: bit for bit), and the expert-token counts must be those the host path reports.
TEST(CudaMoeTest, SixteenBitMoeDecodeStepsReplayAsGraphs) {
  if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  testing::TempDir tmp;
  testing::RandomLlamaShape shape = SmallMoeShape();
  shape.bf16 = true;
  ASSERT_THAT(testing::WriteRandomLlama(tmp.path(), shape, 17), ::shardserve::testing::IsOk());
  ExpertTokens graph_counts, host_counts;
  ASSERT_OK_AND_ASSIGN(Loaded graphs, LoadOnCuda(tmp.path(), {.observer = &graph_counts}));
  ASSERT_OK_AND_ASSIGN(Loaded host, LoadOnCuda(tmp.path(), {.observer = &host_counts, .op_graphs = false,
                                                            .moe_device_offsets = false}));
  std::vector<StepSequence> batch = {
      {.block_ids = WholeContextBlocks(graphs.model->options(), 0), .pos_begin = 0, .tokens = {3, 9, 27, 81, 115}},
      {.block_ids = WholeContextBlocks(graphs.model->options(), 1), .pos_begin = 0, .tokens = {7, 21}}};
  for (int step = 0; step < 8; ++step) {
    ASSERT_OK_AND_ASSIGN(StepResult got, graphs.model->Step(batch));
    ASSERT_OK_AND_ASSIGN(StepResult want, host.model->Step(batch));
    ASSERT_EQ(got.logits, want.logits) << "step " << step;
    for (size_t q = 0; q < batch.size(); ++q) {
      // Greedy: each sequence decodes its own argmax, so both models follow the same tokens.
      const std::vector<float>& l = want.logits[q];
      batch[q].pos_begin += static_cast<int32_t>(batch[q].tokens.size());
      batch[q].tokens = {static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin())};
    }
  }
  EXPECT_GT(graphs.model->graph_replays(), 0) << "no MoE decode step was replayed";
  EXPECT_EQ(host.model->graph_replays(), 0);
  EXPECT_FALSE(host_counts.calls.empty());
  EXPECT_EQ(graph_counts.calls, host_counts.calls);
}

TEST(CudaWeightsTest, Fp8CheckpointsOccupyOneBytePerWeightPlusScalesOnTheDevice) {
  if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  // Projections as e4m3 codes (1 byte) plus one f32 per scale block; the embedding and the lm_head
  // (modules_to_not_convert / ignored_layers) in bf16; norms in f32. Scale blocks counted by hand:
  // llama_fp8_block (32 x 32 blocks) per layer q [64, 64] 2 x 2, k and v [32, 64] 1 x 2, o 2 x 2,
  // gate and up [80, 64] 3 x 2, down [64, 80] 2 x 3: 30; llama_fp8_tensor one per matrix: 7.
  for (const auto& [dir, blocks_per_layer] : {std::pair<std::string, int64_t>{"tests/golden/models/llama_fp8_block", 30},
                                              {"tests/golden/models/llama_fp8_tensor", 7}}) {
    SCOPED_TRACE(dir);
    ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(dir));
    ASSERT_OK_AND_ASSIGN(auto ckpt, Checkpoint::Open(dir));
    const int64_t h = spec.hidden_size;
    const int64_t norm_params = h + spec.num_layers * 2 * h;
    const int64_t table_params = 2 * spec.vocab_size * h;
    const int64_t projection_params = spec.NumParameters() - norm_params - table_params;
    ASSERT_OK_AND_ASSIGN(auto ex, TpExecutor::Create(spec, *ckpt,
                                                     {.kind = kernels::DeviceKind::kCuda, .cuda_devices = {0}}));
    ASSERT_EQ(ex->WeightBytesPerRank().size(), 1u);
    EXPECT_EQ(static_cast<int64_t>(ex->WeightBytesPerRank()[0]),
              norm_params * 4 + table_params * 2 + projection_params + spec.num_layers * blocks_per_layer * 4);
  }
}

}  // namespace
}  // namespace shardserve::engine

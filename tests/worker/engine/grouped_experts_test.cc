// The engine's grouped-expert path (Model::GroupedExperts: one gather of every routed row, one
// GroupedLinear per projection, then one MoeCombine or a scatter per expert), which CUDA ranks
// take, run on the CPU through RecordingBackend's emulations: GroupedLinear as a Linear per group,
// MoeCombine through the shared functions the CUDA kernel runs (kernels/shared/moe_math.h). The
// per-expert loop and the grouped path do the same sums in the same order, so the logits must be
// bit-identical, and the tokens those of transformers.
#include <gtest/gtest.h>

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "common/status/macros.h"
#include "tests/testing/engine_fixtures.h"
#include "tests/testing/golden.h"
#include "tests/testing/recording_backend.h"
#include "tests/testing/status_matchers.h"
#include "worker/engine/generator.h"
#include "worker/engine/model.h"
#include "worker/engine/step_runner.h"
#include "worker/kernels/registry.h"

namespace shardserve::engine {
namespace {

using ::shardserve::testing::ExpertTokens;
using ::shardserve::testing::GoldenModel;
using ::shardserve::testing::GreedyRequests;
using ::shardserve::testing::RecordingBackend;

using Loaded = testing::LoadedModel;

// The model on the CPU backend; through a RecordingBackend that claims GroupedLinear when `grouped`,
// and MoeCombine too when `combine`.
absl::StatusOr<Loaded> Load(const std::string& dir, ModelOptions options, bool grouped, bool combine = false) {
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> cpu, kernels::CreateBackend({}));
  if (grouped) {
    auto rec = std::make_unique<RecordingBackend>(std::move(cpu));
    rec->EmulateGroupedLinearForTest(true);
    rec->EmulateMoeCombineForTest(combine);
    cpu = std::move(rec);
  }
  return testing::LoadModel(dir, options, std::move(cpu));
}

class GroupedExpertsTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GroupedExpertsTest, LogitsBitIdenticalToThePerExpertLoop) {
  ASSERT_OK_AND_ASSIGN(GoldenModel golden, testing::LoadGoldenModel(GetParam()));
  ASSERT_OK_AND_ASSIGN(Loaded grouped, Load(golden.dir, {}, true));
  ASSERT_OK_AND_ASSIGN(Loaded loop, Load(golden.dir, {}, false));
  // Every prompt side by side in one prefill, then 6 decode steps of them all.
  std::vector<StepSequence> batch;
  for (size_t i = 0; i < golden.cases.size(); ++i) {
    batch.push_back({.block_ids = WholeContextBlocks(grouped.model->options(), static_cast<int32_t>(i)),
                     .pos_begin = 0,
                     .tokens = golden.cases[i].prompt_ids});
  }
  for (int step = 0; step < 7; ++step) {
    ASSERT_OK_AND_ASSIGN(StepResult a, grouped.model->Step(batch));
    ASSERT_OK_AND_ASSIGN(StepResult b, loop.model->Step(batch));
    ASSERT_EQ(a.logits, b.logits) << golden.name << " step " << step;
    for (size_t s = 0; s < batch.size(); ++s) {
      batch[s].pos_begin += static_cast<int32_t>(batch[s].tokens.size());
      batch[s].tokens = {static_cast<int32_t>((step * 7 + static_cast<int>(s) * 13) % 50 + 3)};
    }
  }
  const auto& rec = static_cast<const RecordingBackend&>(*grouped.backend);
  EXPECT_GT(rec.grouped_linears(), 0) << "the grouped path did not run";
  EXPECT_EQ(rec.moe_combines(), 0) << "the scatters' path ran the combine";
  // And greedy generation gives transformers' tokens, batched.
  ASSERT_OK_AND_ASSIGN(auto res, Generate(*grouped.model, GreedyRequests(golden)));
  for (size_t i = 0; i < res.size(); ++i) {
    EXPECT_EQ(res[i].tokens, golden.cases[i].greedy_ids) << golden.name << " case " << i;
  }
}

// The same with the combine: each token's expert outputs added in one pass, through the shared
// functions, leave the hidden state bit for bit as the per-expert scatters do.
TEST_P(GroupedExpertsTest, CombineLogitsBitIdenticalToThePerExpertScatters) {
  ASSERT_OK_AND_ASSIGN(GoldenModel golden, testing::LoadGoldenModel(GetParam()));
  // The host copy of the offsets (the device path has its own test below).
  ASSERT_OK_AND_ASSIGN(Loaded combined, Load(golden.dir, {.moe_device_offsets = false}, true, true));
  ASSERT_OK_AND_ASSIGN(Loaded loop, Load(golden.dir, {}, false));
  std::vector<StepSequence> batch;
  for (size_t i = 0; i < golden.cases.size(); ++i) {
    batch.push_back({.block_ids = WholeContextBlocks(combined.model->options(), static_cast<int32_t>(i)),
                     .pos_begin = 0,
                     .tokens = golden.cases[i].prompt_ids});
  }
  for (int step = 0; step < 5; ++step) {
    ASSERT_OK_AND_ASSIGN(StepResult a, combined.model->Step(batch));
    ASSERT_OK_AND_ASSIGN(StepResult b, loop.model->Step(batch));
    ASSERT_EQ(a.logits, b.logits) << golden.name << " step " << step;
    for (size_t s = 0; s < batch.size(); ++s) {
      batch[s].pos_begin += static_cast<int32_t>(batch[s].tokens.size());
      batch[s].tokens = {static_cast<int32_t>((step * 11 + static_cast<int>(s) * 5) % 50 + 3)};
    }
  }
  const auto& rec = static_cast<const RecordingBackend&>(*combined.backend);
  EXPECT_GT(rec.moe_combines(), 0) << "the combine did not run";
}

// The device path (ModelOptions::moe_device_offsets): MoeRoute leaves the offsets on the device and
// the grouped experts read them there (the CPU backend's device-offsets forms), so decode steps are
// recorded and replayed. The same logits, bit for bit, as the host copy's path and the per-expert
// loop, and the same expert-token counts, read back after each step.
TEST_P(GroupedExpertsTest, DevicePathRecordsDecodeStepsWithTheSameLogitsAndCounts) {
  ASSERT_OK_AND_ASSIGN(GoldenModel golden, testing::LoadGoldenModel(GetParam()));
  ExpertTokens device_counts, host_counts, loop_counts;
  ASSERT_OK_AND_ASSIGN(Loaded device, Load(golden.dir, {.observer = &device_counts}, true, true));
  ASSERT_OK_AND_ASSIGN(Loaded host,
                       Load(golden.dir, {.observer = &host_counts, .moe_device_offsets = false}, true, true));
  ASSERT_OK_AND_ASSIGN(Loaded loop, Load(golden.dir, {.observer = &loop_counts}, false));
  std::vector<StepSequence> batch;
  for (size_t i = 0; i < golden.cases.size(); ++i) {
    batch.push_back({.block_ids = WholeContextBlocks(device.model->options(), static_cast<int32_t>(i)),
                     .pos_begin = 0,
                     .tokens = golden.cases[i].prompt_ids});
  }
  for (int step = 0; step < 6; ++step) {
    ASSERT_OK_AND_ASSIGN(StepResult a, device.model->Step(batch));
    ASSERT_OK_AND_ASSIGN(StepResult b, host.model->Step(batch));
    ASSERT_OK_AND_ASSIGN(StepResult c, loop.model->Step(batch));
    ASSERT_EQ(a.logits, c.logits) << golden.name << " step " << step;
    ASSERT_EQ(b.logits, c.logits) << golden.name << " step " << step;
    for (size_t s = 0; s < batch.size(); ++s) {
      batch[s].pos_begin += static_cast<int32_t>(batch[s].tokens.size());
      batch[s].tokens = {static_cast<int32_t>((step * 5 + static_cast<int>(s) * 3) % 50 + 3)};
    }
  }
  EXPECT_GT(device.model->graph_replays(), 0) << "no MoE decode step was replayed";
  EXPECT_EQ(host.model->graph_replays(), 0) << "a step that copies the offsets to the host was recorded";
  EXPECT_FALSE(loop_counts.calls.empty());
  EXPECT_EQ(device_counts.calls, loop_counts.calls);
  EXPECT_EQ(host_counts.calls, loop_counts.calls);
  // And greedy generation, one request at a time (decode steps of one sequence, recorded and
  // replayed), gives transformers' tokens.
  const auto reqs = GreedyRequests(golden);
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_OK_AND_ASSIGN(auto res, Generate(*device.model, {reqs[i]}));
    EXPECT_EQ(res[0].tokens, golden.cases[i].greedy_ids) << golden.name << " case " << i;
  }
}

// One golden model per routing rule and expert layout: softmax top-k (Mixtral; Qwen2-MoE with its
// gated shared expert), sigmoid input-weighted (Llama-4), grouped sigmoid with a bias and an
// ungated shared expert (DeepSeek-V3), group-limited softmax (DeepSeek-V2).
TEST_P(GroupedExpertsTest, ReserveHoldsTheLargestProductExactly) {
  // A prefill of max_step_tokens tokens passes the largest products a step can to the backend:
  // the reservation (kernels::MaxProductActivations of Reserve's limits: what CUDA keeps for the
  // 16-bit rounding of a product's activations) must hold the largest of them, and no more.
  ASSERT_OK_AND_ASSIGN(GoldenModel golden, testing::LoadGoldenModel(GetParam()));
  ModelOptions options;
  options.max_step_tokens = 8;
  ASSERT_OK_AND_ASSIGN(Loaded grouped, Load(golden.dir, options, true));
  std::vector<int32_t> prompt;
  for (int32_t t = 0; t < 8; ++t) prompt.push_back(3 + 5 * t);
  const std::vector<StepSequence> prefill = {
      {.block_ids = WholeContextBlocks(grouped.model->options(), 0), .pos_begin = 0, .tokens = prompt}};
  ASSERT_THAT(grouped.model->Step(prefill).status(), ::shardserve::testing::IsOk());
  const auto& rec = static_cast<const RecordingBackend&>(*grouped.backend);
  ASSERT_GT(rec.grouped_linears(), 0) << "the grouped path did not run";
  EXPECT_EQ(rec.largest_product(), kernels::MaxProductActivations(rec.reserved()))
      << "max_tokens " << rec.reserved().max_tokens << ", max_linear_in " << rec.reserved().max_linear_in
      << ", max_grouped_in " << rec.reserved().max_grouped_in;
}

INSTANTIATE_TEST_SUITE_P(MoeArchitectures, GroupedExpertsTest,
                         ::testing::Values("mixtral", "qwen2_moe", "llama4", "deepseek_v3", "deepseek_v2", "glm4_moe",
                                           "glm4_moe_lite"),
                         [](const auto& test_info) { return test_info.param; });

TEST(GroupedExpertsCpuTest, TheCpuBackendKeepsThePerExpertLoop) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<kernels::Backend> cpu, kernels::CreateBackend({}));
  // Not offered to the engine (nothing to gain on the CPU), though the op runs for tests.
  EXPECT_FALSE(cpu->SupportsOp(kernels::Op::kGroupedLinear, DType::kF32));
  float x = 2, w = 3, y = 0;
  const kernels::GroupedLinearParams::Group group{.w = &w, .begin = 0, .count = 1};
  ASSERT_THAT(cpu->GroupedLinear({.x = &x, .y = &y, .groups = &group, .num_groups = 1, .rows = 1, .in = 1, .out = 1}),
              ::shardserve::testing::IsOk());
  EXPECT_EQ(y, 6.0f);
}

}  // namespace
}  // namespace shardserve::engine

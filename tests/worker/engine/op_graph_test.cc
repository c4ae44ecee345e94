// Recorded decode steps (ModelOptions::op_graphs, CUDA graphs on GPUs), exercised without a GPU
// through RecordingBackend: the engine records a decode step's embedding and layers once per shape
// and replays the recording, refreshing the buffers' contents in between. The answers must be
// those of transformers and bit-identical to running op by op; steps that cannot be recorded run
// op by op.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "common/model_spec/model_spec.h"
#include "common/safetensors/safetensors.h"
#include "common/status/macros.h"
#include "tests/testing/golden.h"
#include "tests/testing/engine_fixtures.h"
#include "tests/testing/recording_backend.h"
#include "tests/testing/status_matchers.h"
#include "worker/engine/generator.h"
#include "worker/engine/model.h"
#include "worker/kernels/registry.h"

namespace shardserve::engine {
namespace {

using ::shardserve::testing::GoldenModel;
using ::shardserve::testing::GreedyRequests;
using ::shardserve::testing::RecordingBackend;

using Loaded = testing::LoadedModel;

// The model on the CPU backend, wrapped in a RecordingBackend when `recording`.
absl::StatusOr<Loaded> Load(const std::string& dir, ModelOptions options, bool recording) {
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> cpu, kernels::CreateBackend({}));
  if (recording) cpu = std::make_unique<RecordingBackend>(std::move(cpu));
  return testing::LoadModel(dir, options, std::move(cpu));
}

RecordingBackend& Recorder(const Loaded& l) { return static_cast<RecordingBackend&>(*l.backend); }

class OpGraphGoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(OpGraphGoldenTest, ReplayedDecodeStepsGiveTransformersTokens) {
  ASSERT_OK_AND_ASSIGN(GoldenModel golden, testing::LoadGoldenModel(GetParam()));
  // One request at a time: every decode step has one sequence; the context grows, so the
  // attention shape key changes every 8 positions and new recordings are made.
  ASSERT_OK_AND_ASSIGN(Loaded alone, Load(golden.dir, {}, true));
  const auto reqs = GreedyRequests(golden);
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_OK_AND_ASSIGN(auto res, Generate(*alone.model, {reqs[i]}));
    EXPECT_EQ(res[0].tokens, golden.cases[i].greedy_ids) << golden.name << " case " << i;
  }
  EXPECT_GT(Recorder(alone).recordings(), 1);
  EXPECT_GT(alone.model->graph_replays(), 3 * 16);
  EXPECT_EQ(alone.model->graph_replays(), Recorder(alone).replays());
  // Batched with chunked prefill and 3-token blocks: prefill chunks run op by op, decode steps of
  // 1-3 sequences replay, and the block tables outgrow their buffer (the recordings are dropped).
  ASSERT_OK_AND_ASSIGN(Loaded batched, Load(golden.dir, {.kv_block_size = 3, .max_step_tokens = 4}, true));
  ASSERT_OK_AND_ASSIGN(auto res, Generate(*batched.model, reqs));
  for (size_t i = 0; i < res.size(); ++i) {
    EXPECT_EQ(res[i].tokens, golden.cases[i].greedy_ids) << golden.name << " batched case " << i;
  }
  EXPECT_GT(batched.model->graph_replays(), 0);
}

// The dense golden models (MoE layers are recorded only on their device path, which needs the
// grouped experts RecordingBackend does not claim here: grouped_experts_test.cc covers it).
INSTANTIATE_TEST_SUITE_P(DenseArchitectures, OpGraphGoldenTest,
                         ::testing::Values("llama", "llama_tied_llama3rope_bias", "mistral", "qwen2",
                                           "llama_bf16_sharded", "llama_fp8_block", "llama_fp8_tensor", "gemma2",
                                           "phi3_partial_rotary", "gemma3"),
                         [](const auto& test_info) { return test_info.param; });

TEST(OpGraphTest, ReplayedLogitsAreBitIdenticalToOpByOp) {
  const std::string dir = testing::Stories260KDir();
  ASSERT_OK_AND_ASSIGN(Loaded rec, Load(dir, {.max_seq_len = 64}, true));
  ASSERT_OK_AND_ASSIGN(Loaded plain, Load(dir, {.max_seq_len = 64}, false));
  // Two sequences decoding side by side for 40 steps, fed the same tokens.
  const std::vector<int32_t> prompt_a = {1, 403, 407, 261}, prompt_b = {1, 67, 411};
  std::vector<StepSequence> batch = {
      {.block_ids = WholeContextBlocks(rec.model->options(), 0), .pos_begin = 0, .tokens = prompt_a},
      {.block_ids = WholeContextBlocks(rec.model->options(), 1), .pos_begin = 0, .tokens = prompt_b}};
  for (int step = 0; step < 40; ++step) {
    ASSERT_OK_AND_ASSIGN(StepResult a, rec.model->Step(batch));
    ASSERT_OK_AND_ASSIGN(StepResult b, plain.model->Step(batch));
    ASSERT_EQ(a.logits, b.logits) << "step " << step;
    for (size_t s = 0; s < batch.size(); ++s) {
      batch[s].pos_begin += static_cast<int32_t>(batch[s].tokens.size());
      batch[s].tokens = {static_cast<int32_t>((step * 7 + static_cast<int>(s) * 13) % 500 + 3)};
    }
  }
  EXPECT_EQ(rec.model->graph_replays(), 39);  // every step but the first (a prefill)
  EXPECT_EQ(plain.model->graph_replays(), 0);
}

TEST(OpGraphTest, AFailedRecordingFallsBackToOpByOpForGood) {
  ASSERT_OK_AND_ASSIGN(GoldenModel golden, testing::LoadGoldenModel("llama"));
  ASSERT_OK_AND_ASSIGN(Loaded l, Load(golden.dir, {}, true));
  Recorder(l).FailRecordingsForTest(true);
  ASSERT_OK_AND_ASSIGN(auto res, Generate(*l.model, GreedyRequests(golden)));
  for (size_t i = 0; i < res.size(); ++i) EXPECT_EQ(res[i].tokens, golden.cases[i].greedy_ids) << "case " << i;
  EXPECT_EQ(Recorder(l).recordings(), 0);
  EXPECT_EQ(l.model->graph_replays(), 0);
}

TEST(OpGraphTest, InvalidatedRecordingsAreRecordedAgain) {
  // Every recording goes stale before its second replay (as when a CUDA backend replaces its
  // scratch): the step runs op by op, the recordings are dropped and made again, tokens stay right.
  ASSERT_OK_AND_ASSIGN(GoldenModel golden, testing::LoadGoldenModel("llama"));
  ASSERT_OK_AND_ASSIGN(Loaded l, Load(golden.dir, {}, true));
  const auto reqs = GreedyRequests(golden);
  const int64_t steps = reqs[0].max_tokens;
  int64_t generated = 0;
  ASSERT_OK_AND_ASSIGN(auto res, Generate(*l.model, {reqs[0]}, [&](size_t, int32_t) {
                         if (++generated % 2 == 0) Recorder(l).InvalidateRecordingsForTest();
                       }));
  EXPECT_EQ(res[0].tokens, golden.cases[0].greedy_ids);
  EXPECT_GT(Recorder(l).recordings(), steps / 4);  // made again after invalidations
  EXPECT_GT(l.model->graph_replays(), 0);
  EXPECT_LT(l.model->graph_replays(), steps - 1);  // some steps fell back to op by op
}

// MoE steps that copy the experts' offsets to the host (no grouped experts on this backend) are never
// recorded.
TEST(OpGraphTest, OffOrMoeStepsAreNeverRecorded) {
  ASSERT_OK_AND_ASSIGN(GoldenModel llama, testing::LoadGoldenModel("llama"));
  ASSERT_OK_AND_ASSIGN(Loaded off, Load(llama.dir, {.op_graphs = false}, true));
  ASSERT_OK_AND_ASSIGN(auto res, Generate(*off.model, GreedyRequests(llama)));
  EXPECT_EQ(Recorder(off).recordings(), 0);
  ASSERT_OK_AND_ASSIGN(GoldenModel mixtral, testing::LoadGoldenModel("mixtral"));
  ASSERT_OK_AND_ASSIGN(Loaded moe, Load(mixtral.dir, {}, true));
  ASSERT_OK_AND_ASSIGN(auto moe_res, Generate(*moe.model, GreedyRequests(mixtral)));
  for (size_t i = 0; i < moe_res.size(); ++i) EXPECT_EQ(moe_res[i].tokens, mixtral.cases[i].greedy_ids);
  EXPECT_EQ(Recorder(moe).recordings(), 0);
}

}  // namespace
}  // namespace shardserve::engine

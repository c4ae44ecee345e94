// Expert spill in the engine: a stage computes some experts of its MoE layers on another worker
// (here an ExpertHost in the same process behind the RemoteExperts interface). Every placement
// must give the Hugging Face logits within the golden tolerance and the same greedy tokens, and a
// failing host must fail the step without breaking the tensor-parallel group.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include <atomic>

#include "absl/strings/str_cat.h"
#include "common/model_spec/model_spec.h"
#include "common/plan/memory_model.h"
#include "common/safetensors/safetensors.h"
#include "tests/testing/golden.h"
#include "tests/testing/status_matchers.h"
#include "worker/engine/executor.h"
#include "worker/engine/expert_host.h"
#include "worker/engine/generator.h"

namespace shardserve::engine {
namespace {

using ::shardserve::testing::GoldenModel;
using ::shardserve::testing::IsOk;
using ::shardserve::testing::StatusIs;
using ::testing::HasSubstr;

constexpr int32_t R = kRemoteExpert;

struct SpillLayout {
  std::string model;
  int ranks;
  bool split_experts;
  std::map<int64_t, std::vector<int32_t>> layer_experts;
  std::string name;
};

void PrintTo(const SpillLayout& l, std::ostream* os) { *os << l.name; }

// The experts a placement leaves to the host, spread over two host devices.
std::vector<HostedExpertSpec> RemoteOf(const std::map<int64_t, std::vector<int32_t>>& layer_experts) {
  std::vector<HostedExpertSpec> out;
  for (const auto& [layer, owners] : layer_experts) {
    for (size_t e = 0; e < owners.size(); ++e) {
      if (owners[e] == R) out.push_back({layer, static_cast<int64_t>(e), static_cast<int>(out.size() % 2)});
    }
  }
  return out;
}

struct Spilled {
  std::unique_ptr<Checkpoint> ckpt;
  std::unique_ptr<ExpertHost> host;
  std::unique_ptr<RemoteExperts> remote;
  std::unique_ptr<TpExecutor> executor;  // destroyed first
};

absl::StatusOr<Spilled> MakeSpilled(const std::string& dir, int ranks, ModelOptions mo,
                                    std::unique_ptr<RemoteExperts> remote = nullptr) {
  const Quantization quantize = mo.quantize;
  Spilled s;
  auto spec = LoadModelSpec(dir);
  if (!spec.ok()) return spec.status();
  auto ckpt = Checkpoint::Open(dir);
  if (!ckpt.ok()) return ckpt.status();
  s.ckpt = *std::move(ckpt);
  if (remote == nullptr) {
    auto host =
        ExpertHost::Create(*spec, *s.ckpt, RemoteOf(mo.layer_experts), kernels::DeviceKind::kCpu, 1, quantize);
    if (!host.ok()) return host.status();
    s.host = *std::move(host);
    remote = std::make_unique<InProcessRemoteExperts>(s.host.get());
  }
  s.remote = std::move(remote);
  mo.remote_experts = s.remote.get();
  ExecutorOptions eo;
  eo.cpu_ranks = ranks;
  eo.model = std::move(mo);
  auto ex = TpExecutor::Create(*spec, *s.ckpt, eo);
  if (!ex.ok()) return ex.status();
  s.executor = *std::move(ex);
  return s;
}

class ExpertSpillTest : public ::testing::TestWithParam<SpillLayout> {};

TEST_P(ExpertSpillTest, LogitsMatchTransformersAndGreedyTokensMatch) {
  const SpillLayout& layout = GetParam();
  ASSERT_OK_AND_ASSIGN(GoldenModel golden, testing::LoadGoldenModel(layout.model));
  ModelOptions mo{.max_step_tokens = 64, .split_experts = layout.split_experts,
                  .layer_experts = layout.layer_experts};
  ASSERT_OK_AND_ASSIGN(Spilled s, MakeSpilled(golden.dir, layout.ranks, mo));
  const size_t v = static_cast<size_t>(s.executor->spec().vocab_size);
  int32_t seq = 0;
  for (const auto& c : golden.cases) {
    ASSERT_OK_AND_ASSIGN(StepResult r,
                         s.executor->Step({StepSequence{.block_ids = WholeContextBlocks(s.executor->options(), seq++),
                                                        .tokens = c.prompt_ids,
                                                        .all_logits = true}}));
    ASSERT_EQ(r.logits[0].size(), c.prompt_ids.size() * v);
    for (size_t p = 0; p < c.prompt_ids.size(); ++p) {
      testing::ExpectLogitsClose(c.logits[p], r.logits[0].data() + p * v, absl::StrCat(layout.name, " position ", p));
    }
  }
  std::vector<GenerationRequest> reqs;
  for (const auto& c : golden.cases) {
    reqs.push_back({.prompt = c.prompt_ids, .max_tokens = static_cast<int32_t>(c.greedy_ids.size())});
  }
  ASSERT_OK_AND_ASSIGN(auto res, Generate(*s.executor, reqs));
  for (size_t i = 0; i < res.size(); ++i) EXPECT_EQ(res[i].tokens, golden.cases[i].greedy_ids) << layout.name;
  // Only the local experts are loaded: fewer bytes than the same layout with every expert local.
  ModelOptions all_local = mo;
  all_local.layer_experts.clear();
  all_local.remote_experts = nullptr;
  ASSERT_OK_AND_ASSIGN(Spilled full, MakeSpilled(golden.dir, layout.ranks, all_local,
                                                 std::make_unique<InProcessRemoteExperts>(nullptr)));
  size_t spilled_bytes = 0, full_bytes = 0;
  for (size_t b : s.executor->WeightBytesPerRank()) spilled_bytes += b;
  for (size_t b : full.executor->WeightBytesPerRank()) full_bytes += b;
  // The host holds whole experts in the ranks' formats: what the ranks saved, but where a rank's
  // slice of an MXFP4 expert keeps its down projection dequantized (16 columns of gpt_oss_mxfp4's
  // 32 are no whole scale block) and the host keeps the whole expert MXFP4. The memory model says
  // what a whole expert takes either way.
  const ModelSpec& spec = s.executor->spec();
  const size_t hosted = RemoteOf(layout.layer_experts).size();
  EXPECT_EQ(s.host->weight_bytes(),
            hosted * static_cast<size_t>(WholeExpertBytes(spec, WorkerWeightFormats(spec, false, Quantization::kNone))))
      << layout.name;
  if (spec.mxfp4.has_value() && layout.split_experts) {
    EXPECT_LT(s.host->weight_bytes(), full_bytes - spilled_bytes) << layout.name;
  } else {
    EXPECT_EQ(full_bytes - spilled_bytes, s.host->weight_bytes()) << layout.name;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, ExpertSpillTest,
    ::testing::Values(
        // qwen2_moe: 3 layers, 0 and 2 MoE, 8 experts, top-2, a shared expert.
        SpillLayout{"qwen2_moe", 1, false, {{0, {0, R, 0, R, R, 0, R, R}}, {2, {R, R, R, R, R, R, R, R}}},
                    "qwen2_moe_tp1_partial_and_whole_layer"},
        SpillLayout{"qwen2_moe", 2, false, {{2, {0, 1, R, R, R, R, R, R}}}, "qwen2_moe_tp2_last_layer_2_local"},
        SpillLayout{"qwen2_moe", 2, true, {{0, {0, 0, 0, R, R, R, R, 0}}}, "qwen2_moe_tp2_split_experts"},
        // mixtral: 2 layers, 4 experts, top-2.
        SpillLayout{"mixtral", 2, false, {{0, {1, R, R, 0}}, {1, {R, 0, 1, R}}}, "mixtral_tp2_both_layers"},
        SpillLayout{"mixtral", 4, false, {{1, {3, R, 0, R}}}, "mixtral_tp4_two_ranks_without_experts"},
        // qwen3_moe: 3 layers, 0 and 2 MoE, 8 experts, top-2, renormalised, no shared expert.
        SpillLayout{"qwen3_moe", 2, false, {{0, {0, R, 1, R, R, 0, R, 1}}, {2, {R, 1, 0, R, R, R, 1, R}}},
                    "qwen3_moe_tp2_both_layers"},
        // deepseek_v3: layer 0 dense, 1 and 2 MoE, 8 experts in 4 groups, top-2 of 2 groups,
        // sigmoid scores with bias correction, routed_scaling_factor, a shared expert.
        SpillLayout{"deepseek_v3", 2, false, {{1, {R, 0, R, 1, 1, R, 0, R}}, {2, {0, R, R, R, 1, R, R, 0}}},
                    "deepseek_v3_tp2_both_layers"},
        SpillLayout{"deepseek_v3_noqlora", 1, false, {{2, {R, 0, R, 0, R, 0, R, 0}}}, "deepseek_v3_noqlora_tp1"},
        // deepseek_v2: softmax routing within the best of 2 groups of 4, top-2, routed_scaling_factor 2;
        // deepseek_v2_lite: greedy softmax top-2, two shared experts.
        SpillLayout{"deepseek_v2", 2, false, {{1, {R, 0, R, 1, 1, R, 0, R}}, {2, {R, R, 0, 1, R, R, R, 0}}},
                    "deepseek_v2_tp2_both_layers"},
        SpillLayout{"deepseek_v2_lite", 2, true, {{2, {0, R, R, 0, R, 0, R, R}}}, "deepseek_v2_lite_tp2_split_experts"},
        // llama4: layers 1 and 3 MoE, 8 experts, top-2, routing weights on the experts' input (the
        // spilled rows are sent already weighted), a shared expert.
        SpillLayout{"llama4", 2, false, {{1, {R, 0, R, 1, 1, R, 0, R}}, {3, {0, R, R, R, 1, R, R, 0}}},
                    "llama4_tp2_both_layers"},
        SpillLayout{"llama4_multimodal", 2, true, {{1, {0, R, R, 0}}}, "llama4_multimodal_tp2_split_experts"},
        // gpt_oss: 4 layers, 4 experts, top-2, biased experts with the clamped SwiGLU (the host
        // applies both); gpt_oss_mxfp4: the host keeps its experts MXFP4 too, and split experts
        // keep their down bias on rank 0.
        SpillLayout{"gpt_oss", 2, false, {{0, {1, R, R, 0}}, {3, {R, 0, 1, R}}}, "gpt_oss_tp2_two_layers"},
        SpillLayout{"gpt_oss_mxfp4", 2, true, {{1, {0, R, R, 0}}}, "gpt_oss_mxfp4_tp2_split_experts"},
        // glm4_moe: DeepSeek-V3's routing in one group, 8 experts, top-2, a shared expert.
        SpillLayout{"glm4_moe", 2, false, {{1, {0, R, 1, R, R, 0, R, 1}}, {2, {R, R, 0, 1, R, R, 0, R}}},
                    "glm4_moe_tp2_both_layers"},
        // glm4_moe_lite: MLA, then the same routing on layers 0 and 2 (mlp_layer_types).
        SpillLayout{"glm4_moe_lite", 2, true, {{0, {0, R, R, 0, R, 0, R, R}}}, "glm4_moe_lite_tp2_split_experts"}),
    [](const auto& test_info) { return test_info.param.name; });

// An expert host quantizes like the stages (--quantize reaches it in its assignment): int8 experts
// computed remotely give the logits and tokens of the same int8 experts computed locally.
TEST(ExpertSpillInt8Test, Int8HostedExpertsMatchInt8LocalExperts) {
  ASSERT_OK_AND_ASSIGN(GoldenModel golden, testing::LoadGoldenModel("mixtral"));
  ModelOptions local{.max_step_tokens = 64, .quantize = Quantization::kInt8};
  ModelOptions spilled = local;
  spilled.layer_experts = {{0, {0, R, R, 0}}, {1, {R, 0, 0, R}}};
  ASSERT_OK_AND_ASSIGN(Spilled s, MakeSpilled(golden.dir, 1, spilled));
  ASSERT_OK_AND_ASSIGN(Spilled l, MakeSpilled(golden.dir, 1, local, std::make_unique<InProcessRemoteExperts>(nullptr)));
  // The host holds 4 int8 experts: w1 and w3 [32, 64] and w2 [64, 32] each.
  EXPECT_EQ(static_cast<int64_t>(s.host->weight_bytes()), 4 * (2 * Q8MatrixBytes(32, 64) + Q8MatrixBytes(64, 32)));
  for (const auto& c : golden.cases) {
    ASSERT_OK_AND_ASSIGN(StepResult rs, s.executor->Step({StepSequence{
                                            .block_ids = WholeContextBlocks(s.executor->options(), 0),
                                            .tokens = c.prompt_ids,
                                            .all_logits = true}}));
    ASSERT_OK_AND_ASSIGN(StepResult rl, l.executor->Step({StepSequence{
                                            .block_ids = WholeContextBlocks(l.executor->options(), 0),
                                            .tokens = c.prompt_ids,
                                            .all_logits = true}}));
    ASSERT_EQ(rs.logits[0].size(), rl.logits[0].size());
    for (size_t i = 0; i < rs.logits[0].size(); ++i) {
      ASSERT_NEAR(rs.logits[0][i], rl.logits[0][i], 1e-5f * (1.0f + std::fabs(rl.logits[0][i]))) << i;
    }
  }
}

// Fails the first `failures` calls, then asks the host.
class FlakyRemote final : public RemoteExperts {
 public:
  FlakyRemote(ExpertHost* host, int failures) : inner_(host), failures_(failures) {}
  std::unique_ptr<RemoteExpertCall> Start(int64_t layer, absl::Span<const ExpertRows> groups,
                                          absl::Span<const float> x, absl::Span<float> y) override {
    if (failures_.fetch_sub(1) > 0) {
      struct Failed final : RemoteExpertCall {
        absl::Status Wait() override { return absl::UnavailableError("host 10.0.0.9:7001 is unreachable"); }
      };
      return std::make_unique<Failed>();
    }
    return inner_.Start(layer, groups, x, y);
  }

 private:
  InProcessRemoteExperts inner_;
  std::atomic<int> failures_;
};

TEST(ExpertSpillErrorsTest, AFailingHostFailsTheStepAndTheGroupStaysUsable) {
  ASSERT_OK_AND_ASSIGN(GoldenModel golden, testing::LoadGoldenModel("mixtral"));
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(golden.dir));
  ASSERT_OK_AND_ASSIGN(auto ckpt, Checkpoint::Open(golden.dir));
  const std::map<int64_t, std::vector<int32_t>> placement{{0, {0, R, 1, R}}};
  ASSERT_OK_AND_ASSIGN(auto host,
                       ExpertHost::Create(spec, *ckpt, RemoteOf(placement), kernels::DeviceKind::kCpu, 1));
  ModelOptions mo{.max_step_tokens = 64, .layer_experts = placement};
  ASSERT_OK_AND_ASSIGN(Spilled s, MakeSpilled(golden.dir, 2, mo, std::make_unique<FlakyRemote>(host.get(), 1)));
  const auto& c = golden.cases[0];
  const StepSequence seq{.block_ids = WholeContextBlocks(s.executor->options(), 0), .tokens = c.prompt_ids,
                         .all_logits = true};
  EXPECT_THAT(s.executor->Step({seq}),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr("remote experts of layer 0: host 10.0.0.9:7001 is unreachable")));
  ASSERT_OK_AND_ASSIGN(StepResult r, s.executor->Step({seq}));
  const size_t v = static_cast<size_t>(spec.vocab_size);
  for (size_t p = 0; p < c.prompt_ids.size(); ++p) {
    testing::ExpectLogitsClose(c.logits[p], r.logits[0].data() + p * v, absl::StrCat("after the failure, position ", p));
  }
}

TEST(ExpertSpillErrorsTest, BadPlacementsNameTheProblem) {
  const std::string dir = "tests/golden/models/qwen2_moe";
  InProcessRemoteExperts nowhere(nullptr);
  auto make = [&](std::map<int64_t, std::vector<int32_t>> placement, RemoteExperts* remote, int ranks = 1) {
    ModelOptions mo{.max_step_tokens = 8, .layer_experts = std::move(placement), .remote_experts = remote};
    ExecutorOptions eo{.cpu_ranks = ranks, .model = mo};
    auto spec = LoadModelSpec(dir);
    auto ckpt = Checkpoint::Open(dir);
    return TpExecutor::Create(*spec, **ckpt, eo).status();
  };
  EXPECT_THAT(make({{1, {0, 0, 0, 0, 0, 0, 0, 0}}}, &nowhere),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 1, which is not a MoE layer")));
  EXPECT_THAT(make({{0, {0, 0}}}, &nowhere),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lists 2 experts; the model has 8")));
  EXPECT_THAT(make({{0, {0, 0, 0, 2, 0, 0, 0, 0}}}, &nowhere, 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("puts expert 3 on rank 2")));
  EXPECT_THAT(make({{0, {0, R, 0, 0, 0, 0, 0, 0}}}, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("remote experts but no way to call them")));
}

TEST(ExpertHostTest, RejectsWhatItCannotServe) {
  const std::string dir = "tests/golden/models/qwen2_moe";
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(dir));
  ASSERT_OK_AND_ASSIGN(auto ckpt, Checkpoint::Open(dir));
  const auto cpu = kernels::DeviceKind::kCpu;
  EXPECT_THAT(ExpertHost::Create(spec, *ckpt, {}, cpu, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at least one expert")));
  EXPECT_THAT(ExpertHost::Create(spec, *ckpt, {{1, 0, 0}}, cpu, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 1 is not a MoE layer")));
  EXPECT_THAT(ExpertHost::Create(spec, *ckpt, {{0, 8, 0}}, cpu, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expert 8 is outside [0, 8)")));
  EXPECT_THAT(ExpertHost::Create(spec, *ckpt, {{0, 3, 0}, {0, 3, 1}}, cpu, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("listed twice")));
  ASSERT_OK_AND_ASSIGN(auto host, ExpertHost::Create(spec, *ckpt, {{0, 3, 0}, {2, 5, 1}}, cpu, 1));
  EXPECT_EQ(host->num_experts(), 2);
  const int64_t h = spec.hidden_size;
  std::vector<float> x(static_cast<size_t>(3 * h), 0.5f), y(x.size());
  const std::vector<ExpertRows> groups{{3, 2}, {5, 1}};
  EXPECT_THAT(host->Compute(0, groups, x, absl::MakeSpan(y)),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("does not host expert 5 of layer 0")));
  EXPECT_THAT(host->Compute(0, {{3, 2}}, x, absl::MakeSpan(y)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2 rows of 64 values; x has 192")));
  EXPECT_THAT(host->Compute(0, {{3, 0}}, {}, {}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("0 rows")));
  ASSERT_THAT(host->Compute(0, {{3, 3}}, x, absl::MakeSpan(y)), IsOk());
  // Identical inputs give identical rows, and the expert is not the identity.
  for (int64_t i = 0; i < h; ++i) {
    EXPECT_EQ(y[static_cast<size_t>(i)], y[static_cast<size_t>(2 * h + i)]);
  }
  EXPECT_NE(y[0], 0.5f);
}

}  // namespace
}  // namespace shardserve::engine

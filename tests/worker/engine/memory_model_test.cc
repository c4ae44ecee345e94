// The memory model (common/plan/memory_model.h) against what the engine really allocates: for
// every golden checkpoint (f32, bf16, FP8; dense, MoE and multi-head latent attention; tied and
// untied) and random f16 / bf16 ones, at tp 1 and 2, unquantized and int8, with expert parallelism,
// split experts and explicit placements (remote experts included), for whole models and pipeline
// stages, the bytes the model predicts per rank equal, exactly, the weight and KV cache bytes each
// rank allocates (Model::weight_bytes and kv_cache_bytes, counted by the loader and the cache
// allocation, not by the memory model). Checked three ways: the engine's own figures
// (TpExecutor::MemoryPerRank), the memory model evaluated as the planner does (from the stage and
// WorkerWeightFormats alone), and the planner's plans (MakePlan's predicted bytes per rank).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/model_spec/model_spec.h"
#include "common/plan/memory_model.h"
#include "common/plan/plan.h"
#include "common/safetensors/safetensors.h"
#include "coordinator/planner/planner.h"
#include "tests/testing/golden.h"
#include "tests/testing/random_model.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "worker/engine/executor.h"
#include "worker/engine/model.h"
#include "worker/engine/remote_experts.h"
#include "worker/engine/weights.h"
#include "worker/kernels/registry.h"

namespace shardserve::engine {
namespace {

constexpr int64_t kBlockSize = 8;
constexpr int64_t kBlocks = 5;

// Never called: the tests only load models (a placement with remote experts needs one).
class NoRemoteExperts final : public RemoteExperts {
 public:
  std::unique_ptr<RemoteExpertCall> Start(int64_t, absl::Span<const ExpertRows>, absl::Span<const float>,
                                          absl::Span<float>) override {
    return nullptr;
  }
};

struct Layout {
  int tp = 1;
  int64_t layer_begin = 0;
  int64_t layer_end = 0;
  Quantization quantize = Quantization::kNone;
  KvCacheFormat kv_cache = KvCacheFormat::kAuto;
  bool split_experts = false;
  std::map<int64_t, std::vector<int32_t>> layer_experts;  // ModelOptions::layer_experts
};

std::string Describe(const std::string& label, const Layout& l) {
  return absl::StrCat(label, " tp=", l.tp, " layers [", l.layer_begin, ", ", l.layer_end, ") ",
                      QuantizationName(l.quantize), " kv ", KvCacheFormatName(l.kv_cache),
                      l.split_experts ? " split experts" : "",
                      l.layer_experts.empty() ? "" : " explicit placement");
}

absl::StatusOr<std::unique_ptr<TpExecutor>> Load(const ModelSpec& spec, const Checkpoint& ckpt, const Layout& l,
                                                 RemoteExperts* remote) {
  ExecutorOptions eo;
  eo.cpu_ranks = l.tp;
  eo.model.layer_begin = l.layer_begin;
  eo.model.layer_end = l.layer_end;
  eo.model.max_seq_len = std::min<int64_t>(32, spec.max_position_embeddings);
  eo.model.num_kv_blocks = kBlocks;
  eo.model.kv_block_size = kBlockSize;
  eo.model.max_step_tokens = 16;
  eo.model.quantize = l.quantize;
  eo.model.kv_cache = l.kv_cache;
  eo.model.split_experts = l.split_experts;
  eo.model.layer_experts = l.layer_experts;
  eo.model.remote_experts = remote;
  return TpExecutor::Create(spec, ckpt, eo);
}

// The routed experts rank `rank` holds in MoE layer `layer`, counted here from the placement (the
// test's own reading of ModelOptions, not the engine's).
int64_t LocalExperts(const ModelSpec& spec, const Layout& l, bool expert_parallel, int64_t layer, int rank) {
  const auto it = l.layer_experts.find(layer);
  if (it == l.layer_experts.end()) return DefaultLocalExperts(spec, l.tp, rank, expert_parallel);
  int64_t n = 0;
  for (int32_t owner : it->second) n += owner != kRemoteExpert && (!expert_parallel || owner == rank) ? 1 : 0;
  return n;
}

// Loads `l` and compares every rank's allocation with the memory model.
void ExpectPredictedEqualsAllocated(const ModelSpec& spec, const Checkpoint& ckpt, const Layout& l,
                                    const std::string& label) {
  SCOPED_TRACE(Describe(label, l));
  NoRemoteExperts remote;
  ASSERT_OK_AND_ASSIGN(auto ex, Load(spec, ckpt, l, &remote));
  const std::vector<size_t> weights = ex->WeightBytesPerRank();
  const std::vector<size_t> kv = ex->KvCacheBytesPerRank();
  const std::vector<RankMemory> engine = ex->MemoryPerRank();
  ASSERT_EQ(weights.size(), static_cast<size_t>(l.tp));
  const WeightFormats planned = WorkerWeightFormats(spec, /*cuda=*/false, l.quantize, l.kv_cache);
  const bool ep = IsExpertParallel(spec, l.tp, l.split_experts);
  for (int r = 0; r < l.tp; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    const int64_t got_weights = static_cast<int64_t>(weights[static_cast<size_t>(r)]);
    const int64_t got_kv = static_cast<int64_t>(kv[static_cast<size_t>(r)]);
    // The engine's own prediction (its formats, its placement).
    EXPECT_EQ(engine[static_cast<size_t>(r)].Weights(), got_weights);
    EXPECT_EQ(engine[static_cast<size_t>(r)].KvBytes(kBlocks, kBlockSize), got_kv);
    // The memory model from the stage alone, with the formats the planner assumes for CPU ranks.
    RankShard shard{.layer_begin = l.layer_begin,
                    .layer_end = l.layer_end,
                    .has_embedding = l.layer_begin == 0,
                    .has_lm_head = l.layer_end == spec.num_layers,
                    .tp = l.tp,
                    .rank = r,
                    .expert_parallel = ep};
    for (int64_t layer = l.layer_begin; layer < l.layer_end; ++layer) {
      if (spec.IsSparseLayer(layer)) shard.local_experts[layer] = LocalExperts(spec, l, ep, layer, r);
    }
    const RankMemory m = RankMemoryOf(spec, shard, planned);
    EXPECT_EQ(m.Weights(), got_weights) << "matrices " << m.matrices << ", experts " << m.experts << ", norms/biases "
                                        << m.norms_biases << ", embedding " << m.embedding << ", lm_head "
                                        << m.lm_head;
    EXPECT_EQ(m.KvBytes(kBlocks, kBlockSize), got_kv);
    EXPECT_EQ(KvBytesPerBlock(spec, l.layer_end - l.layer_begin, l.tp, kBlockSize, planned) * kBlocks, got_kv);
  }
}

// The planner's stages (pp = 1 and 2 on workers of `tp` CPU devices) loaded as the cluster would
// assign them: each stage's predicted rank-0 weight bytes and KV bytes per token are its rank 0's.
void ExpectPlansMatch(const ModelSpec& spec, const Checkpoint& ckpt, int tp, Quantization q,
                      const std::string& label) {
  for (int pp = 1; pp <= std::min<int64_t>(2, spec.num_layers); ++pp) {
    SCOPED_TRACE(absl::StrCat(label, " plan tp=", tp, " pp=", pp, " ", QuantizationName(q)));
    std::vector<WorkerInventory> workers;
    for (int w = 0; w < pp; ++w) {
      WorkerInventory wi{absl::StrCat("w", w), "node", {}};
      for (int d = 0; d < tp; ++d) wi.devices.push_back({DeviceKind::kCpu, d, int64_t{1} << 32, int64_t{1} << 31});
      workers.push_back(std::move(wi));
    }
    PlanPolicy policy;
    policy.tp = tp;
    policy.pp = pp;
    policy.replicas = 1;
    policy.quantize = q;
    policy.max_seq_len = std::min<int64_t>(32, spec.max_position_embeddings);
    ASSERT_OK_AND_ASSIGN(Plan plan, MakePlan(spec, workers, policy));
    for (const StageSpec& st : plan.replicas[0].stages) {
      const Layout l{.tp = tp, .layer_begin = st.layer_begin, .layer_end = st.layer_end, .quantize = q};
      ASSERT_OK_AND_ASSIGN(auto ex, Load(spec, ckpt, l, nullptr));
      EXPECT_EQ(st.predicted_weight_bytes_per_rank, static_cast<int64_t>(ex->WeightBytesPerRank()[0]))
          << "layers [" << st.layer_begin << ", " << st.layer_end << ")";
      ASSERT_GT(st.kv_tokens, 0);
      EXPECT_EQ(st.kv_bytes_per_rank, st.kv_tokens * ex->MemoryPerRank()[0].kv_bytes_per_token);
      EXPECT_EQ(st.kv_bytes_per_rank / st.kv_tokens * kBlocks * kBlockSize,
                static_cast<int64_t>(ex->KvCacheBytesPerRank()[0]));
    }
  }
}

// Every layout of `dir`'s model this suite checks.
void CheckModel(const std::string& dir, const std::string& label) {
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(dir));
  ASSERT_OK_AND_ASSIGN(auto ckpt, Checkpoint::Open(dir));
  ASSERT_OK_AND_ASSIGN(auto backend, kernels::CreateBackend({}));
  const int64_t layers = spec.num_layers, half = std::max<int64_t>(1, layers / 2);
  for (Quantization q : {Quantization::kNone, Quantization::kInt8}) {
    // The planner's formats for CPU ranks are the engine's, with either KV cache format.
    EXPECT_EQ(WorkerWeightFormats(spec, false, q), EngineWeightFormats(spec, *backend, q)) << label;
    if (!spec.IsMla()) {
      const WeightFormats fp8_kv = WorkerWeightFormats(spec, false, q, KvCacheFormat::kFp8E4M3);
      EXPECT_EQ(fp8_kv, EngineWeightFormats(spec, *backend, q, KvCacheFormat::kFp8E4M3)) << label;
      EXPECT_EQ(fp8_kv.kv_bytes, 1) << label;
      // The whole model on one rank with an FP8 cache: a quarter of the f32 cache's bytes.
      ExpectPredictedEqualsAllocated(
          spec, *ckpt, {.layer_begin = 0, .layer_end = layers, .quantize = q, .kv_cache = KvCacheFormat::kFp8E4M3},
          label);
    } else {
      // Multi-head latent attention keeps its latent cache as it is: an FP8 one is refused by name.
      EXPECT_THAT(Load(spec, *ckpt, {.layer_begin = 0, .layer_end = layers, .kv_cache = KvCacheFormat::kFp8E4M3},
                       nullptr),
                  testing::StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("latent")))
          << label;
    }
    // An expert host keeps whole experts (the planner's spilled-expert bytes).
    for (int64_t layer = 0; layer < layers && spec.IsMoe(); ++layer) {
      if (!spec.IsSparseLayer(layer)) continue;
      size_t bytes = 0;
      ASSERT_OK_AND_ASSIGN(MlpWeights expert, LoadExpert(spec, layer, 0, *ckpt, *backend, &bytes, q));
      EXPECT_EQ(static_cast<int64_t>(bytes), WholeExpertBytes(spec, WorkerWeightFormats(spec, false, q))) << label;
      break;
    }
    for (int tp : {1, 2}) {
      if (!ValidateTensorParallelSize(spec, tp).ok()) continue;
      std::vector<std::pair<int64_t, int64_t>> ranges = {{0, layers}};
      if (layers >= 2) {
        ranges.emplace_back(0, half);
        ranges.emplace_back(half, layers);
      }
      for (const auto& [begin, end] : ranges) {
        ExpectPredictedEqualsAllocated(spec, *ckpt, {.tp = tp, .layer_begin = begin, .layer_end = end, .quantize = q},
                                       label);
        if (IsExpertParallel(spec, tp) && spec.moe.expert_intermediate_size % tp == 0) {
          ExpectPredictedEqualsAllocated(
              spec, *ckpt, {.tp = tp, .layer_begin = begin, .layer_end = end, .quantize = q, .split_experts = true},
              label);
        }
      }
      ExpectPlansMatch(spec, *ckpt, tp, q, label);
    }
  }
}

class GoldenMemoryTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenMemoryTest, PredictedBytesAreAllocatedBytes) {
  CheckModel(absl::StrCat("tests/golden/models/", GetParam()), GetParam());
}

INSTANTIATE_TEST_SUITE_P(AllGolden, GoldenMemoryTest, ::testing::ValuesIn(testing::GoldenModelNames()));

// Random checkpoints for the formats and shapes the golden ones lack: f16 (CPU ranks widen its
// matrices, keep its embedding, widen a tied one), bf16 MoE, tied embeddings with an MoE, and KV
// heads replicated over the ranks.
TEST(RandomMemoryTest, F16AndBf16TiedDenseAndMoe) {
  for (bool f16 : {false, true}) {
    for (int64_t experts : {0, 4}) {
      testing::TempDir dir;
      testing::RandomLlamaShape shape{.vocab = 96, .hidden = 32, .intermediate = 48, .layers = 3, .heads = 4,
                                      .kv_heads = 1, .max_positions = 64, .tied = true, .bf16 = !f16, .f16 = f16,
                                      .experts = experts};
      ASSERT_THAT(testing::WriteRandomLlama(dir.path(), shape, 7), testing::IsOk());
      CheckModel(dir.path(), absl::StrCat(f16 ? "f16" : "bf16", experts > 0 ? " moe" : " dense", " tied"));
    }
  }
}

// Explicit expert placements: an uneven owner list and per-layer placements with remote experts,
// expert parallel and split.
TEST(PlacementMemoryTest, ExplicitAndRemoteExperts) {
  const std::string dir = "tests/golden/models/mixtral";
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(dir));
  ASSERT_OK_AND_ASSIGN(auto ckpt, Checkpoint::Open(dir));
  ASSERT_TRUE(spec.IsMoe());
  ASSERT_GE(spec.moe.num_experts, 4);
  const int64_t n = spec.moe.num_experts;
  std::vector<int32_t> uneven, spilled;  // expert 0 on rank 0, the rest on rank 1; every third remote
  for (int64_t e = 0; e < n; ++e) {
    uneven.push_back(e == 0 ? 0 : 1);
    spilled.push_back(e % 3 == 0 ? kRemoteExpert : static_cast<int32_t>(e % 2));
  }
  for (Quantization q : {Quantization::kNone, Quantization::kInt8}) {
    for (bool split : {false, true}) {
      Layout l{.tp = 2, .layer_begin = 0, .layer_end = spec.num_layers, .quantize = q, .split_experts = split};
      l.layer_experts[0] = uneven;
      if (spec.num_layers > 1) l.layer_experts[spec.num_layers - 1] = spilled;
      ExpectPredictedEqualsAllocated(spec, *ckpt, l, "mixtral");
    }
    Layout one{.tp = 1, .layer_begin = 0, .layer_end = spec.num_layers, .quantize = q};
    one.layer_experts[0] = spilled;
    for (int32_t& owner : one.layer_experts[0]) owner = owner == kRemoteExpert ? kRemoteExpert : 0;
    ExpectPredictedEqualsAllocated(spec, *ckpt, one, "mixtral");
  }
}

// On a CUDA device (skipped without one): the formats the planner assumes for CUDA workers are
// the engine's there, and one rank's allocation is the memory model's, for f32, bf16, f16 and FP8
// checkpoints (FP8 kept as codes + scales; per block and per tensor). MLA does not run on CUDA: the
// planner counts its kv_b_proj as if CUDA's HeadLinear took the checkpoint's dtype, the engine
// (which refuses MLA there) as f32, so head_linear_bytes is left out of the comparison.
TEST(CudaMemoryTest, PredictedBytesAreAllocatedBytesOnTheDevice) {
  if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  testing::TempDir f16_dir;
  ASSERT_THAT(testing::WriteRandomLlama(f16_dir.path(),
                                        {.vocab = 96, .hidden = 32, .intermediate = 48, .layers = 2, .heads = 4,
                                         .kv_heads = 2, .max_positions = 64, .f16 = true, .experts = 4},
                                        7),
              testing::IsOk());
  for (const std::string& dir : {std::string("tests/golden/models/llama"), std::string("tests/golden/models/mixtral"),
                                std::string("tests/golden/models/llama_bf16_sharded"),
                                std::string("tests/golden/models/llama_fp8_block"),
                                std::string("tests/golden/models/llama_fp8_tensor"),
                                std::string("tests/golden/models/gpt_oss_mxfp4"), f16_dir.path()}) {
    SCOPED_TRACE(dir);
    ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(dir));
    ASSERT_OK_AND_ASSIGN(auto ckpt, Checkpoint::Open(dir));
    ASSERT_OK_AND_ASSIGN(auto backend, kernels::CreateBackend({.kind = kernels::DeviceKind::kCuda}));
    const WeightFormats planned = WorkerWeightFormats(spec, /*cuda=*/true, Quantization::kNone);
    const auto engine_formats = [&](Quantization q) {
      WeightFormats f = EngineWeightFormats(spec, *backend, q);
      f.head_linear_bytes = planned.head_linear_bytes;
      return f;
    };
    EXPECT_EQ(planned, engine_formats(Quantization::kNone));
    EXPECT_EQ(WorkerWeightFormats(spec, true, Quantization::kInt8), engine_formats(Quantization::kInt8));
    EXPECT_EQ(planned.fp8, spec.fp8.has_value());
    ExecutorOptions eo{.kind = kernels::DeviceKind::kCuda, .cuda_devices = {0}};
    eo.model.max_seq_len = std::min<int64_t>(32, spec.max_position_embeddings);
    eo.model.num_kv_blocks = kBlocks;
    eo.model.kv_block_size = kBlockSize;
    eo.model.max_step_tokens = 16;
    ASSERT_OK_AND_ASSIGN(auto ex, TpExecutor::Create(spec, *ckpt, eo));
    const RankShard shard{.layer_begin = 0, .layer_end = spec.num_layers, .has_embedding = true, .has_lm_head = true};
    const RankMemory m = RankMemoryOf(spec, shard, planned);
    EXPECT_EQ(m.Weights(), static_cast<int64_t>(ex->WeightBytesPerRank()[0]));
    EXPECT_EQ(m.KvBytes(kBlocks, kBlockSize), static_cast<int64_t>(ex->KvCacheBytesPerRank()[0]));
  }
}

}  // namespace
}  // namespace shardserve::engine

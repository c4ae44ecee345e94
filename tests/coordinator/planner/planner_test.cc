#include "coordinator/planner/planner.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/model_spec/model_spec.h"
#include "common/plan/plan.h"
#include "tests/coordinator/planner/model_100m.h"
#include "tests/testing/status_matchers.h"

namespace shardserve {
namespace {

using ::shardserve::testing::IsOk;
using ::shardserve::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int64_t kMB = 1'000'000;
constexpr int64_t kGB = 1'000'000'000;

// ---- Models ---------------------------------------------------------------------------------

using ::shardserve::testing::k100MKvBytesPerToken;
using ::shardserve::testing::k100MWeightBytes;
using ::shardserve::testing::Model100M;

ModelSpec Parse(const std::string& json) {
  absl::StatusOr<ModelSpec> spec = ParseModelSpec(json, "test config");
  EXPECT_THAT(spec, IsOk());
  return spec.ok() ? *spec : ModelSpec{};
}

// Mixtral-like: 4 layers of 8 experts (top-2), 53 MB per layer, 6.3 MB per expert, 216 MB in all.
ModelSpec Mixtral() {
  return Parse(R"({"architectures": ["MixtralForCausalLM"], "vocab_size": 1000, "hidden_size": 512,
    "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
    "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 256})");
}
constexpr int64_t kMixtralExpertBytes = 3 * 512 * 1024 * 4;

// Qwen2-MoE-like: 6 layers, the first 3 dense, the last 3 with 8 experts + a shared expert.
ModelSpec QwenMoe() {
  return Parse(R"({"architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 1000, "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 4,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "mlp_only_layers": [0, 1, 2], "max_position_embeddings": 128})");
}

// ---- Workers --------------------------------------------------------------------------------

WorkerInventory Worker(const std::string& id, int64_t free_bytes, int devices = 1, DeviceKind kind = DeviceKind::kCpu) {
  WorkerInventory w{id, "node-" + id, {}};
  for (int i = 0; i < devices; ++i) w.devices.push_back({kind, i, free_bytes + kGB, free_bytes});
  return w;
}

// ---- Invariants every plan must satisfy -------------------------------------------------------

int64_t Room(const std::vector<WorkerInventory>& workers, const PlanPolicy& policy, const std::string& id,
             DeviceKind kind, int device) {
  for (const WorkerInventory& w : workers) {
    if (w.worker_id != id) continue;
    for (const Device& d : w.devices) {
      if (d.kind == kind && d.index == device) return d.free_bytes - policy.reserve_bytes_per_device;
    }
  }
  ADD_FAILURE() << "no device " << id << ":" << device;
  return 0;
}

void ExpectWellFormed(const ModelSpec& spec, const std::vector<WorkerInventory>& workers, const PlanPolicy& policy,
                      const Plan& plan) {
  ASSERT_FALSE(plan.replicas.empty());
  std::set<std::string> stage_workers;
  std::map<std::string, const StageSpec*> stage_of;
  for (const Pipeline& p : plan.replicas) {
    ASSERT_FALSE(p.stages.empty());
    int64_t next = 0;
    double shares = 0.0;
    for (size_t s = 0; s < p.stages.size(); ++s) {
      const StageSpec& st = p.stages[s];
      EXPECT_TRUE(stage_workers.insert(st.worker_id).second) << st.worker_id << " hosts two stages";
      stage_of[st.worker_id] = &st;
      EXPECT_EQ(st.layer_begin, next);
      EXPECT_LT(st.layer_begin, st.layer_end);
      next = st.layer_end;
      EXPECT_EQ(st.has_embedding, s == 0);
      EXPECT_EQ(st.has_lm_head, s + 1 == p.stages.size());
      EXPECT_EQ(static_cast<size_t>(st.tp), st.devices.size());
      EXPECT_TRUE(std::is_sorted(st.devices.begin(), st.devices.end()));
      EXPECT_EQ(st.kv_tokens, p.stages.front().kv_tokens) << "KV capacity differs within a pipeline";
      EXPECT_GE(st.kv_tokens, plan.max_seq_len);
      for (int d : st.devices) {
        EXPECT_LE(st.predicted_weight_bytes_per_rank + st.kv_bytes_per_rank,
                  Room(workers, policy, st.worker_id, st.device_kind, d))
            << st.worker_id << " overcommitted";
      }
      shares += st.cost_share;
    }
    EXPECT_EQ(next, spec.num_layers);
    EXPECT_NEAR(shares, 1.0, 1e-9);
    // Experts: every MoE layer once, every expert placed once.
    std::vector<int64_t> moe_layers, want;
    for (int64_t l = 0; l < spec.num_layers; ++l) {
      if (spec.IsSparseLayer(l)) want.push_back(l);
    }
    for (const LayerExperts& le : p.experts) {
      moe_layers.push_back(le.layer);
      ASSERT_EQ(static_cast<int64_t>(le.experts.size()), spec.moe.num_experts);
      const StageSpec* owner = nullptr;
      for (const StageSpec& st : p.stages) {
        if (le.layer >= st.layer_begin && le.layer < st.layer_end) owner = &st;
      }
      ASSERT_NE(owner, nullptr);
      for (const ExpertLocation& e : le.experts) {
        EXPECT_EQ(e.remote, e.worker_id != owner->worker_id);
        if (!e.remote) {
          ASSERT_LT(e.rank, owner->tp);
          EXPECT_EQ(e.device, owner->devices[static_cast<size_t>(e.rank)]);
        }
      }
    }
    EXPECT_EQ(moe_layers, want);
  }
  int64_t hosted = 0, remote = 0;
  for (const Pipeline& p : plan.replicas) remote += p.NumRemoteExperts();
  for (const ExpertHostSpec& h : plan.expert_hosts) {
    EXPECT_EQ(stage_workers.count(h.worker_id), 0u) << h.worker_id << " hosts a stage and experts";
    EXPECT_LE(h.predicted_weight_bytes, Room(workers, policy, h.worker_id, h.device_kind, h.device));
    hosted += h.num_experts;
  }
  EXPECT_EQ(hosted, remote);
}

// Plans and checks the invariants.
absl::StatusOr<Plan> PlanAndCheck(const ModelSpec& spec, const std::vector<WorkerInventory>& workers,
                                  const PlanPolicy& policy = {}) {
  absl::StatusOr<Plan> plan = MakePlan(spec, workers, policy);
  if (plan.ok()) ExpectWellFormed(spec, workers, policy, *plan);
  return plan;
}

std::vector<int64_t> LayerCounts(const Pipeline& p) {
  std::vector<int64_t> n;
  for (const StageSpec& st : p.stages) n.push_back(st.layer_end - st.layer_begin);
  return n;
}

// ---- Whole model on one worker ----------------------------------------------------------------

TEST(PlannerTest, SingleCpuWorkerRunsTheWholeModel) {
  ASSERT_OK_AND_ASSIGN(const Plan plan, PlanAndCheck(Model100M(), {Worker("w0", 2 * kGB)}));
  ASSERT_EQ(plan.replicas.size(), 1u);
  ASSERT_EQ(plan.replicas[0].stages.size(), 1u);
  const StageSpec& st = plan.replicas[0].stages[0];
  EXPECT_EQ(st.worker_id, "w0");
  EXPECT_EQ(st.node_name, "node-w0");
  EXPECT_EQ(st.layer_begin, 0);
  EXPECT_EQ(st.layer_end, 12);
  EXPECT_TRUE(st.has_embedding);
  EXPECT_TRUE(st.has_lm_head);
  EXPECT_EQ(st.tp, 1);
  EXPECT_EQ(st.device_kind, DeviceKind::kCpu);
  EXPECT_THAT(st.devices, ElementsAre(0));
  EXPECT_EQ(st.predicted_weight_bytes_per_rank, k100MWeightBytes);
  // kv_fraction 0.9 of what the weights leave.
  const int64_t tokens = static_cast<int64_t>(0.9 * static_cast<double>(2 * kGB - k100MWeightBytes) /
                                              static_cast<double>(k100MKvBytesPerToken));
  EXPECT_EQ(st.kv_tokens, tokens);
  EXPECT_EQ(st.kv_bytes_per_rank, tokens * k100MKvBytesPerToken);
  EXPECT_DOUBLE_EQ(st.cost_share, 1.0);
  EXPECT_EQ(plan.max_seq_len, 1024);
  EXPECT_TRUE(plan.replicas[0].experts.empty());
  EXPECT_TRUE(plan.expert_hosts.empty());
}

TEST(PlannerTest, WeightsMatchNumParametersForEveryArchitecture) {
  for (const ModelSpec& spec : {Model100M(), Mixtral(), QwenMoe()}) {
    ASSERT_OK_AND_ASSIGN(const Plan plan, PlanAndCheck(spec, {Worker("w0", 4 * kGB)}));
    EXPECT_EQ(plan.replicas[0].stages[0].predicted_weight_bytes_per_rank, spec.NumParameters() * 4)
        << ArchitectureName(spec.arch);
  }
}

TEST(PlannerTest, BytesPerParamFollowTheCheckpointDtypeAndNormsStayF32) {
  // A bf16 checkpoint: matrices and embedding at 2 bytes, the 2 norms per layer and the final norm
  // at 4 (the loader keeps them f32), the KV cache at 4 (f32 cache).
  ModelSpec bf16 = Model100M();
  bf16.dtype = DType::kBF16;
  const int64_t norms = 768 + 12 * 2 * 768;
  const int64_t want = (bf16.NumParameters() - norms) * 2 + norms * 4;
  EXPECT_EQ(WeightBytesPerParam(bf16, {Worker("w0", 4 * kGB)}), 2);
  ASSERT_OK_AND_ASSIGN(const Plan plan, PlanAndCheck(bf16, {Worker("w0", 4 * kGB)}));
  const StageSpec& st = plan.replicas[0].stages[0];
  EXPECT_EQ(st.predicted_weight_bytes_per_rank, want);
  EXPECT_EQ(st.kv_bytes_per_rank, st.kv_tokens * k100MKvBytesPerToken);
  // An explicit policy says the same for the f32 model's shapes.
  PlanPolicy two;
  two.bytes_per_param = 2;
  ASSERT_OK_AND_ASSIGN(const Plan explicit_plan, PlanAndCheck(Model100M(), {Worker("w0", 4 * kGB)}, two));
  EXPECT_EQ(explicit_plan.replicas[0].stages[0].predicted_weight_bytes_per_rank, want);
  // f16: CUDA devices hold it as f16; CPU ranks widen the matrices to f32.
  ModelSpec f16 = Model100M();
  f16.dtype = DType::kF16;
  EXPECT_EQ(WeightBytesPerParam(f16, {Worker("w0", 4 * kGB)}), 4);
  WorkerInventory gpu = Worker("g0", 4 * kGB);
  for (Device& d : gpu.devices) d.kind = DeviceKind::kCuda;
  EXPECT_EQ(WeightBytesPerParam(f16, {gpu}), 2);
  EXPECT_EQ(WeightBytesPerParam(f16, {gpu, Worker("w0", 4 * kGB)}), 4);
  EXPECT_EQ(WeightBytesPerParam(Model100M(), {gpu}), 4);  // no dtype in config.json: f32
  // The KV cache: 16-bit where every worker is a GPU worker.
  EXPECT_EQ(KvBytesPerElement(bf16, {gpu}), 2);
  EXPECT_EQ(KvBytesPerElement(f16, {gpu}), 2);
  EXPECT_EQ(KvBytesPerElement(bf16, {Worker("w0", 4 * kGB)}), 4);
  EXPECT_EQ(KvBytesPerElement(Model100M(), {gpu}), 4);
  ASSERT_OK_AND_ASSIGN(const Plan on_gpu, PlanAndCheck(bf16, {gpu}));
  const StageSpec& g = on_gpu.replicas[0].stages[0];
  EXPECT_EQ(g.kv_bytes_per_rank, g.kv_tokens * k100MKvBytesPerToken / 2);
  // An FP8 cache (--kv_cache_dtype=fp8_e4m3): 1 byte per element on either kind of worker, so the
  // same memory holds twice the GPU's bf16 tokens.
  EXPECT_EQ(KvBytesPerElement(bf16, {gpu}, KvCacheFormat::kFp8E4M3), 1);
  EXPECT_EQ(KvBytesPerElement(Model100M(), {Worker("w0", 4 * kGB)}, KvCacheFormat::kFp8E4M3), 1);
  PlanPolicy fp8_kv;
  fp8_kv.kv_cache = KvCacheFormat::kFp8E4M3;
  ASSERT_OK_AND_ASSIGN(const Plan fp8_plan, PlanAndCheck(bf16, {gpu}, fp8_kv));
  const StageSpec& q = fp8_plan.replicas[0].stages[0];
  EXPECT_EQ(q.kv_bytes_per_rank, q.kv_tokens * k100MKvBytesPerToken / 4);
  EXPECT_GE(q.kv_tokens, 2 * g.kv_tokens - 1) << "twice the tokens in the same memory";
}

TEST(PlannerTest, AnFp8KvCacheIsRefusedForMultiHeadLatentAttention) {
  ASSERT_OK_AND_ASSIGN(const ModelSpec mla, LoadModelSpec("tests/golden/models/deepseek_v2_lite"));
  ASSERT_TRUE(mla.IsMla());
  PlanPolicy policy;
  policy.kv_cache = KvCacheFormat::kFp8E4M3;
  EXPECT_THAT(MakePlan(mla, {Worker("w0", 4 * kGB)}, policy),
              StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("kv_cache"), HasSubstr("latent"))));
}

TEST(PlannerTest, Fp8CheckpointsArePlannedAtTheBytesTheyAreHeldIn) {
  // FP8 checkpoints declare torch_dtype bfloat16. CPU ranks hold their F8_E4M3 matrices as bf16: 2
  // bytes per parameter, norms at 4 (what tensor_parallel_test.cc's
  // Fp8MatricesAreHeldAsBf16OnTheCpuBackend measures on a rank). CUDA ranks keep them as 1-byte
  // codes plus their f32 scale blocks; the embedding and the unconverted lm_head stay bf16.
  ASSERT_OK_AND_ASSIGN(const ModelSpec fp8, LoadModelSpec("tests/golden/models/llama_fp8_block"));
  ASSERT_TRUE(fp8.fp8.has_value());
  WorkerInventory gpu = Worker("g0", 4 * kGB);
  for (Device& d : gpu.devices) d.kind = DeviceKind::kCuda;
  EXPECT_EQ(WeightBytesPerParam(fp8, {Worker("w0", 4 * kGB)}), 2);
  EXPECT_EQ(WeightBytesPerParam(fp8, {gpu}), 1);
  EXPECT_EQ(KvBytesPerElement(fp8, {gpu}), 2);
  const int64_t norms = fp8.hidden_size * (1 + 2 * fp8.num_layers);
  ASSERT_OK_AND_ASSIGN(const Plan plan, PlanAndCheck(fp8, {Worker("w0", 4 * kGB)}));
  EXPECT_EQ(plan.replicas[0].stages[0].predicted_weight_bytes_per_rank,
            (fp8.NumParameters() - norms) * 2 + norms * 4);
  // 32 x 32 scale blocks per layer, counted by hand: q [64, 64] 2 x 2, k and v [32, 64] 1 x 2 each,
  // o [64, 64] 2 x 2, gate and up [80, 64] 3 x 2 each, down [64, 80] 2 x 3: 30 blocks.
  const int64_t tables = 2 * fp8.vocab_size * fp8.hidden_size;  // embedding + lm_head, bf16
  const int64_t projections = fp8.NumParameters() - norms - tables;
  ASSERT_OK_AND_ASSIGN(const Plan on_gpu, PlanAndCheck(fp8, {gpu}));
  EXPECT_EQ(on_gpu.replicas[0].stages[0].predicted_weight_bytes_per_rank,
            projections * 1 + fp8.num_layers * 30 * 4 + tables * 2 + norms * 4);
}

TEST(PlannerTest, TiedEmbeddingIsSharedOnlyOnASingleRankThatHoldsBoth) {
  ModelSpec spec = Model100M();
  spec.tie_word_embeddings = true;
  const int64_t embedding = 32000 * 768 * 4;
  ASSERT_OK_AND_ASSIGN(const Plan one, PlanAndCheck(spec, {Worker("w0", 2 * kGB)}));
  EXPECT_EQ(one.replicas[0].stages[0].predicted_weight_bytes_per_rank, spec.NumParameters() * 4);
  PlanPolicy two_stages;
  two_stages.pp = 2;
  ASSERT_OK_AND_ASSIGN(const Plan two, PlanAndCheck(spec, {Worker("a", 2 * kGB), Worker("b", 2 * kGB)}, two_stages));
  const auto& st = two.replicas[0].stages;
  EXPECT_EQ(st[0].predicted_weight_bytes_per_rank + st[1].predicted_weight_bytes_per_rank,
            spec.NumParameters() * 4 + embedding);
  // With tp > 1 the vocab-parallel lm_head is separate from the (replicated) embedding.
  PlanPolicy tp2;
  tp2.tp = 2;
  ModelSpec untied = spec;
  untied.tie_word_embeddings = false;
  ASSERT_OK_AND_ASSIGN(const Plan tied2, PlanAndCheck(spec, {Worker("a", 2 * kGB, 2)}, tp2));
  ASSERT_OK_AND_ASSIGN(const Plan untied2, PlanAndCheck(untied, {Worker("a", 2 * kGB, 2)}, tp2));
  EXPECT_EQ(tied2.replicas[0].stages[0].predicted_weight_bytes_per_rank,
            untied2.replicas[0].stages[0].predicted_weight_bytes_per_rank);
}

TEST(PlannerTest, ReserveIsTakenFromEveryDevice) {
  PlanPolicy policy;
  policy.reserve_bytes_per_device = 500 * kMB;
  ASSERT_OK_AND_ASSIGN(const Plan plan, PlanAndCheck(Model100M(), {Worker("w0", 2 * kGB)}, policy));
  const int64_t tokens = static_cast<int64_t>(0.9 * static_cast<double>(1500 * kMB - k100MWeightBytes) /
                                              static_cast<double>(k100MKvBytesPerToken));
  EXPECT_EQ(plan.replicas[0].stages[0].kv_tokens, tokens);
}

// ---- Replicas vs stages -----------------------------------------------------------------------

TEST(PlannerTest, TwoWorkersThatEachFitGiveTwoReplicas) {
  ASSERT_OK_AND_ASSIGN(const Plan plan, PlanAndCheck(Model100M(), {Worker("b", 2 * kGB), Worker("a", 2 * kGB)}));
  ASSERT_EQ(plan.replicas.size(), 2u);
  ASSERT_EQ(plan.replicas[0].stages.size(), 1u);
  ASSERT_EQ(plan.replicas[1].stages.size(), 1u);
  EXPECT_EQ(plan.replicas[0].stages[0].worker_id, "a");
  EXPECT_EQ(plan.replicas[1].stages[0].worker_id, "b");
}

TEST(PlannerTest, TwoWorkersThatDoNotFitAloneGiveTwoStages) {
  // 400 MB each: the model needs 536 MB of weights, each half about 300 MB with its KV.
  ASSERT_OK_AND_ASSIGN(const Plan plan, PlanAndCheck(Model100M(), {Worker("b", 400 * kMB), Worker("a", 400 * kMB)}));
  ASSERT_EQ(plan.replicas.size(), 1u);
  const Pipeline& p = plan.replicas[0];
  ASSERT_EQ(p.stages.size(), 2u);
  EXPECT_EQ(p.stages[0].worker_id, "a");  // stages in worker_id order
  EXPECT_EQ(p.stages[1].worker_id, "b");
  EXPECT_EQ(p.stages[0].layer_end, p.stages[1].layer_begin);
}

TEST(PlannerTest, ExplicitReplicasOneUsesTheLargestWorker) {
  PlanPolicy policy;
  policy.replicas = 1;
  ASSERT_OK_AND_ASSIGN(const Plan plan,
                       PlanAndCheck(Model100M(), {Worker("a", 1 * kGB), Worker("b", 3 * kGB)}, policy));
  ASSERT_EQ(plan.replicas.size(), 1u);
  ASSERT_EQ(plan.replicas[0].stages.size(), 1u);
  EXPECT_EQ(plan.replicas[0].stages[0].worker_id, "b");
}

TEST(PlannerTest, FourSmallWorkersGiveTwoReplicasOfTwoStagesWithSimilarCapacity) {
  // Largest first, dealt snake-wise: {w1, w4} and {w2, w3}.
  const std::vector<WorkerInventory> workers = {Worker("w1", 500 * kMB), Worker("w2", 450 * kMB),
                                                Worker("w3", 400 * kMB), Worker("w4", 350 * kMB)};
  ASSERT_OK_AND_ASSIGN(const Plan plan, PlanAndCheck(Model100M(), workers));
  ASSERT_EQ(plan.replicas.size(), 2u);
  ASSERT_EQ(plan.replicas[0].stages.size(), 2u);
  EXPECT_EQ(plan.replicas[0].stages[0].worker_id, "w1");
  EXPECT_EQ(plan.replicas[0].stages[1].worker_id, "w4");
  EXPECT_EQ(plan.replicas[1].stages[0].worker_id, "w2");
  EXPECT_EQ(plan.replicas[1].stages[1].worker_id, "w3");
}

TEST(PlannerTest, ExplicitReplicasAndStages) {
  PlanPolicy policy;
  policy.replicas = 2;
  policy.pp = 2;
  std::vector<WorkerInventory> workers;
  for (const char* id : {"a", "b", "c", "d", "e"}) workers.push_back(Worker(id, 2 * kGB));
  ASSERT_OK_AND_ASSIGN(const Plan plan, PlanAndCheck(Model100M(), workers, policy));
  ASSERT_EQ(plan.replicas.size(), 2u);
  EXPECT_EQ(plan.replicas[0].stages.size(), 2u);
  EXPECT_EQ(plan.replicas[1].stages.size(), 2u);
}

TEST(PlannerTest, AutoReplicasUseEveryWorkerThatFits) {
  std::vector<WorkerInventory> workers = {Worker("a", 2 * kGB), Worker("b", 2 * kGB), Worker("c", 2 * kGB),
                                          Worker("tiny", 100 * kMB)};
  ASSERT_OK_AND_ASSIGN(const Plan plan, PlanAndCheck(Model100M(), workers));
  ASSERT_EQ(plan.replicas.size(), 3u);
  for (const Pipeline& p : plan.replicas) EXPECT_NE(p.stages[0].worker_id, "tiny");
}

// ---- Layer ranges and balance -------------------------------------------------------------------

TEST(PlannerTest, ExplicitThreeStagesCoverEveryLayerOnce) {
  PlanPolicy policy;
  policy.pp = 3;
  ASSERT_OK_AND_ASSIGN(
      const Plan plan,
      PlanAndCheck(Model100M(), {Worker("c", 2 * kGB), Worker("a", 2 * kGB), Worker("b", 2 * kGB)}, policy));
  ASSERT_EQ(plan.replicas.size(), 1u);
  const Pipeline& p = plan.replicas[0];
  ASSERT_EQ(p.stages.size(), 3u);
  std::vector<int> covered(12, 0);
  for (const StageSpec& st : p.stages) {
    for (int64_t l = st.layer_begin; l < st.layer_end; ++l) ++covered[static_cast<size_t>(l)];
  }
  EXPECT_EQ(covered, std::vector<int>(12, 1));
  EXPECT_EQ(p.stages[0].layer_begin, 0);
  EXPECT_EQ(p.stages[2].layer_end, 12);
  EXPECT_TRUE(p.stages[0].has_embedding && !p.stages[1].has_embedding && !p.stages[2].has_embedding);
  EXPECT_TRUE(!p.stages[0].has_lm_head && !p.stages[1].has_lm_head && p.stages[2].has_lm_head);
}

TEST(PlannerTest, UniformLayersAreSplitEvenly) {
  ModelSpec spec = Model100M();
  spec.vocab_size = 16;  // negligible embedding and lm_head: only the layers count
  std::vector<WorkerInventory> workers;
  for (const char* id : {"a", "b", "c", "d", "e"}) workers.push_back(Worker(id, 2 * kGB));
  PlanPolicy policy;
  policy.pp = 3;
  ASSERT_OK_AND_ASSIGN(const Plan three, PlanAndCheck(spec, workers, policy));
  EXPECT_THAT(LayerCounts(three.replicas[0]), ElementsAre(4, 4, 4));
  for (const StageSpec& st : three.replicas[0].stages) EXPECT_NEAR(st.cost_share, 1.0 / 3, 1e-3);

  policy.pp = 5;  // 12 layers do not split evenly: the stages differ by at most one layer
  ASSERT_OK_AND_ASSIGN(const Plan five, PlanAndCheck(spec, workers, policy));
  const std::vector<int64_t> n = LayerCounts(five.replicas[0]);
  EXPECT_LE(*std::max_element(n.begin(), n.end()) - *std::min_element(n.begin(), n.end()), 1);
  double lo = 1.0, hi = 0.0;
  for (const StageSpec& st : five.replicas[0].stages) {
    lo = std::min(lo, st.cost_share);
    hi = std::max(hi, st.cost_share);
  }
  EXPECT_LE(hi - lo, 1.0 / 12 + 1e-3);  // within one layer's share
}

TEST(PlannerTest, The100MModelIsBalancedByCostNotLayerCount) {
  // The last stage carries the lm_head's reads (1.5 layers' worth; it runs on one position per
  // sequence, so no prefill FLOPs); the first stage's embedding is a lookup and costs nothing per
  // step: 7 + 5 layers balance best (0.518 / 0.482; 8 + 4 would be 0.592 / 0.408).
  PlanPolicy policy;
  policy.pp = 2;
  ASSERT_OK_AND_ASSIGN(const Plan plan,
                       PlanAndCheck(Model100M(), {Worker("a", 2 * kGB), Worker("b", 2 * kGB)}, policy));
  EXPECT_THAT(LayerCounts(plan.replicas[0]), ElementsAre(7, 5));
  const auto& st = plan.replicas[0].stages;
  EXPECT_NEAR(st[0].cost_share, 0.518, 0.005);
  EXPECT_NEAR(st[1].cost_share, 0.482, 0.005);
}

TEST(PlannerTest, HugeEmbeddingCostsTheFirstStageMemoryNotTime) {
  ModelSpec spec = Model100M();
  spec.vocab_size = 256000;  // 786 MB embedding, 786 MB lm_head
  PlanPolicy policy;
  policy.pp = 3;
  // With room to spare the embedding does not take layers from the first stage; the lm_head
  // (about 12 layers' worth of work) leaves the last stage the fewest.
  ASSERT_OK_AND_ASSIGN(const Plan roomy, PlanAndCheck(spec, {Worker("a", 4 * kGB), Worker("b", 4 * kGB),
                                                             Worker("c", 4 * kGB)},
                                                      policy));
  std::vector<int64_t> n = LayerCounts(roomy.replicas[0]);
  EXPECT_EQ(n[2], 1);
  EXPECT_GE(n[0], 5);
  // When the first worker can hold only the embedding and a few layers, memory decides.
  ASSERT_OK_AND_ASSIGN(const Plan tight, PlanAndCheck(spec, {Worker("a", 880 * kMB), Worker("b", 4 * kGB),
                                                             Worker("c", 4 * kGB)},
                                                      policy));
  EXPECT_EQ(tight.replicas[0].stages[0].worker_id, "a");
  n = LayerCounts(tight.replicas[0]);
  EXPECT_LE(n[0], 3);
}

TEST(PlannerTest, MemoryOverridesBalance) {
  // Stage 0 ("a") has room for the embedding and 4 layers only.
  PlanPolicy policy;
  policy.pp = 2;
  ASSERT_OK_AND_ASSIGN(const Plan plan,
                       PlanAndCheck(Model100M(), {Worker("a", 250 * kMB), Worker("b", 2 * kGB)}, policy));
  EXPECT_THAT(LayerCounts(plan.replicas[0]), ElementsAre(4, 8));
}

TEST(PlannerTest, MoeLayersWeighMoreThanDenseOnes) {
  // Layers 0-2 dense, 3-5 MoE (8 experts, top-2): the dense layers go together.
  PlanPolicy policy;
  policy.pp = 2;
  ASSERT_OK_AND_ASSIGN(const Plan plan, PlanAndCheck(QwenMoe(), {Worker("a", kGB), Worker("b", kGB)}, policy));
  const std::vector<int64_t> n = LayerCounts(plan.replicas[0]);
  EXPECT_GT(n[0], n[1]);
  EXPECT_GE(n[0], 4);
}

// ---- Tensor parallel ----------------------------------------------------------------------------

ModelSpec TwoKvHeads() {
  ModelSpec s;
  s.vocab_size = 1000;
  s.hidden_size = 512;
  s.intermediate_size = 1024;
  s.num_layers = 4;
  s.num_heads = 8;
  s.num_kv_heads = 2;
  s.head_dim = 64;
  s.max_position_embeddings = 256;
  return s;
}

TEST(PlannerTest, TpFourWithTwoKvHeadsReplicatesKvHeads) {
  PlanPolicy policy;
  policy.tp = 4;
  ASSERT_OK_AND_ASSIGN(const Plan plan, PlanAndCheck(TwoKvHeads(), {Worker("g", kGB, 4, DeviceKind::kCuda)}, policy));
  const StageSpec& st = plan.replicas[0].stages[0];
  EXPECT_EQ(st.tp, 4);
  EXPECT_EQ(st.device_kind, DeviceKind::kCuda);
  EXPECT_THAT(st.devices, ElementsAre(0, 1, 2, 3));
  // Per rank: 2 query heads, 1 (replicated) kv head, a quarter of the MLP, the whole embedding and
  // a quarter of the (vocab-parallel) lm_head.
  const int64_t layer = 2 * 512 + 512 * 128 + 2 * 512 * 64 + 128 * 512 + 3 * 512 * 256;
  EXPECT_EQ(st.predicted_weight_bytes_per_rank, (4 * layer + 1000 * 512 + 512 + 250 * 512) * 4);
  EXPECT_EQ(st.kv_bytes_per_rank, st.kv_tokens * 2 * 64 * 4 * 4);  // 1 kv head x 4 layers
}

TEST(PlannerTest, TpThreeWithFourHeadsIsInvalid) {
  ModelSpec spec = TwoKvHeads();
  spec.num_heads = 4;
  spec.num_kv_heads = 4;
  PlanPolicy policy;
  policy.tp = 3;
  EXPECT_THAT(MakePlan(spec, {Worker("g", kGB, 4)}, policy),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("policy.tp"), HasSubstr("num_attention_heads (4)"))));
}

TEST(PlannerTest, AutoTpIsTheLargestValidSizeOnTheRoomiestDevices) {
  // 6 devices, 8 heads: tp 4, on the 4 devices with the most free memory.
  WorkerInventory w = Worker("g", kGB, 6, DeviceKind::kCuda);
  w.devices[1].free_bytes = 500 * kMB;
  w.devices[4].free_bytes = 600 * kMB;
  w.devices.push_back({DeviceKind::kCpu, 0, 64 * kGB, 64 * kGB});  // a worker with GPUs runs on them
  ASSERT_OK_AND_ASSIGN(const Plan plan, PlanAndCheck(TwoKvHeads(), {w}));
  const StageSpec& st = plan.replicas[0].stages[0];
  EXPECT_EQ(st.tp, 4);
  EXPECT_EQ(st.device_kind, DeviceKind::kCuda);
  EXPECT_THAT(st.devices, ElementsAre(0, 2, 3, 5));
}

TEST(PlannerTest, TpNeedsAWorkerWithThatManyDevices) {
  PlanPolicy policy;
  policy.tp = 4;
  EXPECT_THAT(MakePlan(TwoKvHeads(), {Worker("a", kGB, 2), Worker("b", kGB, 1)}, policy),
              StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("policy.tp"), HasSubstr("the most is 2"))));
}

// ---- Not enough memory ----------------------------------------------------------------------------

TEST(PlannerTest, ModelTooLargeSaysNeededAndAvailableBytes) {
  EXPECT_THAT(MakePlan(Model100M(), {Worker("a", 200 * kMB), Worker("b", 100 * kMB)}, {}),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("model needs"), HasSubstr(FormatBytes(k100MWeightBytes) + " weights"),
                             HasSubstr("1 sequence of 1024 tokens"), HasSubstr("300.0 MB free in total"))));
}

TEST(PlannerTest, EnoughMemoryInTotalButNoLayoutFits) {
  // Five workers of 300 MB: 1.5 GB in total. With pp fixed to 2, the first stage (98 MB
  // embedding + 35 MB per layer with its KV) holds at most 5 layers and so does the last (98 MB
  // lm_head): 12 layers do not fit. Three stages do.
  PlanPolicy policy;
  policy.pp = 2;
  std::vector<WorkerInventory> workers;
  for (const char* id : {"a", "b", "c", "d", "e"}) workers.push_back(Worker(id, 300 * kMB));
  EXPECT_THAT(MakePlan(Model100M(), workers, policy),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("1.5 GB free in total"), HasSubstr("no layout fits (tried pp 2)"))));
  policy.pp = 0;
  ASSERT_OK_AND_ASSIGN(const Plan plan, PlanAndCheck(Model100M(), workers, policy));
  EXPECT_EQ(plan.replicas[0].stages.size(), 3u);
}

TEST(PlannerTest, ExplicitReplicasThatDoNotFit) {
  PlanPolicy policy;
  policy.replicas = 2;
  EXPECT_THAT(MakePlan(Model100M(), {Worker("a", 2 * kGB), Worker("b", 400 * kMB)}, policy),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("per replica, x2 replicas")));
}

// ---- KV budget -----------------------------------------------------------------------------------

TEST(PlannerTest, KvTokensBudgetIsReservedOnEveryStage) {
  PlanPolicy policy;
  policy.kv_tokens = 4096;  // 302 MB of KV for the 12 layers
  ASSERT_OK_AND_ASSIGN(const Plan plan, PlanAndCheck(Model100M(), {Worker("a", kGB), Worker("b", kGB)}, policy));
  ASSERT_EQ(plan.replicas.size(), 2u);
  for (const Pipeline& p : plan.replicas) {
    for (const StageSpec& st : p.stages) {
      EXPECT_EQ(st.kv_tokens, 4096);
      EXPECT_EQ(st.kv_bytes_per_rank, 4096 * (st.layer_end - st.layer_begin) * 2 * 768 * 4);
    }
  }
  policy.kv_tokens = 100'000;  // 7.4 GB of KV
  EXPECT_THAT(MakePlan(Model100M(), {Worker("a", 2 * kGB)}, policy),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("100000 tokens (policy.kv_tokens)")));
}

TEST(PlannerTest, PipelineKvCapacityIsItsTightestStage) {
  PlanPolicy policy;
  policy.pp = 2;
  ASSERT_OK_AND_ASSIGN(const Plan plan,
                       PlanAndCheck(Model100M(), {Worker("a", 400 * kMB), Worker("b", 4 * kGB)}, policy));
  const StageSpec& a = plan.replicas[0].stages[0];
  const int64_t per_token = (a.layer_end - a.layer_begin) * 2 * 768 * 4;
  EXPECT_EQ(a.kv_tokens, static_cast<int64_t>(0.9 * static_cast<double>(400 * kMB - a.predicted_weight_bytes_per_rank) /
                                              static_cast<double>(per_token)));
}

TEST(PlannerTest, ShorterMaxSeqLenLetsTheModelFit) {
  // 560 MB: the weights fit, but not with the KV of a 1024-token sequence at kv_fraction 0.9.
  EXPECT_THAT(MakePlan(Model100M(), {Worker("a", 560 * kMB)}, {}),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("1024 tokens at kv_fraction 0.9")));
  PlanPolicy policy;
  policy.max_seq_len = 128;
  ASSERT_OK_AND_ASSIGN(const Plan plan, PlanAndCheck(Model100M(), {Worker("a", 560 * kMB)}, policy));
  EXPECT_EQ(plan.max_seq_len, 128);
}

// ---- Expert spill --------------------------------------------------------------------------------

TEST(PlannerTest, ExpertsThatDoNotFitSpillToAThirdWorker) {
  // Two stages of 90 MB cannot hold the 216 MB model; "c" (60 MB) hosts no stage and takes the
  // experts that do not fit.
  PlanPolicy policy;
  policy.pp = 2;
  const std::vector<WorkerInventory> workers = {Worker("a", 90 * kMB), Worker("b", 90 * kMB), Worker("c", 60 * kMB)};
  ASSERT_OK_AND_ASSIGN(const Plan plan, PlanAndCheck(Mixtral(), workers, policy));
  ASSERT_EQ(plan.replicas.size(), 1u);
  const Pipeline& p = plan.replicas[0];
  ASSERT_EQ(p.stages.size(), 2u);
  EXPECT_EQ(p.stages[0].worker_id, "a");
  EXPECT_EQ(p.stages[1].worker_id, "b");
  ASSERT_EQ(p.experts.size(), 4u);
  EXPECT_GT(p.NumRemoteExperts(), 0);
  for (const LayerExperts& le : p.experts) {
    bool seen_remote = false;
    for (const ExpertLocation& e : le.experts) {
      if (e.remote) {
        EXPECT_EQ(e.worker_id, "c");
      }
      EXPECT_FALSE(seen_remote && !e.remote) << "local experts are the lowest ids";
      seen_remote = seen_remote || e.remote;
    }
  }
  ASSERT_EQ(plan.expert_hosts.size(), 1u);
  EXPECT_EQ(plan.expert_hosts[0].worker_id, "c");
  EXPECT_EQ(plan.expert_hosts[0].num_experts, p.NumRemoteExperts());
  EXPECT_EQ(plan.expert_hosts[0].predicted_weight_bytes, p.NumRemoteExperts() * kMixtralExpertBytes);

  policy.allow_expert_spill = false;
  EXPECT_THAT(MakePlan(Mixtral(), workers, policy),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("216.0 MB")));
}

TEST(PlannerTest, AutoPrefersStagesOverSpill) {
  // Two workers of 150 MB hold the model as two stages: no expert leaves its stage.
  ASSERT_OK_AND_ASSIGN(const Plan plan, PlanAndCheck(Mixtral(), {Worker("a", 150 * kMB), Worker("b", 150 * kMB),
                                                                 Worker("c", 100 * kMB)}));
  EXPECT_EQ(plan.replicas[0].stages.size(), 2u);
  EXPECT_EQ(plan.replicas[0].NumRemoteExperts(), 0);
  EXPECT_TRUE(plan.expert_hosts.empty());
}

TEST(PlannerTest, AutoSpillsWhenWorkersCannotHoldWholeLayers) {
  // "c" (100 MB) cannot hold the two last MoE layers (106 MB) as a stage, but can hold experts:
  // one stage on "a" with 11 of its 32 experts on "c", taken from its last MoE layers.
  ASSERT_OK_AND_ASSIGN(const Plan plan, PlanAndCheck(Mixtral(), {Worker("a", 150 * kMB), Worker("c", 100 * kMB)}));
  ASSERT_EQ(plan.replicas.size(), 1u);
  const Pipeline& p = plan.replicas[0];
  ASSERT_EQ(p.stages.size(), 1u);
  EXPECT_EQ(p.stages[0].worker_id, "a");
  EXPECT_EQ(p.NumRemoteExperts(), 11);
  std::vector<int64_t> local;
  for (const LayerExperts& le : p.experts) {
    local.push_back(
        std::count_if(le.experts.begin(), le.experts.end(), [](const ExpertLocation& e) { return !e.remote; }));
  }
  EXPECT_THAT(local, ElementsAre(8, 8, 5, 0));
}

TEST(PlannerTest, RemoteExpertsAreBalancedOverHostDevices) {
  PlanPolicy policy;
  policy.pp = 1;
  // "a" (130 MB) hosts the stage; "h" (2 x 60 MB) and "i" (60 MB) cannot, and take 14 experts.
  ASSERT_OK_AND_ASSIGN(
      const Plan plan,
      PlanAndCheck(Mixtral(), {Worker("a", 130 * kMB), Worker("h", 60 * kMB, 2), Worker("i", 60 * kMB)}, policy));
  EXPECT_EQ(plan.replicas[0].stages[0].worker_id, "a");
  EXPECT_EQ(plan.replicas[0].NumRemoteExperts(), 14);
  ASSERT_EQ(plan.replicas.size(), 1u);
  ASSERT_EQ(plan.expert_hosts.size(), 3u);
  int64_t lo = INT64_MAX, hi = 0;
  for (const ExpertHostSpec& h : plan.expert_hosts) {
    lo = std::min(lo, h.num_experts);
    hi = std::max(hi, h.num_experts);
  }
  EXPECT_LE(hi - lo, 1);
  EXPECT_EQ(plan.expert_hosts[0].worker_id, "h");
  EXPECT_EQ(plan.expert_hosts[1].device, 1);
}

TEST(PlannerTest, TensorParallelStageSpreadsLocalExpertsOverRanks) {
  // 8 experts on 2 ranks: whole experts in contiguous blocks, as the engine places them.
  ASSERT_OK_AND_ASSIGN(const Plan plan, PlanAndCheck(Mixtral(), {Worker("g", kGB, 2, DeviceKind::kCuda)}));
  const Pipeline& p = plan.replicas[0];
  ASSERT_EQ(p.stages[0].tp, 2);
  EXPECT_TRUE(p.stages[0].expert_parallel);
  for (const LayerExperts& le : p.experts) {
    for (size_t e = 0; e < le.experts.size(); ++e) EXPECT_EQ(le.experts[e].rank, e < 4 ? 0 : 1);
  }
  // With tp = 1 there is nothing to spread.
  ASSERT_OK_AND_ASSIGN(const Plan one, PlanAndCheck(Mixtral(), {Worker("c", kGB)}));
  EXPECT_FALSE(one.replicas[0].stages[0].expert_parallel);
}

TEST(PlannerTest, FewerExpertsThanRanksAreSplit) {
  // 2 experts on 4 ranks: every expert is split over the ranks, like a dense MLP.
  ModelSpec spec = Mixtral();
  spec.moe.num_experts = 2;
  ASSERT_OK_AND_ASSIGN(const Plan plan, PlanAndCheck(spec, {Worker("g", kGB, 4, DeviceKind::kCuda)}));
  const StageSpec& st = plan.replicas[0].stages[0];
  ASSERT_EQ(st.tp, 4);
  EXPECT_FALSE(st.expert_parallel);
  const int64_t attn = 2 * 512 + 512 * 128 + 2 * 512 * 64 + 128 * 512;  // 2 q heads, 1 kv head
  const int64_t moe = 2 * 512 + 2 * 3 * 512 * 256;                      // router + 2 quarter experts
  EXPECT_EQ(st.predicted_weight_bytes_per_rank, (4 * (attn + moe) + 1000 * 512 + 512 + 250 * 512) * 4);
  for (const LayerExperts& le : plan.replicas[0].experts) {
    for (const ExpertLocation& e : le.experts) EXPECT_EQ(e.rank, 0);
  }
}

TEST(PlannerTest, SpillCountsTheExpertsOfTheMostLoadedRank) {
  // "g" has 2 ranks of 55 MB: each holds its non-expert share (8.4 MB) and 7 whole experts, i.e.
  // 14 of the stage's 32 experts, filling the first MoE layers; 18 go to "h" and "i".
  PlanPolicy policy;
  policy.pp = 1;
  ASSERT_OK_AND_ASSIGN(const Plan plan, PlanAndCheck(Mixtral(),
                                                     {Worker("g", 55 * kMB, 2, DeviceKind::kCuda),
                                                      Worker("h", 60 * kMB), Worker("i", 60 * kMB)},
                                                     policy));
  const Pipeline& p = plan.replicas[0];
  ASSERT_EQ(p.stages[0].worker_id, "g");
  ASSERT_EQ(p.stages[0].tp, 2);
  EXPECT_EQ(p.NumRemoteExperts(), 18);
  std::vector<int64_t> local;
  for (const LayerExperts& le : p.experts) {
    local.push_back(
        std::count_if(le.experts.begin(), le.experts.end(), [](const ExpertLocation& e) { return !e.remote; }));
  }
  EXPECT_THAT(local, ElementsAre(8, 6, 0, 0));
  EXPECT_EQ(p.experts[1].experts[5].rank, 1);
  EXPECT_EQ(p.experts[1].experts[5].device, 1);
  EXPECT_EQ(p.stages[0].predicted_weight_bytes_per_rank, 8'398'848 + 7 * kMixtralExpertBytes);
  ASSERT_EQ(plan.expert_hosts.size(), 2u);
  EXPECT_EQ(plan.expert_hosts[0].num_experts, 9);
  EXPECT_EQ(plan.expert_hosts[1].num_experts, 9);
}

// ---- Determinism -----------------------------------------------------------------------------------

TEST(PlannerTest, SameInputSameOutputWhateverTheWorkerOrder) {
  std::vector<WorkerInventory> workers = {Worker("w3", 400 * kMB), Worker("w1", 500 * kMB), Worker("w4", 350 * kMB),
                                          Worker("w2", 450 * kMB)};
  ASSERT_OK_AND_ASSIGN(const Plan first, MakePlan(Model100M(), workers, {}));
  ASSERT_OK_AND_ASSIGN(const Plan again, MakePlan(Model100M(), workers, {}));
  EXPECT_EQ(PlanToString(first), PlanToString(again));
  std::vector<WorkerInventory> reordered = workers;
  const auto by_id = [](const WorkerInventory& a, const WorkerInventory& b) { return a.worker_id < b.worker_id; };
  std::sort(reordered.begin(), reordered.end(), by_id);
  int permutations = 0;
  do {
    ++permutations;
    ASSERT_OK_AND_ASSIGN(const Plan plan, MakePlan(Model100M(), reordered, {}));
    EXPECT_EQ(PlanToString(plan), PlanToString(first));
  } while (std::next_permutation(reordered.begin(), reordered.end(), by_id));
  EXPECT_EQ(permutations, 24);

  const std::vector<WorkerInventory> moe = {Worker("c", 60 * kMB), Worker("b", 90 * kMB), Worker("a", 90 * kMB)};
  const std::vector<WorkerInventory> moe_sorted = {moe[2], moe[1], moe[0]};
  PlanPolicy policy;
  policy.pp = 2;
  ASSERT_OK_AND_ASSIGN(const Plan x, MakePlan(Mixtral(), moe, policy));
  ASSERT_OK_AND_ASSIGN(const Plan y, MakePlan(Mixtral(), moe_sorted, policy));
  EXPECT_EQ(PlanToString(x), PlanToString(y));
}

// ---- Invalid input ---------------------------------------------------------------------------------

TEST(PlannerTest, InvalidPolicyNamesTheField) {
  const std::vector<WorkerInventory> one = {Worker("a", 2 * kGB)};
  auto with = [](auto set) {
    PlanPolicy p;
    set(p);
    return p;
  };
  EXPECT_THAT(
      MakePlan(Model100M(), one, with([](PlanPolicy& p) { p.pp = 13; })),
      StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("policy.pp"), HasSubstr("num_hidden_layers (12)"))));
  EXPECT_THAT(MakePlan(Model100M(), one, with([](PlanPolicy& p) { p.pp = 2; })),
              StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("policy.pp"), HasSubstr("only 1"))));
  EXPECT_THAT(MakePlan(Model100M(), one, with([](PlanPolicy& p) { p.replicas = 2; })),
              StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("policy.replicas"), HasSubstr("only 1"))));
  EXPECT_THAT(MakePlan(Model100M(), one, with([](PlanPolicy& p) { p.tp = -1; })),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("policy.tp")));
  EXPECT_THAT(MakePlan(Model100M(), one, with([](PlanPolicy& p) { p.replicas = -1; })),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("policy.replicas")));
  EXPECT_THAT(MakePlan(Model100M(), one, with([](PlanPolicy& p) { p.kv_fraction = 0.0; })),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("policy.kv_fraction")));
  EXPECT_THAT(MakePlan(Model100M(), one, with([](PlanPolicy& p) { p.kv_fraction = 1.5; })),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("policy.kv_fraction")));
  EXPECT_THAT(MakePlan(Model100M(), one, with([](PlanPolicy& p) { p.kv_tokens = 100; })),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("policy.kv_tokens"), HasSubstr("max_seq_len (1024)"))));
  EXPECT_THAT(MakePlan(Model100M(), one, with([](PlanPolicy& p) { p.max_seq_len = 4096; })),
              StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("policy.max_seq_len"), HasSubstr("1024"))));
  EXPECT_THAT(MakePlan(Model100M(), one, with([](PlanPolicy& p) { p.bytes_per_param = -1; })),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("policy.bytes_per_param")));
  EXPECT_THAT(MakePlan(Model100M(), one, with([](PlanPolicy& p) { p.kv_bytes_per_element = 9; })),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("policy.kv_bytes_per_element")));
  EXPECT_THAT(MakePlan(Model100M(), one, with([](PlanPolicy& p) { p.reserve_bytes_per_device = -1; })),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("policy.reserve_bytes_per_device")));
}

TEST(PlannerTest, InvalidInventory) {
  EXPECT_THAT(MakePlan(Model100M(), {Worker("a", kGB), Worker("a", kGB)}, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("duplicate worker_id \"a\"")));
  EXPECT_THAT(MakePlan(Model100M(), {Worker("", kGB)}, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty worker_id")));
  WorkerInventory twice = Worker("a", kGB, 2);
  twice.devices[1].index = 0;
  EXPECT_THAT(MakePlan(Model100M(), {twice}, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("device cpu:0 is listed twice")));
  WorkerInventory over = Worker("a", kGB);
  over.devices[0].free_bytes = over.devices[0].total_bytes + 1;
  EXPECT_THAT(MakePlan(Model100M(), {over}, {}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("free_bytes")));
}

TEST(PlannerTest, NoDevicesIsAFailedPrecondition) {
  EXPECT_THAT(MakePlan(Model100M(), {}, {}), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no worker")));
  EXPECT_THAT(MakePlan(Model100M(), {Worker("a", kGB, 0)}, {}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("1 workers registered")));
}

TEST(PlannerTest, InconsistentSpecIsInvalid) {
  ModelSpec spec = Mixtral();
  spec.moe.sparse_layers.pop_back();
  EXPECT_THAT(MakePlan(spec, {Worker("a", kGB)}, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("sparse_layers")));
  ModelSpec no_layers = Model100M();
  no_layers.num_layers = 0;
  EXPECT_THAT(MakePlan(no_layers, {Worker("a", kGB)}, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_hidden_layers")));
}

TEST(PipelineKvBlocksTest, TheTightestStageInWholeBlocksButAlwaysOneSequence) {
  Pipeline p;
  p.stages.resize(2);
  p.stages[0].kv_tokens = 1000;
  p.stages[1].kv_tokens = 700;
  EXPECT_EQ(PipelineKvBlocks(p, 100, 16).value_or(-1), 43);  // floor(700 / 16)
  EXPECT_EQ(PipelineKvBlocks(p, 700, 16).value_or(-1), 44);  // ceil(700 / 16): one whole sequence
  p.stages[1].kv_tokens = int64_t{1} << 40;
  p.stages[0].kv_tokens = int64_t{1} << 40;
  EXPECT_EQ(PipelineKvBlocks(p, 100, 1).value_or(-1), (int64_t{1} << 31) - 1);  // block ids are int32
  EXPECT_THAT(PipelineKvBlocks(p, 100, 0), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("block size")));
  EXPECT_THAT(PipelineKvBlocks(Pipeline{}, 100, 16),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no stages")));
}

}  // namespace
}  // namespace shardserve

// Loading FP8 checkpoints (F8_E4M3 matrices with scales, ModelSpec::fp8): the engine holds what a
// BF16 checkpoint of the dequantized weights would give it, for dense and MoE layers, every
// tensor-parallel and expert layout and LoadExpert; and loading errors name the tensor. (The golden
// FP8 models check the numbers against an independent reference: golden_test.cc and
// tensor_parallel_test.cc.)
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/model_spec/model_spec.h"
#include "common/safetensors/safetensors.h"
#include "common/tensor/dtype.h"
#include "nlohmann/json.hpp"
#include "common/plan/memory_model.h"
#include "tests/testing/engine_fixtures.h"
#include "tests/testing/golden.h"
#include "tests/testing/recording_backend.h"
#include "tests/testing/safetensors_file.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "worker/comm/host/host_communicator.h"
#include "worker/engine/executor.h"
#include "worker/engine/generator.h"
#include "worker/engine/model.h"
#include "worker/engine/weights.h"
#include "worker/kernels/registry.h"

namespace shardserve::engine {
namespace {

using ::shardserve::testing::ReadFileOrEmpty;
using ::shardserve::testing::StatusIs;
using ::shardserve::testing::StoredTensor;
using ::shardserve::testing::TempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr char kFp8Dir[] = "tests/golden/models/llama_fp8_block";

absl::StatusOr<std::unique_ptr<TpExecutor>> MakeExecutor(const ModelSpec& spec, const std::string& dir, int ranks,
                                                         bool split_experts = false) {
  auto ckpt = Checkpoint::Open(dir);
  if (!ckpt.ok()) return ckpt.status();
  ExecutorOptions eo;
  eo.cpu_ranks = ranks;
  eo.model.max_step_tokens = 64;
  eo.model.split_experts = split_experts;
  return TpExecutor::Create(spec, **ckpt, eo);
}

// ---------------------------------------------------------------- errors name the tensor

absl::Status LoadOneRank(const ModelSpec& spec, const std::string& dir) {
  auto ckpt = Checkpoint::Open(dir);
  if (!ckpt.ok()) return ckpt.status();
  auto backend = kernels::CreateBackend({});
  if (!backend.ok()) return backend.status();
  return Model::Create(spec, **ckpt, backend->get(), {}).status();
}

TEST(Fp8LoadErrorsTest, Fp8WeightsWithoutTheQuantizationConfigAreRejectedByName) {
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(kFp8Dir));
  spec.fp8.reset();  // config.json without quantization_config: the stored dtype disagrees
  EXPECT_THAT(LoadOneRank(spec, kFp8Dir),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor \"model.layers.0.self_attn.q_proj.weight\" is stored as F8_E4M3 but "
                                 "config.json declares dtype BF16")));
  spec.dtype.reset();  // and without torch_dtype: nothing says how to scale it
  EXPECT_THAT(LoadOneRank(spec, kFp8Dir),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("FP8 weight \"model.layers.0.self_attn.q_proj.weight\" is stored as F8_E4M3 but "
                                 "config.json has no quantization_config")));
}

TEST(Fp8LoadErrorsTest, BlockSizeThatDisagreesWithTheScalesNamesWeightAndScales) {
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(kFp8Dir));
  spec.fp8->block_rows = 16;
  EXPECT_THAT(LoadOneRank(spec, kFp8Dir),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("FP8 weight \"model.layers.0.self_attn.q_proj.weight\" [64, 64] has scale tensor "
                                 "\"model.layers.0.self_attn.q_proj.weight_scale_inv\" of shape [2, 2]; "
                                 "weight_block_size [16, 32] needs [4, 2]")));
}

// Writes into `dir` a copy of the golden llama_fp8_block (or `src`) whose tensors `edit` changes.
void WriteEditedCopy(const TempDir& dir, const std::function<void(std::vector<StoredTensor>&)>& edit,
                     const std::string& src = kFp8Dir) {
  dir.Write("config.json", ReadFileOrEmpty(src + "/config.json"));
  auto tensors = testing::ReadSafetensorsFile(src + "/model.safetensors");
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  edit(*tensors);
  dir.Write("model.safetensors", testing::SafetensorsFile(*tensors));
}

StoredTensor& Find(std::vector<StoredTensor>& tensors, const std::string& name) {
  for (StoredTensor& t : tensors) {
    if (t.name == name) return t;
  }
  ADD_FAILURE() << "no tensor " << name;
  return tensors.front();
}

TEST(Fp8LoadErrorsTest, CorruptScalesAndCodesAreNamedFromTheRankThatReadsThem) {
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(kFp8Dir));
  {
    // down_proj [64, 80] has [2, 3] scales; a zero in the last column block.
    TempDir dir;
    WriteEditedCopy(dir, [](std::vector<StoredTensor>& t) {
      std::string& b = Find(t, "model.layers.1.mlp.down_proj.weight_scale_inv").bytes;
      std::memset(b.data() + 5 * sizeof(float), 0, sizeof(float));
    });
    EXPECT_THAT(MakeExecutor(spec, dir.path(), 2),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("FP8 weight \"model.layers.1.mlp.down_proj.weight\" has scale 0 at block [1, 2] in "
                                   "\"model.layers.1.mlp.down_proj.weight_scale_inv\"")));
  }
  {
    // A NaN code in row 50 of up_proj [80, 64]: in the rows [40, 80) that rank 1 of 2 reads.
    TempDir dir;
    WriteEditedCopy(dir, [](std::vector<StoredTensor>& t) {
      Find(t, "model.layers.1.mlp.up_proj.weight").bytes[50 * 64 + 7] = '\x7f';
    });
    EXPECT_THAT(MakeExecutor(spec, dir.path(), 2),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("rank 1 of 2"), HasSubstr("FP8 weight \"model.layers.1.mlp.up_proj.weight\" holds "
                                                              "a NaN code (0x7f or 0xff) at [50, 7]"))));
  }
  {
    TempDir dir;
    WriteEditedCopy(dir, [](std::vector<StoredTensor>& t) {
      std::erase_if(t, [](const StoredTensor& x) { return x.name == "model.layers.0.self_attn.k_proj.weight_scale_inv"; });
    });
    EXPECT_THAT(MakeExecutor(spec, dir.path(), 2),
                StatusIs(absl::StatusCode::kNotFound,
                         HasSubstr("FP8 weight \"model.layers.0.self_attn.k_proj.weight\" has no scale tensor "
                                   "\"model.layers.0.self_attn.k_proj.weight_scale_inv\"")));
  }
}

// ---------------------------------------------------------------- FP8 == BF16 of its dequantized weights

// Blocks of 24 output x 20 input features: not square (a row/column mix-up changes the answer),
// ragged in every matrix of the tiny Mixtral (64 = 24 + 24 + 16, 32 = 24 + 8, 64 = 3 x 20 + 4), and
// cut by every tensor-parallel slice (q rows at 32, k/v rows at 16, expert columns at 16).
constexpr int64_t kBlockRows = 24, kBlockCols = 20;

// The e4m3 code nearest to x (|x| <= 448), by search over every finite code.
uint8_t NearestE4M3(float x) {
  uint8_t best = 0;
  for (int c = 0; c < 256; ++c) {
    const float v = E4M3ToFloat(static_cast<uint8_t>(c));
    if (!std::isnan(v) && std::fabs(v - x) < std::fabs(E4M3ToFloat(best) - x)) best = static_cast<uint8_t>(c);
  }
  return best;
}

bool IsQuantized(const std::string& name) {
  return absl::EndsWith(name, "_proj.weight") || name == "lm_head.weight" ||
         (absl::StrContains(name, ".experts.") && absl::EndsWith(name, ".weight"));
}

// Writes into `fp8_dir` the golden mixtral with every projection, expert matrix and the lm_head
// block-quantized to F8_E4M3 (scales amax / 448), and into `bf16_dir` the same checkpoint with those
// matrices replaced by BF16 of their dequantized values, rounded as the loader rounds them (f32
// product, then bf16 to nearest even); into `f32_dir` (when given) F32 of the dequantized values.
// Everything else stays F32 in all; no config declares a dtype.
void WriteFp8AndBf16Twin(const TempDir& fp8_dir, const TempDir& bf16_dir, const TempDir* f32_dir = nullptr) {
  const std::string src = "tests/golden/models/mixtral";
  auto config = nlohmann::json::parse(ReadFileOrEmpty(src + "/config.json"));
  config.erase("dtype");
  bf16_dir.Write("config.json", config.dump(2));
  if (f32_dir != nullptr) f32_dir->Write("config.json", config.dump(2));
  config["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {kBlockRows, kBlockCols}}};
  fp8_dir.Write("config.json", config.dump(2));
  auto tensors = testing::ReadSafetensorsFile(src + "/model.safetensors");
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  std::vector<StoredTensor> fp8, bf16, f32;
  int quantized = 0;
  for (const StoredTensor& t : *tensors) {
    if (!IsQuantized(t.name)) {
      fp8.push_back(t);
      bf16.push_back(t);
      f32.push_back(t);
      continue;
    }
    ++quantized;
    ASSERT_EQ(t.dtype, "F32") << t.name;
    const int64_t rows = t.shape[0], cols = t.shape[1];
    const int64_t grid_rows = (rows + kBlockRows - 1) / kBlockRows, grid_cols = (cols + kBlockCols - 1) / kBlockCols;
    std::vector<float> w(static_cast<size_t>(rows * cols));
    std::memcpy(w.data(), t.bytes.data(), t.bytes.size());
    std::vector<float> scales(static_cast<size_t>(grid_rows * grid_cols));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        float& s = scales[static_cast<size_t>((r / kBlockRows) * grid_cols + c / kBlockCols)];
        s = std::max(s, std::fabs(w[static_cast<size_t>(r * cols + c)]) / 448.f);
      }
    }
    std::string codes(static_cast<size_t>(rows * cols), '\0');
    std::vector<uint16_t> held(static_cast<size_t>(rows * cols));
    std::vector<float> exact(static_cast<size_t>(rows * cols));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const size_t i = static_cast<size_t>(r * cols + c);
        const float s = scales[static_cast<size_t>((r / kBlockRows) * grid_cols + c / kBlockCols)];
        const uint8_t code = NearestE4M3(std::min(w[i] / s, 448.f));
        codes[i] = static_cast<char>(code);
        exact[i] = E4M3ToFloat(code) * s;
        held[i] = FloatToBFloat16(exact[i]);
      }
    }
    fp8.push_back({t.name, "F8_E4M3", t.shape, codes});
    fp8.push_back({t.name + "_scale_inv", "F32", {grid_rows, grid_cols}, testing::F32Bytes(scales)});
    bf16.push_back({t.name, "BF16", t.shape, std::string(reinterpret_cast<const char*>(held.data()), held.size() * 2)});
    f32.push_back({t.name, "F32", t.shape, testing::F32Bytes(exact)});
  }
  ASSERT_EQ(quantized, 2 * (4 + 4 * 3) + 1);  // per layer: q, k, v, o and 4 experts x (w1, w2, w3); the lm_head
  fp8_dir.Write("model.safetensors", testing::SafetensorsFile(fp8));
  bf16_dir.Write("model.safetensors", testing::SafetensorsFile(bf16));
  if (f32_dir != nullptr) f32_dir->Write("model.safetensors", testing::SafetensorsFile(f32));
}

class Fp8MixtralTest : public ::testing::Test {
 protected:
  void SetUp() override {
    WriteFp8AndBf16Twin(fp8_dir_, bf16_dir_, &f32_dir_);
    if (HasFatalFailure()) return;
    ASSERT_OK_AND_ASSIGN(fp8_spec_, LoadModelSpec(fp8_dir_.path()));
    ASSERT_OK_AND_ASSIGN(bf16_spec_, LoadModelSpec(bf16_dir_.path()));
    ASSERT_TRUE(fp8_spec_.fp8.has_value());
  }
  TempDir fp8_dir_, bf16_dir_, f32_dir_;
  ModelSpec fp8_spec_, bf16_spec_;
};

TEST_F(Fp8MixtralTest, EveryLayoutGivesTheLogitsAndTokensOfTheBf16Twin) {
  struct Layout {
    int ranks;
    bool split_experts;
  };
  const std::vector<int32_t> prompt = {1, 77, 12, 200, 31, 9, 140};
  for (const Layout& layout : {Layout{1, false}, Layout{2, false}, Layout{2, true}, Layout{4, false}}) {
    SCOPED_TRACE(::testing::Message() << layout.ranks << " ranks" << (layout.split_experts ? ", split experts" : ""));
    ASSERT_OK_AND_ASSIGN(auto fp8, MakeExecutor(fp8_spec_, fp8_dir_.path(), layout.ranks, layout.split_experts));
    ASSERT_OK_AND_ASSIGN(auto bf16, MakeExecutor(bf16_spec_, bf16_dir_.path(), layout.ranks, layout.split_experts));
    EXPECT_EQ(fp8->WeightBytesPerRank(), bf16->WeightBytesPerRank());
    const StepSequence s{.block_ids = WholeContextBlocks(fp8->options(), 0), .tokens = prompt, .all_logits = true};
    ASSERT_OK_AND_ASSIGN(StepResult a, fp8->Step({s}));
    ASSERT_OK_AND_ASSIGN(StepResult b, bf16->Step({s}));
    ASSERT_EQ(a.logits[0].size(), prompt.size() * 256);
    EXPECT_EQ(a.logits[0], b.logits[0]);  // the same bf16 weights, the same arithmetic: bit-equal
    ASSERT_OK_AND_ASSIGN(auto ga, Generate(*fp8, {{.prompt = prompt, .max_tokens = 12}}));
    ASSERT_OK_AND_ASSIGN(auto gb, Generate(*bf16, {{.prompt = prompt, .max_tokens = 12}}));
    EXPECT_EQ(ga[0].tokens, gb[0].tokens);
  }
}

TEST_F(Fp8MixtralTest, LoadExpertHoldsTheDequantizedWeightsAsBf16) {
  ASSERT_OK_AND_ASSIGN(auto fp8_ckpt, Checkpoint::Open(fp8_dir_.path()));
  ASSERT_OK_AND_ASSIGN(auto bf16_ckpt, Checkpoint::Open(bf16_dir_.path()));
  ASSERT_OK_AND_ASSIGN(auto backend, kernels::CreateBackend({}));
  size_t fp8_bytes = 0, bf16_bytes = 0;
  ASSERT_OK_AND_ASSIGN(MlpWeights a, LoadExpert(fp8_spec_, 1, 3, *fp8_ckpt, *backend, &fp8_bytes));
  ASSERT_OK_AND_ASSIGN(MlpWeights b, LoadExpert(bf16_spec_, 1, 3, *bf16_ckpt, *backend, &bf16_bytes));
  const int64_t h = fp8_spec_.hidden_size, f = fp8_spec_.moe.expert_intermediate_size;
  EXPECT_EQ(fp8_bytes, static_cast<size_t>(3 * h * f * 2));  // three bf16 matrices
  EXPECT_EQ(fp8_bytes, bf16_bytes);
  for (const auto& [x, y] : {std::pair{&a.gate, &b.gate}, std::pair{&a.up, &b.up}, std::pair{&a.down, &b.down}}) {
    EXPECT_EQ(x->dtype, DType::kBF16);
    ASSERT_EQ(x->in * x->out, h * f);
    std::vector<uint16_t> got(static_cast<size_t>(h * f)), want(got.size());
    ASSERT_TRUE(backend->CopyToHost(got.data(), x->w.as<void>(), got.size() * 2).ok());
    ASSERT_TRUE(backend->CopyToHost(want.data(), y->w.as<void>(), want.size() * 2).ok());
    EXPECT_EQ(got, want);
  }
}

// ---------------------------------------------------------------- F8_E4M3 kept as codes + scales

// What CUDA ranks do (SupportsOp(kLinear, kF8E4M3)), on the CPU: a RecordingBackend that claims
// F8_E4M3 Linear and runs it as the CPU's f32 Linear of the weights dequantized by
// kernels/shared/fp8_math.h. Without `fp8`, the same wrapper (the same op path) on f32 weights.
std::unique_ptr<kernels::Backend> Fp8KeepingBackend(bool fp8) {
  auto cpu = kernels::CreateBackend({});
  EXPECT_TRUE(cpu.ok()) << cpu.status();
  auto rec = std::make_unique<testing::RecordingBackend>(std::move(*cpu));
  rec->EmulateFp8LinearForTest(fp8);
  return rec;
}

TEST_F(Fp8MixtralTest, KeptFp8MatricesGiveTheLogitsAndTokensOfTheF32TwinBitForBit) {
  ASSERT_OK_AND_ASSIGN(testing::LoadedModel kept, testing::LoadModel(fp8_dir_.path(), {}, Fp8KeepingBackend(true)));
  ASSERT_OK_AND_ASSIGN(testing::LoadedModel f32, testing::LoadModel(f32_dir_.path(), {}, Fp8KeepingBackend(false)));
  // Every projection, expert and the lm_head at 1 byte plus its scales: about a quarter of f32.
  const WeightFormats formats = EngineWeightFormats(fp8_spec_, *kept.backend, Quantization::kNone);
  EXPECT_TRUE(formats.fp8);
  EXPECT_EQ(kept.model->weight_bytes(), static_cast<size_t>(kept.model->memory().Weights()));
  EXPECT_LT(kept.model->weight_bytes(), f32.model->weight_bytes() / 2);
  const std::vector<int32_t> prompt = {1, 77, 12, 200, 31, 9, 140};
  const StepSequence s{.block_ids = WholeContextBlocks(kept.model->options(), 0), .tokens = prompt, .all_logits = true};
  ASSERT_OK_AND_ASSIGN(StepResult a, kept.model->Step({s}));
  ASSERT_OK_AND_ASSIGN(StepResult b, f32.model->Step({s}));
  ASSERT_EQ(a.logits[0].size(), prompt.size() * 256);
  EXPECT_EQ(a.logits[0], b.logits[0]);  // the same f32 weights, the same arithmetic
  const auto& rec = static_cast<const testing::RecordingBackend&>(*kept.backend);
  EXPECT_GT(rec.fp8_linears(), 0) << "no F8_E4M3 Linear ran";
  ASSERT_OK_AND_ASSIGN(auto ga, Generate(*kept.model, {{.prompt = prompt, .max_tokens = 12}}));
  ASSERT_OK_AND_ASSIGN(auto gb, Generate(*f32.model, {{.prompt = prompt, .max_tokens = 12}}));
  EXPECT_EQ(ga[0].tokens, gb[0].tokens);
}

// Every rank of every tensor-parallel layout holds, byte for byte, what the memory model predicts
// for CUDA workers (WorkerWeightFormats(cuda)): 1 byte per weight plus the scale blocks its slice
// overlaps, with slices that start inside blocks (24 x 20 blocks in the Mixtral, 32 x 32 in the
// golden llama whose down_proj columns split at 40), per-tensor scales, and an lm_head left in bf16
// by modules_to_not_convert / ignored_layers.
void ExpectKeptBytesPredicted(const std::string& dir, int tp) {
  SCOPED_TRACE(::testing::Message() << dir << " tp " << tp);
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(dir));
  ASSERT_OK_AND_ASSIGN(auto ckpt, Checkpoint::Open(dir));
  ASSERT_OK_AND_ASSIGN(auto comms, comm::CreateHostGroup(tp));
  const WeightFormats cuda = WorkerWeightFormats(spec, /*cuda=*/true, Quantization::kNone);
  ASSERT_TRUE(cuda.fp8);
  for (int r = 0; r < tp; ++r) {
    SCOPED_TRACE(::testing::Message() << "rank " << r);
    std::unique_ptr<kernels::Backend> backend = Fp8KeepingBackend(true);
    ModelOptions o;
    o.shard = {.rank = r, .size = tp};
    o.comm = comms[static_cast<size_t>(r)].get();
    ASSERT_OK_AND_ASSIGN(auto model, Model::Create(spec, *ckpt, backend.get(), o));
    const int64_t got = static_cast<int64_t>(model->weight_bytes());
    EXPECT_EQ(model->memory().Weights(), got);
    const RankShard shard{.layer_begin = 0, .layer_end = spec.num_layers, .has_embedding = true, .has_lm_head = true,
                          .tp = tp, .rank = r, .expert_parallel = IsExpertParallel(spec, tp)};
    const RankMemory m = RankMemoryOf(spec, shard, cuda);
    EXPECT_EQ(m.Weights(), got) << "matrices " << m.matrices << ", experts " << m.experts << ", lm_head " << m.lm_head;
  }
}

TEST_F(Fp8MixtralTest, KeptFp8BytesAreTheMemoryModelsOnEveryRank) {
  for (int tp : {1, 2, 4}) ExpectKeptBytesPredicted(fp8_dir_.path(), tp);
}

TEST(Fp8KeptGoldenTest, KeptFp8BytesAreTheMemoryModelsOnEveryRank) {
  for (const char* dir : {"tests/golden/models/llama_fp8_block", "tests/golden/models/llama_fp8_tensor"}) {
    for (int tp : {1, 2}) ExpectKeptBytesPredicted(dir, tp);
  }
}

// The golden FP8 models with their weights kept as codes + scales (exactly dequantized, no bf16
// rounding): greedy tokens of the float64 NumPy reference, logits within the FP8 tolerance.
TEST(Fp8KeptGoldenTest, GreedyTokensAndLogitsMatchTheReference) {
  for (const char* name : {"llama_fp8_block", "llama_fp8_tensor"}) {
    SCOPED_TRACE(name);
    ASSERT_OK_AND_ASSIGN(testing::GoldenModel golden, testing::LoadGoldenModel(name));
    ASSERT_OK_AND_ASSIGN(testing::LoadedModel l, testing::LoadModel(golden.dir, {}, Fp8KeepingBackend(true)));
    for (size_t i = 0; i < golden.cases.size(); ++i) {
      const testing::GoldenCase& c = golden.cases[i];
      const StepSequence s{.block_ids = WholeContextBlocks(l.model->options(), static_cast<int32_t>(i)),
                           .tokens = c.prompt_ids, .all_logits = true};
      ASSERT_OK_AND_ASSIGN(StepResult r, l.model->Step({s}));
      const size_t v = static_cast<size_t>(l.spec.vocab_size);
      for (size_t p = 0; p < c.prompt_ids.size(); ++p) {
        testing::ExpectLogitsClose(c.logits[p], r.logits[0].data() + p * v, absl::StrCat(name, " position ", p),
                                   golden.logits_rtol);
      }
    }
    ASSERT_OK_AND_ASSIGN(auto res, Generate(*l.model, testing::GreedyRequests(golden)));
    for (size_t i = 0; i < res.size(); ++i) EXPECT_EQ(res[i].tokens, golden.cases[i].greedy_ids) << "case " << i;
    EXPECT_GT(static_cast<const testing::RecordingBackend&>(*l.backend).fp8_linears(), 0);
  }
}

// ---------------------------------------------------------------- MXFP4 (GPT-OSS)

std::unique_ptr<kernels::Backend> Mxfp4Backend(bool keep) {
  auto cpu = kernels::CreateBackend({});
  EXPECT_TRUE(cpu.ok()) << cpu.status();
  auto rec = std::make_unique<testing::RecordingBackend>(std::move(*cpu));
  rec->RefuseMxfp4ForTest(!keep);
  return rec;
}

// Where the backend takes MXFP4, the experts stay as stored: 17/32 of a byte per weight instead of
// bf16's 2 (gpt_oss_mxfp4: 3 layers x 4 experts of gate, up [32, 64] and down [64, 32]), the
// memory model predicts it, Linear runs on them, and the logits are the dequantized model's
// within f32 summation order (the same weights), with the same greedy tokens.
TEST(Mxfp4KeptTest, ExpertsStayMxfp4AndComputeTheDequantizedModel) {
  const std::string dir = "tests/golden/models/gpt_oss_mxfp4";
  ASSERT_OK_AND_ASSIGN(testing::LoadedModel kept, testing::LoadModel(dir, {}, Mxfp4Backend(true)));
  ASSERT_OK_AND_ASSIGN(testing::LoadedModel decoded, testing::LoadModel(dir, {}, Mxfp4Backend(false)));
  EXPECT_TRUE(EngineWeightFormats(kept.spec, *kept.backend, Quantization::kNone).mxfp4_experts);
  EXPECT_FALSE(EngineWeightFormats(decoded.spec, *decoded.backend, Quantization::kNone).mxfp4_experts);
  EXPECT_EQ(kept.model->weight_bytes(), static_cast<size_t>(kept.model->memory().Weights()));
  EXPECT_EQ(decoded.model->weight_bytes(), static_cast<size_t>(decoded.model->memory().Weights()));
  const int64_t per_expert_bf16 = 3 * 32 * 64 * 2;
  const int64_t per_expert_mxfp4 = 2 * Mxfp4MatrixBytes(32, 64) + Mxfp4MatrixBytes(64, 32);
  EXPECT_EQ(per_expert_mxfp4, 3 * (32 * 64 / 2 + 32 * 64 / 32));
  EXPECT_EQ(decoded.model->weight_bytes() - kept.model->weight_bytes(),
            static_cast<size_t>(3 * 4 * (per_expert_bf16 - per_expert_mxfp4)));

  const std::vector<int32_t> prompt = {1, 77, 12, 200, 31, 9, 140};
  const StepSequence s{.block_ids = WholeContextBlocks(kept.model->options(), 0), .tokens = prompt, .all_logits = true};
  ASSERT_OK_AND_ASSIGN(StepResult a, kept.model->Step({s}));
  ASSERT_OK_AND_ASSIGN(StepResult b, decoded.model->Step({s}));
  ASSERT_EQ(a.logits[0].size(), b.logits[0].size());
  float max_logit = 0;
  for (float v : b.logits[0]) max_logit = std::max(max_logit, std::abs(v));
  for (size_t i = 0; i < a.logits[0].size(); ++i) ASSERT_NEAR(a.logits[0][i], b.logits[0][i], 1e-4f * max_logit) << i;
  EXPECT_GT(static_cast<const testing::RecordingBackend&>(*kept.backend).mxfp4_linears(), 0);
  EXPECT_EQ(static_cast<const testing::RecordingBackend&>(*decoded.backend).mxfp4_linears(), 0);
  ASSERT_OK_AND_ASSIGN(auto ga, Generate(*kept.model, {{.prompt = prompt, .max_tokens = 12}}));
  ASSERT_OK_AND_ASSIGN(auto gb, Generate(*decoded.model, {{.prompt = prompt, .max_tokens = 12}}));
  EXPECT_EQ(ga[0].tokens, gb[0].tokens);
}

// ---------------------------------------------------------------- MXFP4 (GPT-OSS) load errors

// A bad MXFP4 expert is named from the rank that reads it, and a missing expert bias by its name.
TEST(Mxfp4LoadErrorsTest, CorruptScalesAndMissingBiasesAreNamed) {
  const std::string src = "tests/golden/models/gpt_oss_mxfp4";
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(src));
  {
    // Expert 3 of layer 2, row 5, block 1: scale byte 255 (e8m0's NaN). Experts 2 and 3 are rank
    // 1's of 2.
    TempDir dir;
    WriteEditedCopy(
        dir,
        [](std::vector<StoredTensor>& t) {
          Find(t, "model.layers.2.mlp.experts.gate_up_proj_scales").bytes[(3 * 64 + 5) * 2 + 1] = '\xff';
        },
        src);
    EXPECT_THAT(MakeExecutor(spec, dir.path(), 2),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("rank 1 of 2"),
                               HasSubstr("\"model.layers.2.mlp.experts.gate_up_proj_scales\"[3, 5, 1] is 255 (NaN)"))));
  }
  {
    TempDir dir;
    WriteEditedCopy(
        dir,
        [](std::vector<StoredTensor>& t) {
          std::erase_if(t, [](const StoredTensor& x) { return x.name == "model.layers.1.mlp.experts.down_proj_bias"; });
        },
        src);
    EXPECT_THAT(MakeExecutor(spec, dir.path(), 1),
                StatusIs(absl::StatusCode::kNotFound, HasSubstr("model.layers.1.mlp.experts.down_proj_bias")));
  }
}

}  // namespace
}  // namespace shardserve::engine

// The random-model generator (tests/testing/random_model.h) writes checkpoints that the spec parser
// and the engine accept: dense Llama and the Mixtral-style MoE that shardserve-bench-gpu uses, and
// the FP8 Llama (block-wise F8_E4M3, as DeepSeek-V3 / Qwen3-FP8) whose codes and scales are checked
// against an independent quantization of the same random weights, and whose logits on the CPU
// (FP8 dequantized to bf16 on load) and on the kept-FP8 path (RecordingBackend's emulation of the
// CUDA ranks' codes + scales) are those of checkpoints holding the dequantized weights.
#include "tests/testing/random_model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "common/model_spec/model_spec.h"
#include "common/safetensors/safetensors.h"
#include "common/tensor/dtype.h"
#include "nlohmann/json.hpp"
#include "tests/testing/engine_fixtures.h"
#include "tests/testing/recording_backend.h"
#include "tests/testing/safetensors_file.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "worker/engine/executor.h"
#include "worker/kernels/registry.h"

namespace shardserve {
namespace {

testing::RandomLlamaShape TinyShape(int64_t experts) {
  testing::RandomLlamaShape s;
  s.vocab = 64;
  s.hidden = 32;
  s.intermediate = 16;
  s.layers = 2;
  s.heads = 4;
  s.kv_heads = 2;
  s.max_positions = 64;
  s.bf16 = true;
  s.experts = experts;
  s.experts_per_tok = 2;
  return s;
}

// One greedy step of a 3-token prompt on one CPU rank; the logits must be finite.
void ExpectRuns(const std::string& dir) {
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(dir));
  ASSERT_OK_AND_ASSIGN(auto ckpt, Checkpoint::Open(dir));
  ASSERT_OK_AND_ASSIGN(auto ex, engine::TpExecutor::Create(spec, *ckpt, engine::ExecutorOptions{}));
  ASSERT_OK_AND_ASSIGN(auto r, ex->Step({engine::StepSequence{.block_ids = engine::WholeContextBlocks(ex->options(), 0),
                                                              .tokens = {1, 5, 7}}}));
  ASSERT_EQ(r.logits.size(), 1u);
  ASSERT_EQ(r.logits[0].size(), 64u);
  for (float v : r.logits[0]) ASSERT_TRUE(std::isfinite(v));
}

TEST(RandomModelTest, MixtralShapeLoadsAsMoeAndRuns) {
  testing::TempDir tmp;
  ASSERT_TRUE(testing::WriteRandomLlama(tmp.path(), TinyShape(4), 7).ok());
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(tmp.path()));
  EXPECT_EQ(spec.arch, Architecture::kMixtral);
  EXPECT_EQ(spec.moe.num_experts, 4);
  EXPECT_EQ(spec.moe.top_k, 2);
  EXPECT_EQ(spec.moe.expert_intermediate_size, 16);
  ExpectRuns(tmp.path());
}

TEST(RandomModelTest, DenseShapeLoadsAsLlamaAndRuns) {
  testing::TempDir tmp;
  ASSERT_TRUE(testing::WriteRandomLlama(tmp.path(), TinyShape(0), 7).ok());
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(tmp.path()));
  EXPECT_EQ(spec.arch, Architecture::kLlama);
  EXPECT_FALSE(spec.IsMoe());
  ExpectRuns(tmp.path());
}

TEST(RandomModelTest, TooManyExpertsPerTokenIsInvalidArgument) {
  testing::TempDir tmp;
  testing::RandomLlamaShape s = TinyShape(4);
  s.experts_per_tok = 5;
  EXPECT_EQ(testing::WriteRandomLlama(tmp.path(), s, 7).code(), absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------- FP8 (block-wise e4m3)

using testing::StoredTensor;

// Ragged against 128 x 128 blocks everywhere: q/o [160, 160] and gate/up [136, 160] have 2 x 2
// scale blocks, k/v [32, 160] 1 x 2, down [160, 136] 2 x 2, and the last block of each
// dimension is short.
// 10 heads of 16: tp 2 cuts q at row 80 and k/v at 16, inside the first scale block. Everything
// but the projections is F32.
testing::RandomLlamaShape TinyFp8Shape(bool fp8) {
  return {.vocab = 96, .hidden = 160, .intermediate = 136, .layers = 2, .heads = 10, .kv_heads = 2,
          .max_positions = 64, .fp8 = fp8};
}

constexpr uint64_t kFp8Seed = 11;
constexpr int64_t kBlock = 128;

bool IsProjection(const std::string& name) { return absl::EndsWith(name, "_proj.weight"); }

std::map<std::string, StoredTensor> ReadByName(const std::string& dir) {
  std::map<std::string, StoredTensor> m;
  auto tensors = testing::ReadSafetensorsFile(dir + "/model.safetensors");
  EXPECT_TRUE(tensors.ok()) << tensors.status();
  if (tensors.ok()) {
    for (StoredTensor& t : *tensors) m[t.name] = std::move(t);
  }
  return m;
}

std::vector<float> AsFloats(const StoredTensor& t) {
  std::vector<float> v(t.bytes.size() / 4);
  std::memcpy(v.data(), t.bytes.data(), v.size() * 4);
  return v;
}

// The finite e4m3 code nearest to x (|x| <= 448), by search over every code: the reference the
// writer's codes are held to (no ties occur with these random values).
uint8_t NearestCode(float x) {
  int best = 0;
  for (int c = 0; c < 256; ++c) {
    const float v = E4M3ToFloat(static_cast<uint8_t>(c));
    if (!std::isnan(v) && std::fabs(v - x) < std::fabs(E4M3ToFloat(static_cast<uint8_t>(best)) - x)) best = c;
  }
  return static_cast<uint8_t>(best);
}

TEST(RandomModelTest, Fp8WriterQuantizesTheSameRandomWeightsBlockwise) {
  testing::TempDir fp8_dir, f32_dir;
  ASSERT_TRUE(testing::WriteRandomLlama(fp8_dir.path(), TinyFp8Shape(true), kFp8Seed).ok());
  ASSERT_TRUE(testing::WriteRandomLlama(f32_dir.path(), TinyFp8Shape(false), kFp8Seed).ok());
  const auto config = nlohmann::json::parse(testing::ReadFileOrEmpty(fp8_dir.path() + "/config.json"));
  EXPECT_EQ(config["quantization_config"],
            nlohmann::json({{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"activation_scheme", "dynamic"},
                            {"weight_block_size", {kBlock, kBlock}}, {"modules_to_not_convert", {"lm_head"}}}));
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(fp8_dir.path()));
  ASSERT_TRUE(spec.fp8.has_value());
  EXPECT_EQ(spec.fp8->block_rows, kBlock);
  EXPECT_EQ(spec.fp8->block_cols, kBlock);
  EXPECT_EQ(spec.fp8->modules_not_converted, std::vector<std::string>{"lm_head"});

  std::map<std::string, StoredTensor> fp8 = ReadByName(fp8_dir.path()), f32 = ReadByName(f32_dir.path());
  int projections = 0;
  for (const auto& [name, w] : f32) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(fp8.count(name));
    const StoredTensor& q = fp8[name];
    EXPECT_EQ(q.shape, w.shape);
    if (!IsProjection(name)) {  // embedding, norms, lm_head: as written without fp8
      EXPECT_EQ(q.dtype, "F32");
      EXPECT_TRUE(q.bytes == w.bytes);
      continue;
    }
    ++projections;
    ASSERT_EQ(q.dtype, "F8_E4M3");
    ASSERT_TRUE(fp8.count(name + "_scale_inv"));
    const StoredTensor& st = fp8[name + "_scale_inv"];
    const int64_t rows = w.shape[0], cols = w.shape[1];
    const int64_t grid_rows = (rows + kBlock - 1) / kBlock, grid_cols = (cols + kBlock - 1) / kBlock;
    ASSERT_EQ(st.dtype, "F32");
    ASSERT_EQ(st.shape, (std::vector<int64_t>{grid_rows, grid_cols}));
    ASSERT_EQ(q.bytes.size(), static_cast<size_t>(rows * cols));
    const std::vector<float> weights = AsFloats(w), scales = AsFloats(st);
    std::vector<float> amax(scales.size(), 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        float& a = amax[static_cast<size_t>((r / kBlock) * grid_cols + c / kBlock)];
        a = std::max(a, std::fabs(weights[static_cast<size_t>(r * cols + c)]));
      }
    }
    for (size_t b = 0; b < scales.size(); ++b) ASSERT_EQ(scales[b], amax[b] / 448.0f) << "block " << b;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const size_t i = static_cast<size_t>(r * cols + c);
        const float x = std::min(weights[i] / scales[static_cast<size_t>((r / kBlock) * grid_cols + c / kBlock)], 448.0f);
        ASSERT_EQ(static_cast<uint8_t>(q.bytes[i]), NearestCode(x)) << "[" << r << ", " << c << "]";
      }
    }
  }
  EXPECT_EQ(projections, 7 * 2);  // q, k, v, o, gate, up, down in each of the 2 layers
  EXPECT_EQ(fp8.size(), f32.size() + 7 * 2);  // and one scale tensor each
}

// Writes into `dir` the FP8 checkpoint at `fp8_dir` with every projection replaced by its
// dequantized weights (code x scale in f32, computed here from the stored bytes), stored as BF16
// (rounded to nearest even, as the CPU loader holds FP8 matrices) or F32, and no quantization_config
// or torch_dtype (the stored dtypes differ).
void WriteDequantizedTwin(const std::string& fp8_dir, const testing::TempDir& dir, bool bf16) {
  auto config = nlohmann::json::parse(testing::ReadFileOrEmpty(fp8_dir + "/config.json"));
  config.erase("quantization_config");
  config.erase("torch_dtype");
  dir.Write("config.json", config.dump(2));
  auto tensors = testing::ReadSafetensorsFile(fp8_dir + "/model.safetensors");
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  std::map<std::string, std::vector<float>> scales;
  for (const StoredTensor& t : *tensors) {
    if (absl::EndsWith(t.name, "_scale_inv")) scales[t.name] = AsFloats(t);
  }
  std::vector<StoredTensor> out;
  for (const StoredTensor& t : *tensors) {
    if (absl::EndsWith(t.name, "_scale_inv")) continue;
    if (t.dtype != "F8_E4M3") {
      out.push_back(t);
      continue;
    }
    const std::vector<float>& s = scales[t.name + "_scale_inv"];
    const int64_t rows = t.shape[0], cols = t.shape[1], grid_cols = (cols + kBlock - 1) / kBlock;
    std::vector<float> exact(static_cast<size_t>(rows * cols));
    std::vector<uint16_t> held(exact.size());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const size_t i = static_cast<size_t>(r * cols + c);
        exact[i] = E4M3ToFloat(static_cast<uint8_t>(t.bytes[i])) * s[static_cast<size_t>((r / kBlock) * grid_cols + c / kBlock)];
        held[i] = FloatToBFloat16(exact[i]);
      }
    }
    if (bf16) {
      out.push_back({t.name, "BF16", t.shape, std::string(reinterpret_cast<const char*>(held.data()), held.size() * 2)});
    } else {
      out.push_back({t.name, "F32", t.shape, testing::F32Bytes(exact)});
    }
  }
  dir.Write("model.safetensors", testing::SafetensorsFile(out));
}

const std::vector<int32_t> kPrompt = {1, 17, 5, 90, 33, 2, 64};

TEST(RandomModelTest, Fp8ModelLoadsOnTheCpuAsItsDequantizedWeightsInBf16) {
  testing::TempDir fp8_dir, twin_dir;
  ASSERT_TRUE(testing::WriteRandomLlama(fp8_dir.path(), TinyFp8Shape(true), kFp8Seed).ok());
  WriteDequantizedTwin(fp8_dir.path(), twin_dir, /*bf16=*/true);
  ASSERT_OK_AND_ASSIGN(ModelSpec fp8_spec, LoadModelSpec(fp8_dir.path()));
  ASSERT_OK_AND_ASSIGN(ModelSpec twin_spec, LoadModelSpec(twin_dir.path()));
  ASSERT_OK_AND_ASSIGN(auto fp8_ckpt, Checkpoint::Open(fp8_dir.path()));
  ASSERT_OK_AND_ASSIGN(auto twin_ckpt, Checkpoint::Open(twin_dir.path()));
  for (int ranks : {1, 2}) {
    SCOPED_TRACE(::testing::Message() << ranks << " ranks");
    engine::ExecutorOptions eo;
    eo.cpu_ranks = ranks;
    ASSERT_OK_AND_ASSIGN(auto a, engine::TpExecutor::Create(fp8_spec, *fp8_ckpt, eo));
    ASSERT_OK_AND_ASSIGN(auto b, engine::TpExecutor::Create(twin_spec, *twin_ckpt, eo));
    EXPECT_EQ(a->WeightBytesPerRank(), b->WeightBytesPerRank());
    const engine::StepSequence s{.block_ids = engine::WholeContextBlocks(a->options(), 0), .tokens = kPrompt,
                                 .all_logits = true};
    ASSERT_OK_AND_ASSIGN(engine::StepResult ra, a->Step({s}));
    ASSERT_OK_AND_ASSIGN(engine::StepResult rb, b->Step({s}));
    ASSERT_EQ(ra.logits[0].size(), kPrompt.size() * 96);
    EXPECT_EQ(ra.logits[0], rb.logits[0]);  // the same bf16 weights, the same arithmetic: bit-equal
  }
}

TEST(RandomModelTest, Fp8ModelKeptAsCodesAndScalesGivesTheLogitsOfItsDequantizedWeights) {
  testing::TempDir fp8_dir, twin_dir;
  ASSERT_TRUE(testing::WriteRandomLlama(fp8_dir.path(), TinyFp8Shape(true), kFp8Seed).ok());
  WriteDequantizedTwin(fp8_dir.path(), twin_dir, /*bf16=*/false);
  // What CUDA ranks do with it (codes + scales, dequantized in the Linear), emulated on the CPU by
  // RecordingBackend; the twin runs through the same wrapper on f32 weights.
  auto backend = [](bool fp8) -> std::unique_ptr<kernels::Backend> {
    auto cpu = kernels::CreateBackend({});
    EXPECT_TRUE(cpu.ok()) << cpu.status();
    auto rec = std::make_unique<testing::RecordingBackend>(std::move(*cpu));
    rec->EmulateFp8LinearForTest(fp8);
    return rec;
  };
  ASSERT_OK_AND_ASSIGN(testing::LoadedModel kept, testing::LoadModel(fp8_dir.path(), {}, backend(true)));
  ASSERT_OK_AND_ASSIGN(testing::LoadedModel twin, testing::LoadModel(twin_dir.path(), {}, backend(false)));
  // 1 byte per projection weight plus 4 per scale block; the rest (embedding, lm_head, norms) f32.
  const int64_t h = 160, f = 136, kv = 32, v = 96;
  const int64_t projections = 2 * (2 * h * h + 2 * kv * h + 3 * f * h);
  const int64_t scale_blocks = 2 * (2 * 4 + 2 * 2 + 3 * 4);
  EXPECT_EQ(static_cast<int64_t>(kept.model->weight_bytes()),
            projections + 4 * scale_blocks + 4 * (2 * v * h + 2 * 2 * h + h));
  const engine::StepSequence s{.block_ids = engine::WholeContextBlocks(kept.model->options(), 0), .tokens = kPrompt,
                               .all_logits = true};
  ASSERT_OK_AND_ASSIGN(engine::StepResult a, kept.model->Step({s}));
  ASSERT_OK_AND_ASSIGN(engine::StepResult b, twin.model->Step({s}));
  EXPECT_EQ(a.logits[0], b.logits[0]);  // the same f32 weights, the same arithmetic
  EXPECT_GT(static_cast<const testing::RecordingBackend&>(*kept.backend).fp8_linears(), 0) << "no F8_E4M3 Linear ran";
}

TEST(RandomModelTest, Fp8LogitsStayCloseToTheUnquantizedModel) {
  // The quantization is the proper one (not merely self-consistent): the FP8 model's logits are
  // those of the same random f32 weights within e4m3's error. Per weight the relative error is at
  // most 2^-4 (3 mantissa bits, half a step); over 136- and 160-wide sums of random signs it mostly
  // cancels: with this seed the largest logit moves by 2.3% of the logits' spread (5% allowed); a
  // scale or rounding off by a step would move them by far more.
  testing::TempDir fp8_dir, f32_dir;
  ASSERT_TRUE(testing::WriteRandomLlama(fp8_dir.path(), TinyFp8Shape(true), kFp8Seed).ok());
  ASSERT_TRUE(testing::WriteRandomLlama(f32_dir.path(), TinyFp8Shape(false), kFp8Seed).ok());
  std::vector<std::vector<float>> logits;
  for (const std::string& dir : {fp8_dir.path(), f32_dir.path()}) {
    ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(dir));
    ASSERT_OK_AND_ASSIGN(auto ckpt, Checkpoint::Open(dir));
    ASSERT_OK_AND_ASSIGN(auto ex, engine::TpExecutor::Create(spec, *ckpt, engine::ExecutorOptions{}));
    ASSERT_OK_AND_ASSIGN(auto r, ex->Step({engine::StepSequence{.block_ids = engine::WholeContextBlocks(ex->options(), 0),
                                                                .tokens = kPrompt, .all_logits = true}}));
    logits.push_back(r.logits[0]);
  }
  float lo = logits[1][0], hi = logits[1][0], worst = 0;
  for (size_t i = 0; i < logits[1].size(); ++i) {
    lo = std::min(lo, logits[1][i]);
    hi = std::max(hi, logits[1][i]);
    worst = std::max(worst, std::fabs(logits[0][i] - logits[1][i]));
  }
  ASSERT_GT(hi - lo, 0.0f);
  EXPECT_LT(worst, 0.05f * (hi - lo)) << "logit spread " << hi - lo;
  EXPECT_GT(worst, 0.0f);  // and they are quantized: not the f32 weights
}

}  // namespace
}  // namespace shardserve

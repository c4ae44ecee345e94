// Where the engine uses the fused ops (kernels/backend.h): every gated MLP runs as one gated
// LinearGroup, a layer's norms ride on the products after them where nothing else runs between
// (one rank; not Gemma's sandwich norms), and RoPE rides on the KV write exactly where nothing runs between the rotation and
// the write. Not with Llama-4's weightless q/k norm after RoPE or its NoPE layers' temperature, nor
// with LongRoPE's per-sequence runs: there the separate Rope op must still run, in its old place.
// (Rotations commute with those norms and scales up to rounding, so transformers' tolerances alone
// would not see a fused write in the wrong place; the op counts do.) The tokens stay transformers'.
#include <gtest/gtest.h>

#include <memory>
#include <ostream>
#include <string>

#include "common/status/macros.h"
#include "tests/testing/engine_fixtures.h"
#include "tests/testing/golden.h"
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

struct FusionCase {
  std::string model;
  bool rope_in_write;  // every RoPE layer's rotation inside its KV write
  bool norms_in_products;  // one rank, no sandwich norms: norms ride on the q/k/v (and dense MLP) products
};

void PrintTo(const FusionCase& c, std::ostream* os) { *os << c.model; }

std::string CaseName(const ::testing::TestParamInfo<FusionCase>& param) { return param.param.model; }

class EngineFusionTest : public ::testing::TestWithParam<FusionCase> {};

TEST_P(EngineFusionTest, GatedMlpsNormsInProductsAndRopeInTheWriteOnlyWhereNothingRunsBetween) {
  const FusionCase c = GetParam();
  ASSERT_OK_AND_ASSIGN(GoldenModel golden, testing::LoadGoldenModel(c.model));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<kernels::Backend> cpu, kernels::CreateBackend({}));
  auto owned = std::make_unique<RecordingBackend>(std::move(cpu));
  const RecordingBackend& rec = *owned;
  // Op by op (no graph replays, whose ops are not seen again), so the counts are per step.
  ASSERT_OK_AND_ASSIGN(testing::LoadedModel loaded,
                       testing::LoadModel(golden.dir, {.op_graphs = false}, std::move(owned)));
  ASSERT_OK_AND_ASSIGN(auto res, Generate(*loaded.model, GreedyRequests(golden)));
  for (size_t i = 0; i < res.size(); ++i) {
    EXPECT_EQ(res[i].tokens, golden.cases[i].greedy_ids) << c.model << " case " << i;
  }
  EXPECT_GT(rec.gated_linear_groups(), 0) << "the MLPs did not use the gated LinearGroup";
  if (!c.norms_in_products) {
    EXPECT_EQ(rec.normed_linear_groups(), 0) << "a norm moved into products with a norm or add before them";
  } else if (c.model == "llama") {
    // Dense, one rank, no q/k norms: both norms of every layer ride on its products, and the only
    // RmsNorm ops left are those the default LinearGroup runs for them plus the final norm, once
    // per step.
    const int per_step = 2 * static_cast<int>(loaded.spec.num_layers);
    ASSERT_GT(rec.normed_linear_groups(), 0);
    EXPECT_EQ(rec.normed_linear_groups() % per_step, 0) << rec.normed_linear_groups();
    EXPECT_EQ(rec.rms_norms(), rec.normed_linear_groups() + rec.normed_linear_groups() / per_step);
  } else {
    EXPECT_GT(rec.normed_linear_groups(), 0) << "no input norm rode on the q/k/v products";
  }
  if (c.rope_in_write) {
    EXPECT_GT(rec.kv_writes_with_rope(), 0);
    EXPECT_EQ(rec.ropes(), 0) << "a separate Rope ran where the write could rotate";
  } else {
    EXPECT_EQ(rec.kv_writes_with_rope(), 0) << "RoPE moved past what runs between it and the write";
    EXPECT_GT(rec.ropes(), 0);
  }
}

// llama: plain; qwen3: q/k norms with weights before RoPE (they may stay before the fused write);
// gemma3: sliding layers with their own table; phi3_partial_rotary: rotary_dim < head_dim; llama4:
// the weightless q/k norm after RoPE, and query temperature in its NoPE layers; phi3_longrope.
INSTANTIATE_TEST_SUITE_P(Architectures, EngineFusionTest,
                         ::testing::Values(FusionCase{"llama", true, true}, FusionCase{"qwen3", true, true},
                                           FusionCase{"gemma3", true, false},
                                           FusionCase{"phi3_partial_rotary", true, true},
                                           FusionCase{"llama4", false, true}, FusionCase{"phi3_longrope", false, true}),
                         CaseName);

}  // namespace
}  // namespace shardserve::engine

// How far a reduced-precision run (int8 weights, an FP8 KV cache) lands from the transformers
// references of tests/golden: the logits error relative to each position's max|logit|, which first
// generated tokens cannot flip under that error, and how many leading greedy tokens agree.
#ifndef SHARDSERVE_TESTS_TESTING_LOGIT_ERRORS_H_
#define SHARDSERVE_TESTS_TESTING_LOGIT_ERRORS_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/statusor.h"
#include "common/model_spec/model_spec.h"
#include "common/safetensors/safetensors.h"
#include "common/status/macros.h"
#include "tests/testing/engine_fixtures.h"
#include "tests/testing/golden.h"
#include "worker/engine/executor.h"
#include "worker/engine/generator.h"

namespace shardserve::testing {

// The largest and the mean absolute error of each position's logits, each over that position's
// max|logit| of the reference, accumulated over positions.
struct LogitErrors {
  double max_rel = 0, sum_rel = 0;
  int64_t positions = 0;
  // Adds one position: `got` holds ref.size() logits.
  void Add(const std::vector<float>& ref, const float* got) {
    double ref_max = 0, err_max = 0, err_sum = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      ref_max = std::max(ref_max, std::fabs(static_cast<double>(ref[i])));
      const double e = std::fabs(static_cast<double>(got[i]) - ref[i]);
      err_max = std::max(err_max, e);
      err_sum += e;
    }
    max_rel = std::max(max_rel, err_max / ref_max);
    sum_rel += err_sum / static_cast<double>(ref.size()) / ref_max;
    ++positions;
  }
  double mean_rel() const { return positions > 0 ? sum_rel / static_cast<double>(positions) : 0; }
};

// Leading tokens of `got` equal to `want`.
inline size_t LeadingAgreement(const std::vector<int32_t>& got, const std::vector<int32_t>& want) {
  size_t n = 0;
  while (n < got.size() && n < want.size() && got[n] == want[n]) ++n;
  return n;
}

// One executor's run of a golden model's cases against their references.
struct GoldenAccuracy {
  LogitErrors err;  // every prompt position (stories260K: the last one of each prompt)
  // Per case: whether the first generated token cannot flip, because the reference's top-1 leads
  // its runner-up by more than twice the largest error at the last prompt position (golden models
  // with per-position logits only; stories260K: all false).
  std::vector<bool> first_token_safe;
  std::vector<std::vector<int32_t>> generated;  // per case, greedy, the reference's length
  size_t agree = 0, total = 0;                  // leading generated tokens equal to the reference
};

// Runs every case of `golden` on `ex` (one sequence per case, placed at WholeContextBlocks of its
// index), then generates each case's greedy continuation.
inline absl::StatusOr<GoldenAccuracy> MeasureGolden(engine::TpExecutor& ex, const GoldenModel& golden) {
  GoldenAccuracy a;
  int32_t seq = 0;
  for (const GoldenCase& c : golden.cases) {
    const bool every_position = !c.logits.empty();
    engine::StepSequence s{.block_ids = engine::WholeContextBlocks(ex.options(), seq++),
                           .pos_begin = 0,
                           .tokens = c.prompt_ids,
                           .all_logits = every_position};
    ASSIGN_OR_RETURN(engine::StepResult r, ex.Step({s}));
    if (!every_position) {
      a.err.Add(c.last_logits, r.logits[0].data());
      a.first_token_safe.push_back(false);
      continue;
    }
    const size_t v = c.logits[0].size();
    for (size_t p = 0; p < c.prompt_ids.size(); ++p) a.err.Add(c.logits[p], r.logits[0].data() + p * v);
    const std::vector<float>& ref = c.logits.back();
    const float* got = r.logits[0].data() + (c.prompt_ids.size() - 1) * v;
    std::vector<float> sorted = ref;
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
    double worst = 0;
    for (size_t i = 0; i < v; ++i) worst = std::max(worst, std::fabs(static_cast<double>(got[i]) - ref[i]));
    a.first_token_safe.push_back(sorted[0] - sorted[1] > 2 * worst);
  }
  ASSIGN_OR_RETURN(auto res, engine::Generate(ex, GreedyRequests(golden)));
  for (size_t i = 0; i < res.size(); ++i) {
    a.agree += LeadingAgreement(res[i].tokens, golden.cases[i].greedy_ids);
    a.total += golden.cases[i].greedy_ids.size();
    a.generated.push_back(std::move(res[i].tokens));
  }
  return a;
}

// The model in `dir` on `ranks` tensor-parallel CPU ranks with `model` options and 64 tokens per
// step; `*ckpt` keeps the checkpoint alive beside it.
inline absl::StatusOr<std::unique_ptr<engine::TpExecutor>> LoadOnCpuRanks(const std::string& dir, int ranks,
                                                                           engine::ModelOptions model,
                                                                           std::unique_ptr<Checkpoint>* ckpt) {
  ASSIGN_OR_RETURN(ModelSpec spec, LoadModelSpec(dir));
  ASSIGN_OR_RETURN(*ckpt, Checkpoint::Open(dir));
  engine::ExecutorOptions eo;
  eo.cpu_ranks = ranks;
  eo.model = std::move(model);
  eo.model.max_step_tokens = 64;
  return engine::TpExecutor::Create(spec, **ckpt, eo);
}

// Expects each case's first generated token to be the reference's where it cannot flip
// (first_token_safe), or everywhere with `all`; returns how many were checked.
inline size_t ExpectFirstTokens(const GoldenAccuracy& a, const GoldenModel& golden, const std::string& label,
                                bool all = false) {
  size_t checked = 0;
  for (size_t i = 0; i < a.generated.size(); ++i) {
    EXPECT_FALSE(a.generated[i].empty()) << label << " case " << i;
    if (a.generated[i].empty() || !(all || a.first_token_safe[i])) continue;
    EXPECT_EQ(a.generated[i][0], golden.cases[i].greedy_ids[0]) << label << " case " << i;
    ++checked;
  }
  return checked;
}

}  // namespace shardserve::testing

#endif  // SHARDSERVE_TESTS_TESTING_LOGIT_ERRORS_H_

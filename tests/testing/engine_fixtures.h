// What the engine tests that run a whole model share: a model loaded on a given backend, and one
// greedy generation request per golden case of tests/golden (of the reference's length).
#ifndef SHARDSERVE_TESTS_TESTING_ENGINE_FIXTURES_H_
#define SHARDSERVE_TESTS_TESTING_ENGINE_FIXTURES_H_

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/model_spec/model_spec.h"
#include "common/safetensors/safetensors.h"
#include "absl/strings/string_view.h"
#include "common/status/macros.h"
#include "tests/testing/golden.h"
#include "worker/engine/generator.h"
#include "worker/engine/model.h"
#include "worker/engine/step_runner.h"
#include "worker/kernels/backend.h"

namespace shardserve::testing {

// A one-rank Model with what it borrows (spec, checkpoint, backend), kept alive together.
struct LoadedModel {
  ModelSpec spec;
  std::unique_ptr<Checkpoint> ckpt;
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<engine::Model> model;
};

// Loads the model in `dir` (config.json + safetensors) on `backend`.
inline absl::StatusOr<LoadedModel> LoadModel(const std::string& dir, const engine::ModelOptions& options,
                                             std::unique_ptr<kernels::Backend> backend) {
  LoadedModel l;
  ASSIGN_OR_RETURN(l.spec, LoadModelSpec(dir));
  ASSIGN_OR_RETURN(l.ckpt, Checkpoint::Open(dir));
  l.backend = std::move(backend);
  ASSIGN_OR_RETURN(l.model, engine::Model::Create(l.spec, *l.ckpt, l.backend.get(), options));
  return l;
}

// Records what a one-rank model reports per (layer, expert), in the order reported (called from
// the model's thread only).
class ExpertTokens final : public engine::StepObserver {
 public:
  void OnCollective(int /*rank*/, absl::string_view /*op*/, double /*seconds*/) override {}
  void OnExpertTokens(int64_t layer, int64_t expert, int64_t tokens) override {
    calls.push_back({layer, expert, tokens});
  }
  std::vector<std::array<int64_t, 3>> calls;
};

inline std::vector<engine::GenerationRequest> GreedyRequests(const GoldenModel& g) {
  std::vector<engine::GenerationRequest> reqs;
  for (const GoldenCase& c : g.cases) {
    engine::GenerationRequest r;
    r.prompt = c.prompt_ids;
    r.max_tokens = static_cast<int32_t>(c.greedy_ids.size());
    reqs.push_back(r);
  }
  return reqs;
}

}  // namespace shardserve::testing

#endif  // SHARDSERVE_TESTS_TESTING_ENGINE_FIXTURES_H_

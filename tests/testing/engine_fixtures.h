// What the engine tests that run a whole model share: a model loaded on a given backend, and one
// greedy generation request per golden case of tests/golden (of the reference's length).
#ifndef SHARDSERVE_TESTS_TESTING_ENGINE_FIXTURES_H_
#define SHARDSERVE_TESTS_TESTING_ENGINE_FIXTURES_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/model_spec/model_spec.h"
#include "common/safetensors/safetensors.h"
#include "common/status/macros.h"
#include "tests/testing/golden.h"
#include "worker/engine/generator.h"
#include "worker/engine/model.h"
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

// LocalPipeline: pipeline stages chained in one process — the stages' StepRunners called in order,
// each stage's hidden states fed to the next. It is what the cluster's stage streams do over gRPC,
// without the network: the in-process reference for pipeline layouts and their tests.
#ifndef SHARDSERVE_WORKER_ENGINE_LOCAL_PIPELINE_H_
#define SHARDSERVE_WORKER_ENGINE_LOCAL_PIPELINE_H_

#include <memory>
#include <vector>

#include "worker/engine/step_runner.h"

namespace shardserve::engine {

class LocalPipeline final : public StepRunner {
 public:
  // `stages` cover the model's layers in order (stage i ends where stage i+1 begins); checked.
  static absl::StatusOr<std::unique_ptr<LocalPipeline>> Create(std::vector<std::unique_ptr<StepRunner>> stages);

  absl::StatusOr<StepResult> Step(const std::vector<StepSequence>& batch,
                                  absl::Span<const float> hidden_in = {}) override;
  const ModelSpec& spec() const override { return stages_.front()->spec(); }
  const ModelOptions& options() const override { return stages_.front()->options(); }

 private:
  explicit LocalPipeline(std::vector<std::unique_ptr<StepRunner>> stages) : stages_(std::move(stages)) {}
  std::vector<std::unique_ptr<StepRunner>> stages_;
};

}  // namespace shardserve::engine

#endif  // SHARDSERVE_WORKER_ENGINE_LOCAL_PIPELINE_H_

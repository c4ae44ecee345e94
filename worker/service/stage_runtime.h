// StageRuntime: one loaded pipeline stage of a worker — its ranks (a StepRunner), its place in
// the pipeline, and its link to the next stage. Run() takes a reassembled micro-batch and returns
// the response that goes back up the stream: on the last stage the sampled tokens, elsewhere the
// response relayed from the next stage.
//
// Thread-safety: Run() is called from one thread (the worker's stage thread); Cancel() from any.
#ifndef SHARDSERVE_WORKER_SERVICE_STAGE_RUNTIME_H_
#define SHARDSERVE_WORKER_SERVICE_STAGE_RUNTIME_H_

#include <memory>
#include <mutex>
#include <string>

#include "shardserve/v1/stage.grpc.pb.h"
#include "worker/engine/sampling.h"
#include "worker/engine/step_runner.h"

namespace shardserve::service {

class WorkerMetrics;

struct StageConfig {
  std::string assignment_id;
  int stage = 0;             // index in the pipeline (metrics label)
  std::string next_address;  // empty on the last stage
  WorkerMetrics* metrics = nullptr;  // optional, not owned; must outlive the runtime
};

class StageRuntime {
 public:
  // `runner` covers this stage's layers; the last stage is the one whose runner holds the last
  // layer (it must then have an empty next_address, and the others a non-empty one).
  StageRuntime(std::unique_ptr<engine::StepRunner> runner, StageConfig config);
  ~StageRuntime();

  // Never fails as a call: errors travel in the response's error_code / error_message, so the
  // coordinator can fail the batch's requests and the stream stays open.
  v1::StepResponse Run(const v1::StepRequest& request);
  // Cancels the downstream stream (used at shutdown so a blocked Run returns).
  void Cancel();

  const StageConfig& config() const { return config_; }
  const engine::StepRunner& runner() const { return *runner_; }
  bool is_last() const { return config_.next_address.empty(); }

 private:
  absl::StatusOr<v1::StepResponse> RunOrError(const v1::StepRequest& request);
  absl::StatusOr<v1::StepResponse> Forward(const std::vector<v1::StepRequest>& messages);
  void ResetDownstream();

  std::unique_ptr<engine::StepRunner> runner_;
  const StageConfig config_;
  engine::Sampler sampler_;
  // Downstream link, used by the stage thread; `mu_` guards replacing / cancelling it.
  std::mutex mu_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Stage::Stub> stub_;
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>> stream_;
};

}  // namespace shardserve::service

#endif  // SHARDSERVE_WORKER_SERVICE_STAGE_RUNTIME_H_

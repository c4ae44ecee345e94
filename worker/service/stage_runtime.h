// StageRuntime: one loaded pipeline stage of a worker — its ranks (a StepRunner), its place in
// the pipeline, and its link to the next stage.
//
// Run() takes a reassembled micro-batch, runs this stage's layers on it, and then either answers
// at once (the last stage: the sampled tokens; or an error) or forwards the activations over the
// long-lived stream to the next stage and returns WITHOUT waiting for its answer: the answer is
// relayed to `done` (on a gRPC thread) when it arrives. Writes downstream never block the stage
// thread: the link is the shared stage-stream transport (common/rpc/stage_stream_client.h), a
// callback-API stream with its own write queue. So while the next stage works on
// micro-batch k, this stage already runs k+1 — the pipelining that lets P stages work on P
// micro-batches at once. Answers are matched to requests by step_id.
//
// Direct answers (stage.proto): the last stage writes the answer of a request with an
// answer_route to the coordinator's return stream of that route (StageConfig::answer_routes) and
// gives `done` only an acknowledgement (answered_direct); with no such stream open it gives `done`
// the answer itself, which then relays up the pipeline.
//
// When the downstream stream breaks (the next stage went away or answered something unexpected),
// every micro-batch still waiting on it is answered with UNAVAILABLE naming the next stage, and the
// next Run opens a new stream.
//
// Where Run() runs: on the worker's stage thread, or on the gRPC thread that read the micro-batch
// when MayRunOnReader() says that is safe and short (WorkerOptions::stage_inline). There, nothing
// may wait on gRPC: gRPC holds back the completions that a reaction starts until the reaction
// returns. So such a run uses the open link as it is (a closing one fails the micro-batch with
// UNAVAILABLE, as a link that breaks a moment later would) and never replaces it.
//
// Thread-safety: Run() is called by one thread at a time (the caller orders the calls, e.g. under
// a lock); `done` runs on the calling thread or on a gRPC thread of the link, once per request;
// MayRunOnReader() and Cancel() from any thread.
#ifndef SHARDSERVE_WORKER_SERVICE_STAGE_RUNTIME_H_
#define SHARDSERVE_WORKER_SERVICE_STAGE_RUNTIME_H_

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/security/credentials.h>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "common/concurrency/mutex.h"
#include "common/rpc/stage_stream_client.h"
#include "common/tensor/dtype.h"
#include "worker/service/answer_routes.h"
#include "worker/service/convert.h"
#include "worker/service/expert_client.h"
#include "shardserve/v1/stage.grpc.pb.h"
#include "worker/engine/remote_experts.h"
#include "worker/engine/sampling.h"
#include "worker/engine/step_runner.h"

namespace shardserve::service {

class WorkerMetrics;

struct StageConfig {
  std::string assignment_id;
  int stage = 0;             // index in the pipeline (metrics label)
  std::string next_address;  // empty on the last stage
  WorkerMetrics* metrics = nullptr;  // optional, not owned; must outlive the runtime
  // What the runner calls for spilled experts, if anything; the runtime keeps it alive as long as
  // the runner.
  std::shared_ptr<GrpcRemoteExperts> remote_experts;
  // Credentials of the channel to the next stage (null = plaintext).
  std::shared_ptr<grpc::ChannelCredentials> peer_credentials;
  // The worker's open return streams (last stage: where direct answers go); optional, not owned,
  // must outlive the runtime. Null = every answer goes up the StepStreams.
  AnswerRoutes* answer_routes = nullptr;
  // Code what this stage forwards as step deltas when the next stage accepts them
  // (common/rpc/step_delta.h); the sequences keep the keys their upstream stream gave them.
  bool step_deltas = false;
  // How the hidden states this stage forwards travel (Assignment.hidden_wire_dtype): kF32, or
  // kBF16 (half the bytes, each value rounded to nearest even). The next stage reads either.
  DType hidden_wire_dtype = DType::kF32;
};

class StageRuntime {
 public:
  // `runner` covers this stage's layers; the last stage is the one whose runner holds the last
  // layer (it must then have an empty next_address, and the others a non-empty one). The runner
  // (weights and KV cache) may be shared with the runtime this one replaces (WorkerServer keeps a
  // loaded stage when only its id or next hop changes); both must then be driven from the same
  // stage thread, and config.remote_experts must be the one the runner calls.
  StageRuntime(std::shared_ptr<engine::StepRunner> runner, StageConfig config);
  ~StageRuntime();

  using Done = std::function<void(v1::StepResponse)>;

  // Which thread calls Run(): the stage thread, or the gRPC thread that read the micro-batch (then
  // the run must not wait on gRPC; see above).
  enum class Caller { kStageThread, kReader };

  // Never fails as a call: `done` gets exactly one response, and errors travel in its error_code /
  // error_message, so the coordinator can fail the batch's requests and the stream stays open.
  void Run(const v1::StepRequest& request, Done done, Caller caller = Caller::kStageThread);
  // Whether `request` may run on the gRPC thread that read it: only when its run waits on nothing
  // of gRPC's (no remote experts; the last stage, or the link to the next stage open), and only
  // when this stage's last step says it takes at most `budget` (its time, scaled up, never down,
  // by the new tokens of `request` against its own). False before the first step.
  bool MayRunOnReader(const v1::StepRequest& request, absl::Duration budget);
  // Cancels the downstream stream (at shutdown): micro-batches waiting on it are answered with
  // UNAVAILABLE.
  void Cancel();

  const StageConfig& config() const { return config_; }
  const engine::StepRunner& runner() const { return *runner_; }
  // The runner, to build a runtime for a new id or next hop on the same weights.
  std::shared_ptr<engine::StepRunner> shared_runner() const { return runner_; }
  bool is_last() const { return config_.next_address.empty(); }

 private:
  // The sampled tokens (last stage, with compute_us: its time from the start of its layers to the
  // answer), or nullopt when the batch was forwarded (its answer will come through the link);
  // errors as status.
  absl::StatusOr<std::optional<v1::StepResponse>> RunOrForward(const v1::StepRequest& request, Done& done,
                                                              Caller caller);
  // The answer of a batch with decode_steps > 1 (stage.proto): the steps run by
  // engine::RunDecodeSteps, sampled as single steps would be. InvalidArgument unless this stage
  // embeds and samples.
  absl::StatusOr<v1::StepResponse> RunDecodeSteps(const StageBatch& batch, const std::vector<engine::StepSequence>& steps);
  // Gives `response` (this stage's answer to `request`) to the coordinator's return stream when
  // the request names one and this is the last stage, and an acknowledgement to `done`; else gives
  // `response` to `done`.
  void Answer(const v1::StepRequest& request, v1::StepResponse response, Done& done);
  // Sends `messages` (one micro-batch) downstream; `done` gets the answer later.
  // On the reader thread it sends on the open link as it is (see above).
  void Forward(uint64_t step_id, rpc::StageStreamClient::Messages messages, Done done, Caller caller);
  // From here on, what `response` (the answer to `batch`, this stage sampling) sampled under each
  // sample_key is what the next micro-batch's from_previous sequences take.
  void RememberSamples(const StageBatch& batch, const v1::StepResponse& response);
  // Remembers the last step's time and new tokens (what MayRunOnReader predicts from).
  void RecordStep(int64_t tokens, std::chrono::steady_clock::duration elapsed);
  // The open link, opening one when there is none or the last one broke.
  std::shared_ptr<rpc::StageStreamClient> OpenLink();

  std::shared_ptr<engine::RemoteExperts> remote_experts_;  // outlives runner_
  std::shared_ptr<engine::StepRunner> runner_;
  const StageConfig config_;
  engine::Sampler sampler_;
  std::shared_ptr<grpc::Channel> channel_;  // by Run() only
  // Run()'s working state, reused from step to step so that a steady decode allocates nothing for
  // it: the micro-batch converted, the engine's view of its sequences, and the samples of the
  // micro-batch before it (swapped with previous_samples_).
  StageBatch batch_;
  std::vector<engine::StepSequence> steps_;
  absl::flat_hash_map<uint64_t, int32_t> previous_;
  // Where the messages to the next stage are built (as many as a few micro-batches in flight wait
  // for reuse).
  const std::shared_ptr<rpc::MessagePool<v1::StepRequest>> message_pool_ =
      rpc::MessagePool<v1::StepRequest>::Create(size_t{16} << 10, 8);
  // The last step's time and new tokens (0 before the first): MayRunOnReader's prediction.
  std::atomic<int64_t> last_step_ns_{0};
  std::atomic<int64_t> last_step_tokens_{0};
  Mutex mu_;
  // The current link (a closed one stays until the next OpenLink replaces it).
  std::shared_ptr<rpc::StageStreamClient> link_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  // Overlapped decode calls (stage.proto, StepSequence.from_previous): the last id sampled per
  // sample_key by the micro-batch that ran last (empty after one that failed or sampled under no key).
  absl::flat_hash_map<uint64_t, int32_t> previous_samples_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardserve::service

#endif  // SHARDSERVE_WORKER_SERVICE_STAGE_RUNTIME_H_

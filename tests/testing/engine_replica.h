// EngineReplica: a coordinator ReplicaClient that runs the real engine in-process — the stages a
// replica's workers would run (TpExecutor per stage, chained by LocalPipeline), with sampling on
// the "last stage" exactly as a worker does it: Sampler::Sample(logits row, params, sample_index).
// Scheduler and API tests use it in place of gRPC to stage 0, and compare the scheduler's output
// with engine::Generate run alone per request.
//
// Test hooks let a test act at a precise step (cancel a sequence, fail a step) or hold every step
// until it releases them, without sleeping.
//
// Thread-safety: as ReplicaClient; the hooks and StepInputs() may be used from any thread.
#ifndef SHARDSERVE_TESTS_TESTING_ENGINE_REPLICA_H_
#define SHARDSERVE_TESTS_TESTING_ENGINE_REPLICA_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/scheduler/replica_client.h"

namespace shardserve::engine {
class StepRunner;
class Sampler;
struct StepSequence;
}  // namespace shardserve::engine

namespace shardserve::testing {

struct EngineReplicaOptions {
  std::string model_dir;
  // Layer index where each stage after the first begins, ascending (empty = one stage).
  std::vector<int64_t> stage_starts;
  int tp = 1;  // CPU ranks per stage
  // As the assignment gives them to every stage: must match the scheduler's options.
  int64_t kv_blocks = 0;      // KV cache blocks per stage; 0 = the engine's default
  int64_t kv_block_size = 16;
  int64_t max_seq_len = 0;  // 0 = max_position_embeddings
  int64_t max_step_tokens = 256;
};

class EngineReplica final : public coordinator::ReplicaClient {
 public:
  // Loads the model once per stage. Errors of loading (NotFound, InvalidArgument, ...).
  static absl::StatusOr<std::unique_ptr<EngineReplica>> Create(const EngineReplicaOptions& options);
  ~EngineReplica() override;

  absl::StatusOr<coordinator::StepOutput> Step(const coordinator::StepInput& input) override;
  // Records the step (in call order, which is the order steps run in) before `while_waiting`.
  absl::StatusOr<coordinator::StepOutput> StepOverlapping(const coordinator::StepInput& input,
                                                          absl::FunctionRef<void()> while_waiting) override;
  // Takes overlapped decode calls, as a worker does (the tokens of from_previous sequences are its
  // own last samples for them); false after SetOverlapsDecodeCallsForTest(false).
  bool OverlapsDecodeCalls() const override;
  void Shutdown() override;

  // Called on the stepping thread before each step runs (with no scheduler lock held): it may
  // call the scheduler (e.g. Cancel), or block until the test releases it. A non-OK return fails
  // the step with that status.
  using StepHook = std::function<absl::Status(const coordinator::StepInput&)>;
  void SetStepHookForTest(StepHook hook);

  // While held, every Step waits (after being recorded and after the hook) until released or
  // Shutdown() (which then fails it with Unavailable, as a gRPC replica would), at most 120 s.
  void HoldStepsForTest();
  void ReleaseStepsForTest();

  // Every step input seen so far, in order.
  std::vector<coordinator::StepInput> StepInputsForTest() const;
  int64_t NumStepsForTest() const;
  // Waits until at least `n` steps have been recorded (StepInputsForTest().size() >= n); false
  // when `timeout` passed first.
  bool WaitForStepsForTest(int64_t n, absl::Duration timeout = absl::Seconds(60)) const;
  // The KV cache blocks every stage holds (kv_blocks resolved).
  int64_t kv_blocks() const;
  void SetOverlapsDecodeCallsForTest(bool on);

 private:
  EngineReplica() = default;
  // Runs a recorded step (its turn come, run_mu_ held).
  absl::StatusOr<coordinator::StepOutput> Run(const coordinator::StepInput& input)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(run_mu_);
  // The step's answer from the engine, its tokens given.
  absl::StatusOr<coordinator::StepOutput> Compute(const coordinator::StepInput& input,
                                                  std::vector<engine::StepSequence> batch)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(run_mu_);

  std::unique_ptr<engine::StepRunner> runner_;
  std::unique_ptr<engine::Sampler> sampler_;  // used by the stepping thread only

  absl::Mutex run_mu_;  // serialises the runner and the sampler (taken after mu_ is released)
  mutable absl::Mutex mu_;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  StepHook hook_ ABSL_GUARDED_BY(mu_);
  bool held_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<coordinator::StepInput> inputs_ ABSL_GUARDED_BY(mu_);
  bool overlaps_ ABSL_GUARDED_BY(mu_) = true;
  // Steps run in the order they were recorded: step i (its index in inputs_) runs when next_run_ == i.
  size_t next_run_ ABSL_GUARDED_BY(mu_) = 0;
  // The last id sampled per sequence id by the step that ran last (for from_previous).
  absl::flat_hash_map<uint64_t, int32_t> previous_samples_ ABSL_GUARDED_BY(run_mu_);
};

}  // namespace shardserve::testing

#endif  // SHARDSERVE_TESTS_TESTING_ENGINE_REPLICA_H_

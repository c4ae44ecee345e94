// TpExecutor: one worker's ranks running one model tensor-parallel, one thread per rank.
//
// Each rank thread owns its backend (a CPU rank with single-threaded BLAS, or one GPU), its
// communicator, its weight shard and its KV cache: nothing of a rank is touched by another thread.
// Step() hands the same batch to every rank, waits for all of them and returns rank 0's logits
// (a single CPU rank runs on the caller's thread instead: no hand-off for the latency-bound case).
//
// Errors: a step that fails validation fails identically on every rank (validation precedes any
// collective) and leaves the executor usable, as does a failure the ranks ran on through together
// (IsGroupIntact, e.g. a remote expert call). A rank that fails otherwise mid-step aborts the
// communicator group, so its peers return instead of waiting; the executor is then broken and
// every later Step returns FailedPrecondition with the first error.
//
// Thread-safety: Step() may be called from one thread at a time.
#ifndef SHARDSERVE_WORKER_ENGINE_EXECUTOR_H_
#define SHARDSERVE_WORKER_ENGINE_EXECUTOR_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_spec/model_spec.h"
#include "common/plan/memory_model.h"
#include "common/safetensors/safetensors.h"
#include "worker/engine/step_runner.h"
#include "worker/kernels/backend.h"

namespace shardserve::engine {

struct ExecutorOptions {
  kernels::DeviceKind kind = kernels::DeviceKind::kCpu;
  int cpu_ranks = 1;              // kCpu: number of ranks (threads)
  int cpu_threads = 1;            // kCpu with one rank: BLAS threads (ranks > 1 use 1 each)
  std::vector<int> cuda_devices;  // kCuda: one rank per device ordinal
  bool cuda_pdl = false;          // kCuda: programmatic dependent launch (kernels::BackendOptions)
  bool cuda_mma_attention = true;  // kCuda: prefill attention on tensor cores (kernels::BackendOptions)
  bool cuda_fused_norm = true;     // kCuda: norms inside the decode GEMV (kernels::BackendOptions)
  ModelOptions model;             // shard and comm are set per rank by the executor
};

class TpExecutor final : public StepRunner {
 public:
  // Starts the rank threads; each creates its backend and loads its shard. Returns the first
  // rank's error (prefixed with the rank) when any fails; InvalidArgument for bad options.
  // `ckpt` is only used during Create.
  static absl::StatusOr<std::unique_ptr<TpExecutor>> Create(const ModelSpec& spec, const Checkpoint& ckpt,
                                                            const ExecutorOptions& options);
  ~TpExecutor() override;  // stops and joins the rank threads

  absl::StatusOr<StepResult> Step(const std::vector<StepSequence>& batch,
                                  absl::Span<const float> hidden_in = {}) override;
  const ModelSpec& spec() const override { return spec_; }
  const ModelOptions& options() const override { return model_options_; }

  int ranks() const { return static_cast<int>(ranks_.size()); }
  // Device bytes of weights held by each rank, as allocated (measured).
  std::vector<size_t> WeightBytesPerRank() const;
  // Device bytes of KV cache held by each rank, as allocated (measured).
  std::vector<size_t> KvCacheBytesPerRank() const;
  // What the memory model (common/plan/memory_model.h) says each rank holds (Model::memory).
  std::vector<RankMemory> MemoryPerRank() const;
  // Steps that ran as a replayed op graph, summed over ranks (read between steps).
  int64_t GraphReplays() const;

 private:
  struct Rank;
  TpExecutor(const ModelSpec& spec, const ExecutorOptions& options);
  void RankLoop(Rank* rank, const Checkpoint* ckpt);

  const ModelSpec spec_;
  const ExecutorOptions options_;
  ModelOptions model_options_;  // resolved, as rank 0 reports them
  std::vector<std::unique_ptr<Rank>> ranks_;
  struct Sync;
  std::unique_ptr<Sync> sync_;
};

}  // namespace shardserve::engine

#endif  // SHARDSERVE_WORKER_ENGINE_EXECUTOR_H_

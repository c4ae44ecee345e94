#include "worker/engine/executor.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "common/concurrency/mutex.h"
#include "common/status/macros.h"
#include "worker/comm/comm_registry.h"
#include "worker/engine/model.h"
#include "worker/kernels/registry.h"

namespace shardserve::engine {

struct TpExecutor::Rank {
  int index = 0;
  std::unique_ptr<comm::Communicator> comm;
  // Owned by the rank thread once started.
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<Model> model;
  std::thread thread;
  // Written by the rank thread before it reports done (under Sync::mu), read by Step() after.
  absl::Status init_status;
  absl::StatusOr<StepResult> result;
};

// shardserve::Mutex (a std::mutex underneath): the TSan build of the rank threads sees it.
struct TpExecutor::Sync {
  Mutex mu;
  CondVar to_ranks;   // a job or stop is posted
  CondVar to_caller;  // a rank finished
  uint64_t job ABSL_GUARDED_BY(mu) = 0;  // incremented per step
  int done ABSL_GUARDED_BY(mu) = 0;      // ranks finished with the current job (or init)
  bool stop ABSL_GUARDED_BY(mu) = false;
  const std::vector<StepSequence>* batch ABSL_GUARDED_BY(mu) = nullptr;
  absl::Span<const float> hidden ABSL_GUARDED_BY(mu);
  absl::Status broken ABSL_GUARDED_BY(mu);  // first mid-step failure
};

TpExecutor::TpExecutor(const ModelSpec& spec, const ExecutorOptions& options)
    : spec_(spec), options_(options), sync_(std::make_unique<Sync>()) {}

absl::StatusOr<std::unique_ptr<TpExecutor>> TpExecutor::Create(const ModelSpec& spec, const Checkpoint& ckpt,
                                                               const ExecutorOptions& options) {
  int n = 0;
  comm::CommKind comm_kind = comm::CommKind::kHost;
  switch (options.kind) {
    case kernels::DeviceKind::kCpu:
      n = options.cpu_ranks;
      if (n < 1 || n > 256) return absl::InvalidArgumentError(absl::StrCat("cpu ranks must be in [1, 256], got ", n));
      if (options.cpu_threads < 1) {
        return absl::InvalidArgumentError(absl::StrCat("cpu threads must be >= 1, got ", options.cpu_threads));
      }
      break;
    case kernels::DeviceKind::kCuda:
      n = static_cast<int>(options.cuda_devices.size());
      if (n < 1) return absl::InvalidArgumentError("no CUDA devices given");
      comm_kind = comm::CommKind::kNccl;
      for (int d : options.cuda_devices) {
        if (d < 0 || d >= kernels::CudaDeviceCount()) {
          if (!kernels::CudaCompiledIn()) {
            return absl::UnimplementedError("CUDA devices requested but this binary was built without CUDA");
          }
          return absl::FailedPreconditionError(absl::StrCat("CUDA device ", d, " requested but this machine has ",
                                                            kernels::CudaDeviceCount(), " CUDA device(s)"));
        }
      }
      break;
  }
  std::unique_ptr<TpExecutor> ex(new TpExecutor(spec, options));
  std::vector<std::unique_ptr<comm::Communicator>> comms;
  if (n > 1) {
    ASSIGN_OR_RETURN(comms, comm::CreateCommGroup(comm_kind, n, options.cuda_devices));
  }
  for (int r = 0; r < n; ++r) {
    auto rank = std::make_unique<Rank>();
    rank->index = r;
    if (n > 1) rank->comm = std::move(comms[static_cast<size_t>(r)]);
    ex->ranks_.push_back(std::move(rank));
  }
  for (auto& rank : ex->ranks_) {
    Rank* raw = rank.get();
    raw->thread = std::thread([e = ex.get(), raw, &ckpt] { e->RankLoop(raw, &ckpt); });
  }
  // Wait for every rank's initialisation.
  {
    Sync& s = *ex->sync_;
    MutexLock lock(&s.mu);
    while (s.done != n) s.to_caller.Wait(&s.mu);
    s.done = 0;
  }
  for (auto& rank : ex->ranks_) {
    if (!rank->init_status.ok()) {
      return absl::Status(rank->init_status.code(),
                          absl::StrCat("rank ", rank->index, " of ", n, ": ", rank->init_status.message()));
    }
  }
  ex->model_options_ = ex->ranks_[0]->model->options();
  return ex;
}

TpExecutor::~TpExecutor() {
  {
    MutexLock lock(&sync_->mu);
    sync_->stop = true;
  }
  sync_->to_ranks.SignalAll();
  for (auto& rank : ranks_) {
    if (rank->thread.joinable()) rank->thread.join();
  }
}

void TpExecutor::RankLoop(Rank* rank, const Checkpoint* ckpt) {
  const int n = static_cast<int>(ranks_.size());
  kernels::BackendOptions bo;
  bo.kind = options_.kind;
  bo.cpu_threads = n > 1 ? 1 : options_.cpu_threads;
  bo.cuda_pdl = options_.cuda_pdl;
  bo.cuda_mma_attention = options_.cuda_mma_attention;
  bo.cuda_fused_norm = options_.cuda_fused_norm;
  if (options_.kind == kernels::DeviceKind::kCuda) bo.device_index = options_.cuda_devices[static_cast<size_t>(rank->index)];
  absl::Status init = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(rank->backend, kernels::CreateBackend(bo));
    ModelOptions mo = options_.model;
    mo.shard = {.rank = rank->index, .size = n};
    mo.comm = rank->comm.get();
    if (rank->index != 0) mo.on_load_progress = nullptr;  // the ranks load alike: rank 0 reports
    ASSIGN_OR_RETURN(rank->model, Model::Create(spec_, *ckpt, rank->backend.get(), mo));
    return absl::OkStatus();
  }();
  uint64_t seen = 0;
  Sync& s = *sync_;
  {
    MutexLock lock(&s.mu);
    rank->init_status = init;
    ++s.done;
  }
  s.to_caller.Signal();
  if (!init.ok()) return;
  while (true) {
    const std::vector<StepSequence>* batch = nullptr;
    absl::Span<const float> hidden;
    {
      MutexLock lock(&s.mu);
      while (!s.stop && s.job <= seen) s.to_ranks.Wait(&s.mu);
      if (s.stop) return;
      seen = s.job;
      batch = s.batch;
      hidden = s.hidden;
    }
    absl::StatusOr<StepResult> result = rank->model->Step(*batch, hidden);
    if (!result.ok() && !IsGroupIntact(result.status()) && rank->comm != nullptr) {
      rank->comm->Abort(result.status());  // release peers waiting in a collective
    }
    {
      MutexLock lock(&s.mu);
      rank->result = std::move(result);
      ++s.done;
    }
    s.to_caller.Signal();
  }
}

absl::StatusOr<StepResult> TpExecutor::Step(const std::vector<StepSequence>& batch,
                                            absl::Span<const float> hidden_in) {
  const int n = static_cast<int>(ranks_.size());
  // One CPU rank: run on the caller's thread and save two thread hand-offs per step (a CPU
  // backend is not tied to the thread that made it; a CUDA one is, and stays on its rank thread).
  if (n == 1 && options_.kind == kernels::DeviceKind::kCpu) return ranks_[0]->model->Step(batch, hidden_in);
  Sync& s = *sync_;
  {
    MutexLock lock(&s.mu);
    if (!s.broken.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("tensor-parallel group is broken after an earlier failure: ", s.broken.message()));
    }
    s.batch = &batch;
    s.hidden = hidden_in;
    s.done = 0;
    ++s.job;
    s.to_ranks.SignalAll();
    while (s.done != n) s.to_caller.Wait(&s.mu);
    s.batch = nullptr;
  }
  // Rank 0's status is the one to report: a validation error is the same on every rank, a remote
  // expert failure happens only on rank 0, and a peer's abort shows on rank 0 as Aborted carrying
  // the first error.
  for (auto& rank : ranks_) {
    if (!rank->result.ok()) {
      absl::Status st = rank->result.status();
      if (!IsGroupIntact(st)) {
        MutexLock lock(&s.mu);
        s.broken = absl::Status(st.code(), absl::StrCat("rank ", rank->index, ": ", st.message()));
        return s.broken;
      }
      return st;
    }
  }
  return std::move(ranks_[0]->result);
}

std::vector<size_t> TpExecutor::WeightBytesPerRank() const {
  std::vector<size_t> bytes;
  for (const auto& rank : ranks_) bytes.push_back(rank->model->weight_bytes());
  return bytes;
}

std::vector<RankMemory> TpExecutor::MemoryPerRank() const {
  std::vector<RankMemory> out;
  for (const auto& rank : ranks_) out.push_back(rank->model->memory());
  return out;
}

int64_t TpExecutor::GraphReplays() const {
  int64_t replays = 0;
  for (const auto& rank : ranks_) replays += rank->model->graph_replays();
  return replays;
}

std::vector<size_t> TpExecutor::KvCacheBytesPerRank() const {
  std::vector<size_t> bytes;
  for (const auto& rank : ranks_) bytes.push_back(rank->model->kv_cache_bytes());
  return bytes;
}

}  // namespace shardserve::engine

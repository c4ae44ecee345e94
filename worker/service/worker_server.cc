#include "worker/service/worker_server.h"

#include <grpcpp/grpcpp.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log/log.h"
#include "common/model_spec/model_spec.h"
#include "common/safetensors/safetensors.h"
#include "common/status/grpc_status.h"
#include "common/status/macros.h"
#include "worker/engine/executor.h"
#include "worker/kernels/registry.h"
#include "worker/service/convert.h"

namespace shardserve::service {
namespace {

v1::StepResponse ErrorResponse(uint64_t step_id, const absl::Status& st) {
  v1::StepResponse r;
  r.set_step_id(step_id);
  r.set_error_code(static_cast<int32_t>(st.code()));
  r.set_error_message(std::string(st.message()));
  return r;
}

class WorkerServiceImpl final : public v1::Worker::CallbackService {
 public:
  explicit WorkerServiceImpl(WorkerServer* server) : server_(server) {}
  grpc::ServerUnaryReactor* Assign(grpc::CallbackServerContext* ctx, const v1::Assignment* request,
                                   v1::AssignResponse* /*response*/) override {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    reactor->Finish(ToGrpcStatus(server_->Assign(*request)));
    return reactor;
  }

 private:
  WorkerServer* server_;
};

// One data-plane stream from the previous hop. Requests are reassembled from chunks and handed
// to the stage thread; responses are written back one at a time, in completion order.
class StepStreamReactor final : public grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse> {
 public:
  explicit StepStreamReactor(WorkerServer* server) : server_(server), assembler_(kMaxAssembledBytes) {
    StartRead(&incoming_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      std::lock_guard lock(mu_);
      reads_done_ = true;
      MaybeFinishLocked();
      return;
    }
    if (server_->metrics() != nullptr) server_->metrics()->ObserveStream("rx", "upstream", incoming_.ByteSizeLong());
    absl::StatusOr<bool> complete = assembler_.Add(std::move(incoming_));
    incoming_.Clear();
    if (!complete.ok()) {
      Deliver(ErrorResponse(0, complete.status()), /*from_job=*/false);
    } else if (*complete) {
      {
        std::lock_guard lock(mu_);
        ++outstanding_jobs_;
      }
      server_->Enqueue(assembler_.Take(), [this](v1::StepResponse r) { Deliver(std::move(r), /*from_job=*/true); });
    }
    StartRead(&incoming_);
  }

  void OnWriteDone(bool /*ok*/) override {
    std::lock_guard lock(mu_);
    writing_ = false;
    if (!pending_.empty()) {
      WriteNextLocked();
    } else {
      MaybeFinishLocked();
    }
  }

  void OnDone() override { delete this; }

 private:
  static constexpr size_t kMaxAssembledBytes = size_t{1} << 30;

  void Deliver(v1::StepResponse response, bool from_job) {
    std::lock_guard lock(mu_);
    if (from_job) --outstanding_jobs_;
    pending_.push_back(std::move(response));
    if (!writing_) WriteNextLocked();
  }
  void WriteNextLocked() {
    current_ = std::move(pending_.front());
    if (server_->metrics() != nullptr) server_->metrics()->ObserveStream("tx", "upstream", current_.ByteSizeLong());
    pending_.pop_front();
    writing_ = true;
    StartWrite(&current_);
  }
  // Finish once the peer stopped sending and every job has been answered and written.
  void MaybeFinishLocked() {
    if (reads_done_ && outstanding_jobs_ == 0 && !writing_ && pending_.empty() && !finished_) {
      finished_ = true;
      Finish(grpc::Status::OK);
    }
  }

  WorkerServer* const server_;
  ChunkAssembler assembler_;  // used by reactions only (reads are serialised)
  v1::StepRequest incoming_;
  std::mutex mu_;
  std::deque<v1::StepResponse> pending_;  // guarded by mu_
  v1::StepResponse current_;              // the write in flight; mu_
  bool writing_ = false;                  // mu_
  bool reads_done_ = false;               // mu_
  bool finished_ = false;                 // mu_
  int outstanding_jobs_ = 0;              // mu_
};

class StageServiceImpl final : public v1::Stage::CallbackService {
 public:
  explicit StageServiceImpl(WorkerServer* server) : server_(server) {}
  grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>* StepStream(
      grpc::CallbackServerContext* /*ctx*/) override {
    return new StepStreamReactor(server_);
  }

 private:
  WorkerServer* server_;
};

}  // namespace

WorkerServer::WorkerServer(WorkerOptions options)
    : options_(std::move(options)),
      worker_service_(std::make_unique<WorkerServiceImpl>(this)),
      stage_service_(std::make_unique<StageServiceImpl>(this)),
      stage_thread_([this] { StageLoop(); }) {}

WorkerServer::~WorkerServer() {
  Shutdown();
  if (stage_thread_.joinable()) stage_thread_.join();
  std::thread loader;
  {
    std::lock_guard lock(mu_);
    loader = std::move(loader_);
  }
  if (loader.joinable()) loader.join();
}

grpc::Service* WorkerServer::worker_service() { return worker_service_.get(); }
grpc::Service* WorkerServer::stage_service() { return stage_service_.get(); }

WorkerStatusSnapshot WorkerServer::Status() const {
  std::lock_guard lock(mu_);
  return status_;
}

std::vector<v1::Device> WorkerServer::Devices() const {
  std::vector<v1::Device> devices;
  if (options_.kind == kernels::DeviceKind::kCpu) {
    auto mem = kernels::QueryDeviceMemory(kernels::DeviceKind::kCpu, 0);
    for (int r = 0; r < options_.cpu_ranks; ++r) {
      v1::Device d;
      d.set_kind(v1::DEVICE_KIND_CPU);
      d.set_index(r);
      // CPU ranks share the host's memory: each is offered an equal share.
      if (mem.ok()) {
        d.set_total_bytes(mem->total_bytes / options_.cpu_ranks);
        d.set_free_bytes(mem->free_bytes / options_.cpu_ranks);
      }
      devices.push_back(d);
    }
    return devices;
  }
  for (int index : options_.cuda_devices) {
    v1::Device d;
    d.set_kind(v1::DEVICE_KIND_CUDA);
    d.set_index(index);
    if (auto mem = kernels::QueryDeviceMemory(kernels::DeviceKind::kCuda, index); mem.ok()) {
      d.set_total_bytes(mem->total_bytes);
      d.set_free_bytes(mem->free_bytes);
    }
    devices.push_back(d);
  }
  return devices;
}

absl::Status WorkerServer::Assign(const v1::Assignment& a) {
  if (a.assignment_id().empty()) return absl::InvalidArgumentError("assignment_id is empty");
  if (a.model_path().empty()) return absl::InvalidArgumentError("model_path is empty");
  if (a.layer_begin() < 0 || a.layer_end() <= a.layer_begin()) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer range [", a.layer_begin(), ", ", a.layer_end(), ") is empty or negative"));
  }
  const bool cpu = options_.kind == kernels::DeviceKind::kCpu;
  if (a.device_kind() != (cpu ? v1::DEVICE_KIND_CPU : v1::DEVICE_KIND_CUDA)) {
    return absl::InvalidArgumentError(absl::StrCat("device_kind ", v1::DeviceKind_Name(a.device_kind()),
                                                   " does not match this worker's ", cpu ? "CPU" : "CUDA", " devices"));
  }
  if (a.devices_size() < 1) return absl::InvalidArgumentError("devices is empty");
  for (int d : a.devices()) {
    const bool known = cpu ? (d >= 0 && d < options_.cpu_ranks)
                           : std::find(options_.cuda_devices.begin(), options_.cuda_devices.end(), d) !=
                                 options_.cuda_devices.end();
    if (!known) return absl::InvalidArgumentError(absl::StrCat("device ", d, " is not one of this worker's"));
  }
  if (a.max_slots() < 1 || a.max_step_tokens() < 1 || a.max_seq_len() < 0) {
    return absl::InvalidArgumentError("max_slots and max_step_tokens must be >= 1 and max_seq_len >= 0");
  }
  std::lock_guard lock(mu_);
  if (stopping_) return absl::UnavailableError("worker is shutting down");
  if (status_.state == v1::WORKER_STATE_LOADING) {
    return absl::AbortedError(absl::StrCat("still loading assignment ", status_.assignment_id, "; retry later"));
  }
  if (loader_.joinable()) loader_.join();  // finished: it set the state before exiting
  status_ = {.state = v1::WORKER_STATE_LOADING, .assignment_id = a.assignment_id()};
  loader_ = std::thread([this, a] { Load(a); });
  return absl::OkStatus();
}

void WorkerServer::Load(v1::Assignment a) {
  const auto started = std::chrono::steady_clock::now();
  absl::StatusOr<std::shared_ptr<StageRuntime>> runtime = [&]() -> absl::StatusOr<std::shared_ptr<StageRuntime>> {
    ASSIGN_OR_RETURN(ModelSpec spec, LoadModelSpec(a.model_path()));
    const bool last = a.layer_end() == spec.num_layers;
    if (last != a.next_address().empty()) {
      return absl::InvalidArgumentError(absl::StrCat("layers [", a.layer_begin(), ", ", a.layer_end(), ") of ",
                                                     spec.num_layers, (last ? " end the model but" : " do not end the model but"),
                                                     " next_address is \"", a.next_address(), "\""));
    }
    ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(a.model_path()));
    engine::ExecutorOptions eo;
    eo.kind = options_.kind;
    if (options_.kind == kernels::DeviceKind::kCpu) {
      eo.cpu_ranks = a.devices_size();
      eo.cpu_threads = options_.cpu_threads;
    } else {
      eo.cuda_devices.assign(a.devices().begin(), a.devices().end());
    }
    eo.model.max_slots = a.max_slots();
    eo.model.max_seq_len = a.max_seq_len();
    eo.model.max_step_tokens = a.max_step_tokens();
    eo.model.layer_begin = a.layer_begin();
    eo.model.layer_end = a.layer_end();
    eo.model.observer = options_.metrics;
    ASSIGN_OR_RETURN(auto executor, engine::TpExecutor::Create(spec, *ckpt, eo));
    if (options_.metrics != nullptr) {
      options_.metrics->SetLoaded(std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(),
                                  executor->WeightBytesPerRank(), executor->KvCacheBytesPerRank());
    }
    return std::make_shared<StageRuntime>(std::move(executor),
                                          StageConfig{.assignment_id = a.assignment_id(),
                                                      .stage = a.stage(),
                                                      .next_address = a.next_address(),
                                                      .metrics = options_.metrics});
  }();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::shared_ptr<StageRuntime> old;
  {
    std::lock_guard lock(mu_);
    if (runtime.ok()) {
      old = std::move(runtime_);
      runtime_ = *runtime;
      status_ = {.state = v1::WORKER_STATE_READY, .assignment_id = a.assignment_id(),
                 .kv_slots = a.max_slots()};
    } else {
      status_ = {.state = v1::WORKER_STATE_FAILED, .assignment_id = a.assignment_id(),
                 .error = std::string(runtime.status().message())};
    }
  }
  if (runtime.ok()) {
    LOG(INFO) << "assignment " << a.assignment_id() << ": layers [" << a.layer_begin() << ", " << a.layer_end()
              << ") loaded in " << seconds << " s";
  } else {
    LOG(ERROR) << "assignment " << a.assignment_id() << " failed: " << runtime.status();
  }
}

void WorkerServer::Enqueue(v1::StepRequest request, std::function<void(v1::StepResponse)> done) {
  {
    std::lock_guard lock(mu_);
    if (!stopping_ && jobs_.size() < options_.max_queued_steps) {
      jobs_.push_back(Job{std::move(request), std::move(done)});
      jobs_cv_.notify_one();
      return;
    }
  }
  const bool stopping = [&] {
    std::lock_guard lock(mu_);
    return stopping_;
  }();
  done(ErrorResponse(request.step_id(), stopping ? absl::UnavailableError("worker is shutting down")
                                                 : absl::ResourceExhaustedError(absl::StrCat(
                                                       "stage queue full (", options_.max_queued_steps, " steps)"))));
}

void WorkerServer::StageLoop() {
  while (true) {
    Job job;
    std::shared_ptr<StageRuntime> runtime;
    {
      std::unique_lock lock(mu_);
      jobs_cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, nothing left
      job = std::move(jobs_.front());
      jobs_.pop_front();
      if (stopping_) {
        lock.unlock();
        job.done(ErrorResponse(job.request.step_id(), absl::UnavailableError("worker is shutting down")));
        continue;
      }
      runtime = runtime_;
    }
    if (runtime == nullptr) {
      job.done(ErrorResponse(job.request.step_id(), absl::UnavailableError("this worker has no stage loaded")));
      continue;
    }
    runtime->Run(job.request, std::move(job.done));
  }
}

void WorkerServer::Shutdown() {
  std::shared_ptr<StageRuntime> runtime;
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    runtime = runtime_;
  }
  jobs_cv_.notify_all();
  if (runtime != nullptr) runtime->Cancel();
}

}  // namespace shardserve::service

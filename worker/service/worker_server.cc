#include "worker/service/worker_server.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <utility>

#include <google/protobuf/util/message_differencer.h>

#include "absl/strings/str_cat.h"
#include "common/concurrency/arrival_forecast.h"
#include "common/concurrency/spin.h"
#include "common/log/log.h"
#include "common/log/progress.h"
#include "common/rpc/answer_stream_client.h"
#include "common/rpc/step_delta.h"
#include "common/model_spec/model_spec.h"
#include "common/plan/memory_model.h"
#include "common/safetensors/safetensors.h"
#include "common/security/grpc_security.h"
#include "common/status/grpc_raw.h"
#include "common/status/grpc_status.h"
#include "common/status/macros.h"
#include "worker/engine/executor.h"
#include "worker/kernels/registry.h"
#include "worker/service/convert.h"
#include "worker/service/expert_client.h"

namespace shardserve::service {
namespace {

// The engine's option for an assignment's (validated) quantize field.
Quantization ToQuantization(v1::WeightQuantization q) {
  return q == v1::WEIGHT_QUANTIZATION_INT8 ? Quantization::kInt8 : Quantization::kNone;
}

KvCacheFormat ToKvCacheFormat(v1::KvCacheDtype d) {
  return d == v1::KV_CACHE_DTYPE_FP8_E4M3 ? KvCacheFormat::kFp8E4M3 : KvCacheFormat::kAuto;
}

// A raw method, parsed here: an assignment that does not parse is INVALID_ARGUMENT (gRPC's typed
// handler would answer UNIMPLEMENTED).
using WorkerBase = v1::Worker::WithRawCallbackMethod_Assign<v1::Worker::CallbackService>;

class WorkerServiceImpl final : public WorkerBase {
 public:
  explicit WorkerServiceImpl(WorkerServer* server) : server_(server) {}
  using WorkerBase::Assign;
  grpc::ServerUnaryReactor* Assign(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) override {
    return RawUnary<v1::Assignment, v1::AssignResponse>(
        ctx, request, response, [&](const v1::Assignment& assignment, v1::AssignResponse* /*resp*/) {
          if (grpc::Status st = security::CheckPeerRole(*ctx, {security::Role::kCoordinator}); !st.ok()) return st;
          return ToGrpcStatus(server_->Assign(assignment));
        });
  }
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* ctx, const v1::ReleaseRequest* request,
                                    v1::ReleaseResponse* /*response*/) override {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    grpc::Status st = security::CheckPeerRole(*ctx, {security::Role::kCoordinator});
    if (st.ok()) st = ToGrpcStatus(server_->Release(request->reason()));
    reactor->Finish(st);
    return reactor;
  }

 private:
  WorkerServer* server_;
};

// One data-plane stream from the previous hop. Requests are reassembled from chunks and handed
// to the stage thread; responses are written back one at a time, in completion order. Every
// message read is charged to the worker's StreamBudget until its micro-batch is answered (or
// refused); over the budget, the stream stops reading between micro-batches (stream_budget.h).
// With step deltas (announced in the initial metadata), each micro-batch's first chunk is decoded
// against the stream's table (common/rpc/step_delta.h) as it is read, before anything may refuse
// it; one that does not decode is refused and the stream ends with that error once the jobs before
// it are answered.
class StepStreamReactor final : public grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse> {
 public:
  StepStreamReactor(grpc::CallbackServerContext* ctx, WorkerServer* server, bool step_deltas)
      : server_(server), budget_(server->stream_budget()), assembler_(kMaxAssembledBytes) {
    if (step_deltas) {
      // The sender may code its micro-batches against this stream's table (common/rpc/step_delta.h).
      ctx->AddInitialMetadata(rpc::kStepDeltasKey, "1");
    }
    // The stage remembers its samples for overlapped decode calls (StepSequence.from_previous).
    ctx->AddInitialMetadata(rpc::kOverlappedDecodeKey, "1");
    StartSendInitialMetadata();
    ReadNext();
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      MutexLock lock(&mu_);
      reads_done_ = true;
      MaybeFinishLocked();
      return;
    }
    const size_t bytes = incoming_->ByteSizeLong();
    if (server_->metrics() != nullptr) server_->metrics()->ObserveStream("rx", "upstream", bytes);
    if (dropping_step_.has_value() && incoming_->step_id() == *dropping_step_ && incoming_->chunk_index() != 0) {
      // The rest of a refused micro-batch: not kept.
      incoming_->Clear();
      ReadNext();
      return;
    }
    dropping_step_.reset();
    if (incoming_->chunk_index() == 0) {
      // Chunk 0 carries the sequences: decoded as soon as read, so that the table stays in step
      // with the sender's even when the micro-batch is refused below. (The budget is charged the
      // bytes read, not the decoded size.)
      if (absl::Status st = deltas_.Decode(incoming_.get()); !st.ok()) {
        // The two tables may disagree from here on: refuse the step and end the stream (the
        // sender's next step opens a fresh one, with empty tables).
        DropAssembly();
        EndAfterRefusal(ErrorResponse(incoming_->step_id(), st));
        return;
      }
    }
    budget_.Charge(bytes);
    assembling_bytes_ += bytes;
    const uint64_t step_id = incoming_->step_id();
    const uint32_t chunk_index = incoming_->chunk_index();
    const uint32_t chunk_count = std::max<uint32_t>(incoming_->chunk_count(), 1);
    if (chunk_index + 1 < chunk_count && budget_.used() > 2 * budget_.capacity()) {
      // A micro-batch this large does not fit beside what the worker holds: refuse it.
      const size_t used = budget_.used();
      DropAssembly();
      dropping_step_ = step_id;
      Deliver(ErrorResponse(step_id, absl::ResourceExhaustedError(absl::StrCat(
                                         "the worker's stage streams hold ", used, " bytes, over twice their budget of ",
                                         budget_.capacity(), " bytes (--stream_buffer_bytes); micro-batch refused"))),
              /*from_job=*/false);
      incoming_->Clear();
      ReadNext();
      return;
    }
    absl::StatusOr<bool> complete = assembler_.Add(std::move(incoming_));  // ReadNext leases the next
    if (!complete.ok()) {
      DropAssembly();
      Deliver(ErrorResponse(0, complete.status()), /*from_job=*/false);
    } else if (*complete) {
      {
        MutexLock lock(&mu_);
        ++outstanding_jobs_;
      }
      const size_t job_bytes = std::exchange(assembling_bytes_, 0);
      PooledStepRequest request = assembler_.Take();
      const bool omit_ack = request->omit_ack() && !request->answer_route().empty();
      // Bytes and flag in one word: a callback of two words is stored without a heap allocation.
      const uint64_t job = (uint64_t{job_bytes} << 1) | (omit_ack ? 1u : 0u);
      server_->Enqueue(std::move(request), [this, job](v1::StepResponse r) {
        // Released before the answer is delivered: once delivered, the stream may end and go.
        budget_.Release(static_cast<size_t>(job >> 1));
        if ((job & 1) != 0 && r.answered_direct()) {
          Complete();  // the sender has the answer from the return stream
        } else {
          Deliver(std::move(r), /*from_job=*/true);
        }
      });
    }
    if (assembling_bytes_ == 0) {
      // Between micro-batches: read on once the worker's streams are within their budget.
      budget_.WhenRoom([this] { ReadNext(); });
    } else {
      ReadNext();
    }
  }

  void OnWriteDone(bool /*ok*/) override {
    MutexLock lock(&mu_);
    writing_ = false;
    if (!pending_.empty()) {
      WriteNextLocked();
    } else {
      MaybeFinishLocked();
    }
  }

  void OnDone() override {
    budget_.Release(assembling_bytes_);  // a micro-batch cut off by the stream's end
    delete this;
  }

 private:
  static constexpr size_t kMaxAssembledBytes = size_t{1} << 30;

  // Starts the next read, into a message leased from the worker's pool unless the last one was
  // kept (cleared) for it.
  void ReadNext() {
    if (!incoming_) incoming_ = server_->request_pool().Take();
    StartRead(incoming_.get());
  }

  // Forgets the micro-batch being reassembled and gives its bytes back.
  void DropAssembly() {
    assembler_ = ChunkAssembler(kMaxAssembledBytes);
    budget_.Release(std::exchange(assembling_bytes_, 0));
  }
  // Answers with `refusal`, reads no more and ends the stream with its error once every job is
  // answered.
  void EndAfterRefusal(v1::StepResponse refusal) {
    MutexLock lock(&mu_);
    reads_done_ = true;
    end_status_ = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, refusal.error_message());
    pending_.push_back(std::move(refusal));
    if (!writing_) WriteNextLocked();
  }
  // A job answered without a message on this stream.
  void Complete() {
    MutexLock lock(&mu_);
    --outstanding_jobs_;
    MaybeFinishLocked();
  }
  void Deliver(v1::StepResponse response, bool from_job) {
    MutexLock lock(&mu_);
    if (from_job) --outstanding_jobs_;
    pending_.push_back(std::move(response));
    if (!writing_) WriteNextLocked();
  }
  void WriteNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    current_ = std::move(pending_.front());
    if (server_->metrics() != nullptr) server_->metrics()->ObserveStream("tx", "upstream", current_.ByteSizeLong());
    pending_.pop_front();
    writing_ = true;
    StartWrite(&current_);
  }
  // Finish once the peer stopped sending and every job has been answered and written.
  void MaybeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (reads_done_ && outstanding_jobs_ == 0 && !writing_ && pending_.empty() && !finished_) {
      finished_ = true;
      Finish(end_status_);
    }
  }

  WorkerServer* const server_;
  StreamBudget& budget_;      // the worker's; outlives the stream
  // Used by read reactions only (reads are serialised, and the next starts after these are set).
  ChunkAssembler assembler_;
  size_t assembling_bytes_ = 0;           // charged for the micro-batch being reassembled
  std::optional<uint64_t> dropping_step_;  // a refused micro-batch whose chunks are still coming
  PooledStepRequest incoming_;  // the read in progress (null between a handed-off message and ReadNext)
  rpc::StepDeltaDecoder deltas_;  // the stream's sequence table
  Mutex mu_;
  std::deque<v1::StepResponse> pending_ ABSL_GUARDED_BY(mu_);
  v1::StepResponse current_ ABSL_GUARDED_BY(mu_);  // the write in flight
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  int outstanding_jobs_ ABSL_GUARDED_BY(mu_) = 0;
  grpc::Status end_status_ ABSL_GUARDED_BY(mu_);  // OK, or why the stream was ended early
};

// The coordinator's return stream from this worker (Stage.AnswerStream): registered in the worker's
// AnswerRoutes under its route while open (the initial metadata, sent once registered, tells the
// coordinator so; a refused stream ends without it); answers pushed by the last stage are written one at a
// time, in the order pushed. Ends when the coordinator cancels it, a write fails, or the server
// shuts down; an answer pushed after that is refused (and goes up the StepStreams instead).
class AnswerStreamReactor final : public grpc::ServerWriteReactor<v1::StepResponse>, public AnswerRoutes::Sink {
 public:
  AnswerStreamReactor(grpc::CallbackServerContext* ctx, WorkerServer* server, std::string route)
      : server_(server), route_(std::move(route)) {
    if (absl::Status st = server_->answer_routes().Add(route_, this); !st.ok()) {
      MutexLock lock(&mu_);
      FinishLocked(ToGrpcStatus(st));
      return;
    }
    registered_ = true;
    // Tells the coordinator that answers may come here from now on (until the stream ends).
    ctx->AddInitialMetadata(rpc::kAnswerRouteOpenKey, "1");
    StartSendInitialMetadata();
  }

  bool Push(v1::StepResponse& response) override {
    MutexLock lock(&mu_);
    if (finished_) return false;
    pending_.push_back(std::move(response));
    if (!writing_) WriteNextLocked();
    return true;
  }

  void OnWriteDone(bool ok) override {
    MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) {
      FinishLocked(grpc::Status(grpc::StatusCode::UNAVAILABLE, "a write to the return stream failed"));
    } else if (!pending_.empty() && !finished_) {
      WriteNextLocked();
    }
  }

  void OnCancel() override {
    MutexLock lock(&mu_);
    FinishLocked(grpc::Status::CANCELLED);
  }

  void OnDone() override {
    // After Remove no Push runs (AnswerRoutes' contract), so the reactor can go.
    if (registered_) server_->answer_routes().Remove(route_, this);
    delete this;
  }

 private:
  void WriteNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    current_ = std::move(pending_.front());
    pending_.pop_front();
    if (server_->metrics() != nullptr) server_->metrics()->ObserveStream("tx", "coordinator", current_.ByteSizeLong());
    writing_ = true;
    StartWrite(&current_);
  }
  void FinishLocked(grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    pending_.clear();  // their steps fail at the coordinator when this stream ends
    Finish(std::move(status));
  }

  WorkerServer* const server_;
  const std::string route_;
  bool registered_ = false;  // set by the constructor only
  Mutex mu_;
  std::deque<v1::StepResponse> pending_ ABSL_GUARDED_BY(mu_);
  v1::StepResponse current_ ABSL_GUARDED_BY(mu_);  // the write in flight
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

// A stream refused before any message is read (its caller lacks the role).
class RejectedStepStream final : public grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse> {
 public:
  explicit RejectedStepStream(grpc::Status status) { Finish(std::move(status)); }
  void OnDone() override { delete this; }
};

class RejectedAnswerStream final : public grpc::ServerWriteReactor<v1::StepResponse> {
 public:
  explicit RejectedAnswerStream(grpc::Status status) { Finish(std::move(status)); }
  void OnDone() override { delete this; }
};

class StageServiceImpl final : public v1::Stage::CallbackService {
 public:
  explicit StageServiceImpl(WorkerServer* server) : server_(server) {}
  grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>* StepStream(grpc::CallbackServerContext* ctx) override {
    // Stage 0's stream comes from the coordinator, the others' from the previous stage's worker.
    if (grpc::Status st = security::CheckPeerRole(*ctx, {security::Role::kCoordinator, security::Role::kWorker});
        !st.ok()) {
      return new RejectedStepStream(std::move(st));
    }
    return new StepStreamReactor(ctx, server_, server_->step_deltas());
  }
  grpc::ServerWriteReactor<v1::StepResponse>* AnswerStream(grpc::CallbackServerContext* ctx,
                                                           const v1::AnswerStreamRequest* request) override {
    // Only the coordinator takes answers.
    if (grpc::Status st = security::CheckPeerRole(*ctx, {security::Role::kCoordinator}); !st.ok()) {
      return new RejectedAnswerStream(std::move(st));
    }
    return new AnswerStreamReactor(ctx, server_, request->route());
  }

 private:
  WorkerServer* server_;
};

// Synchronous: a call computes on the caller's gRPC thread (the host's devices serialise it).
// On the callback API: the call is queued for the worker's expert threads and answered from
// there, so gRPC's threads never compute.
class ExpertServiceImpl final : public v1::Expert::CallbackService {
 public:
  explicit ExpertServiceImpl(WorkerServer* server) : server_(server) {}
  grpc::ServerUnaryReactor* Compute(grpc::CallbackServerContext* ctx, const v1::ExpertRequest* request,
                                    v1::ExpertResponse* response) override {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    if (grpc::Status st = security::CheckPeerRole(*ctx, {security::Role::kWorker}); !st.ok()) {
      reactor->Finish(st);
      return reactor;
    }
    server_->EnqueueExpertCall(request, response,
                               [reactor](const absl::Status& st) { reactor->Finish(ToGrpcStatus(st)); });
    return reactor;
  }

 private:
  WorkerServer* server_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<grpc::Server>> StartWorkerRpcServer(const std::string& listen,
                                                                   const security::GrpcSecurity& security,
                                                                   WorkerServer& server, int* port) {
  grpc::ServerBuilder builder;
  *port = 0;
  builder.AddListeningPort(
      listen, security.InternalServerCredentials({security::Role::kCoordinator, security::Role::kWorker}), port);
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  // Keepalive pings find vanished peers; idle connections close after 5 min (the defaults of
  // security::GrpcServerLimits; no connection age limit, as stage streams live on one connection).
  security::ApplyServerLimits(security::GrpcServerLimits{}, builder);
  builder.RegisterService(server.worker_service());
  builder.RegisterService(server.stage_service());
  builder.RegisterService(server.expert_service());
  std::unique_ptr<grpc::Server> rpc_server = builder.BuildAndStart();
  if (rpc_server == nullptr || *port == 0) return absl::UnavailableError(absl::StrCat("cannot listen on ", listen));
  return rpc_server;
}

WorkerServer::WorkerServer(WorkerOptions options)
    : options_(std::move(options)),
      worker_service_(std::make_unique<WorkerServiceImpl>(this)),
      stage_service_(std::make_unique<StageServiceImpl>(this)),
      expert_service_(std::make_unique<ExpertServiceImpl>(this)),
      stage_thread_([this] { StageLoop(); }) {
  for (int i = 0; i < std::max(options_.expert_threads, 1); ++i) {
    expert_threads_.emplace_back([this] { ExpertLoop(); });
  }
}

WorkerServer::~WorkerServer() {
  Shutdown();
  if (stage_thread_.joinable()) stage_thread_.join();
  for (std::thread& t : expert_threads_) t.join();
  std::thread loader;
  {
    MutexLock lock(&mu_);
    loader = std::move(loader_);
  }
  if (loader.joinable()) loader.join();
}

grpc::Service* WorkerServer::worker_service() { return worker_service_.get(); }
grpc::Service* WorkerServer::stage_service() { return stage_service_.get(); }
grpc::Service* WorkerServer::expert_service() { return expert_service_.get(); }

absl::Status WorkerServer::ComputeExperts(const v1::ExpertRequest& request, v1::ExpertResponse* response) {
  std::shared_ptr<engine::ExpertHost> host;
  {
    MutexLock lock(&mu_);
    host = expert_host_;
  }
  if (host == nullptr) return absl::UnavailableError("this worker hosts no experts");
  const v1::Tensor& x = request.x();
  int64_t rows = 0;
  std::vector<engine::ExpertRows> groups;
  groups.reserve(static_cast<size_t>(request.groups_size()));
  for (const v1::ExpertGroup& g : request.groups()) {
    if (g.rows() < 1) return absl::InvalidArgumentError(absl::StrCat("expert ", g.expert(), ": rows must be >= 1"));
    groups.push_back({.expert = g.expert(), .rows = g.rows()});
    rows += g.rows();
  }
  // The answer goes back in the dtype x came in (the caller's hidden_wire_dtype).
  const std::optional<DType> wire = FromWireDtype(x.dtype());
  if (!wire.has_value() || x.shape_size() != 2 || x.shape(0) != rows ||
      x.data().size() != static_cast<size_t>(rows * std::max<int64_t>(x.shape(1), 0)) * DTypeSize(*wire)) {
    return absl::InvalidArgumentError(absl::StrCat("x must be F32 or BF16 [", rows,
                                                   " rows (the groups' sum), hidden] with matching data"));
  }
  std::vector<float> in(static_cast<size_t>(rows * x.shape(1)));
  ConvertToFloat(*wire, x.data().data(), in.size(), in.data());
  std::vector<float> out(in.size());
  if (options_.metrics != nullptr) options_.metrics->ObserveStream("rx", "expert-callers", request.ByteSizeLong());
  RETURN_IF_ERROR(host->Compute(request.layer(), groups, in, absl::MakeSpan(out)));
  v1::Tensor* y = response->mutable_y();
  y->set_dtype(ToWireDtype(*wire));
  y->add_shape(x.shape(0));
  y->add_shape(x.shape(1));
  AppendAs(*wire, out, y->mutable_data());
  if (options_.metrics != nullptr) options_.metrics->ObserveStream("tx", "expert-callers", response->ByteSizeLong());
  return absl::OkStatus();
}

int64_t OfferedGpuBytes(int64_t total_bytes, int64_t free_bytes, double utilization) {
  // Rounded up: 1 - 0.9 is a hair under 0.1 in binary, and a byte more kept back is the safe side.
  const auto kept = static_cast<int64_t>(std::ceil(static_cast<double>(total_bytes) * (1.0 - utilization)));
  return std::max<int64_t>(0, free_bytes - kept);
}

WorkerStatusSnapshot WorkerServer::Status() const {
  MutexLock lock(&mu_);
  return status_;
}

WorkerStatusSnapshot WorkerServer::WaitLoaded(absl::Duration timeout) const {
  const absl::Time deadline = absl::Now() + timeout;
  MutexLock lock(&mu_);
  while (status_.state == v1::WORKER_STATE_LOADING) {
    if (loaded_cv_.WaitWithDeadline(&mu_, deadline)) break;
  }
  return status_;
}

std::vector<v1::Device> WorkerServer::Devices() const {
  std::vector<v1::Device> devices = QueryDevices();
  for (v1::Device& d : devices) {
    if (d.kind() != v1::DEVICE_KIND_CUDA) continue;
    d.set_free_bytes(OfferedGpuBytes(d.total_bytes(), d.free_bytes(), options_.gpu_memory_utilization));
  }
  if (options_.memory_per_device > 0) {
    for (v1::Device& d : devices) {
      d.set_total_bytes(std::min<int64_t>(d.total_bytes(), options_.memory_per_device));
      d.set_free_bytes(std::min<int64_t>(d.free_bytes(), options_.memory_per_device));
    }
  }
  return devices;
}

std::vector<v1::Device> WorkerServer::QueryDevices() const {
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
  const bool host = a.role() == v1::ASSIGNMENT_ROLE_EXPERT_HOST;
  if (a.role() != v1::ASSIGNMENT_ROLE_UNSPECIFIED && a.role() != v1::ASSIGNMENT_ROLE_STAGE && !host) {
    return absl::InvalidArgumentError(absl::StrCat("unknown assignment role ", static_cast<int>(a.role())));
  }
  if (!host && (a.layer_begin() < 0 || a.layer_end() <= a.layer_begin())) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer range [", a.layer_begin(), ", ", a.layer_end(), ") is empty or negative"));
  }
  if (host && a.hosted_experts_size() == 0) return absl::InvalidArgumentError("an expert host needs hosted_experts");
  if (!host && a.hosted_experts_size() > 0) {
    return absl::InvalidArgumentError("hosted_experts are for ASSIGNMENT_ROLE_EXPERT_HOST assignments");
  }
  for (const v1::HostedExpert& e : a.hosted_experts()) {
    if (std::find(a.devices().begin(), a.devices().end(), e.device()) == a.devices().end()) {
      return absl::InvalidArgumentError(absl::StrCat("hosted expert ", e.expert(), " of layer ", e.layer(),
                                                     " is on device ", e.device(), ", not one of the assignment's"));
    }
  }
  for (const v1::LayerExperts& le : a.experts()) {
    if (le.addresses_size() != le.ranks_size()) {
      return absl::InvalidArgumentError(absl::StrCat("experts of layer ", le.layer(), ": ", le.ranks_size(),
                                                     " ranks but ", le.addresses_size(), " addresses"));
    }
    for (int e = 0; e < le.ranks_size(); ++e) {
      if ((le.ranks(e) == engine::kRemoteExpert) == le.addresses(e).empty()) {
        return absl::InvalidArgumentError(absl::StrCat("expert ", e, " of layer ", le.layer(),
                                                       ": a remote expert (rank -1) needs an address, and only it"));
      }
    }
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
  if (host) {
    // No layer range, KV cache or next hop to check.
  } else if (a.kv_blocks() < 1 || a.kv_blocks() > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("kv_blocks must be in [1, 2^31 - 1], got ", a.kv_blocks()));
  }
  if (!v1::WeightQuantization_IsValid(a.quantize())) {
    return absl::InvalidArgumentError(absl::StrCat("quantize ", a.quantize(), " is not a known WeightQuantization"));
  }
  if (!v1::KvCacheDtype_IsValid(a.kv_cache_dtype())) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_cache_dtype ", a.kv_cache_dtype(), " is not a known KvCacheDtype"));
  }
  if (a.hidden_wire_dtype() != v1::DTYPE_UNSPECIFIED && !FromWireDtype(a.hidden_wire_dtype()).has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hidden_wire_dtype ",
        v1::DType_IsValid(a.hidden_wire_dtype()) ? v1::DType_Name(a.hidden_wire_dtype())
                                                 : absl::StrCat(a.hidden_wire_dtype()),
        " is not F32 or BF16"));
  }
  if (!host && a.kv_block_size() < 1) {
    return absl::InvalidArgumentError(absl::StrCat("kv_block_size must be >= 1, got ", a.kv_block_size()));
  }
  if (!host && (a.max_step_tokens() < 1 || a.max_seq_len() < 0)) {
    return absl::InvalidArgumentError("max_step_tokens must be >= 1 and max_seq_len >= 0");
  }
  std::shared_ptr<StageRuntime> old;  // freed after the lock is released
  MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("worker is shutting down");
  if (status_.state == v1::WORKER_STATE_LOADING) {
    return absl::AbortedError(absl::StrCat("still loading assignment ", status_.assignment_id, "; retry later"));
  }
  if (status_.state == v1::WORKER_STATE_READY && status_.assignment.has_value() &&
      SameWeightsAndCache(*status_.assignment, a)) {
    return KeepLoadedLocked(a, &old);
  }
  if (loader_.joinable()) loader_.join();  // finished: it set the state before exiting
  status_ = {.state = v1::WORKER_STATE_LOADING, .assignment_id = a.assignment_id(), .assignment = a};
  loader_ = std::thread([this, a] { Load(a); });
  return absl::OkStatus();
}

DType HiddenWireDtype(const v1::Assignment& a) {
  return FromWireDtype(a.hidden_wire_dtype()).value_or(DType::kF32);
}

bool SameWeightsAndCache(const v1::Assignment& a, const v1::Assignment& b) {
  auto identity = [](v1::Assignment x) {
    x.clear_assignment_id();
    x.clear_replica();
    x.clear_stage();
    x.clear_num_stages();
    x.clear_next_address();
    x.clear_hidden_wire_dtype();
    return x;
  };
  return google::protobuf::util::MessageDifferencer::Equals(identity(a), identity(b));
}

absl::Status WorkerServer::KeepLoadedLocked(const v1::Assignment& a, std::shared_ptr<StageRuntime>* old) {
  const std::string was = status_.assignment_id;
  const DType wire = HiddenWireDtype(a);
  if (runtime_ != nullptr && (a.next_address() != runtime_->config().next_address ||
                              a.stage() != runtime_->config().stage || wire != runtime_->config().hidden_wire_dtype)) {
    const bool last = a.layer_end() == runtime_->runner().spec().num_layers;
    if (last != a.next_address().empty()) {
      return absl::InvalidArgumentError(absl::StrCat("layers [", a.layer_begin(), ", ", a.layer_end(), ") ",
                                                     last ? "end the model but" : "do not end the model but",
                                                     " next_address is \"", a.next_address(), "\""));
    }
    StageConfig config = runtime_->config();
    config.assignment_id = a.assignment_id();
    config.stage = a.stage();
    config.next_address = a.next_address();
    config.hidden_wire_dtype = wire;
    // Expert calls already started keep their dtype; later ones take the new one, even those of a
    // step of the old runtime still in flight (a host answers in the dtype it was sent).
    if (config.remote_experts != nullptr) config.remote_experts->set_wire_dtype(wire);
    *old = std::exchange(runtime_, std::make_shared<StageRuntime>(runtime_->shared_runner(), std::move(config)));
  }
  status_.assignment_id = a.assignment_id();
  status_.assignment = a;
  LOG(INFO) << "assignment " << a.assignment_id() << " asks for the weights and KV cache of " << was
            << ", which are loaded: kept (not reloaded)"
            << (*old != nullptr ? absl::StrCat("; next hop now \"", a.next_address(), "\", hidden states as ",
                                               DTypeName(wire))
                                : "");
  return absl::OkStatus();
}

int64_t WorkerServer::weight_loads() const {
  MutexLock lock(&mu_);
  return weight_loads_;
}

absl::Status WorkerServer::Release(const std::string& reason) {
  std::shared_ptr<StageRuntime> old;
  std::shared_ptr<engine::ExpertHost> old_experts;
  std::string had;
  {
    MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("worker is shutting down");
    if (status_.state == v1::WORKER_STATE_LOADING) {
      return absl::AbortedError(absl::StrCat("still loading assignment ", status_.assignment_id, "; retry later"));
    }
    old = std::move(runtime_);
    old_experts = std::move(expert_host_);
    had = status_.assignment_id;
    status_ = {.state = v1::WORKER_STATE_IDLE};
  }
  LOG(INFO) << "released " << (had.empty() ? "no assignment" : absl::StrCat("assignment ", had)) << ": "
            << (reason.empty() ? "no reason given" : reason);
  return absl::OkStatus();  // `old` is freed here, or by the last micro-batch still using it
}

absl::StatusOr<std::shared_ptr<StageRuntime>> WorkerServer::LoadStage(const v1::Assignment& a) {
  const auto started = std::chrono::steady_clock::now();
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
  eo.model.num_kv_blocks = a.kv_blocks();
  eo.model.kv_block_size = a.kv_block_size();
  eo.model.max_seq_len = a.max_seq_len();
  eo.model.max_step_tokens = a.max_step_tokens();
  eo.model.layer_begin = a.layer_begin();
  eo.model.layer_end = a.layer_end();
  eo.model.observer = options_.metrics;
  eo.model.quantize = ToQuantization(a.quantize());
  eo.model.kv_cache = ToKvCacheFormat(a.kv_cache_dtype());
  // A progress line on the worker's stderr (a plain line every few seconds when it is not a
  // terminal, as in a pod's log).
  auto progress = std::make_shared<Progress>(Progress::Options{
      .what = absl::StrCat("loading ", a.assignment_id()), .unit = "layers", .total = a.layer_end() - a.layer_begin(),
      .bytes = true});
  eo.model.on_load_progress = [progress](int64_t done, int64_t /*total*/, size_t bytes) {
    progress->Update(done, static_cast<int64_t>(bytes));
  };
  std::map<int64_t, std::vector<std::string>> remote_addresses;
  bool any_remote = false;
  for (const v1::LayerExperts& le : a.experts()) {
    eo.model.layer_experts[le.layer()].assign(le.ranks().begin(), le.ranks().end());
    remote_addresses[le.layer()].assign(le.addresses().begin(), le.addresses().end());
    for (const std::string& address : le.addresses()) any_remote |= !address.empty();
  }
  std::shared_ptr<GrpcRemoteExperts> remote;
  if (any_remote) {
    ASSIGN_OR_RETURN(remote, GrpcRemoteExperts::Create(remote_addresses, spec.hidden_size, a.assignment_id(),
                                                       options_.expert_call_timeout, options_.metrics,
                                                       /*max_rows_per_call=*/0, options_.peer_credentials,
                                                       HiddenWireDtype(a)));
    eo.model.remote_experts = remote.get();
  }
  ASSIGN_OR_RETURN(auto executor, engine::TpExecutor::Create(spec, *ckpt, eo));
  // Now, not when the executor (which keeps the callback) goes: the final line's time and rate are
  // the load's.
  progress->Finish();
  // The coordinator planned with the memory model: say so when a rank holds other weight bytes
  // than it predicts (a checkpoint whose tensors do not all share config.json's dtype, say).
  const std::vector<size_t> weight_bytes = executor->WeightBytesPerRank();
  const std::vector<RankMemory> predicted = executor->MemoryPerRank();
  for (size_t r = 0; r < weight_bytes.size(); ++r) {
    if (static_cast<int64_t>(weight_bytes[r]) != predicted[r].Weights()) {
      LOG(WARNING) << "assignment " << a.assignment_id() << " rank " << r << " holds " << weight_bytes[r]
                   << " bytes of weights; the memory model predicted " << predicted[r].Weights();
    }
  }
  if (options_.metrics != nullptr) {
    options_.metrics->SetLoaded(std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(),
                                weight_bytes, executor->KvCacheBytesPerRank());
  }
  return std::make_shared<StageRuntime>(std::move(executor),
                                        StageConfig{.assignment_id = a.assignment_id(),
                                                    .stage = a.stage(),
                                                    .next_address = a.next_address(),
                                                    .metrics = options_.metrics,
                                                    .remote_experts = std::move(remote),
                                                    .peer_credentials = options_.peer_credentials,
                                                    .answer_routes = &answer_routes_,
                                                    .step_deltas = options_.step_deltas,
                                                    .hidden_wire_dtype = HiddenWireDtype(a)});
}

void WorkerServer::Load(v1::Assignment a) {
  const auto started = std::chrono::steady_clock::now();
  const bool host = a.role() == v1::ASSIGNMENT_ROLE_EXPERT_HOST;
  std::shared_ptr<StageRuntime> runtime;
  std::shared_ptr<engine::ExpertHost> experts;
  absl::Status st = [&]() -> absl::Status {
    if (!host) {
      ASSIGN_OR_RETURN(runtime, LoadStage(a));
      return absl::OkStatus();
    }
    ASSIGN_OR_RETURN(ModelSpec spec, LoadModelSpec(a.model_path()));
    ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(a.model_path()));
    std::vector<engine::HostedExpertSpec> list;
    for (const v1::HostedExpert& e : a.hosted_experts()) list.push_back({e.layer(), e.expert(), e.device()});
    ASSIGN_OR_RETURN(experts, engine::ExpertHost::Create(spec, *ckpt, list, options_.kind, options_.cpu_threads,
                                                         ToQuantization(a.quantize())));
    if (options_.metrics != nullptr) {
      options_.metrics->SetLoaded(std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(),
                                  {experts->weight_bytes()}, {0});
    }
    return absl::OkStatus();
  }();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::shared_ptr<StageRuntime> old;
  std::shared_ptr<engine::ExpertHost> old_experts;
  {
    MutexLock lock(&mu_);
    if (st.ok()) {
      old = std::move(runtime_);
      old_experts = std::move(expert_host_);
      runtime_ = runtime;
      expert_host_ = experts;
      ++weight_loads_;
      status_ = {.state = v1::WORKER_STATE_READY, .assignment_id = a.assignment_id(),
                 .kv_blocks = runtime != nullptr ? runtime->runner().options().num_kv_blocks : 0,
                 .assignment = a};
    } else {
      status_ = {.state = v1::WORKER_STATE_FAILED, .assignment_id = a.assignment_id(),
                 .error = std::string(st.message()), .assignment = a};
    }
    loaded_cv_.SignalAll();
  }
  if (!st.ok()) {
    LOG(ERROR) << "assignment " << a.assignment_id() << " failed: " << st;
  } else if (host) {
    LOG(INFO) << "assignment " << a.assignment_id() << ": " << experts->num_experts() << " experts ("
              << experts->weight_bytes() << " bytes) loaded in " << seconds << " s";
  } else {
    LOG(INFO) << "assignment " << a.assignment_id() << ": layers [" << a.layer_begin() << ", " << a.layer_end()
              << ") loaded in " << seconds << " s";
  }
}

void WorkerServer::Enqueue(PooledStepRequest request, std::function<void(v1::StepResponse)> done) {
  std::shared_ptr<StageRuntime> here;  // set when the micro-batch runs on this thread
  {
    MutexLock lock(&mu_);
    if (!stopping_ && !stage_busy_ && jobs_.empty() && runtime_ != nullptr &&
        options_.stage_inline > std::chrono::microseconds::zero() &&
        runtime_->MayRunOnReader(*request, absl::FromChrono(options_.stage_inline))) {
      stage_busy_ = true;
      here = runtime_;
    } else if (!stopping_ && jobs_.size() < options_.max_queued_steps) {
      jobs_.push_back(Job{std::move(request), std::move(done), absl::Now()});
      queued_jobs_.store(jobs_.size(), std::memory_order_release);
      jobs_cv_.Signal();
      return;
    }
  }
  if (here != nullptr) {
    if (options_.metrics != nullptr) options_.metrics->CountStageRun(/*on_reader=*/true);
    here->Run(*request, std::move(done), StageRuntime::Caller::kReader);
    MutexLock lock(&mu_);
    stage_busy_ = false;
    if (here != runtime_) retired_.push_back(std::move(here));
    if (!jobs_.empty() || !retired_.empty()) jobs_cv_.Signal();
    return;
  }
  const bool stopping = Stopping();
  done(ErrorResponse(request->step_id(), stopping ? absl::UnavailableError("worker is shutting down")
                                                 : absl::ResourceExhaustedError(absl::StrCat(
                                                       "stage queue full (", options_.max_queued_steps, " steps)"))));
}

void WorkerServer::StageLoop() {
  ArrivalForecast forecast({.max_poll = absl::FromChrono(options_.stage_poll)});
  const auto queued = [this] { return queued_jobs_.load(std::memory_order_acquire) > 0; };
  while (true) {
    Job job;
    std::shared_ptr<StageRuntime> runtime;
    const absl::Time wait_start = absl::Now();
    const bool idle = !queued();
    if (idle) {
      // In steady decoding the next micro-batch comes after about as long as the last ones did:
      // sleep until shortly before it is due, then poll, so that it finds this core awake.
      const auto sleep_until = [this](absl::Time t) {
        MutexLock lock(&mu_);
        while (!stopping_ && jobs_.empty() && absl::Now() < t) jobs_cv_.WaitWithDeadline(&mu_, t);
      };
      SleepThenPoll(forecast.Next(), wait_start, absl::InfiniteFuture(), sleep_until, queued);
    }
    // A fixed poll (--stage_spin_us): the next micro-batch of a short cycle comes a round trip
    // after the last answer.
    SpinFor(absl::FromChrono(options_.stage_spin), queued);
    std::vector<std::shared_ptr<StageRuntime>> retired;  // dropped at the end of the turn, unlocked
    {
      MutexLock lock(&mu_);
      while (!stopping_ && (jobs_.empty() || stage_busy_) && retired_.empty()) jobs_cv_.Wait(&mu_);
      retired.swap(retired_);
      if (jobs_.empty() && stopping_) return;  // nothing left
      // Only runtimes to drop, or a reader thread is running a micro-batch: wait on.
      if (jobs_.empty() || (stage_busy_ && !stopping_)) continue;
      job = std::move(jobs_.front());
      jobs_.pop_front();
      queued_jobs_.store(jobs_.size(), std::memory_order_release);
      if (!stopping_) runtime = runtime_;
      if (runtime != nullptr) stage_busy_ = true;
    }
    if (idle) forecast.Record(job.enqueued - wait_start);
    if (runtime == nullptr && Stopping()) {
      job.done(ErrorResponse(job.request->step_id(), absl::UnavailableError("worker is shutting down")));
      continue;
    }
    if (runtime == nullptr) {
      job.done(ErrorResponse(job.request->step_id(), absl::UnavailableError("this worker has no stage loaded")));
      continue;
    }
    if (options_.metrics != nullptr) options_.metrics->CountStageRun(/*on_reader=*/false);
    runtime->Run(*job.request, std::move(job.done));
    MutexLock lock(&mu_);
    stage_busy_ = false;
  }
}

bool WorkerServer::Stopping() const {
  MutexLock lock(&mu_);
  return stopping_;
}

void WorkerServer::Shutdown() {
  std::shared_ptr<StageRuntime> runtime;
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    runtime = runtime_;
  }
  jobs_cv_.SignalAll();
  expert_cv_.SignalAll();
  if (runtime != nullptr) runtime->Cancel();
}

void WorkerServer::EnqueueExpertCall(const v1::ExpertRequest* request, v1::ExpertResponse* response,
                                     std::function<void(const absl::Status&)> done) {
  absl::Status refused;
  {
    MutexLock lock(&mu_);
    if (stopping_) {
      refused = absl::UnavailableError("worker is shutting down");
    } else if (expert_calls_.size() >= options_.max_queued_steps) {
      refused = absl::ResourceExhaustedError(
          absl::StrCat("expert call queue full (", options_.max_queued_steps, " calls)"));
    } else {
      expert_calls_.push_back(ExpertCall{request, response, std::move(done)});
      expert_cv_.Signal();
      return;
    }
  }
  done(refused);
}

void WorkerServer::ExpertLoop() {
  while (true) {
    ExpertCall call;
    bool stopping = false;
    {
      MutexLock lock(&mu_);
      while (!stopping_ && expert_calls_.empty()) expert_cv_.Wait(&mu_);
      if (expert_calls_.empty()) return;  // stopping, nothing left
      call = std::move(expert_calls_.front());
      expert_calls_.pop_front();
      stopping = stopping_;
    }
    call.done(stopping ? absl::UnavailableError("worker is shutting down")
                       : ComputeExperts(*call.request, call.response));
  }
}

}  // namespace shardserve::service

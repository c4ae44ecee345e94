#include "coordinator/client/grpc_replica_client.h"

#include <grpcpp/grpcpp.h>

#include <deque>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log/log.h"
#include "common/status/grpc_status.h"
#include "coordinator/client/proto_convert.h"
#include "shardserve/v1/stage.grpc.pb.h"

namespace shardserve::coordinator {

// One StepStream call. gRPC rules this class follows:
//  - one write at a time: requests queue in `queue_` while a write is pending;
//  - operations started from outside a reaction (Send) need a hold, or OnDone could run (and the
//    call end) between our check and the StartWrite: the hold taken in Start is released only by
//    Close, and only when no thread is between its check and its StartWrite (`starting_`);
//  - Start* is never called with mu_ held (a reaction could run inline and take mu_).
// gRPC may run reactions on several threads at once; all shared state is under mu_. The read
// buffer `read_` belongs to the read chain (StartRead -> OnReadDone -> StartRead) alone.
class GrpcReplicaClient::Stream final : public grpc::ClientBidiReactor<v1::StepRequest, v1::StepResponse> {
 public:
  Stream(const std::shared_ptr<grpc::Channel>& channel, std::string address)
      : stub_(v1::Stage::NewStub(channel)), address_(std::move(address)) {}

  void Start() {
    stub_->async()->StepStream(&ctx_, this);
    AddHold();
    StartRead(&read_);
    StartCall();
  }

  // Queues `request` and registers for its response. False when the stream is closed.
  bool Send(v1::StepRequest request) {
    {
      absl::MutexLock lock(&mu_);
      if (closing_) return false;
      results_[request.step_id()] = std::nullopt;
      if (writing_) {
        queue_.push_back(std::move(request));
        return true;
      }
      writing_ = true;
      writing_msg_ = std::move(request);
      ++starting_;
    }
    StartWrite(&writing_msg_);
    bool release = false;
    {
      absl::MutexLock lock(&mu_);
      --starting_;
      release = ReleaseHoldLocked();
    }
    if (release) RemoveHold();
    return true;
  }

  // Waits for the response to `step_id` until `deadline`. On a timeout the stream is closed.
  absl::StatusOr<StepOutput> Await(uint64_t step_id, absl::Time deadline) {
    std::optional<absl::StatusOr<StepOutput>> result;
    std::string closed;
    {
      absl::MutexLock lock(&mu_);
      auto answered = [this, step_id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        auto it = results_.find(step_id);
        return cancelled_ || done_ || (it != results_.end() && it->second.has_value());
      };
      const bool ready = mu_.AwaitWithDeadline(absl::Condition(&answered), deadline);
      auto it = results_.find(step_id);
      if (it != results_.end() && it->second.has_value()) result = std::move(*it->second);
      if (it != results_.end()) results_.erase(it);
      if (!result.has_value() && ready) closed = close_reason_;
    }
    if (result.has_value()) return *std::move(result);
    if (!closed.empty()) return absl::UnavailableError(closed);
    Close(absl::StrCat("step ", step_id, " timed out"));
    // A stage that does not answer is a broken pipeline like a closed stream: UNAVAILABLE lets the
    // scheduler fail the sequences over (or park them) instead of failing them.
    return absl::UnavailableError(absl::StrCat("stage stream to ", address_, ": no answer to step ", step_id,
                                               " within the step timeout; the stream is closed"));
  }

  // No more writes; cancels the call (waking every Await at once). OnDone follows. Idempotent.
  void Close(const std::string& why) { Stop(why, /*cancel=*/true); }

  bool closing() {
    absl::MutexLock lock(&mu_);
    return closing_;
  }
  bool done() {
    absl::MutexLock lock(&mu_);
    return done_;
  }
  bool WaitDone(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto is_done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_; };
    return mu_.AwaitWithTimeout(absl::Condition(&is_done), timeout);
  }

  void OnWriteDone(bool ok) override {
    {
      absl::MutexLock lock(&mu_);
      if (ok && !closing_ && !queue_.empty()) {
        writing_msg_ = std::move(queue_.front());
        queue_.pop_front();
      } else {
        writing_ = false;
        if (ok) return;
      }
    }
    if (!ok) {
      Stop("a write failed", /*cancel=*/false);  // the read fails too; OnDone brings the status
      return;
    }
    StartWrite(&writing_msg_);  // from a reaction: the call cannot end meanwhile
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      Stop("the stage ended the stream", /*cancel=*/false);
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      auto it = results_.find(read_.step_id());
      if (it != results_.end() && !it->second.has_value()) {
        it->second = FromProto(read_);
      } else {
        LOG(WARNING) << "stage stream to " << address_ << ": dropping a response to step " << read_.step_id()
                     << ", which nobody waits for";
      }
    }
    StartRead(&read_);
  }

  void OnDone(const grpc::Status& status) override {
    absl::MutexLock lock(&mu_);
    done_ = true;
    const absl::Status st = FromGrpcStatus(status);
    const std::string why = absl::StrCat("stage stream to ", address_, " ended: ", st.ToString());
    if (!cancelled_) close_reason_ = why;  // when we cancelled, our reason says more than CANCELLED
    for (auto& [id, result] : results_) {
      if (!result.has_value()) result = absl::UnavailableError(close_reason_);
    }
  }

 private:
  // No more writes. With `cancel`, the call is cancelled here and waiters wake now with `why`;
  // without (the stage ended the stream), they wait for OnDone, which brings the stage's status.
  void Stop(const std::string& why, bool cancel) {
    bool release = false;
    {
      absl::MutexLock lock(&mu_);
      if (!closing_) {
        closing_ = true;
        release = ReleaseHoldLocked();
      }
      if (cancel && !cancelled_ && !done_) {
        cancelled_ = true;
        close_reason_ = absl::StrCat("stage stream to ", address_, " closed: ", why);
      } else {
        cancel = false;
      }
    }
    if (cancel) ctx_.TryCancel();
    if (release) RemoveHold();
  }

  // Whether the caller must call RemoveHold (once, after unlocking).
  bool ReleaseHoldLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!closing_ || starting_ > 0 || hold_released_) return false;
    hold_released_ = true;
    return true;
  }

  const std::unique_ptr<v1::Stage::Stub> stub_;
  const std::string address_;
  grpc::ClientContext ctx_;
  v1::StepResponse read_;  // the read chain's buffer

  absl::Mutex mu_;
  std::deque<v1::StepRequest> queue_ ABSL_GUARDED_BY(mu_);
  v1::StepRequest writing_msg_;  // written by whoever sets writing_; read by gRPC until OnWriteDone
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  int starting_ ABSL_GUARDED_BY(mu_) = 0;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;    // no more writes
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;  // closed by us (Close): waiters wake at once
  std::string close_reason_ ABSL_GUARDED_BY(mu_);
  bool hold_released_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  // Registered steps: nullopt until answered (or failed by OnDone).
  absl::flat_hash_map<uint64_t, std::optional<absl::StatusOr<StepOutput>>> results_ ABSL_GUARDED_BY(mu_);
};

GrpcReplicaClient::GrpcReplicaClient(std::shared_ptr<grpc::Channel> channel, Options options)
    : channel_(std::move(channel)), options_(std::move(options)) {}

GrpcReplicaClient::~GrpcReplicaClient() {
  Shutdown();
  absl::MutexLock lock(&mu_);
  if (stream_ != nullptr) retired_.push_back(std::move(stream_));
  for (std::shared_ptr<Stream>& s : retired_) {
    if (!s->WaitDone(absl::Seconds(10))) {
      // Freeing it would let gRPC touch freed memory; leaking one object is the lesser evil.
      LOG(ERROR) << "stage stream to " << options_.address << " did not finish within 10s of its cancellation";
      static_cast<void>(new std::shared_ptr<Stream>(std::move(s)));
    }
  }
}

void GrpcReplicaClient::Shutdown() {
  absl::MutexLock lock(&mu_);
  shutdown_ = true;
  if (stream_ != nullptr) stream_->Close("the replica client is shut down");
}

absl::StatusOr<StepOutput> GrpcReplicaClient::Step(const StepInput& input) {
  std::shared_ptr<Stream> stream;  // kept alive by this reference while this Step uses it
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return absl::UnavailableError(absl::StrCat("replica client for ", options_.address, " is shut down"));
    std::erase_if(retired_, [](const std::shared_ptr<Stream>& s) { return s->done(); });
    if (stream_ != nullptr && stream_->closing()) retired_.push_back(std::move(stream_));
    if (stream_ == nullptr) {
      stream_ = std::make_shared<Stream>(channel_, options_.address);
      stream_->Start();
    }
    stream = stream_;
  }
  v1::StepRequest request;
  ToProto(input, &request);
  if (!stream->Send(std::move(request))) {
    return absl::UnavailableError(absl::StrCat("stage stream to ", options_.address, " is closed"));
  }
  return stream->Await(input.step_id, absl::Now() + options_.step_timeout);
}

}  // namespace shardserve::coordinator

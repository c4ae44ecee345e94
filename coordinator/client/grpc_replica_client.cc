#include "coordinator/client/grpc_replica_client.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/concurrency/mutex.h"
#include "common/concurrency/spin.h"
#include "common/log/log.h"
#include "common/rpc/stage_stream_client.h"
#include "common/status/macros.h"
#include "coordinator/client/proto_convert.h"
#include "shardserve/v1/stage.grpc.pb.h"

namespace shardserve::coordinator {

namespace {

// Where one Step's answer lands: filled by the stream's callback (a gRPC thread), awaited by Step.
struct AnswerSlot {
  Mutex mu;
  CondVar cv;
  std::optional<absl::StatusOr<v1::StepResponse>> answer ABSL_GUARDED_BY(mu);
  std::atomic<bool> filled{false};  // answer has a value: what Step polls before it sleeps
};

}  // namespace

GrpcReplicaClient::GrpcReplicaClient(std::shared_ptr<grpc::Channel> channel, Options options)
    : channel_(std::move(channel)), options_(std::move(options)) {}

GrpcReplicaClient::~GrpcReplicaClient() {
  Shutdown();
  std::shared_ptr<rpc::StageStreamClient> stream;
  {
    MutexLock lock(&mu_);
    stream = std::move(stream_);
  }
  // The stream keeps itself alive until gRPC is done with it; waiting here keeps its last
  // reactions from outliving the client's owner (bounded: a stuck call is left to finish alone).
  if (stream != nullptr && !stream->WaitDone(absl::Seconds(10))) {
    LOG(ERROR) << "stage stream to " << options_.address << " did not finish within 10s of its cancellation";
  }
}

void GrpcReplicaClient::Shutdown() {
  std::shared_ptr<rpc::StageStreamClient> stream;
  {
    MutexLock lock(&mu_);
    shutdown_ = true;
    stream = stream_;
  }
  if (stream != nullptr) stream->Close("the replica client is shut down");
}

absl::StatusOr<StepOutput> GrpcReplicaClient::Step(const StepInput& input) {
  std::shared_ptr<rpc::StageStreamClient> stream;
  {
    MutexLock lock(&mu_);
    if (shutdown_) return absl::UnavailableError(absl::StrCat("replica client for ", options_.address, " is shut down"));
    if (stream_ == nullptr || stream_->closing()) {
      // A closed stream finishes on its own (its OnDone fails what still waited on it).
      stream_ = rpc::StageStreamClient::Open(channel_, {.peer = absl::StrCat("stage stream to ", options_.address)});
    }
    stream = stream_;
  }
  std::vector<v1::StepRequest> messages(1);
  ToProto(input, &messages[0]);
  auto slot = std::make_shared<AnswerSlot>();
  rpc::StageStreamClient::Answer answer = [slot](absl::StatusOr<v1::StepResponse> response) {
    MutexLock lock(&slot->mu);
    slot->answer = std::move(response);
    slot->filled.store(true, std::memory_order_release);
    slot->cv.SignalAll();
  };
  RETURN_IF_ERROR(stream->Send(input.step_id, std::move(messages), answer));
  const absl::Time deadline = absl::Now() + options_.step_timeout;
  std::optional<absl::StatusOr<v1::StepResponse>> response;
  // A small batch's answer comes within a round trip or two: polling for it first keeps the
  // wake-up of a sleeping thread off the step's critical path.
  SpinFor(options_.answer_spin, [&slot] { return slot->filled.load(std::memory_order_acquire); });
  {
    MutexLock lock(&slot->mu);
    while (!slot->answer.has_value() && absl::Now() < deadline) slot->cv.WaitWithDeadline(&slot->mu, deadline);
    response = std::move(slot->answer);
  }
  if (!response.has_value()) {
    stream->Close(absl::StrCat("step ", input.step_id, " timed out"));
    // A stage that does not answer is a broken pipeline like a closed stream: UNAVAILABLE lets the
    // scheduler fail the sequences over (or park them) instead of failing them.
    return absl::UnavailableError(absl::StrCat("stage stream to ", options_.address, ": no answer to step ",
                                               input.step_id, " within the step timeout; the stream is closed"));
  }
  if (!response->ok()) return response->status();
  return FromProto(**response);
}

}  // namespace shardserve::coordinator

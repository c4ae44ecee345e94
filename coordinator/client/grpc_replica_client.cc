#include "coordinator/client/grpc_replica_client.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <optional>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/concurrency/mutex.h"
#include "common/concurrency/spin.h"
#include "common/log/log.h"
#include "common/rpc/answer_stream_client.h"
#include "common/rpc/stage_stream_client.h"
#include "common/status/macros.h"
#include "coordinator/client/proto_convert.h"
#include "shardserve/v1/stage.grpc.pb.h"

namespace shardserve::coordinator {

namespace {

// Where one Step's result lands: the first answer or error from either stream (gRPC threads),
// awaited by Step; later ones are dropped.
struct AnswerSlot {
  void Fill(absl::StatusOr<v1::StepResponse> response) {
    MutexLock lock(&mu);
    if (answer.has_value()) return;  // settled already: each Step has one result
    answer = std::move(response);
    filled_at = absl::Now();
    filled.store(true, std::memory_order_release);
    cv.SignalAll();
  }

  Mutex mu;
  CondVar cv;
  std::optional<absl::StatusOr<v1::StepResponse>> answer ABSL_GUARDED_BY(mu);
  absl::Time filled_at ABSL_GUARDED_BY(mu);  // when `answer` came
  std::atomic<bool> filled{false};  // answer has a value: what Step polls before it sleeps
};

// A route id no other return stream on the last stage's worker has: 128 random bits.
std::string NewRoute() {
  thread_local absl::BitGen gen;
  return absl::StrCat(absl::Hex(absl::Uniform<uint64_t>(gen), absl::kZeroPad16),
                      absl::Hex(absl::Uniform<uint64_t>(gen), absl::kZeroPad16));
}

}  // namespace

GrpcReplicaClient::GrpcReplicaClient(std::shared_ptr<grpc::Channel> channel, Options options)
    : GrpcReplicaClient(std::move(channel), nullptr, std::move(options)) {}

GrpcReplicaClient::GrpcReplicaClient(std::shared_ptr<grpc::Channel> channel, std::shared_ptr<grpc::Channel> last_channel,
                                     Options options)
    : channel_(std::move(channel)),
      last_channel_(std::move(last_channel)),
      message_pool_(rpc::MessagePool<v1::StepRequest>::Create(size_t{16} << 10, 8)),
      options_(std::move(options)),
      answer_forecast_({.max_poll = options_.answer_poll}) {}

GrpcReplicaClient::~GrpcReplicaClient() {
  Shutdown();
  std::shared_ptr<rpc::StageStreamClient> stream;
  std::shared_ptr<rpc::AnswerStreamClient> answers;
  {
    MutexLock lock(&mu_);
    stream = std::move(stream_);
    answers = std::move(answers_);
  }
  // The streams keep themselves alive until gRPC is done with them; waiting here keeps their last
  // reactions from outliving the client's owner (bounded: a stuck call is left to finish alone).
  if (stream != nullptr && !stream->WaitDone(absl::Seconds(10))) {
    LOG(ERROR) << "stage stream to " << options_.address << " did not finish within 10s of its cancellation";
  }
  if (answers != nullptr && !answers->WaitDone(absl::Seconds(10))) {
    LOG(ERROR) << "return stream from " << options_.last_address << " did not finish within 10s of its cancellation";
  }
}

void GrpcReplicaClient::Shutdown() {
  std::shared_ptr<rpc::StageStreamClient> stream;
  std::shared_ptr<rpc::AnswerStreamClient> answers;
  {
    MutexLock lock(&mu_);
    shutdown_ = true;
    stream = stream_;
    answers = answers_;
  }
  if (stream != nullptr) stream->Close("the replica client is shut down");
  if (answers != nullptr) answers->Close("the replica client is shut down");
}

absl::StatusOr<StepOutput> GrpcReplicaClient::Step(const StepInput& input) {
  return StepOverlapping(input, [] {});
}

absl::StatusOr<StepOutput> GrpcReplicaClient::StepOverlapping(const StepInput& input,
                                                              absl::FunctionRef<void()> while_waiting) {
  // Runs `while_waiting` exactly once, whichever way this returns.
  bool ran = false;
  auto overlap = [&] {
    if (!ran) {
      ran = true;
      while_waiting();
    }
  };
  absl::StatusOr<StepOutput> out = SendAndWait(input, overlap);
  overlap();
  return out;
}

bool GrpcReplicaClient::OverlapsDecodeCalls() const {
  MutexLock lock(&mu_);
  return stream_ != nullptr && !stream_->closing() && stream_->overlapped_decode();
}

absl::StatusOr<StepOutput> GrpcReplicaClient::SendAndWait(const StepInput& input,
                                                          absl::FunctionRef<void()> while_waiting) {
  std::shared_ptr<rpc::StageStreamClient> stream;
  std::shared_ptr<rpc::AnswerStreamClient> answers;
  {
    MutexLock lock(&mu_);
    if (shutdown_) return absl::UnavailableError(absl::StrCat("replica client for ", options_.address, " is shut down"));
    if (stream_ == nullptr || stream_->closing()) {
      // A closed stream finishes on its own (its OnDone fails what still waited on it).
      stream_ = rpc::StageStreamClient::Open(channel_, {.peer = absl::StrCat("stage stream to ", options_.address),
                                                        .step_deltas = options_.step_deltas});
    }
    if (answers_ != nullptr && answers_->closing() && answers_->unimplemented()) {
      // A last stage without Stage.AnswerStream (an older worker): its answers relay.
      LOG(WARNING) << "the last stage at " << options_.last_address
                   << " has no return stream (UNIMPLEMENTED): its answers come through stage 0";
      direct_off_ = true;
    }
    if (last_channel_ != nullptr && !direct_off_ && (answers_ == nullptr || answers_->closing())) {
      answers_ = rpc::AnswerStreamClient::Open(
          last_channel_, NewRoute(), {.peer = absl::StrCat("return stream from the last stage at ", options_.last_address)});
    }
    stream = stream_;
    answers = answers_;
  }
  rpc::StageStreamClient::Messages messages;
  messages.push_back(message_pool_->Take());
  ToProto(input, messages[0].get());
  auto slot = std::make_shared<AnswerSlot>();
  // Registered before the step is sent, so that its answer finds it.
  bool direct = false;
  if (answers != nullptr) {
    rpc::AnswerStreamClient::Answer direct_answer = [slot](absl::StatusOr<v1::StepResponse> response) {
      slot->Fill(std::move(response));
    };
    // Refused when the return stream has just ended: this step's answer then comes up stage 0's.
    direct = answers->Expect(input.step_id, direct_answer).ok();
    if (direct) {
      messages[0]->set_answer_route(answers->route());
      messages[0]->set_omit_ack(true);  // an acknowledgement would only cost stage 0 and us a message
    }
  }
  rpc::StageStreamClient::Answer answer = [slot](absl::StatusOr<v1::StepResponse> response) {
    // (Not sent with omit_ack; from a worker that ignores it, the return stream settles the step.)
    if (response.ok() && response->answered_direct()) return;
    slot->Fill(std::move(response));
  };
  if (absl::Status st = stream->Send(input.step_id, std::move(messages), answer); !st.ok()) {
    if (direct) answers->Forget(input.step_id);
    return st;
  }
  const absl::Time sent = absl::Now();
  const absl::Time deadline = sent + options_.step_timeout;
  while_waiting();  // the caller's work, while the step runs
  std::optional<absl::StatusOr<v1::StepResponse>> response;
  const auto filled = [&slot] { return slot->filled.load(std::memory_order_acquire); };
  // In steady decoding an answer takes about as long as the last ones did: sleep until shortly
  // before it is due, then poll, so that it finds this core awake.
  ArrivalForecast::Plan plan;
  {
    MutexLock lock(&mu_);
    plan = answer_forecast_.Next();
  }
  const auto sleep_until = [&slot](absl::Time t) {
    MutexLock lock(&slot->mu);
    while (!slot->answer.has_value() && absl::Now() < t) slot->cv.WaitWithDeadline(&slot->mu, t);
  };
  SleepThenPoll(plan, sent, deadline, sleep_until, filled);
  // A small batch's answer comes within a round trip or two: polling for it first keeps the
  // wake-up of a sleeping thread off the step's critical path.
  SpinFor(options_.answer_spin, filled);
  absl::Time answered;
  {
    MutexLock lock(&slot->mu);
    while (!slot->answer.has_value() && absl::Now() < deadline) slot->cv.WaitWithDeadline(&slot->mu, deadline);
    response = std::move(slot->answer);
    answered = slot->filled_at;
  }
  if (response.has_value() && response->ok()) {
    MutexLock lock(&mu_);
    answer_forecast_.Record(answered - sent);
  }
  // Settled by one stream (or not at all): the other's answer is not awaited any more. A step
  // answered directly gets nothing more on stage 0's stream (omit_ack), unless the pipeline breaks.
  if (direct) {
    answers->Forget(input.step_id);
    stream->Forget(input.step_id);
  }
  if (!response.has_value()) {
    const std::string why = absl::StrCat("step ", input.step_id, " timed out");
    stream->Close(why);
    if (answers != nullptr) answers->Close(why);
    // A stage that does not answer is a broken pipeline like a closed stream: UNAVAILABLE lets the
    // scheduler fail the sequences over (or park them) instead of failing them.
    return absl::UnavailableError(absl::StrCat("stage stream to ", options_.address, ": no answer to step ",
                                               input.step_id, " within the step timeout; the stream is closed"));
  }
  if (!response->ok()) return response->status();
  return FromProto(**response);
}

}  // namespace shardserve::coordinator

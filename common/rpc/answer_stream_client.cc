#include "common/rpc/answer_stream_client.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log/log.h"
#include "common/rpc/internal/call_end.h"

namespace shardserve::rpc {

AnswerStreamClient::AnswerStreamClient(std::shared_ptr<grpc::Channel> channel, std::string route, Options options)
    : options_(std::move(options)),
      route_(std::move(route)),
      channel_(std::move(channel)),
      stub_(v1::Stage::NewStub(channel_)) {
  request_.set_route(route_);
}

std::shared_ptr<AnswerStreamClient> AnswerStreamClient::Open(std::shared_ptr<grpc::Channel> channel,
                                                             std::string route, Options options) {
  std::shared_ptr<AnswerStreamClient> client(
      new AnswerStreamClient(std::move(channel), std::move(route), std::move(options)));
  client->Start();
  return client;
}

void AnswerStreamClient::Start() {
  {
    MutexLock lock(&mu_);
    self_ = shared_from_this();  // gRPC uses the reactor until OnDone
  }
  stub_->async()->AnswerStream(&context_, &request_, this);
  // Every later operation starts inside a reaction (the read chain), so no hold is needed.
  StartRead(&read_);
  StartCall();
}

absl::Status AnswerStreamClient::Expect(uint64_t step_id, Answer& answer) {
  MutexLock lock(&mu_);
  if (closing_) {
    return absl::UnavailableError(absl::StrCat(options_.peer, " ", problem_.empty() ? "is closed" : problem_));
  }
  if (!waiting_.try_emplace(step_id, std::move(answer)).second) {  // moves only if inserted
    return absl::InvalidArgumentError(
        absl::StrCat("step_id ", step_id, " is already awaited on the ", options_.peer));
  }
  return absl::OkStatus();
}

bool AnswerStreamClient::Forget(uint64_t step_id) {
  MutexLock lock(&mu_);
  return waiting_.erase(step_id) > 0;
}

void AnswerStreamClient::Close(const std::string& why) {
  {
    MutexLock lock(&mu_);
    closing_ = true;
    if (cancelled_ || done_) return;
    cancelled_ = true;
    problem_ = absl::StrCat("closed: ", why);
  }
  context_.TryCancel();
}

bool AnswerStreamClient::closing() {
  MutexLock lock(&mu_);
  return closing_;
}

bool AnswerStreamClient::WaitDone(absl::Duration timeout) {
  MutexLock lock(&mu_);
  return internal::WaitUntilDone(&mu_, &done_cv_, &done_, timeout);
}

bool AnswerStreamClient::unimplemented() {
  MutexLock lock(&mu_);
  return unimplemented_;
}

void AnswerStreamClient::OnReadInitialMetadataDone(bool ok) {
  // (A refused stream's trailers-only answer also completes this read, without the key.)
  const auto& metadata = context_.GetServerInitialMetadata();
  const bool open = ok && metadata.find(kAnswerRouteOpenKey) != metadata.end();
  MutexLock lock(&mu_);
  registered_ = open;
}

void AnswerStreamClient::OnReadDone(bool ok) {
  if (!ok) {
    // The call is ending: OnDone follows with its status and fails what is still awaited.
    MutexLock lock(&mu_);
    closing_ = true;
    return;
  }
  if (options_.on_received) options_.on_received(read_.ByteSizeLong());
  Answer answer;
  {
    MutexLock lock(&mu_);
    answer = internal::TakeWaiting(waiting_, read_.step_id());
  }
  if (answer != nullptr) {
    v1::StepResponse response = std::move(read_);
    read_.Clear();
    // Inside this reaction the call cannot end, so the client is alive while `answer` runs.
    answer(std::move(response));
  } else {
    read_.Clear();  // its step was settled another way
  }
  StartRead(&read_);
}

void AnswerStreamClient::OnDone(const grpc::Status& status) {
  absl::flat_hash_map<uint64_t, Answer> waiting;
  std::string problem;
  bool registered = false;
  bool cancelled = false;
  {
    MutexLock lock(&mu_);
    closing_ = true;
    cancelled = cancelled_;
    if (!cancelled_) internal::DescribeEnd(status, &problem_);  // when we cancelled, our reason says more
    problem = problem_;
    unimplemented_ = status.error_code() == grpc::StatusCode::UNIMPLEMENTED;
    waiting = std::move(waiting_);
    waiting_.clear();
    registered = registered_;
  }
  if (!registered) {
    // The peer never took answers here: they come up the StepStreams. Dropped unrun.
    if (!status.ok() && !cancelled) LOG(WARNING) << options_.peer << " was refused: " << problem;
    waiting.clear();
  } else if (!waiting.empty()) {
    LOG(WARNING) << options_.peer << " " << problem << "; " << waiting.size() << " micro-batch(es) awaited fail";
  }
  const absl::Status failed = absl::UnavailableError(absl::StrCat(options_.peer, " ", problem));
  for (auto& [step_id, answer] : waiting) answer(failed);
  // Its own reference may be the last: the client is then destroyed on the reaper's thread.
  internal::MarkDoneAndDispose(&mu_, &done_cv_, &done_, &self_);
}

}  // namespace shardserve::rpc

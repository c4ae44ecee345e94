#include "worker/service/stage_runtime.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/log/fields.h"
#include "common/log/log.h"
#include "common/status/macros.h"
#include "worker/service/convert.h"
#include "worker/service/worker_metrics.h"

namespace shardserve::service {
namespace {

// "req-1,req-2": the request ids of a micro-batch's sequences, for its log lines.
std::string RequestIds(const v1::StepRequest& request) {
  std::string ids;
  for (const v1::StepSequence& s : request.sequences()) {
    absl::StrAppend(&ids, ids.empty() ? "" : ",", s.request_id().empty() ? "-" : LogValue(s.request_id()));
  }
  return ids;
}

}  // namespace

// One stream to the next stage on gRPC's callback API. Send() queues a micro-batch's messages and
// registers its answer callback; answers are matched by step_id as they arrive. When the stream
// ends (either side), every micro-batch still waiting is answered with UNAVAILABLE.
class StageRuntime::Link final : public grpc::ClientBidiReactor<v1::StepRequest, v1::StepResponse>,
                                 public std::enable_shared_from_this<Link> {
 public:
  Link(const StageConfig& config) : config_(config) {}

  void Start(v1::Stage::Stub* stub, bool cancelled) {
    {
      MutexLock lock(&mu_);
      self_ = shared_from_this();  // until OnDone: gRPC uses the reactor until then
    }
    stub->async()->StepStream(&context_, this);
    AddHold();  // released by Stop(), so that OnDone waits for writes started outside reactions
    StartRead(&read_);
    StartCall();
    if (cancelled) Stop("was cancelled", /*cancel=*/true);
  }

  // Queues `messages` (one micro-batch) and registers `done` for its answer. On an error (the
  // stream is closed, or step_id is already in flight) `done` is left to the caller.
  absl::Status Send(uint64_t step_id, std::vector<v1::StepRequest> messages, Done& done) {
    {
      MutexLock lock(&mu_);
      if (closing_) {
        return absl::UnavailableError(absl::StrCat("stream to the next stage at ", config_.next_address, " ",
                                                   problem_.empty() ? "is closed" : problem_));
      }
      if (!waiting_.try_emplace(step_id, std::move(done)).second) {  // moves only if inserted
        // Refused so that a repeated id cannot misroute another batch's answer.
        return absl::InvalidArgumentError(
            absl::StrCat("step_id ", step_id, " is already in flight to the next stage"));
      }
      for (v1::StepRequest& m : messages) {
        if (config_.metrics != nullptr) config_.metrics->ObserveStream("tx", "downstream", m.ByteSizeLong());
        queue_.push_back(std::move(m));
      }
      if (writing_) return absl::OkStatus();
      writing_ = true;
      writing_msg_ = std::move(queue_.front());
      queue_.pop_front();
      ++starting_;
    }
    StartWrite(&writing_msg_);
    bool release = false;
    {
      MutexLock lock(&mu_);
      --starting_;
      release = ReleaseHoldLocked();
    }
    if (release) RemoveHold();
    return absl::OkStatus();
  }

  bool closing() {
    MutexLock lock(&mu_);
    return closing_;
  }

  // No more sends; with `cancel` the call is cancelled too (OnDone then fails what is waiting).
  void Stop(const std::string& why, bool cancel) {
    bool release = false;
    {
      MutexLock lock(&mu_);
      if (!closing_) {
        closing_ = true;
        problem_ = why;
        release = ReleaseHoldLocked();
      }
    }
    if (cancel) context_.TryCancel();
    if (release) RemoveHold();
  }

  void WaitDone() {
    MutexLock lock(&mu_);
    while (!done_) done_cv_.Wait(&mu_);
  }

  void OnWriteDone(bool ok) override {
    {
      MutexLock lock(&mu_);
      if (ok && !queue_.empty()) {
        writing_msg_ = std::move(queue_.front());
        queue_.pop_front();
      } else {
        writing_ = false;
        if (ok) return;
      }
    }
    if (!ok) {
      Stop("failed a write", /*cancel=*/true);
      return;
    }
    StartWrite(&writing_msg_);  // from a reaction: the call cannot end meanwhile
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      Stop("ended the stream", /*cancel=*/false);
      return;
    }
    if (config_.metrics != nullptr) config_.metrics->ObserveStream("rx", "downstream", read_.ByteSizeLong());
    Done done;
    {
      MutexLock lock(&mu_);
      auto it = waiting_.find(read_.step_id());
      if (it != waiting_.end()) {
        done = std::move(it->second);
        waiting_.erase(it);
      }
    }
    if (done == nullptr) {
      // An answer to nothing we sent (e.g. the next stage could not reassemble a batch): the
      // stream's state is unknown, so end it and fail what is waiting.
      Stop(absl::StrCat("answered step ", read_.step_id(), " that was not in flight",
                        read_.error_message().empty() ? "" : ": ", read_.error_message()),
           /*cancel=*/true);
      return;
    }
    v1::StepResponse response = std::move(read_);
    read_.Clear();
    // Answer before reading on: the next answer's reaction may run on another thread as soon as the
    // read is started, and upstream must see the answers in the order the next stage gave them.
    // (Inside this reaction the call cannot end, so `done` runs with the link alive.)
    done(std::move(response));
    StartRead(&read_);
  }

  void OnDone(const grpc::Status& status) override {
    absl::flat_hash_map<uint64_t, Done> waiting;
    std::string problem;
    {
      MutexLock lock(&mu_);
      closing_ = true;
      if (problem_.empty()) problem_ = status.ok() ? "closed the stream" : "ended the stream";
      if (!status.ok()) absl::StrAppend(&problem_, ": ", status.error_message());
      problem = problem_;
      waiting = std::move(waiting_);
      waiting_.clear();
    }
    if (!waiting.empty() || !status.ok()) {
      LOG(WARNING) << "stage " << config_.stage << ": next stage at " << config_.next_address << " " << problem << "; "
                   << waiting.size() << " micro-batch(es) in flight fail";
    }
    const absl::Status failed = absl::UnavailableError(absl::StrCat("next stage at ", config_.next_address, " ", problem));
    for (auto& [step_id, done] : waiting) done(ErrorResponse(step_id, failed));
    std::shared_ptr<Link> self;
    {
      MutexLock lock(&mu_);
      done_ = true;
      done_cv_.SignalAll();
      self = std::move(self_);
    }
    // `self` may be the last reference: the link is destroyed here, after its mutex is released.
  }

 private:
  // Whether the caller must call RemoveHold (once, after unlocking).
  bool ReleaseHoldLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!closing_ || starting_ > 0 || hold_released_) return false;
    hold_released_ = true;
    return true;
  }

  const StageConfig& config_;
  grpc::ClientContext context_;
  v1::StepResponse read_;        // the read chain's buffer
  v1::StepRequest writing_msg_;  // owned by whoever set writing_ until OnWriteDone
  Mutex mu_;
  CondVar done_cv_;
  absl::flat_hash_map<uint64_t, Done> waiting_ ABSL_GUARDED_BY(mu_);  // step_id -> the upstream's answer callback
  std::deque<v1::StepRequest> queue_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  int starting_ ABSL_GUARDED_BY(mu_) = 0;  // StartWrite calls outside reactions
  bool closing_ ABSL_GUARDED_BY(mu_) = false;  // no more sends
  bool hold_released_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;  // OnDone has run
  std::string problem_ ABSL_GUARDED_BY(mu_);  // why it closed
  std::shared_ptr<Link> self_ ABSL_GUARDED_BY(mu_);  // keeps the reactor alive until OnDone
};

StageRuntime::StageRuntime(std::shared_ptr<engine::StepRunner> runner, StageConfig config)
    : remote_experts_(config.remote_experts), runner_(std::move(runner)), config_(std::move(config)) {}

StageRuntime::~StageRuntime() {
  Cancel();
  std::shared_ptr<Link> link;
  {
    MutexLock lock(&mu_);
    link = std::move(link_);
  }
  if (link != nullptr) link->WaitDone();
}

void StageRuntime::Cancel() {
  std::shared_ptr<Link> link;
  {
    MutexLock lock(&mu_);
    cancelled_ = true;
    link = link_;
  }
  if (link != nullptr) link->Stop("was cancelled", /*cancel=*/true);
}

void StageRuntime::Run(const v1::StepRequest& request, Done done) {
  absl::StatusOr<std::optional<v1::StepResponse>> r = RunOrForward(request, done);
  if (!r.ok()) {
    // A structured line naming the requests (common/log/fields.h), so that one request can be
    // followed from the coordinator's log through every stage's. Failures of later stages are
    // logged by those stages.
    LOG(WARNING) << "event=step_failed stage=" << config_.stage << " assignment=" << LogValue(config_.assignment_id)
                 << " step_id=" << request.step_id() << " request_ids=" << RequestIds(request)
                 << " status=" << absl::StatusCodeToString(r.status().code())
                 << " error=" << LogValue(r.status().message());
    done(ErrorResponse(request.step_id(), r.status()));
  } else if (r->has_value()) {
    done(**std::move(r));
  }
}

absl::StatusOr<std::optional<v1::StepResponse>> StageRuntime::RunOrForward(const v1::StepRequest& request,
                                                                           Done& done) {
  const int64_t hidden = runner_->spec().hidden_size;
  ASSIGN_OR_RETURN(StageBatch batch, FromProto(request, hidden));
  std::vector<engine::StepSequence> steps;
  steps.reserve(batch.sequences.size());
  for (const StageSequence& s : batch.sequences) {
    steps.push_back(s.step);
    // Greedy sequences get their id from the last stage's device, not a logits row.
    steps.back().greedy = is_last() && s.sample && s.sampling.IsGreedy() && !s.logprobs;
    steps.back().all_logits = is_last() && !s.prompt_logprob_targets.empty();
  }
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(engine::StepResult result, runner_->Step(steps, batch.hidden));
  VLOG(1) << "event=step stage=" << config_.stage << " step_id=" << request.step_id()
          << " sequences=" << request.sequences_size() << " request_ids=" << RequestIds(request) << " ms="
          << std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  if (config_.metrics != nullptr) {
    int64_t tokens = 0;
    bool prefill = false;
    for (const auto& s : steps) {
      tokens += s.NumTokens();
      prefill = prefill || s.NumTokens() > 1;
    }
    config_.metrics->ObserveStep(config_.stage, prefill,
                                 std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), tokens);
  }
  if (!is_last()) {
    batch.hidden = std::move(result.hidden);
    Forward(batch.step_id, ToNextStage(batch, hidden), std::move(done));
    return std::nullopt;
  }
  v1::StepResponse response;
  response.set_step_id(batch.step_id);
  bool any_logprobs = false;
  for (const StageSequence& s : batch.sequences) any_logprobs = any_logprobs || (s.sample && s.logprobs);
  const size_t vocab = static_cast<size_t>(runner_->spec().vocab_size);
  for (size_t i = 0; i < batch.sequences.size(); ++i) {
    const StageSequence& s = batch.sequences[i];
    // Prompt logprobs first: row r's logits give the logprob of the prompt token after it.
    for (size_t r = 0; r < s.prompt_logprob_targets.size(); ++r) {
      const int32_t target = s.prompt_logprob_targets[r];
      if (target < 0) continue;
      if (static_cast<size_t>(target) >= vocab) {
        return absl::InvalidArgumentError(absl::StrCat("sequence ", i, ": prompt_logprob_targets[", r, "] = ", target,
                                                       " is outside the vocabulary [0, ", vocab, ")"));
      }
      const absl::Span<const float> row(result.logits[i].data() + r * vocab, vocab);
      const engine::TokenLogprobs lp = engine::ComputeLogprobs(row, target, s.top_logprobs);
      v1::TokenLogprobs* out = response.add_prompt_logprobs();
      out->set_logprob(lp.logprob);
      out->mutable_top_ids()->Add(lp.top_ids.begin(), lp.top_ids.end());
      out->mutable_top_logprobs()->Add(lp.top_logprobs.begin(), lp.top_logprobs.end());
    }
  }
  for (size_t i = 0; i < batch.sequences.size(); ++i) {
    const StageSequence& s = batch.sequences[i];
    if (!s.sample) continue;
    if (i < result.greedy_ids.size() && result.greedy_ids[i] >= 0) {
      response.add_token_ids(result.greedy_ids[i]);
      if (any_logprobs) response.add_logprobs();  // this one did not ask (it would have had its row)
      continue;
    }
    const std::vector<float>& logits = result.logits[i];
    // The last row holds the logits of the sequence's last new token.
    absl::Span<const float> row(logits.data() + logits.size() - vocab, vocab);
    const int32_t token = sampler_.Sample(row, s.sampling, s.sample_index);
    response.add_token_ids(token);
    if (any_logprobs) {
      v1::TokenLogprobs* out = response.add_logprobs();
      if (s.logprobs) {
        const engine::TokenLogprobs lp = engine::ComputeLogprobs(row, token, s.top_logprobs);
        out->set_logprob(lp.logprob);
        out->mutable_top_ids()->Add(lp.top_ids.begin(), lp.top_ids.end());
        out->mutable_top_logprobs()->Add(lp.top_logprobs.begin(), lp.top_logprobs.end());
      }
    }
  }
  return response;
}

std::shared_ptr<StageRuntime::Link> StageRuntime::OpenLink() {
  std::shared_ptr<Link> old;
  {
    MutexLock lock(&mu_);
    if (link_ != nullptr && !link_->closing()) return link_;
    old = std::move(link_);
  }
  // The old stream is closing: its OnDone answers (or has answered) what was waiting on it.
  if (old != nullptr) {
    old->Stop("was replaced", /*cancel=*/true);
    old->WaitDone();
  }
  if (channel_ == nullptr) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(kMaxMessageBytes);
    args.SetMaxSendMessageSize(kMaxMessageBytes);
    channel_ = grpc::CreateCustomChannel(
        config_.next_address,
        config_.peer_credentials != nullptr ? config_.peer_credentials : grpc::InsecureChannelCredentials(), args);
    stub_ = v1::Stage::NewStub(channel_);
  }
  auto link = std::make_shared<Link>(config_);
  bool cancelled = false;
  {
    MutexLock lock(&mu_);
    cancelled = cancelled_;
    link_ = link;
  }
  link->Start(stub_.get(), cancelled);
  return link;
}

void StageRuntime::Forward(uint64_t step_id, std::vector<v1::StepRequest> messages, Done done) {
  std::shared_ptr<Link> link = OpenLink();
  if (absl::Status st = link->Send(step_id, std::move(messages), done); !st.ok()) {
    done(ErrorResponse(step_id, st));
  }
}

}  // namespace shardserve::service

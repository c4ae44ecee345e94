#include "worker/service/stage_runtime.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <string>
#include <thread>
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

struct StageRuntime::Link {
  std::unique_ptr<grpc::ClientContext> context;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>> stream;
  std::thread reader;
  // Guarded by StageRuntime::mu_.
  absl::flat_hash_map<uint64_t, Done> waiting;  // step_id -> the upstream's answer callback
  bool broken = false;
};

namespace {

v1::StepResponse ErrorResponse(uint64_t step_id, const absl::Status& st) {
  v1::StepResponse failed;
  failed.set_step_id(step_id);
  failed.set_error_code(static_cast<int32_t>(st.code()));
  failed.set_error_message(std::string(st.message()));
  return failed;
}

}  // namespace

StageRuntime::StageRuntime(std::unique_ptr<engine::StepRunner> runner, StageConfig config)
    : remote_experts_(config.remote_experts), runner_(std::move(runner)), config_(std::move(config)) {}

StageRuntime::~StageRuntime() {
  Cancel();
  std::shared_ptr<Link> link;
  {
    std::lock_guard lock(mu_);
    link = std::move(link_);
  }
  if (link != nullptr && link->reader.joinable()) link->reader.join();
}

void StageRuntime::Cancel() {
  std::lock_guard lock(mu_);
  cancelled_ = true;
  if (link_ != nullptr) link_->context->TryCancel();
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
  for (const StageSequence& s : batch.sequences) steps.push_back(s.step);
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
  for (size_t i = 0; i < batch.sequences.size(); ++i) {
    const StageSequence& s = batch.sequences[i];
    if (!s.sample) continue;
    const std::vector<float>& logits = result.logits[i];
    const size_t vocab = static_cast<size_t>(runner_->spec().vocab_size);
    // The last row holds the logits of the sequence's last new token.
    absl::Span<const float> row(logits.data() + logits.size() - vocab, vocab);
    response.add_token_ids(sampler_.Sample(row, s.sampling, s.sample_index));
  }
  return response;
}

std::shared_ptr<StageRuntime::Link> StageRuntime::OpenLink() {
  std::shared_ptr<Link> old;
  {
    std::lock_guard lock(mu_);
    if (link_ != nullptr && !link_->broken) return link_;
    old = std::move(link_);
  }
  // The old link's reader has marked it broken and is answering (or has answered) its waiting
  // batches; let it finish.
  if (old != nullptr && old->reader.joinable()) old->reader.join();
  if (channel_ == nullptr) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(kMaxMessageBytes);
    args.SetMaxSendMessageSize(kMaxMessageBytes);
    channel_ = grpc::CreateCustomChannel(config_.next_address, grpc::InsecureChannelCredentials(), args);
    stub_ = v1::Stage::NewStub(channel_);
  }
  auto link = std::make_shared<Link>();
  link->context = std::make_unique<grpc::ClientContext>();
  {
    std::lock_guard lock(mu_);
    if (cancelled_) link->context->TryCancel();  // Cancel() came first: the stream fails at once
    link_ = link;
  }
  link->stream = stub_->StepStream(link->context.get());
  link->reader = std::thread([this, link] { ReadLoop(link); });
  return link;
}

void StageRuntime::Forward(uint64_t step_id, const std::vector<v1::StepRequest>& messages, Done done) {
  std::shared_ptr<Link> link = OpenLink();
  bool broken = false, duplicate = false;
  {
    std::lock_guard lock(mu_);
    if (link->broken) {
      broken = true;  // it broke since OpenLink: its reader has already answered what was waiting
    } else {
      duplicate = !link->waiting.try_emplace(step_id, std::move(done)).second;  // moves only if inserted
    }
  }
  if (duplicate) {
    // Refused so that a repeated id cannot misroute another batch's answer.
    done(ErrorResponse(step_id, absl::InvalidArgumentError(
                                    absl::StrCat("step_id ", step_id, " is already in flight to the next stage"))));
    return;
  }
  if (broken) {
    done(ErrorResponse(step_id, absl::UnavailableError(
                                    absl::StrCat("stream to the next stage at ", config_.next_address, " is broken"))));
    return;
  }
  for (const v1::StepRequest& m : messages) {
    if (config_.metrics != nullptr) config_.metrics->ObserveStream("tx", "downstream", m.ByteSizeLong());
    if (!link->stream->Write(m)) {
      // The stream is gone: the reader sees it end and answers every waiting batch, this one too.
      link->context->TryCancel();
      return;
    }
  }
}

void StageRuntime::ReadLoop(const std::shared_ptr<Link>& link) {
  v1::StepResponse response;
  std::string problem;
  while (link->stream->Read(&response)) {
    if (config_.metrics != nullptr) config_.metrics->ObserveStream("rx", "downstream", response.ByteSizeLong());
    Done done;
    {
      std::lock_guard lock(mu_);
      auto it = link->waiting.find(response.step_id());
      if (it != link->waiting.end()) {
        done = std::move(it->second);
        link->waiting.erase(it);
      }
    }
    if (done == nullptr) {
      // An answer to nothing we sent (e.g. the next stage could not reassemble a batch): the
      // stream's state is unknown, so end it and fail what is waiting.
      problem = absl::StrCat("answered step ", response.step_id(), " that was not in flight",
                             response.error_message().empty() ? "" : ": ", response.error_message());
      link->context->TryCancel();
      break;
    }
    done(std::move(response));
    response.Clear();
  }
  const grpc::Status st = link->stream->Finish();
  if (problem.empty()) problem = st.ok() ? "closed the stream" : absl::StrCat("ended the stream: ", st.error_message());
  absl::flat_hash_map<uint64_t, Done> waiting;
  {
    std::lock_guard lock(mu_);
    link->broken = true;
    waiting = std::move(link->waiting);
    link->waiting.clear();
  }
  if (!waiting.empty() || !st.ok()) {
    LOG(WARNING) << "stage " << config_.stage << ": next stage at " << config_.next_address << " " << problem << "; "
                 << waiting.size() << " micro-batch(es) in flight fail";
  }
  const absl::Status failed =
      absl::UnavailableError(absl::StrCat("next stage at ", config_.next_address, " ", problem));
  for (auto& [step_id, done] : waiting) done(ErrorResponse(step_id, failed));
}

}  // namespace shardserve::service

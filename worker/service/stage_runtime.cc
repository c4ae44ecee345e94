#include "worker/service/stage_runtime.h"

#include <grpcpp/grpcpp.h>

#include <chrono>

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

StageRuntime::StageRuntime(std::unique_ptr<engine::StepRunner> runner, StageConfig config)
    : runner_(std::move(runner)), config_(std::move(config)) {}

StageRuntime::~StageRuntime() { Cancel(); }

void StageRuntime::Cancel() {
  std::lock_guard lock(mu_);
  if (context_ != nullptr) context_->TryCancel();
}

v1::StepResponse StageRuntime::Run(const v1::StepRequest& request) {
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<v1::StepResponse> r = RunOrError(request);
  // Structured lines (common/log/fields.h) naming the requests, so that one request can be
  // followed from the coordinator's log through every stage's.
  if (r.ok()) {
    VLOG(1) << "event=step stage=" << config_.stage << " step_id=" << request.step_id()
            << " sequences=" << request.sequences_size() << " request_ids=" << RequestIds(request) << " ms="
            << std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    return *std::move(r);
  }
  LOG(WARNING) << "event=step_failed stage=" << config_.stage << " assignment=" << LogValue(config_.assignment_id)
               << " step_id=" << request.step_id() << " request_ids=" << RequestIds(request)
               << " status=" << absl::StatusCodeToString(r.status().code())
               << " error=" << LogValue(r.status().message());
  v1::StepResponse failed;
  failed.set_step_id(request.step_id());
  failed.set_error_code(static_cast<int32_t>(r.status().code()));
  failed.set_error_message(std::string(r.status().message()));
  return failed;
}

absl::StatusOr<v1::StepResponse> StageRuntime::RunOrError(const v1::StepRequest& request) {
  const int64_t hidden = runner_->spec().hidden_size;
  ASSIGN_OR_RETURN(StageBatch batch, FromProto(request, hidden));
  std::vector<engine::StepSequence> steps;
  steps.reserve(batch.sequences.size());
  for (const StageSequence& s : batch.sequences) steps.push_back(s.step);
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(engine::StepResult result, runner_->Step(steps, batch.hidden));
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
    return Forward(ToNextStage(batch, hidden));
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

absl::StatusOr<v1::StepResponse> StageRuntime::Forward(const std::vector<v1::StepRequest>& messages) {
  grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>* stream = nullptr;
  {
    std::lock_guard lock(mu_);
    if (stream_ == nullptr) {
      if (channel_ == nullptr) {
        grpc::ChannelArguments args;
        args.SetMaxReceiveMessageSize(kMaxMessageBytes);
        args.SetMaxSendMessageSize(kMaxMessageBytes);
        channel_ = grpc::CreateCustomChannel(config_.next_address, grpc::InsecureChannelCredentials(), args);
        stub_ = v1::Stage::NewStub(channel_);
      }
      context_ = std::make_unique<grpc::ClientContext>();
      stream_ = stub_->StepStream(context_.get());
    }
    stream = stream_.get();
  }
  for (const v1::StepRequest& m : messages) {
    if (config_.metrics != nullptr) config_.metrics->ObserveStream("tx", "downstream", m.ByteSizeLong());
    if (!stream->Write(m)) {
      ResetDownstream();
      return absl::UnavailableError(absl::StrCat("next stage at ", config_.next_address, " closed the stream"));
    }
  }
  v1::StepResponse response;
  if (!stream->Read(&response)) {
    ResetDownstream();
    return absl::UnavailableError(absl::StrCat("next stage at ", config_.next_address, " did not answer"));
  }
  if (config_.metrics != nullptr) config_.metrics->ObserveStream("rx", "downstream", response.ByteSizeLong());
  return response;
}

void StageRuntime::ResetDownstream() {
  std::unique_ptr<grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>> stream;
  std::unique_ptr<grpc::ClientContext> context;
  {
    std::lock_guard lock(mu_);
    stream = std::move(stream_);
    context = std::move(context_);
  }
  if (context != nullptr) context->TryCancel();
  if (stream != nullptr) {
    grpc::Status st = stream->Finish();
    LOG(WARNING) << "stream to next stage " << config_.next_address << " ended: " << st.error_message();
  }
}

}  // namespace shardserve::service

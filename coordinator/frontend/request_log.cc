#include "coordinator/frontend/request_log.h"

#include <optional>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/log/fields.h"
#include "common/log/log.h"

namespace shardserve::coordinator::frontend {
namespace {

std::string Millis(absl::Duration d) { return absl::StrFormat("%.1f", absl::ToDoubleMilliseconds(d)); }

// Passes every call on to `inner`, noting when the first token came and logging the end.
class LoggingSink final : public SequenceSink {
 public:
  LoggingSink(std::string request_id, std::shared_ptr<SequenceSink> inner, const Clock* clock)
      : request_id_(LogValue(request_id)), inner_(std::move(inner)), clock_(clock), start_(clock->Now()) {}

  void OnTokens(absl::Span<const int32_t> tokens, absl::Span<const TokenLogprobs> logprobs) override {
    {
      absl::MutexLock lock(&mu_);
      if (!first_token_.has_value()) first_token_ = clock_->Now();
    }
    inner_->OnTokens(tokens, logprobs);
  }

  void OnPromptLogprobs(absl::Span<const TokenLogprobs> logprobs) override { inner_->OnPromptLogprobs(logprobs); }

  void OnEnd(const SequenceEnd& end) override {
    const absl::Time now = clock_->Now();
    std::string ttft = "none";
    {
      absl::MutexLock lock(&mu_);
      if (first_token_.has_value()) ttft = Millis(*first_token_ - start_);
    }
    if (end.status.ok()) {
      LOG(INFO) << "event=request_end request_id=" << request_id_ << " status=OK finish_reason="
                << FinishReasonName(end.reason) << " prompt_tokens=" << end.prompt_tokens
                << " cached_prompt_tokens=" << end.cached_prompt_tokens << " completion_tokens=" << end.completion_tokens << " ttft_ms=" << ttft
                << " e2e_ms=" << Millis(now - start_);
    } else {
      LOG(WARNING) << "event=request_end request_id=" << request_id_
                   << " status=" << absl::StatusCodeToString(end.status.code()) << " finish_reason=error"
                   << " prompt_tokens=" << end.prompt_tokens << " completion_tokens=" << end.completion_tokens
                   << " ttft_ms=" << ttft << " e2e_ms=" << Millis(now - start_)
                   << " error=" << LogValue(end.status.message());
    }
    inner_->OnEnd(end);
  }

 private:
  const std::string request_id_;  // already made log-safe
  const std::shared_ptr<SequenceSink> inner_;
  const Clock* const clock_;
  const absl::Time start_;
  absl::Mutex mu_;
  std::optional<absl::Time> first_token_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

void ReportRejected(SchedulerObserver* observer, const absl::Status& status) {
  LOG(WARNING) << "event=request_rejected status=" << absl::StatusCodeToString(status.code())
               << " error=" << LogValue(status.message());
  if (observer != nullptr) observer->OnRejected(status);
}

absl::StatusOr<SequenceId> SubmitWithLog(Scheduler& scheduler, SequenceRequest request,
                                         std::shared_ptr<SequenceSink> sink, const Clock* clock) {
  if (clock == nullptr) clock = RealClock::Get();
  const std::string request_id = request.request_id;
  // Logged before Submit, so that it comes before anything the workers or the end line log.
  LOG(INFO) << "event=request_start request_id=" << LogValue(request_id) << " prompt_tokens=" << request.prompt.size()
            << " max_tokens=" << request.max_tokens
            << (request.resumed.empty() ? "" : absl::StrCat(" resumed_tokens=", request.resumed.size()));
  absl::StatusOr<SequenceId> id =
      scheduler.Submit(std::move(request), std::make_shared<LoggingSink>(request_id, std::move(sink), clock));
  if (!id.ok()) {
    LOG(WARNING) << "event=request_rejected request_id=" << LogValue(request_id)
                 << " status=" << absl::StatusCodeToString(id.status().code())
                 << " error=" << LogValue(id.status().message());
  }
  return id;
}

}  // namespace shardserve::coordinator::frontend

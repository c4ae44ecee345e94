#include "coordinator/frontend/choices.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "coordinator/frontend/request_log.h"

namespace shardserve::coordinator::frontend {

// Choice 0's sink: passes every call on, and submits the other choices at its first token (or end).
class ChoiceGroup::FirstChoiceSink final : public SequenceSink {
 public:
  FirstChoiceSink(std::shared_ptr<ChoiceGroup> group, std::shared_ptr<SequenceSink> inner)
      : group_(std::move(group)), inner_(std::move(inner)) {}

  void OnPromptLogprobs(absl::Span<const TokenLogprobs> logprobs) override { inner_->OnPromptLogprobs(logprobs); }
  void OnTokens(absl::Span<const int32_t> tokens, absl::Span<const TokenLogprobs> logprobs) override {
    inner_->OnTokens(tokens, logprobs);
    group_->SubmitRest();
  }
  void OnEnd(const SequenceEnd& end) override {
    inner_->OnEnd(end);
    group_->SubmitRest();
  }

 private:
  const std::shared_ptr<ChoiceGroup> group_;
  const std::shared_ptr<SequenceSink> inner_;
};

ChoiceGroup::ChoiceGroup(Scheduler& scheduler, size_t n, SequenceRequest request,
                         std::vector<std::shared_ptr<SequenceSink>> rest)
    : scheduler_(scheduler), request_(std::move(request)), rest_(std::move(rest)), rest_done_(rest_.empty()) {
  for (size_t i = 0; i < n; ++i) cancellers_.push_back(std::make_unique<SequenceCanceller>(&scheduler));
}

absl::StatusOr<std::shared_ptr<ChoiceGroup>> ChoiceGroup::Submit(Scheduler& scheduler, SequenceRequest request,
                                                                 std::vector<std::shared_ptr<SequenceSink>> sinks) {
  if (sinks.empty() || sinks.size() > static_cast<size_t>(kMaxChoices)) {
    return absl::InvalidArgumentError(absl::StrCat("n must be in [1, ", kMaxChoices, "], got ", sinks.size()));
  }
  const size_t n = sinks.size();
  std::shared_ptr<SequenceSink> sink = std::move(sinks.front());
  std::vector<std::shared_ptr<SequenceSink>> rest(std::make_move_iterator(sinks.begin() + 1),
                                                  std::make_move_iterator(sinks.end()));
  // Only the other choices need the request again.
  std::shared_ptr<ChoiceGroup> group(new ChoiceGroup(scheduler, n, n > 1 ? request : SequenceRequest(), std::move(rest)));
  if (n > 1) sink = std::make_shared<FirstChoiceSink>(group, std::move(sink));
  absl::StatusOr<SequenceId> id = SubmitWithLog(scheduler, std::move(request), std::move(sink));
  if (!id.ok()) return id.status();
  group->cancellers_[0]->Bind(*id);
  return group;
}

void ChoiceGroup::SubmitRest() {
  std::vector<std::shared_ptr<SequenceSink>> sinks;
  SequenceRequest request;
  bool cancelled = false;
  {
    absl::MutexLock lock(&mu_);
    if (rest_done_) return;
    rest_done_ = true;
    sinks = std::move(rest_);
    request = std::move(request_);
    cancelled = cancelled_;
  }
  const std::string request_id = request.request_id;
  const uint64_t seed = request.sampling.seed;
  // sinks[k] is choice k + 1.
  for (size_t k = 0; k < sinks.size(); ++k) {
    const size_t i = k + 1;
    if (cancelled) {
      sinks[k]->OnEnd(SequenceEnd{.reason = FinishReason::kCancelled});
      continue;
    }
    SequenceRequest r = request;
    r.sampling.seed = seed + i;
    r.prompt_logprobs = false;  // choice 0 reports them
    if (!request_id.empty()) r.request_id = absl::StrCat(request_id, ".", i);
    absl::StatusOr<SequenceId> id = SubmitWithLog(scheduler_, std::move(r), sinks[k]);
    if (id.ok()) {
      cancellers_[i]->Bind(*id);
    } else {
      sinks[k]->OnEnd(SequenceEnd{.status = id.status()});
    }
  }
}

void ChoiceGroup::Cancel(size_t choice, FinishReason reason) {
  if (choice < cancellers_.size()) cancellers_[choice]->Cancel(reason);
}

void ChoiceGroup::CancelAll() {
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
  }
  for (auto& c : cancellers_) c->Cancel();
}

void ChoiceCanceller::Bind(std::shared_ptr<ChoiceGroup> group) {
  bool cancel = false;
  std::vector<size_t> stops;
  {
    absl::MutexLock lock(&mu_);
    group_ = group;
    cancel = cancel_all_;
    stops.swap(stops_);
  }
  for (size_t i : stops) group->Cancel(i, FinishReason::kStop);
  if (cancel) group->CancelAll();
}

void ChoiceCanceller::CancelAll() {
  std::shared_ptr<ChoiceGroup> group;
  {
    absl::MutexLock lock(&mu_);
    cancel_all_ = true;
    group = group_;
  }
  if (group != nullptr) group->CancelAll();
}

void ChoiceCanceller::Stop(size_t choice) {
  std::shared_ptr<ChoiceGroup> group;
  {
    absl::MutexLock lock(&mu_);
    group = group_;
    if (group == nullptr) stops_.push_back(choice);
  }
  if (group != nullptr) group->Cancel(choice, FinishReason::kStop);
}

}  // namespace shardserve::coordinator::frontend

#include "coordinator/frontend/sequence_output.h"

#include <utility>

#include "common/log/log.h"

namespace shardserve::coordinator::frontend {

SequenceText::SequenceText(std::unique_ptr<StreamDecoder> decoder, std::vector<std::string> stops, bool include_stop)
    : decoder_(std::move(decoder)), matcher_(std::move(stops), include_stop) {}

bool SequenceText::Add(int32_t id, std::string* out) {
  if (matcher_.stopped()) return true;
  if (decoder_ == nullptr) return false;
  absl::StatusOr<std::string> piece = decoder_->Next(id);
  if (!piece.ok()) {
    VLOG(1) << "no text for token " << id << ": " << piece.status();
    return false;
  }
  StopStringMatcher::Result r = matcher_.Feed(*piece);
  out->append(r.text);
  return r.stopped;
}

bool SequenceText::Finish(std::string* out) {
  if (matcher_.stopped()) return true;
  if (decoder_ == nullptr) return false;
  StopStringMatcher::Result r = matcher_.Feed(decoder_->Finish());
  out->append(r.text);
  if (r.stopped) return true;
  out->append(matcher_.Finish());
  return false;
}

std::unique_ptr<StreamDecoder> ContinuationDecoder(const Tokenizer* tokenizer, absl::Span<const int32_t> prompt,
                                                   bool skip_special_tokens) {
  if (tokenizer == nullptr) return nullptr;
  std::unique_ptr<StreamDecoder> decoder = tokenizer->NewStreamDecoder(skip_special_tokens);
  if (absl::Status st = decoder->Prime(prompt); !st.ok()) VLOG(1) << "the prompt's text is not decoded: " << st;
  return decoder;
}

void SequenceCanceller::Bind(SequenceId id) {
  bool cancel = false;
  FinishReason reason = FinishReason::kCancelled;
  {
    absl::MutexLock lock(&mu_);
    id_ = id;
    cancel = cancel_requested_;
    reason = reason_;
  }
  if (cancel) scheduler_->Cancel(id, reason);
}

void SequenceCanceller::Cancel(FinishReason reason) {
  std::optional<SequenceId> id;
  {
    absl::MutexLock lock(&mu_);
    if (!cancel_requested_) reason_ = reason;  // the first reason wins
    cancel_requested_ = true;
    id = id_;
    reason = reason_;
  }
  if (id.has_value()) scheduler_->Cancel(*id, reason);
}

}  // namespace shardserve::coordinator::frontend

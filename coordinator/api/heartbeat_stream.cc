#include "coordinator/api/heartbeat_stream.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/escaping.h"
#include "common/status/grpc_raw.h"

namespace shardserve::coordinator {

HeartbeatStreamReactor::HeartbeatStreamReactor(WorkerRegistry* registry, Handler handler, uint64_t stream,
                                               HeartbeatStreamLimits limits, grpc::Status refusal)
    : registry_(registry),
      handler_(std::move(handler)),
      stream_(stream),
      limits_(limits),
      window_start_(std::chrono::steady_clock::now()) {
  // Every answer is the same empty message: encode it once.
  SerializeRawMessage(v1::HeartbeatResponse(), &out_);
  if (!refusal.ok()) {
    End(std::move(refusal), /*by_peer=*/false);
    return;
  }
  StartRead(&in_);
}

grpc::Status HeartbeatStreamReactor::Accept() {
  if (const size_t bytes = in_.Length(); bytes > limits_.max_message_bytes) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("a heartbeat of ", bytes, " bytes; at most ", limits_.max_message_bytes));
  }
  // A fixed window of one heartbeat interval: a worker sends one request per interval.
  const auto now = std::chrono::steady_clock::now();
  if (now - window_start_ >= absl::ToChronoNanoseconds(limits_.interval)) {
    window_start_ = now;
    in_window_ = 0;
  }
  if (++in_window_ > limits_.max_per_interval) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("more than ", limits_.max_per_interval, " heartbeats within one heartbeat interval (",
                                     absl::FormatDuration(limits_.interval), ")"));
  }
  v1::HeartbeatRequest request;
  if (grpc::Status st = ParseRawRequest(in_, &request); !st.ok()) return st;
  in_.Clear();
  if (!bound_worker_.empty() && request.worker_id() != bound_worker_) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("worker_id \"", absl::CHexEscape(request.worker_id()),
                                     "\" on the heartbeat stream of worker ", bound_worker_,
                                     "; one stream carries one worker's heartbeats"));
  }
  if (grpc::Status st = handler_(request, stream_); !st.ok()) return st;
  if (bound_worker_.empty()) bound_worker_ = request.worker_id();
  return grpc::Status::OK;
}

void HeartbeatStreamReactor::OnReadDone(bool ok) {
  if (!ok) {  // the worker closed the stream, or it was cancelled or lost
    End(grpc::Status::OK, /*by_peer=*/true);
    return;
  }
  if (grpc::Status st = Accept(); !st.ok()) {
    End(std::move(st), /*by_peer=*/false);
    return;
  }
  StartWrite(&out_);
}

void HeartbeatStreamReactor::OnWriteDone(bool ok) {
  if (!ok) {
    End(grpc::Status::OK, /*by_peer=*/true);
    return;
  }
  StartRead(&in_);
}

void HeartbeatStreamReactor::End(grpc::Status status, bool by_peer) {
  if (finished_) return;
  finished_ = true;
  closed_by_peer_ = by_peer;
  Finish(std::move(status));
}

void HeartbeatStreamReactor::OnDone() {
  if (closed_by_peer_ && !bound_worker_.empty()) {
    registry_->Disconnected(bound_worker_, stream_, "its heartbeat stream closed (the worker stopped or lost its connection)");
  }
  delete this;
}

}  // namespace shardserve::coordinator

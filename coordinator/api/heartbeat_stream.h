// HeartbeatStreamReactor: the coordinator's side of one Registry.HeartbeatStream call
// (proto/shardserve/v1/control.proto): a worker's heartbeats as messages on one long-lived stream,
// each handled as a unary Heartbeat would be and answered in order by one HeartbeatResponse.
//
// Life of a stream:
//   - requests are read one at a time; the next read starts once the answer to the previous one
//     is written, so at most one request and one answer of a stream are in the coordinator at a
//     time (gRPC's flow control holds back a worker that writes faster);
//   - the first request binds the stream to its worker_id; a later request naming another worker
//     ends the stream with INVALID_ARGUMENT;
//   - a request over HeartbeatStreamLimits::max_message_bytes, or more than max_per_interval
//     requests within one heartbeat interval, ends it with RESOURCE_EXHAUSTED; one that does not
//     parse, with INVALID_ARGUMENT naming the message type;
//   - a request the handler refuses ends the stream with the handler's status (NOT_FOUND: the
//     worker must register again and open a new stream);
//   - when the worker closes the stream or loses it (cancelled, connection gone) after at least
//     one accepted heartbeat, WorkerRegistry::Disconnected marks it dead at once (unless it has
//     moved to a newer stream or registered again: the registry checks). A stream the coordinator
//     ends with an error does not: the worker is alive and will come back.
// A worker silent on an open stream is left to the registry's heartbeat timeout.
//
// Thread-safety: gRPC serialises this reactor's reactions (a read and a write are never in flight
// together); the handler and the registry are thread-safe. The reactor deletes itself in OnDone.
#ifndef SHARDSERVE_COORDINATOR_API_HEARTBEAT_STREAM_H_
#define SHARDSERVE_COORDINATOR_API_HEARTBEAT_STREAM_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/server_callback.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/time/time.h"
#include "coordinator/registry/registry.h"
#include "shardserve/v1/control.pb.h"

namespace shardserve::coordinator {

// What one heartbeat stream may send.
struct HeartbeatStreamLimits {
  size_t max_message_bytes = 64 * 1024;  // one serialized HeartbeatRequest
  int max_per_interval = 8;              // requests within one heartbeat interval
  absl::Duration interval = absl::Seconds(1);  // the registry's heartbeat interval
};

class HeartbeatStreamReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  // Handles one request of stream `stream` (> 0, unique per service): the unary Heartbeat's work
  // with WorkerHeartbeat::stream set. Returns the status that ends the stream when not OK.
  using Handler = std::function<grpc::Status(const v1::HeartbeatRequest& request, uint64_t stream)>;

  // Starts reading. `registry` is borrowed and must outlive the call; `handler` must be callable
  // until OnDone. A non-OK `refusal` (the caller is not a worker) ends the stream at once with it.
  HeartbeatStreamReactor(WorkerRegistry* registry, Handler handler, uint64_t stream, HeartbeatStreamLimits limits,
                         grpc::Status refusal = grpc::Status::OK);

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnDone() override;

 private:
  // The status of request in_, or OK once it is accepted (bound_worker_ set).
  grpc::Status Accept();
  // Finishes the call once; `by_peer`: the worker closed or lost the stream.
  void End(grpc::Status status, bool by_peer);

  WorkerRegistry* const registry_;
  const Handler handler_;
  const uint64_t stream_;
  const HeartbeatStreamLimits limits_;

  // Used by one reaction at a time (see above).
  grpc::ByteBuffer in_;
  grpc::ByteBuffer out_;  // the answer being written: an empty HeartbeatResponse
  std::string bound_worker_;  // the worker_id of the first accepted request
  std::chrono::steady_clock::time_point window_start_;
  int in_window_ = 0;  // requests since window_start_
  bool finished_ = false;
  bool closed_by_peer_ = false;
};

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_API_HEARTBEAT_STREAM_H_

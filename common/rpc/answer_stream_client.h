// AnswerStreamClient: the coordinator's side of one Stage.AnswerStream call
// (proto/shardserve/v1/stage.proto): the return stream on which a replica's last stage writes the
// answers of the micro-batches sent with StepRequest.answer_route == route(), so that they do not
// relay back through the other stages. The micro-batches themselves go out on a StageStreamClient
// to stage 0 (stage_stream_client.h); coordinator/client/grpc_replica_client.h uses both.
//
// A long-lived server stream on gRPC's callback API. Expect() registers a callback for a step_id
// before its micro-batch is sent; answers are matched to callbacks by step_id as they arrive. An
// answer to a step_id that is not registered is dropped (its step was settled another way, e.g.
// failed by a stage before the last, or Forget() was called), and the stream goes on.
//
// Every registered callback runs at most once: with the StepResponse of its step_id, or with
// UNAVAILABLE ("<peer> ...") when the stream ends first (closed by Close(), ended by the peer or
// the connection) after the peer had registered it (kAnswerRouteOpenKey in its initial metadata); Forget() removes one
// without running it. A stream that ends before the peer registered it (refused: an unknown method
// on an older worker, a route in use, a missing role; or the peer gone) runs none: the peer never
// wrote answers there, so they come up the StepStreams (or those fail), and the caller's own bound
// (the step timeout) covers the rest. Callbacks run on gRPC threads without
// any lock held, and must not block.
//
// Lifetime: as StageStreamClient's (Open() returns a shared reference; the client keeps itself
// alive until its call ends and is then destroyed off gRPC's threads; WaitDone() waits for that).
//
// Thread-safety: every method may be called from any thread.
#ifndef SHARDSERVE_COMMON_RPC_ANSWER_STREAM_CLIENT_H_
#define SHARDSERVE_COMMON_RPC_ANSWER_STREAM_CLIENT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/concurrency/mutex.h"
#include "shardserve/v1/stage.grpc.pb.h"

namespace shardserve::rpc {

// The initial-metadata key (value "1") with which a worker says that it registered a return stream
// and will write answers there.
inline constexpr char kAnswerRouteOpenKey[] = "shardserve-answer-route-open";

class AnswerStreamClient final : public grpc::ClientReadReactor<v1::StepResponse>,
                                 public std::enable_shared_from_this<AnswerStreamClient> {
 public:
  using Answer = std::function<void(absl::StatusOr<v1::StepResponse>)>;

  struct Options {
    // Names the peer at the start of every error message, e.g. "return stream from 10.0.0.3:7100".
    std::string peer;
    // Optional byte counter (metrics): each answer read.
    std::function<void(size_t bytes)> on_received;
  };

  // Starts the call on `channel` (held until the call has ended) under `route`, which must be
  // unique on the peer (the peer refuses a route already open there; the stream then ends at once).
  static std::shared_ptr<AnswerStreamClient> Open(std::shared_ptr<grpc::Channel> channel, std::string route,
                                                  Options options);

  ~AnswerStreamClient() override = default;
  AnswerStreamClient(const AnswerStreamClient&) = delete;
  AnswerStreamClient& operator=(const AnswerStreamClient&) = delete;

  // The route the micro-batches name (StepRequest.answer_route).
  const std::string& route() const { return route_; }

  // Registers `answer` for the answer to `step_id`. On an error `answer` is not registered (nor
  // called) and stays with the caller: UNAVAILABLE when the stream is closing or closed,
  // INVALID_ARGUMENT when `step_id` is already registered.
  absl::Status Expect(uint64_t step_id, Answer& answer);
  // Removes the registration of `step_id` without running it (its answer came another way); a later
  // answer to it is dropped. Returns whether it was registered.
  bool Forget(uint64_t step_id);

  // Cancels the call: every registered answer gets UNAVAILABLE "<peer> closed: <why>". Idempotent.
  void Close(const std::string& why);
  // Whether Expect() would be refused: the stream is closing or has ended.
  bool closing();
  // Waits until gRPC has finished with the call; false when `timeout` passed first.
  bool WaitDone(absl::Duration timeout = absl::InfiniteDuration());
  // Whether the stream ended with UNIMPLEMENTED (a peer without Stage.AnswerStream).
  bool unimplemented();

  // The reactions (gRPC's).
  void OnReadInitialMetadataDone(bool ok) override;
  void OnReadDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;

 private:
  AnswerStreamClient(std::shared_ptr<grpc::Channel> channel, std::string route, Options options);
  void Start();

  const Options options_;
  const std::string route_;
  // Declared before context_ (destroyed after it): the call refers to the channel until it ends.
  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<v1::Stage::Stub> stub_;
  grpc::ClientContext context_;
  v1::AnswerStreamRequest request_;
  v1::StepResponse read_;  // the read chain's buffer (StartRead -> OnReadDone -> StartRead)

  Mutex mu_;
  CondVar done_cv_;
  absl::flat_hash_map<uint64_t, Answer> waiting_ ABSL_GUARDED_BY(mu_);  // step_id -> its answer
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;  // closed by us: our reason says more than CANCELLED
  bool done_ ABSL_GUARDED_BY(mu_) = false;       // OnDone has run
  bool registered_ ABSL_GUARDED_BY(mu_) = false;  // the peer's initial metadata said so
  bool unimplemented_ ABSL_GUARDED_BY(mu_) = false;
  std::string problem_ ABSL_GUARDED_BY(mu_);     // why it closed, after the peer's name
  std::shared_ptr<AnswerStreamClient> self_ ABSL_GUARDED_BY(mu_);  // alive until OnDone
};

}  // namespace shardserve::rpc

#endif  // SHARDSERVE_COMMON_RPC_ANSWER_STREAM_CLIENT_H_

// GrpcReplicaClient: ReplicaClient (coordinator/scheduler/replica_client.h) over the
// Stage.StepStream of a replica's stage-0 worker (proto/shardserve/v1/stage.proto).
//
// One long-lived bidirectional stream, opened on the first Step and re-opened on the next Step
// after it breaks. Each Step writes one StepRequest (step_id = StepInput::step_id) and waits for
// the StepResponse with the same step_id, so several Steps (from several threads) can be in flight
// on the one stream: pipelined micro-batches. The stream uses the gRPC callback client API
// (ClientBidiReactor); Step waits on a condition variable, bounded by Options::step_timeout.
//
// Errors from Step: the stages' own error (StepResponse.error_code / error_message);
// Unavailable when the stream cannot be opened or ends ("stage stream to ADDRESS ended: ...");
// Unavailable too after step_timeout (a stage that does not answer breaks the pipeline like a
// closed stream: the stream is cancelled and re-opened by the next Step); Unavailable after
// Shutdown.
//
// Thread-safety: as ReplicaClient (Step from several threads at once; Shutdown from any thread).
// Destruction waits (bounded) for the stream to finish.
#ifndef SHARDSERVE_COORDINATOR_CLIENT_GRPC_REPLICA_CLIENT_H_
#define SHARDSERVE_COORDINATOR_CLIENT_GRPC_REPLICA_CLIENT_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/scheduler/replica_client.h"

namespace grpc {
class Channel;
}  // namespace grpc

namespace shardserve::coordinator {

class GrpcReplicaClient final : public ReplicaClient {
 public:
  struct Options {
    std::string address;                             // stage 0's host:port, for messages
    absl::Duration step_timeout = absl::Seconds(60);  // bound on one Step, > 0
  };

  // `channel` to the stage-0 worker (shared: channels are cheap to share and reuse).
  GrpcReplicaClient(std::shared_ptr<grpc::Channel> channel, Options options);
  ~GrpcReplicaClient() override;

  GrpcReplicaClient(const GrpcReplicaClient&) = delete;
  GrpcReplicaClient& operator=(const GrpcReplicaClient&) = delete;

  absl::StatusOr<StepOutput> Step(const StepInput& input) override;
  void Shutdown() override;

 private:
  class Stream;  // the ClientBidiReactor; defined in the .cc (keeps gRPC types out of this header)

  const std::shared_ptr<grpc::Channel> channel_;
  const Options options_;

  absl::Mutex mu_;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  // Shared with the Steps using it, so that one Step retiring it cannot free it under another.
  std::shared_ptr<Stream> stream_ ABSL_GUARDED_BY(mu_);
  // Streams cancelled or broken, kept until gRPC has finished with them (their OnDone).
  std::vector<std::shared_ptr<Stream>> retired_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_CLIENT_GRPC_REPLICA_CLIENT_H_

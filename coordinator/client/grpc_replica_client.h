// GrpcReplicaClient: ReplicaClient (coordinator/scheduler/replica_client.h) over the
// Stage.StepStream of a replica's stage-0 worker (proto/shardserve/v1/stage.proto).
//
// One long-lived bidirectional stream, opened on the first Step and re-opened on the next Step
// after it breaks. Each Step writes one StepRequest (step_id = StepInput::step_id) and waits for
// the StepResponse with the same step_id, so several Steps (from several threads) can be in flight
// on the one stream: pipelined micro-batches. The stream is the transport every pipeline hop uses
// (common/rpc/stage_stream_client.h); Step waits for its answer, bounded by Options::step_timeout.
//
// Errors from Step: the stages' own error (StepResponse.error_code / error_message);
// Unavailable when the stream cannot be opened or ends ("stage stream to ADDRESS ended: ...");
// Unavailable too after step_timeout (a stage that does not answer breaks the pipeline like a
// closed stream: the stream is cancelled and re-opened by the next Step); Unavailable after
// Shutdown.
//
// Thread-safety: as ReplicaClient (Step from several threads at once; Shutdown from any thread).
// Destruction waits (bounded) for the current stream to finish.
#ifndef SHARDSERVE_COORDINATOR_CLIENT_GRPC_REPLICA_CLIENT_H_
#define SHARDSERVE_COORDINATOR_CLIENT_GRPC_REPLICA_CLIENT_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "common/concurrency/mutex.h"
#include "coordinator/scheduler/replica_client.h"

namespace grpc {
class Channel;
}  // namespace grpc

namespace shardserve::rpc {
class StageStreamClient;
}  // namespace shardserve::rpc

namespace shardserve::coordinator {

class GrpcReplicaClient final : public ReplicaClient {
 public:
  struct Options {
    std::string address;                             // stage 0's host:port, for messages
    absl::Duration step_timeout = absl::Seconds(60);  // bound on one Step, > 0
    // How long Step polls for its answer before it sleeps (common/concurrency/spin.h): an answer
    // within it is taken without a thread wake-up. 0 = sleep at once.
    absl::Duration answer_spin = absl::Microseconds(200);
  };

  // `channel` to the stage-0 worker (shared: channels are cheap to share and reuse).
  GrpcReplicaClient(std::shared_ptr<grpc::Channel> channel, Options options);
  ~GrpcReplicaClient() override;

  GrpcReplicaClient(const GrpcReplicaClient&) = delete;
  GrpcReplicaClient& operator=(const GrpcReplicaClient&) = delete;

  absl::StatusOr<StepOutput> Step(const StepInput& input) override;
  void Shutdown() override;

 private:
  const std::shared_ptr<grpc::Channel> channel_;
  const Options options_;

  Mutex mu_;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  // The open stream (replaced by the next Step once it closes); shared with the Steps using it.
  std::shared_ptr<rpc::StageStreamClient> stream_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_CLIENT_GRPC_REPLICA_CLIENT_H_

// GrpcReplicaClient: ReplicaClient (coordinator/scheduler/replica_client.h) over the
// Stage.StepStream of a replica's stage-0 worker (proto/shardserve/v1/stage.proto).
//
// One long-lived bidirectional stream, opened on the first Step and re-opened on the next Step
// after it breaks. Each Step writes one StepRequest (step_id = StepInput::step_id) and waits for
// the StepResponse with the same step_id, so several Steps (from several threads) can be in flight
// on the one stream: pipelined micro-batches. The stream is the transport every pipeline hop uses
// (common/rpc/stage_stream_client.h); Step waits for its answer, bounded by Options::step_timeout.
//
// Direct answers (stage.proto): given a channel to the replica's last stage (a replica of several
// stages), the client also holds a return stream from it (common/rpc/answer_stream_client.h, a
// fresh random route per stream, opened and re-opened like the other) and sends each step with
// that route, so that the last stage answers here directly instead of through the other stages.
// A Step takes the first full answer or error of its step_id from either stream (stage 0's stream
// then brings nothing, as the step asks it to omit the acknowledgement, or a failure of an earlier
// stage) and ignores whatever comes later, so each Step returns exactly one result (a failure from
// stage 0 after the direct answer comes only from a breaking pipeline, and ends that stream). When the return stream
// ends, the Steps awaiting it fail with UNAVAILABLE (the last stage may have gone with their
// answers), and the next Step opens another. A return stream the last stage refused (never
// registered) fails nothing: those answers come through stage 0; a last stage without
// Stage.AnswerStream (UNIMPLEMENTED) gets no more return streams from this client.
//
// Errors from Step: the stages' own error (StepResponse.error_code / error_message);
// Unavailable when a stream cannot be opened or ends ("stage stream to ADDRESS ended: ...",
// "return stream from the last stage at ADDRESS ended: ...");
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
#include "common/concurrency/arrival_forecast.h"
#include "common/concurrency/mutex.h"
#include "coordinator/scheduler/replica_client.h"

namespace grpc {
class Channel;
}  // namespace grpc

namespace shardserve::v1 {
class StepRequest;
}  // namespace shardserve::v1

namespace shardserve::rpc {
class AnswerStreamClient;
class StageStreamClient;
template <typename M>
class MessagePool;
}  // namespace shardserve::rpc

namespace shardserve::coordinator {

class GrpcReplicaClient final : public ReplicaClient {
 public:
  struct Options {
    std::string address;                             // stage 0's host:port, for messages
    std::string last_address;                        // the last stage's, for messages (direct answers)
    absl::Duration step_timeout = absl::Seconds(60);  // bound on one Step, > 0
    // How long Step polls for its answer before it sleeps (common/concurrency/spin.h): an answer
    // within it is taken without a thread wake-up. 0 (the default) = sleep at once (see
    // WorkerOptions::stage_spin for why).
    absl::Duration answer_spin = absl::ZeroDuration();
    // The longest Step polls per wait for an answer that the last steps' round trips say is due
    // (common/concurrency/arrival_forecast.h): it sleeps until shortly before, then polls, so that
    // the answer finds the step thread's core awake (at most a quarter of a typical round trip;
    // nothing for round trips under 300 us). 0 = no such polling.
    absl::Duration answer_poll = absl::Milliseconds(1);
    // Send steps as deltas (common/rpc/step_delta.h) once stage 0 announces it accepts them; each
    // sequence's key is its StepSequenceInput::sequence_id.
    bool step_deltas = true;
  };

  // `channel` to the stage-0 worker (shared: channels are cheap to share and reuse); answers come
  // back on its stream.
  GrpcReplicaClient(std::shared_ptr<grpc::Channel> channel, Options options);
  // Also `last_channel` to the last stage's worker, whose answers come straight from it (null:
  // as above, e.g. a replica of one stage).
  GrpcReplicaClient(std::shared_ptr<grpc::Channel> channel, std::shared_ptr<grpc::Channel> last_channel,
                    Options options);
  ~GrpcReplicaClient() override;

  GrpcReplicaClient(const GrpcReplicaClient&) = delete;
  GrpcReplicaClient& operator=(const GrpcReplicaClient&) = delete;

  absl::StatusOr<StepOutput> Step(const StepInput& input) override;
  // Runs `while_waiting` once the micro-batch is written to the stream (or has failed to be), then
  // waits for the answer.
  absl::StatusOr<StepOutput> StepOverlapping(const StepInput& input, absl::FunctionRef<void()> while_waiting) override;
  // True once the current stream's worker announced overlapped decode calls (rpc::kOverlappedDecodeKey).
  bool OverlapsDecodeCalls() const override;
  void Shutdown() override;

 private:
  // Sends the step, runs `while_waiting` (not when the send fails), waits for the answer.
  absl::StatusOr<StepOutput> SendAndWait(const StepInput& input, absl::FunctionRef<void()> while_waiting);

  const std::shared_ptr<grpc::Channel> channel_;
  const std::shared_ptr<grpc::Channel> last_channel_;  // null: no direct answers
  // Where each step's message is built (pooled arenas, common/rpc/message_pool.h): as many as a
  // few steps in flight wait for reuse.
  const std::shared_ptr<rpc::MessagePool<v1::StepRequest>> message_pool_;
  const Options options_;

  mutable Mutex mu_;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  // The open stream (replaced by the next Step once it closes); shared with the Steps using it.
  std::shared_ptr<rpc::StageStreamClient> stream_ ABSL_GUARDED_BY(mu_);
  // The open return stream from the last stage (with last_channel_; replaced likewise).
  std::shared_ptr<rpc::AnswerStreamClient> answers_ ABSL_GUARDED_BY(mu_);
  bool direct_off_ ABSL_GUARDED_BY(mu_) = false;  // the last stage has no AnswerStream
  // How long the last steps' answers took after their send (options_.answer_poll).
  ArrivalForecast answer_forecast_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_CLIENT_GRPC_REPLICA_CLIENT_H_

// StageStreamClient: the client side of one Stage.StepStream call (proto/shardserve/v1/stage.proto),
// the one transport of micro-batches between pipeline hops. The coordinator uses it to reach a
// replica's first stage (coordinator/client/grpc_replica_client.h) and every stage but the last to
// reach the next (worker/service/stage_runtime.h).
//
// A long-lived bidirectional stream on gRPC's callback API: Send() queues a micro-batch (one or
// more StepRequest messages sharing a step_id) and registers a callback for its answer, and returns
// without waiting; answers are matched to callbacks by step_id as they arrive, so several
// micro-batches can be in flight at once (pipelining). Writes go out one at a time in Send order.
//
// Every registered callback runs exactly once: with the StepResponse of its step_id, or with
// UNAVAILABLE ("<peer> ...") when the stream ends first — closed by Close(), ended by the peer, a
// failed write, or an answer to a step that is not in flight (the stream's state is then unknown,
// so it is ended). Callbacks run on gRPC threads without any lock held, in the order the peer
// answered; a callback may call Send() on another client but must not block on this one.
//
// Lifetime: Open() returns a shared reference; the client keeps itself (and the channel) alive
// until gRPC has finished with the call (its OnDone), so dropping every reference is always safe;
// a client whose last reference goes with its call's end is destroyed on a thread of its own, never
// on one of gRPC's (where dropping the channel's last reference would break gRPC). WaitDone() waits
// for that end (e.g. before freeing what a callback uses).
//
// Step deltas (common/rpc/step_delta.h): with Options::step_deltas, once the server's initial
// metadata announces kStepDeltasKey, Send codes each micro-batch's first message against the
// stream's sequence table (under the client's lock, so in the order the messages are written);
// until then, and with a server that never announces it, messages go as given. The table lives
// and dies with the call.
//
// Hidden states travel without copies of ours: a sender passes them as a slice beside each message
// (Messages::push_back, OwningSlice), and the client writes the message's own bytes followed by
// that slice (WireMessage), which gRPC hands to the socket as it is.
//
// Overlapped decode calls (stage.proto, StepSequence.from_previous): a server that takes them
// announces kOverlappedDecodeKey in its initial metadata; overlapped_decode() says whether it did.
//
// Thread-safety: every method may be called from any thread.
#ifndef SHARDSERVE_COMMON_RPC_STAGE_STREAM_CLIENT_H_
#define SHARDSERVE_COMMON_RPC_STAGE_STREAM_CLIENT_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/concurrency/mutex.h"
#include "common/rpc/message_pool.h"
#include "common/rpc/step_delta.h"
#include "shardserve/v1/stage.grpc.pb.h"

namespace shardserve::rpc {

// What a StageStreamClient writes: a StepRequest and, optionally, the slice of its hidden.data
// (StageStreamClient::WireMessage); gRPC serializes it through the SerializationTraits below.
struct WireRequest {
  const v1::StepRequest* message = nullptr;
  const grpc::Slice* hidden = nullptr;  // null or empty: none
};

}  // namespace shardserve::rpc

namespace grpc {

// Serializes a WireRequest into the call's own buffer, without the copy a ByteBuffer message would
// take (gRPC duplicates a ByteBuffer it is given to write).
template <>
class SerializationTraits<shardserve::rpc::WireRequest, void> {
 public:
  static Status Serialize(const shardserve::rpc::WireRequest& request, ByteBuffer* buffer, bool* own_buffer);
  static Status Deserialize(ByteBuffer* buffer, shardserve::rpc::WireRequest* request);  // not supported
};

}  // namespace grpc

namespace shardserve::rpc {

class StageStreamClient final : public grpc::ClientBidiReactor<WireRequest, v1::StepResponse>,
                                public std::enable_shared_from_this<StageStreamClient> {
 public:
  using Answer = std::function<void(absl::StatusOr<v1::StepResponse>)>;
  // One micro-batch's messages (usually one; more for chunked hidden states), each on a pooled
  // arena (message_pool.h): the sender builds them there, and they go back to their pool once
  // written, so that a steady stream allocates nothing for its messages.
  using Message = MessagePool<v1::StepRequest>::Lease;
  // A list of Messages that holds its first without a heap allocation. Each message may carry its
  // StepRequest.hidden.data as a slice beside it instead of inside it (see WireMessage): those
  // bytes then go to the socket from where they are, never copied into the message or by
  // serialization.
  class Messages {
   public:
    // `hidden`: the message's hidden-state bytes, which it must not hold itself (empty: none).
    void push_back(Message m, grpc::Slice hidden = grpc::Slice()) {
      if (size_ == 0) {
        first_ = Entry{std::move(m), std::move(hidden)};
      } else {
        rest_.push_back(Entry{std::move(m), std::move(hidden)});
      }
      ++size_;
    }
    size_t size() const { return size_; }
    bool empty() const { return size_ == 0; }
    Message& operator[](size_t i) { return entry(i).message; }
    const Message& operator[](size_t i) const { return entry(i).message; }
    Message& back() { return (*this)[size_ - 1]; }
    const grpc::Slice& hidden(size_t i) const { return entry(i).hidden; }

   private:
    friend class StageStreamClient;
    struct Entry {
      Message message;
      grpc::Slice hidden;
    };
    Entry& entry(size_t i) { return i == 0 ? first_ : rest_[i - 1]; }
    const Entry& entry(size_t i) const { return i == 0 ? first_ : rest_[i - 1]; }
    Entry first_;
    std::vector<Entry> rest_;
    size_t size_ = 0;
  };

  // The bytes written for `message` with `hidden` as its StepRequest.hidden.data: the message's
  // own serialization, then a second `hidden` field holding only `data`, whose bytes are `hidden`
  // itself (a reference, not a copy). A parser merges the two occurrences of the field (protobuf's
  // rule for a singular message field), so the receiver reads exactly the message with the data
  // inside. `message` must not have hidden.data set when `hidden` is not empty.
  static grpc::ByteBuffer WireMessage(const v1::StepRequest& message, const grpc::Slice& hidden);
  // A slice over `values`' bytes that owns them until gRPC and every copy of the slice let go.
  static grpc::Slice OwningSlice(std::vector<float> values);

  struct Options {
    // Names the peer at the start of every error message, e.g. "stage stream to 10.0.0.2:7100"
    // or "next stage at 10.0.0.2:7100".
    std::string peer;
    // Optional byte counters (metrics): each message written, each answer read.
    std::function<void(size_t bytes)> on_sent;
    std::function<void(size_t bytes)> on_received;
    // Code micro-batches as step deltas when the server accepts them (see above).
    bool step_deltas = false;
  };

  // Starts the call on `channel`, which the client holds until the call has ended.
  static std::shared_ptr<StageStreamClient> Open(std::shared_ptr<grpc::Channel> channel, Options options);

  ~StageStreamClient() override = default;
  StageStreamClient(const StageStreamClient&) = delete;
  StageStreamClient& operator=(const StageStreamClient&) = delete;

  // Queues `messages` (one micro-batch, all with `step_id`) and registers `answer` for the answer
  // to `step_id`. On an error `answer` is not registered (nor called) and stays with the caller:
  // UNAVAILABLE when the stream is closing or closed, INVALID_ARGUMENT when `step_id` is already in
  // flight (a repeated id could otherwise take another batch's answer) or `messages` is empty.
  absl::Status Send(uint64_t step_id, Messages messages, Answer& answer);

  // Removes the callback of `step_id` without running it (its answer came another way, e.g. on a
  // return stream); an answer to it that still comes is one to a step not in flight (see above).
  // Returns whether it was registered.
  bool Forget(uint64_t step_id);

  // No more sends; cancels the call, so that every answer still awaited gets UNAVAILABLE
  // "<peer> closed: <why>" (OnDone follows promptly). Idempotent; the first reason is kept.
  void Close(const std::string& why);

  // Whether Send() would be refused: the stream is closing or has ended.
  bool closing();
  // Whether the server announced kOverlappedDecodeKey (false until its initial metadata is read).
  bool overlapped_decode();
  // Waits until gRPC has finished with the call; false when `timeout` passed first.
  bool WaitDone(absl::Duration timeout = absl::InfiniteDuration());

  // The reactions (gRPC's).
  void OnWriteDone(bool ok) override;
  void OnReadDone(bool ok) override;
  void OnReadInitialMetadataDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;

 private:
  StageStreamClient(std::shared_ptr<grpc::Channel> channel, Options options);
  void Start();
  // No more sends. With `cancel` the call is cancelled and awaited answers fail with `why`;
  // without (the peer ended the stream), they fail with the status OnDone brings.
  void Stop(const std::string& why, bool cancel);
  // Moves the queue's first message into writing_entry_ (and writing_wire_) for StartWrite.
  void TakeNextWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the caller must call RemoveHold (once, after unlocking).
  bool ReleaseHoldLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  // Declared before context_ (destroyed after it): the call refers to the channel until it ends.
  const std::shared_ptr<grpc::Channel> channel_;
  // A generic stub, so that the client writes the bytes WireMessage builds (Stage.StepStream).
  grpc::TemplatedGenericStub<WireRequest, v1::StepResponse> stub_;
  grpc::ClientContext context_;
  v1::StepResponse read_;        // the read chain's buffer (StartRead -> OnReadDone -> StartRead)
  // The write in flight: set under mu_ with writing_, read by gRPC from StartWrite to OnWriteDone.
  Messages::Entry writing_entry_;
  WireRequest writing_wire_;  // points into writing_entry_

  // gRPC rules followed: one write at a time (the rest wait in queue_); a write started outside a
  // reaction (Send) needs the hold taken in Start, which is released only once closing and when
  // no thread is between its check and its StartWrite (`starting_`); Start* is never called with
  // mu_ held (a reaction could run inline and take it).
  Mutex mu_;
  CondVar done_cv_;
  absl::flat_hash_map<uint64_t, Answer> waiting_ ABSL_GUARDED_BY(mu_);  // step_id -> its answer
  std::deque<Messages::Entry> queue_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  int starting_ ABSL_GUARDED_BY(mu_) = 0;      // StartWrite calls outside reactions
  bool closing_ ABSL_GUARDED_BY(mu_) = false;  // no more sends
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;  // closed by us: our reason says more than CANCELLED
  bool hold_released_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;  // OnDone has run
  std::string problem_ ABSL_GUARDED_BY(mu_);  // why it closed, after the peer's name
  std::shared_ptr<StageStreamClient> self_ ABSL_GUARDED_BY(mu_);  // alive until OnDone
  // The stream's step-delta coder: set once the server announced it decodes deltas.
  std::unique_ptr<StepDeltaEncoder> deltas_ ABSL_GUARDED_BY(mu_);
  bool overlapped_decode_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace shardserve::rpc

#endif  // SHARDSERVE_COMMON_RPC_STAGE_STREAM_CLIENT_H_

// Conversions between the stage data plane's protobuf messages and engine structs. The only place
// (with the services) where worker code touches protobuf types.
#ifndef SHARDSERVE_WORKER_SERVICE_CONVERT_H_
#define SHARDSERVE_WORKER_SERVICE_CONVERT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/rpc/message_pool.h"
#include "common/rpc/stage_stream_client.h"
#include "common/tensor/dtype.h"
#include "shardserve/v1/stage.pb.h"
#include "worker/engine/sampling.h"
#include "worker/engine/step_runner.h"

namespace shardserve::service {

// Largest hidden-state bytes carried by one StepRequest message; larger tensors are split into
// chunks (StepRequest.chunk_index / chunk_count) and reassembled by the receiver.
inline constexpr size_t kMaxChunkBytes = size_t{2} << 20;
// gRPC message size limit configured on every stage server and channel (chunks + headroom).
inline constexpr int kMaxMessageBytes = 8 << 20;

// One sequence of a micro-batch as the stage sees it.
struct StageSequence {
  engine::StepSequence step;       // slot, positions, tokens (first stage) or num_tokens
  bool sample = false;             // the last stage samples for it
  engine::SamplingParams sampling;  // suppress_ids from the step's suppress_token_ids
  uint64_t sample_index = 0;
  std::string request_id;
  bool logprobs = false;       // return the sampled token's logprobs
  int32_t top_logprobs = 0;    // and this many of the most likely tokens', in [0, 20]
  // Empty, or one per new token: the prompt token whose logprob its logits give (-1: none).
  std::vector<int32_t> prompt_logprob_targets;
  // StepSequence.key: the sequence's identity on the upstream stream (step deltas), which the stage
  // passes on as its key downstream; 0 = none.
  uint64_t key = 0;
  // StepSequence.sample_key / from_previous (overlapped decode calls): the stage remembers its last
  // sampled id under sample_key (0 = not), and, with from_previous, takes the one new token from
  // what it remembered (step.tokens is then empty until the stage fills it in).
  uint64_t sample_key = 0;
  bool from_previous = false;
};

// Most decode steps one StepRequest may ask for (StepRequest.decode_steps).
inline constexpr uint32_t kMaxDecodeSteps = 64;

// A micro-batch, reassembled.
struct StageBatch {
  uint64_t step_id = 0;
  // StepRequest.decode_steps, >= 1 (0 is read as 1). FromProto checks that a batch with more than
  // one is eligible as far as its sequences go (each decodes one given or from_previous token and samples plainly,
  // without logprobs); the stage checks that it both embeds and samples.
  uint32_t decode_steps = 1;
  // StepRequest.answer_route: the coordinator's return stream on the last stage (empty: none).
  std::string answer_route;
  std::vector<StageSequence> sequences;
  // Hidden states [total tokens, hidden] (empty for the first stage's input). FromProto reads F32
  // states in place when it can (`hidden_in`, a view of the request's bytes: valid while the
  // request lives, and not carried by copies of the batch) and copies them into `hidden` only when
  // the bytes are not float-aligned; BF16 states are widened into `hidden`.
  std::vector<float> hidden;
  absl::Span<const float> hidden_in;
  // The stage's input: `hidden_in` when set, else `hidden`.
  absl::Span<const float> input() const {
    return hidden_in.data() != nullptr ? hidden_in : absl::MakeConstSpan(hidden);
  }
};

// Converts a complete (reassembled) request; the batch may view the request's hidden-state bytes
// (StageBatch::hidden_in), so `request` must outlive its use. InvalidArgument naming the problem
// for a dtype other than F32 and BF16, a shape that disagrees with the sequences' token counts or `hidden_size`, bad
// sampling params, or decode_steps above kMaxDecodeSteps or > 1 for a batch that is not eligible
// (stage.proto).
absl::StatusOr<StageBatch> FromProto(const v1::StepRequest& request, int64_t hidden_size);
// The same into `batch`, which keeps the capacity of its vectors and strings from its last use (a
// stage converts one micro-batch per step, so that its steady state allocates nothing here). Every
// field of `batch` and of its sequences is set; on an error `batch` holds a partial conversion.
absl::Status FromProto(const v1::StepRequest& request, int64_t hidden_size, StageBatch* batch);

// Builds the messages that carry `batch` and its output `hidden_states` ([tokens, hidden_size]) to
// the next stage, on arenas of `pool`: sequences without token ids, and the hidden states as
// `wire_dtype` bytes (kF32, exact; or kBF16, rounded to nearest even: half the bytes) split into
// chunks of at most kMaxChunkBytes. The messages do not hold those bytes: each carries its chunk
// as a slice of one buffer beside it (Messages::hidden; for kF32 the buffer is `hidden_states`
// itself), which the stream writes as the message's hidden.data without copying it
// (StageStreamClient::WireMessage). Any wire_dtype other than kBF16 is sent as kF32.
rpc::StageStreamClient::Messages ToNextStage(const StageBatch& batch, std::vector<float> hidden_states,
                                             int64_t hidden_size, rpc::MessagePool<v1::StepRequest>& pool,
                                             DType wire_dtype = DType::kF32);

// The wire's dtype tag of hidden states kept as `dtype` (kBF16 -> DTYPE_BF16, else DTYPE_F32),
// and the reverse for the tags a worker reads (F32, BF16; nullopt for any other).
v1::DType ToWireDtype(DType dtype);
std::optional<DType> FromWireDtype(v1::DType dtype);
// Appends `values` to `bytes` as little-endian `dtype` elements (kF32 or kBF16).
void AppendAs(DType dtype, absl::Span<const float> values, std::string* bytes);

// The answer that fails micro-batch `step_id` with `st` (the status's code and message).
v1::StepResponse ErrorResponse(uint64_t step_id, const absl::Status& st);

// A StepRequest as a stage reads it: on a pooled arena (common/rpc/message_pool.h).
using PooledStepRequest = rpc::MessagePool<v1::StepRequest>::Lease;

// Reassembles chunked StepRequests. Feed messages in order; Add() returns true when a request is
// complete (then take it with Take()). A request's first chunk becomes the whole request (the later
// chunks' bytes are appended to it). InvalidArgument for out-of-order or inconsistent chunks or a
// total above `max_bytes`.
class ChunkAssembler {
 public:
  explicit ChunkAssembler(size_t max_bytes) : max_bytes_(max_bytes) {}
  absl::StatusOr<bool> Add(PooledStepRequest chunk);
  PooledStepRequest Take() { return std::move(pending_); }

 private:
  size_t max_bytes_;
  PooledStepRequest pending_;
  uint32_t expected_ = 0;  // next chunk index; 0 = between requests
};

}  // namespace shardserve::service

#endif  // SHARDSERVE_WORKER_SERVICE_CONVERT_H_

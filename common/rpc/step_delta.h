// Step deltas: coding a Stage.StepStream's micro-batches against what the receiver already knows
// of each sequence (proto/shardserve/v1/stage.proto, "Step deltas", is the wire contract).
//
// A running sequence's block table, sampling parameters, request id, penalty history and token
// mask hardly change from one step to the next, yet a full StepRequest repeats them every step for
// every sequence. Both ends of one stream keep a table of the last full state the stream carried
// per sequence key; the sender (StepDeltaEncoder) then sends, for a sequence the receiver knows,
// only what changed: the new tokens and position (always), the block ids past the common prefix,
// the penalty counts that changed, and the profile (sampling, request id, ...) or mask only when
// they differ. The receiver (StepDeltaDecoder) rebuilds the full micro-batch, so everything after
// it sees the same StepRequest as without deltas.
//
// Who uses it: the shared stage-stream client (common/rpc/stage_stream_client.h) codes each
// micro-batch under its send lock, in stream order, once the server announced kStepDeltasKey; the
// worker's StepStream reactor decodes each reassembled micro-batch as it is read, in stream order.
// Each stream has its own pair; nothing outlives the stream.
//
// Keys: a full StepRequest given to Encode names each sequence by StepSequence.key, a stable
// identity chosen by the caller (the coordinator's sequence id; a stage passes on the key its
// upstream stream used). Keys only decide what is coded against what: the decoded batch equals
// the encoded one whatever the keys are (a key reused for another sequence codes a larger delta).
// Key 0 = no identity: sent in full, not remembered.
//
// Thread-safety: neither class is thread-safe; each belongs to one stream and is used under that
// stream's lock (or from its serialized reactions).
#ifndef SHARDSERVE_COMMON_RPC_STEP_DELTA_H_
#define SHARDSERVE_COMMON_RPC_STEP_DELTA_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "shardserve/v1/stage.pb.h"

namespace shardserve::rpc {

// Initial-metadata key with which a StepStream server announces (value "1") that it decodes
// step deltas; a client codes deltas only after reading it.
inline constexpr char kStepDeltasKey[] = "shardserve-step-deltas";
// Initial-metadata key with which a StepStream server announces (value "1") that it takes
// overlapped decode calls (StepSequence.sample_key / from_previous, stage.proto).
inline constexpr char kOverlappedDecodeKey[] = "shardserve-overlapped-decode";
// Most sequences one stream's table may hold (stage.proto); a receiver refuses a message that
// would exceed it, and a sender forgets the least recently sent sequences to stay within it.
inline constexpr size_t kMaxStreamSequences = 4096;

// The fields of a StepSequence that STEP_SEQUENCE_KEEP_PROFILE keeps (stage.proto): sampling,
// request_id, suppress_token_ids, logprobs, top_logprobs.
struct StepSequenceProfile {
  bool has_sampling = false;
  v1::SamplingParams sampling;
  std::string request_id;
  std::vector<int32_t> suppress_ids;
  bool logprobs = false;
  int32_t top_logprobs = 0;

  // Copies the profile fields of `s`.
  void Take(const v1::StepSequence& s);
  // Sets the profile fields of `s` (sent empty) to these.
  void Give(v1::StepSequence* s) const;
};

// What one end of a stream knows of one sequence: the state its last full or delta message left
// (the encoder's and the decoder's tables hold the same, so they stay in step).
struct StepDeltaSequenceState {
  std::vector<int32_t> blocks;
  std::vector<int32_t> penalty_ids;  // ascending
  std::vector<int32_t> penalty_counts;
  std::string mask;
  StepSequenceProfile profile;
};

class StepDeltaEncoder {
 public:
  struct Options {
    // A sequence not sent for more than this many micro-batches is forgotten (its key goes in the
    // next message's forget_keys): finished and preempted sequences leave the tables this way.
    // >= 1.
    int64_t forget_after_steps = 64;
    // Table bound, <= kMaxStreamSequences (smaller in tests).
    size_t max_sequences = kMaxStreamSequences;
  };

  StepDeltaEncoder() : StepDeltaEncoder(Options{}) {}
  explicit StepDeltaEncoder(Options options);

  // Codes `request` in place: a full StepRequest (chunk 0 of a micro-batch) becomes one with
  // deltas = true, and the table is updated as the receiver's will be when it decodes it. The
  // message must then be sent, after every message coded before it and before any coded after it
  // (the receiver decodes in stream order). A message with chunk_index != 0 is left alone (only
  // chunk 0 carries the sequences). Never fails: what cannot be coded as a delta goes in full.
  void Encode(v1::StepRequest* request);

  size_t size() const { return table_.size(); }

 private:
  struct Entry : StepDeltaSequenceState {
    int64_t last_sent = 0;  // step_ when it was last coded
  };
  // Codes one sequence against `entry` (known: it is in the receiver's table) and stores its full
  // state there.
  void EncodeSequence(v1::StepSequence* s, Entry& entry, bool known);
  // Forgets idle entries and, when `adding` new keys would exceed the bound, the least recently
  // sent ones (never one of `in_message`); their keys go in `request`'s forget_keys.
  void Evict(const absl::flat_hash_set<uint64_t>& in_message, size_t adding, v1::StepRequest* request);

  const Options options_;
  int64_t step_ = 0;  // messages coded
  absl::flat_hash_map<uint64_t, Entry> table_;
  absl::flat_hash_set<uint64_t> seen_;  // Encode's, kept to reuse its memory
};

class StepDeltaDecoder {
 public:
  // `max_sequences`: the table bound, <= kMaxStreamSequences (smaller in tests).
  explicit StepDeltaDecoder(size_t max_sequences = kMaxStreamSequences) : max_sequences_(max_sequences) {}

  // Rebuilds a coded `request` (deltas = true, chunk 0) in place into the full micro-batch: deltas
  // false, no forget_keys, each sequence as the sender had it (keys kept, keep and blocks_kept 0).
  // A request without deltas is left alone. InvalidArgument naming the sequence (index, key,
  // request id) and the field for: a delta for a key not in the table, blocks_kept < 0 or beyond
  // the entry's blocks, unknown keep bits, penalty updates out of order or of unequal lengths, a
  // key twice in one message, a delta without a key, a forget of an unknown key, or a table that
  // would exceed the bound. A refused request changes neither the table nor `request`.
  absl::Status Decode(v1::StepRequest* request);

  size_t size() const { return table_.size(); }

 private:
  using Entry = StepDeltaSequenceState;

  const size_t max_sequences_;
  absl::flat_hash_map<uint64_t, Entry> table_;
  absl::flat_hash_set<uint64_t> forgotten_, seen_;  // Decode's, kept to reuse their memory
};

}  // namespace shardserve::rpc

#endif  // SHARDSERVE_COMMON_RPC_STEP_DELTA_H_

// StepRunner: whatever runs a model step for a batch of sequences — one Model on one rank, or a
// group of tensor-parallel ranks (TpExecutor). Generation and, later, pipeline stages are written
// against this interface.
#ifndef SHARDSERVE_WORKER_ENGINE_STEP_RUNNER_H_
#define SHARDSERVE_WORKER_ENGINE_STEP_RUNNER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/model_spec/model_spec.h"
#include "worker/kernels/backend.h"

namespace shardserve::comm {
class Communicator;
}

namespace shardserve::engine {

class RemoteExperts;

// In ModelOptions::layer_experts: the expert is computed by another worker.
inline constexpr int32_t kRemoteExpert = -1;

struct StepSequence {
  // The sequence's KV cache blocks, in order: block_ids[j] holds positions [j * kv_block_size,
  // (j + 1) * kv_block_size). Must cover pos_begin + NumTokens() positions; further entries are
  // allowed and ignored. The caller owns block allocation: blocks written by one step (those of
  // the new positions) must not belong to another sequence of the step.
  std::vector<int32_t> block_ids;
  int32_t pos_begin = 0;         // the sequence's current length in the cache
  std::vector<int32_t> tokens;   // new tokens (a stage with the embedding needs them)
  int32_t num_tokens = 0;        // new tokens when `tokens` is empty (stages after the first)
  bool all_logits = false;       // logits for every new token, not only the last
  // The caller samples this sequence greedily: the last stage returns the argmax of its last new
  // token's logits (StepResult::sampled_ids; lowest id on ties) instead of the logits, so that only
  // an id leaves the device. Ignored with all_logits.
  bool greedy = false;
  // The caller samples this sequence with these parameters alone (SamplingParams::IsPlain: nothing
  // biased, suppressed, penalized or masked; `step` is the index of the token being sampled). A
  // last stage whose logits stay on a device (a single rank of a non-CPU backend that
  // SupportsOp(kSampleRows)) draws the id there, as the Sampler would, and returns it in
  // StepResult::sampled_ids instead of the logits; elsewhere the logits come back as usual and the
  // caller samples them. Ignored with all_logits or greedy.
  std::optional<kernels::RowSamplingParams> sampling;
  int32_t NumTokens() const { return tokens.empty() ? num_tokens : static_cast<int32_t>(tokens.size()); }
};

struct StepResult {
  // Last stage: per sequence, in request order, [rows, vocab] row-major, rows = NumTokens() or 1;
  // empty for a sequence with an id in sampled_ids.
  std::vector<std::vector<float>> logits;
  // Last stage: per sequence, the id chosen for it (the argmax of a greedy sequence's last logits
  // row, or the draw of a sequence with `sampling` where the device sampled), else -1.
  std::vector<int32_t> sampled_ids;
  // Other stages: the hidden states leaving the stage, [total new tokens, hidden].
  std::vector<float> hidden;
};

// Which slice of the model a rank holds.
struct TpShard {
  int rank = 0;
  int size = 1;
};

// Receives engine events for metrics. Called from rank threads, so implementations must be
// thread-safe and cheap (no I/O). Must outlive the models that report to it.
class StepObserver {
 public:
  virtual ~StepObserver() = default;
  // A collective of this rank took `seconds` (op: "all_reduce", "all_gather").
  virtual void OnCollective(int rank, absl::string_view op, double seconds) = 0;
  // `tokens` tokens of one step were routed to `expert` of MoE layer `layer` (reported by rank 0).
  virtual void OnExpertTokens(int64_t layer, int64_t expert, int64_t tokens) = 0;
};

struct ModelOptions {
  // Paged KV cache: num_kv_blocks blocks of kv_block_size tokens per layer (K and V, this rank's
  // kv heads). 0 = enough for 8 sequences of max_seq_len tokens.
  int64_t num_kv_blocks = 0;
  int64_t kv_block_size = 16;
  int64_t max_seq_len = 0;        // tokens per sequence; 0 = max_position_embeddings
  int64_t max_step_tokens = 256;  // tokens per step over all sequences (prefill chunk budget)
  // Pipeline stage: layers [layer_begin, layer_end); layer_end = -1 means the last layer. The
  // stage holding layer 0 embeds tokens; the stage holding the last layer applies the final norm
  // and the lm_head. Other stages take and return hidden states.
  int64_t layer_begin = 0;
  int64_t layer_end = -1;
  TpShard shard;
  // Required when shard.size > 1: this rank's communicator (must outlive the model).
  comm::Communicator* comm = nullptr;
  // MoE expert placement: expert_owner[e] = the rank that computes expert e. Empty = balanced
  // contiguous blocks when there are at least as many experts as ranks; with fewer experts than
  // ranks every expert is instead split tensor-parallel across all ranks.
  std::vector<int32_t> expert_owner;
  // Split every expert tensor-parallel even when there are enough experts for expert parallelism.
  bool split_experts = false;
  // Per-layer expert placement (the planner's, e.g. with expert spill), overriding expert_owner for
  // the layers listed: layer_experts[layer][e] = the rank computing expert e (any rank >= 0 means
  // "local" when experts are split over all ranks), or kRemoteExpert when another worker computes
  // it through `remote_experts`. Each listed layer must be a MoE layer of the stage.
  std::map<int64_t, std::vector<int32_t>> layer_experts;
  // Computes the remote experts; required when layer_experts names any. Rank 0 calls it (not
  // owned; must outlive the model).
  RemoteExperts* remote_experts = nullptr;
  // Optional metrics sink (not owned).
  StepObserver* observer = nullptr;
  // Decode steps (one new token per sequence) of a single-rank model are recorded once per shape
  // (sequences, attention launch) and replayed (CUDA graphs), where the backend SupportsCapture()
  // and, for MoE models, the step takes the device path below; elsewhere, and when recording
  // fails, steps run op by op.
  bool op_graphs = true;
  // MoE layers whose experts run grouped (the backend SupportsOp(kGroupedLinear) and kMoeCombine)
  // on one rank with no remote experts read the experts' row offsets where MoeRoute leaves them,
  // on the device, in steps of at most Backend::MaxDeviceGroupRows(expert dtype) tokens: no host
  // copy and no wait mid-step, so such decode steps can be recorded. The per-expert token counts
  // (StepObserver::OnExpertTokens) are then read with one copy after the step. false: the host
  // copy of the offsets in every step (tests compare the two paths).
  bool moe_device_offsets = true;
  // Tests only: sample StepSequence::sampling rows with the backend's SampleRows on CPU ranks too
  // (normally only device ranks do, where it saves copying logits rows to the host), so that CPU
  // tests cover the engine's side of device sampling.
  bool sample_rows_on_cpu_for_test = false;
  // kInt8: the linear projections and the lm_head (not embeddings, norms or routers) are quantized
  // at load into the backend's int8 format (DType::kQ8), where it SupportsOp(kLinear, kQ8); on
  // other backends the matrices keep their usual dtype.
  Quantization quantize = Quantization::kNone;
  // kFp8E4M3: the KV cache holds float8 e4m3 codes (KvCacheDType); Create refuses it with
  // InvalidArgument for multi-head latent attention and on a backend whose KvWrite and Attention
  // do not take it.
  KvCacheFormat kv_cache = KvCacheFormat::kAuto;
  // Told after each layer's weights are loaded (layers done of the range, bytes held so far), for
  // a progress line; called on the loading thread. Optional.
  std::function<void(int64_t layers_done, int64_t layers_total, size_t bytes)> on_load_progress;
};

// The block table of sequence `seq` when the cache is cut into whole-context pieces: blocks
// [seq * n, (seq + 1) * n) with n = ceil(max_seq_len / kv_block_size). For callers that run a few
// sequences at fixed places (tests, benchmarks); `resolved` must have max_seq_len resolved (as
// StepRunner::options() returns it). The ids are in range only for seq < num_kv_blocks / n.
inline std::vector<int32_t> WholeContextBlocks(const ModelOptions& resolved, int32_t seq) {
  const int64_t n = (resolved.max_seq_len + resolved.kv_block_size - 1) / resolved.kv_block_size;
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) ids[static_cast<size_t>(j)] = static_cast<int32_t>(seq * n + j);
  return ids;
}

// Step errors after which every tensor-parallel rank is still in step — the ranks ran the whole
// step (or none of it), so the group can take the next batch: InvalidArgument (a batch rejected
// before any work) and errors marked with MarkGroupIntact (e.g. a remote expert call that failed
// while the ranks finished the step). Other errors break the group.
absl::Status MarkGroupIntact(absl::Status status);
bool IsGroupIntact(const absl::Status& status);

class StepRunner {
 public:
  virtual ~StepRunner() = default;
  // Runs one step; see Model::Step for the contract and errors. `hidden_in` is [total new
  // tokens, hidden] for stages without the embedding, and empty otherwise.
  virtual absl::StatusOr<StepResult> Step(const std::vector<StepSequence>& batch,
                                          absl::Span<const float> hidden_in = {}) = 0;
  virtual const ModelSpec& spec() const = 0;
  // The options in force (max_seq_len and num_kv_blocks resolved).
  virtual const ModelOptions& options() const = 0;
};

// Multi-step decoding: runs `steps` (>= 1) decode steps of `batch` on `runner`, which must hold
// both the embedding and the last layer. Every sequence decodes one given token (tokens.size() ==
// 1, not all_logits) and its block_ids must cover pos_begin + steps positions. After step j,
// `pick(i, j, result)` gives the id of sequence i at that step from the step's result (its
// sampled_ids entry, or its logits row, which the caller samples with sample index base + j); step
// j + 1 then decodes that id at the next position. A sequence's `sampling` (device draws) moves on
// with the steps: its `step` is the original plus j at step j. Returns the ids sequence by
// sequence: ids[i * steps + j]. InvalidArgument for a batch that breaks these rules; otherwise the
// runner's errors (the cache then holds whatever the steps before wrote).
using PickToken = std::function<int32_t(size_t sequence, int32_t step, const StepResult& result)>;
absl::StatusOr<std::vector<int32_t>> RunDecodeSteps(StepRunner& runner, std::vector<StepSequence> batch,
                                                    int32_t steps, const PickToken& pick);

}  // namespace shardserve::engine

#endif  // SHARDSERVE_WORKER_ENGINE_STEP_RUNNER_H_

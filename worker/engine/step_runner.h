// StepRunner: whatever runs a model step for a batch of sequences — one Model on one rank, or a
// group of tensor-parallel ranks (TpExecutor). Generation and, later, pipeline stages are written
// against this interface.
#ifndef SHARDSERVE_WORKER_ENGINE_STEP_RUNNER_H_
#define SHARDSERVE_WORKER_ENGINE_STEP_RUNNER_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/model_spec/model_spec.h"

namespace shardserve::comm {
class Communicator;
}

namespace shardserve::engine {

struct StepSequence {
  int32_t slot = 0;
  int32_t pos_begin = 0;         // the sequence's current length in the cache
  std::vector<int32_t> tokens;   // new tokens (a stage with the embedding needs them)
  int32_t num_tokens = 0;        // new tokens when `tokens` is empty (stages after the first)
  bool all_logits = false;       // logits for every new token, not only the last
  int32_t NumTokens() const { return tokens.empty() ? num_tokens : static_cast<int32_t>(tokens.size()); }
};

struct StepResult {
  // Last stage: per sequence, in request order, [rows, vocab] row-major, rows = NumTokens() or 1.
  std::vector<std::vector<float>> logits;
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
  int64_t max_slots = 8;          // sequences that can hold KV state at once
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
  // Optional metrics sink (not owned).
  StepObserver* observer = nullptr;
};

class StepRunner {
 public:
  virtual ~StepRunner() = default;
  // Runs one step; see Model::Step for the contract and errors. `hidden_in` is [total new
  // tokens, hidden] for stages without the embedding, and empty otherwise.
  virtual absl::StatusOr<StepResult> Step(const std::vector<StepSequence>& batch,
                                          absl::Span<const float> hidden_in = {}) = 0;
  virtual const ModelSpec& spec() const = 0;
  // The options in force (max_seq_len resolved).
  virtual const ModelOptions& options() const = 0;
};

}  // namespace shardserve::engine

#endif  // SHARDSERVE_WORKER_ENGINE_STEP_RUNNER_H_

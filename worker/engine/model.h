// Model: one rank's forward pass over a batch of sequences, with a paged KV cache.
//
// The cache is num_kv_blocks blocks of kv_block_size tokens per layer; the caller allocates them
// to sequences (the Model only indexes them). A step takes, for each sequence, its block table,
// the position of its first new token and the new tokens (a prefill chunk or one decode token); sequences of different lengths share one
// batch. Matrix products run over all the batch's tokens at once; attention runs per sequence.
// The step returns f32 logits on the host for the last new token of each sequence, or for all of
// its new tokens when asked; or only the token id for a greedy sequence (the backend's ArgmaxRows)
// and, on a single rank of a device backend, for a sequence with plain sampling parameters (the
// backend's SampleRows; StepSequence::sampling).
//
// Tensor parallelism (Megatron): each rank's Model holds its ShardLayout's slice; the ranks meet in
// an all-reduce after attention and after the MLP/MoE, and gather the vocab-parallel logits.
//
// Thread-safety: a Model is used by one thread at a time (the rank thread that owns its backend).
#ifndef SHARDSERVE_WORKER_ENGINE_MODEL_H_
#define SHARDSERVE_WORKER_ENGINE_MODEL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_spec/model_spec.h"
#include "common/plan/memory_model.h"
#include "common/safetensors/safetensors.h"
#include "worker/engine/step_runner.h"
#include "worker/engine/weights.h"
#include "worker/kernels/backend.h"

namespace shardserve::engine {

// The element type of the KV cache a Model keeps for `spec` on `backend`. kAuto: the checkpoint's
// bf16 or f16 (config.json's dtype) where the backend's KvWrite and Attention take it (half the
// memory of f32, as vLLM's kv_cache_dtype "auto"), else f32. kFp8E4M3: kF8E4M3 (a quarter of f32);
// InvalidArgument for multi-head latent attention (its latent cache is not FP8 yet) and where the
// backend's KvWrite or Attention does not take it. Thread-safe.
absl::StatusOr<DType> KvCacheDType(const ModelSpec& spec, const kernels::Backend& backend,
                                   KvCacheFormat format = KvCacheFormat::kAuto);

// The formats (common/plan/memory_model.h) a Model keeps `spec`'s weights and KV cache in on
// `backend` with `quantize`: the loader's KeptWeightDType / KeptEmbeddingDType for the checkpoint's
// dtype (config.json's; f32 when absent; F8_E4M3 for the matrices of an FP8 checkpoint), kQ8
// matrices where quantizing and the backend takes them, and KvCacheDType for `kv_cache` (f32's
// 4 bytes where KvCacheDType refuses it: Create reports that error). Thread-safe.
WeightFormats EngineWeightFormats(const ModelSpec& spec, const kernels::Backend& backend, Quantization quantize,
                                  KvCacheFormat kv_cache = KvCacheFormat::kAuto);

// The gated MLP activation of `spec`'s MLPs and experts, as the kernels name it.
kernels::GateActivation GateActivationOf(const ModelSpec& spec);

class Model final : public StepRunner {
 public:
  // Loads the rank's weights and allocates its KV cache and workspace on `backend`, which must
  // outlive the Model. Errors: InvalidArgument for options or a checkpoint that disagrees with the
  // spec, ResourceExhausted when memory runs out.
  static absl::StatusOr<std::unique_ptr<Model>> Create(const ModelSpec& spec, const Checkpoint& ckpt,
                                                       kernels::Backend* backend, const ModelOptions& options);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  // Runs one step. InvalidArgument (naming the sequence) for an empty token list, a token id
  // outside the vocabulary, a block table too short for the positions or with a block id outside
  // [0, num_kv_blocks), a block written by two sequences of the step (or twice by one), positions
  // past max_seq_len, more
  // than max_step_tokens tokens in all, or hidden states of the wrong size (or given to the
  // first stage). Nothing is written to the cache when validation fails.
  //
  // With tensor parallelism every rank of the group calls Step with the same batch; rank 0 returns
  // the logits, other ranks return empty logits vectors.
  absl::StatusOr<StepResult> Step(const std::vector<StepSequence>& batch,
                                  absl::Span<const float> hidden_in = {}) override;

  const ModelSpec& spec() const override { return spec_; }
  const ModelOptions& options() const override { return options_; }
  const ShardLayout& layout() const { return layout_; }
  // Device bytes of weights and of KV cache held by this rank, as allocated (measured).
  size_t weight_bytes() const { return weights_.bytes; }
  size_t kv_cache_bytes() const { return kv_bytes_; }
  // What the memory model (common/plan/memory_model.h) says this rank holds, with its formats
  // (EngineWeightFormats); the KV cache is sized from it: memory().KvBytes(num_kv_blocks,
  // kv_block_size) bytes. Equal to the measured bytes above (memory_model_test).
  const RankMemory& memory() const { return memory_; }
  // Steps that ran as a replayed graph so far (tests and benchmarks).
  int64_t graph_replays() const { return graph_replays_; }

 private:
  struct Workspace;
  Model(const ModelSpec& spec, const ModelOptions& options, kernels::Backend* backend);
  absl::Status Validate(const std::vector<StepSequence>& batch, absl::Span<const float> hidden_in);
  // Step after validation.
  absl::StatusOr<StepResult> Run(const std::vector<StepSequence>& batch, absl::Span<const float> hidden_in);
  bool first_stage() const { return options_.layer_begin == 0; }
  bool last_stage() const { return options_.layer_end == spec_.num_layers; }
  absl::Status Layer(int64_t layer, int64_t tokens, const kernels::PagedSeqs& paged);
  // A layer's attention from ws_->normed to ws_->attn (the o projection's input): grouped-query
  // attention over the K/V cache, or multi-head latent attention over the latent cache.
  // `input_norm` set: from ws_->hidden instead, the layer's input norm fused into the q/k/v products
  // (LinearGroupParams::norm; ws_->normed is its scratch, left unspecified).
  absl::Status GqaAttention(int64_t layer, const LayerWeights& lw, int64_t tokens, const kernels::PagedSeqs& paged,
                            std::optional<kernels::LinearGroupParams::Norm> input_norm = std::nullopt);
  // Gemma-2's layer: norms before and after both the attention and the MLP (sandwich_norms).
  absl::Status SandwichLayer(int64_t layer, const LayerWeights& lw, int64_t tokens, const kernels::PagedSeqs& paged);
  // RoPE on ws_->q and ws_->k (longrope: each sequence's new tokens with the short or the long
  // frequencies, by its length at the end of the step).
  absl::Status RopeQk(int64_t layer, int64_t tokens, const kernels::PagedSeqs& paged);
  // The Rope op of a layer on ws_->q and ws_->k with the step's positions (LongRoPE: the short
  // frequencies; RopeQk swaps in the long ones per run). GqaAttention hands it to KvWrite when RoPE
  // and the cache write can run as one op.
  kernels::RopeParams RopeFor(int64_t layer, int64_t tokens) const;
  absl::Status MlaAttention(int64_t layer, const LayerWeights& lw, int64_t tokens, const kernels::PagedSeqs& paged);
  // The Attention op of layer `layer` for a step of `tokens` tokens (Layer runs it; graph keys ask
  // the backend how it would launch).
  kernels::AttentionParams AttentionFor(int64_t layer, int64_t tokens, const kernels::PagedSeqs& paged) const;
  // The embedding (first stage) and every layer: what a graph records.
  absl::Status Forward(int64_t tokens, const kernels::PagedSeqs& paged);
  // Forward through a recorded graph when the step qualifies (ModelOptions::op_graphs), else op by op.
  absl::Status ForwardMaybeRecorded(int64_t tokens, const kernels::PagedSeqs& paged, bool decode_only);
  // y (+)= the gated MLP of x: down(act(x . gate^T) * (x . up^T)), the gate and up products and the
  // activation as one gated LinearGroup (ws_->gate holds the product, ws_->up is its scratch).
  // `norm` set: of RmsNorm(x) instead, the norm fused into the gate and up products.
  absl::Status Mlp(const MlpWeights& w, const float* x, float* y, int64_t tokens, bool accumulate,
                   std::optional<kernels::LinearGroupParams::Norm> norm = std::nullopt);
  absl::Status Moe(const LayerWeights& w, int64_t tokens, float* out);
  // The local experts' share and the shared expert; rows of expert e are [offset[e], offset[e+1]).
  absl::Status LocalExperts(const LayerWeights& w, int64_t tokens, const std::vector<int32_t>& offset, float* out);
  // The shared expert's share (none without one).
  absl::Status SharedExpert(const LayerWeights& w, int64_t tokens, float* out);
  // The local experts' share as grouped products (grouped_experts_): every routed row gathered
  // once, the gate, up and down projections of all local experts one GroupedLinear each, then the
  // rows added back to their tokens: one MoeCombine where the backend SupportsOp it, else a
  // ScatterAddRows per expert (whose rows must be distinct); the same sums either way. The groups
  // come from the host copy of the offsets (`offset`), or, on the device path, from the offsets
  // left on the device (`device_offsets`, with `offset` null): the device-offsets form of the ops.
  absl::Status GroupedExperts(const LayerWeights& w, int64_t tokens, const std::vector<int32_t>* offset,
                              const int32_t* device_offsets, float* out);
  // Whether a step of `tokens` tokens takes the device path of MoE layers (moe_device_rows_).
  bool MoeOnDevice(int64_t tokens) const { return tokens > 0 && tokens <= moe_device_rows_; }
  // Builds the device path's held-expert tables (Workspace::held), once at load.
  absl::Status BuildHeldExperts();
  // After a device-path step: the layers' offsets copied to the host once, and each layer's
  // expert-token counts told to the observer (as the host path tells them during the step).
  absl::Status ReportDeviceExpertTokens();
  // Sums `data` over the tensor-parallel group (no-op for one rank).
  absl::Status AllReduce(float* data, int64_t count);
  bool tp() const { return options_.shard.size > 1; }

  const ModelSpec spec_;
  const ModelOptions options_;
  kernels::Backend* const backend_;  // not owned
  ShardLayout layout_;
  DType kv_dtype_ = DType::kF32;  // of k_cache_ and v_cache_
  // Tensor parallel: a layer's all-reduced output [tokens, hidden] not yet added to the residual
  // stream; the next layer adds it in its first norm (AddRmsNorm), Forward after the last layer.
  const float* pending_residual_ = nullptr;
  // The communicator orders its collectives on the backend's stream (NCCL): no host
  // synchronization before them.
  bool comm_on_stream_ = false;
  // The backend SupportsOp(kGroupedLinear) for the local experts' weights (one dtype, no biases):
  // GroupedExperts instead of LocalExperts' Linear per expert (CUDA; the CPU keeps the loop).
  bool grouped_experts_ = false;
  // The device path of MoE layers (ModelOptions::moe_device_offsets): steps of at most this many
  // tokens route without copying the offsets to the host (MoeRoute's host_offsets null) and run the
  // grouped experts' device-offsets form; 0 = never (several ranks, remote experts, no grouped
  // experts or combine, or a backend without the form for the experts' dtype).
  int64_t moe_device_rows_ = 0;
  ModelWeights weights_;
  RankMemory memory_;
  // Per layer; multi-head latent attention keeps its latent cache in k_cache_ (v_cache_ empty).
  std::vector<kernels::DeviceBuffer> k_cache_, v_cache_;
  size_t kv_bytes_ = 0;
  std::unique_ptr<Workspace> ws_;
  // A failure the step ran on through (a remote expert call), reported when the step ends.
  absl::Status deferred_;
  // Recorded decode steps by (tokens, the backend's attention shape key). Dropped when a buffer
  // they read moves (the block tables grow) or the backend replaced its scratch; recording is
  // switched off for good after a failed recording.
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<kernels::OpGraph>> graphs_;
  bool graphs_off_ = false;
  int64_t graph_replays_ = 0;
};

}  // namespace shardserve::engine

#endif  // SHARDSERVE_WORKER_ENGINE_MODEL_H_

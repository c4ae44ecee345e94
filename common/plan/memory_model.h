// The memory model: the bytes one tensor-parallel rank of a pipeline stage holds, for a ModelSpec,
// a layer range, tp, an expert placement and the formats the rank keeps its tensors in. The one
// place that knows the per-rank memory layout: the planner (coordinator/planner) sizes stages and
// KV budgets with it, and the engine (worker/engine) sizes its KV cache and predicts its weight
// bytes with it. What the engine actually allocates is measured separately (Model::weight_bytes,
// kv_cache_bytes), and tests/worker/engine/memory_model_test.cc holds the two equal, byte for byte,
// for every weight format the workers support, dense and MoE models, tp 1 and 2, expert parallel
// and split experts, and pipeline stages.
//
// ---- What a rank holds -------------------------------------------------------------------------
// As the engine's ShardLayout / LoadWeights (worker/engine/weights.h) lay it out (Megatron):
//  - attention: q/k/v split by heads (KV heads replicated when tp > num_key_value_heads), o by its
//    head columns; the input and post-attention norms (and Gemma-2's two sandwich norms, Qwen3's
//    per-head q/k norms) replicated; q/k/v biases split with their rows, the o_proj bias on rank 0;
//  - multi-head latent attention (DeepSeek-V2/V3): q_a_proj, kv_a_proj_with_mqa (its latent and
//    RoPE rows) and their norms replicated; q_b_proj (or q_proj) and kv_b_proj split by heads,
//    o_proj by its head columns; kv_b_proj is kept per head for HeadLinear at
//    WeightFormats::head_linear_bytes (never int8);
//  - dense MLP: gate/up split by rows, down by columns (intermediate_size / tp each), the gate/up
//    biases split, the down_proj bias on rank 0 (Phi-3's fused gate_up_proj has none);
//  - MoE layer: the router (and DeepSeek-V3's score-correction bias) replicated in f32; the shared
//    expert split like a dense MLP, its gate (Qwen2-MoE) replicated in f32; routed experts whole
//    on the rank that owns them when expert parallel (num_experts >= tp > 1, unless split), else
//    every local expert split over all ranks (1/tp of its width on each);
//  - the first stage: the whole embedding [vocab, hidden] on every rank; the last stage: the final
//    norm and the vocab-parallel lm_head, ceil(vocab / tp) rows per rank (zero-padded). A tied
//    lm_head on one rank (tie_word_embeddings, tp = 1) is the embedding table itself: the last
//    stage then holds the table (once, even when it is also the first stage), at
//    WeightFormats::tied_embedding_bytes, and no lm_head matrix;
//  - norms, biases, routers: f32 (4 bytes) whatever the checkpoint;
//  - KV cache per layer and token: ModelSpec::KvValuesPerToken(tp) elements (K and V of the local
//    KV heads, or the MLA latent + RoPE key, shared by all heads and held whole by every rank) at
//    WeightFormats::kv_bytes; a paged block holds block_size tokens of every layer of the stage.
// A projection matrix [rows, cols] takes rows x cols x matrix_bytes, or Q8MatrixBytes(rows, cols)
// (common/tensor/dtype.h) when int8, plus Fp8ScaleBytes when fp8 (on CUDA, at matrix_bytes = 1).
//
// Pure functions on plain values; thread-safe. Inputs are trusted: callers validate the spec and
// tp first (ValidateTensorParallelSize, common/plan/plan.h); a tp that does not divide the model
// gives meaningless figures, not an error.
#ifndef SHARDSERVE_COMMON_PLAN_MEMORY_MODEL_H_
#define SHARDSERVE_COMMON_PLAN_MEMORY_MODEL_H_

#include <cstdint>
#include <map>

#include "common/model_spec/model_spec.h"
#include "common/tensor/dtype.h"

namespace shardserve {

// The formats a rank keeps its tensors in, as bytes per element.
struct WeightFormats {
  // Projection matrices (attention, MLP, experts, shared expert) and the lm_head, unless int8.
  int64_t matrix_bytes = 4;
  // Projections and the lm_head stored as DType::kQ8: Q8MatrixBytes each (not the embedding,
  // norms, routers, the shared-expert gate or MLA's kv_b_proj).
  bool int8 = false;
  // The embedding table when it is only an embedding, and when it is also a tied lm_head (the
  // engine then keeps a dtype both the embedding lookup and the matrix product take).
  int64_t embedding_bytes = 4;
  int64_t tied_embedding_bytes = 4;
  // MLA's kv_b_proj, kept per head for the HeadLinear op.
  int64_t head_linear_bytes = 4;
  // One KV cache element.
  int64_t kv_bytes = 4;
  // An FP8 checkpoint (ModelSpec::fp8) on a backend that keeps F8_E4M3 matrices (CUDA): each
  // projection (and the lm_head, unless modules_to_not_convert names it) at matrix_bytes (1: the
  // codes) per weight plus the f32 scale blocks its slice overlaps (Fp8ScaleBytes); block sizes 0
  // for one per-tensor scale. Matrices whose rows the loader picks one by one (the q/k rows of
  // interleaved-RoPE heads, MLA's query and RoPE-key rows) are dequantized instead, and an lm_head
  // left unconverted is in the checkpoint's 16-bit dtype: both at dequantized_bytes.
  bool fp8 = false;
  int64_t fp8_block_rows = 0, fp8_block_cols = 0;
  int64_t dequantized_bytes = 2;
  // An MXFP4 checkpoint (ModelSpec::mxfp4) on a backend that keeps its experts as MXFP4 (int8 or
  // not): each routed expert matrix at Mxfp4MatrixBytes (common/tensor/dtype.h) when its slice's
  // columns are whole 32-column scale blocks (gate and up always; down when the rank's width and
  // its first column are multiples of 32), else as any projection (matrix_bytes, or int8).
  bool mxfp4_experts = false;
  bool operator==(const WeightFormats&) const = default;
};

// The formats a worker keeps `spec`'s checkpoint in on CPU ranks (`cuda` false) or CUDA devices,
// by each backend's SupportsOp (worker/kernels): the checkpoint's dtype (config.json's; f32 when
// absent) where the backend's op takes it, else f32. CPU: bf16 matrices and HeadLinear stay bf16,
// f16 ones are widened to f32; the embedding keeps bf16 or f16 (rows are widened on lookup) except
// as a tied f16 lm_head (f32); the KV cache is f32. CUDA: bf16 and f16 stay as they are, for the KV
// cache too (multi-head latent attention, which does not run on CUDA yet, is counted the same
// way). FP8 matrices (ModelSpec::fp8) stay F8_E4M3 with their scales on CUDA (WeightFormats::fp8)
// and are dequantized to bf16 on CPU ranks (and for CUDA's picked-row matrices). `quantize` =
// kInt8 gives int8 matrices on CPU ranks only (CUDA does not take kQ8). MXFP4 experts stay MXFP4 on
// both backends, int8 or not (WeightFormats::mxfp4_experts).
// The engine's own choice (worker/engine's EngineWeightFormats) is tested equal for CPU ranks.
WeightFormats WorkerWeightFormats(const ModelSpec& spec, bool cuda, Quantization quantize);
// The same with the KV cache `kv_cache` asks for: kFp8E4M3 gives kv_bytes = 1 (but for multi-head
// latent attention, which the engine refuses it for). Tested equal to EngineWeightFormats too.
WeightFormats WorkerWeightFormats(const ModelSpec& spec, bool cuda, Quantization quantize, KvCacheFormat kv_cache);

// Bytes of one [rows, cols] projection matrix in `formats`: the slice of the checkpoint's matrix
// whose first element is (row0, col0) there (only FP8 scale grids depend on where a slice starts).
int64_t ProjectionBytes(const WeightFormats& formats, int64_t rows, int64_t cols, int64_t row0 = 0, int64_t col0 = 0);

// Bytes of the scales of an F8_E4M3 slice [rows, cols] starting at (row0, col0) of its matrix, as a
// backend keeps them beside its rows x cols codes: 4 per scale block the slice overlaps (block
// sizes 0: one per-tensor scale). Zero rows or columns: 0.
int64_t Fp8ScaleBytes(int64_t rows, int64_t cols, int64_t row0, int64_t col0, int64_t block_rows, int64_t block_cols);

// Whether `tp` ranks hold each routed expert whole on one rank (as ShardLayout::expert_parallel):
// a MoE model with num_experts >= tp > 1, unless the experts are split on purpose.
bool IsExpertParallel(const ModelSpec& spec, int tp, bool split_experts = false);

// Routed experts rank `rank` of `tp` holds in a MoE layer by default: with expert parallelism the
// balanced contiguous blocks (expert e on rank floor(e x tp / num_experts)), else all of them (each
// split over the ranks).
int64_t DefaultLocalExperts(const ModelSpec& spec, int tp, int rank, bool expert_parallel);

// One rank of a stage: layers [layer_begin, layer_end) on rank `rank` of `tp`.
struct RankShard {
  int64_t layer_begin = 0;
  int64_t layer_end = 0;
  bool has_embedding = false;  // the first stage (layer_begin = 0)
  bool has_lm_head = false;    // the last stage: final norm and lm_head (layer_end = num_layers)
  int tp = 1;
  int rank = 0;
  bool expert_parallel = false;  // IsExpertParallel(spec, tp, split)
  // Routed experts this rank holds in MoE layer l (whole when expert_parallel, else its slice of
  // each), for the layers whose placement is not the default (expert spill, an explicit owner
  // list); a MoE layer of the range not listed holds DefaultLocalExperts.
  std::map<int64_t, int64_t> local_experts;
};

// The bytes of one layer on one rank, apart from its routed experts' count.
struct LayerRankBytes {
  int64_t matrices = 0;  // attention, dense MLP and shared-expert projections
  int64_t f32 = 0;       // norms, biases, router, score-correction bias, shared-expert gate
  int64_t expert = 0;    // one local routed expert (whole, or its 1/tp slice); 0 for a dense layer
};
LayerRankBytes LayerBytes(const ModelSpec& spec, int64_t layer, int tp, int rank, bool expert_parallel,
                          const WeightFormats& formats);

// One whole routed expert (gate, up and down of expert_intermediate_size), as an expert host keeps
// each expert it serves; 0 for a dense model.
int64_t WholeExpertBytes(const ModelSpec& spec, const WeightFormats& formats);

// The embedding, final norm and lm_head a stage's rank holds (see "What a rank holds").
struct EndBytes {
  int64_t embedding = 0;
  int64_t final_norm = 0;
  int64_t lm_head = 0;
};
// `rank`: the rank of `tp` (where its lm_head slice starts matters to FP8 scale grids only).
EndBytes StageEndBytes(const ModelSpec& spec, bool has_embedding, bool has_lm_head, int tp,
                       const WeightFormats& formats, int rank = 0);

// KV cache bytes of one token in one layer on a rank of `tp`, and of one paged block of
// `block_size` tokens in `layers` layers.
int64_t KvBytesPerTokenLayer(const ModelSpec& spec, int tp, const WeightFormats& formats);
int64_t KvBytesPerBlock(const ModelSpec& spec, int64_t layers, int tp, int64_t block_size,
                        const WeightFormats& formats);

// Everything one rank of a stage holds, broken down.
struct RankMemory {
  int64_t matrices = 0;      // the layers' projections without routed experts
  int64_t experts = 0;       // the local routed experts
  int64_t norms_biases = 0;  // f32 tensors: norms (the final norm too), biases, routers
  int64_t embedding = 0;
  int64_t lm_head = 0;
  int64_t kv_bytes_per_token = 0;  // over the stage's layers
  int64_t Weights() const { return matrices + experts + norms_biases + embedding + lm_head; }
  int64_t KvBytes(int64_t blocks, int64_t block_size) const { return blocks * block_size * kv_bytes_per_token; }
};
RankMemory RankMemoryOf(const ModelSpec& spec, const RankShard& shard, const WeightFormats& formats);

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_PLAN_MEMORY_MODEL_H_

#include "worker/engine/model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numbers>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status/macros.h"
#include "worker/comm/communicator.h"
#include "worker/engine/remote_experts.h"
#include "worker/kernels/shared/moe_routing.h"
#include "worker/kernels/shared/row_math.h"

namespace shardserve::engine {

using kernels::AttnSeq;
using kernels::DeviceBuffer;

// Step-sized device buffers, allocated once for max_step_tokens.
struct Model::Workspace {
  DeviceBuffer hidden, normed, q, k, v, attn, tmp, gate, up;  // activations
  DeviceBuffer ids, positions, seqs, inv_freq;                  // inputs
  DeviceBuffer inv_freq_long;  // longrope: the long factors' frequencies (inv_freq: the short ones)
  DeviceBuffer tables;        // the step's block tables, concatenated; grown on demand
  size_t tables_capacity = 0;  // int32 entries that `tables` holds
  DeviceBuffer router, moe_x, moe_y, moe_rows, moe_scales, moe_offsets, shared_gate;
  // Model::GroupedExperts: every routed row [max_step_tokens x top_k] of the input (then the down
  // projection's output), and of the gate and up projections.
  DeviceBuffer grouped_x, grouped_gate, grouped_up;
  std::vector<kernels::GroupedLinearParams::Group> h_gate_groups, h_up_groups, h_down_groups;
  DeviceBuffer logit_rows, selected, logits, gathered, argmax;
  DeviceBuffer sampling;  // [max_step_tokens] RowSamplingParams of the rows SampleRows draws
  std::vector<kernels::RowSamplingParams> h_sampling;
  // Llama-4: 1.0f values (the weight of the weightless q/k norm, and the unit scales of experts
  // whose routing weight scaled their input), and the query scale of each token on NoPE layers.
  DeviceBuffer ones, query_temp;
  float position_scale = 1.0f;
  // Per model layer, its own RoPE table and position scale when it rotates with another RoPE than
  // the model's (ModelSpec::sliding_rope, Gemma-3; ModelSpec::layer_rope_theta, GraniteSWA); an
  // empty buffer otherwise.
  std::vector<DeviceBuffer> inv_freq_layer;
  std::vector<float> position_scale_layer;
  // Host staging.
  std::vector<int32_t> h_ids, h_pos, h_rows;
  std::vector<AttnSeq> h_seqs;
  std::vector<int32_t> h_tables;
  std::vector<float> h_query_temp;
  std::vector<int32_t> h_argmax;
  std::vector<int32_t> h_moe_offsets;  // MoeRoute's host copy of the expert offsets [experts + 1]
  // The device path of MoE layers (Model::moe_device_rows_): per local layer, the experts held
  // (ascending) and their gate, up and down matrices, with the device copies of both lists (ids
  // [held]; weights [3, held]: gate, up, down), built once at load. Empty for dense layers.
  struct HeldExperts {
    std::vector<int32_t> ids;
    std::vector<kernels::WeightView> gate, up, down;
    DeviceBuffer d_ids, d_weights;
  };
  std::vector<HeldExperts> held;
  std::vector<int32_t> h_step_offsets;  // every local layer's offsets, read after a device-path step
  // Validate's scratch: (block, sequence) of every block the step writes.
  std::vector<std::pair<int32_t, int32_t>> h_written;
  // Remote experts (rank 0 of a stage with expert spill): the rows sent and the answers.
  DeviceBuffer remote_x;  // [max_step_tokens x top_k, hidden]
  // Multi-head latent attention: the query's compressed form, its nope and RoPE parts, the
  // absorbed query, the new latent and RoPE-key rows, and the attention's latent output.
  DeviceBuffer mla_qa, mla_q_nope, mla_q_rope, mla_q_latent, mla_latent, mla_k_rope, mla_out;
  std::vector<float> h_remote_x, h_remote_y;
  std::vector<ExpertRows> h_remote_groups;
};

namespace {

// Whether the local experts of every MoE layer can run as grouped products on `backend`: their
// matrices share one dtype the backend SupportsOp(kGroupedLinear, ...), and none has a bias
// (GroupedLinear adds none). Sets *experts_dtype to that dtype.
bool GroupsExperts(const ModelWeights& weights, const ShardLayout& layout, const kernels::Backend& backend,
                   DType* experts_dtype) {
  bool any = false;
  DType& dtype = *experts_dtype;
  dtype = DType::kF32;
  for (const LayerWeights& lw : weights.layers) {
    for (size_t e = 0; e < lw.experts.size(); ++e) {
      if (!lw.IsLocalExpert(static_cast<int64_t>(e), layout)) continue;
      for (const LinearWeight* lin : {&lw.experts[e].gate, &lw.experts[e].up, &lw.experts[e].down}) {
        if (lin->bias() != nullptr || (any && lin->dtype != dtype)) return false;
        dtype = lin->dtype;
        any = true;
      }
    }
  }
  return any && backend.SupportsOp(kernels::Op::kGroupedLinear, dtype);
}

// The routing rule of a MoE spec, as the MoeRoute op takes it (the spec was validated at load).
kernels::MoeRouting MoeRoutingOf(const MoeSpec& ms) {
  kernels::MoeRouteScoring scoring = kernels::MoeRouteScoring::kSoftmaxTopK;
  switch (ms.scoring) {
    case MoeScoring::kSoftmax: scoring = kernels::MoeRouteScoring::kSoftmaxTopK; break;
    case MoeScoring::kSigmoidGrouped: scoring = kernels::MoeRouteScoring::kSigmoidGrouped; break;
    case MoeScoring::kSoftmaxGroupLimited: scoring = kernels::MoeRouteScoring::kSoftmaxGroupLimited; break;
    case MoeScoring::kSigmoidInput: scoring = kernels::MoeRouteScoring::kSigmoidTopK; break;
  }
  return {.scoring = scoring,
          .num_experts = static_cast<int32_t>(ms.num_experts),
          .top_k = static_cast<int32_t>(ms.top_k),
          .n_group = static_cast<int32_t>(ms.n_group),
          .topk_group = static_cast<int32_t>(ms.topk_group),
          .renormalize = ms.norm_topk_prob,
          .scaling = static_cast<float>(ms.routed_scaling_factor)};
}

// RoPE inverse frequencies (f32, as transformers computes them) over the rotated dims, with llama3,
// yarn or longrope (its long factors when `long_factors`, else the short ones) scaling applied.
std::vector<float> InvFreq(const ModelSpec& spec, float* position_scale, bool long_factors = false) {
  const int64_t d = spec.RotaryDim();
  std::vector<float> inv(static_cast<size_t>(d / 2));
  for (int64_t i = 0; i < d / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(d);
    inv[static_cast<size_t>(i)] = 1.0f / std::pow(static_cast<float>(spec.rope.theta), exponent);
  }
  *position_scale = 1.0f;
  switch (spec.rope.type) {
    case RopeType::kDefault:
      break;
    case RopeType::kLinear:
      *position_scale = static_cast<float>(1.0 / spec.rope.factor);
      break;
    case RopeType::kLongrope: {
      const std::vector<float>& ext = long_factors ? spec.rope.long_factor : spec.rope.short_factor;
      for (int64_t i = 0; i < d / 2; ++i) {
        const float exponent = static_cast<float>(2 * i) / static_cast<float>(d);
        inv[static_cast<size_t>(i)] =
            1.0f / (ext[static_cast<size_t>(i)] * std::pow(static_cast<float>(spec.rope.theta), exponent));
      }
      break;
    }
    case RopeType::kYarn: {
      // transformers' _compute_yarn_parameters: float32 tensors, the correction range in double.
      const double base = spec.rope.theta;
      const double orig = static_cast<double>(spec.rope.original_max_position_embeddings);
      auto correction_dim = [&](double rotations) {
        return (static_cast<double>(d) * std::log(orig / (rotations * 2.0 * std::numbers::pi))) / (2.0 * std::log(base));
      };
      double low = correction_dim(spec.rope.beta_fast);
      double high = correction_dim(spec.rope.beta_slow);
      if (spec.rope.truncate) {
        low = std::floor(low);
        high = std::ceil(high);
      }
      low = std::max(low, 0.0);
      high = std::min(high, static_cast<double>(d - 1));
      if (low == high) high += 0.001;
      const float factor = static_cast<float>(spec.rope.factor);
      for (int64_t i = 0; i < d / 2; ++i) {
        const float exponent = static_cast<float>(2 * i) / static_cast<float>(d);
        const float pos_freq = std::pow(static_cast<float>(spec.rope.theta), exponent);
        const float extrapolation = 1.0f / pos_freq;
        const float interpolation = 1.0f / (factor * pos_freq);
        const float ramp = std::clamp(
            (static_cast<float>(i) - static_cast<float>(low)) / static_cast<float>(high - low), 0.0f, 1.0f);
        const float extrapolation_factor = 1.0f - ramp;
        inv[static_cast<size_t>(i)] =
            interpolation * (1.0f - extrapolation_factor) + extrapolation * extrapolation_factor;
      }
      break;
    }
    case RopeType::kLlama3: {
      const double factor = spec.rope.factor;
      const double old_len = static_cast<double>(spec.rope.original_max_position_embeddings);
      const double low_wavelen = old_len / spec.rope.low_freq_factor;
      const double high_wavelen = old_len / spec.rope.high_freq_factor;
      for (float& f : inv) {
        const double wavelen = 2.0 * std::numbers::pi / f;
        if (wavelen > low_wavelen) {
          f = static_cast<float>(f / factor);
        } else if (wavelen >= high_wavelen && spec.rope.high_freq_factor > spec.rope.low_freq_factor) {
          const double smooth = (old_len / wavelen - spec.rope.low_freq_factor) /
                                (spec.rope.high_freq_factor - spec.rope.low_freq_factor);
          f = static_cast<float>((1.0 - smooth) * f / factor + smooth * f);
        }
      }
      break;
    }
  }
  return inv;
}

absl::Status Alloc(kernels::Backend& b, DeviceBuffer* buf, size_t bytes) {
  ASSIGN_OR_RETURN(*buf, b.Allocate(std::max<size_t>(bytes, 64)));
  return absl::OkStatus();
}

// Bounds that keep block ids and table offsets in int32 and a block of reasonable size.
constexpr int64_t kMaxKvBlockSize = 1 << 16;
constexpr int64_t kMaxKvBlocks = (int64_t{1} << 31) - 1;

int64_t BlocksFor(int64_t tokens, int64_t block_size) { return (tokens + block_size - 1) / block_size; }

// The last stage answers this sequence with the argmax of its last logits row, not the row.
bool WantsGreedyId(const StepSequence& s) { return s.greedy && !s.all_logits; }
// ... or with the draw of its sampling parameters, where the backend samples rows.
bool WantsSampledId(const StepSequence& s) { return s.sampling.has_value() && !s.greedy && !s.all_logits; }

// The memory model's figures for a rank of `layout` with `options` (resolved): its local experts
// per MoE layer as LoadWeights places them.
RankMemory PredictedMemory(const ModelSpec& spec, const ShardLayout& layout, const ModelOptions& options,
                           const WeightFormats& formats) {
  RankShard shard{.layer_begin = options.layer_begin,
                  .layer_end = options.layer_end,
                  .has_embedding = options.layer_begin == 0,
                  .has_lm_head = options.layer_end == spec.num_layers,
                  .tp = options.shard.size,
                  .rank = options.shard.rank,
                  .expert_parallel = layout.expert_parallel};
  for (int64_t l = options.layer_begin; l < options.layer_end; ++l) {
    if (!spec.IsSparseLayer(l)) continue;
    int64_t local = 0;
    for (int32_t owner : LayerExpertOwners(layout, spec.moe.num_experts, options.layer_experts, l)) {
      local += layout.OwnsExpert(owner) ? 1 : 0;
    }
    shard.local_experts[l] = local;
  }
  return RankMemoryOf(spec, shard, formats);
}

}  // namespace

absl::StatusOr<DType> KvCacheDType(const ModelSpec& spec, const kernels::Backend& backend, KvCacheFormat format) {
  const kernels::Op write = spec.IsMla() ? kernels::Op::kMlaKvWrite : kernels::Op::kKvWrite;
  const kernels::Op read = spec.IsMla() ? kernels::Op::kMlaAttention : kernels::Op::kAttention;
  if (format == KvCacheFormat::kFp8E4M3) {
    if (spec.IsMla()) {
      return absl::InvalidArgumentError(
          "kv_cache_dtype fp8_e4m3: multi-head latent attention (kv_lora_rank > 0) keeps its latent cache in the "
          "checkpoint's dtype; use kv_cache_dtype auto for this model");
    }
    if (!backend.SupportsOp(write, DType::kF8E4M3) || !backend.SupportsOp(read, DType::kF8E4M3)) {
      return absl::InvalidArgumentError(absl::StrCat("kv_cache_dtype fp8_e4m3: the ", backend.name(),
                                                     " backend's KvWrite and Attention do not take an FP8 cache"));
    }
    return DType::kF8E4M3;
  }
  if (!spec.dtype.has_value() || *spec.dtype == DType::kF32) return DType::kF32;
  const DType d = *spec.dtype;
  return backend.SupportsOp(write, d) && backend.SupportsOp(read, d) ? d : DType::kF32;
}

WeightFormats EngineWeightFormats(const ModelSpec& spec, const kernels::Backend& backend, Quantization quantize,
                                  KvCacheFormat kv_cache) {
  const DType stored = spec.dtype.value_or(DType::kF32);
  const DType matrices = spec.fp8.has_value() ? DType::kF8E4M3 : stored;
  WeightFormats f;
  f.int8 = quantize == Quantization::kInt8 && backend.SupportsOp(kernels::Op::kLinear, DType::kQ8);
  f.matrix_bytes = static_cast<int64_t>(DTypeSize(KeptWeightDType(backend, matrices, kernels::Op::kLinear)));
  if (!f.int8 && KeptWeightDType(backend, matrices, kernels::Op::kLinear) == DType::kF8E4M3) {
    // FP8 kept as codes (matrix_bytes 1) + scales; dequantized (picked-row) matrices and an
    // unconverted lm_head in the checkpoint's 16-bit dtype.
    f.fp8 = true;
    f.fp8_block_rows = spec.fp8->block_rows;
    f.fp8_block_cols = spec.fp8->block_cols;
    f.dequantized_bytes =
        static_cast<int64_t>(DTypeSize(KeptWeightDType(backend, DType::kBF16, kernels::Op::kLinear)));
  }
  f.mxfp4_experts = spec.mxfp4.has_value() && backend.SupportsOp(kernels::Op::kLinear, DType::kMxfp4);
  f.head_linear_bytes = static_cast<int64_t>(DTypeSize(KeptWeightDType(backend, matrices, kernels::Op::kHeadLinear)));
  f.embedding_bytes = static_cast<int64_t>(DTypeSize(KeptEmbeddingDType(backend, stored, false)));
  f.tied_embedding_bytes = static_cast<int64_t>(DTypeSize(KeptEmbeddingDType(backend, stored, true)));
  const absl::StatusOr<DType> kv = KvCacheDType(spec, backend, kv_cache);
  f.kv_bytes = static_cast<int64_t>(DTypeSize(kv.ok() ? *kv : DType::kF32));
  return f;
}

Model::Model(const ModelSpec& spec, const ModelOptions& options, kernels::Backend* backend)
    : spec_(spec), options_(options), backend_(backend), ws_(std::make_unique<Workspace>()) {}

Model::~Model() = default;

absl::StatusOr<std::unique_ptr<Model>> Model::Create(const ModelSpec& spec, const Checkpoint& ckpt,
                                                     kernels::Backend* backend, const ModelOptions& options_in) {
  ModelOptions options = options_in;
  if (options.max_seq_len == 0) options.max_seq_len = spec.max_position_embeddings;
  if (options.layer_end == -1) options.layer_end = spec.num_layers;
  if (options.layer_begin < 0 || options.layer_begin >= options.layer_end || options.layer_end > spec.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer range [", options.layer_begin, ", ", options.layer_end,
                                                   ") is not a non-empty part of the model's ", spec.num_layers,
                                                   " layers"));
  }
  if (options.max_seq_len < 1 || options.max_seq_len > spec.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat("max_seq_len must be in [1, max_position_embeddings = ",
                                                   spec.max_position_embeddings, "], got ", options.max_seq_len));
  }
  if (options.kv_block_size < 1 || options.kv_block_size > kMaxKvBlockSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_block_size must be in [1, ", kMaxKvBlockSize, "], got ", options.kv_block_size));
  }
  if (options.num_kv_blocks == 0) {
    options.num_kv_blocks = 8 * ((options.max_seq_len + options.kv_block_size - 1) / options.kv_block_size);
  }
  if (options.num_kv_blocks < 1 || options.num_kv_blocks > kMaxKvBlocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_kv_blocks must be in [1, ", kMaxKvBlocks, "] (0 = default), got ", options.num_kv_blocks));
  }
  if (options.max_step_tokens < 1 || options.max_step_tokens > (1 << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_step_tokens must be in [1, 2^20], got ", options.max_step_tokens));
  }
  bool any_remote = false;
  for (const auto& [layer, owners] : options.layer_experts) {
    if (layer < options.layer_begin || layer >= options.layer_end || !spec.IsSparseLayer(layer)) {
      return absl::InvalidArgumentError(absl::StrCat("an expert placement is given for layer ", layer,
                                                     ", which is not a MoE layer of layers [", options.layer_begin,
                                                     ", ", options.layer_end, ")"));
    }
    if (static_cast<int64_t>(owners.size()) != spec.moe.num_experts) {
      return absl::InvalidArgumentError(absl::StrCat("the expert placement of layer ", layer, " lists ", owners.size(),
                                                     " experts; the model has ", spec.moe.num_experts));
    }
    for (size_t e = 0; e < owners.size(); ++e) {
      if (owners[e] != kRemoteExpert && (owners[e] < 0 || owners[e] >= options.shard.size)) {
        return absl::InvalidArgumentError(absl::StrCat("the expert placement of layer ", layer, " puts expert ", e,
                                                       " on rank ", owners[e], ", outside [0, ", options.shard.size,
                                                       ") (or ", kRemoteExpert, " for a remote expert)"));
      }
      any_remote |= owners[e] == kRemoteExpert;
    }
  }
  if (any_remote && options.remote_experts == nullptr) {
    return absl::InvalidArgumentError("the expert placement has remote experts but no way to call them");
  }
  if (spec.IsMla() && !(backend->SupportsOp(kernels::Op::kMlaAttention, DType::kF32) &&
                         backend->SupportsOp(kernels::Op::kMlaKvWrite, DType::kF32) &&
                         backend->SupportsOp(kernels::Op::kHeadLinear, DType::kF32))) {
    return absl::UnimplementedError(absl::StrCat(
        backend->name(), ": multi-head latent attention (", ArchitectureName(spec.arch),
        ") is not implemented on this backend; run the model's stages on CPU devices"));
  }
  const bool scales_rows = spec.attn_floor_scale > 0.0 || spec.moe.scoring == MoeScoring::kSigmoidInput;
  if (scales_rows && !backend->SupportsOp(kernels::Op::kScaleRows, DType::kF32)) {
    return absl::UnimplementedError(absl::StrCat(backend->name(), ": ", ArchitectureName(spec.arch),
                                                 " needs the ScaleRows op, which this backend lacks"));
  }
  std::unique_ptr<Model> m(new Model(spec, options, backend));
  ASSIGN_OR_RETURN(m->layout_, ShardLayout::Make(spec, options.shard, options.expert_owner, options.split_experts));
  if (options.shard.size > 1) {
    if (options.comm == nullptr || options.comm->size() != options.shard.size ||
        options.comm->rank() != options.shard.rank) {
      return absl::InvalidArgumentError(absl::StrCat("tensor-parallel rank ", options.shard.rank, " of ",
                                                     options.shard.size, " needs a communicator of that group"));
    }
  }
  // NCCL on the backend's stream: collectives need no host synchronization around them.
  m->comm_on_stream_ = options.comm != nullptr && options.comm->OrderOnStream(backend->stream_handle());
  // Before the weights load: a refused KV cache format is the caller's error, not a late surprise.
  ASSIGN_OR_RETURN(m->kv_dtype_, KvCacheDType(spec, *backend, options.kv_cache));
  const WeightFormats formats = EngineWeightFormats(spec, *backend, options.quantize, options.kv_cache);
  m->memory_ = PredictedMemory(spec, m->layout_, options, formats);
  ASSIGN_OR_RETURN(m->weights_, LoadWeights(spec, m->layout_, options.shard, options.layer_begin, options.layer_end,
                                            ckpt, *backend, options.layer_experts, options.quantize,
                                            options.on_load_progress));

  DType experts_dtype = DType::kF32;
  m->grouped_experts_ = spec.IsMoe() && GroupsExperts(m->weights_, m->layout_, *backend, &experts_dtype);
  // The device path of MoE layers: grouped experts read their row offsets on the device, so a step
  // neither copies them to the host nor waits (and can be recorded). One rank (no collectives
  // inside a layer), no remote experts (their rows go to the host), and the combine in one op.
  if (m->grouped_experts_ && options.moe_device_offsets && options.shard.size == 1 && !any_remote &&
      backend->SupportsOp(kernels::Op::kMoeCombine, DType::kF32)) {
    m->moe_device_rows_ = backend->MaxDeviceGroupRows(experts_dtype);
  }

  // KV cache: [num_kv_blocks, kv_block_size, local kv heads, head_dim] per layer for K and V, in
  // the checkpoint's 16-bit dtype where the backend keeps one (half the memory; vLLM's "auto"),
  // else f32, or FP8 codes when asked (kv_dtype_, set above). Multi-head latent attention: one
  // cache per layer of [num_kv_blocks, kv_block_size, kv_lora_rank + qk_rope_head_dim] (k_cache_;
  // v_cache_ stays empty), whole on every rank. The buffers are sized by the memory model (a
  // layer's block, K and V together), which must be the shape the attention kernels index.
  const bool mla = spec.IsMla();
  const size_t buffers = mla ? 1 : 2;
  const size_t kv_row = static_cast<size_t>(mla ? spec.KvValuesPerToken() : m->layout_.kv_heads * spec.head_dim);
  const size_t kv_block_bytes =
      static_cast<size_t>(KvBytesPerBlock(spec, 1, options.shard.size, options.kv_block_size, formats));
  if (kv_block_bytes != buffers * static_cast<size_t>(options.kv_block_size) * kv_row * DTypeSize(m->kv_dtype_)) {
    return absl::InternalError(absl::StrCat("the memory model's KV block (", kv_block_bytes,
                                            " bytes per layer) is not the cache's shape"));
  }
  const size_t kv_layer_bytes = static_cast<size_t>(options.num_kv_blocks) * kv_block_bytes / buffers;
  for (int64_t l = options.layer_begin; l < options.layer_end; ++l) {
    DeviceBuffer k, v;
    absl::Status st = Alloc(*backend, &k, kv_layer_bytes);
    if (st.ok() && !mla) st = Alloc(*backend, &v, kv_layer_bytes);
    if (!st.ok()) {
      return absl::Status(st.code(), absl::StrCat("KV cache of ", options.num_kv_blocks, " blocks of ",
                                                  options.kv_block_size, " tokens (", buffers * kv_layer_bytes,
                                                  " bytes per layer, ", options.layer_end - options.layer_begin,
                                                  " layers) does not fit on ", backend->name(), ": ", st.message()));
    }
    m->kv_bytes_ += k.bytes() + v.bytes();  // as allocated
    m->k_cache_.push_back(std::move(k));
    m->v_cache_.push_back(std::move(v));
  }

  Workspace& w = *m->ws_;
  const size_t t = static_cast<size_t>(options.max_step_tokens);
  const size_t h = static_cast<size_t>(spec.hidden_size);
  // MLA: the attention output is heads x v_head_dim (the o projection's input).
  const size_t qd = static_cast<size_t>(m->layout_.q_heads * (mla ? spec.mla.v_head_dim : spec.head_dim));
  const size_t kvd = static_cast<size_t>(m->layout_.kv_heads * spec.head_dim);
  const size_t ffn = static_cast<size_t>(
      std::max({m->layout_.ffn, m->layout_.expert_ffn, m->layout_.shared_ffn}));
  const size_t f = sizeof(float);
  const size_t topk = static_cast<size_t>(std::max<int64_t>(spec.moe.top_k, 1));
  const size_t experts = static_cast<size_t>(std::max<int64_t>(spec.moe.num_experts, 1));
  RETURN_IF_ERROR(Alloc(*backend, &w.hidden, t * h * f));
  RETURN_IF_ERROR(Alloc(*backend, &w.normed, t * h * f));
  RETURN_IF_ERROR(Alloc(*backend, &w.q, t * qd * f));
  RETURN_IF_ERROR(Alloc(*backend, &w.k, t * kvd * f));
  RETURN_IF_ERROR(Alloc(*backend, &w.v, t * kvd * f));
  RETURN_IF_ERROR(Alloc(*backend, &w.attn, t * qd * f));
  RETURN_IF_ERROR(Alloc(*backend, &w.tmp, t * h * f));
  RETURN_IF_ERROR(Alloc(*backend, &w.gate, t * ffn * f));
  RETURN_IF_ERROR(Alloc(*backend, &w.up, t * ffn * f));
  RETURN_IF_ERROR(Alloc(*backend, &w.ids, t * sizeof(int32_t)));
  RETURN_IF_ERROR(Alloc(*backend, &w.positions, t * sizeof(int32_t)));
  RETURN_IF_ERROR(Alloc(*backend, &w.seqs, t * sizeof(AttnSeq)));
  RETURN_IF_ERROR(Alloc(*backend, &w.logit_rows, t * sizeof(int32_t)));
  RETURN_IF_ERROR(Alloc(*backend, &w.selected, t * h * f));
  const size_t vpad = static_cast<size_t>(m->layout_.vocab_padded);
  RETURN_IF_ERROR(Alloc(*backend, &w.logits, t * vpad * f));
  RETURN_IF_ERROR(Alloc(*backend, &w.argmax, t * sizeof(int32_t)));
  RETURN_IF_ERROR(Alloc(*backend, &w.sampling, t * sizeof(kernels::RowSamplingParams)));
  if (options.shard.size > 1) {
    RETURN_IF_ERROR(Alloc(*backend, &w.gathered, static_cast<size_t>(options.shard.size) * t * vpad * f));
  }
  if (spec.IsMoe()) {
    RETURN_IF_ERROR(Alloc(*backend, &w.router, t * experts * f));
    // One slot of offsets per local layer: a device-path step reads them all after it ran.
    const size_t local_layers = static_cast<size_t>(options.layer_end - options.layer_begin);
    RETURN_IF_ERROR(Alloc(*backend, &w.moe_offsets, local_layers * (experts + 1) * sizeof(int32_t)));
    RETURN_IF_ERROR(Alloc(*backend, &w.moe_x, t * h * f));
    RETURN_IF_ERROR(Alloc(*backend, &w.moe_y, t * h * f));
    RETURN_IF_ERROR(Alloc(*backend, &w.moe_rows, t * topk * sizeof(int32_t)));
    RETURN_IF_ERROR(Alloc(*backend, &w.moe_scales, t * topk * f));
    RETURN_IF_ERROR(Alloc(*backend, &w.shared_gate, t * f));
    if (any_remote && options.shard.rank == 0) RETURN_IF_ERROR(Alloc(*backend, &w.remote_x, t * topk * h * f));
    if (m->grouped_experts_) {
      const size_t expert_ffn = static_cast<size_t>(m->layout_.expert_ffn);
      RETURN_IF_ERROR(Alloc(*backend, &w.grouped_x, t * topk * h * f));
      RETURN_IF_ERROR(Alloc(*backend, &w.grouped_gate, t * topk * expert_ffn * f));
      RETURN_IF_ERROR(Alloc(*backend, &w.grouped_up, t * topk * expert_ffn * f));
    }
    if (m->moe_device_rows_ > 0) RETURN_IF_ERROR(m->BuildHeldExperts());
  }
  if (scales_rows || spec.qk_l2_norm) {
    const size_t n = std::max(t * topk, static_cast<size_t>(spec.head_dim));
    const std::vector<float> ones(n, 1.0f);
    RETURN_IF_ERROR(Alloc(*backend, &w.ones, n * f));
    RETURN_IF_ERROR(backend->CopyToDevice(w.ones.as<void>(), ones.data(), n * f));
    RETURN_IF_ERROR(Alloc(*backend, &w.query_temp, t * f));
  }
  size_t linear_in = std::max({h, qd, ffn});
  // Grouped experts: the down projection's input is an expert's width.
  if (spec.IsMoe() && m->grouped_experts_) linear_in = std::max(linear_in, static_cast<size_t>(m->layout_.expert_ffn));
  if (mla) {
    const MlaSpec& ml = spec.mla;
    const size_t heads = static_cast<size_t>(m->layout_.q_heads);
    const size_t lat = static_cast<size_t>(ml.kv_lora_rank);
    RETURN_IF_ERROR(Alloc(*backend, &w.mla_qa, t * static_cast<size_t>(std::max<int64_t>(ml.q_lora_rank, 1)) * f));
    RETURN_IF_ERROR(Alloc(*backend, &w.mla_q_nope, t * heads * static_cast<size_t>(ml.qk_nope_head_dim) * f));
    RETURN_IF_ERROR(Alloc(*backend, &w.mla_q_rope, t * heads * static_cast<size_t>(ml.qk_rope_head_dim) * f));
    RETURN_IF_ERROR(Alloc(*backend, &w.mla_q_latent, t * heads * lat * f));
    RETURN_IF_ERROR(Alloc(*backend, &w.mla_latent, t * lat * f));
    RETURN_IF_ERROR(Alloc(*backend, &w.mla_k_rope, t * static_cast<size_t>(ml.qk_rope_head_dim) * f));
    RETURN_IF_ERROR(Alloc(*backend, &w.mla_out, t * heads * lat * f));
    linear_in = std::max({linear_in, static_cast<size_t>(ml.q_lora_rank), lat});
  }
  // The widest Linear input is the hidden size, the attention output or an MLP's width (MLA: or
  // the query's compressed width, or the latent; MoE: or an expert's). An MoE layer's grouped
  // products (top_k rows per token) take the hidden size (gate/up) or an expert's width (down).
  const int64_t grouped_in = spec.IsMoe() ? std::max<int64_t>(spec.hidden_size, m->layout_.expert_ffn) : 0;
  RETURN_IF_ERROR(backend->Reserve({.max_tokens = options.max_step_tokens,
                                    .max_linear_in = static_cast<int64_t>(linear_in),
                                    .max_grouped_in = grouped_in,
                                    .max_q_heads = m->layout_.q_heads,
                                    .max_head_dim = spec.head_dim,
                                    .max_context = options.max_seq_len,
                                    .moe_routing = spec.IsMoe() ? MoeRoutingOf(spec.moe) : kernels::MoeRouting{}}));
  const std::vector<float> inv = InvFreq(spec, &w.position_scale);
  RETURN_IF_ERROR(Alloc(*backend, &w.inv_freq, inv.size() * f));
  RETURN_IF_ERROR(backend->CopyToDevice(w.inv_freq.as<void>(), inv.data(), inv.size() * f));
  if (spec.rope.type == RopeType::kLongrope) {
    float unused = 1.0f;
    const std::vector<float> inv_long = InvFreq(spec, &unused, /*long_factors=*/true);
    RETURN_IF_ERROR(Alloc(*backend, &w.inv_freq_long, inv_long.size() * f));
    RETURN_IF_ERROR(backend->CopyToDevice(w.inv_freq_long.as<void>(), inv_long.data(), inv_long.size() * f));
  }
  // Layers that rotate with another RoPE than the model's: Gemma-3's sliding layers
  // (ModelSpec::sliding_rope), GraniteSWA's layers with their own theta (layer_rope_theta).
  if (spec.sliding_rope.has_value() || !spec.layer_rope_theta.empty()) {
    w.inv_freq_layer.resize(static_cast<size_t>(spec.num_layers));
    w.position_scale_layer.assign(static_cast<size_t>(spec.num_layers), 1.0f);
    for (int64_t l = options.layer_begin; l < options.layer_end; ++l) {
      if (!spec.LayerUsesRope(l) || (!spec.UsesSlidingRope(l) && spec.LayerRopeTheta(l) == spec.rope.theta)) continue;
      ModelSpec own = spec;  // InvFreq reads spec.rope
      own.rope = spec.LayerRope(l);
      own.rope.theta = spec.LayerRopeTheta(l);
      const size_t i = static_cast<size_t>(l);
      const std::vector<float> table = InvFreq(own, &w.position_scale_layer[i]);
      RETURN_IF_ERROR(Alloc(*backend, &w.inv_freq_layer[i], table.size() * f));
      RETURN_IF_ERROR(backend->CopyToDevice(w.inv_freq_layer[i].as<void>(), table.data(), table.size() * f));
    }
  }
  return m;
}

absl::Status Model::Validate(const std::vector<StepSequence>& batch, absl::Span<const float> hidden_in) {
  if (batch.empty()) return absl::InvalidArgumentError("empty step batch");
  int64_t total = 0;
  const int64_t bs = options_.kv_block_size;
  // Blocks holding the step's new positions, with their sequence (a reused vector, not a set: the
  // step allocates nothing here once it has seen its batch size).
  std::vector<std::pair<int32_t, int32_t>>& written = ws_->h_written;
  written.clear();
  for (size_t i = 0; i < batch.size(); ++i) {
    const StepSequence& s = batch[i];
    if (s.NumTokens() < 1) return absl::InvalidArgumentError(absl::StrCat("sequence ", i, ": no tokens"));
    if (first_stage() && static_cast<int32_t>(s.tokens.size()) != s.NumTokens()) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", i, ": the first stage needs the token ids"));
    }
    const int64_t end = int64_t{s.pos_begin} + s.NumTokens();
    if (s.pos_begin < 0 || end > options_.max_seq_len) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", i, ": positions [", s.pos_begin, ", ", end,
                                                     ") exceed the context length ", options_.max_seq_len));
    }
    const int64_t needed = BlocksFor(end, bs);
    if (static_cast<int64_t>(s.block_ids.size()) < needed) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", i, ": ", s.block_ids.size(), " KV blocks of ", bs,
                                                     " tokens cannot hold positions up to ", end, "; ", needed,
                                                     " needed"));
    }
    for (int64_t j = 0; j < needed; ++j) {
      const int32_t id = s.block_ids[static_cast<size_t>(j)];
      if (id < 0 || id >= options_.num_kv_blocks) {
        return absl::InvalidArgumentError(absl::StrCat("sequence ", i, ": KV block ", id, " is outside [0, ",
                                                       options_.num_kv_blocks, ")"));
      }
      if (j >= s.pos_begin / bs) written.emplace_back(id, static_cast<int32_t>(i));
    }
    for (int32_t id : s.tokens) {
      if (id < 0 || id >= spec_.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat("sequence ", i, ": token id ", id,
                                                       " is outside the vocabulary [0, ", spec_.vocab_size, ")"));
      }
    }
    total += s.NumTokens();
  }
  std::sort(written.begin(), written.end());
  auto twice = std::adjacent_find(written.begin(), written.end(),
                                  [](const auto& a, const auto& b) { return a.first == b.first; });
  if (twice != written.end()) {
    // The later of the two sequences (or the one that names the block twice).
    return absl::InvalidArgumentError(absl::StrCat("sequence ", std::next(twice)->second, ": KV block ", twice->first,
                                                   " is written twice in one step"));
  }
  if (total > options_.max_step_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("step has ", total, " tokens; the limit is max_step_tokens = ", options_.max_step_tokens));
  }
  if (first_stage() && !hidden_in.empty()) {
    return absl::InvalidArgumentError("hidden states were given to the first pipeline stage");
  }
  if (!first_stage() && static_cast<int64_t>(hidden_in.size()) != total * spec_.hidden_size) {
    return absl::InvalidArgumentError(absl::StrCat("hidden states hold ", hidden_in.size(), " values; ", total,
                                                   " tokens x hidden ", spec_.hidden_size, " expected"));
  }
  return absl::OkStatus();
}

absl::StatusOr<StepResult> Model::Step(const std::vector<StepSequence>& batch, absl::Span<const float> hidden_in) {
  RETURN_IF_ERROR(Validate(batch, hidden_in));
  deferred_ = absl::OkStatus();
  absl::StatusOr<StepResult> result = Run(batch, hidden_in);
  if (result.ok() && !deferred_.ok()) return MarkGroupIntact(std::exchange(deferred_, absl::OkStatus()));
  if (result.ok() && spec_.IsMoe() && options_.observer != nullptr && options_.shard.rank == 0) {
    int64_t tokens = 0;
    for (const StepSequence& s : batch) tokens += s.NumTokens();
    if (MoeOnDevice(tokens)) RETURN_IF_ERROR(ReportDeviceExpertTokens());
  }
  return result;
}

absl::Status Model::ReportDeviceExpertTokens() {
  Workspace& w = *ws_;
  const size_t stride = static_cast<size_t>(spec_.moe.num_experts + 1);
  w.h_step_offsets.resize(w.held.size() * stride);
  // After the step's own copies to the host: nothing is left on the stream to wait for.
  RETURN_IF_ERROR(backend_->CopyToHost(w.h_step_offsets.data(), w.moe_offsets.as<void>(),
                                       w.h_step_offsets.size() * sizeof(int32_t)));
  for (const LayerWeights& lw : weights_.layers) {
    if (!lw.sparse) continue;
    const int32_t* offset =
        w.h_step_offsets.data() + static_cast<size_t>(lw.layer - options_.layer_begin) * stride;
    for (size_t e = 0; e + 1 < stride; ++e) {
      const int64_t n = offset[e + 1] - offset[e];
      if (n > 0) options_.observer->OnExpertTokens(lw.layer, static_cast<int64_t>(e), n);
    }
  }
  return absl::OkStatus();
}

absl::Status Model::BuildHeldExperts() {
  Workspace& w = *ws_;
  w.held.clear();
  w.held.resize(static_cast<size_t>(options_.layer_end - options_.layer_begin));
  for (const LayerWeights& lw : weights_.layers) {
    if (!lw.sparse) continue;
    Workspace::HeldExperts& held = w.held[static_cast<size_t>(lw.layer - options_.layer_begin)];
    for (size_t e = 0; e < lw.experts.size(); ++e) {
      if (!lw.IsLocalExpert(static_cast<int64_t>(e), layout_)) continue;
      held.ids.push_back(static_cast<int32_t>(e));
      held.gate.push_back(lw.experts[e].gate.view());
      held.up.push_back(lw.experts[e].up.view());
      held.down.push_back(lw.experts[e].down.view());
    }
    if (held.ids.empty()) continue;
    std::vector<const void*> table;
    for (const std::vector<kernels::WeightView>* views : {&held.gate, &held.up, &held.down}) {
      for (const kernels::WeightView& v : *views) table.push_back(v.data);
    }
    RETURN_IF_ERROR(Alloc(*backend_, &held.d_ids, held.ids.size() * sizeof(int32_t)));
    RETURN_IF_ERROR(
        backend_->CopyToDevice(held.d_ids.as<void>(), held.ids.data(), held.ids.size() * sizeof(int32_t)));
    RETURN_IF_ERROR(Alloc(*backend_, &held.d_weights, table.size() * sizeof(const void*)));
    RETURN_IF_ERROR(
        backend_->CopyToDevice(held.d_weights.as<void>(), table.data(), table.size() * sizeof(const void*)));
  }
  return absl::OkStatus();
}

absl::StatusOr<StepResult> Model::Run(const std::vector<StepSequence>& batch, absl::Span<const float> hidden_in) {
  Workspace& w = *ws_;
  kernels::Backend& b = *backend_;
  w.h_ids.clear();
  w.h_pos.clear();
  w.h_seqs.clear();
  w.h_rows.clear();
  w.h_tables.clear();
  for (const StepSequence& s : batch) {
    AttnSeq a;
    a.q_begin = static_cast<int32_t>(w.h_ids.size());
    a.q_len = s.NumTokens();
    a.pos_begin = s.pos_begin;
    // Only the blocks this step reads (Validate checked that they exist).
    const int64_t needed = BlocksFor(int64_t{s.pos_begin} + a.q_len, options_.kv_block_size);
    a.table_begin = static_cast<int32_t>(w.h_tables.size());
    a.table_len = static_cast<int32_t>(needed);
    w.h_tables.insert(w.h_tables.end(), s.block_ids.begin(), s.block_ids.begin() + needed);
    w.h_seqs.push_back(a);
    for (int32_t j = 0; j < a.q_len; ++j) {
      w.h_ids.push_back(s.tokens.empty() ? 0 : s.tokens[static_cast<size_t>(j)]);
      w.h_pos.push_back(s.pos_begin + j);
      if (s.all_logits || j + 1 == a.q_len) w.h_rows.push_back(a.q_begin + j);
    }
  }
  const int64_t tokens = static_cast<int64_t>(w.h_ids.size());
  const int64_t num_seqs = static_cast<int64_t>(w.h_seqs.size());
  const int64_t rows = static_cast<int64_t>(w.h_rows.size());
  const int64_t h = spec_.hidden_size;
  RETURN_IF_ERROR(b.CopyToDevice(w.ids.as<void>(), w.h_ids.data(), tokens * sizeof(int32_t)));
  RETURN_IF_ERROR(b.CopyToDevice(w.positions.as<void>(), w.h_pos.data(), tokens * sizeof(int32_t)));
  RETURN_IF_ERROR(b.CopyToDevice(w.seqs.as<void>(), w.h_seqs.data(), num_seqs * sizeof(AttnSeq)));
  if (w.h_tables.size() > w.tables_capacity) {
    // Grow geometrically: the tables lengthen as contexts do, a block at a time.
    const size_t capacity = std::max(w.h_tables.size(), 2 * w.tables_capacity);
    w.tables = DeviceBuffer();  // free first (a backend may be short of memory)
    w.tables_capacity = 0;
    graphs_.clear();  // they read the old tables
    RETURN_IF_ERROR(Alloc(b, &w.tables, capacity * sizeof(int32_t)));
    w.tables_capacity = capacity;
  }
  RETURN_IF_ERROR(b.CopyToDevice(w.tables.as<void>(), w.h_tables.data(), w.h_tables.size() * sizeof(int32_t)));
  RETURN_IF_ERROR(b.CopyToDevice(w.logit_rows.as<void>(), w.h_rows.data(), rows * sizeof(int32_t)));
  if (spec_.attn_floor_scale > 0.0) {
    // Llama-4's attention temperature, in float32 as transformers computes it.
    const float floor_scale = static_cast<float>(spec_.attn_floor_scale);
    const float attn_scale = static_cast<float>(spec_.attn_temperature_scale);
    w.h_query_temp.resize(static_cast<size_t>(tokens));
    for (int64_t i = 0; i < tokens; ++i) {
      const float p1 = static_cast<float>(w.h_pos[static_cast<size_t>(i)]) + 1.0f;
      w.h_query_temp[static_cast<size_t>(i)] = std::log1p(std::floor(p1 / floor_scale)) * attn_scale + 1.0f;
    }
    RETURN_IF_ERROR(b.CopyToDevice(w.query_temp.as<void>(), w.h_query_temp.data(), tokens * sizeof(float)));
  }

  if (!first_stage()) {
    RETURN_IF_ERROR(b.CopyToDevice(w.hidden.as<void>(), hidden_in.data(), hidden_in.size() * sizeof(float)));
  }
  const bool decode_only = std::all_of(w.h_seqs.begin(), w.h_seqs.end(), [](const AttnSeq& a) { return a.q_len == 1; });
  RETURN_IF_ERROR(ForwardMaybeRecorded(tokens,
                                       {.seqs = w.seqs.as<AttnSeq>(),
                                        .host_seqs = w.h_seqs.data(),
                                        .num_seqs = num_seqs,
                                        .block_table = w.tables.as<int32_t>(),
                                        .host_block_table = w.h_tables.data(),
                                        .table_entries = static_cast<int64_t>(w.h_tables.size())},
                                       decode_only));
  if (!last_stage()) {
    // Hidden states for the next stage (identical on every rank after the layer's all-reduce).
    StepResult result;
    if (options_.shard.rank == 0) {
      result.hidden.resize(static_cast<size_t>(tokens * h));
      RETURN_IF_ERROR(b.CopyToHost(result.hidden.data(), w.hidden.as<float>(), result.hidden.size() * sizeof(float)));
    }
    return result;
  }
  RETURN_IF_ERROR(b.GatherRows({.src = w.hidden.as<float>(),
                                .rows = w.logit_rows.as<int32_t>(),
                                .dst = w.selected.as<float>(),
                                .count = rows,
                                .src_rows = tokens,
                                .width = h}));
  RETURN_IF_ERROR(b.RmsNorm({.x = w.selected.as<float>(),
                             .weight = weights_.final_norm.as<float>(),
                             .y = w.selected.as<float>(),
                             .tokens = rows,
                             .hidden = h,
                             .eps = static_cast<float>(spec_.rms_norm_eps)}));
  const int64_t vpad = layout_.vocab_padded;
  RETURN_IF_ERROR(b.Linear({.x = w.selected.as<float>(),
                            .w = weights_.lm_head_view(),
                            .y = w.logits.as<float>(),
                            .tokens = rows,
                            .in = h,
                            .out = vpad}));
  if (spec_.final_logit_softcapping > 0.0) {
    // Elementwise, so each rank caps its own vocab slice (padding rows stay 0).
    RETURN_IF_ERROR(b.Scale({.x = w.logits.as<float>(), .n = rows * vpad, .scale = 1.0f,
                             .softcap = static_cast<float>(spec_.final_logit_softcapping)}));
  }
  StepResult result;
  result.logits.resize(batch.size());
  result.sampled_ids.assign(batch.size(), -1);
  const int64_t v = spec_.vocab_size;
  if (!tp()) {
    // Greedy sequences: the argmax on the device; sequences with plain sampling parameters: the
    // draw too, where the logits live on a device that samples (on CPU ranks the Sampler reads
    // the row where it is, as fast). Only the ids cross to the host.
    const bool sample_rows = (b.kind() != kernels::DeviceKind::kCpu || options_.sample_rows_on_cpu_for_test) &&
                             b.SupportsOp(kernels::Op::kSampleRows, DType::kF32);
    auto wants_draw = [&](const StepSequence& s) { return sample_rows && WantsSampledId(s); };
    if (std::any_of(batch.begin(), batch.end(), wants_draw)) {
      // Rows of other sequences are argmax rows (temperature 0), cheap and ignored.
      w.h_sampling.assign(static_cast<size_t>(rows), kernels::RowSamplingParams{});
      int64_t row = 0;
      for (const StepSequence& s : batch) {
        const int64_t n = s.all_logits ? s.NumTokens() : 1;
        if (wants_draw(s)) w.h_sampling[static_cast<size_t>(row)] = *s.sampling;
        row += n;
      }
      RETURN_IF_ERROR(b.CopyToDevice(w.sampling.as<void>(), w.h_sampling.data(),
                                     static_cast<size_t>(rows) * sizeof(kernels::RowSamplingParams)));
      RETURN_IF_ERROR(b.SampleRows({.x = w.logits.as<float>(),
                                    .params = w.sampling.as<kernels::RowSamplingParams>(),
                                    .host_params = w.h_sampling.data(),
                                    .out = w.argmax.as<int32_t>(),
                                    .rows = rows,
                                    .width = v,
                                    .stride = vpad}));
    } else if (std::any_of(batch.begin(), batch.end(), WantsGreedyId)) {
      RETURN_IF_ERROR(b.ArgmaxRows(
          {.x = w.logits.as<float>(), .out = w.argmax.as<int32_t>(), .rows = rows, .width = v, .stride = vpad}));
    }
    auto on_device = [&](const StepSequence& s) { return WantsGreedyId(s) || wants_draw(s); };
    if (std::any_of(batch.begin(), batch.end(), on_device)) {
      w.h_argmax.resize(static_cast<size_t>(rows));
      RETURN_IF_ERROR(b.CopyToHost(w.h_argmax.data(), w.argmax.as<void>(), static_cast<size_t>(rows) * sizeof(int32_t)));
    }
    int64_t row = 0;
    for (size_t i = 0; i < batch.size(); ++i) {
      const int64_t n = batch[i].all_logits ? batch[i].NumTokens() : 1;
      if (on_device(batch[i])) {
        result.sampled_ids[i] = w.h_argmax[static_cast<size_t>(row)];
      } else {
        result.logits[i].resize(static_cast<size_t>(n * v));
        RETURN_IF_ERROR(
            b.CopyToHost(result.logits[i].data(), w.logits.as<float>() + row * v, n * v * sizeof(float)));
      }
      row += n;
    }
    return result;
  }
  // Vocab-parallel logits: gather every rank's [rows, vpad] slice; rank 0 assembles [rows, vocab].
  if (!comm_on_stream_) RETURN_IF_ERROR(b.Synchronize());
  const auto gather_start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(options_.comm->AllGather(w.logits.as<float>(), w.gathered.as<float>(),
                                           static_cast<size_t>(rows * vpad)));
  if (options_.observer != nullptr) {
    options_.observer->OnCollective(
        options_.shard.rank, "all_gather",
        std::chrono::duration<double>(std::chrono::steady_clock::now() - gather_start).count());
  }
  if (options_.shard.rank != 0) return result;
  const int ranks = options_.shard.size;
  int64_t row = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const int64_t n = batch[i].all_logits ? batch[i].NumTokens() : 1;
    result.logits[i].resize(static_cast<size_t>(n * v));
    for (int64_t r = 0; r < n; ++r, ++row) {
      for (int k = 0; k < ranks; ++k) {
        const int64_t begin = vpad * k;
        const int64_t count = std::min(vpad, v - begin);
        if (count <= 0) break;
        const float* src = w.gathered.as<float>() + (k * rows + row) * vpad;
        RETURN_IF_ERROR(b.CopyToHost(result.logits[i].data() + r * v + begin, src, count * sizeof(float)));
      }
    }
    if (WantsGreedyId(batch[i])) {
      // Vocab-parallel: the row is assembled on the host anyway; take its argmax here.
      const std::vector<float>& l = result.logits[i];
      result.sampled_ids[i] = static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
      result.logits[i].clear();
    }
  }
  return result;
}

absl::Status Model::Forward(int64_t tokens, const kernels::PagedSeqs& paged) {
  Workspace& w = *ws_;
  if (first_stage()) {
    RETURN_IF_ERROR(backend_->Embedding({.table = weights_.embedding_view(),
                                         .ids = w.ids.as<int32_t>(),
                                         .out = w.hidden.as<float>(),
                                         .tokens = tokens,
                                         .vocab = spec_.vocab_size,
                                         .hidden = spec_.hidden_size}));
    if (spec_.embedding_multiplier != 1.0) {
      RETURN_IF_ERROR(backend_->Scale({.x = w.hidden.as<float>(), .n = tokens * spec_.hidden_size,
                                       .scale = static_cast<float>(spec_.embedding_multiplier)}));
    }
  }
  pending_residual_ = nullptr;
  for (int64_t l = options_.layer_begin; l < options_.layer_end; ++l) RETURN_IF_ERROR(Layer(l, tokens, paged));
  if (pending_residual_ == nullptr) return absl::OkStatus();
  return backend_->Add({.x = w.hidden.as<float>(), .y = std::exchange(pending_residual_, nullptr),
                        .n = tokens * spec_.hidden_size});
}

absl::Status Model::ForwardMaybeRecorded(int64_t tokens, const kernels::PagedSeqs& paged, bool decode_only) {
  kernels::Backend& b = *backend_;
  // Decode steps only (their shapes repeat); one rank (no collectives inside); MoE layers only on
  // their device path (otherwise MoeRoute copies the experts' row offsets to the host mid-step).
  // LongRoPE picks its frequencies by each sequence's length: not a fixed launch.
  const bool eligible = options_.op_graphs && !graphs_off_ && decode_only && !tp() &&
                        (!spec_.IsMoe() || MoeOnDevice(tokens)) &&
                        spec_.rope.type != RopeType::kLongrope && b.SupportsCapture();
  auto forward = [&] { return Forward(tokens, paged); };
  if (!eligible) return forward();
  // Every layer's attention launches alike: ask for the first one's.
  int64_t shape_key = b.AttentionShapeKey(AttentionFor(options_.layer_begin, tokens, paged));
  // Sliding-window (or chunked) and full layers mixed (Gemma-2, Llama-4): their launches differ;
  // the key holds both.
  for (int64_t l = options_.layer_begin + 1; l < options_.layer_end; ++l) {
    if (spec_.LayerSlidingWindow(l) != spec_.LayerSlidingWindow(options_.layer_begin) ||
        spec_.LayerChunkSize(l) != spec_.LayerChunkSize(options_.layer_begin)) {
      shape_key = shape_key * 65536 + b.AttentionShapeKey(AttentionFor(l, tokens, paged));
      break;
    }
  }
  const std::pair<int64_t, int64_t> key{tokens, shape_key};
  auto it = graphs_.find(key);
  if (it == graphs_.end()) {
    // Bounded: a long-running server sees few batch sizes, but contexts keep growing.
    constexpr size_t kMaxGraphs = 256;
    if (graphs_.size() >= kMaxGraphs) graphs_.clear();
    absl::StatusOr<std::unique_ptr<kernels::OpGraph>> graph = b.Capture(forward);
    if (!graph.ok()) {
      // Nothing ran: run the step op by op, and from now on every step (the failure would repeat).
      graphs_off_ = true;
      return forward();
    }
    it = graphs_.emplace(key, *std::move(graph)).first;
  }
  const absl::Status replayed = it->second->Replay();
  if (replayed.code() == absl::StatusCode::kAborted) {
    graphs_.clear();  // the backend's scratch moved: record again from the next step
    return forward();
  }
  RETURN_IF_ERROR(replayed);
  ++graph_replays_;
  return absl::OkStatus();
}

absl::Status Model::AllReduce(float* data, int64_t count) {
  if (!tp()) return absl::OkStatus();
  if (!comm_on_stream_) RETURN_IF_ERROR(backend_->Synchronize());
  const auto start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(options_.comm->AllReduceSum(data, static_cast<size_t>(count)));
  if (options_.observer != nullptr) {
    options_.observer->OnCollective(options_.shard.rank, "all_reduce",
                                    std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return absl::OkStatus();
}

kernels::AttentionParams Model::AttentionFor(int64_t layer, int64_t tokens, const kernels::PagedSeqs& paged) const {
  const size_t local = static_cast<size_t>(layer - options_.layer_begin);
  const int64_t d = spec_.head_dim;
  return {.q = ws_->q.as<float>(),
          .out = ws_->attn.as<float>(),
          .paged = paged,
          .tokens = tokens,
          .q_heads = layout_.q_heads,
          .cache = {.k = k_cache_[local].as<void>(),
                    .v = v_cache_[local].as<void>(),
                    .num_blocks = options_.num_kv_blocks,
                    .block_size = options_.kv_block_size,
                    .kv_heads = layout_.kv_heads,
                    .head_dim = d,
                    .dtype = kv_dtype_},
          .scale = spec_.query_pre_attn_scalar > 0.0 || spec_.attention_multiplier > 0.0
                       ? static_cast<float>(spec_.AttentionScale())
                       : 1.0f / std::sqrt(static_cast<float>(d)),
          .sliding_window = spec_.LayerSlidingWindow(layer),
          .chunk_size = spec_.LayerChunkSize(layer),
          .softcap = static_cast<float>(spec_.attn_logit_softcapping),
          .sinks = spec_.attention_sinks ? weights_.layers[local].sinks.as<float>() : nullptr};
}

namespace {

// One product of a LinearGroup: y = x . lin^T (+ bias).
kernels::LinearGroupParams::Part GroupPart(const LinearWeight& lin, float* y) {
  return {.w = lin.view(), .bias = lin.bias(), .y = y, .out = lin.out};
}

}  // namespace

kernels::GateActivation GateActivationOf(const ModelSpec& spec) {
  switch (spec.activation) {
    case Activation::kSilu: return kernels::GateActivation::kSilu;
    case Activation::kGeluTanh: return kernels::GateActivation::kGeluTanh;
    case Activation::kClampedSwiglu: return kernels::GateActivation::kClampedSwiglu;
  }
  return kernels::GateActivation::kSilu;
}

absl::Status Model::Layer(int64_t layer, int64_t tokens, const kernels::PagedSeqs& paged) {
  Workspace& w = *ws_;
  kernels::Backend& b = *backend_;
  const LayerWeights& lw = weights_.layers[static_cast<size_t>(layer - options_.layer_begin)];
  const int64_t h = spec_.hidden_size;
  const float eps = static_cast<float>(spec_.rms_norm_eps);
  float* hidden = w.hidden.as<float>();
  float* normed = w.normed.as<float>();
  if (spec_.sandwich_norms) return SandwichLayer(layer, lw, tokens, paged);

  // The input norm: with the previous layer's output still to add (several ranks), in the same pass
  // as that add; else fused into the q/k/v products (multi-head latent attention normalises on its
  // own first).
  std::optional<kernels::LinearGroupParams::Norm> input_norm;
  if (pending_residual_ != nullptr) {
    // The previous layer's output joins the residual stream in the same pass as this norm.
    RETURN_IF_ERROR(b.AddRmsNorm({.x = hidden, .y = std::exchange(pending_residual_, nullptr),
                                  .weight = lw.input_norm.as<float>(), .out = normed, .tokens = tokens, .hidden = h,
                                  .eps = eps}));
  } else if (!spec_.IsMla()) {
    input_norm = kernels::LinearGroupParams::Norm{.weight = lw.input_norm.as<float>(), .eps = eps, .scratch = normed};
  } else {
    RETURN_IF_ERROR(b.RmsNorm({.x = hidden, .weight = lw.input_norm.as<float>(), .y = normed, .tokens = tokens,
                               .hidden = h, .eps = eps}));
  }
  auto linear = [&](const LinearWeight& lin, const float* x, float* y, bool accumulate) {
    return b.Linear({.x = x, .w = lin.view(), .bias = lin.bias(), .y = y,
                     .tokens = tokens, .in = lin.in, .out = lin.out, .accumulate = accumulate});
  };
  if (spec_.IsMla()) {
    RETURN_IF_ERROR(MlaAttention(layer, lw, tokens, paged));
  } else {
    RETURN_IF_ERROR(GqaAttention(layer, lw, tokens, paged, input_norm));
  }
  const kernels::LinearGroupParams::Norm post_norm{.weight = lw.post_norm.as<float>(), .eps = eps, .scratch = normed};
  // One rank: the residual add is fused into the o projection (hidden += attn . o^T), and a dense
  // MLP takes the post-attention norm in its gate and up products. Several ranks: each has a
  // partial product over its heads; sum them, then add.
  if (!tp()) {
    RETURN_IF_ERROR(linear(lw.o, w.attn.as<float>(), hidden, true));
    if (!lw.sparse) return Mlp(lw.mlp, hidden, hidden, tokens, /*accumulate=*/true, post_norm);
    RETURN_IF_ERROR(b.RmsNorm({.x = hidden, .weight = post_norm.weight, .y = normed, .tokens = tokens, .hidden = h,
                               .eps = eps}));
  } else {
    RETURN_IF_ERROR(linear(lw.o, w.attn.as<float>(), w.tmp.as<float>(), false));
    RETURN_IF_ERROR(AllReduce(w.tmp.as<float>(), tokens * h));
    RETURN_IF_ERROR(b.AddRmsNorm({.x = hidden, .y = w.tmp.as<float>(), .weight = lw.post_norm.as<float>(),
                                  .out = normed, .tokens = tokens, .hidden = h, .eps = eps}));
  }
  float* out = tp() ? w.tmp.as<float>() : hidden;
  if (lw.sparse) {
    if (tp()) RETURN_IF_ERROR(b.Zero({.x = out, .n = tokens * h}));
    RETURN_IF_ERROR(Moe(lw, tokens, out));
  } else {
    RETURN_IF_ERROR(Mlp(lw.mlp, normed, out, tokens, /*accumulate=*/!tp()));
  }
  if (!tp()) return absl::OkStatus();
  RETURN_IF_ERROR(AllReduce(out, tokens * h));
  // Added by the next layer's AddRmsNorm, or at the end of Forward.
  pending_residual_ = out;
  return absl::OkStatus();
}

absl::Status Model::SandwichLayer(int64_t layer, const LayerWeights& lw, int64_t tokens,
                                  const kernels::PagedSeqs& paged) {
  Workspace& w = *ws_;
  kernels::Backend& b = *backend_;
  const int64_t h = spec_.hidden_size;
  const float eps = static_cast<float>(spec_.rms_norm_eps);
  float* hidden = w.hidden.as<float>();
  float* normed = w.normed.as<float>();
  float* tmp = w.tmp.as<float>();
  RETURN_IF_ERROR(b.RmsNorm({.x = hidden, .weight = lw.input_norm.as<float>(), .y = normed, .tokens = tokens,
                             .hidden = h, .eps = eps}));
  RETURN_IF_ERROR(GqaAttention(layer, lw, tokens, paged));
  RETURN_IF_ERROR(b.Linear({.x = w.attn.as<float>(), .w = lw.o.view(), .bias = lw.o.bias(), .y = tmp,
                            .tokens = tokens, .in = lw.o.in, .out = lw.o.out}));
  RETURN_IF_ERROR(AllReduce(tmp, tokens * h));
  // hidden += PostAttentionNorm(attn); normed = PreFeedforwardNorm(hidden).
  RETURN_IF_ERROR(b.RmsNorm({.x = tmp, .weight = lw.post_norm.as<float>(), .y = tmp, .tokens = tokens, .hidden = h,
                             .eps = eps}));
  RETURN_IF_ERROR(b.AddRmsNorm({.x = hidden, .y = tmp, .weight = lw.pre_ffn_norm.as<float>(), .out = normed,
                                .tokens = tokens, .hidden = h, .eps = eps}));
  RETURN_IF_ERROR(Mlp(lw.mlp, normed, tmp, tokens, /*accumulate=*/false));
  RETURN_IF_ERROR(AllReduce(tmp, tokens * h));
  RETURN_IF_ERROR(b.RmsNorm({.x = tmp, .weight = lw.post_ffn_norm.as<float>(), .y = tmp, .tokens = tokens,
                             .hidden = h, .eps = eps}));
  return b.Add({.x = hidden, .y = tmp, .n = tokens * h});
}

absl::Status Model::GqaAttention(int64_t layer, const LayerWeights& lw, int64_t tokens,
                                 const kernels::PagedSeqs& paged,
                                 std::optional<kernels::LinearGroupParams::Norm> input_norm) {
  Workspace& w = *ws_;
  kernels::Backend& b = *backend_;
  const int64_t d = spec_.head_dim;
  const float eps = static_cast<float>(spec_.rms_norm_eps);
  // q, k and v in one op (one launch for a decode step on a GPU), the input norm fused when given.
  RETURN_IF_ERROR(b.LinearGroup({.x = input_norm.has_value() ? w.hidden.as<float>() : w.normed.as<float>(),
                                 .tokens = tokens,
                                 .in = lw.q.in,
                                 .parts = {{GroupPart(lw.q, w.q.as<float>()), GroupPart(lw.k, w.k.as<float>()),
                                            GroupPart(lw.v, w.v.as<float>())}},
                                 .num_parts = 3,
                                 .norm = input_norm}));
  // Every head of q and k RMS-normalised on its own: the heads are contiguous rows of head_dim, so
  // this is the RmsNorm op over tokens x heads rows.
  auto norm_heads = [&](const float* q_weight, const float* k_weight) -> absl::Status {
    RETURN_IF_ERROR(b.RmsNorm({.x = w.q.as<float>(), .weight = q_weight, .y = w.q.as<float>(),
                               .tokens = tokens * layout_.q_heads, .hidden = d, .eps = eps}));
    return b.RmsNorm({.x = w.k.as<float>(), .weight = k_weight, .y = w.k.as<float>(),
                      .tokens = tokens * layout_.kv_heads, .hidden = d, .eps = eps});
  };
  // Qwen3: with weights, before RoPE.
  if (spec_.qk_norm) RETURN_IF_ERROR(norm_heads(lw.q_norm.as<float>(), lw.k_norm.as<float>()));
  const bool rope = spec_.LayerUsesRope(layer);
  // RoPE rides on the cache write (one launch instead of two on a GPU) when nothing runs between
  // them. Not with Llama-4's weightless q/k norm (after RoPE) or its NoPE layers' query temperature
  // (they change q or k in between; the rotation would then come after them), nor with LongRoPE
  // (its sequences rotate in runs, each with its own frequencies).
  const bool rope_in_write = rope && !spec_.qk_l2_norm && !spec_.LayerTemperatureTuned(layer) &&
                             spec_.rope.type != RopeType::kLongrope;
  if (rope && !rope_in_write) {
    RETURN_IF_ERROR(RopeQk(layer, tokens, paged));
    // Llama-4: without weights, after RoPE.
    if (spec_.qk_l2_norm) RETURN_IF_ERROR(norm_heads(w.ones.as<float>(), w.ones.as<float>()));
  }
  if (spec_.LayerTemperatureTuned(layer)) {
    RETURN_IF_ERROR(b.ScaleRows({.x = w.q.as<float>(), .scales = w.query_temp.as<float>(), .tokens = tokens,
                                 .width = layout_.q_heads * d}));
  }
  const kernels::AttentionParams attention = AttentionFor(layer, tokens, paged);
  kernels::KvWriteParams write{.k = w.k.as<float>(), .v = w.v.as<float>(), .paged = paged, .tokens = tokens,
                               .cache = attention.cache};
  if (rope_in_write) write.rope = RopeFor(layer, tokens);
  RETURN_IF_ERROR(b.KvWrite(write));
  RETURN_IF_ERROR(b.Attention(attention));
  return absl::OkStatus();
}

kernels::RopeParams Model::RopeFor(int64_t layer, int64_t tokens) const {
  const Workspace& w = *ws_;
  // LongRoPE's and YaRN's attention factor scales cos and sin.
  const bool scaled = spec_.rope.type == RopeType::kLongrope || spec_.rope.type == RopeType::kYarn;
  // A layer with its own RoPE has its own table (Workspace::inv_freq_layer).
  const DeviceBuffer* table = &w.inv_freq;
  float position_scale = w.position_scale;
  if (const size_t l = static_cast<size_t>(layer); l < w.inv_freq_layer.size() && !w.inv_freq_layer[l].empty()) {
    table = &w.inv_freq_layer[l];
    position_scale = w.position_scale_layer[l];
  }
  return {.q = w.q.as<float>(), .k = w.k.as<float>(), .positions = w.positions.as<int32_t>(),
          .inv_freq = table->as<float>(), .tokens = tokens,
          .q_heads = layout_.q_heads, .kv_heads = layout_.kv_heads, .head_dim = spec_.head_dim,
          .position_scale = position_scale,
          .rotary_dim = spec_.RotaryDim(),
          .scale = scaled ? static_cast<float>(spec_.rope.attention_factor) : 1.0f};
}

absl::Status Model::RopeQk(int64_t layer, int64_t tokens, const kernels::PagedSeqs& paged) {
  Workspace& w = *ws_;
  const int64_t d = spec_.head_dim;
  const kernels::RopeParams p = RopeFor(layer, tokens);
  if (spec_.rope.type != RopeType::kLongrope) return backend_->Rope(p);
  // LongRoPE, as transformers' KV-cache generation: a step's new tokens of a sequence rotate with
  // the long factors when the sequence is longer than original_max_position_embeddings at the end
  // of the step, else with the short ones. Runs of sequences that agree share one call.
  const int64_t original = spec_.rope.original_max_position_embeddings;
  auto is_long = [&](const AttnSeq& a) { return int64_t{a.pos_begin} + a.q_len > original; };
  for (int64_t s = 0; s < paged.num_seqs;) {
    const bool long_run = is_long(paged.host_seqs[s]);
    const int64_t begin = paged.host_seqs[s].q_begin;
    int64_t end = begin;
    for (; s < paged.num_seqs && is_long(paged.host_seqs[s]) == long_run; ++s) {
      end = paged.host_seqs[s].q_begin + paged.host_seqs[s].q_len;
    }
    kernels::RopeParams run = p;
    run.q = p.q + begin * layout_.q_heads * d;
    run.k = p.k + begin * layout_.kv_heads * d;
    run.positions = p.positions + begin;
    run.tokens = end - begin;
    run.inv_freq = long_run ? w.inv_freq_long.as<float>() : w.inv_freq.as<float>();
    RETURN_IF_ERROR(backend_->Rope(run));
  }
  return absl::OkStatus();
}

absl::Status Model::MlaAttention(int64_t layer, const LayerWeights& lw, int64_t tokens,
                                 const kernels::PagedSeqs& paged) {
  Workspace& w = *ws_;
  kernels::Backend& b = *backend_;
  const MlaSpec& m = spec_.mla;
  const int64_t heads = layout_.q_heads;
  const int64_t lat = m.kv_lora_rank, rope = m.qk_rope_head_dim, nope = m.qk_nope_head_dim;
  // transformers builds q_a_layernorm and kv_a_layernorm with the RMSNorm default eps.
  constexpr float kLatentEps = 1e-6f;
  float* normed = w.normed.as<float>();
  // The down-projections of x: the query's (when compressed), the latent and the RoPE key.
  kernels::LinearGroupParams down{.x = normed, .tokens = tokens, .in = spec_.hidden_size};
  if (m.q_lora_rank > 0) down.parts[static_cast<size_t>(down.num_parts++)] = GroupPart(lw.q_a, w.mla_qa.as<float>());
  down.parts[static_cast<size_t>(down.num_parts++)] = GroupPart(lw.kv_latent, w.mla_latent.as<float>());
  down.parts[static_cast<size_t>(down.num_parts++)] = GroupPart(lw.kv_rope, w.mla_k_rope.as<float>());
  RETURN_IF_ERROR(b.LinearGroup(down));
  const float* q_in = normed;
  if (m.q_lora_rank > 0) {
    RETURN_IF_ERROR(b.RmsNorm({.x = w.mla_qa.as<float>(), .weight = lw.q_a_norm.as<float>(), .y = w.mla_qa.as<float>(),
                               .tokens = tokens, .hidden = m.q_lora_rank, .eps = kLatentEps}));
    q_in = w.mla_qa.as<float>();
  }
  RETURN_IF_ERROR(b.LinearGroup({.x = q_in,
                                 .tokens = tokens,
                                 .in = lw.q_nope.in,
                                 .parts = {{GroupPart(lw.q_nope, w.mla_q_nope.as<float>()),
                                            GroupPart(lw.q_rope, w.mla_q_rope.as<float>())}},
                                 .num_parts = 2}));
  RETURN_IF_ERROR(b.RmsNorm({.x = w.mla_latent.as<float>(), .weight = lw.kv_a_norm.as<float>(),
                             .y = w.mla_latent.as<float>(), .tokens = tokens, .hidden = lat, .eps = kLatentEps}));
  RETURN_IF_ERROR(b.Rope({.q = w.mla_q_rope.as<float>(), .k = w.mla_k_rope.as<float>(),
                          .positions = w.positions.as<int32_t>(), .inv_freq = w.inv_freq.as<float>(),
                          .tokens = tokens, .q_heads = heads, .kv_heads = 1, .head_dim = rope,
                          .position_scale = w.position_scale}));
  // Absorb each head's key up-projection into its query: q_latent[h] = W_UK[h]^T q_nope[h].
  RETURN_IF_ERROR(b.HeadLinear({.x = w.mla_q_nope.as<float>(), .w = lw.w_uk.view(), .y = w.mla_q_latent.as<float>(),
                                .tokens = tokens, .heads = heads, .in = nope, .out = lat, .x_width = nope,
                                .x_offset = 0, .y_width = lat, .y_offset = 0}));
  const kernels::MlaCacheView cache{.data = k_cache_[static_cast<size_t>(layer - options_.layer_begin)].as<void>(),
                                    .num_blocks = options_.num_kv_blocks,
                                    .block_size = options_.kv_block_size,
                                    .latent_dim = lat,
                                    .rope_dim = rope,
                                    .dtype = kv_dtype_};
  RETURN_IF_ERROR(b.MlaKvWrite({.latent = w.mla_latent.as<float>(), .rope = w.mla_k_rope.as<float>(), .paged = paged,
                                .tokens = tokens, .cache = cache}));
  const double af = spec_.rope.type == RopeType::kYarn ? spec_.rope.attention_factor : 1.0;
  RETURN_IF_ERROR(b.MlaAttention({.q_latent = w.mla_q_latent.as<float>(), .q_rope = w.mla_q_rope.as<float>(),
                                  .out = w.mla_out.as<float>(), .paged = paged, .tokens = tokens, .q_heads = heads,
                                  .cache = cache, .scale = static_cast<float>(spec_.AttentionScale()),
                                  .rope_scale = static_cast<float>(af * af)}));
  // Each head's value up-projection: attn[h] = W_UV[h] out[h], the o projection's input.
  return b.HeadLinear({.x = w.mla_out.as<float>(), .w = lw.w_uv.view(), .y = w.attn.as<float>(), .tokens = tokens,
                       .heads = heads, .in = lat, .out = m.v_head_dim, .x_width = lat, .x_offset = 0,
                       .y_width = m.v_head_dim, .y_offset = 0});
}

absl::Status Model::Mlp(const MlpWeights& mw, const float* x, float* y, int64_t tokens, bool accumulate,
                        std::optional<kernels::LinearGroupParams::Norm> norm) {
  Workspace& w = *ws_;
  kernels::Backend& b = *backend_;
  // gate = act(x . gate^T) * (x . up^T) in one op (on a GPU's decode step, one launch for the two
  // products and the activation); w.up is its scratch.
  RETURN_IF_ERROR(b.LinearGroup({.x = x,
                                 .tokens = tokens,
                                 .in = mw.gate.in,
                                 .parts = {{GroupPart(mw.gate, w.gate.as<float>()), GroupPart(mw.up, w.up.as<float>())}},
                                 .num_parts = 2,
                                 .gated = GateActivationOf(spec_),
                                 .norm = norm}));
  return b.Linear({.x = w.gate.as<float>(), .w = mw.down.view(), .bias = mw.down.bias(), .y = y, .tokens = tokens,
                   .in = mw.down.in, .out = mw.down.out, .accumulate = accumulate});
}

// Adds this rank's share of the MoE block's output to `out`: its local experts' contributions (or
// its slice of every expert) and its slice of the shared expert.
absl::Status Model::Moe(const LayerWeights& lw, int64_t tokens, float* out) {
  Workspace& w = *ws_;
  kernels::Backend& b = *backend_;
  const int64_t h = spec_.hidden_size;
  const int64_t e_count = spec_.moe.num_experts;
  float* normed = w.normed.as<float>();

  // Route on the device: router logits [tokens, experts] -> each token's top-k experts and weights,
  // grouped by expert (rows of expert e are [offset[e], offset[e+1])); only the offsets come back.
  RETURN_IF_ERROR(b.Linear({.x = normed, .w = lw.router.view(), .bias = lw.router.bias(), .y = w.router.as<float>(),
                            .tokens = tokens, .in = h, .out = e_count}));
  const MoeSpec& ms = spec_.moe;
  std::vector<int32_t>& offset = w.h_moe_offsets;
  offset.resize(static_cast<size_t>(e_count + 1));
  // The device path leaves the offsets on the device (this layer's slot, read back after the step
  // for the expert-token counts: ReportDeviceExpertTokens).
  const bool on_device = MoeOnDevice(tokens);
  int32_t* device_offsets = w.moe_offsets.as<int32_t>() + (lw.layer - options_.layer_begin) * (e_count + 1);
  RETURN_IF_ERROR(b.MoeRoute({.logits = w.router.as<float>(),
                              .score_bias = lw.score_bias.empty() ? nullptr : lw.score_bias.as<float>(),
                              .offsets = device_offsets,
                              .rows = w.moe_rows.as<int32_t>(),
                              .scales = w.moe_scales.as<float>(),
                              .host_offsets = on_device ? nullptr : offset.data(),
                              .tokens = tokens,
                              .routing = MoeRoutingOf(ms)}));
  if (on_device) {
    RETURN_IF_ERROR(GroupedExperts(lw, tokens, nullptr, device_offsets, out));
    return SharedExpert(lw, tokens, out);
  }
  if (options_.observer != nullptr && options_.shard.rank == 0) {
    for (int64_t e = 0; e < e_count; ++e) {
      const int64_t n = offset[static_cast<size_t>(e + 1)] - offset[static_cast<size_t>(e)];
      if (n > 0) options_.observer->OnExpertTokens(lw.layer, e, n);
    }
  }

  // Llama-4: the routing weight scales each expert's input, and the outputs add up unscaled.
  const bool input_weighted = ms.scoring == MoeScoring::kSigmoidInput;
  // Experts on other workers (rank 0 only): send their rows first, compute the local experts
  // meanwhile, then add the answers.
  std::unique_ptr<RemoteExpertCall> remote;
  if (lw.has_remote_experts && options_.shard.rank == 0) {
    w.h_remote_groups.clear();
    int64_t rows = 0;
    for (int64_t e = 0; e < e_count; ++e) {
      const int64_t begin = offset[static_cast<size_t>(e)];
      const int64_t count = offset[static_cast<size_t>(e + 1)] - begin;
      if (count == 0 || !lw.IsRemoteExpert(e)) continue;
      RETURN_IF_ERROR(b.GatherRows({.src = normed, .rows = w.moe_rows.as<int32_t>() + begin,
                                    .dst = w.remote_x.as<float>() + rows * h, .count = count, .src_rows = tokens,
                                    .width = h}));
      if (input_weighted) {
        RETURN_IF_ERROR(b.ScaleRows({.x = w.remote_x.as<float>() + rows * h,
                                     .scales = w.moe_scales.as<float>() + begin, .tokens = count, .width = h}));
      }
      w.h_remote_groups.push_back({.expert = static_cast<int32_t>(e), .rows = static_cast<int32_t>(count)});
      rows += count;
    }
    if (rows > 0) {
      w.h_remote_x.resize(static_cast<size_t>(rows * h));
      w.h_remote_y.resize(static_cast<size_t>(rows * h));
      RETURN_IF_ERROR(b.CopyToHost(w.h_remote_x.data(), w.remote_x.as<float>(), w.h_remote_x.size() * sizeof(float)));
      remote = options_.remote_experts->Start(lw.layer, w.h_remote_groups, w.h_remote_x, absl::MakeSpan(w.h_remote_y));
    }
  }
  absl::Status local = LocalExperts(lw, tokens, offset, out);
  if (remote != nullptr) {
    // Always wait: the call writes into the workspace.
    absl::Status st = remote->Wait();
    RETURN_IF_ERROR(local);
    if (!st.ok()) {
      // The other ranks are on their way to this layer's all-reduce: finish the step with them
      // (the answer is wrong, and Step reports the failure instead of it), so that the group stays
      // in step and the next batch can run when the host is back. Not InvalidArgument, which reads
      // as a bad batch.
      const absl::StatusCode code =
          st.code() == absl::StatusCode::kInvalidArgument ? absl::StatusCode::kInternal : st.code();
      if (deferred_.ok()) {
        deferred_ = absl::Status(code, absl::StrCat("remote experts of layer ", lw.layer, ": ", st.message()));
      }
      return absl::OkStatus();
    }
    RETURN_IF_ERROR(b.CopyToDevice(w.remote_x.as<void>(), w.h_remote_y.data(), w.h_remote_y.size() * sizeof(float)));
    int64_t rows = 0;
    for (const ExpertRows& g : w.h_remote_groups) {
      const int64_t begin = offset[static_cast<size_t>(g.expert)];
      RETURN_IF_ERROR(b.ScatterAddRows({.src = w.remote_x.as<float>() + rows * h,
                                        .rows = w.moe_rows.as<int32_t>() + begin,
                                        .scales = input_weighted ? w.ones.as<float>() : w.moe_scales.as<float>() + begin,
                                        .dst = out, .count = g.rows,
                                        .dst_rows = tokens, .width = h}));
      rows += g.rows;
    }
  }
  return local;
}

absl::Status Model::LocalExperts(const LayerWeights& lw, int64_t tokens, const std::vector<int32_t>& offset,
                                 float* out) {
  Workspace& w = *ws_;
  kernels::Backend& b = *backend_;
  const int64_t h = spec_.hidden_size;
  const int64_t e_count = spec_.moe.num_experts;
  const bool input_weighted = spec_.moe.scoring == MoeScoring::kSigmoidInput;
  float* normed = w.normed.as<float>();
  if (grouped_experts_) RETURN_IF_ERROR(GroupedExperts(lw, tokens, &offset, nullptr, out));
  for (int64_t e = 0; e < e_count && !grouped_experts_; ++e) {
    const int64_t begin = offset[static_cast<size_t>(e)];
    const int64_t count = offset[static_cast<size_t>(e + 1)] - begin;
    if (count == 0 || !lw.IsLocalExpert(e, layout_)) continue;
    const int32_t* rows = w.moe_rows.as<int32_t>() + begin;
    RETURN_IF_ERROR(b.GatherRows({.src = normed, .rows = rows, .dst = w.moe_x.as<float>(), .count = count,
                                  .src_rows = tokens, .width = h}));
    if (input_weighted) {
      RETURN_IF_ERROR(b.ScaleRows({.x = w.moe_x.as<float>(), .scales = w.moe_scales.as<float>() + begin,
                                   .tokens = count, .width = h}));
    }
    RETURN_IF_ERROR(Mlp(lw.experts[static_cast<size_t>(e)], w.moe_x.as<float>(), w.moe_y.as<float>(), count,
                        /*accumulate=*/false));
    RETURN_IF_ERROR(b.ScatterAddRows({.src = w.moe_y.as<float>(), .rows = rows,
                                      .scales = input_weighted ? w.ones.as<float>() : w.moe_scales.as<float>() + begin,
                                      .dst = out, .count = count, .dst_rows = tokens, .width = h}));
  }
  return SharedExpert(lw, tokens, out);
}

absl::Status Model::SharedExpert(const LayerWeights& lw, int64_t tokens, float* out) {
  Workspace& w = *ws_;
  kernels::Backend& b = *backend_;
  const int64_t h = spec_.hidden_size;
  float* normed = w.normed.as<float>();
  if (layout_.shared_ffn > 0) {
    // out += sigmoid(x . g) * SharedMlp(x); the gate is linear in the (partial) MLP output, so
    // each rank may scale its own slice before the all-reduce.
    if (!spec_.moe.shared_expert_gate) {
      // DeepSeek-V3: out += SharedMlp(x), ungated.
      return Mlp(lw.shared, normed, out, tokens, /*accumulate=*/true);
    }
    float* shared = w.moe_y.as<float>();
    RETURN_IF_ERROR(Mlp(lw.shared, normed, shared, tokens, /*accumulate=*/false));
    RETURN_IF_ERROR(b.Linear({.x = normed, .w = lw.shared_gate.view(), .y = w.shared_gate.as<float>(),
                              .tokens = tokens, .in = h, .out = 1}));
    RETURN_IF_ERROR(b.SigmoidScaleRows({.x = shared, .gate = w.shared_gate.as<float>(), .tokens = tokens, .width = h}));
    RETURN_IF_ERROR(b.Add({.x = out, .y = shared, .n = tokens * h}));
  }
  return absl::OkStatus();
}

absl::Status Model::GroupedExperts(const LayerWeights& lw, int64_t tokens, const std::vector<int32_t>* offset,
                                   const int32_t* device_offsets, float* out) {
  Workspace& w = *ws_;
  kernels::Backend& b = *backend_;
  const int64_t h = spec_.hidden_size;
  const int64_t ffn = layout_.expert_ffn;
  const int64_t e_count = spec_.moe.num_experts;
  const bool input_weighted = spec_.moe.scoring == MoeScoring::kSigmoidInput;
  // The groups: from the host offsets (the groups with rows), or the held experts over the device
  // offsets.
  const Workspace::HeldExperts* held = nullptr;
  kernels::DeviceExpertGroups device;
  w.h_gate_groups.clear();
  w.h_up_groups.clear();
  w.h_down_groups.clear();
  if (device_offsets != nullptr) {
    held = &w.held[static_cast<size_t>(lw.layer - options_.layer_begin)];
    if (held->ids.empty()) return absl::OkStatus();
    // A token picks an expert at most once: no group has more rows than the step has tokens.
    device = {.offsets = device_offsets, .host_ids = held->ids.data(), .ids = held->d_ids.as<int32_t>(),
              .num_experts = e_count, .num_held = static_cast<int64_t>(held->ids.size()),
              .max_rows_per_group = tokens};
  } else {
    for (int64_t e = 0; e < e_count; ++e) {
      const int64_t begin = (*offset)[static_cast<size_t>(e)];
      const int64_t count = (*offset)[static_cast<size_t>(e + 1)] - begin;
      if (count == 0 || !lw.IsLocalExpert(e, layout_)) continue;
      const MlpWeights& mw = lw.experts[static_cast<size_t>(e)];
      w.h_gate_groups.push_back({.w = mw.gate.view(), .begin = begin, .count = count});
      w.h_up_groups.push_back({.w = mw.up.view(), .begin = begin, .count = count});
      w.h_down_groups.push_back({.w = mw.down.view(), .begin = begin, .count = count});
    }
    if (w.h_gate_groups.empty()) return absl::OkStatus();
  }
  // Every routed row, the remote and other ranks' experts' too (no group reads those): one gather.
  // MoeRoute's offsets end at tokens x top_k.
  const int64_t rows = tokens * spec_.moe.top_k;
  float* x = w.grouped_x.as<float>();
  RETURN_IF_ERROR(b.GatherRows({.src = w.normed.as<float>(), .rows = w.moe_rows.as<int32_t>(), .dst = x, .count = rows,
                                .src_rows = tokens, .width = h}));
  if (input_weighted) {
    RETURN_IF_ERROR(b.ScaleRows({.x = x, .scales = w.moe_scales.as<float>(), .tokens = rows, .width = h}));
  }
  const int64_t num_groups = static_cast<int64_t>(w.h_gate_groups.size());
  // Projection `which` (0 gate, 1 up, 2 down) of the groups, in the form at hand.
  auto project = [&](int which, const float* in_rows, float* out_rows, int64_t in, int64_t out_width) {
    kernels::GroupedLinearParams p{.x = in_rows, .y = out_rows, .rows = rows, .in = in, .out = out_width};
    if (held != nullptr) {
      const std::vector<kernels::WeightView>* views[] = {&held->gate, &held->up, &held->down};
      p.device = device;
      p.host_weights = views[which]->data();
      p.weights = held->d_weights.as<const void*>() + which * device.num_held;
    } else {
      const std::vector<kernels::GroupedLinearParams::Group>* groups[] = {&w.h_gate_groups, &w.h_up_groups,
                                                                          &w.h_down_groups};
      p.groups = groups[which]->data();
      p.num_groups = num_groups;
    }
    return b.GroupedLinear(p);
  };
  RETURN_IF_ERROR(project(0, x, w.grouped_gate.as<float>(), h, ffn));
  RETURN_IF_ERROR(project(1, x, w.grouped_up.as<float>(), h, ffn));
  RETURN_IF_ERROR(b.SiluMul({.gate = w.grouped_gate.as<float>(), .up = w.grouped_up.as<float>(),
                             .out = w.grouped_gate.as<float>(), .n = rows * ffn,
                             .act = GateActivationOf(spec_)}));
  // The down projection overwrites the gathered input, which nothing reads any more.
  RETURN_IF_ERROR(project(2, w.grouped_gate.as<float>(), x, ffn, h));
  // Each token's expert outputs added to it in one pass where the backend can (the same sums in the
  // same order as the scatters below; the device path requires it).
  if (held != nullptr || b.SupportsOp(kernels::Op::kMoeCombine, DType::kF32)) {
    return b.MoeCombine({.src = x, .rows = w.moe_rows.as<int32_t>(),
                         .scales = input_weighted ? nullptr : w.moe_scales.as<float>(), .dst = out,
                         .groups = held != nullptr ? nullptr : w.h_down_groups.data(),
                         .num_groups = held != nullptr ? 0 : num_groups, .count = rows,
                         .tokens = tokens, .width = h, .device = device});
  }
  for (const kernels::GroupedLinearParams::Group& g : w.h_down_groups) {
    RETURN_IF_ERROR(b.ScatterAddRows(
        {.src = x + g.begin * h, .rows = w.moe_rows.as<int32_t>() + g.begin,
         .scales = input_weighted ? w.ones.as<float>() : w.moe_scales.as<float>() + g.begin, .dst = out,
         .count = g.count, .dst_rows = tokens, .width = h}));
  }
  return absl::OkStatus();
}

}  // namespace shardserve::engine

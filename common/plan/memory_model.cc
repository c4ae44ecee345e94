#include "common/plan/memory_model.h"

#include <algorithm>
#include <string>

namespace shardserve {
namespace {

constexpr int64_t kF32 = 4;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Local KV heads of a rank (replicated when there are fewer than ranks), as ShardLayout.
int64_t LocalKvHeads(const ModelSpec& s, int tp) { return s.num_kv_heads % tp == 0 ? s.num_kv_heads / tp : 1; }

// Bytes of a gate/up/down MLP of local width `width` starting at column `begin` of the full MLP,
// without biases: gate and up rows [begin, begin + width), down columns the same.
int64_t MlpBytes(const WeightFormats& f, int64_t hidden, int64_t width, int64_t begin = 0) {
  return 2 * ProjectionBytes(f, width, hidden, begin, 0) + ProjectionBytes(f, hidden, width, 0, begin);
}

// Bytes of one routed expert's gate/up/down of local width `width` starting at column `begin`:
// MlpBytes, but MXFP4 matrices kept as such where their columns are whole scale blocks.
int64_t ExpertMlpBytes(const WeightFormats& f, int64_t hidden, int64_t width, int64_t begin = 0) {
  if (!f.mxfp4_experts) return MlpBytes(f, hidden, width, begin);
  constexpr int64_t kBlock = 32;
  const int64_t gate_up = 2 * Mxfp4MatrixBytes(width, hidden);
  const bool whole_blocks = width % kBlock == 0 && begin % kBlock == 0;
  return gate_up + (whole_blocks ? Mxfp4MatrixBytes(hidden, width) : ProjectionBytes(f, hidden, width, 0, begin));
}

// Bytes of a matrix whose rows the loader picks one by one (dequantized when FP8).
int64_t PickedBytes(const WeightFormats& f, int64_t rows, int64_t cols) {
  return f.fp8 ? rows * cols * f.dequantized_bytes : ProjectionBytes(f, rows, cols);
}

// The first global KV head of rank `rank` (ShardLayout::kv_head_begin).
int64_t KvHeadBegin(const ModelSpec& s, int tp, int rank) {
  if (s.num_kv_heads % tp == 0) return s.num_kv_heads / tp * rank;
  return s.num_heads / tp * rank / (s.num_heads / s.num_kv_heads);
}

// Whether the checkpoint's lm_head is F8_E4M3: unless modules_to_not_convert / ignored_layers
// names it (Hugging Face matches the entries as substrings of the module name).
bool LmHeadIsFp8(const ModelSpec& s) {
  if (!s.fp8.has_value()) return false;
  for (const std::string& m : s.fp8->modules_not_converted) {
    if (!m.empty() && (std::string("lm_head").find(m) != std::string::npos || m.find("lm_head") != std::string::npos)) {
      return false;
    }
  }
  return true;
}

// Attention of one layer on one rank: projections into `b->matrices`, norms and biases into `b->f32`.
void AttentionBytes(const ModelSpec& s, int tp, int rank, const WeightFormats& f, LayerRankBytes* b) {
  const int64_t h = s.hidden_size, d = s.head_dim;
  b->f32 += 2 * h * kF32;                       // input and post-attention norms
  if (s.sandwich_norms) b->f32 += 2 * h * kF32;  // Gemma-2's pre- and post-feedforward norms
  if (s.qk_norm) b->f32 += 2 * d * kF32;         // per-head q/k norm weights
  const int64_t heads = s.num_heads / tp;
  if (s.attention_sinks) b->f32 += heads * kF32;  // the rank's heads' sink logits
  if (s.IsMla()) {
    const MlaSpec& m = s.mla;
    const int64_t in_q = m.q_lora_rank > 0 ? m.q_lora_rank : h;
    if (m.q_lora_rank > 0) {
      b->matrices += ProjectionBytes(f, m.q_lora_rank, h);
      b->f32 += m.q_lora_rank * kF32;  // q_a_layernorm
    }
    // q_nope and q_rope rows are picked per head, as is the RoPE key's reordering.
    b->matrices += PickedBytes(f, heads * m.qk_nope_head_dim, in_q) + PickedBytes(f, heads * m.qk_rope_head_dim, in_q);
    b->matrices += ProjectionBytes(f, m.kv_lora_rank, h) + PickedBytes(f, m.qk_rope_head_dim, h);
    b->f32 += m.kv_lora_rank * kF32;  // kv_a_layernorm
    b->matrices += heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank * f.head_linear_bytes;
    b->matrices += ProjectionBytes(f, h, heads * m.v_head_dim, 0, rank * heads * m.v_head_dim);
    return;
  }
  const int64_t q = heads * d, kv = LocalKvHeads(s, tp) * d;
  const int64_t qb = rank * q, kb = KvHeadBegin(s, tp, rank) * d;
  const int64_t q_out = s.num_heads * d, kv_out = s.num_kv_heads * d;
  if (s.fused_qkv) {
    // Phi-3's qkv_proj: q rows, then k rows, then v rows of one matrix.
    b->matrices += ProjectionBytes(f, q, h, qb, 0) + ProjectionBytes(f, kv, h, q_out + kb, 0) +
                   ProjectionBytes(f, kv, h, q_out + kv_out + kb, 0);
  } else if (s.rope_interleaved) {
    b->matrices += PickedBytes(f, q, h) + PickedBytes(f, kv, h) + ProjectionBytes(f, kv, h, kb, 0);
  } else {
    b->matrices += ProjectionBytes(f, q, h, qb, 0) + 2 * ProjectionBytes(f, kv, h, kb, 0);
  }
  b->matrices += ProjectionBytes(f, h, q, 0, qb);
  if (s.qkv_bias) b->f32 += (q + 2 * kv) * kF32;
  if (s.o_bias && rank == 0) b->f32 += h * kF32;
}

}  // namespace

WeightFormats WorkerWeightFormats(const ModelSpec& spec, bool cuda, Quantization quantize, KvCacheFormat kv_cache) {
  WeightFormats f = WorkerWeightFormats(spec, cuda, quantize);
  // An FP8 KV cache: 1 byte per element on both backends (MLA is refused before it is planned).
  if (kv_cache == KvCacheFormat::kFp8E4M3 && !spec.IsMla()) f.kv_bytes = 1;
  return f;
}

WeightFormats WorkerWeightFormats(const ModelSpec& spec, bool cuda, Quantization quantize) {
  // An F8_E4M3 config dtype is read as what its tensors become: bf16.
  DType stored = spec.dtype.value_or(DType::kF32);
  if (stored == DType::kF8E4M3) stored = DType::kBF16;
  const int64_t narrow = stored == DType::kBF16 || stored == DType::kF16 ? 2 : 4;
  WeightFormats f;
  if (cuda) {
    // Linear, Embedding, KvWrite and Attention take f32, bf16 and f16; Linear F8_E4M3 too. Multi-head
    // latent attention does not run on CUDA yet: it is counted as if its ops took them too.
    f.matrix_bytes = narrow;
    if (spec.fp8.has_value()) {
      f.matrix_bytes = 1;
      f.dequantized_bytes = 2;
      f.fp8 = true;
      f.fp8_block_rows = spec.fp8->block_rows;
      f.fp8_block_cols = spec.fp8->block_cols;
    }
    f.embedding_bytes = f.tied_embedding_bytes = narrow;
    f.head_linear_bytes = spec.fp8.has_value() ? 2 : narrow;
    f.kv_bytes = narrow;
    f.mxfp4_experts = spec.mxfp4.has_value();
    return f;
  }
  // CPU: Linear and HeadLinear take f32 and bf16 (and kQ8), Embedding any float dtype, the KV
  // cache f32 only.
  const int64_t bf16_only = stored == DType::kBF16 ? 2 : 4;
  f.matrix_bytes = spec.fp8.has_value() ? 2 : bf16_only;
  f.head_linear_bytes = f.matrix_bytes;
  f.int8 = quantize == Quantization::kInt8;
  f.mxfp4_experts = spec.mxfp4.has_value();
  f.embedding_bytes = narrow;
  f.tied_embedding_bytes = bf16_only;  // the table must also be a Linear matrix
  f.kv_bytes = 4;
  return f;
}

int64_t ProjectionBytes(const WeightFormats& formats, int64_t rows, int64_t cols, int64_t row0, int64_t col0) {
  if (formats.int8) return Q8MatrixBytes(rows, cols);
  const int64_t scales =
      formats.fp8 ? Fp8ScaleBytes(rows, cols, row0, col0, formats.fp8_block_rows, formats.fp8_block_cols) : 0;
  return rows * cols * formats.matrix_bytes + scales;
}

int64_t Fp8ScaleBytes(int64_t rows, int64_t cols, int64_t row0, int64_t col0, int64_t block_rows, int64_t block_cols) {
  if (rows <= 0 || cols <= 0) return 0;
  if (block_rows <= 0 || block_cols <= 0) return kF32;
  const int64_t grid_rows = CeilDiv(row0 % block_rows + rows, block_rows);
  const int64_t grid_cols = CeilDiv(col0 % block_cols + cols, block_cols);
  return grid_rows * grid_cols * kF32;
}

bool IsExpertParallel(const ModelSpec& spec, int tp, bool split_experts) {
  return spec.IsMoe() && spec.moe.num_experts >= tp && tp > 1 && !split_experts;
}

int64_t DefaultLocalExperts(const ModelSpec& spec, int tp, int rank, bool expert_parallel) {
  const int64_t n = spec.moe.num_experts;
  if (!expert_parallel) return n;
  // Expert e is on rank floor(e x tp / n): those with rank x n <= e x tp < (rank + 1) x n.
  return CeilDiv((rank + 1) * n, tp) - CeilDiv(rank * n, tp);
}

LayerRankBytes LayerBytes(const ModelSpec& spec, int64_t layer, int tp, int rank, bool expert_parallel,
                          const WeightFormats& formats) {
  LayerRankBytes b;
  AttentionBytes(spec, tp, rank, formats, &b);
  const int64_t h = spec.hidden_size;
  if (!spec.IsSparseLayer(layer)) {
    const int64_t ffn = spec.intermediate_size / tp;
    if (spec.fused_gate_up) {
      // Phi-3's gate_up_proj: gate rows [0, intermediate), then up rows.
      b.matrices += ProjectionBytes(formats, ffn, h, rank * ffn, 0) +
                    ProjectionBytes(formats, ffn, h, spec.intermediate_size + rank * ffn, 0) +
                    ProjectionBytes(formats, h, ffn, 0, rank * ffn);
    } else {
      b.matrices += MlpBytes(formats, h, ffn, rank * ffn);
    }
    // Phi-3's fused gate_up_proj has no biases.
    if (spec.mlp_bias && !spec.fused_gate_up) b.f32 += (2 * ffn + (rank == 0 ? h : 0)) * kF32;
    return b;
  }
  const MoeSpec& moe = spec.moe;
  b.f32 += moe.num_experts * h * kF32;  // router
  // DeepSeek-V3's score-correction bias, GPT-OSS's router bias.
  if (moe.scoring == MoeScoring::kSigmoidGrouped || moe.router_bias) b.f32 += moe.num_experts * kF32;
  const int64_t shared = moe.shared_expert_intermediate_size / tp;
  if (shared > 0) {
    b.matrices += MlpBytes(formats, h, shared, rank * shared);
    if (moe.shared_expert_gate) b.f32 += h * kF32;
  }
  const int64_t width = expert_parallel ? moe.expert_intermediate_size : moe.expert_intermediate_size / tp;
  b.expert = ExpertMlpBytes(formats, h, width, expert_parallel ? 0 : rank * width);
  // GPT-OSS's expert biases: gate and up of the local width; down on a whole expert's rank, or
  // rank 0 of an expert split over the ranks.
  if (moe.expert_bias) b.expert += (2 * width + (expert_parallel || rank == 0 ? h : 0)) * kF32;
  return b;
}

int64_t WholeExpertBytes(const ModelSpec& spec, const WeightFormats& formats) {
  if (!spec.IsMoe()) return 0;
  const int64_t width = spec.moe.expert_intermediate_size;
  const int64_t biases = spec.moe.expert_bias ? (2 * width + spec.hidden_size) * kF32 : 0;
  return ExpertMlpBytes(formats, spec.hidden_size, width) + biases;
}

EndBytes StageEndBytes(const ModelSpec& spec, bool has_embedding, bool has_lm_head, int tp,
                       const WeightFormats& formats, int rank) {
  EndBytes e;
  const int64_t table = spec.vocab_size * spec.hidden_size;
  const bool tied_here = has_lm_head && spec.tie_word_embeddings && tp == 1;
  if (tied_here) {
    e.embedding = table * formats.tied_embedding_bytes;
  } else if (has_embedding) {
    e.embedding = table * formats.embedding_bytes;
  }
  if (has_lm_head) {
    e.final_norm = spec.hidden_size * kF32;
    if (!tied_here) {
      // ceil(vocab / tp) rows from row min(rank x that, vocab), zero-padded (a padded FP8 slice's
      // scale grid covers its padding too).
      const int64_t rows = CeilDiv(spec.vocab_size, tp);
      if (formats.fp8 && !LmHeadIsFp8(spec)) {
        e.lm_head = rows * spec.hidden_size * formats.dequantized_bytes;
      } else {
        e.lm_head = ProjectionBytes(formats, rows, spec.hidden_size, std::min(rank * rows, spec.vocab_size), 0);
      }
    }
  }
  return e;
}

int64_t KvBytesPerTokenLayer(const ModelSpec& spec, int tp, const WeightFormats& formats) {
  return spec.KvValuesPerToken(tp) * formats.kv_bytes;
}

int64_t KvBytesPerBlock(const ModelSpec& spec, int64_t layers, int tp, int64_t block_size,
                        const WeightFormats& formats) {
  return layers * block_size * KvBytesPerTokenLayer(spec, tp, formats);
}

RankMemory RankMemoryOf(const ModelSpec& spec, const RankShard& shard, const WeightFormats& formats) {
  RankMemory m;
  const int64_t default_experts = spec.IsMoe() ? DefaultLocalExperts(spec, shard.tp, shard.rank, shard.expert_parallel) : 0;
  for (int64_t l = shard.layer_begin; l < shard.layer_end; ++l) {
    const LayerRankBytes b = LayerBytes(spec, l, shard.tp, shard.rank, shard.expert_parallel, formats);
    m.matrices += b.matrices;
    m.norms_biases += b.f32;
    if (spec.IsSparseLayer(l)) {
      const auto it = shard.local_experts.find(l);
      m.experts += (it != shard.local_experts.end() ? it->second : default_experts) * b.expert;
    }
  }
  const EndBytes e = StageEndBytes(spec, shard.has_embedding, shard.has_lm_head, shard.tp, formats, shard.rank);
  m.embedding = e.embedding;
  m.norms_biases += e.final_norm;
  m.lm_head = e.lm_head;
  m.kv_bytes_per_token = (shard.layer_end - shard.layer_begin) * KvBytesPerTokenLayer(spec, shard.tp, formats);
  return m;
}

}  // namespace shardserve

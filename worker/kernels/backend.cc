#include "worker/kernels/backend.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/status/macros.h"
#include "worker/kernels/shared/mxfp4_math.h"

namespace shardserve::kernels {
namespace {

absl::Status Invalid(absl::string_view op, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", what));
}

bool AnyNegative(std::initializer_list<int64_t> v) {
  for (int64_t x : v) {
    if (x < 0) return true;
  }
  return false;
}

absl::Status ValidateCache(absl::string_view op, const KvLayerView& c) {
  if (c.k == nullptr || c.v == nullptr) return Invalid(op, "null cache");
  if (c.num_blocks <= 0 || c.block_size <= 0 || c.kv_heads <= 0 || c.head_dim <= 0) {
    return Invalid(op, "empty cache shape");
  }
  return absl::OkStatus();
}

// Checks every sequence's rows, and that its block table covers its positions with block ids of
// the cache (only the entries the op reads).
absl::Status ValidateSeqs(absl::string_view op, const PagedSeqs& p, int64_t tokens, const KvLayerView& c) {
  if (p.num_seqs < 0 || p.table_entries < 0) return Invalid(op, "negative size");
  if (p.num_seqs > 0 && (p.seqs == nullptr || p.host_seqs == nullptr)) return Invalid(op, "null sequence table");
  if (p.table_entries > 0 && (p.block_table == nullptr || p.host_block_table == nullptr)) {
    return Invalid(op, "null block table");
  }
  for (int64_t i = 0; i < p.num_seqs; ++i) {
    const AttnSeq& s = p.host_seqs[i];
    if (s.q_len < 0 || s.q_begin < 0 || s.q_begin + int64_t{s.q_len} > tokens) {
      return Invalid(op, absl::StrCat("sequence ", i, " rows out of range"));
    }
    if (s.pos_begin < 0) return Invalid(op, absl::StrCat("sequence ", i, " has a negative position"));
    if (s.table_begin < 0 || s.table_len < 0 || s.table_begin + int64_t{s.table_len} > p.table_entries) {
      return Invalid(op, absl::StrCat("sequence ", i, " block table entries out of range"));
    }
    const int64_t end = s.pos_begin + int64_t{s.q_len};
    const int64_t needed = (end + c.block_size - 1) / c.block_size;
    if (needed > s.table_len) {
      return Invalid(op, absl::StrCat("sequence ", i, " has ", s.table_len, " blocks of ", c.block_size,
                                      " tokens, too few for positions up to ", end));
    }
    for (int64_t j = 0; j < needed; ++j) {
      const int32_t b = p.host_block_table[s.table_begin + j];
      if (b < 0 || b >= c.num_blocks) {
        return Invalid(op, absl::StrCat("sequence ", i, " block ", j, " has id ", b, ", outside [0, ", c.num_blocks,
                                        ")"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

int64_t MaxProductActivations(const StepLimits& limits) {
  const int64_t dense = limits.max_tokens * limits.max_linear_in;
  if (limits.moe_routing.num_experts == 0 || limits.moe_routing.top_k <= 1) return dense;
  const int64_t grouped_in = limits.max_grouped_in > 0 ? limits.max_grouped_in : limits.max_linear_in;
  return std::max(dense, limits.max_tokens * limits.moe_routing.top_k * grouped_in);
}

const char* OpName(Op op) {
  switch (op) {
    case Op::kEmbedding: return "Embedding";
    case Op::kLinear: return "Linear";
    case Op::kRmsNorm: return "RmsNorm";
    case Op::kAddRmsNorm: return "AddRmsNorm";
    case Op::kRope: return "Rope";
    case Op::kKvWrite: return "KvWrite";
    case Op::kAttention: return "Attention";
    case Op::kSiluMul: return "SiluMul";
    case Op::kAdd: return "Add";
    case Op::kGatherRows: return "GatherRows";
    case Op::kScatterAddRows: return "ScatterAddRows";
    case Op::kSigmoidScaleRows: return "SigmoidScaleRows";
    case Op::kArgmaxRows: return "ArgmaxRows";
    case Op::kZero: return "Zero";
    case Op::kScale: return "Scale";
    case Op::kScaleRows: return "ScaleRows";
    case Op::kHeadLinear: return "HeadLinear";
    case Op::kMlaKvWrite: return "MlaKvWrite";
    case Op::kMlaAttention: return "MlaAttention";
    case Op::kSampleRows: return "SampleRows";
    case Op::kMoeRoute: return "MoeRoute";
    case Op::kGroupedLinear: return "GroupedLinear";
    case Op::kMoeCombine: return "MoeCombine";
  }
  return "?";
}

absl::StatusOr<DeviceBuffer> Backend::QuantizeWeights(DType format, const float* /*host*/, int64_t /*rows*/,
                                                      int64_t /*cols*/) {
  return absl::UnimplementedError(absl::StrCat(name(), ": cannot quantize weights to ", DTypeName(format)));
}

absl::Status UnsupportedWeights(absl::string_view backend_name, Op op, DType dtype) {
  return absl::UnimplementedError(
      absl::StrCat(backend_name, ": ", OpName(op), " does not take ", DTypeName(dtype), " weights"));
}

absl::Status HeadLinearParams::Validate() const {
  if (x == nullptr || y == nullptr) return Invalid("HeadLinear", "null pointer");
  if (w.data == nullptr) return Invalid("HeadLinear", "null weights");
  if (AnyNegative({tokens, heads, in, out, x_width, x_offset, y_width, y_offset})) {
    return Invalid("HeadLinear", "negative size");
  }
  if (x_offset + in > x_width || y_offset + out > y_width) {
    return Invalid("HeadLinear", absl::StrCat("columns [", x_offset, ", ", x_offset + in, ") of rows of ", x_width,
                                              " or [", y_offset, ", ", y_offset + out, ") of rows of ", y_width,
                                              " are out of range"));
  }
  if (static_cast<const void*>(x) == static_cast<const void*>(y)) return Invalid("HeadLinear", "y aliases x");
  return absl::OkStatus();
}

namespace {

absl::Status ValidateMlaCache(absl::string_view op, const MlaCacheView& c) {
  if (c.data == nullptr) return Invalid(op, "null cache");
  if (c.num_blocks <= 0 || c.block_size <= 0 || c.latent_dim <= 0 || c.rope_dim < 0) {
    return Invalid(op, "empty cache shape");
  }
  return absl::OkStatus();
}

// The cache as ValidateSeqs reads it (blocks and their size).
KvLayerView AsKvView(const MlaCacheView& c) {
  return {.k = c.data, .v = c.data, .num_blocks = c.num_blocks, .block_size = c.block_size, .kv_heads = 1,
          .head_dim = c.row(), .dtype = c.dtype};
}

}  // namespace

absl::Status MlaKvWriteParams::Validate() const {
  if (latent == nullptr || (rope == nullptr && cache.rope_dim > 0)) return Invalid("MlaKvWrite", "null pointer");
  if (tokens < 0) return Invalid("MlaKvWrite", "negative size");
  RETURN_IF_ERROR(ValidateMlaCache("MlaKvWrite", cache));
  return ValidateSeqs("MlaKvWrite", paged, tokens, AsKvView(cache));
}

absl::Status MlaAttentionParams::Validate() const {
  if (q_latent == nullptr || out == nullptr || (q_rope == nullptr && cache.rope_dim > 0)) {
    return Invalid("MlaAttention", "null pointer");
  }
  if (AnyNegative({tokens, q_heads})) return Invalid("MlaAttention", "negative size");
  if (out == q_latent) return Invalid("MlaAttention", "out aliases q_latent");
  RETURN_IF_ERROR(ValidateMlaCache("MlaAttention", cache));
  return ValidateSeqs("MlaAttention", paged, tokens, AsKvView(cache));
}

absl::Status Backend::HeadLinear(const HeadLinearParams& p) {
  RETURN_IF_ERROR(p.Validate());
  return absl::UnimplementedError(absl::StrCat(name(), ": HeadLinear (multi-head latent attention) is not implemented"));
}

absl::Status Backend::MlaKvWrite(const MlaKvWriteParams& p) {
  RETURN_IF_ERROR(p.Validate());
  return absl::UnimplementedError(absl::StrCat(name(), ": MlaKvWrite (multi-head latent attention) is not implemented"));
}

absl::Status Backend::MlaAttention(const MlaAttentionParams& p) {
  RETURN_IF_ERROR(p.Validate());
  return absl::UnimplementedError(
      absl::StrCat(name(), ": MlaAttention (multi-head latent attention) is not implemented"));
}

absl::Status Backend::SampleRows(const SampleRowsParams& p) {
  RETURN_IF_ERROR(p.Validate());
  return absl::UnimplementedError(absl::StrCat(name(), ": SampleRows (sampling on the device) is not implemented"));
}

absl::Status Backend::MoeRoute(const MoeRouteParams& p) {
  RETURN_IF_ERROR(p.Validate());
  return absl::UnimplementedError(absl::StrCat(name(), ": MoeRoute (MoE routing on the device) is not implemented"));
}

absl::Status Backend::GroupedLinear(const GroupedLinearParams& p) {
  RETURN_IF_ERROR(p.Validate());
  return absl::UnimplementedError(absl::StrCat(name(), ": GroupedLinear (grouped expert GEMMs) is not implemented"));
}

absl::Status Backend::MoeCombine(const MoeCombineParams& p) {
  RETURN_IF_ERROR(p.Validate());
  return absl::UnimplementedError(
      absl::StrCat(name(), ": MoeCombine (the grouped experts' combine) is not implemented"));
}

int64_t Backend::MaxDeviceGroupRows(DType /*dtype*/) const { return 0; }

absl::Status DeviceExpertGroups::Validate(absl::string_view op, int64_t rows) const {
  if (offsets == nullptr || (num_held > 0 && (host_ids == nullptr || ids == nullptr))) {
    return Invalid(op, "null expert offsets or ids");
  }
  if (num_experts < 1) return Invalid(op, absl::StrCat("num_experts must be >= 1, got ", num_experts));
  if (num_held < 0 || num_held > num_experts) {
    return Invalid(op, absl::StrCat("num_held ", num_held, " outside [0, num_experts = ", num_experts, "]"));
  }
  if (max_rows_per_group < 0 || max_rows_per_group > rows) {
    return Invalid(op, absl::StrCat("max_rows_per_group ", max_rows_per_group, " outside [0, rows = ", rows, "]"));
  }
  for (int64_t i = 0; i < num_held; ++i) {
    const int32_t e = host_ids[i];
    if (e < 0 || e >= num_experts || (i > 0 && e <= host_ids[i - 1])) {
      return Invalid(op, absl::StrCat("held expert ", i, " is ", e, ": ids must ascend within [0, ", num_experts, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status MoeCombineParams::Validate() const {
  if (src == nullptr || rows == nullptr || dst == nullptr || (num_groups > 0 && groups == nullptr)) {
    return Invalid("MoeCombine", "null pointer");
  }
  if (AnyNegative({num_groups, count, tokens, width})) return Invalid("MoeCombine", "negative size");
  if (static_cast<const void*>(src) == static_cast<const void*>(dst)) return Invalid("MoeCombine", "dst aliases src");
  if (count > INT32_MAX) return Invalid("MoeCombine", absl::StrCat(count, " grouped rows exceed int32"));
  if (device_offsets()) {
    if (groups != nullptr || num_groups != 0) return Invalid("MoeCombine", "host groups given with device offsets");
    return device.Validate("MoeCombine", count);
  }
  int64_t end = 0;
  for (int64_t g = 0; g < num_groups; ++g) {
    const GroupedLinearParams::Group& group = groups[g];
    if (group.begin < 0 || group.count < 0 || group.begin + group.count > count) {
      return Invalid("MoeCombine", absl::StrCat("group ", g, " rows [", group.begin, ", ", group.begin + group.count,
                                                ") outside [0, ", count, ")"));
    }
    if (group.count > 0 && group.begin < end) {
      return Invalid("MoeCombine", absl::StrCat("group ", g, " overlaps an earlier group's rows (groups must ascend)"));
    }
    if (group.count > 0) end = group.begin + group.count;
  }
  return absl::OkStatus();
}

DType GroupedLinearParams::dtype() const {
  if (device_offsets()) return device.num_held > 0 && host_weights != nullptr ? host_weights[0].dtype : DType::kF32;
  return num_groups > 0 && groups != nullptr ? groups[0].w.dtype : DType::kF32;
}

absl::Status GroupedLinearParams::Validate() const {
  if (x == nullptr || y == nullptr || (num_groups > 0 && groups == nullptr)) {
    return Invalid("GroupedLinear", "null pointer");
  }
  if (AnyNegative({num_groups, rows, in, out})) return Invalid("GroupedLinear", "negative size");
  if (static_cast<const void*>(x) == static_cast<const void*>(y)) return Invalid("GroupedLinear", "y aliases x");
  if (device_offsets()) {
    if (groups != nullptr || num_groups != 0) return Invalid("GroupedLinear", "host groups given with device offsets");
    RETURN_IF_ERROR(device.Validate("GroupedLinear", rows));
    if (device.num_held > 0 && (host_weights == nullptr || weights == nullptr)) {
      return Invalid("GroupedLinear", "null expert weights");
    }
    for (int64_t i = 0; i < device.num_held; ++i) {
      if (host_weights[i].data == nullptr) {
        return Invalid("GroupedLinear", absl::StrCat("expert ", device.host_ids[i], " has null weights"));
      }
      if (host_weights[i].dtype != host_weights[0].dtype) {
        return Invalid("GroupedLinear", absl::StrCat("expert ", device.host_ids[i], " has ",
                                                     DTypeName(host_weights[i].dtype), " weights, expert ",
                                                     device.host_ids[0], " ", DTypeName(host_weights[0].dtype)));
      }
    }
    return absl::OkStatus();
  }
  int64_t end = 0;  // groups ascend by begin in practice; overlap is checked against the furthest end so far
  for (int64_t g = 0; g < num_groups; ++g) {
    const Group& group = groups[g];
    if (group.w.data == nullptr) return Invalid("GroupedLinear", absl::StrCat("group ", g, " has null weights"));
    if (group.w.dtype != groups[0].w.dtype) {
      return Invalid("GroupedLinear", absl::StrCat("group ", g, " has ", DTypeName(group.w.dtype), " weights, group 0 ",
                                                   DTypeName(groups[0].w.dtype)));
    }
    if (group.begin < 0 || group.count < 0 || group.begin + group.count > rows) {
      return Invalid("GroupedLinear", absl::StrCat("group ", g, " rows [", group.begin, ", ", group.begin + group.count,
                                                   ") outside [0, ", rows, ")"));
    }
    if (group.count > 0 && group.begin < end) {
      return Invalid("GroupedLinear", absl::StrCat("group ", g, " overlaps an earlier group's rows (groups must ascend)"));
    }
    if (group.count > 0) end = group.begin + group.count;
  }
  return absl::OkStatus();
}

absl::Status EmbeddingParams::Validate() const {
  if (table.data == nullptr || ids == nullptr || out == nullptr) return Invalid("Embedding", "null pointer");
  if (AnyNegative({tokens, vocab, hidden})) return Invalid("Embedding", "negative size");
  return absl::OkStatus();
}

absl::Status LinearParams::Validate() const {
  if (x == nullptr || y == nullptr) return Invalid("Linear", "null pointer");
  if (w.data == nullptr) return Invalid("Linear", "null weights");
  if (AnyNegative({tokens, in, out})) return Invalid("Linear", "negative size");
  if (w.dtype == DType::kF8E4M3 && !w.fp8.Valid(in)) {
    return Invalid("Linear", "F8_E4M3 weights without a valid scale grid (null scales, a block size <= 0, an offset "
                             "outside the first block or too few grid columns)");
  }
  if (w.dtype == DType::kMxfp4) {
    if (w.mxfp4_scales == nullptr) return Invalid("Linear", "MXFP4 weights without scales");
    if (in % kMxfp4Block != 0) {
      return Invalid("Linear", absl::StrCat("MXFP4 weights need an input width that is a multiple of 32, got ", in));
    }
  }
  if (static_cast<const void*>(x) == static_cast<const void*>(y)) return Invalid("Linear", "y aliases x");
  return absl::OkStatus();
}

LinearParams LinearGroupParams::PartParams(int i) const {
  const Part& part = parts[static_cast<size_t>(i)];
  return {.x = x, .w = part.w, .bias = part.bias, .y = part.y, .tokens = tokens, .in = in, .out = part.out,
          .accumulate = part.accumulate};
}

SiluMulParams LinearGroupParams::GateParams() const {
  return {.gate = parts[0].y, .up = parts[1].y, .out = parts[0].y, .n = tokens * parts[0].out,
          .act = gated.value_or(GateActivation::kSilu)};
}

RmsNormParams LinearGroupParams::NormParams() const {
  return {.x = x, .weight = norm->weight, .y = norm->scratch, .tokens = tokens, .hidden = in, .eps = norm->eps};
}

absl::Status LinearGroupParams::Validate() const {
  if (num_parts < 1 || num_parts > kMaxParts) {
    return Invalid("LinearGroup", absl::StrCat(num_parts, " parts (1 to ", kMaxParts, ")"));
  }
  if (norm.has_value()) {
    if (norm->weight == nullptr || norm->scratch == nullptr) {
      return Invalid("LinearGroup", "the normed form needs a norm weight and a scratch");
    }
    if (!(norm->eps >= 0.f) || !std::isfinite(norm->eps)) {
      return Invalid("LinearGroup", absl::StrCat("the normed form's eps must be finite and >= 0, got ", norm->eps));
    }
    if (static_cast<const void*>(norm->scratch) == static_cast<const void*>(x)) {
      return Invalid("LinearGroup", "the normed form's scratch aliases x");
    }
    for (int i = 0; i < num_parts; ++i) {
      if (parts[static_cast<size_t>(i)].y == norm->scratch) {
        return Invalid("LinearGroup", absl::StrCat("the normed form's scratch aliases part ", i, "'s y"));
      }
    }
  }
  if (gated.has_value()) {
    if (num_parts != 2) {
      return Invalid("LinearGroup", absl::StrCat("the gated form takes 2 parts (gate, up), got ", num_parts));
    }
    if (parts[0].out != parts[1].out) {
      return Invalid("LinearGroup", absl::StrCat("the gated form needs gate and up of equal out, got ", parts[0].out,
                                                 " and ", parts[1].out));
    }
    if (parts[0].accumulate || parts[1].accumulate) {
      return Invalid("LinearGroup", "the gated form does not accumulate (gate and up overwrite their y)");
    }
  }
  for (int i = 0; i < num_parts; ++i) {
    if (absl::Status st = PartParams(i).Validate(); !st.ok()) {
      return Invalid("LinearGroup", absl::StrCat("part ", i, ": ", st.message()));
    }
    for (int j = 0; j < i; ++j) {
      if (parts[static_cast<size_t>(j)].y == parts[static_cast<size_t>(i)].y) {
        return Invalid("LinearGroup", absl::StrCat("parts ", j, " and ", i, " write the same y"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Backend::LinearGroup(const LinearGroupParams& p) {
  RETURN_IF_ERROR(p.Validate());
  if (p.norm.has_value()) {
    // The norm into the scratch, then the group over the normalised rows.
    RETURN_IF_ERROR(RmsNorm(p.NormParams()));
    LinearGroupParams over = p;
    over.x = p.norm->scratch;
    over.norm.reset();
    return LinearGroup(over);
  }
  for (int i = 0; i < p.num_parts; ++i) RETURN_IF_ERROR(Linear(p.PartParams(i)));
  if (p.gated.has_value()) return SiluMul(p.GateParams());
  return absl::OkStatus();
}

absl::Status AddRmsNormParams::Validate() const {
  if (x == nullptr || y == nullptr || weight == nullptr || out == nullptr) return Invalid("AddRmsNorm", "null pointer");
  if (AnyNegative({tokens}) || hidden <= 0) return Invalid("AddRmsNorm", "bad size");
  if (static_cast<const void*>(y) == x || y == out || out == x) return Invalid("AddRmsNorm", "x, y and out must not alias");
  return absl::OkStatus();
}

absl::Status RmsNormParams::Validate() const {
  if (x == nullptr || weight == nullptr || y == nullptr) return Invalid("RmsNorm", "null pointer");
  if (AnyNegative({tokens}) || hidden <= 0) return Invalid("RmsNorm", "bad size");
  return absl::OkStatus();
}

absl::Status RopeParams::Validate() const {
  if (q == nullptr || k == nullptr || positions == nullptr || inv_freq == nullptr) return Invalid("Rope", "null pointer");
  if (AnyNegative({tokens, q_heads, kv_heads}) || head_dim <= 0 || head_dim % 2 != 0) {
    return Invalid("Rope", "bad size (head_dim must be even)");
  }
  if (rotary_dim < 0 || rotary_dim > head_dim || rotary_dim % 2 != 0 || rotary_dim == 1) {
    return Invalid("Rope", "rotary_dim must be 0 (all of head_dim) or even and at most head_dim");
  }
  return absl::OkStatus();
}

absl::Status KvWriteParams::Validate() const {
  if (k == nullptr || v == nullptr) return Invalid("KvWrite", "null pointer");
  if (auto st = ValidateCache("KvWrite", cache); !st.ok()) return st;
  RETURN_IF_ERROR(ValidateSeqs("KvWrite", paged, tokens, cache));
  if (!rope.has_value()) return absl::OkStatus();
  if (absl::Status st = rope->Validate(); !st.ok()) return Invalid("KvWrite", absl::StrCat("rope: ", st.message()));
  if (rope->k != k) return Invalid("KvWrite", "rope.k must be the k the op writes");
  if (rope->tokens != tokens || rope->kv_heads != cache.kv_heads || rope->head_dim != cache.head_dim) {
    return Invalid("KvWrite", absl::StrCat("rope shape (", rope->tokens, " tokens, ", rope->kv_heads, " kv heads of ",
                                           rope->head_dim, ") differs from the write's (", tokens, " tokens, ",
                                           cache.kv_heads, " kv heads of ", cache.head_dim, ")"));
  }
  if (static_cast<const float*>(rope->q) == k || static_cast<const float*>(rope->q) == v) {
    return Invalid("KvWrite", "rope.q aliases k or v");
  }
  // Every row rotated exactly once: the sequences' rows tile [0, tokens) in order.
  int64_t end = 0;
  for (int64_t i = 0; i < paged.num_seqs; ++i) {
    if (paged.host_seqs[i].q_begin != end) {
      return Invalid("KvWrite", absl::StrCat("with rope, the sequences' rows must tile [0, tokens) in order: sequence ",
                                             i, " starts at row ", paged.host_seqs[i].q_begin, ", expected ", end));
    }
    end += paged.host_seqs[i].q_len;
  }
  if (end != tokens) {
    return Invalid("KvWrite", absl::StrCat("with rope, the sequences' rows must tile [0, tokens): they cover ", end,
                                           " of ", tokens, " rows"));
  }
  return absl::OkStatus();
}

absl::Status AttentionParams::Validate() const {
  if (q == nullptr || out == nullptr) return Invalid("Attention", "null pointer");
  if (auto st = ValidateCache("Attention", cache); !st.ok()) return st;
  if (q_heads <= 0 || q_heads % cache.kv_heads != 0) {
    return Invalid("Attention", "q_heads must be a positive multiple of kv_heads");
  }
  if (sliding_window < 0) return Invalid("Attention", "negative sliding window");
  if (chunk_size < 0) return Invalid("Attention", "negative chunk size");
  if (!(softcap >= 0.0f)) return Invalid("Attention", "negative or NaN softcap");
  return ValidateSeqs("Attention", paged, tokens, cache);
}

absl::Status SiluMulParams::Validate() const {
  if (gate == nullptr || up == nullptr || out == nullptr) return Invalid("SiluMul", "null pointer");
  if (n < 0) return Invalid("SiluMul", "negative size");
  return absl::OkStatus();
}

absl::Status ScaleParams::Validate() const {
  if (x == nullptr) return Invalid("Scale", "null pointer");
  if (n < 0) return Invalid("Scale", "negative size");
  if (!(softcap >= 0.0f)) return Invalid("Scale", "negative or NaN softcap");
  return absl::OkStatus();
}

absl::Status AddParams::Validate() const {
  if (x == nullptr || y == nullptr) return Invalid("Add", "null pointer");
  if (n < 0) return Invalid("Add", "negative size");
  return absl::OkStatus();
}

absl::Status GatherRowsParams::Validate() const {
  if (src == nullptr || rows == nullptr || dst == nullptr) return Invalid("GatherRows", "null pointer");
  if (AnyNegative({count, src_rows, width})) return Invalid("GatherRows", "negative size");
  return absl::OkStatus();
}

absl::Status ScatterAddRowsParams::Validate() const {
  if (src == nullptr || rows == nullptr || scales == nullptr || dst == nullptr) {
    return Invalid("ScatterAddRows", "null pointer");
  }
  if (AnyNegative({count, dst_rows, width})) return Invalid("ScatterAddRows", "negative size");
  return absl::OkStatus();
}

absl::Status ScaleRowsParams::Validate() const {
  if (x == nullptr || scales == nullptr) return Invalid("ScaleRows", "null pointer");
  if (AnyNegative({tokens, width})) return Invalid("ScaleRows", "negative size");
  return absl::OkStatus();
}

absl::Status SigmoidScaleRowsParams::Validate() const {
  if (x == nullptr || gate == nullptr) return Invalid("SigmoidScaleRows", "null pointer");
  if (AnyNegative({tokens, width})) return Invalid("SigmoidScaleRows", "negative size");
  return absl::OkStatus();
}

absl::Status ArgmaxRowsParams::Validate() const {
  if (x == nullptr || out == nullptr) return Invalid("ArgmaxRows", "null pointer");
  if (AnyNegative({rows})) return Invalid("ArgmaxRows", "negative size");
  if (rows > 0 && (width < 1 || width > stride)) {
    return Invalid("ArgmaxRows", absl::StrCat("width ", width, " must be in [1, stride = ", stride, "]"));
  }
  return absl::OkStatus();
}

absl::Status SampleRowsParams::Validate() const {
  if (x == nullptr || params == nullptr || host_params == nullptr || out == nullptr) {
    return Invalid("SampleRows", "null pointer");
  }
  if (AnyNegative({rows})) return Invalid("SampleRows", "negative size");
  if (rows > 0 && (width < 1 || width > stride)) {
    return Invalid("SampleRows", absl::StrCat("width ", width, " must be in [1, stride = ", stride, "]"));
  }
  for (int64_t r = 0; r < rows; ++r) {
    const RowSamplingParams& q = host_params[r];
    if (!std::isfinite(q.temperature) || q.temperature < 0.0f) {
      return Invalid("SampleRows", absl::StrCat("row ", r, ": temperature must be finite and >= 0, got ", q.temperature));
    }
    if (q.top_k < 0) return Invalid("SampleRows", absl::StrCat("row ", r, ": top_k must be >= 0, got ", q.top_k));
    if (!(q.top_p > 0.0f && q.top_p <= 1.0f)) {
      return Invalid("SampleRows", absl::StrCat("row ", r, ": top_p must be in (0, 1], got ", q.top_p));
    }
    if (!(q.min_p >= 0.0f && q.min_p <= 1.0f)) {
      return Invalid("SampleRows", absl::StrCat("row ", r, ": min_p must be in [0, 1], got ", q.min_p));
    }
  }
  return absl::OkStatus();
}

absl::Status MoeRouteParams::Validate() const {
  if (logits == nullptr || offsets == nullptr || rows == nullptr || scales == nullptr) {
    return Invalid("MoeRoute", "null pointer");
  }
  const MoeRouting& r = routing;
  if (tokens < 0) return Invalid("MoeRoute", "negative token count");
  if (r.num_experts < 1) return Invalid("MoeRoute", absl::StrCat("num_experts must be >= 1, got ", r.num_experts));
  if (r.top_k < 1 || r.top_k > r.num_experts) {
    return Invalid("MoeRoute", absl::StrCat("top_k must be in [1, num_experts = ", r.num_experts, "], got ", r.top_k));
  }
  if (tokens * r.top_k > INT32_MAX) {
    return Invalid("MoeRoute", absl::StrCat(tokens, " tokens x top_k ", r.top_k, " exceed int32 rows"));
  }
  if (!std::isfinite(r.scaling)) return Invalid("MoeRoute", "routed scaling factor must be finite");
  const bool grouped = r.scoring == MoeRouteScoring::kSigmoidGrouped ||
                       r.scoring == MoeRouteScoring::kSoftmaxGroupLimited;
  if (!grouped) return absl::OkStatus();
  if (r.n_group < 1 || r.num_experts % r.n_group != 0) {
    return Invalid("MoeRoute", absl::StrCat("n_group ", r.n_group, " must divide num_experts ", r.num_experts));
  }
  if (r.topk_group < 1 || r.topk_group > r.n_group) {
    return Invalid("MoeRoute", absl::StrCat("topk_group must be in [1, n_group = ", r.n_group, "], got ", r.topk_group));
  }
  const int64_t per_group = r.num_experts / r.n_group;
  if (r.scoring == MoeRouteScoring::kSigmoidGrouped && per_group < 2) {
    return Invalid("MoeRoute", absl::StrCat("grouped sigmoid routing needs >= 2 experts per group, got ", per_group));
  }
  if (int64_t{r.top_k} > int64_t{r.topk_group} * per_group) {
    return Invalid("MoeRoute", absl::StrCat("top_k ", r.top_k, " exceeds the experts of the kept groups (",
                                            r.topk_group, " x ", per_group, ")"));
  }
  return absl::OkStatus();
}

absl::Status ZeroParams::Validate() const {
  if (x == nullptr) return Invalid("Zero", "null pointer");
  if (n < 0) return Invalid("Zero", "negative size");
  return absl::OkStatus();
}

}  // namespace shardserve::kernels

#include "worker/engine/weights.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/fp8/fp8_weights.h"
#include "common/fp8/mxfp4_weights.h"
#include "common/status/macros.h"
#include "worker/kernels/shared/mxfp4_math.h"

namespace shardserve::engine {
namespace {

absl::Status NotDivisible(absl::string_view what, int64_t n, int size) {
  return absl::InvalidArgumentError(absl::StrCat("tensor parallel size ", size, " does not divide ", what, " (", n,
                                                 "); choose a tp that divides it"));
}

// Loads checkpoint tensors onto one backend, counting bytes.
class Loader {
 public:
  Loader(const Checkpoint& ckpt, const ModelSpec& spec, kernels::Backend& backend, Quantization quantize)
      : ckpt_(ckpt), spec_(spec), backend_(backend),
        int8_(quantize == Quantization::kInt8 && backend.SupportsOp(kernels::Op::kLinear, DType::kQ8)) {}

  // config.json's dtype, when given, must be the stored dtype of every weight; an FP8 checkpoint's
  // matrices are F8_E4M3 instead (their scales are checked by ReadWeight*).
  absl::Status CheckDType(const std::string& name) {
    if (!spec_.dtype.has_value()) return absl::OkStatus();
    ASSIGN_OR_RETURN(const SafetensorsEntry* e, ckpt_.Find(name));
    if (e->dtype == DType::kF8E4M3 && spec_.fp8.has_value()) return absl::OkStatus();
    if (e->dtype != *spec_.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(ckpt_.label(), ": tensor \"", name, "\" is stored as ",
                                                     DTypeName(e->dtype), " but config.json declares dtype ",
                                                     DTypeName(*spec_.dtype)));
    }
    return absl::OkStatus();
  }

  // The dtype of the projection matrix `name`: kQ8 when quantizing to int8 (an FP8 matrix is
  // dequantized first, then quantized), else KeptDType (kF8E4M3 for an FP8 matrix on a backend
  // that takes it).
  DType MatrixDType(const std::string& name) {
    return int8_ ? DType::kQ8 : KeptDType(name, kernels::Op::kLinear);
  }
  // MatrixDType for a matrix the loader rearranges (picked or transposed rows): an FP8 one is
  // dequantized, as where the backend does not take F8_E4M3.
  DType DequantizedMatrixDType(const std::string& name) {
    const DType dtype = MatrixDType(name);
    if (dtype != DType::kF8E4M3) return dtype;
    return backend_.SupportsOp(kernels::Op::kLinear, DType::kBF16) ? DType::kBF16 : DType::kF32;
  }
  // Rows [row_begin, row_end) x columns [col_begin, col_end) of the F8_E4M3 matrix `name` as codes
  // and scales (lw->w, lw->scales, lw->fp8), followed by zero rows up to `rows` rows (the grid then
  // covers the padding too, with scales 1). The scales are multiplied by `scale` (a multiplier
  // folded into the matrix). lw->in / out / dtype are the caller's.
  absl::Status UploadFp8(const std::string& name, const Shape& shape, int64_t row_begin, int64_t row_end,
                         int64_t col_begin, int64_t col_end, int64_t rows, LinearWeight* lw, float scale = 1.0f) {
    RETURN_IF_ERROR(CheckDType(name));
    ASSIGN_OR_RETURN(Fp8Slice s,
                     ReadFp8Slice(ckpt_, spec_.fp8, name, shape, row_begin, row_end, col_begin, col_end));
    if (scale != 1.0f) {
      for (float& x : s.scales) x *= scale;
    }
    const int64_t cols = s.cols;
    if (rows * cols == 0) return absl::OkStatus();
    s.codes.resize(static_cast<size_t>(rows * cols), 0);  // code 0 is +0
    if (spec_.fp8->IsBlockWise()) {
      const int64_t grid_rows = (s.row_offset + rows + s.block_rows - 1) / s.block_rows;
      s.scales.resize(static_cast<size_t>(grid_rows * s.grid_cols), 1.0f);
    } else {
      s.block_rows = std::max(s.block_rows, rows);  // one block covering the padding too
    }
    lw->fp8 = {.scales = nullptr, .block_rows = s.block_rows, .block_cols = s.block_cols, .grid_cols = s.grid_cols,
               .row_offset = s.row_offset, .col_offset = s.col_offset};
    ASSIGN_OR_RETURN(lw->w, UploadBytes(s.codes.data(), s.codes.size()));
    ASSIGN_OR_RETURN(lw->scales, UploadBytes(s.scales.data(), s.scales.size() * sizeof(float)));
    return absl::OkStatus();
  }
  absl::StatusOr<kernels::DeviceBuffer> UploadBytes(const void* host, size_t bytes) {
    ASSIGN_OR_RETURN(kernels::DeviceBuffer buf, backend_.Allocate(bytes));
    RETURN_IF_ERROR(backend_.CopyToDevice(buf.as<void>(), host, bytes));
    bytes_ += bytes;
    return buf;
  }
  // The dtype matrix `name` is kept in on this backend for `op`: its stored bf16/f16 (bf16 for a
  // dequantized F8_E4M3 or MXFP4 matrix) where the backend takes it, else f32.
  DType KeptDType(const std::string& name, kernels::Op op) {
    absl::StatusOr<const SafetensorsEntry*> e = ckpt_.Find(name);
    if (e.ok()) return KeptWeightDType(backend_, (*e)->dtype, op);
    if (spec_.mxfp4.has_value() && ckpt_.Has(name + "_blocks")) return KeptWeightDType(backend_, DType::kBF16, op);
    return DType::kF32;
  }
  // Uploads `t` as 16-bit patterns of `dtype` (exact for values read from a tensor of that dtype;
  // dequantized FP8 values are rounded to nearest even).
  absl::StatusOr<kernels::DeviceBuffer> Upload16(const HostTensor& t, DType dtype) {
    std::vector<uint16_t> bits(static_cast<size_t>(t.size()));
    const float* src = t.data();
    if (dtype == DType::kBF16) {
      for (size_t i = 0; i < bits.size(); ++i) bits[i] = FloatToBFloat16(src[i]);
    } else {
      for (size_t i = 0; i < bits.size(); ++i) bits[i] = FloatToHalf(src[i]);
    }
    const size_t bytes = bits.size() * sizeof(uint16_t);
    ASSIGN_OR_RETURN(kernels::DeviceBuffer buf, backend_.Allocate(bytes));
    RETURN_IF_ERROR(backend_.CopyToDevice(buf.as<void>(), bits.data(), bytes));
    bytes_ += bytes;
    return buf;
  }
  absl::StatusOr<kernels::DeviceBuffer> UploadAs(const HostTensor& t, DType dtype) {
    if (dtype == DType::kQ8) {
      const int64_t rows = t.shape().size() == 2 ? t.shape()[0] : 1;
      ASSIGN_OR_RETURN(kernels::DeviceBuffer buf, backend_.QuantizeWeights(DType::kQ8, t.data(), rows, t.shape().back()));
      bytes_ += buf.bytes();
      return buf;
    }
    return dtype == DType::kF32 ? Upload(t) : Upload16(t, dtype);
  }

  absl::StatusOr<kernels::DeviceBuffer> Upload(const HostTensor& t) {
    ASSIGN_OR_RETURN(kernels::DeviceBuffer buf, backend_.Allocate(t.bytes()));
    RETURN_IF_ERROR(backend_.CopyToDevice(buf.as<void>(), t.data(), t.bytes()));
    bytes_ += t.bytes();
    return buf;
  }
  // Multiplies `t` by `scale`, a multiplier folded into a weight (ModelSpec::residual_multiplier),
  // before it is rounded to the dtype it is kept in.
  static void ScaleHost(HostTensor& t, float scale) {
    if (scale == 1.0f) return;
    float* x = t.data();
    for (int64_t i = 0; i < t.size(); ++i) x[i] *= scale;
  }
  absl::StatusOr<kernels::DeviceBuffer> Full(const std::string& name, const Shape& shape,
                                             DType dtype = DType::kF32, float scale = 1.0f) {
    RETURN_IF_ERROR(CheckDType(name));
    ASSIGN_OR_RETURN(HostTensor t, ReadWeight(ckpt_, spec_.fp8, name, shape));
    ScaleHost(t, scale);
    return UploadAs(t, dtype);
  }
  // An RMSNorm weight, f32; as (1 + w) when ModelSpec::norm_plus_one (Gemma), added in f32 as
  // transformers does; then times `scale` (1 / ModelSpec::logits_scaling for the final norm).
  absl::StatusOr<kernels::DeviceBuffer> Norm(const std::string& name, int64_t size, float scale = 1.0f) {
    RETURN_IF_ERROR(CheckDType(name));
    ASSIGN_OR_RETURN(HostTensor t, ReadWeight(ckpt_, spec_.fp8, name, {size}));
    if (spec_.norm_plus_one) {
      for (int64_t i = 0; i < size; ++i) t.data()[i] = 1.0f + t.data()[i];
    }
    ScaleHost(t, scale);
    return Upload(t);
  }
  absl::StatusOr<kernels::DeviceBuffer> Rows(const std::string& name, const Shape& shape, int64_t begin,
                                             int64_t end, DType dtype = DType::kF32) {
    RETURN_IF_ERROR(CheckDType(name));
    ASSIGN_OR_RETURN(HostTensor t, ReadWeightRows(ckpt_, spec_.fp8, name, shape, begin, end));
    return UploadAs(t, dtype);
  }
  absl::StatusOr<kernels::DeviceBuffer> Cols(const std::string& name, const Shape& shape, int64_t begin,
                                             int64_t end, DType dtype = DType::kF32, float scale = 1.0f) {
    RETURN_IF_ERROR(CheckDType(name));
    ASSIGN_OR_RETURN(HostTensor t, ReadWeightCols(ckpt_, spec_.fp8, name, shape, begin, end));
    ScaleHost(t, scale);
    return UploadAs(t, dtype);
  }

  // Column-parallel linear (split by output rows [begin, end)), with optional bias.
  absl::StatusOr<LinearWeight> ColumnParallel(const std::string& prefix, int64_t in, int64_t out, int64_t begin,
                                              int64_t end, bool bias) {
    LinearWeight lw;
    lw.in = in;
    lw.out = end - begin;
    lw.dtype = MatrixDType(prefix + ".weight");
    if (lw.dtype == DType::kF8E4M3) {
      RETURN_IF_ERROR(UploadFp8(prefix + ".weight", {out, in}, begin, end, 0, in, end - begin, &lw));
    } else {
      ASSIGN_OR_RETURN(lw.w, Rows(prefix + ".weight", {out, in}, begin, end, lw.dtype));
    }
    if (bias) {
      ASSIGN_OR_RETURN(lw.b, Rows(prefix + ".bias", {out}, begin, end));
    }
    return lw;
  }
  // Row-parallel linear (split by input columns [begin, end)); the bias is added once, on rank 0.
  // Matrix and bias are multiplied by `scale` (ModelSpec::residual_multiplier for the products
  // that end a layer's attention and MLP).
  absl::StatusOr<LinearWeight> RowParallel(const std::string& prefix, int64_t in, int64_t out, int64_t begin,
                                           int64_t end, bool bias, bool bias_here, float scale = 1.0f) {
    LinearWeight lw;
    lw.in = end - begin;
    lw.out = out;
    lw.dtype = MatrixDType(prefix + ".weight");
    if (lw.dtype == DType::kF8E4M3) {
      RETURN_IF_ERROR(UploadFp8(prefix + ".weight", {out, in}, 0, out, begin, end, out, &lw, scale));
    } else {
      ASSIGN_OR_RETURN(lw.w, Cols(prefix + ".weight", {out, in}, begin, end, lw.dtype, scale));
    }
    if (bias && bias_here) {
      ASSIGN_OR_RETURN(lw.b, Full(prefix + ".bias", {out}, DType::kF32, scale));
    }
    return lw;
  }
  // `down_scale`: RowParallel's scale of the down projection.
  absl::StatusOr<MlpWeights> Mlp(const std::string& prefix, const char* gate, const char* up, const char* down,
                                 int64_t hidden, int64_t width, int64_t begin, int64_t end, bool bias, int rank,
                                 float down_scale = 1.0f) {
    MlpWeights m;
    ASSIGN_OR_RETURN(m.gate, ColumnParallel(prefix + gate, hidden, width, begin, end, bias));
    ASSIGN_OR_RETURN(m.up, ColumnParallel(prefix + up, hidden, width, begin, end, bias));
    ASSIGN_OR_RETURN(m.down, RowParallel(prefix + down, width, hidden, begin, end, bias, rank == 0, down_scale));
    return m;
  }
  // An MLP whose gate and up matrices are stored as one `<prefix><gate_up>` [2 x width, hidden]
  // (gate rows first: Phi-3's gate_up_proj, GraniteMoeShared's shared_mlp.input_linear): this rank's
  // gate rows [begin, end) and up rows width + [begin, end).
  absl::StatusOr<MlpWeights> FusedMlp(const std::string& prefix, const char* gate_up, const char* down,
                                      int64_t hidden, int64_t width, int64_t begin, int64_t end, int rank,
                                      float down_scale = 1.0f) {
    MlpWeights m;
    const std::string fused = prefix + gate_up;
    ASSIGN_OR_RETURN(m.gate, ColumnParallel(fused, hidden, 2 * width, begin, end, false));
    ASSIGN_OR_RETURN(m.up, ColumnParallel(fused, hidden, 2 * width, width + begin, width + end, false));
    ASSIGN_OR_RETURN(m.down, RowParallel(prefix + down, width, hidden, begin, end, false, rank == 0, down_scale));
    return m;
  }
  // A float tensor that may be stored as F32 whatever config.json's dtype (transformers keeps
  // DeepSeek-V3's e_score_correction_bias in f32): read widened, uploaded as f32.
  absl::StatusOr<kernels::DeviceBuffer> FullF32OrConfigDType(const std::string& name, const Shape& shape,
                                                             std::vector<float>* host) {
    ASSIGN_OR_RETURN(const SafetensorsEntry* e, ckpt_.Find(name));
    if (e->dtype != DType::kF32) RETURN_IF_ERROR(CheckDType(name));
    ASSIGN_OR_RETURN(HostTensor t, ReadWeight(ckpt_, spec_.fp8, name, shape));
    host->assign(t.data(), t.data() + t.size());
    return Upload(t);
  }
  // The rows `rows` (indices into [0, shape[0])) of a [rows, cols] matrix, in that order, as one
  // [rows.size(), cols] linear weight of the matrix dtype. Reads the span [min, max] of them.
  absl::StatusOr<LinearWeight> PickedRows(const std::string& name, const Shape& shape,
                                          const std::vector<int64_t>& rows) {
    RETURN_IF_ERROR(CheckDType(name));
    const int64_t lo = *std::min_element(rows.begin(), rows.end());
    const int64_t hi = *std::max_element(rows.begin(), rows.end()) + 1;
    ASSIGN_OR_RETURN(HostTensor t, ReadWeightRows(ckpt_, spec_.fp8, name, shape, lo, hi));
    const int64_t cols = shape[1];
    HostTensor picked({static_cast<int64_t>(rows.size()), cols});
    for (size_t i = 0; i < rows.size(); ++i) {
      std::copy(t.data() + (rows[i] - lo) * cols, t.data() + (rows[i] - lo + 1) * cols, picked.data() + i * cols);
    }
    LinearWeight lw;
    lw.in = cols;
    lw.out = static_cast<int64_t>(rows.size());
    lw.dtype = DequantizedMatrixDType(name);
    ASSIGN_OR_RETURN(lw.w, UploadAs(picked, lw.dtype));
    return lw;
  }
  // The entries `rows` (indices into [0, size)) of a vector of `size` floats, in that order, as f32
  // (a bias picked as PickedRows picks its matrix's rows).
  absl::StatusOr<kernels::DeviceBuffer> PickedValues(const std::string& name, int64_t size,
                                                     const std::vector<int64_t>& rows) {
    RETURN_IF_ERROR(CheckDType(name));
    ASSIGN_OR_RETURN(HostTensor t, ReadWeight(ckpt_, spec_.fp8, name, {size}));
    HostTensor picked({static_cast<int64_t>(rows.size())});
    for (size_t i = 0; i < rows.size(); ++i) picked.data()[i] = t.data()[rows[i]];
    return Upload(picked);
  }
  // kv_b_proj [heads x (nope + v), latent] of heads [head_begin, head_end), per head for HeadLinear:
  // the key rows transposed ([heads, latent, nope]) and the value rows ([heads, v, latent]), in the
  // dtype the backend's HeadLinear takes.
  absl::Status KvB(const std::string& name, int64_t heads, int64_t nope, int64_t v, int64_t latent,
                   int64_t head_begin, int64_t head_end, LinearWeight* uk, LinearWeight* uv) {
    RETURN_IF_ERROR(CheckDType(name));
    const int64_t per = nope + v;
    ASSIGN_OR_RETURN(HostTensor t, ReadWeightRows(ckpt_, spec_.fp8, name, {heads * per, latent}, head_begin * per,
                                                  head_end * per));
    const int64_t local = head_end - head_begin;
    HostTensor k({local * latent, nope}), val({local * v, latent});
    for (int64_t h = 0; h < local; ++h) {
      const float* src = t.data() + h * per * latent;
      for (int64_t r = 0; r < nope; ++r) {
        for (int64_t c = 0; c < latent; ++c) k.data()[(h * latent + c) * nope + r] = src[r * latent + c];
      }
      std::copy(src + nope * latent, src + per * latent, val.data() + h * v * latent);
    }
    // A dequantized FP8 matrix is kept in bf16 where the backend takes it, as the Linear matrices.
    DType dtype = KeptDType(name, kernels::Op::kHeadLinear);
    if (dtype == DType::kF8E4M3) {
      // Transposed per head: no scale grid describes it; dequantized.
      dtype = backend_.SupportsOp(kernels::Op::kHeadLinear, DType::kBF16) ? DType::kBF16 : DType::kF32;
    }
    uk->dtype = uv->dtype = dtype;
    uk->in = nope;
    uk->out = latent;
    uv->in = latent;
    uv->out = v;
    ASSIGN_OR_RETURN(uk->w, UploadAs(k, dtype));
    ASSIGN_OR_RETURN(uv->w, UploadAs(val, dtype));
    return absl::OkStatus();
  }
  // Expert `e` of a fused expert tensor pair (ModelSpec::moe.fused_experts, Llama-4):
  // `<prefix>experts.gate_up_proj` [experts, hidden, 2 x width] and `<prefix>experts.down_proj`
  // [experts, width, hidden], stored transposed against nn.Linear. This rank's gate and up rows
  // [begin, end) (gate columns [begin, end) and up columns width + [begin, end), transposed) and
  // down columns [begin, end) (rows [begin, end) of down_proj[e], transposed); the down
  // projection times `down_scale`.
  absl::StatusOr<MlpWeights> FusedExpert(const std::string& prefix, int64_t experts, int64_t e, int64_t hidden,
                                         int64_t width, int64_t begin, int64_t end, float down_scale) {
    const std::string gate_up = prefix + "experts.gate_up_proj";
    const std::string down = prefix + "experts.down_proj";
    RETURN_IF_ERROR(CheckDType(gate_up));
    RETURN_IF_ERROR(CheckDType(down));
    ASSIGN_OR_RETURN(HostTensor gu, ReadWeightRows(ckpt_, spec_.fp8, gate_up, {experts, hidden, 2 * width}, e, e + 1));
    ASSIGN_OR_RETURN(HostTensor dn, ReadWeightRows(ckpt_, spec_.fp8, down, {experts, width, hidden}, e, e + 1));
    const int64_t local = end - begin;
    HostTensor g({local, hidden}), u({local, hidden}), d({hidden, local});
    for (int64_t r = 0; r < local; ++r) {
      for (int64_t c = 0; c < hidden; ++c) {
        g.data()[r * hidden + c] = gu.data()[c * 2 * width + begin + r];
        u.data()[r * hidden + c] = gu.data()[c * 2 * width + width + begin + r];
        d.data()[c * local + r] = dn.data()[(begin + r) * hidden + c];
      }
    }
    ScaleHost(d, down_scale);
    return UploadExpert(g, u, d, gate_up, down, hidden, local);
  }
  // The same from GraniteMoe's stacked layout (MoeSpec::stacked_experts): gate rows [begin, end)
  // and up rows width + [begin, end) of input_linear[e], columns [begin, end) of output_linear[e].
  // `renamed`: transformers 5's names, experts.gate_up_proj and experts.down_proj (GraniteMoeSWA).
  absl::StatusOr<MlpWeights> StackedExpert(const std::string& prefix, bool renamed, int64_t experts, int64_t e,
                                           int64_t hidden, int64_t width, int64_t begin, int64_t end,
                                           float down_scale) {
    const std::string in = prefix + (renamed ? "experts.gate_up_proj" : "input_linear.weight");
    const std::string out = prefix + (renamed ? "experts.down_proj" : "output_linear.weight");
    RETURN_IF_ERROR(CheckDType(in));
    RETURN_IF_ERROR(CheckDType(out));
    ASSIGN_OR_RETURN(HostTensor gu, ReadWeightRows(ckpt_, spec_.fp8, in, {experts, 2 * width, hidden}, e, e + 1));
    ASSIGN_OR_RETURN(HostTensor dn, ReadWeightRows(ckpt_, spec_.fp8, out, {experts, hidden, width}, e, e + 1));
    const int64_t local = end - begin;
    HostTensor g({local, hidden}), u({local, hidden});
    const float* src = gu.data();
    std::copy(src + begin * hidden, src + end * hidden, g.data());
    std::copy(src + (width + begin) * hidden, src + (width + end) * hidden, u.data());
    HostTensor d = ColumnSlice(dn, hidden, width, begin, end);
    ScaleHost(d, down_scale);
    return UploadExpert(g, u, d, in, out, hidden, local);
  }
  // The same from GPT-OSS's layout (MoeSpec::interleaved_experts): gate rows 2 x [begin, end) and up
  // rows 2 x [begin, end) + 1 of gate_up_proj[e] (transposed, or dequantized from MXFP4), with
  // those entries of gate_up_proj_bias[e]; columns [begin, end) of down_proj[e], with
  // down_proj_bias[e] when `down_bias_here`.
  absl::StatusOr<MlpWeights> InterleavedExpert(const std::string& prefix, int64_t experts, int64_t e, int64_t hidden,
                                               int64_t width, int64_t begin, int64_t end, bool down_bias_here) {
    const std::string gate_up = prefix + "experts.gate_up_proj";
    const std::string down = prefix + "experts.down_proj";
    const int64_t local = end - begin;
    MlpWeights m;
    if (spec_.mxfp4.has_value()) {
      ASSIGN_OR_RETURN(m, Mxfp4Expert(gate_up, down, experts, e, hidden, width, begin, end));
    } else {
      RETURN_IF_ERROR(CheckDType(gate_up));
      RETURN_IF_ERROR(CheckDType(down));
      ASSIGN_OR_RETURN(HostTensor gu_t, ReadWeightRows(ckpt_, spec_.fp8, gate_up, {experts, hidden, 2 * width}, e, e + 1));
      ASSIGN_OR_RETURN(HostTensor dn_t, ReadWeightRows(ckpt_, spec_.fp8, down, {experts, width, hidden}, e, e + 1));
      // [2 x width, hidden] and [hidden, width], as nn.Linear holds them.
      const HostTensor gu = Transposed(gu_t, hidden, 2 * width);
      const HostTensor dn = Transposed(dn_t, width, hidden);
      HostTensor g({local, hidden}), u({local, hidden});
      for (int64_t r = 0; r < local; ++r) {
        const float* gate_row = gu.data() + 2 * (begin + r) * hidden;
        std::copy(gate_row, gate_row + hidden, g.data() + r * hidden);
        std::copy(gate_row + hidden, gate_row + 2 * hidden, u.data() + r * hidden);
      }
      const HostTensor d = ColumnSlice(dn, hidden, width, begin, end);
      ASSIGN_OR_RETURN(m, UploadExpert(g, u, d, gate_up, down, hidden, local));
    }
    const std::string gate_up_bias = gate_up + "_bias";
    RETURN_IF_ERROR(CheckDType(gate_up_bias));
    ASSIGN_OR_RETURN(HostTensor gub, ckpt_.ReadRows(gate_up_bias, {experts, 2 * width}, e, e + 1));
    HostTensor gb({local}), ub({local});
    for (int64_t r = 0; r < local; ++r) {
      gb.data()[r] = gub.data()[2 * (begin + r)];
      ub.data()[r] = gub.data()[2 * (begin + r) + 1];
    }
    ASSIGN_OR_RETURN(m.gate.b, Upload(gb));
    ASSIGN_OR_RETURN(m.up.b, Upload(ub));
    if (down_bias_here) {
      const std::string down_bias = down + "_bias";
      RETURN_IF_ERROR(CheckDType(down_bias));
      ASSIGN_OR_RETURN(HostTensor db, ckpt_.ReadRows(down_bias, {experts, hidden}, e, e + 1));
      ASSIGN_OR_RETURN(m.down.b, Upload(db));
    }
    return m;
  }
  // Whether MXFP4 matrices stay MXFP4 on this backend, int8 asked or not (they are 4-bit already;
  // int8 would take twice the bytes and round them again); else they are dequantized (and
  // quantized to int8 when asked).
  bool KeepsMxfp4() const { return backend_.SupportsOp(kernels::Op::kLinear, DType::kMxfp4); }
  // InterleavedExpert's matrices from an MXFP4 checkpoint (without biases): gate rows 2 x [begin,
  // end) and up rows 2 x [begin, end) + 1 of gate_up_proj[e], columns [begin, end) of down_proj[e].
  // Kept as MXFP4 where KeepsMxfp4(): the gate and up rows as their bytes, the down columns too when
  // they are whole scale blocks (begin and end multiples of 32), else dequantized like the others.
  absl::StatusOr<MlpWeights> Mxfp4Expert(const std::string& gate_up, const std::string& down, int64_t experts,
                                         int64_t e, int64_t hidden, int64_t width, int64_t begin, int64_t end) {
    ASSIGN_OR_RETURN(const Mxfp4Matrix gu, ReadMxfp4ExpertCodes(ckpt_, gate_up, experts, 2 * width, hidden, e));
    ASSIGN_OR_RETURN(const Mxfp4Matrix dn, ReadMxfp4ExpertCodes(ckpt_, down, experts, hidden, width, e));
    const bool keep = KeepsMxfp4();
    const bool keep_down = keep && begin % kernels::kMxfp4Block == 0 && end % kernels::kMxfp4Block == 0;
    // Rows `rows` of `src`, columns [col_begin, col_end) (whole scale blocks), as a kept matrix.
    auto upload_kept = [&](const Mxfp4Matrix& src, const std::vector<int64_t>& rows, int64_t col_begin,
                           int64_t col_end, LinearWeight* lw) -> absl::Status {
      const int64_t cols = col_end - col_begin;
      lw->dtype = DType::kMxfp4;
      lw->in = cols;
      lw->out = static_cast<int64_t>(rows.size());
      std::vector<uint8_t> codes, scales;
      codes.reserve(static_cast<size_t>(lw->out * cols / 2));
      scales.reserve(static_cast<size_t>(lw->out * cols / kernels::kMxfp4Block));
      for (const int64_t r : rows) {
        const uint8_t* code_row = src.codes.data() + r * (src.cols / 2);
        const uint8_t* scale_row = src.scales.data() + r * (src.cols / kernels::kMxfp4Block);
        codes.insert(codes.end(), code_row + col_begin / 2, code_row + col_end / 2);
        scales.insert(scales.end(), scale_row + col_begin / kernels::kMxfp4Block,
                      scale_row + col_end / kernels::kMxfp4Block);
      }
      if (codes.empty()) return absl::OkStatus();
      ASSIGN_OR_RETURN(lw->w, UploadBytes(codes.data(), codes.size()));
      ASSIGN_OR_RETURN(lw->scales, UploadBytes(scales.data(), scales.size()));
      return absl::OkStatus();
    };
    // The same rows and columns dequantized, in the dtype a dequantized MXFP4 matrix is kept in.
    auto upload_decoded = [&](const Mxfp4Matrix& src, const std::vector<int64_t>& rows, int64_t col_begin,
                              int64_t col_end, const std::string& name, LinearWeight* lw) -> absl::Status {
      const int64_t cols = col_end - col_begin;
      HostTensor t({static_cast<int64_t>(rows.size()), cols});
      for (size_t i = 0; i < rows.size(); ++i) {
        for (int64_t c = 0; c < cols; ++c) t.data()[static_cast<int64_t>(i) * cols + c] = src.At(rows[i], col_begin + c);
      }
      lw->dtype = DequantizedMatrixDType(name);
      lw->in = cols;
      lw->out = static_cast<int64_t>(rows.size());
      ASSIGN_OR_RETURN(lw->w, UploadAs(t, lw->dtype));
      return absl::OkStatus();
    };
    std::vector<int64_t> gate_rows, up_rows, down_rows;
    for (int64_t r = begin; r < end; ++r) {
      gate_rows.push_back(2 * r);
      up_rows.push_back(2 * r + 1);
    }
    for (int64_t r = 0; r < hidden; ++r) down_rows.push_back(r);
    auto upload = [&](bool kept, const Mxfp4Matrix& src, const std::vector<int64_t>& rows, int64_t col_begin,
                      int64_t col_end, const std::string& name, LinearWeight* lw) {
      return kept ? upload_kept(src, rows, col_begin, col_end, lw)
                  : upload_decoded(src, rows, col_begin, col_end, name, lw);
    };
    MlpWeights m;
    RETURN_IF_ERROR(upload(keep, gu, gate_rows, 0, hidden, gate_up, &m.gate));
    RETURN_IF_ERROR(upload(keep, gu, up_rows, 0, hidden, gate_up, &m.up));
    RETURN_IF_ERROR(upload(keep_down, dn, down_rows, begin, end, down, &m.down));
    return m;
  }
  // Columns [begin, end) of `t` [rows, cols] (any leading dims of size 1): [rows, end - begin].
  static HostTensor ColumnSlice(const HostTensor& t, int64_t rows, int64_t cols, int64_t begin, int64_t end) {
    HostTensor out({rows, end - begin});
    for (int64_t r = 0; r < rows; ++r) {
      std::copy(t.data() + r * cols + begin, t.data() + r * cols + end, out.data() + r * (end - begin));
    }
    return out;
  }
  // `t` [rows, cols] (any leading dims of size 1) transposed to [cols, rows].
  static HostTensor Transposed(const HostTensor& t, int64_t rows, int64_t cols) {
    HostTensor out({cols, rows});
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) out.data()[c * rows + r] = t.data()[r * cols + c];
    }
    return out;
  }
  // An expert's gate, up ([local, hidden]) and down ([hidden, local]) matrices, rearranged on the
  // host from the checkpoint tensors `gate_up` and `down` (so FP8 ones are dequantized).
  absl::StatusOr<MlpWeights> UploadExpert(const HostTensor& g, const HostTensor& u, const HostTensor& d,
                                          const std::string& gate_up, const std::string& down, int64_t hidden,
                                          int64_t local) {
    MlpWeights m;
    auto upload = [&](const HostTensor& t, const std::string& name, int64_t in, int64_t out,
                      LinearWeight* lw) -> absl::Status {
      lw->in = in;
      lw->out = out;
      lw->dtype = DequantizedMatrixDType(name);
      ASSIGN_OR_RETURN(lw->w, UploadAs(t, lw->dtype));
      return absl::OkStatus();
    };
    RETURN_IF_ERROR(upload(g, gate_up, hidden, local, &m.gate));
    RETURN_IF_ERROR(upload(u, gate_up, hidden, local, &m.up));
    RETURN_IF_ERROR(upload(d, down, local, hidden, &m.down));
    return m;
  }
  // Rows [begin, end) followed by zero rows up to `rows` rows in all.
  absl::StatusOr<kernels::DeviceBuffer> PaddedRows(const std::string& name, const Shape& shape, int64_t begin,
                                                   int64_t end, int64_t rows, DType dtype = DType::kF32) {
    RETURN_IF_ERROR(CheckDType(name));
    ASSIGN_OR_RETURN(HostTensor t, ReadWeightRows(ckpt_, spec_.fp8, name, shape, begin, end));
    HostTensor padded({rows, shape[1]});
    std::copy(t.data(), t.data() + t.size(), padded.data());
    return UploadAs(padded, dtype);
  }
  size_t bytes() const { return bytes_; }

 private:
  const Checkpoint& ckpt_;
  const ModelSpec& spec_;
  kernels::Backend& backend_;
  const bool int8_;
  size_t bytes_ = 0;
};

}  // namespace

absl::StatusOr<ShardLayout> ShardLayout::Make(const ModelSpec& spec, TpShard shard,
                                              const std::vector<int32_t>& expert_owner, bool split_experts) {
  const int n = shard.size;
  if (n < 1 || shard.rank < 0 || shard.rank >= n) {
    return absl::InvalidArgumentError(absl::StrCat("invalid tensor-parallel rank ", shard.rank, " of ", n));
  }
  ShardLayout l;
  l.rank = shard.rank;
  l.vocab_padded = (spec.vocab_size + n - 1) / n;
  l.vocab_begin = l.vocab_padded * shard.rank;
  if (spec.num_heads % n != 0) return NotDivisible("num_attention_heads", spec.num_heads, n);
  l.q_heads = spec.num_heads / n;
  l.q_head_begin = l.q_heads * shard.rank;
  if (spec.num_kv_heads % n == 0) {
    l.kv_heads = spec.num_kv_heads / n;
    l.kv_head_begin = l.kv_heads * shard.rank;
  } else if (n % spec.num_kv_heads == 0) {
    // Fewer kv heads than ranks: each rank holds the one kv head its query heads read.
    l.kv_heads = 1;
    const int64_t group = spec.num_heads / spec.num_kv_heads;
    l.kv_head_begin = l.q_head_begin / group;
  } else {
    return NotDivisible("num_key_value_heads", spec.num_kv_heads, n);
  }
  if (spec.intermediate_size % n != 0) return NotDivisible("intermediate_size", spec.intermediate_size, n);
  l.ffn = spec.intermediate_size / n;
  if (!spec.IsMoe() && !expert_owner.empty()) {
    return absl::InvalidArgumentError("an expert placement was given for a model without experts");
  }
  if (spec.IsMoe()) {
    const int64_t e_count = spec.moe.num_experts;
    l.expert_parallel = e_count >= n && n > 1 && !split_experts;
    if (!expert_owner.empty()) {
      if (static_cast<int64_t>(expert_owner.size()) != e_count) {
        return absl::InvalidArgumentError(absl::StrCat("expert placement lists ", expert_owner.size(),
                                                       " experts; the model has ", e_count));
      }
      if (!l.expert_parallel) {
        return absl::InvalidArgumentError(absl::StrCat("an expert placement needs at least as many experts (", e_count,
                                                       ") as ranks (", n, ") and more than one rank"));
      }
      for (size_t e = 0; e < expert_owner.size(); ++e) {
        if (expert_owner[e] < 0 || expert_owner[e] >= n) {
          return absl::InvalidArgumentError(absl::StrCat("expert placement puts expert ", e, " on rank ",
                                                         expert_owner[e], ", outside [0, ", n, ")"));
        }
      }
      l.expert_owner = expert_owner;
    } else if (l.expert_parallel) {
      // Balanced contiguous blocks: expert e on rank floor(e * n / experts).
      for (int64_t e = 0; e < e_count; ++e) l.expert_owner.push_back(static_cast<int32_t>(e * n / e_count));
    }
    if (l.expert_parallel) {
      l.expert_ffn = spec.moe.expert_intermediate_size;
    } else {
      if (spec.moe.expert_intermediate_size % n != 0) {
        return NotDivisible("the expert intermediate size", spec.moe.expert_intermediate_size, n);
      }
      l.expert_ffn = spec.moe.expert_intermediate_size / n;
    }
    if (spec.moe.shared_expert_intermediate_size % n != 0) {
      return NotDivisible("shared_expert_intermediate_size", spec.moe.shared_expert_intermediate_size, n);
    }
    l.shared_ffn = spec.moe.shared_expert_intermediate_size / n;
  }
  return l;
}

namespace {

// The order in which the loader keeps a RoPE slice of `dim` rows: DeepSeek's interleaved pairs
// (x0, x1), (x2, x3), ... become rotate_half's halves (x0, x2, ..., x1, x3, ...).
std::vector<int64_t> RopeRowOrder(int64_t dim, bool interleaved) {
  std::vector<int64_t> order;
  for (int64_t i = 0; i < dim; ++i) order.push_back(interleaved ? (i < dim / 2 ? 2 * i : 2 * (i - dim / 2) + 1) : i);
  return order;
}

// The rows of a head of `dim` whose first `rotary` rotate in interleaved pairs, reordered into
// rotate_half's halves there; the rest in place.
std::vector<int64_t> InterleavedHeadRowOrder(int64_t dim, int64_t rotary) {
  std::vector<int64_t> order = RopeRowOrder(rotary, true);
  for (int64_t i = rotary; i < dim; ++i) order.push_back(i);
  return order;
}

// Multi-head latent attention weights of one layer (see LayerWeights).
absl::Status LoadMla(Loader& ld, const ModelSpec& spec, const ShardLayout& layout, TpShard shard, const std::string& p,
                     LayerWeights* lw) {
  const MlaSpec& m = spec.mla;
  const int64_t h = spec.hidden_size, heads = spec.num_heads;
  const int64_t nope = m.qk_nope_head_dim, rope = m.qk_rope_head_dim, qk = m.qk_head_dim();
  const int64_t hb = layout.q_head_begin, he = hb + layout.q_heads;
  const std::vector<int64_t> rope_order = RopeRowOrder(rope, m.rope_interleave);
  std::string q_name;
  int64_t q_in = h;
  if (m.q_lora_rank > 0) {
    ASSIGN_OR_RETURN(lw->q_a, ld.ColumnParallel(p + "self_attn.q_a_proj", h, m.q_lora_rank, 0, m.q_lora_rank, false));
    ASSIGN_OR_RETURN(lw->q_a_norm, ld.Full(p + "self_attn.q_a_layernorm.weight", {m.q_lora_rank}));
    q_name = p + "self_attn.q_b_proj.weight";
    q_in = m.q_lora_rank;
  } else {
    q_name = p + "self_attn.q_proj.weight";
  }
  std::vector<int64_t> nope_rows, rope_rows;
  for (int64_t g = hb; g < he; ++g) {
    for (int64_t r = 0; r < nope; ++r) nope_rows.push_back(g * qk + r);
    for (int64_t r : rope_order) rope_rows.push_back(g * qk + nope + r);
  }
  ASSIGN_OR_RETURN(lw->q_nope, ld.PickedRows(q_name, {heads * qk, q_in}, nope_rows));
  ASSIGN_OR_RETURN(lw->q_rope, ld.PickedRows(q_name, {heads * qk, q_in}, rope_rows));
  const std::string kv_a = p + "self_attn.kv_a_proj_with_mqa";
  ASSIGN_OR_RETURN(lw->kv_latent, ld.ColumnParallel(kv_a, h, m.kv_lora_rank + rope, 0, m.kv_lora_rank, false));
  std::vector<int64_t> kv_rope_rows;
  for (int64_t r : rope_order) kv_rope_rows.push_back(m.kv_lora_rank + r);
  ASSIGN_OR_RETURN(lw->kv_rope, ld.PickedRows(kv_a + ".weight", {m.kv_lora_rank + rope, h}, kv_rope_rows));
  ASSIGN_OR_RETURN(lw->kv_a_norm, ld.Full(p + "self_attn.kv_a_layernorm.weight", {m.kv_lora_rank}));
  RETURN_IF_ERROR(ld.KvB(p + "self_attn.kv_b_proj.weight", heads, nope, m.v_head_dim, m.kv_lora_rank, hb, he,
                         &lw->w_uk, &lw->w_uv));
  const int64_t o_in = heads * m.v_head_dim;
  ASSIGN_OR_RETURN(lw->o, ld.RowParallel(p + "self_attn.o_proj", o_in, h, hb * m.v_head_dim, he * m.v_head_dim, false,
                                         shard.rank == 0));
  return absl::OkStatus();
}

// Where the decoder's tensors ("<root>embed_tokens.weight", "<root>layers.N....", "<root>norm.weight")
// and an untied lm_head live: "<weight_prefix>model." and "<weight_prefix>lm_head.weight", except
// in a Gemma-3 multimodal checkpoint (ModelSpec::multimodal_text), which transformers >= 5 saves
// under "model.language_model." (lm_head as usual) and the released checkpoints under
// "language_model.model." (lm_head "language_model.lm_head.weight").
struct DecoderNames {
  std::string root = "model.";
  std::string lm_head = "lm_head.weight";
};

DecoderNames DecoderNamesOf(const ModelSpec& spec, const Checkpoint& ckpt) {
  if (!spec.multimodal_text) {
    // ModelSpec::weight_prefix: "language_model." for Llama-4's multimodal checkpoints, else "".
    return {spec.weight_prefix + "model.", spec.weight_prefix + "lm_head.weight"};
  }
  if (ckpt.Has("model.language_model.embed_tokens.weight")) return {"model.language_model.", "lm_head.weight"};
  return {"language_model.model.", "language_model.lm_head.weight"};
}


// The prefix of layer `layer`'s MLP or MoE block: "<root>layers.<layer>.mlp." (Mixtral's and
// GraniteMoe's MoE: block_sparse_moe., Llama-4: feed_forward.), under the decoder's root
// (DecoderNames).
std::string FfnPrefix(const ModelSpec& spec, const std::string& root, int64_t layer) {
  const char* block = "mlp.";
  if (spec.arch == Architecture::kLlama4) block = "feed_forward.";
  if ((spec.arch == Architecture::kMixtral || spec.IsGraniteMoe()) && spec.IsSparseLayer(layer)) {
    block = "block_sparse_moe.";
  }
  return absl::StrCat(root, "layers.", layer, ".", block);
}

// The router's weight under the MoE block: Llama-4, GraniteMoeSWA and GPT-OSS name it `router`, the
// other GraniteMoe ones `router.layer`, the others `gate`.
const char* RouterName(const ModelSpec& spec) {
  if (spec.arch == Architecture::kLlama4 || spec.arch == Architecture::kGraniteMoeSWA ||
      spec.arch == Architecture::kGptOss) {
    return "router.weight";
  }
  return spec.IsGraniteMoe() ? "router.layer.weight" : "gate.weight";
}

std::string ExpertPrefix(const ModelSpec& spec, const std::string& root, int64_t layer, int64_t expert) {
  return absl::StrCat(FfnPrefix(spec, root, layer), "experts.", expert, ".");
}

// Expert `e` of a layer: its columns [begin, end) of the expert MLP (all of them when whole), with
// the down projection's bias (GPT-OSS's) when `down_bias_here` (on one of the ranks that split an
// expert). The down projection is scaled by the model's residual_multiplier (Granite), which
// scales the whole block's output.
absl::StatusOr<MlpWeights> LoadExpertSlice(Loader& ld, const ModelSpec& spec, const std::string& root, int64_t layer,
                                           int64_t e, int64_t begin, int64_t end, bool down_bias_here) {
  const float down_scale = static_cast<float>(spec.residual_multiplier);
  if (spec.moe.interleaved_experts) {
    return ld.InterleavedExpert(FfnPrefix(spec, root, layer), spec.moe.num_experts, e, spec.hidden_size,
                                spec.moe.expert_intermediate_size, begin, end, down_bias_here);
  }
  if (spec.moe.fused_experts) {
    return ld.FusedExpert(FfnPrefix(spec, root, layer), spec.moe.num_experts, e, spec.hidden_size,
                          spec.moe.expert_intermediate_size, begin, end, down_scale);
  }
  if (spec.moe.stacked_experts) {
    return ld.StackedExpert(FfnPrefix(spec, root, layer), spec.arch == Architecture::kGraniteMoeSWA,
                            spec.moe.num_experts, e, spec.hidden_size, spec.moe.expert_intermediate_size, begin,
                            end, down_scale);
  }
  const std::string ep = ExpertPrefix(spec, root, layer, e);
  // No biases in these layouts (Mlp's rank only places a bias).
  if (spec.arch == Architecture::kMixtral) {
    return ld.Mlp(ep, "w1", "w3", "w2", spec.hidden_size, spec.moe.expert_intermediate_size, begin, end, false, 0,
                  down_scale);
  }
  return ld.Mlp(ep, "gate_proj", "up_proj", "down_proj", spec.hidden_size, spec.moe.expert_intermediate_size, begin,
                end, false, 0, down_scale);
}

}  // namespace

DType KeptWeightDType(const kernels::Backend& backend, DType stored, kernels::Op op) {
  if (stored == DType::kF8E4M3) {
    if (backend.SupportsOp(op, DType::kF8E4M3)) return DType::kF8E4M3;
    return backend.SupportsOp(op, DType::kBF16) ? DType::kBF16 : DType::kF32;
  }
  if (stored == DType::kF32 || !backend.SupportsOp(op, stored)) return DType::kF32;
  return stored;
}

DType KeptEmbeddingDType(const kernels::Backend& backend, DType stored, bool also_lm_head) {
  const DType dtype = KeptWeightDType(backend, stored, kernels::Op::kEmbedding);
  if (also_lm_head && KeptWeightDType(backend, stored, kernels::Op::kLinear) != dtype) return DType::kF32;
  return dtype;
}

std::vector<int32_t> LayerExpertOwners(const ShardLayout& layout, int64_t num_experts,
                                       const std::map<int64_t, std::vector<int32_t>>& layer_experts, int64_t layer) {
  std::vector<int32_t> owners;
  if (auto it = layer_experts.find(layer); it != layer_experts.end()) {
    owners = it->second;
    if (!layout.expert_parallel) {
      for (int32_t& o : owners) o = o == kRemoteExpert ? kRemoteExpert : 0;
    }
  } else if (layout.expert_parallel) {
    owners = layout.expert_owner;
  } else {
    owners.assign(static_cast<size_t>(num_experts), 0);
  }
  return owners;
}

absl::StatusOr<MlpWeights> LoadExpert(const ModelSpec& spec, int64_t layer, int64_t expert, const Checkpoint& ckpt,
                                      kernels::Backend& backend, size_t* bytes, Quantization quantize) {
  if (layer < 0 || layer >= spec.num_layers || !spec.IsSparseLayer(layer)) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " is not a MoE layer of the model"));
  }
  if (expert < 0 || expert >= spec.moe.num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert ", expert, " is outside [0, ", spec.moe.num_experts, ") (layer ", layer, ")"));
  }
  Loader ld(ckpt, spec, backend, quantize);
  ASSIGN_OR_RETURN(MlpWeights m, LoadExpertSlice(ld, spec, DecoderNamesOf(spec, ckpt).root, layer, expert, 0,
                                                 spec.moe.expert_intermediate_size, /*down_bias_here=*/true));
  if (bytes != nullptr) *bytes += ld.bytes();
  return m;
}


absl::StatusOr<ModelWeights> LoadWeights(const ModelSpec& spec, const ShardLayout& layout, TpShard shard,
                                         int64_t layer_begin, int64_t layer_end, const Checkpoint& ckpt,
                                         kernels::Backend& backend,
                                         const std::map<int64_t, std::vector<int32_t>>& layer_experts,
                                         Quantization quantize,
                                         const std::function<void(int64_t, int64_t, size_t)>& on_layer) {
  Loader ld(ckpt, spec, backend, quantize);
  ModelWeights mw;
  const int64_t h = spec.hidden_size;
  const int64_t d = spec.head_dim;
  const int64_t q_out = spec.num_heads * d;
  const int64_t kv_out = spec.num_kv_heads * d;
  const bool first = layer_begin == 0;
  const bool last = layer_end == spec.num_layers;
  const bool lm_head_is_embedding = spec.tie_word_embeddings && shard.size == 1;
  // Granite's residual_multiplier, folded into o_proj and down_proj.
  const float residual_scale = static_cast<float>(spec.residual_multiplier);
  const DecoderNames names = DecoderNamesOf(spec, ckpt);
  const std::string embed_name = names.root + "embed_tokens.weight";
  if (first || (last && lm_head_is_embedding)) {
    const std::string& name = embed_name;
    // A tied lm_head multiplies with the table too: keep a dtype both ops take.
    ASSIGN_OR_RETURN(const SafetensorsEntry* entry, ckpt.Find(name));
    mw.embedding_dtype = KeptEmbeddingDType(backend, entry->dtype, last && lm_head_is_embedding);
    ASSIGN_OR_RETURN(mw.embedding, ld.Full(name, {spec.vocab_size, h}, mw.embedding_dtype));
  }
  if (last) {
    ASSIGN_OR_RETURN(mw.final_norm,
                     ld.Norm(names.root + "norm.weight", h, static_cast<float>(1.0 / spec.logits_scaling)));
    // lm_head: this rank's vocab rows, zero-padded to vocab_padded rows.
    const int64_t vb = std::min(layout.vocab_begin, spec.vocab_size);
    const int64_t ve = std::min(layout.vocab_begin + layout.vocab_padded, spec.vocab_size);
    mw.lm_head.in = h;
    mw.lm_head.out = layout.vocab_padded;
    mw.lm_head_is_embedding = lm_head_is_embedding;
    if (!lm_head_is_embedding) {
      const std::string name = spec.tie_word_embeddings ? embed_name : names.lm_head;
      mw.lm_head.dtype = ld.MatrixDType(name);
      if (mw.lm_head.dtype == DType::kF8E4M3) {
        RETURN_IF_ERROR(ld.UploadFp8(name, {spec.vocab_size, h}, vb, ve, 0, h, layout.vocab_padded, &mw.lm_head));
      } else {
        ASSIGN_OR_RETURN(mw.lm_head.w,
                         ld.PaddedRows(name, {spec.vocab_size, h}, vb, ve, layout.vocab_padded, mw.lm_head.dtype));
      }
    }
  }
  for (int64_t i = layer_begin; i < layer_end; ++i) {
    const std::string p = absl::StrCat(names.root, "layers.", i, ".");
    LayerWeights lw;
    lw.layer = i;
    ASSIGN_OR_RETURN(lw.input_norm, ld.Norm(p + "input_layernorm.weight", h));
    if (spec.arch == Architecture::kGlm4) {
      // GLM-4's names for Gemma-2's three other norms: after the attention, before and after the MLP.
      ASSIGN_OR_RETURN(lw.post_norm, ld.Norm(p + "post_self_attn_layernorm.weight", h));
      ASSIGN_OR_RETURN(lw.pre_ffn_norm, ld.Norm(p + "post_attention_layernorm.weight", h));
      ASSIGN_OR_RETURN(lw.post_ffn_norm, ld.Norm(p + "post_mlp_layernorm.weight", h));
    } else {
      ASSIGN_OR_RETURN(lw.post_norm, ld.Norm(p + "post_attention_layernorm.weight", h));
      if (spec.sandwich_norms) {
        ASSIGN_OR_RETURN(lw.pre_ffn_norm, ld.Norm(p + "pre_feedforward_layernorm.weight", h));
        ASSIGN_OR_RETURN(lw.post_ffn_norm, ld.Norm(p + "post_feedforward_layernorm.weight", h));
      }
    }
    const int64_t qb = layout.q_head_begin * d, qe = qb + layout.q_heads * d;
    const int64_t kb = layout.kv_head_begin * d, ke = kb + layout.kv_heads * d;
    if (spec.IsMla()) {
      RETURN_IF_ERROR(LoadMla(ld, spec, layout, shard, p, &lw));
    } else if (spec.fused_qkv) {
      // qkv_proj rows: q [0, q_out), k [q_out, q_out + kv_out), v [q_out + kv_out, q_out + 2 kv_out).
      const std::string fused = p + "self_attn.qkv_proj";
      const int64_t rows = q_out + 2 * kv_out;
      ASSIGN_OR_RETURN(lw.q, ld.ColumnParallel(fused, h, rows, qb, qe, spec.qkv_bias));
      ASSIGN_OR_RETURN(lw.k, ld.ColumnParallel(fused, h, rows, q_out + kb, q_out + ke, spec.qkv_bias));
      ASSIGN_OR_RETURN(lw.v, ld.ColumnParallel(fused, h, rows, q_out + kv_out + kb, q_out + kv_out + ke, spec.qkv_bias));
    } else if (spec.rope_interleaved) {
      // Every head's rotated rows (and their biases) reordered from interleaved pairs to
      // rotate_half's halves.
      const std::vector<int64_t> order = InterleavedHeadRowOrder(d, spec.RotaryDim());
      std::vector<int64_t> q_rows, k_rows;
      for (int64_t g = layout.q_head_begin; g < layout.q_head_begin + layout.q_heads; ++g) {
        for (int64_t r : order) q_rows.push_back(g * d + r);
      }
      for (int64_t g = layout.kv_head_begin; g < layout.kv_head_begin + layout.kv_heads; ++g) {
        for (int64_t r : order) k_rows.push_back(g * d + r);
      }
      ASSIGN_OR_RETURN(lw.q, ld.PickedRows(p + "self_attn.q_proj.weight", {q_out, h}, q_rows));
      ASSIGN_OR_RETURN(lw.k, ld.PickedRows(p + "self_attn.k_proj.weight", {kv_out, h}, k_rows));
      if (spec.qkv_bias) {
        ASSIGN_OR_RETURN(lw.q.b, ld.PickedValues(p + "self_attn.q_proj.bias", q_out, q_rows));
        ASSIGN_OR_RETURN(lw.k.b, ld.PickedValues(p + "self_attn.k_proj.bias", kv_out, k_rows));
      }
      ASSIGN_OR_RETURN(lw.v, ld.ColumnParallel(p + "self_attn.v_proj", h, kv_out, kb, ke, spec.qkv_bias));
    } else {
      ASSIGN_OR_RETURN(lw.q, ld.ColumnParallel(p + "self_attn.q_proj", h, q_out, qb, qe, spec.qkv_bias));
      ASSIGN_OR_RETURN(lw.k, ld.ColumnParallel(p + "self_attn.k_proj", h, kv_out, kb, ke, spec.qkv_bias));
      ASSIGN_OR_RETURN(lw.v, ld.ColumnParallel(p + "self_attn.v_proj", h, kv_out, kb, ke, spec.qkv_bias));
    }
    if (spec.attention_sinks) {
      ASSIGN_OR_RETURN(lw.sinks, ld.Rows(p + "self_attn.sinks", {spec.num_heads}, layout.q_head_begin,
                                         layout.q_head_begin + layout.q_heads));
    }
    if (spec.qk_norm) {
      // As (1 + w) for Gemma-3 (ModelSpec::norm_plus_one).
      ASSIGN_OR_RETURN(lw.q_norm, ld.Norm(p + "self_attn.q_norm.weight", d));
      ASSIGN_OR_RETURN(lw.k_norm, ld.Norm(p + "self_attn.k_norm.weight", d));
    }
    if (!spec.IsMla()) {
      ASSIGN_OR_RETURN(lw.o, ld.RowParallel(p + "self_attn.o_proj", q_out, h, qb, qe, spec.o_bias, shard.rank == 0,
                                            residual_scale));
    }
    lw.sparse = spec.IsSparseLayer(i);
    if (!lw.sparse) {
      const int64_t fb = layout.ffn * shard.rank;
      if (spec.fused_gate_up) {
        ASSIGN_OR_RETURN(lw.mlp, ld.FusedMlp(FfnPrefix(spec, names.root, i), "gate_up_proj", "down_proj", h,
                                             spec.intermediate_size, fb, fb + layout.ffn, shard.rank));
      } else {
        ASSIGN_OR_RETURN(lw.mlp, ld.Mlp(FfnPrefix(spec, names.root, i), "gate_proj", "up_proj", "down_proj", h, spec.intermediate_size, fb,
                                        fb + layout.ffn, spec.mlp_bias, shard.rank, residual_scale));
      }
    } else {
      const std::string moe = FfnPrefix(spec, names.root, i);
      const int64_t e_count = spec.moe.num_experts;
      ASSIGN_OR_RETURN(lw.router.w, ld.Full(moe + RouterName(spec), {e_count, h}));
      lw.router.in = h;
      lw.router.out = e_count;
      if (spec.moe.router_bias) {
        ASSIGN_OR_RETURN(lw.router.b, ld.Full(moe + "router.bias", {e_count}));
      }
      if (spec.moe.scoring == MoeScoring::kSigmoidGrouped) {
        ASSIGN_OR_RETURN(lw.score_bias,
                         ld.FullF32OrConfigDType(moe + "gate.e_score_correction_bias", {e_count}, &lw.score_bias_host));
      }
      // Expert parallel: whole local experts (slice [0, expert_ffn) = all of it). Otherwise every
      // expert is split tensor-parallel like a dense MLP.
      const int64_t eb = layout.expert_parallel ? 0 : layout.expert_ffn * shard.rank;
      // A whole expert's rank holds its down bias; of an expert split over the ranks, rank 0.
      const bool down_bias_here = layout.expert_parallel || shard.rank == 0;
      lw.expert_owner = LayerExpertOwners(layout, e_count, layer_experts, i);
      for (int64_t e = 0; e < e_count; ++e) {
        lw.has_remote_experts |= lw.IsRemoteExpert(e);
        MlpWeights m;
        if (lw.IsLocalExpert(e, layout)) {
          ASSIGN_OR_RETURN(m, LoadExpertSlice(ld, spec, names.root, i, e, eb, eb + layout.expert_ffn, down_bias_here));
        }
        lw.experts.push_back(std::move(m));
      }
      if (layout.shared_ffn > 0) {
        const int64_t sb = layout.shared_ffn * shard.rank;
        const int64_t width = spec.moe.shared_expert_intermediate_size;
        if (spec.IsGraniteMoe()) {
          // GraniteMoeShared: `shared_mlp` beside the MoE block, gate and up fused, no gate.
          ASSIGN_OR_RETURN(lw.shared, ld.FusedMlp(p + "shared_mlp.", "input_linear", "output_linear", h, width, sb,
                                                  sb + layout.shared_ffn, shard.rank, residual_scale));
        } else {
          // Qwen2-MoE: `shared_expert` with a gate; DeepSeek-V3: `shared_experts`, no gate; Llama-4:
          // `shared_expert`, no gate.
          const char* shared_name =
              spec.moe.shared_expert_gate || spec.arch == Architecture::kLlama4 ? "shared_expert." : "shared_experts.";
          ASSIGN_OR_RETURN(lw.shared, ld.Mlp(moe + shared_name, "gate_proj", "up_proj", "down_proj", h, width, sb,
                                             sb + layout.shared_ffn, false, shard.rank, residual_scale));
        }
        if (spec.moe.shared_expert_gate) {
          ASSIGN_OR_RETURN(lw.shared_gate.w, ld.Full(moe + "shared_expert_gate.weight", {1, h}));
          lw.shared_gate.in = h;
          lw.shared_gate.out = 1;
        }
      }
    }
    mw.layers.push_back(std::move(lw));
    if (on_layer) on_layer(i - layer_begin + 1, layer_end - layer_begin, ld.bytes());
  }
  mw.bytes = ld.bytes();
  return mw;
}

}  // namespace shardserve::engine

// The compute backend interface: memory and the ops the engine runs, in the spirit of ggml's
// backend (device -> buffer -> op) and TensorRT-LLM's Params-struct kernels.
//
// Conventions for every op:
//   * Each op takes one Params struct whose pointer members carry their shape in a comment. All
//     pointers are device pointers of *this* backend (host memory for the CPU backend), except
//     where a member says "host".
//   * Params::Validate() checks sizes and non-null pointers; each op calls it first and returns
//     its InvalidArgument status without touching memory. Validate() cannot see buffer sizes, so
//     the caller guarantees that pointers cover the stated shapes.
//   * Ops are enqueued in order on the backend's single stream; results are visible to later ops
//     and, after Synchronize(), to the host. Ops never allocate.
//   * A failing device call becomes a non-OK Status (Internal, with the library's message) and
//     the backend is then unhealthy; it never aborts the process.
//   * A Backend is used by one thread at a time (the rank thread that owns it).
#ifndef SHARDSERVE_WORKER_KERNELS_BACKEND_H_
#define SHARDSERVE_WORKER_KERNELS_BACKEND_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include <memory>
#include <optional>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/tensor/dtype.h"
#include "worker/kernels/shared/fp8_math.h"
#include "worker/kernels/shared/moe_routing.h"
#include "worker/kernels/shared/row_math.h"  // GateActivation (plain data, shared with the kernels)

namespace shardserve::kernels {

enum class DeviceKind : uint8_t { kCpu, kCuda };

// Owned device memory. Move-only; frees itself through the backend's deallocator.
class DeviceBuffer {
 public:
  using FreeFn = void (*)(void*);
  DeviceBuffer() = default;
  DeviceBuffer(void* ptr, size_t bytes, FreeFn free_fn) : ptr_(ptr), bytes_(bytes), free_fn_(free_fn) {}
  ~DeviceBuffer() { Reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_), free_fn_(o.free_fn_) {
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      ptr_ = o.ptr_;
      bytes_ = o.bytes_;
      free_fn_ = o.free_fn_;
      o.ptr_ = nullptr;
      o.bytes_ = 0;
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }
  bool empty() const { return ptr_ == nullptr; }

 private:
  void Reset() {
    if (ptr_ != nullptr && free_fn_ != nullptr) free_fn_(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  FreeFn free_fn_ = nullptr;
};

// A weight matrix as the backend holds it: its element type, its device memory and, for F8_E4M3,
// its scales. Activations are f32 for every op; weights may be narrower where the backend
// SupportsOp() the pair. The implicit conversion from `const float*` keeps f32 call sites short.
struct WeightView {
  DType dtype = DType::kF32;
  const void* data = nullptr;  // elements of `dtype` (bf16/f16: their 16-bit patterns; F8_E4M3: codes)
  // kF8E4M3 only: element (r, c) is E4M3Decode(code) x Fp8ScaleAt(fp8, r, c) (shared/fp8_math.h).
  Fp8ScaleGrid fp8;
  // kMxfp4 only: the e8m0 scale bytes [out, in / 32] beside `data`'s code pairs [out, in / 2];
  // element (r, c) is Mxfp4At (shared/mxfp4_math.h).
  const uint8_t* mxfp4_scales = nullptr;
  WeightView() = default;
  WeightView(const float* f32) : data(f32) {}  // NOLINT(google-explicit-constructor)
  WeightView(DType type, const void* p) : dtype(type), data(p) {}
  static WeightView Bf16(const uint16_t* p) { return {DType::kBF16, p}; }
  static WeightView F16(const uint16_t* p) { return {DType::kF16, p}; }
  static WeightView F8E4M3(const uint8_t* codes, const Fp8ScaleGrid& scales) {
    WeightView v(DType::kF8E4M3, codes);
    v.fp8 = scales;
    return v;
  }
  static WeightView Mxfp4(const uint8_t* codes, const uint8_t* scales) {
    WeightView v(DType::kMxfp4, codes);
    v.mxfp4_scales = scales;
    return v;
  }
};

// The ops of this interface, for SupportsOp().
enum class Op : uint8_t {
  kEmbedding, kLinear, kRmsNorm, kAddRmsNorm, kRope, kKvWrite, kAttention, kSiluMul, kAdd, kGatherRows,
  kScatterAddRows, kSigmoidScaleRows, kArgmaxRows, kZero, kScale, kScaleRows,
  // Multi-head latent attention (DeepSeek-V3): optional; the Backend defaults are Unimplemented.
  kHeadLinear, kMlaKvWrite, kMlaAttention,
  // Token sampling on the device: optional; the Backend default is Unimplemented.
  kSampleRows,
  // MoE routing and grouping by expert on the device: optional; the Backend default is Unimplemented.
  kMoeRoute,
  // Products of row groups with one matrix each (the experts of a MoE layer in one grouped GEMM):
  // optional; the Backend default is Unimplemented, and engines then run a Linear per expert.
  kGroupedLinear,
  // A MoE layer's grouped expert outputs added to their tokens in one pass: optional; the Backend
  // default is Unimplemented, and engines then run a ScatterAddRows per expert.
  kMoeCombine,
};
// "Embedding", "Linear", ... for messages.
const char* OpName(Op op);
// Unimplemented("<backend>: <op> does not take <dtype> weights"): what an op returns for a dtype
// its backend does not SupportsOp().
absl::Status UnsupportedWeights(absl::string_view backend_name, Op op, DType dtype);

// The largest shapes one engine step passes to the ops, for Backend::Reserve().
struct StepLimits {
  int64_t max_tokens = 0;       // rows of any op's activations
  int64_t max_linear_in = 0;    // the widest Linear input
  // The widest input of an MoE layer's grouped expert products (the hidden size for gate/up, an
  // expert's width for down), whose rows are max_tokens x top_k; 0 = max_linear_in. Dense and
  // shared-expert products take max_tokens rows.
  int64_t max_grouped_in = 0;
  int64_t max_q_heads = 0;      // query heads of Attention
  int64_t max_head_dim = 0;
  int64_t max_context = 0;      // the longest sequence Attention reads (positions)
  // The MoE layers' routing (num_experts 0: no MoE layer): MoeRoute of up to max_tokens tokens
  // then needs no memory beyond the reservation (CUDA: its workspace; growing it during a
  // recording would wait on the stream and break the recording).
  MoeRouting moe_routing;
};

// The most activation elements one product of a step within `limits` takes: [max_tokens,
// max_linear_in], or an MoE layer's grouped [max_tokens x top_k, max_grouped_in] (top_k > 1). What
// a backend that rounds a product's activations to 16 bits holds at once (CUDA's scratch).
int64_t MaxProductActivations(const StepLimits& limits);

// out[t, :] = table[ids[t], :], widened to f32.
struct EmbeddingParams {
  WeightView table;              // [vocab, hidden]
  const int32_t* ids = nullptr;  // [tokens], each in [0, vocab) (checked by the engine)
  float* out = nullptr;          // [tokens, hidden]
  int64_t tokens = 0, vocab = 0, hidden = 0;
  absl::Status Validate() const;
};

// y = x . w^T (+ bias), or y += x . w^T (+ bias) when `accumulate`.
struct LinearParams {
  const float* x = nullptr;     // [tokens, in]
  WeightView w;                 // [out, in]  (PyTorch nn.Linear layout), of a dtype SupportsOp(kLinear, ...)
  const float* bias = nullptr;  // [out] or null
  float* y = nullptr;           // [tokens, out]; must not alias x
  int64_t tokens = 0, in = 0, out = 0;
  bool accumulate = false;
  absl::Status Validate() const;
};

// out = act(gate) * up, elementwise (SiLU unless `act` says otherwise): GatedProduct of
// kernels/shared/row_math.h, which also names the activations (GateActivation).
struct SiluMulParams {
  const float* gate = nullptr;  // [n]
  const float* up = nullptr;    // [n]
  float* out = nullptr;         // [n]; may alias gate or up
  int64_t n = 0;
  GateActivation act = GateActivation::kSilu;
  absl::Status Validate() const;
};

struct RmsNormParams;

// Several products of one x: parts[i].y = x . parts[i].w^T (+ bias), or += when accumulate, for
// i < num_parts. One pass over x (on a GPU, one launch for a decode step, or one rounding of x for
// the tensor cores) instead of one per product: a layer's q, k and v projections, an MLP's gate and
// up. The same sums as a Linear per part.
//
// Gated (`gated` set): a gated MLP's gate and up projections and its activation in one op. It takes
// exactly 2 parts of equal `out`, neither accumulating, and computes
//   parts[0].y = GatedProduct(*gated, x . W0^T (+ b0), x . W1^T (+ b1))   (act(gate) * up)
// exactly as the two Linears followed by SiluMul{gate = parts[0].y, up = parts[1].y, out =
// parts[0].y} do (the default implementation is that sequence): the same f32 values on every
// backend's fused path. parts[1].y is scratch: the op may leave the up projection there or leave it
// untouched (CUDA's decode GEMV never writes it), so its contents afterwards are unspecified. On a
// GPU a decode step then costs one launch instead of two.
//
// Normed (`norm` set): x is the raw residual stream and the products take its RMS-normalised rows,
// RmsNormRow(x[t], norm.weight, norm.eps) over `in` elements, instead: the norm before a layer's
// first products fused into them. The default implementation is RmsNorm{x, norm.weight, y =
// norm.scratch} followed by the group over norm.scratch; a backend that fuses the norm computes
// each normalised element with RmsNormRow's formula from the same sum of squares as its RmsNorm op
// (the same f32 values), and may leave norm.scratch untouched, so its contents afterwards are
// unspecified. On a GPU a decode step then has no norm launch of its own. Combines with `gated`.
struct LinearGroupParams {
  static constexpr int kMaxParts = 4;
  struct Part {
    WeightView w;                 // [out, in]
    const float* bias = nullptr;  // [out] or null
    float* y = nullptr;           // [tokens, out]; must not alias x or another part's y
    int64_t out = 0;
    bool accumulate = false;
  };
  const float* x = nullptr;  // [tokens, in]
  int64_t tokens = 0, in = 0;
  std::array<Part, kMaxParts> parts{};
  int num_parts = 0;
  // Unset: plain products. Set: the gated form above, with this activation.
  std::optional<GateActivation> gated;
  struct Norm {
    const float* weight = nullptr;  // [in]
    float eps = 1e-6f;
    float* scratch = nullptr;  // [tokens, in]; must not alias x or any part's y
  };
  // Unset: x as it is. Set: the normed form above.
  std::optional<Norm> norm;
  // Part i as a Linear.
  LinearParams PartParams(int i) const;
  // The RmsNorm of the normed form's default implementation (x into norm->scratch).
  RmsNormParams NormParams() const;
  // The SiluMul that finishes the gated form: gate = out = parts[0].y, up = parts[1].y, n = tokens x out.
  SiluMulParams GateParams() const;
  // InvalidArgument for a part count outside [1, kMaxParts], a part Linear would refuse (naming
  // the part), two parts writing one y, a gated form that is not 2 parts of equal out with no
  // accumulate, or a normed form with a null weight or scratch, a negative or non-finite eps, or a
  // scratch that aliases x or a part's y.
  absl::Status Validate() const;
};

// A MoE layer's experts over the rows MoeRoute grouped, their row ranges left on the device (the
// device-offsets form of GroupedLinear and MoeCombine): expert e's group is rows
// [offsets[e], offsets[e + 1]), read by the op on the device, so no host copy and no wait precede
// the op (a decode step can then be recorded as a graph). Only the experts the rank holds are
// computed (`host_ids`), in ascending order.
//
// The caller guarantees, as MoeRoute's offsets do, that offsets[0] >= 0, the offsets do not
// decrease, offsets[num_experts] <= the op's rows, and every held expert's group has at most
// max_rows_per_group rows (in a step of T tokens, each expert gets at most one row per token, so
// T is a bound). Backends that read the offsets on the host (CPU) check this and return
// InvalidArgument; device backends cannot, and then compute the rows they find.
struct DeviceExpertGroups {
  const int32_t* offsets = nullptr;   // [num_experts + 1] device (MoeRouteParams::offsets)
  const int32_t* host_ids = nullptr;  // [num_held] host: the experts computed, ascending, in [0, num_experts)
  const int32_t* ids = nullptr;       // [num_held] device: the same ids (device kernels read these)
  int64_t num_experts = 0, num_held = 0;
  int64_t max_rows_per_group = 0;
  // InvalidArgument (prefixed with `op`) for a null pointer, num_experts < 1, num_held outside
  // [0, num_experts], ids not ascending or outside [0, num_experts), or max_rows_per_group outside
  // [0, rows].
  absl::Status Validate(absl::string_view op, int64_t rows) const;
};

// Rows in groups, one weight matrix per group: for each group g and i < groups[g].count,
//   y[begin + i] = x[begin + i] . groups[g].w^T, or += when accumulate (begin = groups[g].begin).
// Rows of no group are left alone. A MoE layer's experts over the rows MoeRoute grouped: one
// launch (CUDA: one grouped GEMM, f32 weights only) instead of one per expert; the same sums as a
// Linear per group.
//
// Two forms of the groups:
//   * host groups (`groups`, `num_groups`): each group's weights and row range from the host;
//   * device offsets (`device.offsets` non-null; `groups` null and num_groups 0): the groups of
//     DeviceExpertGroups, expert device.host_ids[i] multiplying its rows by host_weights[i]. The
//     same sums as the host groups of the same ranges. Backends take this form for weights of a
//     dtype with MaxDeviceGroupRows(dtype) >= device.max_rows_per_group, else Unimplemented.
struct GroupedLinearParams {
  struct Group {
    WeightView w;        // [out, in]; every group's of one dtype SupportsOp(kGroupedLinear, ...)
    int64_t begin = 0;   // the group's first row
    int64_t count = 0;   // its rows; begin + count <= rows
  };
  const float* x = nullptr;       // [rows, in]
  float* y = nullptr;             // [rows, out]; must not alias x
  const Group* groups = nullptr;  // [num_groups] host, ascending by begin, their rows disjoint
  int64_t num_groups = 0, rows = 0, in = 0, out = 0;
  bool accumulate = false;
  // The device-offsets form.
  DeviceExpertGroups device;
  const WeightView* host_weights = nullptr;  // [device.num_held] host: [out, in] each, of one dtype
  // [device.num_held] device: host_weights[i].data, in a table the caller builds once (at load),
  // not per step.
  const void* const* weights = nullptr;
  bool device_offsets() const { return device.offsets != nullptr; }
  // The weights' dtype (group 0's or expert 0's); kF32 when there are none.
  DType dtype() const;
  // InvalidArgument for null pointers, negative sizes, a group out of [0, rows), overlapping
  // groups, null weights or weights of two dtypes (naming the group or expert), host groups given
  // with the device-offsets form, or the DeviceExpertGroups errors.
  absl::Status Validate() const;
};

// The un-permutation of a MoE layer's grouped rows in one pass. For each token t and each group g
// in order that holds a row i of t (rows[i] == t; a group's rows ascend, as MoeRoute lays them out):
//   dst[t] += scales[i] * src[i]   (+= src[i] when scales is null)
// each term added with one fused multiply-add, one group after the other: the same sums in the same
// order as a ScatterAddRows per group (kernels/shared/moe_math.h, CombineElement), in one launch
// instead of one per expert. The groups come from the host (`groups`) or, in the device-offsets
// form (`device.offsets` non-null, `groups` null), are the held experts' ranges of
// DeviceExpertGroups (rows = count); both forms give the same sums for the same ranges.
struct MoeCombineParams {
  const float* src = nullptr;     // [count, width]: the grouped rows (the down projection's output)
  const int32_t* rows = nullptr;  // [count]: the token of each grouped row (MoeRouteParams::rows)
  const float* scales = nullptr;  // [count] or null (unit weights)
  float* dst = nullptr;           // [tokens, width]; must not alias src
  // [num_groups] host: the row ranges that are added (their `w` is not read), ascending and
  // disjoint; rows of no group (other ranks' or remote experts') are left out.
  const GroupedLinearParams::Group* groups = nullptr;
  int64_t num_groups = 0, count = 0, tokens = 0, width = 0;
  // The device-offsets form (its max_rows_per_group is not used by the combine).
  DeviceExpertGroups device;
  bool device_offsets() const { return device.offsets != nullptr; }
  // InvalidArgument for null pointers, negative sizes, dst aliasing src, or a group out of
  // [0, count), overlapping an earlier one or beyond int32 (naming the group), host groups given
  // with the device-offsets form, or the DeviceExpertGroups errors. A row's token outside
  // [0, tokens) is the caller's to prevent (MoeRoute's rows are).
  absl::Status Validate() const;
};

// y[t] = RmsNormRow(x[t], weight)
struct RmsNormParams {
  const float* x = nullptr;       // [tokens, hidden]
  const float* weight = nullptr;  // [hidden]
  float* y = nullptr;             // [tokens, hidden]; may alias x
  int64_t tokens = 0, hidden = 0;
  float eps = 1e-6f;
  absl::Status Validate() const;
};

// The residual add fused with the next norm: x[t] += y[t], then out[t] = RmsNormRow(x[t], weight).
// One pass over the rows instead of an Add and an RmsNorm.
struct AddRmsNormParams {
  float* x = nullptr;             // [tokens, hidden]: the residual stream, updated in place
  const float* y = nullptr;       // [tokens, hidden]: added to x; must not alias x or out
  const float* weight = nullptr;  // [hidden]
  float* out = nullptr;           // [tokens, hidden]: the normalised rows; must not alias x
  int64_t tokens = 0, hidden = 0;
  float eps = 1e-6f;
  absl::Status Validate() const;
};

// In-place rotary embedding (rotate_half layout) of q and k at each token's position: the first
// rotary_dim elements of each head rotate (element i with element i + rotary_dim / 2), the others
// pass through (Phi-3's partial_rotary_factor); cos and sin are multiplied by `scale` (longrope's
// attention factor) before they are applied, as transformers does.
struct RopeParams {
  float* q = nullptr;                // [tokens, q_heads, head_dim]
  float* k = nullptr;                // [tokens, kv_heads, head_dim]
  const int32_t* positions = nullptr;  // [tokens]
  const float* inv_freq = nullptr;   // [rotary_dim / 2]; angle = position * position_scale * inv_freq
  int64_t tokens = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  float position_scale = 1.0f;
  int64_t rotary_dim = 0;  // 0 = head_dim; else even, in [2, head_dim]
  float scale = 1.0f;
  absl::Status Validate() const;
};

// One sequence's part of a batch: rows [q_begin, q_begin + q_len) of the batch are its new tokens
// at positions [pos_begin, pos_begin + q_len). Its cache is paged: entries
// [table_begin, table_begin + table_len) of the op's block table are its blocks in order, block
// j holding positions [j * block_size, (j + 1) * block_size). The table must cover every position
// the op touches (table_len * block_size >= pos_begin + q_len); entries past that are not read.
struct AttnSeq {
  int32_t q_begin = 0;
  int32_t q_len = 0;
  int32_t pos_begin = 0;
  int32_t table_begin = 0;
  int32_t table_len = 0;
};

// KV cache of one layer on one rank, in fixed-size blocks: [num_blocks, block_size, kv_heads,
// head_dim] elements of `dtype` for K and for V. Which block holds which positions of which
// sequence is decided by the caller (the block tables); the cache itself knows nothing about
// sequences. A 16-bit cache stores each f32 value rounded to nearest even and is read widened;
// KvWrite and Attention take the dtypes their backend SupportsOp().
struct KvLayerView {
  void* k = nullptr;
  void* v = nullptr;
  int64_t num_blocks = 0, block_size = 0, kv_heads = 0, head_dim = 0;
  DType dtype = DType::kF32;
};

// The sequences of a paged-cache op and their block tables.
struct PagedSeqs {
  const AttnSeq* seqs = nullptr;        // [num_seqs]; host for the CPU backend, device otherwise
  const AttnSeq* host_seqs = nullptr;   // host copy of `seqs`, for validation and launch sizing
  int64_t num_seqs = 0;
  const int32_t* block_table = nullptr;       // [table_entries] block ids; same memory as `seqs`
  const int32_t* host_block_table = nullptr;  // host copy of `block_table`, for validation
  int64_t table_entries = 0;
  // The most new rows of one sequence (from host_seqs): launches size their grids by it.
  int64_t MaxQueryLen() const {
    int64_t m = 0;
    for (int64_t s = 0; s < num_seqs; ++s) m = host_seqs[s].q_len > m ? host_seqs[s].q_len : m;
    return m;
  }
};

// Writes each sequence's new k/v rows into the cache blocks its table names for its positions.
// The blocks written by different sequences of one call must be distinct (checked by the engine).
//
// With `rope`: Rope(*rope) first, then the write, as one op: q and k are rotated in place exactly
// as the Rope op rotates them (the same f32 values on every backend), and the cache receives the
// rotated keys. On a GPU a step's RoPE and cache write are then one launch instead of two. It asks
// rope->k == k, rope->tokens == tokens, rope->kv_heads and rope->head_dim equal to the cache's, and
// sequences whose rows tile [0, tokens) in order (sequence i starts where sequence i - 1 ends, as
// the engine lays out a step), so that every row is rotated exactly once.
struct KvWriteParams {
  const float* k = nullptr;      // [tokens, kv_heads, head_dim]
  const float* v = nullptr;      // [tokens, kv_heads, head_dim]
  PagedSeqs paged;
  int64_t tokens = 0;
  KvLayerView cache;
  // Unset: a plain write. Set: RoPE fused with the write (above). Held by value, so recorded
  // Params (op graphs) stay valid after the caller's locals are gone.
  std::optional<RopeParams> rope;
  // InvalidArgument for null pointers, a bad cache shape, sequences outside the rows or their
  // block tables, and, with rope, an invalid RopeParams or one that disagrees with the write.
  absl::Status Validate() const;
};

// Causal grouped-query attention of each sequence's new queries over its cached keys
// [0, pos + 1), restricted to keys with pos - key < sliding_window when sliding_window > 0, and
// to keys of the query's chunk (key / chunk_size == pos / chunk_size, i.e. keys from
// pos - pos % chunk_size) when chunk_size > 0 (Llama-4's chunked local attention).
// Query head h reads kv head h / (q_heads / kv_heads).
struct AttentionParams {
  const float* q = nullptr;      // [tokens, q_heads, head_dim]
  float* out = nullptr;          // [tokens, q_heads, head_dim]
  PagedSeqs paged;
  int64_t tokens = 0, q_heads = 0;
  KvLayerView cache;
  float scale = 1.0f;            // usually 1/sqrt(head_dim)
  int64_t sliding_window = 0;    // 0 = none
  int64_t chunk_size = 0;        // 0 = none
  // > 0: each scaled score s becomes softcap * tanh(s / softcap) before the softmax (Gemma-2).
  float softcap = 0.0f;
  // [q_heads] or null: each head's sink logit (ModelSpec::attention_sinks), one more term
  // e^(sink - max) in the softmax's denominator (SinkMass).
  const float* sinks = nullptr;
  absl::Status Validate() const;
};

// x = x * scale, then, when softcap > 0, x = softcap * tanh(x / softcap); elementwise (Gemma-2's
// embedding multiplier and final logit soft-capping).
struct ScaleParams {
  float* x = nullptr;  // [n]
  int64_t n = 0;
  float scale = 1.0f;
  float softcap = 0.0f;
  absl::Status Validate() const;
};

// x += y, elementwise.
struct AddParams {
  float* x = nullptr;        // [n]
  const float* y = nullptr;  // [n]
  int64_t n = 0;
  absl::Status Validate() const;
};

// dst[i] = src[rows[i]]
struct GatherRowsParams {
  const float* src = nullptr;    // [src_rows, width]
  const int32_t* rows = nullptr;  // [count], each in [0, src_rows)
  float* dst = nullptr;          // [count, width]
  int64_t count = 0, src_rows = 0, width = 0;
  absl::Status Validate() const;
};

// dst[rows[i]] += scales[i] * src[i]; `rows` has no duplicates.
struct ScatterAddRowsParams {
  const float* src = nullptr;     // [count, width]
  const int32_t* rows = nullptr;  // [count]
  const float* scales = nullptr;  // [count]
  float* dst = nullptr;           // [dst_rows, width]
  int64_t count = 0, dst_rows = 0, width = 0;
  absl::Status Validate() const;
};

// x[t, :] *= scales[t]  (Llama-4: routing weights applied to the experts' inputs, and the
// position-dependent temperature of the queries of NoPE layers).
struct ScaleRowsParams {
  float* x = nullptr;             // [tokens, width]
  const float* scales = nullptr;  // [tokens]
  int64_t tokens = 0, width = 0;
  absl::Status Validate() const;
};

// x[t, :] *= sigmoid(gate[t])  (Qwen2-MoE shared-expert gate).
struct SigmoidScaleRowsParams {
  float* x = nullptr;           // [tokens, width]
  const float* gate = nullptr;  // [tokens]
  int64_t tokens = 0, width = 0;
  absl::Status Validate() const;
};

// out[r] = the column of the largest of x[r, 0 .. width) (the lowest such column on ties), as
// std::max_element finds it: greedy sampling on the device, so that only ids reach the host.
struct ArgmaxRowsParams {
  const float* x = nullptr;  // [rows, stride]
  int32_t* out = nullptr;    // [rows]
  int64_t rows = 0, width = 0, stride = 0;  // 1 <= width <= stride (when rows > 0)
  absl::Status Validate() const;
};

// How one row of SampleRows is sampled: the plain part of a request's sampling (the engine's
// SamplingParams without logit_bias, suppressed ids, penalties or a mask, which stay on the host).
struct RowSamplingParams {
  float temperature = 0.0f;  // >= 0 and finite; 0 = argmax
  int32_t top_k = 0;         // >= 0; 0 = no limit, 1 = argmax
  float top_p = 1.0f;        // in (0, 1]
  float min_p = 0.0f;        // in [0, 1]; 0 = off
  uint64_t seed = 0;
  uint64_t step = 0;         // the index of the token being sampled in its sequence's output
};

// out[r] = the token drawn from row r of x with params[r], as kernels/shared/sampling_math.h
// defines it (the engine's Sampler::Sample of a plain row): the argmax for temperature 0 or
// top_k 1, otherwise softmax at the temperature over the top_k largest, cut by top_p and min_p, and
// the draw of SamplingUniformOf(seed, step). Only ids reach the host. Backends whose candidates'
// weights are summed in another order (CUDA: a block reduction) may pick a neighbouring candidate
// where the draw falls within rounding of a boundary; rows whose weights are apart beyond float
// rounding get the same ids on every backend.
struct SampleRowsParams {
  const float* x = nullptr;                         // [rows, stride] logits
  const RowSamplingParams* params = nullptr;        // [rows] (device memory)
  const RowSamplingParams* host_params = nullptr;   // [rows] host copy of `params`, for validation and launch sizing
  int32_t* out = nullptr;                           // [rows]
  int64_t rows = 0, width = 0, stride = 0;          // 1 <= width <= stride (when rows > 0)
  // InvalidArgument for null pointers, bad sizes, or a row's parameters out of their ranges
  // (naming the row and the field).
  absl::Status Validate() const;
};

// MoE routing of a batch, then its permutation: token t's top_k experts and weights are
// RouteToken(routing, logits[t], score_bias) (kernels/shared/moe_math.h), and the tokens x top_k
// choices are grouped by expert exactly as GroupByExpert lays them out (expert e's rows are
// [offsets[e], offsets[e + 1]), in ascending token order). The engine gathers, multiplies and
// scatter-adds each expert's run of rows from these, and reads the run lengths from host_offsets:
// the op's one host copy (a device backend waits for it; everything else stays on the device).
// With host_offsets null the offsets stay on the device and the op does not wait for anything
// (CUDA: no copy, no stream synchronization): the grouped experts then read them there
// (DeviceExpertGroups), and a step with MoE layers can be recorded as a graph.
// Every backend gives the same experts, rows and offsets from the same logits (the same routing
// code runs on each); the weights agree to float rounding of expf.
struct MoeRouteParams {
  const float* logits = nullptr;      // [tokens, routing.num_experts] router logits
  const float* score_bias = nullptr;  // [routing.num_experts] or null; read by kSigmoidGrouped only
  int32_t* offsets = nullptr;         // [num_experts + 1]; offsets[num_experts] = tokens * top_k
  int32_t* rows = nullptr;            // [tokens * top_k] the token of each grouped row
  float* scales = nullptr;            // [tokens * top_k] its routing weight
  // [num_experts + 1] host: a copy of `offsets` when the op returns; or null (no copy, no wait).
  int32_t* host_offsets = nullptr;
  int64_t tokens = 0;
  MoeRouting routing;
  // InvalidArgument for null pointers (other than host_offsets), a negative token count, tokens *
  // top_k beyond int32, or routing parameters outside MoeRouting's valid ranges (naming the
  // parameter).
  absl::Status Validate() const;
};

// x = 0, elementwise.
struct ZeroParams {
  float* x = nullptr;  // [n]
  int64_t n = 0;
  absl::Status Validate() const;
};

// Per-head products, for each token t and head h:
//   y[t, h, y_offset .. y_offset + out) (+)= x[t, h, x_offset .. x_offset + in) . w[h]^T
// where w[h] is the [out, in] matrix at element h * out * in of w. Multi-head latent attention
// uses it to absorb the key up-projection into the query and to apply the value up-projection to
// the attention's latent output, one matrix per head.
struct HeadLinearParams {
  const float* x = nullptr;  // [tokens, heads, x_width]
  WeightView w;              // [heads, out, in], of a dtype SupportsOp(kHeadLinear, ...)
  float* y = nullptr;        // [tokens, heads, y_width]; must not alias x
  int64_t tokens = 0, heads = 0, in = 0, out = 0;
  int64_t x_width = 0, x_offset = 0;  // x_offset + in <= x_width
  int64_t y_width = 0, y_offset = 0;  // y_offset + out <= y_width
  bool accumulate = false;
  absl::Status Validate() const;
};

// The KV cache of one multi-head latent attention layer on one rank: per token, its latent
// (kv_lora_rank values) followed by its RoPE key (qk_rope_head_dim values), in blocks:
// [num_blocks, block_size, latent_dim + rope_dim] elements of `dtype`. One row per token whatever
// the number of heads: every head reads the same row.
struct MlaCacheView {
  void* data = nullptr;
  int64_t num_blocks = 0, block_size = 0, latent_dim = 0, rope_dim = 0;
  DType dtype = DType::kF32;
  int64_t row() const { return latent_dim + rope_dim; }
};

// Writes each sequence's new latent and RoPE-key rows into the cache blocks its table names.
struct MlaKvWriteParams {
  const float* latent = nullptr;  // [tokens, latent_dim]
  const float* rope = nullptr;    // [tokens, rope_dim]
  PagedSeqs paged;
  int64_t tokens = 0;
  MlaCacheView cache;
  absl::Status Validate() const;
};

// Causal attention of each sequence's new queries over its cached rows [0, pos + 1), with the
// key up-projection absorbed into the query: for query head h of token t and cached row j
// (latent c_j, RoPE key r_j),
//   score = scale * (q_latent[t, h] . c_j + rope_scale * q_rope[t, h] . r_j),
//   out[t, h] = sum_j softmax_j(score) * c_j   (the latent; the caller applies the value
//                                               up-projection).
struct MlaAttentionParams {
  const float* q_latent = nullptr;  // [tokens, q_heads, latent_dim]
  const float* q_rope = nullptr;    // [tokens, q_heads, rope_dim]
  float* out = nullptr;             // [tokens, q_heads, latent_dim]
  PagedSeqs paged;
  int64_t tokens = 0, q_heads = 0;
  MlaCacheView cache;
  float scale = 1.0f;
  float rope_scale = 1.0f;  // yarn's attention_factor^2 (it scales the rotated q and k)
  absl::Status Validate() const;
};

// Ops recorded by Backend::Capture (a CUDA graph). Replay() enqueues them again, with the
// arguments they were recorded with: the same pointers, sizes and launch shapes, so the caller
// refreshes the contents of the buffers they read (not the buffers themselves) before replaying.
// Aborted when the backend's own scratch was reallocated since the recording (record again). Belongs to the backend that recorded it, which must outlive it; one thread at a time.
class OpGraph {
 public:
  virtual ~OpGraph() = default;
  virtual absl::Status Replay() = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual DeviceKind kind() const = 0;
  // "cpu", "cuda:0", ... for messages and metrics.
  virtual std::string name() const = 0;
  // Whether `op` takes weights (LinearParams::w, EmbeddingParams::table) or a KV cache (KvWrite,
  // Attention: KvLayerView::dtype) of `weight_dtype`; the other ops answer for kF32 only. Every backend takes f32. Loaders keep a checkpoint's
  // bf16/f16 matrices in their dtype where this is true (half the memory and the bytes a decode
  // step reads) and widen them to f32 elsewhere. An op called with a dtype it does not take
  // returns Unimplemented naming the op and the dtype. kF8E4M3 (with WeightView::fp8's scales):
  // the loader keeps an FP8 checkpoint's matrices as codes + scales where SupportsOp(kLinear,
  // kF8E4M3) (CUDA), else dequantizes them. Thread-safe.
  virtual bool SupportsOp(Op op, DType weight_dtype) const = 0;

  // Whether Capture() records ops (CUDA graphs): replaying a recorded decode step costs the host
  // one launch instead of one per op.
  virtual bool SupportsCapture() const = 0;
  // Calls `record`, whose ops are recorded instead of run, and returns them as a graph. Nothing
  // recorded runs until Replay(). Unimplemented where !SupportsCapture(). When `record` fails, or
  // one of its calls cannot be recorded (an allocation, a copy, a synchronization), returns that
  // error and leaves the backend healthy.
  virtual absl::StatusOr<std::unique_ptr<OpGraph>> Capture(absl::FunctionRef<absl::Status()> record) = 0;
  // An opaque key of how Attention(p) would launch beyond p's sizes (CUDA: its key splits, which
  // follow the context length), so that a graph recorded for one step is replayed only for steps
  // that launch alike. 0 where nothing else matters.
  virtual int64_t AttentionShapeKey(const AttentionParams& p) const = 0;

  // Sizes the backend's own scratch memory (if it needs any) for steps up to `limits`, so that
  // ops within them never allocate. Ops called beyond the reserved limits allocate what they
  // need first (correct, but not capturable and slower). Never shrinks. ResourceExhausted when
  // the scratch does not fit.
  virtual absl::Status Reserve(const StepLimits& limits) = 0;

  // The backend's queue as an opaque handle, for a communicator that orders its collectives on it
  // (comm::Communicator::OrderOnStream): a cudaStream_t for CUDA, null for backends whose ops
  // complete before they return. Only kernels/cuda and comm/nccl interpret it.
  virtual void* stream_handle() const = 0;

  // Allocates `bytes` (zero-filled) of device memory. ResourceExhausted when it does not fit.
  virtual absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) = 0;
  // A matrix [rows, cols] of host f32 values quantized into `format` (a weight format this backend
  // SupportsOp(kLinear, format), such as kQ8) in the backend's own layout, for LinearParams::w with
  // in = cols, out = rows. The default: Unimplemented naming the backend and format.
  virtual absl::StatusOr<DeviceBuffer> QuantizeWeights(DType format, const float* host, int64_t rows, int64_t cols);
  virtual absl::Status CopyToDevice(void* dst, const void* host_src, size_t bytes) = 0;
  // Waits for queued work, then copies.
  virtual absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) = 0;
  virtual absl::Status Synchronize() = 0;

  virtual absl::Status Embedding(const EmbeddingParams& p) = 0;
  virtual absl::Status Linear(const LinearParams& p) = 0;
  // The default: Validate(), then Linear for each part in order, then, for the gated form,
  // SiluMul(p.GateParams()).
  virtual absl::Status LinearGroup(const LinearGroupParams& p);
  virtual absl::Status RmsNorm(const RmsNormParams& p) = 0;
  virtual absl::Status AddRmsNorm(const AddRmsNormParams& p) = 0;
  virtual absl::Status Rope(const RopeParams& p) = 0;
  // With p.rope set, Rope(*p.rope) and then the write (KvWriteParams); every backend honours it.
  virtual absl::Status KvWrite(const KvWriteParams& p) = 0;
  virtual absl::Status Attention(const AttentionParams& p) = 0;
  virtual absl::Status SiluMul(const SiluMulParams& p) = 0;
  virtual absl::Status Add(const AddParams& p) = 0;
  virtual absl::Status GatherRows(const GatherRowsParams& p) = 0;
  virtual absl::Status ScatterAddRows(const ScatterAddRowsParams& p) = 0;
  virtual absl::Status SigmoidScaleRows(const SigmoidScaleRowsParams& p) = 0;
  virtual absl::Status ArgmaxRows(const ArgmaxRowsParams& p) = 0;
  virtual absl::Status Zero(const ZeroParams& p) = 0;
  virtual absl::Status Scale(const ScaleParams& p) = 0;
  virtual absl::Status ScaleRows(const ScaleRowsParams& p) = 0;
  // Multi-head latent attention. The defaults: Validate(), then Unimplemented naming the backend
  // and the op (SupportsOp answers false for them).
  virtual absl::Status HeadLinear(const HeadLinearParams& p);
  virtual absl::Status MlaKvWrite(const MlaKvWriteParams& p);
  virtual absl::Status MlaAttention(const MlaAttentionParams& p);
  // Sampling on the device. The default: Validate(), then Unimplemented naming the backend and the
  // op (SupportsOp answers false).
  virtual absl::Status SampleRows(const SampleRowsParams& p);
  // MoE routing on the device. The default: Validate(), then Unimplemented naming the backend and
  // the op (SupportsOp answers false).
  virtual absl::Status MoeRoute(const MoeRouteParams& p);
  // Grouped products. The default: Validate(), then Unimplemented naming the backend and the op
  // (SupportsOp answers false; the engine then runs its per-expert Linear loop).
  virtual absl::Status GroupedLinear(const GroupedLinearParams& p);
  // The largest DeviceExpertGroups::max_rows_per_group the device-offsets form of GroupedLinear
  // takes for weights of `dtype` (that form's MoeCombine then runs too); 0 where this backend
  // lacks the form for that dtype (the default). Thread-safe.
  virtual int64_t MaxDeviceGroupRows(DType dtype) const;
  // The grouped rows' combine. The default: Validate(), then Unimplemented naming the backend and
  // the op (SupportsOp answers false; the engine then runs a ScatterAddRows per expert).
  virtual absl::Status MoeCombine(const MoeCombineParams& p);
};

}  // namespace shardserve::kernels

#endif  // SHARDSERVE_WORKER_KERNELS_BACKEND_H_

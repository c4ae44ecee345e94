// CudaBackend: memory, copies, cuBLAS and error bookkeeping around the kernels of ops.cu. The
// contract is in cuda_backend.h; this file says why things are done the way they are.
//
// Invariants:
//   * stream_, blas_ and blas_workspace_ are created by Init() and never change afterwards.
//   * first_error_ is empty while the backend is healthy. Once a CUDA or cuBLAS call fails it holds
//     that call's message and never changes again; every entry point then refuses to run.
#include "worker/kernels/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status/macros.h"
#include "worker/kernels/cuda/attention.cuh"
#include "worker/kernels/cuda/linear16.cuh"
#include "worker/kernels/cuda/moe_grouped.cuh"
#include "worker/kernels/cuda/linear_fp8.cuh"
#include "worker/kernels/cuda/linear_mxfp4.cuh"
#include "worker/kernels/cuda/moe_route.cuh"
#include "worker/kernels/cuda/ops.cuh"
#include "worker/kernels/cuda/pdl.cuh"
#include "worker/kernels/cuda/sampling.cuh"

namespace shardserve::kernels {
namespace {

// cuBLAS's recommended workspace sizes (cuBLAS docs, cublasSetWorkspace): 32 MiB on Hopper and
// newer, 4 MiB before. Owning it keeps cuBLAS from allocating during an op.
size_t BlasWorkspaceBytes(int compute_major) { return (compute_major >= 9 ? 32u : 4u) << 20; }

// 16-byte weight loads each lane of the decode GEMV keeps in flight. Measured on an H100
// (tests/gpu/README.md): 4, 8 and cuBLAS on rounded activations decode alike.
constexpr int kGemvLoads = 8;

// Weights of an FP8 or MXFP4 GEMM dequantized to bf16 at a time (16 MiB of scratch): the GEMM runs chunk of
// rows after chunk of rows, so a large matrix (an lm_head) never needs a bf16 copy of itself.
constexpr int64_t kFp8ChunkElements = int64_t{8} << 20;
// The fewest rows a chunk may have when it uses the scratch as it is (fewer: the scratch grows).
constexpr int64_t kFp8MinChunkRows = 64;

// The FP8 GEMV's view of the F8_E4M3 parts of `p`: codes, scale grid, bias, y, out and accumulate
// of each part, in order.
cuda::GemvFp8Group GemvFp8GroupOf(const LinearGroupParams& p) {
  static_assert(cuda::GemvFp8Group::kMaxParts >= LinearGroupParams::kMaxParts);
  cuda::GemvFp8Group group;
  group.parts = p.num_parts;
  for (int i = 0; i < p.num_parts; ++i) {
    const LinearGroupParams::Part& part = p.parts[static_cast<size_t>(i)];
    group.codes[i] = static_cast<const uint8_t*>(part.w.data);
    group.scales[i] = part.w.fp8;
    group.bias[i] = part.bias;
    group.y[i] = part.y;
    group.out[i] = part.out;
    group.accumulate[i] = part.accumulate;
  }
  return group;
}

// DeviceBuffer's deallocator. The buffer may be destroyed on any thread with any device current,
// so free on the device that owns the pointer. Errors here have no one to report to; clearing the
// runtime's last error keeps them from being blamed on the caller's next launch.
void FreeDevice(void* ptr) {
  cudaPointerAttributes attr{};
  int current = -1;
  if (cudaPointerGetAttributes(&attr, ptr) == cudaSuccess && cudaGetDevice(&current) == cudaSuccess &&
      attr.device >= 0 && attr.device != current) {
    (void)cudaSetDevice(attr.device);
    (void)cudaFree(ptr);
    (void)cudaSetDevice(current);
  } else {
    (void)cudaFree(ptr);
  }
  (void)cudaGetLastError();
}

bool FitsInt(std::initializer_list<int64_t> sizes) {
  for (int64_t s : sizes) {
    if (s > INT_MAX) return false;
  }
  return true;
}

// Calls launch(table, first) for the non-empty groups of `groups` ([num_groups], validated, rows
// within int32), kMaxLaunchGroups at a time, in order; `first` counts the non-empty groups before
// the table's. Stops at the first error.
template <typename Launch>
absl::Status ForEachGroupTable(const GroupedLinearParams::Group* groups, int64_t num_groups, Launch&& launch) {
  cuda::GroupTable table;
  int first = 0;
  for (int64_t g = 0; g < num_groups; ++g) {
    const GroupedLinearParams::Group& group = groups[g];
    if (group.count == 0) continue;
    table.w[table.n] = group.w.data;
    table.range[table.n] = {static_cast<int32_t>(group.begin), static_cast<int32_t>(group.count)};
    if (++table.n == cuda::kMaxLaunchGroups) {
      RETURN_IF_ERROR(launch(table, first));
      first += table.n;
      table.n = 0;
    }
  }
  if (table.n > 0) return launch(table, first);
  return absl::OkStatus();
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, const CudaBackendOptions& options)
      : device_(device),
        name_(absl::StrCat("cuda:", device)),
        mma_attention_(options.mma_attention),
        fused_norm_(options.fused_norm) {}
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  // Creates the stream, the cuBLAS handle and its workspace. Called once, by CreateCudaBackend.
  absl::Status Init(bool pdl);

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  std::string name() const override { return name_; }
  bool SupportsOp(Op op, DType dtype) const override;
  // 16-bit experts: the grouped GEMV over the device offsets, for groups of up to
  // kGroupedGemvMaxRows rows (larger groups need the GEMM path, which sizes each group on the host).
  int64_t MaxDeviceGroupRows(DType dtype) const override {
    return dtype == DType::kBF16 || dtype == DType::kF16 ? cuda::kGroupedGemvMaxRows : 0;
  }
  void* stream_handle() const override { return stream_; }
  bool SupportsCapture() const override { return true; }
  absl::StatusOr<std::unique_ptr<OpGraph>> Capture(absl::FunctionRef<absl::Status()> record) override;
  // The split-K kernel's splits, planned for the sequences it takes (all of them unless some go to
  // the tensor cores beside it).
  int64_t AttentionShapeKey(const AttentionParams& p) const override {
    return cuda::PlanAttention(p, multiprocessors_, DispatchAttention(p).split_max_q_len).splits;
  }
  // Launches a graph instantiated by Capture() when the scratch it recorded is still current.
  absl::Status Launch(cudaGraphExec_t exec, uint64_t scratch_generation);
  absl::Status Reserve(const StepLimits& limits) override;

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override;
  absl::Status CopyToDevice(void* dst, const void* host_src, size_t bytes) override;
  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) override;
  absl::Status Synchronize() override;

  absl::Status Embedding(const EmbeddingParams& p) override;
  absl::Status Linear(const LinearParams& p) override;
  absl::Status LinearGroup(const LinearGroupParams& p) override;
  absl::Status RmsNorm(const RmsNormParams& p) override;
  absl::Status AddRmsNorm(const AddRmsNormParams& p) override;
  absl::Status Rope(const RopeParams& p) override;
  absl::Status KvWrite(const KvWriteParams& p) override;
  absl::Status Attention(const AttentionParams& p) override;
  absl::Status SiluMul(const SiluMulParams& p) override;
  absl::Status Add(const AddParams& p) override;
  absl::Status GatherRows(const GatherRowsParams& p) override;
  absl::Status ScatterAddRows(const ScatterAddRowsParams& p) override;
  absl::Status SigmoidScaleRows(const SigmoidScaleRowsParams& p) override;
  absl::Status ScaleRows(const ScaleRowsParams& p) override;
  absl::Status ArgmaxRows(const ArgmaxRowsParams& p) override;
  absl::Status SampleRows(const SampleRowsParams& p) override;
  absl::Status MoeRoute(const MoeRouteParams& p) override;
  absl::Status GroupedLinear(const GroupedLinearParams& p) override;
  absl::Status MoeCombine(const MoeCombineParams& p) override;
  absl::Status Zero(const ZeroParams& p) override;
  absl::Status Scale(const ScaleParams& p) override;

 private:
  // Refuses to run when unhealthy; otherwise makes device_ current on the calling thread (the
  // backend may have been created on another thread than the rank thread that uses it).
  absl::Status Enter();
  // OK for cudaSuccess; otherwise records the first error (the backend becomes unhealthy) and
  // returns Internal naming `call`.
  absl::Status Check(cudaError_t err, absl::string_view call);
  absl::Status CheckBlas(cublasStatus_t st, absl::string_view call);
  absl::Status Fail(std::string message);
  // How Attention(p) divides the batch's sequences (attention.cuh, "Dispatch"): with `mma`, those
  // of at least kMinMmaAttentionRows rows on the tensor cores; with `split`, those of at most
  // split_max_q_len rows on the split-K kernel (all of them without `mma`; with it, the shorter
  // ones, when one has a row). Both: two launches on the stream, writing disjoint rows.
  struct AttentionDispatch {
    bool mma = false;
    bool split = true;
    int64_t split_max_q_len = cuda::kAnyQueryLen;
  };
  AttentionDispatch DispatchAttention(const AttentionParams& p) const;
  // Makes scratch_ at least `bytes` long (cudaMalloc after draining the stream, when it grows).
  absl::Status EnsureScratch(size_t bytes);
  // Makes attn_counters_ hold at least `count` counters, zeroed in stream order when it grows.
  absl::Status EnsureAttnCounters(size_t count);
  // Makes `buffer` at least `bytes` long, draining the stream first when it grows. `recorded`:
  // recorded graphs may hold its address, so a reallocation bumps scratch_generation_ (they then
  // refuse to replay); only once the old buffer is sure to go, so that a growth refused inside a
  // recording leaves the graphs recorded before it valid.
  absl::Status Grow(DeviceBuffer& buffer, size_t bytes, bool recorded = true);
  // Linear with bf16/f16 weights: Group16 of one part.
  absl::Status Linear16(const LinearParams& p);
  // Products of one x with 16-bit weights of one type (see linear16.cuh for the two paths): one
  // GEMV launch for every part (gated: LaunchGatedGemv16), or x rounded once for every part's GEMM
  // (gated: then the SiluMul kernel). tokens > 0, in > 0. The normed form: the norm inside the
  // GEMV, or in the kernel that rounds x for the GEMMs.
  absl::Status Group16(const LinearGroupParams& p);
  // The tensor-core product of Group16 on activations already rounded to the weights' type
  // (x16: [tokens, in]), then the bias.
  absl::Status Gemm16(const LinearParams& p, const void* x16);
  // GroupedLinear with bf16/f16 experts (validated; in > 0, out > 0): see its definition.
  absl::Status GroupedLinear16(const GroupedLinearParams& p);
  // GroupedLinear's device-offsets form (validated): one grouped GEMV launch.
  absl::Status GroupedLinearOnDevice(const GroupedLinearParams& p);
  // Makes moe_route_workspace_ large enough for p (validated): grown outside a recording, refused
  // inside one (growing waits on the stream, which a recording cannot hold).
  absl::Status EnsureMoeRouteWorkspace(const MoeRouteParams& p, size_t* bytes);
  // Linear with F8_E4M3 weights (linear_fp8.cuh): the dequantizing GEMV for decode-sized batches,
  // else chunks of rows dequantized to bf16 into the scratch (after x rounded to bf16) and
  // multiplied on the tensor cores. tokens > 0, in > 0, out > 0.
  absl::Status LinearFp8(const LinearParams& p);
  // Linear with MXFP4 weights (linear_mxfp4.cuh): the decoding GEMV for decode-sized batches, else
  // the chunked GEMM of DequantizedGemm.
  absl::Status LinearMxfp4(const LinearParams& p);
  // Names of DequantizedGemm's calls, for errors.
  struct DequantizedCalls {
    const char* launch;
    const char* gemm;
  };
  // y = x . w^T (+ bias) over rows of w that `dequantize(r0, r1, dst)` writes as bf16 into dst
  // ([r1 - r0, in]), chunk after chunk in the scratch, beside x rounded to bf16.
  absl::Status DequantizedGemm(const LinearParams& p,
                               absl::FunctionRef<cudaError_t(int64_t, int64_t, uint16_t*)> dequantize,
                               DequantizedCalls what);

  // Constant after construction / Init().
  const int device_;
  const std::string name_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  void* blas_workspace_ = nullptr;
  int multiprocessors_ = 1;
  int compute_major_ = 0;  // the device's compute capability (major)
  const bool mma_attention_;  // CudaBackendOptions::mma_attention
  const bool fused_norm_;     // CudaBackendOptions::fused_norm

  // Backend-owned scratch for ops that need device memory beyond their Params (the activations
  // of a 16-bit GEMM, rounded; attention's split partials). Sized by Reserve(); grown by an op
  // called beyond it, which bumps scratch_generation_ (graphs that recorded the old one refuse to
  // replay), as does the growth of every buffer below but sample_workspace_.
  DeviceBuffer scratch_;
  uint64_t scratch_generation_ = 0;
  // Split-K attention's arrival counters (attention.cuh, AttentionCounterCount): zeroed once when
  // allocated, left at zero by every launch. Apart from scratch_, whose contents other ops
  // overwrite. Sized by Reserve() (at most kMaxAttnCounters, 128 KiB); grown like scratch_.
  DeviceBuffer attn_counters_;
  // SampleRows' workspace (sorted rows and CUB's storage), grown on demand. Apart from scratch_ so
  // that growing it never invalidates a recorded graph (sampling runs after the recorded layers,
  // so no graph holds its address).
  DeviceBuffer sample_workspace_;
  // MoeRoute's workspace (the choices, their sort and the tokens' routing scratch): sized by
  // Reserve() for StepLimits::moe_routing, so that no step grows it; a growth outside recordings
  // (a step beyond Reserve's limits) invalidates the recorded graphs, whose routing nodes hold its
  // address.
  DeviceBuffer moe_route_workspace_;
  // GroupedLinear (f32): the groups' A, B and C pointers on the device (cuBLAS reads them there;
  // written by a kernel in stream order, never copied from the host), and the host arrays of their
  // shapes (read by cuBLAS on the host), kept between calls to reuse their memory.
  DeviceBuffer grouped_pointers_;
  struct GroupedGemm {
    std::vector<cublasOperation_t> trans_a, trans_b;
    std::vector<int> m, n, k, lda, ldb, ldc, size;
    std::vector<float> alpha, beta;
    void Clear() {
      trans_a.clear();
      trans_b.clear();
      for (std::vector<int>* v : {&m, &n, &k, &lda, &ldb, &ldc, &size}) v->clear();
      alpha.clear();
      beta.clear();
    }
  } grouped_;

  // While Capture() records: errors are the capture's (capture_error_), not the device's, so a
  // failed recording leaves the backend healthy.
  bool capturing_ = false;
  std::string capture_error_;

  // Empty while healthy; the first device error afterwards.
  std::string first_error_;
};

CudaBackend::~CudaBackend() {
  // Best effort: drain queued work, then release in reverse order of creation. Works for a
  // partially initialised backend (Init failed half-way).
  (void)cudaSetDevice(device_);
  if (stream_ != nullptr) (void)cudaStreamSynchronize(stream_);
  if (blas_ != nullptr) (void)cublasDestroy(blas_);
  if (blas_workspace_ != nullptr) (void)cudaFree(blas_workspace_);
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  (void)cudaGetLastError();
}

absl::Status CudaBackend::Init(bool pdl) {
  RETURN_IF_ERROR(Check(cudaSetDevice(device_), "cudaSetDevice"));
  // Non-blocking: the legacy default stream (used by libraries that pass stream 0) does not
  // serialise with ours.
  RETURN_IF_ERROR(Check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"));
  RETURN_IF_ERROR(CheckBlas(cublasCreate(&blas_), "cublasCreate"));
  RETURN_IF_ERROR(CheckBlas(cublasSetStream(blas_, stream_), "cublasSetStream"));
  // Default math never lowers f32 GEMMs to TF32 (that needs CUBLAS_TF32_TENSOR_OP_MATH), which
  // keeps parity with the CPU oracle. Pedantic math would also forbid faster exact algorithms.
  RETURN_IF_ERROR(CheckBlas(cublasSetMathMode(blas_, CUBLAS_DEFAULT_MATH), "cublasSetMathMode"));
  int major = 0;
  RETURN_IF_ERROR(Check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_),
                        "cudaDeviceGetAttribute"));
  RETURN_IF_ERROR(Check(cudaDeviceGetAttribute(&multiprocessors_, cudaDevAttrMultiProcessorCount, device_),
                        "cudaDeviceGetAttribute"));
  compute_major_ = major;
  cuda::pdl::NoteDevice(major, pdl);
  const size_t workspace_bytes = BlasWorkspaceBytes(major);
  RETURN_IF_ERROR(Check(cudaMalloc(&blas_workspace_, workspace_bytes), "cudaMalloc (cuBLAS workspace)"));
  // After cublasSetStream, which resets the workspace to cuBLAS's own pool.
  return CheckBlas(cublasSetWorkspace(blas_, blas_workspace_, workspace_bytes), "cublasSetWorkspace");
}

absl::Status CudaBackend::Fail(std::string message) {
  if (capturing_) {
    if (capture_error_.empty()) capture_error_ = message;
    return absl::InternalError(std::move(message));
  }
  if (first_error_.empty()) first_error_ = message;
  return absl::InternalError(std::move(message));
}

absl::Status CudaBackend::Check(cudaError_t err, absl::string_view call) {
  if (err == cudaSuccess) return absl::OkStatus();
  return Fail(absl::StrCat(name_, ": ", call, " failed: ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

absl::Status CudaBackend::CheckBlas(cublasStatus_t st, absl::string_view call) {
  if (st == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return Fail(
      absl::StrCat(name_, ": ", call, " failed: ", cublasGetStatusName(st), " (", cublasGetStatusString(st), ")"));
}

absl::Status CudaBackend::Enter() {
  if (!first_error_.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(name_, ": backend unhealthy after: ", first_error_));
  }
  return Check(cudaSetDevice(device_), "cudaSetDevice");
}

absl::StatusOr<DeviceBuffer> CudaBackend::Allocate(size_t bytes) {
  RETURN_IF_ERROR(Enter());
  if (bytes == 0) return DeviceBuffer();
  void* ptr = nullptr;
  const cudaError_t err = cudaMalloc(&ptr, bytes);
  if (err == cudaErrorMemoryAllocation) {
    // Out of memory is not sticky: clear it and stay healthy, so the caller may try a smaller plan.
    (void)cudaGetLastError();
    size_t free_bytes = 0, total_bytes = 0;
    (void)cudaMemGetInfo(&free_bytes, &total_bytes);
    (void)cudaGetLastError();
    return absl::ResourceExhaustedError(absl::StrCat(name_, ": cannot allocate ", bytes, " bytes (", free_bytes,
                                                     " of ", total_bytes, " bytes free)"));
  }
  RETURN_IF_ERROR(Check(err, "cudaMalloc"));
  DeviceBuffer buffer(ptr, bytes, &FreeDevice);  // frees ptr on the error paths below
  RETURN_IF_ERROR(Check(cudaMemsetAsync(ptr, 0, bytes, stream_), "cudaMemsetAsync"));
  // Wait, so the zeros are in place for any stream (a communicator's, say), not only ours.
  RETURN_IF_ERROR(Check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"));
  return buffer;
}

absl::Status CudaBackend::CopyToDevice(void* dst, const void* host_src, size_t bytes) {
  RETURN_IF_ERROR(Enter());
  if (bytes == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Check(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync (H2D)"));
  // The caller may reuse host_src as soon as we return. From pageable memory (what the engine
  // passes) cudaMemcpyAsync returns only once the source is staged, so no wait is needed; from
  // page-locked memory the DMA reads the source later: wait for it.
  cudaPointerAttributes attr{};
  const cudaError_t query = cudaPointerGetAttributes(&attr, host_src);
  if (query == cudaSuccess && attr.type == cudaMemoryTypeUnregistered) return absl::OkStatus();
  (void)cudaGetLastError();  // a failed query: not an error of the copy; wait to be safe
  return Check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

absl::Status CudaBackend::CopyToHost(void* host_dst, const void* src, size_t bytes) {
  RETURN_IF_ERROR(Enter());
  if (bytes == 0) return absl::OkStatus();
  // Ordered after the queued ops on the same stream.
  RETURN_IF_ERROR(Check(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync (D2H)"));
  return Check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

absl::Status CudaBackend::Synchronize() {
  RETURN_IF_ERROR(Enter());
  return Check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

bool CudaBackend::SupportsOp(Op op, DType dtype) const {
  switch (op) {
    case Op::kKvWrite:
    case Op::kAttention:
      // kF8E4M3: an FP8 KV cache, e4m3 codes without a scale, encoded and decoded with the CPU
      // backend's functions (kv_cache.cuh). Attention over it runs on the CUDA cores
      // (MmaAttentionApplies takes bf16 caches only).
      return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16 || dtype == DType::kF8E4M3;
    case Op::kLinear:
      if (dtype == DType::kF8E4M3 || dtype == DType::kMxfp4) return true;  // LinearFp8, LinearMxfp4
      [[fallthrough]];
    case Op::kEmbedding:
      return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16;
    case Op::kRmsNorm:
    case Op::kAddRmsNorm:
    case Op::kRope:
    case Op::kSiluMul:
    case Op::kAdd:
    case Op::kGatherRows:
    case Op::kScatterAddRows:
    case Op::kSigmoidScaleRows:
    case Op::kArgmaxRows:
    case Op::kSampleRows:
    case Op::kMoeRoute:
    case Op::kZero:
    case Op::kScale:
    case Op::kScaleRows:
      return dtype == DType::kF32;
    case Op::kGroupedLinear:
      // f32: one cublasGemmGroupedBatchedEx; bf16/f16: GroupedLinear16 (a grouped GEMV, or rounded
      // activations and a GEMM per group).
      return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16;
    case Op::kMoeCombine:
      return dtype == DType::kF32;
    case Op::kHeadLinear:
    case Op::kMlaKvWrite:
    case Op::kMlaAttention:
      return false;  // multi-head latent attention runs on CPU ranks only (Backend's defaults)
  }
  return false;
}

absl::Status CudaBackend::Reserve(const StepLimits& limits) {
  if (limits.max_tokens < 0 || limits.max_linear_in < 0 || limits.max_grouped_in < 0) {
    return absl::InvalidArgumentError(absl::StrCat(name_, ": negative step limits"));
  }
  // 16-bit GEMMs round their activations into the scratch: [tokens, in] of 2 bytes; MoE layers'
  // grouped experts every token's top_k rows: [tokens x top_k, grouped in]. Split-K attention keeps its
  // partial states there: [slots, q_heads, splits, head_dim + 2] floats, capped, its slots never more
  // than the step's tokens (also for the decode rows of a step whose prefill is on the tensor cores:
  // PlanAttention).
  const size_t cast_bytes = static_cast<size_t>(MaxProductActivations(limits)) * 2;
  size_t attn_floats = 0;
  if (limits.max_tokens > 0 && limits.max_q_heads > 0 && limits.max_head_dim > 0) {
    attn_floats = std::min(static_cast<size_t>(limits.max_tokens) * static_cast<size_t>(limits.max_q_heads) *
                               static_cast<size_t>(cuda::kMaxAttnSplits) * static_cast<size_t>(limits.max_head_dim + 2),
                           cuda::MaxAttentionPartialFloats(limits.max_head_dim));
  }
  RETURN_IF_ERROR(EnsureScratch(std::max(cast_bytes, attn_floats * sizeof(float))));
  if (limits.max_tokens > 0 && limits.max_q_heads > 0) {
    RETURN_IF_ERROR(EnsureAttnCounters(std::min(static_cast<size_t>(limits.max_tokens) *
                                                    static_cast<size_t>(limits.max_q_heads),
                                                static_cast<size_t>(cuda::kMaxAttnCounters))));
  }
  MoeRouteParams p;
  p.tokens = limits.max_tokens;
  p.routing = limits.moe_routing;
  // A step's MoeRoute then fits without growing (a recorded MoE decode step cannot grow it). Sizes
  // beyond the sort's int range are left to MoeRoute, which refuses them.
  if (p.routing.num_experts > 0 && p.tokens > 0 &&
      FitsInt({p.tokens * p.routing.top_k, p.tokens * (p.routing.num_experts + p.routing.n_group)})) {
    size_t bytes = 0;
    RETURN_IF_ERROR(Check(cuda::MoeRouteWorkspaceBytes(p, &bytes), "MoeRoute workspace query"));
    RETURN_IF_ERROR(Grow(moe_route_workspace_, bytes));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::EnsureScratch(size_t bytes) { return Grow(scratch_, bytes); }

absl::Status CudaBackend::EnsureAttnCounters(size_t count) {
  const size_t bytes = count * sizeof(unsigned int);
  if (bytes <= attn_counters_.bytes()) return absl::OkStatus();
  RETURN_IF_ERROR(Grow(attn_counters_, bytes));
  // On our (non-blocking) stream, so that it precedes every launch that reads them.
  return Check(cudaMemsetAsync(attn_counters_.as<void>(), 0, attn_counters_.bytes(), stream_),
               "cudaMemsetAsync (attention counters)");
}

absl::Status CudaBackend::Grow(DeviceBuffer& buffer, size_t bytes, bool recorded) {
  if (bytes <= buffer.bytes()) return absl::OkStatus();
  // Queued ops may still read the old buffer: let them finish before it is freed. (Inside a
  // recording this fails, and nothing changes.)
  RETURN_IF_ERROR(Check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"));
  if (recorded) ++scratch_generation_;
  buffer = DeviceBuffer();
  ASSIGN_OR_RETURN(buffer, Allocate(bytes));
  return absl::OkStatus();
}

// A graph instantiated on one backend; replayed on its stream.
class CudaOpGraph final : public OpGraph {
 public:
  CudaOpGraph(CudaBackend* backend, cudaGraphExec_t exec, uint64_t scratch_generation)
      : backend_(backend), exec_(exec), scratch_generation_(scratch_generation) {}
  ~CudaOpGraph() override { (void)cudaGraphExecDestroy(exec_); }
  CudaOpGraph(const CudaOpGraph&) = delete;
  CudaOpGraph& operator=(const CudaOpGraph&) = delete;
  absl::Status Replay() override { return backend_->Launch(exec_, scratch_generation_); }

 private:
  CudaBackend* const backend_;
  const cudaGraphExec_t exec_;
  const uint64_t scratch_generation_;
};

absl::StatusOr<std::unique_ptr<OpGraph>> CudaBackend::Capture(absl::FunctionRef<absl::Status()> record) {
  RETURN_IF_ERROR(Enter());
  // Thread-local mode: only this (the rank's) thread is barred from calls that would break the
  // recording; other ranks' threads allocate and copy as they please.
  RETURN_IF_ERROR(Check(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture"));
  capturing_ = true;
  capture_error_.clear();
  absl::Status st = record();
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream_, &graph);
  capturing_ = false;
  (void)cudaGetLastError();  // an invalidated capture leaves its error behind
  // Update keeps the first error (nvcc warns on assigning to a [[nodiscard]] Status).
  if (!capture_error_.empty()) st.Update(absl::InternalError(capture_error_));
  if (end != cudaSuccess) {
    st.Update(absl::InternalError(absl::StrCat(name_, ": cudaStreamEndCapture failed: ", cudaGetErrorName(end))));
  }
  if (!st.ok()) {
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
    return absl::Status(st.code(), absl::StrCat(name_, ": recording a graph failed: ", st.message()));
  }
  cudaGraphExec_t exec = nullptr;
  const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
  (void)cudaGraphDestroy(graph);
  if (inst != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::InternalError(absl::StrCat(name_, ": cudaGraphInstantiate failed: ", cudaGetErrorName(inst)));
  }
  return std::unique_ptr<OpGraph>(std::make_unique<CudaOpGraph>(this, exec, scratch_generation_));
}

absl::Status CudaBackend::Launch(cudaGraphExec_t exec, uint64_t scratch_generation) {
  if (scratch_generation != scratch_generation_) {
    return absl::AbortedError(absl::StrCat(name_, ": the graph recorded a scratch buffer since replaced"));
  }
  RETURN_IF_ERROR(Enter());
  return Check(cudaGraphLaunch(exec, stream_), "cudaGraphLaunch");
}

absl::Status CudaBackend::Embedding(const EmbeddingParams& p) {
  RETURN_IF_ERROR(p.Validate());
  if (!SupportsOp(Op::kEmbedding, p.table.dtype)) return UnsupportedWeights(name_, Op::kEmbedding, p.table.dtype);
  RETURN_IF_ERROR(Enter());
  return Check(cuda::LaunchEmbeddingTyped(p.table.dtype, p.table.data, p.ids, p.out, p.tokens, p.hidden, stream_),
               "Embedding kernel launch");
}

absl::Status CudaBackend::Linear(const LinearParams& p) {
  RETURN_IF_ERROR(p.Validate());
  if (!SupportsOp(Op::kLinear, p.w.dtype)) return UnsupportedWeights(name_, Op::kLinear, p.w.dtype);
  if (!FitsInt({p.tokens, p.in, p.out})) {
    return absl::UnimplementedError(
        absl::StrCat(name_, ": Linear dimensions exceed cuBLAS's int range: ", p.tokens, "x", p.in, "x", p.out));
  }
  RETURN_IF_ERROR(Enter());
  if (p.tokens == 0 || p.out == 0) return absl::OkStatus();
  if (p.w.dtype == DType::kF8E4M3 && p.in > 0) return LinearFp8(p);
  if (p.w.dtype == DType::kMxfp4 && p.in > 0) return LinearMxfp4(p);
  if (p.w.dtype != DType::kF32 && p.in > 0) return Linear16(p);
  if (p.in == 0) {
    // An empty product (cuBLAS rejects lda = 0): y = bias, or y += bias.
    if (!p.accumulate) {
      RETURN_IF_ERROR(Check(cudaMemsetAsync(p.y, 0, static_cast<size_t>(p.tokens * p.out) * sizeof(float), stream_),
                            "cudaMemsetAsync"));
    }
  } else {
    // Row-major y[tokens, out] = x[tokens, in] . w[out, in]^T is, in cuBLAS's column-major terms,
    // y^T[out, tokens] = op_T(w^T[in, out]) . x^T[in, tokens].
    const float alpha = 1.0f;
    const float beta = p.accumulate ? 1.0f : 0.0f;
    const int tokens = static_cast<int>(p.tokens), in = static_cast<int>(p.in), out = static_cast<int>(p.out);
    RETURN_IF_ERROR(CheckBlas(
        cublasSgemm(blas_, CUBLAS_OP_T, CUBLAS_OP_N, out, tokens, in, &alpha, static_cast<const float*>(p.w.data), in,
                    p.x, in, &beta, p.y, out),
        "cublasSgemm"));
  }
  if (p.bias == nullptr) return absl::OkStatus();
  return Check(cuda::LaunchBiasAdd(p.bias, p.y, p.tokens, p.out, stream_), "Linear bias kernel launch");
}

absl::Status CudaBackend::Linear16(const LinearParams& p) {
  LinearGroupParams one{.x = p.x, .tokens = p.tokens, .in = p.in, .num_parts = 1};
  one.parts[0] = {.w = p.w, .bias = p.bias, .y = p.y, .out = p.out, .accumulate = p.accumulate};
  return Group16(one);
}

absl::Status CudaBackend::Group16(const LinearGroupParams& p) {
  const DType dtype = p.parts[0].w.dtype;
  // The normed form (LinearGroupParams::norm).
  cuda::Gemv16Norm norm_args;
  const cuda::Gemv16Norm* norm = nullptr;
  if (p.norm.has_value()) {
    norm_args = {.weight = p.norm->weight, .eps = p.norm->eps};
    norm = &norm_args;
  }
  if (p.gated.has_value() && p.tokens <= cuda::kGemv16MaxTokens) {
    // Gate, up and the activation in one launch; parts[1].y (the op's scratch) is not written.
    const LinearGroupParams::Part& gate = p.parts[0];
    const LinearGroupParams::Part& up = p.parts[1];
    const cuda::GatedGemv16Params g{.w_gate = gate.w.data, .w_up = up.w.data, .bias_gate = gate.bias,
                                    .bias_up = up.bias, .y = gate.y, .out = gate.out, .act = *p.gated};
    return Check(cuda::LaunchGatedGemv16(dtype, p.x, g, p.tokens, p.in, kGemvLoads, multiprocessors_, stream_, norm),
                 "GatedGemv16 kernel launch");
  }
  if (p.tokens <= cuda::kGemv16MaxTokens) {
    // One launch for every part; bias and accumulation are fused into the GEMV.
    cuda::Gemv16Group group;
    group.parts = p.num_parts;
    for (int i = 0; i < p.num_parts; ++i) {
      const LinearGroupParams::Part& part = p.parts[static_cast<size_t>(i)];
      group.w[i] = part.w.data;
      group.bias[i] = part.bias;
      group.y[i] = part.y;
      group.out[i] = part.out;
      group.accumulate[i] = part.accumulate;
    }
    return Check(cuda::LaunchGemv16(dtype, p.x, group, p.tokens, p.in, kGemvLoads, multiprocessors_, stream_, norm),
                 "Gemv16 kernel launch");
  }
  // x rounded to the weights' type once, for every part's GEMM (the normed form: normalised and
  // rounded in one kernel).
  const int64_t n = p.tokens * p.in;
  RETURN_IF_ERROR(EnsureScratch(static_cast<size_t>(n) * 2));
  if (norm != nullptr) {
    RETURN_IF_ERROR(Check(cuda::LaunchRmsNormTo16(dtype, p.NormParams(), scratch_.as<void>(), stream_),
                          "RmsNormTo16 kernel launch"));
  } else {
    RETURN_IF_ERROR(Check(cuda::LaunchCastTo16(dtype, p.x, scratch_.as<void>(), n, stream_), "CastTo16 kernel launch"));
  }
  for (int i = 0; i < p.num_parts; ++i) {
    const LinearParams part = p.PartParams(i);
    if (part.out > 0) RETURN_IF_ERROR(Gemm16(part, scratch_.as<void>()));
  }
  // The gated form past the GEMV: the GEMMs above, then the activation as its own kernel.
  if (p.gated.has_value()) return Check(cuda::LaunchSiluMul(p.GateParams(), stream_), "SiluMul kernel launch");
  return absl::OkStatus();
}

absl::Status CudaBackend::Gemm16(const LinearParams& p, const void* x16) {
  const cudaDataType type = p.w.dtype == DType::kBF16 ? CUDA_R_16BF : CUDA_R_16F;
  const float alpha = 1.0f;
  const float beta = p.accumulate ? 1.0f : 0.0f;
  const int tokens = static_cast<int>(p.tokens), in = static_cast<int>(p.in), out = static_cast<int>(p.out);
  // The layout of Linear's f32 cublasSgemm; 16-bit inputs, f32 output and accumulation.
  RETURN_IF_ERROR(CheckBlas(cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, out, tokens, in, &alpha, p.w.data, type, in,
                                         x16, type, in, &beta, p.y, CUDA_R_32F, out, CUBLAS_COMPUTE_32F,
                                         CUBLAS_GEMM_DEFAULT),
                            "cublasGemmEx"));
  if (p.bias == nullptr) return absl::OkStatus();
  return Check(cuda::LaunchBiasAdd(p.bias, p.y, p.tokens, p.out, stream_), "Linear bias kernel launch");
}

absl::Status CudaBackend::LinearFp8(const LinearParams& p) {
  const auto* codes = static_cast<const uint8_t*>(p.w.data);
  if (p.tokens <= cuda::kGemvFp8MaxTokens) {
    // The group GEMV with one part (bias and accumulation fused).
    LinearGroupParams one{.x = p.x, .tokens = p.tokens, .in = p.in, .num_parts = 1};
    one.parts[0] = {.w = p.w, .bias = p.bias, .y = p.y, .out = p.out, .accumulate = p.accumulate};
    return Check(cuda::LaunchGemvFp8(p.x, GemvFp8GroupOf(one), p.tokens, p.in, multiprocessors_, stream_),
                 "GemvFp8 kernel launch");
  }
  return DequantizedGemm(
      p,
      [&](int64_t r0, int64_t r1, uint16_t* dst) {
        return cuda::LaunchDequantizeFp8Rows(codes, p.w.fp8, p.in, r0, r1, dst, stream_);
      },
      {"DequantizeFp8Rows kernel launch", "cublasGemmEx (FP8 dequantized)"});
}

absl::Status CudaBackend::LinearMxfp4(const LinearParams& p) {
  const auto* codes = static_cast<const uint8_t*>(p.w.data);
  if (p.tokens <= cuda::kGemvMxfp4MaxTokens) {
    return Check(cuda::LaunchGemvMxfp4(p.x, codes, p.w.mxfp4_scales, p.bias, p.y, p.tokens, p.in, p.out, p.accumulate,
                                       multiprocessors_, stream_),
                 "GemvMxfp4 kernel launch");
  }
  return DequantizedGemm(
      p,
      [&](int64_t r0, int64_t r1, uint16_t* dst) {
        return cuda::LaunchDequantizeMxfp4Rows(codes, p.w.mxfp4_scales, p.in, r0, r1, dst, stream_);
      },
      {"DequantizeMxfp4Rows kernel launch", "cublasGemmEx (MXFP4 dequantized)"});
}

absl::Status CudaBackend::DequantizedGemm(const LinearParams& p,
                                          absl::FunctionRef<cudaError_t(int64_t, int64_t, uint16_t*)> dequantize,
                                          DequantizedCalls what) {
  // The scratch: x as bf16 [tokens, in], then one chunk of dequantized rows [chunk_rows, in].
  constexpr size_t kAlign = 256;
  const size_t x_bytes = (static_cast<size_t>(p.tokens * p.in) * 2 + kAlign - 1) / kAlign * kAlign;
  // Chunks up to kFp8ChunkElements. What the scratch already holds beyond x is used as it is when
  // it takes at least kFp8MinChunkRows rows (or the whole matrix): a decode step of more than 8
  // tokens then allocates nothing and can be recorded into a graph, Reserve having sized the
  // scratch for the step's largest x. Otherwise the scratch grows (a prefill, never recorded).
  const int64_t row_bytes = p.in * 2;
  const int64_t fitting = scratch_.bytes() > x_bytes ? static_cast<int64_t>(scratch_.bytes() - x_bytes) / row_bytes : 0;
  int64_t chunk_rows = std::clamp<int64_t>(kFp8ChunkElements / p.in, 1, p.out);
  if (fitting >= std::min(kFp8MinChunkRows, p.out)) {
    chunk_rows = std::min(chunk_rows, fitting);
  } else {
    RETURN_IF_ERROR(EnsureScratch(x_bytes + static_cast<size_t>(chunk_rows * row_bytes)));
  }
  char* base = scratch_.as<char>();
  auto* w16 = reinterpret_cast<uint16_t*>(base + x_bytes);
  RETURN_IF_ERROR(Check(cuda::LaunchCastTo16(DType::kBF16, p.x, base, p.tokens * p.in, stream_),
                        "CastTo16 kernel launch"));
  const float alpha = 1.0f;
  const float beta = p.accumulate ? 1.0f : 0.0f;
  const int tokens = static_cast<int>(p.tokens), in = static_cast<int>(p.in), out = static_cast<int>(p.out);
  for (int64_t r0 = 0; r0 < p.out; r0 += chunk_rows) {
    const int64_t rows = std::min(chunk_rows, p.out - r0);
    RETURN_IF_ERROR(Check(dequantize(r0, r0 + rows, w16), what.launch));
    // Linear's layout for rows [r0, r0 + rows) of w: y^T[r0 .., tokens] with y's leading dimension.
    RETURN_IF_ERROR(CheckBlas(cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(rows), tokens, in, &alpha,
                                           w16, CUDA_R_16BF, in, base, CUDA_R_16BF, in, &beta, p.y + r0, CUDA_R_32F,
                                           out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                              what.gemm));
  }
  if (p.bias == nullptr) return absl::OkStatus();
  return Check(cuda::LaunchBiasAdd(p.bias, p.y, p.tokens, p.out, stream_), "Linear bias kernel launch");
}

absl::Status CudaBackend::LinearGroup(const LinearGroupParams& p) {
  RETURN_IF_ERROR(p.Validate());
  // F8_E4M3 parts of a decode-sized batch: one FP8 GEMV launch for every part (bias and
  // accumulation fused; the gated form then applies SiluMul). Larger batches: a Linear per part
  // below (each dequantizes its rows). A normed form reaches it through the default's RmsNorm.
  if (p.tokens <= cuda::kGemvFp8MaxTokens && p.in > 0 && FitsInt({p.tokens, p.in}) && !p.norm.has_value()) {
    bool fp8 = true;
    for (int i = 0; i < p.num_parts; ++i) {
      const LinearGroupParams::Part& part = p.parts[static_cast<size_t>(i)];
      fp8 = fp8 && part.w.dtype == DType::kF8E4M3 && FitsInt({part.out});
    }
    if (fp8) {
      RETURN_IF_ERROR(Enter());
      if (p.tokens == 0) return absl::OkStatus();
      RETURN_IF_ERROR(Check(cuda::LaunchGemvFp8(p.x, GemvFp8GroupOf(p), p.tokens, p.in, multiprocessors_, stream_),
                            "GemvFp8 kernel launch"));
      if (p.gated.has_value()) return Check(cuda::LaunchSiluMul(p.GateParams(), stream_), "SiluMul kernel launch");
      return absl::OkStatus();
    }
  }
  // One 16-bit type across the parts, all within cuBLAS's int range: one GEMV launch (the gated
  // form: one launch for both products and the activation), or one rounding of x shared by the
  // parts' GEMMs. Anything else (f32, larger FP8 batches): a Linear per part, and SiluMul for the
  // gated form.
  const DType dtype = p.parts[0].w.dtype;
  bool fused = (dtype == DType::kBF16 || dtype == DType::kF16) && p.in > 0 && FitsInt({p.tokens, p.in});
  for (int i = 0; i < p.num_parts; ++i) {
    const LinearGroupParams::Part& part = p.parts[static_cast<size_t>(i)];
    fused = fused && part.w.dtype == dtype && FitsInt({part.out});
  }
  // The normed form: fused into the GEMV (Gemv16Norm) or into the rounding of x for the GEMMs
  // (RmsNormTo16); elsewhere the default, an RmsNorm kernel into the scratch and then the group.
  if (!fused || (p.norm.has_value() && !fused_norm_)) return Backend::LinearGroup(p);
  RETURN_IF_ERROR(Enter());
  if (p.tokens == 0) return absl::OkStatus();
  return Group16(p);
}

absl::Status CudaBackend::RmsNorm(const RmsNormParams& p) {
  RETURN_IF_ERROR(p.Validate());
  RETURN_IF_ERROR(Enter());
  return Check(cuda::LaunchRmsNorm(p, stream_), "RmsNorm kernel launch");
}

absl::Status CudaBackend::AddRmsNorm(const AddRmsNormParams& p) {
  RETURN_IF_ERROR(p.Validate());
  RETURN_IF_ERROR(Enter());
  return Check(cuda::LaunchAddRmsNorm(p, stream_), "AddRmsNorm kernel launch");
}

absl::Status CudaBackend::Rope(const RopeParams& p) {
  RETURN_IF_ERROR(p.Validate());
  if (cuda::RopeSharedBytes(p.head_dim) > cuda::kMaxDynamicSharedBytes) {
    return absl::UnimplementedError(absl::StrCat(name_, ": Rope head_dim ", p.head_dim, " is too large"));
  }
  RETURN_IF_ERROR(Enter());
  return Check(cuda::LaunchRope(p, stream_), "Rope kernel launch");
}

absl::Status CudaBackend::KvWrite(const KvWriteParams& p) {
  RETURN_IF_ERROR(p.Validate());
  if (!SupportsOp(Op::kKvWrite, p.cache.dtype)) return UnsupportedWeights(name_, Op::kKvWrite, p.cache.dtype);
  // With rope: one kernel that rotates and writes (ops.cu), with Rope's shared cos/sin table.
  if (p.rope.has_value() && cuda::RopeSharedBytes(p.rope->head_dim) > cuda::kMaxDynamicSharedBytes) {
    return absl::UnimplementedError(absl::StrCat(name_, ": KvWrite with rope: head_dim ", p.rope->head_dim,
                                                 " is too large"));
  }
  RETURN_IF_ERROR(Enter());
  return Check(cuda::LaunchKvWrite(p, stream_), "KvWrite kernel launch");
}

CudaBackend::AttentionDispatch CudaBackend::DispatchAttention(const AttentionParams& p) const {
  AttentionDispatch d;
  if (!mma_attention_ || !cuda::MmaAttentionApplies(p, compute_major_)) return d;
  d.mma = true;
  const AttnSeq* seqs = p.paged.host_seqs;
  d.split = std::any_of(seqs, seqs + p.paged.num_seqs,
                        [](const AttnSeq& s) { return s.q_len > 0 && s.q_len < cuda::kMinMmaAttentionRows; });
  if (d.split) d.split_max_q_len = cuda::kMinMmaAttentionRows - 1;
  return d;
}

absl::Status CudaBackend::Attention(const AttentionParams& p) {
  RETURN_IF_ERROR(p.Validate());
  // Prefill sequences on tensor cores where they apply, the others on the split-K kernel, which
  // spreads a decode row's keys over the machine; a step mixing both (chunked prefill beside decode
  // rows) launches both (attention.cuh, "Dispatch").
  const AttentionDispatch d = DispatchAttention(p);
  cuda::AttentionPlan plan;
  if (d.split) {
    plan = cuda::PlanAttention(p, multiprocessors_, d.split_max_q_len);
    if (plan.heads_per_block == 0 || !FitsInt({p.q_heads})) {
      return absl::UnimplementedError(absl::StrCat(name_, ": Attention with head_dim ", p.cache.head_dim, " and ",
                                                   p.q_heads, " query heads is not supported"));
    }
  }
  RETURN_IF_ERROR(Enter());
  // The split kernel's workspace first: growing it drains the stream, before either launch.
  const size_t partial_floats = d.split ? cuda::AttentionPartialFloats(p, plan) : 0;
  RETURN_IF_ERROR(EnsureScratch(partial_floats * sizeof(float)));
  const size_t counters = d.split ? cuda::AttentionCounterCount(p, plan) : 0;
  RETURN_IF_ERROR(EnsureAttnCounters(counters));
  if (d.mma) RETURN_IF_ERROR(Check(cuda::LaunchMmaAttention(p, stream_), "MmaAttention kernel launch"));
  if (!d.split) return absl::OkStatus();
  return Check(cuda::LaunchAttention(p, plan, partial_floats > 0 ? scratch_.as<float>() : nullptr,
                                     counters > 0 ? attn_counters_.as<unsigned int>() : nullptr, stream_),
               "Attention kernel launch");
}

absl::Status CudaBackend::SiluMul(const SiluMulParams& p) {
  RETURN_IF_ERROR(p.Validate());
  RETURN_IF_ERROR(Enter());
  return Check(cuda::LaunchSiluMul(p, stream_), "SiluMul kernel launch");
}

absl::Status CudaBackend::Add(const AddParams& p) {
  RETURN_IF_ERROR(p.Validate());
  RETURN_IF_ERROR(Enter());
  return Check(cuda::LaunchAdd(p, stream_), "Add kernel launch");
}

absl::Status CudaBackend::GatherRows(const GatherRowsParams& p) {
  RETURN_IF_ERROR(p.Validate());
  RETURN_IF_ERROR(Enter());
  return Check(cuda::LaunchGatherRows(p, stream_), "GatherRows kernel launch");
}

absl::Status CudaBackend::ScatterAddRows(const ScatterAddRowsParams& p) {
  RETURN_IF_ERROR(p.Validate());
  RETURN_IF_ERROR(Enter());
  return Check(cuda::LaunchScatterAddRows(p, stream_), "ScatterAddRows kernel launch");
}

absl::Status CudaBackend::SigmoidScaleRows(const SigmoidScaleRowsParams& p) {
  RETURN_IF_ERROR(p.Validate());
  RETURN_IF_ERROR(Enter());
  return Check(cuda::LaunchSigmoidScaleRows(p, stream_), "SigmoidScaleRows kernel launch");
}

absl::Status CudaBackend::ScaleRows(const ScaleRowsParams& p) {
  RETURN_IF_ERROR(p.Validate());
  RETURN_IF_ERROR(Enter());
  return Check(cuda::LaunchScaleRows(p, stream_), "ScaleRows kernel launch");
}

absl::Status CudaBackend::ArgmaxRows(const ArgmaxRowsParams& p) {
  RETURN_IF_ERROR(p.Validate());
  RETURN_IF_ERROR(Enter());
  return Check(cuda::LaunchArgmaxRows(p, stream_), "ArgmaxRows kernel launch");
}

absl::Status CudaBackend::SampleRows(const SampleRowsParams& p) {
  RETURN_IF_ERROR(p.Validate());
  RETURN_IF_ERROR(Enter());
  if (!FitsInt({p.rows * p.stride})) {
    return absl::InvalidArgumentError(
        absl::StrCat(name_, ": SampleRows of ", p.rows, " x ", p.stride, " logits exceeds the sort's int item count"));
  }
  size_t bytes = 0;
  RETURN_IF_ERROR(Check(cuda::SampleRowsWorkspaceBytes(p, &bytes), "SampleRows workspace query"));
  RETURN_IF_ERROR(Grow(sample_workspace_, bytes, /*recorded=*/false));
  return Check(cuda::LaunchSampleRows(p, sample_workspace_.as<void>(), bytes, stream_), "SampleRows launch");
}

absl::Status CudaBackend::MoeRoute(const MoeRouteParams& p) {
  RETURN_IF_ERROR(p.Validate());
  RETURN_IF_ERROR(Enter());
  // The sort counts its items in int, and the routing scratch of every token must be addressable.
  if (!FitsInt({p.tokens * p.routing.top_k, p.tokens * (p.routing.num_experts + p.routing.n_group)})) {
    return absl::InvalidArgumentError(absl::StrCat(name_, ": MoeRoute of ", p.tokens, " tokens x ",
                                                   p.routing.num_experts, " experts exceeds the sort's int range"));
  }
  size_t bytes = 0;
  RETURN_IF_ERROR(EnsureMoeRouteWorkspace(p, &bytes));
  RETURN_IF_ERROR(
      Check(cuda::LaunchMoeRoute(p, moe_route_workspace_.as<void>(), bytes, stream_), "MoeRoute kernel launch"));
  // Device offsets only: the grouped experts read them on the device; nothing waits.
  if (p.host_offsets == nullptr) return absl::OkStatus();
  // The one wait: the caller sizes each expert's GEMMs from the offsets.
  const size_t offset_bytes = static_cast<size_t>(p.routing.num_experts + 1) * sizeof(int32_t);
  RETURN_IF_ERROR(Check(cudaMemcpyAsync(p.host_offsets, p.offsets, offset_bytes, cudaMemcpyDeviceToHost, stream_),
                        "cudaMemcpyAsync (MoeRoute offsets)"));
  return Check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

absl::Status CudaBackend::EnsureMoeRouteWorkspace(const MoeRouteParams& p, size_t* bytes) {
  RETURN_IF_ERROR(Check(cuda::MoeRouteWorkspaceBytes(p, bytes), "MoeRoute workspace query"));
  if (capturing_ && *bytes > moe_route_workspace_.bytes()) {
    return absl::FailedPreconditionError(absl::StrCat(name_, ": MoeRoute of ", p.tokens,
                                                      " tokens needs more workspace than Reserve() made"));
  }
  return Grow(moe_route_workspace_, *bytes);
}

absl::Status CudaBackend::GroupedLinear(const GroupedLinearParams& p) {
  RETURN_IF_ERROR(p.Validate());
  if (p.device_offsets()) return GroupedLinearOnDevice(p);
  if (p.num_groups == 0) return Enter();
  const DType dtype = p.groups[0].w.dtype;
  if (!SupportsOp(Op::kGroupedLinear, dtype)) return UnsupportedWeights(name_, Op::kGroupedLinear, dtype);
  if (!FitsInt({p.rows, p.in, p.out, p.num_groups})) {
    return absl::UnimplementedError(absl::StrCat(name_, ": GroupedLinear dimensions exceed cuBLAS's int range: ",
                                                 p.rows, "x", p.in, "x", p.out));
  }
  RETURN_IF_ERROR(Enter());
  if (p.out == 0) return absl::OkStatus();
  if (p.in == 0) {
    // Empty products (cuBLAS rejects k = 0 with lda = 0): y = 0 on the groups' rows, or unchanged.
    for (int64_t g = 0; g < p.num_groups && !p.accumulate; ++g) {
      const GroupedLinearParams::Group& group = p.groups[g];
      RETURN_IF_ERROR(Check(cudaMemsetAsync(p.y + group.begin * p.out, 0,
                                            static_cast<size_t>(group.count * p.out) * sizeof(float), stream_),
                            "cudaMemsetAsync"));
    }
    return absl::OkStatus();
  }
  if (dtype != DType::kF32) return GroupedLinear16(p);
  // Each group is one problem of its own shape: row-major y[count, out] = x[count, in] . w[out, in]^T
  // is, column-major, y^T[out, count] = op_T(w^T[in, out]) . x^T[in, count] (Linear's layout).
  GroupedGemm& gg = grouped_;
  gg.Clear();
  int problems = 0;
  for (int64_t g = 0; g < p.num_groups; ++g) {
    const GroupedLinearParams::Group& group = p.groups[g];
    if (group.count == 0) continue;
    ++problems;
    gg.trans_a.push_back(CUBLAS_OP_T);
    gg.trans_b.push_back(CUBLAS_OP_N);
    gg.m.push_back(static_cast<int>(p.out));
    gg.n.push_back(static_cast<int>(group.count));
    gg.k.push_back(static_cast<int>(p.in));
    gg.lda.push_back(static_cast<int>(p.in));
    gg.ldb.push_back(static_cast<int>(p.in));
    gg.ldc.push_back(static_cast<int>(p.out));
    gg.size.push_back(1);
    gg.alpha.push_back(1.0f);
    gg.beta.push_back(p.accumulate ? 1.0f : 0.0f);
  }
  if (problems == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Grow(grouped_pointers_, 3 * static_cast<size_t>(problems) * sizeof(void*)));
  const void** dev = grouped_pointers_.as<const void*>();
  // The pointer arrays are written on the device, in stream order: no host copy, no wait.
  RETURN_IF_ERROR(ForEachGroupTable(p.groups, p.num_groups, [&](const cuda::GroupTable& table, int first) {
    return Check(cuda::LaunchBuildGroupedPointers(table, p.x, p.y, p.in, p.out, dev, problems, first, stream_),
                 "GroupedLinear pointers kernel launch");
  }));
  void** a = const_cast<void**>(dev);
  return CheckBlas(cublasGemmGroupedBatchedEx(blas_, gg.trans_a.data(), gg.trans_b.data(), gg.m.data(), gg.n.data(),
                                              gg.k.data(), gg.alpha.data(), a, CUDA_R_32F, gg.lda.data(),
                                              a + problems, CUDA_R_32F, gg.ldb.data(), gg.beta.data(),
                                              a + 2 * problems, CUDA_R_32F, gg.ldc.data(), problems,
                                              gg.size.data(), CUBLAS_COMPUTE_32F),
                   "cublasGemmGroupedBatchedEx");
}

// 16-bit experts. cublasGemmGroupedBatchedEx takes 16-bit A and B only with a 16-bit C (its type
// table), and the engine's activations are f32, so:
//   * Groups of at most kGroupedGemvMaxRows rows (decode, and prefill chunks spread over many
//     experts): one grouped GEMV launch per kMaxLaunchGroups experts, f32 activations and sums.
//     Memory-bound: each expert's weights are read once per kGroupedGemvTile rows, which is all a
//     tensor core could save at these sizes.
//   * Larger groups: the activations are rounded to the weights' type once for every group, and
//     each group is one cublasGemmEx with f32 output and accumulation (Linear's large-batch
//     numerics). A grouped GEMM with a 16-bit C would round every output to 16 bits before the
//     SiLU and the down projection (a second rounding the per-expert Linear never makes) and need
//     a widening pass; a group this size is real GEMM work (>= 32 rows x out x in), so a launch per
//     expert costs the host a few microseconds against a GEMM of similar length.
absl::Status CudaBackend::GroupedLinear16(const GroupedLinearParams& p) {
  const DType dtype = p.groups[0].w.dtype;
  int64_t largest = 0;
  for (int64_t g = 0; g < p.num_groups; ++g) largest = std::max(largest, p.groups[g].count);
  if (largest <= cuda::kGroupedGemvMaxRows) {
    return ForEachGroupTable(p.groups, p.num_groups, [&](const cuda::GroupTable& table, int /*first*/) {
      return Check(cuda::LaunchGroupedGemv16(dtype, p.x, p.y, table, p.in, p.out, p.accumulate, stream_),
                   "GroupedGemv16 kernel launch");
    });
  }
  const int64_t n = p.rows * p.in;
  RETURN_IF_ERROR(EnsureScratch(static_cast<size_t>(n) * 2));
  RETURN_IF_ERROR(Check(cuda::LaunchCastTo16(dtype, p.x, scratch_.as<void>(), n, stream_), "CastTo16 kernel launch"));
  const auto* x16 = scratch_.as<uint16_t>();
  for (int64_t g = 0; g < p.num_groups; ++g) {
    const GroupedLinearParams::Group& group = p.groups[g];
    if (group.count == 0) continue;
    RETURN_IF_ERROR(Gemm16({.x = p.x + group.begin * p.in, .w = group.w, .y = p.y + group.begin * p.out,
                            .tokens = group.count, .in = p.in, .out = p.out, .accumulate = p.accumulate},
                           x16 + group.begin * p.in));
  }
  return absl::OkStatus();
}

// The device-offsets form of 16-bit experts: every held expert's block reads its row range from
// the offsets and its matrix from the caller's device table; blocks of experts without rows exit
// at once. One launch, no host copy, no wait: recordable. The GEMV only (groups are bounded by
// MaxDeviceGroupRows); f32 and FP8 experts, and larger groups, take the host-groups form.
absl::Status CudaBackend::GroupedLinearOnDevice(const GroupedLinearParams& p) {
  const DType dtype = p.dtype();
  if (p.device.num_held > 0 && p.device.max_rows_per_group > MaxDeviceGroupRows(dtype)) {
    return absl::UnimplementedError(absl::StrCat(name_, ": GroupedLinear over device offsets takes ",
                                                 DTypeName(dtype), " groups of at most ", MaxDeviceGroupRows(dtype),
                                                 " rows, asked for ", p.device.max_rows_per_group));
  }
  if (!FitsInt({p.rows, p.in, p.out}) || std::min(p.device.num_held, p.rows) > 65535) {
    return absl::UnimplementedError(absl::StrCat(name_, ": GroupedLinear over device offsets of ", p.device.num_held,
                                                 " experts, ", p.rows, "x", p.in, "x", p.out,
                                                 " exceeds the launch's range"));
  }
  RETURN_IF_ERROR(Enter());
  if (p.device.num_held == 0 || p.out == 0) return absl::OkStatus();
  if (p.in == 0) {
    return absl::UnimplementedError(absl::StrCat(name_, ": GroupedLinear over device offsets needs in > 0"));
  }
  bool aligned = true;
  for (int64_t i = 0; i < p.device.num_held; ++i) {
    aligned = aligned && (reinterpret_cast<uintptr_t>(p.host_weights[i].data) & 15u) == 0;
  }
  const cuda::DeviceGroups groups{.offsets = p.device.offsets, .ids = p.device.ids, .weights = p.weights,
                                  .num_held = static_cast<int>(p.device.num_held)};
  return Check(
      cuda::LaunchGroupedGemv16(dtype, p.x, p.y, groups, aligned, p.rows, p.in, p.out, p.accumulate, stream_),
      "GroupedGemv16 (device offsets) kernel launch");
}

absl::Status CudaBackend::MoeCombine(const MoeCombineParams& p) {
  RETURN_IF_ERROR(p.Validate());
  RETURN_IF_ERROR(Enter());
  if (p.tokens == 0 || p.width == 0) return absl::OkStatus();
  if (p.device_offsets()) {
    // Every held expert searched on the device, kCombineThreads at a time, in order: one launch.
    const cuda::DeviceGroups groups{.offsets = p.device.offsets, .ids = p.device.ids,
                                    .num_held = static_cast<int>(p.device.num_held)};
    return Check(cuda::LaunchMoeCombine(p.src, p.rows, p.scales, groups, p.dst, p.tokens, p.width, stream_),
                 "MoeCombine (device offsets) kernel launch");
  }
  // One launch per kMaxLaunchGroups groups, in order: each token's sum keeps the groups' order.
  return ForEachGroupTable(p.groups, p.num_groups, [&](const cuda::GroupTable& table, int /*first*/) {
    return Check(cuda::LaunchMoeCombine(p.src, p.rows, p.scales, table, p.dst, p.tokens, p.width, stream_),
                 "MoeCombine kernel launch");
  });
}

absl::Status CudaBackend::Zero(const ZeroParams& p) {
  RETURN_IF_ERROR(p.Validate());
  RETURN_IF_ERROR(Enter());
  if (p.n == 0) return absl::OkStatus();
  return Check(cudaMemsetAsync(p.x, 0, static_cast<size_t>(p.n) * sizeof(float), stream_), "cudaMemsetAsync");
}

absl::Status CudaBackend::Scale(const ScaleParams& p) {
  RETURN_IF_ERROR(p.Validate());
  RETURN_IF_ERROR(Enter());
  return Check(cuda::LaunchScale(p, stream_), "Scale kernel launch");
}

}  // namespace

absl::Status CudaBackendDeviceMemory(int device_index, int64_t* total_bytes, int64_t* free_bytes) {
  if (device_index < 0 || device_index >= CudaBackendDeviceCount()) {
    return absl::FailedPreconditionError(absl::StrCat("CUDA device ", device_index, " does not exist"));
  }
  size_t free_b = 0, total_b = 0;
  if (cudaSetDevice(device_index) != cudaSuccess || cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaMemGetInfo failed on device ", device_index));
  }
  *total_bytes = static_cast<int64_t>(total_b);
  *free_bytes = static_cast<int64_t>(free_b);
  return absl::OkStatus();
}

int CudaBackendDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    // No driver, no device, or a driver older than the runtime: report none, and clear the error
    // so it is not blamed on a later call.
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device_index, const CudaBackendOptions& options) {
  const int count = CudaBackendDeviceCount();
  if (device_index < 0 || device_index >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device ", device_index, " requested but this machine has ", count, " CUDA device(s)"));
  }
  auto backend = std::make_unique<CudaBackend>(device_index, options);
  RETURN_IF_ERROR(backend->Init(options.pdl));
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace shardserve::kernels

// A Backend for tests of code that records op graphs (Backend::Capture), without a GPU: it wraps
// another backend (the CPU one) and, while recording, stores each op call with its Params instead
// of running it; OpGraph::Replay runs the stored calls again with those same Params, as a CUDA
// graph relaunches its kernels with their recorded arguments. Like a CUDA capture it refuses
// allocations, copies and synchronization while recording (the recording fails and nothing ran).
//
// Replayed calls read the current contents of the buffers they point at, so a caller that
// refreshes a buffer's contents before replaying sees the new values, while one that moved data
// to another buffer after recording sees stale ones: the bug class graph users must avoid. The
// paged ops' host copies (host_seqs, host_block_table), which a CUDA graph never reads again, are
// pointed at the device copies on replay (host memory on the CPU backend).
#ifndef SHARDSERVE_TESTS_TESTING_RECORDING_BACKEND_H_
#define SHARDSERVE_TESTS_TESTING_RECORDING_BACKEND_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "worker/kernels/backend.h"

namespace shardserve::testing {

class RecordingBackend final : public kernels::Backend {
 public:
  explicit RecordingBackend(std::unique_ptr<kernels::Backend> inner) : inner_(std::move(inner)) {}

  // Test controls: the next recordings fail (as a capture the device refuses would); the graphs
  // recorded so far answer Aborted to Replay (as CUDA's do once the backend replaced the scratch
  // they recorded); the number of graphs recorded and replays run so far.
  void FailRecordingsForTest(bool fail) { fail_recordings_ = fail; }
  void InvalidateRecordingsForTest() { ++*generation_; }
  // GroupedLinear as a Linear per group of the inner backend, and SupportsOp(kGroupedLinear) where
  // the inner one takes the dtype for Linear: the engine's grouped-expert path (the CUDA one) on
  // the CPU, with the per-expert loop's sums. Its device-offsets form runs on the inner backend.
  void EmulateGroupedLinearForTest(bool on) { emulate_grouped_ = on; }
  int grouped_linears() const { return grouped_linears_; }  // GroupedLinear calls run so far
  // MoeCombine on the host (the inner backend's memory must be host memory, as the CPU's is)
  // through kernels/shared/moe_math.h's TokenGroupedRows and CombineElement, the functions the
  // CUDA kernel runs, and SupportsOp(kMoeCombine, kF32).
  void EmulateMoeCombineForTest(bool on) { emulate_combine_ = on; }
  int moe_combines() const { return moe_combines_; }  // MoeCombine calls run so far
  // SupportsOp(kLinear, kF8E4M3), and Linear with F8_E4M3 weights run as the inner backend's f32
  // Linear of the weights dequantized by kernels/shared/fp8_math.h (the functions CUDA's FP8
  // kernels use): the loader's and engine's FP8 path of CUDA ranks (codes + scales kept) on the CPU.
  void EmulateFp8LinearForTest(bool on) { emulate_fp8_ = on; }
  // SupportsOp(kKvWrite or kAttention, kF8E4M3) false: a backend without FP8 KV cache kernels.
  void RefuseFp8KvCacheForTest(bool on) { refuse_fp8_kv_ = on; }
  int fp8_linears() const { return *fp8_linears_; }  // F8_E4M3 Linear calls run so far
  // SupportsOp(kLinear, kMxfp4) false: a backend without MXFP4 kernels (the loader dequantizes).
  void RefuseMxfp4ForTest(bool on) { refuse_mxfp4_ = on; }
  int mxfp4_linears() const { return *mxfp4_linears_; }  // MXFP4 Linear calls run so far
  // Calls seen so far (run or recorded) of the fused forms the engine may use: a LinearGroup with
  // `gated` set, a KvWrite carrying `rope`; and of the separate Rope op. The default LinearGroup's
  // RmsNorm for a normed form counts as an RmsNorm too.
  int gated_linear_groups() const { return gated_linear_groups_; }
  // LinearGroup calls with `norm` set (the norm fused into the products), and RmsNorm ops run.
  int normed_linear_groups() const { return normed_linear_groups_; }
  int rms_norms() const { return rms_norms_; }
  int kv_writes_with_rope() const { return kv_writes_with_rope_; }
  int ropes() const { return ropes_; }
  int recordings() const { return recordings_; }
  int replays() const { return *replays_; }
  // The last Reserve's limits, and the most activation elements (rows x in) one Linear or
  // GroupedLinear took so far: what kernels::MaxProductActivations of those limits must cover.
  const kernels::StepLimits& reserved() const { return reserved_; }
  int64_t largest_product() const { return largest_product_; }

  kernels::DeviceKind kind() const override { return inner_->kind(); }
  std::string name() const override { return "recording-" + inner_->name(); }
  bool SupportsOp(kernels::Op op, DType dtype) const override {
    if (op == kernels::Op::kGroupedLinear && emulate_grouped_) return inner_->SupportsOp(kernels::Op::kLinear, dtype);
    if (op == kernels::Op::kMoeCombine && emulate_combine_) return dtype == DType::kF32;
    if (op == kernels::Op::kLinear && dtype == DType::kF8E4M3 && emulate_fp8_) return true;
    if (dtype == DType::kMxfp4 && refuse_mxfp4_) return false;
    if ((op == kernels::Op::kKvWrite || op == kernels::Op::kAttention) && dtype == DType::kF8E4M3 && refuse_fp8_kv_) {
      return false;
    }
    return inner_->SupportsOp(op, dtype);
  }
  void* stream_handle() const override { return inner_->stream_handle(); }
  bool SupportsCapture() const override { return true; }
  absl::StatusOr<std::unique_ptr<kernels::OpGraph>> Capture(absl::FunctionRef<absl::Status()> record) override;
  // Emulates a launch shape that follows the context, as CUDA's key splits do: one key per 8
  // positions of the longest sequence.
  int64_t AttentionShapeKey(const kernels::AttentionParams& p) const override;
  absl::Status Reserve(const kernels::StepLimits& limits) override {
    reserved_ = limits;
    return inner_->Reserve(limits);
  }
  // The inner backend's where GroupedLinear is emulated (the CPU's: the device-offsets form of
  // GroupedLinear and MoeCombine run on it, recorded like any op); else 0.
  int64_t MaxDeviceGroupRows(DType dtype) const override {
    return emulate_grouped_ && emulate_combine_ ? inner_->MaxDeviceGroupRows(dtype) : 0;
  }

  absl::StatusOr<kernels::DeviceBuffer> Allocate(size_t bytes) override;
  absl::Status CopyToDevice(void* dst, const void* host_src, size_t bytes) override;
  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) override;
  absl::Status Synchronize() override;

  absl::Status Embedding(const kernels::EmbeddingParams& p) override;
  absl::Status Linear(const kernels::LinearParams& p) override;
  // Counted, then Backend's default (a Linear per part, and SiluMul for the gated form), whose
  // calls are run or recorded one by one.
  absl::Status LinearGroup(const kernels::LinearGroupParams& p) override;
  absl::Status RmsNorm(const kernels::RmsNormParams& p) override;
  absl::Status AddRmsNorm(const kernels::AddRmsNormParams& p) override;
  absl::Status Rope(const kernels::RopeParams& p) override;
  absl::Status KvWrite(const kernels::KvWriteParams& p) override;
  absl::Status Attention(const kernels::AttentionParams& p) override;
  absl::Status SiluMul(const kernels::SiluMulParams& p) override;
  absl::Status Add(const kernels::AddParams& p) override;
  absl::Status GatherRows(const kernels::GatherRowsParams& p) override;
  absl::Status ScatterAddRows(const kernels::ScatterAddRowsParams& p) override;
  absl::Status SigmoidScaleRows(const kernels::SigmoidScaleRowsParams& p) override;
  absl::Status ScaleRows(const kernels::ScaleRowsParams& p) override;
  absl::Status ArgmaxRows(const kernels::ArgmaxRowsParams& p) override;
  absl::Status SampleRows(const kernels::SampleRowsParams& p) override;
  // Refused while recording when it copies the offsets to the host (host_offsets given).
  absl::Status MoeRoute(const kernels::MoeRouteParams& p) override;
  absl::Status GroupedLinear(const kernels::GroupedLinearParams& p) override;
  absl::Status MoeCombine(const kernels::MoeCombineParams& p) override;
  absl::Status HeadLinear(const kernels::HeadLinearParams& p) override;
  absl::Status MlaKvWrite(const kernels::MlaKvWriteParams& p) override;
  absl::Status MlaAttention(const kernels::MlaAttentionParams& p) override;
  absl::Status Zero(const kernels::ZeroParams& p) override;
  absl::Status Scale(const kernels::ScaleParams& p) override;

 private:
  // Runs `call` now, or stores it while recording.
  absl::Status RunOrRecord(std::function<absl::Status()> call);
  absl::Status Refuse(const char* what);

  std::unique_ptr<kernels::Backend> inner_;
  bool recording_ = false;
  bool fail_recordings_ = false;
  bool emulate_grouped_ = false;
  bool emulate_fp8_ = false;
  bool refuse_fp8_kv_ = false;
  std::shared_ptr<int> fp8_linears_ = std::make_shared<int>(0);
  bool refuse_mxfp4_ = false;
  std::shared_ptr<int> mxfp4_linears_ = std::make_shared<int>(0);
  int grouped_linears_ = 0;
  bool emulate_combine_ = false;
  int moe_combines_ = 0;
  int gated_linear_groups_ = 0;
  int normed_linear_groups_ = 0;
  int rms_norms_ = 0;
  int kv_writes_with_rope_ = 0;
  int ropes_ = 0;
  kernels::StepLimits reserved_;
  int64_t largest_product_ = 0;
  absl::Status recording_error_;
  std::vector<std::function<absl::Status()>> tape_;
  int recordings_ = 0;
  std::shared_ptr<int> replays_ = std::make_shared<int>(0);
  std::shared_ptr<int> generation_ = std::make_shared<int>(0);
};

}  // namespace shardserve::testing

#endif  // SHARDSERVE_TESTS_TESTING_RECORDING_BACKEND_H_

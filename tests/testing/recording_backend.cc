#include "tests/testing/recording_backend.h"

#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/kernels/shared/moe_math.h"

namespace shardserve::testing {
namespace {

class RecordedGraph final : public kernels::OpGraph {
 public:
  RecordedGraph(std::vector<std::function<absl::Status()>> tape, std::shared_ptr<int> replays,
                std::shared_ptr<const int> generation)
      : tape_(std::move(tape)),
        replays_(std::move(replays)),
        generation_(std::move(generation)),
        recorded_generation_(*generation_) {}
  absl::Status Replay() override {
    if (*generation_ != recorded_generation_) return absl::AbortedError("recording invalidated (test)");
    for (const auto& call : tape_) {
      if (absl::Status st = call(); !st.ok()) return st;
    }
    ++*replays_;
    return absl::OkStatus();
  }

 private:
  std::vector<std::function<absl::Status()>> tape_;
  std::shared_ptr<int> replays_;
  std::shared_ptr<const int> generation_;
  const int recorded_generation_;
};

// A replayed paged op reads its sequences and block tables from the "device" copies (host memory
// here), as a CUDA kernel would; their host copies may have moved since the recording.
kernels::PagedSeqs ForReplay(kernels::PagedSeqs p) {
  p.host_seqs = p.seqs;
  p.host_block_table = p.block_table;
  p.table_entries = std::numeric_limits<int32_t>::max();  // the table may have grown within its buffer
  return p;
}

}  // namespace

absl::StatusOr<std::unique_ptr<kernels::OpGraph>> RecordingBackend::Capture(absl::FunctionRef<absl::Status()> record) {
  recording_ = true;
  recording_error_ = absl::OkStatus();
  tape_.clear();
  absl::Status st = record();
  recording_ = false;
  st.Update(recording_error_);
  if (fail_recordings_) st.Update(absl::InternalError("recording refused (test)"));
  std::vector<std::function<absl::Status()>> tape = std::move(tape_);
  tape_.clear();
  if (!st.ok()) return st;
  ++recordings_;
  return std::unique_ptr<kernels::OpGraph>(std::make_unique<RecordedGraph>(std::move(tape), replays_, generation_));
}

int64_t RecordingBackend::AttentionShapeKey(const kernels::AttentionParams& p) const {
  int64_t longest = 0;
  for (int64_t s = 0; s < p.paged.num_seqs; ++s) {
    const kernels::AttnSeq& a = p.paged.host_seqs[s];
    longest = std::max<int64_t>(longest, int64_t{a.pos_begin} + a.q_len);
  }
  return longest / 8;
}

absl::Status RecordingBackend::Refuse(const char* what) {
  absl::Status st = absl::FailedPreconditionError(absl::StrCat(name(), ": ", what, " while recording"));
  recording_error_.Update(st);
  return st;
}

absl::Status RecordingBackend::RunOrRecord(std::function<absl::Status()> call) {
  if (!recording_) return call();
  tape_.push_back(std::move(call));
  return absl::OkStatus();
}

absl::StatusOr<kernels::DeviceBuffer> RecordingBackend::Allocate(size_t bytes) {
  if (recording_) return Refuse("Allocate");
  return inner_->Allocate(bytes);
}
absl::Status RecordingBackend::CopyToDevice(void* dst, const void* host_src, size_t bytes) {
  if (recording_) return Refuse("CopyToDevice");
  return inner_->CopyToDevice(dst, host_src, bytes);
}
absl::Status RecordingBackend::CopyToHost(void* host_dst, const void* src, size_t bytes) {
  if (recording_) return Refuse("CopyToHost");
  return inner_->CopyToHost(host_dst, src, bytes);
}
absl::Status RecordingBackend::Synchronize() {
  if (recording_) return Refuse("Synchronize");
  return inner_->Synchronize();
}

absl::Status RecordingBackend::Embedding(const kernels::EmbeddingParams& p) {
  return RunOrRecord([this, p] { return inner_->Embedding(p); });
}
absl::Status RecordingBackend::Linear(const kernels::LinearParams& p) {
  largest_product_ = std::max(largest_product_, p.tokens * p.in);
  if (p.w.dtype == DType::kMxfp4) {
    return RunOrRecord([this, p] {
      ++*mxfp4_linears_;
      return inner_->Linear(p);
    });
  }
  if (!emulate_fp8_ || p.w.dtype != DType::kF8E4M3) return RunOrRecord([this, p] { return inner_->Linear(p); });
  if (absl::Status st = p.Validate(); !st.ok()) return st;
  // Dequantized when run (a replay reads the codes then), from host memory: the inner backend is
  // the CPU one.
  return RunOrRecord([this, p] {
    std::vector<float> w(static_cast<size_t>(p.out * p.in));
    for (int64_t r = 0; r < p.out; ++r) {
      kernels::Fp8DequantizeRow(static_cast<const uint8_t*>(p.w.data), p.w.fp8, r, p.in, w.data() + r * p.in);
    }
    kernels::LinearParams f = p;
    f.w = kernels::WeightView(w.data());
    ++*fp8_linears_;
    return inner_->Linear(f);
  });
}
absl::Status RecordingBackend::RmsNorm(const kernels::RmsNormParams& p) {
  ++rms_norms_;
  return RunOrRecord([this, p] { return inner_->RmsNorm(p); });
}
absl::Status RecordingBackend::AddRmsNorm(const kernels::AddRmsNormParams& p) {
  return RunOrRecord([this, p] { return inner_->AddRmsNorm(p); });
}
absl::Status RecordingBackend::LinearGroup(const kernels::LinearGroupParams& p) {
  // A normed form comes back here without its norm (Backend's default): count its gated form then.
  if (p.norm.has_value()) {
    ++normed_linear_groups_;
  } else if (p.gated.has_value()) {
    ++gated_linear_groups_;
  }
  return Backend::LinearGroup(p);
}
absl::Status RecordingBackend::Rope(const kernels::RopeParams& p) {
  ++ropes_;
  return RunOrRecord([this, p] { return inner_->Rope(p); });
}
absl::Status RecordingBackend::KvWrite(const kernels::KvWriteParams& p) {
  if (p.rope.has_value()) ++kv_writes_with_rope_;
  if (!recording_) return inner_->KvWrite(p);
  kernels::KvWriteParams r = p;
  r.paged = ForReplay(p.paged);
  return RunOrRecord([this, r] { return inner_->KvWrite(r); });
}
absl::Status RecordingBackend::Attention(const kernels::AttentionParams& p) {
  if (!recording_) return inner_->Attention(p);
  kernels::AttentionParams r = p;
  r.paged = ForReplay(p.paged);
  return RunOrRecord([this, r] { return inner_->Attention(r); });
}
absl::Status RecordingBackend::SiluMul(const kernels::SiluMulParams& p) {
  return RunOrRecord([this, p] { return inner_->SiluMul(p); });
}
absl::Status RecordingBackend::Add(const kernels::AddParams& p) {
  return RunOrRecord([this, p] { return inner_->Add(p); });
}
absl::Status RecordingBackend::GatherRows(const kernels::GatherRowsParams& p) {
  return RunOrRecord([this, p] { return inner_->GatherRows(p); });
}
absl::Status RecordingBackend::ScatterAddRows(const kernels::ScatterAddRowsParams& p) {
  return RunOrRecord([this, p] { return inner_->ScatterAddRows(p); });
}
absl::Status RecordingBackend::ScaleRows(const kernels::ScaleRowsParams& p) {
  return RunOrRecord([this, p] { return inner_->ScaleRows(p); });
}

absl::Status RecordingBackend::SigmoidScaleRows(const kernels::SigmoidScaleRowsParams& p) {
  return RunOrRecord([this, p] { return inner_->SigmoidScaleRows(p); });
}
absl::Status RecordingBackend::ArgmaxRows(const kernels::ArgmaxRowsParams& p) {
  return RunOrRecord([this, p] { return inner_->ArgmaxRows(p); });
}
absl::Status RecordingBackend::SampleRows(const kernels::SampleRowsParams& p) {
  return RunOrRecord([this, p] { return inner_->SampleRows(p); });
}
absl::Status RecordingBackend::MoeRoute(const kernels::MoeRouteParams& p) {
  if (recording_ && p.host_offsets != nullptr) return Refuse("MoeRoute with a host copy of the offsets");
  return RunOrRecord([this, p] { return inner_->MoeRoute(p); });
}
absl::Status RecordingBackend::GroupedLinear(const kernels::GroupedLinearParams& p) {
  largest_product_ = std::max(largest_product_, p.rows * p.in);  // CUDA rounds every row at once
  if (!emulate_grouped_) return inner_->GroupedLinear(p);
  if (absl::Status st = p.Validate(); !st.ok()) return st;
  ++grouped_linears_;
  // The device-offsets form: the inner (CPU) backend's, which reads the offsets when it runs.
  if (p.device_offsets()) return RunOrRecord([this, p] { return inner_->GroupedLinear(p); });
  for (int64_t g = 0; g < p.num_groups; ++g) {
    const kernels::GroupedLinearParams::Group& group = p.groups[g];
    if (group.count == 0) continue;
    absl::Status st = Linear({.x = p.x + group.begin * p.in, .w = group.w, .y = p.y + group.begin * p.out,
                              .tokens = group.count, .in = p.in, .out = p.out, .accumulate = p.accumulate});
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}
absl::Status RecordingBackend::MoeCombine(const kernels::MoeCombineParams& p) {
  if (!emulate_combine_) return inner_->MoeCombine(p);
  if (absl::Status st = p.Validate(); !st.ok()) return st;
  ++moe_combines_;
  // The device-offsets form: the inner (CPU) backend's, the same functions over the offsets it
  // reads when it runs.
  if (p.device_offsets()) return RunOrRecord([this, p] { return inner_->MoeCombine(p); });
  // The groups as the CUDA kernel's table holds them (copied: a recording outlives the caller's).
  std::vector<kernels::GroupRange> ranges;
  for (int64_t g = 0; g < p.num_groups; ++g) {
    ranges.push_back({static_cast<int32_t>(p.groups[g].begin), static_cast<int32_t>(p.groups[g].count)});
  }
  return RunOrRecord([p, ranges = std::move(ranges)] {
    std::vector<int32_t> found(ranges.size());
    for (int64_t t = 0; t < p.tokens; ++t) {
      const int n = kernels::TokenGroupedRows(p.rows, ranges.data(), static_cast<int>(ranges.size()),
                                              static_cast<int32_t>(t), found.data());
      float* d = p.dst + t * p.width;
      for (int64_t e = 0; e < p.width; ++e) {
        d[e] = kernels::CombineElement(d[e], p.src, p.scales, found.data(), n, p.width, e);
      }
    }
    return absl::OkStatus();
  });
}
absl::Status RecordingBackend::HeadLinear(const kernels::HeadLinearParams& p) {
  return RunOrRecord([this, p] { return inner_->HeadLinear(p); });
}
absl::Status RecordingBackend::MlaKvWrite(const kernels::MlaKvWriteParams& p) {
  if (!recording_) return inner_->MlaKvWrite(p);
  kernels::MlaKvWriteParams r = p;
  r.paged = ForReplay(p.paged);
  return RunOrRecord([this, r] { return inner_->MlaKvWrite(r); });
}
absl::Status RecordingBackend::MlaAttention(const kernels::MlaAttentionParams& p) {
  if (!recording_) return inner_->MlaAttention(p);
  kernels::MlaAttentionParams r = p;
  r.paged = ForReplay(p.paged);
  return RunOrRecord([this, r] { return inner_->MlaAttention(r); });
}
absl::Status RecordingBackend::Zero(const kernels::ZeroParams& p) {
  return RunOrRecord([this, p] { return inner_->Zero(p); });
}
absl::Status RecordingBackend::Scale(const kernels::ScaleParams& p) {
  return RunOrRecord([this, p] { return inner_->Scale(p); });
}

}  // namespace shardserve::testing

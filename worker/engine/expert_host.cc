#include "worker/engine/expert_host.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/concurrency/mutex.h"
#include "common/status/macros.h"
#include "worker/engine/model.h"
#include "worker/kernels/registry.h"

namespace shardserve::engine {

// One device: its backend and the scratch buffers of one call at a time.
struct ExpertHost::Device {
  std::unique_ptr<kernels::Backend> backend;
  Mutex mu;
  kernels::DeviceBuffer x ABSL_GUARDED_BY(mu), gate ABSL_GUARDED_BY(mu), up ABSL_GUARDED_BY(mu),
      y ABSL_GUARDED_BY(mu);  // grown on demand
  int64_t rows_capacity ABSL_GUARDED_BY(mu) = 0;

  absl::Status Reserve(int64_t rows, int64_t hidden, int64_t ffn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (rows <= rows_capacity) return absl::OkStatus();
    const int64_t n = std::max<int64_t>(rows, 2 * rows_capacity);
    ASSIGN_OR_RETURN(x, backend->Allocate(static_cast<size_t>(n * hidden) * sizeof(float)));
    ASSIGN_OR_RETURN(y, backend->Allocate(static_cast<size_t>(n * hidden) * sizeof(float)));
    ASSIGN_OR_RETURN(gate, backend->Allocate(static_cast<size_t>(n * ffn) * sizeof(float)));
    ASSIGN_OR_RETURN(up, backend->Allocate(static_cast<size_t>(n * ffn) * sizeof(float)));
    rows_capacity = n;
    return absl::OkStatus();
  }
};

ExpertHost::ExpertHost(const ModelSpec& spec) : spec_(spec) {}

ExpertHost::~ExpertHost() {
  experts_.clear();  // weights before their backends
  devices_.clear();
}

absl::StatusOr<std::unique_ptr<ExpertHost>> ExpertHost::Create(const ModelSpec& spec, const Checkpoint& ckpt,
                                                               const std::vector<HostedExpertSpec>& experts,
                                                               kernels::DeviceKind kind, int cpu_threads,
                                                               Quantization quantize) {
  if (experts.empty()) return absl::InvalidArgumentError("an expert host needs at least one expert");
  if (!spec.IsMoe()) return absl::InvalidArgumentError("the model has no experts to host");
  std::unique_ptr<ExpertHost> host(new ExpertHost(spec));
  for (const HostedExpertSpec& e : experts) {
    if (host->experts_.count({e.layer, e.expert}) > 0) {
      return absl::InvalidArgumentError(absl::StrCat("expert ", e.expert, " of layer ", e.layer, " is listed twice"));
    }
    // CPU devices share the host's memory and BLAS: one backend serves them all.
    const int key = kind == kernels::DeviceKind::kCpu ? 0 : e.device;
    std::unique_ptr<Device>& dev = host->devices_[key];
    if (dev == nullptr) {
      dev = std::make_unique<Device>();
      ASSIGN_OR_RETURN(dev->backend,
                       kernels::CreateBackend({.kind = kind, .device_index = key, .cpu_threads = cpu_threads}));
    }
    ASSIGN_OR_RETURN(MlpWeights w, LoadExpert(spec, e.layer, e.expert, ckpt, *dev->backend, &host->weight_bytes_,
                                                    quantize));
    host->experts_.emplace(std::make_pair(e.layer, e.expert), Entry{dev.get(), std::move(w)});
  }
  return host;
}

absl::Status ExpertHost::Compute(int64_t layer, absl::Span<const ExpertRows> groups, absl::Span<const float> x,
                                 absl::Span<float> y) {
  const int64_t h = spec_.hidden_size;
  const int64_t ffn = spec_.moe.expert_intermediate_size;
  int64_t total = 0;
  std::vector<const Entry*> entries;
  entries.reserve(groups.size());
  for (const ExpertRows& g : groups) {
    auto it = experts_.find({layer, g.expert});
    if (it == experts_.end()) {
      return absl::NotFoundError(absl::StrCat("this worker does not host expert ", g.expert, " of layer ", layer));
    }
    if (g.rows < 1) {
      return absl::InvalidArgumentError(absl::StrCat("expert ", g.expert, " of layer ", layer, ": ", g.rows, " rows"));
    }
    entries.push_back(&it->second);
    total += g.rows;
  }
  if (static_cast<int64_t>(x.size()) != total * h || y.size() != x.size()) {
    return absl::InvalidArgumentError(absl::StrCat("the groups hold ", total, " rows of ", h, " values; x has ",
                                                   x.size(), " values and y ", y.size()));
  }
  int64_t row = 0;
  for (size_t i = 0; i < groups.size(); ++i) {
    const int64_t n = groups[i].rows;
    Device& d = *entries[i]->device;
    const MlpWeights& w = entries[i]->weights;
    kernels::Backend& b = *d.backend;
    MutexLock lock(&d.mu);
    RETURN_IF_ERROR(d.Reserve(n, h, ffn));
    const size_t bytes = static_cast<size_t>(n * h) * sizeof(float);
    RETURN_IF_ERROR(b.CopyToDevice(d.x.as<void>(), x.data() + row * h, bytes));
    auto linear = [&](const LinearWeight& lin, const float* in, float* out) {
      return b.Linear({.x = in, .w = lin.view(), .bias = lin.bias(),
                       .y = out, .tokens = n, .in = lin.in, .out = lin.out});
    };
    RETURN_IF_ERROR(linear(w.gate, d.x.as<float>(), d.gate.as<float>()));
    RETURN_IF_ERROR(linear(w.up, d.x.as<float>(), d.up.as<float>()));
    RETURN_IF_ERROR(
        b.SiluMul({.gate = d.gate.as<float>(), .up = d.up.as<float>(), .out = d.gate.as<float>(), .n = n * ffn,
                   .act = GateActivationOf(spec_)}));
    RETURN_IF_ERROR(linear(w.down, d.gate.as<float>(), d.y.as<float>()));
    RETURN_IF_ERROR(b.CopyToHost(y.data() + row * h, d.y.as<float>(), bytes));
    row += n;
  }
  return absl::OkStatus();
}

namespace {

class DoneCall final : public RemoteExpertCall {
 public:
  explicit DoneCall(absl::Status status) : status_(std::move(status)) {}
  absl::Status Wait() override { return status_; }

 private:
  absl::Status status_;
};

}  // namespace

std::unique_ptr<RemoteExpertCall> InProcessRemoteExperts::Start(int64_t layer, absl::Span<const ExpertRows> groups,
                                                                absl::Span<const float> x, absl::Span<float> y) {
  return std::make_unique<DoneCall>(host_->Compute(layer, groups, x, y));
}

}  // namespace shardserve::engine

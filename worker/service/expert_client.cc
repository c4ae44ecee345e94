#include "worker/service/expert_client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/concurrency/mutex.h"
#include "common/status/grpc_status.h"
#include "worker/service/convert.h"
#include "worker/service/worker_metrics.h"

namespace shardserve::service {
namespace {

// The calls of one layer: each writes its rows of y; Wait() returns once all have answered.
class PendingCalls final : public engine::RemoteExpertCall {
 public:
  struct One {
    std::string address;
    grpc::ClientContext context;
    v1::ExpertRequest request;
    v1::ExpertResponse response;
    std::vector<std::pair<float*, int64_t>> segments;  // where its answer's rows go, in order
    int64_t rows = 0;
  };

  PendingCalls(int64_t hidden, DType wire, WorkerMetrics* metrics) : hidden_(hidden), wire_(wire), metrics_(metrics) {}

  ~PendingCalls() override {
    // The engine always waits; this guards against a caller that does not.
    MutexLock lock(&mu_);
    if (outstanding_ > 0) {
      for (auto& c : calls_) c->context.TryCancel();
      while (outstanding_ != 0) cv_.Wait(&mu_);
    }
  }

  One& Add() { return *calls_.emplace_back(std::make_unique<One>()); }

  void Send(v1::Expert::Stub* stub, One& one) {
    {
      MutexLock lock(&mu_);
      ++outstanding_;
    }
    stub->async()->Compute(&one.context, &one.request, &one.response,
                           [this, &one](const grpc::Status& status) { Done(one, status); });
  }

  absl::Status Wait() override {
    MutexLock lock(&mu_);
    while (outstanding_ != 0) cv_.Wait(&mu_);
    return status_;
  }

 private:
  void Done(One& one, const grpc::Status& status) {
    absl::Status st = FromGrpcStatus(status);
    if (st.ok()) {
      const v1::Tensor& t = one.response.y();
      // The host answers in the dtype it was sent.
      const size_t bytes = static_cast<size_t>(one.rows * hidden_) * DTypeSize(wire_);
      if (t.dtype() != ToWireDtype(wire_) || t.shape_size() != 2 || t.shape(0) != one.rows || t.shape(1) != hidden_ ||
          t.data().size() != bytes) {
        st = absl::InternalError(
            absl::StrCat("the answer is not ", DTypeName(wire_), " [", one.rows, ", ", hidden_, "]"));
      } else {
        const char* from = t.data().data();
        for (const auto& [to, rows] : one.segments) {
          const size_t values = static_cast<size_t>(rows * hidden_);
          ConvertToFloat(wire_, from, values, to);
          from += values * DTypeSize(wire_);
        }
      }
    }
    if (metrics_ != nullptr) {
      metrics_->ObserveStream("rx", "experts", one.response.ByteSizeLong());
    }
    MutexLock lock(&mu_);
    if (!st.ok() && status_.ok()) {
      status_ = absl::Status(st.code(), absl::StrCat("expert host ", one.address, ": ", st.message()));
    }
    if (--outstanding_ == 0) cv_.SignalAll();
  }

  const int64_t hidden_;
  const DType wire_;  // how the rows travel, both ways
  WorkerMetrics* const metrics_;
  std::vector<std::unique_ptr<One>> calls_;
  Mutex mu_;
  CondVar cv_;
  int outstanding_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status status_ ABSL_GUARDED_BY(mu_);  // the first failure
};

}  // namespace

absl::StatusOr<std::unique_ptr<GrpcRemoteExperts>> GrpcRemoteExperts::Create(
    const std::map<int64_t, std::vector<std::string>>& addresses, int64_t hidden_size, std::string assignment_id,
    std::chrono::milliseconds deadline, WorkerMetrics* metrics, int64_t max_rows_per_call,
    std::shared_ptr<grpc::ChannelCredentials> credentials, DType wire_dtype) {
  if (credentials == nullptr) credentials = grpc::InsecureChannelCredentials();
  if (hidden_size < 1) return absl::InvalidArgumentError("hidden_size must be >= 1");
  std::unique_ptr<GrpcRemoteExperts> r(new GrpcRemoteExperts());
  r->hidden_ = hidden_size;
  r->set_wire_dtype(wire_dtype);
  r->fixed_max_rows_ = std::max<int64_t>(max_rows_per_call, 0);
  r->assignment_id_ = std::move(assignment_id);
  r->deadline_ = deadline;
  r->metrics_ = metrics;
  std::map<std::string, int> index;
  for (const auto& [layer, per_expert] : addresses) {
    std::vector<int>& hosts = r->host_of_[layer];
    for (const std::string& a : per_expert) {
      if (a.empty()) {
        hosts.push_back(-1);
        continue;
      }
      auto [it, added] = index.emplace(a, static_cast<int>(r->hosts_.size()));
      if (added) {
        grpc::ChannelArguments args;
        args.SetMaxReceiveMessageSize(kMaxMessageBytes);
        args.SetMaxSendMessageSize(kMaxMessageBytes);
        r->hosts_.push_back(
            {a, v1::Expert::NewStub(grpc::CreateCustomChannel(a, credentials, args))});
      }
      hosts.push_back(it->second);
    }
  }
  if (r->hosts_.empty()) return absl::InvalidArgumentError("no expert is remote");
  return r;
}

void GrpcRemoteExperts::set_wire_dtype(DType wire_dtype) {
  wire_.store(wire_dtype == DType::kBF16 ? DType::kBF16 : DType::kF32, std::memory_order_relaxed);
}

int64_t GrpcRemoteExperts::MaxRows(DType wire) const {
  if (fixed_max_rows_ > 0) return fixed_max_rows_;
  const auto value_bytes = static_cast<int64_t>(DTypeSize(wire));
  return std::max<int64_t>(1, static_cast<int64_t>(kMaxChunkBytes) / (hidden_ * value_bytes));
}

std::unique_ptr<engine::RemoteExpertCall> GrpcRemoteExperts::Start(int64_t layer,
                                                                  absl::Span<const engine::ExpertRows> groups,
                                                                  absl::Span<const float> x, absl::Span<float> y) {
  // One dtype and row bound for all of this call's requests, whatever set_wire_dtype does meanwhile.
  const DType wire = wire_.load(std::memory_order_relaxed);
  const int64_t max_rows = MaxRows(wire);
  auto pending = std::make_unique<PendingCalls>(hidden_, wire, metrics_);
  auto fail = [&](absl::Status st) {
    struct Failed final : engine::RemoteExpertCall {
      explicit Failed(absl::Status s) : st(std::move(s)) {}
      absl::Status Wait() override { return st; }
      absl::Status st;
    };
    return std::make_unique<Failed>(std::move(st));
  };
  auto layer_hosts = host_of_.find(layer);
  // Per host, the request being filled; a full one (max_rows) is replaced by a new one.
  std::vector<PendingCalls::One*> open(hosts_.size(), nullptr);
  std::vector<std::pair<int, PendingCalls::One*>> to_send;
  int64_t row = 0;
  for (const engine::ExpertRows& g : groups) {
    const bool known = layer_hosts != host_of_.end() && g.expert >= 0 &&
                       g.expert < static_cast<int32_t>(layer_hosts->second.size());
    const int host = known ? layer_hosts->second[static_cast<size_t>(g.expert)] : -1;
    if (host < 0) {
      return fail(absl::InternalError(absl::StrCat("expert ", g.expert, " of layer ", layer, " has no host")));
    }
    int64_t left = g.rows;
    while (left > 0) {
      PendingCalls::One*& one = open[static_cast<size_t>(host)];
      if (one == nullptr || one->rows == max_rows) {
        one = &pending->Add();
        one->address = hosts_[static_cast<size_t>(host)].address;
        one->request.set_layer(static_cast<int32_t>(layer));
        one->request.set_assignment_id(assignment_id_);
        one->request.mutable_x()->set_dtype(ToWireDtype(wire));
        to_send.emplace_back(host, one);
      }
      const int64_t n = std::min(left, max_rows - one->rows);
      v1::ExpertGroup* eg = one->request.add_groups();
      eg->set_expert(g.expert);
      eg->set_rows(static_cast<int32_t>(n));
      // A request's rows need not be contiguous in x (groups of other hosts come between).
      AppendAs(wire, x.subspan(static_cast<size_t>(row * hidden_), static_cast<size_t>(n * hidden_)),
               one->request.mutable_x()->mutable_data());
      one->segments.emplace_back(y.data() + row * hidden_, n);
      row += n;
      left -= n;
      one->rows += n;
    }
  }
  if (row * hidden_ != static_cast<int64_t>(x.size()) || y.size() != x.size()) {
    return fail(absl::InternalError(absl::StrCat("the groups hold ", row, " rows; x has ", x.size(), " values and y ",
                                                 y.size())));
  }
  const auto deadline = std::chrono::system_clock::now() + deadline_;
  for (auto& [host, one] : to_send) {
    one->request.mutable_x()->add_shape(one->rows);
    one->request.mutable_x()->add_shape(hidden_);
    one->context.set_deadline(deadline);
    if (metrics_ != nullptr) metrics_->ObserveStream("tx", "experts", one->request.ByteSizeLong());
    pending->Send(hosts_[static_cast<size_t>(host)].stub.get(), *one);
  }
  return pending;
}

}  // namespace shardserve::service

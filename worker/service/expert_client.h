// GrpcRemoteExperts: the engine's RemoteExperts over Expert.Compute calls to the workers that host
// a stage's spilled experts (proto/shardserve/v1/expert.proto). One call per host per MoE layer
// and step, split into several when the rows exceed the message size; all calls of a layer run
// concurrently, while the stage's rank 0 computes its local experts.
#ifndef SHARDSERVE_WORKER_SERVICE_EXPERT_CLIENT_H_
#define SHARDSERVE_WORKER_SERVICE_EXPERT_CLIENT_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/security/credentials.h>

#include "absl/status/statusor.h"
#include "common/tensor/dtype.h"
#include "shardserve/v1/expert.grpc.pb.h"
#include "worker/engine/remote_experts.h"

namespace shardserve::service {

class WorkerMetrics;

class GrpcRemoteExperts final : public engine::RemoteExperts {
 public:
  // addresses[layer][e]: host:port of the worker computing expert e of MoE layer `layer`; empty
  // for local experts. InvalidArgument when no address is given at all. `max_rows_per_call`: 0 =
  // as many as fit in a message (kMaxChunkBytes); tests set it lower. `credentials`: of the
  // channels to the hosts (null = plaintext). `wire_dtype`: how the rows travel both ways (the
  // assignment's hidden_wire_dtype): kF32, or kBF16 (each value rounded to bfloat16 on the way
  // out, and the host answers in the dtype it was sent); any other is taken as kF32.
  static absl::StatusOr<std::unique_ptr<GrpcRemoteExperts>> Create(
      const std::map<int64_t, std::vector<std::string>>& addresses, int64_t hidden_size, std::string assignment_id,
      std::chrono::milliseconds deadline, WorkerMetrics* metrics, int64_t max_rows_per_call = 0,
      std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr, DType wire_dtype = DType::kF32);

  std::unique_ptr<engine::RemoteExpertCall> Start(int64_t layer, absl::Span<const engine::ExpertRows> groups,
                                                  absl::Span<const float> x, absl::Span<float> y) override;

  // Changes how the rows of later Start() calls travel (an assignment with another
  // hidden_wire_dtype kept the stage loaded); calls already started keep theirs. Thread-safe.
  void set_wire_dtype(DType wire_dtype);

  // Rows of `hidden_size` values per request at most, with the wire dtype now (so that a request
  // stays under the message size limit); exposed for tests.
  int64_t max_rows_per_call() const { return MaxRows(wire_.load(std::memory_order_relaxed)); }

 private:
  struct Host {
    std::string address;
    std::unique_ptr<v1::Expert::Stub> stub;
  };
  GrpcRemoteExperts() = default;
  int64_t MaxRows(DType wire) const;

  std::vector<Host> hosts_;
  std::map<int64_t, std::vector<int>> host_of_;  // [layer][expert] -> index into hosts_, or -1
  int64_t hidden_ = 0;
  int64_t fixed_max_rows_ = 0;  // the caller's max_rows_per_call; 0 = what fits in a message
  std::atomic<DType> wire_{DType::kF32};  // how the rows travel, both ways (kF32 or kBF16)
  std::string assignment_id_;
  std::chrono::milliseconds deadline_{0};
  WorkerMetrics* metrics_ = nullptr;
};

}  // namespace shardserve::service

#endif  // SHARDSERVE_WORKER_SERVICE_EXPERT_CLIENT_H_

// WorkerClient: how the coordinator pushes an assignment to a worker (Worker.Assign in
// proto/shardserve/v1/control.proto), behind an interface so that tests use a fake.
#ifndef SHARDSERVE_COORDINATOR_CLIENT_WORKER_CLIENT_H_
#define SHARDSERVE_COORDINATOR_CLIENT_WORKER_CLIENT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/plan/plan.h"

namespace shardserve::coordinator {

// Where the experts of one MoE layer of a stage live (mirrors shardserve.v1.LayerExperts).
struct LayerExpertPlacement {
  int64_t layer = 0;
  std::vector<int32_t> ranks;           // per expert: the stage's rank, or -1 when remote
  std::vector<std::string> addresses;   // per expert: the host's address when remote, else empty
};

// One expert an expert host serves (mirrors shardserve.v1.HostedExpert).
struct HostedExpert {
  int64_t layer = 0;
  int32_t expert = 0;
  int device = 0;
};

// One pipeline stage of one replica, or the experts an expert host serves, for one worker
// (mirrors shardserve.v1.Assignment).
struct WorkerAssignment {
  bool expert_host = false;   // ASSIGNMENT_ROLE_EXPERT_HOST (else a stage)
  std::string assignment_id;  // unique per plan and worker
  std::string model_path;     // the model directory as the worker sees it
  int32_t replica = 0;
  int32_t stage = 0;
  int32_t num_stages = 1;
  int64_t layer_begin = 0;  // layers [layer_begin, layer_end)
  int64_t layer_end = 0;
  DeviceKind device_kind = DeviceKind::kCpu;
  std::vector<int> devices;  // CUDA ordinals, or CPU ranks (the count is what matters)
  int64_t kv_blocks = 0;      // KV cache blocks to allocate, >= 1
  int32_t kv_block_size = 0;  // tokens per KV cache block, >= 1
  int32_t max_seq_len = 0;
  int32_t max_step_tokens = 0;
  std::string next_address;  // the next stage's worker; empty on the last stage
  std::vector<LayerExpertPlacement> experts;  // stage: its MoE layers' expert placement
  std::vector<HostedExpert> hosted_experts;   // expert host: what it loads and serves
  Quantization quantize = Quantization::kNone;  // how to store the weight matrices
};

// Thread-safe: Assign may be called from several threads at once.
class WorkerClient {
 public:
  virtual ~WorkerClient() = default;

  // Sends `assignment` to the worker serving at `address` and returns once the worker has taken
  // it (loading goes on in the background; its progress arrives through heartbeats). Blocks the
  // caller for at most the implementation's deadline. Errors: the call's status, e.g.
  // Unavailable (unreachable), DeadlineExceeded, or the worker's own InvalidArgument.
  virtual absl::Status Assign(const std::string& address, const WorkerAssignment& assignment) = 0;

  // Tells the worker at `address` to drop its assignment and become idle (Worker.Release), for
  // `reason` (logged by the worker). Same deadline and errors as Assign; Aborted while it loads.
  virtual absl::Status Release(const std::string& address, const std::string& reason) = 0;
};

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_CLIENT_WORKER_CLIENT_H_

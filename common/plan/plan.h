// Placement-plan value types: what the coordinator knows about its workers (WorkerInventory), what
// the operator asks for (PlanPolicy), and the plan the pure planner (coordinator/planner) computes
// from them (Plan). These are plain structs with no behaviour beyond small helpers; the planner
// fills them, the coordinator turns them into worker assignments, and `shardserve plan` prints them
// with PlanToString. Nothing here does I/O or knows about gRPC.
//
// Units: all sizes are bytes (int64_t); device indices are the worker's own numbering.
// Thread-safety: plain values; the functions below are pure and thread-safe.
#ifndef SHARDSERVE_COMMON_PLAN_PLAN_H_
#define SHARDSERVE_COMMON_PLAN_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/model_spec/model_spec.h"

namespace shardserve {

// ---------------------------------------------------------------------------------------------
// Inventory: what each worker reports when it registers.

enum class DeviceKind : uint8_t { kCpu, kCuda };

// "cpu" or "cuda".
absl::string_view DeviceKindName(DeviceKind kind);

struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;            // the worker's index for this device (unique per kind on a worker)
  int64_t total_bytes = 0;  // device memory (host RAM share for a CPU rank)
  int64_t free_bytes = 0;   // available to the model now; 0 <= free_bytes <= total_bytes
};

struct WorkerInventory {
  std::string worker_id;  // unique in the cluster; the planner orders workers by it
  std::string node_name;  // the machine it runs on (informational)
  std::vector<Device> devices;
};

// ---------------------------------------------------------------------------------------------
// Policy: what the operator fixes; 0 means "let the planner choose" where noted.

struct PlanPolicy {
  int tp = 0;        // tensor-parallel ranks per stage (= devices of one worker); 0 = auto
  int pp = 0;        // pipeline stages per replica (= workers per replica); 0 = auto
  int replicas = 0;  // data-parallel pipelines; 0 = auto (as many as fit)
  // KV budget. When kv_tokens > 0, every stage reserves KV for exactly kv_tokens tokens (summed
  // over all sequences) and the plan fails if that does not fit. Otherwise each stage gives
  // kv_fraction of the device memory left after its weights to KV (0 < kv_fraction <= 1).
  double kv_fraction = 0.9;
  int64_t kv_tokens = 0;
  // Longest sequence (prompt + generation); 0 = the model's max_position_embeddings. Every stage
  // must hold the KV of at least one sequence of this length.
  int64_t max_seq_len = 0;
  // Bytes per element of the weight matrices and the embedding as the workers hold them; 0 = the
  // formats the workers keep the checkpoint in (WorkerWeightFormats, common/plan/memory_model.h).
  // Norms, biases and routers are always f32 (4 bytes).
  int64_t bytes_per_param = 0;
  // Bytes per KV cache element as the workers keep it; 0 = the workers' (WorkerWeightFormats).
  int64_t kv_bytes_per_element = 0;
  // Subtracted from every device's free_bytes before planning (workspace, allocator slack).
  int64_t reserve_bytes_per_device = 0;
  // How the workers store weight matrices: with kInt8 the projections and the lm_head count at
  // Q8MatrixBytes (common/tensor/dtype.h) instead of bytes_per_param per element.
  Quantization quantize = Quantization::kNone;
  // How the workers keep the KV cache (the coordinator's --kv_cache_dtype): kFp8E4M3 counts 1 byte
  // per element (unless kv_bytes_per_element is set) and is refused for multi-head latent attention.
  KvCacheFormat kv_cache = KvCacheFormat::kAuto;
  // Allow experts of MoE layers that do not fit on their stage's worker to live on other workers
  // (called over gRPC). When false, a stage must hold all experts of its layers.
  bool allow_expert_spill = true;
};

// ---------------------------------------------------------------------------------------------
// Plan: the planner's answer.

// One pipeline stage: one worker running a contiguous range of layers on `tp` of its devices.
struct StageSpec {
  std::string worker_id;
  std::string node_name;
  int64_t layer_begin = 0;  // [layer_begin, layer_end)
  int64_t layer_end = 0;
  bool has_embedding = false;  // the token embedding (always stage 0)
  bool has_lm_head = false;    // final norm, lm_head and sampling (always the last stage)
  int tp = 1;                  // ranks = devices.size()
  // MoE layers (as the engine's ShardLayout): true when each local expert is whole on one rank
  // (num_experts >= tp > 1); false when every local expert is split over all ranks like a dense
  // MLP (tp = 1, or fewer experts than ranks).
  bool expert_parallel = false;
  DeviceKind device_kind = DeviceKind::kCpu;
  std::vector<int> devices;  // rank r runs on device index devices[r] (ascending)
  // Predicted bytes on the most loaded rank (rank 0: it also holds the row-parallel biases and
  // the most local experts), by the memory model (common/plan/memory_model.h): weights, and the KV
  // cache for `kv_tokens` tokens.
  int64_t predicted_weight_bytes_per_rank = 0;
  int64_t kv_bytes_per_rank = 0;
  // KV capacity in tokens over all sequences; the same for every stage of a pipeline (the
  // pipeline's capacity is that of its tightest stage, and the others reserve no more).
  int64_t kv_tokens = 0;
  // This stage's share of its pipeline's weighted cost (see coordinator/planner/planner.h);
  // the shares of a pipeline sum to 1.
  double cost_share = 0.0;
};

// Where one expert of one MoE layer lives.
struct ExpertLocation {
  std::string worker_id;
  // Local experts: the stage's TP rank holding it (device = stage.devices[rank]); 0 when the
  // stage splits every expert over all its ranks (StageSpec::expert_parallel false). Remote
  // experts: the position of `device` among the host worker's devices (each remote expert is
  // whole on one device).
  int rank = 0;
  int device = 0;       // device index on that worker
  bool remote = false;  // true when worker_id is not the worker of the layer's stage
};

struct LayerExperts {
  int64_t layer = 0;
  std::vector<ExpertLocation> experts;  // indexed by expert id; size = num_experts
};

// One complete pipeline (data-parallel replica).
struct Pipeline {
  std::vector<StageSpec> stages;      // stage s runs before stage s + 1
  std::vector<LayerExperts> experts;  // one entry per MoE layer, ascending layer; empty if dense
  int64_t NumRemoteExperts() const;
};

// A worker (device) holding spilled experts for stages on other workers.
struct ExpertHostSpec {
  std::string worker_id;
  std::string node_name;
  DeviceKind device_kind = DeviceKind::kCpu;
  int device = 0;
  int64_t num_experts = 0;
  int64_t predicted_weight_bytes = 0;
};

struct Plan {
  std::vector<Pipeline> replicas;
  std::vector<ExpertHostSpec> expert_hosts;  // sorted by (worker_id, device)
  int64_t max_seq_len = 0;                   // the resolved policy value
};

// ---------------------------------------------------------------------------------------------
// Helpers.

// Checks that `tp` ranks can split `spec`, with the rules of the engine's ShardLayout::Make
// (worker/engine/weights.h), which coordinator code may not include: tp >= 1 divides
// num_attention_heads and intermediate_size; either tp divides num_key_value_heads or
// num_key_value_heads divides tp (then KV heads are replicated); for MoE models tp divides
// shared_expert_intermediate_size, and the expert intermediate size too when there are fewer
// experts than ranks (otherwise experts are whole, expert parallel). InvalidArgument naming the
// config field that tp does not divide.
absl::Status ValidateTensorParallelSize(const ModelSpec& spec, int tp);

// Decimal units with one decimal: "950 B", "12.3 KB", "3.2 GB". Negative values get a '-'.
std::string FormatBytes(int64_t bytes);

// A readable multi-line table of the plan: per replica, one row per stage (worker, node, layers,
// embedding / lm_head, tp and devices, predicted weight and KV bytes per rank, KV tokens, cost
// share), a summary of local and remote experts per stage, and the expert hosts.
std::string PlanToString(const Plan& plan);

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_PLAN_PLAN_H_

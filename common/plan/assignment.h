// WorkerAssignment: what one worker is asked to hold (mirrors shardserve.v1.Assignment in
// proto/shardserve/v1/control.proto) — one pipeline stage of one replica, or the experts an expert
// host serves. The coordinator's control loop makes them from a Plan and sends them (Worker.Assign);
// workers report the one they hold when they register, so that a restarted coordinator can adopt
// it. Plain values; no behaviour.
#ifndef SHARDSERVE_COMMON_PLAN_ASSIGNMENT_H_
#define SHARDSERVE_COMMON_PLAN_ASSIGNMENT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "common/plan/plan.h"

namespace shardserve {

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
  KvCacheFormat kv_cache = KvCacheFormat::kAuto;  // how to keep the KV cache (stages)
  // Stages: how the hidden states go to the next stage and to expert hosts: kF32 or kBF16.
  DType hidden_wire_dtype = DType::kF32;
};

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_PLAN_ASSIGNMENT_H_

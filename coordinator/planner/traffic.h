// What a plan moves between devices per token, and how much of the time its stages idle: the
// figures `shardserve plan --explain` prints for the chosen layout. Pure.
//
// Per token means per token of one sequence going through the model (a decoded token, or one
// prompt token of a prefill), with activations as the engine sends them (f32):
//  - tensor parallelism: every layer all-reduces its attention output and its MLP (or MoE) output,
//    [hidden] floats each; a ring all-reduce sends 2 (tp - 1) / tp of the buffer from each rank
//    (NCCL's ring; the CPU ranks' shared-memory reduction copies about as much). The last stage also
//    all-gathers its vocab-parallel logits for each sampled token: (tp - 1) slices of
//    ceil(vocab / tp) floats arrive at each rank.
//  - pipeline: each stage but the last sends the token's [hidden] floats to the next over gRPC.
//  - expert spill: rows routed to experts on expert hosts go there and come back ([hidden] floats
//    each way per routed expert), expected over uniform routing: top_k x (remote experts / experts)
//    per MoE layer.
// Pipeline bubble, from the stages' cost shares (which sum to 1; the planner's roofline weights):
//  - one micro-batch in flight: a step passes through the stages in turn, so on average a stage
//    idles 1 - 1/pp of the time;
//  - pp micro-batches in flight (the scheduler's default pipeline depth): the slowest stage sets the
//    pace and the others idle 1 - cost / max cost; averaged, 1 - 1 / (pp x max cost share). Hop
//    latency and uneven micro-batches are not counted.
#ifndef SHARDSERVE_COORDINATOR_PLANNER_TRAFFIC_H_
#define SHARDSERVE_COORDINATOR_PLANNER_TRAFFIC_H_

#include <cstdint>
#include <vector>

#include "common/model_spec/model_spec.h"
#include "common/plan/plan.h"

namespace shardserve {

struct StageTraffic {
  int64_t tp_all_reduce_bytes = 0;     // sent by each rank, per token
  int64_t logits_all_gather_bytes = 0; // received by each rank, per sampled token (last stage, tp > 1)
  int64_t next_stage_bytes = 0;        // to the next stage, per token (0 on the last)
  double remote_expert_bytes = 0;      // to and from expert hosts, per token, expected
};

struct PipelineTraffic {
  std::vector<StageTraffic> stages;
  double bubble_one_micro_batch = 0.0;  // average idle fraction of a stage, in [0, 1)
  double bubble_pipelined = 0.0;        // with pp micro-batches in flight, in [0, 1)
};

// One entry per replica of `plan`, which MakePlan made for `spec`.
std::vector<PipelineTraffic> EstimateTraffic(const ModelSpec& spec, const Plan& plan);

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_PLANNER_TRAFFIC_H_

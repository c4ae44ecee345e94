// The simulator's cost model: how long one micro-batch takes on one pipeline stage, and one hop
// between stages. A per-op roofline: each op's time is the larger of (bytes it reads or writes /
// achievable memory bandwidth) and (FLOPs / achievable compute rate), from a DeviceProfile; on a
// device that does not overlap the two (DeviceProfile::overlap_memory_and_compute false: CPUs),
// their sum.
//
// Per layer of a stage, on its most loaded rank (tp ranks work in parallel):
//  - projections (q, k, v, o; gate, up, down; a MoE layer's router, shared expert and the experts
//    its tokens are routed to): the weights' bytes once per step (a batch reads each matrix once)
//    and 2 x tokens x parameters FLOPs, split over the tp ranks. A MoE layer reads only the
//    experts some token of the batch is routed to: with uniform routing, E x (1 - (1 - k/E)^T)
//    of E experts for T tokens and top-k; each token costs its k experts' FLOPs;
//  - attention: reads every sequence's cached keys and values (context x 2 x local KV heads x
//    head_dim x KV bytes) and writes the new ones; 4 x new tokens x context x local heads x
//    head_dim FLOPs (scores and weighted sum; a prefill chunk attends to half its own length on
//    average);
//  - two all-reduces of tokens x hidden activations when tp > 1 (ring: 2 (tp - 1) / tp of the
//    bytes over the intra-node link, 2 (tp - 1) link latencies);
//  - layer_overhead_s (kernel launches, norms, RoPE).
// The last stage adds the final norm and the lm_head for the sequences that sample
// (vocab x hidden weights / tp once, 2 x sampled x vocab x hidden FLOPs / tp); every stage adds
// step_overhead_s. The embedding lookup is free.
//
// A hop carries tokens x hidden activations over a link (latency + bytes / bandwidth) plus a fixed
// software cost per hop (gRPC stream, serialization: ~100 us on loopback here, ARCHITECTURE.md).
//
// A machine's memory bus and cores shared with other stages running at the same time (CPU stages
// of one machine): Cost with a HostShare prices every op at that fraction of the device's
// bandwidth and of its compute rate (the fixed per-layer and per-step costs are host work: they
// take 1 / compute share as long); the simulator decides the share (simulator.h).
//
// Not modelled: expert calls to spilled experts (a stage that spills is charged as if its experts
// were local), load imbalance between experts, compute/communication overlap, sliding windows,
// the GPU's lower efficiency at tiny batch sizes beyond layer_overhead_s.
//
// Thread-safety: immutable after construction; Cost() is const and thread-safe.
#ifndef SHARDSERVE_COORDINATOR_SIM_COST_MODEL_H_
#define SHARDSERVE_COORDINATOR_SIM_COST_MODEL_H_

#include <cstdint>

#include "absl/types/span.h"
#include "common/model_spec/model_spec.h"
#include "common/plan/plan.h"
#include "coordinator/scheduler/pipelining.h"
#include "coordinator/sim/device_profile.h"

namespace shardserve::sim {

// One sequence's part of a micro-batch (the scheduler's pipelining policy prices the same).
using SequenceWork = coordinator::StepWork;

// Where a stage's time goes (seconds, on its slowest rank).
struct StageTime {
  double weights = 0;      // projections and lm_head (weights read / GEMM FLOPs)
  double attention = 0;    // KV cache reads and attention FLOPs
  double collectives = 0;  // tensor-parallel all-reduces
  double overhead = 0;     // per-layer and per-step fixed costs
  // What the ops of weights + attention ask of each resource, whichever bounds them: their memory
  // traffic at the achievable bandwidth, and their FLOPs at the achievable rate (for a pipelining
  // policy that asks what two stages sharing one machine's bus and cores take together).
  double memory_demand = 0;
  double compute_demand = 0;
  double Total() const { return weights + attention + collectives + overhead; }
};

// The fraction of its device's memory bandwidth and compute rate a stage gets while other stages
// use the same machine, each in (0, 1]; {1, 1} = the machine to itself.
struct HostShare {
  double memory = 1.0;
  double compute = 1.0;
};

// What each of `concurrent` stages (>= 1, may be fractional: an expected number) running at once
// on one machine gets, when the machine runs them `parallelism` times faster together than one
// after the other (per resource, >= 1): the aggregate speed-up min(parallelism, concurrent) split
// evenly, so each gets min(parallelism, concurrent) / concurrent of its alone rate. E.g. two
// stages on a bus of parallelism 1.3 each read at 0.65 of the rate one alone gets.
HostShare ShareOfHost(double concurrent, const coordinator::HostParallelism& parallelism);

class StageCostModel {
 public:
  // `spec` is copied. bytes_per_param / kv_bytes_per_element: what the planner resolved
  // (WeightBytesPerParam / KvBytesPerElement). stage.tp >= 1 and its layer range inside the model
  // (a programmer error otherwise).
  StageCostModel(const ModelSpec& spec, const StageSpec& stage, DeviceProfile device, int64_t bytes_per_param,
                 int64_t kv_bytes_per_element);

  StageTime Cost(absl::Span<const SequenceWork> batch) const { return Cost(batch, HostShare{}); }
  // The same on a machine shared with other running stages (both shares in (0, 1]; a programmer
  // error otherwise).
  StageTime Cost(absl::Span<const SequenceWork> batch, const HostShare& share) const;

  const DeviceProfile& device() const { return device_; }

 private:
  // One op's roofline time on one rank; adds its demands to `t`.
  double Roofline(double bytes, double flops, const HostShare& share, StageTime& t) const;

  ModelSpec spec_;
  StageSpec stage_;
  DeviceProfile device_;
  int64_t bytes_per_param_;
  int64_t kv_bytes_;
  // Per rank, derived from the shapes.
  double local_heads_ = 0;
  double local_kv_heads_ = 0;
  double attn_params_ = 0;    // q, k, v, o of one layer on one rank
  double dense_params_ = 0;   // the dense MLP of one layer on one rank
  double expert_params_ = 0;  // one routed expert, whole
  double shared_params_ = 0;  // the shared expert on one rank
  double router_params_ = 0;
};

// Seconds for `tokens` activations of `hidden` elements to cross `link`, plus `overhead_s`.
double HopSeconds(int64_t tokens, int64_t hidden, int64_t activation_bytes, const LinkProfile& link,
                  double overhead_s);

}  // namespace shardserve::sim

#endif  // SHARDSERVE_COORDINATOR_SIM_COST_MODEL_H_

// The placement planner: a pure function from (model shape, worker inventory, policy) to a Plan
// (common/plan/plan.h) or an error. No I/O, no gRPC, no clocks: the same input always gives the
// same output, whatever the order of `workers`. Used by the coordinator when workers join or
// leave, and by `shardserve plan` to print a plan without starting anything.
//
// ---- What a stage holds ------------------------------------------------------------------------
// The memory model (common/plan/memory_model.h) says, for one rank of a stage: the bytes of its
// layers' weights (split or replicated as the engine lays them out), its local experts, the
// embedding on the first stage, the final norm and lm_head on the last, and its KV cache per
// token. The planner counts with it and nothing else; the engine sizes its KV cache with it, and
// tests/worker/engine/memory_model_test.cc holds the plans' figures equal to what the engine
// allocates. The formats are the workers' (WorkerWeightFormats: CUDA formats when every worker
// runs on CUDA devices, else CPU formats, so that a mixed inventory is not under-counted), with
// policy.bytes_per_param (every weight matrix and embedding element) and
// policy.kv_bytes_per_element overriding them when set; policy.quantize = kInt8 counts int8
// matrices only when no worker runs on CUDA (CUDA backends do not take them). Parallelism follows
// ARCHITECTURE.md: tensor parallel (TP) inside a worker, pipeline parallel (PP) across workers,
// data-parallel replicas of whole pipelines. Predicted bytes are those of rank 0, the most loaded
// rank (it holds the row-parallel biases and, expert parallel, the most experts). For an f32
// checkpoint with tp = 1, pp = 1 the weights are exactly ModelSpec::NumParameters() x 4.
//
// ---- Devices --------------------------------------------------------------------------------
// A worker runs on its CUDA devices when it has any, else on its CPU devices, and hosts at most
// one stage (run several workers on a node to get several replicas there). A stage with tp ranks
// uses the tp devices with the most room (free_bytes - policy.reserve_bytes_per_device; ties: lower
// index); its capacity per rank is the smallest room among them.
//
// ---- What "auto" chooses ----------------------------------------------------------------------
//  - tp = 0: per worker, the largest tp <= its device count that ValidateTensorParallelSize
//    accepts (TP is cheap inside a node and gives the stage all of the node's memory).
//  - pp = 0: the fewest stages that fit: pp = 1, 2, ... up to min(eligible workers, layers).
//  - replicas = 0: for that pp, as many replicas as fit (at most workers / pp). Fewest stages
//    first means that when the model fits on one worker, two workers give two replicas (twice
//    the throughput, no stage hops) rather than one two-stage pipeline; a two-stage pipeline is
//    chosen only when no single worker can hold the model plus the KV of one sequence.
//  - which workers: the replicas x pp workers with the most capacity (tp x capacity per rank),
//    dealt to the replicas snake-wise (0, 1, .., R-1, R-1, .., 0, 0, ..) so that replicas get
//    similar capacity; inside a replica, stages are ordered by worker_id.
//  Replicas always have the same pp (tp may differ between heterogeneous workers).
//
// ---- Stage balance ---------------------------------------------------------------------------
// Layer ranges are contiguous and non-empty. Among the partitions in which every stage holds its
// weights plus the minimum KV (below), the planner picks the one with the smallest maximum stage
// cost, then the smallest sum of squared stage costs (so slack is spread evenly), where
//   cost(stage) = (0.5 x bytes(stage) / bytes(model) + 0.5 x flops(stage) / flops(model)) / tp
//   bytes: parameters a decode step reads, unsharded, all experts counted: the layers, and the
//          lm_head on the last stage; not the embedding, a lookup that reads one row per token;
//   flops: forward FLOPs per prompt token = 2 x active parameters: the whole dense layer, for a
//          MoE layer attention + router + top_k experts + shared expert; 0 for the embedding and
//          for the lm_head, which runs on one position per sequence.
// The cost is a time model: bytes for a memory-bound decode step, FLOPs for prefill, where a MoE
// layer costs only its top_k experts. What a stage holds (the embedding included) is the memory
// constraint above, not part of the cost. Dividing by tp models a stage with more ranks as
// proportionally faster and larger. Attention-score FLOPs, which grow with the context, are the
// same in every layer and are left out. So the last stage gets fewer layers (the lm_head's
// reads), the first stage is not penalised for its embedding unless memory binds, and a MoE layer
// counts for more than a dense one of the same width. Measured on the 100M model at 16 clients
// (32-token prompts, 32 output tokens): 7 + 5 layers keep both stages busy 0.85-0.9 of the time;
// 8 + 4 left the first stage the bottleneck (0.92 vs 0.69).
//
// ---- KV budget -------------------------------------------------------------------------------
// Minimum: every stage holds the KV of one sequence of max_seq_len tokens (or policy.kv_tokens
// when set). With policy.kv_tokens, every stage reserves exactly that many tokens. Otherwise a
// stage could hold floor(kv_fraction x (capacity - weights) / KV bytes per token) tokens, and every
// stage of a pipeline gets the pipeline's smallest such capacity (the others could not use more).
// Sliding windows are not taken into account (the engine keeps max_seq_len positions per sequence),
// nor are activation workspaces: leave room for them with policy.reserve_bytes_per_device.
//
// ---- Expert spill vs more stages ---------------------------------------------------------------
// A remote expert costs a gRPC round trip per MoE layer per step, a stage boundary one hop per
// step. So the planner first tries every pp (and replica count) with all experts local, and
// spills only when none fits: with a fixed pp too small for the model, or with workers too small
// to hold whole MoE layers but large enough to hold some experts. Spill (MoE models, with
// policy.allow_expert_spill) repeats the same search (pp ascending, replicas descending) where a
// stage must hold only its non-expert weights plus the minimum KV. Each stage then keeps as many
// experts as fit next to the minimum KV, filling its MoE layers in order: the spill is
// concentrated in its last MoE layers (a layer with any remote expert costs an expert call per
// step, while the bytes sent depend only on the total of remote experts). Inside a layer the
// lowest expert ids stay local, spread over the ranks as usual. So a spilling stage has about the
// minimum KV capacity: set policy.kv_tokens to trade local experts for KV. Spilled experts go to
// the workers that host no stage (a worker hosts a stage or experts, never both), each whole
// expert to the one device with the most room left (ties: lower worker_id, then device index),
// which balances the hosts.
//
// ---- Complexity --------------------------------------------------------------------------------
// The partition is a dynamic program over (stage, layer) with pruning, O(pp x layers^2) at worst
// per pipeline; the search tries at most min(workers, layers) values of pp and, for each, replica
// counts from the most that the total capacity allows downwards.
#ifndef SHARDSERVE_COORDINATOR_PLANNER_PLANNER_H_
#define SHARDSERVE_COORDINATOR_PLANNER_PLANNER_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_spec/model_spec.h"
#include "common/plan/plan.h"
#include "coordinator/planner/traffic.h"

namespace shardserve {

// Bytes per element of the weight matrices (unquantized) that the workers hold for `spec`'s
// checkpoint: WorkerWeightFormats(...).matrix_bytes (see "What a stage holds" above), what
// policy.bytes_per_param = 0 resolves to in PlanExplanation. Pure.
int64_t WeightBytesPerParam(const ModelSpec& spec, const std::vector<WorkerInventory>& workers);
// Bytes per KV cache element the workers keep for `spec`'s checkpoint (what
// policy.kv_bytes_per_element = 0 resolves to): WorkerWeightFormats(...).kv_bytes, 2 for a
// bf16/f16 checkpoint when every worker runs on CUDA devices (the engine keeps the cache in that
// dtype there), else 4; 1 for kv_cache kFp8E4M3. Pure.
int64_t KvBytesPerElement(const ModelSpec& spec, const std::vector<WorkerInventory>& workers,
                          KvCacheFormat kv_cache = KvCacheFormat::kAuto);

// Computes a placement of `spec` on `workers` under `policy`, as described above.
//
// Errors:
//  - InvalidArgument, naming the field and why: an inconsistent ModelSpec; a policy field out of
//    range (negative tp/pp/replicas, kv_fraction outside (0, 1], kv_tokens below max_seq_len,
//    max_seq_len above max_position_embeddings, bytes_per_param outside [0, 8], ...); a policy.tp
//    the model cannot be split by (e.g. "does not divide num_attention_heads (4)") or that no
//    worker has enough devices for; policy.pp above num_hidden_layers or above the workers that
//    can host a stage; policy.replicas x pp above those workers; an inventory with an empty or
//    duplicate worker_id, a duplicate device, or free_bytes outside [0, total_bytes].
//  - FailedPrecondition: no worker has any device (wait for workers to register).
//  - ResourceExhausted: no layout fits; the message states the bytes the model needs (weights +
//    the minimum KV) and the bytes the workers have free in total, e.g. "model needs 620.3 MB
//    (536.4 MB weights + 83.9 MB for the KV of 1 sequence of 1024 tokens at kv_fraction 0.9),
//    workers have 300.0 MB free in total"; when the total would be enough, it adds which pp were
//    tried and what the largest worker offers.
// Pure and thread-safe.
absl::StatusOr<Plan> MakePlan(const ModelSpec& spec, const std::vector<WorkerInventory>& workers,
                              const PlanPolicy& policy);

// ---- Why this plan: the search as data (`shardserve plan --explain`) ----------------------------
// ExplainPlan runs the same search as MakePlan, through the same code, and records every layout it
// evaluated, in the order it evaluated them, with the per-rank figures that decided it. The first
// layout that fits is the plan, so the explanation cannot disagree with MakePlan.

// One stage of an evaluated layout, as rank 0 (the most loaded rank) would hold it.
struct StageEvaluation {
  int replica = 0;
  std::string worker_id;
  int tp = 1;
  int64_t layer_begin = 0;  // [layer_begin, layer_end)
  int64_t layer_end = 0;
  bool has_embedding = false;
  bool has_lm_head = false;
  // Weight bytes per rank: the layers' weights (their routed experts too unless the layout spills
  // experts: then the experts the stage keeps, or none for a stage that did not fit), plus the
  // embedding on the first stage and the final norm + lm_head on the last.
  int64_t weight_bytes_per_rank = 0;
  // The KV the planner requires per rank: one sequence of max_seq_len tokens (or policy.kv_tokens),
  // divided by kv_fraction when kv_tokens is 0 (the planner gives KV only that fraction of the room).
  int64_t min_kv_bytes_per_rank = 0;
  int64_t min_kv_tokens = 0;
  // KV capacity: tokens and bytes per rank. For the chosen layout, the pipeline's (every stage gets
  // its tightest stage's capacity, as in the plan); for a stage that did not fit, its own.
  int64_t kv_tokens = 0;
  int64_t kv_bytes_per_rank = 0;
  // Device memory the planner counts per rank: the smallest free_bytes - reserve_bytes_per_device
  // among the stage's devices. Activations and workspaces are not counted except through the reserve.
  int64_t room_per_rank = 0;
  bool fits = false;  // weight_bytes_per_rank + the minimum KV fit in room_per_rank
  // MoE, chosen layout: (layer, expert) pairs of its layers kept on the stage, and placed on other
  // workers (expert spill). 0 and 0 otherwise.
  int64_t local_experts = 0;
  int64_t remote_experts = 0;
};

enum class LayoutVerdict {
  kChosen,          // the first layout in search order that fits: the plan
  kTooLittleMemory, // skipped without partitioning: the workers it would use have less memory in
                    // total than `replicas` copies of the model (tp = 1, nothing replicated) + min KV
  kNoPartitionFits, // no split of the layers into pp contiguous stages fits one of its pipelines
  kNoExpertRoom,    // expert spill: the experts the stages cannot hold do not fit on the other workers
};
const char* LayoutVerdictName(LayoutVerdict v);

// One layout (pp stages x replicas, tp per worker) that the search evaluated.
struct LayoutEvaluation {
  bool expert_spill = false;
  int pp = 1;
  int replicas = 1;
  // kTooLittleMemory entries of consecutive replica counts are merged: replicas_hi..replicas.
  int replicas_hi = 1;
  int tp_min = 1;  // tp of the workers the layout would use (they differ on mixed inventories)
  int tp_max = 1;
  LayoutVerdict verdict = LayoutVerdict::kChosen;
  std::string reason;  // plain words with numbers, e.g. "worker \"a\" (tp=1): 140.2 GB of weights per rank > 80.0 GB"
  // kTooLittleMemory (for replicas_hi): bytes needed vs what the largest replicas x pp workers have.
  int64_t needed_bytes = 0;
  int64_t available_bytes = 0;
  // kChosen: every stage of every replica. kNoPartitionFits: the pipeline that failed, its stages
  // each holding as many layers as fit, up to the first stage that cannot (fits = false).
  std::vector<StageEvaluation> stages;
};

struct PlanExplanation {
  // The policy as the search resolved it.
  int64_t bytes_per_param = 0;
  int64_t kv_bytes_per_element = 0;
  int64_t max_seq_len = 0;
  int64_t min_kv_tokens = 0;  // KV every stage must hold (max_seq_len, or policy.kv_tokens)
  double kv_fraction = 0.0;   // 0 when policy.kv_tokens is set
  int64_t reserve_bytes_per_device = 0;
  bool int8 = false;
  bool tp_auto = true, pp_auto = true, replicas_auto = true;
  int64_t model_weight_bytes = 0;  // the whole model on one rank (tp = 1)
  int eligible_workers = 0;        // workers that can host a stage
  // The search order, in words: how the planner ranks layouts (it takes the first that fits).
  std::string search_order;
  std::vector<LayoutEvaluation> layouts;  // in the order evaluated; the last is kChosen when plan is ok
  // What MakePlan returns for the same input (ok, or its error).
  absl::StatusOr<Plan> plan = absl::UnknownError("not planned");
  // When `plan` is ok: its per-token traffic and pipeline bubble, per replica (traffic.h).
  std::vector<PipelineTraffic> traffic;
};

// MakePlan's search, recorded. Returns InvalidArgument / FailedPrecondition as MakePlan does (bad
// spec, policy or inventory: nothing was searched); when the search ran, an explanation whose
// `plan` equals MakePlan's result, ResourceExhausted included. Pure and thread-safe.
absl::StatusOr<PlanExplanation> ExplainPlan(const ModelSpec& spec, const std::vector<WorkerInventory>& workers,
                                            const PlanPolicy& policy);

// The paged KV cache of a pipeline: blocks of `block_size` tokens, the same block ids on every
// stage, so its capacity is that of its tightest stage: floor(kv_tokens / block_size) blocks
// (kv_bytes_per_rank / the bytes of one block of the stage's layers on one rank), raised to the
// ceil(max_seq_len / block_size) blocks one whole sequence needs (the plan reserves at least
// max_seq_len tokens; rounding up to whole blocks may exceed it by less than one block). Capped
// at 2^31 - 1 (block ids are int32). InvalidArgument for block_size < 1, an empty pipeline or
// max_seq_len < 1. Pure.
absl::StatusOr<int64_t> PipelineKvBlocks(const Pipeline& pipeline, int64_t max_seq_len, int64_t block_size);

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_PLANNER_PLANNER_H_

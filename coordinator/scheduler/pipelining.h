// Pipelining policy: into how many micro-batches a replica splits its running sequences, chosen
// from a cost model of its stages rather than fixed to the number of stages.
//
// Why it matters. With P stages and one micro-batch in flight, each stage idles while the others
// work. Splitting the running set into k micro-batches lets the stages work at once, but each
// micro-batch reads every weight of every stage again: a decode step of b sequences costs a
// weight-read-bound stage about as much as one of b/k. So splitting pays when the stages can
// really work in parallel and a micro-batch's time grows with its size (prefill chunks, long
// contexts, compute-bound stages, stages on separate machines), and loses when the stages share
// one memory bus (CPU stages on one node) and are bound by weight reads: two micro-batches of 8
// then read the weights twice through the same bus for the tokens one micro-batch of 16 gives.
//
// The prediction (PredictRound). The running set's next step (each decoding sequence one token,
// each prefilling one its next chunk; StepWork) is dealt into k micro-batches the way the
// scheduler fills them: ceil(n / k) sequences each, decodes first, at most max_step_tokens tokens
// each. One round (every micro-batch through every stage once) then takes at least
//   - the busiest stage's work: sum over the micro-batches of its time for each;
//   - a micro-batch's latency: its time on every stage plus every hop (a micro-batch cannot
//     overtake itself), the mean over the micro-batches (a quick one goes round again while a
//     slow one, say with a long prefill chunk, is still in flight);
//   - per machine whose resources several stages share (CPU stages on one machine: its memory
//     bus, and its cores, which also run the hops, the coordinator and whatever else runs there),
//     summed over its stages and the micro-batches: their reads over the memory parallelism (how
//     much more the bus reads with all those stages reading than with one), and their arithmetic
//     over the compute parallelism (the hops between two of its stages count as its cores' work
//     too), the larger of the two (their sum on cores that do not overlap reads and arithmetic:
//     HostParallelism::overlap). Each op asks for both, whichever bounds it alone: an op that
//     a split turns from compute-bound to memory-bound still computes on the shared cores.
// With k = 1 that is simply the latency (the sum of the stages). The choice is the k in
// [1, max_micro_batches] with the most tokens per second, where a split other than the current
// one must win by kMinPipeliningGain: the model is approximate, and a change costs a pipeline
// flush (fewer micro-batches wait for those in flight) or fill, so a load near the break-even
// point must not make the split flap.
//
// Thread-safety: the functions are pure; a PipelineCostModel is immutable and its methods are
// const and thread-safe (the scheduler calls it under its lock from several threads). A
// PipeliningCache is not thread-safe.
#ifndef SHARDSERVE_COORDINATOR_SCHEDULER_PIPELINING_H_
#define SHARDSERVE_COORDINATOR_SCHEDULER_PIPELINING_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"

namespace shardserve::coordinator {

// One sequence's part of a micro-batch, as the cost model sees it.
struct StepWork {
  int64_t pos_begin = 0;  // tokens already in its KV cache
  int64_t tokens = 0;     // new tokens (a prefill chunk, or 1 to decode), >= 1
  bool sample = false;    // the last stage samples a token for it
};

// A stage's time for one micro-batch, in seconds, and what it asks of its machine: its reads
// (weights, KV cache) at the machine's bandwidth, and its arithmetic and fixed costs at its cores'
// rate, whichever of the two bounds each op. Both are <= total.
struct StageSeconds {
  double total = 0;
  double memory = 0;
  double compute = 0;
};

// How much faster the stages of one shared machine run all at once than one after the other, >= 1
// each (and at most the number of those stages).
struct HostParallelism {
  double memory = 1.0;   // memory-bound ops (weight and KV reads)
  double compute = 1.0;  // the others
  // Whether an op's reads overlap its arithmetic (the machine's bound is the larger of the two
  // sums) or add to it, as on CPU cores (their sum; StageSeconds::total is then reads plus
  // arithmetic too).
  bool overlap = true;
};

// The cost of one replica's pipeline. Implemented over the simulator's roofline by
// sim::PipelineCost (coordinator/sim/pipeline_cost.h); tests may fake it.
class PipelineCostModel {
 public:
  virtual ~PipelineCostModel() = default;
  // Stages of the pipeline, >= 1.
  virtual int num_stages() const = 0;
  // Time of stage `stage` (in [0, num_stages)) for one micro-batch of `work`.
  virtual StageSeconds Stage(int stage, absl::Span<const StepWork> work) const = 0;
  // Time for `tokens` tokens' activations to go from stage `stage` to the next one (after the last
  // stage: for the sampled ids to come back to the coordinator; `tokens` is then 0).
  virtual double Hop(int stage, int64_t tokens) const = 0;
  // Stages that share one machine's memory bus and cores (CPU stages on one machine) share a
  // group id >= 0; -1 = the stage has its own (a GPU, or the only stage on its machine).
  virtual int SharedGroup(int stage) const = 0;
  // For a shared group: how much faster its stages run all at once than one after the other.
  virtual HostParallelism Parallelism(int group) const = 0;
  // Where the stages run, for the explanation: e.g. "2 CPU stages on one machine".
  virtual std::string Describe() const = 0;
};

// Another split must predict at least this much more throughput than the current one to replace it.
inline constexpr double kMinPipeliningGain = 1.10;

// The predicted round of one split (see the file comment).
struct RoundPrediction {
  int32_t micro_batches = 1;
  int64_t tokens = 0;      // tokens the round processes (over its micro-batches)
  double seconds = 0;      // the round's duration
  bool host_bound = false;  // a machine shared by several stages sets the pace
  double TokensPerSecond() const { return seconds > 0 ? static_cast<double>(tokens) / seconds : 0; }
};

// `running`: every running sequence's next work, decodes (tokens == 1 after the prompt) before
// prefills, in the scheduler's order. micro_batches >= 1, max_step_tokens >= 1.
RoundPrediction PredictRound(const PipelineCostModel& model, absl::Span<const StepWork> running,
                             int32_t micro_batches, int64_t max_step_tokens);

struct PipeliningChoice {
  int32_t micro_batches = 1;    // chosen, in [1, max_micro_batches]
  int32_t max_micro_batches = 1;
  int64_t sequences = 0;         // running sequences it was chosen for
  double gain = 1.0;             // the chosen split's throughput over one micro-batch's (predicted)
  double best_split_gain = 1.0;  // with one chosen: the best split's throughput over one's
  bool weight_bound = false;     // one micro-batch's reads take longer than its arithmetic
  bool shared_host = false;      // some stages share a machine (SharedGroup)
};

// Chooses the split for `running` (as PredictRound takes it), given the `current` one (clamped to
// [1, max_micro_batches]). With no sequence, or max_micro_batches == 1, the answer is 1
// micro-batch.
PipeliningChoice ChooseMicroBatches(const PipelineCostModel& model, absl::Span<const StepWork> running,
                                    int32_t max_micro_batches, int64_t max_step_tokens, int32_t current = 1);

// Memo of ChooseMicroBatches for one cost model (a replica's), so that a build does not price every
// split again while the running set keeps its shape. The shape (Shape below) has the running
// set's decodes all at their mean context and every context rounded up to a bucket (within 1/8 of
// it, and at least 16 tokens): the price of a decode batch hardly moves as its contexts grow by a
// token per step, and how its sequences are dealt into micro-batches is the scheduler's order, not
// a property of the load (a cost linear in the contexts sees the same total either way). The
// choice is ChooseMicroBatches of that shape, taken from the memo when the shape, the limits and
// the current split were priced before.
//
// Thread-safety: not thread-safe (the scheduler keeps one per replica, under its lock).
class PipeliningCache {
 public:
  // `model` must outlive the cache. Keeps at most `capacity` (>= 1) choices; when full, it
  // forgets them all (running sets come back to recent shapes, rarely to old ones).
  explicit PipeliningCache(const PipelineCostModel* model, size_t capacity = 1024);

  // == ChooseMicroBatches(model, Shape(running), max_micro_batches, max_step_tokens, current).
  PipeliningChoice Choose(absl::Span<const StepWork> running, int32_t max_micro_batches, int64_t max_step_tokens,
                          int32_t current);

  // `running` (decodes, tokens == 1 with sample, first; then prefills, in order) with every decode
  // at the decodes' mean pos_begin, and each pos_begin rounded up to its bucket.
  static std::vector<StepWork> Shape(absl::Span<const StepWork> running);

  int64_t hits() const { return hits_; }
  int64_t misses() const { return misses_; }

 private:
  const PipelineCostModel* const model_;
  const size_t capacity_;
  // Key: max_micro_batches, max_step_tokens, current, the decodes and their context, then
  // (pos_begin, tokens, sample) per prefill.
  absl::flat_hash_map<std::vector<int64_t>, PipeliningChoice> choices_;
  int64_t hits_ = 0;
  int64_t misses_ = 0;
};

// One line for `shardserve status`, e.g. "1 micro-batch for 16 running sequences (2 CPU stages
// on one machine, stages sharing one machine's memory bus and cores: a split would read the
// weights again per micro-batch; split: 0.95x the throughput at best)". `where` is
// PipelineCostModel::Describe().
std::string DescribePipelining(const PipeliningChoice& choice, const std::string& where);

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_SCHEDULER_PIPELINING_H_

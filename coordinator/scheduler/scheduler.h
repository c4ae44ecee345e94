// Scheduler: admits generation requests, routes each to a data-parallel replica, and runs every
// replica's step loop — continuous batching with chunked prefill across the network, the same
// policy as the single-process engine (worker/engine/generator.h), so that a request gets exactly
// the tokens `shardserve-run` gives it (greedy or seeded sampling: the last stage samples with the
// request's SamplingOptions and sample_index = the token's index in the sequence's output).
//
// ---- Per replica -------------------------------------------------------------------------------
// Each replica has a paged KV cache of kv_blocks blocks of kv_block_size tokens (the same block ids
// on every stage: the scheduler allocates them from a BlockPool, the workers only index them).
// With prefix caching, full blocks stay cached after their sequences end, and an admitted
// sequence whose context starts with cached blocks takes them and prefills only the rest
// (block_pool.h); the cache gives its blocks up, least recently used first, when new ones are
// needed. A replica runs at most
// max_slots sequences at once, and keeps a FIFO of waiting sequences and the running ones. A
// running sequence holds the blocks covering the positions it has written so far, plus those of
// the micro-batch it is in. Its step loop (pipeline_depth threads per replica) repeats:
//   1. end the running sequences cancelled since the last step and free their blocks;
//   2. admit waiting sequences, in order, while fewer than max_slots run and the available blocks
//      (free or cached but unused) hold the first prefill chunk of the next one after its cached
//      prefix (which it gets at once) plus one block of headroom per running sequence (so that
//      admission does not at once cause a preemption);
//   3. build a micro-batch under max_step_tokens: first every decoding sequence (one token each,
//      least recently stepped first), then prefill chunks of the others in admission order, each
//      as long as the budget left allows; a chunk that reaches the end of its prompt, and every
//      decode, asks for a sampled token. Then, oldest admission first, each member gets the
//      blocks its new tokens need; when the free list runs short, the most recently admitted
//      running sequence that is not in flight is PREEMPTED (possibly the member itself, which then
//      leaves the micro-batch): its blocks are released (its full ones stay in the prefix cache
//      while nothing needs them), its context (prompt + generated tokens) is kept, and it goes
//      back to the FRONT of the waiting queue, to be recomputed as a prefill (after whatever
//      prefix is still cached) when admitted again. Sampling is seeded by (seed, sample_index =
//      tokens generated so far), so a preempted sequence's output does not change;
//   4. run it (ReplicaClient::Step, outside the lock);
//   5. cache the blocks the step filled; append the sampled tokens, stream them to the sinks
//      (queued: "Delivery" below), and
//      end the sequences that hit a stop condition, freeing their blocks: a stop id (the
//      request's stop_token_ids, plus the model's EOS ids unless ignore_eos) -> kStop; max_tokens
//      generated or the context (max_seq_len) full -> kLength. A failed step fails the sequences
//      that were in it with its status, except that when it failed with UNAVAILABLE (the
//      replica's pipeline broke: a worker died, a stream closed) and another replica can hold
//      them, they FAIL OVER: each moves to the front of that replica's waiting queue, keeping
//      the tokens it has delivered, and is recomputed there (at most kMaxFailovers times).
//      With no other replica (and SchedulerOptions::recovery_timeout > 0) they RECOVER instead
//      (below).
//
// ---- Delivery (asynchronous scheduling) ------------------------------------------------------
// The step loop does not make sink calls: step 5 queues them (tokens, logprobs, ends) in one
// scheduler-wide outbox, in the order it decides them, and goes straight on to steps 1-3 and the
// next ReplicaClient::Step, so that the time between a step's answer and the next step's send is
// only the scheduler's own bookkeeping under its lock (the constraint masks of structured output
// are computed in between, outside the lock). The step loop then makes the queued calls itself, in
// order, once the next step is sent and while it runs (ReplicaClient::StepOverlapping), so that no
// other thread wakes for them; when another thread is making calls at that moment, the loop leaves
// them to it, and it hands what is left to the delivery thread (kThreads). Every other method that decides sink calls (Cancel of a
// waiting sequence, RemoveReplica, Shutdown, Poll, BeginStep / EndStep) makes them before it
// returns, itself or by waiting for the thread delivering them. A step loop builds its next
// micro-batch only once the calls of its answer before last are made, so that what a sink does
// about them (the front end cancels a sequence whose text hit a stop string) takes effect at most
// one step late (one token more is computed, not streamed). One thread at a time delivers, in
// queue order, so one sequence's calls never overlap and keep their order (OnEnd last), even
// when it moved to another replica. The next step cannot be built before the answer: its input
// holds the tokens the answer samples.
//
// ---- Multi-step decoding ----------------------------------------------------------------------
// With SchedulerOptions::decode_steps_per_call = K > 1, or with 0 (auto) and K the replica's
// current choice (decode_steps.h: from the serving overhead per call and the compute per decode
// step its calls measure; 1 until some are timed, and whenever a step's compute dwarfs the
// overhead), a micro-batch asks its replica for k decode steps in one call
// (StepInput::decode_steps; the worker feeds each sampled id into the next step itself), which
// saves k - 1 round trips. A replica times the calls of its decode-only micro-batches (every
// member decoding one token): the call, plus the step loop's own work since the answer before
// when it did not sleep for work meanwhile, less StepOutput::compute_time (calls whose replica
// reports none are not counted, nor calls that overlapped another call of the replica: with
// pipeline_depth > 1 a call also waits for the other's compute). Only when that gives exactly the tokens of k single
// steps: the replica has one stage (ReplicaOptions::stages), the micro-batch has no prefill chunk,
// and no member needs anything computed per token: no penalties, logit_bias, structured output,
// logprobs, prompt logprobs owed, or min_tokens still suppressing stop ids. k is K capped by every
// member's remaining max_tokens and context (max_seq_len); the members' KV blocks for the k
// positions are taken after the usual one-step blocks, from blocks available without preempting
// anything (when they are too few, the batch runs one step); a sequence that ends early frees them
// with the rest of its blocks. The answer's k tokens of a sequence are applied in
// order exactly as k answers would be (stop ids, max_tokens, the context; usage), and those after
// the one that ended it are dropped as if never made; the sink gets a call's tokens in one
// OnTokens. A stop string the front end matches ends the sequence as with single steps, which may
// be up to k tokens later; the front end returns no text past the stop string.
//
// ---- Overlapped decode calls (asynchronous scheduling) ----------------------------------------
// A call's next micro-batch holds the tokens its answer samples, so a replica would idle for the
// round trip and the scheduler's work between two calls. With SchedulerOptions::
// overlap_decode_calls (default), on a replica with one stage and pipeline_depth 1 whose client
// takes them (ReplicaClient::OverlapsDecodeCalls: a worker announces it), the scheduler sends the
// NEXT call of a plain decode batch while the last one runs, and the replica takes each
// sequence's token from its own last sample (StepSequenceInput::from_previous). The replica then
// runs one more step loop, and:
//  - a call is continuable when every member is a plain decode (as multi-step decoding needs) and
//    it asks the replica to remember its samples (StepInput::remember_samples). It is the tail
//    while it is the last call built and in flight;
//  - a step loop builds the tail's continuation when only the tail is in flight, no waiting
//    sequence can be admitted, and every running sequence is in the tail (none would wait behind
//    the chain): the tail's members that are not cancelled and may still generate after the tail's
//    tokens, at positions consumed + the tail's steps, sample_index past the tail's tokens, with k
//    decode steps (the replica's choice, capped by what each may still generate) and the blocks for
//    them, taken without preempting anything (when too few are free, no continuation). The
//    continuation becomes the tail, so a steady decode keeps two calls in flight;
//  - calls are sent and applied in the order they were built (the replica runs them in that
//    order; each sequence is in at most two, the tail and its base);
//  - a continuation's tokens are applied to a sequence only when its base left it running on the
//    replica as it was: one that ended in the base (a stop id, max_tokens), was cancelled, failed
//    over or parked since, gets nothing from it (its row was computed and is dropped). Blocks the
//    continuation writes past the end of a sequence that ended are only written before any later
//    call can use them (calls run in order), and never hold cached prefixes (only blocks filled with
//    the sequence's own tokens are cached);
//  - a stop string the front end matches can be two calls late instead of one;
//  - the tuner ("Multi-step decoding") times a continuation from its base's answer to its own: what
//    the replica did not spend computing between the two is the overhead the overlap left
//    exposed, so k stays small where the overlap hides the round trip.
//
// ---- Recovery (one replica, no lost request) --------------------------------------------------
// With recovery_timeout > 0, a sequence whose pipeline broke (an UNAVAILABLE step, or its replica
// removed) and that no other replica can take is PARKED: it keeps its context and delivered
// tokens, holds no KV blocks, and waits, at most recovery_timeout since it last made progress (a
// token or a prompt chunk), for a replica to take it: one added by AddReplica (the worker came
// back or a spare took its stage) takes every parked sequence it can hold at once; a replica still
// listed (its stream broke, it may work again) is retried after a backoff (kRecoveryRetryMin,
// doubling to kRecoveryRetryMax). It is then recomputed like a failed-over one, so its output
// does not change. Past its recovery deadline it fails with UNAVAILABLE (naming the timeout and
// the failure). A request submitted while no replica serves, after one has served, is parked the
// same way instead of being refused. Cancelling a parked sequence ends it at once. Poll() applies
// deadlines and retries; with StepDriver::kThreads a scheduler thread calls it every 50 ms (with
// kCaller the caller does).
// Pipelining: a replica runs pipeline_depth step loops (threads) over the same state, so up to
// that many micro-batches are in flight at once, each of different sequences (a sequence stays
// "in flight" from the build of its micro-batch until its answer has been applied). The replica splits its running set into k
// micro-batches: k = pipeline_depth, or, with ReplicaOptions::pipeline_cost, the k in
// [1, pipeline_depth] its cost model predicts the most throughput for (ChooseMicroBatches,
// pipelining.h), chosen again at every build from the running set after admission (priced once
// per shape of the running set: PipeliningCache). A micro-batch
// is built only while fewer than k are in flight, and takes at most ceil(running / k) sequences,
// so the running set splits into k groups that take turns through the stages (k = 1: one
// micro-batch of every running sequence at a time; when k drops, the groups merge as their
// micro-batches come back).
// The batch builder skips sequences already in flight and never preempts them. The oldest running
// sequence is only ever preempted by itself, when every block not held by in-flight sequences is
// too few; every request fits the cache alone (checked at Submit), so the oldest sequence always
// finishes.
//
// ---- Priorities ----------------------------------------------------------------------------
// With SchedulingPolicy::kPriority each sequence ranks by (SequenceRequest::priority, arrival):
// a lower priority value is served first, and among equal values the earlier request. A replica's
// waiting queue is kept in that order (a new request, a preempted or failed-over sequence and an
// unparked one all take their place by rank rather than the back or the front), the prefill
// chunks of a micro-batch are taken in rank order, members get their blocks in rank order, and a
// preemption takes the lowest-ranked running sequence not in flight (the largest priority value,
// then the latest admitted). So the best-ranked running sequence is only ever preempted by
// itself, and always finishes. A waiting sequence never preempts a running one to be admitted:
// a request of a better rank jumps the queue, and runs as soon as a slot and blocks are free.
// With kFcfs (the default) everything is in arrival order, as the steps above say, and a request
// whose priority is not 0 is refused (InvalidArgument naming "priority"), as vLLM does.
//
// ---- Admission and routing ----------------------------------------------------------------------
// Submit validates the request (ValidateSequenceRequest), picks the least-loaded replica whose KV
// cache can hold the whole sequence (fewest (running + waiting) / max_slots; ties: lowest replica
// id) and queues the sequence there. At most max_queued sequences wait over all replicas (a
// preempted sequence waits again, but is never refused); beyond that Submit fails.
//
// ---- Ownership and threads ----------------------------------------------------------------------
// The scheduler owns its ReplicaClients, pipeline_depth threads per replica and, with kThreads,
// its delivery thread. Sinks are shared with the caller (the public API's stream reactors) and
// released after their OnEnd. Sink calls are made with no scheduler lock held (see SequenceSink),
// on the delivery thread or the thread of a call that decided them ("Delivery" above).
//
// ---- Who runs the step loops ------------------------------------------------------------------
// With StepDriver::kThreads (production) the loop above runs on pipeline_depth threads per replica
// that call ReplicaClient::Step. With StepDriver::kCaller the scheduler starts no threads: the
// caller runs each replica's loop by hand, BeginStep (steps 1-3) then EndStep (step 5) per
// micro-batch, at most pipeline_depth of them open per replica. Everything else (admission,
// batching, preemption, prefix caching, stop conditions, failover) is the same code. This is how a
// discrete-event simulation drives the real scheduler on virtual time (coordinator/sim): its
// clock is an injected Clock, and the order of events is the caller's, so runs are reproducible.
//
// Thread-safety: all public methods are thread-safe.
#ifndef SHARDSERVE_COORDINATOR_SCHEDULER_SCHEDULER_H_
#define SHARDSERVE_COORDINATOR_SCHEDULER_SCHEDULER_H_

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/concurrency/clock.h"
#include "common/concurrency/mutex.h"
#include "coordinator/scheduler/block_pool.h"
#include "coordinator/scheduler/decode_steps.h"
#include "coordinator/scheduler/pipelining.h"
#include "coordinator/scheduler/replica_client.h"
#include "coordinator/scheduler/scheduler_observer.h"
#include "coordinator/scheduler/sequence.h"

namespace shardserve::coordinator {

// Who runs the replicas' step loops (see "Who runs the step loops" above).
enum class StepDriver : uint8_t {
  kThreads,  // pipeline_depth threads per replica call ReplicaClient::Step
  kCaller,   // no threads; the caller calls BeginStep / EndStep
};

// Largest SchedulerOptions::decode_steps_per_call (a worker takes at most as many, stage.proto).
inline constexpr int32_t kMaxDecodeStepsPerCall = 64;
// SchedulerOptions::decode_steps_per_call that lets each replica choose (decode_steps.h).
inline constexpr int32_t kAutoDecodeStepsPerCall = 0;

// How each replica orders its waiting sequences, its prefill chunks and its preemptions
// ("Priorities" above).
enum class SchedulingPolicy : uint8_t {
  kFcfs,      // arrival order; every request's SequenceRequest::priority must be 0
  kPriority,  // SequenceRequest::priority first (lower first), arrival order among equals
};

// "fcfs" / "priority"; nullopt for anything else.
std::optional<SchedulingPolicy> ParseSchedulingPolicy(absl::string_view name);
absl::string_view SchedulingPolicyName(SchedulingPolicy policy);

struct SchedulerOptions {
  RequestLimits limits;               // vocab_size >= 1, max_seq_len >= 2
  int64_t max_step_tokens = 256;      // tokens per micro-batch over all sequences, >= 1
  int64_t max_queued = 1024;          // sequences waiting for a slot over all replicas, >= 0
  std::vector<int32_t> eos_token_ids;  // the model's EOS ids (stop unless ignore_eos)
  SchedulerObserver* observer = nullptr;  // borrowed, may be null; must outlive the scheduler
  const Clock* clock = nullptr;           // borrowed; null = RealClock
  StepDriver step_driver = StepDriver::kThreads;
  // How long a sequence whose pipeline broke waits for a replica to take it ("Recovery" above);
  // 0 = it fails at once when no other replica can take it. >= 0.
  absl::Duration recovery_timeout = absl::ZeroDuration();
  // Multi-step decoding ("Multi-step decoding" above): the most decode steps one micro-batch may
  // ask a replica for, in [1, kMaxDecodeStepsPerCall]; 1 = one step per call (off); 0 =
  // kAutoDecodeStepsPerCall: each replica chooses, in [1, kMaxAutoDecodeSteps], from what its
  // calls measure (decode_steps.h).
  int32_t decode_steps_per_call = kAutoDecodeStepsPerCall;
  // Overlapped decode calls ("Overlapped decode calls" above): a 1-stage replica with
  // pipeline_depth 1 whose client takes them gets the next call of a plain decode batch while the
  // last one runs. Only with StepDriver::kThreads.
  bool overlap_decode_calls = true;
  SchedulingPolicy policy = SchedulingPolicy::kFcfs;  // "Priorities" above
  // InvalidArgument naming the field when a value is out of range.
  absl::Status Validate() const;
};

struct ReplicaOptions {
  int32_t max_slots = 8;      // sequences running at once (a scheduling limit), >= 1
  // Micro-batches in flight at once, >= 1: with P pipeline stages, P lets every stage work on a
  // different micro-batch; 1 = one at a time. With pipeline_cost, the most micro-batches in flight.
  int32_t pipeline_depth = 1;
  // When set, each build chooses how many micro-batches (in [1, pipeline_depth]) the running set
  // splits into ("Pipelining" above); null = always pipeline_depth. Shared, immutable.
  std::shared_ptr<const PipelineCostModel> pipeline_cost;
  int64_t kv_blocks = 0;      // KV cache blocks of every stage (the replica's capacity), in [1, 2^31 - 1]
  int32_t kv_block_size = 16;  // tokens per block, >= 1
  // Keep full blocks after their sequences end and reuse them for later sequences with the same
  // prefix (block_pool.h).
  bool prefix_caching = true;
  // Pipeline stages of the replica (0 = not known). Multi-step decoding is only asked of a replica
  // with exactly one stage.
  int32_t stages = 0;
};

using SequenceId = uint64_t;

struct ReplicaStats {
  int replica = 0;
  int32_t max_slots = 0;
  int64_t running = 0;  // admitted (holding KV blocks, or about to)
  int64_t waiting = 0;  // queued for admission (new or preempted)
  uint64_t steps = 0;   // micro-batches run so far
  int64_t kv_blocks_used = 0;    // KV cache blocks held by its sequences
  int64_t kv_blocks_cached = 0;  // blocks whose contents are kept for prefix reuse (held or not)
  int64_t kv_blocks_total = 0;   // the replica's KV cache blocks (the same on every stage)
  bool draining = false;         // DrainReplica: takes no new work
  int32_t micro_batches = 1;     // the running set's current split ("Pipelining" above)
  std::string pipelining;        // how it is chosen, and why the current split (one line)
  int32_t decode_steps = 1;      // the most decode steps an eligible micro-batch asks for now
  std::string decode_steps_why;  // how they are chosen, and why this many (one line)
};

struct SchedulerStats {
  int64_t running = 0;
  int64_t waiting = 0;
  int64_t recovering = 0;  // parked, waiting for a replica to recover ("Recovery" above)
  SchedulingPolicy policy = SchedulingPolicy::kFcfs;  // SchedulerOptions::policy
  std::vector<ReplicaStats> replicas;  // by replica id
};

class Scheduler {
 public:
  // `options` must be valid (checked: a programmer error otherwise).
  explicit Scheduler(SchedulerOptions options);
  // Shutdown(Unavailable("shutting down")) when not shut down yet.
  ~Scheduler();

  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Starts serving on a replica: takes ownership of `client` and starts its step loops (none with
  // StepDriver::kCaller, where `client` may be null: it is only ever Shutdown).
  // AlreadyExists for a replica id in use; InvalidArgument for max_slots < 1, pipeline_depth < 1,
  // kv_blocks or kv_block_size out of range, or a null client with kThreads; FailedPrecondition
  // after Shutdown.
  absl::Status AddReplica(int replica, std::unique_ptr<ReplicaClient> client, const ReplicaOptions& options);

  // Stops serving on a replica (its worker failed or died): interrupts its step in flight
  // (ReplicaClient::Shutdown), waits for its loop to stop, and moves its sequences to the other
  // replicas whose KV cache can hold them: running ones fail over (to the front of a waiting
  // queue, keeping the tokens they have delivered, to be recomputed), waiting ones join the back.
  // Sequences no other replica can take park when recovery is on ("Recovery" above) and fail
  // with `reason` (which must not be OK) otherwise; cancelled ones end as cancelled. Returns once done; a no-op for an unknown replica or one already being
  // removed. Must not be called from a sink.
  void RemoveReplica(int replica, const absl::Status& reason);

  // Drain: stops routing work to `replica` (new requests, and sequences failing over or parked,
  // go to other replicas, or park when none serves), while its own running and waiting sequences
  // go on to their end. The caller removes it (RemoveReplica) once it is empty, or at a deadline.
  // A no-op for an unknown replica or one being removed.
  void DrainReplica(int replica);

  // Ids of the replicas serving now (draining ones included), ascending.
  std::vector<int> Replicas() const;

  // Queues a request; `sink` (non-null) then receives its output. Errors (the sink is then never
  // called): InvalidArgument from ValidateSequenceRequest or ReplayResumed, or when the resumed
  // tokens already end the request (the front end answers those itself), or when prompt +
  // max_tokens needs more KV blocks than any serving replica has (the message gives both
  // numbers); Unavailable when no
  // replica is serving (unless recovery parks it: "Recovery" above) or after Shutdown (with its
  // reason); ResourceExhausted when max_queued
  // sequences are already waiting (the message gives the limit). Refusals are reported to the
  // observer.
  // A request with resumed tokens (SequenceRequest::resumed) starts the way a preempted sequence
  // that had generated them is recomputed, so its output goes on exactly as the uninterrupted
  // run's would; it reports no prompt logprobs (they went out with the first attempt's tokens).
  absl::StatusOr<SequenceId> Submit(SequenceRequest request, std::shared_ptr<SequenceSink> sink);

  // Ends a sequence with `reason` (kCancelled: the client went away; kStop: the front end matched
  // one of the request's stop strings): at once when it is waiting (its OnEnd is made before
  // Cancel returns, unless Cancel is called from a sink call, which it then follows), otherwise at the end of its step in flight or before the next one (on its
  // replica's thread), freeing its KV blocks; no tokens are delivered after the cancel is seen. A
  // preempted sequence waits, so it ends at once. A no-op for a finished or unknown id. Must not
  // be called with a lock the sink takes.
  void Cancel(SequenceId id, FinishReason reason = FinishReason::kCancelled);

  // Stops everything: no more requests; every waiting and running sequence fails with `reason`
  // (not OK; the API uses Unavailable "shutting down"); step loops stop (steps in flight are
  // interrupted) and are joined. Idempotent. Must not be called from a sink.
  void Shutdown(const absl::Status& reason);

  // ---- StepDriver::kCaller only (FailedPrecondition / nullopt / no-op with kThreads) ----------
  // Builds the next micro-batch of `replica` as one pass of its step loop would now (steps 1-3:
  // ends its cancelled sequences, admits waiting ones, builds a batch of at most
  // ceil(running / pipeline_depth) sequences), when fewer than pipeline_depth of its micro-batches
  // are open (begun and not ended) and it has work. nullopt when it has none, when pipeline_depth
  // are open, or for an unknown or removed replica. The sink calls of ended sequences are made on
  // the calling thread. The caller runs the batch and reports its answer with EndStep.
  std::optional<StepInput> BeginStep(int replica);
  // Applies the answer to the open micro-batch `step_id` of `replica` as the step loop does after
  // ReplicaClient::Step returns (step 5: tokens, stop conditions, failover of its sequences when
  // `out` is Unavailable); `took` is what the observer reports as its duration. Sink calls are
  // made on the calling thread. A no-op for an unknown replica or step (e.g. the replica was
  // removed: RemoveReplica and Shutdown close its open micro-batches, whose answers are dropped).
  void EndStep(int replica, uint64_t step_id, const absl::StatusOr<StepOutput>& out, absl::Duration took);

  // Recovery: fails the parked sequences past their deadline and hands those due for a retry to
  // a serving replica. Called every 50 ms by a scheduler thread with kThreads; with kCaller, by
  // the caller. Sink calls are made on the calling thread.
  void Poll();

  SchedulerStats Stats() const;
  const SchedulerOptions& options() const { return options_; }

 private:
  struct Sequence;
  struct Replica;
  struct Event;  // a sink call to make after unlocking
  struct Batch;  // a micro-batch being run

  absl::StatusOr<SequenceId> SubmitImpl(SequenceRequest request, std::shared_ptr<SequenceSink> sink);
  void ReplicaLoop(Replica* replica);
  // Steps 1-3 of the loop: ends cancelled sequences, admits, builds the next micro-batch.
  Batch NextBatchLocked(Replica& r, std::vector<Event>& events) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Step 5: applies the answer (its sink calls into `events`), releases the batch, ends the
  // cancelled.
  void FinishLocked(Replica& r, const Batch& batch, const absl::StatusOr<StepOutput>& out, absl::Duration took,
                    std::vector<Event>& events) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // With kCaller: releases the replica's open micro-batches (RemoveReplica, Shutdown).
  void CloseOpenBatchesLocked(Replica& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether a build may make a micro-batch now: fewer than its split in flight, and a running
  // sequence not in flight or one to admit.
  bool HasWorkLocked(const Replica& r) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // With a cost model: chooses the split for the running set now (Replica::choice).
  void ChoosePipeliningLocked(Replica& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks the batch's sequences that are still live as no longer in flight in it (waking the
  // replica that now holds one that moved, when nothing else holds it).
  void ReleaseLocked(const Batch& batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EndCancelledLocked(Replica& r, std::vector<Event>& events) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AdmitLocked(Replica& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the front waiting sequence can be admitted now.
  bool CanAdmitLocked(const Replica& r) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether a sequence with `context` (all to be prefilled but the cached prefix `match`) could be
  // admitted now: a slot free, and blocks for its first chunk plus one per running sequence.
  bool FitsNowLocked(const Replica& r, absl::Span<const int32_t> context, absl::Span<const int32_t> match) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The cached blocks holding a prefix of `seq`'s context (a waiting sequence), refreshed when the
  // replica's cache changed since the last look.
  const std::vector<int32_t>& MatchLocked(const Replica& r, Sequence& seq) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Applies token out.token_ids[index] of the running sequence `s` (from `in`'s answer): appends
  // and queues it, then ends `s` on a stop or length. True when it ended `s` (which is then
  // destroyed). With `coalesce` (a later token of a multi-step answer, whose predecessor is the last
  // of `events` and carries no constraint or logprobs) it joins that event instead of a new one.
  bool ApplyTokenLocked(Replica& r, Sequence& s, const StepSequenceInput& in, const StepOutput& out, size_t index,
                        bool coalesce, std::vector<Event>& events) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `s` (running, its next token given) may decode several steps in one call, or be
  // continued by an overlapped call: it samples plainly and needs nothing computed per token.
  bool PlainDecodeLocked(const Sequence& s) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Overlapped decode calls: whether the next build makes the continuation of the replica's call
  // in flight (Replica::tail), and that continuation (empty when it cannot be made after all).
  bool CanContinueLocked(const Replica& r) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Batch BuildContinuationLocked(Replica& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The decode steps to ask of the micro-batch of `members` (their one-step blocks already taken):
  // the replica's steps per call (fixed or auto) capped as "Multi-step decoding" above says,
  // having given the members the blocks for them; 1 when multi-step decoding does not apply or
  // the blocks are not available.
  int32_t DecodeStepsLocked(Replica& r, absl::Span<Sequence* const> members) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives every member blocks up to `ahead` positions past its consumed tokens, when the free blocks
  // hold all of them without preempting anything; false (nothing taken) otherwise.
  bool GrowAllLocked(Replica& r, absl::Span<Sequence* const> members, int64_t ahead)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives `seq` blocks until they cover `tokens` positions; false (nothing taken) when too few are free.
  bool GrowLocked(Replica& r, Sequence& seq, int64_t tokens) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees a running sequence's blocks and puts it back at the front of the waiting queue.
  void PreemptLocked(Replica& r, Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues `seq` (waiting, counted by the caller in num_waiting_) on `to`: with kFcfs at the front
  // (`front`) or the back, with kPriority at its place by rank ("Priorities" above).
  void EnqueueLocked(Replica& to, Sequence& seq, bool front) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether waiting `a` is admitted before waiting `b` under kPriority: (priority, arrival).
  static bool WaitsBefore(const Sequence& a, const Sequence& b);
  // Whether running `a` keeps its blocks before running `b` (is served first, preempted last):
  // (priority, admission) under kPriority, admission under kFcfs.
  bool RunsBefore(const Sequence& a, const Sequence& b) const;
  // Takes `seq` off `from` (giving back its blocks when it runs; a waiting one must already be out
  // of `from`'s queue) and puts it at the front of `to`'s waiting queue with nothing cached, to be
  // recomputed from its context. `to` may be `from` (a preemption).
  void RequeueLocked(Replica& from, Sequence& seq, Replica& to) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // At most `max_sequences` sequences.
  Batch BuildBatchLocked(Replica& r, size_t max_sequences) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ApplyLocked(Replica& r, const Batch& batch, const absl::StatusOr<StepOutput>& out, absl::Duration took,
                   std::vector<Event>& events) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes `seq` (running or waiting) and queues its OnEnd.
  void EndLocked(Sequence& seq, SequenceEnd end, std::vector<Event>& events) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The least-loaded replica other than `exclude` that is not stopping nor draining and whose KV
  // cache holds a sequence of `tokens` positions; nullptr when none.
  Replica* PickReplicaLocked(int64_t tokens, const Replica* exclude = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves `seq` (running on `from`, or taken out of its waiting queue) to the front of the waiting
  // queue of another replica that can hold it, as if preempted: it keeps its context and tokens and
  // is recomputed there. False (nothing changed) when no other replica can take it.
  bool FailOverLocked(Replica& from, Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Recovery: takes `seq` (running on `from`, or already out of every queue) off its replica and
  // parks it until a replica takes it or its deadline passes. False (nothing changed) when
  // recovery is off or the scheduler is shutting down.
  bool ParkLocked(Replica* from, Sequence& seq, const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hands parked sequences to serving replicas that can hold them (all of them, or only those
  // whose retry time has come), oldest first.
  void UnparkLocked(bool all) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RecoveryLoop();
  // "Delivery" above. Appends `events` to the outbox (and empties `events`); with `wake`, wakes the
  // delivery thread to make their calls (without: the caller makes them, with DeliverHere).
  void QueueLocked(std::vector<Event>& events, bool wake = true) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A step loop, while its step runs: makes the outbox's calls on this thread, unless another
  // thread is making calls (which then leaves the rest to the delivery thread).
  void DeliverHere() ABSL_LOCKS_EXCLUDED(mu_);
  // Makes the sink calls of the outbox, in order, with mu_ released meanwhile.
  void DeliverOutboxLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Returns once the events queued so far are delivered (delivering them itself when no other
  // thread is); at once when called from a sink call of this scheduler.
  void Flush() ABSL_LOCKS_EXCLUDED(mu_);
  void DeliveryLoop() ABSL_LOCKS_EXCLUDED(mu_);
  static void Deliver(std::vector<Event>& events);

  // Times one sequence may fail over to another replica before a failed step fails it.
  static constexpr int kMaxFailovers = 3;
  // Backoff of a parked sequence's retries on a replica that is still listed.
  static constexpr absl::Duration kRecoveryRetryMin = absl::Milliseconds(100);
  static constexpr absl::Duration kRecoveryRetryMax = absl::Seconds(2);

  // Constant after construction.
  const SchedulerOptions options_;
  const Clock* const clock_;

  mutable Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status shutdown_reason_ ABSL_GUARDED_BY(mu_);
  SequenceId next_id_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t num_waiting_ ABSL_GUARDED_BY(mu_) = 0;  // over all replicas
  // Every live sequence (waiting or running). A sequence is erased exactly when its OnEnd is queued.
  absl::flat_hash_map<SequenceId, std::unique_ptr<Sequence>> sequences_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::unique_ptr<Replica>> replicas_ ABSL_GUARDED_BY(mu_);
  // Recovery: parked sequences, oldest first (they hold no replica and no KV blocks).
  std::deque<Sequence*> parked_ ABSL_GUARDED_BY(mu_);
  // The largest KV cache (in tokens) a replica has had: new requests park only when one fits.
  int64_t served_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  // Sink calls decided and not yet made, in the order they were decided ("Delivery" above).
  std::vector<Event> outbox_ ABSL_GUARDED_BY(mu_);
  bool delivering_ ABSL_GUARDED_BY(mu_) = false;        // a thread is making the outbox's calls
  uint64_t queued_events_ ABSL_GUARDED_BY(mu_) = 0;     // events ever queued
  uint64_t delivered_events_ ABSL_GUARDED_BY(mu_) = 0;  // of those, delivered
  bool stop_delivery_ ABSL_GUARDED_BY(mu_) = false;
  CondVar delivery_cv_;  // delivering_ or delivered_events_ changed
  // The delivery thread's: the outbox has calls no other thread will make, or stop_delivery_.
  CondVar deliverer_cv_;
  CondVar shutdown_cv_;  // shut_down_ was set (the recovery thread waits for it)
  std::thread recovery_thread_;  // with kThreads and recovery_timeout > 0
  std::thread delivery_thread_;  // with kThreads
};

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_SCHEDULER_SCHEDULER_H_

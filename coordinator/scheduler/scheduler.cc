#include "coordinator/scheduler/scheduler.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log/log.h"
#include "common/sampling/token_history.h"
#include "coordinator/scheduler/next_token.h"

namespace shardserve::coordinator {

// Invariants (under mu_):
//  - a Sequence is in sequences_ iff its OnEnd has not been queued;
//  - it is in exactly one of its replica's `waiting` (running == false) or `running` (true);
//  - a waiting sequence holds no KV blocks and has consumed == 0 unless it never ran;
//  - a replica's BlockPool holds one reference per block of each running sequence; a waiting
//    sequence holds none; a running sequence's blocks cover at least its `consumed` positions (and
//    those of its micro-batch while in flight), and its first `cached_blocks` blocks are cached
//    entries of the pool (its matched prefix and the full blocks it has committed since);
//  - a sequence in flight is never preempted or ended by another step;
//  - only the replica's own threads end a running sequence, except RemoveReplica / Shutdown, which
//    do so after those threads have been joined; a sequence is in_flight from the build of its
//    micro-batch until its answer has been applied, and only a sequence that is not in flight is
//    put in a micro-batch or ended by EndCancelledLocked;
//  - every sink call is queued in outbox_ under mu_ when it is decided, and the outbox is
//    delivered by one thread at a time (delivering_), in order. So the token and end events of
//    one sequence are delivered in order, never from two threads at once;
//  - batches_in_flight of a replica counts its micro-batches built and not yet finished (or closed).
struct Scheduler::Sequence {
  SequenceId id = 0;
  SequenceRequest request;
  std::shared_ptr<SequenceSink> sink;
  Replica* replica = nullptr;
  bool running = false;
  std::vector<int32_t> blocks;   // KV cache blocks, in position order (running only)
  int64_t cached_blocks = 0;     // leading `blocks` that are prefix-cache entries (running only)
  int32_t consumed = 0;          // tokens of `context` already in the KV cache
  int32_t cached_prompt_tokens = -1;  // prompt tokens found cached at the first admission (-1: not yet)
  // The last BlockPool::Match of a waiting sequence's context, and the pool epoch it was made at
  // (none: not matched since it last waited).
  std::vector<int32_t> match;
  std::optional<uint64_t> match_epoch;
  std::vector<int32_t> context;  // prompt followed by the generated tokens
  TokenHistory history;          // with a penalty: the tokens it reads (the context, counted)
  // With prompt_logprobs: the next prompt position whose logprob is still owed (1 = none sent).
  int32_t prompt_logprobs_next = 1;
  int32_t generated = 0;
  int32_t constraint_state = 0;  // with request.constraint: its state after the generated tokens
  bool cancelled = false;
  FinishReason cancel_reason = FinishReason::kCancelled;  // with cancelled
  // The micro-batches in flight that it is in: 1, or 2 with an overlapped decode call.
  int32_t in_flight = 0;
  // Bumped whenever it leaves its replica's running set other than by ending (failover, park,
  // preemption): an overlapped call built before then no longer applies to it.
  uint32_t placement = 0;
  int failovers = 0;       // times moved to another replica after its own failed
  // Recovery (parked: replica == nullptr, in parked_): when it fails unless a replica takes it
  // (set when it parks, cleared when it makes progress), when it may be retried on a replica still
  // listed, the retries so far, and why it parked.
  std::optional<absl::Time> recovery_deadline;
  absl::Time retry_at;
  int retries = 0;
  absl::Status park_reason;
  uint64_t last_step = 0;  // the replica step that last included it (0 = none)
  uint64_t admitted = 0;   // admission order on its replica
  absl::Time submitted;
  std::optional<absl::Time> first_admitted;
  std::optional<absl::Time> first_token;
  absl::Time last_token;
};

struct Scheduler::Batch {
  StepInput input;
  std::vector<SequenceId> members;  // per input sequence
  // The step loop's own time between the answer before and this batch's call (applying it,
  // building this one), when it did not sleep for work meanwhile; zero otherwise and with kCaller.
  absl::Duration lead = absl::ZeroDuration();
  // Replica::calls_started when it was built, and whether another of the replica's calls was in
  // flight then: a call that overlapped another (pipeline_depth > 1) waited for the other's compute,
  // which is not serving overhead, so multi-step decoding does not time it.
  uint64_t call = 0;
  bool overlapped = false;
  // Overlapped decode calls: the call this one continues (0: none), each member's placement when
  // it was built, and when its answer came back (kThreads).
  uint64_t base_call = 0;
  std::vector<uint32_t> placements;
  absl::Time answered;
};

struct Scheduler::Replica {
  int id = 0;
  int32_t max_slots = 0;
  int64_t kv_blocks = 0;
  int64_t block_size = 0;
  std::unique_ptr<ReplicaClient> client;  // set at creation; used without the lock
  std::unique_ptr<BlockPool> pool;        // the KV cache blocks
  std::unique_ptr<DecodeStepsTuner> decode_steps;  // its decode steps per call ("Multi-step decoding")
  std::deque<Sequence*> waiting;
  std::vector<Sequence*> running;  // admission order
  int32_t depth = 1;  // step loops (micro-batches in flight at once, at most)
  int32_t stages = 0;  // ReplicaOptions::stages
  std::shared_ptr<const PipelineCostModel> cost;  // null: the split is always `depth`
  PipeliningChoice choice;                        // with `cost`: the last one
  std::unique_ptr<PipeliningCache> pipelining_cache;  // with `cost`: its choices by the running set's shape
  int32_t micro_batches = 1;     // the split now (`depth` without a cost model)
  int32_t batches_in_flight = 0;  // built and not yet finished (or closed)
  uint64_t calls_started = 0;     // micro-batches built so far (Batch::call)
  // Overlapped decode calls ("Overlapped decode calls" in scheduler.h): on for a 1-stage replica
  // with one micro-batch at a time (it then runs one more step loop), with kThreads and the option.
  // Its calls are sent and applied in the order they were built (calls_sent, calls_applied; the
  // loops wait on `order`). `tail` is the last call built when it may be continued: a plain decode
  // call still in flight, its decode steps and its members.
  bool overlap = false;
  struct Tail {
    uint64_t call = 0;
    int32_t steps = 1;
    std::vector<SequenceId> members;
    bool continued = false;  // a continuation was tried
  };
  std::optional<Tail> tail;
  uint64_t calls_sent = 0;
  uint64_t calls_applied = 0;
  CondVar order;
  // The last call answered and when (the tuner times an overlapped call from its base's answer).
  uint64_t last_answered_call = 0;
  absl::Time last_answered;
  bool stopping = false;
  bool draining = false;      // DrainReplica: no new work is routed here
  uint64_t steps = 0;         // micro-batches answered
  uint64_t last_step_id = 0;  // of the last micro-batch built
  uint64_t next_admitted = 1;
  std::vector<std::thread> threads;
  // Its step loops wait here for work (HasWorkLocked) or `stopping`: signalled (under mu_) when a
  // sequence joins `waiting`, when `stopping` is set, and, with several loops, when a micro-batch
  // finishes or the split grows.
  CondVar work;
  // StepDriver::kCaller: the micro-batches begun and not yet ended, by step id.
  std::map<uint64_t, Batch> open;
};

struct Scheduler::Event {
  std::shared_ptr<SequenceSink> sink;
  std::vector<TokenLogprobs> prompt_logprobs;  // delivered before the tokens
  std::vector<int32_t> tokens;
  std::vector<TokenLogprobs> logprobs;  // empty, or one per token
  std::optional<SequenceEnd> end;
  // Structured output: the sequence's new constraint state, whose mask Deliver computes (if not
  // cached yet) outside the lock, so that the next batch finds it ready.
  std::shared_ptr<const TokenConstraint> constraint;
  int32_t constraint_state = -1;
};


namespace {

// The scheduler whose events this thread is delivering (a sink call is running), if any.
thread_local const Scheduler* t_delivering = nullptr;

int64_t BlocksFor(int64_t tokens, int64_t block_size) { return (tokens + block_size - 1) / block_size; }

// Whether a sequence still owes prompt logprobs (it must then compute those positions, not take
// them from the prefix cache).
bool OwesPromptLogprobs(const SequenceRequest& r, int32_t next) {
  return r.prompt_logprobs && next < static_cast<int32_t>(r.prompt.size());
}

// Positions a request writes to the KV cache at most: every token but the last one generated.
int64_t MaxCachedTokens(const SequenceRequest& r) {
  return static_cast<int64_t>(r.prompt.size()) + r.max_tokens - 1;
}

}  // namespace

std::optional<SchedulingPolicy> ParseSchedulingPolicy(absl::string_view name) {
  if (name == "fcfs") return SchedulingPolicy::kFcfs;
  if (name == "priority") return SchedulingPolicy::kPriority;
  return std::nullopt;
}

absl::string_view SchedulingPolicyName(SchedulingPolicy policy) {
  return policy == SchedulingPolicy::kPriority ? "priority" : "fcfs";
}

absl::Status SchedulerOptions::Validate() const {
  if (limits.vocab_size < 1) return absl::InvalidArgumentError("vocab_size must be >= 1");
  if (limits.max_seq_len < 2) {
    return absl::InvalidArgumentError(absl::StrCat("max_seq_len must be >= 2, got ", limits.max_seq_len));
  }
  if (max_step_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_step_tokens must be >= 1, got ", max_step_tokens));
  }
  if (max_queued < 0) return absl::InvalidArgumentError(absl::StrCat("max_queued must be >= 0, got ", max_queued));
  if (decode_steps_per_call < 0 || decode_steps_per_call > kMaxDecodeStepsPerCall) {
    return absl::InvalidArgumentError(absl::StrCat("decode_steps_per_call must be in [0, ", kMaxDecodeStepsPerCall,
                                                   "] (0 = auto), got ", decode_steps_per_call));
  }
  if (recovery_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("recovery_timeout must be >= 0, got ", absl::FormatDuration(recovery_timeout)));
  }
  return absl::OkStatus();
}

Scheduler::Scheduler(SchedulerOptions options)
    : options_(std::move(options)), clock_(options_.clock != nullptr ? options_.clock : RealClock::Get()) {
  CHECK(options_.Validate().ok()) << options_.Validate();
  if (options_.step_driver == StepDriver::kThreads) delivery_thread_ = std::thread([this] { DeliveryLoop(); });
  if (options_.step_driver == StepDriver::kThreads && options_.recovery_timeout > absl::ZeroDuration()) {
    recovery_thread_ = std::thread([this] { RecoveryLoop(); });
  }
}

absl::StatusOr<SequenceId> Scheduler::Submit(SequenceRequest request, std::shared_ptr<SequenceSink> sink) {
  // The first mask of a constrained sequence, computed here rather than under the lock.
  if (request.constraint != nullptr) (void)request.constraint->AllowedMask(request.constraint->StartState());
  absl::StatusOr<SequenceId> id = SubmitImpl(std::move(request), std::move(sink));
  if (!id.ok() && options_.observer != nullptr) options_.observer->OnRejected(id.status());
  return id;
}

Scheduler::~Scheduler() { Shutdown(absl::UnavailableError("shutting down")); }

absl::Status Scheduler::AddReplica(int replica, std::unique_ptr<ReplicaClient> client, const ReplicaOptions& options) {
  if (client == nullptr && options_.step_driver == StepDriver::kThreads) {
    return absl::InvalidArgumentError("replica client is null");
  }
  if (options.max_slots < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_slots must be >= 1, got ", options.max_slots));
  }
  if (options.pipeline_depth < 1) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline_depth must be >= 1, got ", options.pipeline_depth));
  }
  if (options.kv_blocks < 1 || options.kv_blocks > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("kv_blocks must be in [1, 2^31 - 1], got ", options.kv_blocks));
  }
  if (options.kv_block_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("kv_block_size must be >= 1, got ", options.kv_block_size));
  }
  MutexLock lock(&mu_);
  if (shut_down_) return absl::FailedPreconditionError("the scheduler is shut down");
  if (replicas_.contains(replica)) {
    return absl::AlreadyExistsError(absl::StrCat("replica ", replica, " is already serving"));
  }
  auto r = std::make_unique<Replica>();
  r->id = replica;
  r->max_slots = options.max_slots;
  r->kv_blocks = options.kv_blocks;
  r->block_size = options.kv_block_size;
  r->client = std::move(client);
  r->depth = options.pipeline_depth;
  r->stages = options.stages;
  r->cost = options.pipeline_cost;
  if (r->cost != nullptr) r->pipelining_cache = std::make_unique<PipeliningCache>(r->cost.get());
  r->micro_batches = r->cost != nullptr ? 1 : r->depth;
  r->choice.max_micro_batches = r->depth;
  r->pool = std::make_unique<BlockPool>(options.kv_blocks, options.kv_block_size, options.prefix_caching);
  r->decode_steps = std::make_unique<DecodeStepsTuner>(options_.decode_steps_per_call);
  Replica* raw = r.get();
  replicas_.emplace(replica, std::move(r));
  served_tokens_ = std::max(served_tokens_, options.kv_blocks * options.kv_block_size);
  UnparkLocked(/*all=*/true);  // a replica came (back): parked sequences need not wait for a retry
  raw->overlap = options_.overlap_decode_calls && options_.step_driver == StepDriver::kThreads &&
                 options.stages == 1 && options.pipeline_depth == 1;
  if (options_.step_driver == StepDriver::kThreads) {
    const int32_t loops = options.pipeline_depth + (raw->overlap ? 1 : 0);
    for (int32_t t = 0; t < loops; ++t) raw->threads.emplace_back([this, raw] { ReplicaLoop(raw); });
  }
  LOG(INFO) << "scheduler: replica " << replica << " serving with " << options.kv_blocks << " KV blocks of "
            << options.kv_block_size << " tokens, at most " << options.max_slots << " sequences at once, "
            << options.pipeline_depth << " micro-batch(es) in flight, prefix caching "
            << (options.prefix_caching ? "on" : "off") << (raw->overlap ? ", overlapped decode calls" : "")
            << ", scheduling " << SchedulingPolicyName(options_.policy);
  return absl::OkStatus();
}

std::vector<int> Scheduler::Replicas() const {
  MutexLock lock(&mu_);
  std::vector<int> out;
  for (const auto& [id, r] : replicas_) {
    if (!r->stopping) out.push_back(id);
  }
  return out;
}

void Scheduler::DrainReplica(int replica) {
  MutexLock lock(&mu_);
  auto it = replicas_.find(replica);
  if (it == replicas_.end() || it->second->stopping || it->second->draining) return;
  it->second->draining = true;
  LOG(INFO) << "scheduler: draining replica " << replica << " (" << it->second->running.size() << " running, "
            << it->second->waiting.size() << " waiting)";
}

Scheduler::Replica* Scheduler::PickReplicaLocked(int64_t tokens, const Replica* exclude) {
  Replica* best = nullptr;
  for (auto& [id, r] : replicas_) {
    if (r.get() == exclude || r->stopping || r->draining || BlocksFor(tokens, r->block_size) > r->kv_blocks) continue;
    if (best == nullptr) {
      best = r.get();
      continue;
    }
    // load(r) < load(best), as fractions of max_slots, without division.
    const int64_t load_r = static_cast<int64_t>(r->running.size() + r->waiting.size());
    const int64_t load_b = static_cast<int64_t>(best->running.size() + best->waiting.size());
    if (load_r * best->max_slots < load_b * r->max_slots) best = r.get();
  }
  return best;
}

absl::StatusOr<SequenceId> Scheduler::SubmitImpl(SequenceRequest request, std::shared_ptr<SequenceSink> sink) {
  if (sink == nullptr) return absl::InvalidArgumentError("sink is null");
  if (absl::Status st = ValidateSequenceRequest(request, options_.limits); !st.ok()) return st;
  if (request.priority != 0 && options_.policy != SchedulingPolicy::kPriority) {
    return InvalidRequestField("priority", absl::StrCat("priority is ", request.priority,
                                                        ", but this coordinator serves requests first come, first "
                                                        "served (--scheduling_policy=fcfs): leave priority at 0, or "
                                                        "start it with --scheduling_policy=priority"));
  }
  absl::StatusOr<ResumedState> resumed = ReplayResumed(request, options_.eos_token_ids, options_.limits);
  if (!resumed.ok()) return resumed.status();
  if (resumed->ended.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat("resume.token_ids already end the request (",
                                                   FinishReasonName(*resumed->ended), "); nothing is left to generate"));
  }
  // The prompt's logprobs went out before the first token, in the attempt that delivered it.
  if (!request.resumed.empty()) request.prompt_logprobs = false;
  MutexLock lock(&mu_);
  if (shut_down_) return absl::UnavailableError(shutdown_reason_.message());
  const int64_t tokens = MaxCachedTokens(request);
  Replica* r = PickReplicaLocked(tokens);
  bool park = false;
  if (r == nullptr && options_.recovery_timeout > absl::ZeroDuration() && tokens <= served_tokens_) {
    // Recovery: no replica serves now, one did and could hold it; wait for one to come back.
    park = std::none_of(replicas_.begin(), replicas_.end(),
                        [](const auto& e) { return !e.second->stopping && !e.second->draining; });
    if (park && num_waiting_ + std::ssize(parked_) >= options_.max_queued) {
      return absl::ResourceExhaustedError(absl::StrCat("the waiting queue is full: ", num_waiting_ + std::ssize(parked_),
                                                       " requests are waiting (max_queued = ", options_.max_queued,
                                                       ") while no replica serves; retry later"));
    }
  }
  if (r == nullptr && !park) {
    // Either nothing serves, or no serving replica's KV cache can hold this sequence.
    const Replica* largest = nullptr;
    for (const auto& [id, rep] : replicas_) {
      if (!rep->stopping && !rep->draining && (largest == nullptr || rep->kv_blocks * rep->block_size >
                                                       largest->kv_blocks * largest->block_size)) {
        largest = rep.get();
      }
    }
    if (largest == nullptr) return absl::UnavailableError("no replica is serving");
    return absl::InvalidArgumentError(absl::StrCat(
        "the prompt (", request.prompt.size(), " tokens) and max_tokens (", request.max_tokens, ") need ",
        BlocksFor(tokens, largest->block_size), " KV cache blocks of ", largest->block_size,
        " tokens; the largest replica has ", largest->kv_blocks, " blocks; lower max_tokens or shorten the prompt"));
  }
  if (!park && num_waiting_ >= options_.max_queued) {
    // A request that can be admitted at once does not count as waiting.
    if (!r->waiting.empty() || !FitsNowLocked(*r, request.prompt,
                                              r->pool->Match(request.prompt, std::ssize(request.prompt) - 1))) {
      return absl::ResourceExhaustedError(absl::StrCat("the waiting queue is full: ", num_waiting_,
                                                       " requests are waiting (max_queued = ", options_.max_queued,
                                                       "); retry later"));
    }
  }
  auto seq = std::make_unique<Sequence>();
  seq->id = next_id_++;
  seq->context = request.prompt;
  if (request.sampling.HasPenalties()) {
    seq->history = TokenHistory(request.prompt, request.sampling.repetition_penalty != 1.0f);
  }
  // Resumed tokens: as if this sequence had generated them (and been preempted since).
  for (int32_t token : request.resumed) {
    seq->context.push_back(token);
    if (request.sampling.HasPenalties()) seq->history.AddGenerated(token);
  }
  seq->generated = static_cast<int32_t>(request.resumed.size());
  seq->constraint_state = resumed->constraint_state;
  seq->request = std::move(request);
  seq->sink = std::move(sink);
  seq->replica = r;
  seq->submitted = clock_->Now();
  Sequence* raw = seq.get();
  sequences_.emplace(raw->id, std::move(seq));
  if (park) {
    CHECK(ParkLocked(nullptr, *raw, absl::UnavailableError("no replica is serving")));
    return raw->id;
  }
  EnqueueLocked(*r, *raw, /*front=*/false);
  ++num_waiting_;
  // Admit it now when it fits, so that the queue limit counts only sequences that really wait.
  AdmitLocked(*r);
  r->work.SignalAll();
  return raw->id;
}

void Scheduler::Cancel(SequenceId id, FinishReason reason) {
  std::vector<Event> events;
  {
    MutexLock lock(&mu_);
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return;
    Sequence& seq = *it->second;
    if (!seq.running) {
      // Waiting (new or preempted, holding no blocks): nobody else touches it; end it here.
      EndLocked(seq, SequenceEnd{.reason = reason}, events);
    } else if (!seq.cancelled) {
      seq.cancelled = true;  // its replica's loop ends it before the next step
      seq.cancel_reason = reason;
    }
    if (events.empty()) return;
    QueueLocked(events);
  }
  Flush();
}

void Scheduler::EndLocked(Sequence& seq, SequenceEnd end, std::vector<Event>& events) {
  const int replica_id = seq.replica != nullptr ? seq.replica->id : -1;
  if (seq.replica == nullptr) {
    std::erase(parked_, &seq);  // parked (or in no queue at all)
  } else if (seq.running) {
    Replica& r = *seq.replica;
    r.pool->Release(seq.blocks);
    seq.blocks.clear();
    std::erase(r.running, &seq);
  } else {
    Replica& r = *seq.replica;
    auto it = std::find(r.waiting.begin(), r.waiting.end(), &seq);
    if (it != r.waiting.end()) {
      r.waiting.erase(it);
      --num_waiting_;
    }
  }
  end.prompt_tokens = static_cast<int32_t>(seq.request.prompt.size());
  end.completion_tokens = seq.generated;
  end.cached_prompt_tokens = std::max(0, seq.cached_prompt_tokens);
  if (options_.observer != nullptr) {
    const absl::Time now = clock_->Now();
    RequestReport report{.replica = replica_id,
                         .end = end,
                         .queue_time = std::max(absl::ZeroDuration(), seq.first_admitted.value_or(now) - seq.submitted),
                         .e2e_time = std::max(absl::ZeroDuration(), now - seq.submitted)};
    if (seq.first_token.has_value()) {
      report.time_to_first_token = std::max(absl::ZeroDuration(), *seq.first_token - seq.submitted);
    }
    options_.observer->OnRequestEnd(report);
  }
  events.push_back(Event{.sink = std::move(seq.sink), .end = std::move(end)});
  sequences_.erase(seq.id);  // destroys `seq`
}

bool Scheduler::HasWorkLocked(const Replica& r) const {
  if (CanContinueLocked(r)) return true;
  if (r.batches_in_flight >= r.micro_batches) return false;
  for (const Sequence* s : r.running) {
    if (!s->in_flight) return true;  // to step, or (cancelled) to end
  }
  return CanAdmitLocked(r);
}

bool Scheduler::CanAdmitLocked(const Replica& r) const {
  if (r.waiting.empty()) return false;
  Sequence& front = *r.waiting.front();
  return FitsNowLocked(r, front.context, MatchLocked(r, front));
}

const std::vector<int32_t>& Scheduler::MatchLocked(const Replica& r, Sequence& seq) const {
  if (OwesPromptLogprobs(seq.request, seq.prompt_logprobs_next)) {
    seq.match.clear();
    return seq.match;
  }
  if (seq.match_epoch != r.pool->epoch()) {
    // The last token is always computed: its logits give the next token.
    seq.match = r.pool->Match(seq.context, std::ssize(seq.context) - 1);
    seq.match_epoch = r.pool->epoch();
  }
  return seq.match;
}

bool Scheduler::FitsNowLocked(const Replica& r, absl::Span<const int32_t> context,
                              absl::Span<const int32_t> match) const {
  if (static_cast<int64_t>(r.running.size()) >= r.max_slots) return false;
  // The first prefill chunk after the cached prefix (a preempted sequence recomputes the rest of
  // its context), plus one block of headroom per running sequence: enough for each to decode into
  // a new block, so that admitting a sequence does not at once force the preemption of a newer
  // one (or of itself). Cached blocks nobody holds count as available, so taking them costs too.
  const int64_t cached = std::ssize(match) * r.block_size;
  const int64_t chunk = std::min<int64_t>(std::ssize(context) - cached, options_.max_step_tokens);
  const int64_t fresh = BlocksFor(cached + chunk, r.block_size) - std::ssize(match);
  return fresh + r.pool->CountUnreferenced(match) + std::ssize(r.running) <= r.pool->available();
}

bool Scheduler::GrowLocked(Replica& r, Sequence& seq, int64_t tokens) {
  const int64_t need = BlocksFor(tokens, r.block_size) - static_cast<int64_t>(seq.blocks.size());
  return r.pool->Allocate(need, seq.blocks);
}

void Scheduler::RequeueLocked(Replica& from, Sequence& seq, Replica& to) {
  ++seq.placement;
  if (seq.running) {
    from.pool->Release(seq.blocks);
    seq.blocks.clear();
    std::erase(from.running, &seq);
    seq.running = false;
  }
  seq.cached_blocks = 0;
  seq.consumed = 0;  // recomputed from its context (prompt + generated tokens) when admitted again
  seq.match_epoch.reset();
  seq.replica = &to;
  EnqueueLocked(to, seq, /*front=*/true);
  ++num_waiting_;
  to.work.SignalAll();
}

bool Scheduler::WaitsBefore(const Sequence& a, const Sequence& b) {
  return std::pair(a.request.priority, a.id) < std::pair(b.request.priority, b.id);
}

bool Scheduler::RunsBefore(const Sequence& a, const Sequence& b) const {
  if (options_.policy == SchedulingPolicy::kPriority && a.request.priority != b.request.priority) {
    return a.request.priority < b.request.priority;
  }
  return a.admitted < b.admitted;
}

void Scheduler::EnqueueLocked(Replica& to, Sequence& seq, bool front) {
  if (options_.policy == SchedulingPolicy::kPriority) {
    auto at = std::find_if(to.waiting.begin(), to.waiting.end(),
                           [&](const Sequence* other) { return WaitsBefore(seq, *other); });
    to.waiting.insert(at, &seq);
  } else if (front) {
    to.waiting.push_front(&seq);
  } else {
    to.waiting.push_back(&seq);
  }
}

void Scheduler::PreemptLocked(Replica& r, Sequence& seq) {
  CHECK(seq.running && !seq.in_flight);
  RequeueLocked(r, seq, r);
  if (options_.observer != nullptr) options_.observer->OnPreempted(r.id);
}

bool Scheduler::FailOverLocked(Replica& from, Sequence& seq) {
  Replica* to = PickReplicaLocked(MaxCachedTokens(seq.request), &from);
  if (to == nullptr) return false;
  RequeueLocked(from, seq, *to);
  ++seq.failovers;
  if (options_.observer != nullptr) options_.observer->OnFailover(from.id);
  LOG(WARNING) << "event=failover request_id=" << (seq.request.request_id.empty() ? "-" : seq.request.request_id)
               << " from_replica=" << from.id << " to_replica=" << to->id << " generated=" << seq.generated;
  return true;
}

bool Scheduler::ParkLocked(Replica* from, Sequence& seq, const absl::Status& why) {
  if (options_.recovery_timeout <= absl::ZeroDuration() || shut_down_) return false;
  ++seq.placement;
  if (from != nullptr && seq.running) {
    from->pool->Release(seq.blocks);
    seq.blocks.clear();
    std::erase(from->running, &seq);
    seq.running = false;
  }
  seq.cached_blocks = 0;
  seq.consumed = 0;  // recomputed from its context when a replica takes it
  seq.match_epoch.reset();
  seq.replica = nullptr;
  const absl::Time now = clock_->Now();
  if (!seq.recovery_deadline.has_value()) seq.recovery_deadline = now + options_.recovery_timeout;
  seq.retry_at = now + std::min(kRecoveryRetryMax, kRecoveryRetryMin * (int64_t{1} << std::min(seq.retries, 8)));
  ++seq.retries;
  seq.park_reason = why;
  // Oldest (lowest id) first.
  auto at = std::find_if(parked_.begin(), parked_.end(), [&](const Sequence* p) { return p->id > seq.id; });
  parked_.insert(at, &seq);
  LOG(WARNING) << "event=park request_id=" << (seq.request.request_id.empty() ? "-" : seq.request.request_id)
               << " from_replica=" << (from != nullptr ? absl::StrCat(from->id) : "-") << " generated=" << seq.generated
               << " reason=\"" << why.message() << "\"";
  return true;
}

void Scheduler::UnparkLocked(bool all) {
  const absl::Time now = clock_->Now();
  // Newest first, each to the front of its new queue: the oldest ends up first in line.
  for (auto it = parked_.rbegin(); it != parked_.rend();) {
    Sequence& seq = **it;
    Replica* to = (all || now >= seq.retry_at) ? PickReplicaLocked(MaxCachedTokens(seq.request)) : nullptr;
    if (to == nullptr) {
      ++it;
      continue;
    }
    it = std::make_reverse_iterator(parked_.erase(std::next(it).base()));
    seq.replica = to;
    EnqueueLocked(*to, seq, /*front=*/true);
    ++num_waiting_;
    to->work.SignalAll();
    LOG(INFO) << "event=unpark request_id=" << (seq.request.request_id.empty() ? "-" : seq.request.request_id)
              << " to_replica=" << to->id << " generated=" << seq.generated;
  }
}

void Scheduler::Poll() {
  std::vector<Event> events;
  {
    MutexLock lock(&mu_);
    const absl::Time now = clock_->Now();
    std::vector<Sequence*> expired;
    for (Sequence* s : parked_) {
      if (s->recovery_deadline.has_value() && now >= *s->recovery_deadline) expired.push_back(s);
    }
    for (Sequence* s : expired) {
      EndLocked(*s,
                SequenceEnd{.status = absl::UnavailableError(absl::StrCat(
                                "no replica recovered within the recovery timeout (",
                                absl::FormatDuration(options_.recovery_timeout), "): ", s->park_reason.message()))},
                events);
    }
    UnparkLocked(/*all=*/false);
    QueueLocked(events);
  }
  Flush();
}

void Scheduler::RecoveryLoop() {
  while (true) {
    {
      MutexLock lock(&mu_);
      const absl::Time deadline = absl::Now() + absl::Milliseconds(50);
      while (!shut_down_ && !shutdown_cv_.WaitWithDeadline(&mu_, deadline)) {
      }
      if (shut_down_) return;
    }
    Poll();
  }
}

void Scheduler::ReleaseLocked(const Batch& batch) {
  for (SequenceId id : batch.members) {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) continue;
    Sequence& s = *it->second;
    CHECK_GT(s.in_flight, 0);
    // A sequence that moved while still in an overlapped call can be stepped by its new replica now.
    if (--s.in_flight == 0 && s.replica != nullptr) s.replica->work.SignalAll();
  }
}

void Scheduler::EndCancelledLocked(Replica& r, std::vector<Event>& events) {
  std::vector<Sequence*> cancelled;
  for (Sequence* s : r.running) {
    if (s->cancelled && !s->in_flight) cancelled.push_back(s);
  }
  for (Sequence* s : cancelled) EndLocked(*s, SequenceEnd{.reason = s->cancel_reason}, events);
}

void Scheduler::AdmitLocked(Replica& r) {
  while (CanAdmitLocked(r)) {
    Sequence* s = r.waiting.front();
    r.waiting.pop_front();
    --num_waiting_;
    s->running = true;
    // Its cached prefix (CanAdmitLocked has just matched it), then blocks for the first chunk.
    std::vector<int32_t> match = MatchLocked(r, *s);
    s->match_epoch.reset();
    r.pool->Acquire(match);
    s->blocks = std::move(match);
    s->cached_blocks = std::ssize(s->blocks);
    s->consumed = static_cast<int32_t>(s->cached_blocks * r.block_size);
    if (s->cached_prompt_tokens < 0) {
      s->cached_prompt_tokens = std::min<int32_t>(s->consumed, static_cast<int32_t>(s->request.prompt.size()));
    }
    if (options_.observer != nullptr && r.pool->caching()) {
      options_.observer->OnPrefixCacheLookup(r.id, std::ssize(s->context), s->consumed);
    }
    const int64_t chunk = std::min<int64_t>(std::ssize(s->context) - s->consumed, options_.max_step_tokens);
    CHECK(GrowLocked(r, *s, s->consumed + chunk));  // CanAdmitLocked saw enough available blocks
    s->admitted = r.next_admitted++;
    if (!s->first_admitted.has_value()) s->first_admitted = clock_->Now();
    r.running.push_back(s);
  }
}

Scheduler::Batch Scheduler::BuildBatchLocked(Replica& r, size_t max_sequences) {
  Batch batch;
  batch.input.step_id = ++r.last_step_id;
  int64_t left = options_.max_step_tokens;
  auto pending = [](const Sequence* s) { return static_cast<int64_t>(s->context.size()) - s->consumed; };
  std::vector<Sequence*> decodes, prefills;
  for (Sequence* s : r.running) {
    if (s->cancelled || s->in_flight) continue;
    (pending(s) == 1 ? decodes : prefills).push_back(s);
  }
  // Least recently stepped first, so that a budget smaller than the decodes starves nobody.
  std::stable_sort(decodes.begin(), decodes.end(),
                   [](const Sequence* a, const Sequence* b) { return a->last_step < b->last_step; });
  // Prefill chunks in admission order (r.running's), or by rank ("Priorities" above).
  if (options_.policy == SchedulingPolicy::kPriority) {
    std::stable_sort(prefills.begin(), prefills.end(),
                     [this](const Sequence* a, const Sequence* b) { return RunsBefore(*a, *b); });
  }
  // 1. The members and their new tokens, in batch order.
  struct Member {
    Sequence* seq;
    int64_t n;
    bool dropped = false;  // preempted while the batch was being given blocks
  };
  std::vector<Member> members;
  for (Sequence* s : decodes) {
    if (left <= 0 || members.size() >= max_sequences) break;
    members.push_back({s, 1});
    left -= 1;
  }
  for (Sequence* s : prefills) {
    if (left <= 0 || members.size() >= max_sequences) break;
    const int64_t n = std::min(pending(s), left);
    members.push_back({s, n});
    left -= n;
  }
  // 2. Blocks for their new tokens, oldest admission first (best rank first with kPriority). A
  //    victim is always the last of that order among the running sequences not in flight (nor
  //    cancelled), so it is never a member already served here: it is the member being served, a
  //    later member (dropped from the batch) or a sequence outside it.
  std::vector<Member*> by_age;
  for (Member& m : members) by_age.push_back(&m);
  std::sort(by_age.begin(), by_age.end(),
            [this](const Member* a, const Member* b) { return RunsBefore(*a->seq, *b->seq); });
  for (Member* m : by_age) {
    if (m->dropped) continue;
    Sequence& s = *m->seq;
    while (!GrowLocked(r, s, s.consumed + m->n)) {
      Sequence* victim = nullptr;
      for (Sequence* other : r.running) {
        // A cancelled one is about to end and free its blocks anyway (it is never in a batch).
        if (other->in_flight || other->cancelled) continue;
        if (victim == nullptr || RunsBefore(*victim, *other)) victim = other;
      }
      CHECK(victim != nullptr);  // `s` itself is running and not in flight
      for (Member& other : members) {
        if (other.seq == victim) other.dropped = true;
      }
      PreemptLocked(r, *victim);
      if (victim == &s) break;
    }
  }
  // 2b. Multi-step decoding, when every member allows it and blocks are free for it.
  if (r.decode_steps->steps() > 1) {
    std::vector<Sequence*> kept;
    for (const Member& m : members) {
      if (!m.dropped) kept.push_back(m.seq);
    }
    batch.input.decode_steps = DecodeStepsLocked(r, kept);
  }
  // 3. The micro-batch.
  for (const Member& m : members) {
    if (m.dropped) continue;
    Sequence* s = m.seq;
    StepSequenceInput in;
    in.block_ids = s->blocks;
    in.pos_begin = s->consumed;
    in.token_ids.assign(s->context.begin() + s->consumed, s->context.begin() + s->consumed + m.n);
    in.sample = s->consumed + m.n == static_cast<int64_t>(s->context.size());
    if (in.sample) {
      const SequenceRequest& req = s->request;
      in.sampling = req.sampling;
      in.sample_index = static_cast<uint64_t>(s->generated);
      in.logprobs = req.logprobs;
      in.top_logprobs = req.top_logprobs;
      if (req.sampling.HasPenalties()) {
        in.penalty_token_ids = s->history.ids();
        in.penalty_token_counts = s->history.counts();
      }
      if (req.constraint != nullptr || s->generated < req.min_tokens || !req.bad_words.empty()) {
        const auto output = absl::MakeConstSpan(s->context).subspan(req.prompt.size());
        NextTokenRules rules = NextTokenRulesOf(req, options_.eos_token_ids, options_.limits.vocab_size, output,
                                                s->constraint_state);
        in.suppress_token_ids = std::move(rules.suppress);
        in.allowed_token_mask = std::move(rules.mask);
      }
    }
    if (OwesPromptLogprobs(s->request, s->prompt_logprobs_next)) {
      // Row i predicts the token at position consumed + i + 1.
      const int32_t prompt_len = static_cast<int32_t>(s->request.prompt.size());
      bool any = false;
      for (int64_t i = 0; i < m.n; ++i) {
        const int32_t t = s->consumed + static_cast<int32_t>(i) + 1;
        const bool owed = t >= s->prompt_logprobs_next && t < prompt_len;
        in.prompt_logprob_targets.push_back(owed ? s->context[static_cast<size_t>(t)] : -1);
        any = any || owed;
      }
      if (!any) in.prompt_logprob_targets.clear();
      in.top_logprobs = s->request.top_logprobs;
    }
    in.request_id = s->request.request_id;
    in.sequence_id = s->id;
    batch.input.sequences.push_back(std::move(in));
    batch.members.push_back(s->id);
    ++s->in_flight;
    s->last_step = batch.input.step_id;
    batch.placements.push_back(s->placement);
  }
  return batch;
}

bool Scheduler::PlainDecodeLocked(const Sequence& s) const {
  const SequenceRequest& req = s.request;
  return static_cast<int64_t>(s.context.size()) - s.consumed == 1 && !req.sampling.HasPenalties() &&
         req.sampling.logit_bias.empty() && req.constraint == nullptr && !req.logprobs &&
         !OwesPromptLogprobs(req, s.prompt_logprobs_next) && s.generated >= req.min_tokens && req.bad_words.empty();
}

bool Scheduler::CanContinueLocked(const Replica& r) const {
  if (!r.overlap || !r.tail.has_value() || r.tail->continued || r.stopping) return false;
  // Only the tail is in flight (so it is not answered yet), ...
  if (r.batches_in_flight != 1 || r.calls_started != r.tail->call) return false;
  // ... no sequence waits to join (the next call after the tail's answer takes it), and every
  // running one is in the tail or about to end (none would wait behind the overlapped calls).
  if (CanAdmitLocked(r)) return false;
  for (const Sequence* s : r.running) {
    if (!s->cancelled && !s->in_flight) return false;
  }
  return r.client != nullptr && r.client->OverlapsDecodeCalls();
}

Scheduler::Batch Scheduler::BuildContinuationLocked(Replica& r) {
  Replica::Tail& tail = *r.tail;
  tail.continued = true;  // one try per tail
  Batch batch;
  // The members that may still generate after the tail's tokens, and how many steps all may take.
  std::vector<Sequence*> members;
  int64_t k = r.decode_steps->steps();
  for (SequenceId id : tail.members) {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) continue;
    Sequence* s = it->second.get();
    if (s->replica != &r || !s->running || s->cancelled || s->in_flight != 1) continue;
    const int64_t left =
        std::min<int64_t>(s->request.max_tokens - s->generated - tail.steps,
                          options_.limits.max_seq_len - std::ssize(s->context) - tail.steps);
    if (left <= 0) continue;  // the tail's tokens end it
    k = std::min(k, left);
    members.push_back(s);
  }
  if (members.empty()) return batch;
  // Its new positions are [consumed + tail.steps, + k): blocks for them, without preempting anything.
  if (!GrowAllLocked(r, members, tail.steps + k)) return batch;
  batch.input.step_id = ++r.last_step_id;
  batch.input.decode_steps = static_cast<int32_t>(k);
  batch.input.remember_samples = true;
  batch.base_call = tail.call;
  for (Sequence* s : members) {
    const SequenceRequest& req = s->request;
    StepSequenceInput in;
    in.block_ids = s->blocks;
    in.pos_begin = s->consumed + tail.steps;
    in.from_previous = true;
    in.sample = true;
    in.sampling = req.sampling;
    in.sample_index = static_cast<uint64_t>(s->generated + tail.steps);
    in.request_id = req.request_id;
    in.sequence_id = s->id;
    batch.input.sequences.push_back(std::move(in));
    batch.members.push_back(s->id);
    batch.placements.push_back(s->placement);
    ++s->in_flight;
    s->last_step = batch.input.step_id;
  }
  return batch;
}

int32_t Scheduler::DecodeStepsLocked(Replica& r, absl::Span<Sequence* const> members) {
  if (r.stages != 1 || members.empty()) return 1;
  int64_t k = r.decode_steps->steps();
  for (const Sequence* s : members) {
    const SequenceRequest& req = s->request;
    if (!PlainDecodeLocked(*s)) return 1;
    // The tokens it may still generate: the step ends it at max_tokens or a full context.
    k = std::min<int64_t>(k, std::min<int64_t>(req.max_tokens - s->generated,
                                               options_.limits.max_seq_len - std::ssize(s->context)));
  }
  if (k <= 1) return 1;
  // Blocks for positions [consumed, consumed + k), without preempting anything.
  if (!GrowAllLocked(r, members, k)) return 1;
  return static_cast<int32_t>(k);
}

bool Scheduler::GrowAllLocked(Replica& r, absl::Span<Sequence* const> members, int64_t ahead) {
  int64_t need = 0;
  for (const Sequence* s : members) {
    need += std::max<int64_t>(0, BlocksFor(s->consumed + ahead, r.block_size) - std::ssize(s->blocks));
  }
  if (need > r.pool->available()) return false;
  for (Sequence* s : members) CHECK(GrowLocked(r, *s, s->consumed + ahead));
  return true;
}

void Scheduler::ApplyLocked(Replica& r, const Batch& batch, const absl::StatusOr<StepOutput>& out,
                            absl::Duration took, std::vector<Event>& events) {
  ++r.steps;
  const int32_t steps = std::max(batch.input.decode_steps, 1);
  absl::Status status = out.status();
  if (status.ok()) {
    size_t want = 0;
    for (const StepSequenceInput& in : batch.input.sequences) want += in.sample ? 1 : 0;
    want *= static_cast<size_t>(steps);
    bool logprobs = false;
    for (const StepSequenceInput& in : batch.input.sequences) logprobs = logprobs || (in.sample && in.logprobs);
    if (out->token_ids.size() != want) {
      status = absl::InternalError(absl::StrCat("replica ", r.id, " returned ", out->token_ids.size(),
                                                " tokens for a step that sampled ", want, " sequences"));
    } else if (logprobs && out->logprobs.size() != want) {
      status = absl::InternalError(absl::StrCat("replica ", r.id, " returned ", out->logprobs.size(),
                                                " logprobs for a step that sampled ", want, " sequences"));
    } else {
      size_t targets = 0;
      for (const StepSequenceInput& in : batch.input.sequences) {
        for (int32_t t : in.prompt_logprob_targets) targets += t >= 0 ? 1 : 0;
      }
      if (out->prompt_logprobs.size() != targets) {
        status = absl::InternalError(absl::StrCat("replica ", r.id, " returned ", out->prompt_logprobs.size(),
                                                  " prompt logprobs for a step that asked for ", targets));
      }
    }
  }
  if (options_.observer != nullptr) {
    StepReport report{.replica = r.id,
                      .sequences = static_cast<int32_t>(batch.input.sequences.size()),
                      .duration = took,
                      .status = status};
    for (const StepSequenceInput& in : batch.input.sequences) {
      const bool decode = in.sample && in.NumTokens() == 1 && in.sample_index > 0;
      (decode ? report.decode_tokens : report.prefill_tokens) += in.NumTokens() * steps;
    }
    options_.observer->OnStep(report);
  }
  if (status.ok()) {
    // Multi-step decoding: time the calls of decode-only batches, those it can apply to.
    const bool decode_only =
        std::all_of(batch.input.sequences.begin(), batch.input.sequences.end(),
                    [](const StepSequenceInput& in) { return in.sample && in.NumTokens() == 1; });
    // Only calls that ran alone from build to answer (none in flight when it was built, none built
    // since).
    const bool alone = !batch.overlapped && r.calls_started == batch.call;
    if (decode_only && batch.base_call != 0) {
      // An overlapped call ran right after its base: what the replica was not computing between
      // their answers is the serving overhead it did not hide.
      if (r.last_answered_call == batch.base_call) {
        r.decode_steps->Observe(std::max(absl::ZeroDuration(), batch.answered - r.last_answered), out->compute_time,
                                steps);
      }
    } else if (decode_only && alone) {
      r.decode_steps->Observe(batch.lead + took, out->compute_time, steps);
    }
  }
  if (!status.ok() && r.stopping) {
    // Interrupted by RemoveReplica / Shutdown, which end these sequences with their own reason
    // (FinishLocked releases them).
    return;
  }
  if (!status.ok()) {
    LOG(WARNING) << "replica " << r.id << ": step " << batch.input.step_id << " of "
                 << batch.input.sequences.size() << " sequence(s) failed: " << status;
  }
  size_t k = 0;
  size_t prompt_k = 0;  // next entry of out->prompt_logprobs
  for (size_t b = 0; b < batch.members.size(); ++b) {
    const StepSequenceInput& in = batch.input.sequences[b];
    const size_t sampled = k;  // its first entry of out->token_ids (and out->logprobs)
    if (status.ok() && in.sample) k += static_cast<size_t>(steps);
    auto it = sequences_.find(batch.members[b]);
    if (batch.base_call != 0) {
      // An overlapped call: its tokens count only for a sequence its base call left running here as
      // it was (not ended, cancelled, moved or parked since).
      if (it == sequences_.end()) continue;
      const Sequence& c = *it->second;
      if (c.placement != batch.placements[b] || c.replica != &r || !c.running || c.cancelled) continue;
      if (status.ok() && (c.consumed != in.pos_begin || std::ssize(c.context) != int64_t{in.pos_begin} + 1)) {
        LOG(ERROR) << "replica " << r.id << ": overlapped step " << batch.input.step_id << " continued sequence "
                   << c.id << " at position " << in.pos_begin << " but its base left it at " << c.consumed
                   << " of " << c.context.size() << "; its tokens are dropped";
        continue;
      }
    }
    CHECK(it != sequences_.end()) << "a sequence in flight was ended by another thread";
    Sequence& s = *it->second;  // stays in flight until its events are delivered (ReleaseLocked)
    if (!status.ok()) {
      // A broken pipeline (UNAVAILABLE) is this replica's problem, not the request's: another
      // replica recomputes it. Other errors fail it. Either way it stays in flight until
      // ReleaseLocked, so the other replica does not step it before this thread is done with it.
      // With no replica to take it, it waits for one to recover (ParkLocked).
      const bool broken = absl::IsUnavailable(status) && !s.cancelled;
      const bool moved = broken && ((s.failovers < kMaxFailovers && FailOverLocked(r, s)) || ParkLocked(&r, s, status));
      if (!moved) EndLocked(s, SequenceEnd{.status = status}, events);
      continue;
    }
    s.recovery_deadline.reset();  // progress: a later break gives it a whole recovery_timeout again
    s.retries = 0;
    s.consumed += static_cast<int32_t>(in.NumTokens());
    r.pool->Commit(s.blocks, s.context, s.consumed, &s.cached_blocks);
    if (!in.prompt_logprob_targets.empty()) {
      Event e{.sink = s.sink};
      for (size_t i = 0; i < in.prompt_logprob_targets.size(); ++i) {
        if (in.prompt_logprob_targets[i] < 0) continue;
        e.prompt_logprobs.push_back(out->prompt_logprobs[prompt_k++]);
        s.prompt_logprobs_next = in.pos_begin + static_cast<int32_t>(i) + 2;
      }
      if (!s.cancelled) events.push_back(std::move(e));
    }
    if (!in.sample || s.cancelled) continue;  // a cancelled sequence is ended before the next step
    // With several decode steps, their tokens one after the other, as that many answers; those
    // after the one that ends the sequence are dropped (`s` is gone then).
    for (int32_t j = 0; j < steps; ++j) {
      if (j > 0) {
        // Step j wrote the previous token at the next position.
        ++s.consumed;
        r.pool->Commit(s.blocks, s.context, s.consumed, &s.cached_blocks);
      }
      if (ApplyTokenLocked(r, s, in, *out, sampled + static_cast<size_t>(j), /*coalesce=*/j > 0, events)) break;
    }
  }
}

bool Scheduler::ApplyTokenLocked(Replica& r, Sequence& s, const StepSequenceInput& in, const StepOutput& out,
                                 size_t index, bool coalesce, std::vector<Event>& events) {
  const int32_t token = out.token_ids[index];
  s.context.push_back(token);
  ++s.generated;
  if (s.request.sampling.HasPenalties()) s.history.AddGenerated(token);
  const absl::Time now = clock_->Now();
  if (!s.first_token.has_value()) {
    s.first_token = now;
  } else if (options_.observer != nullptr) {
    options_.observer->OnInterTokenLatency(std::max(absl::ZeroDuration(), now - s.last_token));
  }
  s.last_token = now;
  if (coalesce) {
    // The next token of one decode call joins its predecessor's event: one sink call for them.
    events.back().tokens.push_back(token);
  } else {
    events.push_back(Event{.sink = s.sink, .tokens = {token}});
  }
  if (in.logprobs) events.back().logprobs.push_back(out.logprobs[index]);
  const SequenceRequest& req = s.request;
  bool constraint_done = false;
  if (req.constraint != nullptr) {
    // The mask allowed only tokens the constraint accepts; anything else is a broken stage.
    s.constraint_state = req.constraint->Advance(s.constraint_state, token);
    if (s.constraint_state < 0) {
      EndLocked(s, SequenceEnd{.status = absl::InternalError(absl::StrCat(
                                   "replica ", r.id, " sampled token ", token, " that the output constraint does not allow"))},
                events);
      return true;
    }
    constraint_done = req.constraint->IsFinished(s.constraint_state);
    if (!constraint_done) {
      events.back().constraint = req.constraint;
      events.back().constraint_state = s.constraint_state;
    }
  }
  const bool stop = constraint_done || IsStopToken(req, options_.eos_token_ids, token);
  if (stop) {
    EndLocked(s, SequenceEnd{.reason = FinishReason::kStop}, events);  // destroys `s`
    return true;
  }
  if (s.generated >= req.max_tokens || static_cast<int64_t>(s.context.size()) >= options_.limits.max_seq_len) {
    EndLocked(s, SequenceEnd{.reason = FinishReason::kLength}, events);
    return true;
  }
  return false;
}

void Scheduler::ChoosePipeliningLocked(Replica& r) {
  // The running set's next step, decodes first, as BuildBatchLocked orders it.
  std::vector<StepWork> work;
  work.reserve(r.running.size());
  for (int pass = 0; pass < 2; ++pass) {
    for (const Sequence* s : r.running) {
      if (s->cancelled) continue;
      const int64_t pending = std::ssize(s->context) - s->consumed;
      if ((pending == 1) != (pass == 0)) continue;
      work.push_back(StepWork{.pos_begin = s->consumed, .tokens = std::max<int64_t>(pending, 1), .sample = true});
    }
  }
  r.choice = r.pipelining_cache->Choose(work, r.depth, options_.max_step_tokens, r.micro_batches);
  if (r.choice.micro_batches != r.micro_batches && !work.empty()) {
    LOG(INFO) << "scheduler: replica " << r.id << " pipelining: " << DescribePipelining(r.choice, r.cost->Describe());
  }
  r.micro_batches = r.choice.micro_batches;
}

Scheduler::Batch Scheduler::NextBatchLocked(Replica& r, std::vector<Event>& events) {
  EndCancelledLocked(r, events);
  AdmitLocked(r);
  if (r.cost != nullptr) ChoosePipeliningLocked(r);
  Batch batch;
  if (r.batches_in_flight < r.micro_batches) {
    const size_t k = static_cast<size_t>(r.micro_batches);
    const size_t share = (r.running.size() + k - 1) / k;
    batch = BuildBatchLocked(r, std::max<size_t>(share, 1));
  } else if (CanContinueLocked(r)) {
    batch = BuildContinuationLocked(r);
  } else {
    return Batch{};  // the split dropped: wait for a batch
  }
  if (!batch.input.sequences.empty()) {
    batch.overlapped = r.batches_in_flight > 0;
    batch.call = ++r.calls_started;
    ++r.batches_in_flight;
    if (r.overlap) {
      // The new tail: this call, when every member decodes plainly (a continuation's members do).
      r.tail.reset();
      bool plain = true;
      for (size_t b = 0; b < batch.members.size() && plain; ++b) {
        const StepSequenceInput& in = batch.input.sequences[b];
        plain = in.sample && in.NumTokens() == 1 &&
                (in.from_previous || PlainDecodeLocked(*sequences_.at(batch.members[b])));
      }
      if (plain) {
        batch.input.remember_samples = true;
        r.tail = Replica::Tail{.call = batch.call, .steps = std::max(batch.input.decode_steps, 1), .members = batch.members};
      }
    }
  }
  // The split may have grown, or the call may be continued: another step loop may build at once.
  if (r.batches_in_flight < r.micro_batches || CanContinueLocked(r)) r.work.SignalAll();
  return batch;
}

void Scheduler::FinishLocked(Replica& r, const Batch& batch, const absl::StatusOr<StepOutput>& out,
                             absl::Duration took, std::vector<Event>& events) {
  ApplyLocked(r, batch, out, took, events);
  ReleaseLocked(batch);
  --r.batches_in_flight;
  if (r.tail.has_value() && r.tail->call == batch.call) r.tail.reset();  // answered: nothing to continue
  r.last_answered_call = batch.call;
  r.last_answered = batch.answered;
  EndCancelledLocked(r, events);
  // Another step loop of the replica may build now (the one finishing goes on by itself).
  if (r.depth > 1 || r.overlap) r.work.SignalAll();
}

void Scheduler::ReplicaLoop(Replica* r) {
  Batch batch;
  absl::StatusOr<StepOutput> out;
  absl::Duration took;
  bool answered = false;  // `batch` ran and `out` is its answer, to apply
  // The outbox marks (queued_events_) after this loop's last two answers: the next build waits
  // until the older one's events are delivered, so that the sinks' reactions to them (a stop string
  // cancelling its sequence) take effect at most one step late.
  uint64_t mark = 0, previous_mark = 0;
  absl::Time answered_at;  // when the last answer came back
  bool slept = false;      // waited for work since then
  while (true) {
    std::vector<Event> events;
    if (answered) {
      answered = false;
      std::vector<std::pair<std::shared_ptr<const TokenConstraint>, int32_t>> masks;
      {
        MutexLock lock(&mu_);
        // Overlapped decode calls: answers are applied in the order the calls were built (an
        // overlapped call's after its base's).
        while (r->overlap && !r->stopping && r->calls_applied + 1 < batch.call) r->order.Wait(&mu_);
        FinishLocked(*r, batch, out, took, events);
        if (r->overlap) {
          r->calls_applied = std::max(r->calls_applied, batch.call);
          r->order.SignalAll();
        }
        for (const Event& e : events) {
          if (e.constraint != nullptr && !e.end.has_value()) masks.emplace_back(e.constraint, e.constraint_state);
        }
        // Delivered by this thread while the next step runs (DeliverHere), or, when another thread
        // is delivering, after it.
        QueueLocked(events, /*wake=*/false);
        previous_mark = mark;
        mark = queued_events_;
      }
      // Structured output: the masks the next step needs, computed outside the lock.
      for (const auto& [constraint, state] : masks) (void)constraint->AllowedMask(state);
    }
    {
      MutexLock lock(&mu_);
      while (!r->stopping && delivered_events_ < previous_mark) delivery_cv_.Wait(&mu_);
      while (!r->stopping && !HasWorkLocked(*r)) {
        // Nothing to overlap with: what this loop queued goes out now, before it sleeps.
        if (!outbox_.empty() && !delivering_) {
          DeliverOutboxLocked();  // unlocks meanwhile: look again
          continue;
        }
        r->work.Wait(&mu_);
        slept = true;
      }
      if (r->stopping) {
        if (!outbox_.empty()) deliverer_cv_.Signal();
        return;
      }
      batch = NextBatchLocked(*r, events);
      QueueLocked(events, /*wake=*/false);
    }
    if (batch.input.sequences.empty()) {
      DeliverHere();
      continue;
    }
    if (r->overlap) {
      // Overlapped decode calls: calls are sent in the order they were built (an overlapped call
      // after its base).
      MutexLock lock(&mu_);
      while (!r->stopping && r->calls_sent + 1 < batch.call) r->order.Wait(&mu_);
    }
    const absl::Time step_start = clock_->Now();
    if (answered_at != absl::Time() && !slept) batch.lead = std::max(absl::ZeroDuration(), step_start - answered_at);
    slept = false;
    // The previous answer's sink calls are made here while this step runs: no other thread wakes.
    const uint64_t call = batch.call;
    out = r->client->StepOverlapping(batch.input, [this, r, call] {
      if (r->overlap) {
        // Sent (the client's contract): the next call may go.
        MutexLock lock(&mu_);
        r->calls_sent = std::max(r->calls_sent, call);
        r->order.SignalAll();
      }
      DeliverHere();
    });
    answered_at = clock_->Now();
    batch.answered = answered_at;
    took = std::max(absl::ZeroDuration(), answered_at - step_start);
    answered = true;
  }
}

std::optional<StepInput> Scheduler::BeginStep(int replica) {
  std::vector<Event> events;
  std::optional<StepInput> result;
  {
    MutexLock lock(&mu_);
    if (options_.step_driver != StepDriver::kCaller) return std::nullopt;
    auto it = replicas_.find(replica);
    if (it == replicas_.end() || it->second->stopping) return std::nullopt;
    Replica& r = *it->second;
    // A pass can build nothing (its only member preempted itself); the step loop would simply go
    // round again, so try a few times before saying there is no work.
    for (int attempt = 0; attempt < 4 && std::ssize(r.open) < r.depth && HasWorkLocked(r); ++attempt) {
      Batch batch = NextBatchLocked(r, events);
      if (batch.input.sequences.empty()) continue;
      result = batch.input;
      r.open.emplace(batch.input.step_id, std::move(batch));
      break;
    }
    QueueLocked(events);
  }
  Flush();
  return result;
}

void Scheduler::EndStep(int replica, uint64_t step_id, const absl::StatusOr<StepOutput>& out, absl::Duration took) {
  {
    MutexLock lock(&mu_);
    if (options_.step_driver != StepDriver::kCaller) return;
    auto it = replicas_.find(replica);
    if (it == replicas_.end() || it->second->stopping) return;
    auto b = it->second->open.find(step_id);
    if (b == it->second->open.end()) return;
    const Batch batch = std::move(b->second);
    it->second->open.erase(b);
    std::vector<Event> events;
    FinishLocked(*it->second, batch, out, took, events);
    QueueLocked(events);
  }
  Flush();
}

void Scheduler::CloseOpenBatchesLocked(Replica& r) {
  for (const auto& [step_id, batch] : r.open) ReleaseLocked(batch);
  r.batches_in_flight -= static_cast<int32_t>(r.open.size());
  r.open.clear();
}

void Scheduler::QueueLocked(std::vector<Event>& events, bool wake) {
  if (events.empty()) return;
  queued_events_ += events.size();
  for (Event& e : events) outbox_.push_back(std::move(e));
  events.clear();
  if (wake) deliverer_cv_.Signal();
}

void Scheduler::DeliverHere() {
  MutexLock lock(&mu_);
  // When another thread is delivering, it hands what is left to the delivery thread as it ends.
  if (!outbox_.empty() && !delivering_) DeliverOutboxLocked();
}

void Scheduler::DeliverOutboxLocked() {
  delivering_ = true;
  std::vector<Event> batch;
  batch.swap(outbox_);
  const uint64_t n = batch.size();
  mu_.Unlock();
  const Scheduler* const outer = t_delivering;
  t_delivering = this;
  Deliver(batch);
  t_delivering = outer;
  mu_.Lock();
  delivered_events_ += n;
  delivering_ = false;
  delivery_cv_.SignalAll();
  // Queued meanwhile, by a thread that left them to whoever was delivering.
  if (!outbox_.empty()) deliverer_cv_.Signal();
}

void Scheduler::Flush() {
  MutexLock lock(&mu_);
  if (t_delivering == this) return;  // from a sink call: the delivering loop goes on with the rest
  const uint64_t mine = queued_events_;
  while (true) {
    if (delivering_) {
      if (delivered_events_ >= mine) return;  // the delivering thread goes on with the rest
      while (delivering_ && delivered_events_ < mine) delivery_cv_.Wait(&mu_);
      continue;
    }
    if (outbox_.empty()) return;
    DeliverOutboxLocked();
  }
}

void Scheduler::DeliveryLoop() {
  MutexLock lock(&mu_);
  while (true) {
    while ((outbox_.empty() || delivering_) && !stop_delivery_) deliverer_cv_.Wait(&mu_);
    if (!outbox_.empty() && !delivering_) {
      DeliverOutboxLocked();
    } else if (stop_delivery_) {
      return;
    }
  }
}

void Scheduler::Deliver(std::vector<Event>& events) {
  for (Event& e : events) {
    if (!e.prompt_logprobs.empty()) e.sink->OnPromptLogprobs(e.prompt_logprobs);
    if (!e.tokens.empty()) e.sink->OnTokens(e.tokens, e.logprobs);
    if (e.end.has_value()) e.sink->OnEnd(*e.end);
    if (e.constraint != nullptr && !e.end.has_value()) (void)e.constraint->AllowedMask(e.constraint_state);
  }
  events.clear();
}

void Scheduler::RemoveReplica(int replica, const absl::Status& reason) {
  CHECK(!reason.ok());
  Replica* r = nullptr;
  {
    MutexLock lock(&mu_);
    auto it = replicas_.find(replica);
    if (it == replicas_.end() || it->second->stopping) return;
    r = it->second.get();
    r->stopping = true;
    r->work.SignalAll();
    r->order.SignalAll();
  }
  LOG(WARNING) << "scheduler: removing replica " << replica << ": " << reason;
  if (r->client != nullptr) r->client->Shutdown();
  for (std::thread& t : r->threads) t.join();
  std::vector<Event> events;
  std::unique_ptr<Replica> owned;
  {
    MutexLock lock(&mu_);
    CloseOpenBatchesLocked(*r);
    // Newest first, each to the front of a waiting queue: the oldest ends up first in line.
    while (!r->running.empty()) {
      Sequence& s = *r->running.back();
      if (s.cancelled) {
        EndLocked(s, SequenceEnd{.reason = s.cancel_reason}, events);
      } else if (!FailOverLocked(*r, s) && !ParkLocked(r, s, reason)) {
        EndLocked(s, SequenceEnd{.status = reason}, events);
      }
    }
    std::deque<Sequence*> moved = std::move(r->waiting);
    r->waiting.clear();
    num_waiting_ -= static_cast<int64_t>(moved.size());
    for (Sequence* s : moved) {
      Replica* to = PickReplicaLocked(MaxCachedTokens(s->request));
      if (to == nullptr) {
        s->replica = nullptr;  // in no queue: ParkLocked queues it, EndLocked finds nothing to unlink
        if (!ParkLocked(nullptr, *s, reason)) EndLocked(*s, SequenceEnd{.status = reason}, events);
        continue;
      }
      s->replica = to;
      EnqueueLocked(*to, *s, /*front=*/false);
      ++num_waiting_;
      to->work.SignalAll();
    }
    owned = std::move(replicas_[replica]);
    replicas_.erase(replica);
    QueueLocked(events);
  }
  Flush();
  // `owned` (and its client) are destroyed here, outside the lock.
}

void Scheduler::Shutdown(const absl::Status& reason) {
  CHECK(!reason.ok());
  std::vector<Replica*> stopping;
  {
    MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
    shutdown_reason_ = reason;
    shutdown_cv_.SignalAll();
    for (auto& [id, r] : replicas_) {
      if (r->stopping) continue;  // being removed by RemoveReplica, which joins it
      r->stopping = true;
      r->work.SignalAll();
      r->order.SignalAll();
      stopping.push_back(r.get());
    }
  }
  for (Replica* r : stopping) {
    if (r->client != nullptr) r->client->Shutdown();
  }
  for (Replica* r : stopping) {
    for (std::thread& t : r->threads) t.join();
  }
  std::vector<Event> events;
  std::vector<std::unique_ptr<Replica>> owned;
  {
    MutexLock lock(&mu_);
    for (Replica* r : stopping) {
      CloseOpenBatchesLocked(*r);
      while (!r->running.empty()) EndLocked(*r->running.front(), SequenceEnd{.status = reason}, events);
      while (!r->waiting.empty()) EndLocked(*r->waiting.front(), SequenceEnd{.status = reason}, events);
      owned.push_back(std::move(replicas_[r->id]));
      replicas_.erase(r->id);
    }
    while (!parked_.empty()) EndLocked(*parked_.front(), SequenceEnd{.status = reason}, events);
    QueueLocked(events);
  }
  if (recovery_thread_.joinable()) recovery_thread_.join();
  Flush();
  {
    MutexLock lock(&mu_);
    stop_delivery_ = true;
    deliverer_cv_.Signal();
  }
  if (delivery_thread_.joinable()) delivery_thread_.join();
}

SchedulerStats Scheduler::Stats() const {
  MutexLock lock(&mu_);
  SchedulerStats stats;
  stats.policy = options_.policy;
  for (const auto& [id, r] : replicas_) {
    ReplicaStats rs{.replica = id,
                    .max_slots = r->max_slots,
                    .running = static_cast<int64_t>(r->running.size()),
                    .waiting = static_cast<int64_t>(r->waiting.size()),
                    .steps = r->steps,
                    .kv_blocks_used = r->pool->held(),
                    .kv_blocks_cached = r->pool->cached(),
                    .kv_blocks_total = r->kv_blocks,
                    .draining = r->draining,
                    .micro_batches = r->micro_batches};
    rs.pipelining = r->cost != nullptr
                        ? DescribePipelining(r->choice, r->cost->Describe())
                        : absl::StrCat(r->depth, r->depth == 1 ? " micro-batch" : " micro-batches",
                                       " in flight at most (fixed pipeline depth)");
    rs.decode_steps = r->stages == 1 ? r->decode_steps->steps() : 1;
    rs.decode_steps_why =
        r->stages == 1 ? r->decode_steps->Describe()
                       : absl::StrCat("1 (several decode steps per call need a 1-stage replica; this one has ",
                                      r->stages == 0 ? "unknown" : absl::StrCat(r->stages), " stages)");
    if (r->overlap) {
      absl::StrAppend(&rs.decode_steps_why, r->client->OverlapsDecodeCalls()
                                                ? "; decode calls overlapped (the next is sent while one runs)"
                                                : "; decode calls not overlapped (the worker does not announce them)");
    }
    stats.running += rs.running;
    stats.waiting += rs.waiting;
    stats.replicas.push_back(rs);
  }
  stats.recovering = std::ssize(parked_);
  return stats;
}

}  // namespace shardserve::coordinator

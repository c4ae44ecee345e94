// The scheduler against the real engine in-process (tests/testing/engine_replica.h): whatever the
// batching (many concurrent requests, fewer slots than requests, tiny step budgets that chunk every
// prompt, several replicas, pipeline stages, a KV cache so small that sequences are preempted and
// recomputed), every request gets exactly the tokens that engine::Generate gives it alone — greedy
// and seeded sampling — and cancellation, step failures, the queue limit and shutdown affect only
// the requests they should, with every KV block given back.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/model_spec/model_spec.h"
#include "common/safetensors/safetensors.h"
#include "coordinator/scheduler/scheduler.h"
#include "tests/testing/engine_replica.h"
#include "tests/testing/preemption_counter.h"
#include "tests/testing/status_matchers.h"
#include "worker/engine/executor.h"
#include "worker/engine/generator.h"

namespace shardserve::coordinator {
namespace {

using ::shardserve::testing::EngineReplica;
using ::shardserve::testing::EngineReplicaOptions;
using ::shardserve::testing::IsOk;
using ::shardserve::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

constexpr absl::Duration kWait = absl::Seconds(120);  // bound on every wait; tests finish far sooner

std::string ModelDir(const std::string& name) { return absl::StrCat("tests/golden/models/", name); }

// Records one sequence's output; OnEnd must come exactly once, after all tokens.
class CollectingSink final : public SequenceSink {
 public:
  void OnTokens(absl::Span<const int32_t> tokens, absl::Span<const TokenLogprobs> /*logprobs*/) override {
    absl::MutexLock lock(&mu_);
    EXPECT_EQ(ends_, 0) << "tokens after OnEnd";
    tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  }
  void OnEnd(const SequenceEnd& end) override {
    {
      absl::MutexLock lock(&mu_);
      ++ends_;
      end_ = end;
    }
    if (!done_.HasBeenNotified()) done_.Notify();
  }
  // Waits (bounded) for OnEnd.
  bool Wait() { return done_.WaitForNotificationWithTimeout(kWait); }
  std::vector<int32_t> tokens() const {
    absl::MutexLock lock(&mu_);
    return tokens_;
  }
  SequenceEnd end() const {
    absl::MutexLock lock(&mu_);
    return end_;
  }
  int ends() const {
    absl::MutexLock lock(&mu_);
    return ends_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<int32_t> tokens_ ABSL_GUARDED_BY(mu_);
  SequenceEnd end_ ABSL_GUARDED_BY(mu_);
  int ends_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Notification done_;
};

using ::shardserve::testing::PreemptionCounter;

struct Setup {
  std::string model = "llama";
  int replicas = 1;
  int32_t max_slots = 3;
  int64_t max_step_tokens = 5;
  int64_t max_queued = 1024;
  std::vector<int64_t> stage_starts;
  int tp = 1;
  std::vector<int32_t> eos;  // the scheduler's EOS ids
  int64_t kv_blocks = 0;     // per replica; 0 = the engine's default (8 whole contexts)
  int32_t kv_block_size = 16;
  SchedulerObserver* observer = nullptr;
  int32_t pipeline_depth = 1;
  bool prefix_caching = true;
  absl::Duration recovery_timeout = absl::ZeroDuration();  // SchedulerOptions::recovery_timeout
  int32_t decode_steps_per_call = 1;  // SchedulerOptions::decode_steps_per_call
  int32_t stages = 0;                 // ReplicaOptions::stages
  bool overlap = true;                // SchedulerOptions::overlap_decode_calls
  SchedulingPolicy policy = SchedulingPolicy::kFcfs;
  // Wraps each replica's client (e.g. to observe its steps); identity when null.
  std::function<std::unique_ptr<ReplicaClient>(std::unique_ptr<ReplicaClient>)> wrap;
};

struct Harness {
  ModelSpec spec;
  std::unique_ptr<Scheduler> scheduler;
  std::vector<EngineReplica*> replicas;  // owned by the scheduler
};

// Starts serving replica `id` of `setup` on `h` (an engine of its own, as a new worker would be).
absl::Status AddEngineReplica(Harness& h, const Setup& setup, int id) {
  auto replica = EngineReplica::Create(EngineReplicaOptions{.model_dir = ModelDir(setup.model),
                                                            .stage_starts = setup.stage_starts,
                                                            .tp = setup.tp,
                                                            .kv_blocks = setup.kv_blocks,
                                                            .kv_block_size = setup.kv_block_size,
                                                            .max_step_tokens = setup.max_step_tokens});
  if (!replica.ok()) return replica.status();
  h.replicas.push_back(replica->get());
  const ReplicaOptions ro{.max_slots = setup.max_slots,
                          .pipeline_depth = setup.pipeline_depth,
                          .kv_blocks = (*replica)->kv_blocks(),
                          .kv_block_size = setup.kv_block_size,
                          .prefix_caching = setup.prefix_caching,
                          .stages = setup.stages};
  std::unique_ptr<ReplicaClient> client = *std::move(replica);
  if (setup.wrap) client = setup.wrap(std::move(client));
  return h.scheduler->AddReplica(id, std::move(client), ro);
}

absl::StatusOr<Harness> MakeHarness(const Setup& setup) {
  Harness h;
  auto spec = LoadModelSpec(ModelDir(setup.model));
  if (!spec.ok()) return spec.status();
  h.spec = *spec;
  SchedulerOptions so;
  so.limits = {.vocab_size = h.spec.vocab_size, .max_seq_len = h.spec.max_position_embeddings};
  so.max_step_tokens = setup.max_step_tokens;
  so.max_queued = setup.max_queued;
  so.eos_token_ids = setup.eos;
  so.observer = setup.observer;
  so.recovery_timeout = setup.recovery_timeout;
  so.decode_steps_per_call = setup.decode_steps_per_call;
  so.overlap_decode_calls = setup.overlap;
  so.policy = setup.policy;
  h.scheduler = std::make_unique<Scheduler>(so);
  for (int r = 0; r < setup.replicas; ++r) {
    if (absl::Status st = AddEngineReplica(h, setup, r); !st.ok()) return st;
  }
  return h;
}

// Requests of many shapes, from a fixed seed.
std::vector<SequenceRequest> MakeRequests(int n, int64_t vocab, uint32_t seed, bool sampled) {
  std::mt19937 rng(seed);
  std::vector<SequenceRequest> out;
  for (int i = 0; i < n; ++i) {
    SequenceRequest r;
    r.request_id = absl::StrCat("req-", i);
    const int len = 1 + static_cast<int>(rng() % 23);
    for (int t = 0; t < len; ++t) r.prompt.push_back(static_cast<int32_t>(rng() % vocab));
    r.max_tokens = 1 + static_cast<int32_t>(rng() % 18);
    if (sampled) {
      r.sampling = {.temperature = 0.7f + 0.1f * static_cast<float>(i % 4),
                    .top_k = (i % 3 == 0) ? 0 : 20,
                    .top_p = (i % 2 == 0) ? 1.0f : 0.9f,
                    .seed = 1000u + static_cast<uint64_t>(i)};
    }
    out.push_back(std::move(r));
  }
  return out;
}

// engine::Generate on each request alone, as shardserve-run does it.
absl::StatusOr<std::vector<engine::GenerationResult>> Reference(const std::string& model,
                                                               const std::vector<SequenceRequest>& requests,
                                                               const std::vector<int32_t>& eos) {
  auto spec = LoadModelSpec(ModelDir(model));
  if (!spec.ok()) return spec.status();
  auto ckpt = Checkpoint::Open(ModelDir(model));
  if (!ckpt.ok()) return ckpt.status();
  auto ex = engine::TpExecutor::Create(*spec, **ckpt, engine::ExecutorOptions{});
  if (!ex.ok()) return ex.status();
  std::vector<engine::GenerationResult> out;
  for (const SequenceRequest& r : requests) {
    engine::GenerationRequest g{.prompt = r.prompt, .max_tokens = r.max_tokens};
    g.sampling = {.temperature = r.sampling.temperature, .top_k = r.sampling.top_k, .top_p = r.sampling.top_p,
                  .seed = r.sampling.seed};
    g.stop_ids = r.stop_token_ids;
    if (!r.ignore_eos) g.stop_ids.insert(g.stop_ids.end(), eos.begin(), eos.end());
    auto res = engine::Generate(**ex, {g});
    if (!res.ok()) return res.status();
    out.push_back((*res)[0]);
  }
  return out;
}

FinishReason ToFinish(engine::FinishReason f) {
  return f == engine::FinishReason::kStop ? FinishReason::kStop : FinishReason::kLength;
}

// Submits every request at once, waits for all, and checks each against the reference. The
// replicas in `hold` run no step until every request is submitted (a deterministic start).
void RunAndCompare(Scheduler& scheduler, const std::string& model, const std::vector<SequenceRequest>& requests,
                   const std::vector<int32_t>& eos, const std::vector<EngineReplica*>& hold = {}) {
  ASSERT_OK_AND_ASSIGN(auto expected, Reference(model, requests, eos));
  for (EngineReplica* r : hold) r->HoldStepsForTest();
  std::vector<std::shared_ptr<CollectingSink>> sinks;
  for (const SequenceRequest& r : requests) {
    sinks.push_back(std::make_shared<CollectingSink>());
    ASSERT_THAT(scheduler.Submit(r, sinks.back()), IsOk());  // held replicas are freed at shutdown
  }
  for (EngineReplica* r : hold) r->ReleaseStepsForTest();
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(sinks[i]->Wait()) << "request " << i << " did not finish";
    const SequenceEnd end = sinks[i]->end();
    EXPECT_THAT(end.status, IsOk()) << "request " << i;
    EXPECT_THAT(sinks[i]->tokens(), ElementsAreArray(expected[i].tokens)) << "request " << i;
    EXPECT_EQ(end.reason, ToFinish(expected[i].finish)) << "request " << i;
    EXPECT_EQ(end.prompt_tokens, static_cast<int32_t>(requests[i].prompt.size()));
    EXPECT_EQ(end.completion_tokens, static_cast<int32_t>(expected[i].tokens.size()));
    EXPECT_EQ(sinks[i]->ends(), 1);
  }
  const SchedulerStats stats = scheduler.Stats();
  EXPECT_EQ(stats.running, 0);
  EXPECT_EQ(stats.waiting, 0);
  for (const ReplicaStats& r : stats.replicas) {
    EXPECT_EQ(r.kv_blocks_used, 0) << "replica " << r.replica << " kept KV blocks";
    EXPECT_GT(r.kv_blocks_total, 0);
  }
}

// Every step of `replica` gave each sequence blocks for its new positions, in range; a block a
// sequence writes (one holding a position from pos_begin on) is in no other sequence's table in
// that step, and one sequence holds a block once. Blocks before pos_begin may be shared (a cached
// prefix, read only). No sequence appears twice in a step.
void ExpectSoundBlockTables(const EngineReplica& replica, int64_t block_size, int32_t max_slots) {
  for (const StepInput& in : replica.StepInputsForTest()) {
    std::map<int32_t, int> holders;
    std::set<int32_t> written;
    std::set<std::string> ids;
    EXPECT_LE(static_cast<int64_t>(in.sequences.size()), max_slots) << "step " << in.step_id;
    for (const StepSequenceInput& s : in.sequences) {
      EXPECT_TRUE(ids.insert(s.request_id).second) << s.request_id << " twice in step " << in.step_id;
      // Several decode steps write positions [pos_begin, pos_begin + decode_steps).
      const int64_t end = s.pos_begin + static_cast<int64_t>(s.token_ids.size()) + (in.decode_steps - 1);
      EXPECT_GE(static_cast<int64_t>(s.block_ids.size()) * block_size, end) << "step " << in.step_id;
      std::set<int32_t> own;
      for (size_t j = 0; j < s.block_ids.size(); ++j) {
        const int32_t b = s.block_ids[j];
        EXPECT_TRUE(own.insert(b).second) << "block " << b << " twice in one table in step " << in.step_id;
        ++holders[b];
        if (static_cast<int64_t>(j) >= s.pos_begin / block_size) written.insert(b);
        EXPECT_GE(b, 0);
        EXPECT_LT(b, replica.kv_blocks());
      }
    }
    for (int32_t b : written) {
      EXPECT_EQ(holders[b], 1) << "block " << b << " is written and shared in step " << in.step_id;
    }
  }
}

class SchedulerModelTest : public ::testing::TestWithParam<std::string> {};

TEST_P(SchedulerModelTest, GreedyTokensMatchTheEngineAlone) {
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.model = GetParam(), .max_slots = 3, .max_step_tokens = 5}));
  RunAndCompare(*h.scheduler, GetParam(), MakeRequests(10, h.spec.vocab_size, 7, false), {});
}

TEST_P(SchedulerModelTest, SeededSamplingMatchesTheEngineAlone) {
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.model = GetParam(), .max_slots = 4, .max_step_tokens = 7}));
  RunAndCompare(*h.scheduler, GetParam(), MakeRequests(10, h.spec.vocab_size, 11, true), {});
}

INSTANTIATE_TEST_SUITE_P(GoldenModels, SchedulerModelTest,
                         ::testing::Values("llama", "llama_tied_llama3rope_bias", "mistral", "qwen2", "mixtral",
                                           "qwen2_moe"));

TEST(SchedulerTest, BatchesRespectSlotsBlocksAndTheStepBudget) {
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.max_slots = 2, .max_step_tokens = 3}));
  RunAndCompare(*h.scheduler, "llama", MakeRequests(6, h.spec.vocab_size, 3, false), {});
  ExpectSoundBlockTables(*h.replicas[0], 16, 2);
  bool chunked = false;
  for (const StepInput& in : h.replicas[0]->StepInputsForTest()) {
    int64_t tokens = 0;
    for (const StepSequenceInput& s : in.sequences) {
      tokens += static_cast<int64_t>(s.token_ids.size());
      chunked |= !s.sample;
    }
    EXPECT_LE(tokens, 3);
    EXPECT_GE(tokens, 1);
  }
  EXPECT_TRUE(chunked) << "some prompt should have been prefilled in several chunks";
}

TEST(SchedulerTest, OneTokenStepBudgetStillMatches) {
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.max_slots = 3, .max_step_tokens = 1}));
  RunAndCompare(*h.scheduler, "llama", MakeRequests(5, h.spec.vocab_size, 5, true), {});
}

TEST(SchedulerTest, PipelineAndTensorParallelReplicaMatchesOneProcess) {
  ASSERT_OK_AND_ASSIGN(Harness h,
                       MakeHarness({.model = "qwen2_moe", .max_slots = 3, .max_step_tokens = 6,
                                    .stage_starts = {1}, .tp = 2}));
  RunAndCompare(*h.scheduler, "qwen2_moe", MakeRequests(6, h.spec.vocab_size, 13, false), {});
}

// Passes steps through to the engine, and records how many were in flight at once and whether two
// in flight ever shared a KV block. The first step is held until a second one is in flight (the
// scheduler should send the other micro-batch without waiting for the first), so the overlap does
// not depend on timing; a scheduler that never pipelines releases it after kPartnerWait and the
// test fails on max_in_flight.
class OverlapProbe final : public ReplicaClient {
 public:
  static constexpr absl::Duration kPartnerWait = absl::Seconds(20);

  explicit OverlapProbe(std::unique_ptr<ReplicaClient> inner) : inner_(std::move(inner)) {}
  absl::StatusOr<StepOutput> Step(const StepInput& input) override {
    {
      absl::MutexLock lock(&mu_);
      ++in_flight_;
      max_in_flight_ = std::max(max_in_flight_, in_flight_);
      for (const StepSequenceInput& s : input.sequences) {
        for (int32_t b : s.block_ids) shared_block_ |= !blocks_.insert(b).second;
      }
      if (!held_first_) {
        held_first_ = true;
        mu_.AwaitWithTimeout(absl::Condition(+[](int* n) { return *n >= 2; }, &in_flight_), kPartnerWait);
      }
    }
    absl::StatusOr<StepOutput> out = inner_->Step(input);
    absl::MutexLock lock(&mu_);
    --in_flight_;
    for (const StepSequenceInput& s : input.sequences) {
      for (int32_t b : s.block_ids) blocks_.erase(b);
    }
    return out;
  }
  void Shutdown() override { inner_->Shutdown(); }
  int max_in_flight() const {
    absl::MutexLock lock(&mu_);
    return max_in_flight_;
  }
  bool shared_block() const {
    absl::MutexLock lock(&mu_);
    return shared_block_;
  }

 private:
  std::unique_ptr<ReplicaClient> inner_;
  mutable absl::Mutex mu_;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  int max_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  std::set<int32_t> blocks_ ABSL_GUARDED_BY(mu_);
  bool shared_block_ ABSL_GUARDED_BY(mu_) = false;
  bool held_first_ ABSL_GUARDED_BY(mu_) = false;
};

TEST(SchedulerTest, PipelinedMicroBatchesOverlapAndMatchTheEngineAlone) {
  OverlapProbe* probe = nullptr;
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.max_slots = 6,
                                               .max_step_tokens = 8,
                                               .stage_starts = {1},
                                               .pipeline_depth = 2,
                                               .wrap = [&](std::unique_ptr<ReplicaClient> inner) {
                                                 auto p = std::make_unique<OverlapProbe>(std::move(inner));
                                                 probe = p.get();
                                                 return p;
                                               }}));
  RunAndCompare(*h.scheduler, "llama", MakeRequests(12, h.spec.vocab_size, 17, true), {});
  EXPECT_EQ(probe->max_in_flight(), 2) << "two micro-batches should have been in flight at once, never more";
  EXPECT_FALSE(probe->shared_block()) << "a KV block was in two micro-batches in flight";
  // Each micro-batch took at most half of the running sequences (6 slots, depth 2 -> <= 3).
  for (const StepInput& in : h.replicas[0]->StepInputsForTest()) EXPECT_LE(in.sequences.size(), 3u);
}

// Records the thread of every sink call.
class ThreadRecordingSink final : public SequenceSink {
 public:
  void OnTokens(absl::Span<const int32_t> tokens, absl::Span<const TokenLogprobs> /*logprobs*/) override {
    absl::MutexLock lock(&mu_);
    threads_.insert(std::this_thread::get_id());
    tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  }
  void OnEnd(const SequenceEnd& end) override {
    {
      absl::MutexLock lock(&mu_);
      threads_.insert(std::this_thread::get_id());
      end_ = end;
    }
    done_.Notify();
  }
  bool Wait() { return done_.WaitForNotificationWithTimeout(kWait); }
  size_t token_count() const {
    absl::MutexLock lock(&mu_);
    return tokens_.size();
  }
  std::vector<int32_t> tokens() const {
    absl::MutexLock lock(&mu_);
    return tokens_;
  }
  std::set<std::thread::id> threads() const {
    absl::MutexLock lock(&mu_);
    return threads_;
  }
  SequenceEnd end() const {
    absl::MutexLock lock(&mu_);
    return end_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<int32_t> tokens_ ABSL_GUARDED_BY(mu_);
  std::set<std::thread::id> threads_ ABSL_GUARDED_BY(mu_);
  SequenceEnd end_ ABSL_GUARDED_BY(mu_);
  absl::Notification done_;
};

// Overrides StepOverlapping as a network client does (the step is under way while the caller's
// work runs), and checks that, by the time the caller's work is done, the sink has every token
// the earlier steps sampled.
class OverlapChecker final : public ReplicaClient {
 public:
  OverlapChecker(std::unique_ptr<ReplicaClient> inner, const ThreadRecordingSink* sink)
      : inner_(std::move(inner)), sink_(sink) {}
  absl::StatusOr<StepOutput> Step(const StepInput& input) override { return inner_->Step(input); }
  absl::StatusOr<StepOutput> StepOverlapping(const StepInput& input, absl::FunctionRef<void()> while_waiting) override {
    absl::StatusOr<StepOutput> out = inner_->Step(input);  // "sent": the answer is on its way
    while_waiting();
    absl::MutexLock lock(&mu_);
    step_threads_.insert(std::this_thread::get_id());
    if (sink_->token_count() != sampled_) behind_.push_back(input.step_id);
    if (out.ok()) sampled_ += out->token_ids.size();
    ++steps_;
    return out;
  }
  void Shutdown() override { inner_->Shutdown(); }
  std::set<std::thread::id> step_threads() const {
    absl::MutexLock lock(&mu_);
    return step_threads_;
  }
  std::vector<uint64_t> behind() const {
    absl::MutexLock lock(&mu_);
    return behind_;
  }
  int steps() const {
    absl::MutexLock lock(&mu_);
    return steps_;
  }

 private:
  const std::unique_ptr<ReplicaClient> inner_;
  const ThreadRecordingSink* const sink_;
  mutable absl::Mutex mu_;
  size_t sampled_ ABSL_GUARDED_BY(mu_) = 0;
  int steps_ ABSL_GUARDED_BY(mu_) = 0;
  std::set<std::thread::id> step_threads_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> behind_ ABSL_GUARDED_BY(mu_);  // steps whose overlap left tokens undelivered
};

TEST(SchedulerTest, TheStepLoopDeliversThePreviousAnswerWhileItsNextStepRuns) {
  auto sink = std::make_shared<ThreadRecordingSink>();
  OverlapChecker* checker = nullptr;
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.max_slots = 1, .wrap = [&](std::unique_ptr<ReplicaClient> inner) {
                                                 auto c = std::make_unique<OverlapChecker>(std::move(inner), sink.get());
                                                 checker = c.get();
                                                 return c;
                                               }}));
  std::vector<SequenceRequest> requests = MakeRequests(1, h.spec.vocab_size, 29, false);
  requests[0].max_tokens = 12;
  ASSERT_OK_AND_ASSIGN(auto expected, Reference("llama", requests, {}));
  ASSERT_THAT(h.scheduler->Submit(requests[0], sink), IsOk());
  ASSERT_TRUE(sink->Wait());
  EXPECT_THAT(sink->end().status, IsOk());
  EXPECT_THAT(sink->tokens(), ElementsAreArray(expected[0].tokens));
  ASSERT_GE(checker->steps(), 12);
  // Each step's overlap delivered every token sampled before it, on the step loop's own thread:
  // every sink call (the last token and the end too) was made there, none on another thread.
  EXPECT_THAT(checker->behind(), ::testing::IsEmpty());
  EXPECT_EQ(checker->step_threads().size(), 1u);
  EXPECT_EQ(sink->threads(), checker->step_threads());
}

TEST(SchedulerTest, PipelineDepthMustBePositive) {
  SchedulerOptions so;
  so.limits = {.vocab_size = 10, .max_seq_len = 16};
  Scheduler scheduler(so);
  ASSERT_OK_AND_ASSIGN(auto replica, EngineReplica::Create(EngineReplicaOptions{.model_dir = ModelDir("llama")}));
  EXPECT_THAT(scheduler.AddReplica(0, std::move(replica), {.max_slots = 2, .pipeline_depth = 0}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("pipeline_depth")));
}

TEST(SchedulerTest, StopIdsAndEosEndGeneration) {
  const std::string model = "llama";
  ASSERT_OK_AND_ASSIGN(Harness probe, MakeHarness({}));
  std::vector<SequenceRequest> base = MakeRequests(1, probe.spec.vocab_size, 21, false);
  base[0].max_tokens = 16;
  ASSERT_OK_AND_ASSIGN(auto free_run, Reference(model, base, {}));
  ASSERT_GE(free_run[0].tokens.size(), 4u);
  const int32_t stop = free_run[0].tokens[3];
  // The 4th token as a request stop id, as the model's EOS, and as EOS with ignore_eos.
  std::vector<SequenceRequest> requests(3, base[0]);
  requests[0].stop_token_ids = {stop};
  requests[2].ignore_eos = true;
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.eos = {stop}}));
  RunAndCompare(*h.scheduler, model, requests, {stop});
  ASSERT_OK_AND_ASSIGN(auto expected, Reference(model, requests, {stop}));
  EXPECT_EQ(expected[0].finish, engine::FinishReason::kStop);
  EXPECT_EQ(expected[1].finish, engine::FinishReason::kStop);
  EXPECT_LE(expected[0].tokens.size(), 4u);
  EXPECT_EQ(expected[2].tokens, free_run[0].tokens);
}

TEST(SchedulerTest, CancellingARunningSequenceFreesItsSlotAndSparesTheOthers) {
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.max_slots = 2, .max_step_tokens = 4}));
  std::vector<SequenceRequest> requests = MakeRequests(5, h.spec.vocab_size, 31, false);
  for (SequenceRequest& r : requests) r.max_tokens = 12;
  ASSERT_OK_AND_ASSIGN(auto expected, Reference("llama", requests, {}));
  std::vector<std::shared_ptr<CollectingSink>> sinks;
  std::vector<SequenceId> ids;
  absl::Notification submitted;
  // Step 1 waits until every id is known; step 6 cancels request 0, which is running by then.
  Scheduler* scheduler = h.scheduler.get();
  h.replicas[0]->SetStepHookForTest([&ids, &submitted, scheduler](const StepInput& in) {
    if (in.step_id == 1 && !submitted.WaitForNotificationWithTimeout(kWait)) {
      return absl::DeadlineExceededError("test never submitted");
    }
    // As a front end whose stop string matched: the sequence ends as stopped (a later cancel of
    // the same sequence does not change that).
    if (in.step_id == 6) {
      scheduler->Cancel(ids[0], FinishReason::kStop);
      scheduler->Cancel(ids[0]);
    }
    return absl::OkStatus();
  });
  for (const SequenceRequest& r : requests) {
    sinks.push_back(std::make_shared<CollectingSink>());
    ASSERT_OK_AND_ASSIGN(SequenceId id, h.scheduler->Submit(r, sinks.back()));
    ids.push_back(id);
  }
  submitted.Notify();
  for (auto& s : sinks) ASSERT_TRUE(s->Wait());
  const SequenceEnd cancelled = sinks[0]->end();
  EXPECT_THAT(cancelled.status, IsOk());
  EXPECT_EQ(cancelled.reason, FinishReason::kStop);
  const std::vector<int32_t> got = sinks[0]->tokens();
  ASSERT_LT(got.size(), expected[0].tokens.size());
  EXPECT_THAT(got, ElementsAreArray(expected[0].tokens.begin(), expected[0].tokens.begin() + got.size()));
  for (size_t i = 1; i < requests.size(); ++i) {
    EXPECT_THAT(sinks[i]->tokens(), ElementsAreArray(expected[i].tokens)) << "request " << i;
    EXPECT_EQ(sinks[i]->end().reason, ToFinish(expected[i].finish));
  }
  // After the cancel is seen, the sequence is in no step.
  bool seen_after = false;
  for (const StepInput& in : h.replicas[0]->StepInputsForTest()) {
    if (in.step_id <= 6) continue;
    for (const StepSequenceInput& s : in.sequences) seen_after |= s.request_id == requests[0].request_id;
  }
  EXPECT_FALSE(seen_after);
  EXPECT_EQ(h.scheduler->Stats().running, 0);
}


TEST(SchedulerTest, CancellingAWaitingSequenceEndsItAtOnce) {
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.max_slots = 1}));
  h.replicas[0]->HoldStepsForTest();
  std::vector<SequenceRequest> requests = MakeRequests(2, h.spec.vocab_size, 41, false);
  ASSERT_OK_AND_ASSIGN(auto expected, Reference("llama", requests, {}));
  auto first = std::make_shared<CollectingSink>();
  auto second = std::make_shared<CollectingSink>();
  ASSERT_THAT(h.scheduler->Submit(requests[0], first), IsOk());
  ASSERT_OK_AND_ASSIGN(SequenceId waiting, h.scheduler->Submit(requests[1], second));
  EXPECT_EQ(h.scheduler->Stats().waiting, 1);
  h.scheduler->Cancel(waiting);  // ends on this thread
  EXPECT_EQ(second->ends(), 1);
  EXPECT_EQ(second->end().reason, FinishReason::kCancelled);
  EXPECT_TRUE(second->tokens().empty());
  EXPECT_EQ(h.scheduler->Stats().waiting, 0);
  h.scheduler->Cancel(waiting);  // unknown by now: a no-op
  h.replicas[0]->ReleaseStepsForTest();
  ASSERT_TRUE(first->Wait());
  EXPECT_THAT(first->tokens(), ElementsAreArray(expected[0].tokens));
}

TEST(SchedulerTest, QueueLimitRejectsWithResourceExhausted) {
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.max_slots = 1, .max_queued = 2}));
  h.replicas[0]->HoldStepsForTest();
  std::vector<SequenceRequest> requests = MakeRequests(4, h.spec.vocab_size, 43, false);
  std::vector<std::shared_ptr<CollectingSink>> sinks;
  for (int i = 0; i < 3; ++i) {  // one running, two waiting
    sinks.push_back(std::make_shared<CollectingSink>());
    ASSERT_THAT(h.scheduler->Submit(requests[i], sinks.back()), IsOk()) << i;
  }
  EXPECT_THAT(h.scheduler->Submit(requests[3], std::make_shared<CollectingSink>()),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("max_queued = 2")));
  h.replicas[0]->ReleaseStepsForTest();
  for (auto& s : sinks) {
    ASSERT_TRUE(s->Wait());
    EXPECT_THAT(s->end().status, IsOk());
  }
  // Room again.
  RunAndCompare(*h.scheduler, "llama", {requests[3]}, {});
}

TEST(SchedulerTest, TwoReplicasShareTheLoadAndMatchTheEngine) {
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.replicas = 2, .max_slots = 2, .max_step_tokens = 8}));
  RunAndCompare(*h.scheduler, "llama", MakeRequests(9, h.spec.vocab_size, 17, true), {});
  EXPECT_GT(h.replicas[0]->NumStepsForTest(), 0);
  EXPECT_GT(h.replicas[1]->NumStepsForTest(), 0);
}

TEST(SchedulerTest, RoutesToTheLeastLoadedReplica) {
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.replicas = 2, .max_slots = 2}));
  for (EngineReplica* r : h.replicas) r->HoldStepsForTest();
  std::vector<SequenceRequest> requests = MakeRequests(4, h.spec.vocab_size, 19, false);
  std::vector<std::shared_ptr<CollectingSink>> sinks;
  for (const SequenceRequest& r : requests) {
    sinks.push_back(std::make_shared<CollectingSink>());
    ASSERT_THAT(h.scheduler->Submit(r, sinks.back()), IsOk());
  }
  const SchedulerStats stats = h.scheduler->Stats();
  ASSERT_EQ(stats.replicas.size(), 2u);
  EXPECT_EQ(stats.replicas[0].running, 2);
  EXPECT_EQ(stats.replicas[1].running, 2);
  for (EngineReplica* r : h.replicas) r->ReleaseStepsForTest();
  for (auto& s : sinks) ASSERT_TRUE(s->Wait());
}

TEST(SchedulerTest, AFailedStepFailsOnlyItsSequences) {
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.max_slots = 1}));
  std::vector<SequenceRequest> requests = MakeRequests(2, h.spec.vocab_size, 47, false);
  for (SequenceRequest& r : requests) r.max_tokens = 5;  // request 0 needs more than one step
  ASSERT_OK_AND_ASSIGN(auto expected, Reference("llama", requests, {}));
  h.replicas[0]->SetStepHookForTest([](const StepInput& in) {
    return in.step_id == 2 ? absl::InternalError("stage 1: out of memory") : absl::OkStatus();
  });
  auto first = std::make_shared<CollectingSink>();
  auto second = std::make_shared<CollectingSink>();
  ASSERT_THAT(h.scheduler->Submit(requests[0], first), IsOk());
  ASSERT_THAT(h.scheduler->Submit(requests[1], second), IsOk());
  ASSERT_TRUE(first->Wait());
  ASSERT_TRUE(second->Wait());
  // With one slot, step 2 holds request 0 only (it has a prompt of several chunks or a decode).
  EXPECT_THAT(first->end().status, StatusIs(absl::StatusCode::kInternal, HasSubstr("out of memory")));
  EXPECT_THAT(second->end().status, IsOk());
  EXPECT_THAT(second->tokens(), ElementsAreArray(expected[1].tokens));
}

TEST(SchedulerTest, ShutdownFailsOutstandingSequencesAndRejectsNewOnes) {
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.max_slots = 1}));
  h.replicas[0]->HoldStepsForTest();
  std::vector<SequenceRequest> requests = MakeRequests(2, h.spec.vocab_size, 53, false);
  auto running = std::make_shared<CollectingSink>();
  auto waiting = std::make_shared<CollectingSink>();
  ASSERT_THAT(h.scheduler->Submit(requests[0], running), IsOk());
  ASSERT_THAT(h.scheduler->Submit(requests[1], waiting), IsOk());
  h.scheduler->Shutdown(absl::UnavailableError("shutting down"));  // interrupts the held step
  for (auto* s : {running.get(), waiting.get()}) {
    ASSERT_EQ(s->ends(), 1);
    EXPECT_THAT(s->end().status, StatusIs(absl::StatusCode::kUnavailable, "shutting down"));
  }
  EXPECT_THAT(h.scheduler->Submit(requests[0], std::make_shared<CollectingSink>()),
              StatusIs(absl::StatusCode::kUnavailable, "shutting down"));
  h.scheduler->Shutdown(absl::UnavailableError("again"));  // idempotent
}

TEST(SchedulerTest, RemovingAReplicaMovesItsSequencesToAnotherAndTheyStayExact) {
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.replicas = 2, .max_slots = 1}));
  std::vector<SequenceRequest> requests = MakeRequests(4, h.spec.vocab_size, 59, false);
  for (SequenceRequest& r : requests) r.max_tokens = 12;
  ASSERT_OK_AND_ASSIGN(auto expected, Reference("llama", requests, {}));
  // Replica 0 delivers a few tokens of its running sequence, then holds its next step.
  h.replicas[1]->HoldStepsForTest();
  h.replicas[0]->SetStepHookForTest([&h](const StepInput& in) {
    if (in.step_id == 8) h.replicas[0]->HoldStepsForTest();
    return absl::OkStatus();
  });
  std::vector<std::shared_ptr<CollectingSink>> sinks;
  for (const SequenceRequest& r : requests) {  // replicas 0, 1, 0, 1: two running, two waiting
    sinks.push_back(std::make_shared<CollectingSink>());
    ASSERT_THAT(h.scheduler->Submit(r, sinks.back()), IsOk());
  }
  ASSERT_TRUE(h.replicas[0]->WaitForStepsForTest(8));
  // Interrupts the held step; its running sequence (with tokens delivered) and its waiting one
  // move to replica 1.
  h.scheduler->RemoveReplica(0, absl::UnavailableError("replica 0 lost: worker w-1 is dead"));
  EXPECT_THAT(h.scheduler->Replicas(), ElementsAreArray({1}));
  EXPECT_EQ(h.scheduler->Stats().replicas[0].waiting + h.scheduler->Stats().replicas[0].running, 4);
  h.replicas[1]->ReleaseStepsForTest();
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(sinks[i]->Wait());
    EXPECT_THAT(sinks[i]->end().status, IsOk()) << i;
    EXPECT_THAT(sinks[i]->tokens(), ElementsAreArray(expected[i].tokens)) << i;
    EXPECT_EQ(sinks[i]->ends(), 1);
  }
  // Without another replica, removal fails what it had.
  auto last = std::make_shared<CollectingSink>();
  h.replicas[1]->HoldStepsForTest();
  ASSERT_THAT(h.scheduler->Submit(requests[0], last), IsOk());
  h.scheduler->RemoveReplica(1, absl::UnavailableError("replica 1 lost"));
  ASSERT_TRUE(last->Wait());
  EXPECT_THAT(last->end().status, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("replica 1 lost")));
  EXPECT_THAT(h.scheduler->Submit(requests[0], std::make_shared<CollectingSink>()),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("no replica")));
}

TEST(SchedulerTest, SequencesOfABrokenPipelineFailOverAndGetTheirTokens) {
  // Replica 0's pipeline breaks (every step from its third on is UNAVAILABLE, as when a worker
  // dies) while it is still listed; its sequences, some with tokens delivered, continue on
  // replica 1 with exactly the tokens they would have had. Errors other than UNAVAILABLE and a
  // single replica still fail a sequence.
  PreemptionCounter counter;
  ASSERT_OK_AND_ASSIGN(Harness h,
                       MakeHarness({.replicas = 2, .max_slots = 3, .max_step_tokens = 8, .observer = &counter}));
  h.replicas[0]->SetStepHookForTest([](const StepInput& in) {
    return in.step_id >= 3 ? absl::UnavailableError("next stage at 10.0.0.2:7100 ended the stream")
                           : absl::OkStatus();
  });
  std::vector<SequenceRequest> requests = MakeRequests(10, h.spec.vocab_size, 61, true);
  RunAndCompare(*h.scheduler, "llama", requests, {}, h.replicas);
  size_t moved = 0;
  std::set<std::string> on_zero;
  for (const StepInput& in : h.replicas[0]->StepInputsForTest()) {
    for (const StepSequenceInput& s : in.sequences) on_zero.insert(s.request_id);
  }
  for (const StepInput& in : h.replicas[1]->StepInputsForTest()) {
    for (const StepSequenceInput& s : in.sequences) moved += on_zero.count(s.request_id);
  }
  EXPECT_GT(moved, 0u) << "some sequences should have moved from replica 0 to replica 1";
  EXPECT_GT(counter.failovers(), 0);
}

TEST(SchedulerTest, ASequenceFailsOverAtMostThreeTimes) {
  // Both replicas' pipelines are broken: the sequence bounces between them, then fails with the
  // last step's error instead of moving on for ever.
  PreemptionCounter counter;
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.replicas = 2, .max_slots = 2, .observer = &counter}));
  for (EngineReplica* r : h.replicas) {
    r->SetStepHookForTest([](const StepInput&) { return absl::UnavailableError("the stream ended"); });
  }
  auto sink = std::make_shared<CollectingSink>();
  ASSERT_THAT(h.scheduler->Submit(MakeRequests(1, h.spec.vocab_size, 63, false)[0], sink), IsOk());
  ASSERT_TRUE(sink->Wait());
  EXPECT_THAT(sink->end().status, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("the stream ended")));
  EXPECT_EQ(counter.failovers(), 3);
  EXPECT_EQ(h.replicas[0]->NumStepsForTest() + h.replicas[1]->NumStepsForTest(), 4);
}

TEST(SchedulerTest, WithNoOtherReplicaABrokenPipelineFailsItsSequences) {
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.max_slots = 2}));
  h.replicas[0]->SetStepHookForTest([](const StepInput&) { return absl::UnavailableError("stage 1 is gone"); });
  auto sink = std::make_shared<CollectingSink>();
  ASSERT_THAT(h.scheduler->Submit(MakeRequests(1, h.spec.vocab_size, 62, false)[0], sink), IsOk());
  ASSERT_TRUE(sink->Wait());
  EXPECT_THAT(sink->end().status, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("stage 1 is gone")));
}

// ---- Recovery: one replica, no lost request ---------------------------------------------------

TEST(SchedulerRecoveryTest, ABrokenPipelineWithNoOtherReplicaRecoversAndItsSequencesStayExact) {
  // The only replica's pipeline breaks for a while (its steps 4 to 9 are UNAVAILABLE, as when a
  // stage worker is restarting) while it stays listed: its sequences, some with tokens delivered,
  // park, are retried on it, and get exactly the tokens they would have had (seeded sampling).
  std::atomic<int> failed{0};
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.max_slots = 3, .max_step_tokens = 8,
                                               .recovery_timeout = absl::Seconds(60)}));
  h.replicas[0]->SetStepHookForTest([&failed](const StepInput& in) {
    if (in.step_id < 4 || in.step_id > 9) return absl::OkStatus();
    failed.fetch_add(1);
    return absl::UnavailableError("stage stream to 10.0.0.2:7100 ended: connection refused");
  });
  RunAndCompare(*h.scheduler, "llama", MakeRequests(8, h.spec.vocab_size, 71, true), {}, h.replicas);
  EXPECT_EQ(failed.load(), 6);
  EXPECT_EQ(h.scheduler->Stats().recovering, 0);
}

TEST(SchedulerRecoveryTest, SequencesOfARemovedOnlyReplicaWaitForTheNextOneAndStayExact) {
  // The only replica is removed (its worker died) with sequences running and waiting, some with
  // tokens delivered; a request arrives while nothing serves. All of them park, and finish with
  // exactly the reference tokens once a new replica (the restarted worker, or a spare) serves.
  const ::shardserve::coordinator::Setup setup{.max_slots = 2, .recovery_timeout = absl::Seconds(60)};
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness(setup));
  std::vector<SequenceRequest> requests = MakeRequests(5, h.spec.vocab_size, 73, false);
  for (SequenceRequest& r : requests) r.max_tokens = 12;
  ASSERT_OK_AND_ASSIGN(auto expected, Reference("llama", requests, {}));
  h.replicas[0]->SetStepHookForTest([&h](const StepInput& in) {
    if (in.step_id == 6) h.replicas[0]->HoldStepsForTest();
    return absl::OkStatus();
  });
  std::vector<std::shared_ptr<CollectingSink>> sinks;
  for (size_t i = 0; i + 1 < requests.size(); ++i) {
    sinks.push_back(std::make_shared<CollectingSink>());
    ASSERT_THAT(h.scheduler->Submit(requests[i], sinks.back()), IsOk());
  }
  ASSERT_TRUE(h.replicas[0]->WaitForStepsForTest(6));
  h.scheduler->RemoveReplica(0, absl::UnavailableError("replica 0 stopped serving: worker w-1 is dead"));
  EXPECT_THAT(h.scheduler->Replicas(), ::testing::IsEmpty());
  EXPECT_EQ(h.scheduler->Stats().recovering, 4);
  EXPECT_GT(sinks[0]->tokens().size(), 0u) << "the first sequence should have streamed tokens before the break";
  sinks.push_back(std::make_shared<CollectingSink>());
  ASSERT_THAT(h.scheduler->Submit(requests.back(), sinks.back()), IsOk()) << "parked, not refused";
  EXPECT_EQ(h.scheduler->Stats().recovering, 5);
  for (const auto& sink : sinks) EXPECT_EQ(sink->ends(), 0);
  ASSERT_THAT(AddEngineReplica(h, setup, 1), IsOk());
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(sinks[i]->Wait());
    EXPECT_THAT(sinks[i]->end().status, IsOk()) << i;
    EXPECT_THAT(sinks[i]->tokens(), ElementsAreArray(expected[i].tokens)) << i;
    EXPECT_EQ(sinks[i]->ends(), 1);
  }
  EXPECT_EQ(h.scheduler->Stats().recovering, 0);
}

TEST(SchedulerRecoveryTest, ParkedSequencesFailAfterTheRecoveryTimeoutAndCancelAtOnce) {
  const ::shardserve::coordinator::Setup setup{.max_slots = 2, .recovery_timeout = absl::Milliseconds(200)};
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness(setup));
  h.replicas[0]->HoldStepsForTest();
  std::vector<SequenceRequest> requests = MakeRequests(2, h.spec.vocab_size, 75, false);
  auto waits = std::make_shared<CollectingSink>();
  auto cancelled = std::make_shared<CollectingSink>();
  ASSERT_OK_AND_ASSIGN(SequenceId waits_id, h.scheduler->Submit(requests[0], waits));
  ASSERT_OK_AND_ASSIGN(SequenceId cancelled_id, h.scheduler->Submit(requests[1], cancelled));
  h.scheduler->RemoveReplica(0, absl::UnavailableError("replica 0 stopped serving: worker w-1 is dead"));
  EXPECT_EQ(h.scheduler->Stats().recovering, 2);
  h.scheduler->Cancel(cancelled_id);
  EXPECT_EQ(cancelled->ends(), 1) << "a parked sequence ends at once when cancelled";
  EXPECT_EQ(cancelled->end().reason, FinishReason::kCancelled);
  ASSERT_TRUE(waits->Wait());
  EXPECT_THAT(waits->end().status, StatusIs(absl::StatusCode::kUnavailable,
                                            AllOf(HasSubstr("recovery timeout"), HasSubstr("w-1 is dead"))));
  EXPECT_EQ(h.scheduler->Stats().recovering, 0);
  h.scheduler->Cancel(waits_id);  // a no-op once ended
  EXPECT_EQ(waits->ends(), 1);
}

TEST(SchedulerRecoveryTest, WithoutRecoveryOrBeforeAnyReplicaServedNothingParks) {
  SchedulerOptions so;
  so.limits = {.vocab_size = 256, .max_seq_len = 128};
  so.recovery_timeout = absl::Seconds(60);
  Scheduler never_served(so);
  EXPECT_THAT(never_served.Submit({.prompt = {1, 2}, .max_tokens = 3}, std::make_shared<CollectingSink>()),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("no replica")));
  so.recovery_timeout = absl::Seconds(-1);
  EXPECT_THAT(so.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("recovery_timeout")));
}

TEST(SchedulerTest, SubmitValidatesTheRequest) {
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({}));  // llama: vocab 256, context 128
  auto sink = std::make_shared<CollectingSink>();
  SequenceRequest ok{.prompt = {1, 2, 3}, .max_tokens = 4};
  auto with = [&](auto edit) {
    SequenceRequest r = ok;
    edit(r);
    return h.scheduler->Submit(r, sink).status();
  };
  EXPECT_THAT(with([](SequenceRequest& r) { r.prompt.clear(); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("prompt is empty")));
  EXPECT_THAT(with([](SequenceRequest& r) { r.prompt[1] = 256; }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("prompt.token_ids[1] = 256")));
  EXPECT_THAT(with([](SequenceRequest& r) { r.prompt.assign(128, 5); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("prompt is too long: 128 tokens")));
  EXPECT_THAT(with([](SequenceRequest& r) { r.max_tokens = 0; }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_tokens must be >= 1")));
  EXPECT_THAT(with([](SequenceRequest& r) { r.max_tokens = 126; }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_tokens can be at most 125")));
  EXPECT_THAT(with([](SequenceRequest& r) { r.sampling.temperature = -1; }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("sampling.temperature")));
  EXPECT_THAT(with([](SequenceRequest& r) { r.sampling.top_p = 1.5f; }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("sampling.top_p")));
  EXPECT_THAT(with([](SequenceRequest& r) { r.sampling.top_k = -2; }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("sampling.top_k")));
  EXPECT_THAT(with([](SequenceRequest& r) { r.stop_token_ids = {3, -1}; }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("stop_token_ids[1] = -1")));
  EXPECT_EQ(sink->ends(), 0);
  // The longest request that fits: prompt + max_tokens = the context.
  RunAndCompare(*h.scheduler, "llama", {SequenceRequest{.prompt = {1, 2, 3}, .max_tokens = 125}}, {});
}

// ---- Paged KV cache and preemption -------------------------------------------------------------

TEST(SchedulerKvTest, PreemptionUnderATinyKvBudgetKeepsEveryOutputIdentical) {
  // Blocks of 4 tokens, 11 in all: the longest request (prompt <= 23 + max_tokens <= 18) needs at
  // most 10, so every request fits alone but a handful running together do not. Mixed greedy and
  // seeded sampling, different lengths, more slots than the cache can feed.
  PreemptionCounter counter;
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.max_slots = 6, .max_step_tokens = 8, .kv_blocks = 11,
                                               .kv_block_size = 4, .observer = &counter}));
  std::vector<SequenceRequest> requests = MakeRequests(8, h.spec.vocab_size, 71, false);
  for (const SequenceRequest& r : MakeRequests(8, h.spec.vocab_size, 72, true)) requests.push_back(r);
  for (size_t i = 8; i < requests.size(); ++i) requests[i].request_id = absl::StrCat("sampled-", i);
  RunAndCompare(*h.scheduler, "llama", requests, {}, h.replicas);
  EXPECT_GT(counter.preempted(), 0) << "the budget should have forced preemption";
  ExpectSoundBlockTables(*h.replicas[0], 4, 6);
  const SchedulerStats stats = h.scheduler->Stats();
  EXPECT_EQ(stats.replicas[0].kv_blocks_total, 11);
  EXPECT_EQ(stats.replicas[0].kv_blocks_used, 0);
  // A preempted sequence is recomputed with its generated tokens in the prompt: from the end of
  // whatever prefix of it is still cached (position 0 when nothing is), so it steps back.
  std::map<std::string, int64_t> written_to;
  int64_t recomputed = 0;
  for (const StepInput& in : h.replicas[0]->StepInputsForTest()) {
    for (const StepSequenceInput& s : in.sequences) {
      auto it = written_to.find(s.request_id);
      if (it != written_to.end() && s.pos_begin < it->second) ++recomputed;
      written_to[s.request_id] = s.pos_begin + static_cast<int64_t>(s.token_ids.size());
    }
  }
  EXPECT_GT(recomputed, 0);
  EXPECT_LE(recomputed, counter.preempted());  // some were preempted before their first step
}

TEST(SchedulerKvTest, PriorityPreemptionUnderATinyKvBudgetKeepsEveryOutputIdentical) {
  // The budget of the test above, with priorities: the waiting queue is ordered by them and the
  // victims are the worst-ranked, so sequences are preempted and recomputed in other orders than
  // with fcfs; every output must still be what the engine alone gives.
  PreemptionCounter counter;
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.max_slots = 6, .max_step_tokens = 8, .kv_blocks = 11,
                                               .kv_block_size = 4, .observer = &counter,
                                               .policy = SchedulingPolicy::kPriority}));
  std::vector<SequenceRequest> requests = MakeRequests(8, h.spec.vocab_size, 71, false);
  for (const SequenceRequest& r : MakeRequests(8, h.spec.vocab_size, 72, true)) requests.push_back(r);
  for (size_t i = 0; i < requests.size(); ++i) requests[i].priority = static_cast<int32_t>((i * 7) % 5) - 2;
  RunAndCompare(*h.scheduler, "llama", requests, {}, h.replicas);
  EXPECT_GT(counter.preempted(), 0) << "the budget should have forced preemption";
  ExpectSoundBlockTables(*h.replicas[0], 4, 6);
}

// Records prompt logprobs (each before any token) and tokens.
class PromptLogprobsSink final : public SequenceSink {
 public:
  void OnPromptLogprobs(absl::Span<const TokenLogprobs> logprobs) override {
    absl::MutexLock lock(&mu_);
    EXPECT_TRUE(tokens_.empty()) << "prompt logprobs after a token";
    for (const TokenLogprobs& lp : logprobs) prompt_.push_back(lp.logprob);
  }
  void OnTokens(absl::Span<const int32_t> tokens, absl::Span<const TokenLogprobs> /*logprobs*/) override {
    absl::MutexLock lock(&mu_);
    tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  }
  void OnEnd(const SequenceEnd& end) override {
    EXPECT_TRUE(end.status.ok()) << end.status;
    done_.Notify();
  }
  bool Wait() { return done_.WaitForNotificationWithTimeout(kWait); }
  std::vector<float> prompt() const {
    absl::MutexLock lock(&mu_);
    return prompt_;
  }
  std::vector<int32_t> tokens() const {
    absl::MutexLock lock(&mu_);
    return tokens_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<float> prompt_ ABSL_GUARDED_BY(mu_);
  std::vector<int32_t> tokens_ ABSL_GUARDED_BY(mu_);
  absl::Notification done_;
};

TEST(SchedulerKvTest, PromptLogprobsComeOnceEachThroughPreemptionAndChunks) {
  // The tiny KV budget of the test above forces preemption (some mid-prompt); every sequence still
  // gets each prompt token's logprob exactly once, equal to what it gets alone on a large cache,
  // and the same tokens.
  const std::vector<SequenceRequest> requests = [] {
    std::vector<SequenceRequest> r = MakeRequests(12, 256, 73, false);  // the llama golden model's vocabulary
    for (SequenceRequest& q : r) q.prompt_logprobs = true;
    return r;
  }();
  auto run = [&](int32_t max_slots, int64_t max_step_tokens, int64_t kv_blocks, int32_t kv_block_size,
                 PreemptionCounter* counter) {
    auto h = MakeHarness({.max_slots = max_slots, .max_step_tokens = max_step_tokens, .kv_blocks = kv_blocks,
                          .kv_block_size = kv_block_size, .observer = counter});
    EXPECT_TRUE(h.ok()) << h.status();
    std::vector<std::shared_ptr<PromptLogprobsSink>> sinks;
    for (const SequenceRequest& r : requests) {
      sinks.push_back(std::make_shared<PromptLogprobsSink>());
      EXPECT_TRUE(h->scheduler->Submit(r, sinks.back()).ok());
    }
    for (auto& sink : sinks) EXPECT_TRUE(sink->Wait());
    return sinks;
  };
  PreemptionCounter tight, roomy;
  const auto got = run(6, 8, 11, 4, &tight);
  const auto alone = run(1, 64, 0, 16, &roomy);
  EXPECT_GT(tight.preempted(), 0);
  EXPECT_EQ(roomy.preempted(), 0);
  for (size_t i = 0; i < requests.size(); ++i) {
    SCOPED_TRACE(requests[i].request_id);
    const std::vector<float> a = got[i]->prompt(), b = alone[i]->prompt();
    ASSERT_EQ(a.size(), requests[i].prompt.size() - 1);
    ASSERT_EQ(b.size(), a.size());
    for (size_t k = 0; k < a.size(); ++k) EXPECT_NEAR(a[k], b[k], 1e-4) << "prompt token " << k + 1;
    EXPECT_EQ(got[i]->tokens(), alone[i]->tokens());
  }
}

TEST(SchedulerKvTest, WithoutPrefixCachingAPreemptedSequenceRestartsAtPositionZero) {
  PreemptionCounter counter;
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.max_slots = 6, .max_step_tokens = 8, .kv_blocks = 11,
                                               .kv_block_size = 4, .observer = &counter,
                                               .prefix_caching = false}));
  RunAndCompare(*h.scheduler, "llama", MakeRequests(12, h.spec.vocab_size, 71, false), {}, h.replicas);
  EXPECT_GT(counter.preempted(), 0);
  EXPECT_EQ(counter.looked_up_tokens(), 0) << "no lookups with prefix caching off";
  std::map<std::string, int64_t> starts;
  for (const StepInput& in : h.replicas[0]->StepInputsForTest()) {
    for (const StepSequenceInput& s : in.sequences) starts[s.request_id] += s.pos_begin == 0 ? 1 : 0;
  }
  int64_t restarts = 0;
  for (const auto& [id, n] : starts) restarts += n - 1;
  EXPECT_GT(restarts, 0);
  EXPECT_EQ(h.scheduler->Stats().replicas[0].kv_blocks_cached, 0);
}

TEST(SchedulerKvTest, PipelineReplicaWithTinyKvBudgetMatchesOneProcess) {
  PreemptionCounter counter;
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.model = "qwen2_moe", .max_slots = 4, .max_step_tokens = 6,
                                               .stage_starts = {1}, .kv_blocks = 14, .kv_block_size = 3,
                                               .observer = &counter}));
  RunAndCompare(*h.scheduler, "qwen2_moe", MakeRequests(8, h.spec.vocab_size, 73, true), {}, h.replicas);
  EXPECT_GT(counter.preempted(), 0);
}

TEST(SchedulerKvTest, CancellingAPreemptedSequenceEndsItAtOnceAndFreesItsBlocks) {
  // Two sequences of 4 + 30 tokens in 9 blocks of 4: each fits alone (33 positions), both do not,
  // so the newer one is preempted; the step hook cancels it while it waits.
  PreemptionCounter counter;
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.max_slots = 2, .max_step_tokens = 8, .kv_blocks = 9,
                                               .kv_block_size = 4, .observer = &counter}));
  std::vector<SequenceRequest> requests = MakeRequests(2, h.spec.vocab_size, 75, false);
  for (SequenceRequest& r : requests) {
    r.prompt.resize(4, 1);
    r.max_tokens = 30;
  }
  ASSERT_OK_AND_ASSIGN(auto expected, Reference("llama", requests, {}));
  auto older = std::make_shared<CollectingSink>();
  auto newer = std::make_shared<CollectingSink>();
  std::atomic<SequenceId> newer_id{0};
  std::atomic<bool> cancelled_while_waiting{false};
  absl::Notification submitted;
  Scheduler* scheduler = h.scheduler.get();
  h.replicas[0]->SetStepHookForTest([&](const StepInput& in) {
    if (in.step_id == 1 && !submitted.WaitForNotificationWithTimeout(kWait)) {
      return absl::DeadlineExceededError("test never submitted");
    }
    if (!cancelled_while_waiting && counter.preempted() > 0 && scheduler->Stats().waiting == 1) {
      cancelled_while_waiting = true;
      scheduler->Cancel(newer_id);  // waiting: ends on this thread, at once
      EXPECT_EQ(newer->ends(), 1);
    }
    return absl::OkStatus();
  });
  ASSERT_THAT(h.scheduler->Submit(requests[0], older), IsOk());
  ASSERT_OK_AND_ASSIGN(SequenceId id, h.scheduler->Submit(requests[1], newer));
  newer_id = id;
  submitted.Notify();
  ASSERT_TRUE(older->Wait());
  ASSERT_TRUE(newer->Wait());
  ASSERT_TRUE(cancelled_while_waiting) << "the newer sequence was never preempted";
  EXPECT_EQ(newer->end().reason, FinishReason::kCancelled);
  const std::vector<int32_t> got = newer->tokens();
  ASSERT_LT(got.size(), expected[1].tokens.size());
  EXPECT_THAT(got, ElementsAreArray(expected[1].tokens.begin(), expected[1].tokens.begin() + got.size()));
  EXPECT_THAT(older->tokens(), ElementsAreArray(expected[0].tokens));
  const SchedulerStats stats = h.scheduler->Stats();
  EXPECT_EQ(stats.running + stats.waiting, 0);
  EXPECT_EQ(stats.replicas[0].kv_blocks_used, 0);
}

TEST(SchedulerKvTest, CancellingARunningSequenceGivesItsBlocksBack) {
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.max_slots = 2, .kv_blocks = 20, .kv_block_size = 4}));
  h.replicas[0]->HoldStepsForTest();
  std::vector<SequenceRequest> requests = MakeRequests(2, h.spec.vocab_size, 77, false);
  requests[0].prompt.assign(9, 5);  // its first chunk (5 tokens) takes 2 blocks at admission
  auto first = std::make_shared<CollectingSink>();
  auto second = std::make_shared<CollectingSink>();
  ASSERT_OK_AND_ASSIGN(SequenceId a, h.scheduler->Submit(requests[0], first));
  ASSERT_OK_AND_ASSIGN(SequenceId b, h.scheduler->Submit(requests[1], second));
  EXPECT_GT(h.scheduler->Stats().replicas[0].kv_blocks_used, 0);  // admitted with their first chunks
  h.scheduler->Cancel(a);
  h.scheduler->Cancel(b);
  h.replicas[0]->ReleaseStepsForTest();
  ASSERT_TRUE(first->Wait());
  ASSERT_TRUE(second->Wait());
  EXPECT_EQ(first->end().reason, FinishReason::kCancelled);
  EXPECT_EQ(second->end().reason, FinishReason::kCancelled);
  const SchedulerStats stats = h.scheduler->Stats();
  EXPECT_EQ(stats.running, 0);
  EXPECT_EQ(stats.replicas[0].kv_blocks_used, 0);
  EXPECT_EQ(stats.replicas[0].kv_blocks_total, 20);
}

TEST(SchedulerKvTest, RequestsThatCanNeverFitAreRefusedAtSubmit) {
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.kv_blocks = 4, .kv_block_size = 4}));  // 16 positions
  auto sink = std::make_shared<CollectingSink>();
  // 10 + 7 tokens write 16 positions (the last token is never fed back): it fits; one more does not.
  SequenceRequest fits{.prompt = std::vector<int32_t>(10, 3), .max_tokens = 7};
  SequenceRequest too_long = fits;
  too_long.max_tokens = 8;
  EXPECT_THAT(h.scheduler->Submit(too_long, sink),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the prompt (10 tokens) and max_tokens (8) need 5 KV cache blocks of 4 tokens; the "
                                 "largest replica has 4 blocks")));
  EXPECT_EQ(sink->ends(), 0);
  RunAndCompare(*h.scheduler, "llama", {fits}, {});
}

TEST(SchedulerKvTest, AddReplicaValidatesTheKvCache) {
  Scheduler scheduler(SchedulerOptions{.limits = {.vocab_size = 10, .max_seq_len = 8}});
  ASSERT_OK_AND_ASSIGN(auto replica, EngineReplica::Create({.model_dir = ModelDir("llama")}));
  EXPECT_THAT(scheduler.AddReplica(0, std::move(replica), {.kv_blocks = 0}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("kv_blocks must be in [1, 2^31 - 1], got 0")));
  ASSERT_OK_AND_ASSIGN(replica, EngineReplica::Create({.model_dir = ModelDir("llama")}));
  EXPECT_THAT(scheduler.AddReplica(0, std::move(replica), {.kv_blocks = 4, .kv_block_size = 0}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("kv_block_size must be >= 1")));
}


// ---- Prefix caching ----------------------------------------------------------------------------

// `n` requests that start with the same `shared` tokens, then differ (each its own suffix of 1-9
// tokens), half greedy and half seeded sampling.
std::vector<SequenceRequest> SharedPrefixRequests(int n, int shared, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> prefix;
  for (int t = 0; t < shared; ++t) prefix.push_back(static_cast<int32_t>(rng() % vocab));
  std::vector<SequenceRequest> out;
  for (int i = 0; i < n; ++i) {
    SequenceRequest r;
    r.request_id = absl::StrCat("shared-", i);
    r.prompt = prefix;
    const int suffix = 1 + static_cast<int>(rng() % 9);
    for (int t = 0; t < suffix; ++t) r.prompt.push_back(static_cast<int32_t>(rng() % vocab));
    r.max_tokens = 2 + static_cast<int32_t>(rng() % 10);
    if (i % 2 == 1) r.sampling = {.temperature = 0.8f, .top_k = 20, .top_p = 0.9f, .seed = 500u + static_cast<uint64_t>(i)};
    out.push_back(std::move(r));
  }
  return out;
}

// The position each request's first step started at.
std::map<std::string, int64_t> FirstPositions(const EngineReplica& replica) {
  std::map<std::string, int64_t> first;
  for (const StepInput& in : replica.StepInputsForTest()) {
    for (const StepSequenceInput& s : in.sequences) first.try_emplace(s.request_id, s.pos_begin);
  }
  return first;
}

TEST(SchedulerPrefixTest, LaterRequestsReuseTheCachedPrefixAndGetTheSameTokens) {
  PreemptionCounter counter;
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.max_slots = 4, .max_step_tokens = 8, .kv_blocks = 40,
                                               .kv_block_size = 4, .observer = &counter}));
  const std::vector<SequenceRequest> requests = SharedPrefixRequests(6, 18, h.spec.vocab_size, 81);
  // The first request alone: nothing is cached yet, it computes everything.
  RunAndCompare(*h.scheduler, "llama", {requests[0]}, {});
  EXPECT_EQ(counter.cached_tokens(), 0);
  EXPECT_GT(h.scheduler->Stats().replicas[0].kv_blocks_cached, 0);
  // Then the others together: each finds the 16 tokens of the shared prefix in 4 full blocks (the
  // 18 shared tokens end inside the fifth block, which is not shared).
  std::vector<SequenceRequest> rest(requests.begin() + 1, requests.end());
  ASSERT_OK_AND_ASSIGN(auto expected, Reference("llama", rest, {}));
  std::vector<std::shared_ptr<CollectingSink>> sinks;
  h.replicas[0]->HoldStepsForTest();
  for (const SequenceRequest& r : rest) {
    sinks.push_back(std::make_shared<CollectingSink>());
    ASSERT_THAT(h.scheduler->Submit(r, sinks.back()), IsOk());
  }
  h.replicas[0]->ReleaseStepsForTest();
  for (size_t i = 0; i < rest.size(); ++i) {
    ASSERT_TRUE(sinks[i]->Wait());
    EXPECT_THAT(sinks[i]->end().status, IsOk());
    EXPECT_THAT(sinks[i]->tokens(), ElementsAreArray(expected[i].tokens)) << rest[i].request_id;
    EXPECT_EQ(sinks[i]->end().cached_prompt_tokens, 16) << rest[i].request_id;
  }
  const std::map<std::string, int64_t> first = FirstPositions(*h.replicas[0]);
  EXPECT_EQ(first.at("shared-0"), 0);
  for (const SequenceRequest& r : rest) EXPECT_EQ(first.at(r.request_id), 16) << r.request_id;
  EXPECT_GE(counter.cached_tokens(), 16 * static_cast<int64_t>(rest.size()));
  ExpectSoundBlockTables(*h.replicas[0], 4, 4);
  const SchedulerStats stats = h.scheduler->Stats();
  EXPECT_EQ(stats.replicas[0].kv_blocks_used, 0);
}

TEST(SchedulerPrefixTest, AWholePromptInCachedBlocksStillComputesItsLastToken) {
  // A prompt of exactly 3 blocks asked twice: the second time the first 2 blocks are reused and
  // the third is recomputed (its last token's logits are needed), into a block of its own.
  PreemptionCounter counter;
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.max_slots = 2, .max_step_tokens = 16, .kv_blocks = 20,
                                               .kv_block_size = 4, .observer = &counter}));
  SequenceRequest r = SharedPrefixRequests(1, 12, h.spec.vocab_size, 82)[0];
  r.prompt.resize(12);
  r.max_tokens = 5;
  RunAndCompare(*h.scheduler, "llama", {r}, {});
  r.request_id = "again";
  RunAndCompare(*h.scheduler, "llama", {r}, {});
  EXPECT_EQ(counter.cached_tokens(), 8);
  EXPECT_EQ(FirstPositions(*h.replicas[0]).at("again"), 8);
  ExpectSoundBlockTables(*h.replicas[0], 4, 2);
}

TEST(SchedulerPrefixTest, SharedPrefixesUnderATinyKvBudgetWithPipelining) {
  // Eviction, preemption, sharing and two micro-batches in flight at once on a 2-stage replica:
  // every output stays identical to the request run alone, and every block comes back.
  PreemptionCounter counter;
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.model = "qwen2_moe", .max_slots = 5, .max_step_tokens = 7,
                                               .stage_starts = {1}, .kv_blocks = 16, .kv_block_size = 3,
                                               .observer = &counter, .pipeline_depth = 2}));
  std::vector<SequenceRequest> requests = SharedPrefixRequests(8, 10, h.spec.vocab_size, 83);
  for (const SequenceRequest& r : SharedPrefixRequests(6, 7, h.spec.vocab_size, 84)) requests.push_back(r);
  for (size_t i = 8; i < requests.size(); ++i) requests[i].request_id = absl::StrCat("other-", i);
  RunAndCompare(*h.scheduler, "qwen2_moe", requests, {}, h.replicas);
  EXPECT_GT(counter.cached_tokens(), 0);
  EXPECT_GT(counter.preempted(), 0) << "the budget should have forced preemption";
  ExpectSoundBlockTables(*h.replicas[0], 3, 5);
}


namespace multi_step {

// The most decode steps any step of `replica` asked for.
int32_t MaxDecodeSteps(const EngineReplica& replica) {
  int32_t most = 0;
  for (const StepInput& in : replica.StepInputsForTest()) most = std::max(most, in.decode_steps);
  return most;
}

class SchedulerMultiStepTest : public ::testing::TestWithParam<int32_t> {};

// k decode steps per call give the tokens of k single steps (and of the engine alone), greedy and
// seeded, with max_tokens ending sequences anywhere inside a call; blocks come back.
TEST_P(SchedulerMultiStepTest, TokensMatchTheEngineAlone) {
  for (const bool sampled : {false, true}) {
    SCOPED_TRACE(sampled ? "seeded sampling" : "greedy");
    ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.max_slots = 3,
                                                 .max_step_tokens = 8,
                                                 .decode_steps_per_call = GetParam(),
                                                 .stages = 1}));
    std::vector<SequenceRequest> requests = MakeRequests(8, h.spec.vocab_size, sampled ? 31 : 29, sampled);
    for (size_t i = 0; i < requests.size(); i += 2) requests[i].max_tokens += 20;  // some run several calls
    RunAndCompare(*h.scheduler, "llama", requests, {}, h.replicas);
    EXPECT_EQ(MaxDecodeSteps(*h.replicas[0]), GetParam()) << "no call ran the full decode_steps_per_call";
    ExpectSoundBlockTables(*h.replicas[0], 16, 3);
    for (const StepInput& in : h.replicas[0]->StepInputsForTest()) {
      if (in.decode_steps == 1) continue;
      for (const StepSequenceInput& seq : in.sequences) {
        EXPECT_EQ(seq.NumTokens(), 1) << "a prefill chunk in a multi-step call " << in.step_id;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Steps, SchedulerMultiStepTest, ::testing::Values(4, 8));

// A stop id, the EOS, and max_tokens inside a call end the sequence exactly there: no later token
// reaches the sink, usage counts what was delivered, and the blocks come back.
TEST(SchedulerMultiStepTest, StopsInsideACallAreExact) {
  const std::string model = "llama";
  ASSERT_OK_AND_ASSIGN(Harness probe, MakeHarness({}));
  std::vector<SequenceRequest> base = MakeRequests(1, probe.spec.vocab_size, 21, false);
  base[0].max_tokens = 24;
  ASSERT_OK_AND_ASSIGN(auto free_run, Reference(model, base, {}));
  // A token first generated inside the first multi-step call (tokens 1..8: token 0 comes with the
  // prefill), not at its end.
  const std::vector<int32_t>& t = free_run[0].tokens;
  size_t at = 2;
  while (at < 7 && at < t.size() && std::find(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(at), t[at]) != t.begin() + static_cast<std::ptrdiff_t>(at)) ++at;
  ASSERT_LT(at, std::min<size_t>(7, t.size())) << "no fresh token inside the first call";
  const int32_t stop = t[at];
  std::vector<SequenceRequest> requests(4, base[0]);
  requests[0].stop_token_ids = {stop};
  requests[2].ignore_eos = true;
  requests[3].max_tokens = 7;  // ends in the middle of the first call
  requests[3].ignore_eos = true;
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.max_slots = 4, .max_step_tokens = 64, .eos = {stop},
                                               .decode_steps_per_call = 8, .stages = 1}));
  RunAndCompare(*h.scheduler, model, requests, {stop}, h.replicas);
  ASSERT_OK_AND_ASSIGN(auto expected, Reference(model, requests, {stop}));
  EXPECT_EQ(expected[0].finish, engine::FinishReason::kStop);
  EXPECT_EQ(expected[0].tokens.size(), at + 1);
  EXPECT_EQ(expected[3].tokens.size(), 7u);
  EXPECT_EQ(MaxDecodeSteps(*h.replicas[0]), 8);
}

// Batches that need the coordinator per token run one step per call: penalties, logit_bias,
// logprobs, min_tokens still suppressing, and a replica not known to have one stage.
TEST(SchedulerMultiStepTest, IneligibleBatchesRunOneStepPerCall) {
  ASSERT_OK_AND_ASSIGN(Harness probe, MakeHarness({}));
  std::vector<SequenceRequest> base = MakeRequests(1, probe.spec.vocab_size, 5, false);
  base[0].max_tokens = 12;
  std::vector<std::vector<SequenceRequest>> cases(4, base);
  cases[0][0].sampling.repetition_penalty = 1.3f;
  cases[1][0].sampling.logit_bias = {{3, 2.0f}};
  cases[2][0].logprobs = true;
  cases[3][0].min_tokens = 12;
  cases[3][0].stop_token_ids = {0};
  for (size_t c = 0; c < cases.size(); ++c) {
    ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.decode_steps_per_call = 8, .stages = 1}));
    auto sink = std::make_shared<CollectingSink>();
    ASSERT_THAT(h.scheduler->Submit(cases[c][0], sink), IsOk());
    ASSERT_TRUE(sink->Wait());
    EXPECT_THAT(sink->end().status, IsOk());
    EXPECT_EQ(sink->tokens().size(), 12u) << "case " << c;
    EXPECT_EQ(MaxDecodeSteps(*h.replicas[0]), 1) << "case " << c;
  }
  // Eligible requests on a replica whose stage count is not known (or above one).
  for (const int32_t stages : {0, 2}) {
    ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.decode_steps_per_call = 8, .stages = stages}));
    auto sink = std::make_shared<CollectingSink>();
    ASSERT_THAT(h.scheduler->Submit(base[0], sink), IsOk());
    ASSERT_TRUE(sink->Wait());
    EXPECT_EQ(MaxDecodeSteps(*h.replicas[0]), 1) << stages << " stages";
  }
  // Control: the same request does run several steps per call on a 1-stage replica.
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.decode_steps_per_call = 8, .stages = 1}));
  auto sink = std::make_shared<CollectingSink>();
  ASSERT_THAT(h.scheduler->Submit(base[0], sink), IsOk());
  ASSERT_TRUE(sink->Wait());
  EXPECT_GT(MaxDecodeSteps(*h.replicas[0]), 1);
}

// With too few free blocks for the lookahead, a call runs one step and preempts nobody for it:
// two sequences that each end up needing 3 of the 5 blocks. The outputs stay exact, and there are
// no more preemptions than with one step per call.
TEST(SchedulerMultiStepTest, ATinyKvBudgetFallsBackWithoutPreemptingForLookahead) {
  int preempted_single = -1;
  for (const int32_t steps : {1, 8}) {
    SCOPED_TRACE(absl::StrCat(steps, " decode steps per call"));
    PreemptionCounter counter;
    ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.max_slots = 2, .max_step_tokens = 8, .kv_blocks = 5,
                                                 .kv_block_size = 4, .observer = &counter,
                                                 .decode_steps_per_call = steps, .stages = 1}));
    std::vector<SequenceRequest> requests = MakeRequests(2, h.spec.vocab_size, 17, false);
    for (SequenceRequest& r : requests) {
      r.prompt.resize(3, 1);
      r.max_tokens = 9;
      r.ignore_eos = true;
    }
    RunAndCompare(*h.scheduler, "llama", requests, {}, h.replicas);
    ExpectSoundBlockTables(*h.replicas[0], 4, 2);
    if (steps == 1) {
      preempted_single = counter.preempted();
      continue;
    }
    EXPECT_LE(counter.preempted(), preempted_single);
    bool fell_back = false;  // a decode-only call of both sequences that ran one step
    for (const StepInput& in : h.replicas[0]->StepInputsForTest()) {
      bool decodes = in.sequences.size() == 2;
      for (const StepSequenceInput& seq : in.sequences) decodes = decodes && seq.token_ids.size() == 1;
      fell_back = fell_back || (decodes && in.decode_steps == 1);
    }
    EXPECT_TRUE(fell_back);
    EXPECT_GT(MaxDecodeSteps(*h.replicas[0]), 1);
  }
}

TEST(SchedulerMultiStepTest, DecodeStepsPerCallIsValidated) {
  SchedulerOptions so;
  so.limits = {.vocab_size = 10, .max_seq_len = 10};
  so.decode_steps_per_call = -1;
  EXPECT_THAT(so.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("decode_steps_per_call")));
  so.decode_steps_per_call = kAutoDecodeStepsPerCall;  // 0: each replica chooses
  EXPECT_THAT(so.Validate(), IsOk());
  so.decode_steps_per_call = kMaxDecodeStepsPerCall + 1;
  EXPECT_THAT(so.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("decode_steps_per_call")));
  so.decode_steps_per_call = kMaxDecodeStepsPerCall;
  EXPECT_THAT(so.Validate(), IsOk());
}

}  // namespace multi_step

namespace overlap {

// The steps of `replica` that continued the one before (a from_previous sequence), checking each:
// the step recorded just before it asked the replica to remember its samples and sampled every
// sequence it continues, which it continues right after that step's positions and sample indices.
int CheckOverlappedSteps(const EngineReplica& replica) {
  const std::vector<StepInput> steps = replica.StepInputsForTest();
  int overlapped = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    const StepInput& in = steps[i];
    bool any = false;
    for (const StepSequenceInput& s : in.sequences) {
      if (!s.from_previous) continue;
      any = true;
      EXPECT_TRUE(s.token_ids.empty()) << "step " << in.step_id;
      EXPECT_TRUE(in.remember_samples) << "step " << in.step_id;
      if (i == 0) {
        ADD_FAILURE() << "the first step continues nothing";
        continue;
      }
      const StepInput& before = steps[i - 1];
      EXPECT_TRUE(before.remember_samples) << "step " << before.step_id << " before step " << in.step_id;
      auto it = std::find_if(before.sequences.begin(), before.sequences.end(),
                             [&s](const StepSequenceInput& b) { return b.sequence_id == s.sequence_id; });
      if (it == before.sequences.end()) {
        ADD_FAILURE() << "step " << in.step_id << " continues sequence " << s.sequence_id << " that step "
                      << before.step_id << " did not have";
        continue;
      }
      EXPECT_TRUE(it->sample);
      EXPECT_EQ(s.pos_begin, it->pos_begin + it->NumTokens() - 1 + before.decode_steps) << "step " << in.step_id;
      EXPECT_EQ(s.sample_index, it->sample_index + static_cast<uint64_t>(before.decode_steps)) << "step " << in.step_id;
    }
    overlapped += any ? 1 : 0;
  }
  return overlapped;
}

// The in-process replica answers a tiny model's step in microseconds, often before the other step
// loop has built the continuation; a worker's answer takes a round trip. So a call that may be
// continued (it remembers its samples) waits for the next call to arrive, up to 50 ms, before it
// runs, as a slower replica would; then `also` (may be null) runs.
EngineReplica::StepHook AsSlowAsAWorker(EngineReplica* replica, EngineReplica::StepHook also = nullptr) {
  return [replica, also](const StepInput& in) {
    if (in.remember_samples) {
      replica->WaitForStepsForTest(replica->NumStepsForTest() + 1, absl::Milliseconds(50));
    }
    return also ? also(in) : absl::OkStatus();
  };
}

class SchedulerOverlapTest : public ::testing::TestWithParam<int32_t> {};

// Overlapped decode calls, with one decode step per call and several: greedy and seeded tokens,
// stop ids and max_tokens reached inside a call whose continuation is already sent, are those of
// the engine alone; every block comes back; and without the option (or the client's support, or
// one stage) no call is overlapped.
TEST_P(SchedulerOverlapTest, TokensMatchTheEngineAlone) {
  for (const bool sampled : {false, true}) {
    SCOPED_TRACE(sampled ? "seeded sampling" : "greedy");
    std::vector<int32_t> eos;
    {
      ASSERT_OK_AND_ASSIGN(Harness probe, MakeHarness({}));
      std::vector<SequenceRequest> requests = MakeRequests(8, probe.spec.vocab_size, sampled ? 41 : 43, sampled);
      for (size_t i = 0; i < requests.size(); i += 2) requests[i].max_tokens += 20;
      // A stop id some request generates in its middle (the reference tells where).
      ASSERT_OK_AND_ASSIGN(auto free_run, Reference("llama", requests, {}));
      for (const auto& r : free_run) {
        if (r.tokens.size() >= 8) {
          eos = {r.tokens[5]};
          break;
        }
      }
      ASSERT_FALSE(eos.empty());
      for (const bool on : {true, false}) {
        SCOPED_TRACE(on ? "overlapped" : "not overlapped");
        ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.max_slots = 3,
                                                     .max_step_tokens = 8,
                                                     .eos = eos,
                                                     .decode_steps_per_call = GetParam(),
                                                     .stages = 1,
                                                     .overlap = on}));
        h.replicas[0]->SetStepHookForTest(AsSlowAsAWorker(h.replicas[0]));
        RunAndCompare(*h.scheduler, "llama", requests, eos, h.replicas);
        const int overlapped = CheckOverlappedSteps(*h.replicas[0]);
        if (on) {
          EXPECT_GT(overlapped, 0) << "no call continued the one before it";
        } else {
          EXPECT_EQ(overlapped, 0);
        }
        ExpectSoundBlockTables(*h.replicas[0], 16, 3);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Steps, SchedulerOverlapTest, ::testing::Values(1, 4));

TEST(SchedulerOverlapTest, OnlyWhereTheClientTakesThemAndTheReplicaHasOneStage) {
  ASSERT_OK_AND_ASSIGN(Harness probe, MakeHarness({}));
  std::vector<SequenceRequest> requests = MakeRequests(4, probe.spec.vocab_size, 47, false);
  for (SequenceRequest& r : requests) r.max_tokens = 12;
  for (const int32_t stages : {0, 2}) {
    ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.max_step_tokens = 8, .stages = stages}));
    h.replicas[0]->SetStepHookForTest(AsSlowAsAWorker(h.replicas[0]));
    RunAndCompare(*h.scheduler, "llama", requests, {}, h.replicas);
    EXPECT_EQ(CheckOverlappedSteps(*h.replicas[0]), 0) << stages << " stages";
  }
  // A client that does not take them (an older worker).
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.max_step_tokens = 8, .stages = 1}));
  h.replicas[0]->SetOverlapsDecodeCallsForTest(false);
  h.replicas[0]->SetStepHookForTest(AsSlowAsAWorker(h.replicas[0]));
  RunAndCompare(*h.scheduler, "llama", requests, {}, h.replicas);
  EXPECT_EQ(CheckOverlappedSteps(*h.replicas[0]), 0);
  // Control: the same requests do overlap where it takes them.
  ASSERT_OK_AND_ASSIGN(Harness on, MakeHarness({.max_step_tokens = 8, .stages = 1}));
  on.replicas[0]->SetStepHookForTest(AsSlowAsAWorker(on.replicas[0]));
  RunAndCompare(*on.scheduler, "llama", requests, {}, on.replicas);
  EXPECT_GT(CheckOverlappedSteps(*on.replicas[0]), 0);
}

// A sequence cancelled while its overlapped call runs gets nothing from it (nor after): its tokens
// are a prefix of its free run; the others are exact.
TEST(SchedulerOverlapTest, ACancelDuringAnOverlappedCallDeliversNothingMore) {
  ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.max_slots = 2, .max_step_tokens = 8, .stages = 1}));
  std::vector<SequenceRequest> requests = MakeRequests(2, h.spec.vocab_size, 53, false);
  for (SequenceRequest& r : requests) {
    r.max_tokens = 24;
    r.ignore_eos = true;
  }
  ASSERT_OK_AND_ASSIGN(auto expected, Reference("llama", requests, {}));
  std::vector<std::shared_ptr<CollectingSink>> sinks;
  std::atomic<SequenceId> victim{0};
  std::atomic<bool> cancelled{false};
  Scheduler* scheduler = h.scheduler.get();
  h.replicas[0]->SetStepHookForTest(AsSlowAsAWorker(h.replicas[0], [&](const StepInput& in) {
    for (const StepSequenceInput& s : in.sequences) {
      if (s.from_previous && s.sequence_id == victim.load() && !cancelled.exchange(true)) {
        scheduler->Cancel(s.sequence_id);
      }
    }
    return absl::OkStatus();
  }));
  for (const SequenceRequest& r : requests) {
    sinks.push_back(std::make_shared<CollectingSink>());
    ASSERT_OK_AND_ASSIGN(SequenceId id, h.scheduler->Submit(r, sinks.back()));
    if (sinks.size() == 1) victim = id;
  }
  for (auto& sink : sinks) ASSERT_TRUE(sink->Wait());
  EXPECT_TRUE(cancelled.load()) << "no overlapped call carried the victim";
  EXPECT_EQ(sinks[0]->end().reason, FinishReason::kCancelled);
  const std::vector<int32_t> got = sinks[0]->tokens();
  ASSERT_LT(got.size(), expected[0].tokens.size());
  EXPECT_THAT(got, ElementsAreArray(expected[0].tokens.begin(), expected[0].tokens.begin() + got.size()));
  EXPECT_THAT(sinks[1]->end().status, IsOk());
  EXPECT_THAT(sinks[1]->tokens(), ElementsAreArray(expected[1].tokens));
  EXPECT_EQ(h.scheduler->Stats().replicas[0].kv_blocks_used, 0);
}

// Replica 0's pipeline breaks once its calls overlap (a base and its continuation both fail, or a
// continuation alone): its sequences fail over to replica 1 with exactly their tokens.
TEST(SchedulerOverlapTest, ABrokenPipelineUnderOverlappedCallsFailsOverExactly) {
  for (const int first_failing : {1, 2}) {
    SCOPED_TRACE(absl::StrCat("from overlapped call ", first_failing));
    PreemptionCounter counter;
    ASSERT_OK_AND_ASSIGN(Harness h, MakeHarness({.replicas = 2, .max_slots = 3, .max_step_tokens = 8,
                                                 .observer = &counter, .stages = 1}));
    // Fails every step from the first_failing-th overlapped call on: that call, and the
    // continuation of it already built (a base and its continuation both failing); with 2, the
    // first continuation's tokens are applied before the break.
    auto seen = std::make_shared<std::atomic<int>>(0);
    auto broken = std::make_shared<std::atomic<bool>>(false);
    h.replicas[0]->SetStepHookForTest(AsSlowAsAWorker(h.replicas[0], [seen, broken, first_failing](const StepInput& in) {
      const bool overlapped =
          std::any_of(in.sequences.begin(), in.sequences.end(), [](const StepSequenceInput& s) { return s.from_previous; });
      if (overlapped && ++*seen >= first_failing) broken->store(true);
      return broken->load() ? absl::UnavailableError("the worker died") : absl::OkStatus();
    }));
    h.replicas[1]->SetStepHookForTest(AsSlowAsAWorker(h.replicas[1]));
    std::vector<SequenceRequest> requests = MakeRequests(6, h.spec.vocab_size, 59, true);
    for (SequenceRequest& r : requests) r.max_tokens += 16;
    RunAndCompare(*h.scheduler, "llama", requests, {}, h.replicas);
    EXPECT_TRUE(broken->load()) << "too few overlapped calls on replica 0";
    EXPECT_GT(counter.failovers(), 0);
    EXPECT_EQ(h.scheduler->Stats().replicas[1].kv_blocks_used, 0);
  }
}

}  // namespace overlap

}  // namespace
}  // namespace shardserve::coordinator

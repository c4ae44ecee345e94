// Multi-step decoding (StepRequest.decode_steps) through a real 1-stage worker on 127.0.0.1 (port
// 0): the coordinator's Scheduler driving it through GrpcReplicaClient (step deltas on) gives the
// same tokens with 1, 4 and 8 decode steps per call — greedy ones equal to Hugging Face's, seeded
// ones equal to one step per call, with overlapped decode calls and without — and a worker refuses
// decode_steps for a batch that cannot take them, with INVALID_ARGUMENT naming the field; an
// overlapped call (from_previous) takes the token the call before sampled.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "coordinator/client/grpc_replica_client.h"
#include "common/model_spec/model_spec.h"
#include "coordinator/scheduler/scheduler.h"
#include "tests/testing/golden.h"
#include "tests/testing/status_matchers.h"
#include "tests/worker/service/stage_rig.h"
#include "worker/service/worker_metrics.h"

namespace shardserve::service {
namespace {

using ::testing::HasSubstr;

class Collect final : public coordinator::SequenceSink {
 public:
  void OnTokens(absl::Span<const int32_t> tokens, absl::Span<const coordinator::TokenLogprobs>) override {
    absl::MutexLock lock(&mu_);
    tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  }
  void OnEnd(const coordinator::SequenceEnd& end) override {
    {
      absl::MutexLock lock(&mu_);
      end_ = end;
    }
    done_.Notify();
  }
  bool Wait() { return done_.WaitForNotificationWithTimeout(absl::Seconds(60)); }
  std::vector<int32_t> tokens() const {
    absl::MutexLock lock(&mu_);
    return tokens_;
  }
  coordinator::SequenceEnd end() const {
    absl::MutexLock lock(&mu_);
    return end_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<int32_t> tokens_ ABSL_GUARDED_BY(mu_);
  coordinator::SequenceEnd end_ ABSL_GUARDED_BY(mu_);
  absl::Notification done_;
};

// Passes steps on to `inner`, recording the most decode steps asked for, counting the overlapped
// calls (with a from_previous sequence) and the answers whose compute time
// (StepResponse.compute_us) is missing or longer than the call.
class StepsProbe final : public coordinator::ReplicaClient {
 public:
  StepsProbe(std::unique_ptr<coordinator::ReplicaClient> inner, std::atomic<int32_t>* most,
             std::atomic<int32_t>* untimed, std::atomic<int32_t>* overlapped)
      : inner_(std::move(inner)), most_(most), untimed_(untimed), overlapped_(overlapped) {}
  absl::StatusOr<coordinator::StepOutput> Step(const coordinator::StepInput& input) override {
    return StepOverlapping(input, [] {});
  }
  absl::StatusOr<coordinator::StepOutput> StepOverlapping(const coordinator::StepInput& input,
                                                          absl::FunctionRef<void()> while_waiting) override {
    for (int32_t m = most_->load(); input.decode_steps > m && !most_->compare_exchange_weak(m, input.decode_steps);) {
    }
    for (const coordinator::StepSequenceInput& s : input.sequences) {
      if (s.from_previous) {
        ++*overlapped_;
        break;
      }
    }
    const absl::Time start = absl::Now();
    absl::StatusOr<coordinator::StepOutput> out = inner_->StepOverlapping(input, while_waiting);
    const absl::Duration call = absl::Now() - start;
    if (out.ok() && (out->compute_time <= absl::ZeroDuration() || out->compute_time > call)) ++*untimed_;
    return out;
  }
  bool OverlapsDecodeCalls() const override { return inner_->OverlapsDecodeCalls(); }
  void Shutdown() override { inner_->Shutdown(); }

 private:
  std::unique_ptr<coordinator::ReplicaClient> inner_;
  std::atomic<int32_t>* most_;
  std::atomic<int32_t>* untimed_;
  std::atomic<int32_t>* overlapped_;
};

void StopWorker(RunningWorker& w) {
  w.server->Shutdown();
  w.rpc->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
}

// Every golden case greedily and seeded (temperature 0.8), all at once, through a Scheduler with
// `steps` decode steps per call (0 = auto), overlapped decode calls on or off, and a 1-stage
// worker; the tokens per request, in that order. `most` gets the most decode steps a call asked
// for, `overlapped` the calls that continued their previous one. Every answer must report the
// worker's compute time, within the call's.
std::vector<std::vector<int32_t>> Serve(const testing::GoldenModel& golden, int32_t steps, bool overlap, int32_t* most,
                                        int32_t* overlapped) {
  std::atomic<int32_t> most_steps{0};
  std::atomic<int32_t> untimed{0};
  std::atomic<int32_t> overlapped_calls{0};
  RunningWorker w = StartWorker(WorkerOptions{.cpu_ranks = 1, .step_deltas = true});
  EXPECT_TRUE(w.server->Assign(StageAssignment(golden.dir, 0, 0, 2, 1, "")).ok());
  EXPECT_EQ(AwaitLoaded(*w.server).state, v1::WORKER_STATE_READY) << w.server->Status().error;
  std::vector<std::vector<int32_t>> out;
  {
    coordinator::SchedulerOptions so;
    absl::StatusOr<ModelSpec> spec = LoadModelSpec(golden.dir);
    EXPECT_THAT(spec.status(), testing::IsOk());
    so.limits = {.vocab_size = spec.ok() ? spec->vocab_size : 1, .max_seq_len = 128};
    so.max_step_tokens = 64;
    so.decode_steps_per_call = steps;
    so.overlap_decode_calls = overlap;
    coordinator::Scheduler scheduler(so);
    auto client = std::make_unique<coordinator::GrpcReplicaClient>(
        grpc::CreateChannel(w.address, grpc::InsecureChannelCredentials()),
        coordinator::GrpcReplicaClient::Options{.address = w.address, .step_deltas = true});
    EXPECT_THAT(scheduler.AddReplica(0, std::make_unique<StepsProbe>(std::move(client), &most_steps, &untimed, &overlapped_calls),
                                     {.max_slots = 8, .kv_blocks = 32, .kv_block_size = 16, .stages = 1}),
                testing::IsOk());
    std::vector<std::shared_ptr<Collect>> sinks;
    for (const bool sampled : {false, true}) {
      for (size_t c = 0; c < golden.cases.size(); ++c) {
        coordinator::SequenceRequest r;
        r.request_id = "req-" + std::to_string(sinks.size());
        r.prompt = golden.cases[c].prompt_ids;
        r.max_tokens = static_cast<int32_t>(golden.cases[c].greedy_ids.size());
        r.ignore_eos = true;
        if (sampled) r.sampling = {.temperature = 0.8f, .top_k = 40, .seed = 100 + c};
        sinks.push_back(std::make_shared<Collect>());
        EXPECT_THAT(scheduler.Submit(r, sinks.back()), testing::IsOk());
      }
    }
    for (const auto& s : sinks) {
      EXPECT_TRUE(s->Wait());
      EXPECT_THAT(s->end().status, testing::IsOk());
      out.push_back(s->tokens());
    }
    const coordinator::SchedulerStats stats = scheduler.Stats();
    EXPECT_EQ(stats.replicas.at(0).kv_blocks_used, 0);
    scheduler.Shutdown(absl::UnavailableError("test over"));
  }
  StopWorker(w);
  *most = most_steps.load();
  *overlapped = overlapped_calls.load();
  EXPECT_EQ(untimed.load(), 0) << "answers without the worker's compute time, or with one longer than the call";
  return out;
}

TEST(MultiStepWorkerTest, TheSchedulerGetsTheSameTokensWithSeveralDecodeStepsPerCall) {
  ASSERT_OK_AND_ASSIGN(testing::GoldenModel golden, testing::LoadGoldenModel("llama"));
  const size_t n = golden.cases.size();
  int32_t most = 0;
  int32_t overlapped = 0;
  // One step per call, no overlapped calls: the reference for the seeded cases.
  const std::vector<std::vector<int32_t>> one = Serve(golden, 1, /*overlap=*/false, &most, &overlapped);
  ASSERT_EQ(one.size(), 2 * n);
  EXPECT_EQ(most, 1);
  EXPECT_EQ(overlapped, 0);
  for (size_t c = 0; c < n; ++c) EXPECT_EQ(one[c], golden.cases[c].greedy_ids) << "case " << c;
  // Then with overlapped calls (the default) as well, one step per call and several.
  int32_t overlapped_runs = 0;
  for (const int32_t steps : {1, 4, 8}) {
    for (const bool overlap : {false, true}) {
      if (steps == 1 && !overlap) continue;  // that is `one`
      SCOPED_TRACE(absl::StrCat(steps, " steps per call, overlapped calls ", overlap ? "on" : "off"));
      const std::vector<std::vector<int32_t>> many = Serve(golden, steps, overlap, &most, &overlapped);
      ASSERT_EQ(many.size(), 2 * n);
      EXPECT_EQ(most, steps) << "no call ran " << steps << " decode steps";
      // (Whether a continuation is built before its base's answer comes depends on the threads'
      // timing: counted over all the runs below.)
      if (overlap) {
        overlapped_runs += overlapped;
      } else {
        EXPECT_EQ(overlapped, 0);
      }
      for (size_t c = 0; c < n; ++c) {
        EXPECT_EQ(many[c], golden.cases[c].greedy_ids) << "greedy case " << c;
        EXPECT_EQ(many[n + c], one[n + c]) << "sampled case " << c;
      }
      EXPECT_NE(many[2 * n - 1], golden.cases[n - 1].greedy_ids) << "the seeded case should not be greedy";
    }
  }
  // Auto (the default): whatever it chooses, the same tokens.
  const std::vector<std::vector<int32_t>> chosen =
      Serve(golden, coordinator::kAutoDecodeStepsPerCall, /*overlap=*/true, &most, &overlapped);
  overlapped_runs += overlapped;
  EXPECT_GT(overlapped_runs, 0) << "no call continued the one before it, in any run";
  ASSERT_EQ(chosen.size(), 2 * n);
  for (size_t c = 0; c < n; ++c) {
    EXPECT_EQ(chosen[c], golden.cases[c].greedy_ids) << "auto, greedy case " << c;
    EXPECT_EQ(chosen[n + c], one[n + c]) << "auto, sampled case " << c;
  }
}

// A decode of one sequence (blocks [0, 8): 128 positions) at position `pos` with `steps` steps.
v1::StepRequest Decode(uint64_t id, int pos, int32_t token, uint32_t steps) {
  v1::StepRequest r = Step(id, 0, pos, {token}, 0);
  r.set_decode_steps(steps);
  return r;
}

// A worker serving both layers of `golden` as the only stage of its pipeline.
RunningWorker StartOneStageWorker(const testing::GoldenModel& golden) {
  RunningWorker w = StartWorker(1);
  EXPECT_TRUE(w.server->Assign(StageAssignment(golden.dir, 0, 0, 2, 1, "")).ok());
  EXPECT_EQ(AwaitLoaded(*w.server).state, v1::WORKER_STATE_READY) << w.server->Status().error;
  return w;
}

// The answer to `request` on a new stream to `address`.
v1::StepResponse Ask(const std::string& address, const v1::StepRequest& request) {
  auto stub = v1::Stage::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  auto stream = stub->StepStream(&ctx);
  v1::StepResponse r;
  EXPECT_TRUE(stream->Write(request));
  EXPECT_TRUE(stream->Read(&r));
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  return r;
}

TEST(MultiStepWorkerTest, DecodeStepsMatchSingleStepsOnTheRawStream) {
  ASSERT_OK_AND_ASSIGN(testing::GoldenModel golden, testing::LoadGoldenModel("llama"));
  RunningWorker w = StartOneStageWorker(golden);
  ASSERT_FALSE(HasFailure()) << "the worker did not load the model";
  const testing::GoldenCase& gc = golden.cases.back();
  ASSERT_GE(gc.greedy_ids.size(), 6u);
  // The prompt, then 5 steps in one request: the golden tokens 1..5.
  const v1::StepResponse first = Ask(w.address, Step(1, 0, 0, gc.prompt_ids, 0));
  ASSERT_EQ(first.error_code(), 0) << first.error_message();
  ASSERT_EQ(first.token_ids_size(), 1);
  EXPECT_EQ(first.token_ids(0), gc.greedy_ids[0]);
  const absl::Time start = absl::Now();
  const v1::StepResponse rest = Ask(w.address, Decode(2, static_cast<int>(gc.prompt_ids.size()), first.token_ids(0), 5));
  const absl::Duration call = absl::Now() - start;
  ASSERT_EQ(rest.error_code(), 0) << rest.error_message();
  // The worker's compute for the 5 steps: reported, and within the call's time.
  EXPECT_GT(first.compute_us(), 0u);
  EXPECT_GT(rest.compute_us(), 0u);
  EXPECT_LE(absl::Microseconds(static_cast<int64_t>(rest.compute_us())), call);
  EXPECT_THAT(std::vector<int32_t>(rest.token_ids().begin(), rest.token_ids().end()),
              ::testing::ElementsAreArray(gc.greedy_ids.begin() + 1, gc.greedy_ids.begin() + 6));
  StopWorker(w);
}

// Overlapped decode calls on the raw stream: a call whose sequence is from_previous decodes the
// token the call before sampled under its sample_key (the golden tokens follow on), one that has
// nothing to continue is refused with UNAVAILABLE, and a malformed one with INVALID_ARGUMENT.
TEST(MultiStepWorkerTest, AnOverlappedCallTakesTheTokenTheCallBeforeSampled) {
  ASSERT_OK_AND_ASSIGN(testing::GoldenModel golden, testing::LoadGoldenModel("llama"));
  RunningWorker w = StartOneStageWorker(golden);
  ASSERT_FALSE(HasFailure()) << "the worker did not load the model";
  const testing::GoldenCase& gc = golden.cases.back();
  ASSERT_GE(gc.greedy_ids.size(), 6u);
  const int prompt = static_cast<int>(gc.prompt_ids.size());
  const auto from_previous = [](v1::StepRequest r, uint64_t key) {
    v1::StepSequence* s = r.mutable_sequences(0);
    s->clear_token_ids();
    s->set_num_tokens(1);
    s->set_sample_key(key);
    s->set_from_previous(true);
    return r;
  };
  const auto ids = [](const v1::StepResponse& r) { return std::vector<int32_t>(r.token_ids().begin(), r.token_ids().end()); };
  // The prompt, remembered under key 7; then 3 steps from it; then 1 more step (the token the
  // sender never saw is never sent).
  v1::StepRequest prefill = Step(1, 0, 0, gc.prompt_ids, 0);
  prefill.mutable_sequences(0)->set_sample_key(7);
  const v1::StepResponse first = Ask(w.address, prefill);
  ASSERT_EQ(first.error_code(), 0) << first.error_message();
  EXPECT_THAT(ids(first), ::testing::ElementsAre(gc.greedy_ids[0]));
  const v1::StepResponse three = Ask(w.address, from_previous(Decode(2, prompt, 0, 3), 7));
  ASSERT_EQ(three.error_code(), 0) << three.error_message();
  EXPECT_THAT(ids(three), ::testing::ElementsAreArray(gc.greedy_ids.begin() + 1, gc.greedy_ids.begin() + 4));
  const v1::StepResponse one = Ask(w.address, from_previous(Decode(3, prompt + 3, 0, 1), 7));
  ASSERT_EQ(one.error_code(), 0) << one.error_message();
  EXPECT_THAT(ids(one), ::testing::ElementsAre(gc.greedy_ids[4]));
  // Nothing sampled under key 8 by the call before; and then nothing at all (that call failed).
  for (const uint64_t key : {8, 7}) {
    const v1::StepResponse r = Ask(w.address, from_previous(Decode(4, prompt + 4, 0, 1), key));
    EXPECT_EQ(r.error_code(), grpc::StatusCode::UNAVAILABLE) << "key " << key;
    EXPECT_THAT(r.error_message(), HasSubstr("sample_key")) << "key " << key;
  }
  // Malformed: token ids as well, no key, several tokens.
  std::vector<std::pair<std::string, v1::StepRequest>> bad;
  bad.emplace_back("token ids too", from_previous(Decode(5, prompt, 0, 1), 7));
  bad.back().second.mutable_sequences(0)->add_token_ids(3);
  bad.emplace_back("no sample_key", from_previous(Decode(5, prompt, 0, 1), 0));
  bad.emplace_back("two tokens", from_previous(Decode(5, prompt, 0, 1), 7));
  bad.back().second.mutable_sequences(0)->set_num_tokens(2);
  for (const auto& [what, request] : bad) {
    const v1::StepResponse r = Ask(w.address, request);
    EXPECT_EQ(r.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << what;
    EXPECT_THAT(r.error_message(), HasSubstr("from_previous")) << what;
  }
  StopWorker(w);
}

TEST(MultiStepWorkerTest, IneligibleBatchesAreRefusedNamingDecodeSteps) {
  ASSERT_OK_AND_ASSIGN(testing::GoldenModel golden, testing::LoadGoldenModel("llama"));
  RunningWorker w = StartOneStageWorker(golden);
  ASSERT_FALSE(HasFailure()) << "the worker did not load the model";
  std::vector<std::pair<std::string, v1::StepRequest>> bad;
  bad.emplace_back("a prefill chunk", Step(1, 0, 0, {1, 2, 3}, 0));
  bad.back().second.set_decode_steps(4);
  bad.emplace_back("penalties", Decode(1, 3, 5, 4));
  bad.back().second.mutable_sequences(0)->mutable_sampling()->set_repetition_penalty(1.2f);
  bad.emplace_back("a mask", Decode(1, 3, 5, 4));
  bad.back().second.mutable_sequences(0)->set_allowed_token_mask(std::string(64, '\xff'));
  bad.emplace_back("suppressed ids", Decode(1, 3, 5, 4));
  bad.back().second.mutable_sequences(0)->add_suppress_token_ids(2);
  bad.emplace_back("logprobs", Decode(1, 3, 5, 4));
  bad.back().second.mutable_sequences(0)->set_logprobs(true);
  bad.emplace_back("no sampling", Decode(1, 3, 5, 4));
  bad.back().second.mutable_sequences(0)->set_sample(false);
  bad.emplace_back("too many steps", Decode(1, 3, 5, kMaxDecodeSteps + 1));
  for (const auto& [what, request] : bad) {
    const v1::StepResponse r = Ask(w.address, request);
    EXPECT_EQ(r.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << what;
    EXPECT_THAT(r.error_message(), HasSubstr("decode_steps")) << what;
    EXPECT_EQ(r.token_ids_size(), 0) << what;
  }
  // Too few blocks for the steps: 1 block (16 positions) for 4 steps from position 14.
  v1::StepRequest short_blocks = Decode(1, 14, 5, 4);
  short_blocks.mutable_sequences(0)->mutable_block_ids()->Truncate(1);
  const v1::StepResponse r = Ask(w.address, short_blocks);
  EXPECT_EQ(r.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(r.error_message(), HasSubstr("KV blocks"));
  StopWorker(w);
}

TEST(MultiStepWorkerTest, AStageOfALongerPipelineRefusesDecodeSteps) {
  ASSERT_OK_AND_ASSIGN(testing::GoldenModel golden, testing::LoadGoldenModel("llama"));
  RunningWorker w1 = StartWorker(1);
  RunningWorker w0 = StartWorker(1);
  ASSERT_TRUE(w1.server->Assign(StageAssignment(golden.dir, 1, 1, 2, 1, "")).ok());
  ASSERT_TRUE(w0.server->Assign(StageAssignment(golden.dir, 0, 0, 1, 1, w1.address)).ok());
  ASSERT_EQ(AwaitLoaded(*w1.server).state, v1::WORKER_STATE_READY) << w1.server->Status().error;
  ASSERT_EQ(AwaitLoaded(*w0.server).state, v1::WORKER_STATE_READY) << w0.server->Status().error;
  // Stage 0 (not the last), and the last stage itself (which does not embed).
  for (const std::string& address : {w0.address, w1.address}) {
    v1::StepRequest request = Decode(1, 3, 5, 4);
    if (address == w1.address) {  // what stage 0 would forward: hidden states, no token ids
      request.mutable_sequences(0)->clear_token_ids();
      v1::Tensor* hidden = request.mutable_hidden();
      hidden->set_dtype(v1::DTYPE_F32);
      hidden->add_shape(1);
      hidden->add_shape(64);
      hidden->set_data(std::string(64 * sizeof(float), '\0'));
    }
    const v1::StepResponse r = Ask(address, request);
    EXPECT_EQ(r.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << address;
    EXPECT_THAT(r.error_message(), HasSubstr("decode_steps")) << address;
  }
  // Nor does stage 0 take an overlapped call: it does not sample.
  v1::StepRequest overlapped = Decode(1, 3, 0, 1);
  overlapped.mutable_sequences(0)->clear_token_ids();
  overlapped.mutable_sequences(0)->set_sample_key(7);
  overlapped.mutable_sequences(0)->set_from_previous(true);
  const v1::StepResponse r = Ask(w0.address, overlapped);
  EXPECT_EQ(r.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(r.error_message(), HasSubstr("from_previous"));
  StopWorker(w0);
  StopWorker(w1);
}

}  // namespace
}  // namespace shardserve::service

// Step deltas through real stages (common/rpc/step_delta.h): a replica of two workers on
// 127.0.0.1 (port 0), driven by the coordinator's GrpcReplicaClient with several sequences per
// step (prefills, growing block tables, a sampled sequence with penalties and min_tokens, one with
// logprobs, one joining late), gives the same tokens with deltas on and off — greedy ones equal to
// Hugging Face's — while carrying fewer bytes on both hops; a worker refuses a delta it cannot
// decode and ends that stream.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "coordinator/client/grpc_replica_client.h"
#include "tests/testing/golden.h"
#include "tests/testing/status_matchers.h"
#include "tests/worker/service/stage_rig.h"
#include "worker/service/worker_metrics.h"

namespace shardserve::service {
namespace {

using ::testing::HasSubstr;

constexpr int kBlockTokens = 16;  // StageAssignment's kv_block_size
constexpr int kBlocksPerSequence = 8;

// A counter of a worker's registry: shardserve_worker_stream_bytes_total{direction, peer}.
double StreamBytes(const WorkerMetrics& metrics, const std::string& direction, const std::string& peer) {
  return CounterValue(metrics, "shardserve_worker_stream_bytes_total", {{"direction", direction}, {"peer", peer}})
      .value_or(0);
}

struct Generation {
  std::vector<std::vector<int32_t>> tokens;  // per sequence
  double stage0_rx = 0;                      // bytes from the coordinator
  double stage1_rx = 0;                      // bytes from stage 0
};

// One simulated sequence of the coordinator's scheduler.
struct Seq {
  int slot = 0;  // its blocks are [slot * 8, slot * 8 + 8)
  std::vector<int32_t> context;
  int pos = 0;
  size_t want = 0;  // tokens to generate
  int join_step = 0;
  coordinator::SamplingOptions sampling;
  bool logprobs = false;
  std::map<int32_t, int32_t> history;  // penalties: id -> times generated (prompt ids with 0)
  std::vector<int32_t> out;
};

Generation Generate(const testing::GoldenModel& golden, bool worker_deltas, bool client_deltas) {
  Generation run;
  WorkerMetrics m0, m1;
  RunningWorker w1 = StartWorker(WorkerOptions{.cpu_ranks = 1, .metrics = &m1, .step_deltas = worker_deltas});
  RunningWorker w0 = StartWorker(WorkerOptions{.cpu_ranks = 1, .metrics = &m0, .step_deltas = worker_deltas});
  EXPECT_TRUE(w1.server->Assign(StageAssignment(golden.dir, 1, 1, 2, 1, "")).ok());
  EXPECT_TRUE(w0.server->Assign(StageAssignment(golden.dir, 0, 0, 1, 1, w1.address)).ok());
  EXPECT_EQ(AwaitLoaded(*w1.server).state, v1::WORKER_STATE_READY) << w1.server->Status().error;
  EXPECT_EQ(AwaitLoaded(*w0.server).state, v1::WORKER_STATE_READY) << w0.server->Status().error;
  {
    coordinator::GrpcReplicaClient client(
        grpc::CreateChannel(w0.address, grpc::InsecureChannelCredentials()),
        grpc::CreateChannel(w1.address, grpc::InsecureChannelCredentials()),
        {.address = w0.address, .last_address = w1.address, .step_deltas = client_deltas});
    std::vector<Seq> seqs;
    for (size_t c = 0; c < golden.cases.size() && c < 3; ++c) {
      seqs.push_back({.slot = static_cast<int>(c), .context = golden.cases[c].prompt_ids,
                      .want = golden.cases[c].greedy_ids.size()});
    }
    // Sequence 1 samples, with penalties over its history and min_tokens 3 (its first tokens may
    // not be token 2); sequence 2 asks for logprobs; a fourth (case 0 again) joins at step 6.
    seqs[1].sampling = {.temperature = 0.9f, .top_k = 20, .seed = 17, .frequency_penalty = 0.4f,
                        .repetition_penalty = 1.2f};
    for (int32_t id : seqs[1].context) seqs[1].history.try_emplace(id, 0);
    seqs[2].logprobs = true;
    seqs.push_back({.slot = 3, .context = golden.cases[0].prompt_ids, .want = golden.cases[0].greedy_ids.size(),
                    .join_step = 6});
    for (uint64_t step = 1;; ++step) {
      coordinator::StepInput in{.step_id = step};
      std::vector<Seq*> members;
      for (Seq& s : seqs) {
        if (s.out.size() >= s.want || static_cast<int>(step) < s.join_step) continue;
        coordinator::StepSequenceInput q;
        q.pos_begin = s.pos;
        q.token_ids.assign(s.context.begin() + s.pos, s.context.end());
        const int blocks = (s.pos + static_cast<int>(q.token_ids.size()) + kBlockTokens - 1) / kBlockTokens;
        for (int b = 0; b < blocks && b < kBlocksPerSequence; ++b) q.block_ids.push_back(s.slot * kBlocksPerSequence + b);
        q.sample = true;
        q.sampling = s.sampling;
        q.sample_index = s.out.size();
        q.request_id = "req-" + std::to_string(s.slot);
        q.sequence_id = static_cast<uint64_t>(s.slot + 1);
        q.logprobs = s.logprobs;
        q.top_logprobs = s.logprobs ? 2 : 0;
        if (s.sampling.HasPenalties()) {
          for (const auto& [id, count] : s.history) {
            q.penalty_token_ids.push_back(id);
            q.penalty_token_counts.push_back(count);
          }
          if (s.out.size() < 3) q.suppress_token_ids = {2};
        }
        in.sequences.push_back(std::move(q));
        members.push_back(&s);
      }
      if (members.empty()) break;
      absl::StatusOr<coordinator::StepOutput> out = client.Step(in);
      if (!out.ok() || out->token_ids.size() != members.size()) {
        ADD_FAILURE() << "step " << step << ": " << out.status();
        break;
      }
      for (size_t i = 0; i < members.size(); ++i) {
        Seq& s = *members[i];
        s.pos = static_cast<int>(s.context.size());
        s.context.push_back(out->token_ids[i]);
        s.out.push_back(out->token_ids[i]);
        ++s.history[out->token_ids[i]];
      }
    }
    for (const Seq& s : seqs) run.tokens.push_back(s.out);
  }
  run.stage0_rx = StreamBytes(m0, "rx", "upstream");
  run.stage1_rx = StreamBytes(m1, "rx", "upstream");
  for (RunningWorker* w : {&w0, &w1}) {
    w->server->Shutdown();
    w->rpc->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }
  return run;
}

TEST(StepDeltaStagesTest, TheSameTokensWithDeltasOnAndOffInFewerBytes) {
  ASSERT_OK_AND_ASSIGN(testing::GoldenModel golden, testing::LoadGoldenModel("llama"));
  ASSERT_GE(golden.cases.size(), 3u);
  const Generation on = Generate(golden, /*worker_deltas=*/true, /*client_deltas=*/true);
  // The client wants deltas but the workers never announce them: everything goes in full.
  const Generation off = Generate(golden, /*worker_deltas=*/false, /*client_deltas=*/true);
  ASSERT_EQ(on.tokens.size(), 4u);
  EXPECT_EQ(on.tokens, off.tokens);
  EXPECT_EQ(on.tokens[0], golden.cases[0].greedy_ids);  // greedy: Hugging Face's tokens
  EXPECT_EQ(on.tokens[2], golden.cases[2].greedy_ids);
  EXPECT_EQ(on.tokens[3], golden.cases[0].greedy_ids);
  EXPECT_NE(on.tokens[1], golden.cases[1].greedy_ids);  // sampled
  EXPECT_LT(on.stage0_rx, off.stage0_rx * 0.75) << on.stage0_rx << " B against " << off.stage0_rx << " B";
  EXPECT_LT(on.stage1_rx, off.stage1_rx) << on.stage1_rx << " B against " << off.stage1_rx << " B";
}

TEST(StepDeltaStagesTest, ADeltaTheWorkerCannotDecodeIsRefusedAndEndsTheStream) {
  ASSERT_OK_AND_ASSIGN(testing::GoldenModel golden, testing::LoadGoldenModel("llama"));
  RunningWorker w = StartWorker(1);
  ASSERT_TRUE(w.server->Assign(StageAssignment(golden.dir, 0, 0, 2, 1, "")).ok());
  ASSERT_EQ(AwaitLoaded(*w.server).state, v1::WORKER_STATE_READY) << w.server->Status().error;
  auto stub = v1::Stage::NewStub(grpc::CreateChannel(w.address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  auto stream = stub->StepStream(&ctx);
  stream->WaitForInitialMetadata();
  EXPECT_EQ(ctx.GetServerInitialMetadata().count(rpc::kStepDeltasKey), 1u);
  v1::StepRequest r = Step(1, 0, 0, {1, 2}, 0);
  r.set_deltas(true);
  r.mutable_sequences(0)->set_key(5);
  r.mutable_sequences(0)->set_keep(v1::STEP_SEQUENCE_KEEP_PROFILE);  // a delta of a key never sent
  ASSERT_TRUE(stream->Write(r));
  v1::StepResponse answer;
  ASSERT_TRUE(stream->Read(&answer));
  EXPECT_EQ(answer.step_id(), 1u);
  EXPECT_EQ(answer.error_code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(answer.error_message(), HasSubstr("sequence 0 (key 5"));
  EXPECT_FALSE(stream->Read(&answer));  // the stream ends: the tables may disagree
  const grpc::Status end = stream->Finish();
  EXPECT_EQ(end.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(end.error_message(), HasSubstr("does not know"));
  w.server->Shutdown();
  w.rpc->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
}

}  // namespace
}  // namespace shardserve::service

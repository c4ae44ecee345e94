// Workers serving pipeline stages over gRPC on 127.0.0.1 (port 0), driven the way the coordinator
// drives stage 0: greedy tokens must equal Hugging Face's, and bad input gets error responses.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <numeric>
#include <set>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/metrics/metrics_server.h"
#include "common/model_spec/model_spec.h"
#include "common/safetensors/safetensors.h"
#include "tests/testing/golden.h"
#include "tests/testing/status_matchers.h"
#include "worker/engine/expert_host.h"
#include "worker/service/convert.h"
#include "worker/service/expert_client.h"
#include "tests/worker/service/stage_rig.h"
#include "worker/service/worker_server.h"

namespace shardserve::service {
namespace {

using ::shardserve::testing::IsOk;
using ::shardserve::testing::StatusIs;
using ::testing::HasSubstr;

// `m` copied into a message of a pool, as a stage stream reads one.
PooledStepRequest Pooled(const v1::StepRequest& m) {
  static const auto& pool =
      *new std::shared_ptr<rpc::MessagePool<v1::StepRequest>>(rpc::MessagePool<v1::StepRequest>::Create(1024, 4));
  PooledStepRequest lease = pool->Take();
  *lease = m;
  return lease;
}

// A minimal HTTP/1.0 GET on 127.0.0.1 (no client library needed for one request).
std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  (void)write(fd, req.data(), req.size());
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) out.append(buf, static_cast<size_t>(n));
  close(fd);
  return out;
}

class StageStreamTest : public ::testing::Test {
 protected:
  // Two workers: stage 0 = layers [0, 1) on 2 ranks, stage 1 = layers [1, 2) on 1 rank.
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(golden_, testing::LoadGoldenModel("llama"));
    w1_ = StartWorker(1);
    w0_ = StartWorker(2, &metrics_);
    ASSERT_TRUE(w1_.server->Assign(StageAssignment(golden_.dir, 1, 1, 2, 1, "")).ok());
    ASSERT_TRUE(w0_.server->Assign(StageAssignment(golden_.dir, 0, 0, 1, 2, w1_.address)).ok());
    ASSERT_EQ(AwaitLoaded(*w1_.server).state, v1::WORKER_STATE_READY) << w1_.server->Status().error;
    ASSERT_EQ(AwaitLoaded(*w0_.server).state, v1::WORKER_STATE_READY) << w0_.server->Status().error;
    EXPECT_EQ(w0_.server->Status().kv_blocks, 32);  // READY reports the blocks allocated
    EXPECT_EQ(w1_.server->Status().kv_blocks, 32);
    channel_ = grpc::CreateChannel(w0_.address, grpc::InsecureChannelCredentials());
    stub_ = v1::Stage::NewStub(channel_);
  }
  void TearDown() override {
    for (RunningWorker* w : {&w0_, &w1_}) {
      if (w->server) w->server->Shutdown();
      if (w->rpc) w->rpc->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    }
  }

  testing::GoldenModel golden_;
  WorkerMetrics metrics_;  // of w0_ (declared first: outlives the worker)
  RunningWorker w0_, w1_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Stage::Stub> stub_;
};


TEST_F(StageStreamTest, GreedyTokensThroughTwoStagesMatchTransformers) {
  grpc::ClientContext ctx;
  auto stream = stub_->StepStream(&ctx);
  uint64_t step = 1;
  for (size_t c = 0; c < golden_.cases.size(); ++c) {
    const auto& gc = golden_.cases[c];
    std::vector<int32_t> out;
    std::vector<int32_t> next = gc.prompt_ids;
    int pos = 0;
    for (size_t i = 0; i < gc.greedy_ids.size(); ++i) {
      ASSERT_TRUE(stream->Write(Step(step, static_cast<int>(c), pos, next, i)));
      v1::StepResponse r;
      ASSERT_TRUE(stream->Read(&r));
      ASSERT_EQ(r.error_code(), 0) << r.error_message();
      ASSERT_EQ(r.step_id(), step);
      ASSERT_EQ(r.token_ids_size(), 1);
      pos += static_cast<int>(next.size());
      out.push_back(r.token_ids(0));
      next = {r.token_ids(0)};
      ++step;
    }
    EXPECT_EQ(out, gc.greedy_ids) << "case " << c;
  }
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());

  // Stage 0's metrics, read over HTTP as Prometheus would. The prompts have 1, 5 and 11 tokens:
  // the 1-token one counts as a decode step, so 2 prefill steps (16 tokens) and 94 decode steps.
  ASSERT_OK_AND_ASSIGN(auto server, MetricsServer::Start("127.0.0.1:0", metrics_.registry()));
  const std::string page = HttpGet(server->port(), "/metrics");
  for (const char* expected :
       {"shardserve_worker_step_seconds_count{phase=\"prefill\",stage=\"0\"} 2",
        "shardserve_worker_step_seconds_count{phase=\"decode\",stage=\"0\"} 94",
        "shardserve_worker_step_tokens_total{phase=\"prefill\",stage=\"0\"} 16",
        "shardserve_worker_collective_seconds_count{op=\"all_reduce\",rank=\"0\"} 192",
        "shardserve_worker_stream_messages_total{direction=\"tx\",peer=\"downstream\"} 96",
        "shardserve_worker_stream_messages_total{direction=\"rx\",peer=\"upstream\"} 96",
        "shardserve_worker_weight_bytes{rank=\"1\"}", "shardserve_worker_kv_cache_bytes{rank=\"0\"}",
        "shardserve_worker_assignment_load_seconds"}) {
    EXPECT_THAT(page, HasSubstr(expected));
  }
}

// Generates golden case `gc` greedily through the stage at `stub` on a new stream, in the KV
// blocks of sequence `seq`; step ids continue from *step.
std::vector<int32_t> GenerateThrough(v1::Stage::Stub& stub, const testing::GoldenCase& gc, int seq, uint64_t* step) {
  grpc::ClientContext ctx;
  auto stream = stub.StepStream(&ctx);
  std::vector<int32_t> out;
  std::vector<int32_t> next = gc.prompt_ids;
  int pos = 0;
  for (size_t i = 0; i < gc.greedy_ids.size(); ++i) {
    if (!stream->Write(Step(*step, seq, pos, next, i))) break;
    v1::StepResponse r;
    if (!stream->Read(&r) || r.error_code() != 0 || r.token_ids_size() != 1) {
      ADD_FAILURE() << "step " << *step << ": " << r.error_message();
      break;
    }
    pos += static_cast<int>(next.size());
    out.push_back(r.token_ids(0));
    next = {r.token_ids(0)};
    ++*step;
  }
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  return out;
}

// A restarted coordinator that assigns what a worker already serves (same weights and KV cache,
// a new id): the worker keeps its loaded stage, is READY for the new id at once, and answers as
// before — also in KV blocks that still hold an earlier sequence's entries.
TEST_F(StageStreamTest, TheSameAssignmentAgainIsTakenWithoutReloadingAndAnswersTheSame) {
  uint64_t step = 1;
  // Sequence slot 0 is filled by case 0 first.
  EXPECT_EQ(GenerateThrough(*stub_, golden_.cases[0], 0, &step), golden_.cases[0].greedy_ids);
  const int64_t loads0 = w0_.server->weight_loads(), loads1 = w1_.server->weight_loads();
  EXPECT_EQ(loads0, 1);
  v1::Assignment again1 = StageAssignment(golden_.dir, 1, 1, 2, 1, "");
  again1.set_assignment_id("plan-new-1/r0/s1/w-1");
  v1::Assignment again0 = StageAssignment(golden_.dir, 0, 0, 1, 2, w1_.address);
  again0.set_assignment_id("plan-new-1/r0/s0/w-0");
  ASSERT_THAT(w1_.server->Assign(again1), IsOk());
  ASSERT_THAT(w0_.server->Assign(again0), IsOk());
  for (const auto& [w, id] : {std::pair{&w0_, "plan-new-1/r0/s0/w-0"}, std::pair{&w1_, "plan-new-1/r0/s1/w-1"}}) {
    const WorkerStatusSnapshot s = w->server->Status();
    EXPECT_EQ(s.state, v1::WORKER_STATE_READY) << "no LOADING: nothing to load";
    EXPECT_EQ(s.assignment_id, id);
    EXPECT_EQ(s.kv_blocks, 32);
    ASSERT_TRUE(s.assignment.has_value());
    EXPECT_EQ(s.assignment->assignment_id(), id);
  }
  EXPECT_EQ(w0_.server->weight_loads(), loads0);
  EXPECT_EQ(w1_.server->weight_loads(), loads1);
  // The same KV blocks (slot 0), now for other prompts: the stale entries are never read.
  for (size_t c = 1; c < golden_.cases.size(); ++c) {
    EXPECT_EQ(GenerateThrough(*stub_, golden_.cases[c], 0, &step), golden_.cases[c].greedy_ids) << "case " << c;
  }
}

// Only the next hop changes (the next stage's worker was replaced): still no reload, and the
// stage now sends to the new address.
TEST_F(StageStreamTest, ANewNextHopIsTakenWithoutReloading) {
  RunningWorker w2 = StartWorker(1);
  ASSERT_THAT(w2.server->Assign(StageAssignment(golden_.dir, 1, 1, 2, 1, "")), IsOk());
  ASSERT_EQ(AwaitLoaded(*w2.server).state, v1::WORKER_STATE_READY);
  w1_.server->Shutdown();
  w1_.rpc->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
  v1::Assignment moved = StageAssignment(golden_.dir, 0, 0, 1, 2, w2.address);
  moved.set_assignment_id("test-0#2");
  ASSERT_THAT(w0_.server->Assign(moved), IsOk());
  EXPECT_EQ(w0_.server->Status().state, v1::WORKER_STATE_READY);
  EXPECT_EQ(w0_.server->weight_loads(), 1);
  uint64_t step = 1;
  EXPECT_EQ(GenerateThrough(*stub_, golden_.cases[1], 2, &step), golden_.cases[1].greedy_ids);
  // A next hop on the last layer's stage does not fit: refused, the stage is kept as it was.
  v1::Assignment bad = StageAssignment(golden_.dir, 1, 1, 2, 1, "127.0.0.1:1");
  bad.set_assignment_id("bad");
  EXPECT_THAT(w2.server->Assign(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("next_address")));
  EXPECT_EQ(w2.server->Status().assignment_id, "test-1");
  w2.server->Shutdown();
  w2.rpc->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
}

// Anything else that shapes the weights or the KV cache is loaded anew.
TEST_F(StageStreamTest, ADifferentKvCacheOrLayerRangeReloads) {
  v1::Assignment bigger = StageAssignment(golden_.dir, 1, 1, 2, 1, "");
  bigger.set_assignment_id("test-1#kv");
  bigger.set_kv_blocks(40);
  ASSERT_THAT(w1_.server->Assign(bigger), IsOk());
  const WorkerStatusSnapshot s = AwaitLoaded(*w1_.server);
  EXPECT_EQ(s.state, v1::WORKER_STATE_READY) << s.error;
  EXPECT_EQ(s.kv_blocks, 40);
  EXPECT_EQ(w1_.server->weight_loads(), 2);
  v1::Assignment whole = StageAssignment(golden_.dir, 0, 0, 2, 1, "");
  whole.set_assignment_id("test-1#whole");
  ASSERT_THAT(w1_.server->Assign(whole), IsOk());
  EXPECT_EQ(AwaitLoaded(*w1_.server).state, v1::WORKER_STATE_READY);
  EXPECT_EQ(w1_.server->weight_loads(), 3);
  uint64_t step = 1;
  auto stub = v1::Stage::NewStub(grpc::CreateChannel(w1_.address, grpc::InsecureChannelCredentials()));
  EXPECT_EQ(GenerateThrough(*stub, golden_.cases[2], 1, &step), golden_.cases[2].greedy_ids);
}

// Logprobs, logit bias, suppressed ids and the allowed-token mask travel through both stages (the first forwards them) and
// are applied by the last: against the log-softmax of transformers' logits of the prompt.
TEST_F(StageStreamTest, LogprobsBiasAndSuppressionReachTheLastStage) {
  grpc::ClientContext ctx;
  auto stream = stub_->StepStream(&ctx);
  const auto& gc = golden_.cases[1];
  const std::vector<float>& ref = gc.logits.back();
  const double mx = *std::max_element(ref.begin(), ref.end());
  double z = 0;
  for (float l : ref) z += std::exp(static_cast<double>(l) - mx);
  const double log_z = mx + std::log(z);
  std::vector<int32_t> order(ref.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int32_t a, int32_t b) { return ref[static_cast<size_t>(a)] > ref[static_cast<size_t>(b)]; });
  ASSERT_EQ(order[0], gc.greedy_ids[0]);
  auto run = [&](uint64_t id, int seq, const std::function<void(v1::StepSequence*)>& edit, bool ok = true) {
    v1::StepRequest req = Step(id, seq, 0, gc.prompt_ids, 0);
    edit(req.mutable_sequences(0));
    EXPECT_TRUE(stream->Write(req));
    v1::StepResponse r;
    EXPECT_TRUE(stream->Read(&r));
    if (ok) {
      EXPECT_EQ(r.error_code(), 0) << r.error_message();
    }
    return r;
  };
  v1::StepResponse r = run(1, 0, [](v1::StepSequence* s) {
    s->set_logprobs(true);
    s->set_top_logprobs(3);
  });
  ASSERT_EQ(r.token_ids_size(), 1);
  EXPECT_EQ(r.token_ids(0), gc.greedy_ids[0]);
  ASSERT_EQ(r.logprobs_size(), 1);
  EXPECT_NEAR(r.logprobs(0).logprob(), ref[static_cast<size_t>(gc.greedy_ids[0])] - log_z, 1e-3);
  ASSERT_EQ(r.logprobs(0).top_ids_size(), 3);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(r.logprobs(0).top_ids(i), order[static_cast<size_t>(i)]);
    EXPECT_NEAR(r.logprobs(0).top_logprobs(i), ref[static_cast<size_t>(order[static_cast<size_t>(i)])] - log_z, 1e-3);
  }
  r = run(2, 1, [&](v1::StepSequence* s) { s->add_suppress_token_ids(gc.greedy_ids[0]); });
  ASSERT_EQ(r.token_ids_size(), 1);
  EXPECT_EQ(r.token_ids(0), order[1]);
  EXPECT_EQ(r.logprobs_size(), 0);  // not asked
  r = run(3, 2, [&](v1::StepSequence* s) { (*s->mutable_sampling()->mutable_logit_bias())[gc.greedy_ids[0]] = -100.f; });
  ASSERT_EQ(r.token_ids_size(), 1);
  EXPECT_EQ(r.token_ids(0), order[1]);
  // Penalties with the history the coordinator sends: the greedy token counted as generated once
  // and a presence penalty wider than its margin gives the runner-up; counted as a prompt token
  // only, it is not touched.
  const float margin = ref[static_cast<size_t>(order[0])] - ref[static_cast<size_t>(order[1])];
  ASSERT_LT(margin, 2.f);
  r = run(4, 0, [&](v1::StepSequence* s) {
    s->mutable_sampling()->set_presence_penalty(2.f);
    s->add_penalty_token_ids(gc.greedy_ids[0]);
    s->add_penalty_token_counts(1);
  });
  ASSERT_EQ(r.token_ids_size(), 1);
  EXPECT_EQ(r.token_ids(0), order[1]);
  r = run(5, 1, [&](v1::StepSequence* s) {
    s->mutable_sampling()->set_presence_penalty(2.f);
    s->add_penalty_token_ids(gc.greedy_ids[0]);
    s->add_penalty_token_counts(0);
  });
  ASSERT_EQ(r.token_ids_size(), 1);
  EXPECT_EQ(r.token_ids(0), order[0]);
  r = run(6, 2, [&](v1::StepSequence* s) {
    s->mutable_sampling()->set_presence_penalty(2.f);
    s->add_penalty_token_ids(gc.greedy_ids[0]);  // no count: refused, naming the problem
  }, /*ok=*/false);
  EXPECT_THAT(r.error_message(), HasSubstr("penalty history has 1 ids but 0 counts"));
  // Prompt logprobs: each row's logits give the next prompt token's logprob (transformers' logits
  // at every prompt position); -1 rows give none.
  r = run(7, 3, [&](v1::StepSequence* s) {
    for (size_t i = 0; i + 1 < gc.prompt_ids.size(); ++i) s->add_prompt_logprob_targets(i == 1 ? -1 : gc.prompt_ids[i + 1]);
    s->add_prompt_logprob_targets(-1);
    s->set_top_logprobs(2);
  });
  ASSERT_EQ(r.token_ids_size(), 1);
  EXPECT_EQ(r.token_ids(0), gc.greedy_ids[0]);
  ASSERT_EQ(r.prompt_logprobs_size(), static_cast<int>(gc.prompt_ids.size()) - 2);
  int k = 0;
  for (size_t i = 0; i + 1 < gc.prompt_ids.size(); ++i) {
    if (i == 1) continue;
    const std::vector<float>& row = gc.logits[i];
    const double rmx = *std::max_element(row.begin(), row.end());
    double rz = 0;
    for (float l : row) rz += std::exp(static_cast<double>(l) - rmx);
    EXPECT_NEAR(r.prompt_logprobs(k).logprob(), row[static_cast<size_t>(gc.prompt_ids[i + 1])] - rmx - std::log(rz), 1e-3);
    EXPECT_EQ(r.prompt_logprobs(k).top_ids_size(), 2);
    ++k;
  }
  {
    // The same rows with a second sequence after it in the micro-batch: the stage sets each
    // sequence's own flags (all rows' logits for this one; the id drawn where the logits are for the
    // other), so the prompt logprobs and both greedy ids come out as they do alone.
    v1::StepRequest two = Step(10, 3, 0, gc.prompt_ids, 0);
    v1::StepSequence* s = two.mutable_sequences(0);
    for (size_t i = 0; i + 1 < gc.prompt_ids.size(); ++i) s->add_prompt_logprob_targets(i == 1 ? -1 : gc.prompt_ids[i + 1]);
    s->add_prompt_logprob_targets(-1);
    s->set_top_logprobs(2);
    *two.add_sequences() = Step(10, 2, 0, gc.prompt_ids, 0).sequences(0);
    ASSERT_TRUE(stream->Write(two));
    v1::StepResponse both;
    ASSERT_TRUE(stream->Read(&both));
    ASSERT_EQ(both.error_code(), 0) << both.error_message();
    ASSERT_EQ(both.token_ids_size(), 2);
    EXPECT_EQ(both.token_ids(0), gc.greedy_ids[0]);
    EXPECT_EQ(both.token_ids(1), gc.greedy_ids[0]);
    ASSERT_EQ(both.prompt_logprobs_size(), r.prompt_logprobs_size());
    for (int j = 0; j < r.prompt_logprobs_size(); ++j) {
      EXPECT_NEAR(both.prompt_logprobs(j).logprob(), r.prompt_logprobs(j).logprob(), 1e-4);
      EXPECT_EQ(both.prompt_logprobs(j).top_ids_size(), 2);
    }
  }
  r = run(8, 0, [&](v1::StepSequence* s) { s->add_prompt_logprob_targets(3); }, /*ok=*/false);
  EXPECT_THAT(r.error_message(), HasSubstr("1 prompt_logprob_targets for 5 tokens"));
  r = run(9, 3, [](v1::StepSequence* s) { s->set_top_logprobs(21); }, /*ok=*/false);
  EXPECT_NE(r.error_code(), 0);
  EXPECT_THAT(r.error_message(), HasSubstr("top_logprobs must be in [0, 20]"));
  // Structured output's mask: only order[2] allowed; logprobs stay those of the raw logits.
  std::string mask((ref.size() + 7) / 8, '\0');
  const auto third = static_cast<size_t>(order[2]);
  mask[third / 8] = static_cast<char>(1 << (third % 8));
  r = run(5, 0, [&](v1::StepSequence* s) {
    s->set_allowed_token_mask(mask);
    s->set_logprobs(true);
  });
  ASSERT_EQ(r.token_ids_size(), 1);
  EXPECT_EQ(r.token_ids(0), order[2]);
  ASSERT_EQ(r.logprobs_size(), 1);
  EXPECT_NEAR(r.logprobs(0).logprob(), ref[third] - log_z, 1e-3);
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(StageStreamTest, BadStepsGetErrorResponsesAndTheStreamStaysUsable) {
  grpc::ClientContext ctx;
  auto stream = stub_->StepStream(&ctx);
  v1::StepResponse r;
  ASSERT_TRUE(stream->Write(Step(7, 0, 0, {5, 999}, 0)));  // token outside the vocabulary
  ASSERT_TRUE(stream->Read(&r));
  EXPECT_EQ(r.step_id(), 7u);
  EXPECT_EQ(r.error_code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_THAT(r.error_message(), HasSubstr("token id 999"));
  v1::StepRequest bad_sampling = Step(8, 0, 0, {5}, 0);
  bad_sampling.mutable_sequences(0)->mutable_sampling()->set_temperature(-1);
  ASSERT_TRUE(stream->Write(bad_sampling));
  ASSERT_TRUE(stream->Read(&r));
  EXPECT_THAT(r.error_message(), HasSubstr("temperature"));
  ASSERT_TRUE(stream->Write(Step(9, 0, 0, {5, 6}, 0)));
  ASSERT_TRUE(stream->Read(&r));
  EXPECT_EQ(r.error_code(), 0) << r.error_message();
  EXPECT_EQ(r.token_ids_size(), 1);
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

// A next stage that answers only once it holds `hold` micro-batches, and then in reverse order
// (token = 10 × step_id): stage 0 must forward micro-batch k+1 before k is answered (pipelining)
// and route answers by step_id. With `close`, it ends the stream instead of answering.
class HoldingStage final : public v1::Stage::Service {
 public:
  HoldingStage(size_t hold, bool close) : hold_(hold), close_(close) {}
  grpc::Status StepStream(grpc::ServerContext* /*ctx*/,
                          grpc::ServerReaderWriter<v1::StepResponse, v1::StepRequest>* stream) override {
    ChunkAssembler assembler(size_t{1} << 30);
    std::vector<uint64_t> ids;
    v1::StepRequest m;
    while (ids.size() < hold_ && stream->Read(&m)) {
      absl::StatusOr<bool> complete = assembler.Add(Pooled(m));
      if (!complete.ok()) return grpc::Status(grpc::StatusCode::INTERNAL, std::string(complete.status().message()));
      if (*complete) ids.push_back(assembler.Take()->step_id());
      m.Clear();
    }
    if (close_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "holding stage went away");
    for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
      v1::StepResponse r;
      r.set_step_id(*it);
      r.add_token_ids(static_cast<int32_t>(*it * 10));
      stream->Write(r);
    }
    while (stream->Read(&m)) {
    }
    return grpc::Status::OK;
  }

 private:
  const size_t hold_;
  const bool close_;
};

// Stage 0 (layer 0 of the golden llama) in front of a HoldingStage; a stream to stage 0 with a
// deadline, so that a stage that waits for each answer before forwarding the next fails the test
// instead of hanging it.
struct PipelineRig {
  testing::GoldenModel golden;
  HoldingStage next;
  std::unique_ptr<grpc::Server> next_rpc;
  RunningWorker w0;
  grpc::ClientContext ctx;
  std::unique_ptr<v1::Stage::Stub> stub;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>> stream;

  PipelineRig(size_t hold, bool close) : next(hold, close) {}
  void Start() {
    ASSERT_OK_AND_ASSIGN(golden, testing::LoadGoldenModel("llama"));
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.SetMaxReceiveMessageSize(kMaxMessageBytes);
    b.RegisterService(&next);
    next_rpc = b.BuildAndStart();
    ASSERT_NE(next_rpc, nullptr);
    w0 = StartWorker(1);
    ASSERT_TRUE(w0.server->Assign(StageAssignment(golden.dir, 0, 0, 1, 1, absl::StrCat("127.0.0.1:", port))).ok());
    ASSERT_EQ(AwaitLoaded(*w0.server).state, v1::WORKER_STATE_READY) << w0.server->Status().error;
    stub = v1::Stage::NewStub(grpc::CreateChannel(w0.address, grpc::InsecureChannelCredentials()));
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    stream = stub->StepStream(&ctx);
  }
  ~PipelineRig() {
    if (stream != nullptr) {
      ctx.TryCancel();
      stream->Finish();
    }
    if (w0.server) w0.server->Shutdown();
    if (w0.rpc) w0.rpc->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    if (next_rpc) next_rpc->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }
};

TEST(StagePipeliningTest, ForwardsTheNextMicroBatchBeforeTheLastIsAnswered) {
  PipelineRig rig(/*hold=*/3, /*close=*/false);
  ASSERT_NO_FATAL_FAILURE(rig.Start());
  ASSERT_TRUE(rig.stream->Write(Step(1, 0, 0, {5, 6}, 0)));
  ASSERT_TRUE(rig.stream->Write(Step(2, 1, 0, {7}, 0)));
  ASSERT_TRUE(rig.stream->Write(Step(3, 2, 0, {8, 9, 10}, 0)));
  std::vector<std::pair<uint64_t, int32_t>> answers;
  for (int i = 0; i < 3; ++i) {
    v1::StepResponse r;
    ASSERT_TRUE(rig.stream->Read(&r)) << "answer " << i << " never came: stage 0 did not pipeline";
    ASSERT_EQ(r.error_code(), 0) << r.error_message();
    ASSERT_EQ(r.token_ids_size(), 1);
    answers.emplace_back(r.step_id(), r.token_ids(0));
  }
  EXPECT_THAT(answers, ::testing::ElementsAre(std::pair<uint64_t, int32_t>{3, 30}, std::pair<uint64_t, int32_t>{2, 20},
                                              std::pair<uint64_t, int32_t>{1, 10}));
}

TEST(StagePipeliningTest, MicroBatchesInFlightFailWhenTheNextStageGoesAway) {
  PipelineRig rig(/*hold=*/2, /*close=*/true);
  ASSERT_NO_FATAL_FAILURE(rig.Start());
  ASSERT_TRUE(rig.stream->Write(Step(1, 0, 0, {5, 6}, 0)));
  ASSERT_TRUE(rig.stream->Write(Step(2, 1, 0, {7}, 0)));
  std::vector<uint64_t> failed;
  for (int i = 0; i < 2; ++i) {
    v1::StepResponse r;
    ASSERT_TRUE(rig.stream->Read(&r));
    EXPECT_EQ(r.error_code(), static_cast<int>(grpc::StatusCode::UNAVAILABLE));
    EXPECT_THAT(r.error_message(), HasSubstr("holding stage went away"));
    failed.push_back(r.step_id());
  }
  EXPECT_THAT(failed, ::testing::UnorderedElementsAre(1u, 2u));
}

// shardserve_worker_stage_runs_total{thread}: micro-batches run on the reading gRPC thread
// ("reader") or the stage thread ("stage").
double StageRuns(const WorkerMetrics& metrics, const std::string& thread) {
  return CounterValue(metrics, "shardserve_worker_stage_runs_total", {{"thread", thread}}).value_or(-1);
}

// Two stages of the golden Llama with WorkerOptions::stage_inline = `budget`: stage 0 = layer 0 on
// `ranks0` ranks, stage 1 = layer 1 on 1 rank. Shut down when it goes.
struct InlineStages {
  InlineStages(const std::string& model, std::chrono::microseconds budget, int ranks0, WorkerMetrics* m0,
               WorkerMetrics* m1) {
    w1 = StartWorker(WorkerOptions{.cpu_ranks = 1, .metrics = m1, .stage_inline = budget});
    w0 = StartWorker(WorkerOptions{.cpu_ranks = ranks0, .metrics = m0, .stage_inline = budget});
    EXPECT_TRUE(w1.server->Assign(StageAssignment(model, 1, 1, 2, 1, "")).ok());
    EXPECT_TRUE(w0.server->Assign(StageAssignment(model, 0, 0, 1, ranks0, w1.address)).ok());
    for (RunningWorker* w : {&w1, &w0}) {
      const WorkerStatusSnapshot st = AwaitLoaded(*w->server);
      if (st.state != v1::WORKER_STATE_READY) error += absl::StrCat(w->address, ": ", st.error, "; ");
    }
    stub = v1::Stage::NewStub(grpc::CreateChannel(w0.address, grpc::InsecureChannelCredentials()));
  }
  ~InlineStages() {
    for (RunningWorker* w : {&w0, &w1}) Stop(*w);
  }
  static void Stop(RunningWorker& w) {
    if (w.server) w.server->Shutdown();
    if (w.rpc) w.rpc->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }
  RunningWorker w0, w1;
  std::string error;  // empty when both loaded
  std::unique_ptr<v1::Stage::Stub> stub;
};

// WorkerOptions::stage_inline: a micro-batch that the stage's last step says is short runs on the
// gRPC thread that read it; the first (no step time yet) and those over the budget go to the stage
// thread. Two stages, so that stage 0 forwards from the reader thread too; the greedy tokens are
// transformers' whichever thread ran each step.
TEST(StageInlineTest, ShortStepsRunOnTheThreadThatReadThemAndGiveTheSameTokens) {
  ASSERT_OK_AND_ASSIGN(testing::GoldenModel golden, testing::LoadGoldenModel("llama"));
  const testing::GoldenCase& gc = golden.cases.back();  // the longest prompt
  const size_t steps = gc.greedy_ids.size();
  ASSERT_GE(steps, 3u);
  for (const std::chrono::microseconds budget :
       {std::chrono::microseconds(0), std::chrono::microseconds(1), std::chrono::microseconds(10'000'000)}) {
    SCOPED_TRACE(absl::StrCat("stage_inline = ", budget.count(), " us"));
    WorkerMetrics m0, m1;
    InlineStages stages(golden.dir, budget, /*ranks0=*/2, &m0, &m1);
    ASSERT_EQ(stages.error, "");
    uint64_t step = 1;
    EXPECT_EQ(GenerateThrough(*stages.stub, gc, 0, &step), gc.greedy_ids);
    for (const WorkerMetrics* m : {&m0, &m1}) {
      const double on_reader = StageRuns(*m, "reader");
      const double on_stage = StageRuns(*m, "stage");
      EXPECT_EQ(on_reader + on_stage, static_cast<double>(steps));
      if (budget.count() <= 1) {
        EXPECT_EQ(on_reader, 0);  // off, or every step takes longer than 1 us
      } else {
        // The prefill has no step time yet (nor stage 0 a link), so it goes to the stage thread.
        // Not all of the rest need run on the reader: a step may arrive after the stage thread
        // answered the last one but before it marked the stage idle, and is then queued.
        EXPECT_GE(on_stage, 1);
        EXPECT_GE(on_reader, static_cast<double>(steps) / 2);
      }
    }
  }
}

// A stage that runs its micro-batches on the reading thread and whose next stage goes away: every
// later micro-batch is still answered (UNAVAILABLE naming the next stage), none hangs, whichever
// thread runs it (the reader while the dead link still looks open, the stage thread after).
TEST(StageInlineTest, MicroBatchesAfterTheNextStageWentAwayAreAnswered) {
  ASSERT_OK_AND_ASSIGN(testing::GoldenModel golden, testing::LoadGoldenModel("llama"));
  WorkerMetrics m0;
  InlineStages stages(golden.dir, std::chrono::microseconds(10'000'000), /*ranks0=*/1, &m0, /*m1=*/nullptr);
  ASSERT_EQ(stages.error, "");
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));  // a hang fails, not blocks
  auto stream = stages.stub->StepStream(&ctx);
  const std::vector<int32_t>& prompt = golden.cases.back().prompt_ids;
  uint64_t step = 1;
  int pos = 0;
  std::vector<int32_t> next = prompt;
  for (int i = 0; i < 4; ++i, ++step) {  // the prefill, then decode steps on the reading thread
    ASSERT_TRUE(stream->Write(Step(step, 0, pos, next, static_cast<uint64_t>(i))));
    v1::StepResponse r;
    ASSERT_TRUE(stream->Read(&r));
    ASSERT_EQ(r.error_code(), 0) << r.error_message();
    pos += static_cast<int>(next.size());
    next = {r.token_ids(0)};
  }
  const std::string stage1 = stages.w1.address;
  InlineStages::Stop(stages.w1);
  for (int i = 0; i < 3; ++i, ++step) {
    ASSERT_TRUE(stream->Write(Step(step, 0, pos, next, static_cast<uint64_t>(4 + i))));
    v1::StepResponse r;
    ASSERT_TRUE(stream->Read(&r)) << "micro-batch " << step << " was never answered";
    EXPECT_EQ(r.step_id(), step);
    EXPECT_EQ(r.error_code(), static_cast<int>(grpc::StatusCode::UNAVAILABLE)) << r.error_message();
    EXPECT_THAT(r.error_message(), HasSubstr(stage1));
  }
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(StageRuns(m0, "reader") + StageRuns(m0, "stage"), 7);  // every micro-batch ran once
  EXPECT_GE(StageRuns(m0, "reader"), 1);
}

TEST(WorkerAssignTest, InvalidAssignmentsNameTheField) {
  WorkerServer w(WorkerOptions{.cpu_ranks = 1});
  v1::Assignment a = StageAssignment("tests/golden/models/llama", 0, 0, 2, 1, "");
  a.clear_model_path();
  EXPECT_THAT(w.Assign(a).message(), HasSubstr("model_path"));
  a = StageAssignment("tests/golden/models/llama", 0, 0, 2, 2, "");
  EXPECT_THAT(w.Assign(a).message(), HasSubstr("device 1 is not one of this worker's"));
  a = StageAssignment("tests/golden/models/llama", 0, 0, 2, 1, "");
  a.set_device_kind(v1::DEVICE_KIND_CUDA);
  EXPECT_THAT(w.Assign(a).message(), HasSubstr("does not match"));
  a = StageAssignment("tests/golden/models/llama", 0, 0, 2, 1, "");
  a.set_kv_blocks(0);
  EXPECT_THAT(w.Assign(a).message(), HasSubstr("kv_blocks must be in [1, 2^31 - 1], got 0"));
  a = StageAssignment("tests/golden/models/llama", 0, 0, 2, 1, "");
  a.set_kv_block_size(0);
  EXPECT_THAT(w.Assign(a).message(), HasSubstr("kv_block_size must be >= 1, got 0"));
  a = StageAssignment("tests/golden/models/llama", 0, 0, 2, 1, "");
  a.set_quantize(static_cast<v1::WeightQuantization>(5));
  EXPECT_THAT(w.Assign(a).message(), HasSubstr("quantize 5 is not a known WeightQuantization"));
  a = StageAssignment("tests/golden/models/llama", 0, 0, 2, 1, "");
  a.set_kv_cache_dtype(static_cast<v1::KvCacheDtype>(9));
  EXPECT_THAT(w.Assign(a).message(), HasSubstr("kv_cache_dtype 9 is not a known KvCacheDtype"));
  a = StageAssignment("tests/golden/models/llama", 0, 0, 2, 1, "");
  a.set_hidden_wire_dtype(v1::DTYPE_F16);
  EXPECT_THAT(w.Assign(a), StatusIs(absl::StatusCode::kInvalidArgument,
                                    HasSubstr("hidden_wire_dtype DTYPE_F16 is not F32 or BF16")));
  a.set_hidden_wire_dtype(static_cast<v1::DType>(12));
  EXPECT_THAT(w.Assign(a).message(), HasSubstr("hidden_wire_dtype 12 is not F32 or BF16"));
  // Nothing was taken: the worker is still idle.
  EXPECT_EQ(w.Status().state, v1::WORKER_STATE_IDLE);
}

TEST(WorkerAssignTest, AssignmentThatCannotLoadReportsFailedWithTheReason) {
  WorkerServer w(WorkerOptions{.cpu_ranks = 1});
  ASSERT_TRUE(w.Assign(StageAssignment("/nonexistent/model", 0, 0, 2, 1, "")).ok());
  WorkerStatusSnapshot s = AwaitLoaded(w);
  EXPECT_EQ(s.state, v1::WORKER_STATE_FAILED);
  EXPECT_THAT(s.error, HasSubstr("/nonexistent/model/config.json"));
  // A last-layer mismatch with next_address is caught at load.
  ASSERT_TRUE(w.Assign(StageAssignment("tests/golden/models/llama", 0, 0, 1, 1, "")).ok());
  s = AwaitLoaded(w);
  EXPECT_EQ(s.state, v1::WORKER_STATE_FAILED);
  EXPECT_THAT(s.error, HasSubstr("do not end the model but next_address is \"\""));
  // An FP8 KV cache for multi-head latent attention is refused at load, with the reason.
  v1::Assignment mla = StageAssignment("tests/golden/models/deepseek_v2_lite", 0, 0, 3, 1, "");
  mla.set_kv_cache_dtype(v1::KV_CACHE_DTYPE_FP8_E4M3);
  ASSERT_TRUE(w.Assign(mla).ok());
  s = AwaitLoaded(w);
  EXPECT_EQ(s.state, v1::WORKER_STATE_FAILED);
  EXPECT_THAT(s.error, HasSubstr("multi-head latent attention (kv_lora_rank > 0)"));
}

v1::Assignment ExpertHostAssignment(const std::string& model,
                                    const std::vector<std::tuple<int, int, int>>& experts) {
  v1::Assignment a;
  a.set_assignment_id("test-experts");
  a.set_model_path(model);
  a.set_role(v1::ASSIGNMENT_ROLE_EXPERT_HOST);
  a.set_device_kind(v1::DEVICE_KIND_CPU);
  std::set<int> devices;
  for (const auto& [layer, expert, device] : experts) {
    v1::HostedExpert* e = a.add_hosted_experts();
    e->set_layer(layer);
    e->set_expert(expert);
    e->set_device(device);
    devices.insert(device);
  }
  for (int d : devices) a.add_devices(d);
  return a;
}

TEST(ExpertServiceTest, RemoteCallsGiveTheHostsAnswerAcrossSplitCalls) {
  const std::string dir = "tests/golden/models/qwen2_moe";  // layers 0 and 2 MoE, 8 experts, hidden 64
  RunningWorker w = StartWorker(2);
  ASSERT_TRUE(w.server->Assign(ExpertHostAssignment(dir, {{0, 1, 0}, {0, 3, 1}, {0, 5, 0}, {2, 0, 1}})).ok());
  ASSERT_EQ(AwaitLoaded(*w.server).state, v1::WORKER_STATE_READY);
  EXPECT_EQ(w.server->Status().kv_blocks, 0);

  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(dir));
  ASSERT_OK_AND_ASSIGN(auto ckpt, Checkpoint::Open(dir));
  ASSERT_OK_AND_ASSIGN(auto reference, engine::ExpertHost::Create(spec, *ckpt, {{0, 1, 0}, {0, 3, 0}, {0, 5, 0}},
                                                                  kernels::DeviceKind::kCpu, 1));
  // Expert 7 of layer 0 names the host, which does not hold it.
  std::vector<std::string> layer0(8, "");
  for (int e : {1, 3, 5, 7}) layer0[static_cast<size_t>(e)] = w.address;
  ASSERT_OK_AND_ASSIGN(auto remote, GrpcRemoteExperts::Create({{0, layer0}}, spec.hidden_size, "test-stage",
                                                              std::chrono::seconds(10), nullptr,
                                                              /*max_rows_per_call=*/3));
  const int64_t h = spec.hidden_size;
  const std::vector<engine::ExpertRows> groups{{1, 4}, {3, 2}, {5, 1}};  // 7 rows: calls of 3, 3 and 1
  std::vector<float> x(static_cast<size_t>(7 * h));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 37) % 101) / 50.0f - 1.0f;
  std::vector<float> got(x.size(), 0.f), want(x.size(), 0.f);
  ASSERT_THAT(remote->Start(0, groups, x, absl::MakeSpan(got))->Wait(), IsOk());
  ASSERT_THAT(reference->Compute(0, groups, x, absl::MakeSpan(want)), IsOk());
  for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-5f) << "value " << i;
  EXPECT_NE(got[0], 0.f);

  EXPECT_THAT(remote->Start(0, {{7, 1}}, std::vector<float>(static_cast<size_t>(h)), absl::MakeSpan(got).first(64))
                  ->Wait(),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr(absl::StrCat("expert host ", w.address, ": this worker does not host expert 7 of layer 0"))));
  EXPECT_THAT(remote->Start(0, {{2, 1}}, std::vector<float>(static_cast<size_t>(h)), absl::MakeSpan(got).first(64))
                  ->Wait(),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("expert 2 of layer 0 has no host")));

  // A host that is not there: UNAVAILABLE (or the deadline), naming it.
  ASSERT_OK_AND_ASSIGN(auto nowhere, GrpcRemoteExperts::Create({{0, {"", "127.0.0.1:1", "", "", "", "", "", ""}}},
                                                               spec.hidden_size, "test-stage",
                                                               std::chrono::seconds(2), nullptr));
  const absl::Status st =
      nowhere->Start(0, {{1, 1}}, std::vector<float>(static_cast<size_t>(h)), absl::MakeSpan(got).first(64))->Wait();
  EXPECT_TRUE(st.code() == absl::StatusCode::kUnavailable || st.code() == absl::StatusCode::kDeadlineExceeded) << st;
  EXPECT_THAT(st.message(), HasSubstr("expert host 127.0.0.1:1"));
}

// With the bf16 wire (the coordinator's --hidden_wire_dtype=bf16) the rows go out rounded to bfloat16 and the host
// answers in bfloat16: what comes back is the reference's experts over the rounded rows, rounded
// (within one bf16 step where the two computations' last f32 bits straddle a rounding boundary),
// and every value is a bfloat16. Twice the rows fit in a call.
TEST(ExpertServiceTest, Bf16CallsCarryRoundedRowsBothWays) {
  const std::string dir = "tests/golden/models/qwen2_moe";
  RunningWorker w = StartWorker(2);
  ASSERT_TRUE(w.server->Assign(ExpertHostAssignment(dir, {{0, 1, 0}, {0, 3, 1}})).ok());
  ASSERT_EQ(AwaitLoaded(*w.server).state, v1::WORKER_STATE_READY);
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(dir));
  ASSERT_OK_AND_ASSIGN(auto ckpt, Checkpoint::Open(dir));
  ASSERT_OK_AND_ASSIGN(auto reference,
                       engine::ExpertHost::Create(spec, *ckpt, {{0, 1, 0}, {0, 3, 0}}, kernels::DeviceKind::kCpu, 1));
  std::vector<std::string> layer0(8, "");
  for (int e : {1, 3}) layer0[static_cast<size_t>(e)] = w.address;
  ASSERT_OK_AND_ASSIGN(auto f32, GrpcRemoteExperts::Create({{0, layer0}}, spec.hidden_size, "test-stage",
                                                           std::chrono::seconds(10), nullptr));
  ASSERT_OK_AND_ASSIGN(auto bf16, GrpcRemoteExperts::Create({{0, layer0}}, spec.hidden_size, "test-stage",
                                                            std::chrono::seconds(10), nullptr, 0, nullptr,
                                                            DType::kBF16));
  EXPECT_EQ(bf16->max_rows_per_call(), 2 * f32->max_rows_per_call());
  const int64_t h = spec.hidden_size;
  const std::vector<engine::ExpertRows> groups{{1, 3}, {3, 2}};
  std::vector<float> x(static_cast<size_t>(5 * h));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 37) % 101) / 50.0f - 1.0f;
  std::vector<float> rounded(x.size());
  for (size_t i = 0; i < x.size(); ++i) rounded[i] = BFloat16ToFloat(FloatToBFloat16(x[i]));
  ASSERT_NE(rounded, x);  // the rows are not all bf16 values already
  std::vector<float> got(x.size(), 0.f), want(x.size(), 0.f);
  ASSERT_THAT(bf16->Start(0, groups, x, absl::MakeSpan(got))->Wait(), IsOk());
  ASSERT_THAT(reference->Compute(0, groups, rounded, absl::MakeSpan(want)), IsOk());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>(got[i]) & 0xffffu, 0u) << "value " << i << " is not a bfloat16";
    const float w16 = BFloat16ToFloat(FloatToBFloat16(want[i]));
    ASSERT_NEAR(got[i], w16, std::abs(w16) * 0x1p-7f + 1e-6f) << "value " << i;
  }
  EXPECT_NE(got[0], 0.f);
}

// An expert host that answers each call with what `answer` makes of its request: the client must
// refuse an answer of the wrong dtype, shape or size with an error naming the host, not read it.
class FakeExpertHost final : public v1::Expert::Service {
 public:
  explicit FakeExpertHost(std::function<grpc::Status(const v1::ExpertRequest&, v1::ExpertResponse*)> answer)
      : answer_(std::move(answer)) {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
    address_ = absl::StrCat("127.0.0.1:", port);
  }
  ~FakeExpertHost() override { server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2)); }
  const std::string& address() const { return address_; }

  grpc::Status Compute(grpc::ServerContext*, const v1::ExpertRequest* req, v1::ExpertResponse* resp) override {
    return answer_(*req, resp);
  }

 private:
  std::function<grpc::Status(const v1::ExpertRequest&, v1::ExpertResponse*)> answer_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

TEST(ExpertServiceTest, AnswersOfTheWrongDtypeShapeOrSizeAreRefusedNamingTheHost) {
  constexpr int64_t kHidden = 8;
  // The request's rows echoed back as the answer, then spoiled by `spoil`.
  auto echo = [](std::function<void(v1::Tensor&)> spoil) {
    return [spoil](const v1::ExpertRequest& req, v1::ExpertResponse* resp) {
      *resp->mutable_y() = req.x();
      spoil(*resp->mutable_y());
      return grpc::Status::OK;
    };
  };
  const std::vector<float> x(static_cast<size_t>(3 * kHidden), 0.5f);
  struct Case {
    std::string name;
    DType wire;
    std::function<void(v1::Tensor&)> spoil;
    std::string error;  // empty: the answer is good
  };
  const std::vector<Case> cases = {
      {"bf16 echo", DType::kBF16, [](v1::Tensor&) {}, ""},
      {"f32 echo", DType::kF32, [](v1::Tensor&) {}, ""},
      {"f32 answer to bf16 rows", DType::kBF16,
       [](v1::Tensor& t) {
         t.set_dtype(v1::DTYPE_F32);
         t.mutable_data()->append(t.data());  // even the bytes of an F32 [3, 8]
       },
       "the answer is not BF16 [3, 8]"},
      {"bf16 answer to f32 rows", DType::kF32, [](v1::Tensor& t) { t.set_dtype(v1::DTYPE_BF16); },
       "the answer is not F32 [3, 8]"},
      {"a row short", DType::kF32, [](v1::Tensor& t) { t.set_shape(0, 2); }, "the answer is not F32 [3, 8]"},
      {"one dimension", DType::kF32,
       [](v1::Tensor& t) {
         t.clear_shape();
         t.add_shape(3 * kHidden);
       },
       "the answer is not F32 [3, 8]"},
      {"a byte short", DType::kBF16, [](v1::Tensor& t) { t.mutable_data()->pop_back(); },
       "the answer is not BF16 [3, 8]"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    FakeExpertHost host(echo(c.spoil));
    ASSERT_OK_AND_ASSIGN(auto remote, GrpcRemoteExperts::Create({{0, {host.address(), host.address()}}}, kHidden,
                                                                "test-stage", std::chrono::seconds(10), nullptr, 0,
                                                                nullptr, c.wire));
    std::vector<float> y(x.size(), -1.f);
    const absl::Status st = remote->Start(0, {{0, 2}, {1, 1}}, x, absl::MakeSpan(y))->Wait();
    if (c.error.empty()) {
      ASSERT_THAT(st, IsOk());
      EXPECT_EQ(y, x);  // 0.5 is a bfloat16: the echo is exact both ways
    } else {
      EXPECT_THAT(st, StatusIs(absl::StatusCode::kInternal,
                               HasSubstr(absl::StrCat("expert host ", host.address(), ": ", c.error))));
      EXPECT_EQ(y, std::vector<float>(x.size(), -1.f));  // nothing of a refused answer is written
    }
  }
  // The host's own error reaches the caller with its code, naming the host.
  FakeExpertHost failing([](const v1::ExpertRequest&, v1::ExpertResponse*) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "out of expert memory");
  });
  ASSERT_OK_AND_ASSIGN(auto remote, GrpcRemoteExperts::Create({{0, {failing.address()}}}, kHidden, "test-stage",
                                                              std::chrono::seconds(10), nullptr));
  std::vector<float> y(static_cast<size_t>(kHidden));
  EXPECT_THAT(remote->Start(0, {{0, 1}}, absl::MakeConstSpan(x).first(kHidden), absl::MakeSpan(y))->Wait(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr(absl::StrCat("expert host ", failing.address(), ": out of expert memory"))));
}

TEST(ExpertServiceTest, AWorkerWithoutExpertsAndBadRequestsAreRefused) {
  RunningWorker w = StartWorker(1);
  v1::ExpertRequest req;
  req.set_layer(0);
  v1::ExpertResponse resp;
  EXPECT_THAT(w.server->ComputeExperts(req, &resp),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("hosts no experts")));
  ASSERT_TRUE(w.server->Assign(ExpertHostAssignment("tests/golden/models/qwen2_moe", {{0, 1, 0}})).ok());
  ASSERT_EQ(AwaitLoaded(*w.server).state, v1::WORKER_STATE_READY);
  v1::ExpertGroup* g = req.add_groups();
  g->set_expert(1);
  g->set_rows(2);
  req.mutable_x()->set_dtype(v1::DTYPE_F32);
  req.mutable_x()->add_shape(1);
  req.mutable_x()->add_shape(64);
  req.mutable_x()->set_data(std::string(64 * 4, '\0'));
  EXPECT_THAT(w.server->ComputeExperts(req, &resp),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("x must be F32 or BF16 [2 rows")));
  g->set_rows(0);
  EXPECT_THAT(w.server->ComputeExperts(req, &resp),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rows must be >= 1")));
  g->set_rows(1);
  ASSERT_THAT(w.server->ComputeExperts(req, &resp), IsOk());
  EXPECT_EQ(resp.y().shape_size(), 2);
  EXPECT_EQ(resp.y().data().size(), 64u * 4u);
  // A stage step sent to an expert host is refused, not lost.
  absl::Notification answered;
  v1::StepResponse step;
  w.server->Enqueue(w.server->request_pool().Take(), [&](v1::StepResponse r) {
    step = std::move(r);
    answered.Notify();
  });
  ASSERT_TRUE(answered.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(step.error_code(), static_cast<int>(absl::StatusCode::kUnavailable));
  // Expert.Compute goes through the expert threads: answered from there, and refused (inline,
  // never dropped) once the worker stops.
  absl::Notification computed;
  absl::Status queued_status = absl::UnknownError("not answered");
  v1::ExpertResponse queued;
  w.server->EnqueueExpertCall(&req, &queued, [&](const absl::Status& st) {
    queued_status = st;
    computed.Notify();
  });
  ASSERT_TRUE(computed.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_THAT(queued_status, IsOk());
  EXPECT_EQ(queued.y().data(), resp.y().data());
  w.server->Shutdown();
  absl::Status after_stop;
  w.server->EnqueueExpertCall(&req, &queued, [&](const absl::Status& st) { after_stop = st; });
  EXPECT_THAT(after_stop, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("shutting down")));
}

TEST(WorkerAssignTest, InvalidExpertAssignmentsNameTheField) {
  WorkerServer w(WorkerOptions{.cpu_ranks = 2});
  v1::Assignment a = ExpertHostAssignment("tests/golden/models/qwen2_moe", {});
  a.add_devices(0);
  EXPECT_THAT(w.Assign(a).message(), HasSubstr("an expert host needs hosted_experts"));
  a = ExpertHostAssignment("tests/golden/models/qwen2_moe", {{0, 1, 1}});
  a.set_devices(0, 0);
  EXPECT_THAT(w.Assign(a).message(), HasSubstr("hosted expert 1 of layer 0 is on device 1, not one of the assignment's"));
  a = StageAssignment("tests/golden/models/qwen2_moe", 0, 0, 3, 1, "");
  a.add_hosted_experts()->set_expert(1);
  EXPECT_THAT(w.Assign(a).message(), HasSubstr("hosted_experts are for ASSIGNMENT_ROLE_EXPERT_HOST"));
  a = StageAssignment("tests/golden/models/qwen2_moe", 0, 0, 3, 1, "");
  v1::LayerExperts* le = a.add_experts();
  le->set_layer(2);
  le->add_ranks(0);
  le->add_ranks(-1);
  le->add_addresses("");
  EXPECT_THAT(w.Assign(a).message(), HasSubstr("experts of layer 2: 2 ranks but 1 addresses"));
  le->add_addresses("");
  EXPECT_THAT(w.Assign(a).message(), HasSubstr("expert 1 of layer 2: a remote expert (rank -1) needs an address"));
  a.set_role(static_cast<v1::AssignmentRole>(7));
  EXPECT_THAT(w.Assign(a).message(), HasSubstr("unknown assignment role 7"));
}

TEST(ConvertTest, LargeHiddenStatesAreChunkedAndReassembled) {
  StageBatch batch;
  batch.step_id = 42;
  StageSequence s;
  s.step.block_ids = {7, 3, 5};
  s.step.num_tokens = 1024;
  batch.sequences.push_back(s);
  const int64_t hidden = 1100;  // 1024 x 1100 x 4 bytes = 4.3 MiB: three chunks
  batch.hidden.resize(1024 * hidden);
  for (size_t i = 0; i < batch.hidden.size(); ++i) batch.hidden[i] = static_cast<float>(i % 9973);
  const auto pool = rpc::MessagePool<v1::StepRequest>::Create(1024, 4);
  std::vector<float> engine_output = batch.hidden;  // as the engine returns it, moved in
  const char* const output_bytes = reinterpret_cast<const char*>(engine_output.data());
  rpc::StageStreamClient::Messages msgs = ToNextStage(batch, std::move(engine_output), hidden, *pool);
  ASSERT_EQ(msgs.size(), 3u);
  ChunkAssembler assembler(size_t{1} << 30);
  for (size_t i = 0; i < msgs.size(); ++i) {
    // The bytes ride beside the message, not in it: slices of the engine's own output buffer.
    EXPECT_TRUE(msgs[i]->hidden().data().empty());
    EXPECT_EQ(msgs.hidden(i).size(), i < 2 ? kMaxChunkBytes : batch.hidden.size() * sizeof(float) - 2 * kMaxChunkBytes);
    EXPECT_EQ(reinterpret_cast<const char*>(msgs.hidden(i).begin()), output_bytes + i * kMaxChunkBytes);
    // What the stream writes, parsed as the next stage parses it.
    grpc::ByteBuffer wire = rpc::StageStreamClient::WireMessage(*msgs[i], msgs.hidden(i));
    EXPECT_LE(wire.Length(), static_cast<size_t>(kMaxMessageBytes));
    v1::StepRequest parsed;
    ASSERT_TRUE(grpc::SerializationTraits<v1::StepRequest>::Deserialize(&wire, &parsed).ok());
    ASSERT_OK_AND_ASSIGN(bool done, assembler.Add(Pooled(parsed)));
    EXPECT_EQ(done, i + 1 == 3);
  }
  // The reassembled message stays alive: the batch reads its hidden states in place.
  const PooledStepRequest pooled = assembler.Take();
  const v1::StepRequest& whole = *pooled;
  ASSERT_OK_AND_ASSIGN(StageBatch back, FromProto(whole, hidden));
  EXPECT_EQ(back.step_id, 42u);
  EXPECT_EQ(back.sequences[0].step.NumTokens(), 1024);
  EXPECT_EQ(back.sequences[0].step.block_ids, (std::vector<int32_t>{7, 3, 5}));
  EXPECT_EQ(back.hidden_in.data(), reinterpret_cast<const float*>(whole.hidden().data().data()));
  EXPECT_TRUE(back.hidden.empty());  // not copied
  const absl::Span<const float> got = back.input();
  EXPECT_EQ(std::vector<float>(got.begin(), got.end()), batch.hidden);
}

TEST(ConvertTest, InconsistentChunksAndTensorsAreRejected) {
  ChunkAssembler assembler(1000);
  v1::StepRequest c1;
  c1.set_chunk_index(1);
  c1.set_chunk_count(2);
  EXPECT_THAT(assembler.Add(Pooled(c1)).status().message(), HasSubstr("chunk 0 expected"));
  v1::StepRequest big;
  big.set_chunk_count(1);
  big.mutable_hidden()->set_data(std::string(2000, 'x'));
  EXPECT_THAT(assembler.Add(Pooled(big)).status().message(), HasSubstr("exceed 1000 bytes"));
  v1::StepRequest wrong = Step(1, 0, 0, {1, 2}, 0);
  wrong.mutable_hidden()->set_dtype(v1::DTYPE_F16);
  EXPECT_THAT(FromProto(wrong, 64).status().message(), HasSubstr("must be F32 or BF16, got dtype 2"));
  wrong.mutable_hidden()->set_dtype(v1::DTYPE_F32);
  wrong.mutable_hidden()->add_shape(2);
  wrong.mutable_hidden()->add_shape(63);
  EXPECT_THAT(FromProto(wrong, 64).status().message(), HasSubstr("shape [2, 64]"));
  // BF16 states of the F32 size (or F32 states of the BF16 size) are refused by their byte count.
  v1::StepRequest sized = Step(1, 0, 0, {1, 2}, 0);
  sized.mutable_hidden()->add_shape(2);
  sized.mutable_hidden()->add_shape(64);
  sized.mutable_hidden()->set_dtype(v1::DTYPE_BF16);
  sized.mutable_hidden()->set_data(std::string(2 * 64 * 4, '\0'));
  EXPECT_THAT(FromProto(sized, 64).status().message(), HasSubstr("carry 512 bytes; 256 expected for BF16"));
  sized.mutable_hidden()->set_dtype(v1::DTYPE_F32);
  sized.mutable_hidden()->set_data(std::string(2 * 64 * 2, '\0'));
  EXPECT_THAT(FromProto(sized, 64).status().message(), HasSubstr("carry 256 bytes; 512 expected for F32"));
}

// BF16 on the wire: half the bytes, in chunks of the same size; the next stage widens each value
// back to the float its bf16 stands for (round to nearest even; checked against known encodings
// in dtype_test), including values that are not exact in bf16.
TEST(ConvertTest, Bf16HiddenStatesTravelAsHalfTheBytesAndWidenOnArrival) {
  StageBatch batch;
  batch.step_id = 9;
  StageSequence s;
  s.step.block_ids = {2};
  s.step.num_tokens = 1024;
  batch.sequences.push_back(s);
  const int64_t hidden = 1100;  // 1024 x 1100 x 2 bytes = 2.15 MiB: two chunks (three as F32)
  std::vector<float> engine_output(1024 * hidden);
  for (size_t i = 0; i < engine_output.size(); ++i) {
    engine_output[i] = (static_cast<float>(i % 9973) - 4986.f) * 0.0137f;
  }
  const std::vector<float> sent = engine_output;
  const auto pool = rpc::MessagePool<v1::StepRequest>::Create(1024, 4);
  rpc::StageStreamClient::Messages msgs = ToNextStage(batch, std::move(engine_output), hidden, *pool, DType::kBF16);
  ASSERT_EQ(msgs.size(), 2u);
  EXPECT_EQ(msgs[0]->hidden().dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(msgs.hidden(0).size(), kMaxChunkBytes);
  EXPECT_EQ(msgs.hidden(1).size(), sent.size() * 2 - kMaxChunkBytes);
  ChunkAssembler assembler(size_t{1} << 30);
  for (size_t i = 0; i < msgs.size(); ++i) {
    grpc::ByteBuffer wire = rpc::StageStreamClient::WireMessage(*msgs[i], msgs.hidden(i));
    v1::StepRequest parsed;
    ASSERT_TRUE(grpc::SerializationTraits<v1::StepRequest>::Deserialize(&wire, &parsed).ok());
    ASSERT_OK_AND_ASSIGN(bool done, assembler.Add(Pooled(parsed)));
    EXPECT_EQ(done, i + 1 == 2);
  }
  const PooledStepRequest pooled = assembler.Take();
  StageBatch back;
  back.hidden_in = absl::MakeConstSpan(sent);  // left over from a previous F32 step: must be reset
  ASSERT_THAT(FromProto(*pooled, hidden, &back), IsOk());
  EXPECT_EQ(back.hidden_in.data(), nullptr);
  const absl::Span<const float> got = back.input();
  ASSERT_EQ(got.size(), sent.size());
  size_t inexact = 0;
  for (size_t i = 0; i < sent.size(); ++i) {
    ASSERT_EQ(got[i], BFloat16ToFloat(FloatToBFloat16(sent[i]))) << i;
    ASSERT_LE(std::abs(got[i] - sent[i]), std::abs(sent[i]) * 0x1p-8f) << i;  // half an ulp of 8 bits
    inexact += got[i] != sent[i];
  }
  EXPECT_GT(inexact, sent.size() / 2);  // the rounding happened
}

TEST(OfferedGpuBytesTest, KeepsBackTheUnusedFractionOfTheWholeDevice) {
  const int64_t gib = int64_t{1} << 30;
  // An idle 80 GiB device at 0.9 offers 72 GiB; with 20 GiB held by another process, 52 GiB.
  EXPECT_EQ(OfferedGpuBytes(80 * gib, 80 * gib, 0.9), 80 * gib - 8 * gib);
  EXPECT_EQ(OfferedGpuBytes(80 * gib, 60 * gib, 0.9), 52 * gib);
  EXPECT_EQ(OfferedGpuBytes(80 * gib, 60 * gib, 1.0), 60 * gib);
  // Already fuller than the fraction allows: nothing.
  EXPECT_EQ(OfferedGpuBytes(80 * gib, 4 * gib, 0.9), 0);
}


// What one pipeline of stories260K (trained; 5 layers as stages [0, 2) and [2, 5)) answers for
// every reference case: the greedy ids, and the first token's top-20 logprobs.
struct WireRun {
  std::vector<std::vector<int32_t>> greedy;
  std::vector<v1::TokenLogprobs> first;
  double tx_bytes = 0;  // stage 0's downstream stream bytes
  int64_t tokens = 0;   // hidden-state rows forwarded
};

WireRun RunStoriesPipeline(const testing::GoldenModel& model, DType wire) {
  WireRun run;
  WorkerMetrics metrics;
  RunningWorker w1 = StartWorker(1);
  RunningWorker w0 = StartWorker(1, &metrics);
  EXPECT_TRUE(w1.server->Assign(StageAssignment(model.dir, 1, 2, 5, 1, "")).ok());
  v1::Assignment first = StageAssignment(model.dir, 0, 0, 2, 1, w1.address);
  first.set_hidden_wire_dtype(ToWireDtype(wire));
  EXPECT_TRUE(w0.server->Assign(first).ok());
  EXPECT_EQ(AwaitLoaded(*w1.server).state, v1::WORKER_STATE_READY) << w1.server->Status().error;
  EXPECT_EQ(AwaitLoaded(*w0.server).state, v1::WORKER_STATE_READY) << w0.server->Status().error;
  auto stub = v1::Stage::NewStub(grpc::CreateChannel(w0.address, grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext ctx;
    auto stream = stub->StepStream(&ctx);
    uint64_t step = 1;
    for (size_t c = 0; c < model.cases.size(); ++c) {
      const testing::GoldenCase& gc = model.cases[c];
      std::vector<int32_t> out, next = gc.prompt_ids;
      int pos = 0;
      for (size_t i = 0; i < gc.greedy_ids.size(); ++i, ++step) {
        v1::StepRequest req = Step(step, static_cast<int>(c % 4), pos, next, i);
        if (i == 0) {
          req.mutable_sequences(0)->set_logprobs(true);
          req.mutable_sequences(0)->set_top_logprobs(20);
        }
        if (!stream->Write(req)) break;
        v1::StepResponse r;
        if (!stream->Read(&r) || r.error_code() != 0 || r.token_ids_size() != 1) {
          ADD_FAILURE() << "step " << step << ": " << r.error_message();
          break;
        }
        if (i == 0 && r.logprobs_size() == 1) run.first.push_back(r.logprobs(0));
        run.tokens += static_cast<int64_t>(next.size());
        pos += static_cast<int>(next.size());
        out.push_back(r.token_ids(0));
        next = {r.token_ids(0)};
      }
      run.greedy.push_back(out);
    }
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
  }
  run.tx_bytes = CounterValue(metrics, "shardserve_worker_stream_bytes_total",
                              {{"direction", "tx"}, {"peer", "downstream"}})
                     .value_or(0);
  for (RunningWorker* w : {&w0, &w1}) {
    w->server->Shutdown();
    w->rpc->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }
  return run;
}

// Assignment.hidden_wire_dtype BF16 (the coordinator's --hidden_wire_dtype=bf16) against
// transformers' outputs for the trained stories260K: the greedy continuations stay the
// reference's, and the first token's logprobs move by at most a bound measured here (the f32
// wire, the same pipeline, stays within the golden tests' 1e-3); the hop carries 2 bytes per value
// fewer than the f32 wire does.
TEST(HiddenWireDtypeTest, Bf16HopsKeepStories260KOnTransformersOutputs) {
  ASSERT_OK_AND_ASSIGN(const testing::GoldenModel model, testing::LoadStories260K());
  const WireRun f32 = RunStoriesPipeline(model, DType::kF32);
  const WireRun bf16 = RunStoriesPipeline(model, DType::kBF16);
  const int64_t hidden = 64;
  ASSERT_EQ(f32.tokens, bf16.tokens);
  // Stage 0 forwards every row; bf16 halves the hidden-state bytes (the rest of each message is
  // the same, up to a varint byte or two per message).
  const double saved = f32.tx_bytes - bf16.tx_bytes;
  const double expected = 2.0 * static_cast<double>(hidden * f32.tokens);
  EXPECT_GT(saved, 0.97 * expected) << f32.tx_bytes << " against " << bf16.tx_bytes;
  EXPECT_LT(saved, 1.03 * expected) << f32.tx_bytes << " against " << bf16.tx_bytes;
  ASSERT_EQ(f32.first.size(), model.cases.size());
  ASSERT_EQ(bf16.first.size(), model.cases.size());
  double worst[2] = {0, 0};
  for (size_t c = 0; c < model.cases.size(); ++c) {
    const testing::GoldenCase& gc = model.cases[c];
    EXPECT_EQ(f32.greedy[c], gc.greedy_ids) << "f32, case " << c;
    EXPECT_EQ(bf16.greedy[c], gc.greedy_ids) << "bf16, case " << c;
    const std::vector<float>& ref = gc.last_logits;
    const double mx = *std::max_element(ref.begin(), ref.end());
    double z = 0;
    for (float l : ref) z += std::exp(static_cast<double>(l) - mx);
    const double log_z = mx + std::log(z);
    for (int w = 0; w < 2; ++w) {
      const v1::TokenLogprobs& got = (w == 0 ? f32 : bf16).first[c];
      ASSERT_EQ(got.top_ids_size(), 20);
      for (int i = 0; i < 20; ++i) {
        const double want = ref[static_cast<size_t>(got.top_ids(i))] - log_z;
        worst[w] = std::max(worst[w], std::abs(got.top_logprobs(i) - want));
      }
    }
  }
  EXPECT_LE(worst[0], 1e-3);
  EXPECT_LE(worst[1], 5e-2);
  std::printf("max |logprob - transformers'| over the first tokens' top 20: f32 wire %.2e, bf16 wire %.2e; "
              "stage 0 sent %.0f bytes (f32) and %.0f (bf16) for %lld rows\n",
              worst[0], worst[1], f32.tx_bytes, bf16.tx_bytes, static_cast<long long>(f32.tokens));
}

// An assignment that changes only hidden_wire_dtype keeps the stage loaded (no weight load) and
// the next micro-batch travels in the new dtype: half the bytes of the same step before.
TEST(HiddenWireDtypeTest, AChangeOfDtypeKeepsTheStageLoadedAndTakesEffect) {
  ASSERT_OK_AND_ASSIGN(const testing::GoldenModel model, testing::LoadStories260K());
  WorkerMetrics metrics;
  RunningWorker w1 = StartWorker(1);
  RunningWorker w0 = StartWorker(1, &metrics);
  ASSERT_TRUE(w1.server->Assign(StageAssignment(model.dir, 1, 2, 5, 1, "")).ok());
  v1::Assignment a = StageAssignment(model.dir, 0, 0, 2, 1, w1.address);
  ASSERT_TRUE(w0.server->Assign(a).ok());
  ASSERT_EQ(AwaitLoaded(*w1.server).state, v1::WORKER_STATE_READY) << w1.server->Status().error;
  ASSERT_EQ(AwaitLoaded(*w0.server).state, v1::WORKER_STATE_READY) << w0.server->Status().error;
  auto stub = v1::Stage::NewStub(grpc::CreateChannel(w0.address, grpc::InsecureChannelCredentials()));
  const std::vector<int32_t> prompt = model.cases[0].prompt_ids;
  // One prefill of the prompt through both stages (as a new sequence each time): its token, and
  // the bytes stage 0 sent downstream for it.
  auto prefill = [&](uint64_t step, int slot) -> std::pair<int32_t, double> {
    const double before = CounterValue(metrics, "shardserve_worker_stream_bytes_total",
                                       {{"direction", "tx"}, {"peer", "downstream"}})
                              .value_or(0);
    grpc::ClientContext ctx;
    auto stream = stub->StepStream(&ctx);
    v1::StepResponse r;
    EXPECT_TRUE(stream->Write(Step(step, slot, 0, prompt, 0)));
    EXPECT_TRUE(stream->Read(&r));
    EXPECT_EQ(r.error_code(), 0) << r.error_message();
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
    const double after = CounterValue(metrics, "shardserve_worker_stream_bytes_total",
                                      {{"direction", "tx"}, {"peer", "downstream"}})
                             .value_or(0);
    return {r.token_ids_size() == 1 ? r.token_ids(0) : -1, after - before};
  };
  const auto [f32_token, f32_bytes] = prefill(1, 0);
  EXPECT_EQ(f32_token, model.cases[0].greedy_ids[0]);

  a.set_assignment_id("test-0-bf16");
  a.set_hidden_wire_dtype(v1::DTYPE_BF16);
  ASSERT_THAT(w0.server->Assign(a), IsOk());
  EXPECT_EQ(w0.server->Status().state, v1::WORKER_STATE_READY);  // at once: nothing to load
  EXPECT_EQ(w0.server->Status().assignment_id, "test-0-bf16");
  EXPECT_EQ(w0.server->weight_loads(), 1);
  const auto [bf16_token, bf16_bytes] = prefill(2, 1);
  EXPECT_EQ(bf16_token, model.cases[0].greedy_ids[0]);
  const double saved = 2.0 * 64 * static_cast<double>(prompt.size());  // 2 bytes per value
  EXPECT_NEAR(f32_bytes - bf16_bytes, saved, 0.03 * saved) << f32_bytes << " against " << bf16_bytes;

  // Back to F32 (UNSPECIFIED means F32): the bytes of the first prefill again.
  a.set_assignment_id("test-0-f32");
  a.clear_hidden_wire_dtype();
  ASSERT_THAT(w0.server->Assign(a), IsOk());
  EXPECT_EQ(w0.server->weight_loads(), 1);
  const auto [again_token, again_bytes] = prefill(3, 2);
  EXPECT_EQ(again_token, model.cases[0].greedy_ids[0]);
  EXPECT_NEAR(again_bytes, f32_bytes, 0.03 * saved);
  for (RunningWorker* w : {&w0, &w1}) {
    w->server->Shutdown();
    w->rpc->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }
}

}  // namespace
}  // namespace shardserve::service

// Direct answers (proto/shardserve/v1/stage.proto): two workers on 127.0.0.1 serving stage 0 and
// stage 1 of the golden llama, driven as the coordinator drives them: a StepStream to stage 0 and a
// return stream (Stage.AnswerStream) on stage 1. The answers come from the last stage's return
// stream, stage 0's stream brings only acknowledgements, and without a return stream of the route
// the answers come up the pipeline as before.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/testing/golden.h"
#include "tests/testing/status_matchers.h"
#include "tests/worker/service/stage_rig.h"
#include "worker/service/worker_server.h"

namespace shardserve::service {
namespace {

using ::testing::HasSubstr;

// A return stream on a worker, as the coordinator holds one. A synchronous call must be finished
// before its reader goes (its completion queue dies with it): the destructor cancels and finishes.
struct ReturnStream {
  ~ReturnStream() {
    if (reader != nullptr && !finished) {
      ctx.TryCancel();
      reader->Finish();
    }
  }
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<v1::StepResponse>> reader;
  bool finished = false;  // Finish() was called by the test
};

class DirectAnswerTest : public ::testing::Test {
 protected:
  // Stage 0 = layers [0, 1), stage 1 = layers [1, 2), one rank each.
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(golden_, testing::LoadGoldenModel("llama"));
    ASSERT_NO_FATAL_FAILURE(StartTwoStages(golden_.dir, &w0_, &w1_));
    stub0_ = v1::Stage::NewStub(grpc::CreateChannel(w0_.address, grpc::InsecureChannelCredentials()));
    stub1_ = v1::Stage::NewStub(grpc::CreateChannel(w1_.address, grpc::InsecureChannelCredentials()));
    forward_ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    forward_ = stub0_->StepStream(&forward_ctx_);
  }
  void TearDown() override {
    if (forward_ != nullptr) {
      forward_->WritesDone();
      forward_->Finish();
    }
    for (RunningWorker* w : {&w0_, &w1_}) {
      if (w->server) w->server->Shutdown();
      if (w->rpc) w->rpc->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    }
  }

  // Opens a return stream on the last stage under `route`; with `await`, waits (bounded) until the
  // worker has registered it.
  std::unique_ptr<ReturnStream> OpenReturnStream(const std::string& route, bool await = true) {
    auto rs = std::make_unique<ReturnStream>();
    rs->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::AnswerStreamRequest request;
    request.set_route(route);
    rs->reader = stub1_->AnswerStream(&rs->ctx, request);
    for (int i = 0; await && i < 1000 && !w1_.server->answer_routes().HasRouteForTest(route); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return rs;
  }

  // One step through stage 0 with `route`; returns what stage 0's stream brought.
  v1::StepResponse Send(v1::StepRequest request, const std::string& route) {
    request.set_answer_route(route);
    EXPECT_TRUE(forward_->Write(request));
    v1::StepResponse r;
    EXPECT_TRUE(forward_->Read(&r));
    EXPECT_EQ(r.step_id(), request.step_id());
    return r;
  }

  testing::GoldenModel golden_;
  RunningWorker w0_, w1_;
  std::unique_ptr<v1::Stage::Stub> stub0_, stub1_;
  grpc::ClientContext forward_ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>> forward_;
};

TEST_F(DirectAnswerTest, GreedyTokensComeFromTheLastStagesReturnStream) {
  auto rs = OpenReturnStream("route-a");
  ASSERT_TRUE(w1_.server->answer_routes().HasRouteForTest("route-a"));
  uint64_t step = 1;
  for (size_t c = 0; c < golden_.cases.size(); ++c) {
    const testing::GoldenCase& gc = golden_.cases[c];
    std::vector<int32_t> out;
    std::vector<int32_t> next = gc.prompt_ids;
    int pos = 0;
    for (size_t i = 0; i < gc.greedy_ids.size(); ++i, ++step) {
      const v1::StepResponse ack = Send(Step(step, static_cast<int>(c), pos, next, i), "route-a");
      EXPECT_TRUE(ack.answered_direct());
      EXPECT_EQ(ack.token_ids_size(), 0);
      EXPECT_EQ(ack.error_code(), 0) << ack.error_message();
      v1::StepResponse answer;
      ASSERT_TRUE(rs->reader->Read(&answer));
      ASSERT_EQ(answer.step_id(), step);
      ASSERT_EQ(answer.error_code(), 0) << answer.error_message();
      ASSERT_EQ(answer.token_ids_size(), 1);
      EXPECT_FALSE(answer.answered_direct());
      pos += static_cast<int>(next.size());
      out.push_back(answer.token_ids(0));
      next = {answer.token_ids(0)};
    }
    EXPECT_EQ(out, gc.greedy_ids) << "case " << c;
  }
}

// With omit_ack (as the coordinator sends), stage 0's stream carries nothing for a step answered
// directly, and the stream still ends cleanly once every step is answered.
TEST_F(DirectAnswerTest, AnOmittedAcknowledgementIsNotWritten) {
  auto rs = OpenReturnStream("route-o");
  const testing::GoldenCase& gc = golden_.cases[0];
  std::vector<int32_t> out;
  std::vector<int32_t> next = gc.prompt_ids;
  int pos = 0;
  for (size_t i = 0; i < gc.greedy_ids.size(); ++i) {
    v1::StepRequest request = Step(i + 1, 0, pos, next, i);
    request.set_answer_route("route-o");
    request.set_omit_ack(true);
    ASSERT_TRUE(forward_->Write(request));
    v1::StepResponse answer;
    ASSERT_TRUE(rs->reader->Read(&answer));
    ASSERT_EQ(answer.step_id(), i + 1);
    ASSERT_EQ(answer.token_ids_size(), 1) << answer.error_message();
    pos += static_cast<int>(next.size());
    out.push_back(answer.token_ids(0));
    next = {answer.token_ids(0)};
  }
  EXPECT_EQ(out, gc.greedy_ids);
  forward_->WritesDone();
  v1::StepResponse extra;
  EXPECT_FALSE(forward_->Read(&extra)) << "step " << extra.step_id();
  EXPECT_TRUE(forward_->Finish().ok());
  forward_.reset();
}

TEST_F(DirectAnswerTest, ALastStagesErrorGoesToTheReturnStream) {
  auto rs = OpenReturnStream("route-e");
  // Only the last stage reads prompt_logprob_targets: one outside the vocabulary fails there.
  v1::StepRequest bad = Step(1, 0, 0, {5}, 0);
  bad.mutable_sequences(0)->add_prompt_logprob_targets(1 << 30);
  const v1::StepResponse ack = Send(bad, "route-e");
  EXPECT_TRUE(ack.answered_direct());
  v1::StepResponse answer;
  ASSERT_TRUE(rs->reader->Read(&answer));
  EXPECT_EQ(answer.step_id(), 1u);
  EXPECT_EQ(answer.error_code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_THAT(answer.error_message(), HasSubstr("outside the vocabulary"));
}

TEST_F(DirectAnswerTest, WithoutAReturnStreamOfItsRouteTheAnswerComesUpThePipeline) {
  // A route never opened.
  v1::StepResponse r = Send(Step(1, 0, 0, {5, 6}, 0), "nobody");
  EXPECT_FALSE(r.answered_direct());
  EXPECT_EQ(r.error_code(), 0) << r.error_message();
  EXPECT_EQ(r.token_ids_size(), 1);
  // A route whose stream the coordinator has closed.
  auto rs = OpenReturnStream("route-c");
  ASSERT_TRUE(w1_.server->answer_routes().HasRouteForTest("route-c"));
  rs->ctx.TryCancel();
  rs->finished = true;
  EXPECT_EQ(rs->reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  for (int i = 0; i < 1000 && w1_.server->answer_routes().HasRouteForTest("route-c"); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_FALSE(w1_.server->answer_routes().HasRouteForTest("route-c"));
  r = Send(Step(2, 0, 2, {r.token_ids(0)}, 1), "route-c");
  EXPECT_FALSE(r.answered_direct());
  EXPECT_EQ(r.error_code(), 0) << r.error_message();
  EXPECT_EQ(r.token_ids_size(), 1);
}

TEST_F(DirectAnswerTest, AnOpenRouteAndABadRouteAreRefused) {
  auto first = OpenReturnStream("route-d");
  ASSERT_TRUE(w1_.server->answer_routes().HasRouteForTest("route-d"));
  auto second = OpenReturnStream("route-d", /*await=*/false);
  v1::StepResponse unused;
  EXPECT_FALSE(second->reader->Read(&unused));
  second->finished = true;
  EXPECT_EQ(second->reader->Finish().error_code(), grpc::StatusCode::ALREADY_EXISTS);
  auto empty = OpenReturnStream("", /*await=*/false);
  EXPECT_FALSE(empty->reader->Read(&unused));
  empty->finished = true;
  EXPECT_EQ(empty->reader->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // The first still takes answers.
  EXPECT_TRUE(Send(Step(1, 0, 0, {5}, 0), "route-d").answered_direct());
  ASSERT_TRUE(first->reader->Read(&unused));
  EXPECT_EQ(unused.token_ids_size(), 1);
}

}  // namespace
}  // namespace shardserve::service

// GrpcReplicaClient with direct answers (stage.proto): in-process fakes of a replica's stage 0
// (Stage.StepStream) and last stage (Stage.AnswerStream) on 127.0.0.1:0. The answer comes from the
// last stage's return stream, stage 0's acknowledgement is not taken for it, a dead last stage or
// a failure before it fails the step with UNAVAILABLE, and no answer is taken twice or by another
// step.
#include <grpcpp/grpcpp.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/rpc/answer_stream_client.h"
#include "coordinator/client/grpc_replica_client.h"
#include "shardserve/v1/stage.grpc.pb.h"
#include "tests/testing/status_matchers.h"

namespace shardserve::coordinator {
namespace {

using ::shardserve::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr absl::Duration kWait = absl::Seconds(60);

// The last stage: return streams, one open at a time. Deliver() queues an answer for the stream
// of a route; Crash() ends the open stream with UNAVAILABLE.
class FakeLastStage final : public v1::Stage::Service {
 public:
  grpc::Status AnswerStream(grpc::ServerContext* ctx, const v1::AnswerStreamRequest* request,
                            grpc::ServerWriter<v1::StepResponse>* writer) override {
    {
      absl::MutexLock lock(&mu_);
      routes_.push_back(request->route());
      open_ = request->route();
      crashed_ = false;
    }
    // Registered: as a worker says it.
    ctx->AddInitialMetadata(rpc::kAnswerRouteOpenKey, "1");
    writer->SendInitialMetadata();
    while (!ctx->IsCancelled()) {
      std::vector<v1::StepResponse> out;
      bool crashed = false;
      {
        absl::MutexLock lock(&mu_);
        mu_.AwaitWithTimeout(absl::Condition(
                                 +[](FakeLastStage* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) {
                                   return !s->queue_.empty() || s->crashed_;
                                 },
                                 this),
                             absl::Milliseconds(20));
        out.swap(queue_);
        crashed = crashed_;
        if (crashed) open_.clear();
      }
      for (const v1::StepResponse& r : out) {
        if (!writer->Write(r)) return grpc::Status::CANCELLED;
      }
      if (crashed) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "last stage crashed");
    }
    absl::MutexLock lock(&mu_);
    if (open_ == request->route()) open_.clear();
    return grpc::Status::CANCELLED;
  }

  // False when no return stream of `route` is open.
  bool Deliver(const std::string& route, const v1::StepResponse& answer) {
    absl::MutexLock lock(&mu_);
    if (route.empty() || route != open_) return false;
    queue_.push_back(answer);
    ++delivered_;
    return true;
  }
  void Crash() {
    absl::MutexLock lock(&mu_);
    crashed_ = true;
  }
  // Waits (bounded) until a return stream other than `not_this` is open; returns its route.
  std::string AwaitOpen(const std::string& not_this = "") {
    absl::MutexLock lock(&mu_);
    auto ready = [this, &not_this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !open_.empty() && open_ != not_this;
    };
    mu_.AwaitWithTimeout(absl::Condition(&ready), kWait);
    return open_;
  }
  std::vector<std::string> routes() {
    absl::MutexLock lock(&mu_);
    return routes_;
  }
  int delivered() {
    absl::MutexLock lock(&mu_);
    return delivered_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> routes_ ABSL_GUARDED_BY(mu_);
  std::string open_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::StepResponse> queue_ ABSL_GUARDED_BY(mu_);
  bool crashed_ ABSL_GUARDED_BY(mu_) = false;
  int delivered_ ABSL_GUARDED_BY(mu_) = 0;
};

// Stage 0 of the fake replica, standing for stages 0..P-2: answers each step with, per sampled
// sequence, block_ids[0] * 1000 + pos_begin + num_tokens — through the last stage's return stream
// (and an acknowledgement here) when the step names an open route, else here. Knobs: the last stage
// dies holding a step's answer; a stage before the last fails a step (UNAVAILABLE here) while the
// last stage still answers it, late (just before the next step's answer).
class FakeFirstStage final : public v1::Stage::Service {
 public:
  explicit FakeFirstStage(FakeLastStage* last) : last_(last) {}

  grpc::Status StepStream(grpc::ServerContext* /*ctx*/,
                          grpc::ServerReaderWriter<v1::StepResponse, v1::StepRequest>* stream) override {
    v1::StepRequest req;
    std::optional<std::pair<std::string, v1::StepResponse>> late;  // a failed step's direct answer
    while (stream->Read(&req)) {
      uint64_t lose = 0, fail = 0;
      {
        absl::MutexLock lock(&mu_);
        requests_.push_back(req);
        lose = lose_step_;
        fail = fail_step_;
      }
      if (late.has_value()) {
        last_->Deliver(late->first, late->second);
        late.reset();
      }
      v1::StepResponse answer;
      answer.set_step_id(req.step_id());
      for (const v1::StepSequence& s : req.sequences()) {
        if (s.sample()) answer.add_token_ids(s.block_ids(0) * 1000 + s.pos_begin() + s.num_tokens());
      }
      v1::StepResponse ack;
      ack.set_step_id(req.step_id());
      ack.set_answered_direct(true);
      // What goes up this stream: the answer, an error, an acknowledgement (unless omitted), or nothing.
      std::optional<v1::StepResponse> up = answer;
      if (req.step_id() == lose) {
        up = ack;  // the last stage took the step and died with its answer
        last_->Crash();
      } else if (req.step_id() == fail) {
        up->Clear();
        up->set_step_id(req.step_id());
        up->set_error_code(static_cast<int>(grpc::StatusCode::UNAVAILABLE));
        up->set_error_message("next stage at 10.0.0.9:7100 ended the stream");
        late.emplace(req.answer_route(), answer);
      } else if (last_->Deliver(req.answer_route(), answer)) {
        up = ack;
      }
      if (up.has_value() && up->answered_direct() && req.omit_ack()) up.reset();
      if (up.has_value() && !stream->Write(*up)) break;
    }
    return grpc::Status::OK;
  }

  void LoseStep(uint64_t step) {
    absl::MutexLock lock(&mu_);
    lose_step_ = step;
  }
  void FailStep(uint64_t step) {
    absl::MutexLock lock(&mu_);
    fail_step_ = step;
  }
  std::vector<v1::StepRequest> requests() {
    absl::MutexLock lock(&mu_);
    return requests_;
  }

 private:
  FakeLastStage* const last_;
  absl::Mutex mu_;
  std::vector<v1::StepRequest> requests_ ABSL_GUARDED_BY(mu_);
  uint64_t lose_step_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t fail_step_ ABSL_GUARDED_BY(mu_) = 0;
};

class DirectAnswerClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    first_rpc_ = Serve(&first_, &first_address_);
    last_rpc_ = Serve(&last_, &last_address_);
    ASSERT_NE(first_rpc_, nullptr);
    ASSERT_NE(last_rpc_, nullptr);
    client_ = std::make_unique<GrpcReplicaClient>(
        grpc::CreateChannel(first_address_, grpc::InsecureChannelCredentials()),
        grpc::CreateChannel(last_address_, grpc::InsecureChannelCredentials()),
        GrpcReplicaClient::Options{.address = first_address_, .last_address = last_address_, .step_timeout = kWait});
  }
  void TearDown() override {
    client_.reset();
    for (auto* rpc : {&first_rpc_, &last_rpc_}) (*rpc)->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  }
  static std::unique_ptr<grpc::Server> Serve(grpc::Service* service, std::string* address) {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    *address = absl::StrCat("127.0.0.1:", port);
    return server;
  }
  // One sampled sequence in block `block` at `pos`: its answer is block * 1000 + pos + 1.
  static StepInput Input(uint64_t step_id, int32_t block, int32_t pos) {
    StepInput in{.step_id = step_id};
    in.sequences.push_back({.block_ids = {block}, .pos_begin = pos, .token_ids = {7}, .sample = true});
    return in;
  }
  // Runs steps until one is answered through the open return stream (the first ones may go out
  // before the last stage has registered it, and come back up stage 0's stream); returns the route.
  std::string WarmUp(uint64_t* step) {
    const std::string route = last_.AwaitOpen();
    const int before = last_.delivered();
    for (int i = 0; i < 100 && last_.delivered() == before; ++i) {
      EXPECT_THAT(client_->Step(Input(*step, 1, 0)).status(), shardserve::testing::IsOk());
      ++*step;
    }
    return route;
  }

  FakeLastStage last_;
  FakeFirstStage first_{&last_};
  std::unique_ptr<grpc::Server> first_rpc_, last_rpc_;
  std::string first_address_, last_address_;
  std::unique_ptr<GrpcReplicaClient> client_;
};

TEST_F(DirectAnswerClientTest, TheAnswerComesFromTheLastStagesReturnStream) {
  ASSERT_THAT(client_->Step(Input(1, 1, 0)).status(), shardserve::testing::IsOk());  // opens both streams
  uint64_t step = 2;
  const std::string route = WarmUp(&step);
  ASSERT_FALSE(route.empty());
  const int before = last_.delivered();
  for (int i = 0; i < 5; ++i, ++step) {
    ASSERT_OK_AND_ASSIGN(StepOutput out, client_->Step(Input(step, 3, i)));
    EXPECT_THAT(out.token_ids, ElementsAre(3000 + i + 1));  // the answer, not the acknowledgement
  }
  EXPECT_EQ(last_.delivered() - before, 5);
  const std::vector<v1::StepRequest> sent = first_.requests();
  for (size_t i = sent.size() - 5; i < sent.size(); ++i) {
    EXPECT_EQ(sent[i].answer_route(), route);
    EXPECT_TRUE(sent[i].omit_ack());  // stage 0 need not acknowledge what we have
  }
  EXPECT_EQ(last_.routes().size(), 1u);  // one long-lived return stream
}

TEST_F(DirectAnswerClientTest, ADeadLastStageFailsTheStepUnavailableAndTheNextStepReopens) {
  ASSERT_THAT(client_->Step(Input(1, 1, 0)).status(), shardserve::testing::IsOk());
  uint64_t step = 2;
  const std::string route = WarmUp(&step);
  first_.LoseStep(step);
  EXPECT_THAT(client_->Step(Input(step, 2, 0)),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("return stream from the last stage"), HasSubstr("last stage crashed"))));
  ++step;
  // The next step opens another return stream, under another route, and is answered.
  ASSERT_OK_AND_ASSIGN(StepOutput out, client_->Step(Input(step, 4, 2)));
  EXPECT_THAT(out.token_ids, ElementsAre(4003));
  const std::string reopened = last_.AwaitOpen(route);
  EXPECT_NE(reopened, route);
  EXPECT_FALSE(reopened.empty());
}

TEST_F(DirectAnswerClientTest, AFailureBeforeTheLastStageFailsTheStepAndItsLateAnswerIsDropped) {
  ASSERT_THAT(client_->Step(Input(1, 1, 0)).status(), shardserve::testing::IsOk());
  uint64_t step = 2;
  WarmUp(&step);
  first_.FailStep(step);
  EXPECT_THAT(client_->Step(Input(step, 5, 0)),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("ended the stream")));
  // The failed step's answer reaches the return stream just before the next step's: it is dropped,
  // and each later step gets its own answer.
  for (int i = 1; i <= 3; ++i) {
    ++step;
    ASSERT_OK_AND_ASSIGN(StepOutput out, client_->Step(Input(step, 6, i)));
    EXPECT_THAT(out.token_ids, ElementsAre(6000 + i + 1));
  }
  EXPECT_EQ(last_.routes().size(), 1u);  // a late answer does not end the return stream
}

// A last stage that refuses return streams (here: an older worker without Stage.AnswerStream) fails
// no step: the answers come up stage 0's stream.
TEST_F(DirectAnswerClientTest, ALastStageWithoutReturnStreamsAnswersThroughStageZero) {
  v1::Stage::Service bare;  // every method UNIMPLEMENTED
  std::string bare_address;
  std::unique_ptr<grpc::Server> bare_rpc = Serve(&bare, &bare_address);
  ASSERT_NE(bare_rpc, nullptr);
  auto client = std::make_unique<GrpcReplicaClient>(
      grpc::CreateChannel(first_address_, grpc::InsecureChannelCredentials()),
      grpc::CreateChannel(bare_address, grpc::InsecureChannelCredentials()),
      GrpcReplicaClient::Options{.address = first_address_, .last_address = bare_address, .step_timeout = kWait});
  for (int i = 0; i < 20; ++i) {
    ASSERT_OK_AND_ASSIGN(StepOutput out, client->Step(Input(static_cast<uint64_t>(i + 1), 2, i)));
    EXPECT_THAT(out.token_ids, ElementsAre(2000 + i + 1));
  }
  EXPECT_EQ(last_.delivered(), 0);
  client.reset();
  bare_rpc->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
}

}  // namespace
}  // namespace shardserve::coordinator

// GrpcReplicaClient and GrpcWorkerClient against in-process fake Stage / Worker services on
// 127.0.0.1:0: what goes on the wire, stage errors, a stream that ends and is re-opened, the step
// timeout, shutdown of a blocked step, unreachable peers.
#include <grpcpp/grpcpp.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "coordinator/client/grpc_replica_client.h"
#include "coordinator/client/grpc_worker_client.h"
#include "coordinator/client/proto_convert.h"
#include "shardserve/v1/control.grpc.pb.h"
#include "shardserve/v1/stage.grpc.pb.h"
#include "tests/testing/status_matchers.h"

namespace shardserve::coordinator {
namespace {

using ::shardserve::testing::IsOk;
using ::shardserve::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr absl::Duration kWait = absl::Seconds(60);

// Stage 0 of a fake replica: answers each StepRequest with, per sampled sequence,
// block_ids[0] * 1000 + pos_begin + num_tokens. Test knobs: fail a step, end the stream at a step,
// hold a step until released.
class FakeStage final : public v1::Stage::Service {
 public:
  grpc::Status StepStream(grpc::ServerContext* ctx,
                          grpc::ServerReaderWriter<v1::StepResponse, v1::StepRequest>* stream) override {
    {
      absl::MutexLock lock(&mu_);
      ++streams_;
    }
    v1::StepRequest req;
    while (stream->Read(&req)) {
      uint64_t hold = 0, end = 0, fail = 0;
      {
        absl::MutexLock lock(&mu_);
        requests_.push_back(req);
        hold = hold_step_;
        end = end_step_;
        fail = fail_step_;
      }
      if (req.step_id() == end) return grpc::Status(grpc::StatusCode::INTERNAL, "stage crashed");
      if (req.step_id() == hold) {
        held_.Notify();
        // Bounded: the client cancels (timeout or shutdown) long before this.
        for (int i = 0; i < 600 && !ctx->IsCancelled(); ++i) {
          if (release_.WaitForNotificationWithTimeout(absl::Milliseconds(100))) break;
        }
        if (ctx->IsCancelled()) return grpc::Status::CANCELLED;
      }
      v1::StepResponse resp;
      resp.set_step_id(req.step_id());
      if (req.step_id() == fail) {
        resp.set_error_code(static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED));
        resp.set_error_message("stage 1: KV block 300 out of range");
      } else {
        for (const v1::StepSequence& s : req.sequences()) {
          // The first block id, the position and the token count, so the test sees what arrived.
          if (s.sample()) resp.add_token_ids(s.block_ids(0) * 1000 + s.pos_begin() + s.num_tokens());
        }
      }
      if (!stream->Write(resp)) break;
    }
    return grpc::Status::OK;
  }

  void HoldStep(uint64_t step) {
    absl::MutexLock lock(&mu_);
    hold_step_ = step;
  }
  void EndStreamAtStep(uint64_t step) {
    absl::MutexLock lock(&mu_);
    end_step_ = step;
  }
  void FailStep(uint64_t step) {
    absl::MutexLock lock(&mu_);
    fail_step_ = step;
  }
  bool WaitHeld() { return held_.WaitForNotificationWithTimeout(kWait); }
  void Release() {
    if (!release_.HasBeenNotified()) release_.Notify();
  }
  std::vector<v1::StepRequest> requests() {
    absl::MutexLock lock(&mu_);
    return requests_;
  }
  int streams() {
    absl::MutexLock lock(&mu_);
    return streams_;
  }

 private:
  absl::Mutex mu_;
  std::vector<v1::StepRequest> requests_ ABSL_GUARDED_BY(mu_);
  int streams_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t hold_step_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t end_step_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t fail_step_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Notification held_, release_;
};

class FakeWorker final : public v1::Worker::Service {
 public:
  grpc::Status Assign(grpc::ServerContext*, const v1::Assignment* a, v1::AssignResponse*) override {
    absl::MutexLock lock(&mu_);
    last_ = *a;
    if (a->kv_blocks() < 1) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "kv_blocks must be >= 1");
    return grpc::Status::OK;
  }
  v1::Assignment last() {
    absl::MutexLock lock(&mu_);
    return last_;
  }

 private:
  absl::Mutex mu_;
  v1::Assignment last_ ABSL_GUARDED_BY(mu_);
};

class GrpcClientsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&stage_);
    builder.RegisterService(&worker_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    address_ = absl::StrCat("127.0.0.1:", port);
  }
  void TearDown() override {
    stage_.Release();
    server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  }
  std::unique_ptr<GrpcReplicaClient> Client(absl::Duration step_timeout = kWait) {
    return std::make_unique<GrpcReplicaClient>(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()),
                                               GrpcReplicaClient::Options{.address = address_,
                                                                          .step_timeout = step_timeout});
  }
  static StepInput Input(uint64_t step_id) {
    StepInput in{.step_id = step_id};
    in.sequences.push_back({.block_ids = {2}, .pos_begin = 0, .token_ids = {5, 6, 7}, .sample = false, .request_id = "a"});
    in.sequences.push_back({.block_ids = {1, 4},
                            .pos_begin = 9,
                            .token_ids = {42},
                            .sample = true,
                            .sampling = {.temperature = 0.5f, .top_k = 7, .top_p = 0.9f, .seed = 11},
                            .sample_index = 3,
                            .request_id = "b"});
    return in;
  }

  FakeStage stage_;
  FakeWorker worker_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

TEST_F(GrpcClientsTest, StepSendsTheBatchAndReturnsTheSampledTokens) {
  auto client = Client();
  ASSERT_OK_AND_ASSIGN(StepOutput out, client->Step(Input(1)));
  EXPECT_THAT(out.token_ids, ElementsAre(1000 + 9 + 1));
  ASSERT_OK_AND_ASSIGN(out, client->Step(Input(2)));
  EXPECT_EQ(stage_.streams(), 1);  // one long-lived stream
  const std::vector<v1::StepRequest> got = stage_.requests();
  ASSERT_EQ(got.size(), 2u);
  const v1::StepRequest& r = got[0];
  EXPECT_EQ(r.step_id(), 1u);
  ASSERT_EQ(r.sequences_size(), 2);
  EXPECT_THAT(r.sequences(0).block_ids(), ElementsAre(2));
  EXPECT_THAT(r.sequences(1).block_ids(), ElementsAre(1, 4));
  EXPECT_EQ(r.sequences(0).num_tokens(), 3);
  EXPECT_THAT(r.sequences(0).token_ids(), ElementsAre(5, 6, 7));
  EXPECT_FALSE(r.sequences(0).sample());
  const v1::StepSequence& s = r.sequences(1);
  EXPECT_EQ(s.pos_begin(), 9);
  EXPECT_TRUE(s.sample());
  EXPECT_FLOAT_EQ(s.sampling().temperature(), 0.5f);
  EXPECT_EQ(s.sampling().top_k(), 7);
  EXPECT_FLOAT_EQ(s.sampling().top_p(), 0.9f);
  EXPECT_EQ(s.sampling().seed(), 11u);
  EXPECT_EQ(s.sample_index(), 3u);
  EXPECT_EQ(s.request_id(), "b");
  EXPECT_FALSE(r.has_hidden());
}

TEST_F(GrpcClientsTest, AStageErrorFailsTheStepAndTheStreamGoesOn) {
  stage_.FailStep(1);
  auto client = Client();
  EXPECT_THAT(client->Step(Input(1)),
              StatusIs(absl::StatusCode::kResourceExhausted, "stage 1: KV block 300 out of range"));
  EXPECT_THAT(client->Step(Input(2)), IsOk());
  EXPECT_EQ(stage_.streams(), 1);
}

TEST_F(GrpcClientsTest, AnEndedStreamFailsItsStepAndTheNextStepReconnects) {
  stage_.EndStreamAtStep(1);
  auto client = Client();
  EXPECT_THAT(client->Step(Input(1)),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("stage crashed")));
  EXPECT_THAT(client->Step(Input(2)), IsOk());
  EXPECT_EQ(stage_.streams(), 2);
}

TEST_F(GrpcClientsTest, AStepWithoutAnswerTimesOutAsABrokenPipeline) {
  // UNAVAILABLE, like a closed stream, so that the scheduler fails its sequences over (or parks
  // them) instead of failing them.
  stage_.HoldStep(1);
  auto client = Client(absl::Milliseconds(300));
  EXPECT_THAT(client->Step(Input(1)),
              StatusIs(absl::StatusCode::kUnavailable, AllOf(HasSubstr("step 1"), HasSubstr("step timeout"))));
  EXPECT_THAT(client->Step(Input(2)), IsOk());  // on a new stream
  EXPECT_EQ(stage_.streams(), 2);
}

TEST_F(GrpcClientsTest, ShutdownInterruptsABlockedStep) {
  stage_.HoldStep(1);
  auto client = Client();
  absl::StatusOr<StepOutput> result;
  std::thread stepper([&] { result = client->Step(Input(1)); });
  ASSERT_TRUE(stage_.WaitHeld());
  client->Shutdown();
  stepper.join();
  EXPECT_THAT(result, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("shut down")));
  EXPECT_THAT(client->Step(Input(2)), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("shut down")));
}

TEST_F(GrpcClientsTest, StepOverlappingRunsTheCallersWorkOnceWhileTheStepIsOut) {
  // The stage holds step 1 until the caller's work releases it: that work runs after the step
  // reached the stage and before its answer came.
  stage_.HoldStep(1);
  auto client = Client();
  int runs = 0;
  bool held = false;
  absl::StatusOr<StepOutput> out = client->StepOverlapping(Input(1), [&] {
    ++runs;
    held = stage_.WaitHeld();
    stage_.Release();
  });
  EXPECT_EQ(runs, 1);
  EXPECT_TRUE(held);
  ASSERT_THAT(out, IsOk());
  EXPECT_THAT(out->token_ids, ElementsAre(1000 + 9 + 1));
  // A failed step runs it once too: here the client is shut down, so nothing is sent.
  client->Shutdown();
  runs = 0;
  EXPECT_THAT(client->StepOverlapping(Input(2), [&] { ++runs; }),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("shut down")));
  EXPECT_EQ(runs, 1);
}

TEST_F(GrpcClientsTest, UnreachableStageIsUnavailable) {
  auto client = std::make_unique<GrpcReplicaClient>(
      grpc::CreateChannel("127.0.0.1:1", grpc::InsecureChannelCredentials()),
      GrpcReplicaClient::Options{.address = "127.0.0.1:1", .step_timeout = kWait});
  EXPECT_THAT(client->Step(Input(1)), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("127.0.0.1:1")));
}

TEST_F(GrpcClientsTest, AssignSendsTheAssignment) {
  GrpcWorkerClient client({.timeout = kWait});
  WorkerAssignment a{.assignment_id = "plan-1/r0/s1/w-2",
                     .model_path = "/models/x",
                     .replica = 0,
                     .stage = 1,
                     .num_stages = 2,
                     .layer_begin = 6,
                     .layer_end = 12,
                     .device_kind = DeviceKind::kCpu,
                     .devices = {0, 1},
                     .kv_blocks = 4000,
                     .kv_block_size = 32,
                     .max_seq_len = 1024,
                     .max_step_tokens = 128,
                     .next_address = ""};
  ASSERT_THAT(client.Assign(address_, a), IsOk());
  const v1::Assignment got = worker_.last();
  EXPECT_EQ(got.assignment_id(), "plan-1/r0/s1/w-2");
  EXPECT_EQ(got.model_path(), "/models/x");
  EXPECT_EQ(got.stage(), 1);
  EXPECT_EQ(got.num_stages(), 2);
  EXPECT_EQ(got.layer_begin(), 6);
  EXPECT_EQ(got.layer_end(), 12);
  EXPECT_EQ(got.device_kind(), v1::DEVICE_KIND_CPU);
  EXPECT_THAT(got.devices(), ElementsAre(0, 1));
  EXPECT_EQ(got.kv_blocks(), 4000);
  EXPECT_EQ(got.kv_block_size(), 32);
  EXPECT_EQ(got.max_seq_len(), 1024);
  EXPECT_EQ(got.max_step_tokens(), 128);
  a.kv_blocks = 0;
  EXPECT_THAT(client.Assign(address_, a), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("kv_blocks")));
  EXPECT_THAT(client.Assign("127.0.0.1:1", a),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("Worker.Assign to 127.0.0.1:1")));
}

// What a restarted coordinator reads back from a worker's registration (RegisterRequest.held) is
// what it assigned, field for field; enum values it does not know are refused naming the field.
TEST(AssignmentProtoTest, AnAssignmentRoundTripsAndUnknownEnumsNameTheField) {
  const WorkerAssignment a{.assignment_id = "plan-3/r1/s0/w-4",
                           .model_path = "/models/m",
                           .replica = 1,
                           .stage = 0,
                           .num_stages = 2,
                           .layer_begin = 0,
                           .layer_end = 5,
                           .device_kind = DeviceKind::kCuda,
                           .devices = {2, 3},
                           .kv_blocks = 77,
                           .kv_block_size = 16,
                           .max_seq_len = 2048,
                           .max_step_tokens = 256,
                           .next_address = "w-5:50051",
                           .experts = {{.layer = 1, .ranks = {0, 1, -1}, .addresses = {"", "", "h:1"}}},
                           .quantize = Quantization::kInt8,
                           .kv_cache = KvCacheFormat::kFp8E4M3,
                           .hidden_wire_dtype = DType::kBF16};
  v1::Assignment p;
  ToProto(a, &p);
  EXPECT_EQ(p.kv_cache_dtype(), v1::KV_CACHE_DTYPE_FP8_E4M3);
  EXPECT_EQ(p.hidden_wire_dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(p.quantize(), v1::WEIGHT_QUANTIZATION_INT8);
  ASSERT_OK_AND_ASSIGN(WorkerAssignment back, FromProto(p));
  EXPECT_EQ(back.assignment_id, a.assignment_id);
  EXPECT_EQ(back.model_path, a.model_path);
  EXPECT_EQ(back.replica, 1);
  EXPECT_EQ(back.num_stages, 2);
  EXPECT_EQ(back.layer_end, 5);
  EXPECT_EQ(back.device_kind, DeviceKind::kCuda);
  EXPECT_THAT(back.devices, ElementsAre(2, 3));
  EXPECT_EQ(back.kv_blocks, 77);
  EXPECT_EQ(back.kv_block_size, 16);
  EXPECT_EQ(back.max_seq_len, 2048);
  EXPECT_EQ(back.max_step_tokens, 256);
  EXPECT_EQ(back.next_address, "w-5:50051");
  ASSERT_EQ(back.experts.size(), 1u);
  EXPECT_THAT(back.experts[0].ranks, ElementsAre(0, 1, -1));
  EXPECT_THAT(back.experts[0].addresses, ElementsAre("", "", "h:1"));
  EXPECT_EQ(back.quantize, Quantization::kInt8);
  EXPECT_EQ(back.kv_cache, KvCacheFormat::kFp8E4M3);
  EXPECT_EQ(back.hidden_wire_dtype, DType::kBF16);
  // The default KV format goes out as AUTO and comes back as kAuto; the default wire as F32.
  WorkerAssignment plain = a;
  plain.kv_cache = KvCacheFormat::kAuto;
  plain.hidden_wire_dtype = DType::kF32;
  ToProto(plain, &p);
  EXPECT_EQ(p.kv_cache_dtype(), v1::KV_CACHE_DTYPE_AUTO);
  EXPECT_EQ(p.hidden_wire_dtype(), v1::DTYPE_F32);
  ASSERT_OK_AND_ASSIGN(back, FromProto(p));
  EXPECT_EQ(back.kv_cache, KvCacheFormat::kAuto);
  EXPECT_EQ(back.hidden_wire_dtype, DType::kF32);
  // A worker of before the field reports none: F32, as it sent.
  v1::Assignment unset = p;
  unset.clear_hidden_wire_dtype();
  ASSERT_OK_AND_ASSIGN(back, FromProto(unset));
  EXPECT_EQ(back.hidden_wire_dtype, DType::kF32);

  v1::Assignment bad = p;
  bad.set_kv_cache_dtype(static_cast<v1::KvCacheDtype>(9));
  EXPECT_THAT(FromProto(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("kv_cache_dtype: unknown KV cache dtype 9")));
  bad = p;
  bad.set_hidden_wire_dtype(v1::DTYPE_F16);
  EXPECT_THAT(FromProto(bad), StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr("hidden_wire_dtype: DTYPE_F16 is not F32 or BF16")));
  bad.set_hidden_wire_dtype(static_cast<v1::DType>(11));
  EXPECT_THAT(FromProto(bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("hidden_wire_dtype: 11 is not F32 or BF16")));
  bad = p;
  bad.set_quantize(static_cast<v1::WeightQuantization>(6));
  EXPECT_THAT(FromProto(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("quantize: unknown weight quantization 6")));
  bad = p;
  bad.set_role(static_cast<v1::AssignmentRole>(7));
  EXPECT_THAT(FromProto(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("role: unknown assignment role 7")));
  bad = p;
  bad.set_device_kind(static_cast<v1::DeviceKind>(8));
  EXPECT_THAT(FromProto(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("device_kind: unsupported device kind 8")));
}

}  // namespace
}  // namespace shardserve::coordinator

// The worker's stage-stream byte budget (issue 20, item 4): StreamBudget's accounting and
// resumption, and a worker refusing a micro-batch too large for its budget while its stream stays
// usable and every byte is given back; a refused micro-batch still keeps the step-delta table in step.
#include "worker/service/stream_budget.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "tests/testing/golden.h"
#include "worker/service/convert.h"
#include "worker/service/worker_server.h"

namespace shardserve::service {
namespace {

TEST(StreamBudgetTest, ResumesWaitersOnceBackWithinCapacity) {
  StreamBudget budget(100);
  int resumed = 0;
  budget.WhenRoom([&] { ++resumed; });
  EXPECT_EQ(resumed, 1);  // within capacity: at once
  budget.Charge(150);
  budget.WhenRoom([&] { ++resumed; });
  budget.WhenRoom([&] { ++resumed; });
  EXPECT_EQ(resumed, 1);
  budget.Release(40);  // 110: still over
  EXPECT_EQ(resumed, 1);
  budget.Release(10);  // 100: at capacity
  EXPECT_EQ(resumed, 3);
  EXPECT_EQ(budget.used(), 100u);
  budget.Release(1000);  // never below zero
  EXPECT_EQ(budget.used(), 0u);
}

// A micro-batch of `chunks` chunks of `chunk_bytes` hidden bytes each.
std::vector<v1::StepRequest> Chunks(uint64_t step_id, uint32_t chunks, size_t chunk_bytes) {
  std::vector<v1::StepRequest> out;
  for (uint32_t i = 0; i < chunks; ++i) {
    v1::StepRequest r;
    r.set_step_id(step_id);
    r.set_chunk_index(i);
    r.set_chunk_count(chunks);
    r.mutable_hidden()->set_data(std::string(chunk_bytes, 'x'));
    out.push_back(std::move(r));
  }
  return out;
}

// `service` on a loopback port (set in *port), taking messages up to kMaxMessageBytes.
std::unique_ptr<grpc::Server> Serve(grpc::Service* service, int* port) {
  grpc::ServerBuilder b;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), port);
  b.SetMaxReceiveMessageSize(kMaxMessageBytes);
  b.RegisterService(service);
  return b.BuildAndStart();
}

TEST(WorkerStreamBudgetTest, MicroBatchOverTwiceTheBudgetIsRefusedAndTheStreamStaysUsable) {
  WorkerServer worker(WorkerOptions{.stream_buffer_bytes = size_t{1} << 20});
  int port = 0;
  std::unique_ptr<grpc::Server> rpc = Serve(worker.stage_service(), &port);
  ASSERT_NE(rpc, nullptr);
  auto stub = v1::Stage::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto stream = stub->StepStream(&ctx);
  // 8 MiB in 16 chunks of 512 KiB against a budget of 1 MiB: refused once past 2 MiB.
  for (v1::StepRequest& m : Chunks(1, 16, size_t{512} << 10)) ASSERT_TRUE(stream->Write(m));
  v1::StepResponse r;
  ASSERT_TRUE(stream->Read(&r));
  EXPECT_EQ(r.step_id(), 1u);
  EXPECT_EQ(r.error_code(), static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED)) << r.error_message();
  EXPECT_NE(r.error_message().find("--stream_buffer_bytes"), std::string::npos) << r.error_message();
  // The next micro-batch (small) is read and answered (this worker has no stage: UNAVAILABLE).
  for (v1::StepRequest& m : Chunks(2, 2, size_t{256} << 10)) ASSERT_TRUE(stream->Write(m));
  ASSERT_TRUE(stream->Read(&r));
  EXPECT_EQ(r.step_id(), 2u);
  EXPECT_EQ(r.error_code(), static_cast<int>(grpc::StatusCode::UNAVAILABLE)) << r.error_message();
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(worker.stream_budget().used(), 0u);  // every byte given back
  worker.Shutdown();
  rpc->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
}

// A refused micro-batch still counts for the stream's step-delta table (common/rpc/step_delta.h):
// a delta of what it carried decodes afterwards (and the stream is not ended as out of step).
TEST(WorkerStreamBudgetTest, ARefusedMicroBatchStillUpdatesTheStepDeltaTable) {
  WorkerServer worker(WorkerOptions{.stream_buffer_bytes = size_t{1} << 20});
  int port = 0;
  std::unique_ptr<grpc::Server> rpc = Serve(worker.stage_service(), &port);
  ASSERT_NE(rpc, nullptr);
  auto stub = v1::Stage::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto stream = stub->StepStream(&ctx);
  std::vector<v1::StepRequest> big = Chunks(1, 16, size_t{512} << 10);  // refused, as above
  big[0].set_deltas(true);
  v1::StepSequence* s = big[0].add_sequences();
  s->set_key(9);
  s->add_block_ids(1);
  s->add_block_ids(2);
  s->set_num_tokens(1);
  for (v1::StepRequest& m : big) ASSERT_TRUE(stream->Write(m));
  v1::StepResponse r;
  ASSERT_TRUE(stream->Read(&r));
  EXPECT_EQ(r.error_code(), static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED)) << r.error_message();
  v1::StepRequest next;  // key 9 keeps its two blocks and grows a third
  next.set_step_id(2);
  next.set_deltas(true);
  s = next.add_sequences();
  s->set_key(9);
  s->set_blocks_kept(2);
  s->add_block_ids(3);
  s->set_num_tokens(1);
  ASSERT_TRUE(stream->Write(next));
  ASSERT_TRUE(stream->Read(&r));
  EXPECT_EQ(r.step_id(), 2u);
  // Decoded, then refused only because this worker has no stage.
  EXPECT_EQ(r.error_code(), static_cast<int>(grpc::StatusCode::UNAVAILABLE)) << r.error_message();
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  worker.Shutdown();
  rpc->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
}

// A next stage that reads everything and answers nothing: what stage 0 forwards stays unanswered,
// so its bytes stay charged.
class SilentStage final : public v1::Stage::Service {
 public:
  grpc::Status StepStream(grpc::ServerContext* /*ctx*/,
                          grpc::ServerReaderWriter<v1::StepResponse, v1::StepRequest>* stream) override {
    v1::StepRequest m;
    while (stream->Read(&m)) ++messages_;
    return grpc::Status::OK;
  }
  int messages() const { return messages_.load(); }

 private:
  std::atomic<int> messages_{0};
};

TEST(WorkerStreamBudgetTest, OverTheBudgetTheStreamStopsReadingBetweenMicroBatches) {
  absl::StatusOr<testing::GoldenModel> golden = testing::LoadGoldenModel("llama");
  ASSERT_TRUE(golden.ok()) << golden.status();
  SilentStage next;
  int next_port = 0;
  std::unique_ptr<grpc::Server> next_rpc = Serve(&next, &next_port);
  ASSERT_NE(next_rpc, nullptr);

  constexpr size_t kBudget = 400;  // a few of the micro-batches below
  WorkerServer worker(WorkerOptions{.stream_buffer_bytes = kBudget});
  int port = 0;
  std::unique_ptr<grpc::Server> rpc = Serve(worker.stage_service(), &port);
  ASSERT_NE(rpc, nullptr);
  v1::Assignment a;
  a.set_assignment_id("budget");
  a.set_model_path(golden->dir);
  a.set_stage(0);
  a.set_layer_begin(0);
  a.set_layer_end(1);
  a.set_device_kind(v1::DEVICE_KIND_CPU);
  a.add_devices(0);
  a.set_kv_blocks(64);
  a.set_kv_block_size(16);
  a.set_max_step_tokens(64);
  a.set_next_address(absl::StrCat("127.0.0.1:", next_port));
  ASSERT_TRUE(worker.Assign(a).ok());
  const WorkerStatusSnapshot loaded = worker.WaitLoaded(absl::Seconds(30));
  ASSERT_EQ(loaded.state, v1::WORKER_STATE_READY) << loaded.error;

  auto stub = v1::Stage::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  auto stream = stub->StepStream(&ctx);
  size_t step_bytes = 0;
  for (uint64_t id = 1; id <= 30; ++id) {
    v1::StepRequest r;
    r.set_step_id(id);
    v1::StepSequence* s = r.add_sequences();
    s->add_block_ids(static_cast<int32_t>(id % 64));
    s->set_pos_begin(0);
    s->set_num_tokens(4);
    for (int32_t t : {5, 6, 7, 8}) s->add_token_ids(t);
    step_bytes = std::max(step_bytes, r.ByteSizeLong());
    ASSERT_TRUE(stream->Write(r));  // small: gRPC's windows take them all
  }
  // The worker reads until the budget is spent, then pauses the stream; with nothing answered it
  // stays paused.
  ASSERT_TRUE(worker.stream_budget().WaitForPausedStreamForTest(absl::Seconds(30)));
  // Nothing is answered, so without back-pressure all 30 would be charged.
  EXPECT_LE(worker.stream_budget().used(), kBudget + step_bytes);
  EXPECT_GT(worker.stream_budget().used(), 0u);
  EXPECT_LT(next.messages(), 30);
  ctx.TryCancel();
  stream->Finish();
  worker.Shutdown();  // answers what is in flight: the paused stream resumes and ends
  rpc->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  next_rpc->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  EXPECT_EQ(worker.stream_budget().used(), 0u);
}

}  // namespace
}  // namespace shardserve::service

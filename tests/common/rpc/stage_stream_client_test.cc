// StageStreamClient against an in-process Stage service on 127.0.0.1:0 whose behaviour each test
// scripts: answers matched by step_id whatever their order, several messages per micro-batch,
// refused sends, an answer to a step not in flight, the peer ending the stream, Close, and byte
// counters. (The coordinator's and the workers' uses of it are tested in grpc_clients_test and
// stage_stream_test.)
#include "common/rpc/stage_stream_client.h"

#include <grpcpp/grpcpp.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/concurrency/mutex.h"
#include "tests/testing/status_matchers.h"

namespace shardserve::rpc {
namespace {

using ::shardserve::testing::IsOk;
using ::shardserve::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Stream = grpc::ServerReaderWriter<v1::StepResponse, v1::StepRequest>;

constexpr absl::Duration kWait = absl::Seconds(30);

// A Stage service that hands each call to the test's script.
class ScriptedStage final : public v1::Stage::Service {
 public:
  using Script = std::function<grpc::Status(grpc::ServerContext*, Stream*)>;
  explicit ScriptedStage(Script script) : script_(std::move(script)) {}
  grpc::Status StepStream(grpc::ServerContext* ctx, Stream* stream) override { return script_(ctx, stream); }

 private:
  Script script_;
};

// A peer that reads and never answers, until the client cancels.
grpc::Status ReadUntilCancelled(grpc::ServerContext* ctx, Stream* stream) {
  v1::StepRequest m;
  while (!ctx->IsCancelled() && stream->Read(&m)) {
  }
  return grpc::Status::OK;
}

v1::StepRequest Message(uint64_t step_id, int32_t token) {
  v1::StepRequest m;
  m.set_step_id(step_id);
  m.add_sequences()->add_token_ids(token);
  return m;
}

// One micro-batch of `messages`, each copied onto a pooled arena as a sender builds it.
StageStreamClient::Messages Batch(std::initializer_list<v1::StepRequest> messages) {
  static const auto& pool =
      *new std::shared_ptr<MessagePool<v1::StepRequest>>(MessagePool<v1::StepRequest>::Create(1024, 8));
  StageStreamClient::Messages batch;
  for (const v1::StepRequest& m : messages) {
    batch.push_back(pool->Take());
    *batch.back() = m;
  }
  return batch;
}

v1::StepResponse Answer(uint64_t step_id, int32_t token) {
  v1::StepResponse r;
  r.set_step_id(step_id);
  r.add_token_ids(token);
  return r;
}

// Collects the answers the client delivers, in delivery order.
class Answers {
 public:
  StageStreamClient::Answer For(uint64_t step_id) {
    return [this, step_id](absl::StatusOr<v1::StepResponse> r) {
      MutexLock lock(&mu_);
      got_.emplace_back(step_id, std::move(r));
      cv_.SignalAll();
    };
  }
  // Waits for `n` answers in all; returns them.
  std::vector<std::pair<uint64_t, absl::StatusOr<v1::StepResponse>>> Wait(size_t n) {
    const absl::Time deadline = absl::Now() + kWait;
    MutexLock lock(&mu_);
    while (got_.size() < n && absl::Now() < deadline) cv_.WaitWithDeadline(&mu_, deadline);
    return got_;
  }

 private:
  Mutex mu_;
  CondVar cv_;
  std::vector<std::pair<uint64_t, absl::StatusOr<v1::StepResponse>>> got_ ABSL_GUARDED_BY(mu_);
};

class StageStreamClientTest : public ::testing::Test {
 protected:
  void Serve(ScriptedStage::Script script) {
    service_ = std::make_unique<ScriptedStage>(std::move(script));
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    address_ = "127.0.0.1:" + std::to_string(port);
    channel_ = grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
  }
  std::shared_ptr<StageStreamClient> Open(StageStreamClient::Options options = {}) {
    if (options.peer.empty()) options.peer = "stage stream to " + address_;
    return StageStreamClient::Open(channel_, std::move(options));
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  }

  std::unique_ptr<ScriptedStage> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(StageStreamClientTest, AnswersAreMatchedByStepIdInTheOrderThePeerGivesThem) {
  // Reads three micro-batches (the second in two messages), then answers them in reverse order.
  std::vector<v1::StepRequest> seen;
  Serve([&](grpc::ServerContext*, Stream* stream) {
    v1::StepRequest m;
    for (int i = 0; i < 4 && stream->Read(&m); ++i) seen.push_back(m);
    for (uint64_t step : {3, 2, 1}) stream->Write(Answer(step, static_cast<int32_t>(step * 10)));
    while (stream->Read(&m)) {
    }
    return grpc::Status::OK;
  });
  Answers answers;
  std::shared_ptr<StageStreamClient> client = Open();
  for (uint64_t step : {1, 2, 3}) {
    StageStreamClient::Messages messages = step == 2 ? Batch({Message(step, 1), Message(step, 2)}) : Batch({Message(step, 1)});
    StageStreamClient::Answer answer = answers.For(step);
    ASSERT_THAT(client->Send(step, std::move(messages), answer), IsOk());
  }
  auto got = answers.Wait(3);
  ASSERT_EQ(got.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    const uint64_t step = 3 - i;
    EXPECT_EQ(got[i].first, step);
    ASSERT_THAT(got[i].second.status(), IsOk());
    EXPECT_EQ(got[i].second->step_id(), step);
    EXPECT_THAT(got[i].second->token_ids(), ElementsAre(static_cast<int32_t>(step * 10)));
  }
  // Written in Send order, both messages of step 2 included.
  ASSERT_EQ(seen.size(), 4u);
  EXPECT_EQ(seen[0].step_id(), 1u);
  EXPECT_EQ(seen[1].step_id(), 2u);
  EXPECT_EQ(seen[2].step_id(), 2u);
  EXPECT_EQ(seen[2].sequences(0).token_ids(0), 2);
  EXPECT_EQ(seen[3].step_id(), 3u);
  client->Close("test over");
  EXPECT_TRUE(client->WaitDone(kWait));
}

TEST_F(StageStreamClientTest, RefusesARepeatedStepIdAndAnEmptyBatchAndKeepsTheAnswer) {
  Serve(ReadUntilCancelled);
  Answers answers;
  std::shared_ptr<StageStreamClient> client = Open();
  StageStreamClient::Answer first = answers.For(7);
  ASSERT_THAT(client->Send(7, Batch({Message(7, 1)}), first), IsOk());
  StageStreamClient::Answer again = answers.For(7);
  EXPECT_THAT(client->Send(7, Batch({Message(7, 2)}), again), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("already in flight")));
  EXPECT_NE(again, nullptr);  // still the caller's
  StageStreamClient::Answer empty = answers.For(8);
  EXPECT_THAT(client->Send(8, StageStreamClient::Messages(), empty), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no messages")));
  StageStreamClient::Messages unleased;
  unleased.push_back(StageStreamClient::Message());
  StageStreamClient::Answer refused = answers.For(9);
  EXPECT_THAT(client->Send(9, std::move(unleased), refused),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty message lease")));
  EXPECT_NE(refused, nullptr);
  EXPECT_NE(empty, nullptr);
  client->Close("test over");
  auto got = answers.Wait(1);
  ASSERT_EQ(got.size(), 1u);  // only the registered one, failed by the close
  EXPECT_EQ(got[0].first, 7u);
  EXPECT_THAT(got[0].second.status(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("closed: test over")));
}

TEST_F(StageStreamClientTest, CloseFailsEveryAwaitedAnswerAndLaterSendsAreRefused) {
  Serve(ReadUntilCancelled);
  Answers answers;
  std::shared_ptr<StageStreamClient> client = Open();
  for (uint64_t step : {1, 2}) {
    StageStreamClient::Answer a = answers.For(step);
    ASSERT_THAT(client->Send(step, Batch({Message(step, 1)}), a), IsOk());
  }
  client->Close("step 1 timed out");
  client->Close("a second reason is ignored");
  auto got = answers.Wait(2);
  ASSERT_EQ(got.size(), 2u);
  for (const auto& [step, r] : got) {
    EXPECT_THAT(r.status(), StatusIs(absl::StatusCode::kUnavailable,
                                     HasSubstr("stage stream to " + address_ + " closed: step 1 timed out")));
  }
  EXPECT_TRUE(client->closing());
  StageStreamClient::Answer late = answers.For(3);
  EXPECT_THAT(client->Send(3, Batch({Message(3, 1)}), late), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("closed")));
  EXPECT_TRUE(client->WaitDone(kWait));
}

TEST_F(StageStreamClientTest, APeerThatEndsTheStreamFailsWhatWaitsWithItsStatus) {
  Serve([](grpc::ServerContext*, Stream* stream) {
    v1::StepRequest m;
    stream->Read(&m);
    stream->Write(Answer(m.step_id(), 5));
    stream->Read(&m);
    return grpc::Status(grpc::StatusCode::INTERNAL, "stage crashed");
  });
  Answers answers;
  std::shared_ptr<StageStreamClient> client = Open({.peer = "next stage at somewhere"});
  StageStreamClient::Answer a1 = answers.For(1);
  ASSERT_THAT(client->Send(1, Batch({Message(1, 1)}), a1), IsOk());
  ASSERT_EQ(answers.Wait(1).size(), 1u);
  StageStreamClient::Answer a2 = answers.For(2);
  ASSERT_THAT(client->Send(2, Batch({Message(2, 1)}), a2), IsOk());
  auto got = answers.Wait(2);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_THAT(got[0].second.status(), IsOk());
  EXPECT_THAT(got[1].second.status(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("next stage at somewhere ended the stream")));
  EXPECT_THAT(got[1].second.status().message(), HasSubstr("stage crashed"));
  EXPECT_TRUE(client->WaitDone(kWait));
  EXPECT_TRUE(client->closing());
}

TEST_F(StageStreamClientTest, AnAnswerToAStepNotInFlightEndsTheStream) {
  Serve([](grpc::ServerContext* ctx, Stream* stream) {
    v1::StepRequest m;
    stream->Read(&m);
    v1::StepResponse stray = Answer(99, 1);
    stray.set_error_message("could not reassemble");
    stream->Write(stray);
    while (!ctx->IsCancelled() && stream->Read(&m)) {
    }
    return grpc::Status::OK;
  });
  Answers answers;
  std::shared_ptr<StageStreamClient> client = Open();
  StageStreamClient::Answer a = answers.For(1);
  ASSERT_THAT(client->Send(1, Batch({Message(1, 1)}), a), IsOk());
  auto got = answers.Wait(1);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_THAT(got[0].second.status(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("answered step 99, which was not in flight: could not reassemble")));
  EXPECT_TRUE(client->WaitDone(kWait));
}

TEST_F(StageStreamClientTest, CountsTheBytesOfEveryMessageAndAnswer) {
  Serve([](grpc::ServerContext*, Stream* stream) {
    v1::StepRequest m;
    int n = 0;
    while (stream->Read(&m)) {
      if (++n == 2) stream->Write(Answer(m.step_id(), 123456));
    }
    return grpc::Status::OK;
  });
  Mutex mu;
  size_t sent = 0, received = 0;
  Answers answers;
  std::shared_ptr<StageStreamClient> client = Open({.on_sent =
                                                        [&](size_t b) {
                                                          MutexLock lock(&mu);
                                                          sent += b;
                                                        },
                                                    .on_received =
                                                        [&](size_t b) {
                                                          MutexLock lock(&mu);
                                                          received += b;
                                                        }});
  StageStreamClient::Messages messages = Batch({Message(4, 1), Message(4, 300000)});
  const size_t want_sent = messages[0]->ByteSizeLong() + messages[1]->ByteSizeLong();
  StageStreamClient::Answer a = answers.For(4);
  ASSERT_THAT(client->Send(4, std::move(messages), a), IsOk());
  ASSERT_EQ(answers.Wait(1).size(), 1u);
  {
    MutexLock lock(&mu);
    EXPECT_EQ(sent, want_sent);
    EXPECT_EQ(received, Answer(4, 123456).ByteSizeLong());
  }
  client->Close("test over");
  EXPECT_TRUE(client->WaitDone(kWait));
}

TEST_F(StageStreamClientTest, DroppingEveryReferenceWhileAnswersAreAwaitedIsSafe) {
  // The client keeps itself alive until gRPC is done: the awaited answer still comes (failed).
  Serve(ReadUntilCancelled);
  Answers answers;
  {
    std::shared_ptr<StageStreamClient> client = Open();
    StageStreamClient::Answer a = answers.For(1);
    ASSERT_THAT(client->Send(1, Batch({Message(1, 1)}), a), IsOk());
    client->Close("dropped");
  }
  auto got = answers.Wait(1);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_THAT(got[0].second.status(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("closed: dropped")));
}

// The bytes WireMessage writes parse as the message with the slice as its hidden.data: with and
// without a tensor header in the message, for lengths whose varints take 1 to 4 bytes, and with no
// slice at all.
TEST(WireMessageTest, ParsesAsTheMessageWithTheSliceAsItsHiddenData) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{127}, size_t{128}, size_t{16383}, size_t{16384}, size_t{3} << 20}) {
    for (bool header : {true, false}) {
      SCOPED_TRACE(absl::StrCat(n, " bytes, tensor header ", header));
      v1::StepRequest m = Message(5, 9);
      m.set_chunk_index(header ? 0 : 1);
      m.set_chunk_count(2);
      if (header) {
        m.mutable_hidden()->set_dtype(v1::DTYPE_F32);
        m.mutable_hidden()->add_shape(3);
        m.mutable_hidden()->add_shape(7);
      }
      std::string bytes(n, '\0');
      for (size_t i = 0; i < n; ++i) bytes[i] = static_cast<char>((i * 131) % 251);
      grpc::ByteBuffer wire = StageStreamClient::WireMessage(m, grpc::Slice(bytes));
      v1::StepRequest parsed;
      ASSERT_TRUE(grpc::SerializationTraits<v1::StepRequest>::Deserialize(&wire, &parsed).ok());
      v1::StepRequest want = m;
      if (n > 0) want.mutable_hidden()->set_data(bytes);
      EXPECT_EQ(parsed.SerializeAsString(), want.SerializeAsString());
      EXPECT_EQ(parsed.hidden().data(), bytes);
      EXPECT_EQ(parsed.hidden().shape_size(), header ? 2 : 0);
    }
  }
}

TEST(WireMessageTest, AnOwningSliceKeepsTheVectorsBytesWhereTheyAre) {
  std::vector<float> values(1000);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i) * 0.5f;
  const std::vector<float> want = values;
  const float* where = values.data();
  grpc::Slice all = StageStreamClient::OwningSlice(std::move(values));
  ASSERT_EQ(all.size(), want.size() * sizeof(float));
  EXPECT_EQ(reinterpret_cast<const float*>(all.begin()), where);  // not copied
  grpc::Slice part = all.sub(400, 4000);
  all = grpc::Slice();  // the view keeps the bytes alive
  EXPECT_EQ(std::memcmp(part.begin(), reinterpret_cast<const char*>(want.data()) + 400, 3600), 0);
  EXPECT_EQ(StageStreamClient::OwningSlice({}).size(), 0u);
}

TEST_F(StageStreamClientTest, HiddenSlicesArriveAsTheMessagesHiddenData) {
  // Reads one micro-batch of two messages, each with hidden bytes beside it, and answers it.
  std::vector<v1::StepRequest> seen;
  Serve([&](grpc::ServerContext*, Stream* stream) {
    v1::StepRequest m;
    for (int i = 0; i < 2 && stream->Read(&m); ++i) seen.push_back(m);
    stream->Write(Answer(6, 1));
    while (stream->Read(&m)) {
    }
    return grpc::Status::OK;
  });
  std::vector<float> first(300000), second(77);
  for (size_t i = 0; i < first.size(); ++i) first[i] = static_cast<float>(i);
  for (size_t i = 0; i < second.size(); ++i) second[i] = -static_cast<float>(i);
  const std::vector<float> first_copy = first, second_copy = second;
  StageStreamClient::Messages messages = Batch({Message(6, 1), Message(6, 2)});
  messages[0]->mutable_hidden()->set_dtype(v1::DTYPE_F32);
  StageStreamClient::Messages with_hidden;
  with_hidden.push_back(std::move(messages[0]), StageStreamClient::OwningSlice(std::move(first)));
  with_hidden.push_back(std::move(messages[1]), StageStreamClient::OwningSlice(std::move(second)));
  Answers answers;
  std::shared_ptr<StageStreamClient> client = Open();
  StageStreamClient::Answer a = answers.For(6);
  ASSERT_THAT(client->Send(6, std::move(with_hidden), a), IsOk());
  ASSERT_EQ(answers.Wait(1).size(), 1u);
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[0].hidden().dtype(), v1::DTYPE_F32);
  EXPECT_EQ(seen[0].hidden().data(),
            std::string(reinterpret_cast<const char*>(first_copy.data()), first_copy.size() * sizeof(float)));
  EXPECT_EQ(seen[1].hidden().data(),
            std::string(reinterpret_cast<const char*>(second_copy.data()), second_copy.size() * sizeof(float)));
  EXPECT_EQ(seen[1].sequences(0).token_ids(0), 2);
  client->Close("test over");
  EXPECT_TRUE(client->WaitDone(kWait));
}

}  // namespace
}  // namespace shardserve::rpc

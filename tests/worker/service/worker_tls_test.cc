// A worker daemon's port with mutual TLS (the server worker_main builds, StartWorkerRpcServer):
// only the coordinator assigns, only the coordinator and workers open stage streams, and
// certificates of the client role, of another CA or none at all get nowhere.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_certificate_verifier.h>
#include <grpcpp/security/tls_credentials_options.h>

#include <chrono>
#include <memory>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/security/grpc_security.h"
#include "gtest/gtest.h"
#include "shardserve/v1/control.grpc.pb.h"
#include "shardserve/v1/stage.grpc.pb.h"
#include "tests/testing/tls_fixture.h"
#include "worker/service/worker_server.h"

namespace shardserve::service {
namespace {

using security::Role;

class WorkerTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<WorkerServer>(WorkerOptions{});
    int port = 0;
    auto rpc = StartWorkerRpcServer("127.0.0.1:0", ca_.Security("worker-0", {Role::kWorker}), *server_, &port);
    ASSERT_TRUE(rpc.ok()) << rpc.status();
    rpc_ = *std::move(rpc);
    address_ = absl::StrCat("127.0.0.1:", port);
  }
  void TearDown() override {
    server_->Shutdown();
    rpc_->Shutdown(std::chrono::system_clock::now());
  }

  std::shared_ptr<grpc::ChannelCredentials> As(const std::string& name, Role role) {
    return ca_.Security(name, {role}).InternalChannelCredentials(Role::kWorker);
  }

  grpc::Status Assign(std::shared_ptr<grpc::ChannelCredentials> creds) {
    auto stub = v1::Worker::NewStub(grpc::CreateChannel(address_, std::move(creds)));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::AssignResponse response;
    return stub->Assign(&ctx, v1::Assignment(), &response);
  }

  // Opens a stage stream, sends one micro-batch and closes; returns the responses' step ids and
  // the stream's status.
  std::pair<std::vector<uint64_t>, grpc::Status> Stream(std::shared_ptr<grpc::ChannelCredentials> creds) {
    auto stub = v1::Stage::NewStub(grpc::CreateChannel(address_, std::move(creds)));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    auto stream = stub->StepStream(&ctx);
    v1::StepRequest request;
    request.set_step_id(7);
    std::vector<uint64_t> ids;
    if (stream->Write(request)) {
      stream->WritesDone();
      v1::StepResponse response;
      while (stream->Read(&response)) ids.push_back(response.step_id());
    }
    return {ids, stream->Finish()};
  }

  shardserve::testing::TestCa ca_{"cluster CA"};
  shardserve::testing::TestCa other_ca_{"another CA"};
  std::unique_ptr<WorkerServer> server_;
  std::unique_ptr<grpc::Server> rpc_;
  std::string address_;
};

TEST_F(WorkerTlsTest, OnlyTheCoordinatorAssigns) {
  // The coordinator's call gets through to validation (an empty assignment is malformed).
  EXPECT_EQ(Assign(As("coordinator", Role::kCoordinator)).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // Another worker, a client certificate, or plaintext: refused before the assignment is read.
  EXPECT_EQ(Assign(As("worker-1", Role::kWorker)).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(Assign(As("client", Role::kClient)).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(Assign(grpc::InsecureChannelCredentials()).error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(WorkerTlsTest, AnAssignmentThatIsNotAMessageIsInvalidArgument) {
  grpc::GenericStub stub(grpc::CreateChannel(address_, As("coordinator", Role::kCoordinator)));
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::Slice slice(std::string("\xff\xff\xff\xff", 4));
  grpc::ByteBuffer request(&slice, 1), response;
  grpc::Status status;
  void* tag = nullptr;
  bool ok = false;
  // A generic stream carries a unary exchange: one message each way.
  auto call = stub.PrepareCall(&ctx, "/shardserve.v1.Worker/Assign", &cq);
  call->StartCall(reinterpret_cast<void*>(1));
  cq.Next(&tag, &ok);
  call->WriteLast(request, grpc::WriteOptions(), reinterpret_cast<void*>(2));
  cq.Next(&tag, &ok);
  call->Read(&response, reinterpret_cast<void*>(3));
  cq.Next(&tag, &ok);
  call->Finish(&status, reinterpret_cast<void*>(4));
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
}

TEST_F(WorkerTlsTest, StageStreamsOpenOnlyForTheCoordinatorAndWorkers) {
  for (Role role : {Role::kCoordinator, Role::kWorker}) {
    auto [ids, status] = Stream(As(absl::StrCat("peer-", security::RoleName(role)), role));
    EXPECT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(ids, std::vector<uint64_t>{7}) << security::RoleName(role);  // answered (no stage loaded)
  }
  auto [client_ids, client_status] = Stream(As("client", Role::kClient));
  EXPECT_EQ(client_status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(client_ids.empty());
  // No certificate at all: the handshake fails.
  grpc::experimental::TlsChannelCredentialsOptions o;
  o.set_certificate_provider(std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      ca_.Dir("ca-only", {Role::kClient}).ca_file, 1));
  o.watch_root_certs();
  o.set_check_call_host(false);
  o.set_certificate_verifier(std::make_shared<grpc::experimental::NoOpCertificateVerifier>());
  auto [none_ids, none_status] = Stream(grpc::experimental::TlsCredentials(o));
  EXPECT_FALSE(none_status.ok());
  EXPECT_TRUE(none_ids.empty());
  // A worker certificate from another CA.
  auto foreign = security::GrpcSecurity::UncheckedForTest(other_ca_.Dir("w", {Role::kWorker}, ca_.cert_pem()));
  auto [foreign_ids, foreign_status] = Stream(foreign.InternalChannelCredentials(Role::kWorker));
  EXPECT_FALSE(foreign_status.ok());
  EXPECT_TRUE(foreign_ids.empty());
}

// The return stream of direct answers (Stage.AnswerStream) opens only for the coordinator: a
// worker or a client is refused before the stream is registered.
TEST_F(WorkerTlsTest, ReturnStreamsOpenOnlyForTheCoordinator) {
  auto open = [&](Role role, const std::string& route) {
    auto stub = v1::Stage::NewStub(
        grpc::CreateChannel(address_, As(absl::StrCat("peer-", security::RoleName(role)), role)));
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::AnswerStreamRequest request;
    request.set_route(route);
    auto reader = stub->AnswerStream(ctx.get(), request);
    return std::tuple{std::move(stub), std::move(ctx), std::move(reader)};
  };
  for (Role role : {Role::kWorker, Role::kClient}) {
    auto [stub, ctx, reader] = open(role, "r");
    v1::StepResponse response;
    EXPECT_FALSE(reader->Read(&response));
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::PERMISSION_DENIED) << security::RoleName(role);
  }
  EXPECT_FALSE(server_->answer_routes().HasRouteForTest("r"));
  // The coordinator's is registered (and stays open until it cancels).
  auto [stub, ctx, reader] = open(Role::kCoordinator, "r");
  for (int i = 0; i < 500 && !server_->answer_routes().HasRouteForTest("r"); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(server_->answer_routes().HasRouteForTest("r"));
  ctx->TryCancel();
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
}

}  // namespace
}  // namespace shardserve::service

// GrpcServerLimits: validation, and an idle connection closed by the server (max_connection_idle)
// so that the client's channel leaves READY without any call failing.
#include <grpcpp/grpcpp.h>

#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/security/grpc_security.h"
#include "gtest/gtest.h"
#include "shardserve/v1/control.grpc.pb.h"

namespace shardserve::security {
namespace {

class OkRegistry final : public v1::Registry::CallbackService {
  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* ctx, const v1::RegisterRequest* /*request*/,
                                     v1::RegisterResponse* /*response*/) override {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

TEST(GrpcServerLimitsTest, ValidateNamesTheFlag) {
  EXPECT_TRUE(GrpcServerLimits{}.Validate().ok());
  GrpcServerLimits zero_keepalive{.keepalive_time = absl::ZeroDuration()};
  EXPECT_NE(zero_keepalive.Validate().message().find("--grpc_keepalive_time_ms"), std::string::npos);
  GrpcServerLimits negative_age{.max_connection_age = absl::Seconds(-1)};
  EXPECT_NE(negative_age.Validate().message().find("--grpc_max_connection_age_ms"), std::string::npos);
}

// Makes one call on `channel`; true when it succeeds.
bool Call(const std::shared_ptr<grpc::Channel>& channel) {
  auto stub = v1::Registry::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::RegisterResponse response;
  return stub->Register(&ctx, v1::RegisterRequest(), &response).ok();
}

// Whether the channel, READY after a call, leaves READY within `wait` while making no calls.
bool LeavesReadyWhenIdle(absl::Duration max_connection_idle, std::chrono::milliseconds wait) {
  OkRegistry service;
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  ApplyServerLimits({.max_connection_idle = max_connection_idle}, b);
  b.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
  EXPECT_TRUE(Call(channel));
  EXPECT_EQ(channel->GetState(false), GRPC_CHANNEL_READY);
  const bool changed = channel->WaitForStateChange(GRPC_CHANNEL_READY, std::chrono::system_clock::now() + wait);
  EXPECT_TRUE(Call(channel));  // a closed idle connection is reopened by the next call
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  return changed;
}

// A second server on a port in use fails to start (gRPC's default SO_REUSEPORT would let it share
// the port and take a share of the connections).
TEST(GrpcServerLimitsTest, APortInUseIsRefused) {
  OkRegistry service;
  grpc::ServerBuilder first;
  int port = 0;
  first.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  ApplyServerLimits({}, first);
  first.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = first.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ASSERT_GT(port, 0);
  grpc::ServerBuilder second;
  second.AddListeningPort(absl::StrCat("127.0.0.1:", port), grpc::InsecureServerCredentials());
  ApplyServerLimits({}, second);
  std::unique_ptr<grpc::Server> twin = second.BuildAndStart();
  EXPECT_EQ(twin, nullptr);
  EXPECT_TRUE(Call(grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials())));
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

TEST(GrpcServerLimitsTest, IdleConnectionsAreClosedAfterMaxConnectionIdle) {
  EXPECT_TRUE(LeavesReadyWhenIdle(absl::Milliseconds(300), std::chrono::milliseconds(5000)));
}

TEST(GrpcServerLimitsTest, WithoutAnIdleLimitTheConnectionStays) {
  EXPECT_FALSE(LeavesReadyWhenIdle(absl::ZeroDuration(), std::chrono::milliseconds(1500)));
}

}  // namespace
}  // namespace shardserve::security

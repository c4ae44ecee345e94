// The coordinator with TLS: the public API and the control plane are separate ports; only
// certificates with the worker role register (a client certificate, a foreign CA's, none, or
// plaintext cannot), and the public port serves TLS to clients without certificates.
#include <grpcpp/grpcpp.h>

#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/security/grpc_security.h"
#include "coordinator/api/coordinator.h"
#include "gtest/gtest.h"
#include "shardserve/v1/control.grpc.pb.h"
#include "shardserve/v1/inference.grpc.pb.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/tls_fixture.h"

namespace shardserve::coordinator {
namespace {

using security::Role;

class NoWorkers final : public WorkerClient {
 public:
  absl::Status Assign(const std::string&, const WorkerAssignment&) override { return absl::OkStatus(); }
};

class CoordinatorTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CoordinatorOptions o;
    o.model_path = "tests/golden/models/llama";
    o.expected_workers = 2;
    o.tls = ca_.Dir("coordinator", {Role::kCoordinator});
    ASSERT_OK_AND_ASSIGN(coordinator_, Coordinator::Start(o, {.worker_client = std::make_unique<NoWorkers>()}));
  }

  grpc::Status Register(const std::string& address, std::shared_ptr<grpc::ChannelCredentials> creds) {
    auto stub = v1::Registry::NewStub(grpc::CreateChannel(address, std::move(creds)));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::RegisterRequest req;
    req.set_node_name("n");
    req.set_address("127.0.0.1:1");
    v1::Device* d = req.add_devices();
    d->set_kind(v1::DEVICE_KIND_CPU);
    d->set_total_bytes(int64_t{1} << 30);
    d->set_free_bytes(int64_t{1} << 30);
    v1::RegisterResponse response;
    return stub->Register(&ctx, req, &response);
  }
  std::shared_ptr<grpc::ChannelCredentials> As(const std::string& name, Role role) {
    return ca_.Security(name, {role}).InternalChannelCredentials(Role::kCoordinator);
  }

  shardserve::testing::TestCa ca_{"cluster CA"};
  shardserve::testing::TestCa other_ca_{"another CA"};
  std::unique_ptr<Coordinator> coordinator_;
};

TEST_F(CoordinatorTlsTest, OnlyWorkerCertificatesRegisterOnTheControlPort) {
  ASSERT_NE(coordinator_->control_address(), coordinator_->address());
  grpc::Status worker = Register(coordinator_->control_address(), As("worker", Role::kWorker));
  EXPECT_TRUE(worker.ok()) << worker.error_message();
  EXPECT_EQ(Register(coordinator_->control_address(), As("client", Role::kClient)).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(Register(coordinator_->control_address(), grpc::InsecureChannelCredentials()).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  auto foreign = security::GrpcSecurity::UncheckedForTest(other_ca_.Dir("w", {Role::kWorker}, ca_.cert_pem()));
  EXPECT_FALSE(Register(coordinator_->control_address(), foreign.InternalChannelCredentials(Role::kCoordinator)).ok());
  EXPECT_EQ(coordinator_->registry().List().size(), 1u);
}

TEST_F(CoordinatorTlsTest, ThePublicPortHasNoRegistryAndServesTlsToClientsWithoutCertificates) {
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = ca_.cert_pem();
  const std::string port = coordinator_->address().substr(coordinator_->address().rfind(':') + 1);
  auto channel = grpc::CreateChannel(absl::StrCat("localhost:", port), grpc::SslCredentials(ssl));
  // Even a worker's certificate cannot register through the public port.
  EXPECT_EQ(Register(coordinator_->address(), As("worker", Role::kWorker)).error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
  auto inference = v1::Inference::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::ModelInfo info;
  grpc::Status st = inference->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info);
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(Register(coordinator_->address(), grpc::InsecureChannelCredentials()).error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

TEST(CoordinatorTlsOptionsTest, PublicPlaintextOnlyOnLoopbackAndTheCertificateMustBeTheCoordinators) {
  shardserve::testing::TestCa ca("cluster CA");
  CoordinatorOptions o;
  o.model_path = "tests/golden/models/llama";
  o.tls = ca.Dir("worker", {Role::kWorker});
  EXPECT_THAT(Coordinator::Start(o).status(),
              shardserve::testing::StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("coordinator")));
  o.tls = ca.Dir("coordinator", {Role::kCoordinator});
  o.public_plaintext = true;
  o.listen = "0.0.0.0:0";
  EXPECT_THAT(Coordinator::Start(o).status(), shardserve::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                                                            ::testing::HasSubstr("loopback")));
}

}  // namespace
}  // namespace shardserve::coordinator

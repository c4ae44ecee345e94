// TLS and mutual TLS between shardserve processes, with certificates the test makes itself:
// who gets through an internal port (roles), what a plaintext client or a foreign CA gets, the
// flags' half-configurations, and certificate rotation without a restart.
#include "common/security/grpc_security.h"

#include <grpc/grpc_security_constants.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_certificate_verifier.h>
#include <grpcpp/security/tls_credentials_options.h>

#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/security/cert_authority.h"
#include "common/security/tls_files.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "shardserve/v1/control.grpc.pb.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/tls_fixture.h"

namespace shardserve::security {
namespace {

using ::testing::HasSubstr;

// Answers Register with the caller's roles, comma-separated.
class EchoRegistry final : public v1::Registry::CallbackService {
  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* ctx, const v1::RegisterRequest* /*request*/,
                                     v1::RegisterResponse* response) override {
    std::vector<std::string> roles;
    for (Role r : PeerRoles(*ctx->auth_context())) roles.emplace_back(RoleName(r));
    response->set_worker_id(absl::StrJoin(roles, ","));
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

class Server {
 public:
  explicit Server(std::shared_ptr<grpc::ServerCredentials> creds) {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", std::move(creds), &port_);
    b.RegisterService(&service_);
    server_ = b.BuildAndStart();
  }
  ~Server() { server_->Shutdown(std::chrono::system_clock::now()); }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  EchoRegistry service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

struct CallResult {
  grpc::Status status;
  std::string roles;        // what the server saw
  std::string server_name;  // the CN of the server's certificate, as the client saw it
};

CallResult Call(const std::shared_ptr<grpc::Channel>& channel) {
  auto stub = v1::Registry::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::RegisterResponse response;
  CallResult r;
  r.status = stub->Register(&ctx, v1::RegisterRequest(), &response);
  r.roles = response.worker_id();
  for (const grpc::string_ref& cn : ctx.auth_context()->FindPropertyValues(GRPC_X509_CN_PROPERTY_NAME)) {
    r.server_name.assign(cn.data(), cn.size());
  }
  return r;
}

CallResult Call(const std::string& address, std::shared_ptr<grpc::ChannelCredentials> creds) {
  return Call(grpc::CreateChannel(address, std::move(creds)));
}

// TLS that trusts `ca_file` but presents no certificate.
std::shared_ptr<grpc::ChannelCredentials> NoCertificate(const std::string& ca_file) {
  grpc::experimental::TlsChannelCredentialsOptions o;
  o.set_certificate_provider(std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(ca_file, 1));
  o.watch_root_certs();
  o.set_check_call_host(false);
  o.set_certificate_verifier(std::make_shared<grpc::experimental::NoOpCertificateVerifier>());
  return grpc::experimental::TlsCredentials(o);
}

class GrpcSecurityTest : public ::testing::Test {
 protected:
  shardserve::testing::TestCa ca_{"cluster CA"};
  shardserve::testing::TestCa other_ca_{"another CA"};
};

TEST_F(GrpcSecurityTest, MutualTlsLetsTheAllowedRoleInAndShowsItToTheServer) {
  Server coordinator(ca_.Security("coordinator", {Role::kCoordinator}).InternalServerCredentials({Role::kWorker}));
  CallResult r = Call(coordinator.address(),
                      ca_.Security("worker", {Role::kWorker}).InternalChannelCredentials(Role::kCoordinator));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.roles, "worker");
  EXPECT_EQ(r.server_name, "coordinator");
}

TEST_F(GrpcSecurityTest, ManyCallsOnOneChannelCostOneHandshake) {
  Server coordinator(ca_.Security("coordinator", {Role::kCoordinator}).InternalServerCredentials({Role::kWorker}));
  auto channel = grpc::CreateChannel(
      coordinator.address(), ca_.Security("worker", {Role::kWorker}).InternalChannelCredentials(Role::kCoordinator));
  const int64_t before = InternalClientHandshakes();
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(Call(channel).status.ok());
  EXPECT_EQ(InternalClientHandshakes() - before, 1);
}

TEST_F(GrpcSecurityTest, PlaintextClientAgainstATlsServerIsRefused) {
  Server coordinator(ca_.Security("coordinator", {Role::kCoordinator}).InternalServerCredentials({Role::kWorker}));
  EXPECT_EQ(Call(coordinator.address(), grpc::InsecureChannelCredentials()).status.error_code(),
            grpc::StatusCode::UNAVAILABLE);
  Server public_port(ca_.Security("public", {Role::kCoordinator}).PublicServerCredentials());
  EXPECT_EQ(Call(public_port.address(), grpc::InsecureChannelCredentials()).status.error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

TEST_F(GrpcSecurityTest, ClientCertificateFromAnotherCaIsRefused) {
  Server coordinator(ca_.Security("coordinator", {Role::kCoordinator}).InternalServerCredentials({Role::kWorker}));
  // A worker certificate, but signed by another CA; the client itself trusts the cluster CA.
  GrpcSecurity foreign = GrpcSecurity::UncheckedForTest(other_ca_.Dir("worker", {Role::kWorker}, ca_.cert_pem()));
  CallResult r = Call(coordinator.address(), foreign.InternalChannelCredentials(Role::kCoordinator));
  EXPECT_FALSE(r.status.ok());
  EXPECT_NE(r.status.error_code(), grpc::StatusCode::OK);
  // The public port, which takes client certificates optionally, still verifies one that is shown.
  Server public_port(ca_.Security("public", {Role::kCoordinator}).PublicServerCredentials());
  EXPECT_FALSE(Call(public_port.address(), foreign.InternalChannelCredentials(Role::kCoordinator)).status.ok());
}

TEST_F(GrpcSecurityTest, ServerOfAnotherCaIsRefusedByTheClient) {
  Server impostor(other_ca_.Security("coordinator", {Role::kCoordinator}).InternalServerCredentials({Role::kWorker}));
  EXPECT_EQ(Call(impostor.address(), ca_.Security("worker", {Role::kWorker}).InternalChannelCredentials(Role::kCoordinator))
                .status.error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

TEST_F(GrpcSecurityTest, InternalPortWithoutAClientCertificateIsRefused) {
  Server coordinator(ca_.Security("coordinator", {Role::kCoordinator}).InternalServerCredentials({Role::kWorker}));
  const std::string ca_file = ca_.Dir("ca-only", {Role::kClient}).ca_file;
  EXPECT_FALSE(Call(coordinator.address(), NoCertificate(ca_file)).status.ok());
}

TEST_F(GrpcSecurityTest, ClientRoleCertificateIsPermissionDeniedOnAnInternalPort) {
  Server coordinator(ca_.Security("coordinator", {Role::kCoordinator}).InternalServerCredentials({Role::kWorker}));
  CallResult r = Call(coordinator.address(),
                      ca_.Security("client", {Role::kClient}).InternalChannelCredentials(Role::kCoordinator));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << r.status.error_message();
  EXPECT_THAT(r.status.error_message(), HasSubstr("worker"));
}

TEST_F(GrpcSecurityTest, ClientRefusesAServerWithoutTheExpectedRole) {
  // A worker's port answering where the coordinator was expected (or a client certificate used
  // to serve): the client's handshake fails.
  Server worker(ca_.Security("worker-1", {Role::kWorker}).InternalServerCredentials({Role::kWorker}));
  CallResult r = Call(worker.address(),
                      ca_.Security("worker-2", {Role::kWorker}).InternalChannelCredentials(Role::kCoordinator));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(Call(worker.address(), ca_.Security("worker-3", {Role::kWorker}).InternalChannelCredentials(Role::kWorker))
                  .status.ok());
}

TEST_F(GrpcSecurityTest, PublicPortTakesClientsWithoutCertificates) {
  Server public_port(ca_.Security("public", {Role::kCoordinator}).PublicServerCredentials());
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = ca_.cert_pem();
  CallResult r = Call(grpc::CreateChannel(absl::StrCat("localhost:", public_port.address().substr(10)),
                                          grpc::SslCredentials(ssl)));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.roles, "");
}

TEST_F(GrpcSecurityTest, RotatedServerCertificateIsUsedByNewConnectionsWithoutARestart) {
  TlsOptions files = ca_.Dir("server", {Role::kWorker});
  auto server_security = GrpcSecurity::Create(files, Role::kWorker);
  ASSERT_THAT(server_security.status(), shardserve::testing::IsOk());
  Server server(server_security->InternalServerCredentials({Role::kWorker}));
  GrpcSecurity client = ca_.Security("client-worker", {Role::kWorker});
  auto old_channel = grpc::CreateChannel(server.address(), client.InternalChannelCredentials(Role::kWorker));
  CallResult before = Call(old_channel);
  ASSERT_TRUE(before.status.ok()) << before.status.error_message();
  EXPECT_EQ(before.server_name, "server");

  // Replace the files in place (as a Secret update or cert-manager renewal does).
  TlsOptions next = ca_.Dir("server-renewed", {Role::kWorker});
  ASSERT_THAT(WriteTlsDir(ca_.root() + "/server",
                          {.cert_pem = shardserve::testing::ReadFileOrEmpty(next.cert_file),
                           .key_pem = shardserve::testing::ReadFileOrEmpty(next.key_file)},
                          ca_.cert_pem()),
              shardserve::testing::IsOk());
  // New connections (fresh credentials, so no pooled connection is reused) see the new certificate
  // within a few refresh intervals.
  std::string seen;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < deadline) {
    CallResult r = Call(server.address(), client.InternalChannelCredentials(Role::kWorker));
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    seen = r.server_name;
    if (seen == "server-renewed") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  EXPECT_EQ(seen, "server-renewed");
  // The connection made before the rotation keeps serving.
  CallResult after = Call(old_channel);
  EXPECT_TRUE(after.status.ok()) << after.status.error_message();
}

TEST(TlsFlagsTest, NoneMeansPlaintextAndHalfConfiguredIsRefused) {
  ASSERT_OK_AND_ASSIGN(std::optional<TlsOptions> none, TlsOptionsFromFlags("", "", "", ""));
  EXPECT_FALSE(none.has_value());
  auto half = TlsOptionsFromFlags("a.crt", "a.key", "", "");
  EXPECT_EQ(half.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(half.status().message()), HasSubstr("--tls_ca"));
  EXPECT_EQ(TlsOptionsFromFlags("a.crt", "", "", "/d").status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_OK_AND_ASSIGN(std::optional<TlsOptions> dir, TlsOptionsFromFlags("", "", "", "/secrets/tls/"));
  ASSERT_TRUE(dir.has_value());
  EXPECT_EQ(dir->cert_file, "/secrets/tls/tls.crt");
  EXPECT_EQ(dir->key_file, "/secrets/tls/tls.key");
  EXPECT_EQ(dir->ca_file, "/secrets/tls/ca.crt");
}

TEST(TlsFilesTest, FilesMustLoadMatchAndChainToTheCaAndCarryTheRole) {
  shardserve::testing::TestCa ca("cluster CA"), other("another CA");
  TlsOptions good = ca.Dir("w", {Role::kWorker});
  ASSERT_OK_AND_ASSIGN(std::vector<Role> roles, CheckTlsFiles(good));
  EXPECT_EQ(roles, std::vector<Role>{Role::kWorker});
  EXPECT_THAT(GrpcSecurity::Create(good, Role::kWorker).status(), shardserve::testing::IsOk());
  // A worker certificate cannot start a coordinator.
  auto wrong_role = GrpcSecurity::Create(good, Role::kCoordinator);
  EXPECT_EQ(wrong_role.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(wrong_role.status().message()), HasSubstr("coordinator"));
  // Another CA's certificate.
  auto foreign = CheckTlsFiles(other.Dir("x", {Role::kWorker}, ca.cert_pem()));
  EXPECT_EQ(foreign.status().code(), absl::StatusCode::kInvalidArgument);
  // The key of another certificate.
  TlsOptions mixed = good;
  mixed.key_file = ca.Dir("y", {Role::kWorker}).key_file;
  auto mismatch = CheckTlsFiles(mixed);
  EXPECT_EQ(mismatch.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(mismatch.status().message()), HasSubstr("not the private key"));
  TlsOptions missing = good;
  missing.ca_file = "/nonexistent/ca.crt";
  EXPECT_EQ(CheckTlsFiles(missing).status().code(), absl::StatusCode::kNotFound);
}

TEST(TlsFilesTest, LoopbackAddresses) {
  EXPECT_TRUE(IsLoopbackAddress("127.0.0.1:7000"));
  EXPECT_TRUE(IsLoopbackAddress("localhost:0"));
  EXPECT_TRUE(IsLoopbackAddress("[::1]:7000"));
  EXPECT_FALSE(IsLoopbackAddress("0.0.0.0:7000"));
  EXPECT_FALSE(IsLoopbackAddress("[::]:7000"));
  EXPECT_FALSE(IsLoopbackAddress("10.0.0.3:7000"));
}

}  // namespace
}  // namespace shardserve::security

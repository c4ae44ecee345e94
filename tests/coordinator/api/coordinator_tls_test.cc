// The coordinator with TLS: the public API and the control plane are separate ports; only
// certificates with the worker role register (a client certificate, a foreign CA's, none, or
// plaintext cannot), and the public port serves TLS to clients without certificates.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <httplib.h>
#include <openssl/bio.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

#include <chrono>

#include "nlohmann/json.hpp"

#include "absl/strings/str_cat.h"
#include "common/security/grpc_security.h"
#include "coordinator/server/coordinator.h"
#include "gtest/gtest.h"
#include "shardserve/v1/control.grpc.pb.h"
#include "shardserve/v1/inference.grpc.pb.h"
#include "common/security/api_keys.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/tls_fixture.h"

namespace shardserve::coordinator {
namespace {

using security::Role;

class NoWorkers final : public WorkerClient {
 public:
  absl::Status Assign(const std::string&, const WorkerAssignment&) override { return absl::OkStatus(); }
  absl::Status Release(const std::string&, const std::string&) override { return absl::OkStatus(); }
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

// The heartbeat stream has the control port's rules: a worker certificate heartbeats on it; a
// client certificate is refused before any heartbeat is read.
TEST_F(CoordinatorTlsTest, OnlyWorkerCertificatesHeartbeatOnTheStream) {
  auto stream_beat = [&](std::shared_ptr<grpc::ChannelCredentials> creds, const std::string& worker_id) {
    auto stub = v1::Registry::NewStub(grpc::CreateChannel(coordinator_->control_address(), std::move(creds)));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    auto stream = stub->HeartbeatStream(&ctx);
    v1::HeartbeatRequest hb;
    hb.set_worker_id(worker_id);
    hb.set_state(v1::WORKER_STATE_IDLE);
    v1::HeartbeatResponse answer;
    bool answered = stream->Write(hb) && stream->Read(&answer);
    stream->WritesDone();
    while (stream->Read(&answer)) {
    }
    grpc::Status st = stream->Finish();
    return std::make_pair(answered, st);
  };
  ASSERT_TRUE(Register(coordinator_->control_address(), As("worker", Role::kWorker)).ok());
  const std::vector<WorkerRecord> workers = coordinator_->registry().List();
  ASSERT_EQ(workers.size(), 1u);
  const auto [worker_answered, worker_status] = stream_beat(As("worker", Role::kWorker), workers[0].worker_id);
  EXPECT_TRUE(worker_answered);
  EXPECT_TRUE(worker_status.ok()) << worker_status.error_message();
  const auto [client_answered, client_status] = stream_beat(As("client", Role::kClient), workers[0].worker_id);
  EXPECT_FALSE(client_answered);
  EXPECT_EQ(client_status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
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

grpc::Status ClusterStatus(const std::shared_ptr<grpc::Channel>& channel, const std::string& key = "") {
  auto admin = v1::Admin::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  if (!key.empty()) ctx.AddMetadata("authorization", "Bearer " + key);
  v1::ClusterStatus st;
  return admin->GetClusterStatus(&ctx, v1::GetClusterStatusRequest(), &st);
}

grpc::Status ModelInfo(const std::shared_ptr<grpc::Channel>& channel, const std::string& key = "") {
  auto inference = v1::Inference::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  if (!key.empty()) ctx.AddMetadata("authorization", "Bearer " + key);
  v1::ModelInfo info;
  return inference->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info);
}

TEST_F(CoordinatorTlsTest, WithoutApiKeysTheAdminApiNeedsAnAdminCertificate) {
  const std::string port = coordinator_->address().substr(coordinator_->address().rfind(':') + 1);
  auto as = [&](const std::string& name, std::vector<Role> roles) {
    const security::TlsOptions files = ca_.Dir(name, std::move(roles));
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = shardserve::testing::ReadFileOrEmpty(files.ca_file);
    ssl.pem_cert_chain = shardserve::testing::ReadFileOrEmpty(files.cert_file);
    ssl.pem_private_key = shardserve::testing::ReadFileOrEmpty(files.key_file);
    return grpc::CreateChannel(absl::StrCat("localhost:", port), grpc::SslCredentials(ssl));
  };
  grpc::SslCredentialsOptions anonymous;
  anonymous.pem_root_certs = ca_.cert_pem();
  auto no_cert = grpc::CreateChannel(absl::StrCat("localhost:", port), grpc::SslCredentials(anonymous));
  EXPECT_EQ(ClusterStatus(no_cert).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(ModelInfo(no_cert).ok());  // the user API takes anonymous TLS clients without keys
  EXPECT_EQ(ClusterStatus(as("a-worker", {Role::kWorker})).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(ClusterStatus(as("a-client", {Role::kClient})).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  grpc::Status admin = ClusterStatus(as("an-admin", {Role::kAdmin}));
  EXPECT_TRUE(admin.ok()) << admin.error_message();
}

// API keys on both front ends (plaintext here: keys do not depend on TLS).
class CoordinatorApiKeysTest : public ::testing::Test {
 protected:
  void SetUp() override {
    keys_file_ = dir_.Write("keys", absl::StrCat("alice user sha256:", security::Sha256Hex("alice-key"), "\n",
                                                 "ops admin sha256:", security::Sha256Hex("ops-key"), "\n",
                                                 "slow user sha256:", security::Sha256Hex("slow-key"),
                                                 " rps=0.001 burst=1\n"));
    CoordinatorOptions o;
    o.model_path = "tests/golden/models/llama";
    o.api_keys_file = keys_file_;
    o.http_listen = "127.0.0.1:0";
    ASSERT_OK_AND_ASSIGN(coordinator_, Coordinator::Start(o, {.worker_client = std::make_unique<NoWorkers>()}));
    channel_ = grpc::CreateChannel(coordinator_->address(), grpc::InsecureChannelCredentials());
  }
  shardserve::testing::TempDir dir_;
  std::string keys_file_;
  std::unique_ptr<Coordinator> coordinator_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(CoordinatorApiKeysTest, GrpcNeedsAKeyAndAdminCallsNeedTheAdminRole) {
  EXPECT_EQ(ModelInfo(channel_).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(ModelInfo(channel_, "wrong").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(ModelInfo(channel_, "alice-key").ok());
  EXPECT_EQ(ClusterStatus(channel_, "alice-key").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(ClusterStatus(channel_).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(ClusterStatus(channel_, "ops-key").ok());
  EXPECT_TRUE(ModelInfo(channel_, "slow-key").ok());
  EXPECT_EQ(ModelInfo(channel_, "slow-key").error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  // Generate is refused before anything is scheduled.
  auto inference = v1::Inference::NewStub(channel_);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::GenerateRequest req;
  req.mutable_token_ids()->add_ids(1);
  req.set_max_tokens(1);
  auto reader = inference->Generate(&ctx, req);
  v1::GenerateResponse r;
  while (reader->Read(&r)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
}

TEST_F(CoordinatorApiKeysTest, HttpAnswers401WithAnOpenAiErrorWithoutAValidKey) {
  const std::string http = coordinator_->http_address();
  httplib::Client client("127.0.0.1", std::stoi(http.substr(http.rfind(':') + 1)));
  auto none = client.Get("/v1/models");
  ASSERT_TRUE(none);
  EXPECT_EQ(none->status, 401);
  const nlohmann::json body = nlohmann::json::parse(none->body);
  EXPECT_EQ(body["error"]["code"], "invalid_api_key");
  EXPECT_EQ(body["error"]["type"], "invalid_request_error");
  auto wrong = client.Post("/v1/completions", {{"Authorization", "Bearer nope"}}, R"({"prompt": [1], "max_tokens": 1})",
                           "application/json");
  ASSERT_TRUE(wrong);
  EXPECT_EQ(wrong->status, 401);
  auto ok = client.Get("/v1/models", {{"Authorization", "Bearer alice-key"}});
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200);
  EXPECT_EQ(client.Get("/v1/models", {{"Authorization", "Bearer slow-key"}})->status, 200);
  auto limited = client.Get("/v1/models", {{"Authorization", "Bearer slow-key"}});
  ASSERT_TRUE(limited);
  EXPECT_EQ(limited->status, 429);
}

TEST(CoordinatorHttpsTest, TheHttpApiServesHttpsWithTheSameFlagsAndRefusesPlainHttp) {
  shardserve::testing::TestCa ca("cluster CA");
  CoordinatorOptions o;
  o.model_path = "tests/golden/models/llama";
  o.tls = ca.Dir("coordinator", {Role::kCoordinator});
  o.http_listen = "127.0.0.1:0";
  ASSERT_OK_AND_ASSIGN(auto coordinator, Coordinator::Start(o, {.worker_client = std::make_unique<NoWorkers>()}));
  const std::string http = coordinator->http_address();
  const int port = std::stoi(http.substr(http.rfind(':') + 1));
  httplib::SSLClient https("localhost", port);
  https.set_ca_cert_path(o.tls->ca_file.c_str());
  https.enable_server_certificate_verification(true);
  auto models = https.Get("/v1/models");
  ASSERT_TRUE(models) << httplib::to_string(models.error());
  EXPECT_EQ(models->status, 200);
  // A client that does not trust the cluster CA refuses the server.
  httplib::SSLClient untrusting("localhost", port);
  untrusting.set_ca_cert_path(ca.Dir("elsewhere", {Role::kClient}).cert_file.c_str());  // not a CA
  untrusting.enable_server_certificate_verification(true);
  EXPECT_FALSE(untrusting.Get("/v1/models"));
  // Plain HTTP gets no answer.
  httplib::Client plain("127.0.0.1", port);
  plain.set_read_timeout(std::chrono::seconds(5));
  auto r = plain.Get("/v1/models");
  EXPECT_TRUE(!r || r->status != 200);
}

// Bytes that are not a protobuf message (0xff: field 31 with the invalid wire type 7).
grpc::ByteBuffer Garbage() {
  grpc::Slice slice(std::string("\xff\xff\xff\xff", 4));
  return grpc::ByteBuffer(&slice, 1);
}

// Sends one raw message on `method` (unary methods take the same wire exchange) and returns the
// call's status.
grpc::Status RawStreamCall(const std::shared_ptr<grpc::Channel>& channel, const std::string& method) {
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  void* tag = nullptr;
  bool ok = false;
  auto call = stub.PrepareCall(&ctx, method, &cq);
  call->StartCall(reinterpret_cast<void*>(1));
  cq.Next(&tag, &ok);
  call->WriteLast(Garbage(), grpc::WriteOptions(), reinterpret_cast<void*>(2));
  cq.Next(&tag, &ok);
  grpc::ByteBuffer response;
  do {
    call->Read(&response, reinterpret_cast<void*>(3));
    cq.Next(&tag, &ok);
  } while (ok);
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(4));
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return status;
}

TEST(CoordinatorRawRequestsTest, RequestsThatAreNotMessagesAreInvalidArgument) {
  CoordinatorOptions o;
  o.model_path = "tests/golden/models/llama";
  ASSERT_OK_AND_ASSIGN(auto coordinator, Coordinator::Start(o, {.worker_client = std::make_unique<NoWorkers>()}));
  auto public_port = grpc::CreateChannel(coordinator->address(), grpc::InsecureChannelCredentials());
  auto control_port = grpc::CreateChannel(coordinator->control_address(), grpc::InsecureChannelCredentials());
  for (const char* method : {"/shardserve.v1.Inference/Tokenize", "/shardserve.v1.Inference/GetModelInfo",
                             "/shardserve.v1.Admin/GetClusterStatus"}) {
    grpc::Status st = RawStreamCall(public_port, method);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method << ": " << st.error_message();
  }
  for (const char* method : {"/shardserve.v1.Registry/Register", "/shardserve.v1.Registry/Heartbeat",
                             "/shardserve.v1.Registry/HeartbeatStream"}) {
    EXPECT_EQ(RawStreamCall(control_port, method).error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method;
  }
  grpc::Status stream = RawStreamCall(control_port, "/shardserve.v1.Registry/HeartbeatStream");
  EXPECT_THAT(stream.error_message(), ::testing::HasSubstr("HeartbeatRequest"));
  grpc::Status generate = RawStreamCall(public_port, "/shardserve.v1.Inference/Generate");
  EXPECT_EQ(generate.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << generate.error_message();
  EXPECT_THAT(generate.error_message(), ::testing::HasSubstr("GenerateRequest"));
  // A real method that does not exist is still UNIMPLEMENTED.
  EXPECT_EQ(RawStreamCall(public_port, "/shardserve.v1.Inference/NoSuchMethod").error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
}

// The common name of the certificate an HTTPS server at 127.0.0.1:port presents to a new
// connection (empty when the handshake fails).
std::string HttpsServerName(int port) {
  std::string cn;
  SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
  BIO* bio = BIO_new_ssl_connect(ctx);
  BIO_set_conn_hostname(bio, absl::StrCat("127.0.0.1:", port).c_str());
  if (BIO_do_connect(bio) == 1 && BIO_do_handshake(bio) == 1) {
    SSL* ssl = nullptr;
    BIO_get_ssl(bio, &ssl);
    if (X509* cert = SSL_get1_peer_certificate(ssl); cert != nullptr) {
      char buf[256] = {};
      X509_NAME_get_text_by_NID(X509_get_subject_name(cert), NID_commonName, buf, sizeof(buf));
      cn = buf;
      X509_free(cert);
    }
  }
  BIO_free_all(bio);
  SSL_CTX_free(ctx);
  return cn;
}

TEST(CoordinatorHttpsTest, ARotatedCertificateIsServedToNewConnectionsWithoutARestart) {
  shardserve::testing::TestCa ca("cluster CA");
  CoordinatorOptions o;
  o.model_path = "tests/golden/models/llama";
  o.tls = ca.Dir("coordinator", {Role::kCoordinator});
  o.http_listen = "127.0.0.1:0";
  ASSERT_OK_AND_ASSIGN(auto coordinator, Coordinator::Start(o, {.worker_client = std::make_unique<NoWorkers>()}));
  const std::string http = coordinator->http_address();
  const int port = std::stoi(http.substr(http.rfind(':') + 1));
  httplib::SSLClient kept("localhost", port);  // a connection made before the rotation
  kept.set_ca_cert_path(o.tls->ca_file.c_str());
  kept.enable_server_certificate_verification(true);
  kept.set_keep_alive(true);
  ASSERT_TRUE(kept.Get("/v1/models"));
  EXPECT_EQ(HttpsServerName(port), "coordinator");
  // Renew the coordinator's certificate in place (as cert-manager does): same CA and role.
  const security::TlsOptions renewed = ca.Dir("coordinator-renewed", {Role::kCoordinator});
  ASSERT_THAT(security::WriteTlsDir(ca.root() + "/coordinator",
                                    {.cert_pem = shardserve::testing::ReadFileOrEmpty(renewed.cert_file),
                                     .key_pem = shardserve::testing::ReadFileOrEmpty(renewed.key_file)},
                                    ca.cert_pem()),
              shardserve::testing::IsOk());
  EXPECT_EQ(HttpsServerName(port), "coordinator-renewed");  // read at each handshake
  auto after = kept.Get("/v1/models");
  ASSERT_TRUE(after);
  EXPECT_EQ(after->status, 200);
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

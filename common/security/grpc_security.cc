#include "common/security/grpc_security.h"

#include <grpc/grpc_security_constants.h>
#include <grpcpp/security/auth_metadata_processor.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_certificate_verifier.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <grpc/grpc.h>
#include <grpcpp/server_builder.h>
#include <grpcpp/server_context.h>

#include <algorithm>
#include <limits>
#include <atomic>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardserve::security {
namespace {

std::atomic<int64_t> g_client_handshakes{0};

std::shared_ptr<grpc::experimental::FileWatcherCertificateProvider> Provider(const TlsOptions& o) {
  const int64_t seconds = std::max<int64_t>(1, absl::ToInt64Seconds(o.refresh_interval));
  return std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(o.key_file, o.cert_file, o.ca_file,
                                                                              static_cast<unsigned int>(seconds));
}

std::string RoleList(absl::Span<const Role> roles) {
  return absl::StrJoin(roles, " or ", [](std::string* out, Role r) { absl::StrAppend(out, RoleName(r)); });
}

bool IsTls(const grpc::AuthContext& auth) {
  for (const grpc::string_ref& v : auth.FindPropertyValues(GRPC_TRANSPORT_SECURITY_TYPE_PROPERTY_NAME)) {
    if (v == "ssl" || v == "tls") return true;
  }
  return false;
}

// The client side of an internal link: the server's certificate (already chained to the CA by
// the handshake) must carry `role`.
class RoleVerifier final : public grpc::experimental::ExternalCertificateVerifier {
 public:
  explicit RoleVerifier(Role role) : uri_(RoleUri(role)), role_(role) {}
  bool Verify(grpc::experimental::TlsCustomVerificationCheckRequest* request,
              std::function<void(grpc::Status)> /*callback*/, grpc::Status* sync_status) override {
    g_client_handshakes.fetch_add(1, std::memory_order_relaxed);
    for (const grpc::string_ref& uri : request->uri_names()) {
      if (absl::string_view(uri.data(), uri.size()) == uri_) {
        *sync_status = grpc::Status::OK;
        return true;
      }
    }
    *sync_status = grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                                absl::StrCat("the server's certificate does not carry the role ", RoleName(role_),
                                             " (URI SAN ", uri_, ")"));
    return true;
  }
  void Cancel(grpc::experimental::TlsCustomVerificationCheckRequest* /*request*/) override {}

 private:
  const std::string uri_;
  const Role role_;
};

// The server side of an internal port: every call's peer must carry one of the allowed roles.
class RoleProcessor final : public grpc::AuthMetadataProcessor {
 public:
  explicit RoleProcessor(std::vector<Role> allowed) : allowed_(std::move(allowed)) {}
  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata& /*auth_metadata*/, grpc::AuthContext* context,
                       OutputMetadata* /*consumed*/, OutputMetadata* /*response*/) override {
    return CheckPeerRole(*context, allowed_);
  }

 private:
  const std::vector<Role> allowed_;
};

}  // namespace

absl::StatusOr<GrpcSecurity> GrpcSecurity::Create(std::optional<TlsOptions> options, Role own_role) {
  GrpcSecurity s;
  if (!options.has_value()) return s;
  absl::StatusOr<std::vector<Role>> roles = CheckTlsFiles(*options);
  if (!roles.ok()) return roles.status();
  if (std::find(roles->begin(), roles->end(), own_role) == roles->end()) {
    return absl::InvalidArgumentError(absl::StrCat("the certificate in ", options->cert_file,
                                                   " does not carry the role ", RoleName(own_role), " (URI SAN ",
                                                   RoleUri(own_role), "): its peers would refuse it"));
  }
  s.options_ = std::move(options);
  return s;
}

std::shared_ptr<grpc::ServerCredentials> GrpcSecurity::InternalServerCredentials(
    std::vector<Role> allowed_peers) const {
  if (!options_.has_value()) return grpc::InsecureServerCredentials();
  grpc::experimental::TlsServerCredentialsOptions o(Provider(*options_));
  o.watch_root_certs();
  o.watch_identity_key_cert_pairs();
  o.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  // The handshake verifies the chain; roles are checked per call by the processor.
  o.set_certificate_verifier(std::make_shared<grpc::experimental::NoOpCertificateVerifier>());
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::experimental::TlsServerCredentials(o);
  creds->SetAuthMetadataProcessor(std::make_shared<RoleProcessor>(std::move(allowed_peers)));
  return creds;
}

std::shared_ptr<grpc::ServerCredentials> GrpcSecurity::PublicServerCredentials() const {
  if (!options_.has_value()) return grpc::InsecureServerCredentials();
  grpc::experimental::TlsServerCredentialsOptions o(Provider(*options_));
  o.watch_root_certs();
  o.watch_identity_key_cert_pairs();
  o.set_cert_request_type(GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  o.set_certificate_verifier(std::make_shared<grpc::experimental::NoOpCertificateVerifier>());
  return grpc::experimental::TlsServerCredentials(o);
}

std::shared_ptr<grpc::ChannelCredentials> GrpcSecurity::InternalChannelCredentials(Role server_role) const {
  if (!options_.has_value()) return grpc::InsecureChannelCredentials();
  grpc::experimental::TlsChannelCredentialsOptions o;
  o.set_certificate_provider(Provider(*options_));
  o.watch_root_certs();
  o.watch_identity_key_cert_pairs();
  o.set_verify_server_certs(true);
  o.set_check_call_host(false);
  o.set_certificate_verifier(grpc::experimental::ExternalCertificateVerifier::Create<RoleVerifier>(server_role));
  return grpc::experimental::TlsCredentials(o);
}

int64_t InternalClientHandshakes() { return g_client_handshakes.load(std::memory_order_relaxed); }

std::vector<Role> PeerRoles(const grpc::AuthContext& auth) {
  std::vector<Role> roles;
  for (const grpc::string_ref& v : auth.FindPropertyValues(GRPC_PEER_URI_PROPERTY_NAME)) {
    if (std::optional<Role> r = RoleFromUri(absl::string_view(v.data(), v.size()))) roles.push_back(*r);
  }
  if (!roles.empty()) return roles;
  for (const grpc::string_ref& v : auth.FindPropertyValues(GRPC_X509_PEM_CERT_PROPERTY_NAME)) {
    return RolesOfCertificatePem(absl::string_view(v.data(), v.size()));
  }
  return roles;
}

grpc::Status CheckPeerRole(const grpc::AuthContext& auth, absl::Span<const Role> allowed) {
  if (!IsTls(auth)) return grpc::Status::OK;
  if (auth.FindPropertyValues(GRPC_X509_PEM_CERT_PROPERTY_NAME).empty()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        absl::StrCat("this call needs a client certificate with the role ", RoleList(allowed)));
  }
  for (Role r : PeerRoles(auth)) {
    if (std::find(allowed.begin(), allowed.end(), r) != allowed.end()) return grpc::Status::OK;
  }
  return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                      absl::StrCat("the caller's certificate does not carry the role ", RoleList(allowed)));
}

grpc::Status CheckPeerRole(const grpc::ServerContextBase& context, std::initializer_list<Role> allowed) {
  std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr) return grpc::Status::OK;
  return CheckPeerRole(*auth, absl::Span<const Role>(allowed.begin(), allowed.size()));
}

absl::Status GrpcServerLimits::Validate() const {
  auto bad = [](const char* flag, absl::Duration d) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, " must be ", d < absl::ZeroDuration() ? ">= 0" : "> 0",
                                                   ", got ", absl::FormatDuration(d)));
  };
  if (keepalive_time <= absl::ZeroDuration()) return bad("grpc_keepalive_time_ms", keepalive_time);
  if (keepalive_timeout <= absl::ZeroDuration()) return bad("grpc_keepalive_timeout_ms", keepalive_timeout);
  if (min_client_ping_interval < absl::ZeroDuration()) {
    return bad("grpc_min_client_ping_interval_ms", min_client_ping_interval);
  }
  if (max_connection_idle < absl::ZeroDuration()) return bad("grpc_max_connection_idle_ms", max_connection_idle);
  if (max_connection_age < absl::ZeroDuration()) return bad("grpc_max_connection_age_ms", max_connection_age);
  if (max_connection_age_grace < absl::ZeroDuration()) {
    return bad("grpc_max_connection_age_grace_ms", max_connection_age_grace);
  }
  return absl::OkStatus();
}

void ApplyServerLimits(const GrpcServerLimits& limits, grpc::ServerBuilder& builder) {
  // Milliseconds as gRPC's int arguments, saturated; 0 = off (the argument is not set).
  auto ms = [](absl::Duration d) {
    return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(d), std::numeric_limits<int>::max()));
  };
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, ms(limits.keepalive_time));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ms(limits.keepalive_timeout));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // A port another socket holds is refused. gRPC binds with SO_REUSEPORT by default, so a second
  // server on a port in use (a coordinator started twice, or its API and control ports given the
  // same number) would start without error and receive a share of the connections: workers
  // registering on an API server get UNIMPLEMENTED, clients reach a stale process.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // The server's own keepalive pings are not limited by data frames (0 = any number).
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             ms(limits.min_client_ping_interval));
  if (limits.max_connection_idle > absl::ZeroDuration()) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, ms(limits.max_connection_idle));
  }
  if (limits.max_connection_age > absl::ZeroDuration()) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, ms(limits.max_connection_age));
    if (limits.max_connection_age_grace > absl::ZeroDuration()) {
      builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS, ms(limits.max_connection_age_grace));
    }
  }
}

}  // namespace shardserve::security

// gRPC credentials of every shardserve server and channel, built the same way in every binary from
// TlsOptions (tls_files.h).
//
// Two kinds of port:
//  - public (the coordinator's Inference and Admin API): server TLS; a client certificate is
//    optional, and verified against the cluster CA when one is presented.
//  - internal (the coordinator's control port, every worker port): mutual TLS, always required
//    when TLS is on. The server accepts only peers whose certificate chains to the cluster CA and
//    carries one of the roles the port allows (checked on every call: PERMISSION_DENIED for a
//    wrong role, UNAUTHENTICATED without a certificate); the client accepts only servers whose
//    certificate chains to the CA and carries the role it expects (the handshake fails otherwise).
//    Host names are not checked on internal links: the role is the identity.
// Certificates and the CA are re-read from their files every TlsOptions::refresh_interval;
// connections made after a change use the new files (existing ones keep theirs).
//
// Without TLS options every method returns the insecure credentials, and CheckPeerRole passes:
// the daemons log loudly when they run like that on a non-loopback address.
//
// Thread-safety: a GrpcSecurity is immutable after construction; all methods may be called from
// any thread.
#ifndef SHARDSERVE_COMMON_SECURITY_GRPC_SECURITY_H_
#define SHARDSERVE_COMMON_SECURITY_GRPC_SECURITY_H_

#include <grpcpp/security/auth_context.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/security/tls_files.h"

namespace grpc {
class ServerContextBase;
}  // namespace grpc

namespace shardserve::security {

class GrpcSecurity {
 public:
  // Plaintext everywhere.
  GrpcSecurity() = default;
  // TLS with these files. Checks them first (CheckTlsFiles) and that the certificate carries
  // `own_role`, so that a process whose peers would reject it fails at start: InvalidArgument
  // naming the file or the missing role. nullopt options: plaintext.
  static absl::StatusOr<GrpcSecurity> Create(std::optional<TlsOptions> options, Role own_role);

  // Without the checks of Create: for tests that need a certificate its own CA file rejects.
  static GrpcSecurity UncheckedForTest(TlsOptions options) {
    GrpcSecurity s;
    s.options_ = std::move(options);
    return s;
  }

  bool tls_enabled() const { return options_.has_value(); }
  const std::optional<TlsOptions>& options() const { return options_; }

  // An internal port whose callers must carry one of `allowed_peers`.
  std::shared_ptr<grpc::ServerCredentials> InternalServerCredentials(std::vector<Role> allowed_peers) const;
  // The public API port.
  std::shared_ptr<grpc::ServerCredentials> PublicServerCredentials() const;
  // A channel to an internal port served by a process with `server_role`; presents this process's
  // certificate.
  std::shared_ptr<grpc::ChannelCredentials> InternalChannelCredentials(Role server_role) const;

 private:
  std::optional<TlsOptions> options_;
};

// TLS handshakes this process has completed as a client of an internal link so far (each one
// verifies the server's role once). Long-lived channels make it stay flat while requests flow:
// the benchmarks and tests read it to show that no request pays for a handshake.
int64_t InternalClientHandshakes();

// The roles of a call's peer: the URI SANs of the certificate it presented (empty for plaintext
// calls and calls without a client certificate).
std::vector<Role> PeerRoles(const grpc::AuthContext& auth);

// OK when the call came in over plaintext (the server runs without TLS), or the peer presented a
// certificate that carries one of `allowed`. UNAUTHENTICATED when a TLS call has no client
// certificate; PERMISSION_DENIED naming the roles otherwise.
grpc::Status CheckPeerRole(const grpc::ServerContextBase& context, std::initializer_list<Role> allowed);
grpc::Status CheckPeerRole(const grpc::AuthContext& auth, absl::Span<const Role> allowed);

}  // namespace shardserve::security

#endif  // SHARDSERVE_COMMON_SECURITY_GRPC_SECURITY_H_

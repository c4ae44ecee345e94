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
#include "absl/time/time.h"
#include "common/security/tls_files.h"

namespace grpc {
class ServerBuilder;
}  // namespace grpc

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

// Connection limits of a gRPC server (every shardserve gRPC port), so that dead, idle or abusive
// clients cannot hold its connections forever. Zero turns a limit off. ApplyServerLimits also
// turns SO_REUSEPORT off: a port in use fails the server's start instead of being shared.
struct GrpcServerLimits {
  // The server pings a connection after this long without activity (GRPC_ARG_KEEPALIVE_TIME_MS,
  // also without calls) and closes it when the ping is not answered within keepalive_timeout
  // (GRPC_ARG_KEEPALIVE_TIMEOUT_MS): a peer that vanished without closing is found.
  absl::Duration keepalive_time = absl::Seconds(60);
  absl::Duration keepalive_timeout = absl::Seconds(20);
  // Clients may ping at most this often without data; more often earns a GOAWAY
  // (GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, "too_many_pings").
  absl::Duration min_client_ping_interval = absl::Seconds(10);
  // A connection without calls this long is closed gracefully (GRPC_ARG_MAX_CONNECTION_IDLE_MS);
  // clients reconnect when they next call.
  absl::Duration max_connection_idle = absl::Minutes(5);
  // A connection older than this is told to go away (GRPC_ARG_MAX_CONNECTION_AGE_MS) and its calls
  // are cancelled after max_connection_age_grace (GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS). Off by
  // default: stage streams and long generations live on one connection.
  absl::Duration max_connection_age = absl::ZeroDuration();
  absl::Duration max_connection_age_grace = absl::ZeroDuration();

  // InvalidArgument naming the flag (--grpc_...) when a value is negative, or a keepalive time is 0.
  absl::Status Validate() const;
};

// Sets `limits` (valid) as channel arguments of the server `builder` builds.
void ApplyServerLimits(const GrpcServerLimits& limits, grpc::ServerBuilder& builder);

}  // namespace shardserve::security

#endif  // SHARDSERVE_COMMON_SECURITY_GRPC_SECURITY_H_

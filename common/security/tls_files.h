// TLS configuration of every shardserve process, and the certificate facts the rest of the code
// needs (roles), without any gRPC type.
//
// Every binary takes the same flags: --tls_cert, --tls_key and --tls_ca (PEM files), or one
// --tls_dir holding tls.crt, tls.key and ca.crt (the layout of a Kubernetes TLS Secret with its CA).
// All of them unset means plaintext; any other partial combination is an error, never a silent
// fallback to plaintext.
//
// Roles: a certificate carries the roles of its holder as URI subject alternative names
// "spiffe://shardserve/<role>" (RoleUri). Internal links check them: a worker's certificate must
// carry `worker`, the coordinator's `coordinator`; a client certificate (`client`, or none) can
// never register as a worker or open a stage stream.
//
// Thread-safety: free functions, no shared state.
#ifndef SHARDSERVE_COMMON_SECURITY_TLS_FILES_H_
#define SHARDSERVE_COMMON_SECURITY_TLS_FILES_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace shardserve::security {

enum class Role { kCoordinator, kWorker, kClient, kAdmin };

// "coordinator", "worker", "client", "admin".
absl::string_view RoleName(Role role);
// "spiffe://shardserve/<name>": the URI SAN that marks a certificate with `role`.
std::string RoleUri(Role role);
// The role a URI SAN names, or nullopt for any other URI.
std::optional<Role> RoleFromUri(absl::string_view uri);

// Where a process finds its certificate, key and cluster CA. The files are re-read every
// refresh_interval (certificate rotation without a restart: new connections use the new files).
struct TlsOptions {
  std::string cert_file;  // PEM certificate chain, leaf first
  std::string key_file;   // PEM private key of the leaf
  std::string ca_file;    // PEM CA certificate(s) peers must chain to
  absl::Duration refresh_interval = absl::Seconds(10);
};

// The TLS settings given by the four flags. nullopt when none is set (plaintext). InvalidArgument,
// naming the flags, when TLS is half-configured: only some of --tls_cert/--tls_key/--tls_ca, or
// --tls_dir together with any of them.
absl::StatusOr<std::optional<TlsOptions>> TlsOptionsFromFlags(const std::string& cert, const std::string& key,
                                                              const std::string& ca, const std::string& dir);

// Reads and checks the files of `options`: each parses as PEM, the key belongs to the leaf
// certificate, and the leaf chains to the CA and is within its validity period. Returns the roles
// the leaf carries. InvalidArgument naming the file and the problem otherwise (NotFound for a
// missing file).
absl::StatusOr<std::vector<Role>> CheckTlsFiles(const TlsOptions& options);

// The roles named by the URI SANs of the first certificate of `pem` (empty when it has none or
// does not parse).
std::vector<Role> RolesOfCertificatePem(absl::string_view pem);

// True for addresses only this machine can reach: 127.0.0.0/8, ::1 and "localhost" (HOST:PORT,
// or [HOST]:PORT). A daemon serving plaintext on any other address logs a loud warning.
bool IsLoopbackAddress(absl::string_view host_port);

}  // namespace shardserve::security

#endif  // SHARDSERVE_COMMON_SECURITY_TLS_FILES_H_

// A throw-away certificate authority: shardserve-local makes one at start (and the tests make
// their own) to run every link with mutual TLS without asking anyone for certificates. Keys are
// ECDSA P-256; certificates are X.509 v3 with the roles as URI SANs (tls_files.h).
//
// Thread-safety: a CertificateAuthority is immutable after Create; Issue may be called from any
// thread.
#ifndef SHARDSERVE_COMMON_SECURITY_CERT_AUTHORITY_H_
#define SHARDSERVE_COMMON_SECURITY_CERT_AUTHORITY_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/security/tls_files.h"

namespace shardserve::security {

// A certificate and its private key, PEM.
struct CertificateAndKey {
  std::string cert_pem;
  std::string key_pem;
};

struct CertificateRequest {
  std::string common_name;
  std::vector<Role> roles;                // URI SANs spiffe://shardserve/<role>
  std::vector<std::string> dns_names;     // DNS SANs (for clients that check host names)
  std::vector<std::string> ip_addresses;  // IP SANs, e.g. "127.0.0.1"
  absl::Duration validity = absl::Hours(24);
};

class CertificateAuthority {
 public:
  // A new self-signed CA with a fresh key. Internal on an OpenSSL failure.
  static absl::StatusOr<std::unique_ptr<CertificateAuthority>> Create(const std::string& common_name,
                                                                      absl::Duration validity = absl::Hours(24));
  ~CertificateAuthority();
  CertificateAuthority(const CertificateAuthority&) = delete;
  CertificateAuthority& operator=(const CertificateAuthority&) = delete;

  // The CA's certificate, PEM (what peers put in ca.crt).
  const std::string& cert_pem() const { return cert_pem_; }
  // A leaf certificate signed by this CA, usable for both server and client authentication.
  // InvalidArgument for a malformed IP address; Internal on an OpenSSL failure.
  absl::StatusOr<CertificateAndKey> Issue(const CertificateRequest& request) const;

 private:
  struct Impl;
  explicit CertificateAuthority(std::unique_ptr<Impl> impl, std::string cert_pem);
  std::unique_ptr<Impl> impl_;
  std::string cert_pem_;
};

// Writes `leaf` and `ca_pem` as DIR/tls.crt, DIR/tls.key (mode 0600) and DIR/ca.crt, creating
// DIR; each file is replaced atomically (written beside it, then renamed), so that a process
// watching the files never reads half of one. Internal on an I/O error.
absl::Status WriteTlsDir(const std::string& dir, const CertificateAndKey& leaf, const std::string& ca_pem);

}  // namespace shardserve::security

#endif  // SHARDSERVE_COMMON_SECURITY_CERT_AUTHORITY_H_

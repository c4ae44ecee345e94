// Certificates made by a test itself: a throw-away CA (OpenSSL, common/security/cert_authority.h)
// and TLS directories (tls.crt, tls.key, ca.crt) for any role, under a TempDir.
#ifndef SHARDSERVE_TESTS_TESTING_TLS_FIXTURE_H_
#define SHARDSERVE_TESTS_TESTING_TLS_FIXTURE_H_

#include <memory>
#include <string>
#include <vector>

#include "common/security/cert_authority.h"
#include "common/security/grpc_security.h"
#include "tests/testing/temp_dir.h"

namespace shardserve::testing {

class TestCa {
 public:
  // CHECK-fails when OpenSSL cannot make the CA (a broken test environment).
  explicit TestCa(const std::string& name);

  const std::string& cert_pem() const { return ca_->cert_pem(); }
  // Writes DIR/<name>/{tls.crt,tls.key,ca.crt}: a certificate from this CA carrying `roles` (and
  // DNS localhost / IP 127.0.0.1), with `trusted_ca_pem` as ca.crt (default: this CA). Returns
  // the options (refresh every second) pointing at them.
  security::TlsOptions Dir(const std::string& name, std::vector<security::Role> roles,
                           const std::string& trusted_ca_pem = "") const;
  // The same directory's security, checked like a daemon's (own role = roles.front()).
  security::GrpcSecurity Security(const std::string& name, std::vector<security::Role> roles) const;
  const std::string& root() const { return dir_.path(); }

 private:
  TempDir dir_;
  std::unique_ptr<security::CertificateAuthority> ca_;
};

}  // namespace shardserve::testing

#endif  // SHARDSERVE_TESTS_TESTING_TLS_FIXTURE_H_

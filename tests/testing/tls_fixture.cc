#include "tests/testing/tls_fixture.h"

#include "common/log/log.h"

namespace shardserve::testing {

TestCa::TestCa(const std::string& name) {
  auto ca = security::CertificateAuthority::Create(name);
  CHECK(ca.ok()) << ca.status();
  ca_ = *std::move(ca);
}

security::TlsOptions TestCa::Dir(const std::string& name, std::vector<security::Role> roles,
                                 const std::string& trusted_ca_pem) const {
  auto leaf = ca_->Issue({.common_name = name, .roles = std::move(roles), .dns_names = {"localhost"},
                          .ip_addresses = {"127.0.0.1"}});
  CHECK(leaf.ok()) << leaf.status();
  const std::string dir = dir_.path() + "/" + name;
  absl::Status st = security::WriteTlsDir(dir, *leaf, trusted_ca_pem.empty() ? ca_->cert_pem() : trusted_ca_pem);
  CHECK(st.ok()) << st;
  return {.cert_file = dir + "/tls.crt",
          .key_file = dir + "/tls.key",
          .ca_file = dir + "/ca.crt",
          .refresh_interval = absl::Seconds(1)};
}

security::GrpcSecurity TestCa::Security(const std::string& name, std::vector<security::Role> roles) const {
  const security::Role own = roles.front();
  auto s = security::GrpcSecurity::Create(Dir(name, std::move(roles)), own);
  CHECK(s.ok()) << s.status();
  return *std::move(s);
}

}  // namespace shardserve::testing

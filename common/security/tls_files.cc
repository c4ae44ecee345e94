#include "common/security/tls_files.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <fstream>
#include <memory>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace shardserve::security {
namespace {

constexpr absl::string_view kRolePrefix = "spiffe://shardserve/";

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
struct StoreFree {
  void operator()(X509_STORE* s) const { X509_STORE_free(s); }
};
struct StoreCtxFree {
  void operator()(X509_STORE_CTX* s) const { X509_STORE_CTX_free(s); }
};
struct StackFree {
  void operator()(STACK_OF(X509) * s) const { sk_X509_pop_free(s, X509_free); }
};
using X509Ptr = std::unique_ptr<X509, X509Free>;

absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(what, ": cannot read ", path));
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::unique_ptr<BIO, BioFree> MemBio(absl::string_view data) {
  return std::unique_ptr<BIO, BioFree>(BIO_new_mem_buf(data.data(), static_cast<int>(data.size())));
}

// Every certificate of a PEM bundle, in order.
std::vector<X509Ptr> ReadCertificates(absl::string_view pem) {
  std::vector<X509Ptr> out;
  auto bio = MemBio(pem);
  while (bio != nullptr) {
    X509* x = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr);
    if (x == nullptr) break;
    out.emplace_back(x);
  }
  ERR_clear_error();  // the end of the bundle reads as an error
  return out;
}

std::vector<Role> RolesOf(X509* cert) {
  std::vector<Role> roles;
  auto* names = static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(cert, NID_subject_alt_name, nullptr, nullptr));
  if (names == nullptr) return roles;
  for (int i = 0; i < sk_GENERAL_NAME_num(names); ++i) {
    const GENERAL_NAME* n = sk_GENERAL_NAME_value(names, i);
    if (n->type != GEN_URI) continue;
    const ASN1_IA5STRING* s = n->d.uniformResourceIdentifier;
    absl::string_view uri(reinterpret_cast<const char*>(ASN1_STRING_get0_data(s)),
                          static_cast<size_t>(ASN1_STRING_length(s)));
    if (std::optional<Role> r = RoleFromUri(uri)) roles.push_back(*r);
  }
  GENERAL_NAMES_free(names);
  return roles;
}

}  // namespace

absl::string_view RoleName(Role role) {
  switch (role) {
    case Role::kCoordinator:
      return "coordinator";
    case Role::kWorker:
      return "worker";
    case Role::kClient:
      return "client";
    case Role::kAdmin:
      return "admin";
  }
  return "unknown";
}

std::string RoleUri(Role role) { return absl::StrCat(kRolePrefix, RoleName(role)); }

std::optional<Role> RoleFromUri(absl::string_view uri) {
  if (!absl::ConsumePrefix(&uri, kRolePrefix)) return std::nullopt;
  for (Role r : {Role::kCoordinator, Role::kWorker, Role::kClient, Role::kAdmin}) {
    if (uri == RoleName(r)) return r;
  }
  return std::nullopt;
}

absl::StatusOr<std::optional<TlsOptions>> TlsOptionsFromFlags(const std::string& cert, const std::string& key,
                                                              const std::string& ca, const std::string& dir) {
  const int files = !cert.empty() + !key.empty() + !ca.empty();
  if (!dir.empty()) {
    if (files > 0) {
      return absl::InvalidArgumentError("give either --tls_dir or --tls_cert/--tls_key/--tls_ca, not both");
    }
    std::string d = dir;
    while (d.size() > 1 && d.back() == '/') d.pop_back();
    return std::optional<TlsOptions>(
        TlsOptions{.cert_file = d + "/tls.crt", .key_file = d + "/tls.key", .ca_file = d + "/ca.crt"});
  }
  if (files == 0) return std::optional<TlsOptions>();
  if (files < 3) {
    std::string missing;
    for (auto [flag, value] : {std::pair{"--tls_cert", &cert}, {"--tls_key", &key}, {"--tls_ca", &ca}}) {
      if (value->empty()) absl::StrAppend(&missing, missing.empty() ? "" : ", ", flag);
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "TLS is half-configured: --tls_cert, --tls_key and --tls_ca go together (missing: ", missing,
        "); refusing to start rather than fall back to plaintext"));
  }
  return std::optional<TlsOptions>(TlsOptions{.cert_file = cert, .key_file = key, .ca_file = ca});
}

absl::StatusOr<std::vector<Role>> CheckTlsFiles(const TlsOptions& options) {
  absl::StatusOr<std::string> cert_pem = ReadFile(options.cert_file, "--tls_cert");
  if (!cert_pem.ok()) return cert_pem.status();
  absl::StatusOr<std::string> key_pem = ReadFile(options.key_file, "--tls_key");
  if (!key_pem.ok()) return key_pem.status();
  absl::StatusOr<std::string> ca_pem = ReadFile(options.ca_file, "--tls_ca");
  if (!ca_pem.ok()) return ca_pem.status();
  std::vector<X509Ptr> chain = ReadCertificates(*cert_pem);
  if (chain.empty()) return absl::InvalidArgumentError(absl::StrCat(options.cert_file, " holds no PEM certificate"));
  std::vector<X509Ptr> cas = ReadCertificates(*ca_pem);
  if (cas.empty()) return absl::InvalidArgumentError(absl::StrCat(options.ca_file, " holds no PEM certificate"));
  auto key_bio = MemBio(*key_pem);
  std::unique_ptr<EVP_PKEY, PkeyFree> key(PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
  ERR_clear_error();
  if (key == nullptr) return absl::InvalidArgumentError(absl::StrCat(options.key_file, " holds no PEM private key"));
  if (X509_check_private_key(chain.front().get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat(options.key_file, " is not the private key of the certificate in ", options.cert_file));
  }
  std::unique_ptr<X509_STORE, StoreFree> store(X509_STORE_new());
  for (const X509Ptr& c : cas) X509_STORE_add_cert(store.get(), c.get());
  std::unique_ptr<STACK_OF(X509), StackFree> untrusted(sk_X509_new_null());
  for (size_t i = 1; i < chain.size(); ++i) {
    X509_up_ref(chain[i].get());
    sk_X509_push(untrusted.get(), chain[i].get());
  }
  std::unique_ptr<X509_STORE_CTX, StoreCtxFree> ctx(X509_STORE_CTX_new());
  X509_STORE_CTX_init(ctx.get(), store.get(), chain.front().get(), untrusted.get());
  if (X509_verify_cert(ctx.get()) != 1) {
    const int err = X509_STORE_CTX_get_error(ctx.get());
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat("the certificate in ", options.cert_file,
                                                   " does not verify against the CA in ", options.ca_file, ": ",
                                                   X509_verify_cert_error_string(err)));
  }
  return RolesOf(chain.front().get());
}

std::vector<Role> RolesOfCertificatePem(absl::string_view pem) {
  std::vector<X509Ptr> certs = ReadCertificates(pem);
  if (certs.empty()) return {};
  return RolesOf(certs.front().get());
}

bool IsLoopbackAddress(absl::string_view host_port) {
  absl::string_view host = host_port;
  if (absl::StartsWith(host, "[")) {
    const size_t close = host.find(']');
    host = host.substr(1, close == absl::string_view::npos ? absl::string_view::npos : close - 1);
  } else if (const size_t colon = host.rfind(':'); colon != absl::string_view::npos) {
    host = host.substr(0, colon);
  }
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

}  // namespace shardserve::security

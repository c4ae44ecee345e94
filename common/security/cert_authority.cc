#include "common/security/cert_authority.h"

#include <openssl/bio.h>
#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardserve::security {
namespace {

struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using X509Ptr = std::unique_ptr<X509, X509Free>;
using PkeyPtr = std::unique_ptr<EVP_PKEY, PkeyFree>;

absl::Status OpenSslError(absl::string_view what) {
  const unsigned long e = ERR_get_error();
  char buf[256] = {};
  ERR_error_string_n(e, buf, sizeof(buf));
  ERR_clear_error();
  return absl::InternalError(absl::StrCat(what, ": ", buf));
}

PkeyPtr NewKey() { return PkeyPtr(EVP_EC_gen("P-256")); }

// Adds one extension given in OpenSSL's config syntax ("critical,CA:TRUE").
bool AddExtension(X509* cert, X509* issuer, int nid, const std::string& value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str());
  if (ext == nullptr) return false;
  const bool ok = X509_add_ext(cert, ext, -1) == 1;
  X509_EXTENSION_free(ext);
  return ok;
}

// A certificate for `key`'s public half with a random serial and `cn` as subject, not yet signed.
X509Ptr NewCertificate(EVP_PKEY* key, const std::string& cn, absl::Duration validity) {
  X509Ptr cert(X509_new());
  X509_set_version(cert.get(), 2);
  unsigned char serial[16];
  RAND_bytes(serial, sizeof(serial));
  serial[0] &= 0x7f;  // positive
  BIGNUM* bn = BN_bin2bn(serial, sizeof(serial), nullptr);
  BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(cert.get()));
  BN_free(bn);
  X509_gmtime_adj(X509_getm_notBefore(cert.get()), -3600);  // tolerate clock skew between processes
  X509_gmtime_adj(X509_getm_notAfter(cert.get()), static_cast<long>(absl::ToInt64Seconds(validity)));
  X509_set_pubkey(cert.get(), key);
  X509_NAME* name = X509_get_subject_name(cert.get());
  X509_NAME_add_entry_by_txt(name, "O", MBSTRING_ASC, reinterpret_cast<const unsigned char*>("shardserve"), -1, -1, 0);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, reinterpret_cast<const unsigned char*>(cn.c_str()), -1, -1, 0);
  return cert;
}

absl::StatusOr<std::string> CertPem(X509* cert) {
  BIO* bio = BIO_new(BIO_s_mem());
  if (PEM_write_bio_X509(bio, cert) != 1) {
    BIO_free(bio);
    return OpenSslError("PEM_write_bio_X509");
  }
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  std::string out(data, static_cast<size_t>(n));
  BIO_free(bio);
  return out;
}

absl::StatusOr<std::string> KeyPem(EVP_PKEY* key) {
  BIO* bio = BIO_new(BIO_s_mem());
  if (PEM_write_bio_PrivateKey(bio, key, nullptr, nullptr, 0, nullptr, nullptr) != 1) {
    BIO_free(bio);
    return OpenSslError("PEM_write_bio_PrivateKey");
  }
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  std::string out(data, static_cast<size_t>(n));
  BIO_free(bio);
  return out;
}

absl::Status WriteAtomically(const std::string& path, const std::string& data, mode_t mode) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", tmp));
    out << data;
    if (!out.flush()) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  }
  if (chmod(tmp.c_str(), mode) != 0) return absl::InternalError(absl::StrCat("cannot chmod ", tmp));
  if (std::rename(tmp.c_str(), path.c_str()) != 0) return absl::InternalError(absl::StrCat("cannot rename ", tmp));
  return absl::OkStatus();
}

}  // namespace

struct CertificateAuthority::Impl {
  PkeyPtr key;
  X509Ptr cert;
};

CertificateAuthority::CertificateAuthority(std::unique_ptr<Impl> impl, std::string cert_pem)
    : impl_(std::move(impl)), cert_pem_(std::move(cert_pem)) {}
CertificateAuthority::~CertificateAuthority() = default;

absl::StatusOr<std::unique_ptr<CertificateAuthority>> CertificateAuthority::Create(const std::string& common_name,
                                                                                   absl::Duration validity) {
  auto impl = std::make_unique<Impl>();
  impl->key = NewKey();
  if (impl->key == nullptr) return OpenSslError("EVP_EC_gen");
  impl->cert = NewCertificate(impl->key.get(), common_name, validity);
  X509* c = impl->cert.get();
  X509_set_issuer_name(c, X509_get_subject_name(c));
  if (!AddExtension(c, c, NID_basic_constraints, "critical,CA:TRUE") ||
      !AddExtension(c, c, NID_key_usage, "critical,keyCertSign,cRLSign") ||
      !AddExtension(c, c, NID_subject_key_identifier, "hash")) {
    return OpenSslError("CA extensions");
  }
  if (X509_sign(c, impl->key.get(), EVP_sha256()) == 0) return OpenSslError("X509_sign");
  absl::StatusOr<std::string> pem = CertPem(c);
  if (!pem.ok()) return pem.status();
  return std::unique_ptr<CertificateAuthority>(new CertificateAuthority(std::move(impl), *std::move(pem)));
}

absl::StatusOr<CertificateAndKey> CertificateAuthority::Issue(const CertificateRequest& request) const {
  PkeyPtr key = NewKey();
  if (key == nullptr) return OpenSslError("EVP_EC_gen");
  X509Ptr cert = NewCertificate(key.get(), request.common_name, request.validity);
  X509_set_issuer_name(cert.get(), X509_get_subject_name(impl_->cert.get()));
  std::vector<std::string> sans;
  for (Role r : request.roles) sans.push_back("URI:" + RoleUri(r));
  for (const std::string& d : request.dns_names) sans.push_back("DNS:" + d);
  for (const std::string& ip : request.ip_addresses) sans.push_back("IP:" + ip);
  X509* c = cert.get();
  if (!AddExtension(c, impl_->cert.get(), NID_basic_constraints, "critical,CA:FALSE") ||
      !AddExtension(c, impl_->cert.get(), NID_key_usage, "critical,digitalSignature,keyEncipherment") ||
      !AddExtension(c, impl_->cert.get(), NID_ext_key_usage, "serverAuth,clientAuth") ||
      !AddExtension(c, impl_->cert.get(), NID_authority_key_identifier, "keyid:always")) {
    return OpenSslError("certificate extensions");
  }
  if (!sans.empty() && !AddExtension(c, impl_->cert.get(), NID_subject_alt_name, absl::StrJoin(sans, ","))) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat("bad subject alternative names: ", absl::StrJoin(sans, ",")));
  }
  if (X509_sign(c, impl_->key.get(), EVP_sha256()) == 0) return OpenSslError("X509_sign");
  CertificateAndKey out;
  absl::StatusOr<std::string> cert_pem = CertPem(c);
  if (!cert_pem.ok()) return cert_pem.status();
  absl::StatusOr<std::string> key_pem = KeyPem(key.get());
  if (!key_pem.ok()) return key_pem.status();
  out.cert_pem = *std::move(cert_pem);
  out.key_pem = *std::move(key_pem);
  return out;
}

absl::Status WriteTlsDir(const std::string& dir, const CertificateAndKey& leaf, const std::string& ca_pem) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  if (absl::Status st = WriteAtomically(dir + "/ca.crt", ca_pem, 0644); !st.ok()) return st;
  if (absl::Status st = WriteAtomically(dir + "/tls.key", leaf.key_pem, 0600); !st.ok()) return st;
  return WriteAtomically(dir + "/tls.crt", leaf.cert_pem, 0644);
}

}  // namespace shardserve::security

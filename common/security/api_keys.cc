#include "common/security/api_keys.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace shardserve::security {
namespace {

std::array<unsigned char, 32> Sha256(absl::string_view data) {
  std::array<unsigned char, 32> out{};
  unsigned int n = 0;
  EVP_Digest(data.data(), data.size(), out.data(), &n, EVP_sha256(), nullptr);
  return out;
}

bool ParseHex(absl::string_view hex, std::array<unsigned char, 32>* out) {
  if (hex.size() != 64) return false;
  for (size_t i = 0; i < 32; ++i) {
    int v = 0;
    for (int j = 0; j < 2; ++j) {
      const char c = absl::ascii_tolower(hex[2 * i + j]);
      const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      if (d < 0) return false;
      v = v * 16 + d;
    }
    (*out)[i] = static_cast<unsigned char>(v);
  }
  return true;
}

}  // namespace

std::string Sha256Hex(absl::string_view key) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char b : Sha256(key)) {
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 15]);
  }
  return out;
}

ApiKeys::Lease::~Lease() { keys_->Release(index_); }

ApiKeys::ApiKeys(std::vector<Entry> entries, const Clock* clock)
    : entries_(std::move(entries)), clock_(clock != nullptr ? clock : RealClock::Get()) {
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  for (const Entry& e : entries_) state_.push_back({.tokens = e.burst, .refilled = now});
}

absl::StatusOr<std::unique_ptr<ApiKeys>> ApiKeys::Parse(absl::string_view text, const Clock* clock) {
  std::vector<Entry> entries;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    if (const size_t hash = line.find('#'); hash != absl::string_view::npos) line = line.substr(0, hash);
    std::vector<absl::string_view> f = absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (f.empty()) continue;
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat("--api_keys_file line ", line_no, ": ", why));
    };
    if (f.size() < 3) return bad("want NAME ROLE sha256:HEX [rps=R] [burst=B] [concurrency=C]");
    Entry e;
    e.name = std::string(f[0]);
    if (f[1] == "user") {
      e.role = ApiRole::kUser;
    } else if (f[1] == "admin") {
      e.role = ApiRole::kAdmin;
    } else {
      return bad(absl::StrCat("role must be user or admin, got \"", f[1], "\""));
    }
    absl::string_view hex = f[2];
    if (!absl::ConsumePrefix(&hex, "sha256:") || !ParseHex(hex, &e.hash)) {
      return bad("the key must be given as sha256:<64 hex digits> (printf %s KEY | sha256sum)");
    }
    bool burst_set = false;
    for (size_t i = 3; i < f.size(); ++i) {
      std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(f[i], absl::MaxSplits('=', 1));
      double v = 0;
      if (!absl::SimpleAtod(kv.second, &v) || !(v >= 0) || v > 1e9) {
        return bad(absl::StrCat("bad limit \"", f[i], "\" (a number >= 0)"));
      }
      if (kv.first == "rps") {
        e.rps = v;
      } else if (kv.first == "burst") {
        e.burst = v;
        burst_set = true;
      } else if (kv.first == "concurrency") {
        e.concurrency = static_cast<int64_t>(v);
      } else {
        return bad(absl::StrCat("unknown limit \"", kv.first, "\" (rps, burst, concurrency)"));
      }
    }
    if (!burst_set) e.burst = std::max(1.0, e.rps);
    if (e.rps > 0 && e.burst < 1) return bad("burst must be >= 1");
    for (const Entry& other : entries) {
      if (other.name == e.name) return bad(absl::StrCat("duplicate name ", e.name));
      if (other.hash == e.hash) return bad(absl::StrCat("the same key as ", other.name));
    }
    entries.push_back(std::move(e));
  }
  if (entries.empty()) return absl::InvalidArgumentError("--api_keys_file holds no key");
  return std::unique_ptr<ApiKeys>(new ApiKeys(std::move(entries), clock));
}

absl::StatusOr<std::unique_ptr<ApiKeys>> ApiKeys::Load(const std::string& path, const Clock* clock) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("--api_keys_file: cannot read ", path));
  std::stringstream s;
  s << in.rdbuf();
  return Parse(s.str(), clock);
}

absl::StatusOr<std::shared_ptr<ApiKeys::Lease>> ApiKeys::Admit(absl::string_view authorization, ApiRole role) {
  absl::string_view token = absl::StripAsciiWhitespace(authorization);
  if (token.empty()) {
    return absl::UnauthenticatedError("missing API key: send \"authorization: Bearer KEY\"");
  }
  if (!absl::ConsumePrefix(&token, "Bearer ") && !absl::ConsumePrefix(&token, "bearer ")) {
    return absl::UnauthenticatedError("malformed authorization: want \"Bearer KEY\"");
  }
  token = absl::StripAsciiWhitespace(token);
  const std::array<unsigned char, 32> presented = Sha256(token);
  // Every stored hash is compared, in constant time, whatever matches.
  size_t found = entries_.size();
  for (size_t i = 0; i < entries_.size(); ++i) {
    const bool eq = CRYPTO_memcmp(presented.data(), entries_[i].hash.data(), presented.size()) == 0;
    if (eq) found = i;
  }
  if (found == entries_.size()) return absl::UnauthenticatedError("invalid API key");
  const Entry& e = entries_[found];
  if (role == ApiRole::kAdmin && e.role != ApiRole::kAdmin) {
    return absl::PermissionDeniedError(absl::StrCat("API key ", e.name, " has the role user; this call needs admin"));
  }
  absl::MutexLock lock(&mu_);
  State& s = state_[found];
  if (e.concurrency > 0 && s.in_flight >= e.concurrency) {
    return absl::ResourceExhaustedError(
        absl::StrCat("API key ", e.name, " has ", s.in_flight, " requests in flight, its limit (concurrency=",
                     e.concurrency, ")"));
  }
  if (e.rps > 0) {
    const absl::Time now = clock_->Now();
    const double elapsed = std::max(0.0, absl::ToDoubleSeconds(now - s.refilled));
    s.tokens = std::min(e.burst, s.tokens + elapsed * e.rps);
    s.refilled = now;
    if (s.tokens < 1) {
      return absl::ResourceExhaustedError(
          absl::StrCat("API key ", e.name, " is over its request rate (rps=", e.rps, ", burst=", e.burst, ")"));
    }
    s.tokens -= 1;
  }
  ++s.in_flight;
  return std::shared_ptr<Lease>(new Lease(this, found, e.name));
}

void ApiKeys::Release(size_t index) {
  absl::MutexLock lock(&mu_);
  --state_[index].in_flight;
}

}  // namespace shardserve::security

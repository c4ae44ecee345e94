// API keys of the public API (gRPC and HTTP), with a role and per-key limits.
//
// The file (--api_keys_file) holds one key per line; '#' starts a comment:
//   NAME ROLE sha256:HEX [rps=R] [burst=B] [concurrency=C]
// NAME names the key in logs and errors (never the key itself); ROLE is `user` or `admin` (admin
// may also do everything a user does); HEX is the SHA-256 of the key (`printf %s KEY | sha256sum`),
// so the file holds no usable secret. rps (requests per second, a token bucket of `burst`
// requests, default burst = max(1, rps)) and concurrency (requests in flight) are optional; absent
// or 0 = unlimited.
//
// Callers send the key as "authorization: Bearer KEY" (gRPC metadata) or "Authorization: Bearer
// KEY" (HTTP). The presented key is hashed and compared with every stored hash in constant time.
//
// Thread-safety: all methods are thread-safe.
#ifndef SHARDSERVE_COMMON_SECURITY_API_KEYS_H_
#define SHARDSERVE_COMMON_SECURITY_API_KEYS_H_

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/concurrency/clock.h"

namespace shardserve::security {

enum class ApiRole { kUser, kAdmin };

// The hex SHA-256 of `key` (what the file stores after "sha256:").
std::string Sha256Hex(absl::string_view key);

class ApiKeys {
 public:
  // Held while a request runs: releases its concurrency slot when destroyed (on any thread).
  class Lease {
   public:
    ~Lease();
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    const std::string& key_name() const { return name_; }

   private:
    friend class ApiKeys;
    Lease(ApiKeys* keys, size_t index, std::string name) : keys_(keys), index_(index), name_(std::move(name)) {}
    ApiKeys* const keys_;
    const size_t index_;
    const std::string name_;
  };

  // Parses a keys file's contents. InvalidArgument naming the line for a malformed one (unknown
  // role, a hash that is not 64 hex digits, a bad limit, a duplicate name or hash) or for a file
  // without keys. `clock` is borrowed and must outlive the object (null = the real clock).
  static absl::StatusOr<std::unique_ptr<ApiKeys>> Parse(absl::string_view text, const Clock* clock = nullptr);
  // Reads and parses `path`; NotFound when it cannot be read.
  static absl::StatusOr<std::unique_ptr<ApiKeys>> Load(const std::string& path, const Clock* clock = nullptr);

  // Checks the `authorization` value ("Bearer KEY") of a request that needs `role`, and admits it
  // under its key's limits. UNAUTHENTICATED when missing, malformed or unknown; PERMISSION_DENIED
  // when the key's role is `user` and `role` is admin; RESOURCE_EXHAUSTED naming the limit when
  // the key is over its request rate or concurrency. The lease must outlive the request and not
  // this object.
  absl::StatusOr<std::shared_ptr<Lease>> Admit(absl::string_view authorization, ApiRole role);

  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    std::string name;
    ApiRole role = ApiRole::kUser;
    std::array<unsigned char, 32> hash{};
    double rps = 0;  // 0 = unlimited
    double burst = 0;
    int64_t concurrency = 0;  // 0 = unlimited
  };
  struct State {
    double tokens = 0;
    absl::Time refilled;
    int64_t in_flight = 0;
  };
  ApiKeys(std::vector<Entry> entries, const Clock* clock);
  void Release(size_t index);

  const std::vector<Entry> entries_;  // constant after construction
  const Clock* const clock_;
  absl::Mutex mu_;
  std::vector<State> state_ ABSL_GUARDED_BY(mu_);  // one per entry
};

}  // namespace shardserve::security

#endif  // SHARDSERVE_COMMON_SECURITY_API_KEYS_H_

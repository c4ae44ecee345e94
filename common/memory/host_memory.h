// The host memory this process may use: /proc/meminfo's MemTotal and MemAvailable, each capped by
// the memory limit of the process's cgroup (a container's, a systemd unit's). A worker in a
// Kubernetes pod with a memory limit sees the node's whole memory in /proc/meminfo; offering that
// to the planner would place more than the pod may hold, and the kernel would kill it.
//
// Limits: cgroup v2 memory.max, or v1 memory.limit_in_bytes, the tightest over the process's
// cgroup and its ancestors (a missing or unreadable file is no limit). What the limiting cgroup
// uses counts against it less its inactive page cache, which the kernel reclaims first (kubelet's
// working set): free = min(MemAvailable, limit - (usage - inactive_file)).
#ifndef SHARDSERVE_COMMON_MEMORY_HOST_MEMORY_H_
#define SHARDSERVE_COMMON_MEMORY_HOST_MEMORY_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace shardserve {

struct HostMemory {
  int64_t total_bytes = 0;
  int64_t free_bytes = 0;
  int64_t cgroup_limit_bytes = 0;  // the limit that applied; 0 when none is below MemTotal
};

// Where the figures are read (tests point them at a directory of their own).
struct HostMemoryPaths {
  std::string meminfo = "/proc/meminfo";
  std::string self_cgroup = "/proc/self/cgroup";
  std::string cgroup_root = "/sys/fs/cgroup";
};

// Internal when `paths.meminfo` has no MemTotal; a cgroup file that cannot be read or parsed is
// taken as no limit.
absl::StatusOr<HostMemory> QueryHostMemory(const HostMemoryPaths& paths = {});

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_MEMORY_HOST_MEMORY_H_

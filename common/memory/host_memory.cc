#include "common/memory/host_memory.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace shardserve {
namespace {

namespace fs = std::filesystem;

// The file's first line, trimmed; nullopt when it cannot be read.
std::optional<std::string> FirstLine(const fs::path& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  return std::string(absl::StripAsciiWhitespace(line));
}

std::optional<int64_t> ReadBytes(const fs::path& path) {
  const std::optional<std::string> line = FirstLine(path);
  int64_t v = 0;
  if (!line.has_value() || !absl::SimpleAtoi(*line, &v) || v < 0) return std::nullopt;
  return v;
}

// `key`'s value in a memory.stat file ("key value" lines); 0 when absent.
int64_t StatValue(const fs::path& path, const std::string& key) {
  std::ifstream in(path);
  std::string k;
  int64_t v = 0;
  while (in >> k >> v) {
    if (k == key) return std::max<int64_t>(v, 0);
  }
  return 0;
}

struct Limit {
  int64_t limit = 0;
  int64_t working_set = 0;  // usage less inactive page cache
};

// Walks from the cgroup `rel` (a path under `root`) up to `root` itself and keeps the tightest
// limit. `limit_file` "max" (v2) or a value at or above `no_limit_from` (v1's unlimited) is none.
std::optional<Limit> TightestLimit(const fs::path& root, const std::string& rel, const char* limit_file,
                                   const char* usage_file, const char* inactive_key, int64_t no_limit_from) {
  std::vector<std::string> parts;
  for (absl::string_view p : absl::StrSplit(rel, '/', absl::SkipEmpty())) {
    if (p == "..") return std::nullopt;  // not a cgroup path
    if (p != ".") parts.emplace_back(p);
  }
  std::optional<Limit> best;
  for (size_t depth = parts.size() + 1; depth-- > 0;) {
    fs::path dir = root;
    for (size_t i = 0; i < depth; ++i) dir /= parts[i];
    const std::optional<std::string> text = FirstLine(dir / limit_file);
    int64_t limit = 0;
    if (!text.has_value() || *text == "max" || !absl::SimpleAtoi(*text, &limit) || limit <= 0 ||
        limit >= no_limit_from || (best.has_value() && limit >= best->limit)) {
      continue;
    }
    const int64_t usage = ReadBytes(dir / usage_file).value_or(0);
    const int64_t inactive = StatValue(dir / "memory.stat", inactive_key);
    best = Limit{.limit = limit, .working_set = std::max<int64_t>(usage - inactive, 0)};
  }
  return best;
}

}  // namespace

absl::StatusOr<HostMemory> QueryHostMemory(const HostMemoryPaths& paths) {
  HostMemory m;
  {
    std::ifstream in(paths.meminfo);
    std::string key, unit;
    int64_t kb = 0;
    while (in >> key >> kb) {
      std::getline(in, unit);
      if (key == "MemTotal:") m.total_bytes = kb * 1024;
      if (key == "MemAvailable:") m.free_bytes = kb * 1024;
    }
  }
  if (m.total_bytes <= 0) return absl::InternalError(absl::StrCat("cannot read MemTotal from ", paths.meminfo));
  // "0::/path" is cgroup v2; "N:a,memory,b:/path" a v1 hierarchy with the memory controller.
  std::optional<Limit> limit;
  std::ifstream cgroups(paths.self_cgroup);
  std::string line;
  const fs::path root(paths.cgroup_root);
  while (std::getline(cgroups, line)) {
    std::vector<std::string> parts = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (parts.size() != 3 || parts[2].empty() || parts[2][0] != '/') continue;
    const std::string rel = parts[2].substr(1);
    std::optional<Limit> found;
    if (parts[0] == "0" && parts[1].empty()) {
      found = TightestLimit(root, rel, "memory.max", "memory.current", "inactive_file", m.total_bytes);
    } else {
      const std::vector<absl::string_view> controllers = absl::StrSplit(parts[1], ',');
      if (std::find(controllers.begin(), controllers.end(), "memory") == controllers.end()) continue;
      found = TightestLimit(root / "memory", rel, "memory.limit_in_bytes", "memory.usage_in_bytes",
                            "total_inactive_file", m.total_bytes);
    }
    if (found.has_value() && (!limit.has_value() || found->limit < limit->limit)) limit = found;
  }
  if (limit.has_value()) {
    m.cgroup_limit_bytes = limit->limit;
    m.total_bytes = std::min(m.total_bytes, limit->limit);
    m.free_bytes = std::min(m.free_bytes, std::max<int64_t>(limit->limit - limit->working_set, 0));
  }
  return m;
}

}  // namespace shardserve

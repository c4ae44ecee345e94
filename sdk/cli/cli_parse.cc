#include "sdk/cli/cli_parse.h"

#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace shardserve::cli {

absl::StatusOr<int64_t> ParseBytes(absl::string_view text) {
  const absl::string_view t = absl::StripAsciiWhitespace(text);
  size_t split = 0;
  while (split < t.size() && (absl::ascii_isdigit(static_cast<unsigned char>(t[split])) || t[split] == '.')) ++split;
  double value = 0;
  if (split == 0 || !absl::SimpleAtod(t.substr(0, split), &value) || value < 0) {
    return absl::InvalidArgumentError(absl::StrCat("\"", text, "\" is not a size such as 8GiB or 512MiB"));
  }
  const std::string unit = absl::AsciiStrToLower(t.substr(split));
  double scale = 0;
  if (unit.empty() || unit == "b") scale = 1;
  else if (unit == "kib") scale = 1024.0;
  else if (unit == "mib") scale = 1024.0 * 1024;
  else if (unit == "gib") scale = 1024.0 * 1024 * 1024;
  else if (unit == "tib") scale = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "kb") scale = 1e3;
  else if (unit == "mb") scale = 1e6;
  else if (unit == "gb") scale = 1e9;
  else if (unit == "tb") scale = 1e12;
  else return absl::InvalidArgumentError(absl::StrCat("\"", text, "\": unknown unit \"", unit, "\""));
  const double bytes = value * scale;
  if (bytes > 9e18) return absl::InvalidArgumentError(absl::StrCat("\"", text, "\" is too large"));
  return static_cast<int64_t>(std::llround(bytes));
}

absl::StatusOr<std::vector<WorkerInventory>> ParseWorkers(absl::string_view text) {
  std::vector<WorkerInventory> workers;
  for (absl::string_view entry : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    entry = absl::StripAsciiWhitespace(entry);
    const std::vector<absl::string_view> name_rest = absl::StrSplit(entry, absl::MaxSplits('=', 1));
    const std::string hint = absl::StrCat("worker \"", entry, "\" is not NAME=KIND:COUNTxSIZE (e.g. a=cuda:8x80GiB)");
    if (name_rest.size() != 2 || name_rest[0].empty()) return absl::InvalidArgumentError(hint);
    const std::vector<absl::string_view> kind_rest = absl::StrSplit(name_rest[1], absl::MaxSplits(':', 1));
    if (kind_rest.size() != 2) return absl::InvalidArgumentError(hint);
    DeviceKind kind;
    if (kind_rest[0] == "cpu") kind = DeviceKind::kCpu;
    else if (kind_rest[0] == "cuda") kind = DeviceKind::kCuda;
    else return absl::InvalidArgumentError(absl::StrCat(hint, ": kind must be cpu or cuda"));
    const std::vector<absl::string_view> count_size = absl::StrSplit(kind_rest[1], absl::MaxSplits('x', 1));
    int count = 0;
    if (count_size.size() != 2 || !absl::SimpleAtoi(count_size[0], &count) || count < 1 || count > 1024) {
      return absl::InvalidArgumentError(absl::StrCat(hint, ": COUNT must be in [1, 1024]"));
    }
    auto size = ParseBytes(count_size[1]);
    if (!size.ok()) return absl::InvalidArgumentError(absl::StrCat(hint, ": ", size.status().message()));
    WorkerInventory w;
    w.worker_id = std::string(name_rest[0]);
    w.node_name = w.worker_id;
    for (int d = 0; d < count; ++d) w.devices.push_back({.kind = kind, .index = d, .total_bytes = *size, .free_bytes = *size});
    workers.push_back(std::move(w));
  }
  if (workers.empty()) return absl::InvalidArgumentError("--workers lists no worker");
  return workers;
}

absl::StatusOr<std::vector<int32_t>> ParseIds(absl::string_view text) {
  std::vector<int32_t> ids;
  int index = 0;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    part = absl::StripAsciiWhitespace(part);
    int32_t id = 0;
    if (part.empty() || !absl::SimpleAtoi(part, &id) || id < 0) {
      return absl::InvalidArgumentError(absl::StrCat("--prompt_ids element ", index, " (\"", part,
                                                     "\") is not a non-negative integer"));
    }
    ids.push_back(id);
    ++index;
  }
  return ids;
}

}  // namespace shardserve::cli

#include "sdk/cli/cli_parse.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/flags/parse.h"
#include "nlohmann/json.hpp"

namespace shardserve::cli {

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
    auto size = ParseByteSize(count_size[1]);
    if (!size.ok()) return absl::InvalidArgumentError(absl::StrCat(hint, ": ", size.status().message()));
    absl::string_view name = name_rest[0];
    int repeat = 0;  // 0: one worker named NAME
    if (const size_t star = name.rfind('*'); star != absl::string_view::npos) {
      if (star == 0 || !absl::SimpleAtoi(name.substr(star + 1), &repeat) || repeat < 1 || repeat > 100000) {
        return absl::InvalidArgumentError(absl::StrCat(hint, ": NAME*N needs N in [1, 100000]"));
      }
      name = name.substr(0, star);
    }
    for (int i = 0; i < std::max(repeat, 1); ++i) {
      WorkerInventory w;
      w.worker_id = repeat > 0 ? absl::StrCat(name, "-", i) : std::string(name);
      w.node_name = w.worker_id;
      for (int d = 0; d < count; ++d) {
        w.devices.push_back({.kind = kind, .index = d, .total_bytes = *size, .free_bytes = *size});
      }
      workers.push_back(std::move(w));
    }
  }
  if (workers.empty()) return absl::InvalidArgumentError("--workers lists no worker");
  return workers;
}

absl::StatusOr<std::vector<FaultSpec>> ParseFaults(absl::string_view text) {
  std::vector<FaultSpec> faults;
  for (absl::string_view entry : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    entry = absl::StripAsciiWhitespace(entry);
    const std::vector<absl::string_view> parts = absl::StrSplit(entry, absl::MaxSplits('@', 1));
    FaultSpec f;
    if (parts.size() != 2 || parts[0].empty() || !absl::SimpleAtod(parts[1], &f.at_s) || !(f.at_s >= 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--fail: \"", entry, "\" is not WORKER@SECONDS (e.g. node-3@30)"));
    }
    f.worker = std::string(parts[0]);
    faults.push_back(std::move(f));
  }
  return faults;
}

absl::StatusOr<std::vector<std::string>> ParseTextList(absl::string_view value, absl::string_view flag,
                                                       PlainText plain) {
  std::vector<std::string> out;
  if (value.empty()) return out;
  if (value.front() != '[') {
    if (plain == PlainText::kOne) return std::vector<std::string>{std::string(value)};
    for (absl::string_view entry : absl::StrSplit(value, ',', absl::SkipEmpty())) out.emplace_back(entry);
    return out;
  }
  const nlohmann::json list = nlohmann::json::parse(value.begin(), value.end(), nullptr, /*allow_exceptions=*/false);
  const std::string hint = absl::StrCat(flag, " starts with '[' but is not a JSON list of non-empty strings (e.g. ",
                                        R"(["\n\n", "a, b"]))");
  if (!list.is_array()) return absl::InvalidArgumentError(hint);
  for (const nlohmann::json& e : list) {
    if (!e.is_string() || e.get<std::string>().empty()) return absl::InvalidArgumentError(absl::StrCat(hint, ": ", e.dump()));
    out.push_back(e.get<std::string>());
  }
  return out;
}

}  // namespace shardserve::cli

#include "worker/run/run_options.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace shardserve::run {

absl::StatusOr<std::vector<int32_t>> ParseTokenIds(absl::string_view text) {
  std::vector<int32_t> ids;
  if (absl::StripAsciiWhitespace(text).empty()) return absl::InvalidArgumentError("--prompt_ids is empty");
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

absl::StatusOr<DeviceChoice> ParseDevices(absl::string_view text, int threads) {
  DeviceChoice c;
  if (threads < 1 || threads > 1024) {
    return absl::InvalidArgumentError(absl::StrCat("--threads must be in [1, 1024], got ", threads));
  }
  if (text == "cpu") {
    c.backend.kind = kernels::DeviceKind::kCpu;
    c.backend.cpu_threads = threads;
    return c;
  }
  if (text == "cuda" || absl::StartsWith(text, "cuda:")) {
    c.backend.kind = kernels::DeviceKind::kCuda;
    absl::string_view index = text == "cuda" ? "0" : text.substr(5);
    if (!absl::SimpleAtoi(index, &c.backend.device_index) || c.backend.device_index < 0) {
      return absl::InvalidArgumentError(absl::StrCat("--devices=", text, ": \"", index,
                                                     "\" is not a CUDA device index"));
    }
    return c;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--devices=", text, " is not a device (expected cpu, cuda or cuda:N)"));
}

}  // namespace shardserve::run

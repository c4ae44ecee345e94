#include "common/log/progress.h"

#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

namespace shardserve {
namespace {

std::string Size(double bytes) {
  if (bytes >= 1e9) return absl::StrFormat("%.2f GB", bytes / 1e9);
  if (bytes >= 1e6) return absl::StrFormat("%.1f MB", bytes / 1e6);
  return absl::StrFormat("%.0f kB", bytes / 1e3);
}

std::string Clock(double seconds) {
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return absl::StrFormat("%d:%02d:%02d", s / 3600, (s / 60) % 60, s % 60);
  return absl::StrFormat("%d:%02d", s / 60, s % 60);
}

}  // namespace

Progress::Progress(Options options)
    : options_(std::move(options)),
      tty_(options_.tty >= 0 ? options_.tty != 0 : isatty(fileno(options_.out)) != 0),
      start_(absl::Now()) {}

Progress::~Progress() { Finish(); }

std::string Progress::Line(const Options& o, int64_t done, int64_t bytes, absl::Duration elapsed) {
  const double secs = absl::ToDoubleSeconds(elapsed);
  std::string line = absl::StrCat(o.what, "  ", done);
  if (o.total > 0) absl::StrAppend(&line, "/", o.total);
  absl::StrAppend(&line, " ", o.unit);
  if (o.total > 0) absl::StrAppend(&line, absl::StrFormat("  %3.0f%%", 100.0 * static_cast<double>(done) / static_cast<double>(o.total)));
  if (o.bytes) {
    absl::StrAppend(&line, "  ", Size(static_cast<double>(bytes)));
    if (secs > 0) absl::StrAppend(&line, "  ", Size(static_cast<double>(bytes) / secs), "/s");
  } else if (secs > 0) {
    absl::StrAppend(&line, absl::StrFormat("  %.1f %s/s", static_cast<double>(done) / secs, o.unit));
  }
  if (o.total > 0 && done > 0 && done < o.total) {
    absl::StrAppend(&line, "  ETA ", Clock(secs * static_cast<double>(o.total - done) / static_cast<double>(done)));
  } else if (o.total > 0 && done >= o.total) {
    absl::StrAppend(&line, "  in ", Clock(secs));
  }
  return line;
}

void Progress::Update(int64_t done, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (finished_) return;
  done_ = std::max(done_, done);
  bytes_ = std::max(bytes_, bytes);
  const absl::Time now = absl::Now();
  if (now - last_print_ >= (tty_ ? absl::Milliseconds(100) : options_.plain_interval)) {
    last_print_ = now;
    PrintLocked(/*final=*/false);
  }
}

void Progress::Finish() {
  absl::MutexLock lock(&mu_);
  if (finished_) return;
  finished_ = true;
  // A plain line that already showed the whole (the last Update's) is not printed twice.
  if (!tty_ && options_.total > 0 && printed_done_ >= options_.total) return;
  PrintLocked(/*final=*/true);
}

void Progress::PrintLocked(bool final) {
  const std::string line = Line(options_, done_, bytes_, absl::Now() - start_);
  printed_done_ = done_;
  if (tty_) {
    // Rewrite the line in place: carriage return, the text, clear to the end of the line.
    std::fprintf(options_.out, "\r%s\033[K%s", line.c_str(), final ? "\n" : "");
  } else {
    std::fprintf(options_.out, "%s\n", line.c_str());
  }
  std::fflush(options_.out);
}

}  // namespace shardserve

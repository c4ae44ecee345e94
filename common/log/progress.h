// Progress: how far a long operation has come (loading a model's weights, a benchmark's
// requests), for the person watching. On a terminal, one line rewritten in place at most every
// 100 ms ("loading weights  12/80 layers  15%  1.21 GB  310 MB/s  ETA 0:03"); elsewhere (a log
// file, a pipe, a Kubernetes pod), a plain line at most every `plain_interval`, and one at the
// end, so that logs stay readable.
//
// Thread-safe: Update may be called from several threads.
#ifndef SHARDSERVE_COMMON_LOG_PROGRESS_H_
#define SHARDSERVE_COMMON_LOG_PROGRESS_H_

#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace shardserve {

class Progress {
 public:
  struct Options {
    std::string what;            // "loading weights"
    std::string unit;            // "layers", "requests"
    int64_t total = 0;           // 0 = unknown (no percentage or ETA)
    bool bytes = false;          // Update's `bytes` is shown (size and rate)
    FILE* out = stderr;
    // Whether `out` is a terminal; nullopt-like -1 = ask isatty.
    int tty = -1;
    absl::Duration plain_interval = absl::Seconds(5);
  };
  explicit Progress(Options options);
  // Prints the final line (as Finish) if it was not printed.
  ~Progress();

  // `done` units (and `bytes`, with Options::bytes) so far.
  void Update(int64_t done, int64_t bytes = 0);
  // The final line; later calls do nothing.
  void Finish();

  // The line for `done` of the options' total after `elapsed` (exposed for tests).
  static std::string Line(const Options& options, int64_t done, int64_t bytes, absl::Duration elapsed);

 private:
  void PrintLocked(bool final) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  const bool tty_;
  const absl::Time start_;
  absl::Mutex mu_;
  int64_t done_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_print_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  int64_t printed_done_ ABSL_GUARDED_BY(mu_) = -1;  // `done` of the last line printed
};

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_LOG_PROGRESS_H_

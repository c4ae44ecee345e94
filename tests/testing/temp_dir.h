// A fresh temporary directory, removed with everything in it on destruction.
#ifndef SHARDSERVE_TESTS_TESTING_TEMP_DIR_H_
#define SHARDSERVE_TESTS_TESTING_TEMP_DIR_H_

#include <string>

#include "absl/strings/string_view.h"

namespace shardserve::testing {

class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  // Writes `contents` to path()/name and returns the full path.
  std::string Write(absl::string_view name, absl::string_view contents) const;

 private:
  std::string path_;
};

// Reads a whole file; empty string when it cannot be read.
std::string ReadFileOrEmpty(const std::string& path);

}  // namespace shardserve::testing

#endif  // SHARDSERVE_TESTS_TESTING_TEMP_DIR_H_

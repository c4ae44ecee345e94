#include "worker/run/run_options.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace shardserve::run {
namespace {

using ::shardserve::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(RunOptionsTest, ParsesTokenIds) {
  ASSERT_OK_AND_ASSIGN(auto ids, ParseTokenIds("1, 2,3"));
  EXPECT_THAT(ids, ElementsAre(1, 2, 3));
}

TEST(RunOptionsTest, RejectsBadTokenIds) {
  EXPECT_THAT(ParseTokenIds(""), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty")));
  EXPECT_THAT(ParseTokenIds("1,,2"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("element 1")));
  EXPECT_THAT(ParseTokenIds("1,x"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"x\"")));
  EXPECT_THAT(ParseTokenIds("-4"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("non-negative")));
  EXPECT_THAT(ParseTokenIds("99999999999"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("element 0")));
}

TEST(RunOptionsTest, ParsesDevices) {
  ASSERT_OK_AND_ASSIGN(auto cpu, ParseDevices("cpu", 2));
  EXPECT_EQ(cpu.backend.kind, kernels::DeviceKind::kCpu);
  EXPECT_EQ(cpu.backend.cpu_threads, 2);
  ASSERT_OK_AND_ASSIGN(auto cuda, ParseDevices("cuda:1", 1));
  EXPECT_EQ(cuda.backend.kind, kernels::DeviceKind::kCuda);
  EXPECT_EQ(cuda.backend.device_index, 1);
  EXPECT_THAT(ParseDevices("tpu", 1), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a device")));
  EXPECT_THAT(ParseDevices("cuda:x", 1), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"x\"")));
  EXPECT_THAT(ParseDevices("cpu", 0), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--threads")));
}

}  // namespace
}  // namespace shardserve::run

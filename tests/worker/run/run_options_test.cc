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
  ASSERT_OK_AND_ASSIGN(auto cpu, ParseDevices("cpu", 2, 0));
  EXPECT_EQ(cpu.kind, kernels::DeviceKind::kCpu);
  EXPECT_EQ(cpu.cpu_ranks, 1);
  EXPECT_EQ(cpu.cpu_threads, 2);
  ASSERT_OK_AND_ASSIGN(auto ranks, ParseDevices("cpu:4", 1, 0));
  EXPECT_EQ(ranks.cpu_ranks, 4);
  ASSERT_OK_AND_ASSIGN(auto cuda, ParseDevices("cuda:1,3", 1, 0));
  EXPECT_EQ(cuda.kind, kernels::DeviceKind::kCuda);
  EXPECT_THAT(cuda.cuda_devices, ElementsAre(1, 3));
  ASSERT_OK_AND_ASSIGN(auto all, ParseDevices("cuda:all", 1, 2));
  EXPECT_THAT(all.cuda_devices, ElementsAre(0, 1));
  ASSERT_OK_AND_ASSIGN(auto plain, ParseDevices("cuda", 1, 0));
  EXPECT_THAT(plain.cuda_devices, ElementsAre(0));
}

TEST(RunOptionsTest, RejectsBadDevices) {
  EXPECT_THAT(ParseDevices("tpu", 1, 0), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a device list")));
  EXPECT_THAT(ParseDevices("cuda:x", 1, 0), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"x\"")));
  EXPECT_THAT(ParseDevices("cuda:0,0", 1, 0), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("twice")));
  EXPECT_THAT(ParseDevices("cpu:0", 1, 0), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank count")));
  EXPECT_THAT(ParseDevices("cpu:", 1, 0), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank count")));
  EXPECT_THAT(ParseDevices("cuda:all", 1, 0), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no CUDA")));
  EXPECT_THAT(ParseDevices("cpu", 0, 0), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--threads")));
}

}  // namespace
}  // namespace shardserve::run

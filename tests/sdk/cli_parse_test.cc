#include "sdk/cli/cli_parse.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace shardserve::cli {
namespace {

using ::shardserve::testing::StatusIs;
using ::testing::HasSubstr;

TEST(CliParseTest, WorkersBecomeAnInventory) {
  ASSERT_OK_AND_ASSIGN(auto workers, ParseWorkers("a=cuda:8x80GiB, b=cpu:2x16GiB"));
  ASSERT_EQ(workers.size(), 2u);
  EXPECT_EQ(workers[0].worker_id, "a");
  ASSERT_EQ(workers[0].devices.size(), 8u);
  EXPECT_EQ(workers[0].devices[7].kind, DeviceKind::kCuda);
  EXPECT_EQ(workers[0].devices[7].index, 7);
  EXPECT_EQ(workers[0].devices[0].free_bytes, 80ll << 30);
  EXPECT_EQ(workers[1].devices[1].kind, DeviceKind::kCpu);
}

TEST(CliParseTest, BadWorkersNameTheEntry) {
  EXPECT_THAT(ParseWorkers(""), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no worker")));
  EXPECT_THAT(ParseWorkers("a"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("worker \"a\"")));
  EXPECT_THAT(ParseWorkers("a=tpu:2x1GiB"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cpu or cuda")));
  EXPECT_THAT(ParseWorkers("a=cpu:0x1GiB"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("COUNT")));
  EXPECT_THAT(ParseWorkers("a=cpu:2x1QB"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown unit")));
}

}  // namespace
}  // namespace shardserve::cli

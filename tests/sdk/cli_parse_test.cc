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

TEST(CliParseTest, ARepeatedEntryNamesEachWorker) {
  ASSERT_OK_AND_ASSIGN(auto workers, ParseWorkers("h100*3=cuda:8x80GiB,small=cuda:4x24GiB"));
  ASSERT_EQ(workers.size(), 4u);
  EXPECT_EQ(workers[0].worker_id, "h100-0");
  EXPECT_EQ(workers[2].worker_id, "h100-2");
  EXPECT_EQ(workers[2].node_name, "h100-2");
  EXPECT_EQ(workers[3].worker_id, "small");
  EXPECT_EQ(workers[3].devices.size(), 4u);
  EXPECT_THAT(ParseWorkers("a*0=cpu:1x1GiB"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("NAME*N")));
  EXPECT_THAT(ParseWorkers("*2=cpu:1x1GiB"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("NAME*N")));
}

TEST(CliParseTest, FaultsAreWorkerAtSeconds) {
  ASSERT_OK_AND_ASSIGN(auto faults, ParseFaults("node-3@30, b@1.5"));
  ASSERT_EQ(faults.size(), 2u);
  EXPECT_EQ(faults[0].worker, "node-3");
  EXPECT_DOUBLE_EQ(faults[0].at_s, 30);
  EXPECT_DOUBLE_EQ(faults[1].at_s, 1.5);
  EXPECT_THAT(ParseFaults("b"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("WORKER@SECONDS")));
  EXPECT_THAT(ParseFaults("b@-1"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("WORKER@SECONDS")));
}

TEST(CliParseTest, TextListsArePlainOrJson) {
  ASSERT_OK_AND_ASSIGN(auto none, ParseTextList("", "--stop", PlainText::kOne));
  EXPECT_TRUE(none.empty());
  ASSERT_OK_AND_ASSIGN(auto one, ParseTextList("a, b", "--stop", PlainText::kOne));
  EXPECT_THAT(one, ::testing::ElementsAre("a, b"));
  ASSERT_OK_AND_ASSIGN(auto split, ParseTextList("x,,y z", "--bad_words", PlainText::kCommaSeparated));
  EXPECT_THAT(split, ::testing::ElementsAre("x", "y z"));
  ASSERT_OK_AND_ASSIGN(auto json, ParseTextList(R"(["\n\n", "a, b", "[x]"])", "--bad_words", PlainText::kCommaSeparated));
  EXPECT_THAT(json, ::testing::ElementsAre("\n\n", "a, b", "[x]"));
  for (const char* bad : {"[x]", R"(["a", 1])", R"(["a", ""])", R"([["a"]])", "[\"a\""}) {
    EXPECT_THAT(ParseTextList(bad, "--stop", PlainText::kOne),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         ::testing::AllOf(HasSubstr("--stop"), HasSubstr("JSON list of non-empty strings"))))
        << bad;
  }
}

}  // namespace
}  // namespace shardserve::cli

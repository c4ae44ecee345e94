// `shardserve bench`'s parsing, statistics and load loop (against an in-process fake client).
#include "sdk/cli/bench.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <mutex>
#include <set>
#include <vector>
#include <nlohmann/json.hpp>

#include "tests/testing/status_matchers.h"

namespace shardserve::cli {
namespace {

using ::shardserve::testing::StatusIs;
using ::testing::HasSubstr;

TEST(BenchTest, LengthRangesParseAndNameTheFlag) {
  ASSERT_OK_AND_ASSIGN(LengthRange one, ParseLengthRange("32", "--prompt_tokens"));
  EXPECT_EQ(one.min, 32);
  EXPECT_EQ(one.max, 32);
  ASSERT_OK_AND_ASSIGN(LengthRange range, ParseLengthRange("8:64", "--prompt_tokens"));
  EXPECT_EQ(range.min, 8);
  EXPECT_EQ(range.max, 64);
  for (const char* bad : {"", "0", "9:8", "a", "1:2:3", "-1:4", "4:"}) {
    EXPECT_THAT(ParseLengthRange(bad, "--prompt_tokens"),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--prompt_tokens")))
        << bad;
  }
}

TEST(BenchTest, OptionsAreValidated) {
  BenchOptions o;
  EXPECT_THAT(o.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--requests or --duration_s")));
  o.requests = 4;
  EXPECT_TRUE(o.Validate().ok());
  o.concurrency = 0;
  EXPECT_THAT(o.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--concurrency")));
  o.concurrency = 2;
  o.rate = -1;
  EXPECT_THAT(o.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--rate")));
}

TEST(BenchTest, PercentilesAreNearestRank) {
  std::vector<double> v;
  for (int i = 100; i >= 1; --i) v.push_back(i);  // 1..100, unsorted
  const Percentiles p = Summarize(v);
  EXPECT_EQ(p.count, 100);
  EXPECT_DOUBLE_EQ(p.p50, 50);
  EXPECT_DOUBLE_EQ(p.p90, 90);
  EXPECT_DOUBLE_EQ(p.p99, 99);
  EXPECT_DOUBLE_EQ(p.mean, 50.5);
  const Percentiles three = Summarize({3, 1, 2});
  EXPECT_DOUBLE_EQ(three.p50, 2);
  EXPECT_DOUBLE_EQ(three.p99, 3);
  EXPECT_EQ(Summarize(std::vector<double>{}).count, 0);
}

TEST(BenchTest, SummaryCountsFailuresByCodeAndGivesTheJsonFields) {
  std::vector<RequestSample> samples = {
      {.ok = true, .ttft_s = 0.1, .e2e_s = 0.5, .output_tokens = 5, .itl_s = {0.1, 0.1, 0.1, 0.1}},
      {.ok = true, .ttft_s = 0.3, .e2e_s = 0.7, .output_tokens = 3, .itl_s = {0.2, 0.2}},
      {.ok = false, .code = "RESOURCE_EXHAUSTED"},
      {.ok = false, .code = "RESOURCE_EXHAUSTED"},
      {.ok = false, .code = "UNAVAILABLE"},
  };
  const BenchSummary s = Summarize(samples, 2.0);
  EXPECT_EQ(s.completed, 2);
  EXPECT_EQ(s.failed, 3);
  EXPECT_EQ(s.output_tokens, 8);
  EXPECT_DOUBLE_EQ(s.requests_per_s, 1.0);
  EXPECT_DOUBLE_EQ(s.output_tokens_per_s, 4.0);
  EXPECT_EQ(s.itl_s.count, 6);
  const nlohmann::json j = nlohmann::json::parse(ToJson(s));
  EXPECT_DOUBLE_EQ(j["requests_per_s"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(j["output_tokens_per_s"].get<double>(), 4.0);
  for (const char* key : {"ttft_s", "itl_s", "e2e_s"}) {
    for (const char* q : {"p50", "p90", "p99"}) EXPECT_TRUE(j[key].contains(q)) << key << "." << q;
  }
  EXPECT_DOUBLE_EQ(j["ttft_s"]["p50"].get<double>(), 0.1);
  EXPECT_DOUBLE_EQ(j["ttft_s"]["p99"].get<double>(), 0.3);
  EXPECT_EQ(j["failed_by_code"]["RESOURCE_EXHAUSTED"].get<int>(), 2);
  EXPECT_EQ(j["failed_by_code"]["UNAVAILABLE"].get<int>(), 1);
  EXPECT_THAT(ToTable(s), HasSubstr("failed RESOURCE_EXHAUSTED: 2"));
}

// Streams max_tokens tokens one per message; fails every request whose seed is a multiple of 5
// with RESOURCE_EXHAUSTED. Records the prompts and the largest number of calls at once.
class FakeClient final : public Client {
 public:
  std::mutex mu_;
  int active_ = 0, max_active_ = 0;
  bool ignore_eos_ = true;
  std::vector<std::vector<int32_t>> prompts_;

 protected:
  // One request: counted as active from its start until its stream has ended.
  class Stream final : public GenerateStream {
   public:
    Stream(FakeClient* client, const GenerateOptions& options) : client_(client), options_(options) {}
    std::optional<GenerateDelta> Next() override {
      if (done_) return std::nullopt;
      if (options_.seed % 5 == 0) return End(absl::ResourceExhaustedError("queue full"));
      if (next_ < options_.max_tokens) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        return GenerateDelta{.token_ids = {next_++}};
      }
      if (next_++ == options_.max_tokens) return GenerateDelta{.finished = true, .finish_reason = "length"};
      return End(absl::OkStatus());
    }
    absl::Status status() const override { return status_; }
    void Cancel() override {}

   private:
    std::optional<GenerateDelta> End(absl::Status status) {
      done_ = true;
      status_ = std::move(status);
      std::lock_guard lock(client_->mu_);
      --client_->active_;
      return std::nullopt;
    }
    FakeClient* const client_;
    const GenerateOptions options_;
    int32_t next_ = 0;
    bool done_ = false;
    absl::Status status_;
  };

  std::unique_ptr<GenerateStream> DoStartGenerate(const Prompt& prompt, const GenerateOptions& options,
                                                  const CallOptions&) override {
    std::lock_guard lock(mu_);
    ++active_;
    max_active_ = std::max(max_active_, active_);
    prompts_.push_back(prompt.ids);
    ignore_eos_ &= options.ignore_eos;
    return std::make_unique<Stream>(this, options);
  }
  absl::StatusOr<std::vector<int32_t>> DoTokenize(const std::string&, bool, const CallOptions&) override {
    return absl::UnimplementedError("fake");
  }
  absl::StatusOr<ModelInfo> DoGetModelInfo(const CallOptions&) override { return absl::UnimplementedError("fake"); }
  absl::StatusOr<ClusterInfo> DoClusterStatus(const CallOptions&) override {
    return absl::UnimplementedError("fake");
  }
};

TEST(BenchTest, ClosedLoopSendsEveryRequestWithTheAskedShapes) {
  FakeClient client;
  BenchOptions o{.concurrency = 4, .requests = 20, .prompt_tokens = {.min = 3, .max = 9},
                 .output_tokens = {.min = 4, .max = 4}, .prompt_vocab = 50};
  ASSERT_OK_AND_ASSIGN(BenchSummary s, RunBench(client, o));
  EXPECT_EQ(s.completed + s.failed, 20);
  EXPECT_EQ(s.failed_by_code["RESOURCE_EXHAUSTED"], 4);  // seeds 0, 5, 10, 15
  EXPECT_EQ(s.output_tokens, 16 * 4);
  EXPECT_EQ(s.ttft_s.count, 16);
  EXPECT_EQ(s.itl_s.count, 16 * 3);
  EXPECT_GT(s.output_tokens_per_s, 0);
  EXPECT_LE(client.max_active_, 4);
  EXPECT_TRUE(client.ignore_eos_);
  ASSERT_EQ(client.prompts_.size(), 20u);
  for (const auto& p : client.prompts_) {
    EXPECT_GE(p.size(), 3u);
    EXPECT_LE(p.size(), 9u);
    for (int32_t id : p) {
      EXPECT_GE(id, 1);
      EXPECT_LT(id, 50);
    }
  }
}

TEST(BenchTest, ASharedPrefixStartsEveryPrompt) {
  FakeClient client;
  BenchOptions o{.concurrency = 3, .requests = 9, .prompt_tokens = {.min = 2, .max = 5},
                 .output_tokens = {.min = 2, .max = 2}, .prompt_vocab = 1000, .shared_prefix_tokens = 12};
  ASSERT_OK_AND_ASSIGN(BenchSummary s, RunBench(client, o));
  ASSERT_EQ(client.prompts_.size(), 9u);
  const std::vector<int32_t> prefix(client.prompts_[0].begin(), client.prompts_[0].begin() + 12);
  std::set<std::vector<int32_t>> suffixes;
  for (const auto& p : client.prompts_) {
    ASSERT_GE(p.size(), 14u);
    ASSERT_LE(p.size(), 17u);
    EXPECT_EQ(std::vector<int32_t>(p.begin(), p.begin() + 12), prefix);
    suffixes.insert(std::vector<int32_t>(p.begin() + 12, p.end()));
  }
  EXPECT_GT(suffixes.size(), 1u) << "each request draws its own tokens after the prefix";
  o.shared_prefix_tokens = -1;
  EXPECT_THAT(o.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--shared_prefix_tokens")));
}

TEST(BenchTest, PromptUsageIsSummed) {
  const BenchSummary s = Summarize({{.ok = true, .output_tokens = 1, .prompt_tokens = 40, .cached_prompt_tokens = 32},
                                    {.ok = true, .output_tokens = 1, .prompt_tokens = 40, .cached_prompt_tokens = 0}},
                                   1.0);
  EXPECT_EQ(s.prompt_tokens, 80);
  EXPECT_EQ(s.cached_prompt_tokens, 32);
  const nlohmann::json j = nlohmann::json::parse(ToJson(s));
  EXPECT_EQ(j["cached_prompt_tokens"].get<int64_t>(), 32);
  EXPECT_THAT(ToTable(s), HasSubstr("80, 32 of them from the prefix cache"));
}

TEST(BenchTest, OpenLoopStopsAtTheRequestCount) {
  FakeClient client;
  BenchOptions o{.concurrency = 2, .requests = 12, .rate = 2000, .output_tokens = {.min = 2, .max = 2}};
  ASSERT_OK_AND_ASSIGN(BenchSummary s, RunBench(client, o));
  EXPECT_EQ(s.completed + s.failed, 12);
  EXPECT_LE(client.max_active_, 2);
}

}  // namespace
}  // namespace shardserve::cli

// Structured output end to end below the API: the scheduler keeps each sequence's grammar state,
// sends the allowed-token mask with every sampling step, and the real engine (stories260K, run
// in-process by EngineReplica) samples under it with temperature 1. Every output must parse and
// validate against its schema (json_validator.h, written independently of the compiler).
#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/model_spec/model_spec.h"
#include "common/tokenizer/tokenizer.h"
#include "coordinator/scheduler/scheduler.h"
#include "coordinator/structured/grammar.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/coordinator/structured/json_validator.h"
#include "tests/coordinator/structured/test_schemas.h"
#include "tests/testing/engine_replica.h"
#include "tests/testing/status_matchers.h"

namespace shardserve::coordinator {
namespace {

using ::shardserve::testing::EngineReplica;
using ::shardserve::testing::EngineReplicaOptions;
using ::shardserve::testing::IsOk;
using testing_json::Json;

constexpr char kModelDir[] = "../shared/models/stories260K";
constexpr absl::Duration kWait = absl::Seconds(300);

class Sink final : public SequenceSink {
 public:
  void OnTokens(absl::Span<const int32_t> tokens, absl::Span<const TokenLogprobs> /*logprobs*/) override {
    absl::MutexLock lock(&mu_);
    tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  }
  void OnEnd(const SequenceEnd& end) override {
    {
      absl::MutexLock lock(&mu_);
      end_ = end;
    }
    done_.Notify();
  }
  bool Wait() { return done_.WaitForNotificationWithTimeout(kWait); }
  std::vector<int32_t> tokens() const {
    absl::MutexLock lock(&mu_);
    return tokens_;
  }
  SequenceEnd end() const {
    absl::MutexLock lock(&mu_);
    return end_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<int32_t> tokens_ ABSL_GUARDED_BY(mu_);
  SequenceEnd end_ ABSL_GUARDED_BY(mu_);
  absl::Notification done_;
};

class StructuredGenerationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(spec_, LoadModelSpec(kModelDir));
    ASSERT_OK_AND_ASSIGN(tokenizer_, LoadTokenizer(kModelDir));
    compiler_ = std::make_unique<structured::ConstraintCompiler>(
        structured::VocabularyFromTokenizer(*tokenizer_, static_cast<int32_t>(spec_.vocab_size)));
    SchedulerOptions so;
    so.limits = {.vocab_size = spec_.vocab_size, .max_seq_len = spec_.max_position_embeddings};
    so.eos_token_ids = tokenizer_->eos_ids();
    scheduler_ = std::make_unique<Scheduler>(so);
    ASSERT_OK_AND_ASSIGN(auto replica, EngineReplica::Create(EngineReplicaOptions{.model_dir = kModelDir}));
    replica_ = replica.get();
    const ReplicaOptions ro{.max_slots = 16, .kv_blocks = replica->kv_blocks(), .kv_block_size = 16};
    ASSERT_THAT(scheduler_->AddReplica(0, std::move(replica), ro), IsOk());
  }
  void TearDown() override {
    if (scheduler_ != nullptr) scheduler_->Shutdown(absl::UnavailableError("test over"));
  }

  SequenceRequest Request(const std::string& prompt, uint64_t seed, float temperature,
                          std::shared_ptr<const TokenConstraint> constraint) {
    SequenceRequest r;
    r.request_id = absl::StrCat("s", seed);
    absl::StatusOr<std::vector<int32_t>> ids = tokenizer_->Encode(prompt, true);
    EXPECT_TRUE(ids.ok());
    r.prompt = *ids;
    r.max_tokens = static_cast<int32_t>(spec_.max_position_embeddings) - static_cast<int32_t>(r.prompt.size());
    r.sampling = {.temperature = temperature, .seed = seed};
    r.constraint = std::move(constraint);
    return r;
  }

  ModelSpec spec_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<structured::ConstraintCompiler> compiler_;
  std::unique_ptr<Scheduler> scheduler_;
  EngineReplica* replica_ = nullptr;  // owned by the scheduler
};

// >= 50 schemas x 3 seeds (two sampled at temperature 1, one greedy): 100% parse and validate.
TEST_F(StructuredGenerationTest, EveryOutputValidatesAgainstItsSchema) {
  struct Case {
    std::string schema;
    uint64_t seed;
    std::shared_ptr<Sink> sink;
  };
  std::vector<Case> cases;
  const char* prompts[] = {"Once upon a time", "The little dog", "Lily wanted"};
  for (const char* schema : testing_json::kTestSchemas) {
    ASSERT_OK_AND_ASSIGN(auto c, compiler_->Compile({structured::ConstraintKind::kJsonSchema, schema}));
    for (uint64_t seed = 1; seed <= 3; ++seed) {
      cases.push_back({schema, seed, std::make_shared<Sink>()});
      const float temperature = seed == 3 ? 0.0f : 1.0f;
      ASSERT_THAT(scheduler_->Submit(Request(prompts[seed - 1], seed, temperature, c), cases.back().sink), IsOk());
    }
  }
  ASSERT_GE(cases.size(), 150u);
  int valid = 0;
  for (const Case& c : cases) {
    ASSERT_TRUE(c.sink->Wait());
    const SequenceEnd end = c.sink->end();
    ASSERT_THAT(end.status, IsOk()) << c.schema;
    EXPECT_EQ(end.reason, FinishReason::kStop) << c.schema << " seed " << c.seed;
    absl::StatusOr<std::string> text = tokenizer_->Decode(c.sink->tokens(), /*skip_special_tokens=*/true);
    ASSERT_TRUE(text.ok()) << text.status();
    const Json v = Json::parse(*text, nullptr, /*allow_exceptions=*/false);
    if (v.is_discarded()) {
      ADD_FAILURE() << "not JSON: " << *text << "\nschema " << c.schema << " seed " << c.seed;
      continue;
    }
    const Json schema = Json::parse(c.schema);
    const std::string why = testing_json::Validate(v, schema, schema);
    EXPECT_EQ(why, "") << *text << "\nschema " << c.schema << " seed " << c.seed;
    valid += why.empty();
  }
  EXPECT_EQ(valid, static_cast<int>(cases.size()));
}

// Free-form JSON (strings of any length, any number of members): this story model keeps writing
// members and rarely closes the object within its context, so an output either ended with EOS and
// parses as an object, or ran to max_tokens (finish_reason length) and is a prefix of one. Regex
// outputs are bounded and always complete.
TEST_F(StructuredGenerationTest, JsonObjectAndRegex) {
  ASSERT_OK_AND_ASSIGN(auto object, compiler_->Compile({structured::ConstraintKind::kJsonObject, ""}));
  ASSERT_OK_AND_ASSIGN(structured::ByteDfa object_dfa, structured::ByteDfa::Compile(structured::JsonObjectRegex()));
  const std::string re = R"((yes|no), because [a-z ]{1,30}\.)";
  ASSERT_OK_AND_ASSIGN(auto regex, compiler_->Compile({structured::ConstraintKind::kRegex, re}));
  ASSERT_OK_AND_ASSIGN(structured::ByteDfa check, structured::ByteDfa::Compile(re));
  std::vector<std::shared_ptr<Sink>> objects, regexes;
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    objects.push_back(std::make_shared<Sink>());
    SequenceRequest r = Request("Once upon a time", seed, 1.0f, object);
    r.max_tokens = 64;
    ASSERT_THAT(scheduler_->Submit(r, objects.back()), IsOk());
    regexes.push_back(std::make_shared<Sink>());
    ASSERT_THAT(scheduler_->Submit(Request("Tom said", seed, 1.0f, regex), regexes.back()), IsOk());
  }
  for (auto& s : objects) {
    ASSERT_TRUE(s->Wait());
    ASSERT_THAT(s->end().status, IsOk());
    std::string bytes;
    for (int32_t id : s->tokens()) bytes += compiler_->vocabulary().bytes[static_cast<size_t>(id)];
    if (s->end().reason == FinishReason::kStop) {
      const Json v = Json::parse(bytes, nullptr, false);
      EXPECT_TRUE(!v.is_discarded() && v.is_object()) << bytes;
    } else {
      EXPECT_EQ(s->end().reason, FinishReason::kLength);
      EXPECT_EQ(s->tokens().size(), 64u);
      EXPECT_GE(object_dfa.Walk(object_dfa.start(), bytes), 0) << bytes;
      EXPECT_EQ(bytes[0], '{');
    }
  }
  for (auto& s : regexes) {
    ASSERT_TRUE(s->Wait());
    ASSERT_THAT(s->end().status, IsOk());
    EXPECT_EQ(s->end().reason, FinishReason::kStop);
    absl::StatusOr<std::string> text = tokenizer_->Decode(s->tokens(), true);
    ASSERT_TRUE(text.ok());
    EXPECT_TRUE(check.FullMatch(*text)) << *text;
  }
}

// The mask travels with every sampling step of a constrained sequence, and only then.
TEST_F(StructuredGenerationTest, MaskSentOnlyForConstrainedSamplingSteps) {
  ASSERT_OK_AND_ASSIGN(auto c, compiler_->Compile({structured::ConstraintKind::kRegex, "[a-z]{3}"}));
  auto constrained = std::make_shared<Sink>();
  auto free = std::make_shared<Sink>();
  SequenceRequest plain = Request("Once", 9, 1.0f, nullptr);
  plain.max_tokens = 4;
  ASSERT_THAT(scheduler_->Submit(Request("Once", 8, 1.0f, c), constrained), IsOk());
  ASSERT_THAT(scheduler_->Submit(plain, free), IsOk());
  ASSERT_TRUE(constrained->Wait());
  ASSERT_TRUE(free->Wait());
  int masked = 0;
  for (const StepInput& in : replica_->StepInputsForTest()) {
    for (const StepSequenceInput& s : in.sequences) {
      const bool is_constrained = s.request_id == "s8";
      EXPECT_EQ(s.allowed_token_mask != nullptr, is_constrained && s.sample) << s.request_id;
      masked += s.allowed_token_mask != nullptr;
    }
  }
  EXPECT_EQ(masked, static_cast<int>(constrained->tokens().size()));
}

}  // namespace
}  // namespace shardserve::coordinator

// Step deltas (common/rpc/step_delta.h): random step sequences (joins, prefill chunks, growth
// across blocks, sampling changes, penalties, masks, preemption, finishes, reopened streams, small
// table bounds) coded, sent as bytes and decoded give back exactly the full messages; the
// decoder's refusals name the sequence and the field and change nothing.
#include "common/rpc/step_delta.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <google/protobuf/util/message_differencer.h>

#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "tests/testing/status_matchers.h"

namespace shardserve::rpc {
namespace {

using ::google::protobuf::util::MessageDifferencer;
using ::shardserve::testing::IsOk;
using ::shardserve::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int kBlockSize = 4;

// One running sequence of a simulated scheduler.
struct SimSequence {
  uint64_t key = 0;
  int prompt = 0;     // prompt length
  int pos = 0;        // tokens already cached
  int generated = 0;
  std::vector<int32_t> blocks;
  v1::SamplingParams sampling;
  bool logprobs = false;
  bool penalties = false;
  std::map<int32_t, int32_t> history;  // id -> times generated
  bool masked = false;
  std::string mask;
  std::string request_id;
};

// Drives a scheduler-like model of a stage stream: the full StepRequest of each step.
class Simulator {
 public:
  explicit Simulator(uint32_t seed) : rng_(seed) {}

  v1::StepRequest NextStep() {
    // Joins.
    if (live_.size() < 24 && Chance(0.5)) {
      for (int n = Uniform(1, 3); n > 0; --n) Join();
    }
    v1::StepRequest r;
    r.set_step_id(++step_);
    for (size_t i = 0; i < live_.size();) {
      SimSequence& s = live_[i];
      if (s.generated > 0 && Chance(0.04)) {  // finished: leaves without a word
        live_.erase(live_.begin() + static_cast<long>(i));
        continue;
      }
      if (Chance(0.03)) {  // preempted: recomputed from position 0 in new blocks
        s.blocks.clear();
        s.pos = 0;
      }
      if (Chance(0.75)) AddTo(s, r.add_sequences());
      ++i;
    }
    return r;
  }

 private:
  bool Chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }
  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }

  void Join() {
    SimSequence s;
    // Now and then a key already used (a reused id must still decode right).
    s.key = Chance(0.05) && next_key_ > 1 ? static_cast<uint64_t>(Uniform(1, static_cast<int>(next_key_ - 1)))
                                          : next_key_++;
    for (const SimSequence& o : live_) {
      if (o.key == s.key) s.key = next_key_++;
    }
    s.prompt = Uniform(1, 13);
    s.request_id = "req-" + std::to_string(s.key);
    if (Chance(0.6)) {
      s.sampling.set_temperature(0.5f + static_cast<float>(Uniform(0, 4)) / 4);
      s.sampling.set_top_k(Uniform(0, 40));
      s.sampling.set_seed(static_cast<uint64_t>(Uniform(1, 1000)));
      if (Chance(0.3)) {
        (*s.sampling.mutable_logit_bias())[Uniform(0, 50)] = 1.5f;
        (*s.sampling.mutable_logit_bias())[Uniform(51, 99)] = -2.0f;
      }
    }
    s.penalties = Chance(0.4);
    if (s.penalties) s.sampling.set_frequency_penalty(0.5f);
    s.logprobs = Chance(0.3);
    s.masked = Chance(0.3);
    live_.push_back(std::move(s));
  }

  void AddTo(SimSequence& s, v1::StepSequence* out) {
    const int n = s.pos < s.prompt ? std::min(s.prompt - s.pos, Uniform(1, 6)) : 1;
    while (static_cast<int>(s.blocks.size()) * kBlockSize < s.pos + n) s.blocks.push_back(next_block_++);
    out->set_key(s.key);
    out->mutable_block_ids()->Add(s.blocks.begin(), s.blocks.end());
    out->set_pos_begin(s.pos);
    out->set_num_tokens(n);
    for (int t = 0; t < n; ++t) out->add_token_ids(Uniform(0, 99));
    out->set_request_id(s.request_id);
    const bool sample = s.pos + n >= s.prompt;
    out->set_sample(sample);
    if (s.logprobs && s.pos == 0) {  // prompt logprobs with the first chunk
      for (int t = 0; t < n; ++t) out->add_prompt_logprob_targets(Uniform(-1, 99));
    }
    if (sample) {
      *out->mutable_sampling() = s.sampling;
      out->set_sample_index(static_cast<uint64_t>(s.generated));
      if (s.generated < 2) out->add_suppress_token_ids(2);  // min_tokens
      out->set_logprobs(s.logprobs);
      out->set_top_logprobs(s.logprobs ? 3 : 0);
      if (s.penalties) {
        for (const auto& [id, count] : s.history) {
          out->add_penalty_token_ids(id);
          out->add_penalty_token_counts(count);
        }
      }
      if (s.masked) {
        if (s.mask.empty() || Chance(0.5)) s.mask = std::string(8, static_cast<char>(Uniform(1, 255)));
        out->set_allowed_token_mask(s.mask);
      }
      ++s.history[Uniform(0, 30)];  // the token this step samples
      ++s.generated;
    }
    s.pos += n;
  }

  std::mt19937 rng_;
  std::vector<SimSequence> live_;
  uint64_t step_ = 0;
  uint64_t next_key_ = 1;
  int32_t next_block_ = 0;
};

// Codes `full`, sends it as bytes, decodes it: the result must equal `full`.
void RoundTrip(StepDeltaEncoder& encoder, StepDeltaDecoder& decoder, const v1::StepRequest& full,
               size_t* full_bytes, size_t* coded_bytes) {
  v1::StepRequest coded = full;
  encoder.Encode(&coded);
  *full_bytes += full.ByteSizeLong();
  *coded_bytes += coded.ByteSizeLong();
  v1::StepRequest received;
  ASSERT_TRUE(received.ParseFromString(coded.SerializeAsString()));
  ASSERT_THAT(decoder.Decode(&received), IsOk());
  // Keys are identities, not data: one the table had no room for arrives as 0 (sent in full).
  ASSERT_EQ(received.sequences_size(), full.sequences_size());
  v1::StepRequest expected = full;
  for (int i = 0; i < full.sequences_size(); ++i) {
    const uint64_t key = received.sequences(i).key();
    ASSERT_TRUE(key == full.sequences(i).key() || key == 0) << "step " << full.step_id() << " sequence " << i;
    expected.mutable_sequences(i)->set_key(key);
  }
  std::string diff;
  MessageDifferencer differ;
  differ.ReportDifferencesToString(&diff);
  ASSERT_TRUE(differ.Compare(expected, received)) << "step " << full.step_id() << ":\n" << diff;
  ASSERT_EQ(encoder.size(), decoder.size()) << "step " << full.step_id();
}

struct RandomCase {
  uint32_t seed;
  StepDeltaEncoder::Options options;
  double reopen;  // chance per step that the stream is reopened (both tables start empty)
};

class StepDeltaRoundTripTest : public ::testing::TestWithParam<RandomCase> {};

TEST_P(StepDeltaRoundTripTest, DecodedStepsEqualTheFullOnes) {
  const RandomCase& c = GetParam();
  Simulator sim(c.seed);
  std::mt19937 rng(c.seed + 1);
  auto encoder = std::make_unique<StepDeltaEncoder>(c.options);
  auto decoder = std::make_unique<StepDeltaDecoder>(c.options.max_sequences);
  size_t full_bytes = 0, coded_bytes = 0;
  for (int step = 0; step < 600; ++step) {
    if (std::uniform_real_distribution<double>(0, 1)(rng) < c.reopen) {
      encoder = std::make_unique<StepDeltaEncoder>(c.options);
      decoder = std::make_unique<StepDeltaDecoder>(c.options.max_sequences);
    }
    ASSERT_NO_FATAL_FAILURE(RoundTrip(*encoder, *decoder, sim.NextStep(), &full_bytes, &coded_bytes));
    ASSERT_LE(decoder->size(), c.options.max_sequences);
  }
  // Not a target, a sign that something is coded at all: decode steps dominate the mix (with a
  // table far smaller than the running sequences, most go in full).
  if (c.options.max_sequences >= 64) {
    EXPECT_LT(coded_bytes, full_bytes * 3 / 4) << "full " << full_bytes << " B, coded " << coded_bytes << " B";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Mixes, StepDeltaRoundTripTest,
    ::testing::Values(RandomCase{.seed = 1, .options = {}, .reopen = 0.0},
                      RandomCase{.seed = 2, .options = {}, .reopen = 0.02},
                      RandomCase{.seed = 3, .options = {.forget_after_steps = 2, .max_sequences = 4096}, .reopen = 0.0},
                      RandomCase{.seed = 4, .options = {.forget_after_steps = 64, .max_sequences = 5}, .reopen = 0.01},
                      RandomCase{.seed = 5, .options = {.forget_after_steps = 1, .max_sequences = 1}, .reopen = 0.0}));

// A decode step of a known sequence: a few bytes, only what changed.
v1::StepRequest DecodeStep(uint64_t step, int pos, std::vector<int32_t> blocks, int32_t token) {
  v1::StepRequest r;
  r.set_step_id(step);
  v1::StepSequence* s = r.add_sequences();
  s->set_key(7);
  s->mutable_block_ids()->Add(blocks.begin(), blocks.end());
  s->set_pos_begin(pos);
  s->set_num_tokens(1);
  s->add_token_ids(token);
  s->set_sample(true);
  s->set_sample_index(static_cast<uint64_t>(pos));
  s->set_request_id("req-7");
  s->mutable_sampling()->set_temperature(0.7f);
  s->mutable_sampling()->set_seed(5);
  (*s->mutable_sampling()->mutable_logit_bias())[3] = 1.0f;
  (*s->mutable_sampling()->mutable_logit_bias())[9] = -1.0f;
  s->add_penalty_token_ids(4);
  s->add_penalty_token_counts(1);
  s->add_penalty_token_ids(8);
  s->add_penalty_token_counts(pos);
  return r;
}

TEST(StepDeltaEncoderTest, AKnownSequenceSendsOnlyWhatChanged) {
  StepDeltaEncoder encoder;
  v1::StepRequest first = DecodeStep(1, 7, {10, 11}, 42);
  encoder.Encode(&first);
  EXPECT_TRUE(first.deltas());
  EXPECT_EQ(first.sequences(0).keep(), 0u);  // new: in full
  EXPECT_THAT(first.sequences(0).block_ids(), ElementsAre(10, 11));

  v1::StepRequest next = DecodeStep(2, 8, {10, 11, 12}, 43);  // a new block
  encoder.Encode(&next);
  const v1::StepSequence& s = next.sequences(0);
  EXPECT_EQ(s.keep(), static_cast<uint32_t>(v1::STEP_SEQUENCE_KEEP_PROFILE | v1::STEP_SEQUENCE_KEEP_PENALTIES));
  EXPECT_EQ(s.blocks_kept(), 2);
  EXPECT_THAT(s.block_ids(), ElementsAre(12));
  EXPECT_THAT(s.token_ids(), ElementsAre(43));
  EXPECT_EQ(s.pos_begin(), 8);
  EXPECT_FALSE(s.has_sampling());
  EXPECT_EQ(s.request_id(), "");
  EXPECT_THAT(s.penalty_token_ids(), ElementsAre(8));  // only the count that changed
  EXPECT_THAT(s.penalty_token_counts(), ElementsAre(8));
  EXPECT_LT(next.ByteSizeLong(), DecodeStep(2, 8, {10, 11, 12}, 43).ByteSizeLong() * 6 / 10);
}

TEST(StepDeltaEncoderTest, IdleSequencesAreForgottenAndTheTableStaysBounded) {
  StepDeltaEncoder encoder({.forget_after_steps = 2, .max_sequences = 2});
  StepDeltaDecoder decoder(2);
  auto step = [&](uint64_t id, std::vector<uint64_t> keys) {
    v1::StepRequest r;
    r.set_step_id(id);
    for (uint64_t k : keys) {
      v1::StepSequence* s = r.add_sequences();
      s->set_key(k);
      s->add_block_ids(static_cast<int32_t>(k));
      s->set_num_tokens(1);
      s->add_token_ids(1);
    }
    encoder.Encode(&r);
    std::vector<uint64_t> forgotten(r.forget_keys().begin(), r.forget_keys().end());
    EXPECT_THAT(decoder.Decode(&r), IsOk());
    return forgotten;
  };
  EXPECT_THAT(step(1, {1, 2}), ElementsAre());
  EXPECT_THAT(step(2, {3}), ElementsAre(1));  // over the bound: the least recently sent goes
  EXPECT_EQ(decoder.size(), 2u);
  EXPECT_THAT(step(3, {3}), ElementsAre());
  // Key 2 was last sent in step 1: not in steps 2 and 3, nor in 4, which forgets it.
  EXPECT_THAT(step(4, {3}), ElementsAre(2));
  EXPECT_EQ(decoder.size(), 1u);
  EXPECT_THAT(step(5, {3}), ElementsAre());
}

// A coded step of key 7 after a full one, for the refusals below.
v1::StepRequest CodedSecondStep() {
  StepDeltaEncoder encoder;
  v1::StepRequest first = DecodeStep(1, 7, {10, 11}, 42);
  encoder.Encode(&first);
  v1::StepRequest next = DecodeStep(2, 8, {10, 11, 12}, 43);
  encoder.Encode(&next);
  return next;
}

// Decodes `r` with `decoder`, expecting a refusal that leaves `r` and the table as they were.
absl::Status DecodeRefused(StepDeltaDecoder& decoder, const v1::StepRequest& r) {
  v1::StepRequest copy = r;
  const size_t size = decoder.size();
  absl::Status st = decoder.Decode(&copy);
  EXPECT_TRUE(MessageDifferencer::Equals(copy, r));
  EXPECT_EQ(decoder.size(), size);
  return st;
}

TEST(StepDeltaDecoderTest, ADeltaForAnUnknownSequenceIsRefused) {
  StepDeltaDecoder decoder;  // a fresh stream: it never saw step 1
  EXPECT_THAT(DecodeRefused(decoder, CodedSecondStep()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("step 2"), HasSubstr("sequence 0 (key 7"),
                             HasSubstr("a delta for a sequence this stream does not know"))));
}

TEST(StepDeltaDecoderTest, BlocksBeyondTheKnownOnesAreRefused) {
  StepDeltaDecoder decoder;
  v1::StepRequest first = DecodeStep(1, 7, {10, 11}, 42);
  first.set_deltas(true);
  ASSERT_THAT(decoder.Decode(&first), IsOk());
  v1::StepRequest bad = CodedSecondStep();
  bad.mutable_sequences(0)->set_blocks_kept(3);
  EXPECT_THAT(DecodeRefused(decoder, bad),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("key 7"), HasSubstr("blocks_kept 3 but the stream knows 2 block ids"))));
  bad.mutable_sequences(0)->set_blocks_kept(-1);
  EXPECT_THAT(DecodeRefused(decoder, bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("blocks_kept -1")));
  // The good one still decodes: the refusals changed nothing.
  v1::StepRequest good = CodedSecondStep();
  ASSERT_THAT(decoder.Decode(&good), IsOk());
  EXPECT_THAT(good.sequences(0).block_ids(), ElementsAre(10, 11, 12));
}

TEST(StepDeltaDecoderTest, MalformedMessagesAreRefusedNamingTheField) {
  StepDeltaDecoder decoder(2);
  v1::StepRequest first = DecodeStep(1, 7, {10, 11}, 42);
  first.set_deltas(true);
  ASSERT_THAT(decoder.Decode(&first), IsOk());

  v1::StepRequest forget = CodedSecondStep();
  forget.add_forget_keys(99);
  EXPECT_THAT(DecodeRefused(decoder, forget),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("forget_keys names key 99")));

  v1::StepRequest twice = CodedSecondStep();
  *twice.add_sequences() = twice.sequences(0);
  EXPECT_THAT(DecodeRefused(decoder, twice),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("sequence 1 (key 7, request -): key appears twice")));

  v1::StepRequest bits = CodedSecondStep();
  bits.mutable_sequences(0)->set_keep(64);
  EXPECT_THAT(DecodeRefused(decoder, bits), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown keep bits 64")));

  v1::StepRequest keyless = CodedSecondStep();
  keyless.mutable_sequences(0)->set_key(0);
  EXPECT_THAT(DecodeRefused(decoder, keyless),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("keep / blocks_kept without a key")));

  v1::StepRequest order = CodedSecondStep();
  order.mutable_sequences(0)->add_penalty_token_ids(2);  // after 8: not ascending
  order.mutable_sequences(0)->add_penalty_token_counts(1);
  EXPECT_THAT(DecodeRefused(decoder, order),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("penalty_token_ids updates must be ascending")));

  v1::StepRequest full;
  full.set_deltas(true);
  for (uint64_t k : {20, 21}) {
    v1::StepSequence* s = full.add_sequences();
    s->set_key(k);
    s->set_num_tokens(1);
  }
  EXPECT_THAT(DecodeRefused(decoder, full),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("would hold 3 sequences, more than 2")));
}

// The coder names every field it carries: a field added to StepSequence or SamplingParams must be
// placed (sent every step, coded, or in the profile) before it can travel with deltas.
TEST(StepDeltaCoverageTest, EveryStepSequenceFieldHasAPlace) {
  const std::set<std::string> placed = {
      // sent every step
      "pos_begin", "num_tokens", "token_ids", "sample", "sample_index", "prompt_logprob_targets", "sample_key",
      "from_previous",
      // coded on their own
      "block_ids", "penalty_token_ids", "penalty_token_counts", "allowed_token_mask",
      // the profile (StepSequenceProfile)
      "sampling", "request_id", "suppress_token_ids", "logprobs", "top_logprobs",
      // the coding itself
      "key", "keep", "blocks_kept"};
  std::set<std::string> fields;
  const auto* d = v1::StepSequence::descriptor();
  for (int i = 0; i < d->field_count(); ++i) fields.insert(d->field(i)->name());
  EXPECT_EQ(fields, placed);
  // SameSampling (step_delta.cc) compares these.
  std::set<std::string> sampling;
  const auto* p = v1::SamplingParams::descriptor();
  for (int i = 0; i < p->field_count(); ++i) sampling.insert(p->field(i)->name());
  EXPECT_EQ(sampling, (std::set<std::string>{"temperature", "top_k", "top_p", "seed", "min_p", "logit_bias",
                                             "presence_penalty", "frequency_penalty", "repetition_penalty"}));
}

TEST(StepDeltaDecoderTest, AMessageWithoutDeltasIsLeftAlone) {
  StepDeltaDecoder decoder;
  const v1::StepRequest full = DecodeStep(1, 7, {10, 11}, 42);
  v1::StepRequest copy = full;
  ASSERT_THAT(decoder.Decode(&copy), IsOk());
  EXPECT_TRUE(MessageDifferencer::Equals(copy, full));
  EXPECT_EQ(decoder.size(), 0u);
}

}  // namespace
}  // namespace shardserve::rpc

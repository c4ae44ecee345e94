// The pipelining policy over a fake cost model whose stage times are simple formulas, so that each
// expected round time is computed here by hand: one micro-batch costs the sum of the stages; a
// split is paced by its busiest stage, or by the machine its stages share.
#include "coordinator/scheduler/pipelining.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

namespace shardserve::coordinator {
namespace {

using ::testing::HasSubstr;

// Each stage: `weights` seconds of weight reads per micro-batch whatever its size (memory-bound),
// plus `per_token` seconds of compute per token, plus a fixed hop.
class FakeCost final : public PipelineCostModel {
 public:
  FakeCost(int stages, double weights, double per_token, bool shared, HostParallelism parallelism = {})
      : stages_(stages), weights_(weights), per_token_(per_token), shared_(shared), parallelism_(parallelism) {}
  int num_stages() const override { return stages_; }
  StageSeconds Stage(int, absl::Span<const StepWork> work) const override {
    double tokens = 0;
    for (const StepWork& w : work) tokens += static_cast<double>(w.tokens);
    return {.total = weights_ + per_token_ * tokens, .memory = weights_, .compute = per_token_ * tokens};
  }
  double Hop(int, int64_t) const override { return kHop; }
  int SharedGroup(int) const override { return shared_ ? 0 : -1; }
  HostParallelism Parallelism(int) const override { return parallelism_; }
  std::string Describe() const override { return shared_ ? "2 stages on one machine" : "2 stages on 2 machines"; }

  static constexpr double kHop = 1e-4;

 private:
  int stages_;
  double weights_, per_token_;
  bool shared_;
  HostParallelism parallelism_;
};

std::vector<StepWork> Decodes(int n) { return std::vector<StepWork>(n, StepWork{.pos_begin = 40, .tokens = 1, .sample = true}); }

TEST(PipeliningTest, OneMicroBatchTakesTheSumOfTheStagesAndHops) {
  const FakeCost cost(2, 0.010, 0.001, /*shared=*/false);
  const RoundPrediction r = PredictRound(cost, Decodes(16), 1, 256);
  EXPECT_EQ(r.tokens, 16);
  EXPECT_DOUBLE_EQ(r.seconds, 2 * (0.010 + 0.016) + 2 * FakeCost::kHop);
}

TEST(PipeliningTest, ASplitOnSeparateMachinesIsPacedByTheBusiestStage) {
  const FakeCost cost(2, 0.010, 0.001, /*shared=*/false);
  const RoundPrediction r = PredictRound(cost, Decodes(16), 2, 256);
  // Each stage runs both micro-batches of 8, 2 x (10 ms + 8 ms); one micro-batch's way through
  // both stages and hops is as long, plus the hops.
  EXPECT_DOUBLE_EQ(r.seconds, 2 * (0.010 + 0.008) + 2 * FakeCost::kHop);
  EXPECT_FALSE(r.host_bound);
  // Three micro-batches on two stages: each stage's three are longer than one micro-batch's way.
  const FakeCost two(2, 0.010, 0.001, /*shared=*/false);
  EXPECT_DOUBLE_EQ(PredictRound(two, Decodes(18), 3, 256).seconds, 3 * (0.010 + 0.006));
}

TEST(PipeliningTest, ASplitOnASharedMachineIsPacedByItsBusAndCores) {
  const FakeCost cost(2, 0.010, 0.001, /*shared=*/true, {.memory = 1.0, .compute = 1.0});
  const RoundPrediction r = PredictRound(cost, Decodes(16), 2, 256);
  // Reads: 2 stages x 2 micro-batches x 10 ms; arithmetic: 16 ms per stage, and the hop between
  // the stages of each micro-batch. The bus is the tighter.
  EXPECT_DOUBLE_EQ(r.seconds, std::max(4 * 0.010, 2 * 0.016 + 2 * FakeCost::kHop));
  EXPECT_TRUE(r.host_bound);
  // Compute-bound stages on cores that do not run two at once.
  const FakeCost cores(2, 0.002, 0.001, /*shared=*/true, {.memory = 2.0, .compute = 1.0});
  EXPECT_DOUBLE_EQ(PredictRound(cores, Decodes(16), 2, 256).seconds, 2 * 0.016 + 2 * FakeCost::kHop);
}

TEST(PipeliningTest, TheBudgetCutsAPrefillChunk) {
  const FakeCost cost(2, 0.010, 0.001, /*shared=*/false);
  std::vector<StepWork> work = Decodes(4);
  work.push_back(StepWork{.pos_begin = 0, .tokens = 100, .sample = true});
  EXPECT_EQ(PredictRound(cost, work, 1, 64).tokens, 64);
  // Two micro-batches of at most 3 sequences: 3 decodes; the last decode and the prefill cut to 63.
  EXPECT_EQ(PredictRound(cost, work, 2, 64).tokens, 3 + 1 + 63);
}

TEST(PipeliningTest, WeightBoundStagesOnASharedMachineKeepOneMicroBatch) {
  // Weight reads dominate (a decode step of 16 costs barely more than one of 8).
  const FakeCost cost(2, 0.010, 0.0001, /*shared=*/true, {.memory = 1.3, .compute = 1.0});
  const PipeliningChoice c = ChooseMicroBatches(cost, Decodes(16), 2, 256);
  EXPECT_EQ(c.micro_batches, 1);
  EXPECT_TRUE(c.weight_bound);
  EXPECT_TRUE(c.shared_host);
  EXPECT_LT(c.best_split_gain, 1.0);
  const std::string text = DescribePipelining(c, cost.Describe());
  EXPECT_THAT(text, HasSubstr("1 micro-batch for 16 running sequences"));
  EXPECT_THAT(text, HasSubstr("shared memory bus"));
  EXPECT_THAT(text, HasSubstr("2 stages on one machine"));
}

TEST(PipeliningTest, ComputeBoundStagesOnSeparateMachinesSplit) {
  const FakeCost cost(2, 0.002, 0.001, /*shared=*/false);
  const PipeliningChoice c = ChooseMicroBatches(cost, Decodes(16), 2, 256);
  EXPECT_EQ(c.micro_batches, 2);
  EXPECT_FALSE(c.weight_bound);
  // One: 2 x 18 ms + hops; two: 2 x (2 + 8) ms + hops.
  EXPECT_NEAR(c.gain, (2 * 0.018 + 2 * FakeCost::kHop) / (2 * 0.010 + 2 * FakeCost::kHop), 1e-9);
  EXPECT_THAT(DescribePipelining(c, cost.Describe()), HasSubstr("2 micro-batches for 16 running sequences"));
}

TEST(PipeliningTest, WeightBoundStagesOnSeparateMachinesGainTooLittleToSplit) {
  // A split reads every weight twice per round: the stages work at once for no more tokens.
  const FakeCost cost(2, 0.010, 0.00001, /*shared=*/false);
  EXPECT_EQ(ChooseMicroBatches(cost, Decodes(16), 2, 256).micro_batches, 1);
}

TEST(PipeliningTest, ComputeBoundStagesSharingOneMachineWithoutParallelismKeepOne) {
  const FakeCost cost(2, 0.0001, 0.001, /*shared=*/true, {.memory = 1.3, .compute = 1.0});
  const PipeliningChoice c = ChooseMicroBatches(cost, Decodes(16), 2, 256);
  EXPECT_EQ(c.micro_batches, 1);
  EXPECT_FALSE(c.weight_bound);
  EXPECT_THAT(DescribePipelining(c, cost.Describe()), HasSubstr("sharing one machine's cores and memory bus gain too little"));
}

TEST(PipeliningTest, OneSequenceOrDepthOneNeverSplits) {
  const FakeCost cost(2, 0.002, 0.001, /*shared=*/false);
  EXPECT_EQ(ChooseMicroBatches(cost, Decodes(1), 2, 256).micro_batches, 1);
  EXPECT_EQ(ChooseMicroBatches(cost, Decodes(16), 1, 256).micro_batches, 1);
  const PipeliningChoice idle = ChooseMicroBatches(cost, {}, 2, 256);
  EXPECT_EQ(idle.micro_batches, 1);
  EXPECT_THAT(DescribePipelining(idle, cost.Describe()), HasSubstr("idle now"));
}

TEST(PipeliningTest, NearTheBreakEvenPointTheCurrentSplitStays) {
  // A split predicts 1.07x: less than kMinPipeliningGain either way.
  const FakeCost cost(2, 0.010, 0.0001, /*shared=*/false);
  const double one = 2 * (0.010 + 0.0016) + 2 * FakeCost::kHop;
  const double two = 2 * (0.010 + 0.0008) + 2 * FakeCost::kHop;
  ASSERT_GT(one / two, 1.0);
  ASSERT_LT(one / two, kMinPipeliningGain);
  EXPECT_EQ(ChooseMicroBatches(cost, Decodes(16), 2, 256, /*current=*/1).micro_batches, 1);
  const PipeliningChoice stay = ChooseMicroBatches(cost, Decodes(16), 2, 256, /*current=*/2);
  EXPECT_EQ(stay.micro_batches, 2);
  EXPECT_NEAR(stay.gain, one / two, 1e-9);
}

TEST(PipeliningTest, DeeperPipelinesSplitFurtherOnlyForEnoughGain) {
  // Four compute-bound stages on four machines: each step of the split pays.
  const FakeCost cost(4, 0.001, 0.001, /*shared=*/false);
  EXPECT_EQ(ChooseMicroBatches(cost, Decodes(32), 4, 256).micro_batches, 4);
  // Weight reads dominate: no split gains 10%.
  const FakeCost weights(4, 0.010, 0.00001, /*shared=*/false);
  EXPECT_EQ(ChooseMicroBatches(weights, Decodes(32), 4, 256).micro_batches, 1);
}

// A cost that grows with the contexts too (KV reads): `kv` seconds per cached position read, on
// top of FakeCost's, so that bucketing the contexts matters to the price.
class ContextCost final : public PipelineCostModel {
 public:
  int num_stages() const override { return 2; }
  StageSeconds Stage(int stage, absl::Span<const StepWork> work) const override {
    double tokens = 0, positions = 0;
    for (const StepWork& w : work) {
      tokens += static_cast<double>(w.tokens);
      positions += static_cast<double>(w.pos_begin + w.tokens);
    }
    const double memory = 0.004 + 2e-6 * positions;
    const double compute = (stage == 0 ? 2e-4 : 3e-4) * tokens;
    return {.total = std::max(memory, compute) + 1e-4, .memory = memory, .compute = compute};
  }
  double Hop(int, int64_t tokens) const override { return 1e-4 + 1e-6 * static_cast<double>(tokens); }
  int SharedGroup(int) const override { return -1; }
  HostParallelism Parallelism(int) const override { return {}; }
  std::string Describe() const override { return "2 stages on 2 machines"; }
};

void ExpectSameChoice(const PipeliningChoice& a, const PipeliningChoice& b) {
  EXPECT_EQ(a.micro_batches, b.micro_batches);
  EXPECT_EQ(a.max_micro_batches, b.max_micro_batches);
  EXPECT_EQ(a.sequences, b.sequences);
  EXPECT_DOUBLE_EQ(a.gain, b.gain);
  EXPECT_DOUBLE_EQ(a.best_split_gain, b.best_split_gain);
  EXPECT_EQ(a.weight_bound, b.weight_bound);
  EXPECT_EQ(a.shared_host, b.shared_host);
}

TEST(PipeliningCacheTest, ShapePutsTheDecodesAtTheirMeanContextAndRoundsContextsUpWithinAnEighth) {
  const std::vector<StepWork> running = {{.pos_begin = 300, .tokens = 1, .sample = true},
                                         {.pos_begin = 17, .tokens = 1, .sample = true},
                                         {.pos_begin = 1, .tokens = 1, .sample = true},
                                         {.pos_begin = 5002, .tokens = 1, .sample = true},
                                         {.pos_begin = 100, .tokens = 30, .sample = true},
                                         {.pos_begin = 3, .tokens = 7, .sample = false}};
  const std::vector<StepWork> shape = PipeliningCache::Shape(running);
  ASSERT_EQ(shape.size(), running.size());
  // The decodes' mean context is 1330, in the buckets of 128 from 1024: 1408. The prefills keep
  // their order, tokens and sample flags, with contexts 100 -> 112 and 3 -> 16 (buckets of 16).
  std::vector<int64_t> pos;
  for (const StepWork& w : shape) pos.push_back(w.pos_begin);
  EXPECT_EQ(pos, (std::vector<int64_t>{1408, 1408, 1408, 1408, 112, 16}));
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(shape[i].tokens, 1);
    EXPECT_TRUE(shape[i].sample);
  }
  EXPECT_EQ(shape[4].tokens, 30);
  EXPECT_TRUE(shape[4].sample);
  EXPECT_EQ(shape[5].tokens, 7);
  EXPECT_FALSE(shape[5].sample);
  // Every bucket is within an eighth of the context (or 15 tokens), above it.
  for (int64_t p : {0, 1, 15, 16, 17, 255, 256, 257, 1000, 4095, 4096, 100000}) {
    const int64_t rounded = PipeliningCache::Shape(std::vector<StepWork>{{.pos_begin = p, .tokens = 2}})[0].pos_begin;
    EXPECT_GE(rounded, p);
    EXPECT_LE(rounded - p, std::max<int64_t>(15, p / 8)) << p;
  }
}

// A replica's running set over many builds: decodes advance a token a step, prompts arrive and
// are prefilled in chunks, sequences finish. Every build, the cache's choice must be the one
// ChooseMicroBatches gives the shape, whether it came from the memo or not (also across the
// memo's forgetting, with a tiny capacity), and most builds must hit.
void RunCacheAgainstUncached(size_t capacity) {
  const ContextCost cost;
  PipeliningCache cache(&cost, capacity);
  std::mt19937 rng(7);
  struct Seq {
    int64_t pos = 0;
    int64_t prompt = 0;
    int64_t left = 0;  // tokens to generate
  };
  std::vector<Seq> seqs;
  int32_t current = 1;
  for (int step = 0; step < 3000; ++step) {
    if (seqs.size() < 24 && rng() % 8 == 0) {
      seqs.push_back({.pos = 0, .prompt = 8 + static_cast<int64_t>(rng() % 200), .left = 1 + static_cast<int64_t>(rng() % 300)});
    }
    std::vector<StepWork> work;
    for (int pass = 0; pass < 2; ++pass) {
      for (const Seq& s : seqs) {
        const bool decode = s.pos >= s.prompt;
        if (decode != (pass == 0)) continue;
        work.push_back({.pos_begin = s.pos, .tokens = decode ? 1 : s.prompt - s.pos, .sample = true});
      }
    }
    const int32_t depth = step % 500 < 250 ? 2 : 4;
    const PipeliningChoice cached = cache.Choose(work, depth, 64, current);
    const PipeliningChoice uncached = ChooseMicroBatches(cost, PipeliningCache::Shape(work), depth, 64, current);
    ExpectSameChoice(cached, uncached);
    if (::testing::Test::HasFailure()) FAIL() << "at step " << step;
    current = cached.micro_batches;
    // Run the step: decodes advance by one, prefills by a chunk of the budget left.
    int64_t budget = 64;
    for (Seq& s : seqs) {
      if (s.pos >= s.prompt) {
        ++s.pos;
        --s.left;
        --budget;
      }
    }
    for (Seq& s : seqs) {
      if (s.pos < s.prompt && budget > 0) {
        const int64_t n = std::min(budget, s.prompt - s.pos);
        s.pos += n;
        budget -= n;
      }
    }
    std::erase_if(seqs, [](const Seq& s) { return s.left <= 0; });
  }
  EXPECT_EQ(cache.hits() + cache.misses(), 3000);
  if (capacity >= 1024) {
    EXPECT_GT(cache.hits(), cache.misses()) << "the cache hardly ever serves";
  }
}

TEST(PipeliningCacheTest, CachedChoiceEqualsTheUncachedOne) { RunCacheAgainstUncached(1024); }

TEST(PipeliningCacheTest, CachedChoiceEqualsTheUncachedOneWhenTheMemoForgets) { RunCacheAgainstUncached(2); }

TEST(PipeliningCacheTest, OneShapeIsPricedOnce) {
  const ContextCost cost;
  PipeliningCache cache(&cost);
  // Contexts 40 and 41 share a bucket (33..48), so the second build is the first one's shape.
  const PipeliningChoice a = cache.Choose(Decodes(16), 2, 256, 1);
  std::vector<StepWork> next = Decodes(16);
  for (StepWork& w : next) ++w.pos_begin;
  const PipeliningChoice b = cache.Choose(next, 2, 256, 1);
  EXPECT_EQ(cache.misses(), 1);
  EXPECT_EQ(cache.hits(), 1);
  ExpectSameChoice(a, b);
  // Another current split is another question.
  (void)cache.Choose(next, 2, 256, 2);
  EXPECT_EQ(cache.misses(), 2);
}

}  // namespace
}  // namespace shardserve::coordinator

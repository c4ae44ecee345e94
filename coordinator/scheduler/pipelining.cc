#include "coordinator/scheduler/pipelining.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log/log.h"

namespace shardserve::coordinator {

RoundPrediction PredictRound(const PipelineCostModel& model, absl::Span<const StepWork> running,
                             int32_t micro_batches, int64_t max_step_tokens) {
  CHECK_GE(micro_batches, 1);
  CHECK_GE(max_step_tokens, 1);
  RoundPrediction round{.micro_batches = micro_batches};
  // Deal the sequences as the scheduler fills its micro-batches: ceil(n / k) each, in order, under
  // the token budget (a prefill chunk is cut to what is left of it).
  const size_t n = running.size();
  const size_t k = static_cast<size_t>(micro_batches);
  const size_t share = std::max<size_t>(1, (n + k - 1) / k);
  std::vector<std::vector<StepWork>> parts;
  size_t next = 0;
  for (size_t j = 0; j < k && next < n; ++j) {
    std::vector<StepWork> part;
    int64_t left = max_step_tokens;
    while (next < n && part.size() < share && left > 0) {
      StepWork w = running[next++];
      if (w.tokens > left) {
        w.tokens = left;
        w.sample = false;  // the chunk no longer reaches the end of its prompt
      }
      left -= w.tokens;
      round.tokens += w.tokens;
      part.push_back(w);
    }
    if (!part.empty()) parts.push_back(std::move(part));
  }
  const int stages = model.num_stages();
  std::vector<double> busy(static_cast<size_t>(stages), 0.0);
  std::map<int, std::pair<double, double>> shared;  // group -> (memory seconds, compute seconds)
  std::map<int, int> group_stages;
  for (int s = 0; s < stages; ++s) {
    if (const int g = model.SharedGroup(s); g >= 0) ++group_stages[g];
  }
  double latency = 0;  // summed over the micro-batches, then their mean
  for (const std::vector<StepWork>& part : parts) {
    int64_t tokens = 0;
    for (const StepWork& w : part) tokens += w.tokens;
    double path = 0;
    for (int s = 0; s < stages; ++s) {
      const StageSeconds t = model.Stage(s, part);
      busy[static_cast<size_t>(s)] += t.total;
      path += t.total + model.Hop(s, s + 1 < stages ? tokens : 0);
      if (const int g = model.SharedGroup(s); g >= 0 && group_stages[g] > 1) {
        shared[g].first += t.memory;
        shared[g].second += t.compute;
        // A hop between two stages of the machine is its cores' work too (serialization, gRPC).
        if (s + 1 < stages && model.SharedGroup(s + 1) == g) shared[g].second += model.Hop(s, tokens);
      }
    }
    latency += path;
  }
  if (!parts.empty()) latency /= static_cast<double>(parts.size());
  round.seconds = std::max(latency, *std::max_element(busy.begin(), busy.end()));
  for (const auto& [g, seconds] : shared) {
    const HostParallelism p = model.Parallelism(g);
    const double memory = seconds.first / std::max(1.0, p.memory), compute = seconds.second / std::max(1.0, p.compute);
    const double bound = p.overlap ? std::max(memory, compute) : memory + compute;
    if (bound > round.seconds) {
      round.seconds = bound;
      round.host_bound = true;
    }
  }
  return round;
}

PipeliningChoice ChooseMicroBatches(const PipelineCostModel& model, absl::Span<const StepWork> running,
                                    int32_t max_micro_batches, int64_t max_step_tokens, int32_t current) {
  PipeliningChoice choice{.micro_batches = std::clamp(current, 1, std::max(1, max_micro_batches)),
                          .max_micro_batches = std::max(1, max_micro_batches),
                          .sequences = static_cast<int64_t>(running.size())};
  for (int s = 0; s < model.num_stages(); ++s) {
    choice.shared_host = choice.shared_host || model.SharedGroup(s) >= 0;
  }
  if (running.empty()) {
    choice.micro_batches = 1;  // nothing to split; the next load starts from one micro-batch
    return choice;
  }
  const RoundPrediction one = PredictRound(model, running, 1, max_step_tokens);
  double memory = 0, compute = 0;
  {
    // How much of one micro-batch's time its stages spend waiting on memory.
    std::vector<StepWork> batch;
    int64_t left = max_step_tokens;
    for (const StepWork& w : running) {
      if (left <= 0) break;
      batch.push_back(w);
      batch.back().tokens = std::min(w.tokens, left);
      left -= batch.back().tokens;
    }
    for (int s = 0; s < model.num_stages(); ++s) {
      const StageSeconds t = model.Stage(s, batch);
      memory += t.memory;
      compute += t.compute;
    }
  }
  choice.weight_bound = memory > compute;
  // The current split stays unless another one beats it by kMinPipeliningGain.
  std::vector<double> tps(static_cast<size_t>(choice.max_micro_batches) + 1, 0.0);
  tps[1] = one.TokensPerSecond();
  double best_split = 0;
  for (int32_t k = 2; k <= choice.max_micro_batches; ++k) {
    tps[static_cast<size_t>(k)] = PredictRound(model, running, k, max_step_tokens).TokensPerSecond();
    best_split = std::max(best_split, tps[static_cast<size_t>(k)]);
  }
  double best = tps[static_cast<size_t>(choice.micro_batches)];
  for (int32_t k = 1; k <= choice.max_micro_batches; ++k) {
    if (tps[static_cast<size_t>(k)] >= best * kMinPipeliningGain) {
      best = tps[static_cast<size_t>(k)];
      choice.micro_batches = k;
    }
  }
  if (tps[1] > 0) {
    choice.gain = best / tps[1];
    if (choice.max_micro_batches > 1) choice.best_split_gain = best_split / tps[1];
  }
  return choice;
}

PipeliningCache::PipeliningCache(const PipelineCostModel* model, size_t capacity)
    : model_(model), capacity_(std::max<size_t>(capacity, 1)) {
  CHECK(model_ != nullptr);
}

namespace {

// Rounds a context length up to its bucket: 2^(floor(log2(pos)) - 3) tokens, at least 16 (within
// 1/8 of it).
int64_t Bucket(int64_t pos) {
  int64_t bucket = 16;
  while (bucket * 16 <= pos) bucket *= 2;
  return (pos + bucket - 1) / bucket * bucket;
}

}  // namespace

std::vector<StepWork> PipeliningCache::Shape(absl::Span<const StepWork> running) {
  size_t decodes = 0;
  int64_t positions = 0;
  while (decodes < running.size() && running[decodes].tokens == 1 && running[decodes].sample) {
    positions += running[decodes++].pos_begin;
  }
  std::vector<StepWork> shape;
  shape.reserve(running.size());
  if (decodes > 0) {
    const int64_t n = static_cast<int64_t>(decodes);
    shape.assign(decodes, StepWork{.pos_begin = Bucket((positions + n / 2) / n), .tokens = 1, .sample = true});
  }
  for (size_t i = decodes; i < running.size(); ++i) {
    shape.push_back(running[i]);
    shape.back().pos_begin = Bucket(running[i].pos_begin);
  }
  return shape;
}

PipeliningChoice PipeliningCache::Choose(absl::Span<const StepWork> running, int32_t max_micro_batches,
                                         int64_t max_step_tokens, int32_t current) {
  const std::vector<StepWork> shape = Shape(running);
  std::vector<int64_t> key;
  key.reserve(5 + 3 * shape.size());
  key.insert(key.end(), {max_micro_batches, max_step_tokens, current});
  // The decodes are alike: their number and context say it all.
  size_t decodes = 0;
  while (decodes < shape.size() && shape[decodes].tokens == 1 && shape[decodes].sample) ++decodes;
  key.insert(key.end(), {static_cast<int64_t>(decodes), decodes > 0 ? shape[0].pos_begin : 0});
  for (size_t i = decodes; i < shape.size(); ++i) {
    key.insert(key.end(), {shape[i].pos_begin, shape[i].tokens, shape[i].sample ? 1 : 0});
  }
  if (auto it = choices_.find(key); it != choices_.end()) {
    ++hits_;
    return it->second;
  }
  ++misses_;
  if (choices_.size() >= capacity_) choices_.clear();
  const PipeliningChoice choice = ChooseMicroBatches(*model_, shape, max_micro_batches, max_step_tokens, current);
  choices_.emplace(std::move(key), choice);
  return choice;
}

std::string DescribePipelining(const PipeliningChoice& c, const std::string& where) {
  if (c.max_micro_batches <= 1) return absl::StrCat("1 micro-batch (pipeline depth 1; ", where, ")");
  if (c.sequences == 0) {
    return absl::StrCat("up to ", c.max_micro_batches, " micro-batches, chosen per step from the load (", where,
                        "; idle now)");
  }
  if (c.micro_batches == 1) {
    std::string why;
    if (c.weight_bound && c.shared_host) {
      why = "decode-bound stages on a shared memory bus: a split would read the weights again per micro-batch";
    } else if (c.weight_bound) {
      why = "stages bound by weight reads: a split would read the weights again per micro-batch";
    } else if (c.shared_host) {
      why = "stages sharing one machine's cores and memory bus gain too little from a split";
    } else {
      why = "a split would not keep the stages busier";
    }
    return absl::StrFormat("1 micro-batch for %d running %s (%s, %s; split: %.2fx the throughput at best)",
                           c.sequences, c.sequences == 1 ? "sequence" : "sequences", where, why, c.best_split_gain);
  }
  return absl::StrFormat("%d micro-batches for %d running sequences (%s; the stages work at once: %.2fx the "
                         "throughput of one micro-batch)",
                         c.micro_batches, c.sequences, where, c.gain);
}

}  // namespace shardserve::coordinator

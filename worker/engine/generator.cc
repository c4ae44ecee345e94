#include "worker/engine/generator.h"

#include <algorithm>
#include <deque>

#include "absl/strings/str_cat.h"
#include "common/sampling/token_history.h"
#include "common/status/macros.h"

namespace shardserve::engine {
namespace {

struct Active {
  size_t index;           // request index
  std::vector<int32_t> blocks;  // KV cache blocks, enough for the whole sequence
  int32_t consumed = 0;   // tokens of prompt+output already in the cache
  std::vector<int32_t> context;  // prompt followed by generated tokens
  TokenHistory history;          // for the penalties (empty without them)
  bool done = false;
};

// KV blocks reserved for a request: its longest possible sequence.
int64_t BlocksNeeded(const StepRunner& model, const GenerationRequest& r) {
  const ModelOptions& o = model.options();
  const int64_t tokens = std::min<int64_t>(static_cast<int64_t>(r.prompt.size()) + r.max_tokens, o.max_seq_len);
  return (tokens + o.kv_block_size - 1) / o.kv_block_size;
}

}  // namespace

absl::string_view FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength: return "length";
    case FinishReason::kStop: return "stop";
  }
  return "?";
}

absl::Status ValidateRequest(const StepRunner& model, const GenerationRequest& r) {
  const ModelSpec& spec = model.spec();
  const int64_t ctx = model.options().max_seq_len;
  if (r.prompt.empty()) return absl::InvalidArgumentError("the prompt is empty");
  for (size_t i = 0; i < r.prompt.size(); ++i) {
    if (r.prompt[i] < 0 || r.prompt[i] >= spec.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("prompt token ", i, " has id ", r.prompt[i],
                                                     ", outside the vocabulary [0, ", spec.vocab_size, ")"));
    }
  }
  if (static_cast<int64_t>(r.prompt.size()) >= ctx) {
    return absl::InvalidArgumentError(absl::StrCat("the prompt has ", r.prompt.size(),
                                                   " tokens; the context length is ", ctx,
                                                   ", which leaves no room to generate"));
  }
  if (r.max_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens must be >= 1, got ", r.max_tokens));
  }
  const int64_t blocks = BlocksNeeded(model, r);
  if (blocks > model.options().num_kv_blocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the prompt (", r.prompt.size(), " tokens) and max_tokens (", r.max_tokens, ") need ", blocks,
        " KV blocks of ", model.options().kv_block_size, " tokens; the model has ", model.options().num_kv_blocks));
  }
  return r.sampling.Validate();
}

absl::StatusOr<std::vector<GenerationResult>> Generate(StepRunner& model, const std::vector<GenerationRequest>& requests,
                                                       const TokenCallback& on_token) {
  for (size_t i = 0; i < requests.size(); ++i) {
    if (auto st = ValidateRequest(model, requests[i]); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat("request ", i, ": ", st.message()));
    }
  }
  const int64_t ctx = model.options().max_seq_len;
  const int64_t budget = model.options().max_step_tokens;
  std::vector<GenerationResult> results(requests.size());
  std::deque<size_t> waiting;
  for (size_t i = 0; i < requests.size(); ++i) waiting.push_back(i);
  std::vector<int32_t> free_blocks;  // the lowest id at the back
  for (int64_t b = model.options().num_kv_blocks - 1; b >= 0; --b) free_blocks.push_back(static_cast<int32_t>(b));
  std::vector<Active> active;
  Sampler sampler;

  while (!waiting.empty() || !active.empty()) {
    while (!waiting.empty()) {
      const size_t i = waiting.front();
      const size_t need = static_cast<size_t>(BlocksNeeded(model, requests[i]));
      if (need > free_blocks.size()) break;  // FIFO: later requests wait too
      waiting.pop_front();
      Active a{.index = i, .context = requests[i].prompt};
      const SamplingParams& sp = requests[i].sampling;
      if (sp.HasPenalties()) a.history = TokenHistory(requests[i].prompt, sp.repetition_penalty != 1.0f);
      a.blocks.assign(free_blocks.end() - static_cast<std::ptrdiff_t>(need), free_blocks.end());
      std::reverse(a.blocks.begin(), a.blocks.end());
      free_blocks.resize(free_blocks.size() - need);
      active.push_back(std::move(a));
    }
    // Decodes first (one token each), then prefill chunks with what is left of the budget.
    std::vector<StepSequence> batch;
    std::vector<size_t> members;  // index into `active` per batch entry
    int64_t left = budget;
    for (int pass = 0; pass < 2 && left > 0; ++pass) {
      for (size_t a = 0; a < active.size() && left > 0; ++a) {
        Active& s = active[a];
        const int64_t pending = static_cast<int64_t>(s.context.size()) - s.consumed;
        const bool decoding = pending == 1;
        if ((pass == 0) != decoding) continue;
        const int64_t n = std::min(pending, left);
        const SamplingParams& sp = requests[s.index].sampling;
        StepSequence seq{.block_ids = s.blocks, .pos_begin = s.consumed, .greedy = sp.IsGreedy()};
        if (!seq.greedy && sp.IsPlain() && n == pending) {  // this step reaches the end: it samples
          seq.sampling = kernels::RowSamplingParams{.temperature = sp.temperature, .top_k = sp.top_k,
                                                    .top_p = sp.top_p, .min_p = sp.min_p, .seed = sp.seed,
                                                    .step = results[s.index].tokens.size()};
        }
        seq.tokens.assign(s.context.begin() + s.consumed, s.context.begin() + s.consumed + n);
        batch.push_back(std::move(seq));
        members.push_back(a);
        left -= n;
      }
    }
    ASSIGN_OR_RETURN(StepResult step, model.Step(batch));
    for (size_t b = 0; b < batch.size(); ++b) {
      Active& s = active[members[b]];
      s.consumed += static_cast<int32_t>(batch[b].tokens.size());
      if (s.consumed < static_cast<int32_t>(s.context.size())) continue;  // prompt chunk, not yet at the end
      const GenerationRequest& req = requests[s.index];
      GenerationResult& res = results[s.index];
      int32_t token;
      if (step.sampled_ids.size() > b && step.sampled_ids[b] >= 0) {
        token = step.sampled_ids[b];
      } else if (req.sampling.HasPenalties()) {
        SamplingParams params = req.sampling;
        params.history_ids = s.history.ids();
        params.history_counts = s.history.counts();
        token = sampler.Sample(step.logits[b], params, res.tokens.size());
      } else {
        token = sampler.Sample(step.logits[b], req.sampling, res.tokens.size());
      }
      if (req.sampling.HasPenalties()) s.history.AddGenerated(token);
      res.tokens.push_back(token);
      s.context.push_back(token);
      if (on_token) on_token(s.index, token);
      if (std::find(req.stop_ids.begin(), req.stop_ids.end(), token) != req.stop_ids.end()) {
        res.finish = FinishReason::kStop;
        s.done = true;
      } else if (static_cast<int32_t>(res.tokens.size()) >= req.max_tokens ||
                 static_cast<int64_t>(s.context.size()) >= ctx) {
        res.finish = FinishReason::kLength;
        s.done = true;
      }
    }
    for (const Active& s : active) {
      if (s.done) free_blocks.insert(free_blocks.end(), s.blocks.rbegin(), s.blocks.rend());
    }
    std::erase_if(active, [](const Active& s) { return s.done; });
  }
  return results;
}

}  // namespace shardserve::engine

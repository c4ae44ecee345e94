// shardserve-bench-grammar: the per-token cost of structured output on the coordinator (the
// allowed-token mask of the sequence's state, then advancing the state with the sampled token) at
// batch 1, on a synthetic 32k-token vocabulary (256 byte tokens plus word, number and punctuation
// pieces) or on a model directory's tokenizer (--model_dir).
//
// For each schema it runs `--sequences` random walks (a uniformly chosen allowed token per step,
// up to `--max_tokens` each) twice: "cold" includes computing the masks of newly visited automaton
// states; "warm" repeats the same walks with every mask cached (the steady state of a server that
// has seen the schema before).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/tokenizer/tokenizer.h"
#include "coordinator/structured/grammar.h"

ABSL_FLAG(std::string, model_dir, "", "use this model's tokenizer instead of the synthetic 32k vocabulary");
ABSL_FLAG(int32_t, vocab_size, 32000, "size of the synthetic vocabulary");
ABSL_FLAG(int32_t, sequences, 20, "random walks per schema");
ABSL_FLAG(int32_t, max_tokens, 256, "tokens per walk at most");

namespace shardserve::structured {
namespace {

TokenVocabulary SyntheticVocabulary(int32_t size) {
  TokenVocabulary v;
  v.bytes.resize(static_cast<size_t>(size));
  v.eos_ids = {2};
  std::mt19937 rng(1);
  int32_t id = 3;
  for (int b = 0; b < 256 && id < size; ++b) v.bytes[static_cast<size_t>(id++)] = std::string(1, static_cast<char>(b));
  const std::string punct[] = {"{\"", "\":", "\",\"", "\"}", "},", "[{", "}]", "\":\"", "\": ", ", \"", "\":[", "]}", "null", "true", "false", "\\n", "\\\""};
  for (const std::string& p : punct) {
    if (id < size) v.bytes[static_cast<size_t>(id++)] = p;
  }
  std::uniform_int_distribution<int> len(1, 10), letter(0, 25), digit(0, 9), kind(0, 9);
  while (id < size) {
    std::string s;
    const int k = kind(rng);
    if (k == 0) {
      for (int i = len(rng) % 4 + 1; i > 0; --i) s.push_back(static_cast<char>('0' + digit(rng)));
    } else {
      if (k < 6) s.push_back(' ');
      for (int i = len(rng); i > 0; --i) s.push_back(static_cast<char>('a' + letter(rng)));
    }
    v.bytes[static_cast<size_t>(id++)] = s;
  }
  return v;
}

int Main() {
  TokenVocabulary vocab;
  std::string label;
  if (const std::string dir = absl::GetFlag(FLAGS_model_dir); !dir.empty()) {
    absl::StatusOr<std::unique_ptr<Tokenizer>> t = LoadTokenizer(dir);
    if (!t.ok()) {
      std::fprintf(stderr, "%s\n", t.status().ToString().c_str());
      return 1;
    }
    vocab = VocabularyFromTokenizer(**t, (*t)->vocab_size());
    label = dir;
  } else {
    vocab = SyntheticVocabulary(absl::GetFlag(FLAGS_vocab_size));
    label = "synthetic";
  }
  const int32_t n_vocab = static_cast<int32_t>(vocab.bytes.size());
  ConstraintCompiler compiler(std::move(vocab));
  const std::vector<std::pair<std::string, ConstraintSpec>> cases = {
      {"json_object", {ConstraintKind::kJsonObject, ""}},
      {"person", {ConstraintKind::kJsonSchema,
                  R"({"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"},)"
                  R"("tags":{"type":"array","items":{"type":"string"},"maxItems":5},"email":{"type":"string"}},)"
                  R"("required":["name","age"],"additionalProperties":false})"}},
      {"nested", {ConstraintKind::kJsonSchema,
                  R"({"type":"object","properties":{"id":{"type":"integer"},"items":{"type":"array","items":)"
                  R"({"type":"object","properties":{"sku":{"type":"string"},"qty":{"type":"number"},)"
                  R"("kind":{"enum":["a","b","c"]}},"required":["sku","qty","kind"]}}},"required":["id","items"]})"}},
      {"regex_date", {ConstraintKind::kRegex, R"(\d{4}-\d{2}-\d{2}( [a-z ]{0,40})?)"}},
  };
  std::printf("vocabulary: %s, %d ids; batch 1\n", label.c_str(), n_vocab);
  std::printf("%-12s %10s %8s %8s %12s %12s %10s %14s\n", "constraint", "compile_ms", "states", "tokens", "cold_us/tok",
              "warm_us/tok", "masks", "max_mask_us");
  for (const auto& [name, spec] : cases) {
    const auto t0 = std::chrono::steady_clock::now();
    auto g = compiler.CompileGrammar(spec);
    const auto t1 = std::chrono::steady_clock::now();
    if (!g.ok()) {
      std::fprintf(stderr, "%s: %s\n", name.c_str(), g.status().ToString().c_str());
      return 1;
    }
    const GrammarConstraint& c = **g;
    // The walks: the tokens chosen in the cold pass are replayed in the warm pass.
    std::mt19937 rng(7);
    std::vector<std::vector<int32_t>> walks;
    double cold = 0, warm = 0, max_mask = 0;  // max_mask: the slowest single mask (a cold state)
    int64_t tokens = 0;
    std::vector<int32_t> allowed;
    for (int32_t w = 0; w < absl::GetFlag(FLAGS_sequences); ++w) {
      std::vector<int32_t> walk;
      int32_t s = c.StartState();
      for (int32_t i = 0; i < absl::GetFlag(FLAGS_max_tokens) && !c.IsFinished(s); ++i) {
        const auto a = std::chrono::steady_clock::now();
        std::shared_ptr<const std::string> mask = c.AllowedMask(s);
        const auto b = std::chrono::steady_clock::now();
        allowed.clear();  // the sampler's job, not timed
        for (int32_t id = 0; id < n_vocab; ++id) {
          if (((*mask)[static_cast<size_t>(id) / 8] >> (id % 8)) & 1) allowed.push_back(id);
        }
        const int32_t tok = allowed[std::uniform_int_distribution<size_t>(0, allowed.size() - 1)(rng)];
        const auto d = std::chrono::steady_clock::now();
        s = c.Advance(s, tok);
        const auto e = std::chrono::steady_clock::now();
        if (s < 0) {
          std::fprintf(stderr, "%s: an allowed token was refused\n", name.c_str());
          return 1;
        }
        const double mask_us = std::chrono::duration<double, std::micro>(b - a).count();
        max_mask = std::max(max_mask, mask_us);
        cold += mask_us + std::chrono::duration<double, std::micro>(e - d).count();
        walk.push_back(tok);
        ++tokens;
      }
      walks.push_back(std::move(walk));
    }
    for (const auto& walk : walks) {
      int32_t s = c.StartState();
      const auto a = std::chrono::steady_clock::now();
      for (int32_t tok : walk) {
        std::shared_ptr<const std::string> mask = c.AllowedMask(s);
        if (mask->empty()) return 1;
        s = c.Advance(s, tok);
      }
      warm += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - a).count();
    }
    std::printf("%-12s %10.2f %8d %8lld %12.2f %12.3f %10d %14.1f\n", name.c_str(),
                std::chrono::duration<double, std::milli>(t1 - t0).count(), c.dfa().num_states(),
                static_cast<long long>(tokens), cold / static_cast<double>(tokens), warm / static_cast<double>(tokens),
                c.CachedMasksForTest(), max_mask);
  }
  return 0;
}

}  // namespace
}  // namespace shardserve::structured

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return shardserve::structured::Main();
}

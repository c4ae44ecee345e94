// Encode throughput of each tokenizer implementation on about 1 MB of text (prose, and random
// words that defeat the per-call word cache), plus whole-sequence and streamed decode of the
// prose's ids. Run from the repository root:
//
//   build/bin/shardserve-bench-tokenizer
//
// MB is 10^6 bytes of UTF-8 input. Each figure is the best of several runs (at least 3, and at
// least about a second of work), single-threaded.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/tokenizer/sentencepiece_tokenizer.h"
#include "common/tokenizer/tokenizer.h"
#include "common/tokenizer/tokenizer_config.h"

namespace shardserve {
namespace {

// Mostly English prose (what prompts mostly are), with some code, numbers and other scripts.
std::string MakeText(size_t bytes) {
  static const char* const kParagraphs[] = {
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
      "friends. One day, she saw a big red ball under a tree and wanted to play with it, but it was too high. ",
      "The quick brown fox jumps over the lazy dog. I'm sure you'll see that they've gone home; we'd like it if "
      "you're there too, and he'll be happy to help. ",
      "def square(x):\n    return x * x  # the square\n\nfor i in range(10):\n    print(i, square(i))\n",
      "It's 2024 and the year has 365 days, 12 months and 52 weeks. Call 555-0123 before 10:30 am, or pay "
      "$19.99 (about 42%) online. ",
      "Le café est très bon. Nous sommes allés à la plage, et c'était génial ! Die Größe der Straße überrascht "
      "mich. ",
      "你好，世界。今天天气很好，我们去公园散步吧。日本語のテキストです。 Emoji: 😀 🚀 👍 and more.\n\n",
      "Tom and Ben went to the shop to buy some milk and bread. They had fun on the way home, and the sun "
      "was shining while the birds were singing in the tall green trees. ",
  };
  std::string text;
  text.reserve(bytes + 512);
  for (size_t i = 0; text.size() < bytes; ++i) {
    text += kParagraphs[i % (sizeof(kParagraphs) / sizeof(kParagraphs[0]))];
    if (i % 7 == 6) text += "Chapter " + std::to_string(i / 7) + ".\n";
  }
  return text;
}

// Words of random letters (a few accented) with random punctuation and numbers: nearly every word
// is new, so this is the worst case for the per-call word cache.
std::string MakeRandomWords(size_t bytes) {
  static const char* const kLetters[] = {"a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n",
                                         "o", "p", "q", "r", "s", "t", "u", "v", "w", "x", "y", "z", "é", "ö"};
  static const char* const kSeparators[] = {" ", " ", " ", " ", " ", ", ", ". ", "\n", "  ", "? "};
  std::mt19937 rng(42);
  std::string text;
  text.reserve(bytes + 64);
  while (text.size() < bytes) {
    const int len = 1 + static_cast<int>(rng() % 9);
    for (int i = 0; i < len; ++i) text += kLetters[rng() % 28];
    if (rng() % 11 == 0) text += std::to_string(rng() % 100000);
    text += kSeparators[rng() % 10];
  }
  return text;
}

// Best seconds per call of `fn` over at least 3 runs and about `min_seconds` in total.
double BestSeconds(const std::function<void()>& fn, double min_seconds = 1.0) {
  using Clock = std::chrono::steady_clock;
  double best = 1e30;
  double total = 0;
  for (int run = 0; run < 3 || total < min_seconds; ++run) {
    const auto start = Clock::now();
    fn();
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    best = std::min(best, s);
    total += s;
    if (run > 50) break;
  }
  return best;
}

struct Candidate {
  const char* name;
  std::string dir;
  bool tokenizer_model;  // load tokenizer.model even when tokenizer.json exists
};

int Run() {
  const std::string text = MakeText(1'000'000);
  const std::string random_words = MakeRandomWords(1'000'000);
  const double mb = static_cast<double>(text.size()) / 1e6;
  const double random_mb = static_cast<double>(random_words.size()) / 1e6;
  const std::string g = "tests/golden/tokenizers/";
  const std::string stories = "../shared/models/stories260K";
  const Candidate candidates[] = {
      {"HF byte-level BPE, Llama-3 regex (bytelevel_llama3)", g + "bytelevel_llama3", false},
      {"HF byte-level BPE, GPT-2 regex (bytelevel_gpt2)", g + "bytelevel_gpt2", false},
      {"HF byte-level BPE, NFC + Qwen2 regex (bytelevel_qwen2)", g + "bytelevel_qwen2", false},
      {"HF Metaspace BPE + byte fallback (metaspace_bytefallback)", g + "metaspace_bytefallback", false},
      {"HF legacy Llama BPE, no pre-tokenizer (stories260K json)", stories, false},
      {"SentencePiece BPE, native (spm_llama2)", g + "spm_llama2", false},
      {"SentencePiece BPE + charsmap, native (spm_charsmap)", g + "spm_charsmap", false},
      {"SentencePiece BPE, native (stories260K tokenizer.model)", stories, true},
  };
  std::printf("prose: %zu bytes of UTF-8 (mostly English, some code, numbers, accents, CJK, emoji)\n", text.size());
  std::printf("random: %zu bytes of random words (worst case for the word cache)\n\n", random_words.size());
  std::printf("%-58s %9s %9s %9s %9s %9s %9s\n", "tokenizer", "tokens", "prose", "random", "encode", "decode",
              "stream");
  std::printf("%-58s %9s %9s %9s %9s %9s %9s\n", "", "(prose)", "MB/s", "MB/s", "Mtok/s", "Mtok/s", "Mtok/s");
  for (const Candidate& c : candidates) {
    if (!std::filesystem::exists(c.dir)) {
      std::printf("%-58s (skipped: %s not found)\n", c.name, c.dir.c_str());
      continue;
    }
    absl::StatusOr<std::unique_ptr<Tokenizer>> loaded;
    if (c.tokenizer_model) {
      absl::StatusOr<TokenizerConfig> config = LoadTokenizerConfig(c.dir);
      if (!config.ok()) {
        std::printf("%-58s error: %s\n", c.name, std::string(config.status().message()).c_str());
        return 1;
      }
      loaded = LoadSentencePieceTokenizer(c.dir + "/tokenizer.model", *config);
    } else {
      loaded = LoadTokenizer(c.dir);
    }
    if (!loaded.ok()) {
      std::printf("%-58s error: %s\n", c.name, std::string(loaded.status().message()).c_str());
      return 1;
    }
    const Tokenizer& tok = **loaded;
    std::vector<int32_t> ids;
    bool ok = true;
    const double encode_s = BestSeconds([&] {
      absl::StatusOr<std::vector<int32_t>> r = tok.Encode(text, /*add_special_tokens=*/false);
      ok = ok && r.ok();
      if (r.ok()) ids = *std::move(r);
    });
    const double random_s = BestSeconds([&] {
      absl::StatusOr<std::vector<int32_t>> r = tok.Encode(random_words, /*add_special_tokens=*/false);
      ok = ok && r.ok();
    });
    size_t decoded_bytes = 0;
    const double decode_s = BestSeconds([&] {
      absl::StatusOr<std::string> r = tok.Decode(ids, /*skip_special_tokens=*/true);
      ok = ok && r.ok();
      if (r.ok()) decoded_bytes = r->size();
    });
    size_t streamed_bytes = 0;
    const double stream_s = BestSeconds([&] {
      std::unique_ptr<StreamDecoder> stream = tok.NewStreamDecoder(/*skip_special_tokens=*/true);
      streamed_bytes = 0;
      for (int32_t id : ids) {
        absl::StatusOr<std::string> piece = stream->Next(id);
        ok = ok && piece.ok();
        if (piece.ok()) streamed_bytes += piece->size();
      }
      streamed_bytes += stream->Finish().size();
    });
    if (!ok || streamed_bytes != decoded_bytes) {
      std::printf("%-58s error: encode/decode failed or stream and decode disagree\n", c.name);
      return 1;
    }
    const double n = static_cast<double>(ids.size());
    std::printf("%-58s %9zu %9.2f %9.2f %9.3f %9.3f %9.3f\n", c.name, ids.size(), mb / encode_s, random_mb / random_s,
                n / encode_s / 1e6, n / decode_s / 1e6, n / stream_s / 1e6);
  }
  return 0;
}

}  // namespace
}  // namespace shardserve

int main() { return shardserve::Run(); }

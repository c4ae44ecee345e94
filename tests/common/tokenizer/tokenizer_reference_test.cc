// Exactness against the Hugging Face reference: for every committed reference file
// (tests/golden/tokenizers/, written by make_tokenizer_reference.py with the `tokenizers`,
// `transformers` and `sentencepiece` Python packages), each test string must encode to identical
// ids with and without special tokens, and the ids must decode (at once and streamed one id at a
// time) to the reference text, with and without skip_special_tokens.
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/tokenizer/sentencepiece_tokenizer.h"
#include "common/tokenizer/tokenizer.h"
#include "common/tokenizer/tokenizer_config.h"
#include "common/tokenizer/utf8.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace shardserve {
namespace {

using json = nlohmann::json;

constexpr char kGolden[] = "tests/golden/tokenizers";
constexpr char kStories[] = "../shared/models/stories260K";

struct ReferenceSet {
  const char* name;
  std::string model_dir;
  std::string reference;
  TokenizerKind kind;
  bool load_tokenizer_model;  // load tokenizer.model even though tokenizer.json is present
};

std::vector<ReferenceSet> ReferenceSets() {
  const std::string g = kGolden;
  return {
      {"bytelevel_gpt2", g + "/bytelevel_gpt2", g + "/bytelevel_gpt2/reference.json", TokenizerKind::kHfBpe, false},
      {"bytelevel_llama3", g + "/bytelevel_llama3", g + "/bytelevel_llama3/reference.json", TokenizerKind::kHfBpe,
       false},
      {"bytelevel_qwen2", g + "/bytelevel_qwen2", g + "/bytelevel_qwen2/reference.json", TokenizerKind::kHfBpe, false},
      {"metaspace_bytefallback", g + "/metaspace_bytefallback", g + "/metaspace_bytefallback/reference.json",
       TokenizerKind::kHfBpe, false},
      {"spm_llama2", g + "/spm_llama2", g + "/spm_llama2/reference.json", TokenizerKind::kSentencePiece, false},
      {"spm_charsmap", g + "/spm_charsmap", g + "/spm_charsmap/reference.json", TokenizerKind::kSentencePiece, false},
      {"stories260K_hf", kStories, g + "/stories260K_hf_reference.json", TokenizerKind::kHfBpe, false},
      {"stories260K_spm", kStories, g + "/stories260K_spm_reference.json", TokenizerKind::kSentencePiece, true},
  };
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string Streamed(const Tokenizer& tok, const std::vector<int32_t>& ids, bool skip_special) {
  std::unique_ptr<StreamDecoder> stream = tok.NewStreamDecoder(skip_special);
  std::string text;
  for (int32_t id : ids) {
    absl::StatusOr<std::string> piece = stream->Next(id);
    EXPECT_TRUE(piece.ok()) << piece.status();
    if (piece.ok()) text += *piece;
  }
  return text + stream->Finish();
}

// Byte-level vocabularies spell the space byte as "Ġ".
bool IsByteLevel(const Tokenizer& tok) { return tok.PieceToId("\xC4\xA0").has_value(); }

// The set's tokenizer: its tokenizer.model when the set says so, else what LoadTokenizer picks.
absl::StatusOr<std::unique_ptr<Tokenizer>> Load(const ReferenceSet& set) {
  if (!set.load_tokenizer_model) return LoadTokenizer(set.model_dir);
  absl::StatusOr<TokenizerConfig> config = LoadTokenizerConfig(set.model_dir);
  if (!config.ok()) return config.status();
  return LoadSentencePieceTokenizer(set.model_dir + "/tokenizer.model", *config);
}

class TokenizerReferenceTest : public ::testing::TestWithParam<ReferenceSet> {};

TEST_P(TokenizerReferenceTest, IdsAndTextMatchHuggingFace) {
  const ReferenceSet& set = GetParam();
  if (!std::filesystem::exists(set.model_dir)) GTEST_SKIP() << set.model_dir << " is not available";
  absl::StatusOr<std::unique_ptr<Tokenizer>> loaded = Load(set);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const Tokenizer& tok = **loaded;
  EXPECT_EQ(tok.kind(), set.kind);

  const json ref = json::parse(ReadAll(set.reference), nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(ref.is_discarded()) << set.reference;
  ASSERT_TRUE(ref.contains("cases") && ref["cases"].is_array());
  int checked = 0;
  int mismatched = 0;
  for (const json& c : ref["cases"]) {
    const std::string text = c["text"].get<std::string>();
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    const auto plain = c["ids_no_special"].get<std::vector<int32_t>>();
    const std::string decoded = c["decoded"].get<std::string>();
    const std::string decoded_skip = c["decoded_skip_special"].get<std::string>();
    SCOPED_TRACE(::testing::Message() << set.name << " text=\"" << text << "\"");

    absl::StatusOr<std::vector<int32_t>> got = tok.Encode(text, /*add_special_tokens=*/true);
    absl::StatusOr<std::vector<int32_t>> got_plain = tok.Encode(text, /*add_special_tokens=*/false);
    absl::StatusOr<std::string> text_all = tok.Decode(ids, /*skip_special_tokens=*/false);
    absl::StatusOr<std::string> text_skip = tok.Decode(ids, /*skip_special_tokens=*/true);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_TRUE(got_plain.ok()) << got_plain.status();
    ASSERT_TRUE(text_all.ok()) << text_all.status();
    ASSERT_TRUE(text_skip.ok()) << text_skip.status();
    const std::string streamed = Streamed(tok, ids, /*skip_special=*/false);
    const std::string streamed_skip = Streamed(tok, ids, /*skip_special=*/true);
    EXPECT_EQ(*got, ids);
    EXPECT_EQ(*got_plain, plain);
    EXPECT_EQ(*text_all, decoded);
    EXPECT_EQ(*text_skip, decoded_skip);
    EXPECT_EQ(streamed, decoded);
    EXPECT_EQ(streamed_skip, decoded_skip);
    ++checked;
    if (*got != ids || *got_plain != plain || *text_all != decoded || *text_skip != decoded_skip ||
        streamed != decoded || streamed_skip != decoded_skip) {
      ++mismatched;
    }
  }
  EXPECT_GE(checked, 40);
  std::printf("[ reference ] %s: %d strings, %d with a mismatch\n", set.name, checked, mismatched);

  // Random id sequences (stray byte tokens, special tokens anywhere): Decode must match exactly.
  // Streaming must too, except where a run of <0xXX> tokens mixes valid characters and invalid
  // bytes (see internal/decoder.h): then the stream keeps the valid characters.
  ASSERT_TRUE(ref.contains("decode_cases") && ref["decode_cases"].is_array());
  int decodes = 0;
  int stream_compared = 0;
  for (const json& c : ref["decode_cases"]) {
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    for (const bool skip : {false, true}) {
      const std::string expected = c[skip ? "decoded_skip_special" : "decoded"].get<std::string>();
      SCOPED_TRACE(::testing::Message() << set.name << " decode case " << decodes << " skip=" << skip);
      absl::StatusOr<std::string> text = tok.Decode(ids, skip);
      ASSERT_TRUE(text.ok()) << text.status();
      EXPECT_EQ(*text, expected);
      const bool may_differ = tok.kind() == TokenizerKind::kHfBpe && !IsByteLevel(tok) &&
                              expected.find("\xEF\xBF\xBD") != std::string::npos;
      if (!may_differ) {
        EXPECT_EQ(Streamed(tok, ids, skip), expected);
        ++stream_compared;
      }
    }
    ++decodes;
  }
  std::printf("[ reference ] %s: %d random id sequences decoded (%d streams compared)\n", set.name, decodes,
              stream_compared);
}

// A decoder primed with a prompt (StreamDecoder::Prime) streams the rest as transformers'
// text-generation pipeline and vLLM cut a completion from its prompt: Decode(prompt + rest) less
// the first Decode(prompt).size() bytes (Decode is checked against Hugging Face above). Every split
// of every reference string whose decodes are valid UTF-8 is tried. A clone taken before each id
// returns what the decoder then returns for it.
TEST_P(TokenizerReferenceTest, APrimedDecoderContinuesThePromptAndAClonePredictsTheNextText) {
  const ReferenceSet& set = GetParam();
  if (!std::filesystem::exists(set.model_dir)) GTEST_SKIP() << set.model_dir << " is not available";
  absl::StatusOr<std::unique_ptr<Tokenizer>> loaded = Load(set);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const Tokenizer& tok = **loaded;
  const json ref = json::parse(ReadAll(set.reference), nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(ref.is_discarded()) << set.reference;
  int splits = 0, kept_space = 0;
  for (const json& c : ref["cases"]) {
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    for (size_t k = 1; k < ids.size(); ++k) {
      const absl::Span<const int32_t> prompt = absl::MakeConstSpan(ids).subspan(0, k);
      const absl::Span<const int32_t> rest = absl::MakeConstSpan(ids).subspan(k);
      absl::StatusOr<std::string> head = tok.Decode(prompt, /*skip_special_tokens=*/true);
      absl::StatusOr<std::string> whole = tok.Decode(ids, /*skip_special_tokens=*/true);
      ASSERT_TRUE(head.ok() && whole.ok());
      if (!ValidateUtf8(*head).ok() || head->find("\xEF\xBF\xBD") != std::string::npos) continue;  // ends mid-character
      ASSERT_TRUE(whole->starts_with(*head)) << set.name << " split " << k;
      SCOPED_TRACE(::testing::Message() << set.name << " \"" << *whole << "\" split after " << k << " ids");
      std::unique_ptr<StreamDecoder> stream = tok.NewStreamDecoder(/*skip_special_tokens=*/true);
      ASSERT_TRUE(stream->Prime(prompt).ok());
      std::string text;
      for (int32_t id : rest) {
        const std::unique_ptr<StreamDecoder> clone = stream->Clone();
        absl::StatusOr<std::string> predicted = clone->Next(id);
        absl::StatusOr<std::string> piece = stream->Next(id);
        ASSERT_TRUE(predicted.ok() && piece.ok());
        EXPECT_EQ(*predicted, *piece);
        text += *piece;
      }
      text += stream->Finish();
      EXPECT_EQ(text, whole->substr(head->size()));
      ++splits;
      kept_space += !head->empty() && text.starts_with(' ') ? 1 : 0;
    }
  }
  EXPECT_GE(splits, 100);
  // SentencePiece-style vocabularies drop the space of a text's first word, so a continuation that
  // starts with a word shows the rule at work.
  if (!IsByteLevel(tok)) {
    EXPECT_GT(kept_space, 0);
  }
  std::printf("[ reference ] %s: %d splits continued, %d starting with a kept space\n", set.name, splits, kept_space);
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, TokenizerReferenceTest, ::testing::ValuesIn(ReferenceSets()),
                         [](const ::testing::TestParamInfo<ReferenceSet>& param_info) {
                           return param_info.param.name;
                         });

}  // namespace
}  // namespace shardserve

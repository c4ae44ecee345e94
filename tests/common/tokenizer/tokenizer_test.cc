// Loading, bad input and streaming behaviour of the tokenizers. Exactness against Hugging Face is in
// tokenizer_reference_test.cc.
#include "common/tokenizer/tokenizer.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/tokenizer/hf_bpe_tokenizer.h"
#include "common/tokenizer/sentencepiece_tokenizer.h"
#include "common/tokenizer/tokenizer_config.h"
#include "common/tokenizer/utf8.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardserve {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr char kLlama3[] = "tests/golden/tokenizers/bytelevel_llama3";
constexpr char kGpt2[] = "tests/golden/tokenizers/bytelevel_gpt2";
constexpr char kQwen2[] = "tests/golden/tokenizers/bytelevel_qwen2";
constexpr char kMetaspace[] = "tests/golden/tokenizers/metaspace_bytefallback";
constexpr char kSpm[] = "tests/golden/tokenizers/spm_llama2";
constexpr char kSpmCharsmap[] = "tests/golden/tokenizers/spm_charsmap";
constexpr char kStories[] = "../shared/models/stories260K";

std::unique_ptr<Tokenizer> Load(const std::string& dir) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = LoadTokenizer(dir);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *std::move(t) : nullptr;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteAll(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A fresh empty directory under the test's temp dir, removed again at the end of the test.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& name)
      : path_((fs::path(::testing::TempDir()) / ("tokenizer_test_" + name + "_" + std::to_string(getpid()))).string()) {
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::vector<int32_t> Ids(const Tokenizer& t, std::string_view text, bool special = false) {
  absl::StatusOr<std::vector<int32_t>> ids = t.Encode(text, special);
  EXPECT_TRUE(ids.ok()) << ids.status();
  return ids.ok() ? *ids : std::vector<int32_t>();
}

// Streams `ids`; returns each Next() result (and Finish() last).
std::vector<std::string> StreamPieces(const Tokenizer& t, const std::vector<int32_t>& ids, bool skip_special) {
  std::unique_ptr<StreamDecoder> stream = t.NewStreamDecoder(skip_special);
  std::vector<std::string> pieces;
  for (int32_t id : ids) {
    absl::StatusOr<std::string> piece = stream->Next(id);
    EXPECT_TRUE(piece.ok()) << piece.status();
    pieces.push_back(piece.ok() ? *piece : "<error>");
  }
  pieces.push_back(stream->Finish());
  return pieces;
}

std::string Join(const std::vector<std::string>& pieces) {
  std::string s;
  for (const std::string& p : pieces) s += p;
  return s;
}

// ---------------------------------------------------------------------------------------------
// Choosing the implementation.

TEST(LoadTokenizerTest, PrefersTokenizerJsonWhenBothArePresent) {
  if (!fs::exists(kStories)) GTEST_SKIP() << kStories << " is not available";
  std::unique_ptr<Tokenizer> t = Load(kStories);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->kind(), TokenizerKind::kHfBpe);
  EXPECT_THAT(t->source(), HasSubstr("tokenizer.json"));
  EXPECT_EQ(t->vocab_size(), 512);
  EXPECT_EQ(t->bos_id(), 1);
  EXPECT_THAT(t->eos_ids(), ElementsAre(2));
}

TEST(LoadTokenizerTest, UsesTokenizerModelWhenItIsTheOnlyOne) {
  std::unique_ptr<Tokenizer> t = Load(kSpm);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->kind(), TokenizerKind::kSentencePiece);
  EXPECT_THAT(t->source(), HasSubstr("tokenizer.model"));
  EXPECT_EQ(t->bos_id(), 1);
  EXPECT_THAT(t->eos_ids(), ElementsAre(2));
}

TEST(LoadTokenizerTest, DirectoryWithoutTokenizerIsNotFound) {
  const ScratchDir scratch("empty");
  const std::string& dir = scratch.path();
  WriteAll(dir + "/config.json", "{}");
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = LoadTokenizer(dir);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(t.status().message(), HasSubstr(dir));
  EXPECT_THAT(t.status().message(), HasSubstr("no tokenizer.json or tokenizer.model"));
}

TEST(LoadTokenizerTest, MissingDirectoryIsNotFound) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = LoadTokenizer("tests/golden/tokenizers/no_such_dir");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
}

// ---------------------------------------------------------------------------------------------
// Corrupt files: the error names the file.

TEST(LoadTokenizerTest, TruncatedTokenizerJsonNamesTheFile) {
  const ScratchDir scratch("truncated_json");
  const std::string& dir = scratch.path();
  const std::string text = ReadAll(std::string(kLlama3) + "/tokenizer.json");
  WriteAll(dir + "/tokenizer.json", text.substr(0, text.size() / 2));
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = LoadTokenizer(dir);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr(dir + "/tokenizer.json"));
  EXPECT_THAT(t.status().message(), HasSubstr("not valid JSON"));
}

TEST(LoadTokenizerTest, TruncatedTokenizerModelNamesTheFile) {
  const ScratchDir scratch("truncated_model");
  const std::string& dir = scratch.path();
  const std::string bytes = ReadAll(std::string(kSpm) + "/tokenizer.model");
  WriteAll(dir + "/tokenizer.model", bytes.substr(0, bytes.size() / 2));
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = LoadTokenizer(dir);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr(dir + "/tokenizer.model"));
}

TEST(LoadTokenizerTest, GarbageTokenizerModelNamesTheFile) {
  const ScratchDir scratch("garbage_model");
  const std::string& dir = scratch.path();
  WriteAll(dir + "/tokenizer.model", "this is not a protobuf \xff\xfe\x01\x02 at all");
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = LoadTokenizer(dir);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr(dir + "/tokenizer.model"));
}

TEST(LoadTokenizerTest, EmptyTokenizerModelNamesTheFile) {
  const ScratchDir scratch("empty_model");
  const std::string& dir = scratch.path();
  WriteAll(dir + "/tokenizer.model", "");
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = LoadTokenizer(dir);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr(dir + "/tokenizer.model"));
}

TEST(LoadTokenizerTest, MalformedTokenizerConfigNamesTheFile) {
  const ScratchDir scratch("bad_config");
  const std::string& dir = scratch.path();
  fs::copy_file(std::string(kLlama3) + "/tokenizer.json", dir + "/tokenizer.json");
  WriteAll(dir + "/tokenizer_config.json", "{\"add_bos_token\": \"yes\"}");
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = LoadTokenizer(dir);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr(dir + "/tokenizer_config.json"));
  EXPECT_THAT(t.status().message(), HasSubstr("add_bos_token"));
}

TEST(LoadTokenizerTest, EosTokenOutsideTheVocabularyIsAnError) {
  const ScratchDir scratch("bad_eos");
  const std::string& dir = scratch.path();
  fs::copy_file(std::string(kLlama3) + "/tokenizer.json", dir + "/tokenizer.json");
  WriteAll(dir + "/tokenizer_config.json", "{\"eos_token\": \"<|not_a_token|>\"}");
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = LoadTokenizer(dir);
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("<|not_a_token|>"));
  EXPECT_THAT(t.status().message(), HasSubstr("tokenizer_config.json"));
}

// Each case edits one part of a valid tokenizer.json.
struct BadJsonCase {
  const char* name;
  std::string from;
  std::string to;
  absl::StatusCode code;
  const char* message;
};

class BadTokenizerJsonTest : public ::testing::TestWithParam<BadJsonCase> {};

TEST_P(BadTokenizerJsonTest, IsRejectedWithTheFileAndThePlace) {
  const BadJsonCase& c = GetParam();
  std::string text = ReadAll(std::string(kMetaspace) + "/tokenizer.json");
  const size_t at = text.find(c.from);
  ASSERT_NE(at, std::string::npos) << c.from;
  text.replace(at, c.from.size(), c.to);
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = ParseHfBpeTokenizer(text, "dir/tokenizer.json", TokenizerConfig());
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), c.code) << t.status();
  EXPECT_THAT(t.status().message(), HasSubstr("dir/tokenizer.json"));
  EXPECT_THAT(t.status().message(), HasSubstr(c.message));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, BadTokenizerJsonTest,
    ::testing::Values(BadJsonCase{"UnigramModel", "\"type\":\"BPE\"", "\"type\":\"Unigram\"",
                                  absl::StatusCode::kUnimplemented, "only BPE models"},
                      BadJsonCase{"MergeOfUnknownToken", "\"merges\":[[", "\"merges\":[[\"nope\",\"x\"],[",
                                  absl::StatusCode::kInvalidArgument, "model.merges[0]"},
                      BadJsonCase{"NegativeVocabId", "\"<unk>\":0", "\"<unk>\":-5", absl::StatusCode::kInvalidArgument,
                                  "model.vocab"},
                      BadJsonCase{"DuplicateVocabId", "\"<s>\":1", "\"<s>\":0", absl::StatusCode::kInvalidArgument,
                                  "gives id 0"},
                      BadJsonCase{"UnknownPreTokenizer", "\"type\":\"Metaspace\"", "\"type\":\"BertPreTokenizer\"",
                                  absl::StatusCode::kUnimplemented, "pre_tokenizer"},
                      BadJsonCase{"UnknownDecoder", "\"type\":\"Fuse\"", "\"type\":\"CTC\"",
                                  absl::StatusCode::kUnimplemented, "decoder.decoders[2]"},
                      BadJsonCase{"AddedTokenWithoutContent", "\"content\":\"<unk>\"", "\"content\":7",
                                  absl::StatusCode::kInvalidArgument, "added_tokens[0].content"},
                      BadJsonCase{"PostProcessorIdOutOfRange", "\"ids\":[1]", "\"ids\":[99999]",
                                  absl::StatusCode::kInvalidArgument, "post_processor"},
                      BadJsonCase{"BadRegex", "\"type\":\"Metaspace\",\"replacement\"",
                                  "\"type\":\"Split\",\"pattern\":{\"Regex\":\"(\"},\"behavior\":\"Isolated\",\"r\"",
                                  absl::StatusCode::kInvalidArgument, "does not compile"}),
    [](const ::testing::TestParamInfo<BadJsonCase>& param_info) { return param_info.param.name; });

TEST(LoadTokenizerTest, DeeplyNestedComponentsAreRejected) {
  std::string text = ReadAll(std::string(kMetaspace) + "/tokenizer.json");
  const std::string from = "\"normalizer\":null";
  const size_t at = text.find(from);
  ASSERT_NE(at, std::string::npos);
  std::string nested;
  for (int i = 0; i < 5000; ++i) nested += "{\"type\":\"Sequence\",\"normalizers\":[";
  for (int i = 0; i < 5000; ++i) nested += "]}";
  text.replace(at, from.size(), "\"normalizer\":" + nested);
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = ParseHfBpeTokenizer(text, "dir/tokenizer.json", TokenizerConfig());
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("nested too deeply"));
}

// ---------------------------------------------------------------------------------------------
// Bad input at run time.

class AllTokenizersTest : public ::testing::TestWithParam<const char*> {};

TEST_P(AllTokenizersTest, InvalidUtf8IsRejectedWithItsOffset) {
  std::unique_ptr<Tokenizer> t = Load(GetParam());
  ASSERT_NE(t, nullptr);
  for (const auto& [text, offset] : std::vector<std::pair<std::string, std::string>>{
           {"abc\xff"
            "def",
            "byte offset 3"},
           {"ok \xC3\x28", "byte offset 4"},           // bad continuation byte
           {"\xED\xA0\x80", "byte offset 1"},          // UTF-16 surrogate
           {"\xC0\xAF", "byte offset 0"},              // overlong '/'
           {"trailing \xE4\xB8", "byte offset 9"}}) {  // truncated at the end
    absl::StatusOr<std::vector<int32_t>> ids = t->Encode(text, true);
    ASSERT_FALSE(ids.ok()) << text;
    EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(ids.status().message(), HasSubstr("UTF-8"));
    EXPECT_THAT(ids.status().message(), HasSubstr(offset));
  }
}

TEST_P(AllTokenizersTest, IdsOutsideTheVocabularyAreRejected) {
  std::unique_ptr<Tokenizer> t = Load(GetParam());
  ASSERT_NE(t, nullptr);
  for (int32_t bad : {-1, t->vocab_size(), t->vocab_size() + 1000}) {
    const std::string id_text = "token id " + std::to_string(bad);
    absl::StatusOr<std::string> text = t->Decode(std::vector<int32_t>{5, bad}, false);
    ASSERT_FALSE(text.ok());
    EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(text.status().message(), HasSubstr(id_text));
    absl::StatusOr<std::string> piece = t->IdToPiece(bad);
    ASSERT_FALSE(piece.ok());
    EXPECT_THAT(piece.status().message(), HasSubstr(id_text));
    std::unique_ptr<StreamDecoder> stream = t->NewStreamDecoder(true);
    absl::StatusOr<std::string> next = stream->Next(bad);
    ASSERT_FALSE(next.ok());
    EXPECT_EQ(next.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(next.status().message(), HasSubstr(id_text));
  }
}

TEST_P(AllTokenizersTest, PiecesRoundTrip) {
  std::unique_ptr<Tokenizer> t = Load(GetParam());
  ASSERT_NE(t, nullptr);
  for (int32_t id = 0; id < t->vocab_size(); ++id) {
    absl::StatusOr<std::string> piece = t->IdToPiece(id);
    ASSERT_TRUE(piece.ok()) << piece.status();
    EXPECT_EQ(t->PieceToId(*piece), id) << *piece;
  }
  EXPECT_EQ(t->PieceToId("this is certainly not a token"), std::nullopt);
}

// Streaming any id sequence gives Decode()'s text whenever it is valid UTF-8 (for SentencePiece
// and byte-level BPE even with invalid bytes: both replace them the same way), and never splits a
// character.
TEST_P(AllTokenizersTest, StreamOfRandomIdsMatchesDecode) {
  std::unique_ptr<Tokenizer> t = Load(GetParam());
  ASSERT_NE(t, nullptr);
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int32_t> any_id(0, t->vocab_size() - 1);
  int compared = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<int32_t> ids(1 + trial % 24);
    for (int32_t& id : ids) id = any_id(rng);
    for (bool skip : {false, true}) {
      absl::StatusOr<std::string> decoded = t->Decode(ids, skip);
      ASSERT_TRUE(decoded.ok()) << decoded.status();
      const std::vector<std::string> pieces = StreamPieces(*t, ids, skip);
      for (const std::string& p : pieces) EXPECT_TRUE(ValidateUtf8(p).ok());
      const std::string streamed = Join(pieces);
      const bool exact_always =
          t->kind() == TokenizerKind::kSentencePiece || std::string(GetParam()).find("bytelevel") != std::string::npos;
      if (exact_always || decoded->find(kUtf8Replacement) == std::string::npos) {
        EXPECT_EQ(streamed, *decoded) << "trial " << trial << " skip " << skip;
        ++compared;
      }
    }
  }
  EXPECT_GT(compared, 100);
}

INSTANTIATE_TEST_SUITE_P(Dirs, AllTokenizersTest,
                         ::testing::Values(kGpt2, kLlama3, kQwen2, kMetaspace, kSpm, kSpmCharsmap),
                         [](const ::testing::TestParamInfo<const char*>& param_info) {
                           return fs::path(param_info.param).filename().string();
                         });

// ---------------------------------------------------------------------------------------------
// Special tokens and tokenizer_config.json.

TEST(TokenizerSpecialTokensTest, Llama3StyleBosEosAndTemplate) {
  std::unique_ptr<Tokenizer> t = Load(kLlama3);
  ASSERT_NE(t, nullptr);
  const std::optional<int32_t> bos = t->PieceToId("<|begin_of_text|>");
  const std::optional<int32_t> eot = t->PieceToId("<|eot_id|>");
  ASSERT_TRUE(bos && eot);
  EXPECT_EQ(t->bos_id(), bos);
  EXPECT_THAT(t->eos_ids(), ElementsAre(*eot));
  EXPECT_TRUE(t->IsSpecial(*bos));
  EXPECT_FALSE(t->IsSpecial(Ids(*t, "a")[0]));
  ASSERT_TRUE(t->chat_template().has_value());
  EXPECT_THAT(*t->chat_template(), HasSubstr("<|start_header_id|>"));
  // Special-token text in the prompt becomes the special id, as in Hugging Face.
  EXPECT_THAT(Ids(*t, "<|eot_id|>"), ElementsAre(*eot));
  EXPECT_EQ(Ids(*t, "x", true).front(), *bos);
}

TEST(TokenizerSpecialTokensTest, Qwen2StyleHasNoBosAndUsesTheDefaultTemplate) {
  std::unique_ptr<Tokenizer> t = Load(kQwen2);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->bos_id(), std::nullopt);
  EXPECT_THAT(t->eos_ids(), ElementsAre(*t->PieceToId("<|im_end|>")));
  ASSERT_TRUE(t->chat_template().has_value());
  EXPECT_THAT(*t->chat_template(), HasSubstr("<|im_start|>assistant"));
  EXPECT_EQ(Ids(*t, "hi", true), Ids(*t, "hi", false));
}

TEST(TokenizerSpecialTokensTest, SentencePieceSpellsOutSpecialTokenText) {
  std::unique_ptr<Tokenizer> t = Load(kSpm);
  ASSERT_NE(t, nullptr);
  const std::vector<int32_t> ids = Ids(*t, "<s>");
  EXPECT_GT(ids.size(), 1u);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 1), 0);
  EXPECT_TRUE(t->IsSpecial(1));
  EXPECT_TRUE(t->IsSpecial(2));
  EXPECT_FALSE(t->IsSpecial(ids[0]));
  EXPECT_THAT(*t->chat_template(), HasSubstr("[INST]"));
}

TEST(TokenizerSpecialTokensTest, GenerationConfigEosIdsAreAdded) {
  const ScratchDir scratch("generation_config");
  const std::string& dir = scratch.path();
  fs::copy_file(std::string(kLlama3) + "/tokenizer.json", dir + "/tokenizer.json");
  fs::copy_file(std::string(kLlama3) + "/tokenizer_config.json", dir + "/tokenizer_config.json");
  WriteAll(dir + "/generation_config.json", "{\"eos_token_id\": [1001, 1004]}");
  WriteAll(dir + "/chat_template.jinja", "{{ messages }}");
  std::unique_ptr<Tokenizer> t = Load(dir);
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(t->eos_ids(), ElementsAre(1004, 1001));  // tokenizer_config's <|eot_id|> first
  EXPECT_EQ(t->chat_template(), "{{ messages }}");     // chat_template.jinja wins

  WriteAll(dir + "/generation_config.json", "{\"eos_token_id\": 5000000}");
  absl::StatusOr<std::unique_ptr<Tokenizer>> bad = LoadTokenizer(dir);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("generation_config.json"));
  EXPECT_THAT(bad.status().message(), HasSubstr("5000000"));
}

TEST(TokenizerSpecialTokensTest, SentencePieceHonoursAddBosAndAddEos) {
  const ScratchDir scratch("spm_eos");
  const std::string& dir = scratch.path();
  fs::copy_file(std::string(kSpm) + "/tokenizer.model", dir + "/tokenizer.model");
  WriteAll(dir + "/tokenizer_config.json", "{\"add_bos_token\": false, \"add_eos_token\": true}");
  std::unique_ptr<Tokenizer> t = Load(dir);
  ASSERT_NE(t, nullptr);
  std::vector<int32_t> plain = Ids(*t, "Hello");
  plain.push_back(2);
  EXPECT_EQ(Ids(*t, "Hello", true), plain);
}

// ---------------------------------------------------------------------------------------------
// Streaming.

TEST(TokenizerStreamDecoderTest, ByteFallbackCharacterIsReleasedWhole) {
  std::unique_ptr<Tokenizer> t = Load(kMetaspace);
  ASSERT_NE(t, nullptr);
  // 😀 is not in the vocabulary: four <0xXX> tokens.
  const std::vector<int32_t> ids = Ids(*t, "a😀b");
  std::vector<std::string> pieces = StreamPieces(*t, ids, true);
  EXPECT_EQ(Join(pieces), "a😀b");
  int emoji_piece = -1;
  for (size_t i = 0; i < pieces.size(); ++i) {
    EXPECT_TRUE(ValidateUtf8(pieces[i]).ok());
    if (pieces[i].find("😀") != std::string::npos) emoji_piece = static_cast<int>(i);
  }
  ASSERT_GE(emoji_piece, 3);
  for (int i = emoji_piece - 3; i < emoji_piece; ++i) EXPECT_EQ(pieces[i], "") << i;  // the first three bytes
}

TEST(TokenizerStreamDecoderTest, ByteLevelEmojiIsReleasedWhole) {
  std::unique_ptr<Tokenizer> t = Load(kGpt2);
  ASSERT_NE(t, nullptr);
  const std::vector<int32_t> ids = Ids(*t, "😀");
  ASSERT_GT(ids.size(), 1u);
  std::vector<std::string> pieces = StreamPieces(*t, ids, true);
  for (size_t i = 0; i + 2 < pieces.size(); ++i) EXPECT_EQ(pieces[i], "");
  EXPECT_EQ(pieces[pieces.size() - 2], "😀");
  EXPECT_EQ(pieces.back(), "");
}

TEST(TokenizerStreamDecoderTest, FirstWordLosesOnlyItsOwnSpace) {
  for (const char* dir : {kSpm, kMetaspace}) {
    std::unique_ptr<Tokenizer> t = Load(dir);
    ASSERT_NE(t, nullptr);
    const std::vector<int32_t> ids = Ids(*t, "Hello world", true);
    const std::vector<std::string> pieces = StreamPieces(*t, ids, true);
    EXPECT_EQ(Join(pieces), "Hello world") << dir;
    // The first visible piece does not start with the space SentencePiece put before "Hello".
    for (const std::string& p : pieces) {
      if (p.empty()) continue;
      EXPECT_NE(p[0], ' ') << dir;
      break;
    }
  }
}

TEST(TokenizerStreamDecoderTest, SkippedSpecialTokensPrintNothing) {
  std::unique_ptr<Tokenizer> t = Load(kLlama3);
  ASSERT_NE(t, nullptr);
  const std::vector<int32_t> ids = Ids(*t, "<|begin_of_text|>Hi<|eot_id|>");
  std::vector<std::string> skipped = StreamPieces(*t, ids, true);
  EXPECT_EQ(skipped.front(), "");
  EXPECT_EQ(Join(skipped), "Hi");
  EXPECT_EQ(Join(StreamPieces(*t, ids, false)), "<|begin_of_text|>Hi<|eot_id|>");
}

TEST(TokenizerStreamDecoderTest, FinishFlushesAnIncompleteCharacterAndResets) {
  std::unique_ptr<Tokenizer> t = Load(kMetaspace);
  ASSERT_NE(t, nullptr);
  const int32_t e4 = *t->PieceToId("<0xE4>");
  std::unique_ptr<StreamDecoder> stream = t->NewStreamDecoder(true);
  EXPECT_EQ(*stream->Next(e4), "");
  EXPECT_EQ(stream->Finish(), kUtf8Replacement);
  // A new sequence: the first-word rule applies again.
  std::string again;
  for (int32_t id : Ids(*t, "Hello", true)) again += *stream->Next(id);
  EXPECT_EQ(again + stream->Finish(), "Hello");
}

TEST(TokenizerStreamDecoderTest, InvalidBytesBecomeReplacementCharacters) {
  for (const char* dir : {kSpm, kMetaspace}) {
    std::unique_ptr<Tokenizer> t = Load(dir);
    ASSERT_NE(t, nullptr);
    const int32_t e4 = *t->PieceToId("<0xE4>");
    const int32_t b8 = *t->PieceToId("<0xB8>");
    const int32_t ff = *t->PieceToId("<0xFF>");
    const int32_t a = *t->PieceToId("a");
    const std::vector<int32_t> ids = {e4, b8, a, ff};
    const std::string r(kUtf8Replacement);
    EXPECT_EQ(*t->Decode(ids, true), r + r + "a" + r) << dir;
    EXPECT_EQ(Join(StreamPieces(*t, ids, true)), r + r + "a" + r) << dir;
  }
}

}  // namespace
}  // namespace shardserve

// The native SentencePiece implementation against Debian's libsentencepiece on the same
// tokenizer.model files: identical ids for thousands of random strings, identical text for random
// id sequences. (The committed Python reference, tokenizer_reference_test.cc, is the primary
// check; this one adds breadth.)
#include "tests/common/tokenizer/sentencepiece_oracle.h"

#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "common/tokenizer/sentencepiece_tokenizer.h"
#include "common/tokenizer/tokenizer_config.h"
#include "gtest/gtest.h"

namespace shardserve {
namespace {

std::string ReadAll(const std::string& path) {
  absl::StatusOr<std::string> s = ReadTokenizerFile(path);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : "";
}

// Random text from fragments that stress normalization, whitespace, user-defined symbols, digits,
// byte fallback and special-token spellings.
std::string RandomText(std::mt19937& rng) {
  static const char* const kFragments[] = {" ",
                                           "  ",
                                           "   ",
                                           "\t",
                                           "\n",
                                           "\r\n",
                                           "\u00a0",
                                           "\u3000",
                                           "\u2581",
                                           "\u2581\u2581",
                                           "a",
                                           "e",
                                           "the",
                                           "The",
                                           " the",
                                           "'s",
                                           "Hello",
                                           "world",
                                           "Lily",
                                           "park",
                                           "once",
                                           "upon",
                                           "time",
                                           "caf\u00e9",
                                           "e\u0301",
                                           "\u00f6",
                                           "\u00df",
                                           "\u4e2d",
                                           "\u4f60\u597d",
                                           "\u65e5\u672c",
                                           "\ud55c",
                                           "\U0001F600",
                                           "\u2764\ufe0f",
                                           "!",
                                           "...",
                                           "?",
                                           "\"",
                                           "(",
                                           ")",
                                           "#",
                                           "-",
                                           ",",
                                           ".",
                                           "1",
                                           "12",
                                           "123",
                                           "2024",
                                           "3.14",
                                           "<s>",
                                           "</s>",
                                           "<unk>",
                                           "[INST]",
                                           "[/INST]",
                                           "[INST",
                                           "\uff21",
                                           "\uff22",
                                           "AB",
                                           "A",
                                           "B",
                                           "\ufb01",
                                           "\u216b",
                                           "\u00b2",
                                           "\u0085",
                                           "\x01",
                                           "\ufeff",
                                           "\u041f\u0440\u0438"};
  std::uniform_int_distribution<int> count(0, 30);
  std::uniform_int_distribution<size_t> pick(0, sizeof(kFragments) / sizeof(kFragments[0]) - 1);
  std::string s;
  for (int n = count(rng); n > 0; --n) s += kFragments[pick(rng)];
  return s;
}

class SentencePieceOracleTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    const std::string path = std::string(GetParam()) + "/tokenizer.model";
    if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " is not available";
    ASSERT_EQ(oracle_.LoadFromSerialized(ReadAll(path)), "");
    absl::StatusOr<std::unique_ptr<Tokenizer>> t = LoadSentencePieceTokenizer(path, TokenizerConfig());
    ASSERT_TRUE(t.ok()) << t.status();
    native_ = *std::move(t);
  }

  SentencePieceOracle oracle_;
  std::unique_ptr<Tokenizer> native_;
};

TEST_P(SentencePieceOracleTest, EncodeMatchesLibsentencepiece) {
  std::mt19937 rng(2024);
  int mismatches = 0;
  for (int i = 0; i < 3000; ++i) {
    const std::string text = RandomText(rng);
    std::vector<int> expected;
    ASSERT_EQ(oracle_.Encode(text, &expected), "");
    absl::StatusOr<std::vector<int32_t>> got = native_->Encode(text, /*add_special_tokens=*/false);
    ASSERT_TRUE(got.ok()) << got.status();
    if (std::vector<int>(got->begin(), got->end()) != expected && ++mismatches <= 5) {
      ADD_FAILURE() << "text \"" << text << "\"";
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST_P(SentencePieceOracleTest, DecodeOfRandomIdsMatchesLibsentencepiece) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> any_id(0, oracle_.PieceCount() - 1);
  int mismatches = 0;
  for (int i = 0; i < 3000; ++i) {
    std::vector<int> ids(1 + i % 20);
    for (int& id : ids) id = any_id(rng);
    std::string expected;
    ASSERT_EQ(oracle_.Decode(ids, &expected), "");
    absl::StatusOr<std::string> got = native_->Decode(std::vector<int32_t>(ids.begin(), ids.end()), true);
    ASSERT_TRUE(got.ok()) << got.status();
    if (*got != expected && ++mismatches <= 5) {
      std::string list;
      for (int id : ids) list += oracle_.IdToPiece(id) + " ";
      ADD_FAILURE() << "pieces: " << list << "\n got \"" << *got << "\"\nwant \"" << expected << "\"";
    }
  }
  EXPECT_EQ(mismatches, 0);
}

INSTANTIATE_TEST_SUITE_P(Models, SentencePieceOracleTest,
                         ::testing::Values("tests/golden/tokenizers/spm_llama2", "tests/golden/tokenizers/spm_charsmap",
                                           "../shared/models/stories260K"),
                         [](const ::testing::TestParamInfo<const char*>& param_info) {
                           return std::filesystem::path(param_info.param).filename().string();
                         });

}  // namespace
}  // namespace shardserve

#include "coordinator/structured/grammar.h"

#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/coordinator/structured/json_validator.h"
#include "tests/coordinator/structured/test_schemas.h"
#include "tests/testing/status_matchers.h"

namespace shardserve::structured {
namespace {

using ::shardserve::testing::IsOk;
using ::shardserve::testing::StatusIs;
using ::testing::HasSubstr;
using testing_json::Json;

constexpr char kModelDir[] = "../shared/models/stories260K";

bool Matches(const std::string& schema, const std::string& text) {
  absl::StatusOr<std::string> re = JsonSchemaRegex(schema);
  EXPECT_TRUE(re.ok()) << re.status();
  absl::StatusOr<ByteDfa> dfa = ByteDfa::Compile(*re);
  EXPECT_TRUE(dfa.ok()) << dfa.status();
  return dfa->FullMatch(text);
}

TEST(JsonSchemaTest, ObjectWithRequiredAndOptionalProperties) {
  const std::string s =
      R"({"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"string"},"c":{"type":"boolean"}},"required":["b"]})";
  EXPECT_TRUE(Matches(s, R"({"b":"x"})"));
  EXPECT_TRUE(Matches(s, R"({"a":-12,"b":"","c":true})"));
  EXPECT_TRUE(Matches(s, R"({"a":0,"b":"q"})"));
  EXPECT_TRUE(Matches(s, R"({"b":"q","c":false})"));
  EXPECT_FALSE(Matches(s, R"({"a":1})"));          // b is required
  EXPECT_FALSE(Matches(s, R"({"a":01,"b":"q"})"));  // no leading zeros
  EXPECT_FALSE(Matches(s, R"({"b":"q",})"));
  EXPECT_FALSE(Matches(s, R"({"b":"q","d":1})"));  // no other properties
  EXPECT_FALSE(Matches(s, R"({ "b":"q"})"));       // compact: no whitespace
}

TEST(JsonSchemaTest, OneOptionalPropertyKeepsItsClosingQuote) {
  const std::string s = R"({"type":"object","properties":{"k":{"type":"string","maxLength":5}}})";
  EXPECT_TRUE(Matches(s, "{}"));
  EXPECT_TRUE(Matches(s, R"({"k":"abc"})"));
  EXPECT_FALSE(Matches(s, R"({"k":"abc})"));
}

TEST(JsonSchemaTest, AllOptionalPropertiesMayAllBeOmitted) {
  const std::string s = R"({"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"integer"}}})";
  for (const char* ok : {"{}", R"({"a":1})", R"({"b":2})", R"({"a":1,"b":2})"}) EXPECT_TRUE(Matches(s, ok)) << ok;
  for (const char* bad : {R"({,"b":2})", R"({"a":1,})", R"({"b":2,"a":1})"}) EXPECT_FALSE(Matches(s, bad)) << bad;
}

TEST(JsonSchemaTest, StringsWithEscapes) {
  const std::string s = R"({"type":"string"})";
  for (const char* ok : {R"("")", R"("plain")", R"("a\"b")", R"("\\\/\b\f\n\r\t")", R"("\u00e9\uFFFF")", "\"\xC3\xA9\""}) {
    EXPECT_TRUE(Matches(s, ok)) << ok;
  }
  for (const char* bad : {R"("a"b")", R"("\x")", R"("\ud800")", "\"a\nb\"", R"("abc)", "\"\xC3\""}) {
    EXPECT_FALSE(Matches(s, bad)) << bad;
  }
  EXPECT_TRUE(Matches(R"({"type":"string","minLength":2,"maxLength":3})", R"("a\n")"));
  EXPECT_FALSE(Matches(R"({"type":"string","minLength":2,"maxLength":3})", R"("a")"));
  EXPECT_FALSE(Matches(R"({"type":"string","minLength":2,"maxLength":3})", R"("abcd")"));
}

TEST(JsonSchemaTest, NumbersIntegersAndLiterals) {
  EXPECT_TRUE(Matches(R"({"type":"number"})", "-0.5e+10"));
  EXPECT_TRUE(Matches(R"({"type":"number"})", "12"));
  EXPECT_FALSE(Matches(R"({"type":"number"})", "1."));
  EXPECT_FALSE(Matches(R"({"type":"number"})", ".5"));
  EXPECT_FALSE(Matches(R"({"type":"integer"})", "1.5"));
  EXPECT_TRUE(Matches(R"({"enum":["a\"b",3,null,{"k":[1]}]})", R"("a\"b")"));
  EXPECT_TRUE(Matches(R"({"enum":["a\"b",3,null,{"k":[1]}]})", R"({"k":[1]})"));
  EXPECT_FALSE(Matches(R"({"enum":["a\"b",3,null,{"k":[1]}]})", "4"));
  EXPECT_TRUE(Matches(R"({"const":"x.y*"})", R"("x.y*")"));
  EXPECT_FALSE(Matches(R"({"const":"x.y*"})", R"("xzy")"));
}

TEST(JsonSchemaTest, ArraysWithBounds) {
  const std::string s = R"({"type":"array","items":{"type":"integer"},"minItems":1,"maxItems":3})";
  EXPECT_FALSE(Matches(s, "[]"));
  EXPECT_TRUE(Matches(s, "[1]"));
  EXPECT_TRUE(Matches(s, "[1,2,3]"));
  EXPECT_FALSE(Matches(s, "[1,2,3,4]"));
  EXPECT_TRUE(Matches(R"({"type":"array"})", R"([1,"a",[null],{"k":{}}])"));
}

TEST(JsonSchemaTest, RefsAnyOfAndTypeLists) {
  const std::string s =
      R"({"$defs":{"p":{"type":"object","properties":{"x":{"type":"integer"}},"required":["x"]}},"anyOf":[{"$ref":"#/$defs/p"},{"type":["string","null"]}]})";
  EXPECT_TRUE(Matches(s, R"({"x":1})"));
  EXPECT_TRUE(Matches(s, R"("s")"));
  EXPECT_TRUE(Matches(s, "null"));
  EXPECT_FALSE(Matches(s, "1"));
}

TEST(JsonSchemaTest, UnsupportedKeywordsAreNamed) {
  EXPECT_THAT(JsonSchemaRegex(R"({"type":"string","pattern":"a+"})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"pattern\"")));
  EXPECT_THAT(JsonSchemaRegex(R"({"type":"object","properties":{"n":{"type":"integer","minimum":0}}})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"minimum\" at /properties/n")));
  EXPECT_THAT(JsonSchemaRegex(R"({"type":"object","properties":{"a":{"type":"strin"}}})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown type \"strin\"")));
  EXPECT_THAT(JsonSchemaRegex("{"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not valid JSON")));
  EXPECT_THAT(JsonSchemaRegex(R"({"$defs":{"n":{"type":"array","items":{"$ref":"#/$defs/n"}}},"$ref":"#/$defs/n"})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("recursive $ref")));
  EXPECT_THAT(JsonSchemaRegex(R"({"type":"object","required":["a"],"properties":{}})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not in properties")));
  EXPECT_THAT(JsonSchemaRegex(R"({"type":"array","maxItems":100000})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("maxItems")));
}

class GrammarTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<std::unique_ptr<Tokenizer>> t = LoadTokenizer(kModelDir);
    ASSERT_TRUE(t.ok()) << t.status();
    tokenizer_ = t->release();
    compiler_ = new ConstraintCompiler(VocabularyFromTokenizer(*tokenizer_, tokenizer_->vocab_size()));
  }
  static void TearDownTestSuite() {
    delete compiler_;
    delete tokenizer_;
  }

  // A random walk through the constraint: a uniformly chosen allowed token, or (30% of the time)
  // one that closes something, so that walks end. Checks at each state that the mask and Advance
  // agree on every id. Returns the generated ids (ending with EOS when finished).
  static std::vector<int32_t> Walk(const GrammarConstraint& c, uint32_t seed, int max_tokens, bool* finished) {
    std::mt19937 rng(seed);
    const TokenVocabulary& v = compiler_->vocabulary();
    const int32_t n = static_cast<int32_t>(v.bytes.size());
    std::vector<int32_t> out;
    int32_t s = c.StartState();
    *finished = false;
    for (int i = 0; i < max_tokens; ++i) {
      std::shared_ptr<const std::string> mask = c.AllowedMask(s);
      std::vector<int32_t> allowed, closing;
      for (int32_t id = 0; id < n; ++id) {
        const bool bit = ((*mask)[static_cast<size_t>(id) / 8] >> (id % 8)) & 1;
        EXPECT_EQ(bit, c.Advance(s, id) >= 0) << "id " << id << " in state " << s;
        if (!bit) continue;
        allowed.push_back(id);
        const std::string& b = v.bytes[static_cast<size_t>(id)];
        if (b.empty() || b[0] == '"' || b[0] == '}' || b[0] == ']' || b[0] == ',') closing.push_back(id);
      }
      if (allowed.empty()) {
        ADD_FAILURE() << "no allowed token in state " << s;
        return out;
      }
      const auto& pool = (!closing.empty() && std::uniform_int_distribution<int>(0, 9)(rng) < 3) ? closing : allowed;
      const int32_t tok = pool[std::uniform_int_distribution<size_t>(0, pool.size() - 1)(rng)];
      out.push_back(tok);
      s = c.Advance(s, tok);
      if (c.IsFinished(s)) {
        *finished = true;
        return out;
      }
    }
    return out;
  }

  static std::string Text(const std::vector<int32_t>& ids) {
    std::string text;
    for (int32_t id : ids) text += compiler_->vocabulary().bytes[static_cast<size_t>(id)];
    return text;
  }

  static inline Tokenizer* tokenizer_ = nullptr;
  static inline ConstraintCompiler* compiler_ = nullptr;
};

TEST_F(GrammarTest, VocabularyBytes) {
  const TokenVocabulary& v = compiler_->vocabulary();
  ASSERT_EQ(v.bytes.size(), 512u);
  const std::optional<int32_t> a = tokenizer_->PieceToId("<0x41>");
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(v.bytes[static_cast<size_t>(*a)], "A");
  const std::optional<int32_t> space_the = tokenizer_->PieceToId("\xE2\x96\x81the");
  ASSERT_TRUE(space_the.has_value());
  EXPECT_EQ(v.bytes[static_cast<size_t>(*space_the)], " the");
  EXPECT_EQ(v.eos_ids, tokenizer_->eos_ids());
  for (int32_t id : v.eos_ids) EXPECT_TRUE(v.bytes[static_cast<size_t>(id)].empty());
  ASSERT_TRUE(tokenizer_->bos_id().has_value());
  EXPECT_TRUE(v.bytes[static_cast<size_t>(*tokenizer_->bos_id())].empty());
}

// Byte-level BPE (GPT-2, Llama-3, Qwen2) and Metaspace + byte fallback tokenizer.json files: each
// token's bytes decode to what the tokenizer decodes, so a constraint sees the real text.
TEST(VocabularyTest, ByteLevelAndMetaspaceTokenizers) {
  for (const char* dir : {"bytelevel_gpt2", "bytelevel_llama3", "bytelevel_qwen2", "metaspace_bytefallback"}) {
    SCOPED_TRACE(dir);
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Tokenizer> t, LoadTokenizer(absl::StrCat("tests/golden/tokenizers/", dir)));
    const TokenVocabulary v = VocabularyFromTokenizer(*t, t->vocab_size());
    const bool byte_level = std::string(dir).rfind("bytelevel", 0) == 0;
    const std::optional<int32_t> space_t = t->PieceToId(byte_level ? "\xC4\xA0t" : "\xE2\x96\x81t");
    ASSERT_TRUE(space_t.has_value());
    EXPECT_EQ(v.bytes[static_cast<size_t>(*space_t)], " t");
    // Decoding may drop the first token's leading space (SentencePiece style): compare after it.
    const int32_t first[] = {*space_t};
    ASSERT_OK_AND_ASSIGN(const std::string prefix, t->Decode(first, true));
    int64_t usable = 0;
    for (int32_t id = 0; id < t->vocab_size(); ++id) {
      const std::string& b = v.bytes[static_cast<size_t>(id)];
      if (b.empty()) continue;
      ++usable;
      // Sequences of whole characters decode to exactly these bytes after a first token.
      const int32_t ids[] = {*space_t, id};
      absl::StatusOr<std::string> text = t->Decode(ids, true);
      ASSERT_TRUE(text.ok());
      if (text->find("\xEF\xBF\xBD") == std::string::npos) {
        EXPECT_EQ(*text, prefix + b) << id;
      }
    }
    EXPECT_GT(usable, t->vocab_size() * 9 / 10);
    for (int32_t id : t->eos_ids()) EXPECT_TRUE(v.bytes[static_cast<size_t>(id)].empty());
  }
}

TEST_F(GrammarTest, CompiledOncePerSchema) {
  const ConstraintSpec spec{ConstraintKind::kJsonSchema, R"({"type":"integer"})"};
  ASSERT_OK_AND_ASSIGN(auto a, compiler_->Compile(spec));
  ASSERT_OK_AND_ASSIGN(auto b, compiler_->Compile(spec));
  EXPECT_EQ(a.get(), b.get());
  ASSERT_OK_AND_ASSIGN(auto c, compiler_->Compile({ConstraintKind::kRegex, R"({"type":"integer"})"}));
  EXPECT_NE(a.get(), c.get());
}

TEST_F(GrammarTest, CacheIsBoundedByCountAndBytes) {
  ConstraintCompiler by_count(compiler_->vocabulary(), {.max_cached = 1});
  const ConstraintSpec a{ConstraintKind::kRegex, "a+"}, b{ConstraintKind::kRegex, "b+"};
  ASSERT_OK_AND_ASSIGN(auto a1, by_count.Compile(a));
  ASSERT_OK_AND_ASSIGN(auto b1, by_count.Compile(b));  // evicts a
  ASSERT_OK_AND_ASSIGN(auto a2, by_count.Compile(a));
  EXPECT_NE(a1.get(), a2.get());
  ConstraintCompiler by_bytes(compiler_->vocabulary(), {.max_cached_bytes = 1});
  ASSERT_OK_AND_ASSIGN(auto c1, by_bytes.Compile(a));
  ASSERT_OK_AND_ASSIGN(auto c2, by_bytes.Compile(a));
  EXPECT_EQ(c1.get(), c2.get());  // one entry is always kept
  ASSERT_OK_AND_ASSIGN(auto d1, by_bytes.Compile(b));
  ASSERT_OK_AND_ASSIGN(auto c3, by_bytes.Compile(a));
  EXPECT_NE(c1.get(), c3.get());
}

TEST_F(GrammarTest, EosOnlyWhereTheTextIsComplete) {
  ASSERT_OK_AND_ASSIGN(auto g, compiler_->CompileGrammar({ConstraintKind::kRegex, "ab|abc"}));
  const int32_t eos = compiler_->vocabulary().eos_ids[0];
  const int32_t a = *tokenizer_->PieceToId("<0x61>");
  const int32_t b = *tokenizer_->PieceToId("<0x62>");
  const int32_t c = *tokenizer_->PieceToId("<0x63>");
  int32_t s = g->StartState();
  EXPECT_EQ(g->Advance(s, eos), -1);
  s = g->Advance(s, a);
  ASSERT_GE(s, 0);
  EXPECT_EQ(g->Advance(s, eos), -1);
  s = g->Advance(s, b);
  ASSERT_GE(s, 0);
  const int32_t after_c = g->Advance(s, c);
  EXPECT_TRUE(g->IsFinished(g->Advance(s, eos)));  // "ab" is complete...
  ASSERT_GE(after_c, 0);                           // ...and may go on to "abc"
  const auto mask = g->AllowedMask(after_c);       // then only EOS is left
  for (int32_t id = 0; id < 512; ++id) EXPECT_EQ(((*mask)[static_cast<size_t>(id) / 8] >> (id % 8)) & 1, id == eos) << id;
}

TEST_F(GrammarTest, RandomWalksOverTheTestSchemasValidate) {
  int finished = 0, total = 0;
  for (const char* schema_text : testing_json::kTestSchemas) {
    ASSERT_OK_AND_ASSIGN(auto g, compiler_->CompileGrammar({ConstraintKind::kJsonSchema, schema_text}));
    const Json schema = Json::parse(schema_text);
    for (uint32_t seed = 0; seed < 4; ++seed) {
      bool done = false;
      std::vector<int32_t> ids = Walk(*g, seed, 400, &done);
      ++total;
      if (!done) continue;
      ++finished;
      ids.pop_back();  // EOS
      const std::string text = Text(ids);
      const Json v = Json::parse(text, nullptr, false);
      ASSERT_FALSE(v.is_discarded()) << schema_text << "\n" << text;
      EXPECT_EQ(testing_json::Validate(v, schema, schema), "") << schema_text << "\n" << text;
    }
  }
  EXPECT_GE(finished, total * 9 / 10);
}

TEST_F(GrammarTest, JsonObjectWalksParseAsObjects) {
  ASSERT_OK_AND_ASSIGN(auto g, compiler_->CompileGrammar({ConstraintKind::kJsonObject, ""}));
  int finished = 0;
  for (uint32_t seed = 0; seed < 10; ++seed) {
    bool done = false;
    std::vector<int32_t> ids = Walk(*g, seed, 400, &done);
    if (!done) continue;
    ++finished;
    ids.pop_back();
    const Json v = Json::parse(Text(ids), nullptr, false);
    EXPECT_TRUE(v.is_object()) << Text(ids);
  }
  EXPECT_GE(finished, 5);
}

TEST_F(GrammarTest, RegexWalksMatch) {
  const std::string re = R"((?:[a-z]{1,8}@[a-z]{1,8}\.(?:com|org))|\d{3}-\d{4})";
  ASSERT_OK_AND_ASSIGN(auto g, compiler_->CompileGrammar({ConstraintKind::kRegex, re}));
  ASSERT_OK_AND_ASSIGN(ByteDfa check, ByteDfa::Compile(re));
  for (uint32_t seed = 0; seed < 20; ++seed) {
    bool done = false;
    std::vector<int32_t> ids = Walk(*g, seed, 100, &done);
    ASSERT_TRUE(done);
    ids.pop_back();
    EXPECT_TRUE(check.FullMatch(Text(ids))) << Text(ids);
  }
}

}  // namespace
}  // namespace shardserve::structured

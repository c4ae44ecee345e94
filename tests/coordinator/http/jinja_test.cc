// The Jinja subset against Python jinja2: jinja_golden.json holds what jinja2 rendered for each
// case (recorded by make_jinja_golden.py in transformers' chat-template environment).
#include "common/chat_template/jinja.h"

#include <fstream>
#include <sstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardserve::jinja {
namespace {

using ::testing::HasSubstr;

nlohmann::ordered_json LoadGolden() {
  std::ifstream in("tests/coordinator/http/jinja_golden.json");
  std::stringstream ss;
  ss << in.rdbuf();
  return nlohmann::ordered_json::parse(ss.str());
}

TEST(JinjaTest, MatchesJinja2OnEveryRecordedCase) {
  const nlohmann::ordered_json golden = LoadGolden();
  ASSERT_GE(golden["cases"].size(), 30u);
  for (const auto& c : golden["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    absl::StatusOr<JinjaTemplate> t = JinjaTemplate::Parse(c["template"].get<std::string>());
    ASSERT_TRUE(t.ok()) << t.status();
    absl::StatusOr<std::string> out = t->Render(c["context"]);
    if (c.contains("error")) {
      ASSERT_FALSE(out.ok()) << "rendered: " << *out;
      EXPECT_THAT(out.status().message(), HasSubstr(c["error"].get<std::string>()));
    } else {
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_EQ(*out, c["output"].get<std::string>());
    }
  }
}

TEST(JinjaTest, CoversTheThreeTemplateStyles) {
  const nlohmann::ordered_json golden = LoadGolden();
  int styles = 0;
  for (const auto& c : golden["cases"]) {
    const std::string name = c["name"];
    styles += name == "llama3_style" || name == "chatml_style" || name == "mistral_style";
  }
  EXPECT_EQ(styles, 3);
}

TEST(JinjaTest, UnsupportedTagIsAnErrorWithTheLine) {
  absl::StatusOr<JinjaTemplate> t = JinjaTemplate::Parse("a\n{% macro m() %}x{% endmacro %}");
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("line 2"));
  EXPECT_THAT(t.status().message(), HasSubstr("macro"));
}

TEST(JinjaTest, SyntaxErrorsAreErrorsNotCrashes) {
  for (const char* bad : {"{{ x ", "{% if x %}no end", "{{ 'unterminated }}", "{% for %}{% endfor %}", "{{ (1, }}",
                          "{{ x | }}", "{{ x[ }}", "{% set %}", "{# open", "{{ 1 $ 2 }}", "{% endif %}",
                          "{{ [1, 2 }}", "{{ {'a' 1} }}"}) {
    SCOPED_TRACE(bad);
    EXPECT_FALSE(JinjaTemplate::Parse(bad).ok());
  }
}

TEST(JinjaTest, RuntimeErrorsAreErrors) {
  for (const char* bad : {"{{ 1 / 0 }}", "{{ 1 // 0 }}", "{{ 'a' - 1 }}", "{{ x() }}", "{{ 1 < 'a' }}",
                          "{% for x in 3 %}{% endfor %}", "{{ 9223372036854775807 + 1 }}", "{{ x | nofilter }}",
                          "{{ range(10000000) | length }}", "{% set n.a = 1 %}"}) {
    SCOPED_TRACE(bad);
    absl::StatusOr<JinjaTemplate> t = JinjaTemplate::Parse(bad);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_FALSE(t->Render(nlohmann::ordered_json::object()).ok());
  }
}

TEST(JinjaTest, OutputIsCapped) {
  absl::StatusOr<JinjaTemplate> t =
      JinjaTemplate::Parse("{% for i in range(1000) %}{% for j in range(1000) %}{{ s }}{% endfor %}{% endfor %}");
  ASSERT_TRUE(t.ok());
  absl::StatusOr<std::string> out = t->Render({{"s", "0123456789"}});
  ASSERT_FALSE(out.ok());
  EXPECT_THAT(out.status().message(), HasSubstr("4 MiB"));
}

}  // namespace
}  // namespace shardserve::jinja

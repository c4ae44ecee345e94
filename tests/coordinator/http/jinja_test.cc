// The Jinja subset against Python jinja2: jinja_golden.json holds what jinja2 rendered for each
// case (recorded by make_jinja_golden.py in transformers' chat-template environment).
#include "common/chat_template/jinja.h"

#include <fstream>
#include <sstream>
#include <string>
#include <utility>

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

// The tool-calling templates of Llama-3.1-Instruct and Qwen2.5-Instruct (committed model data)
// are recorded as they are on disk, with tools, calls, tool answers and a refusal.
TEST(JinjaTest, CoversTheModelToolCallingTemplates) {
  const nlohmann::ordered_json golden = LoadGolden();
  for (const auto& [prefix, file] : {std::pair<std::string, std::string>{"llama3.1_", "llama3.1_instruct.jinja"},
                                     std::pair<std::string, std::string>{"qwen2.5_", "qwen2.5_instruct.jinja"}}) {
    SCOPED_TRACE(file);
    std::ifstream in("tests/coordinator/http/chat_templates/" + file);
    std::stringstream ss;
    ss << in.rdbuf();
    ASSERT_FALSE(ss.str().empty());
    int cases = 0, with_tools = 0, with_calls = 0;
    for (const auto& c : golden["cases"]) {
      if (c["name"].get<std::string>().rfind(prefix, 0) != 0) continue;
      ++cases;
      EXPECT_EQ(c["template"].get<std::string>(), ss.str());
      with_tools += c["context"].contains("tools");
      for (const auto& m : c["context"]["messages"]) with_calls += m.contains("tool_calls") && c.contains("output");
    }
    EXPECT_GE(cases, 4);
    EXPECT_GE(with_tools, 3);
    EXPECT_GE(with_calls, 1);
  }
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

// The Jinja subset against Python jinja2: jinja_golden.json holds what jinja2 rendered for each
// case (recorded by make_jinja_golden.py in transformers' chat-template environment).
#include "common/chat_template/jinja.h"

#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
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
  ASSERT_GE(golden["cases"].size(), 60u);
  // strftime_now's time in the recording (UTC).
  const absl::Time now = absl::FromUnixSeconds(golden["now"].get<int64_t>());
  for (const auto& c : golden["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    absl::StatusOr<JinjaTemplate> t = JinjaTemplate::Parse(c["template"].get<std::string>());
    ASSERT_TRUE(t.ok()) << t.status();
    absl::StatusOr<std::string> out = t->Render(c["context"], now, absl::UTCTimeZone());
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

// Macros, loop controls, block assignments and strftime_now, each in at least one recorded case
// (the cases' output is checked above).
TEST(JinjaTest, CoversMacrosLoopControlsAndTheHarmonyStyle) {
  const nlohmann::ordered_json golden = LoadGolden();
  int macros = 0, macro_errors = 0, harmony = 0;
  bool loop_controls = false, block_set = false, strftime = false;
  for (const auto& c : golden["cases"]) {
    const std::string name = c["name"];
    const std::string tmpl = c["template"];
    if (tmpl.find("{% macro") != std::string::npos || tmpl.find("{%- macro") != std::string::npos) {
      ++macros;
      macro_errors += c.contains("error");
    }
    loop_controls |= tmpl.find("{% break %}") != std::string::npos && tmpl.find("{% continue %}") != std::string::npos;
    block_set |= tmpl.find("{% endset %}") != std::string::npos;
    strftime |= tmpl.find("strftime_now(") != std::string::npos && c.contains("output");
    harmony += name.rfind("harmony_style", 0) == 0 && c.contains("output");
  }
  EXPECT_GE(macros, 15);
  EXPECT_GE(macro_errors, 3);
  EXPECT_TRUE(loop_controls);
  EXPECT_TRUE(block_set);
  EXPECT_TRUE(strftime);
  EXPECT_GE(harmony, 4);
}

TEST(JinjaTest, StrftimeNowFormatsTheRenderTimeInItsZone) {
  absl::StatusOr<JinjaTemplate> t = JinjaTemplate::Parse("{{ strftime_now('%Y-%m-%d %H:%M') }}");
  ASSERT_TRUE(t.ok());
  const absl::Time now = absl::FromUnixSeconds(1796634303);  // 2026-12-07 09:05:03 UTC
  EXPECT_EQ(*t->Render(nlohmann::ordered_json::object(), now, absl::UTCTimeZone()), "2026-12-07 09:05");
  EXPECT_EQ(*t->Render(nlohmann::ordered_json::object(), now, absl::FixedTimeZone(15 * 3600)), "2026-12-08 00:05");
  // Without a time, the current one: today's date in the local zone, as the template sees it.
  absl::StatusOr<JinjaTemplate> date = JinjaTemplate::Parse("{{ strftime_now('%Y-%m-%d') }}");
  ASSERT_TRUE(date.ok());
  const absl::Time before = absl::Now();
  const std::string today = *date->Render(nlohmann::ordered_json::object());
  const absl::Time after = absl::Now();
  EXPECT_TRUE(today == absl::FormatTime("%Y-%m-%d", before, absl::LocalTimeZone()) ||
              today == absl::FormatTime("%Y-%m-%d", after, absl::LocalTimeZone()))
      << today;
}

TEST(JinjaTest, RunawayMacroRecursionIsAnError) {
  absl::StatusOr<JinjaTemplate> t = JinjaTemplate::Parse("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
  ASSERT_TRUE(t.ok()) << t.status();
  absl::StatusOr<std::string> out = t->Render(nlohmann::ordered_json::object());
  ASSERT_FALSE(out.ok());
  EXPECT_THAT(out.status().message(), HasSubstr("nested more than 64 deep"));
  // Recursion as deep as the limit renders.
  absl::StatusOr<JinjaTemplate> deep = JinjaTemplate::Parse(
      "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{% else %}bottom{% endif %}{% endmacro %}{{ f(depth) }}");
  ASSERT_TRUE(deep.ok());
  EXPECT_EQ(*deep->Render({{"depth", kMaxMacroDepth - 1}}), "bottom");
  EXPECT_FALSE(deep->Render({{"depth", kMaxMacroDepth}}).ok());
}

// Values a render makes are bounded: strings and lists that double in a loop end in an error (not
// in all the memory), and a namespace that holds itself is written and compared without end.
TEST(JinjaTest, ValuesAreBoundedInSize) {
  const std::pair<std::string, std::string> too_large[] = {
      {"{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "4 MiB"},
      {"{% set ns = namespace(s='x\"') %}{% for i in range(64) %}{% set ns.s = (ns.s, 1) ~ '' %}{% endfor %}", "4 MiB"},
      {"{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}{% endfor %}",
       "a list of over a million items"},
      {"{{ ('a' * 1000000) | replace('a', 'aaaaa') }}", "replace makes a string over 4 MiB"},
      {"{{ ('a' * 1000000).replace('a', 'aaaaa') }}", "replace makes a string over 4 MiB"},
      {"{% set big = 'a' * 3000000 %}{{ [big, big] | join }}", "join makes a string over 4 MiB"},
      {"{{ ('ab' * 1000000) | list | length }}", "over a million characters"},
  };
  for (const auto& [source, error] : too_large) {
    SCOPED_TRACE(source);
    absl::StatusOr<JinjaTemplate> t = JinjaTemplate::Parse(source);
    ASSERT_TRUE(t.ok()) << t.status();
    absl::StatusOr<std::string> out = t->Render(nlohmann::ordered_json::object());
    ASSERT_FALSE(out.ok());
    EXPECT_THAT(out.status().message(), HasSubstr(error));
  }
  absl::StatusOr<JinjaTemplate> self = JinjaTemplate::Parse(
      "{% set ns = namespace(n=1) %}{% set ns.me = ns %}{{ ns.me == ns }} {{ [ns] }} {{ (ns | tojson) | length > 100 }}");
  ASSERT_TRUE(self.ok()) << self.status();
  EXPECT_EQ(*self->Render(nlohmann::ordered_json::object()), "True [<Namespace>] True");
}

// Templates nested deeper than the parser takes are syntax errors, never a stack overflow: long
// chains (which nest as deep as they are long), unary operators, brackets and blocks.
TEST(JinjaTest, DeepNestingIsRefused) {
  auto repeat = [](const std::string& s, int n) {
    std::string out;
    for (int i = 0; i < n; ++i) out += s;
    return out;
  };
  const std::vector<std::string> deep = {
      "{{ x" + repeat(" | trim", 5000) + " }}",
      "{{ 1" + repeat(" + 1", 5000) + " }}",
      "{{ x" + repeat(".a", 5000) + " }}",
      "{{ x" + repeat("[0]", 5000) + " }}",
      "{{ f" + repeat("()", 5000) + " }}",
      "{{ " + repeat("not ", 100000) + "x }}",
      "{{ " + repeat("-", 100000) + "1 }}",
      "{{ " + repeat("[", 100000) + repeat("]", 100000) + " }}",
      "{{ " + repeat("(", 100000) + "1" + repeat(")", 100000) + " }}",
      "{{ " + repeat("{'a': ", 100000) + "1" + repeat("}", 100000) + " }}",
      repeat("{% if x %}", 5000) + repeat("{% endif %}", 5000),
      repeat("{% for x in y %}", 5000) + repeat("{% endfor %}", 5000),
      repeat("{% macro m() %}", 5000) + repeat("{% endmacro %}", 5000),
  };
  for (const std::string& t : deep) {
    SCOPED_TRACE(t.substr(0, 40));
    absl::StatusOr<JinjaTemplate> parsed = JinjaTemplate::Parse(t);
    ASSERT_FALSE(parsed.ok());
    EXPECT_THAT(parsed.status().message(), HasSubstr("too deeply"));
  }
  // Within the limits, the same constructs parse and render.
  absl::StatusOr<JinjaTemplate> ok = JinjaTemplate::Parse("{{ 1" + repeat(" + 1", 100) + " }}" +
                                                          repeat("{% if true %}", 50) + "y" + repeat("{% endif %}", 50));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok->Render(nlohmann::ordered_json::object()), "101y");
}

// Rendering is bounded: deep expressions inside recursive macros stop with an error before the
// stack runs out, and loops that would run for hours stop after a bounded amount of work.
TEST(JinjaTest, RenderingIsBoundedInDepthAndWork) {
  std::string nested = "f(n + 1)";
  for (int i = 0; i < 120; ++i) nested = "[" + nested + "]";
  absl::StatusOr<JinjaTemplate> deep =
      JinjaTemplate::Parse("{% macro f(n) %}{{ " + nested + " }}{% endmacro %}{{ f(0) }}");
  ASSERT_TRUE(deep.ok()) << deep.status();
  absl::StatusOr<std::string> out = deep->Render(nlohmann::ordered_json::object());
  ASSERT_FALSE(out.ok());
  EXPECT_THAT(out.status().message(), HasSubstr("nests too deeply"));

  // A loop of a million loops of a million: stopped by the work budget (a small one here, to keep
  // the test quick under the sanitizers; a server's is kMaxRenderSteps).
  absl::StatusOr<JinjaTemplate> busy =
      JinjaTemplate::Parse("{% for i in range(1000000) %}{% for j in range(1000000) %}{% endfor %}{% endfor %}never");
  ASSERT_TRUE(busy.ok());
  out = busy->Render(nlohmann::ordered_json::object(), absl::UnixEpoch(), absl::UTCTimeZone(), /*max_steps=*/100'000);
  ASSERT_FALSE(out.ok());
  EXPECT_THAT(out.status().message(), HasSubstr("too much work (over 100000 steps)"));
  // A server's budget takes what a chat template does many times over: 10,000 iterations of a
  // few statements each.
  absl::StatusOr<JinjaTemplate> fine = JinjaTemplate::Parse(
      "{% set ns = namespace(n=0) %}{% for i in range(10000) %}{% if i is even %}{% set ns.n = ns.n + 1 %}"
      "{% endif %}{% endfor %}{{ ns.n }}");
  ASSERT_TRUE(fine.ok());
  EXPECT_EQ(*fine->Render(nlohmann::ordered_json::object()), "5000");
  static_assert(kMaxRenderSteps >= 10'000'000);
}

TEST(JinjaTest, UnsupportedTagIsAnErrorWithTheLine) {
  absl::StatusOr<JinjaTemplate> t =
      JinjaTemplate::Parse("a\n{% macro m() %}{{ caller() }}{% endmacro %}\n{% call m() %}x{% endcall %}");
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("line 3"));
  EXPECT_THAT(t.status().message(), HasSubstr("call"));
}

TEST(JinjaTest, SyntaxErrorsAreErrorsNotCrashes) {
  for (const char* bad : {"{{ x ", "{% if x %}no end", "{{ 'unterminated }}", "{% for %}{% endfor %}", "{{ (1, }}",
                          "{{ x | }}", "{{ x[ }}", "{% set %}", "{# open", "{{ 1 $ 2 }}", "{% endif %}",
                          "{{ [1, 2 }}", "{{ {'a' 1} }}", "{% break %}", "{% if x %}{% continue %}{% endif %}",
                          "{% for x in y %}{% macro m() %}{% break %}{% endmacro %}{% endfor %}",
                          "{% macro m(a=1, b) %}{% endmacro %}", "{% macro m(a, a) %}{% endmacro %}",
                          "{% macro m( %}{% endmacro %}", "{% macro %}{% endmacro %}", "{% macro m() %}no end",
                          "{% set x %}no end", "{% set a, b %}x{% endset %}", "{% set x | trim %}x{% endset %}"}) {
    SCOPED_TRACE(bad);
    EXPECT_FALSE(JinjaTemplate::Parse(bad).ok());
  }
}

TEST(JinjaTest, RuntimeErrorsAreErrors) {
  for (const char* bad : {"{{ 1 / 0 }}", "{{ 1 // 0 }}", "{{ 'a' - 1 }}", "{{ x() }}", "{{ 1 < 'a' }}",
                          "{% for x in 3 %}{% endfor %}", "{{ 9223372036854775807 + 1 }}", "{{ x | nofilter }}",
                          "{{ range(10000000) | length }}", "{% set n.a = 1 %}", "{{ strftime_now() }}",
                          "{{ strftime_now(1) }}", "{{ strftime_now('%Y' * 200) }}", "{% macro m() %}{{ 1 / 0 }}{% endmacro %}{{ m() }}",
                          "{% macro m(a=1 / 0) %}{% endmacro %}{{ m() }}"}) {
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

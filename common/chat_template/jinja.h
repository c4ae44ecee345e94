// A Jinja2 interpreter for the subset of the language that Hugging Face chat templates use, so the
// coordinator can turn chat messages into a prompt the way transformers' apply_chat_template does.
//
// Supported:
//   * text, {{ expressions }}, {% statements %}, {# comments #}, whitespace control ({%- -%},
//     {{- -}}), and the environment transformers uses: trim_blocks and lstrip_blocks on.
//   * statements: if / elif / else, for (with tuple unpacking, an `if` filter, `else`, and `loop`:
//     index, index0, revindex, revindex0, first, last, length, previtem, nextitem), break and
//     continue (the loopcontrols extension transformers enables), set (a name, a namespace
//     attribute `ns.x`, or a tuple; or a block: {% set x %}...{% endset %}), macros (parameters
//     with defaults, keyword arguments, `varargs` and `kwargs`, recursion up to kMaxMacroDepth
//     calls deep; a macro sees its arguments, the variables of the template's top level and those
//     around its definition, as in Jinja2), generation blocks (rendered as plain content).
//   * expressions: literals (strings, integers, floats, true/false/none in either case, lists,
//     dicts, tuples), names, `.attr`, `[key]`, slices `[a:b:c]`, calls, filters `x | f(...)`,
//     tests `x is [not] t(...)`, `not`, `and`, `or`, `a if c else b`, comparisons, `in`, `not in`,
//     + - * / // % ** and ~ (string concatenation).
//   * globals: raise_exception(msg) (rendering fails with msg), namespace(...), range(...),
//     strftime_now(format) (the render's time, formatted by C's strftime, as transformers'
//     datetime.now().strftime does).
//   * filters: trim, length/count, tojson (transformers' variant: json.dumps, non-ASCII kept,
//     indent=), upper, lower, capitalize, title, default/d, join, first, last, string, int, float,
//     list, replace, items, reverse, safe, selectattr/rejectattr (with a test), map(attribute=),
//     abs, round, sort(attribute=).
//   * tests: defined, undefined, none, string, number, integer, float, boolean, mapping,
//     iterable, sequence, true, false, equalto/eq/==, ne, odd, even, divisibleby, in.
//   * methods: str.strip/lstrip/rstrip/split/startswith/endswith/upper/lower/replace/title,
//     dict.items/keys/values/get.
// Not supported (a parse or render error naming it, never a crash): call blocks (and so `caller`),
// include, extends, import, filter blocks, filters on a block set.
//
// Rendering is bounded: expressions nest at most 128 deep and blocks 64 (deeper is a parse
// error); evaluation at most 512 levels deep across macro calls; kMaxRenderSteps of work; strings
// of 4 MiB and lists of a million items; the output 4 MiB. Past a bound, an error naming it.
//
// Values print as Python does (True, None, ['a', 1], 1.0). Undefined names and missing keys are
// Jinja's default Undefined: they print as "", are false, and only `is defined` tells them apart.
//
// Thread-safety: a parsed JinjaTemplate is immutable; Render may be called from many threads.
#ifndef SHARDSERVE_COMMON_CHAT_TEMPLATE_JINJA_H_
#define SHARDSERVE_COMMON_CHAT_TEMPLATE_JINJA_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"

namespace shardserve::jinja {

struct Program;  // the parsed template (internal)

// The deepest macro calls may nest (a recursive macro over a JSON schema nests once per level).
inline constexpr int kMaxMacroDepth = 64;
// The most work a render does by default: statements run and expressions evaluated, a loop
// iteration counting ten (a chat template takes a few thousand; a template that loops a million
// times a million times ends with an error after about a second).
inline constexpr int64_t kMaxRenderSteps = 20'000'000;

class JinjaTemplate {
 public:
  // Parses `source`. InvalidArgument with the line number for syntax errors and unsupported tags.
  static absl::StatusOr<JinjaTemplate> Parse(absl::string_view source);

  // Renders with the variables of `context` (a JSON object; its values become template values:
  // objects are dicts, arrays are lists). InvalidArgument for errors while rendering (with the line
  // number), and for raise_exception (with its message). Output is capped at 4 MiB. strftime_now
  // gives the current time in the local time zone.
  absl::StatusOr<std::string> Render(const nlohmann::ordered_json& context) const;
  // As above, with strftime_now giving `now` in `zone`, and at most `max_steps` steps of work.
  absl::StatusOr<std::string> Render(const nlohmann::ordered_json& context, absl::Time now, absl::TimeZone zone,
                                     int64_t max_steps = kMaxRenderSteps) const;

 private:
  explicit JinjaTemplate(std::shared_ptr<const Program> program) : program_(std::move(program)) {}
  std::shared_ptr<const Program> program_;
};

}  // namespace shardserve::jinja

#endif  // SHARDSERVE_COMMON_CHAT_TEMPLATE_JINJA_H_

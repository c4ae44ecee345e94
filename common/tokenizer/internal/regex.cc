#include "common/tokenizer/internal/regex.h"

#include "common/tokenizer/internal/string_view.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "absl/strings/str_cat.h"

namespace shardserve::tokenizer_internal {
namespace {

// Oniguruma's \s and \w as class contents (valid both inside and outside a [...] class).
constexpr std::string_view kSpaceClass = "\\t-\\r\\x{85}\\p{Z}";
constexpr std::string_view kWordClass = "\\p{L}\\p{M}\\p{Nd}\\p{Pc}";
constexpr std::string_view kHexClass = "0-9A-Fa-f";

std::string Pcre2Error(int code) {
  PCRE2_UCHAR buffer[256];
  if (pcre2_get_error_message(code, buffer, sizeof(buffer)) < 0) return absl::StrCat("PCRE2 error ", code);
  return std::string(reinterpret_cast<const char*>(buffer));
}

size_t Utf8Len(unsigned char lead) {
  if (lead < 0x80) return 1;
  if (lead < 0xE0) return 2;
  if (lead < 0xF0) return 3;
  return 4;
}

}  // namespace

struct Regex::Code {
  pcre2_code* code = nullptr;
  ~Code() { pcre2_code_free(code); }
};

std::string TranslateOnigurumaPattern(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 32);
  bool in_class = false;
  size_t class_start = 0;  // index in `p` just after '[' or '[^'
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[i + 1];
      std::string_view cls;
      bool negate = false;
      switch (e) {
        case 's':
          cls = kSpaceClass;
          break;
        case 'S':
          cls = kSpaceClass;
          negate = true;
          break;
        case 'w':
          cls = kWordClass;
          break;
        case 'W':
          cls = kWordClass;
          negate = true;
          break;
        case 'h':
          cls = kHexClass;
          break;
        case 'H':
          cls = kHexClass;
          negate = true;
          break;
        default:
          break;
      }
      if (!cls.empty() && (!in_class || !negate)) {
        if (in_class) {
          out.append(cls);
        } else {
          absl::StrAppend(&out, negate ? "[^" : "[", AbslView(cls), "]");
        }
      } else {
        out.append(p.substr(i, 2));  // other escapes (and negated classes inside [...]) pass through
      }
      ++i;
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out.push_back(c);
      if (i + 1 < p.size() && p[i + 1] == '^') out.push_back(p[++i]);
      class_start = i + 1;
      continue;
    }
    if (in_class) {
      if (c == '[' && i + 1 < p.size() && p[i + 1] == ':') {  // POSIX class [:alpha:]
        const size_t close = p.find(":]", i + 2);
        if (close != std::string_view::npos) {
          out.append(p.substr(i, close + 2 - i));
          i = close + 1;
          continue;
        }
      }
      if (c == ']' && i != class_start) in_class = false;
    }
    out.push_back(c);
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Regex>> Regex::Compile(std::string_view pattern) {
  std::unique_ptr<Regex> re(new Regex());
  re->pcre2_pattern_ = TranslateOnigurumaPattern(pattern);
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(re->pcre2_pattern_.data()), re->pcre2_pattern_.size(),
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &error, &offset, nullptr);
  if (code == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("regular expression \"", AbslView(pattern), "\" does not compile (",
                                                   Pcre2Error(error), " at offset ", offset, " of the PCRE2 form \"",
                                                   re->pcre2_pattern_, "\")"));
  }
  re->code_ = std::make_unique<Code>();
  re->code_->code = code;
  // JIT is an optimisation only: without it (or when it fails) pcre2_match interprets.
  (void)pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  return re;
}

absl::StatusOr<std::unique_ptr<Regex>> Regex::CompileLiteral(std::string_view literal) {
  std::string quoted;
  for (char c : literal) {
    if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) quoted.push_back('\\');
    quoted.push_back(c);
  }
  return Compile(quoted);
}

Regex::~Regex() = default;

absl::Status Regex::FindAll(std::string_view text, std::vector<std::pair<size_t, size_t>>* matches) const {
  return ForEachMatch(text, [matches](size_t begin, size_t end) { matches->emplace_back(begin, end); });
}

absl::Status Regex::ForEachMatch(std::string_view text, absl::FunctionRef<void(size_t, size_t)> fn) const {
  // One match-data block per thread, reused: only the whole-match offsets are read, and they are
  // copied out before `fn` runs, so a nested ForEachMatch from `fn` may reuse the block.
  struct MatchData {
    pcre2_match_data* md = pcre2_match_data_create(1, nullptr);
    ~MatchData() { pcre2_match_data_free(md); }
  };
  thread_local MatchData holder;
  pcre2_match_data* md = holder.md;
  if (md == nullptr) return absl::ResourceExhaustedError("cannot allocate PCRE2 match data");
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t start = 0;
  absl::Status status;
  while (start < text.size()) {
    int rc = pcre2_match(code_->code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {  // very long runs: the interpreter keeps its frames on the heap
      rc = pcre2_match(code_->code, subject, text.size(), start, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md, nullptr);
    }
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      status = absl::InternalError(absl::StrCat("regular expression match failed: ", Pcre2Error(rc)));
      break;
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t begin = ov[0];
    const size_t end = ov[1];
    if (end <= begin) {  // empty match: move on by one character
      if (begin >= text.size()) break;
      start = begin + Utf8Len(static_cast<unsigned char>(text[begin]));
      continue;
    }
    fn(begin, end);
    start = end;
  }
  return status;
}

}  // namespace shardserve::tokenizer_internal

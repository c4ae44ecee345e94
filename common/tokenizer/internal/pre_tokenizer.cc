#include "common/tokenizer/internal/pre_tokenizer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/status/macros.h"
#include "common/tokenizer/internal/string_view.h"

namespace shardserve::tokenizer_internal {
namespace {

struct Span {
  size_t begin;
  size_t end;
  bool is_match;
};

absl::StatusOr<std::unique_ptr<Regex>> CompileAt(std::string_view pattern, bool literal, const JsonWhere& where) {
  auto re = literal ? Regex::CompileLiteral(pattern) : Regex::Compile(pattern);
  if (!re.ok()) return where.Error(std::string(re.status().message()));
  return re;
}

}  // namespace

absl::Status PreTokenizer::AddSteps(const Json& j, const JsonWhere& where) {
  ASSIGN_OR_RETURN(std::string type, JsonType(j, where));
  if (byte_level_) return where.Unsupported("follows a ByteLevel pre-tokenizer, which must come last");
  if (type == "Sequence") {
    const Json* list = JsonMember(j, "pretokenizers");
    if (list == nullptr || !list->is_array()) return where.Child("pretokenizers").Error("is missing or not a list");
    size_t i = 0;
    for (const Json& e : *list) RETURN_IF_ERROR(AddSteps(e, where.Child("pretokenizers").Index(i++)));
    return absl::OkStatus();
  }
  Step step;
  if (type == "Split") {
    step.kind = Kind::kSplit;
    const Json* pattern = JsonMember(j, "pattern");
    if (pattern == nullptr || !pattern->is_object()) return where.Child("pattern").Error("is missing or not an object");
    if (pattern->contains("String")) {
      ASSIGN_OR_RETURN(std::string text, JsonString(*pattern, "String", where.Child("pattern")));
      if (text.empty()) return where.Child("pattern.String").Error("is empty");
      ASSIGN_OR_RETURN(step.regex, CompileAt(text, /*literal=*/true, where.Child("pattern.String")));
    } else if (pattern->contains("Regex")) {
      ASSIGN_OR_RETURN(std::string text, JsonString(*pattern, "Regex", where.Child("pattern")));
      ASSIGN_OR_RETURN(step.regex, CompileAt(text, /*literal=*/false, where.Child("pattern.Regex")));
    } else {
      return where.Child("pattern").Error("has neither \"String\" nor \"Regex\"");
    }
    ASSIGN_OR_RETURN(std::string behavior, JsonString(j, "behavior", where));
    if (behavior == "Removed")
      step.behavior = Behavior::kRemoved;
    else if (behavior == "Isolated")
      step.behavior = Behavior::kIsolated;
    else if (behavior == "MergedWithPrevious")
      step.behavior = Behavior::kMergedWithPrevious;
    else if (behavior == "MergedWithNext")
      step.behavior = Behavior::kMergedWithNext;
    else if (behavior == "Contiguous")
      step.behavior = Behavior::kContiguous;
    else
      return where.Child("behavior").Error(absl::StrCat("is \"", behavior, "\", not a split behavior"));
    ASSIGN_OR_RETURN(step.invert, JsonBoolOr(j, "invert", false, where));
  } else if (type == "Digits") {
    step.kind = Kind::kSplit;
    ASSIGN_OR_RETURN(bool individual, JsonBoolOr(j, "individual_digits", false, where));
    ASSIGN_OR_RETURN(step.regex, CompileAt(individual ? "\\p{N}" : "\\p{N}+", /*literal=*/false, where));
    step.behavior = Behavior::kIsolated;
  } else if (type == "Metaspace") {
    step.kind = Kind::kMetaspace;
    ASSIGN_OR_RETURN(step.replacement, JsonStringOr(j, "replacement", "\xE2\x96\x81", where));
    if (step.replacement.empty()) return where.Child("replacement").Error("is empty");
    ASSIGN_OR_RETURN(step.split, JsonBoolOr(j, "split", true, where));
    // Older files have add_prefix_space instead of prepend_scheme.
    ASSIGN_OR_RETURN(bool add_prefix_space, JsonBoolOr(j, "add_prefix_space", true, where));
    ASSIGN_OR_RETURN(std::string scheme,
                     JsonStringOr(j, "prepend_scheme", add_prefix_space ? "always" : "never", where));
    if (scheme == "always")
      step.prepend = Prepend::kAlways;
    else if (scheme == "never")
      step.prepend = Prepend::kNever;
    else if (scheme == "first")
      step.prepend = Prepend::kFirst;
    else
      return where.Child("prepend_scheme").Error(absl::StrCat("is \"", scheme, "\", not always/never/first"));
    ASSIGN_OR_RETURN(step.regex, CompileAt(step.replacement, /*literal=*/true, where.Child("replacement")));
  } else if (type == "ByteLevel") {
    step.kind = Kind::kByteLevel;
    ASSIGN_OR_RETURN(step.add_prefix_space, JsonBoolOr(j, "add_prefix_space", true, where));
    ASSIGN_OR_RETURN(bool use_regex, JsonBoolOr(j, "use_regex", true, where));
    if (use_regex) {
      ASSIGN_OR_RETURN(step.regex, CompileAt(kGpt2Pattern, /*literal=*/false, where));
    }
    byte_level_ = true;
  } else {
    return where.Unsupported(absl::StrCat("is a \"", type,
                                          "\" pre-tokenizer, which is not supported (supported: Sequence, Split, "
                                          "ByteLevel, Metaspace, Digits)"));
  }
  steps_.push_back(std::move(step));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<PreTokenizer>> PreTokenizer::FromJson(const Json& j, const JsonWhere& where) {
  auto p = std::unique_ptr<PreTokenizer>(new PreTokenizer());
  if (!j.is_null()) RETURN_IF_ERROR(p->AddSteps(j, where));
  return p;
}

// Mirrors NormalizedString::split of the `tokenizers` library.
absl::Status PreTokenizer::SplitThen(size_t k, const Regex& regex, Behavior behavior, bool invert,
                                     std::string_view piece, bool at_start, WordSink sink) const {
  absl::Status status;
  auto part = [&](size_t begin, size_t end) {
    if (begin == end || !status.ok()) return;
    status = Apply(k, piece.substr(begin, end - begin), at_start && begin == 0, sink);
  };
  if (!invert && (behavior == Behavior::kIsolated || behavior == Behavior::kRemoved)) {
    // The common case, streamed: gaps and (unless removed) matches in order.
    size_t prev = 0;
    RETURN_IF_ERROR(regex.ForEachMatch(piece, [&](size_t b, size_t e) {
      part(prev, b);
      if (behavior == Behavior::kIsolated) part(b, e);
      prev = e;
    }));
    part(prev, piece.size());
    return status;
  }
  std::vector<Span> spans;
  size_t prev = 0;
  RETURN_IF_ERROR(regex.ForEachMatch(piece, [&](size_t b, size_t e) {
    if (prev != b) spans.push_back({prev, b, invert});
    spans.push_back({b, e, !invert});
    prev = e;
  }));
  if (prev != piece.size()) spans.push_back({prev, piece.size(), invert});

  std::vector<Span> merged;  // is_match here means "remove"
  merged.reserve(spans.size());
  switch (behavior) {
    case Behavior::kIsolated:
      for (const Span& s : spans) merged.push_back({s.begin, s.end, false});
      break;
    case Behavior::kRemoved:
      for (const Span& s : spans) merged.push_back({s.begin, s.end, s.is_match});
      break;
    case Behavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (const Span& s : spans) {
        if (s.is_match && !previous_match && !merged.empty()) {
          merged.back().end = s.end;
        } else {
          merged.push_back({s.begin, s.end, false});
        }
        previous_match = s.is_match;
      }
      break;
    }
    case Behavior::kMergedWithNext: {
      bool previous_match = false;
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->is_match && !previous_match && !merged.empty()) {
          merged.back().begin = it->begin;
        } else {
          merged.push_back({it->begin, it->end, false});
        }
        previous_match = it->is_match;
      }
      std::reverse(merged.begin(), merged.end());
      break;
    }
    case Behavior::kContiguous: {
      bool previous_match = false;
      for (const Span& s : spans) {
        if (s.is_match == previous_match && !merged.empty()) {
          merged.back().end = s.end;
        } else {
          merged.push_back({s.begin, s.end, false});
        }
        previous_match = s.is_match;
      }
      break;
    }
  }
  for (const Span& s : merged) {
    if (!s.is_match) part(s.begin, s.end);
  }
  return status;
}

absl::Status PreTokenizer::Apply(size_t k, std::string_view piece, bool at_start, WordSink sink) const {
  if (piece.empty()) return absl::OkStatus();
  if (k == steps_.size()) {
    sink(piece);
    return absl::OkStatus();
  }
  const Step& step = steps_[k];
  switch (step.kind) {
    case Kind::kSplit:
      return SplitThen(k + 1, *step.regex, step.behavior, step.invert, piece, at_start, sink);
    case Kind::kMetaspace: {
      std::string text = piece.find(' ') == std::string_view::npos
                             ? std::string(piece)
                             : absl::StrReplaceAll(AbslView(piece), {{" ", step.replacement}});
      const bool prepend = step.prepend == Prepend::kAlways || (step.prepend == Prepend::kFirst && at_start);
      if (prepend && !absl::StartsWith(text, step.replacement)) {
        std::string with_prefix;
        with_prefix.reserve(step.replacement.size() + text.size());
        with_prefix.append(step.replacement).append(text);
        text.swap(with_prefix);
      }
      if (step.split) return SplitThen(k + 1, *step.regex, Behavior::kMergedWithNext, false, text, at_start, sink);
      return Apply(k + 1, text, at_start, sink);
    }
    case Kind::kByteLevel: {
      std::string prefixed;
      if (step.add_prefix_space && !piece.starts_with(' ')) {
        prefixed.reserve(piece.size() + 1);
        prefixed.push_back(' ');
        prefixed.append(piece);
        piece = prefixed;
      }
      if (step.regex != nullptr)
        return SplitThen(k + 1, *step.regex, Behavior::kIsolated, false, piece, at_start, sink);
      return Apply(k + 1, piece, at_start, sink);
    }
  }
  return absl::InternalError("unknown pre-tokenizer step");
}

absl::Status PreTokenizer::PreTokenize(std::string_view text, bool at_input_start, WordSink sink) const {
  return Apply(0, text, at_input_start, sink);
}

absl::Status PreTokenizer::PreTokenizeToVector(std::string_view text, bool at_input_start,
                                               std::vector<std::string>* out) const {
  return PreTokenize(text, at_input_start, [out](std::string_view word) { out->emplace_back(word); });
}

}  // namespace shardserve::tokenizer_internal

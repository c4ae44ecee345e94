#include "coordinator/http/http_server.h"

#include <httplib.h>
#include <openssl/err.h>
#include <openssl/ssl.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <optional>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/http/capped_body.h"
#include "common/http/client_connection.h"
#include "common/log/log.h"
#include "coordinator/frontend/admission.h"
#include "coordinator/frontend/chat_prompt.h"
#include "coordinator/frontend/choices.h"
#include "coordinator/frontend/reasoning.h"
#include "coordinator/frontend/request_log.h"
#include "coordinator/frontend/sequence_output.h"
#include "coordinator/frontend/tool_calls.h"
#include "coordinator/http/openai_protocol.h"
#include "coordinator/structured/json_schema.h"

namespace shardserve::coordinator::http {
namespace {

using frontend::ChoiceCanceller;
using frontend::ChoiceGroup;
using frontend::ParsedOutput;
using frontend::ParseReasoningFormat;
using frontend::ParseToolCallFormat;
using frontend::ParseToolCalls;
using frontend::ReasoningFormat;
using frontend::ReasoningFormatOf;
using frontend::ReasoningSplit;
using frontend::ReasoningStreamer;
using frontend::ReportRejected;
using frontend::SequenceText;
using frontend::SplitReasoning;
using frontend::ToolCallFormat;
using frontend::ToolCallStreamer;

using Json = nlohmann::ordered_json;

// How often a request that is not streamed looks whether its client is still there.
constexpr absl::Duration kClientLook = absl::Milliseconds(200);
// The longest X-Request-Id taken as a request's name.
constexpr size_t kMaxClientRequestId = 128;

// Rung whenever any choice of a request has news: one thread waits on it for news of several
// HttpChoices (a completions request with several prompts has one per prompt). Thread-safe.
class Bell {
 public:
  void Ring() {
    absl::MutexLock lock(&mu_);
    ++rings_;
  }
  uint64_t rings() {
    absl::MutexLock lock(&mu_);
    return rings_;
  }
  // Waits up to `timeout` for a ring after `seen` (a value of rings()).
  void WaitPast(uint64_t seen, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto rung = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return rings_ != seen; };
    mu_.AwaitWithTimeout(absl::Condition(&rung), timeout);
  }

 private:
  absl::Mutex mu_;
  uint64_t rings_ ABSL_GUARDED_BY(mu_) = 0;
};

// One request's output queues, one per choice: the SequenceSinks the scheduler feeds (never
// blocking) and the handler thread that drains them. Text goes through each choice's stream
// decoder and stop-string matcher here, so the handler only sees text that is final.
class HttpChoices final : public std::enable_shared_from_this<HttpChoices> {
 public:
  // `tokenizer` (may be null) decodes the text and spells the tokens of logprobs entries. Each
  // choice's text is decoded as the continuation of `admitted`'s prompt (StreamDecoder::Prime: a
  // first word keeps its space), with its stop strings and text options.
  // `bell` (may be null) is rung after each piece of news.
  HttpChoices(int n, const Tokenizer* tokenizer, const frontend::AdmittedRequest& admitted,
              std::shared_ptr<Bell> bell = nullptr)
      : tokenizer_(tokenizer), num_choices_(static_cast<size_t>(n)), bell_(std::move(bell)) {
    const std::unique_ptr<StreamDecoder> primed =
        frontend::ContinuationDecoder(tokenizer, admitted.sequence.prompt, admitted.skip_special_tokens);
    for (int i = 0; i < n; ++i) {
      choices_.emplace_back(primed != nullptr ? primed->Clone() : nullptr, admitted.stop, admitted.include_stop);
    }
  }

  size_t size() const { return num_choices_; }

  // One SequenceSink per choice, for ChoiceGroup::Submit.
  std::vector<std::shared_ptr<SequenceSink>> Sinks() {
    std::vector<std::shared_ptr<SequenceSink>> sinks;
    for (size_t i = 0; i < num_choices_; ++i) sinks.push_back(std::make_shared<ChoiceSink>(shared_from_this(), i));
    return sinks;
  }

  // The submitted choices; applies what came before (a cancel, a stop string's match).
  void Bind(std::shared_ptr<ChoiceGroup> group) { canceller_.Bind(std::move(group)); }

  // Ends every choice (the client went away). No lock held: the scheduler may call OnEnd on this
  // thread.
  void Cancel() { canceller_.CancelAll(); }

  // Completions' echo, before Submit: every choice's answer starts with `prompt_text`; with
  // logprobs, its entries start with the prompt's tokens' (the first one without a logprob), and
  // the prompt's text is held back until they have all arrived (from choice 0), so that a streamed
  // chunk's text and entries agree.
  void Echo(std::string prompt_text, std::vector<int32_t> prompt, bool with_logprobs) {
    absl::MutexLock lock(&mu_);
    echo_text_ = std::move(prompt_text);
    echo_prompt_ = std::move(prompt);
    if (with_logprobs && !echo_prompt_.empty()) {
      if (tokenizer_ != nullptr) echo_decoder_ = tokenizer_->NewStreamDecoder(/*skip_special_tokens=*/true);
      auto [token, chars] = SpellAt(echo_decoder_.get(), echo_prompt_[0]);
      echo_entries_.push_back(LogprobEntry{.token = std::move(token), .has_logprob = false, .text_chars = chars});
      AdvanceEchoLocked();
    }
    if (!with_logprobs || echo_prompt_.size() <= 1) ReleaseEchoLocked();
  }

  struct Update {
    size_t index = 0;                    // the choice
    std::string text;                    // new final text
    std::vector<LogprobEntry> logprobs;  // of the new tokens, when the request asked
    std::optional<SequenceEnd> end;      // once, when the choice has ended (with all its text)
    double cumulative_logprob = 0;       // of all its tokens so far (with logprobs asked)
  };

  // Waits up to `timeout` for news of any choice, and takes what there is: one Update per choice
  // with news, in choice order (none after the timeout).
  std::vector<Update> Wait(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(
                             +[](HttpChoices* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) { return s->HasNewsLocked(); },
                             this),
                         timeout);
    std::vector<Update> updates;
    for (size_t i = 0; i < choices_.size(); ++i) {
      Choice& c = choices_[i];
      const bool end = c.end.has_value() && !c.end_taken;
      if (c.text.empty() && c.logprobs.empty() && !end) continue;
      Update& u = updates.emplace_back();
      u.index = i;
      u.text = std::move(c.text);
      c.text.clear();
      u.logprobs = std::move(c.logprobs);
      c.logprobs.clear();
      if (end) u.end = c.end;
      c.end_taken = c.end_taken || end;
      u.cumulative_logprob = c.cumulative_logprob;
    }
    return updates;
  }

 private:
  struct Choice {
    Choice(std::unique_ptr<StreamDecoder> decoder, const std::vector<std::string>& stops, bool include_stop)
        : sequence_text(std::move(decoder), stops, include_stop) {}
    SequenceText sequence_text;  // no text when the model has no tokenizer
    std::string text;                    // final text not yet taken by Wait
    std::vector<LogprobEntry> logprobs;  // not yet taken by Wait
    std::optional<SequenceEnd> end;
    bool end_taken = false;  // Wait has reported the end
    double cumulative_logprob = 0;
    // Tokens delivered after the one that completed a stop string (several decode steps per call
    // deliver them together): not returned, and not counted in the usage.
    int32_t past_stop = 0;
  };

  class ChoiceSink final : public SequenceSink {
   public:
    ChoiceSink(std::shared_ptr<HttpChoices> choices, size_t index) : choices_(std::move(choices)), index_(index) {}
    void OnPromptLogprobs(absl::Span<const TokenLogprobs> logprobs) override {
      choices_->OnPromptLogprobs(logprobs);
      choices_->Ring();
    }
    void OnTokens(absl::Span<const int32_t> tokens, absl::Span<const TokenLogprobs> logprobs) override {
      choices_->OnTokens(index_, tokens, logprobs);
      choices_->Ring();
    }
    void OnEnd(const SequenceEnd& end) override {
      choices_->OnEnd(index_, end);
      choices_->Ring();
    }

   private:
    const std::shared_ptr<HttpChoices> choices_;
    const size_t index_;
  };

  void OnPromptLogprobs(absl::Span<const TokenLogprobs> logprobs) {
    absl::MutexLock lock(&mu_);
    for (const TokenLogprobs& lp : logprobs) {
      if (echo_entries_.empty() || echo_entries_.size() >= echo_prompt_.size()) break;  // not asked, or all there
      echo_entries_.push_back(Entry(echo_decoder_.get(), echo_prompt_[echo_entries_.size()], lp));
      AdvanceEchoLocked();
    }
    if (!echo_released_ && !echo_entries_.empty() && echo_entries_.size() == echo_prompt_.size()) ReleaseEchoLocked();
  }

  void OnTokens(size_t index, absl::Span<const int32_t> tokens, absl::Span<const TokenLogprobs> logprobs) {
    bool stop_now = false;
    {
      absl::MutexLock lock(&mu_);
      Choice& c = choices_[index];
      if (c.sequence_text.stopped()) {
        c.past_stop += static_cast<int32_t>(tokens.size());
        return;
      }
      for (size_t i = 0; i < tokens.size(); ++i) {
        if (i < logprobs.size()) {
          c.logprobs.push_back(Entry(c.sequence_text.decoder(), tokens[i], logprobs[i]));
          c.cumulative_logprob += logprobs[i].logprob;
        }
        if (c.sequence_text.has_text() && c.sequence_text.Add(tokens[i], &c.text)) {
          stop_now = true;
          c.past_stop += static_cast<int32_t>(tokens.size() - i - 1);
          break;
        }
      }
    }
    // A stop string matched: end the choice as stopped (logged and counted as such).
    if (stop_now) canceller_.Stop(index);
  }

  void OnEnd(size_t index, const SequenceEnd& end) {
    absl::MutexLock lock(&mu_);
    Choice& c = choices_[index];
    c.end = end;
    if (c.sequence_text.stopped()) {
      c.end->status = absl::OkStatus();
      c.end->reason = FinishReason::kStop;
      c.end->completion_tokens -= std::min(c.past_stop, c.end->completion_tokens);
    } else if (end.status.ok() && end.reason != FinishReason::kCancelled && c.sequence_text.Finish(&c.text)) {
      c.end->reason = FinishReason::kStop;
    }
  }

  bool HasNewsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const Choice& c : choices_) {
      if (!c.text.empty() || !c.logprobs.empty() || (c.end.has_value() && !c.end_taken)) return true;
    }
    return false;
  }

  // The echoed prompt goes in front of every choice's text and entries (before any token's: the
  // prompt's logprobs come before choice 0's first token, and the others start after it).
  void ReleaseEchoLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    echo_released_ = true;
    for (Choice& c : choices_) {
      c.text = echo_text_ + c.text;
      c.logprobs.insert(c.logprobs.begin(), echo_entries_.begin(), echo_entries_.end());
    }
    echo_entries_.clear();
  }

  // A token's text: decoded alone (special tokens included), or "token_id:N" without a tokenizer.
  std::string Spell(int32_t id) const {
    if (tokenizer_ != nullptr) {
      absl::StatusOr<std::string> s = tokenizer_->Decode({id}, /*skip_special_tokens=*/false);
      if (s.ok()) return *std::move(s);
    }
    return absl::StrCat("token_id:", id);
  }
  // `id` spelled where `at` stands (the decoder of the text before it; null: decoded alone), and
  // the characters it adds to that text: see LogprobEntry.
  std::pair<std::string, int64_t> SpellAt(const StreamDecoder* at, int32_t id) const {
    if (at != nullptr) {
      absl::StatusOr<std::string> text = at->Clone()->Next(id);
      if (text.ok() && !text->empty()) {
        int64_t chars = 0;
        for (unsigned char b : *text) chars += (b & 0xC0) != 0x80 ? 1 : 0;  // lead bytes: one per character
        return {*std::move(text), chars};
      }
    }
    return {Spell(id), 0};
  }
  // The entry of token `id` where `at` stands, its alternatives spelled in the same place.
  LogprobEntry Entry(const StreamDecoder* at, int32_t id, const TokenLogprobs& lp) const {
    auto [token, chars] = SpellAt(at, id);
    LogprobEntry e{.token = std::move(token), .logprob = lp.logprob, .text_chars = chars};
    for (size_t k = 0; k < lp.top_ids.size() && k < lp.top_logprobs.size(); ++k) {
      e.top.emplace_back(SpellAt(at, lp.top_ids[k]).first, lp.top_logprobs[k]);
    }
    return e;
  }
  // The echoed prompt's decoder takes the token just entered.
  void AdvanceEchoLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (echo_decoder_ != nullptr) (void)echo_decoder_->Next(echo_prompt_[echo_entries_.size() - 1]);
  }

  void Ring() {
    if (bell_ != nullptr) bell_->Ring();
  }

  const Tokenizer* const tokenizer_;
  const size_t num_choices_;  // choices_.size(), fixed at construction
  const std::shared_ptr<Bell> bell_;
  absl::Mutex mu_;
  std::vector<Choice> choices_ ABSL_GUARDED_BY(mu_);  // fixed size
  ChoiceCanceller canceller_;
  // Echo: the prompt, and with logprobs its entries until they have all arrived.
  std::string echo_text_ ABSL_GUARDED_BY(mu_);
  std::vector<int32_t> echo_prompt_ ABSL_GUARDED_BY(mu_);
  std::vector<LogprobEntry> echo_entries_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<StreamDecoder> echo_decoder_ ABSL_GUARDED_BY(mu_);  // the prompt's text up to echo_entries_
  bool echo_released_ ABSL_GUARDED_BY(mu_) = false;
};

const char* FinishReasonText(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength: return "length";
    case FinishReason::kStop: return "stop";
    case FinishReason::kCancelled: return "cancelled";
  }
  return "";
}

// A tool call's id, unique within the server's run: the response's id, the choice and the call.
std::string ToolCallId(const std::string& response_id, size_t choice, size_t call) {
  return absl::StrCat("call_", response_id.substr(response_id.find('-') + 1), "_", choice, "_", call);
}

void Reply(httplib::Response& res, const ApiError& error) {
  res.status = error.http_status;
  res.set_content(Dump(error.body), "application/json");
}

void ReplyStatus(httplib::Response& res, const absl::Status& status) { Reply(res, ErrorFromStatus(status)); }

// The parsed messages as the chat prompt's turns (moved out of `messages`).
std::vector<frontend::ChatTurn> TakeTurns(std::vector<ChatMessage>& messages) {
  std::vector<frontend::ChatTurn> turns;
  for (ChatMessage& m : messages) {
    turns.push_back({.role = std::move(m.role), .content = std::move(m.content), .name = std::move(m.name),
                     .tool_calls = std::move(m.tool_calls), .tool_call_id = std::move(m.tool_call_id),
                     .reasoning = std::move(m.reasoning)});
  }
  return turns;
}

// `st` with "prompt[p]: " before its message; its payloads (the field it names) kept.
absl::Status NamingPrompt(const absl::Status& st, size_t p) {
  absl::Status named(st.code(), absl::StrCat("prompt[", p, "]: ", st.message()));
  st.ForEachPayload([&named](absl::string_view url, const absl::Cord& payload) { named.SetPayload(url, payload); });
  return named;
}

ApiError TooLarge(size_t max_body) {
  return MakeError(413, "invalid_request_error", absl::StrCat("request body is larger than ", max_body, " bytes"),
                   "request_too_large");
}

std::string HostOf(const std::string& listen) { return listen.substr(0, listen.rfind(':')); }

// OpenSSL's certificate callback: gives the connection the certificate chain and key read from
// their files now. 1 = go on, 0 = fail the handshake (files missing, or a key that does not match).
int LoadCertificateAtHandshake(SSL* ssl, void* arg) {
  const auto* files = static_cast<const security::TlsOptions*>(arg);
  if (SSL_use_certificate_chain_file(ssl, files->cert_file.c_str()) != 1 ||
      SSL_use_PrivateKey_file(ssl, files->key_file.c_str(), SSL_FILETYPE_PEM) != 1 || SSL_check_private_key(ssl) != 1) {
    LOG(WARNING) << "HTTPS handshake refused: cannot load " << files->cert_file << " / " << files->key_file;
    ERR_clear_error();
    return 0;
  }
  return 1;
}


// A token id of the JSON (int64) as the scheduler's int32: ids beyond int32 become ids outside
// the vocabulary, which admission refuses naming the field.
int32_t ClampId(int64_t id) {
  return static_cast<int32_t>(std::clamp<int64_t>(id, -1, std::numeric_limits<int32_t>::max()));
}

// The constraint that response_format or a guided_* field asks for (none for text).
std::optional<frontend::ConstraintInput> ConstraintOf(const SamplingFields& fields) {
  structured::ConstraintSpec spec;
  switch (fields.response_format) {
    case SamplingFields::ResponseFormat::kText:
      return std::nullopt;
    case SamplingFields::ResponseFormat::kJsonObject:
      spec = {structured::ConstraintKind::kJsonObject, ""};
      break;
    case SamplingFields::ResponseFormat::kJsonSchema:
      spec = {structured::ConstraintKind::kJsonSchema, fields.json_schema};
      break;
    case SamplingFields::ResponseFormat::kRegex:
      spec = {structured::ConstraintKind::kRegex, fields.regex};
      break;
    case SamplingFields::ResponseFormat::kChoice: {
      // Exactly one of the strings.
      std::vector<std::string> alternatives;
      for (const std::string& c : fields.choices) alternatives.push_back(structured::RegexLiteral(c));
      spec = {structured::ConstraintKind::kRegex, absl::StrCat("(?:", absl::StrJoin(alternatives, "|"), ")")};
      break;
    }
  }
  return frontend::ConstraintInput{std::move(spec), fields.format_param};
}

// A request's choices once submitted to the scheduler: what its answer, whole or streamed, is made
// of. Choice k of prompt p is choice p * generate + k.
struct Submitted {
  ResponseMeta meta;
  bool chat = false;
  int n = 1;         // choices answered per prompt
  int generate = 1;  // choices generated per prompt (best_of; n unless ranked)
  bool logprobs = false;
  std::optional<ToolCallFormat> tool_format;  // set: answers are parsed for tool calls
  std::vector<frontend::ToolFunction> tools;  // with tool_format: the request's (AdmittedRequest's)
  std::optional<ReasoningFormat> reasoning;   // set: chat answers are split (before tools are parsed)
  std::string harmony_opened;                 // the harmony message the prompt opened (AdmittedRequest's)
  int64_t prompt_tokens = 0;                  // over every prompt
  std::shared_ptr<Bell> bell;                 // rung by every prompt's choices
  std::vector<std::shared_ptr<HttpChoices>> choices;  // one per prompt

  int total() const { return generate * static_cast<int>(choices.size()); }
  void CancelAll() const {
    for (const auto& c : choices) c->Cancel();
  }
  // Usage over every generated choice (`ends`: every choice's end, by index, or null before it); a
  // prompt's cached tokens are its first choice's.
  Usage UsageOf(const std::vector<std::optional<SequenceEnd>>& ends) const {
    Usage u{.prompt_tokens = prompt_tokens};
    for (size_t i = 0; i < ends.size(); ++i) {
      if (!ends[i].has_value()) continue;
      u.completion_tokens += ends[i]->completion_tokens;
      if (i % static_cast<size_t>(generate) == 0) u.cached_tokens += ends[i]->cached_prompt_tokens;
    }
    return u;
  }
};

// Collects every choice, then answers them in one JSON body (ranked by best_of, tool calls parsed).
void AnswerWhole(const Submitted& sub, httplib::Response& res, const std::function<bool()>& client_gone) {
  const std::vector<std::shared_ptr<HttpChoices>>& choices = sub.choices;
  const size_t num_prompts = choices.size();
  const int generate = sub.generate;
  const int n = sub.n;
  const bool rank = generate > n;
  const bool logprobs = sub.logprobs;
  const ResponseMeta& meta = sub.meta;
  const bool chat = sub.chat;
  const std::optional<ToolCallFormat>& tool_format = sub.tool_format;
  const bool parse_tools = tool_format.has_value();
  const int total = sub.total();
  struct Answer {
    std::string text;
    std::vector<LogprobEntry> entries;
    std::optional<SequenceEnd> end;
    double cumulative_logprob = 0;
  };
  std::vector<Answer> answers(static_cast<size_t>(total));
  // Nobody reads the answer of a client that has hung up (a timeout of its own, say, after which
  // it may well send the request again): its sequences are cancelled rather than run to the end.
  absl::Time next_look = absl::Now() + kClientLook;
  // The prompts generate together; their answers are collected one prompt after the other.
  for (size_t p = 0; p < num_prompts; ++p) {
    int ended = 0;
    while (ended < generate) {
      if (absl::Now() >= next_look) {
        if (client_gone()) {
          sub.CancelAll();
          LOG(INFO) << "request " << meta.id << ": the client hung up before the answer; cancelled";
          ReplyAndClose(res, 499, "", "text/plain");  // nginx's "client closed request"; nobody reads it
          return;
        }
        next_look = absl::Now() + kClientLook;
      }
      for (HttpChoices::Update& u : choices[p]->Wait(kClientLook)) {
        Answer& a = answers[p * static_cast<size_t>(generate) + u.index];
        a.text += u.text;
        a.entries.insert(a.entries.end(), std::make_move_iterator(u.logprobs.begin()),
                         std::make_move_iterator(u.logprobs.end()));
        a.cumulative_logprob = u.cumulative_logprob;
        if (!u.end.has_value()) continue;
        if (!u.end->status.ok()) {
          sub.CancelAll();  // the answer fails as a whole
          return ReplyStatus(res, u.end->status);
        }
        a.end = u.end;
        ++ended;
      }
    }
  }
  std::vector<std::optional<SequenceEnd>> ends;
  for (const Answer& a : answers) ends.push_back(a.end);
  std::vector<size_t> order;
  for (size_t p = 0; p < num_prompts; ++p) {
    std::vector<size_t> mine(static_cast<size_t>(generate));
    for (size_t k = 0; k < mine.size(); ++k) mine[k] = p * mine.size() + k;
    if (rank) {
      std::stable_sort(mine.begin(), mine.end(), [&](size_t a, size_t b) {
        return answers[a].cumulative_logprob > answers[b].cumulative_logprob;
      });
      mine.resize(static_cast<size_t>(n));
    }
    order.insert(order.end(), mine.begin(), mine.end());
  }
  std::vector<ChoiceOutput> out;
  for (size_t i : order) {
    ChoiceOutput& o = out.emplace_back(ChoiceOutput{.text = answers[i].text,
                                                    .finish_reason = FinishReasonText(answers[i].end->reason),
                                                    .logprobs = logprobs ? &answers[i].entries : nullptr});
    if (sub.reasoning.has_value()) {
      ReasoningSplit split = SplitReasoning(*sub.reasoning, o.text, sub.harmony_opened);
      o.reasoning = std::move(split.reasoning);
      o.text = std::move(split.content);
    }
    if (!parse_tools) continue;
    ParsedOutput parsed = ParseToolCalls(*tool_format, o.text, sub.tools);
    if (parsed.calls.empty()) continue;
    o.text = std::move(parsed.content);
    o.tool_calls = std::move(parsed.calls);
    for (size_t k = 0; k < o.tool_calls.size(); ++k) o.tool_call_ids.push_back(ToolCallId(meta.id, out.size() - 1, k));
    if (answers[i].end->reason == FinishReason::kStop) o.finish_reason = "tool_calls";
  }
  const Usage usage = sub.UsageOf(ends);
  const Json reply = chat ? ChatResponse(meta, out, usage) : CompletionResponse(meta, out, usage);
  res.set_content(Dump(reply), "application/json");
}

// Streams the choices as server-sent events, as they come.
void AnswerStreamed(std::shared_ptr<const Submitted> sub, httplib::Response& res, absl::Duration keepalive,
                    bool include_usage, std::shared_ptr<security::ApiKeys::Lease> lease) {
  // The provider runs on this handler's thread until it calls sink.done() or a write
  // fails; the releaser then runs (success = false when the client went away first). Not ranked,
  // so generate == n and a choice's index is p * n + k.
  struct StreamState {
    bool role_sent = false;
    bool done = false;
    std::vector<int64_t> text_offset;  // completions' logprobs: where each choice's next token's text starts
    std::vector<std::optional<SequenceEnd>> ends;  // by choice, once it has ended
    int ended = 0;
    std::shared_ptr<security::ApiKeys::Lease> lease;  // released with the stream
    std::vector<ToolCallStreamer> tools;  // chat with tools parsed: one per choice
    std::vector<ReasoningStreamer> reasoning;  // chat with reasoning split: one per choice
  };
  auto state = std::make_shared<StreamState>();
  const size_t num_choices = static_cast<size_t>(sub->total());
  state->text_offset.assign(num_choices, 0);
  state->ends.resize(num_choices);
  if (sub->tool_format.has_value()) {
    state->tools.assign(num_choices, ToolCallStreamer(*sub->tool_format, sub->tools));
  }
  if (sub->reasoning.has_value()) {
    state->reasoning.assign(num_choices, ReasoningStreamer(*sub->reasoning, sub->harmony_opened));
  }
  state->lease = std::move(lease);
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [sub, state, keepalive, include_usage](size_t /*offset*/, httplib::DataSink& sink) {
        const std::vector<std::shared_ptr<HttpChoices>>& choices = sub->choices;
        const ResponseMeta& meta = sub->meta;
        const bool chat = sub->chat;
        const bool logprobs = sub->logprobs;
        const int total = sub->total();
        auto write = [&sink](const std::string& s) { return sink.write(s.data(), s.size()); };
        if (chat && !state->role_sent) {
          state->role_sent = true;
          for (int i = 0; i < total; ++i) {
            if (!write(SseEvent(Dump(ChatChunk(meta, "assistant", std::string(), "", nullptr, i))))) return false;
          }
        }
        // News of any prompt's choices, in index order; else a wait (up to keepalive) for the bell.
        auto take = [&choices]() {
          std::vector<HttpChoices::Update> all;
          for (size_t p = 0; p < choices.size(); ++p) {
            for (HttpChoices::Update& u : choices[p]->Wait(absl::ZeroDuration())) {
              u.index += p * choices[p]->size();
              all.push_back(std::move(u));
            }
          }
          return all;
        };
        const uint64_t seen = sub->bell->rings();
        std::vector<HttpChoices::Update> updates = take();
        if (updates.empty()) {
          sub->bell->WaitPast(seen, keepalive);
          updates = take();
        }
        for (HttpChoices::Update& u : updates) {
          const int index = static_cast<int>(u.index);
          // With reasoning split, the reasoning goes out as reasoning_content deltas and the rest
          // goes on as the content.
          if (!state->reasoning.empty()) {
            ReasoningStreamer& splitter = state->reasoning[u.index];
            ReasoningSplit split = splitter.Add(u.text);
            if (u.end.has_value() && u.end->status.ok()) {
              ReasoningSplit rest = splitter.Finish();
              split.reasoning += rest.reasoning;
              split.content += rest.content;
            }
            if (!split.reasoning.empty() &&
                !write(SseEvent(Dump(ReasoningChunk(meta, split.reasoning, index))))) {
              return false;
            }
            u.text = std::move(split.content);
          }
          // With tools, what may be a call is held back until the choice ends, then parsed.
          ParsedOutput parsed;
          if (!state->tools.empty()) {
            u.text = state->tools[u.index].Add(u.text);
            if (u.end.has_value() && u.end->status.ok()) {
              parsed = state->tools[u.index].Finish();
              u.text += parsed.content;
            }
          }
          if (!u.text.empty() || (logprobs && !u.logprobs.empty())) {
            const std::vector<LogprobEntry>* lp = logprobs ? &u.logprobs : nullptr;
            const Json chunk = chat ? ChatChunk(meta, "", u.text, "", lp, index)
                                    : CompletionChunk(meta, u.text, "", lp, state->text_offset[u.index], index);
            for (const LogprobEntry& e : u.logprobs) state->text_offset[u.index] += e.text_chars;
            if (!write(SseEvent(Dump(chunk)))) return false;
          }
          if (!u.end.has_value()) continue;
          if (!u.end->status.ok()) {
            // The answer fails as a whole: the error, then the end of the stream.
            if (!write(SseEvent(Dump(ErrorFromStatus(u.end->status).body)))) return false;
            sub->CancelAll();
            if (!write(SseDone())) return false;
            state->done = true;
            sink.done();
            return true;
          }
          // The calls: a delta with each one's id and name, then one with its arguments.
          for (size_t k = 0; k < parsed.calls.size(); ++k) {
            const std::string id = ToolCallId(meta.id, u.index, k);
            const int call = static_cast<int>(k);
            if (!write(SseEvent(Dump(ToolCallChunk(meta, index, call, &id, &parsed.calls[k].name, ""))))) return false;
            if (!write(SseEvent(Dump(ToolCallChunk(meta, index, call, nullptr, nullptr, parsed.calls[k].arguments))))) {
              return false;
            }
          }
          const char* reason = !parsed.calls.empty() && u.end->reason == FinishReason::kStop
                                   ? "tool_calls"
                                   : FinishReasonText(u.end->reason);
          const Json last = chat ? ChatChunk(meta, "", std::nullopt, reason, nullptr, index)
                                 : CompletionChunk(meta, "", reason, nullptr, 0, index);
          if (!write(SseEvent(Dump(last)))) return false;
          state->ends[u.index] = *u.end;
          ++state->ended;
        }
        if (state->ended < total) {
          // Nothing new: a comment line (ignored by SSE clients) finds out whether the client is still there.
          return !updates.empty() ? true : write(": keep-alive\n\n");
        }
        if (include_usage) {
          const Json usage =
              UsageChunk(meta, chat ? "chat.completion.chunk" : "text_completion", sub->UsageOf(state->ends));
          if (!write(SseEvent(Dump(usage)))) return false;
        }
        if (!write(SseDone())) return false;
        state->done = true;
        sink.done();
        return true;
      },
      [sub, state](bool /*success*/) {
        if (!state->done) sub->CancelAll();  // the client left (or the server stopped) mid-stream
      });
}

}  // namespace

absl::Status HttpServerOptions::Validate() const {
  const size_t colon = listen.rfind(':');
  if (listen.empty() || colon == std::string::npos || colon == 0) {
    return absl::InvalidArgumentError(absl::StrCat("--http_listen must be HOST:PORT, got \"", listen, "\""));
  }
  int port = -1;
  if (!absl::SimpleAtoi(listen.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("--http_listen port must be in [0, 65535], got \"", listen, "\""));
  }
  if (max_body_bytes < 1024) return absl::InvalidArgumentError("http max_body_bytes must be at least 1024");
  if (keepalive <= absl::ZeroDuration()) return absl::InvalidArgumentError("http keepalive must be > 0");
  if (!reasoning_parser.empty()) {
    if (absl::Status st = ParseReasoningFormat(reasoning_parser).status(); !st.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--reasoning_parser: ", st.message(), ", or nothing"));
    }
  }
  if (tool_call_parser != "auto") {
    if (absl::Status st = ParseToolCallFormat(tool_call_parser).status(); !st.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--tool_call_parser: ", st.message(), ", or auto"));
    }
  }
  return limits.Validate("--http_");
}

struct HttpServer::Impl {
  Impl(std::unique_ptr<httplib::Server> s, std::shared_ptr<const security::TlsOptions> files)
      : tls_files(std::move(files)), server_holder(std::move(s)), server(*server_holder) {}
  HttpServerOptions options;
  const Tokenizer* tokenizer = nullptr;
  Scheduler* scheduler = nullptr;
  std::function<absl::Status()> ready;
  std::unique_ptr<frontend::Admission> admission;  // request -> the scheduler's request
  std::unique_ptr<frontend::ChatPrompt> chat_prompt;  // /tokenize's messages
  std::atomic<uint64_t> next_id{1};

  // What the SSL_CTX's certificate callback reads (null without TLS); outlives the server.
  std::shared_ptr<const security::TlsOptions> tls_files;
  std::unique_ptr<httplib::Server> server_holder;  // an httplib::SSLServer with options.tls
  httplib::Server& server;                         // *server_holder
  std::thread thread;
  std::string address;
  int port = 0;
  absl::Mutex stop_mu;
  bool stopped ABSL_GUARDED_BY(stop_mu) = false;

  void Routes();
  Json ModelJson() const;
  void Models(httplib::Response& res);
  void Model(const std::string& id, httplib::Response& res);
  void Tokenize(const std::string& body, httplib::Response& res);
  void Detokenize(const std::string& body, httplib::Response& res);
  // `body`: the request's JSON. `lease`: the request's API-key admission (null without keys),
  // held until it ends.
  // `client_gone`: whether the client has hung up (checked while a request that is not streamed
  // runs: its sequences are then cancelled). `client_request_id`: the X-Request-Id header (empty
  // when absent).
  void Generate(const std::string& body, httplib::Response& res, bool chat,
                std::shared_ptr<security::ApiKeys::Lease> lease, const std::function<bool()>& client_gone,
                const std::string& client_request_id);
  // Reads the request body under max_body_bytes into *body; false when it could not be read, the
  // error (413 over the cap, 400 for broken framing) answered and the connection to be closed.
  bool ReadBody(const httplib::ContentReader& reader, httplib::Response& res, std::string* body) const;
  // A request refused before the scheduler: logged and counted, then answered.
  void Reject(httplib::Response& res, const absl::Status& status) {
    ReportRejected(options.observer, status);
    ReplyStatus(res, status);
  }
  absl::Status CheckModel(const std::string& model) const;
};

absl::Status HttpServer::Impl::CheckModel(const std::string& model) const {
  if (model.empty() || model == options.model_id || model == options.model_path) return absl::OkStatus();
  return WithParam(absl::NotFoundError(absl::StrCat("the model '", model, "' does not exist; this server serves '",
                                                    options.model_id, "'")),
                   "model");
}

Json HttpServer::Impl::ModelJson() const {
  Json model;
  model["id"] = options.model_id;
  model["object"] = "model";
  model["created"] = 0;
  model["owned_by"] = "shardserve";
  model["root"] = options.model_path;
  model["max_model_len"] = scheduler->options().limits.max_seq_len;
  return model;
}

void HttpServer::Impl::Models(httplib::Response& res) {
  Json list;
  list["object"] = "list";
  list["data"] = Json::array({ModelJson()});
  res.set_content(Dump(list), "application/json");
}

void HttpServer::Impl::Tokenize(const std::string& body, httplib::Response& res) {
  absl::StatusOr<TokenizeRequest> r = ParseTokenizeRequest(body);
  if (!r.ok()) return ReplyStatus(res, r.status());
  if (absl::Status st = CheckModel(r->model); !st.ok()) return ReplyStatus(res, st);
  const char* const param = r->prompt.has_value() ? "prompt" : "messages";
  if (tokenizer == nullptr) {
    return ReplyStatus(res, InvalidParam(param, absl::StrCat("the model ", options.model_path, " has no tokenizer")));
  }
  absl::StatusOr<std::vector<int32_t>> ids;
  if (r->prompt.has_value()) {
    ids = tokenizer->Encode(*r->prompt, r->add_special_tokens.value_or(true));
  } else {
    // Rendered as a chat request's prompt is (frontend::ChatPrompt), the BOS being the template's.
    absl::StatusOr<frontend::TemplateKwargs> kwargs = frontend::TemplateKwargs::Parse(r->chat_template_kwargs);
    if (!kwargs.ok()) {
      return ReplyStatus(
          res, InvalidParam("chat_template_kwargs", absl::StrCat("chat_template_kwargs: ", kwargs.status().message())));
    }
    absl::StatusOr<std::string> text =
        chat_prompt->RenderText(TakeTurns(*r->messages), {.add_generation_prompt = r->add_generation_prompt,
                                                          .continue_final_message = r->continue_final_message,
                                                          .template_kwargs = *std::move(kwargs)});
    if (text.ok()) {
      ids = tokenizer->Encode(*text, r->add_special_tokens.value_or(false));
    } else {
      ids = text.status();
    }
  }
  if (!ids.ok()) return ReplyStatus(res, InvalidParam(param, ids.status().message()));
  Json j;
  j["count"] = ids->size();
  j["max_model_len"] = scheduler->options().limits.max_seq_len;
  j["tokens"] = *ids;
  res.set_content(Dump(j), "application/json");
}

void HttpServer::Impl::Detokenize(const std::string& body, httplib::Response& res) {
  absl::StatusOr<DetokenizeRequest> r = ParseDetokenizeRequest(body);
  if (!r.ok()) return ReplyStatus(res, r.status());
  if (absl::Status st = CheckModel(r->model); !st.ok()) return ReplyStatus(res, st);
  if (tokenizer == nullptr) {
    return ReplyStatus(res, InvalidParam("tokens", absl::StrCat("the model ", options.model_path, " has no tokenizer")));
  }
  std::vector<int32_t> ids;
  const int64_t vocab = scheduler->options().limits.vocab_size;
  for (size_t i = 0; i < r->tokens.size(); ++i) {
    if (r->tokens[i] < 0 || r->tokens[i] >= vocab) {
      return ReplyStatus(res, InvalidParam("tokens", absl::StrCat("tokens[", i, "] = ", r->tokens[i],
                                                                  " is outside the vocabulary [0, ", vocab, ")")));
    }
    ids.push_back(static_cast<int32_t>(r->tokens[i]));
  }
  absl::StatusOr<std::string> text = tokenizer->Decode(ids, /*skip_special_tokens=*/false);
  if (!text.ok()) return ReplyStatus(res, InvalidParam("tokens", text.status().message()));
  Json j;
  j["prompt"] = *text;
  res.set_content(Dump(j), "application/json");
}

void HttpServer::Impl::Model(const std::string& id, httplib::Response& res) {
  if (id != options.model_id) {
    return Reply(res, MakeError(404, "invalid_request_error",
                                absl::StrCat("The model '", id, "' does not exist; this server serves '",
                                             options.model_id, "'"),
                                "model_not_found"));
  }
  res.set_content(Dump(ModelJson()), "application/json");
}

bool HttpServer::Impl::ReadBody(const httplib::ContentReader& reader, httplib::Response& res,
                                std::string* body) const {
  switch (ReadCappedBody(reader, options.max_body_bytes, res, body)) {
    case BodyRead::kOk:
      return true;
    case BodyRead::kTooLarge:
      ReplyAndClose(res, 413, Dump(TooLarge(options.max_body_bytes).body), "application/json");
      return false;
    case BodyRead::kBroken:
      ReplyAndClose(res, 400,
                    Dump(MakeError(400, "invalid_request_error", "the request body could not be read").body),
                    "application/json");
      return false;
  }
  return false;
}

void HttpServer::Impl::Generate(const std::string& body, httplib::Response& res, bool chat,
                                std::shared_ptr<security::ApiKeys::Lease> lease,
                                const std::function<bool()>& client_gone, const std::string& client_request_id) {
  // A client's X-Request-Id names the request (its response's id is "cmpl-" or "chatcmpl-" and
  // it; the request log's request_id too), so that a gateway's logs and ours meet; it is sent back
  // in the reply's X-Request-Id. Characters that would need quoting in a log line are refused.
  if (!client_request_id.empty()) {
    const bool plain = client_request_id.size() <= kMaxClientRequestId &&
                       std::all_of(client_request_id.begin(), client_request_id.end(), [](char c) {
                         return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' ||
                                c == '.' || c == ':' || c == '/' || c == '+';
                       });
    if (!plain) {
      return Reject(res, InvalidParam("X-Request-Id", absl::StrCat("the X-Request-Id header must be 1 to ",
                                                                   kMaxClientRequestId,
                                                                   " characters of A-Z a-z 0-9 - _ . : / +")));
    }
    res.set_header("X-Request-Id", client_request_id);
  }
  // One entry per prompt: a chat has one; completions 1 to kMaxPrompts, each with its own choices.
  struct Prompt {
    std::variant<std::string, std::vector<int32_t>, frontend::ChatInput> input;
    std::string echo_text;  // completions' echo: the prompt's text (of token ids: decoded once admitted)
    bool ids = false;
  };
  std::vector<Prompt> prompts;
  SamplingFields fields;
  bool echo = false;  // completions: the answer starts with the prompt
  if (chat) {
    absl::StatusOr<ChatRequest> parsed = ParseChatRequest(body);
    if (!parsed.ok()) return Reject(res, parsed.status());
    fields = parsed->fields;
    if (absl::Status st = CheckModel(fields.model); !st.ok()) return Reject(res, st);
    frontend::ChatInput in{.tools = std::move(parsed->tools),
                           .functions = std::move(parsed->tool_functions),
                           .tool_choice = parsed->tool_choice,
                           .tool_name = std::move(parsed->tool_name),
                           .parallel_tool_calls = parsed->parallel_tool_calls,
                           .add_generation_prompt = parsed->add_generation_prompt,
                           .continue_final_message = parsed->continue_final_message,
                           .template_kwargs = std::move(parsed->chat_template_kwargs)};
    in.turns = TakeTurns(parsed->messages);
    prompts.push_back({.input = std::move(in)});
  } else {
    absl::StatusOr<CompletionRequest> parsed = ParseCompletionRequest(body);
    if (!parsed.ok()) return Reject(res, parsed.status());
    fields = parsed->fields;
    if (absl::Status st = CheckModel(fields.model); !st.ok()) return Reject(res, st);
    echo = parsed->echo;
    for (CompletionPrompt& p : parsed->prompts) {
      if (p.text.has_value()) {
        prompts.push_back({.input = *p.text, .echo_text = echo ? *std::move(p.text) : std::string()});
      } else {
        std::vector<int32_t> ids;
        for (int64_t id : p.ids) ids.push_back(ClampId(id));
        prompts.push_back({.input = std::move(ids), .ids = true});
      }
    }
  }
  // n choices; with best_of, that many are generated and the n most likely answered (their
  // logprobs are needed to rank them, whether or not the client asked for them).
  const int n = static_cast<int>(fields.n);
  const int generate = static_cast<int>(fields.best_of.value_or(fields.n));
  if (generate < n) {
    return Reject(res, InvalidParam("best_of", absl::StrCat("'best_of' (", generate, ") must be >= 'n' (", n, ")")));
  }
  const bool rank = generate > n;
  if (rank && fields.stream) return Reject(res, InvalidParam("best_of", "'best_of' > 'n' cannot be streamed"));
  frontend::AdmissionRequest request;
  // OpenAI's defaults: 16 tokens for completions; chat runs to the end of the context.
  request.max_tokens = chat ? fields.max_tokens : fields.max_tokens.value_or(16);
  SequenceRequest& r = request.sequence;
  r.request_id = absl::StrCat(chat ? "chatcmpl-" : "cmpl-",
                              client_request_id.empty() ? absl::StrCat(next_id.fetch_add(1)) : client_request_id);
  if (client_request_id.empty()) res.set_header("X-Request-Id", r.request_id);
  r.sampling = {.temperature = static_cast<float>(fields.temperature),
                .top_k = static_cast<int32_t>(fields.top_k),
                .top_p = static_cast<float>(fields.top_p),
                .seed = static_cast<uint64_t>(fields.seed.value_or(0)),
                .min_p = static_cast<float>(fields.min_p),
                .presence_penalty = static_cast<float>(fields.presence_penalty),
                .frequency_penalty = static_cast<float>(fields.frequency_penalty),
                .repetition_penalty = static_cast<float>(fields.repetition_penalty)};
  for (const auto& [id, bias] : fields.logit_bias) r.sampling.logit_bias.emplace_back(ClampId(id), static_cast<float>(bias));
  for (int64_t id : fields.stop_token_ids) r.stop_token_ids.push_back(ClampId(id));
  r.ignore_eos = fields.ignore_eos;
  r.min_tokens = static_cast<int32_t>(std::min<int64_t>(fields.min_tokens, std::numeric_limits<int32_t>::max()));
  r.logprobs = fields.logprobs || rank;
  r.top_logprobs = static_cast<int32_t>(fields.top_logprobs);
  r.prompt_logprobs = echo && fields.logprobs;
  r.priority = fields.priority;
  request.stop = fields.stop;
  request.include_stop = fields.include_stop_str_in_output;
  request.truncate_prompt_tokens = fields.truncate_prompt_tokens;
  for (int64_t id : fields.allowed_token_ids) request.allowed_token_ids.push_back(ClampId(id));
  request.bad_words = fields.bad_words;
  request.skip_special_tokens = fields.skip_special_tokens;
  request.n = generate;
  request.constraint = ConstraintOf(fields);
  const ResponseMeta meta{.id = r.request_id, .created = absl::ToUnixSeconds(absl::Now()), .model = options.model_id};
  // Every prompt is admitted before any is submitted, so a bad one refuses the request as a whole.
  // Admit reports its own refusals.
  const size_t num_prompts = prompts.size();
  std::vector<frontend::AdmittedRequest> admitted;
  for (size_t p = 0; p < num_prompts; ++p) {
    frontend::AdmissionRequest one = request;
    one.prompt = std::move(prompts[p].input);
    if (num_prompts > 1) one.sequence.request_id = absl::StrCat(meta.id, "-", p);
    absl::StatusOr<frontend::AdmittedRequest> a = admission->Admit(std::move(one), frontend::OpenAiFieldNames(chat));
    if (!a.ok()) return ReplyStatus(res, num_prompts > 1 ? NamingPrompt(a.status(), p) : a.status());
    admitted.push_back(*std::move(a));
  }
  // Choice k of prompt p is the answer's choice p * generate + k (p * n + k once ranked).
  Submitted sub{.meta = meta,
                .chat = chat,
                .n = n,
                .generate = generate,
                .logprobs = fields.logprobs,
                .tool_format = admitted[0].tool_calls,
                .tools = std::move(admitted[0].tools),
                .reasoning = admitted[0].reasoning,  // chat answers the model writes freely
                .harmony_opened = admitted[0].harmony_opened,
                .bell = std::make_shared<Bell>()};
  for (size_t p = 0; p < num_prompts; ++p) {
    SequenceRequest& seq = admitted[p].sequence;
    std::string& echo_text = prompts[p].echo_text;
    // Echoed: the prompt as it was computed (decoded from its ids when it was given as ids, or cut
    // by truncate_prompt_tokens).
    if (echo && (prompts[p].ids || admitted[p].prompt_truncated) && tokenizer != nullptr) {
      absl::StatusOr<std::string> text = tokenizer->Decode(seq.prompt, /*skip_special_tokens=*/true);
      if (text.ok()) echo_text = *std::move(text);
    }
    sub.prompt_tokens += static_cast<int64_t>(seq.prompt.size());
    auto c = std::make_shared<HttpChoices>(generate, tokenizer, admitted[p], sub.bell);
    if (echo) c->Echo(std::move(echo_text), seq.prompt, fields.logprobs);
    // Logged and counted like the gRPC front end's requests (coordinator/frontend/request_log.h).
    absl::StatusOr<std::shared_ptr<ChoiceGroup>> group = ChoiceGroup::Submit(*scheduler, std::move(seq), c->Sinks());
    if (!group.ok()) {
      sub.CancelAll();
      return ReplyStatus(res, group.status());
    }
    c->Bind(*std::move(group));
    sub.choices.push_back(std::move(c));
  }
  if (!fields.stream) return AnswerWhole(sub, res, client_gone);
  AnswerStreamed(std::make_shared<const Submitted>(std::move(sub)), res, options.keepalive, fields.include_usage,
                 std::move(lease));
}

void HttpServer::Impl::Routes() {
  // Each route first admits the request under its API key (when keys are configured); the lease
  // lives as long as the request, streams included (the content provider holds it).
  auto admit = [this](const httplib::Request& req,
                      httplib::Response& res) -> std::optional<std::shared_ptr<security::ApiKeys::Lease>> {
    if (options.api_keys == nullptr) return std::shared_ptr<security::ApiKeys::Lease>();
    absl::StatusOr<std::shared_ptr<security::ApiKeys::Lease>> lease =
        options.api_keys->Admit(req.get_header_value("Authorization"), security::ApiRole::kUser);
    if (!lease.ok()) {
      Reject(res, lease.status());
      return std::nullopt;
    }
    return *std::move(lease);
  };
  server.Get("/v1/models", [this, admit](const httplib::Request& req, httplib::Response& res) {
    if (admit(req, res).has_value()) Models(res);
  });
  // One model by id (the OpenAI client's models.retrieve); ids may contain '/'.
  server.Get(R"(/v1/models/(.+))", [this, admit](const httplib::Request& req, httplib::Response& res) {
    if (admit(req, res).has_value()) Model(req.matches[1], res);
  });
  // vLLM's tokenizer endpoints.
  // Liveness and readiness as vLLM's /health (no API key, for probes): 200 with an empty body when
  // the cluster serves, 503 with the reason (as the gRPC API gives it) while it does not.
  server.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (absl::Status st = ready(); !st.ok()) return ReplyStatus(res, st);
    res.status = 200;
  });
  // Routes with a body: the API key is admitted first (an unauthenticated client never makes the
  // server read a body), then the body is read under max_body_bytes whatever its transfer
  // encoding. A request refused before its body is read closes its connection.
  using Lease = std::shared_ptr<security::ApiKeys::Lease>;
  using Handle = std::function<void(const httplib::Request&, const std::string&, httplib::Response&, Lease)>;
  auto with_body = [this, admit](Handle handle) {
    return [this, admit, handle = std::move(handle)](const httplib::Request& req, httplib::Response& res,
                                                     const httplib::ContentReader& reader) {
      std::optional<Lease> lease = admit(req, res);
      if (!lease.has_value()) {
        std::string refusal = std::move(res.body);
        return ReplyAndClose(res, res.status, std::move(refusal), "application/json");
      }
      std::string body;
      if (ReadBody(reader, res, &body)) handle(req, body, res, *std::move(lease));
    };
  };
  server.Post("/tokenize", with_body([this](const httplib::Request&, const std::string& body, httplib::Response& res,
                                            Lease) {
    Tokenize(body, res);
  }));
  server.Post("/detokenize", with_body([this](const httplib::Request&, const std::string& body,
                                              httplib::Response& res, Lease) {
    Detokenize(body, res);
  }));
  // The socket is looked up once, the first time a request is still running after kClientLook.
  auto client_gone = [this](const httplib::Request& req) {
    return [addr = req.remote_addr, remote_port = req.remote_port, local_port = port,
            connection = std::optional<ClientConnection>(), looked = false]() mutable {
      if (!looked) {
        connection = ClientConnection::Find(addr, remote_port, local_port);
        looked = true;
      }
      return connection.has_value() && connection->Gone();
    };
  };
  for (const bool chat : {false, true}) {
    server.Post(chat ? "/v1/chat/completions" : "/v1/completions",
                with_body([this, chat, client_gone](const httplib::Request& req, const std::string& body,
                                                    httplib::Response& res, Lease lease) {
                  Generate(body, res, chat, std::move(lease), client_gone(req), req.get_header_value("X-Request-Id"));
                }));
  }
  // Any other request with a body: 404 without reading it (cpp-httplib would read it whole).
  RefuseUnroutedBodies(server, [](const httplib::Request& req, httplib::Response& res) {
    Reply(res, MakeError(404, "invalid_request_error", absl::StrCat("unknown route: ", req.method, " ", req.path),
                         "unknown_route"));
  });
  // A known path with the wrong method: 405, before the body is read.
  server.set_pre_routing_handler([](const httplib::Request& req, httplib::Response& res) {
    const bool models = req.path == "/v1/models";
    const bool post = req.path == "/v1/completions" || req.path == "/v1/chat/completions";
    if ((models && req.method != "GET" && req.method != "HEAD") || (post && req.method != "POST")) {
      res.set_header("Allow", models ? "GET" : "POST");
      // Closes the connection: a body this request may have is not read.
      ReplyAndClose(res, 405,
                    Dump(MakeError(405, "invalid_request_error",
                                   absl::StrCat(req.method, " is not allowed on ", req.path, "; use ",
                                                models ? "GET" : "POST"),
                                   "method_not_allowed")
                             .body),
                    "application/json");
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  // Every error without a body of ours (no route, body too large, malformed HTTP) gets one.
  const size_t max_body = options.max_body_bytes;
  server.set_error_handler(httplib::Server::HandlerWithResponse([max_body](const httplib::Request& req,
                                                                          httplib::Response& res) {
    if (!res.body.empty() || res.content_provider_) return httplib::Server::HandlerResponse::Handled;
    ApiError e;
    switch (res.status) {
      case 404:
        e = MakeError(404, "invalid_request_error", absl::StrCat("unknown route: ", req.method, " ", req.path),
                      "unknown_route");
        break;
      case 413:
        e = TooLarge(max_body);
        break;
      default:
        e = MakeError(res.status, res.status < 500 ? "invalid_request_error" : "server_error",
                      absl::StrCat("HTTP error ", res.status));
        break;
    }
    e.http_status = res.status;
    Reply(res, e);
    return httplib::Server::HandlerResponse::Handled;
  }));
  server.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
    Reply(res, MakeError(500, "server_error", "internal error"));
  });
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() { Stop(); }

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(HttpServerOptions options, const Tokenizer* tokenizer,
                                                              Scheduler* scheduler,
                                                              std::function<absl::Status()> ready) {
  if (absl::Status st = options.Validate(); !st.ok()) return st;
  std::unique_ptr<httplib::Server> server;
  std::shared_ptr<const security::TlsOptions> tls_files;
  if (options.tls.has_value()) {
    // The certificate and key are read at every handshake (SSL_CTX_set_cert_cb), so a rotated
    // pair is served to the next connection without a restart.
    auto files = std::make_shared<security::TlsOptions>(*options.tls);
    auto ssl = std::make_unique<httplib::SSLServer>([files](SSL_CTX& ctx) {
      SSL_CTX_set_min_proto_version(&ctx, TLS1_2_VERSION);
      SSL_CTX_set_cert_cb(&ctx, &LoadCertificateAtHandshake, files.get());
      return true;
    });
    if (!ssl->is_valid()) return absl::InternalError("cannot set up the HTTPS server (OpenSSL)");
    server = std::move(ssl);
    tls_files = std::move(files);
  } else {
    server = std::make_unique<httplib::Server>();
  }
  auto impl = std::make_unique<Impl>(std::move(server), std::move(tls_files));
  impl->options = std::move(options);
  impl->tokenizer = tokenizer;
  impl->scheduler = scheduler;
  impl->ready = std::move(ready);
  impl->chat_prompt = std::make_unique<frontend::ChatPrompt>(tokenizer, impl->options.model_path);
  impl->admission = std::make_unique<frontend::Admission>(
      frontend::AdmissionOptions{.tokenizer = tokenizer,
                                 .model_path = impl->options.model_path,
                                 .constraints = impl->options.constraints,
                                 .tool_call_parser = impl->options.tool_call_parser,
                                 .reasoning = ReasoningFormatOf(impl->options.reasoning_parser),
                                 .limits = scheduler->options().limits,
                                 .eos_token_ids = scheduler->options().eos_token_ids,
                                 .ready = impl->ready,
                                 .observer = impl->options.observer});

  Impl& s = *impl;
  ApplyServingLimits(s.options.limits, s.server);
  // Content-Length bodies over the cap: refused by cpp-httplib before they are read (413); chunked
  // ones are cut by ReadCappedBody in the routes.
  s.server.set_payload_max_length(s.options.max_body_bytes);
  s.Routes();
  const std::string host = HostOf(s.options.listen);
  int want = 0;
  (void)absl::SimpleAtoi(s.options.listen.substr(s.options.listen.rfind(':') + 1), &want);  // checked by Validate
  absl::StatusOr<int> bound = BindServer(s.server, host, want);
  if (!bound.ok()) return absl::UnavailableError(absl::StrCat("cannot serve HTTP on --http_listen=", s.options.listen));
  s.port = *bound;
  s.address = absl::StrCat(host, ":", s.port);
  s.thread = std::thread([&s] { s.server.listen_after_bind(); });
  // Stop() only interrupts a server that is running: wait until it is.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!s.server.is_running() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  LOG(INFO) << "OpenAI-compatible HTTP API on " << (s.tls_files != nullptr ? "https://" : "http://") << s.address
            << "/v1";
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

void HttpServer::Stop() {
  {
    absl::MutexLock lock(&impl_->stop_mu);
    if (impl_->stopped) return;
    impl_->stopped = true;
  }
  impl_->server.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

const std::string& HttpServer::address() const { return impl_->address; }
int HttpServer::port() const { return impl_->port; }

}  // namespace shardserve::coordinator::http

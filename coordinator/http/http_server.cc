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
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/log/log.h"
#include "coordinator/api/request_log.h"
#include "coordinator/api/sequence_output.h"
#include "coordinator/api/stop_strings.h"
#include "coordinator/http/jinja.h"
#include "coordinator/http/openai_protocol.h"
#include "coordinator/structured/json_schema.h"

namespace shardserve::coordinator::http {
namespace {

using Json = nlohmann::ordered_json;

// One request's output queue: the SequenceSink the scheduler feeds (never blocking) and the
// handler thread that drains it. Text goes through the stream decoder and the stop-string matcher
// here, so the handler only sees text that is final.
class HttpSequence final : public SequenceSink {
 public:
  // `tokenizer` (may be null) spells the tokens of logprobs entries.
  HttpSequence(Scheduler* scheduler, std::unique_ptr<StreamDecoder> decoder, std::vector<std::string> stops,
               const Tokenizer* tokenizer)
      : canceller_(scheduler), sequence_text_(std::move(decoder), std::move(stops)), tokenizer_(tokenizer) {}

  // The id from Submit; cancels at once when a cancel was asked for before.
  void Bind(SequenceId id) { canceller_.Bind(id); }

  // Ends the sequence (the client went away, or a stop string matched). No lock held: the
  // scheduler may call OnEnd on this thread.
  void Cancel() { canceller_.Cancel(); }
  // A stop string matched: end the sequence as stopped (logged and counted as such).
  void Stop() { canceller_.Cancel(FinishReason::kStop); }

  void OnTokens(absl::Span<const int32_t> tokens, absl::Span<const TokenLogprobs> logprobs) override {
    bool stop_now = false;
    {
      absl::MutexLock lock(&mu_);
      if (sequence_text_.stopped()) return;
      for (size_t i = 0; i < tokens.size(); ++i) {
        if (i < logprobs.size()) logprobs_.push_back(Entry(tokens[i], logprobs[i]));
        if (sequence_text_.has_text() && sequence_text_.Add(tokens[i], &text_)) {
          stop_now = true;
          break;
        }
      }
    }
    if (stop_now) Stop();
  }

  void OnEnd(const SequenceEnd& end) override {
    absl::MutexLock lock(&mu_);
    end_ = end;
    if (sequence_text_.stopped()) {
      end_->status = absl::OkStatus();
      end_->reason = FinishReason::kStop;
    } else if (end.status.ok() && end.reason != FinishReason::kCancelled && sequence_text_.Finish(&text_)) {
      end_->reason = FinishReason::kStop;
    }
  }

  struct Update {
    std::string text;                    // new final text
    std::vector<LogprobEntry> logprobs;  // of the new tokens, when the request asked
    std::optional<SequenceEnd> end;      // set once the sequence has ended (with all its text)
  };

  // Waits up to `timeout` for new text or the end, and takes what there is.
  Update Wait(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(
                             +[](HttpSequence* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) {
                               return !s->text_.empty() || !s->logprobs_.empty() || s->end_.has_value();
                             },
                             this),
                         timeout);
    Update u;
    u.text = std::move(text_);
    text_.clear();
    u.logprobs = std::move(logprobs_);
    logprobs_.clear();
    u.end = end_;
    return u;
  }

 private:
  // A token's text: decoded alone (special tokens included), or "token_id:N" without a tokenizer.
  std::string Spell(int32_t id) const {
    if (tokenizer_ != nullptr) {
      absl::StatusOr<std::string> s = tokenizer_->Decode({id}, /*skip_special_tokens=*/false);
      if (s.ok()) return *std::move(s);
    }
    return absl::StrCat("token_id:", id);
  }
  LogprobEntry Entry(int32_t id, const TokenLogprobs& lp) const {
    LogprobEntry e{.token = Spell(id), .logprob = lp.logprob};
    for (size_t k = 0; k < lp.top_ids.size() && k < lp.top_logprobs.size(); ++k) {
      e.top.emplace_back(Spell(lp.top_ids[k]), lp.top_logprobs[k]);
    }
    return e;
  }

  SequenceCanceller canceller_;
  absl::Mutex mu_;
  SequenceText sequence_text_ ABSL_GUARDED_BY(mu_);  // no text when the model has no tokenizer
  const Tokenizer* tokenizer_;
  std::string text_ ABSL_GUARDED_BY(mu_);             // final text not yet taken by Wait
  std::vector<LogprobEntry> logprobs_ ABSL_GUARDED_BY(mu_);  // not yet taken by Wait
  std::optional<SequenceEnd> end_ ABSL_GUARDED_BY(mu_);
};

const char* FinishReasonText(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength: return "length";
    case FinishReason::kStop: return "stop";
    case FinishReason::kCancelled: return "cancelled";
  }
  return "";
}

void Reply(httplib::Response& res, const ApiError& error) {
  res.status = error.http_status;
  res.set_content(Dump(error.body), "application/json");
}

void ReplyStatus(httplib::Response& res, const absl::Status& status) { Reply(res, ErrorFromStatus(status)); }

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
  if (threads < 1) return absl::InvalidArgumentError("http threads must be >= 1");
  if (read_timeout <= absl::ZeroDuration() || write_timeout <= absl::ZeroDuration() ||
      keepalive <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("http timeouts must be > 0");
  }
  return absl::OkStatus();
}

struct HttpServer::Impl {
  Impl(std::unique_ptr<httplib::Server> s, std::shared_ptr<const security::TlsOptions> files)
      : tls_files(std::move(files)), server_holder(std::move(s)), server(*server_holder) {}
  HttpServerOptions options;
  const Tokenizer* tokenizer = nullptr;
  Scheduler* scheduler = nullptr;
  std::function<absl::Status()> ready;
  std::optional<jinja::JinjaTemplate> chat_template;
  absl::Status chat_template_error;  // why chat is not served (no template, or it does not parse)
  std::string bos_token, eos_token;
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
  void Tokenize(const httplib::Request& req, httplib::Response& res);
  void Detokenize(const httplib::Request& req, httplib::Response& res);
  // `lease`: the request's API-key admission (null without keys), held until it ends.
  void Generate(const httplib::Request& req, httplib::Response& res, bool chat,
                std::shared_ptr<security::ApiKeys::Lease> lease);
  // A request refused before the scheduler: logged and counted, then answered.
  void Reject(httplib::Response& res, const absl::Status& status) {
    ReportRejected(options.observer, status);
    ReplyStatus(res, status);
  }
  absl::StatusOr<std::vector<int32_t>> ChatPrompt(const ChatRequest& request) const;
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

void HttpServer::Impl::Tokenize(const httplib::Request& req, httplib::Response& res) {
  absl::StatusOr<TokenizeRequest> r = ParseTokenizeRequest(req.body);
  if (!r.ok()) return ReplyStatus(res, r.status());
  if (absl::Status st = CheckModel(r->model); !st.ok()) return ReplyStatus(res, st);
  if (tokenizer == nullptr) {
    return ReplyStatus(res, InvalidParam("prompt", absl::StrCat("the model ", options.model_path, " has no tokenizer")));
  }
  absl::StatusOr<std::vector<int32_t>> ids = tokenizer->Encode(r->prompt, r->add_special_tokens);
  if (!ids.ok()) return ReplyStatus(res, InvalidParam("prompt", ids.status().message()));
  Json j;
  j["count"] = ids->size();
  j["max_model_len"] = scheduler->options().limits.max_seq_len;
  j["tokens"] = *ids;
  res.set_content(Dump(j), "application/json");
}

void HttpServer::Impl::Detokenize(const httplib::Request& req, httplib::Response& res) {
  absl::StatusOr<DetokenizeRequest> r = ParseDetokenizeRequest(req.body);
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

absl::StatusOr<std::vector<int32_t>> HttpServer::Impl::ChatPrompt(const ChatRequest& request) const {
  if (tokenizer == nullptr) {
    return InvalidParam("messages", absl::StrCat("the model ", options.model_path,
                                                 " has no tokenizer, so chat messages cannot be served"));
  }
  if (!chat_template.has_value()) return chat_template_error;
  Json context;
  Json messages = Json::array();
  for (const ChatMessage& m : request.messages) {
    Json msg;
    msg["role"] = m.role;
    msg["content"] = m.content;
    if (m.name.has_value()) msg["name"] = *m.name;
    messages.push_back(std::move(msg));
  }
  context["messages"] = std::move(messages);
  context["bos_token"] = bos_token;
  context["eos_token"] = eos_token;
  context["add_generation_prompt"] = true;
  absl::StatusOr<std::string> prompt = chat_template->Render(context);
  if (!prompt.ok()) return InvalidParam("messages", prompt.status().message());
  absl::StatusOr<std::vector<int32_t>> ids = tokenizer->Encode(*prompt, /*add_special_tokens=*/false);
  if (!ids.ok()) return InvalidParam("messages", ids.status().message());
  return ids;
}

void HttpServer::Impl::Generate(const httplib::Request& req, httplib::Response& res, bool chat,
                                std::shared_ptr<security::ApiKeys::Lease> lease) {
  const RequestLimits& limits = scheduler->options().limits;
  SequenceRequest seq;
  SamplingFields fields;
  if (chat) {
    absl::StatusOr<ChatRequest> parsed = ParseChatRequest(req.body);
    if (!parsed.ok()) return Reject(res, parsed.status());
    fields = parsed->fields;
    if (absl::Status st = CheckModel(fields.model); !st.ok()) return Reject(res, st);
    absl::StatusOr<std::vector<int32_t>> prompt = ChatPrompt(*parsed);
    if (!prompt.ok()) return Reject(res, prompt.status());
    seq.prompt = *std::move(prompt);
  } else {
    absl::StatusOr<CompletionRequest> parsed = ParseCompletionRequest(req.body);
    if (!parsed.ok()) return Reject(res, parsed.status());
    fields = parsed->fields;
    if (absl::Status st = CheckModel(fields.model); !st.ok()) return Reject(res, st);
    if (parsed->prompt_text.has_value()) {
      if (tokenizer == nullptr) {
        return Reject(res, InvalidParam("prompt", absl::StrCat("the model ", options.model_path,
                                                                    " has no tokenizer: send the prompt as token ids")));
      }
      absl::StatusOr<std::vector<int32_t>> ids = tokenizer->Encode(*parsed->prompt_text, /*add_special_tokens=*/true);
      if (!ids.ok()) return Reject(res, InvalidParam("prompt", ids.status().message()));
      seq.prompt = *std::move(ids);
    } else {
      for (size_t i = 0; i < parsed->prompt_ids.size(); ++i) {
        const int64_t id = parsed->prompt_ids[i];
        if (id < 0 || id >= limits.vocab_size) {
          return Reject(res, InvalidParam("prompt", absl::StrCat("prompt[", i, "] = ", id, " is outside the vocabulary [0, ",
                                                                      limits.vocab_size, ")")));
        }
        seq.prompt.push_back(static_cast<int32_t>(id));
      }
    }
  }
  const int64_t prompt_len = static_cast<int64_t>(seq.prompt.size());
  if (prompt_len >= limits.max_seq_len) {
    return Reject(res, InvalidParam(chat ? "messages" : "prompt",
                                         absl::StrCat("the prompt has ", prompt_len, " tokens; the context holds ",
                                                      limits.max_seq_len, " (prompt + max_tokens)")));
  }
  // OpenAI's defaults: 16 tokens for completions; chat runs to the end of the context.
  const int64_t max_tokens = fields.max_tokens.value_or(chat ? limits.max_seq_len - prompt_len : 16);
  if (prompt_len + max_tokens > limits.max_seq_len) {
    return Reject(res, InvalidParam("max_tokens", absl::StrCat("prompt (", prompt_len, " tokens) + max_tokens (", max_tokens,
                                                      ") exceeds the context of ", limits.max_seq_len, " tokens")));
  }
  if (absl::Status st = ValidateStopStrings(fields.stop, "stop"); !st.ok()) {
    return Reject(res, InvalidParam("stop", st.message()));
  }
  seq.max_tokens = static_cast<int32_t>(max_tokens);
  seq.sampling = {.temperature = static_cast<float>(fields.temperature),
                  .top_k = static_cast<int32_t>(fields.top_k),
                  .top_p = static_cast<float>(fields.top_p),
                  .seed = static_cast<uint64_t>(fields.seed.value_or(0)),
                  .min_p = static_cast<float>(fields.min_p)};
  // Ids beyond the vocabulary (int32 included) are refused by ValidateSequenceRequest below.
  auto clamp_id = [](int64_t id) {
    return static_cast<int32_t>(std::clamp<int64_t>(id, -1, std::numeric_limits<int32_t>::max()));
  };
  for (const auto& [id, bias] : fields.logit_bias) {
    seq.sampling.logit_bias.emplace_back(clamp_id(id), static_cast<float>(bias));
  }
  std::sort(seq.sampling.logit_bias.begin(), seq.sampling.logit_bias.end());
  for (int64_t id : fields.stop_token_ids) seq.stop_token_ids.push_back(clamp_id(id));
  seq.ignore_eos = fields.ignore_eos;
  seq.min_tokens = static_cast<int32_t>(std::min<int64_t>(fields.min_tokens, std::numeric_limits<int32_t>::max()));
  seq.logprobs = fields.logprobs;
  seq.top_logprobs = static_cast<int32_t>(fields.top_logprobs);
  if (fields.response_format != SamplingFields::ResponseFormat::kText) {
    if (options.constraints == nullptr) {
      return Reject(res, InvalidParam(fields.format_param, absl::StrCat("the model ", options.model_path,
                                                                      " has no tokenizer: structured output needs one")));
    }
    structured::ConstraintSpec spec;
    const std::string& param = fields.format_param;
    switch (fields.response_format) {
      case SamplingFields::ResponseFormat::kText:
        break;
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
        std::vector<std::string> alternatives;
        for (const std::string& c : fields.choices) alternatives.push_back(structured::RegexLiteral(c));
        spec = {structured::ConstraintKind::kRegex, absl::StrCat("(?:", absl::StrJoin(alternatives, "|"), ")")};
        break;
      }
    }
    absl::StatusOr<std::shared_ptr<const TokenConstraint>> c = options.constraints->Compile(spec);
    if (!c.ok()) return Reject(res, InvalidParam(param, c.status().message()));
    seq.constraint = *std::move(c);
  }
  const uint64_t n = next_id.fetch_add(1);
  seq.request_id = absl::StrCat(chat ? "chatcmpl-" : "cmpl-", n);
  if (absl::Status st = ValidateSequenceRequest(seq, limits); !st.ok()) return Reject(res, st);
  if (absl::Status st = ready(); !st.ok()) return Reject(res, st);

  const ResponseMeta meta{.id = seq.request_id, .created = absl::ToUnixSeconds(absl::Now()), .model = options.model_id};
  auto sequence = std::make_shared<HttpSequence>(
      scheduler, tokenizer != nullptr ? tokenizer->NewStreamDecoder(/*skip_special_tokens=*/true) : nullptr,
      fields.stop, tokenizer);
  // Logged and counted like the gRPC front end's requests (coordinator/api/request_log.h).
  absl::StatusOr<SequenceId> id = SubmitWithLog(*scheduler, std::move(seq), sequence);
  if (!id.ok()) return ReplyStatus(res, id.status());
  sequence->Bind(*id);
  auto usage_of = [prompt_len](const SequenceEnd& end) {
    return Usage{.prompt_tokens = prompt_len,
                 .completion_tokens = end.completion_tokens,
                 .cached_tokens = end.cached_prompt_tokens};
  };

  const bool logprobs = fields.logprobs;
  if (!fields.stream) {
    std::string text;
    std::vector<LogprobEntry> entries;
    while (true) {
      HttpSequence::Update u = sequence->Wait(absl::Seconds(1));
      text += u.text;
      entries.insert(entries.end(), std::make_move_iterator(u.logprobs.begin()), std::make_move_iterator(u.logprobs.end()));
      if (!u.end.has_value()) continue;
      if (!u.end->status.ok()) return ReplyStatus(res, u.end->status);
      const char* reason = FinishReasonText(u.end->reason);
      const std::vector<LogprobEntry>* lp = logprobs ? &entries : nullptr;
      const Json body = chat ? ChatResponse(meta, text, reason, usage_of(*u.end), lp)
                             : CompletionResponse(meta, text, reason, usage_of(*u.end), lp);
      res.set_content(Dump(body), "application/json");
      return;
    }
  }

  // Streamed: the provider runs on this handler's thread until it calls sink.done() or a write
  // fails; the releaser then runs (success = false when the client went away first).
  struct StreamState {
    bool role_sent = false;
    bool done = false;
    int64_t text_offset = 0;  // completions' logprobs: where the next token's text starts
    std::shared_ptr<security::ApiKeys::Lease> lease;  // released with the stream
  };
  auto state = std::make_shared<StreamState>();
  state->lease = std::move(lease);
  const absl::Duration keepalive = options.keepalive;
  const bool include_usage = fields.include_usage;
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [sequence, state, meta, chat, keepalive, include_usage, usage_of, logprobs](size_t /*offset*/,
                                                                                  httplib::DataSink& sink) {
        auto write = [&sink](const std::string& s) { return sink.write(s.data(), s.size()); };
        if (chat && !state->role_sent) {
          state->role_sent = true;
          if (!write(SseEvent(Dump(ChatChunk(meta, "assistant", std::string(), ""))))) return false;
        }
        HttpSequence::Update u = sequence->Wait(keepalive);
        const bool news = !u.text.empty() || (logprobs && !u.logprobs.empty());
        if (news) {
          const std::vector<LogprobEntry>* lp = logprobs ? &u.logprobs : nullptr;
          const Json chunk = chat ? ChatChunk(meta, "", u.text, "", lp)
                                  : CompletionChunk(meta, u.text, "", lp, state->text_offset);
          for (const LogprobEntry& e : u.logprobs) state->text_offset += static_cast<int64_t>(e.token.size());
          if (!write(SseEvent(Dump(chunk)))) return false;
        }
        if (!u.end.has_value()) {
          // Nothing new: a comment line (ignored by SSE clients) finds out whether the client is still there.
          return news ? true : write(": keep-alive\n\n");
        }
        if (!u.end->status.ok()) {
          if (!write(SseEvent(Dump(ErrorFromStatus(u.end->status).body)))) return false;
        } else {
          const char* reason = FinishReasonText(u.end->reason);
          const Json last = chat ? ChatChunk(meta, "", std::nullopt, reason) : CompletionChunk(meta, "", reason);
          if (!write(SseEvent(Dump(last)))) return false;
          if (include_usage) {
            const Json usage = UsageChunk(meta, chat ? "chat.completion.chunk" : "text_completion", usage_of(*u.end));
            if (!write(SseEvent(Dump(usage)))) return false;
          }
        }
        if (!write(SseDone())) return false;
        state->done = true;
        sink.done();
        return true;
      },
      [sequence, state](bool /*success*/) {
        if (!state->done) sequence->Cancel();  // the client left (or the server stopped) mid-stream
      });
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
  server.Post("/tokenize", [this, admit](const httplib::Request& req, httplib::Response& res) {
    if (admit(req, res).has_value()) Tokenize(req, res);
  });
  server.Post("/detokenize", [this, admit](const httplib::Request& req, httplib::Response& res) {
    if (admit(req, res).has_value()) Detokenize(req, res);
  });
  // Liveness and readiness as vLLM's /health (no API key, for probes): 200 with an empty body when
  // the cluster serves, 503 with the reason (as the gRPC API gives it) while it does not.
  server.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (absl::Status st = ready(); !st.ok()) return ReplyStatus(res, st);
    res.status = 200;
  });
  server.Post("/v1/completions", [this, admit](const httplib::Request& req, httplib::Response& res) {
    if (auto lease = admit(req, res)) Generate(req, res, /*chat=*/false, *std::move(lease));
  });
  server.Post("/v1/chat/completions", [this, admit](const httplib::Request& req, httplib::Response& res) {
    if (auto lease = admit(req, res)) Generate(req, res, /*chat=*/true, *std::move(lease));
  });
  // A known path with the wrong method: 405, before the body is read.
  server.set_pre_routing_handler([](const httplib::Request& req, httplib::Response& res) {
    const bool models = req.path == "/v1/models";
    const bool post = req.path == "/v1/completions" || req.path == "/v1/chat/completions";
    if ((models && req.method != "GET" && req.method != "HEAD") || (post && req.method != "POST")) {
      res.set_header("Allow", models ? "GET" : "POST");
      Reply(res, MakeError(405, "invalid_request_error",
                           absl::StrCat(req.method, " is not allowed on ", req.path, "; use ", models ? "GET" : "POST"),
                           "method_not_allowed"));
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  // Every error without a body of ours (no route, body too large, malformed HTTP) gets one.
  const size_t max_body = options.max_body_bytes;
  server.set_error_handler(httplib::Server::HandlerWithResponse([max_body](const httplib::Request& req,
                                                                          httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Handled;
    ApiError e;
    switch (res.status) {
      case 404:
        e = MakeError(404, "invalid_request_error", absl::StrCat("unknown route: ", req.method, " ", req.path),
                      "unknown_route");
        break;
      case 413:
        e = MakeError(413, "invalid_request_error",
                      absl::StrCat("request body is larger than ", max_body, " bytes"), "request_too_large");
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
  const std::string& dir = impl->options.model_path;
  if (tokenizer == nullptr) {
    impl->chat_template_error = InvalidParam("messages", absl::StrCat("the model ", dir, " has no tokenizer"));
  } else if (!tokenizer->chat_template().has_value()) {
    impl->chat_template_error = InvalidParam(
        "messages", absl::StrCat("the model has no chat template: ", dir,
                                 "/tokenizer_config.json has no \"chat_template\" (and there is no chat_template.jinja); "
                                 "use /v1/completions"));
  } else {
    absl::StatusOr<jinja::JinjaTemplate> t = jinja::JinjaTemplate::Parse(*tokenizer->chat_template());
    if (t.ok()) {
      impl->chat_template = *std::move(t);
    } else {
      LOG(WARNING) << "the chat template of " << dir << " cannot be used: " << t.status();
      impl->chat_template_error =
          InvalidParam("messages", absl::StrCat("the chat template of ", dir, " is not supported: ", t.status().message()));
    }
    if (std::optional<int32_t> bos = tokenizer->bos_id(); bos.has_value()) {
      impl->bos_token = tokenizer->IdToPiece(*bos).value_or("");
    }
    if (!tokenizer->eos_ids().empty()) impl->eos_token = tokenizer->IdToPiece(tokenizer->eos_ids()[0]).value_or("");
  }

  Impl& s = *impl;
  const int threads = s.options.threads;
  s.server.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  s.server.set_payload_max_length(s.options.max_body_bytes);
  s.server.set_read_timeout(absl::ToChronoSeconds(s.options.read_timeout));
  s.server.set_write_timeout(absl::ToChronoSeconds(s.options.write_timeout));
  s.server.set_keep_alive_timeout(2);
  s.server.set_tcp_nodelay(true);
  s.Routes();
  const std::string host = HostOf(s.options.listen);
  int want = 0;
  (void)absl::SimpleAtoi(s.options.listen.substr(s.options.listen.rfind(':') + 1), &want);  // checked by Validate
  if (want == 0) {
    s.port = s.server.bind_to_any_port(host);
  } else {
    s.port = s.server.bind_to_port(host, want) ? want : -1;
  }
  if (s.port <= 0) return absl::UnavailableError(absl::StrCat("cannot serve HTTP on --http_listen=", s.options.listen));
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

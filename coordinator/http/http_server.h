// HttpServer: the coordinator's OpenAI-compatible HTTP API (cpp-httplib, a pool of threads with
// normal stacks), next to the gRPC Inference service and fed by the same Scheduler.
//
//   GET  /v1/models            the served model
//   POST /v1/completions       prompt (text or token ids) -> text; stream = server-sent events
//   POST /v1/chat/completions  messages -> the model's chat template -> prompt -> text
//
// A request is parsed strictly (openai_protocol.h) into a frontend::AdmissionRequest, which
// frontend::Admission (coordinator/frontend/admission.h) turns into the scheduler's request as it
// does the gRPC API's (text prompts tokenized; chat prompts rendered with the tokenizer's chat
// template and tokenized without adding special tokens, as transformers' apply_chat_template
// does; every check, with errors naming the field as this API spells it; the cluster's readiness
// last), and submitted to the Scheduler. Generated ids become text through the tokenizer's StreamDecoder and a
// StopStringMatcher (the text ends before the stop string, or with it with
// include_stop_str_in_output): a stop string ends the request with finish_reason "stop" (and cancels the
// sequence in the scheduler); EOS or a stop id gives "stop"; max_tokens or the context gives
// "length".
//
// Errors are OpenAI-shaped JSON bodies ({"error": {"message", "type", "param", "code"}}): 400 for
// invalid requests (malformed JSON, unknown fields, wrong types, values out of range), 413 for a
// body over max_body_bytes (Content-Length or chunked; never buffered past the cap), 404 for an unknown route or model, 405 for a wrong method, 429 when
// the scheduler's queue is full, 503 while the cluster is not ready, 500 when generation fails;
// with API keys, 401 without a valid key and 429 over the key's limits.
//
// Streams: one handler thread per streamed request, waiting on the request's own queue (the
// scheduler's threads never block on a client). A client that disconnects mid-stream is noticed
// at the next write (a keep-alive comment is written after `keepalive` without output), and its
// sequence is cancelled. A request that is not streamed looks at its connection's socket every
// 200 ms (common/http/client_connection.h) and is cancelled once its client has hung up.
//
// Thread-safety: Start and Stop may be called from any thread; Stop is idempotent.
#ifndef SHARDSERVE_COORDINATOR_HTTP_HTTP_SERVER_H_
#define SHARDSERVE_COORDINATOR_HTTP_HTTP_SERVER_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/http/serving_limits.h"
#include "common/security/api_keys.h"
#include "common/security/tls_files.h"
#include "common/tokenizer/tokenizer.h"
#include "coordinator/scheduler/scheduler.h"
#include "coordinator/scheduler/scheduler_observer.h"
#include "coordinator/structured/grammar.h"

namespace shardserve::coordinator::http {

struct HttpServerOptions {
  std::string listen;          // HOST:PORT; port 0 picks a free port
  std::string model_id;        // the model's name in /v1/models and replies (requests may also use model_path)
  std::string model_path;      // the model directory (for messages, and accepted as a model name)
  // Larger request bodies get 413, whatever their transfer encoding (Content-Length or chunked);
  // a chunked body is read only up to here, then the connection is closed. >= 1024.
  size_t max_body_bytes = 1 << 20;
  // Connection budget and timeouts (common/http/serving_limits.h). Each connection holds one
  // thread while it is open (a streamed request for as long as it streams); slow or silent
  // clients are dropped by the idle and read timeouts.
  HttpServingLimits limits;
  absl::Duration keepalive = absl::Seconds(1);  // SSE comment after this long without output
  // Told of the requests this front end refuses itself (bad parameters, cluster not ready), so
  // that the metrics count them with the scheduler's refusals; borrowed, may be null.
  SchedulerObserver* observer = nullptr;
  // API keys (borrowed, may be null = no authentication): every route needs "Authorization:
  // Bearer KEY" with a key of role user or admin, answered 401 (missing or unknown key) or 429
  // (the key's rate or concurrency limit) with an OpenAI-style body otherwise.
  security::ApiKeys* api_keys = nullptr;
  // HTTPS with these files (the certificate and key are read at each handshake, so a rotated
  // certificate is used by new connections without a restart); nullopt = plain HTTP.
  std::optional<security::TlsOptions> tls;
  // Compiles response_format constraints (borrowed, may be null: response_format json_object /
  // json_schema is then refused with 400; must outlive the server).
  structured::ConstraintCompiler* constraints = nullptr;
  // How the model writes tool calls (coordinator/frontend/tool_calls.h): "hermes", "llama3_json", or
  // "auto" (detected from the chat template).
  std::string tool_call_parser = "auto";
  // A reasoning model's format (coordinator/frontend/reasoning.h): "deepseek_r1", "qwen3" or
  // "gpt_oss" splits each chat answer into message.reasoning_content and message.content; "" leaves
  // it whole, except for a harmony chat template (GPT-OSS), whose channels are always read.
  std::string reasoning_parser;
  // InvalidArgument naming the option when out of range.
  absl::Status Validate() const;
};

class HttpServer {
 public:
  // Binds and starts serving. `tokenizer` may be null (then only token-id prompts are served);
  // `ready` tells whether the cluster serves now (OK, or Unavailable with the reason). The
  // scheduler, tokenizer and `ready`'s captures must outlive the server. Errors: InvalidArgument
  // for options; Unavailable when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(HttpServerOptions options, const Tokenizer* tokenizer,
                                                           Scheduler* scheduler,
                                                           std::function<absl::Status()> ready);
  ~HttpServer();  // Stop()

  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Stops accepting, ends open streams and joins the threads. Requests still waiting for the
  // scheduler return once it ends them, so shut the scheduler down first.
  void Stop();

  // The address actually bound ("127.0.0.1:8080").
  const std::string& address() const;
  int port() const;

 private:
  struct Impl;
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardserve::coordinator::http

#endif  // SHARDSERVE_COORDINATOR_HTTP_HTTP_SERVER_H_

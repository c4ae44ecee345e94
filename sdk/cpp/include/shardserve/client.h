// shardserve C++ client: the public Inference and Admin APIs of a shardserve cluster.
//
//   auto client = shardserve::Client::Connect("127.0.0.1:7000", {});
//   if (!client.ok()) return client.status();
//   // The whole answer at once:
//   absl::StatusOr<shardserve::GenerateResult> r =
//       (*client)->Generate(shardserve::Prompt::Text("Once upon a time"), {.max_tokens = 32});
//   // Streamed, pull style:
//   auto stream = (*client)->StartGenerate(shardserve::Prompt::Text("Once upon a time"), {.max_tokens = 32});
//   for (const shardserve::GenerateDelta& d : *stream) std::cout << d.text;
//   if (!stream->status().ok()) ...
//   // Streamed, push style: GenerateStreaming(prompt, options, callback).
//
// Errors are absl::Status values with the gRPC code and the server's message (for example
// INVALID_ARGUMENT naming the bad field, UNAVAILABLE with the reason the cluster is not ready).
// Errors made on this side (an address that is not HOST:PORT, inconsistent options) are
// INVALID_ARGUMENT from Connect.
//
// Every call has a deadline: ClientOptions::timeout from its start, or CallOptions::deadline.
// A call that fails with UNAVAILABLE before the server sent anything (no connection, the cluster
// not ready yet) is tried again, up to ClientOptions::retry.max_attempts attempts in all with
// exponential backoff, within the same deadline. A generation (n = 1) whose stream breaks with
// UNAVAILABLE after tokens arrived (the coordinator restarted, a replica failed) is RESUMED: the
// same request (same seed) goes again with the server's request id and the tokens received so far
// (GenerateRequest.resume), and the server continues exactly where the stream broke, so the
// caller sees every token, text character and logprob once, as the unbroken stream would have
// sent them. At most retry.max_resumes resumes in a row without a new token, with the backoff of
// RetryOptions, within the first attempt's deadline; then the UNAVAILABLE error is returned. With
// n > 1 the error is returned as it is. The channel reconnects at least every retry.max_backoff.
//
// No protobuf or gRPC type appears in this header: the package installs no generated code.
// Thread-safety: a Client may be shared by threads and every call is independent. A
// GenerateStream is used by one thread at a time, except Cancel(), which any thread may call.
// CancellationToken is thread-safe.
#ifndef SHARDSERVE_SDK_CPP_INCLUDE_SHARDSERVE_CLIENT_H_
#define SHARDSERVE_SDK_CPP_INCLUDE_SHARDSERVE_CLIENT_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace shardserve {

// Transport security: TLS with the given PEM contents (not file names).
struct TlsOptions {
  bool enabled = false;
  std::string root_certs;   // PEM CA certificates to trust; empty = the system's roots
  std::string client_cert;  // PEM certificate chain for mutual TLS; set with client_key or not at all
  std::string client_key;   // PEM private key of client_cert
  std::string server_name;  // the name to check the server's certificate against; empty = the address's host
};

// Retry of UNAVAILABLE before the first response (gRPC's own retry policy does the work), and
// resume of a generation whose stream broke after tokens arrived (see the top of this file).
struct RetryOptions {
  int max_attempts = 4;  // attempts in all, 1..5 (gRPC's limit); 1 = never retry
  std::chrono::milliseconds initial_backoff{100};
  std::chrono::milliseconds max_backoff{2000};
  double backoff_multiplier = 2.0;  // >= 1
  // Resumes of one generation in a row without a new token, 0..100; 0 = never resume. Each waits
  // initial_backoff x backoff_multiplier^k (k = resumes in a row so far), at most max_backoff.
  // A Generate whose gRPC retries ran out before any response is sent again the same way (each
  // time with max_attempts of its own). The defaults ride out a coordinator restart of 15 s or so,
  // whether it comes before the first token or after.
  int max_resumes = 10;
};

struct ClientOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};  // per call, including streaming; > 0
  TlsOptions tls;
  // Sent as "authorization: Bearer <token>" on every call when not empty. Printable ASCII only.
  std::string bearer_token;
  RetryOptions retry;
};

// Cancels calls from any thread. Pass a pointer in CallOptions; Cancel() ends every call using the
// token with CANCELLED, and every later call started with it fails at once with CANCELLED.
// Copies share the same state. Thread-safe.
class CancellationToken {
 public:
  CancellationToken();
  void Cancel();
  bool IsCancelled() const;

  // Internal: the state shared with the calls (defined in client.cc).
  struct State;
  const std::shared_ptr<State>& StateForClient() const { return state_; }

 private:
  std::shared_ptr<State> state_;
};

// Per-call settings.
struct CallOptions {
  // When set, the call's deadline instead of now + ClientOptions::timeout.
  std::optional<std::chrono::system_clock::time_point> deadline;
  // When set, cancels the call. Not owned; must outlive the call (or the stream).
  const CancellationToken* cancellation = nullptr;
};

// A call of one of the request's tools, parsed by the server from the model's output.
struct ToolCall {
  std::string id;         // a tool message answers the call by this id (ChatMessage::tool_call_id)
  std::string name;       // the function's name
  std::string arguments;  // the arguments object as JSON text
};

// One chat message; the server renders a list of them with the model's chat template.
struct ChatMessage {
  std::string role;  // system, user, assistant, tool or developer
  std::string content;
  std::string name;  // optional
  std::vector<ToolCall> tool_calls;  // an assistant message's calls (given back to the model)
  std::string tool_call_id;          // a tool message: the call it answers (optional)
  // An assistant message's reasoning (a result's reasoning_text, given back; optional).
  std::string reasoning_content;
};

// Whether and how the model calls the request's tools (GenerateOptions::tools).
enum class ToolChoice {
  kDefault,   // kAuto when tools are given
  kNone,      // the tools are shown to the model; its output is never parsed as calls
  kAuto,      // the model decides; calls in its output come back as ToolCalls
  kRequired,  // the output is constrained to calls of the tools
  kFunction,  // the output is constrained to one call of GenerateOptions::tool_name
};

struct Prompt {
  std::string text;
  std::vector<int32_t> ids;
  bool is_ids = false;
  std::vector<ChatMessage> chat;
  bool is_chat = false;
  static Prompt Text(std::string t) { return Prompt{.text = std::move(t)}; }
  static Prompt Ids(std::vector<int32_t> i) { return Prompt{.ids = std::move(i), .is_ids = true}; }
  static Prompt Chat(std::vector<ChatMessage> m) { return Prompt{.chat = std::move(m), .is_chat = true}; }
};

struct GenerateOptions {
  int32_t max_tokens = 64;
  float temperature = 0.0f;  // 0 = greedy
  int32_t top_k = 0;         // 0 = no limit
  float top_p = 1.0f;
  uint64_t seed = 0;
  std::vector<int32_t> stop_token_ids;  // in addition to the model's EOS ids
  bool ignore_eos = false;
  std::string request_id;  // optional; the server makes one when empty
  float min_p = 0.0f;      // [0, 1]: drop tokens less likely than min_p x the most likely; 0 = off
  std::map<int32_t, float> logit_bias;  // token id -> bias in [-100, 100], added to the logits
  int32_t min_tokens = 0;  // no EOS or stop id before this many tokens
  bool logprobs = false;   // report each token's logprob (GenerateDelta::logprobs)
  int32_t top_logprobs = 0;  // and this many of the most likely tokens', in [0, 20]
  // As vLLM and OpenAI define them: presence and frequency in [-2, 2] (0 = off) over the generated
  // tokens, repetition in (0, 2] (1 = off) over the prompt and the generated tokens.
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  float repetition_penalty = 1.0f;
  // Also report the prompt tokens' logprobs (GenerateDelta::prompt_logprobs), for scoring.
  bool prompt_logprobs = false;
  // Text that ends generation (at most 16 strings; the text stops right before the first match,
  // or with it when include_stop_str_in_output).
  std::vector<std::string> stop;
  bool include_stop_str_in_output = false;
  // False: the model's special tokens ("</s>", ...) are spelled in the text (vLLM's option).
  bool skip_special_tokens = true;
  // A longer prompt keeps only its last k tokens (k >= 1), or with -1 its last ones that fit the
  // context beside max_tokens; 0 = the prompt as it is (vLLM's truncate_prompt_tokens).
  int32_t truncate_prompt_tokens = 0;
  // The scheduling rank on a coordinator with --scheduling_policy=priority: lower values are served
  // first. Must be 0 under the default fcfs policy (vLLM's priority).
  int32_t priority = 0;
  // Every generated token is one of these ids (empty = any token; vLLM's allowed_token_ids). Not
  // with a structured-output constraint.
  std::vector<int32_t> allowed_token_ids;
  // Words kept out of the output (vLLM's bad_words; needs a model with a tokenizer): their
  // spellings alone and after a space are banned, token by token.
  std::vector<std::string> bad_words;
  // Structured output (GenerateRequest.constraint), at most one: the text must match a JSON
  // Schema (as JSON text), be any JSON object, or match a regular expression.
  std::string json_schema;
  bool json_object = false;
  std::string regex;
  // Tools for a chat prompt, as the JSON text of OpenAI's "tools" array ([{"type": "function",
  // "function": {"name", "description", "parameters"}}]); the server gives them to the chat
  // template and parses calls from the output (finish_reason "tool_calls", GenerateResult::tool_calls).
  std::string tools;
  ToolChoice tool_choice = ToolChoice::kDefault;
  std::string tool_name;             // with ToolChoice::kFunction
  bool parallel_tool_calls = true;   // with ToolChoice::kRequired: false = exactly one call
  // A chat prompt whose final message the model continues (an assistant message holding the
  // answer's start) instead of starting a new assistant turn.
  bool continue_final_message = false;
  // A chat prompt's extra chat-template variables, as the JSON text of an object (vLLM's
  // chat_template_kwargs, e.g. {"enable_thinking": false} for Qwen3); empty = none.
  std::string chat_template_kwargs;
  // Independent choices of the same prompt (OpenAI's n), in [1, 16]: choice i samples with seed + i.
  // Each delta names its choice (GenerateDelta::index); Generate needs n = 1, GenerateChoices
  // returns every choice.
  int32_t n = 1;
};

// One generated token's log-probabilities (log-softmax of the model's logits).
struct TokenLogprob {
  float logprob = 0.0f;
  std::vector<int32_t> top_ids;     // most likely first
  std::vector<float> top_logprobs;
};

// A piece of the streamed answer. The last one has `finished` set with the reason and usage.
struct GenerateDelta {
  std::vector<int32_t> token_ids;  // new tokens since the previous delta
  std::string text;                // their text (complete UTF-8 characters only)
  bool finished = false;
  std::string finish_reason;       // "length", "stop" or "cancelled" when finished
  int32_t prompt_tokens = 0;       // usage, on the last delta
  int32_t completion_tokens = 0;
  int32_t cached_prompt_tokens = 0;  // of prompt_tokens, found in the server's prefix cache
  std::string request_id;
  std::vector<TokenLogprob> logprobs;  // with GenerateOptions::logprobs: one per token_ids entry
  // With GenerateOptions::prompt_logprobs: prompt tokens 1, 2, ... (all before the first token).
  std::vector<TokenLogprob> prompt_logprobs;
  int32_t index = 0;  // the choice this delta belongs to (GenerateOptions::n)
  std::vector<ToolCall> tool_calls;  // on the choice's last delta: the calls parsed from its text
  // With the server's --reasoning_parser, for chat answers: the new part of the model's reasoning
  // (text then carries only the answer's content).
  std::string reasoning_text;
};

// The whole answer of a generation.
struct GenerateResult {
  std::vector<int32_t> token_ids;
  std::string text;
  std::string finish_reason;  // "length", "stop" or "cancelled"
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;
  int32_t cached_prompt_tokens = 0;  // of prompt_tokens, found in the server's prefix cache
  std::string request_id;
  std::vector<TokenLogprob> logprobs;  // with GenerateOptions::logprobs: one per token_ids entry
  // With GenerateOptions::prompt_logprobs: prompt tokens 1, 2, ... (all before the first token).
  std::vector<TokenLogprob> prompt_logprobs;
  std::vector<ToolCall> tool_calls;  // with GenerateOptions::tools: the calls the model made
  // With the server's --reasoning_parser, for chat answers: the model's reasoning (the inside of
  // <think>...</think>); text is then the answer's content.
  std::string reasoning_text;
};

struct ModelInfo {
  std::string model_path;
  std::string architecture;
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 0;  // the context length served
  int64_t num_layers = 0;
  int64_t num_parameters = 0;
  std::vector<int32_t> eos_token_ids;
  bool has_tokenizer = false;
};

struct WorkerInfo {
  std::string worker_id, node_name, address;
  std::string state;  // "ready", "loading", ... (the proto's WorkerState without its prefix, lower case)
  std::string error, devices, assignment;
  std::string metrics_address;  // HOST:PORT of its /metrics endpoint; empty when it serves none
  bool draining = false;        // being drained (DrainWorker), or drained
};

struct ClusterInfo {
  bool ready = false;
  std::string reason;
  std::string model_path;
  std::vector<WorkerInfo> workers;  // one page: the first 256 workers, live ones first
  int64_t total_workers = 0;        // every worker the coordinator knows (workers may list fewer)
  std::string plan;
  int64_t running_sequences = 0;
  int64_t waiting_sequences = 0;
  // Per serving replica: "replica R: <how it splits its running sequences into micro-batches>".
  std::vector<std::string> pipelining;
  // Per serving replica: "replica R: <decode steps per worker call, and why>" (multi-step
  // decoding; empty from a coordinator that does not say).
  std::vector<std::string> decode_steps;
  // The order waiting requests are admitted in: "fcfs" or "priority" (empty from a coordinator
  // that does not say).
  std::string scheduling_policy;
};

// A generation being streamed, read in pull style:
//
//   while (std::optional<GenerateDelta> d = stream->Next()) { ... }
//   // or: for (const GenerateDelta& d : *stream) { ... }
//   absl::Status st = stream->status();
//
// Destroying an unfinished stream cancels the request. A stream may outlive its Client.
class GenerateStream {
 public:
  virtual ~GenerateStream() = default;

  // Blocks for the next delta; nullopt once the stream has ended (then status() says how).
  virtual std::optional<GenerateDelta> Next() = 0;
  // The final status: OK after the last delta, else the error (CANCELLED after Cancel()).
  // Meaningful once Next() has returned nullopt; before that it is OK.
  virtual absl::Status status() const = 0;
  // Ends the request; the next Next() returns nullopt and status() is CANCELLED. Any thread.
  virtual void Cancel() = 0;

  // An input iterator over the remaining deltas, for range-for.
  class Iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = GenerateDelta;
    using difference_type = std::ptrdiff_t;
    using pointer = const GenerateDelta*;
    using reference = const GenerateDelta&;
    Iterator() = default;
    explicit Iterator(GenerateStream* stream) : stream_(stream) { Advance(); }
    reference operator*() const { return *current_; }
    pointer operator->() const { return &*current_; }
    Iterator& operator++() {
      Advance();
      return *this;
    }
    bool operator==(const Iterator& other) const { return stream_ == other.stream_; }

   private:
    void Advance() {
      current_ = stream_->Next();
      if (!current_) stream_ = nullptr;
    }
    GenerateStream* stream_ = nullptr;  // null at the end
    std::optional<GenerateDelta> current_;
  };
  Iterator begin() { return Iterator(this); }
  Iterator end() { return Iterator(); }
};

// A client of one cluster. Client::Connect makes the gRPC one; tests may implement the protected
// Do* methods to fake a cluster (the public methods are written on top of them).
class Client {
 public:
  // Creates a channel to `address` (HOST:PORT). Does not wait for the server: an unreachable
  // server shows as UNAVAILABLE on the first call. INVALID_ARGUMENT for an address that is not
  // HOST:PORT or for inconsistent options (the message names the option).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& address, ClientOptions options);
  virtual ~Client() = default;

  // Starts a generation and returns its stream at once; errors show in the stream's status().
  std::unique_ptr<GenerateStream> StartGenerate(const Prompt& prompt, const GenerateOptions& options,
                                                const CallOptions& call = {}) {
    return DoStartGenerate(prompt, options, call);
  }

  // Generates and returns the whole answer. InvalidArgument for options.n > 1 (use GenerateChoices).
  absl::StatusOr<GenerateResult> Generate(const Prompt& prompt, const GenerateOptions& options,
                                          const CallOptions& call = {});
  // Generates options.n choices and returns each whole answer, in choice order (the n choices of
  // one request: they share the prompt's KV cache on the server).
  absl::StatusOr<std::vector<GenerateResult>> GenerateChoices(const Prompt& prompt, const GenerateOptions& options,
                                                              const CallOptions& call = {});

  // Streams the answer to `on_delta`, called on this thread; returning false from it cancels the
  // request and makes the result CANCELLED. Returns OK after the last delta.
  absl::Status GenerateStreaming(const Prompt& prompt, const GenerateOptions& options,
                                 const std::function<bool(const GenerateDelta&)>& on_delta,
                                 const CallOptions& call = {});

  // Tokenizes with the served model's tokenizer.
  absl::StatusOr<std::vector<int32_t>> Tokenize(const std::string& text, bool add_special_tokens,
                                                const CallOptions& call = {}) {
    return DoTokenize(text, add_special_tokens, call);
  }
  absl::StatusOr<ModelInfo> GetModelInfo(const CallOptions& call = {}) { return DoGetModelInfo(call); }
  // The coordinator's view of the cluster (Admin.GetClusterStatus).
  absl::StatusOr<ClusterInfo> ClusterStatus(const CallOptions& call = {}) { return DoClusterStatus(call); }
  // Starts draining a worker (Admin.DrainWorker): no new work for its replica, its requests move
  // to another replica (or run to their end for at most `timeout` when none can take them), its
  // stage goes to a spare worker if any, and it is released (state "idle": it may be stopped).
  // Returns once the drain is under way; ClusterStatus shows its progress.
  absl::Status DrainWorker(const std::string& worker_id, std::chrono::milliseconds timeout,
                           const CallOptions& call = {}) {
    return DoDrainWorker(worker_id, timeout, call);
  }

 protected:
  // Thread-safe in every implementation: threads share a Client.
  virtual std::unique_ptr<GenerateStream> DoStartGenerate(const Prompt& prompt, const GenerateOptions& options,
                                                          const CallOptions& call) = 0;
  virtual absl::StatusOr<std::vector<int32_t>> DoTokenize(const std::string& text, bool add_special_tokens,
                                                          const CallOptions& call) = 0;
  virtual absl::StatusOr<ModelInfo> DoGetModelInfo(const CallOptions& call) = 0;
  virtual absl::StatusOr<ClusterInfo> DoClusterStatus(const CallOptions& call) = 0;
  // Unimplemented unless overridden (it came after the others).
  virtual absl::Status DoDrainWorker(const std::string& worker_id, std::chrono::milliseconds timeout,
                                     const CallOptions& call);
};

}  // namespace shardserve

#endif  // SHARDSERVE_SDK_CPP_INCLUDE_SHARDSERVE_CLIENT_H_

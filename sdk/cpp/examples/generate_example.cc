// An example of the shardserve C++ client: prints what the cluster serves, then streams a greedy
// generation to stdout (the same output as `shardserve generate --prompt TEXT --max_tokens N`).
//
//   shardserve_client_example HOST:PORT "Once upon a time" [MAX_TOKENS]
//
// Exit status: 0 on success, 1 when a call fails (the error on stderr), 2 for bad arguments.
#include <cstdlib>
#include <iostream>
#include <string>

#include "shardserve/client.h"

int main(int argc, char** argv) {
  if (argc < 3 || argc > 4) {
    std::cerr << "usage: shardserve_client_example HOST:PORT PROMPT [MAX_TOKENS]\n";
    return 2;
  }
  int max_tokens = 32;
  if (argc == 4) {
    char* end = nullptr;
    const long n = std::strtol(argv[3], &end, 10);
    if (*argv[3] == '\0' || *end != '\0' || n < 1 || n > 1000000) {
      std::cerr << "MAX_TOKENS must be an integer in 1..1000000, not \"" << argv[3] << "\"\n";
      return 2;
    }
    max_tokens = static_cast<int>(n);
  }

  shardserve::ClientOptions options;
  options.timeout = std::chrono::seconds(60);
  auto client = shardserve::Client::Connect(argv[1], options);
  if (!client.ok()) {
    std::cerr << "error: " << client.status() << "\n";
    return 2;
  }

  absl::StatusOr<shardserve::ModelInfo> info = (*client)->GetModelInfo();
  if (!info.ok()) {
    std::cerr << "error: model info from " << argv[1] << ": " << info.status() << "\n";
    return 1;
  }
  std::cerr << "model: " << info->architecture << ", " << info->num_layers << " layers, vocabulary "
            << info->vocab_size << "\n";

  // Pull-style streaming: each delta carries the new tokens' text; the last has the usage.
  std::unique_ptr<shardserve::GenerateStream> stream =
      (*client)->StartGenerate(shardserve::Prompt::Text(argv[2]), {.max_tokens = max_tokens, .temperature = 0.0f});
  shardserve::GenerateDelta last;
  for (const shardserve::GenerateDelta& d : *stream) {
    std::cout << d.text << std::flush;
    if (d.finished) last = d;
  }
  std::cout << "\n";
  if (!stream->status().ok()) {
    std::cerr << "error: generate: " << stream->status() << "\n";
    return 1;
  }
  std::cerr << "finish_reason: " << last.finish_reason << "\n"
            << "usage: " << last.prompt_tokens << " prompt + " << last.completion_tokens << " completion tokens\n";
  return 0;
}

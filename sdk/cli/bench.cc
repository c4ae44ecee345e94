#include "sdk/cli/bench.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <deque>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/concurrency/mutex.h"
#include "common/log/progress.h"

namespace shardserve::cli {
namespace {

using SteadyClock = std::chrono::steady_clock;

double Seconds(SteadyClock::duration d) { return std::chrono::duration<double>(d).count(); }

// A request to send: its index (which seeds its prompt and length) and when it arrived.
struct Ticket {
  int64_t index = 0;
  SteadyClock::time_point arrival;
};

// Hands tickets to the sending threads: at once (closed loop) or at Poisson arrival times pushed
// by a producer (open loop).
class TicketQueue {
 public:
  void Push(Ticket t) {
    MutexLock lock(&mu_);
    queue_.push_back(t);
    cv_.Signal();
  }
  void Close() {
    MutexLock lock(&mu_);
    closed_ = true;
    cv_.SignalAll();
  }
  std::optional<Ticket> Pop() {
    MutexLock lock(&mu_);
    while (!closed_ && queue_.empty()) cv_.Wait(&mu_);
    if (queue_.empty()) return std::nullopt;
    Ticket t = queue_.front();
    queue_.pop_front();
    return t;
  }

 private:
  Mutex mu_;
  CondVar cv_;
  std::deque<Ticket> queue_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

int32_t Draw(std::mt19937_64& rng, LengthRange r) {
  return r.min + static_cast<int32_t>(rng() % static_cast<uint64_t>(r.max - r.min + 1));
}

RequestSample RunOne(Client& client, const BenchOptions& o, const Ticket& ticket) {
  std::mt19937_64 rng(o.seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(ticket.index));
  const int32_t prompt_len = Draw(rng, o.prompt_tokens);
  std::vector<int32_t> ids;
  ids.reserve(static_cast<size_t>(o.shared_prefix_tokens + prompt_len));
  // The same prefix for every request, and in every run whatever --seed (like a system prompt).
  std::mt19937_64 shared_rng(kSharedPrefixSeed);
  for (int32_t i = 0; i < o.shared_prefix_tokens; ++i) {
    ids.push_back(1 + static_cast<int32_t>(shared_rng() % static_cast<uint64_t>(o.prompt_vocab - 1)));
  }
  for (int32_t i = 0; i < prompt_len; ++i) {
    ids.push_back(1 + static_cast<int32_t>(rng() % static_cast<uint64_t>(o.prompt_vocab - 1)));
  }
  GenerateOptions g{.max_tokens = Draw(rng, o.output_tokens),
                    .temperature = o.temperature,
                    .seed = static_cast<uint64_t>(ticket.index),
                    .ignore_eos = true};
  RequestSample s;
  std::optional<SteadyClock::time_point> last;
  const absl::Status st = client.GenerateStreaming(Prompt::Ids(std::move(ids)), g, [&](const GenerateDelta& d) {
    if (d.finished) {
      s.prompt_tokens = d.prompt_tokens;
      s.cached_prompt_tokens = d.cached_prompt_tokens;
    }
    if (d.token_ids.empty()) return true;
    const auto now = SteadyClock::now();
    const size_t k = d.token_ids.size();
    if (!last.has_value()) {
      s.ttft_s = Seconds(now - ticket.arrival);
    } else {
      const double gap = Seconds(now - *last) / static_cast<double>(k);
      s.itl_s.insert(s.itl_s.end(), k, gap);
    }
    last = now;
    s.output_tokens += static_cast<int32_t>(k);
    return true;
  });
  s.e2e_s = Seconds(SteadyClock::now() - ticket.arrival);
  s.ok = st.ok();
  if (!st.ok()) s.code = absl::StatusCodeToString(st.code());
  return s;
}

nlohmann::json ToJson(const Percentiles& p) {
  return {{"p50", p.p50}, {"p90", p.p90}, {"p99", p.p99}, {"mean", p.mean}, {"count", p.count}};
}

}  // namespace

absl::StatusOr<LengthRange> ParseLengthRange(absl::string_view text, absl::string_view flag) {
  const std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
  LengthRange r;
  bool ok = (parts.size() == 1 || parts.size() == 2) && absl::SimpleAtoi(parts[0], &r.min);
  r.max = r.min;
  if (ok && parts.size() == 2) ok = absl::SimpleAtoi(parts[1], &r.max);
  if (!ok || r.min < 1 || r.max < r.min) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": \"", text, "\" is not N or MIN:MAX with 1 <= MIN <= MAX"));
  }
  return r;
}

absl::Status BenchOptions::Validate() const {
  if (concurrency < 1) return absl::InvalidArgumentError(absl::StrCat("--concurrency must be >= 1, got ", concurrency));
  if (requests < 0) return absl::InvalidArgumentError(absl::StrCat("--requests must be >= 0, got ", requests));
  if (!(duration_s >= 0) || !std::isfinite(duration_s)) {
    return absl::InvalidArgumentError(absl::StrCat("--duration_s must be >= 0, got ", duration_s));
  }
  if (requests == 0 && duration_s == 0) {
    return absl::InvalidArgumentError("give --requests or --duration_s (or both) to bound the run");
  }
  if (!(rate >= 0) || !std::isfinite(rate)) {
    return absl::InvalidArgumentError(absl::StrCat("--rate must be >= 0 (0 = closed loop), got ", rate));
  }
  if (prompt_vocab < 2) return absl::InvalidArgumentError(absl::StrCat("--prompt_vocab must be >= 2, got ", prompt_vocab));
  if (shared_prefix_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--shared_prefix_tokens must be >= 0, got ", shared_prefix_tokens));
  }
  if (!(temperature >= 0) || !std::isfinite(temperature)) {
    return absl::InvalidArgumentError(absl::StrCat("--temperature must be >= 0, got ", temperature));
  }
  for (const auto& [name, r] : {std::pair{"--prompt_tokens", prompt_tokens}, std::pair{"--max_tokens", output_tokens}}) {
    if (r.min < 1 || r.max < r.min) return absl::InvalidArgumentError(absl::StrCat(name, " must be 1 <= MIN <= MAX"));
  }
  return absl::OkStatus();
}

Percentiles Summarize(std::vector<double> values) {
  Percentiles p;
  p.count = static_cast<int64_t>(values.size());
  if (values.empty()) return p;
  std::sort(values.begin(), values.end());
  auto rank = [&](double q) {
    // Nearest rank: the smallest value with at least q of the samples at or below it.
    const size_t n = values.size();
    const size_t i = static_cast<size_t>(std::ceil(q * static_cast<double>(n)));
    return values[std::clamp<size_t>(i, 1, n) - 1];
  };
  p.p50 = rank(0.50);
  p.p90 = rank(0.90);
  p.p99 = rank(0.99);
  double sum = 0;
  for (double v : values) sum += v;
  p.mean = sum / static_cast<double>(values.size());
  return p;
}

BenchSummary Summarize(const std::vector<RequestSample>& samples, double wall_s) {
  BenchSummary s;
  s.wall_s = wall_s;
  std::vector<double> ttft, itl, e2e;
  for (const RequestSample& r : samples) {
    if (!r.ok) {
      ++s.failed;
      ++s.failed_by_code[r.code];
      continue;
    }
    ++s.completed;
    s.output_tokens += r.output_tokens;
    s.prompt_tokens += r.prompt_tokens;
    s.cached_prompt_tokens += r.cached_prompt_tokens;
    if (r.ttft_s >= 0) ttft.push_back(r.ttft_s);
    itl.insert(itl.end(), r.itl_s.begin(), r.itl_s.end());
    e2e.push_back(r.e2e_s);
  }
  if (wall_s > 0) {
    s.requests_per_s = static_cast<double>(s.completed) / wall_s;
    s.output_tokens_per_s = static_cast<double>(s.output_tokens) / wall_s;
  }
  s.ttft_s = Summarize(std::move(ttft));
  s.itl_s = Summarize(std::move(itl));
  s.e2e_s = Summarize(std::move(e2e));
  return s;
}

std::string ToJson(const BenchSummary& s) {
  nlohmann::json j = {{"requests_per_s", s.requests_per_s},
                      {"output_tokens_per_s", s.output_tokens_per_s},
                      {"ttft_s", ToJson(s.ttft_s)},
                      {"itl_s", ToJson(s.itl_s)},
                      {"e2e_s", ToJson(s.e2e_s)},
                      {"completed", s.completed},
                      {"failed", s.failed},
                      {"failed_by_code", nlohmann::json::object()},
                      {"output_tokens", s.output_tokens},
                      {"prompt_tokens", s.prompt_tokens},
                      {"cached_prompt_tokens", s.cached_prompt_tokens},
                      {"wall_s", s.wall_s}};
  for (const auto& [code, n] : s.failed_by_code) j["failed_by_code"][code] = n;
  return j.dump();
}

std::string ToTable(const BenchSummary& s) {
  std::ostringstream out;
  out << absl::StrFormat("requests: %d completed, %d failed in %.2f s\n", s.completed, s.failed, s.wall_s);
  for (const auto& [code, n] : s.failed_by_code) out << absl::StrFormat("  failed %s: %d\n", code, n);
  out << absl::StrFormat("throughput: %.2f requests/s, %.1f output tokens/s (%d tokens)\n", s.requests_per_s,
                         s.output_tokens_per_s, s.output_tokens);
  out << absl::StrFormat("prompt tokens: %d, %d of them from the prefix cache\n", s.prompt_tokens,
                         s.cached_prompt_tokens);
  out << absl::StrFormat("%-22s %10s %10s %10s %10s %8s\n", "latency (ms)", "p50", "p90", "p99", "mean", "n");
  for (const auto& [name, p] : {std::pair{"time to first token", s.ttft_s}, std::pair{"inter-token", s.itl_s},
                                std::pair{"end to end", s.e2e_s}}) {
    out << absl::StrFormat("%-22s %10.2f %10.2f %10.2f %10.2f %8d\n", name, p.p50 * 1e3, p.p90 * 1e3, p.p99 * 1e3,
                           p.mean * 1e3, p.count);
  }
  return out.str();
}

absl::StatusOr<BenchSummary> RunBench(Client& client, const BenchOptions& o) {
  if (absl::Status st = o.Validate(); !st.ok()) return st;
  const auto start = SteadyClock::now();
  const std::optional<SteadyClock::time_point> stop_sending =
      o.duration_s > 0 ? std::optional(start + std::chrono::duration_cast<SteadyClock::duration>(
                                                   std::chrono::duration<double>(o.duration_s)))
                       : std::nullopt;
  auto may_send = [&](int64_t index, SteadyClock::time_point now) {
    return (o.requests == 0 || index < o.requests) && (!stop_sending.has_value() || now < *stop_sending);
  };

  std::optional<Progress> progress;
  if (o.progress) progress.emplace(Progress::Options{.what = "bench", .unit = "requests", .total = o.requests});
  Mutex mu;
  std::vector<RequestSample> samples;  // guarded by mu while the senders run
  std::atomic<int64_t> next{0};
  TicketQueue queue;
  const bool open_loop = o.rate > 0;
  std::vector<std::thread> senders;
  for (int32_t c = 0; c < o.concurrency; ++c) {
    senders.emplace_back([&] {
      while (true) {
        std::optional<Ticket> ticket;
        if (open_loop) {
          ticket = queue.Pop();
        } else {
          const int64_t i = next.fetch_add(1);
          const auto now = SteadyClock::now();
          if (may_send(i, now)) ticket = Ticket{.index = i, .arrival = now};
        }
        if (!ticket.has_value()) return;
        RequestSample s = RunOne(client, o, *ticket);
        MutexLock lock(&mu);
        samples.push_back(std::move(s));
        if (progress.has_value()) progress->Update(static_cast<int64_t>(samples.size()));
      }
    });
  }
  if (open_loop) {
    std::mt19937_64 rng(o.seed);
    std::exponential_distribution<double> gap(o.rate);
    auto at = start;
    for (int64_t i = 0;; ++i) {
      at += std::chrono::duration_cast<SteadyClock::duration>(std::chrono::duration<double>(gap(rng)));
      if (!may_send(i, at)) break;
      std::this_thread::sleep_until(at);
      queue.Push(Ticket{.index = i, .arrival = at});
    }
    queue.Close();
  }
  for (std::thread& t : senders) t.join();
  if (progress.has_value()) progress->Finish();
  return Summarize(samples, Seconds(SteadyClock::now() - start));
}

}  // namespace shardserve::cli

// Serving a prometheus-cpp registry on HTTP GET /metrics (Prometheus text format 0.0.4).
//
// Why not prometheus-cpp's Exposer: Debian's CivetWeb (under the Exposer) runs its threads on
// fixed 100 KiB stacks, and glibc carves every thread's static TLS out of its stack; OpenBLAS
// (60 KiB) and glog (30 KiB) leave almost nothing, and the Exposer's threads overflow and crash the
// worker. This server is cpp-httplib with the limits every shardserve HTTP endpoint has
// (common/http/serving_limits.h: threads on normal stacks started on demand up to a budget, idle
// and read/write timeouts), so a slow or silent client holds one thread of the budget, never the
// endpoint. Request bodies are not read (GET only).
//
// Metric naming in shardserve: shardserve_<subsystem>_<what>_<unit>; counters end in _total,
// durations are _seconds histograms, labels stay low-cardinality (stage, rank, phase, op,
// finish_reason — never request ids). Each process declares all its families in one metrics.h.
#ifndef SHARDSERVE_COMMON_METRICS_METRICS_SERVER_H_
#define SHARDSERVE_COMMON_METRICS_METRICS_SERVER_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/http/serving_limits.h"
#include "prometheus/registry.h"

namespace shardserve {

class MetricsServer {
 public:
  // Called before each scrape collects the registry, to refresh gauges that are read from other
  // objects (queue lengths, worker states); scrapes are serialized, so it never runs twice at
  // once. Must not block for long.
  using BeforeScrape = std::function<void()>;

  // Serves `registry` at http://`address`/metrics; `address` is IPV4:PORT or localhost:PORT (port 0
  // picks a free port). `before_scrape` may be null; everything it uses must outlive the server.
  // `limits`: the connection budget and timeouts. InvalidArgument for a malformed address or
  // limits, Unavailable when it cannot bind.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& address,
                                                              std::shared_ptr<prometheus::Registry> registry,
                                                              BeforeScrape before_scrape = nullptr,
                                                              const HttpServingLimits& limits = {});
  ~MetricsServer();  // stops serving and joins the threads
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // The bound port.
  int port() const { return port_; }
  // "http://HOST:PORT/metrics".
  std::string url() const { return url_; }
  // "HOST:PORT" as bound (the port resolved when 0 was asked for).
  std::string address() const { return address_; }

 private:
  struct Impl;
  explicit MetricsServer(std::unique_ptr<Impl> impl);
  // The Prometheus text of the registry now (before_scrape first), one scrape at a time.
  std::string Scrape();

  // Constant after Start.
  std::shared_ptr<prometheus::Registry> registry_;
  BeforeScrape before_scrape_;
  int port_ = 0;
  std::string url_;
  std::string address_;
  std::unique_ptr<Impl> impl_;  // the cpp-httplib server and its listening thread
  absl::Mutex scrape_mu_;       // serializes before_scrape_ and Collect

};

// Histogram buckets for LLM serving latencies: 1 ms .. 120 s, roughly x2 apart.
const std::vector<double>& LatencyBuckets();
// Buckets for per-step and per-collective times: 10 us .. 10 s.
const std::vector<double>& StepBuckets();
// Buckets for the gap between two tokens of one sequence (inter-token latency): 1 ms .. 10 s,
// finer than LatencyBuckets where decode steps usually fall (5 .. 250 ms).
const std::vector<double>& InterTokenBuckets();
// Buckets for counts per step (sequences in a batch, tokens in a step): powers of two, 1 .. 8192.
const std::vector<double>& CountBuckets();

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_METRICS_METRICS_SERVER_H_

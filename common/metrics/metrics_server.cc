#include "common/metrics/metrics_server.h"

#include <arpa/inet.h>
#include <httplib.h>

#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "common/http/capped_body.h"
#include "absl/strings/str_cat.h"
#include "prometheus/text_serializer.h"

namespace shardserve {

struct MetricsServer::Impl {
  httplib::Server server;
  std::thread thread;  // runs listen_after_bind
};

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& address,
                                                                    std::shared_ptr<prometheus::Registry> registry,
                                                                    BeforeScrape before_scrape,
                                                                    const HttpServingLimits& limits) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 || !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address \"", address, "\" is not HOST:PORT"));
  }
  std::string host = address.substr(0, colon);
  if (host == "localhost") host = "127.0.0.1";
  in_addr parsed{};
  if (inet_pton(AF_INET, host.c_str(), &parsed) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address \"", address, "\": \"", host, "\" is not an IPv4 address or localhost"));
  }
  if (absl::Status st = limits.Validate("metrics server: "); !st.ok()) return st;
  std::unique_ptr<MetricsServer> server(new MetricsServer(std::make_unique<Impl>()));
  server->registry_ = std::move(registry);
  server->before_scrape_ = std::move(before_scrape);
  httplib::Server& http = server->impl_->server;
  ApplyServingLimits(limits, http);
  // Nothing here takes a body: refuse one at once rather than read it.
  http.set_payload_max_length(0);
  MetricsServer* self = server.get();
  http.Get("/metrics", [self](const httplib::Request&, httplib::Response& res) {
    res.set_content(self->Scrape(), "text/plain; version=0.0.4; charset=utf-8");
  });
  RefuseUnroutedBodies(http, [](const httplib::Request&, httplib::Response& res) {
    res.status = 404;
    res.set_content("not found: this server answers GET /metrics\n", "text/plain");
  });
  http.set_error_handler([](const httplib::Request&, httplib::Response& res) {
    if (res.status == 404) res.set_content("not found: this server answers GET /metrics\n", "text/plain");
  });
  absl::StatusOr<int> bound = BindServer(http, host, port);
  if (!bound.ok()) return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", address));
  server->port_ = *bound;
  server->address_ = absl::StrCat(address.substr(0, colon), ":", *bound);
  server->url_ = absl::StrCat("http://", server->address_, "/metrics");
  server->impl_->thread = std::thread([&http] { http.listen_after_bind(); });
  // stop() only interrupts a server that runs: wait until it does.
  for (int i = 0; i < 10000 && !http.is_running(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return server;
}

MetricsServer::MetricsServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

MetricsServer::~MetricsServer() {
  impl_->server.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

std::string MetricsServer::Scrape() {
  absl::MutexLock lock(&scrape_mu_);
  if (before_scrape_ != nullptr) before_scrape_();
  return prometheus::TextSerializer().Serialize(registry_->Collect());
}

const std::vector<double>& LatencyBuckets() {
  static const std::vector<double> kBuckets = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                               2.5,   5,      10,    20,   30,    60,   120};
  return kBuckets;
}

const std::vector<double>& StepBuckets() {
  static const std::vector<double> kBuckets = {1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01,
                                               0.025, 0.05,  0.1,  0.25, 0.5,    1,    2.5,    5,      10};
  return kBuckets;
}

const std::vector<double>& InterTokenBuckets() {
  static const std::vector<double> kBuckets = {0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                                               0.1,   0.15,   0.2,   0.25, 0.3,   0.4,  0.5,   0.75, 1,    2.5,  5,   10};
  return kBuckets;
}

const std::vector<double>& CountBuckets() {
  static const std::vector<double> kBuckets = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192};
  return kBuckets;
}

}  // namespace shardserve

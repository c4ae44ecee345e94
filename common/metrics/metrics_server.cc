#include "common/metrics/metrics_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "prometheus/text_serializer.h"

namespace shardserve {
namespace {

constexpr size_t kMaxRequestBytes = 8192;
constexpr int kRequestTimeoutMs = 2000;

void WriteAll(int fd, const std::string& data) {
  size_t sent = 0;
  while (sent < data.size()) {
    const ssize_t n = send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return;
    sent += static_cast<size_t>(n);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& address,
                                                                    std::shared_ptr<prometheus::Registry> registry,
                                                                    BeforeScrape before_scrape) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 || !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address \"", address, "\" is not HOST:PORT"));
  }
  std::string host = address.substr(0, colon);
  if (host == "localhost") host = "127.0.0.1";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address \"", address, "\": \"", host, "\" is not an IPv4 address or localhost"));
  }
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  server->registry_ = std::move(registry);
  server->before_scrape_ = std::move(before_scrape);
  server->listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  setsockopt(server->listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (server->listen_fd_ < 0 || bind(server->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(server->listen_fd_, 16) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", address, ": ", std::strerror(errno)));
  }
  socklen_t len = sizeof(addr);
  getsockname(server->listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  server->port_ = ntohs(addr.sin_port);
  server->address_ = absl::StrCat(address.substr(0, colon), ":", server->port_);
  server->url_ = absl::StrCat("http://", server->address_, "/metrics");
  server->thread_ = std::thread([s = server.get()] { s->Serve(); });
  return server;
}

MetricsServer::~MetricsServer() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) close(listen_fd_);
}

void MetricsServer::Serve() {
  while (!stop_.load()) {
    pollfd p{.fd = listen_fd_, .events = POLLIN, .revents = 0};
    if (poll(&p, 1, 200) <= 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Answer(fd);
    close(fd);
  }
}

void MetricsServer::Answer(int fd) {
  std::string request;
  char buf[1024];
  while (request.size() < kMaxRequestBytes && !absl::StrContains(request, "\r\n\r\n")) {
    pollfd p{.fd = fd, .events = POLLIN, .revents = 0};
    if (poll(&p, 1, kRequestTimeoutMs) <= 0) return;
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return;
    request.append(buf, static_cast<size_t>(n));
  }
  if (absl::StartsWith(request, "GET /metrics ") || absl::StartsWith(request, "GET /metrics?")) {
    if (before_scrape_ != nullptr) before_scrape_();
    const std::string body = prometheus::TextSerializer().Serialize(registry_->Collect());
    WriteAll(fd, absl::StrCat("HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                              "Content-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body));
  } else {
    const std::string body = "not found: this server answers GET /metrics\n";
    WriteAll(fd, absl::StrCat("HTTP/1.0 404 Not Found\r\nContent-Type: text/plain\r\nContent-Length: ", body.size(),
                              "\r\nConnection: close\r\n\r\n", body));
  }
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

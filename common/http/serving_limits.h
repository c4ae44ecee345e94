// The limits that keep a cpp-httplib server answering while some of its clients are slow or hostile
// (slow-loris connections that dribble a request, silent connections, idle keep-alive connections).
//
// How cpp-httplib 0.11.4 (Debian) serves: one thread accepts connections and hands each to a task
// queue; a task holds one thread for the connection's whole life (its keep-alive requests
// included). A connection that sends nothing is dropped after `idle_timeout`; each read or write
// of a request that has started waits at most `read_timeout` / `write_timeout` (these bound one
// read, not a whole request: a client that sends a byte every few seconds keeps its thread for as
// long as the request's headers last, up to ~8 KiB). So the budget of threads is what slow
// clients exhaust, and this file makes it large, cheap and explicit:
//
//   - threads are started on demand up to `max_threads` and leave after 30 s idle, so a large budget
//     costs nothing while it is not used;
//   - connections beyond `max_threads` wait in a queue of `max_queued` accepted connections; when
//     that is full too, the acceptor stops accepting (the kernel's backlog holds the rest) until a
//     thread frees up — the process never grows past the budget;
//   - a connection serves at most `max_requests_per_connection` requests, then is closed.
//
// Thread-safety: ApplyServingLimits must be called before the server listens.
#ifndef SHARDSERVE_COMMON_HTTP_SERVING_LIMITS_H_
#define SHARDSERVE_COMMON_HTTP_SERVING_LIMITS_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace httplib {
class Server;
}  // namespace httplib

namespace shardserve {

struct HttpServingLimits {
  // Connections served at once (one thread each, started on demand), >= 1.
  int max_threads = 512;
  // Accepted connections waiting for a thread, >= 0; beyond that, accepting pauses.
  int max_queued = 1024;
  // A connection that sends no request this long (before its first one, or between keep-alive
  // requests) is closed. Rounded up to whole seconds (cpp-httplib's unit), >= 1 s.
  absl::Duration idle_timeout = absl::Seconds(5);
  // Bound on each read of a request (headers and body) and each write of a reply, > 0.
  absl::Duration read_timeout = absl::Seconds(10);
  absl::Duration write_timeout = absl::Seconds(30);
  // Requests served on one keep-alive connection before it is closed, >= 1.
  int max_requests_per_connection = 100;

  // InvalidArgument naming the field when out of range. `what` prefixes the message ("--http_").
  absl::Status Validate(const char* what = "") const;
};

// Binds `server` to `host`:`port` (port 0 picks a free port) with a listen backlog of `backlog`
// connections, and SO_REUSEADDR (not cpp-httplib's default SO_REUSEPORT, with which a second
// process could bind the same port). cpp-httplib listens with a backlog of 5: a burst of
// connections beyond it waits for SYN retransmits (1 s, then 3 s, ...). Returns the bound port;
// Unavailable when it cannot bind.
absl::StatusOr<int> BindServer(httplib::Server& server, const std::string& host, int port, int backlog = 4096);

// Sets `server`'s task queue (the on-demand thread pool above), timeouts and keep-alive limits.
// `limits` must be valid (Validate). The server must not be listening yet.
void ApplyServingLimits(const HttpServingLimits& limits, httplib::Server& server);

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_HTTP_SERVING_LIMITS_H_

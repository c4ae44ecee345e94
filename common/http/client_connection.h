// Whether the client of a cpp-httplib request is still there, for a handler that computes long
// before it answers (a completion that is not streamed): once the client has closed its
// connection, nobody reads the answer and the work can stop.
//
// cpp-httplib 0.11.4 (Debian) hands a handler no socket, so ClientConnection::Find looks for it
// among the process's open files: the TCP socket whose peer is the request's remote address and
// port and whose local port is the server's. The socket stays open while its handler runs (the
// server closes it after the handler returns), so the descriptor found cannot be reused under it.
// The search reads /proc/self/fd and asks each descriptor its peer (~75 us per hundred here); the HTTP API
// makes it once per request, and only for one still running after 200 ms.
//
// Gone() reports a client that closed or reset the connection (a FIN, an RST or a socket error),
// with TLS too: it looks at the TCP socket, not at the bytes. A client that only shut down its
// sending side while waiting for the answer counts as gone; HTTP clients do not do that.
//
// Thread-compatible: Gone() may be called from any thread while the handler runs.
#ifndef SHARDSERVE_COMMON_HTTP_CLIENT_CONNECTION_H_
#define SHARDSERVE_COMMON_HTTP_CLIENT_CONNECTION_H_

#include <optional>
#include <string>

namespace shardserve {

class ClientConnection {
 public:
  // The socket of the connection from `remote_addr`:`remote_port` (as cpp-httplib's Request spells
  // them: a numeric host) to this process's `local_port`; nullopt when none is open.
  static std::optional<ClientConnection> Find(const std::string& remote_addr, int remote_port, int local_port);

  // Whether the client has hung up. Does not block.
  bool Gone() const;

  int fd() const { return fd_; }

 private:
  explicit ClientConnection(int fd) : fd_(fd) {}
  int fd_;
};

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_HTTP_CLIENT_CONNECTION_H_

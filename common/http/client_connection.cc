#include "common/http/client_connection.h"

#include <dirent.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <cstdlib>

namespace shardserve {
namespace {

// `addr`'s port; -1 when it is not an internet address.
int PortOf(const sockaddr_storage& addr) {
  if (addr.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(addr).sin_port);
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(addr).sin6_port);
  return -1;
}

// Whether `addr`'s numeric host is `host`, as cpp-httplib spells a request's remote address
// (getnameinfo with NI_NUMERICHOST).
bool HostIs(const sockaddr_storage& addr, socklen_t len, const std::string& host) {
  char buf[NI_MAXHOST];
  return getnameinfo(reinterpret_cast<const sockaddr*>(&addr), len, buf, sizeof(buf), nullptr, 0, NI_NUMERICHOST) ==
             0 &&
         host == buf;
}

}  // namespace

std::optional<ClientConnection> ClientConnection::Find(const std::string& remote_addr, int remote_port,
                                                       int local_port) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return std::nullopt;
  std::optional<ClientConnection> found;
  while (const dirent* entry = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || fd == dirfd(dir)) continue;
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    // Not a socket, or not connected: getpeername fails.
    if (getpeername(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&addr), &len) != 0) continue;
    // The ports first: the host's spelling (getnameinfo) only for the few sockets they match.
    if (PortOf(addr) != remote_port) continue;
    sockaddr_storage local{};
    socklen_t local_len = sizeof(local);
    if (getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&local), &local_len) != 0) continue;
    if (PortOf(local) != local_port || !HostIs(addr, len, remote_addr)) continue;
    found = ClientConnection(static_cast<int>(fd));
    break;
  }
  closedir(dir);
  return found;
}

bool ClientConnection::Gone() const {
  pollfd p{.fd = fd_, .events = POLLRDHUP, .revents = 0};
  if (poll(&p, 1, 0) < 0) return false;
  return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

}  // namespace shardserve

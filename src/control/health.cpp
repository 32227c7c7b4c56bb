// Health checks of services (health.h).
#include "control/health.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

#include "loom/error.h"

namespace loom::control {
namespace {

using std::chrono::milliseconds;

// Connects to 127.0.0.1:port within `timeout`; the socket (>= 0) or -1.
int connect_local(int port, milliseconds timeout) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  timeval tv{static_cast<time_t>(timeout.count() / 1000),
             static_cast<suseconds_t>((timeout.count() % 1000) * 1000)};
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

}  // namespace

bool healthy(const Health& health) {
  switch (health.kind) {
    case Health::Kind::kNone:
    case Health::Kind::kHeartbeat:  // readiness is "started"; heartbeats are for liveness
      return true;
    case Health::Kind::kTcp: {
      const int fd = connect_local(health.port, milliseconds(500));
      if (fd < 0) return false;
      ::close(fd);
      return true;
    }
    case Health::Kind::kHttp: {
      const int fd = connect_local(health.port, milliseconds(500));
      if (fd < 0) return false;
      const std::string request =
          "GET " + health.path + " HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
      bool ok = ::send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
                static_cast<ssize_t>(request.size());
      char reply[64] = {};
      ok = ok && ::recv(fd, reply, sizeof reply - 1, 0) >= 12;
      ::close(fd);
      // "HTTP/1.x 2xx"
      return ok && std::strncmp(reply, "HTTP/1.", 7) == 0 && reply[9] == '2';
    }
  }
  return false;
}

std::string describe(const Health& health) {
  switch (health.kind) {
    case Health::Kind::kNone:
      return "started";
    case Health::Kind::kHeartbeat:
      return "started (heartbeats)";
    case Health::Kind::kTcp:
      return detail::concat("tcp port ", health.port);
    case Health::Kind::kHttp:
      return detail::concat("http :", health.port, health.path, " answering 2xx");
  }
  return "?";
}

}  // namespace loom::control

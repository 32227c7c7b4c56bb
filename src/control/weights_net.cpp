// The TCP side of weight snapshots: sockets with deadlines and the publisher's listener (see
// weights_net.h).
#include "control/weights_net.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include "loom/error.h"
#include "util/thread_name.h"

namespace loom::control::weights {
namespace {

using std::chrono::milliseconds;
using util::SteadyClock;

// How often blocked server threads look at stopping_.
constexpr milliseconds kSlice{100};
constexpr size_t kMaxRequestLine = 4096;
// Bytes per send/recv call.
constexpr size_t kIoChunk = 4 << 20;

std::string errno_text(int error) { return std::strerror(error); }

// The reply line goes out at once. The buffer sizes stay the kernel's: setting them turns off
// its autotuning, which sizes them better for bulk transfers.
void set_socket_options(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

std::string address_text(const sockaddr_storage& address) {
  char host[INET6_ADDRSTRLEN] = {};
  int port = 0;
  if (address.ss_family == AF_INET) {
    const auto& a = reinterpret_cast<const sockaddr_in&>(address);
    ::inet_ntop(AF_INET, &a.sin_addr, host, sizeof host);
    port = ntohs(a.sin_port);
  } else {
    const auto& a = reinterpret_cast<const sockaddr_in6&>(address);
    ::inet_ntop(AF_INET6, &a.sin6_addr, host, sizeof host);
    port = ntohs(a.sin6_port);
    return detail::concat("[", host, "]:", port);
  }
  return detail::concat(host, ":", port);
}

struct AddrInfoDeleter {
  void operator()(addrinfo* info) const { ::freeaddrinfo(info); }
};
using AddrInfo = std::unique_ptr<addrinfo, AddrInfoDeleter>;

AddrInfo resolve(const std::string& host, int port, bool passive, const std::string& what) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  const int rc =
      ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found);
  LOOM_CHECK(rc == 0, IoError, what, ": cannot resolve host \"", host, "\": ", ::gai_strerror(rc));
  return AddrInfo(found);
}

}  // namespace

std::pair<std::string, int> split_host_port(const std::string& address, const std::string& what) {
  const size_t colon = address.rfind(':');
  std::string host = colon == std::string::npos ? "" : address.substr(0, colon);
  const std::string port_text = colon == std::string::npos ? "" : address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  int port = -1;
  if (!port_text.empty() && port_text.size() <= 5 &&
      port_text.find_first_not_of("0123456789") == std::string::npos) {
    port = std::stoi(port_text);
  }
  LOOM_CHECK(!host.empty() && port >= 0 && port <= 65535, InvalidArgument, what, " \"", address,
             "\" is not HOST:PORT with a port in [0, 65535]");
  return {host, port};
}

Socket::~Socket() {
  if (fd_ >= 0) ::close(fd_);
}

void Socket::shutdown() { ::shutdown(fd_, SHUT_RDWR); }

std::unique_ptr<Socket> Socket::connect(const std::string& address,
                                        SteadyClock::time_point deadline, std::string& why) {
  const auto [host, port] = split_host_port(address, "weights source");
  const AddrInfo info = resolve(host, port, false, "weights source " + address);
  for (const addrinfo* a = info.get(); a != nullptr; a = a->ai_next) {
    const int fd =
        ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) {
      why = "socket: " + errno_text(errno);
      continue;
    }
    auto socket = std::make_unique<Socket>(fd, address);
    if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        why = errno_text(errno);
        continue;
      }
      if (!socket->wait_for(POLLOUT, deadline)) {
        why = "connecting timed out";
        continue;
      }
      int error = 0;
      socklen_t length = sizeof error;
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length);
      if (error != 0) {
        why = errno_text(error);
        continue;
      }
    }
    set_socket_options(fd);
    return socket;
  }
  return nullptr;
}

bool Socket::wait_for(short events, SteadyClock::time_point deadline) {
  while (true) {
    pollfd p{fd_, events, 0};
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - SteadyClock::now());
    if (left.count() < 0) return false;
    const int rc = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 1 << 30)));
    if (rc > 0) return true;
    if (rc < 0 && errno != EINTR) {
      throw CommError(detail::concat("weights at ", peer_, ": poll failed: ", errno_text(errno)));
    }
  }
}

std::string Socket::read_line(size_t max_bytes, SteadyClock::time_point deadline, bool& eof) {
  eof = false;
  while (true) {
    const size_t newline = pending_.find('\n');
    if (newline != std::string::npos) {
      std::string line = pending_.substr(0, newline);
      pending_.erase(0, newline + 1);
      return line;
    }
    LOOM_CHECK(pending_.size() <= max_bytes, CorruptData, "weights at ", peer_,
               ": a line longer than ", max_bytes, " bytes: is it a Loom weights peer?");
    char buffer[64 * 1024];
    const ssize_t n = ::recv(fd_, buffer, sizeof buffer, 0);
    if (n > 0) {
      pending_.append(buffer, static_cast<size_t>(n));
      continue;
    }
    if (n == 0) {
      if (pending_.empty()) {
        eof = true;
        return "";
      }
      throw CommError(detail::concat("weights at ", peer_, ": the connection closed mid-line"));
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      throw CommError(
          detail::concat("weights at ", peer_, ": receiving failed: ", errno_text(errno)));
    }
    if (!wait_for(POLLIN, deadline)) {
      throw Timeout(detail::concat("weights at ", peer_,
                                   ": no complete line in time (a publisher answers every request "
                                   "within its timeout: is it stuck, or not a Loom publisher?)"));
    }
  }
}

void Socket::read_exact(void* dst, size_t n, milliseconds stall, util::Hasher64& hasher,
                        const std::string& what) {
  auto* out = static_cast<uint8_t*>(dst);
  // Bytes that arrived with the line before them.
  size_t done = std::min(n, pending_.size());
  std::memcpy(out, pending_.data(), done);
  hasher.update(out, done);
  pending_.erase(0, done);
  while (done < n) {
    const ssize_t got = ::recv(fd_, out + done, std::min(n - done, kIoChunk), 0);
    if (got > 0) {
      hasher.update(out + done, static_cast<size_t>(got));
      done += static_cast<size_t>(got);
      continue;
    }
    if (got == 0) {
      throw CommError(detail::concat("weights at ", peer_,
                                     ": the publisher closed the connection "
                                     "after ",
                                     done, " of ", n, " bytes of ", what,
                                     " (did it stop?); ask again for the newest version"));
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      throw CommError(detail::concat("weights at ", peer_, ": receiving ", what, " failed after ",
                                     done, " of ", n, " bytes: ", errno_text(errno)));
    }
    if (!wait_for(POLLIN, util::deadline_after(stall))) {
      throw CommError(detail::concat("weights at ", peer_, ": no byte of ", what, " for ",
                                     stall.count(), " ms after ", done, " of ", n,
                                     " bytes (WeightSubscriberOptions::io_timeout)"));
    }
  }
}

void Socket::write_all(const void* data, size_t n, milliseconds stall) {
  const auto* in = static_cast<const uint8_t*>(data);
  size_t done = 0;
  while (done < n) {
    const ssize_t sent = ::send(fd_, in + done, std::min(n - done, kIoChunk), MSG_NOSIGNAL);
    if (sent > 0) {
      done += static_cast<size_t>(sent);
      continue;
    }
    if (sent < 0 && errno == EINTR) continue;
    if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
      throw CommError(detail::concat("weights to ", peer_, ": sending failed after ", done, " of ",
                                     n, " bytes: ", errno_text(errno)));
    }
    if (!wait_for(POLLOUT, util::deadline_after(stall))) {
      throw CommError(detail::concat("weights to ", peer_, ": the peer took no byte for ",
                                     stall.count(), " ms"));
    }
  }
}

// One version's bytes, copied out of the segment for the connections that send it.
struct WeightServer::Copy {
  int64_t version = -1;
  uint64_t checksum = 0;
  Layout layout;
  std::unique_ptr<uint8_t[]> bytes;
};

WeightServer::WeightServer(const std::string& name, const std::string& listen, int max_connections,
                           Published& published)
    : name_(name), max_connections_(max_connections), published_(published) {
  const std::string what = detail::concat("weights \"", name, "\": listen address");
  const auto [host, port] = split_host_port(listen, what);
  const AddrInfo info = resolve(host, port, true, what + " " + listen);
  std::string why = "no address";
  for (const addrinfo* a = info.get(); a != nullptr && listen_fd_ < 0; a = a->ai_next) {
    const int fd =
        ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, 64) != 0) {
      why = errno_text(errno);
      ::close(fd);
      continue;
    }
    listen_fd_ = fd;
  }
  LOOM_CHECK(listen_fd_ >= 0, IoError, what, " ", listen, " cannot be bound: ", why,
             " (choose a free port, or port 0 for any)");
  sockaddr_storage bound{};
  socklen_t length = sizeof bound;
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &length);
  endpoint_ = address_text(bound);
  const bool wildcard = host == "0.0.0.0" || host == "::";
  if (wildcard) {
    char hostname[256] = {};
    ::gethostname(hostname, sizeof hostname - 1);
    endpoint_ = detail::concat(hostname, ":", endpoint_.substr(endpoint_.rfind(':') + 1));
  }
  acceptor_ = std::thread([this] { accept_loop(); });
}

WeightServer::~WeightServer() {
  stopping_ = true;
  {
    std::lock_guard<std::mutex> lock(published_.mutex);
    published_.changed.notify_all();
  }
  acceptor_.join();
  for (Connection& c : connections_) c.socket->shutdown();  // unblocks a stalled send
  for (Connection& c : connections_) c.thread.join();
  ::close(listen_fd_);
}

void WeightServer::accept_loop() {
  util::name_this_thread("loom-weights");
  while (!stopping_) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(kSlice.count())) <= 0) continue;
    sockaddr_storage peer{};
    socklen_t length = sizeof peer;
    const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&peer), &length,
                             SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) continue;
    set_socket_options(fd);
    auto socket = std::make_unique<Socket>(fd, address_text(peer));
    // Finished connections are reaped here, so the list stays as long as the live ones.
    for (auto it = connections_.begin(); it != connections_.end();) {
      if (it->done) {
        it->thread.join();
        it = connections_.erase(it);
      } else {
        ++it;
      }
    }
    if (static_cast<int>(connections_.size()) >= max_connections_) {
      Reply busy;
      busy.status = "busy";
      busy.message = detail::concat("this publisher serves at most ", max_connections_,
                                    " subscribers at once (WeightPublisherOptions::"
                                    "max_connections); try again later");
      const std::string line = reply_line(busy);
      try {
        socket->write_all(line.data(), line.size(), milliseconds(1000));
      } catch (const Error&) {
      }
      continue;
    }
    Connection& c = connections_.emplace_back();
    c.socket = std::move(socket);
    c.thread = std::thread([this, &c] {
      util::name_this_thread("loom-weights-tx");
      try {
        serve(c);
      } catch (const std::exception& e) {
        spdlog::debug("weights \"{}\": subscriber {}: {}", name_, c.socket->peer(), e.what());
      }
      c.done = true;
    });
  }
}

void WeightServer::serve(Connection& connection) {
  Socket& socket = *connection.socket;
  const milliseconds stall(30000);
  while (!stopping_) {
    bool eof = false;
    std::string line;
    try {
      line = socket.read_line(kMaxRequestLine, util::deadline_after(kSlice), eof);
    } catch (const Timeout&) {
      continue;  // no request yet: look at stopping_ again
    }
    if (eof) return;
    const Request request = parse_request(line, "weights request from " + socket.peer());
    Reply reply;
    {
      std::unique_lock<std::mutex> lock(published_.mutex);
      published_.changed.wait_for(lock, milliseconds(request.timeout_ms), [&] {
        return stopping_ || published_.closing || published_.latest > request.newer_than;
      });
      reply.latest = published_.latest;
      if (stopping_ || published_.closing) {
        reply.status = "closed";
      } else if (published_.latest <= request.newer_than) {
        reply.status = "none";
      }
    }
    if (!reply.status.empty()) {
      if (reply.status == "closed") {
        reply.message = detail::concat("the publisher of weights \"", name_, "\" is closing");
      }
      const std::string text = reply_line(reply);
      socket.write_all(text.data(), text.size(), stall);
      if (reply.status == "closed") return;
      continue;
    }
    const std::shared_ptr<const Copy> copy = newest_copy();
    if (copy == nullptr) return;  // stopping
    reply.status = "ok";
    reply.version = copy->version;
    reply.latest = copy->version;
    reply.checksum = copy->checksum;
    reply.layout = copy->layout;
    const std::string text = reply_line(reply);
    socket.write_all(text.data(), text.size(), stall);
    socket.write_all(copy->bytes.get(), copy->layout.total_bytes, stall);
  }
}

std::shared_ptr<const WeightServer::Copy> WeightServer::newest_copy() {
  const SegmentHeader* header = nullptr;
  const uint8_t* base = nullptr;
  Layout layout;
  {
    std::lock_guard<std::mutex> lock(published_.mutex);
    header = published_.header;
    base = published_.base;
    layout = published_.layout;
  }
  std::lock_guard<std::mutex> lock(copy_mutex_);
  const int64_t latest = header->latest_version.load(std::memory_order_acquire);
  if (copy_ != nullptr && copy_->version == latest) return copy_;
  // The previous version's buffer when no connection sends it any more: fresh pages cost more
  // to fault in than the copy itself (64 MiB: 240 ms against 10 ms on the 2-core VM).
  std::shared_ptr<Copy> copy;
  if (spare_ != nullptr && spare_.use_count() == 1) {
    copy = std::move(spare_);
  } else {
    copy = std::make_shared<Copy>();
    copy->bytes.reset(new uint8_t[std::max<uint64_t>(layout.total_bytes, 1)]);
  }
  copy->layout = std::move(layout);
  const std::vector<Span> spans = {{copy->bytes.get(), copy->layout.total_bytes}};
  const std::string where = "weights \"" + name_ + "\"";
  // The publisher is in this process and copies at the same speed: a torn copy is retried at
  // once and succeeds unless it publishes faster than slots - 1 copies take.
  while (!stopping_) {
    const ReadResult read = read_newest(*header, base, -1, spans, where);
    if (read.status != ReadStatus::kOk) continue;
    LOOM_CHECK(read.computed == read.checksum, CorruptData, where, ": version ", read.version,
               " in the segment has xxHash64 ", util::hash_hex(read.computed), ", not ",
               util::hash_hex(read.checksum), ": the segment was written by something else");
    copy->version = read.version;
    copy->checksum = read.checksum;
    spare_ = std::move(copy_);
    copy_ = std::move(copy);
    return copy_;
  }
  return nullptr;
}

}  // namespace loom::control::weights

// The TCP side of weight snapshots: blocking socket helpers with deadlines, and the publisher's
// listener (WeightServer), which serves the newest version of the publisher's segment to
// subscribers on other hosts. The protocol's lines are in weights_format.h. Private to Loom.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "control/weights_format.h"
#include "util/deadline.h"
#include "util/hash.h"

namespace loom::control::weights {

// "HOST:PORT" -> host and port; InvalidArgument naming `what` for anything else.
std::pair<std::string, int> split_host_port(const std::string& address, const std::string& what);

// A connected stream socket, closed on destruction. Every call takes a deadline; passing it is
// loom::Timeout, a failed or closed peer CommError, both naming `peer`.
class Socket {
 public:
  Socket(int fd, std::string peer) : fd_(fd), peer_(std::move(peer)) {}
  ~Socket();
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  // Connects to "HOST:PORT" once: nullptr when refused or unreachable (why says so), IoError
  // for a host that does not resolve.
  static std::unique_ptr<Socket> connect(const std::string& address,
                                         util::SteadyClock::time_point deadline, std::string& why);

  int fd() const { return fd_; }
  const std::string& peer() const { return peer_; }
  // One line without its '\n', at most max_bytes; "" with eof = true when the peer closed
  // before a byte of it. A Timeout leaves what arrived buffered for the next call.
  std::string read_line(size_t max_bytes, util::SteadyClock::time_point deadline, bool& eof);
  // Exactly n bytes into dst, hashed; the deadline is extended by `stall` whenever bytes arrive.
  void read_exact(void* dst, size_t n, std::chrono::milliseconds stall, util::Hasher64& hasher,
                  const std::string& what);
  void write_all(const void* data, size_t n, std::chrono::milliseconds stall);
  // Stops blocking calls of other threads on this socket (they fail).
  void shutdown();

 private:
  // Waits for `events` until the deadline; false when it passed.
  bool wait_for(short events, util::SteadyClock::time_point deadline);

  int fd_;
  std::string peer_;
  std::string pending_;  // received after the last line read, not yet consumed
};

// What the listener reads: the publisher's segment and its newest version. Owned by the
// publisher; the publisher thread writes it under `mutex` after each publish.
struct Published {
  std::mutex mutex;
  std::condition_variable changed;
  // Below: protected by mutex.
  const SegmentHeader* header = nullptr;  // null until the first publish creates the segment
  const uint8_t* base = nullptr;
  Layout layout;
  int64_t latest = -1;
  bool closing = false;
};

// The publisher's TCP listener: one accepting thread, and one thread per connection (at most
// max_connections; more are answered "busy" and closed). A connection reads a request line,
// waits for a version newer than asked (on Published::changed), copies the newest version out of
// the segment under its sequence lock (one copy per version, shared by the connections that send
// it), and sends the reply line and the bytes.
// Thread safety: the constructor and destructor run on the publisher's thread; everything else
// runs on the server's own threads.
class WeightServer {
 public:
  // Binds `listen` ("ADDRESS:PORT"); IoError naming it when it cannot.
  WeightServer(const std::string& name, const std::string& listen, int max_connections,
               Published& published);
  // Answers waiting requests "closed", stops and joins every thread.
  ~WeightServer();
  WeightServer(const WeightServer&) = delete;
  WeightServer& operator=(const WeightServer&) = delete;

  // "HOST:PORT" as bound.
  const std::string& endpoint() const { return endpoint_; }

 private:
  struct Copy;
  struct Connection {
    std::unique_ptr<Socket> socket;
    std::thread thread;
    std::atomic<bool> done{false};
  };

  void accept_loop();
  void serve(Connection& connection);
  // The newest version's bytes (a version newer than `newer_than`), copied once per version.
  std::shared_ptr<const Copy> newest_copy();

  // Constant after construction.
  const std::string name_;
  const int max_connections_;
  Published& published_;
  int listen_fd_ = -1;
  std::string endpoint_;

  std::atomic<bool> stopping_{false};
  std::thread acceptor_;
  // Touched by the acceptor thread only (and by the destructor after it is joined).
  std::list<Connection> connections_;
  // Protected by copy_mutex_: the newest copy, and the one before it, reused for the next
  // version once no connection sends it.
  std::mutex copy_mutex_;
  std::shared_ptr<Copy> copy_;
  std::shared_ptr<Copy> spare_;
};

}  // namespace loom::control::weights

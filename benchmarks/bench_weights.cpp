// bench_data --mode=weights: weight snapshots (loom/control/weights.h) from publish() to a
// subscriber process holding the version, as bandwidth, beside the physical floor of each
// transport: a memcpy of the same bytes (shared memory, same host) and the same bytes over a
// plain TCP socket (loopback, and between two network namespaces when root). The subscriber is
// this binary again (--mode=weights-peer), in the other namespace for the last case; the two
// processes read one clock (CLOCK_MONOTONIC, shared across namespaces). Rounds interleave Loom
// and the baseline; round 0 is "cold" (segment created, connection opened, destination pages
// faulted), the median of the others "warm".
#include "bench_weights.h"

#include <ATen/ATen.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <thread>

#include "bench_report.h"
#ifdef LOOM_BENCH_REMOTE
#include "harness/network_namespaces.h"
#endif
#include "control/weights_net.h"
#include "loom/control/weights.h"
#include "loom/error.h"
#include "util/fd.h"
#include "util/subprocess.h"

namespace loom::bench {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Tensors of 4 MiB (the last one smaller) making up `bytes`.
std::map<std::string, at::Tensor> model_of(int64_t bytes, int64_t version) {
  std::map<std::string, at::Tensor> tensors;
  const int64_t piece = int64_t{4} << 20;
  for (int64_t i = 0, done = 0; done < bytes; ++i, done += piece) {
    const int64_t n = std::min(piece, bytes - done) / 4;
    char name[32];
    std::snprintf(name, sizeof name, "layer%03lld.weight", static_cast<long long>(i));
    tensors.emplace(name, at::full({n}, static_cast<float>(version), at::kFloat));
  }
  return tensors;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

std::pair<double, double> median_spread(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v.back() - v.front()};
}

// A listening TCP socket for the raw baseline; accept() once.
class RawListener {
 public:
  explicit RawListener(const std::string& host) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    ::inet_pton(AF_INET, host.c_str(), &address.sin_addr);
    LOOM_CHECK_SYS(::bind(fd_, reinterpret_cast<sockaddr*>(&address), sizeof address), "bind ",
                   host);
    LOOM_CHECK_SYS(::listen(fd_, 1), "listen");
    socklen_t length = sizeof address;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &length);
    address_ = host + ":" + std::to_string(ntohs(address.sin_port));
  }
  ~RawListener() { ::close(fd_); }
  const std::string& address() const { return address_; }
  int accept() { return LOOM_CHECK_SYS(::accept(fd_, nullptr, nullptr), "accept"); }

 private:
  int fd_ = -1;
  std::string address_;
};

// The subscriber process and the line protocol it speaks on its stdout: "ready" before each
// transfer, "done <ns>" when it holds the bytes.
class Peer {
 public:
  Peer(std::vector<std::string> prefix, const std::string& source, const std::string& raw,
       const WeightsSettings& s) {
    int fds[2];
    LOOM_CHECK_SYS(::pipe2(fds, O_CLOEXEC), "pipe");
    std::vector<std::string> argv = std::move(prefix);
    argv.insert(argv.end(), {fs::read_symlink("/proc/self/exe").string(), "--mode=weights-peer",
                             "--weights-source=" + source, "--rounds=" + std::to_string(s.rounds),
                             "--weights-mib=" + std::to_string(s.mib)});
    if (!raw.empty()) argv.push_back("--weights-raw=" + raw);
    process_ = std::make_unique<util::Subprocess>(
        util::Subprocess::spawn({.argv = argv, .output_fd = fds[1]}));
    ::close(fds[1]);
    out_ = ::fdopen(fds[0], "r");
  }
  ~Peer() {
    if (out_ != nullptr) ::fclose(out_);
  }
  // The next protocol line's value: "ready" -> 0, "done N" -> N.
  int64_t expect(const char* what) {
    char line[4096];
    while (std::fgets(line, sizeof line, out_) != nullptr) {
      if (std::strncmp(line, what, std::strlen(what)) == 0) {
        return std::strcmp(what, "done") == 0 ? std::stoll(line + 5) : 0;
      }
      std::fprintf(stderr, "weights peer: %s", line);
    }
    throw Error(detail::concat("bench_data: the weights peer ended before \"", what,
                               "\": ", process_->wait().describe()));
  }

 private:
  std::unique_ptr<util::Subprocess> process_;
  FILE* out_ = nullptr;
};

struct Transport {
  std::string label;                // "shm", "tcp-loopback", "tcp-netns"
  std::string listen;               // the publisher's; "" for shared memory
  std::string raw_host;             // the raw baseline's listening host; "" for memcpy
  std::vector<std::string> prefix;  // runs the peer (ip netns exec ...)
};

void report_pair(const WeightsSettings& s, const std::string& case_name, double loom_s,
                 double base_s, const std::string& baseline_name, double bytes, double loom_spread,
                 double base_spread, double publish_s) {
  const double gb = bytes / 1e9;
  Row row{"data", case_name, gb / loom_s, gb / base_s, baseline_name, "GB/s", base_s / loom_s};
  row.extra["loom_ms"] = loom_s * 1e3;
  row.extra["baseline_ms"] = base_s * 1e3;
  row.extra["publish_ms"] = publish_s * 1e3;  // how long publish() held the trainer
  if (loom_spread >= 0) {
    row.extra["loom_spread_ms"] = loom_spread * 1e3;
    row.extra["baseline_spread_ms"] = base_spread * 1e3;
  }
  if (s.json) {
    print_json(row);
  } else {
    std::printf("%-34s %10.2f %10.2f  %-28s %6.2fx  %s (%.1f vs %.1f ms; publish %.1f ms)\n",
                case_name.c_str(), row.loom, row.baseline, baseline_name.c_str(), row.ratio,
                row.unit.c_str(), loom_s * 1e3, base_s * 1e3, publish_s * 1e3);
  }
  std::fflush(stdout);
}

void measure(const WeightsSettings& s, const Transport& t) {
  const int64_t bytes = static_cast<int64_t>(s.mib * (1 << 20)) / 4 * 4;
  const std::string name = "bench-" + t.label + "-" + std::to_string(::getpid());
  control::WeightPublisher publisher(name, {.listen = t.listen});
  std::unique_ptr<RawListener> raw;
  if (!t.raw_host.empty()) raw = std::make_unique<RawListener>(t.raw_host);
  Peer peer(t.prefix, t.listen.empty() ? name : publisher.endpoint(), raw ? raw->address() : "", s);
  std::unique_ptr<util::UniqueFd> raw_socket;
  if (raw) raw_socket = std::make_unique<util::UniqueFd>(raw->accept());
  std::vector<std::map<std::string, at::Tensor>> versions = {model_of(bytes, 0),
                                                             model_of(bytes, 1)};
  const auto source = at::full({bytes}, 1, at::kByte);
  std::vector<double> loom_s, base_s, publish_s;  // publish_s: the trainer's part of loom_s
  at::Tensor warm_destination = at::zeros({bytes}, at::kByte);  // faulted in once, here
  for (int r = 0; r < s.rounds; ++r) {
    peer.expect("ready");
    std::this_thread::sleep_for(milliseconds(20));  // the peer is waiting in latest()
    const int64_t start = now_ns();
    publisher.publish(r, versions[r % 2]);
    publish_s.push_back(static_cast<double>(now_ns() - start) * 1e-9);
    loom_s.push_back(static_cast<double>(peer.expect("done") - start) * 1e-9);
    if (raw) {
      peer.expect("ready");
      std::this_thread::sleep_for(milliseconds(20));
      const int64_t raw_start = now_ns();
      size_t sent = 0;
      const auto* data = static_cast<const uint8_t*>(source.data_ptr());
      while (sent < static_cast<size_t>(bytes)) {
        const ssize_t n = ::send(raw_socket->get(), data + sent, bytes - sent, MSG_NOSIGNAL);
        LOOM_CHECK(n > 0, IoError, "bench_data: raw send failed: ", std::strerror(errno));
        sent += static_cast<size_t>(n);
      }
      base_s.push_back(static_cast<double>(peer.expect("done") - raw_start) * 1e-9);
    } else {
      // Round 0 into fresh pages, as the cold Loom transfer; later rounds into warm ones.
      at::Tensor destination = r == 0 ? at::empty({bytes}, at::kByte) : warm_destination;
      const auto copy_start = Clock::now();
      std::memcpy(destination.data_ptr(), source.data_ptr(), static_cast<size_t>(bytes));
      base_s.push_back(std::chrono::duration<double>(Clock::now() - copy_start).count());
      asm volatile("" : : "g"(destination.data_ptr()) : "memory");
    }
  }
  const std::string size = format_bytes(static_cast<double>(bytes));
  const std::string baseline = raw ? "raw_tcp_same_bytes" : "memcpy_same_bytes";
  report_pair(s, "weights/" + t.label + "/" + size + "/cold", loom_s[0], base_s[0], baseline,
              static_cast<double>(bytes), -1, -1, publish_s[0]);
  if (s.rounds > 1) {
    const auto [loom_median, loom_spread] =
        median_spread(std::vector<double>(loom_s.begin() + 1, loom_s.end()));
    const auto [base_median, base_spread] =
        median_spread(std::vector<double>(base_s.begin() + 1, base_s.end()));
    const double publish_median =
        median_spread(std::vector<double>(publish_s.begin() + 1, publish_s.end())).first;
    report_pair(s, "weights/" + t.label + "/" + size + "/warm", loom_median, base_median, baseline,
                static_cast<double>(bytes), loom_spread, base_spread, publish_median);
  }
}

// Enters (and on destruction leaves) a network namespace, on this thread only: the sockets the
// publisher and the raw listener create here belong to it.
class InNamespace {
 public:
  explicit InNamespace(const std::string& name) {
    const int target = LOOM_CHECK_SYS(::open(("/run/netns/" + name).c_str(), O_RDONLY | O_CLOEXEC),
                                      "opening /run/netns/", name);
    LOOM_CHECK_SYS(::setns(target, CLONE_NEWNET), "setns ", name);
    ::close(target);
  }
  ~InNamespace() { ::setns(home_.get(), CLONE_NEWNET); }

 private:
  util::UniqueFd home_{::open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC)};
};

}  // namespace

int run_weights(const WeightsSettings& s) {
  if (!s.json) {
    std::printf("%-34s %10s %10s  %-28s %7s\n", "case", "loom", "baseline", "baseline", "ratio");
  }
  measure(s, {.label = "shm"});
  measure(s, {.label = "tcp-loopback", .listen = "127.0.0.1:0", .raw_host = "127.0.0.1"});
#ifdef LOOM_BENCH_REMOTE
  testing::NetworkNamespaces net;
  if (!net.ok()) {
    std::fprintf(stderr,
                 "bench_data: no tcp-netns rows: cannot create network namespaces "
                 "(needs root and iproute2)\n");
    return 0;
  }
  InNamespace inside(net.name(0));
  measure(s, {.label = "tcp-netns",
              .listen = testing::NetworkNamespaces::address(0) + ":0",
              .raw_host = testing::NetworkNamespaces::address(0),
              .prefix = net.exec_in(1)});
#endif
  return 0;
}

int run_weights_peer(const WeightsSettings& s) {
  at::set_num_threads(1);
  control::WeightSubscriber subscriber(s.peer_source);
  control::WeightVersion version;
  const int64_t bytes = static_cast<int64_t>(s.mib * (1 << 20)) / 4 * 4;
  std::unique_ptr<control::weights::Socket> raw;
  std::vector<uint8_t> buffer;
  if (!s.peer_raw.empty()) {
    std::string why;
    raw = control::weights::Socket::connect(s.peer_raw, util::deadline_after(milliseconds(10000)),
                                            why);
    LOOM_CHECK(raw != nullptr, IoError, "bench_data peer: connecting to ", s.peer_raw, ": ", why);
    buffer.resize(static_cast<size_t>(bytes));
  }
  for (int r = 0; r < s.rounds; ++r) {
    std::printf("ready\n");
    std::fflush(stdout);
    subscriber.latest_into(version, r - 1, std::chrono::seconds(60));
    LOOM_CHECK(version.version == r, Error, "bench_data peer: received version ", version.version,
               ", expected ", r);
    std::printf("done %lld\n", static_cast<long long>(now_ns()));
    std::fflush(stdout);
    if (raw) {
      std::printf("ready\n");
      std::fflush(stdout);
      size_t got = 0;
      while (got < buffer.size()) {
        const ssize_t n = ::recv(raw->fd(), buffer.data() + got, buffer.size() - got, 0);
        if (n > 0) {
          got += static_cast<size_t>(n);
        } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
          throw IoError("bench_data peer: the raw connection failed");
        } else {
          pollfd p{raw->fd(), POLLIN, 0};
          ::poll(&p, 1, 1000);
        }
      }
      std::printf("done %lld\n", static_cast<long long>(now_ns()));
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace loom::bench

// Weight snapshots (loom/control/weights.h): the publisher's segment and the subscribers of both
// transports. The bytes are weights_format.h's, the TCP listener is weights_net.h's.
#include "loom/control/weights.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <spdlog/spdlog.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <new>
#include <thread>

#include "control/weights_format.h"
#include "control/weights_net.h"
#include "loom/error.h"
#include "util/deadline.h"
#include "util/fd.h"

namespace loom::control {
namespace {

using namespace weights;  // NOLINT: this file is the format's one user
using std::chrono::milliseconds;
using util::SteadyClock;

// How long a subscriber sleeps at most before it looks at its deadline and the publisher again.
constexpr milliseconds kWaitSlice{10};
// How long a starting publisher tries to lock a segment it found, which a subscriber's
// liveness probe may hold for a moment.
constexpr milliseconds kClaimTries{200};

std::string errno_text(int error) { return std::strerror(error); }

void futex_wake(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void futex_wait(const std::atomic<uint32_t>* word, uint32_t seen, milliseconds slice) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(slice.count() / 1000);
  ts.tv_nsec = static_cast<long>(slice.count() % 1000) * 1000000;
  ::syscall(SYS_futex, reinterpret_cast<const uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

// A mapped segment, unmapped on destruction.
struct Mapping {
  void* base = MAP_FAILED;
  size_t bytes = 0;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (base != MAP_FAILED) ::munmap(base, bytes);
  }
  SegmentHeader& header() const { return *static_cast<SegmentHeader*>(base); }
  uint8_t* bytes_at(uint64_t offset) const { return static_cast<uint8_t*>(base) + offset; }
};

// Whether the process holding `fd`'s segment exclusively is gone: its flock is free.
bool publisher_gone(int fd) {
  if (::flock(fd, LOCK_SH | LOCK_NB) == 0) {
    ::flock(fd, LOCK_UN);
    return true;
  }
  return false;
}

// The pid in a segment's header, 0 when the segment is too short or not initialised.
int pid_in(int fd) {
  SegmentHeader header;
  const ssize_t n = ::pread(fd, &header, sizeof header, 0);
  if (n != static_cast<ssize_t>(sizeof header)) return 0;
  return header.magic.load() == kMagic ? header.pid : 0;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Publisher

struct WeightPublisher::Impl {
  // Constant after construction.
  std::string name;
  WeightPublisherOptions options;
  std::string path;
  // Owned by the publishing thread; the segment is created by the first publish.
  std::unique_ptr<util::UniqueFd> fd;  // holds the flock that says this publisher is alive
  Mapping mapping;
  Layout layout;
  std::atomic<int64_t> latest{-1};
  // Shared with the listener thread (its own mutex).
  Published published;
  std::unique_ptr<WeightServer> server;  // with options.listen

  void claim_name();
  void create_segment(const Layout& given);
};

void WeightPublisher::Impl::claim_name() {
  const std::string shm = "/" + segment_name(name);
  const int raw = ::shm_open(shm.c_str(), O_RDWR | O_CLOEXEC, 0600);
  if (raw < 0) {
    LOOM_CHECK(errno == ENOENT, IoError, "weights \"", name, "\": opening ", path,
               " failed: ", errno_text(errno));
    return;
  }
  util::UniqueFd existing(raw);
  const auto until = util::deadline_after(kClaimTries);
  while (::flock(existing.get(), LOCK_EX | LOCK_NB) != 0) {
    if (util::expired(until)) {
      throw InvalidArgument(detail::concat(
          "weights \"", name, "\": ", path, " belongs to a live publisher (pid ",
          pid_in(existing.get()),
          "); stop it, or give this publisher another name (WeightPublisher's name)"));
    }
    std::this_thread::sleep_for(milliseconds(5));
  }
  spdlog::warn("weights \"{}\": removing {}, left by publisher pid {}, which is gone", name, path,
               pid_in(existing.get()));
  ::shm_unlink(shm.c_str());
}

void WeightPublisher::Impl::create_segment(const Layout& given) {
  const std::string layout_text = layout_json(given).dump();
  const Geometry g = geometry(options.slots, layout_text.size(), given.total_bytes);
  const std::string shm = "/" + segment_name(name);
  const int raw = ::shm_open(shm.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  LOOM_CHECK(raw >= 0, IoError, "weights \"", name, "\": creating ", path,
             " failed: ", errno_text(errno),
             errno == EEXIST ? " (another publisher took the name since this one started)" : "");
  auto owned = std::make_unique<util::UniqueFd>(raw);
  LOOM_CHECK_SYS(::flock(raw, LOCK_EX | LOCK_NB), "locking ", path);
  const int error = ::posix_fallocate(raw, 0, static_cast<off_t>(g.segment_bytes));
  if (error != 0) {
    ::shm_unlink(shm.c_str());
    throw IoError(detail::concat("weights \"", name, "\": reserving ", g.segment_bytes,
                                 " bytes of shared memory for ", path, " (", options.slots,
                                 " versions of ", given.total_bytes,
                                 " bytes) failed: ", errno_text(error),
                                 " (a container's /dev/shm is often 64 MiB: raise it, e.g. "
                                 "docker --shm-size, or lower WeightPublisherOptions::slots)"));
  }
  mapping.bytes = g.segment_bytes;
  mapping.base =
      ::mmap(nullptr, g.segment_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, raw, 0);
  if (mapping.base == MAP_FAILED) {
    const int map_error = errno;
    ::shm_unlink(shm.c_str());
    throw IoError(detail::concat("weights \"", name, "\": mapping ", path,
                                 " failed: ", errno_text(map_error)));
  }
  auto* header = new (mapping.base) SegmentHeader();
  header->format_version = kFormatVersion;
  header->slot_count = static_cast<uint32_t>(options.slots);
  header->pid = static_cast<int32_t>(::getpid());
  header->layout_offset = g.layout_offset;
  header->layout_bytes = layout_text.size();
  header->data_offset = g.data_offset;
  header->slot_stride = g.slot_stride;
  header->data_bytes = given.total_bytes;
  header->segment_bytes = g.segment_bytes;
  std::memcpy(mapping.bytes_at(g.layout_offset), layout_text.data(), layout_text.size());
  header->magic.store(kMagic, std::memory_order_release);
  fd = std::move(owned);
  layout = given;
  std::lock_guard<std::mutex> lock(published.mutex);
  published.header = header;
  published.base = mapping.bytes_at(0);
  published.layout = given;
}

WeightPublisher::WeightPublisher(std::string name, WeightPublisherOptions options)
    : impl_(std::make_unique<Impl>()) {
  check_name(name);
  LOOM_CHECK(options.slots >= kMinSlots && options.slots <= kMaxSlots, InvalidArgument,
             "weights \"", name, "\": WeightPublisherOptions::slots is ", options.slots,
             "; it must be in [", kMinSlots, ", ", kMaxSlots, "]");
  LOOM_CHECK(options.max_connections >= 1, InvalidArgument, "weights \"", name,
             "\": WeightPublisherOptions::max_connections must be at least 1");
  impl_->name = std::move(name);
  impl_->options = std::move(options);
  impl_->path = weights::segment_path(impl_->name);
  impl_->claim_name();
  if (!impl_->options.listen.empty()) {
    impl_->server = std::make_unique<WeightServer>(
        impl_->name, impl_->options.listen, impl_->options.max_connections, impl_->published);
  }
}

WeightPublisher::~WeightPublisher() {
  {
    std::lock_guard<std::mutex> lock(impl_->published.mutex);
    impl_->published.closing = true;
    impl_->published.changed.notify_all();
  }
  impl_->server.reset();
  if (impl_->fd != nullptr) {
    SegmentHeader& header = impl_->mapping.header();
    header.closed.store(1, std::memory_order_release);
    header.publishes.fetch_add(1, std::memory_order_release);
    futex_wake(&header.publishes);
    ::shm_unlink(("/" + segment_name(impl_->name)).c_str());
  }
}

void WeightPublisher::publish(int64_t version, const std::map<std::string, at::Tensor>& tensors) {
  Impl& s = *impl_;
  const int64_t previous = s.latest.load(std::memory_order_relaxed);
  LOOM_CHECK(version >= 0 && version > previous, InvalidArgument, "weights \"", s.name,
             "\": version ", version,
             " must be at least 0 and greater than the last one published (", previous, ")");
  const Layout given = layout_of(tensors);
  if (s.fd == nullptr) {
    s.create_segment(given);
  } else {
    const std::string difference = layout_difference(s.layout, given);
    LOOM_CHECK(difference.empty(), InvalidArgument, "weights \"", s.name, "\": ", difference,
               "; the layout is fixed by the first publish: publish the same tensors, or another "
               "model under another name");
  }
  SegmentHeader& header = s.mapping.header();
  const int32_t newest = header.latest_slot.load(std::memory_order_relaxed);
  const int slot = (newest + 1) % s.options.slots;
  uint8_t* data =
      s.mapping.bytes_at(header.data_offset + static_cast<uint64_t>(slot) * header.slot_stride);
  begin_write(header, slot);
  util::Hasher64 hasher;
  for (const TensorSpec& spec : s.layout.tensors) {
    const at::Tensor& given_tensor = tensors.at(spec.name);
    const at::Tensor t = given_tensor.device().is_cpu() ? given_tensor.contiguous()
                                                        : given_tensor.to(at::kCPU).contiguous();
    copy_and_hash(data + spec.offset, t.data_ptr(), spec.bytes, hasher);
  }
  end_write(header, slot, version, hasher.digest());
  futex_wake(&header.publishes);
  s.latest.store(version, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(s.published.mutex);
  s.published.latest = version;
  s.published.changed.notify_all();
}

std::string WeightPublisher::endpoint() const {
  return impl_->server == nullptr ? "" : impl_->server->endpoint();
}

std::string WeightPublisher::segment_path() const { return impl_->path; }

int64_t WeightPublisher::latest_version() const {
  return impl_->latest.load(std::memory_order_relaxed);
}

// ---------------------------------------------------------------------------------------------
// Subscriber

namespace {

// Makes `into` hold tensors of `layout` (keeping its tensors when they already match) and
// returns their bytes in layout order.
std::vector<Span> prepare(std::map<std::string, at::Tensor>& into, const Layout& layout) {
  bool reusable = into.size() == layout.tensors.size();
  for (const TensorSpec& spec : layout.tensors) {
    if (!reusable) break;
    const auto it = into.find(spec.name);
    reusable = it != into.end() && it->second.defined() && it->second.device().is_cpu() &&
               it->second.scalar_type() == spec.dtype && it->second.sizes().vec() == spec.shape &&
               it->second.is_contiguous();
  }
  if (!reusable) {
    into.clear();
    for (const TensorSpec& spec : layout.tensors) {
      into.emplace(spec.name, at::empty(spec.shape, at::TensorOptions().dtype(spec.dtype)));
    }
  }
  std::vector<Span> spans;
  for (const TensorSpec& spec : layout.tensors) {
    spans.push_back({into.at(spec.name).data_ptr(), spec.bytes});
  }
  return spans;
}

// The shared-memory side: the segment of a publisher on this host.
class ShmSource {
 public:
  explicit ShmSource(std::string name)
      : name_(std::move(name)), path_(segment_path(name_)), where_("weights \"" + name_ + "\"") {
    check_name(name_);
  }

  void latest_into(WeightVersion& into, int64_t newer_than, milliseconds timeout,
                   int64_t& torn_total) {
    const auto deadline = util::deadline_after(timeout);
    into.torn_reads = 0;
    while (true) {
      if (mapping_ == nullptr && !attach()) {
        if (util::expired(deadline)) throw Timeout(timeout_message(newer_than, timeout));
        std::this_thread::sleep_for(kWaitSlice);
        continue;
      }
      const SegmentHeader& header = mapping_->header();
      const uint32_t seen = header.publishes.load(std::memory_order_acquire);
      const std::vector<Span> spans = prepare(into.tensors, layout_);
      const ReadResult read = read_newest(header, mapping_->bytes_at(0), newer_than, spans, where_);
      if (read.status == ReadStatus::kTorn) {
        ++into.torn_reads;
        ++torn_total;
        LOOM_CHECK(!util::expired(deadline), Timeout, where_, ": no whole version within ",
                   timeout.count(), " ms: the publisher overwrote ", into.torn_reads,
                   " reads of this call while they were copied; it publishes faster than this "
                   "subscriber copies: raise WeightPublisherOptions::slots (now ",
                   mapping_->header().slot_count, ")");
        continue;
      }
      if (read.status == ReadStatus::kOk) {
        LOOM_CHECK(read.computed == read.checksum, CorruptData, where_, ": version ", read.version,
                   " in ", path_, " has xxHash64 ", util::hash_hex(read.computed),
                   " where the publisher wrote ", util::hash_hex(read.checksum),
                   ": the segment was changed by something other than its publisher");
        into.version = read.version;
        into.checksum = read.checksum;
        return;
      }
      newest_ = read.version;
      if (header.closed.load(std::memory_order_acquire) != 0) {
        state_ = detail::concat("its publisher (pid ", header.pid, ") closed it");
        detach();
        continue;
      }
      if (publisher_gone(fd_->get())) {
        state_ = detail::concat("its publisher (pid ", header.pid, ") died without removing it");
        detach();
        continue;
      }
      if (util::expired(deadline)) throw Timeout(timeout_message(newer_than, timeout));
      futex_wait(&header.publishes, seen, std::min(kWaitSlice, util::time_left(deadline)));
    }
  }

 private:
  // Maps the segment when a live publisher has initialised it; false (state_ says why) when
  // there is none yet. CorruptData for a segment that is not Loom's format.
  bool attach() {
    const int raw = ::shm_open(("/" + segment_name(name_)).c_str(), O_RDONLY | O_CLOEXEC, 0);
    if (raw < 0) {
      LOOM_CHECK(errno == ENOENT, IoError, where_, ": opening ", path_,
                 " failed: ", errno_text(errno));
      if (state_.empty() || state_ == kCreating) {
        state_ = "there is no " + path_ + " (a publisher creates it at its first publish)";
      }
      return false;
    }
    auto fd = std::make_unique<util::UniqueFd>(raw);
    struct stat info {};
    LOOM_CHECK_SYS(::fstat(raw, &info), "reading the size of ", path_);
    const auto bytes = static_cast<uint64_t>(info.st_size);
    if (publisher_gone(raw)) {
      const int pid = pid_in(raw);
      state_ = detail::concat("its publisher", pid ? detail::concat(" (pid ", pid, ")") : "",
                              " died without removing ", path_);
      return false;
    }
    if (bytes < kHeaderRegion || pid_in(raw) == 0) {
      state_ = kCreating;
      return false;
    }
    auto mapping = std::make_unique<Mapping>();
    mapping->bytes = bytes;
    mapping->base = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, raw, 0);
    LOOM_CHECK(mapping->base != MAP_FAILED, IoError, where_, ": mapping ", path_,
               " failed: ", errno_text(errno));
    const SegmentHeader& header = mapping->header();
    check_header(header, bytes, path_);
    const std::string text(reinterpret_cast<const char*>(mapping->bytes_at(header.layout_offset)),
                           header.layout_bytes);
    const nlohmann::json value = nlohmann::json::parse(text, nullptr, false);
    layout_ = parse_layout(value, path_);
    LOOM_CHECK(layout_.total_bytes == header.data_bytes, CorruptData, path_, ": the layout holds ",
               layout_.total_bytes, " bytes, the header says ", header.data_bytes);
    fd_ = std::move(fd);
    mapping_ = std::move(mapping);
    return true;
  }

  void detach() {
    mapping_.reset();
    fd_.reset();
  }

  std::string timeout_message(int64_t newer_than, milliseconds timeout) const {
    if (mapping_ != nullptr) {
      return detail::concat(where_, ": no version newer than ", newer_than, " within ",
                            timeout.count(), " ms (the newest is ", newest_,
                            "); is the trainer still publishing?");
    }
    return detail::concat(where_, ": no publisher within ", timeout.count(), " ms: ", state_,
                          ". Start the publisher on this host under that name (a publisher on "
                          "another host is reached as HOST:PORT, its endpoint())");
  }

  static constexpr const char* kCreating = "its publisher is still creating it";

  const std::string name_;
  const std::string path_;
  const std::string where_;
  std::unique_ptr<util::UniqueFd> fd_;
  std::unique_ptr<Mapping> mapping_;
  Layout layout_;
  int64_t newest_ = -1;
  std::string state_;  // why there is no mapping, for messages
};

// The TCP side: requests to a publisher's listener.
class TcpSource {
 public:
  TcpSource(std::string address, WeightSubscriberOptions options)
      : address_(std::move(address)), options_(options), where_("weights at " + address_) {
    split_host_port(address_, "weights source");
  }

  void latest_into(WeightVersion& into, int64_t newer_than, milliseconds timeout) {
    const auto deadline = util::deadline_after(timeout);
    into.torn_reads = 0;
    said_.clear();
    while (true) {
      if (socket_ == nullptr) {
        std::string why;
        socket_ = Socket::connect(address_, deadline, why);
        // What the publisher itself said last (busy, closing) says more than a connect failure.
        if (socket_ == nullptr && said_.empty()) state_ = why;
        if (socket_ == nullptr) {
          if (util::expired(deadline)) throw Timeout(timeout_message(newer_than, timeout));
          std::this_thread::sleep_for(std::min(milliseconds(50), util::time_left(deadline)));
          continue;
        }
      }
      const auto left = std::max<int64_t>(
          0, std::chrono::duration_cast<milliseconds>(deadline - SteadyClock::now()).count());
      Reply reply;
      try {
        const std::string request = request_line({newer_than, left});
        socket_->write_all(request.data(), request.size(), options_.io_timeout);
        bool eof = false;
        const std::string line =
            socket_->read_line(kMaxLayoutBytes, deadline + options_.io_timeout, eof);
        if (eof) throw CommError(where_ + ": the publisher closed the connection");
        reply = parse_reply(line, static_cast<uint64_t>(options_.max_bytes), where_);
      } catch (const CommError& e) {
        // The publisher went away between requests (or restarted): connect again.
        if (said_.empty()) state_ = e.what();
        socket_.reset();
        if (util::expired(deadline)) throw Timeout(timeout_message(newer_than, timeout));
        continue;
      } catch (const Error&) {
        // A reply that is late or not Loom's: this connection's next line could be its answer
        // to this request, so it is not used again.
        socket_.reset();
        throw;
      }
      if (reply.status == "ok") {
        receive(reply, into);
        return;
      }
      newest_ = reply.latest;
      if (reply.status == "closed" || reply.status == "busy") {
        state_ = said_ = reply.message;
        socket_.reset();
        if (util::expired(deadline)) throw Timeout(timeout_message(newer_than, timeout));
        std::this_thread::sleep_for(std::min(milliseconds(50), util::time_left(deadline)));
        continue;
      }
      if (util::expired(deadline)) throw Timeout(timeout_message(newer_than, timeout));
    }
  }

 private:
  void receive(const Reply& reply, WeightVersion& into) {
    const std::vector<Span> spans = prepare(into.tensors, reply.layout);
    util::Hasher64 hasher;
    const std::string what = detail::concat("version ", reply.version);
    try {
      for (const Span& span : spans) {
        socket_->read_exact(span.data, span.bytes, options_.io_timeout, hasher, what);
      }
    } catch (const Error&) {
      socket_.reset();
      throw;
    }
    const uint64_t computed = hasher.digest();
    if (computed != reply.checksum) {
      socket_.reset();
      throw CorruptData(detail::concat(where_, ": version ", reply.version,
                                       " arrived with xxHash64 ", util::hash_hex(computed),
                                       ", not ", util::hash_hex(reply.checksum),
                                       " as sent: the bytes changed on the way; ask again"));
    }
    into.version = reply.version;
    into.checksum = reply.checksum;
  }

  std::string timeout_message(int64_t newer_than, milliseconds timeout) const {
    if (socket_ != nullptr) {
      return detail::concat(where_, ": no version newer than ", newer_than, " within ",
                            timeout.count(), " ms (the newest is ", newest_,
                            "); is the trainer still publishing?");
    }
    return detail::concat(where_, ": no publisher answered within ", timeout.count(), " ms (",
                          state_,
                          "). Is the publisher running with WeightPublisherOptions::listen, and "
                          "is this its endpoint(), reachable from this host?");
  }

  const std::string address_;
  const WeightSubscriberOptions options_;
  const std::string where_;
  std::unique_ptr<Socket> socket_;
  int64_t newest_ = -1;
  std::string state_ = "not connected yet";  // why there is no answer, for messages
  std::string said_;  // the publisher's last message in this call (busy, closing)
};

// A name has no ':'; "HOST:PORT" does.
bool is_tcp_source(const std::string& source) { return source.find(':') != std::string::npos; }

}  // namespace

struct WeightSubscriber::Impl {
  std::unique_ptr<ShmSource> shm;
  std::unique_ptr<TcpSource> tcp;
  int64_t torn_reads = 0;
};

WeightSubscriber::WeightSubscriber(std::string source, WeightSubscriberOptions options)
    : impl_(std::make_unique<Impl>()) {
  if (is_tcp_source(source)) {
    impl_->tcp = std::make_unique<TcpSource>(std::move(source), options);
  } else {
    impl_->shm = std::make_unique<ShmSource>(std::move(source));
  }
}

WeightSubscriber::~WeightSubscriber() = default;

WeightVersion WeightSubscriber::latest(int64_t newer_than, milliseconds timeout) {
  WeightVersion version;
  latest_into(version, newer_than, timeout);
  return version;
}

void WeightSubscriber::latest_into(WeightVersion& into, int64_t newer_than, milliseconds timeout) {
  if (impl_->shm != nullptr) {
    impl_->shm->latest_into(into, newer_than, timeout, impl_->torn_reads);
  } else {
    impl_->tcp->latest_into(into, newer_than, timeout);
  }
}

int64_t WeightSubscriber::torn_reads() const { return impl_->torn_reads; }

}  // namespace loom::control

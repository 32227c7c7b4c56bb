// The intra-node fast path (see shm_collectives.h): collectives through one shared-memory
// segment per group, futex barriers, robust mutexes for liveness.
#include "comm/shm_collectives.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <new>
#include <random>
#include <thread>
#include <utility>

#include "comm/group_internal.h"
#include "comm/reduce_kernels.h"
#include "loom/error.h"
#include "util/dtype.h"

namespace loom::comm::internal {
namespace {

using std::chrono::milliseconds;

constexpr uint64_t kMagic = 0x314d48534d4f4f4cull;  // "LOOMSHM1"
constexpr const char* kNamePrefix = "loom-shm-";
constexpr size_t kPage = 4096;
// Spins before a wait sleeps on the futex: about 20-60 us, less than a futex wake-up costs.
constexpr int kSpins = 2000;
// Yields instead, when the ranks outnumber the cores.
constexpr int kYields = 50;
// How often a sleeping wait checks its deadline, a broken group and the peer's liveness.
constexpr milliseconds kCheckEvery{10};

enum RankState : uint32_t { kAbsent = 0, kAttached = 1, kDetached = 2, kDead = 3 };

struct alignas(64) Control {
  std::atomic<uint32_t> arrived{0};  // the futex word: barriers this rank has reached
  std::atomic<uint32_t> state{kAbsent};
  std::atomic<uint64_t> tags[2] = {};  // the signature of op k is in tags[k % 2]
  std::atomic<int32_t> pid{0};
  pthread_mutex_t alive;  // robust, process-shared; held by the attached thread
};

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t seen, std::chrono::nanoseconds slice) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(slice.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(slice.count() % 1000000000);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string link_target(const char* path) {
  char buffer[256];
  const ssize_t n = ::readlink(path, buffer, sizeof(buffer) - 1);
  return n > 0 ? std::string(buffer, static_cast<size_t>(n)) : std::string();
}

// The pid in a segment name "loom-shm-<pid>-<random>", or 0.
int pid_of_segment(const std::string& name) {
  if (name.rfind(kNamePrefix, 0) != 0) return 0;
  return std::atoi(name.c_str() + std::strlen(kNamePrefix));
}

// Removes segments whose creator died before unlinking them (it is killed between creating the
// segment and every rank mapping it). Segments of live processes are left alone.
void remove_stale_segments() {
  for (const std::string& name : shared_memory_segments()) {
    const int pid = pid_of_segment(name);
    if (pid > 0 && ::kill(pid, 0) == -1 && errno == ESRCH) ::shm_unlink(("/" + name).c_str());
  }
}

std::string errno_text(int error) { return std::strerror(error); }

}  // namespace

struct ShmCollectives::Segment {
  uint64_t magic;
  int32_t size;
  uint64_t slot_bytes;
  uint64_t total_bytes;
  std::atomic<int32_t> claim;      // the rank + 1 that is writing `reason`
  std::atomic<int32_t> broken_by;  // the rank + 1 that broke the group, once `reason` is written
  char reason[1024];
};

namespace {

size_t controls_offset() { return round_up(sizeof(ShmCollectives::Segment), 64); }
size_t slots_offset(int size) {
  return round_up(controls_offset() + size * sizeof(Control), kPage);
}
size_t segment_bytes(int size, size_t slot_bytes) {
  return slots_offset(size) + (static_cast<size_t>(size) + 1) * slot_bytes;
}
Control& control_at(void* base, int r) {
  return reinterpret_cast<Control*>(static_cast<uint8_t*>(base) + controls_offset())[r];
}

}  // namespace

std::string host_identity() {
  char hostname[256] = {};
  ::gethostname(hostname, sizeof(hostname) - 1);
  return detail::concat(read_first_line("/proc/sys/kernel/random/boot_id"), "|", hostname, "|",
                        link_target("/proc/self/ns/net"), "|", link_target("/proc/self/ns/mnt"));
}

std::vector<std::string> shared_memory_segments(int pid) {
  std::vector<std::string> names;
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return names;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (pid_of_segment(name) > 0 && (pid == 0 || pid_of_segment(name) == pid)) {
      names.push_back(name);
    }
  }
  ::closedir(dir);
  std::sort(names.begin(), names.end());
  return names;
}

std::unique_ptr<ShmCollectives> ShmCollectives::connect(Store& store, const std::string& prefix,
                                                        int rank, int size, size_t slot_bytes,
                                                        milliseconds timeout,
                                                        const std::string& description,
                                                        std::vector<int> group_ranks) {
  const auto named = [&](int r) { return group_ranks.empty() ? r : group_ranks[r]; };
  slot_bytes = round_up(std::max<size_t>(slot_bytes, kPage), kPage);
  const size_t total = segment_bytes(size, slot_bytes);
  const std::string name_key = prefix + "/name";
  const std::string unlinked_key = prefix + "/unlinked";
  const auto mapped_key = [&](int r) { return detail::concat(prefix, "/mapped/", r); };
  const std::string advice =
      "; set GlooOptions::shared_memory = false (config comm.shared_memory = false) to use TCP "
      "between the ranks of this host instead";

  std::string name;
  int fd = -1;
  if (rank == 0) {
    remove_stale_segments();
    std::random_device random;
    name = detail::concat(kNamePrefix, ::getpid(), "-", std::hex, random(), random());
    fd = ::shm_open(("/" + name).c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    LOOM_CHECK(
        fd >= 0, CommError,
        detail::concat("group ", description, ": creating the shared-memory segment /dev/shm/",
                       name, " failed: ", errno_text(errno), advice));
    const int error = ::posix_fallocate(fd, 0, static_cast<off_t>(total));
    if (error != 0) {
      ::close(fd);
      ::shm_unlink(("/" + name).c_str());
      throw CommError(detail::concat(
          "group ", description, ": reserving ", total, " bytes of shared memory in /dev/shm/",
          name, " failed: ", errno_text(error),
          " (a container's /dev/shm is often 64 MiB: raise it, e.g. docker --shm-size=1g, or "
          "lower GlooOptions::shared_memory_slot_bytes)",
          advice));
    }
  } else {
    name = store.get(name_key, timeout);
    fd = ::shm_open(("/" + name).c_str(), O_RDWR, 0600);
    LOOM_CHECK(
        fd >= 0, CommError,
        detail::concat("group ", description,
                       ": opening rank 0's shared-memory segment "
                       "/dev/shm/",
                       name, " failed: ", errno_text(errno),
                       " (are the ranks in different containers or mount namespaces?)", advice));
    struct stat info {};
    const bool sized = ::fstat(fd, &info) == 0 && static_cast<size_t>(info.st_size) == total;
    if (!sized) {
      ::close(fd);
      throw CommError(detail::concat("group ", description, ": shared-memory segment /dev/shm/",
                                     name, " has ", info.st_size, " bytes where ", total,
                                     " were expected: the ranks disagree on the group size or "
                                     "the slot size; give every rank the same GlooOptions"));
    }
  }
  void* base = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  const int map_error = errno;
  ::close(fd);
  if (base == MAP_FAILED) {
    if (rank == 0) ::shm_unlink(("/" + name).c_str());
    throw CommError(detail::concat("group ", description,
                                   ": mapping the shared-memory segment /dev/shm/", name,
                                   " failed: ", errno_text(map_error), advice));
  }

  if (rank == 0) {
    auto* segment = new (base) Segment{};
    segment->magic = kMagic;
    segment->size = size;
    segment->slot_bytes = slot_bytes;
    segment->total_bytes = total;
    for (int r = 0; r < size; ++r) {
      Control* control = new (&control_at(base, r)) Control();
      pthread_mutexattr_t attributes;
      pthread_mutexattr_init(&attributes);
      pthread_mutexattr_setpshared(&attributes, PTHREAD_PROCESS_SHARED);
      pthread_mutexattr_setrobust(&attributes, PTHREAD_MUTEX_ROBUST);
      pthread_mutex_init(&control->alive, &attributes);
      pthread_mutexattr_destroy(&attributes);
    }
    store.set(name_key, name);
    // Unlinked once every rank has mapped it (or at the timeout): the mappings keep the memory,
    // and nothing is left in /dev/shm whatever happens to the ranks later.
    std::vector<std::string> keys;
    for (int r = 1; r < size; ++r) keys.push_back(mapped_key(r));
    try {
      store.wait(keys, timeout);
    } catch (const Timeout&) {
      ::shm_unlink(("/" + name).c_str());
      ::munmap(base, total);
      std::vector<int> missing;
      for (int r = 1; r < size; ++r) {
        if (!store.check({mapped_key(r)})) missing.push_back(named(r));
      }
      throw Timeout(detail::concat("group ", description, ": rank(s) [", rank_list(missing, ", "),
                                   "] did not map the shared-memory segment within ",
                                   timeout.count(), " ms"));
    }
    ::shm_unlink(("/" + name).c_str());
    store.set(unlinked_key, "1");
  } else {
    const auto* segment = static_cast<const Segment*>(base);
    if (segment->magic != kMagic || segment->size != size || segment->slot_bytes != slot_bytes) {
      ::munmap(base, total);
      throw CommError(detail::concat("group ", description, ": shared-memory segment /dev/shm/",
                                     name, " does not match this rank's group (size ", size,
                                     ", slot ", slot_bytes, " bytes)"));
    }
    store.set(mapped_key(rank), "1");
    // Every rank returns a group that has left nothing in /dev/shm.
    try {
      store.wait({unlinked_key}, timeout);
    } catch (const Timeout&) {
      ::munmap(base, total);
      throw Timeout(detail::concat("group ", description, ": rank ", named(0),
                                   " did not confirm within ", timeout.count(),
                                   " ms that every rank mapped the shared-memory segment"));
    }
  }
  return std::unique_ptr<ShmCollectives>(
      new ShmCollectives(rank, size, slot_bytes, base, total, description, std::move(group_ranks)));
}

ShmCollectives::ShmCollectives(int rank, int size, size_t slot_bytes, void* base,
                               size_t mapped_bytes, std::string description,
                               std::vector<int> group_ranks)
    : rank_(rank),
      size_(size),
      slot_bytes_(slot_bytes),
      base_(base),
      mapped_bytes_(mapped_bytes),
      description_(std::move(description)),
      group_ranks_(std::move(group_ranks)),
      segment_(static_cast<Segment*>(base)),
      spins_(size <= static_cast<int>(std::thread::hardware_concurrency()) ? kSpins : 0),
      yields_(spins_ == 0 ? kYields : 0) {}

ShmCollectives::~ShmCollectives() { ::munmap(base_, mapped_bytes_); }

uint8_t* ShmCollectives::slot(int r) const {
  return static_cast<uint8_t*>(base_) + slots_offset(size_) + static_cast<size_t>(r) * slot_bytes_;
}

uint8_t* ShmCollectives::result() const { return slot(size_); }

void ShmCollectives::attach() {
  Control& me = control_at(base_, rank_);
  const int locked = pthread_mutex_lock(&me.alive);
  if (locked == EOWNERDEAD) pthread_mutex_consistent(&me.alive);
  me.pid.store(::getpid(), std::memory_order_relaxed);
  me.state.store(kAttached, std::memory_order_release);
  attached_ = true;
}

void ShmCollectives::detach() {
  if (!attached_) return;
  attached_ = false;
  Control& me = control_at(base_, rank_);
  me.state.store(kDetached, std::memory_order_release);
  pthread_mutex_unlock(&me.alive);
  for (int r = 0; r < size_; ++r) futex_wake(&control_at(base_, r).arrived);
}

template <typename E>
void ShmCollectives::fail(const std::string& why) {
  break_group(why);
  throw E(why);
}

void ShmCollectives::break_group(const std::string& why) {
  int32_t expected = 0;
  if (segment_->claim.compare_exchange_strong(expected, rank_ + 1)) {
    std::snprintf(segment_->reason, sizeof(segment_->reason), "%s", why.c_str());
    segment_->broken_by.store(rank_ + 1, std::memory_order_release);
    for (int r = 0; r < size_; ++r) futex_wake(&control_at(base_, r).arrived);
  }
}

void ShmCollectives::check_peer(int peer) {
  const int32_t by = segment_->broken_by.load(std::memory_order_acquire);
  if (by != 0 && by != rank_ + 1) {
    throw CommError(detail::concat("rank ", named(by - 1), " broke the group: ", segment_->reason));
  }
  Control& c = control_at(base_, peer);
  uint32_t state = c.state.load(std::memory_order_acquire);
  if (state == kAbsent) return;  // its group has not started its worker yet
  if (state == kAttached) {
    const int locked = pthread_mutex_trylock(&c.alive);
    if (locked == EBUSY) return;  // held by its thread: alive
    if (locked == EOWNERDEAD) {
      c.state.store(kDead, std::memory_order_release);
      pthread_mutex_consistent(&c.alive);
    }
    if (locked == 0 || locked == EOWNERDEAD) pthread_mutex_unlock(&c.alive);
    // Unlocked while attached: its owner is gone, unless it detached just now.
    state = c.state.load(std::memory_order_acquire);
  }
  const auto pid = c.pid.load(std::memory_order_relaxed);
  if (state == kDetached) {
    fail<CommError>(detail::concat("rank ", named(peer), " (pid ", pid,
                                   ") left the group (destroyed it) before this op completed"));
  }
  fail<CommError>(detail::concat(
      "rank ", named(peer), " (pid ", pid,
      ") died: its process exited or was killed while this rank waited for it (the kernel "
      "released its alive mutex in the shared-memory segment)"));
}

void ShmCollectives::wait_for(int peer, uint32_t target, Clock::time_point deadline) {
  std::atomic<uint32_t>& word = control_at(base_, peer).arrived;
  const auto reached = [target](uint32_t seen) { return static_cast<int32_t>(seen - target) >= 0; };
  // Spinning only pays while every rank has a core: with more ranks than cores the rank waited
  // for may need this core to get there, so an oversubscribed wait yields it instead.
  for (int i = 0; i < spins_; ++i) {
    if (reached(word.load(std::memory_order_acquire))) return;
    cpu_relax();
  }
  for (int i = 0; i < yields_; ++i) {
    if (reached(word.load(std::memory_order_acquire))) return;
    std::this_thread::yield();
  }
  for (;;) {
    const uint32_t seen = word.load(std::memory_order_acquire);
    if (reached(seen)) return;
    check_peer(peer);
    const Clock::time_point now = Clock::now();
    if (now >= deadline) {
      fail<Timeout>(detail::concat(
          "Timed out waiting for rank ", named(peer),
          " in the shared-memory path: it did not reach the same point of this op (it is slow, "
          "stuck, or did not issue this collective)"));
    }
    futex_wait(&word, seen, std::min<Clock::duration>(deadline - now, kCheckEvery));
  }
}

void ShmCollectives::begin(uint64_t tag) {
  control_at(base_, rank_).tags[ops_ % 2].store(tag, std::memory_order_relaxed);
  tag_ = tag;
  tags_pending_ = true;
}

void ShmCollectives::sync(Clock::time_point deadline) {
  const uint32_t target = ++generation_;
  Control& me = control_at(base_, rank_);
  me.arrived.store(target, std::memory_order_release);  // publishes the slot and the tag too
  futex_wake(&me.arrived);
  for (int step = 1; step < size_; ++step) wait_for((rank_ + step) % size_, target, deadline);
  if (!tags_pending_) return;
  tags_pending_ = false;
  const int parity = static_cast<int>(ops_++ % 2);
  for (int r = 0; r < size_; ++r) {
    if (control_at(base_, r).tags[parity].load(std::memory_order_relaxed) != tag_) {
      fail<CommError>(detail::concat(
          "rank ", named(r),
          " issued a different collective at this point (another op, dtype, element "
          "count or sequence number): the ranks diverged; `loom flight diff` over the flight "
          "dumps names the first op where they did"));
    }
  }
}

namespace {

// Elements [begin, begin + size) of shard `r`'s window at offset `o` of length up to q.
struct Window {
  int64_t begin;
  int64_t size;
};
Window window_of(int64_t n, int world, int r, int64_t o, int64_t q) {
  const ShardRange shard = shard_range(n, world, r);
  return {shard.begin + o, std::clamp<int64_t>(shard.size() - o, 0, q)};
}

}  // namespace

template <typename T>
void ShmCollectives::all_reduce_typed(T* data, int64_t n, ReduceOp op, Clock::time_point deadline) {
  const ReduceKernel kernel = reduce_kernel<T>(op);
  // Each piece takes a window of q elements from every rank's shard of the tensor.
  const int64_t q = static_cast<int64_t>(slot_bytes_ / sizeof(T)) / size_;
  const int64_t longest = shard_range(n, size_, 0).size();
  T* const mine = reinterpret_cast<T*>(slot(rank_));
  T* const reduced = reinterpret_cast<T*>(result());
  for (int64_t o = 0; o < longest; o += q) {
    for (int j = 0; j < size_; ++j) {  // the windows other ranks reduce
      const Window w = window_of(n, size_, j, o, q);
      if (j != rank_ && w.size > 0) std::memcpy(mine + j * q, data + w.begin, w.size * sizeof(T));
    }
    sync(deadline);
    const Window own = window_of(n, size_, rank_, o, q);
    if (own.size > 0) {
      const auto operand = [&](int j) -> const T* {
        return j == rank_ ? data + own.begin : reinterpret_cast<const T*>(slot(j)) + rank_ * q;
      };
      T* out = reduced + rank_ * q;
      kernel(out, operand(0), operand(1), static_cast<size_t>(own.size));
      for (int j = 2; j < size_; ++j) kernel(out, out, operand(j), static_cast<size_t>(own.size));
    }
    sync(deadline);
    for (int j = 0; j < size_; ++j) {
      const Window w = window_of(n, size_, j, o, q);
      if (w.size > 0) std::memcpy(data + w.begin, reduced + j * q, w.size * sizeof(T));
    }
  }
}

template <typename T>
void ShmCollectives::reduce_scatter_typed(T* output, const T* input, int64_t n, ReduceOp op,
                                          Clock::time_point deadline) {
  const ReduceKernel kernel = reduce_kernel<T>(op);
  const int64_t q = static_cast<int64_t>(slot_bytes_ / sizeof(T)) / size_;
  const int64_t longest = shard_range(n, size_, 0).size();
  T* const mine = reinterpret_cast<T*>(slot(rank_));
  // The output may be a view of the input (a shard of a bucket): then reduce through the result
  // slot, since writing the output would overwrite this rank's operand mid-chain.
  const auto* in_bytes = reinterpret_cast<const uint8_t*>(input);
  const auto* out_bytes = reinterpret_cast<const uint8_t*>(output);
  const int64_t own_size = shard_range(n, size_, rank_).size();
  const bool aliased = out_bytes < in_bytes + n * sizeof(T) &&
                       in_bytes < out_bytes + own_size * static_cast<int64_t>(sizeof(T));
  for (int64_t o = 0; o < longest; o += q) {
    for (int j = 0; j < size_; ++j) {
      const Window w = window_of(n, size_, j, o, q);
      if (j != rank_ && w.size > 0) std::memcpy(mine + j * q, input + w.begin, w.size * sizeof(T));
    }
    sync(deadline);
    const Window own = window_of(n, size_, rank_, o, q);
    if (own.size > 0) {
      const auto operand = [&](int j) -> const T* {
        return j == rank_ ? input + own.begin : reinterpret_cast<const T*>(slot(j)) + rank_ * q;
      };
      T* out = aliased ? reinterpret_cast<T*>(result()) + rank_ * q : output + o;
      kernel(out, operand(0), operand(1), static_cast<size_t>(own.size));
      for (int j = 2; j < size_; ++j) kernel(out, out, operand(j), static_cast<size_t>(own.size));
      if (aliased) std::memcpy(output + o, out, own.size * sizeof(T));
    }
    sync(deadline);  // the slots are read: the next piece (or op) may overwrite them
  }
}

namespace {

template <typename F>
void dispatch_reducible(const char* op, at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat:
      return f(float{});
    case at::kDouble:
      return f(double{});
    case at::kInt:
      return f(int32_t{});
    case at::kLong:
      return f(int64_t{});
    case at::kByte:
      return f(uint8_t{});
    default:
      throw InvalidArgument(
          detail::concat(op,
                         ": the shared-memory path reduces fp32, fp64, int32, int64 and "
                         "uint8 (bf16 and fp16 are accumulated in fp32 by the caller), not ",
                         util::dtype_name(dtype)));
  }
}

}  // namespace

void ShmCollectives::all_reduce(const at::Tensor& tensor, ReduceOp op, uint64_t tag,
                                Clock::time_point deadline) {
  dispatch_reducible("all_reduce", tensor.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    begin(tag);
    all_reduce_typed<T>(static_cast<T*>(tensor.data_ptr()), tensor.numel(), op, deadline);
  });
}

void ShmCollectives::reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op,
                                    uint64_t tag, Clock::time_point deadline) {
  dispatch_reducible("reduce_scatter", input.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    begin(tag);
    reduce_scatter_typed<T>(static_cast<T*>(output.data_ptr()),
                            static_cast<const T*>(input.data_ptr()), input.numel(), op, deadline);
  });
}

void ShmCollectives::all_gather(const at::Tensor& output, const at::Tensor& input, uint64_t tag,
                                Clock::time_point deadline) {
  const int64_t n = input.numel() * static_cast<int64_t>(input.element_size());
  std::vector<uint8_t*> outputs;
  for (int j = 0; j < size_; ++j)
    outputs.push_back(static_cast<uint8_t*>(output.data_ptr()) + j * n);
  all_gather_bytes(outputs, static_cast<const uint8_t*>(input.data_ptr()), n, tag, deadline);
}

void ShmCollectives::all_gather(const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                uint64_t tag, Clock::time_point deadline) {
  std::vector<uint8_t*> pointers;
  for (const at::Tensor& output : outputs)
    pointers.push_back(static_cast<uint8_t*>(output.data_ptr()));
  all_gather_bytes(pointers, static_cast<const uint8_t*>(input.data_ptr()),
                   input.numel() * static_cast<int64_t>(input.element_size()), tag, deadline);
}

void ShmCollectives::all_gather_bytes(const std::vector<uint8_t*>& outputs, const uint8_t* input,
                                      int64_t n, uint64_t tag, Clock::time_point deadline) {
  begin(tag);
  const auto q = static_cast<int64_t>(slot_bytes_);
  for (int64_t o = 0; o < n; o += q) {
    const int64_t len = std::min(q, n - o);
    std::memcpy(slot(rank_), input + o, len);
    sync(deadline);
    for (int j = 0; j < size_; ++j)
      std::memcpy(outputs[j] + o, j == rank_ ? input + o : slot(j), len);
    sync(deadline);
  }
}

void ShmCollectives::broadcast(const at::Tensor& tensor, int root, uint64_t tag,
                               Clock::time_point deadline) {
  begin(tag);
  auto* data = static_cast<uint8_t*>(tensor.data_ptr());
  const int64_t n = tensor.numel() * static_cast<int64_t>(tensor.element_size());
  const auto q = static_cast<int64_t>(slot_bytes_);
  for (int64_t o = 0; o < n; o += q) {
    const int64_t len = std::min(q, n - o);
    if (rank_ == root) std::memcpy(slot(root), data + o, len);
    sync(deadline);
    if (rank_ != root) std::memcpy(data + o, slot(root), len);
    sync(deadline);
  }
}

void ShmCollectives::barrier(uint64_t tag, Clock::time_point deadline) {
  begin(tag);
  sync(deadline);
}

}  // namespace loom::comm::internal

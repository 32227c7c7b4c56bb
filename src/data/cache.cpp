// NodeCache: flock-based fill locks and pins, verify-before-rename downloads, LRU eviction
// of unpinned files under a byte limit.
#include "loom/data/cache.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <set>
#include <tuple>
#include <vector>

#include <spdlog/spdlog.h>
#include "data/shard_format.h"
#include "util/fd.h"
#include "util/files.h"
#include "util/hash.h"
#include "util/mapped_file.h"

namespace loom::data {
namespace {

namespace fs = std::filesystem;

constexpr const char* kLockSuffix = ".lock";
constexpr const char* kPartSuffix = ".part";
constexpr const char* kEvictLock = ".evict.lock";

fs::path default_dir() {
  if (const char* v = std::getenv("LOOM_DATA_CACHE"); v && *v) return v;
  if (const char* v = std::getenv("XDG_CACHE_HOME"); v && *v) return fs::path(v) / "loom/data";
  if (const char* v = std::getenv("HOME"); v && *v) return fs::path(v) / ".cache/loom/data";
  return fs::temp_directory_path() / "loom-data-cache";
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

int open_lock(const fs::path& path) {
  return LOOM_CHECK_SYS(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644), "opening ",
                        path.string());
}

void lock(int fd, int op, const fs::path& path) {
  while (::flock(fd, op) != 0) {
    if (errno == EINTR) continue;
    LOOM_CHECK_SYS(-1, "locking ", path.string());
  }
}

bool try_lock(int fd, int op) {
  while (::flock(fd, op | LOCK_NB) != 0) {
    if (errno == EINTR) continue;
    return false;
  }
  return true;
}

uint64_t hash_file(const fs::path& path) {
  util::MappedFile file(path);
  return util::xxh64(file.data(), file.size());
}

// The (device, inode, size, mtime) of a file: a cached file this process has already hashed
// is not hashed again while it is the same file.
using FileId = std::tuple<dev_t, ino_t, off_t, int64_t>;

FileId file_id(const struct stat& st) {
  return {st.st_dev, st.st_ino, st.st_size,
          static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec};
}

// Files every NodeCache of this process has verified.
struct VerifiedFiles {
  std::mutex mutex;
  std::set<FileId> ids;
  static VerifiedFiles& get() {
    static VerifiedFiles v;
    return v;
  }
  bool contains(const FileId& id) {
    std::lock_guard<std::mutex> lock(mutex);
    return ids.count(id) > 0;
  }
  void insert(const FileId& id) {
    std::lock_guard<std::mutex> lock(mutex);
    ids.insert(id);
  }
};

// A complete file in the cache and its last use (its lock file's mtime, in ns).
struct CachedEntry {
  int64_t last_use;
  fs::path path;
  uint64_t bytes;
};

}  // namespace

uint64_t parse_bytes(const std::string& text, const std::string& what) {
  size_t used = 0;
  uint64_t value = 0;
  try {
    value = std::stoull(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  LOOM_CHECK(used > 0 && text[0] != '-', InvalidArgument, what, " is \"", text,
             "\"; give bytes, optionally with a K, M, G or T suffix (e.g. 64G)");
  const std::string suffix = text.substr(used);
  int shift = 0;
  if (suffix == "K" || suffix == "KiB")
    shift = 10;
  else if (suffix == "M" || suffix == "MiB")
    shift = 20;
  else if (suffix == "G" || suffix == "GiB")
    shift = 30;
  else if (suffix == "T" || suffix == "TiB")
    shift = 40;
  else
    LOOM_CHECK(suffix.empty(), InvalidArgument, what, " is \"", text,
               "\"; the suffix must be K, M, G or T (powers of 1024)");
  LOOM_CHECK(shift == 0 || value <= (~uint64_t{0} >> shift), InvalidArgument, what, " \"", text,
             "\" does not fit 64 bits");
  return value << shift;
}

NodeCache::Pin::Pin(Pin&& other) noexcept : fd_(other.fd_), path_(std::move(other.path_)) {
  other.fd_ = -1;
}

NodeCache::Pin& NodeCache::Pin::operator=(Pin&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    path_ = std::move(other.path_);
    other.fd_ = -1;
  }
  return *this;
}

NodeCache::Pin::~Pin() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor drops the shared flock
}

struct NodeCache::Impl {
  CacheOptions options;
  RemoteClient client;
  std::atomic<uint64_t> hits{0}, downloads{0}, bytes_downloaded{0}, evictions{0}, refetched{0},
      skipped_pinned{0};

  Impl(CacheOptions o, RemoteOptions remote) : options(std::move(o)), client(std::move(remote)) {}

  // Evicts unpinned files, least recently used first, until `need` more bytes fit the limit.
  // Holds the cache-wide eviction lock, so that two processes do not both count the same
  // free space. Only non-blocking locks are taken under it, so it cannot deadlock with a
  // fill lock held by its caller.
  void make_room(uint64_t need) {
    if (options.limit_bytes == 0) return;
    util::UniqueFd evict(open_lock(options.dir / kEvictLock));
    lock(evict.get(), LOCK_EX, options.dir / kEvictLock);
    std::vector<CachedEntry> entries = scan();
    uint64_t total = 0;
    for (const CachedEntry& e : entries) total += e.bytes;
    if (total + need <= options.limit_bytes) return;
    std::sort(entries.begin(), entries.end(),
              [](const CachedEntry& a, const CachedEntry& b) { return a.last_use < b.last_use; });
    for (const CachedEntry& e : entries) {
      if (total + need <= options.limit_bytes) break;
      const fs::path lock_path = e.path.string() + kLockSuffix;
      util::UniqueFd fill(::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
      if (fill.get() < 0 || !try_lock(fill.get(), LOCK_EX)) continue;  // being filled
      util::UniqueFd data(::open(e.path.c_str(), O_RDONLY | O_CLOEXEC));
      if (data.get() < 0) continue;
      if (!try_lock(data.get(), LOCK_EX)) {
        skipped_pinned.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      if (::unlink(e.path.c_str()) == 0) {
        total -= e.bytes;
        evictions.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }

  // Every complete file in the cache with its last use (its lock file's mtime).
  std::vector<CachedEntry> scan() const {
    std::vector<CachedEntry> out;
    std::error_code ec;
    for (const auto& version : fs::directory_iterator(options.dir, ec)) {
      if (!version.is_directory(ec)) continue;
      for (const auto& f : fs::directory_iterator(version.path(), ec)) {
        const std::string name = f.path().filename().string();
        if (ends_with(name, kLockSuffix) || ends_with(name, kPartSuffix) || name[0] == '.') {
          continue;
        }
        struct stat st {
        }, lk{};
        if (::stat(f.path().c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
        const fs::path lock_path = f.path().string() + kLockSuffix;
        const struct stat& used = ::stat(lock_path.c_str(), &lk) == 0 ? lk : st;
        out.push_back(
            {static_cast<int64_t>(used.st_mtim.tv_sec) * 1000000000 + used.st_mtim.tv_nsec,
             f.path(), static_cast<uint64_t>(st.st_size)});
      }
    }
    return out;
  }
};

NodeCache::NodeCache(CacheOptions options, RemoteOptions remote) {
  if (options.dir.empty()) options.dir = default_dir();
  if (options.limit_bytes == 0) {
    if (const char* v = std::getenv("LOOM_DATA_CACHE_LIMIT"); v && *v) {
      options.limit_bytes = parse_bytes(v, "LOOM_DATA_CACHE_LIMIT");
    }
  }
  std::error_code ec;
  fs::create_directories(options.dir, ec);
  LOOM_CHECK(!ec, IoError, "cannot create the data cache directory ", options.dir.string(), ": ",
             ec.message(), "; set LOOM_DATA_CACHE to a writable directory");
  impl_ = std::make_unique<Impl>(std::move(options), std::move(remote));
}

NodeCache::~NodeCache() = default;

fs::path NodeCache::version_dir(const std::string& version) const {
  return impl_->options.dir / version;
}

NodeCache::Pin NodeCache::acquire(const RemoteFile& f, bool* downloaded_here) {
  util::check_plain_file_name(f.name, f.url, "file");
  util::check_plain_file_name(f.version, f.url, "content version");
  const fs::path dir = version_dir(f.version);
  std::error_code ec;
  fs::create_directories(dir, ec);
  LOOM_CHECK(!ec, IoError, "cannot create ", dir.string(), ": ", ec.message());
  const fs::path path = dir / f.name;
  const fs::path lock_path = path.string() + kLockSuffix;
  const fs::path part = path.string() + kPartSuffix;

  // The fill lock: one process checks, downloads or pins this file at a time.
  util::UniqueFd fill(open_lock(lock_path));
  lock(fill.get(), LOCK_EX, lock_path);
  bool downloaded = false;
  for (int round = 0;; ++round) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      Pin pin(fd, path);
      struct stat st {};
      LOOM_CHECK_SYS(::fstat(fd, &st), "stat of ", path.string());
      const FileId id = file_id(st);
      bool good = static_cast<uint64_t>(st.st_size) == f.bytes;
      if (good && !VerifiedFiles::get().contains(id)) {
        good = hash_file(path) == f.xxhash64;
        if (good) VerifiedFiles::get().insert(id);
      }
      if (good) {
        lock(fd, LOCK_SH, path);          // the pin: eviction needs LOCK_EX
        ::futimens(fill.get(), nullptr);  // last use, for LRU
        if (!downloaded) impl_->hits.fetch_add(1, std::memory_order_relaxed);
        if (downloaded_here) *downloaded_here = downloaded;
        return pin;
      }
      LOOM_CHECK(!downloaded, CorruptData, "the cached copy of ", f.url, " at ", path.string(),
                 " changed right after it was verified; check the disk of ",
                 impl_->options.dir.string());
      spdlog::warn(
          "data cache: {} does not match its manifest entry ({} bytes, xxHash64 {}); "
          "fetching it again",
          path.string(), f.bytes, util::hash_hex(f.xxhash64));
      impl_->refetched.fetch_add(1, std::memory_order_relaxed);
      LOOM_CHECK_SYS(::unlink(path.c_str()), "removing ", path.string());
    } else if (errno != ENOENT) {
      LOOM_CHECK_SYS(-1, "opening ", path.string());
    }
    impl_->make_room(f.bytes);
    impl_->client.download(f.url, part, f.bytes);
    const uint64_t hash = hash_file(part);
    if (hash != f.xxhash64) {
      ::unlink(part.c_str());
      LOOM_CHECK(round == 0, CorruptData, f.url, " was downloaded twice with xxHash64 ",
                 util::hash_hex(hash), " but the manifest says ", util::hash_hex(f.xxhash64),
                 ": the remote copy differs from the dataset its manifest describes; upload "
                 "the dataset again");
      spdlog::warn("data cache: {} arrived with xxHash64 {}, not {}; downloading it again", f.url,
                   util::hash_hex(hash), util::hash_hex(f.xxhash64));
      continue;
    }
    LOOM_CHECK_SYS(::rename(part.c_str(), path.c_str()), "renaming ", part.string());
    util::fsync_dir(dir);
    struct stat st {};
    LOOM_CHECK_SYS(::stat(path.c_str(), &st), "stat of ", path.string());
    VerifiedFiles::get().insert(file_id(st));
    impl_->downloads.fetch_add(1, std::memory_order_relaxed);
    impl_->bytes_downloaded.fetch_add(f.bytes, std::memory_order_relaxed);
    downloaded = true;
  }
}

uint64_t NodeCache::resident_bytes() const {
  uint64_t total = 0;
  for (const auto& e : impl_->scan()) total += e.bytes;
  return total;
}

const CacheOptions& NodeCache::options() const { return impl_->options; }
const RemoteClient& NodeCache::client() const { return impl_->client; }

CacheStats NodeCache::stats() const {
  return {impl_->hits.load(),      impl_->downloads.load(), impl_->bytes_downloaded.load(),
          impl_->evictions.load(), impl_->refetched.load(), impl_->skipped_pinned.load()};
}

VerifyReport verify_remote_dataset(const std::string& url, NodeCache& cache,
                                   const ProgressFn& progress) {
  const Manifest m = read_manifest(url, cache.client().options());
  auto fetch = [&](const std::string& file, uint64_t bytes, uint64_t hash) {
    return std::make_shared<NodeCache::Pin>(
        cache.acquire({join_url(url, file), m.version, file, bytes, hash}));
  };
  return format::verify_files(cache.version_dir(m.version), m, url, fetch, progress);
}

}  // namespace loom::data

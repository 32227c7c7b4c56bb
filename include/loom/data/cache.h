// The node-local cache of remote dataset files, shared by every process on the node.
//
// Layout: DIR/<content version>/<file>, beside it <file>.lock (the fill lock; its mtime is the
// file's last use) and, while a download runs or after one broke off, <file>.part. A file is
// downloaded by one process while the others wait on its fill lock, so each file is fetched
// once per node however many ranks read it. A downloaded file is hash-checked against the
// manifest before it is renamed into place; a cached file is hashed again the first time each
// process uses it, and one that fails is deleted and fetched again, never read.
//
// A Pin holds a shared flock on the cached file; eviction takes the fill lock and an exclusive
// flock without waiting, so a file that any process on the node has pinned is never evicted.
// With limit_bytes set, a download first evicts unpinned files, least recently used first,
// until the cache plus the new file fits. The limit is a target: files pinned by readers are
// never evicted, so the cache exceeds it when the pinned files alone do.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "loom/data/remote.h"
#include "loom/visibility.h"

namespace loom::data {

struct CacheOptions {
  // Empty: $LOOM_DATA_CACHE, else $XDG_CACHE_HOME/loom/data, else $HOME/.cache/loom/data.
  std::filesystem::path dir;
  // 0: $LOOM_DATA_CACHE_LIMIT (bytes, with an optional K, M, G or T suffix, powers of 1024),
  // else no limit.
  uint64_t limit_bytes = 0;
};

// One remote file of a dataset: where it is, where it goes in the cache, what it must be.
struct RemoteFile {
  std::string url;
  std::string version;  // the dataset's content version: the cache subdirectory
  std::string name;     // the file name in the dataset (a plain file name)
  uint64_t bytes = 0;
  uint64_t xxhash64 = 0;
};

// What one NodeCache object did, for tests, benchmarks and the log.
struct CacheStats {
  uint64_t hits = 0;       // acquires served by a file already cached
  uint64_t downloads = 0;  // files downloaded (and verified) by this object
  uint64_t bytes_downloaded = 0;
  uint64_t evictions = 0;       // files this object evicted
  uint64_t refetched = 0;       // cached files that failed their hash and were fetched again
  uint64_t skipped_pinned = 0;  // eviction candidates left because a reader had them pinned
};

class LOOM_API NodeCache {
 public:
  // A cached file held in place. Movable; releasing it (destruction) lets eviction take it.
  class Pin {
   public:
    Pin() = default;
    Pin(Pin&& other) noexcept;
    Pin& operator=(Pin&& other) noexcept;
    Pin(const Pin&) = delete;
    Pin& operator=(const Pin&) = delete;
    ~Pin();
    const std::filesystem::path& path() const { return path_; }
    explicit operator bool() const { return fd_ >= 0; }

   private:
    friend class NodeCache;
    Pin(int fd, std::filesystem::path path) : fd_(fd), path_(std::move(path)) {}
    int fd_ = -1;
    std::filesystem::path path_;
  };

  NodeCache(CacheOptions options, RemoteOptions remote);
  ~NodeCache();
  NodeCache(const NodeCache&) = delete;
  NodeCache& operator=(const NodeCache&) = delete;

  // The cached copy of `file`, pinned: downloaded if no process on the node has it, after
  // making room under the limit; hash-checked before use. RemoteError when the download
  // fails; CorruptData naming the URL when the downloaded bytes fail their hash twice.
  // Thread-safe. `downloaded`, when given, is set to whether this call downloaded the file.
  Pin acquire(const RemoteFile& file, bool* downloaded = nullptr);

  // The directory a dataset version's files are cached in.
  std::filesystem::path version_dir(const std::string& version) const;
  // Bytes of complete files in the cache now (every version), by a scan.
  uint64_t resident_bytes() const;

  const CacheOptions& options() const;
  const RemoteClient& client() const;
  CacheStats stats() const;

 private:
  struct LOOM_HIDDEN Impl;
  std::unique_ptr<Impl> impl_;
};

// verify_dataset for the URL of a remote dataset: its manifest is fetched, then each file is
// downloaded through `cache` (hash-checked on arrival, one file pinned at a time, so a cache
// under a limit suffices) and checked as verify_dataset checks a local one. Files are named by
// URL in the report; a file that cannot be downloaded, or arrives corrupt twice, is reported as
// that file's problem. A manifest that cannot be fetched or trusted throws as read_manifest.
LOOM_API VerifyReport verify_remote_dataset(const std::string& url, NodeCache& cache,
                                            const ProgressFn& progress = {});

// Parses "123", "64K", "512M", "2G", "1T" (powers of 1024) as bytes; InvalidArgument naming
// `what` otherwise.
LOOM_API uint64_t parse_bytes(const std::string& text, const std::string& what);

}  // namespace loom::data

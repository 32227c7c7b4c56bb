// Per-chunk hashes of shard files, checked on first touch.
#include "data/chunk_check.h"

#include <algorithm>
#include <atomic>

#include "loom/error.h"
#include "util/hash.h"

namespace loom::data::format {

std::vector<uint64_t> chunk_hashes(const uint8_t* data, uint64_t size, uint64_t chunk_bytes) {
  std::vector<uint64_t> hashes;
  hashes.reserve(chunk_count(size, chunk_bytes));
  for (uint64_t at = 0; at < size; at += chunk_bytes) {
    hashes.push_back(util::xxh64(data + at, std::min(chunk_bytes, size - at)));
  }
  return hashes;
}

ChunkChecker::ChunkChecker(const uint8_t* data, uint64_t size, uint64_t chunk_bytes,
                           std::vector<uint64_t> hashes, std::filesystem::path file)
    : data_(data),
      size_(size),
      chunk_bytes_(chunk_bytes),
      hashes_(std::move(hashes)),
      file_(std::move(file)),
      verified_(std::make_unique<std::atomic<bool>[]>(hashes_.size())),
      mutex_(std::make_unique<std::mutex>()),
      verified_count_(std::make_unique<std::atomic<uint64_t>>(0)) {
  LOOM_CHECK(
      hashes_.empty() || (chunk_bytes_ > 0 && chunk_count(size_, chunk_bytes_) == hashes_.size()),
      CorruptData, "shard ", file_.string(), " has ", hashes_.size(),
      " chunk hashes in the manifest but ", size_, " bytes make ",
      chunk_bytes_ ? chunk_count(size_, chunk_bytes_) : 0, " chunks");
}

void ChunkChecker::check(uint64_t offset, uint64_t size) const {
  if (hashes_.empty() || size == 0) return;
  const uint64_t first = offset / chunk_bytes_;
  const uint64_t last = std::min<uint64_t>((offset + size - 1) / chunk_bytes_, hashes_.size() - 1);
  for (uint64_t c = first; c <= last; ++c) {
    if (verified_[c].load(std::memory_order_acquire)) continue;
    std::lock_guard<std::mutex> lock(*mutex_);
    if (verified_[c].load(std::memory_order_relaxed)) continue;  // another thread did it
    verify_chunk(c);
    verified_[c].store(true, std::memory_order_release);
  }
}

void ChunkChecker::verify_chunk(uint64_t chunk) const {
  const uint64_t begin = chunk * chunk_bytes_;
  const uint64_t n = std::min(chunk_bytes_, size_ - begin);
  const uint64_t hash = util::xxh64(data_ + begin, n);
  LOOM_CHECK(hash == hashes_[chunk], CorruptData, "shard ", file_.string(), " is corrupt: chunk ",
             chunk, " (bytes ", begin, " to ", begin + n, ") has xxHash64 ", util::hash_hex(hash),
             " but the manifest says ", util::hash_hex(hashes_[chunk]),
             "; the file changed after the build (a bad disk or an interrupted copy). Run `loom "
             "data verify ",
             file_.parent_path().string(), "` and restore the shard or rebuild the dataset");
  verified_count_->fetch_add(1, std::memory_order_relaxed);
}

uint64_t ChunkChecker::chunks_verified() const {
  return verified_count_->load(std::memory_order_relaxed);
}

}  // namespace loom::data::format

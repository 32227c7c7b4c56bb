// Per-chunk xxHash64s of a shard file: computing them (writers, migrate, verify) and checking
// each chunk the first time a read touches it (data::Reader). Private to Loom.
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace loom::data::format {

// xxHash64 of each `chunk_bytes` piece of [data, data + size), the last one possibly shorter.
std::vector<uint64_t> chunk_hashes(const uint8_t* data, uint64_t size, uint64_t chunk_bytes);

// The number of chunks of a file of `size` bytes.
inline uint64_t chunk_count(uint64_t size, uint64_t chunk_bytes) {
  return (size + chunk_bytes - 1) / chunk_bytes;
}

// Checks the chunks of one mapped shard lazily: check(offset, size) hashes every chunk that
// [offset, offset + size) overlaps and that no earlier call has verified, so each chunk is
// hashed once per checker however often it is read. A chunk that fails is CorruptData naming
// the shard, the chunk and its byte range, and fails again on every later touch (it is never
// marked verified). With no hashes (a format 1 dataset) check() does nothing.
//
// Thread safety: check() may be called from several threads at once; each chunk is hashed by
// exactly one of them while the others touching it wait. A verified chunk costs one atomic
// load per touch; first touches are serialized by one mutex per checker (hashing 1 MiB takes
// about 0.1 ms). The mapped bytes must outlive the checker.
class ChunkChecker {
 public:
  ChunkChecker(const uint8_t* data, uint64_t size, uint64_t chunk_bytes,
               std::vector<uint64_t> hashes, std::filesystem::path file);

  void check(uint64_t offset, uint64_t size) const;
  bool enabled() const { return !hashes_.empty(); }
  uint64_t chunks() const { return hashes_.size(); }
  uint64_t chunks_verified() const;

 private:
  void verify_chunk(uint64_t chunk) const;

  // Constant after construction.
  const uint8_t* data_;
  uint64_t size_;
  uint64_t chunk_bytes_;
  std::vector<uint64_t> hashes_;
  std::filesystem::path file_;
  // One flag per chunk, set (release) once its hash has matched; read without the mutex.
  std::unique_ptr<std::atomic<bool>[]> verified_;
  // Held while a chunk is hashed, so that each is hashed once (a std::once_flag per chunk
  // would do, but libstdc++'s call_once may hang after the callable throws, GCC bug 66146).
  std::unique_ptr<std::mutex> mutex_;
  std::unique_ptr<std::atomic<uint64_t>> verified_count_;
};

}  // namespace loom::data::format

// xxHash64 of byte ranges: the checksum of data shards, records and checkpoint tensors.
// Private to Loom. Hashes are printed as 16 lowercase hex digits (hash_hex).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace loom::util {

// xxHash64 of [data, data + size) with seed 0.
uint64_t xxh64(const void* data, size_t size);
inline uint64_t xxh64(std::string_view bytes) { return xxh64(bytes.data(), bytes.size()); }

// 16 lowercase hex digits, the form hashes take in manifests and messages.
std::string hash_hex(uint64_t hash);
// Parses hash_hex's form; anything else is loom::CorruptData naming `what`.
uint64_t parse_hash_hex(std::string_view hex, std::string_view what);

// An incremental xxHash64: update() in pieces gives the same digest as xxh64 of the whole.
// Not thread-safe; movable, not copyable.
class Hasher64 {
 public:
  Hasher64();
  ~Hasher64();
  Hasher64(Hasher64&&) noexcept;
  Hasher64& operator=(Hasher64&&) noexcept;

  void update(const void* data, size_t size);
  uint64_t digest() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace loom::util

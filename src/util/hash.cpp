// xxHash64 through libxxhash (Debian's libxxhash-dev).
#include "util/hash.h"

#include <xxhash.h>

#include <cstdio>

#include "loom/error.h"

namespace loom::util {

uint64_t xxh64(const void* data, size_t size) { return XXH64(data, size, 0); }

std::string hash_hex(uint64_t hash) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(hash));
  return buf;
}

uint64_t parse_hash_hex(std::string_view hex, std::string_view what) {
  uint64_t value = 0;
  bool ok = hex.size() == 16;
  for (char c : hex) {
    int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (digit < 0) ok = false;
    value = value << 4 | static_cast<uint64_t>(digit & 0xf);
  }
  if (!ok) {
    throw CorruptData(
        detail::concat(what, ": '", hex, "' is not an xxHash64 (16 lowercase hex digits)"));
  }
  return value;
}

struct Hasher64::State {
  XXH64_state_t* xxh = XXH64_createState();
  ~State() { XXH64_freeState(xxh); }
};

Hasher64::Hasher64() : state_(std::make_unique<State>()) {
  LOOM_CHECK(state_->xxh != nullptr, Error, "XXH64_createState: out of memory");
  XXH64_reset(state_->xxh, 0);
}
Hasher64::~Hasher64() = default;
Hasher64::Hasher64(Hasher64&&) noexcept = default;
Hasher64& Hasher64::operator=(Hasher64&&) noexcept = default;

void Hasher64::update(const void* data, size_t size) { XXH64_update(state_->xxh, data, size); }
uint64_t Hasher64::digest() const { return XXH64_digest(state_->xxh); }

}  // namespace loom::util

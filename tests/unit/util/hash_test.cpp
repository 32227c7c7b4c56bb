#include "util/hash.h"

#include <gtest/gtest.h>

#include <string>

#include "harness/harness.h"
#include "loom/error.h"

namespace loom::util {
namespace {

TEST(Hash, KnownValues) {
  // Reference digests from the xxHash specification's test vectors (seed 0).
  EXPECT_EQ(xxh64("", 0), 0xef46db3751d8e999ULL);
  EXPECT_EQ(hash_hex(xxh64("abc")), "44bc2cf5ad770999");
}

TEST(Hash, IncrementalEqualsOneShot) {
  std::string data(100000, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 131 + 7);
  Hasher64 hasher;
  for (size_t at = 0; at < data.size(); at += 4099) {
    hasher.update(data.data() + at, std::min<size_t>(4099, data.size() - at));
  }
  EXPECT_EQ(hasher.digest(), xxh64(data));
  data[5000] ^= 1;
  EXPECT_NE(hasher.digest(), xxh64(data));
}

TEST(Hash, HexRoundTripAndErrors) {
  EXPECT_EQ(parse_hash_hex(hash_hex(0x0123456789abcdefULL), "h"), 0x0123456789abcdefULL);
  auto message = testing::error_of<CorruptData>([] { parse_hash_hex("12G4", "shard a.bin"); });
  EXPECT_NE(message.find("shard a.bin"), std::string::npos) << message;
  EXPECT_THROW(parse_hash_hex("0123456789ABCDEF", "h"), CorruptData);
}

}  // namespace
}  // namespace loom::util

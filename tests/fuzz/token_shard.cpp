// A token shard file as the reader opens it (header, document index) and every document range
// it hands out. The manifest entry is made to agree with the header, as a consistent but
// malicious or buggy dataset would: what is left to check is the file itself.
#include <algorithm>
#include <cstring>

#include "data/shard_format.h"
#include "fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace loom::data;
  const std::filesystem::path dir = loom::fuzz::scratch_dir();
  loom::fuzz::write_bytes(dir / "tokens.bin", data, size);
  ShardInfo info{.file = "tokens.bin", .bytes = size};
  uint32_t token_bytes = 2;
  if (size >= sizeof(format::TokenHeader)) {
    format::TokenHeader h;
    std::memcpy(&h, data, sizeof(h));
    info.items = h.num_tokens;
    info.documents = h.num_documents;
    token_bytes = h.token_bytes == 4 ? 4 : 2;  // what a manifest's vocabulary can ask for
  }
  loom::fuzz::refuses_cleanly([&] {
    const format::TokenShard shard(dir, info, token_bytes);
    const uint64_t documents = std::min<uint64_t>(shard.num_documents(), 4096);
    for (uint64_t d = 0; d < documents; ++d) {
      loom::fuzz::refuses_cleanly([&] {
        const auto [begin, end] = shard.document(d);
        // A range handed out lies inside the tokens, which lie inside the file.
        if (begin > end || end > shard.num_tokens()) __builtin_trap();
        if (sizeof(format::TokenHeader) + end * shard.token_bytes() > shard.file().size()) {
          __builtin_trap();
        }
      });
    }
  });
  return 0;
}

// A record shard file as the reader opens it (header, record index) and every record's bounds
// and checksum check. The manifest entry is made to agree with the header.
#include <algorithm>
#include <cstring>

#include "data/shard_format.h"
#include "fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace loom::data;
  const std::filesystem::path dir = loom::fuzz::scratch_dir();
  loom::fuzz::write_bytes(dir / "records.bin", data, size);
  ShardInfo info{.file = "records.bin", .bytes = size};
  if (size >= sizeof(format::RecordHeader)) {
    format::RecordHeader h;
    std::memcpy(&h, data, sizeof(h));
    info.items = h.num_records;
  }
  loom::fuzz::refuses_cleanly([&] {
    const format::RecordShard shard(dir, info);
    const uint64_t records = std::min<uint64_t>(shard.num_records(), 4096);
    for (uint64_t i = 0; i < records; ++i) {
      format::RecordShard::Payload payload{nullptr, 0};
      if (!shard.check(i, &payload).empty()) continue;
      // A payload handed out lies between the header and the index.
      const uint8_t* begin = shard.file().data() + sizeof(format::RecordHeader);
      if (payload.first < begin ||
          payload.first + payload.second > shard.file().data() + shard.file().size()) {
        __builtin_trap();
      }
    }
  });
  return 0;
}

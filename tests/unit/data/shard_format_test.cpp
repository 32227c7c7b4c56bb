// Shard headers, indexes and record payloads as untrusted input: counts and offsets claiming
// 2^60 and more, index entries that wrap, tensor shapes whose element count overflows. Each
// is CorruptData naming the shard (or a decode error naming the field), never a read outside
// the mapped file.
#include "data/shard_format.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>

#include "harness/harness.h"
#include "loom/data/dataset.h"
#include "loom/error.h"

namespace loom::data::format {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::TempDir;

// Overwrites the 8 bytes at `offset` of `file` with `value`.
void put_u64(const fs::path& file, std::streamoff offset, uint64_t value) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(offset);
  f.write(reinterpret_cast<const char*>(&value), 8);
}

constexpr uint64_t k2to60 = uint64_t{1} << 60;

TEST(ShardFormat, TokenHeaderCountsBeyondTheFileAreCorruptData) {
  TempDir dir;
  TokenDatasetWriter writer(dir / "ds", {.vocab_size = 100});
  writer.add_document({1, 2, 3});
  const ShardInfo good = writer.finish().shards.at(0);
  const uint64_t size = fs::file_size(dir / "ds" / good.file);
  struct Case {
    std::streamoff offset;
    uint64_t value;
  };
  // num_documents (offset 24) of 2^61 with the index moved to the last 8 bytes: (n + 1) * 8
  // wraps to 8, which "fits" a check that multiplies first. Then num_tokens (16) and the
  // index offset (32) beyond the file.
  for (const Case& c : std::vector<Case>{
           {24, uint64_t{1} << 61}, {16, k2to60}, {32, k2to60}, {32, UINT64_MAX - 7}}) {
    SCOPED_TRACE(c.offset);
    TempDir copy;
    fs::copy(dir / "ds", copy / "ds");
    put_u64(copy / "ds" / good.file, c.offset, c.value);
    if (c.offset == 24) put_u64(copy / "ds" / good.file, 32, size - 8);
    ShardInfo info = good;  // a manifest that agrees with the header
    if (c.offset == 24) info.documents = c.value;
    if (c.offset == 16) info.items = c.value;
    const std::string message = error_of<CorruptData>([&] { TokenShard(copy / "ds", info, 2); });
    EXPECT_NE(message.find(good.file), std::string::npos) << message;
    EXPECT_NE(message.find("does not fit the file"), std::string::npos) << message;
  }
  EXPECT_NO_THROW(TokenShard(dir / "ds", good, 2));
}

TEST(ShardFormat, RecordHeaderCountsBeyondTheFileAreCorruptData) {
  TempDir dir;
  RecordDatasetWriter writer(dir / "ds", {{"x", FieldType::kInt}});
  for (int i = 0; i < 3; ++i) writer.add(Record().integer(i));
  const ShardInfo good = writer.finish().shards.at(0);
  const fs::path file = dir / "ds" / good.file;
  const uint64_t size = fs::file_size(file);
  // num_records (offset 16) of 2^61 with the index moved to the last 8 bytes: wraps to fit.
  put_u64(file, 16, uint64_t{1} << 61);
  put_u64(file, 24, size - 8);
  ShardInfo info = good;
  info.items = uint64_t{1} << 61;
  std::string message = error_of<CorruptData>([&] { RecordShard(dir / "ds", info); });
  EXPECT_NE(message.find(good.file), std::string::npos) << message;
  EXPECT_NE(message.find("does not fit the file"), std::string::npos) << message;
  put_u64(file, 16, 3);
  put_u64(file, 24, k2to60);
  message = error_of<CorruptData>([&] { RecordShard(dir / "ds", good); });
  EXPECT_NE(message.find("does not fit the file"), std::string::npos) << message;
}

TEST(ShardFormat, AnIndexEntryThatWrapsIsCorruptNotARead) {
  TempDir dir;
  RecordDatasetWriter writer(dir / "ds", {{"x", FieldType::kInt}});
  for (int i = 0; i < 3; ++i) writer.add(Record().integer(i));
  const ShardInfo info = writer.finish().shards.at(0);
  const fs::path file = dir / "ds" / info.file;
  const uint64_t index_offset = fs::file_size(file) - 4 * 8;
  // Record 1 "begins" 4 bytes before 2^64: begin + 8 wraps, end - begin - 8 is huge.
  put_u64(file, static_cast<std::streamoff>(index_offset + 8), UINT64_MAX - 3);
  RecordShard shard(dir / "ds", info);
  RecordShard::Payload payload;
  EXPECT_EQ(shard.check(1, &payload), "its index entry is corrupt");
  const std::string message = error_of<CorruptData>([&] { shard.payload(1); });
  EXPECT_NE(message.find(info.file), std::string::npos) << message;
  EXPECT_EQ(shard.check(0, &payload), "its index entry is corrupt");  // its end is wrong too
  EXPECT_EQ(shard.check(2, &payload), "");  // record 2's entries are intact
}

TEST(ShardFormat, TensorShapesBeyondThePayloadAreDecodeErrors) {
  const std::vector<Field> schema = {{"t", FieldType::kTensor, "float32", {}}};
  // ndim 3, dims 2^40 each: 2^120 elements, which wraps to 0 in 64 bits.
  std::string payload(4 + 3 * 8, '\0');
  const uint32_t ndim = 3;
  std::memcpy(payload.data(), &ndim, 4);
  for (int k = 0; k < 3; ++k) {
    const int64_t d = int64_t{1} << 40;
    std::memcpy(payload.data() + 4 + 8 * k, &d, 8);
  }
  FieldView view;
  EXPECT_EQ(decode_record(schema, reinterpret_cast<const uint8_t*>(payload.data()), payload.size(),
                          &view),
            "field 't' runs past the record");
  // A shape the schema fixes must be the record's shape.
  const std::vector<Field> fixed = {{"t", FieldType::kTensor, "uint8", {2, 2}}};
  std::string one(4 + 8 + 4, '\0');
  const uint32_t one_dim = 1;
  const int64_t four = 4;
  std::memcpy(one.data(), &one_dim, 4);
  std::memcpy(one.data() + 4, &four, 8);
  EXPECT_EQ(decode_record(fixed, reinterpret_cast<const uint8_t*>(one.data()), one.size(), &view),
            "field 't' does not have the schema's shape");
  EXPECT_EQ(decode_record(schema, reinterpret_cast<const uint8_t*>(one.data()), one.size(), &view),
            "field 't' runs past the record");  // 4 float32 need 16 bytes, 4 are there
}

}  // namespace
}  // namespace loom::data::format

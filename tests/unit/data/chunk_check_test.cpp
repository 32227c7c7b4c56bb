// Per-chunk hashes of token shards: a flipped byte fails the first read that touches its
// chunk, with a message naming shard, chunk and offset; other chunks still read; each chunk
// is hashed once per reader, from any number of threads.
#include "data/chunk_check.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fstream>
#include <thread>

#include "harness/harness.h"
#include "loom/data/reader.h"
#include "loom/error.h"
#include "util/hash.h"

namespace loom::data {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::TempDir;

constexpr uint64_t kChunk = 64;  // tiny chunks: many per shard

// One shard of 400 uint16 tokens 0, 1, 2, ... in 4 documents of 100; 64-byte chunks, so the
// file (64 header + 800 tokens + 5 * 8 index = 904 bytes) has 15 chunks.
fs::path counting_tokens(const TempDir& dir) {
  const fs::path ds = dir / "ds";
  TokenDatasetWriter writer(ds, {.vocab_size = 1000, .chunk_bytes = kChunk});
  for (uint32_t d = 0; d < 4; ++d) {
    std::vector<uint32_t> doc;
    for (uint32_t t = 0; t < 100; ++t) doc.push_back(d * 100 + t);
    writer.add_document(doc);
  }
  writer.finish();
  return ds;
}

void flip_byte(const fs::path& file, std::streamoff offset) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x01);
  f.seekp(offset);
  f.write(&c, 1);
}

std::vector<int64_t> row(const Batch& b, int64_t r) {
  const at::Tensor t = b["tokens"][r].contiguous();
  return {t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel()};
}

std::vector<int64_t> iota(int64_t first, int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = first + i;
  return v;
}

TEST(ChunkCheck, WritersRecordAHashPerChunk) {
  TempDir dir;
  const fs::path ds = counting_tokens(dir);
  const Manifest m = read_manifest(ds);
  ASSERT_EQ(m.shards.size(), 1u);
  EXPECT_EQ(m.format_version, Manifest::kFormatVersion);
  EXPECT_EQ(m.chunk_bytes, kChunk);
  EXPECT_EQ(m.shards[0].bytes, 904u);
  const std::string bytes = [&] {
    std::ifstream in(ds / "tokens_00000.bin", std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  std::vector<uint64_t> expected;
  for (size_t at = 0; at < bytes.size(); at += kChunk)
    expected.push_back(util::xxh64(bytes.substr(at, kChunk)));
  EXPECT_EQ(m.shards[0].chunk_hashes, expected);
  EXPECT_EQ(expected.size(), 15u);
}

// Sample i of seq_len 9 is tokens [9i, 9i + 10): bytes [64 + 18i, 64 + 18i + 20) of the shard.
TEST(ChunkCheck, FlippedTokenByteFailsTheFirstReadOfItsChunkOnly) {
  TempDir dir;
  const fs::path ds = counting_tokens(dir);
  const fs::path shard = ds / "tokens_00000.bin";
  flip_byte(shard, 64 + 2 * 250);  // token 250: byte 564, chunk 8 (bytes 512 to 576)
  Reader reader(ds, {.batch_size = 1, .seq_len = 9, .prefetch = 0});
  EXPECT_EQ(reader.chunks_verified(), 0u);  // nothing is hashed at open

  // Sample 0 (bytes 64 to 84, chunk 1) and sample 40 (tokens 360..369, bytes 784 to 804,
  // chunk 12) are intact and read exactly.
  EXPECT_EQ(row(reader.read({0}), 0), iota(0, 10));
  EXPECT_EQ(row(reader.read({40}), 0), iota(360, 10));
  EXPECT_EQ(reader.chunks_verified(), 2u);

  // Sample 27 is tokens 243..252: bytes 550 to 570, inside chunk 8.
  const std::string expected =
      "shard " + shard.string() + " is corrupt: chunk 8 (bytes 512 to 576) has xxHash64 " +
      util::hash_hex(util::xxh64([&] {
        std::ifstream in(shard, std::ios::binary);
        std::string b(64, '\0');
        in.seekg(512);
        in.read(b.data(), 64);
        return b;
      }())) +
      " but the manifest says " + util::hash_hex(read_manifest(ds).shards[0].chunk_hashes[8]) +
      "; the file changed after the build (a bad disk or an interrupted copy). Run `loom data "
      "verify " +
      ds.string() + "` and restore the shard or rebuild the dataset";
  EXPECT_EQ(error_of<CorruptData>([&] { reader.read({27}); }), expected);
  // A failed chunk is never marked good: it fails again, and costs a hash each time.
  EXPECT_EQ(error_of<CorruptData>([&] { reader.read({27}); }), expected);
  EXPECT_EQ(reader.chunks_verified(), 2u);
  // Sample 26 (tokens 234..243, bytes 532 to 552) also touches chunk 8.
  EXPECT_THROW(reader.read({26}), CorruptData);
  // Sample 29 (tokens 261..270, bytes 586 to 606, chunk 9) reads.
  EXPECT_EQ(row(reader.read({29}), 0), iota(261, 10));

  // verify names the same chunk and its offset.
  const VerifyReport report = verify_dataset(ds);
  EXPECT_FALSE(report.ok);
  EXPECT_EQ(report.file, shard.string());
  EXPECT_EQ(report.offset, 512);
  EXPECT_EQ(report.problem.rfind("chunk 8 (bytes 512 to 576) has xxHash64 ", 0), 0u)
      << report.problem;
}

TEST(ChunkCheck, NextDoesNotConsumeABatchWithACorruptChunk) {
  TempDir dir;
  const fs::path ds = counting_tokens(dir);
  flip_byte(ds / "tokens_00000.bin", 64 + 2 * 250);
  for (int prefetch : {0, 2}) {
    SCOPED_TRACE(prefetch);
    // 44 samples in one batch: the whole stream, so the first next() touches chunk 8.
    Reader reader(ds, {.batch_size = 44, .seq_len = 9, .prefetch = prefetch});
    const SamplerState before = reader.state();
    EXPECT_THROW(reader.next(), CorruptData);
    EXPECT_EQ(reader.state(), before);
    EXPECT_THROW(reader.next(), CorruptData);
  }
}

TEST(ChunkCheck, DocumentIndexEntriesAreChecked) {
  TempDir dir;
  const fs::path ds = counting_tokens(dir);
  // The index starts at 864: entry d at 864 + 8d, all in chunk 13 (832 to 896) but the last.
  // Entry 2 (document 1's end) flipped would make document 1 one token longer.
  flip_byte(ds / "tokens_00000.bin", 864 + 8 * 2);
  Reader documents(ds, {.seq_len = 120, .sampling = TokenSampling::kDocument, .prefetch = 0});
  auto message = error_of<CorruptData>([&] { documents.read({1}); });
  EXPECT_NE(message.find("chunk 13 (bytes 832 to 896)"), std::string::npos) << message;
  // Packed sampling never reads the index: sample 0 (chunk 1) reads.
  Reader packed(ds, {.seq_len = 9, .prefetch = 0});
  EXPECT_EQ(row(packed.read({0}), 0), iota(0, 10));
}

TEST(ChunkCheck, EachChunkIsHashedOncePerReaderFromAnyNumberOfThreads) {
  TempDir dir;
  const fs::path ds = counting_tokens(dir);
  Reader reader(ds, {.batch_size = 1, .seq_len = 9, .prefetch = 0});
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (uint64_t i = 0; i < reader.num_samples(); ++i) {
        const Batch b = reader.read({i});
        EXPECT_EQ(row(b, 0), iota(static_cast<int64_t>(9 * i), 10));
      }
    });
  }
  for (auto& t : threads) t.join();
  // The samples cover tokens 0..396 (44 * 9 + 1 = 397 tokens): bytes 64 to 858, chunks 1 to
  // 13; chunk 0 holds only the header (bytes 0 to 64), chunk 14 only the index.
  EXPECT_EQ(reader.chunks_verified(), 13u);
  reader.read({0});
  EXPECT_EQ(reader.chunks_verified(), 13u);
}

TEST(ChunkCheck, CheckerRefusesAHashCountThatDoesNotFitTheFile) {
  const std::string bytes(200, 'x');
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  auto message = error_of<CorruptData>([&] {
    format::ChunkChecker(p, 200, 64, {1, 2, 3}, "/data/ds/tokens_00000.bin");
  });
  EXPECT_EQ(message,
            "shard /data/ds/tokens_00000.bin has 3 chunk hashes in the manifest but 200 bytes make "
            "4 chunks");
  const format::ChunkChecker unchecked(p, 200, 0, {}, "/data/ds/tokens_00000.bin");
  EXPECT_FALSE(unchecked.enabled());
  unchecked.check(0, 200);  // a format 1 shard: nothing to check
  EXPECT_EQ(unchecked.chunks_verified(), 0u);
}

}  // namespace
}  // namespace loom::data

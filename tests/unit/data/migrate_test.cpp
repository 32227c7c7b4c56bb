// Format versions: the format 1 and 2 datasets kept in tests/data/format-v1 and format-v2
// (written by the code of those formats) read with today's reader, and migrate_dataset brings
// them to the current format, keeping the content version when the content identity is
// unchanged.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fstream>

#include "harness/harness.h"
#include "loom/data/dataset.h"
#include "loom/data/reader.h"
#include "loom/data/vocabulary.h"
#include "loom/error.h"
#include "util/files.h"

namespace loom::data {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::TempDir;

const fs::path kFormat1 = fs::path(LOOM_SOURCE_DIR) / "tests" / "data" / "format-v1";
const fs::path kFormat2 = fs::path(LOOM_SOURCE_DIR) / "tests" / "data" / "format-v2";
constexpr char kTokensVersion1[] = "5418a01a453035ea";
constexpr char kRecordsVersion1[] = "f9b2ba64c56eac6c";
constexpr char kTokensVersion2[] = "103d5ecfec3871f1";

// A writable copy of a kept dataset.
fs::path copy_of(const TempDir& dir, const std::string& name, const fs::path& kept = kFormat1) {
  fs::copy(kept / name, dir / name, fs::copy_options::recursive);
  return dir / name;
}

std::vector<int64_t> row(const Batch& b, int64_t r) {
  const at::Tensor t = b["tokens"][r].contiguous();
  return {t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel()};
}

TEST(FormatVersions, Format1DatasetsReadAsTheyWereWritten) {
  const Manifest tokens = read_manifest(kFormat1 / "tokens");
  EXPECT_EQ(tokens.format_version, 1);
  EXPECT_EQ(tokens.version, kTokensVersion1);
  EXPECT_EQ(tokens.chunk_bytes, 0u);
  EXPECT_TRUE(tokens.tokenizer_files.empty());
  // What `loom data show tokens --seq-len 8 --batch 2 --step 1 --ids` printed when they were
  // written (tests/data/format-v1/tokens.show.txt): samples 176 and 154.
  Reader reader(kFormat1 / "tokens", {.batch_size = 2, .seq_len = 8, .prefetch = 0});
  EXPECT_EQ(reader.num_samples(), 485u);
  reader.next();
  const Batch b = reader.next();
  EXPECT_EQ(b.indices, (std::vector<uint64_t>{176, 154}));
  EXPECT_EQ(row(b, 0), (std::vector<int64_t>{8, 14, 44, 66, 93, 74, 5, 82, 34}));
  EXPECT_EQ(row(b, 1), (std::vector<int64_t>{78, 85, 82, 6, 77, 68, 8, 4, 61}));
  EXPECT_EQ(reader.chunks_verified(), 0u);  // format 1 has no chunk hashes
  EXPECT_EQ(Vocabulary::of_dataset(kFormat1 / "tokens").size(), 120u);

  Reader records(kFormat1 / "records", {.batch_size = 4, .prefetch = 0});
  EXPECT_EQ(records.manifest().version, kRecordsVersion1);
  const Batch r = records.read({0, 1, 2, 3});
  EXPECT_TRUE(at::equal(r["id"], at::arange(4, at::kLong)));
  EXPECT_TRUE(at::equal(r["obs"], at::arange(1, 17, at::kLong).reshape({4, 2, 2})));
  EXPECT_TRUE(at::equal(r["reward"], at::tensor({0.5, -1.25, 2.0, 0.0}, at::kDouble)));
  EXPECT_EQ(r.strings.at("text"), (std::vector<std::string>{"In the beginning", "God created",
                                                            "the heaven", "and the earth"}));
}

// A record dataset's identity is the same in both formats: migrating keeps its version, and
// only manifest.json changes.
TEST(FormatVersions, MigratingRecordsKeepsTheirVersion) {
  TempDir dir;
  const fs::path ds = copy_of(dir, "records");
  const std::string shard = util::read_file(ds / "records_00000.bin");
  const Batch before = Reader(ds, {.prefetch = 0}).read({0, 1, 2, 3});

  const MigrateReport report = migrate_dataset(ds);
  EXPECT_TRUE(report.rewritten);
  EXPECT_EQ(report.from_format, 1);
  EXPECT_EQ(report.to_format, 3);
  EXPECT_EQ(report.old_version, kRecordsVersion1);
  EXPECT_EQ(report.new_version, kRecordsVersion1);
  const Manifest m = read_manifest(ds);
  EXPECT_EQ(m.format_version, 3);
  EXPECT_EQ(m.version, kRecordsVersion1);
  EXPECT_EQ(m.previous_version, "");
  EXPECT_EQ(m.chunk_bytes, Manifest::kDefaultChunkBytes);
  ASSERT_EQ(m.shards.size(), 1u);
  EXPECT_EQ(m.shards[0].chunk_hashes.size(), 1u);  // 474 bytes: one chunk
  EXPECT_EQ(util::read_file(ds / "records_00000.bin"), shard);

  const Batch after = Reader(ds, {.prefetch = 0}).read({0, 1, 2, 3});
  for (const char* field : {"id", "obs", "reward"}) {
    EXPECT_TRUE(at::equal(before[field], after[field])) << field;
  }
  EXPECT_EQ(before.strings, after.strings);

  // Already current: nothing to do, nothing written.
  const std::string manifest = util::read_file(ds / "manifest.json");
  const MigrateReport again = migrate_dataset(ds);
  EXPECT_FALSE(again.rewritten);
  EXPECT_EQ(again.from_format, 3);
  EXPECT_EQ(util::read_file(ds / "manifest.json"), manifest);
  EXPECT_TRUE(verify_dataset(ds).ok);
}

// Format 1 left the tokenizer files out of the version; format 2 covers them, so a token
// dataset with a tokenizer gets a new version, and keeps the old one as previous_version:
// a reader state saved on the format 1 dataset resumes on the migrated one.
TEST(FormatVersions, MigratingTokensCoversTheTokenizerAndResumesOldStates) {
  TempDir dir;
  const fs::path ds = copy_of(dir, "tokens");
  Reader old_reader(ds, {.batch_size = 2, .seq_len = 8, .prefetch = 0});
  old_reader.next();
  const SamplerState saved = old_reader.state();
  const Batch expected = old_reader.next();

  const MigrateReport report = migrate_dataset(ds);
  EXPECT_TRUE(report.rewritten);
  EXPECT_EQ(report.old_version, kTokensVersion1);
  EXPECT_NE(report.new_version, kTokensVersion1);
  const Manifest m = read_manifest(ds);
  EXPECT_EQ(m.version, report.new_version);
  EXPECT_EQ(m.previous_version, kTokensVersion1);
  ASSERT_EQ(m.tokenizer_files.size(), 2u);
  EXPECT_EQ(m.tokenizer_files[0].file, "tokenizer.model");
  EXPECT_EQ(m.tokenizer_files[0].bytes, fs::file_size(ds / "tokenizer.model"));
  EXPECT_EQ(m.tokenizer_files[1].file, "tokenizer.vocab");
  EXPECT_EQ(m.tokenizer_files[1].bytes, fs::file_size(ds / "tokenizer.vocab"));

  Reader migrated(ds, {.batch_size = 2, .seq_len = 8, .prefetch = 0});
  migrated.restore(saved);  // a state of previous_version
  const Batch b = migrated.next();
  EXPECT_EQ(b.indices, expected.indices);
  EXPECT_TRUE(at::equal(b["tokens"], expected["tokens"]));
  EXPECT_GT(migrated.chunks_verified(), 0u);
  EXPECT_EQ(migrated.state().dataset_version, m.version);

  // The tokenizer files are now checked at every open.
  std::ofstream(ds / "tokenizer.vocab", std::ios::app) << "extra\t0\n";
  auto message = error_of<CorruptData>([&] { Reader(ds, {.seq_len = 8}); });
  EXPECT_NE(message.find("tokenizer file " + (ds / "tokenizer.vocab").string()), std::string::npos)
      << message;
  EXPECT_THROW(Vocabulary::of_dataset(ds), CorruptData);
}

// Format 2 datasets read as format 2 wrote them (tests/data/format-v2/*.show.txt), and migrate
// to format 3 keeping their version and every shard: format 3 only adds what format 2 could
// not describe.
TEST(FormatVersions, Format2DatasetsReadAsTheyWereWrittenAndMigrateKeepingTheirVersion) {
  TempDir dir;
  for (const char* name : {"tokens", "records"}) {
    const fs::path ds = copy_of(dir, name, kFormat2);
    const Manifest before = read_manifest(ds);
    EXPECT_EQ(before.format_version, 2);
    Reader tokens_or_records(ds, {.batch_size = 2, .seq_len = 8, .prefetch = 0});
    tokens_or_records.next();
    const Batch b = tokens_or_records.next();
    if (std::string(name) == "tokens") {
      EXPECT_EQ(before.version, kTokensVersion2);
      EXPECT_EQ(b.indices, (std::vector<uint64_t>{176, 154}));
      EXPECT_EQ(row(b, 0), (std::vector<int64_t>{8, 14, 44, 66, 93, 74, 5, 82, 34}));
      EXPECT_EQ(row(b, 1), (std::vector<int64_t>{78, 85, 82, 6, 77, 68, 8, 4, 61}));
      EXPECT_GT(tokens_or_records.chunks_verified(), 0u);
    } else {
      EXPECT_EQ(before.version, kRecordsVersion1);
      EXPECT_EQ(b.indices, (std::vector<uint64_t>{3, 0}));
      EXPECT_TRUE(at::equal(b["id"], at::tensor({3, 0}, at::kLong)));
      EXPECT_EQ(b.strings.at("text"),
                (std::vector<std::string>{"and the earth", "In the beginning"}));
    }
    std::vector<std::string> shards;
    for (const ShardInfo& s : before.shards) shards.push_back(util::read_file(ds / s.file));

    const MigrateReport report = migrate_dataset(ds);
    EXPECT_TRUE(report.rewritten);
    EXPECT_EQ(report.from_format, 2);
    EXPECT_EQ(report.to_format, 3);
    EXPECT_EQ(report.new_version, before.version);
    const Manifest after = read_manifest(ds);
    EXPECT_EQ(after.format_version, 3);
    EXPECT_EQ(after.version, before.version);
    EXPECT_EQ(after.previous_version, "");
    for (size_t i = 0; i < before.shards.size(); ++i) {
      EXPECT_EQ(after.shards[i].chunk_hashes, before.shards[i].chunk_hashes);
      EXPECT_EQ(util::read_file(ds / before.shards[i].file), shards[i]);
    }
    Reader migrated(ds, {.batch_size = 2, .seq_len = 8, .prefetch = 0});
    migrated.next();
    const Batch again = migrated.next();
    EXPECT_EQ(again.indices, b.indices);
    for (const auto& [key, t] : b.tensors) EXPECT_TRUE(at::equal(again[key], t)) << key;
    EXPECT_EQ(again.strings, b.strings);
  }
}

TEST(FormatVersions, MigrationRefusesACorruptShardAndChangesNothing) {
  TempDir dir;
  const fs::path ds = copy_of(dir, "tokens");
  {
    std::fstream f(ds / "tokens_00001.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x7f');
  }
  const std::string manifest = util::read_file(ds / "manifest.json");
  auto message = error_of<CorruptData>([&] { migrate_dataset(ds); });
  EXPECT_NE(message.find("cannot migrate " + ds.string() + ": shard " +
                         (ds / "tokens_00001.bin").string()),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("nothing was changed"), std::string::npos) << message;
  EXPECT_EQ(util::read_file(ds / "manifest.json"), manifest);
}

TEST(FormatVersions, AnUnknownFormatVersionNamesWhatThisLoomReads) {
  TempDir dir;
  const fs::path ds = copy_of(dir, "records");
  std::string text = util::read_file(ds / "manifest.json");
  text.replace(text.find("\"format_version\": 1"), 19, "\"format_version\": 9");
  util::write_file_atomic(ds / "manifest.json", text);
  EXPECT_EQ(error_of<CorruptData>([&] { read_manifest(ds); }),
            (ds / "manifest.json").string() +
                " has format version 9; this Loom reads versions 1 to 3: read it with a newer "
                "Loom, or rebuild it with this one");
}

}  // namespace
}  // namespace loom::data

// Token and record datasets: writing, manifests, versions, verify and every corruption case.
#include "loom/data/dataset.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "harness/harness.h"
#include "loom/data/reader.h"
#include "loom/error.h"
#include "util/files.h"

namespace loom::data {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::TempDir;

// A token dataset whose global token stream is 0, 1, 2, ... (mod vocab), in documents of the
// given lengths, small shards so that windows cross shard boundaries.
Manifest write_counting_tokens(const fs::path& dir, const std::vector<size_t>& doc_lengths,
                               uint64_t vocab = 1000, uint64_t tokens_per_shard = 37) {
  TokenDatasetWriter writer(dir, {.vocab_size = vocab, .tokens_per_shard = tokens_per_shard});
  uint32_t next = 0;
  for (size_t length : doc_lengths) {
    std::vector<uint32_t> doc;
    for (size_t i = 0; i < length; ++i) doc.push_back(next++ % vocab);
    writer.add_document(doc);
  }
  return writer.finish();
}

std::vector<Field> image_schema() {
  return {{"image", FieldType::kTensor, "uint8", {2, 3}},
          {"label", FieldType::kInt, "", {}, {"zero", "one", "two"}},
          {"caption", FieldType::kText},
          {"weight", FieldType::kFloat},
          {"raw", FieldType::kBytes}};
}

Manifest write_records(const fs::path& dir, int n, uint64_t bytes_per_shard = 200) {
  RecordDatasetWriter writer(dir, image_schema(), {.bytes_per_shard = bytes_per_shard});
  for (int i = 0; i < n; ++i) {
    uint8_t pixels[6];
    for (int k = 0; k < 6; ++k) pixels[k] = static_cast<uint8_t>(i * 6 + k);
    writer.add(Record()
                   .tensor(pixels, 6, {2, 3})
                   .integer(i % 3)
                   .text("sample " + std::to_string(i))
                   .real(i * 0.5)
                   .bytes(std::string(static_cast<size_t>(i % 4), '\x7f')));
  }
  return writer.finish();
}

void flip_byte(const fs::path& file, std::streamoff offset) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x20);
  f.seekp(offset);
  f.write(&c, 1);
}

TEST(TokenDataset, RoundTripAcrossShardsWith16And32BitTokens) {
  for (uint64_t vocab : {1000ull, 100000ull}) {
    TempDir dir;
    const Manifest m = write_counting_tokens(dir.path() / "ds", {10, 50, 3, 80, 7}, vocab);
    EXPECT_EQ(m.total_items(), 150u);
    EXPECT_EQ(m.total_documents(), 5u);
    EXPECT_GT(m.shards.size(), 2u);
    EXPECT_EQ(read_manifest(dir.path() / "ds").version, m.version);

    Reader reader(dir.path() / "ds", {.batch_size = 4, .seq_len = 8});
    EXPECT_EQ(reader.num_samples(), (150u - 1) / 8);
    Batch b = reader.read({0, 5, 17});
    ASSERT_EQ(b["tokens"].sizes(), (std::vector<int64_t>{3, 9}));
    for (int r = 0; r < 3; ++r) {
      const int64_t start = static_cast<int64_t>(b.indices[r]) * 8;
      for (int k = 0; k < 9; ++k) EXPECT_EQ(b["tokens"][r][k].item<int64_t>(), start + k);
    }
  }
}

TEST(TokenDataset, DocumentSamplingCutsPadsAndMasks) {
  TempDir dir;
  write_counting_tokens(dir.path() / "ds", {3, 12, 5});
  Reader reader(
      dir.path() / "ds",
      {.batch_size = 3, .seq_len = 4, .sampling = TokenSampling::kDocument, .pad_id = -1});
  EXPECT_EQ(reader.num_samples(), 3u);
  Batch b = reader.read({0, 1, 2});
  auto tokens = b["tokens"];
  EXPECT_TRUE(tokens[0].equal(at::tensor({0, 1, 2, -1, -1}, at::kLong)));
  EXPECT_TRUE(tokens[1].equal(at::tensor({3, 4, 5, 6, 7}, at::kLong)));
  EXPECT_TRUE(tokens[2].equal(at::tensor({15, 16, 17, 18, 19}, at::kLong)));
  EXPECT_EQ(b["mask"].sum().item<int64_t>(), 3 + 5 + 5);
}

TEST(TokenDataset, EosIsAppendedAndIdsAreChecked) {
  TempDir dir;
  TokenDatasetWriter writer(dir.path() / "ds", {.vocab_size = 10, .eos_id = 9});
  writer.add_document({1, 2});
  writer.add_document({3});
  EXPECT_EQ(writer.tokens_written(), 5u);
  auto message = error_of<InvalidArgument>([&] { writer.add_document({4, 10}); });
  EXPECT_NE(message.find("token id 10"), std::string::npos) << message;
}

TEST(TokenDataset, VersionNamesTheContent) {
  TempDir dir;
  const auto a = write_counting_tokens(dir.path() / "a", {10, 20});
  const auto b = write_counting_tokens(dir.path() / "b", {10, 20});
  const auto c = write_counting_tokens(dir.path() / "c", {10, 21});
  EXPECT_EQ(a.version, b.version);
  EXPECT_NE(a.version, c.version);
  EXPECT_EQ(a.version.size(), 16u);
}

TEST(TokenDataset, RefusesToOverwriteADataset) {
  TempDir dir;
  write_counting_tokens(dir.path() / "ds", {5});
  auto message =
      error_of<InvalidArgument>([&] { TokenDatasetWriter(dir.path() / "ds", {.vocab_size = 10}); });
  EXPECT_NE(message.find("already holds a dataset"), std::string::npos) << message;
}

TEST(RecordDataset, FieldsCollateByType) {
  TempDir dir;
  const Manifest m = write_records(dir.path() / "ds", 20);
  EXPECT_EQ(m.total_items(), 20u);
  EXPECT_GT(m.shards.size(), 2u);
  EXPECT_EQ(m.field("label").classes[2], "two");

  Reader reader(dir.path() / "ds", {.batch_size = 2});
  Batch b = reader.read({7, 13});
  EXPECT_EQ(b["image"].sizes(), (std::vector<int64_t>{2, 2, 3}));
  EXPECT_EQ(b["image"].scalar_type(), at::kByte);
  EXPECT_EQ(b["image"][1][1][2].item<int>(), 13 * 6 + 5);
  EXPECT_TRUE(b["label"].equal(at::tensor({1, 1}, at::kLong)));
  EXPECT_DOUBLE_EQ(b["weight"][0].item<double>(), 3.5);
  EXPECT_EQ(b.strings.at("caption")[1], "sample 13");
  EXPECT_EQ(b.strings.at("raw")[0], std::string(3, '\x7f'));
  auto message = error_of<InvalidArgument>([&] { (void)b["pixels"]; });
  EXPECT_NE(message.find("image"), std::string::npos) << message;
}

TEST(RecordDataset, RecordsMustMatchTheSchema) {
  TempDir dir;
  RecordDatasetWriter writer(dir.path() / "ds", image_schema());
  uint8_t pixels[6] = {};
  auto message = error_of<InvalidArgument>([&] { writer.add(Record().tensor(pixels, 6, {3, 2})); });
  EXPECT_NE(message.find("5"), std::string::npos) << message;
  message = error_of<InvalidArgument>([&] {
    writer.add(Record().tensor(pixels, 6, {3, 2}).integer(0).text("").real(0).bytes(""));
  });
  EXPECT_NE(message.find("fixed shape"), std::string::npos) << message;
  message = error_of<InvalidArgument>([&] {
    writer.add(Record().tensor(pixels, 6, {2, 3}).text("x").text("").real(0).bytes(""));
  });
  EXPECT_NE(message.find("'label' is int"), std::string::npos) << message;
}

TEST(DatasetIntegrity, VerifyPassesOnAGoodDataset) {
  TempDir dir;
  const Manifest m = write_records(dir.path() / "ds", 20);
  uint64_t last = 0;
  const VerifyReport report =
      verify_dataset(dir.path() / "ds", [&](uint64_t done, uint64_t) { last = done; });
  EXPECT_TRUE(report.ok) << report.problem;
  EXPECT_EQ(report.bytes_checked, m.total_bytes());
  EXPECT_EQ(last, m.total_bytes());
}

TEST(DatasetIntegrity, FlippedByteInARecordNamesShardAndRecord) {
  TempDir dir;
  const auto ds = dir.path() / "ds";
  write_records(ds, 20);
  // Record 0 is 66 bytes (image 26, label 8, caption 12, weight 8, raw 4, checksum 8), so
  // this byte lies inside record 1 of the first shard.
  flip_byte(ds / "records_00000.bin", 64 + 66 + 30);

  const VerifyReport report = verify_dataset(ds);
  EXPECT_FALSE(report.ok);
  EXPECT_NE(report.file.find("records_00000.bin"), std::string::npos);
  EXPECT_EQ(report.record, 1);
  EXPECT_GT(report.offset, 64);
  EXPECT_NE(report.problem.find("checksum"), std::string::npos) << report.problem;

  Reader reader(ds, {.batch_size = 20, .prefetch = 1});  // opening checks sizes, not content
  auto message = error_of<CorruptData>([&] { reader.next(); });
  EXPECT_NE(message.find("record 1 of shard"), std::string::npos) << message;
  EXPECT_NE(message.find("records_00000.bin"), std::string::npos) << message;
  // The failed batch was not consumed: the state did not move and the error repeats.
  EXPECT_EQ(reader.state().position, 0u);
  EXPECT_THROW(reader.next(), CorruptData);
}

TEST(DatasetIntegrity, TruncatedShardFailsAtOpen) {
  TempDir dir;
  const auto ds = dir.path() / "ds";
  write_records(ds, 20);
  fs::resize_file(ds / "records_00001.bin", fs::file_size(ds / "records_00001.bin") - 3);
  auto message = error_of<CorruptData>([&] { Reader(ds, {}); });
  EXPECT_NE(message.find("records_00001.bin"), std::string::npos) << message;
  EXPECT_NE(message.find("truncated"), std::string::npos) << message;
  EXPECT_FALSE(verify_dataset(ds).ok);
}

// A token shard cut short, by part of a token and by whole tokens: refused at open, naming the
// file, its size and the size the manifest promises; verify says the same.
TEST(DatasetIntegrity, TruncatedTokenShardFailsAtOpen) {
  for (const uintmax_t cut : {uintmax_t{1}, uintmax_t{8}}) {
    SCOPED_TRACE(::testing::Message() << "cut " << cut << " bytes");
    TempDir dir;
    const auto ds = dir.path() / "ds";
    write_counting_tokens(ds, {40, 40});
    const auto shard = ds / "tokens_00001.bin";
    const uintmax_t size = fs::file_size(shard);
    fs::resize_file(shard, size - cut);
    const std::string expected = "shard " + shard.string() + " is " + std::to_string(size - cut) +
                                 " bytes but the manifest says " + std::to_string(size) +
                                 " (truncated); restore it or rebuild the dataset";
    EXPECT_EQ(error_of<CorruptData>([&] { Reader(ds, {.seq_len = 4}); }), expected);
    const VerifyReport report = verify_dataset(ds);
    EXPECT_FALSE(report.ok);
    EXPECT_EQ(report.file, shard.string());
    EXPECT_EQ(report.problem, expected);
  }
}

// Only the document index's first and last entries are checked at open; one in between that
// goes backwards is found when a sample reads it (here with chunk hashing off, which would
// otherwise report the changed bytes first), and nothing outside the shard is read.
TEST(DatasetIntegrity, ABackwardsDocumentIndexEntryIsCorruptDataNamingTheDocument) {
  TempDir dir;
  const auto ds = dir.path() / "ds";
  write_counting_tokens(ds, {3, 3, 3});  // one shard: 9 two-byte tokens, index 0 3 6 9
  const auto shard = ds / "tokens_00000.bin";
  const uint64_t index_offset = fs::file_size(shard) - 4 * 8;  // the index ends the file
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    const uint64_t entry = 7;  // document 1 = [7, 6)
    f.seekp(static_cast<std::streamoff>(index_offset + 8));
    f.write(reinterpret_cast<const char*>(&entry), 8);
  }
  Reader reader(ds, {.seq_len = 4, .sampling = TokenSampling::kDocument, .verify_chunks = false});
  EXPECT_EQ(reader.read({0})["tokens"].sizes(), (std::vector<int64_t>{1, 5}));
  EXPECT_EQ(error_of<CorruptData>([&] { reader.read({1}); }),
            "document 1 of shard " + shard.string() +
                " spans tokens [7, 6) of 9: its document index is corrupt; run `loom data "
                "verify` and restore or rebuild the dataset");
  EXPECT_FALSE(verify_dataset(ds).ok);
}

TEST(DatasetIntegrity, MissingShardIsAnIoError) {
  TempDir dir;
  const auto ds = dir.path() / "ds";
  write_counting_tokens(ds, {40, 40});
  fs::remove(ds / "tokens_00001.bin");
  auto message = error_of<IoError>([&] { Reader(ds, {.seq_len = 4}); });
  EXPECT_NE(message.find("tokens_00001.bin"), std::string::npos) << message;
  EXPECT_NE(message.find("missing"), std::string::npos) << message;
  const VerifyReport report = verify_dataset(ds);
  EXPECT_NE(report.problem.find("missing"), std::string::npos) << report.problem;
}

TEST(DatasetIntegrity, ChangedTokensFailTheShardHash) {
  TempDir dir;
  const auto ds = dir.path() / "ds";
  write_counting_tokens(ds, {40, 40});
  flip_byte(ds / "tokens_00000.bin", 64 + 10);
  const VerifyReport report = verify_dataset(ds);
  EXPECT_FALSE(report.ok);
  EXPECT_NE(report.problem.find("xxHash64"), std::string::npos) << report.problem;
  EXPECT_NE(report.file.find("tokens_00000.bin"), std::string::npos);
  Reader unchecked(ds, {.seq_len = 4});  // hashes are verify's job unless asked for at open
  auto message = error_of<CorruptData>([&] { Reader(ds, {.seq_len = 4, .verify_hashes = true}); });
  EXPECT_NE(message.find("tokens_00000.bin"), std::string::npos) << message;
  EXPECT_NE(message.find("manifest says"), std::string::npos) << message;
}

// A number beyond double's range makes nlohmann throw out_of_range, not parse_error (found by
// tests/fuzz/dataset_manifest.cpp): CorruptData naming the file, like any other bad JSON.
TEST(DatasetIntegrity, AManifestNumberTooLargeIsCorruptData) {
  TempDir dir;
  const auto ds = dir.path() / "ds";
  fs::create_directories(ds);
  std::ofstream(ds / "manifest.json") << "{\"format_version\": 1e999}";
  EXPECT_EQ(error_of<CorruptData>([&] { read_manifest(ds); }),
            (ds / "manifest.json").string() +
                " is not valid JSON: [json.exception.out_of_range.406] number overflow parsing "
                "'1e999'");
}

TEST(DatasetIntegrity, EditedOrMissingManifest) {
  TempDir dir;
  const auto ds = dir.path() / "ds";
  write_counting_tokens(ds, {40});
  std::string text = [&] {
    std::ifstream in(ds / "manifest.json");
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  const auto at = text.find("\"eos_id\": -1");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 12, "\"eos_id\": 3 ");
  std::ofstream(ds / "manifest.json") << text;
  auto message = error_of<CorruptData>([&] { read_manifest(ds); });
  EXPECT_NE(message.find("was edited"), std::string::npos) << message;

  fs::remove(ds / "manifest.json");
  message = error_of<IoError>([&] { read_manifest(ds); });
  EXPECT_NE(message.find("no manifest.json"), std::string::npos) << message;
  message = error_of<IoError>([&] { read_manifest(dir.path() / "nowhere"); });
  EXPECT_NE(message.find("does not exist"), std::string::npos) << message;
}

// A manifest edited to name files outside the dataset, or with fields of the wrong type:
// CorruptData naming the manifest (and the name), before any file is opened.
TEST(DatasetIntegrity, HostileManifestNamesAndTypesAreRefused) {
  TempDir dir;
  const auto ds = dir.path() / "ds";
  write_counting_tokens(ds, {40});
  const std::string original = util::read_file(ds / "manifest.json");
  auto refused = [&](const std::function<void(nlohmann::json&)>& change) {
    nlohmann::json j = nlohmann::json::parse(original);
    change(j);
    util::write_file_atomic(ds / "manifest.json", j.dump(2));
    std::string message = error_of<CorruptData>([&] { read_manifest(ds); });
    EXPECT_NE(message.find((ds / "manifest.json").string()), std::string::npos) << message;
    EXPECT_THROW(Reader(ds, {.seq_len = 4}), CorruptData);
    return message;
  };
  for (const std::string& name :
       std::vector<std::string>{"../../../etc/hostname", "/etc/hostname", "..", ".x", "",
                                std::string("tokens_00000.bin\0", 17), "sub/tokens.bin"}) {
    SCOPED_TRACE(name);
    const std::string message = refused([&](nlohmann::json& j) { j["shards"][0]["file"] = name; });
    EXPECT_NE(message.find("is not a plain file name"), std::string::npos) << message;
  }
  std::string message =
      refused([](nlohmann::json& j) { j["tokenizer"] = "../../../etc/hostname"; });
  EXPECT_NE(message.find("tokenizer file name \"../../../etc/hostname\""), std::string::npos)
      << message;
  message = refused([](nlohmann::json& j) { j["shards"][0]["bytes"] = "640"; });
  EXPECT_NE(message.find("\"bytes\""), std::string::npos) << message;
  message = refused([](nlohmann::json& j) { j["shards"][0]["tokens"] = -5; });
  EXPECT_NE(message.find("\"tokens\""), std::string::npos) << message;
  message = refused([](nlohmann::json& j) { j["shards"] = 7; });
  message = refused([](nlohmann::json& j) { j["format"] = 3; });  // not a type_error escaping
  EXPECT_NE(message.find("is not a Loom dataset manifest"), std::string::npos) << message;
  message = refused([](nlohmann::json& j) { j = nlohmann::json::array(); });
  EXPECT_NE(message.find("is not a Loom dataset manifest"), std::string::npos) << message;
}

}  // namespace
}  // namespace loom::data

// data::Reader: the batches each rank gets, prefetch, and exact resume through state() and
// restore() at the same or another world size and batch size.
#include "loom/data/reader.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <random>
#include <set>

#include "harness/harness.h"
#include "loom/error.h"
#include "util/hash.h"

namespace loom::data {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::TempDir;

// A token dataset whose stream is 0, 1, 2, ...: a packed sample's first token names it.
fs::path counting_dataset(const TempDir& dir, uint32_t tokens, const char* name = "ds") {
  TokenDatasetWriter writer(dir.path() / name, {.vocab_size = 1u << 20, .tokens_per_shard = 1000});
  std::vector<uint32_t> doc;
  for (uint32_t t = 0; t < tokens; ++t) {
    doc.push_back(t);
    if (doc.size() == 97) {
      writer.add_document(doc);
      doc.clear();
    }
  }
  if (!doc.empty()) writer.add_document(doc);
  writer.finish();
  return dir.path() / name;
}

// The samples of a batch, read back from the tokens themselves (not from batch.indices).
std::vector<uint64_t> samples_of(const Batch& b, int64_t seq_len) {
  std::vector<uint64_t> out;
  const auto tokens = b["tokens"];
  for (int64_t r = 0; r < b.num_real; ++r) {
    const int64_t first = tokens[r][0].item<int64_t>();
    EXPECT_EQ(first % seq_len, 0);
    EXPECT_EQ(tokens[r][seq_len].item<int64_t>(), first + seq_len);  // the window is whole
    out.push_back(static_cast<uint64_t>(first / seq_len));
  }
  return out;
}

TEST(Reader, RanksSplitEachGlobalBatchAndCoverTheEpoch) {
  TempDir dir;
  const auto ds = counting_dataset(dir, 4001);
  const int world = 3;
  std::vector<std::unique_ptr<Reader>> readers;
  for (int r = 0; r < world; ++r) {
    readers.push_back(std::make_unique<Reader>(
        ds,
        ReaderOptions{.batch_size = 5, .seq_len = 10, .seed = 7, .rank = r, .world_size = world}));
  }
  std::multiset<uint64_t> seen;
  const uint64_t steps = readers[0]->steps_per_epoch();
  EXPECT_EQ(steps, 400u / 15);
  for (uint64_t s = 0; s < steps; ++s) {
    for (auto& reader : readers) {
      Batch b = reader->next();
      EXPECT_EQ(b.epoch, 0u);
      for (uint64_t v : samples_of(b, 10)) seen.insert(v);
    }
    EXPECT_EQ(readers[0]->state(), readers[2]->state());
  }
  EXPECT_EQ(seen.size(), steps * 15);
  EXPECT_EQ(std::set<uint64_t>(seen.begin(), seen.end()).size(), seen.size())
      << "a sample repeated";
  EXPECT_EQ(readers[1]->next().epoch, 1u);
}

TEST(Reader, PrefetchDoesNotChangeBatchesOrState) {
  TempDir dir;
  const auto ds = counting_dataset(dir, 3000);
  Reader sync(ds, {.batch_size = 4, .seq_len = 16, .seed = 3, .prefetch = 0});
  Reader ahead(ds, {.batch_size = 4, .seq_len = 16, .seed = 3, .prefetch = 4});
  for (int s = 0; s < 100; ++s) {  // crosses into epoch 2
    Batch a = sync.next(), b = ahead.next();
    ASSERT_TRUE(a["tokens"].equal(b["tokens"])) << "step " << s;
    ASSERT_EQ(sync.state(), ahead.state());
  }
}

TEST(Reader, OptionsAreChecked) {
  TempDir dir;
  const auto ds = counting_dataset(dir, 100);
  EXPECT_THROW(Reader(ds, {.batch_size = 0, .seq_len = 4}), InvalidArgument);
  EXPECT_THROW(Reader(ds, {.seq_len = 0}), InvalidArgument);
  EXPECT_THROW(Reader(ds, {.seq_len = 4, .rank = 2, .world_size = 2}), InvalidArgument);
  auto message = error_of<InvalidArgument>([&] { Reader(ds, {.seq_len = 100}); });
  EXPECT_NE(message.find("fewer than seq_len + 1"), std::string::npos) << message;
}

TEST(Reader, StateOfAnotherDatasetVersionNamesBoth) {
  TempDir dir;
  const auto a = counting_dataset(dir, 500, "a");
  const auto b = counting_dataset(dir, 600, "b");
  Reader ra(a, {.batch_size = 2, .seq_len = 4});
  ra.next();
  Reader rb(b, {.batch_size = 2, .seq_len = 4});
  const SamplerState state = ra.state();
  auto message = error_of<InvalidArgument>([&] { rb.restore(state); });
  EXPECT_NE(message.find(ra.manifest().version), std::string::npos) << message;
  EXPECT_NE(message.find(rb.manifest().version), std::string::npos) << message;
  rb.restore(state, {.allow_version_change = true});
  EXPECT_EQ(rb.state().position, state.position);
}

// The property: read k steps at (W1, B1), save the state as JSON, resume at (W2, B2) with new
// readers; the samples of the epoch read before and after, over all ranks, are exactly the
// uninterrupted epoch's samples up to that point: none repeated, none skipped.
TEST(Reader, ResumeAtAnyWorldSizeNeitherRepeatsNorSkips) {
  TempDir dir;
  std::mt19937_64 rng(20261202);
  for (int trial = 0; trial < 12; ++trial) {
    const uint32_t tokens = 500 + static_cast<uint32_t>(rng() % 3000);
    const auto ds = counting_dataset(dir, tokens, ("ds" + std::to_string(trial)).c_str());
    const int64_t seq = 1 + static_cast<int64_t>(rng() % 12);
    const int w1 = 1 + static_cast<int>(rng() % 4), w2 = 1 + static_cast<int>(rng() % 4);
    const int64_t b1 = 1 + static_cast<int64_t>(rng() % 6),
                  b2 = 1 + static_cast<int64_t>(rng() % 6);
    const uint64_t seed = rng();
    auto make = [&](int world, int64_t batch) {
      std::vector<std::unique_ptr<Reader>> readers;
      for (int r = 0; r < world; ++r) {
        readers.push_back(std::make_unique<Reader>(ds, ReaderOptions{.batch_size = batch,
                                                                     .seq_len = seq,
                                                                     .seed = seed,
                                                                     .rank = r,
                                                                     .world_size = world,
                                                                     .epoch_end = EpochEnd::kPad,
                                                                     .prefetch = 2}));
      }
      return readers;
    };
    SCOPED_TRACE(::testing::Message()
                 << "trial " << trial << ": tokens " << tokens << " seq " << seq << " W " << w1
                 << "->" << w2 << " B " << b1 << "->" << b2);
    auto before = make(w1, b1);
    const uint64_t n = before[0]->num_samples();
    const uint64_t k = rng() % (before[0]->steps_per_epoch() + 1);
    std::multiset<uint64_t> seen;
    for (uint64_t s = 0; s < k; ++s) {
      for (auto& reader : before) {
        for (uint64_t v : samples_of(reader->next(), seq)) seen.insert(v);
      }
    }
    const std::string saved = before[0]->state().to_json();
    before.clear();

    auto after = make(w2, b2);
    for (auto& reader : after) reader->restore(SamplerState::from_json(saved));
    while (after[0]->state().epoch == 0) {
      for (auto& reader : after) {
        for (uint64_t v : samples_of(reader->next(), seq)) seen.insert(v);
      }
    }
    ASSERT_EQ(seen.size(), n);
    ASSERT_EQ(std::set<uint64_t>(seen.begin(), seen.end()).size(), n) << "repeat or skip";
    ASSERT_EQ(*seen.rbegin(), n - 1);
  }
}

TEST(Reader, RanksAsThreadsAgreeOnTheGlobalBatch) {
  TempDir dir;
  const auto ds = counting_dataset(dir, 5000);
  const int world = 4;
  std::vector<std::vector<uint64_t>> per_rank(world);
  testing::expect_all_ok(testing::run_threads(world, [&](testing::Rank& r) {
    Reader reader(ds,
                  {.batch_size = 3, .seq_len = 8, .seed = 11, .rank = r.rank, .world_size = world});
    for (int s = 0; s < 20; ++s) {
      for (uint64_t v : samples_of(reader.next(), 8)) per_rank[r.rank].push_back(v);
    }
  }));
  Reader single(ds, {.batch_size = 12, .seq_len = 8, .seed = 11});
  for (int s = 0; s < 20; ++s) {
    const auto global = samples_of(single.next(), 8);
    for (int r = 0; r < world; ++r) {
      for (int i = 0; i < 3; ++i) EXPECT_EQ(per_rank[r][s * 3 + i], global[r * 3 + i]);
    }
  }
}

// Entries are what the dataset stores (documents, records), whatever the sampling: their sizes
// and content hashes are the same for the same content in another dataset with another token
// width or shard size, and differ where the content does.
TEST(Reader, EntriesAreTheStoredDocumentsAndRecordsWithContentHashes) {
  TempDir dir;
  const std::vector<std::vector<uint32_t>> docs = {{1, 2, 3}, {4}, {5, 6, 7, 8, 9}, {1, 2, 3}};
  auto tokens = [&](const char* name, uint32_t vocab, uint64_t per_shard) {
    TokenDatasetWriter writer(dir / name,
                              {.vocab_size = vocab, .eos_id = 0, .tokens_per_shard = per_shard});
    for (const auto& d : docs) writer.add_document(d);
    writer.finish();
    return Reader(dir / name, {.batch_size = 1, .seq_len = 2});
  };
  const Reader narrow = tokens("narrow", 16, 1000);  // uint16 on disk, one shard
  const Reader wide = tokens("wide", 1u << 20, 5);   // uint32 on disk, several shards
  ASSERT_EQ(narrow.num_entries(), 4u);
  ASSERT_EQ(wide.num_entries(), 4u);
  for (uint64_t i = 0; i < 4; ++i) {
    std::vector<uint32_t> ids = docs[i];
    ids.push_back(0);  // the eos
    const Reader::Entry e = narrow.entry(i);
    EXPECT_EQ(e.size, ids.size()) << i;
    EXPECT_EQ(e.hash, util::xxh64(ids.data(), 4 * ids.size())) << i;  // little-endian host
    EXPECT_EQ(wide.entry(i).size, e.size) << i;
    EXPECT_EQ(wide.entry(i).hash, e.hash) << i;
  }
  EXPECT_EQ(narrow.entry(0).hash, narrow.entry(3).hash);
  EXPECT_NE(narrow.entry(0).hash, narrow.entry(1).hash);
  EXPECT_EQ(error_of<InvalidArgument>([&] { narrow.entry(4); }),
            "entry 4 of " + (dir / "narrow").string() + ", which holds 4 documents");

  const std::vector<Field> schema = {{.name = "text", .type = FieldType::kText}};
  auto records = [&](const char* name, const std::vector<std::string>& texts) {
    RecordDatasetWriter writer(dir / name, schema);
    for (const std::string& t : texts) writer.add(Record().text(t));
    writer.finish();
    return Reader(dir / name, {.batch_size = 1});
  };
  const Reader a = records("a", {"one", "two", "three"});
  const Reader b = records("b", {"three", "two", "four!"});
  ASSERT_EQ(a.num_entries(), 3u);
  EXPECT_EQ(a.entry(2).hash, b.entry(0).hash);
  EXPECT_EQ(a.entry(1).hash, b.entry(1).hash);
  EXPECT_NE(a.entry(0).hash, b.entry(2).hash);
  EXPECT_EQ(a.entry(2).size, b.entry(0).size);
  EXPECT_EQ(a.entry(1).size + 2, a.entry(2).size);  // "three" is 2 bytes longer than "two"
}

}  // namespace
}  // namespace loom::data

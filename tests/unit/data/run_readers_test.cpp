// <run_dir>/readers.json (data/run_readers.h): what Runtime::open_dataset and open_mixture
// record for the viewers, read back whole; a reader opened again with the same options is not
// added twice; a missing or malformed file is an error naming it.
#include "data/run_readers.h"

#include <gtest/gtest.h>

#include "harness/harness.h"
#include "loom/data/dataset.h"
#include "loom/error.h"
#include "util/files.h"

namespace loom::data {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::TempDir;

fs::path tokens(const TempDir& dir, const char* name) {
  TokenDatasetWriter writer(dir / name, {.vocab_size = 50});
  writer.add_document(std::vector<uint32_t>(200, 7));
  writer.finish();
  return dir / name;
}

TEST(RunReaders, ReadersAndMixturesReadBackAsRecorded) {
  TempDir dir;
  const fs::path a = tokens(dir, "a"), b = tokens(dir, "b");
  const fs::path run = dir / "run";
  fs::create_directories(run);
  const Reader reader(a, {.batch_size = 3,
                          .seq_len = 8,
                          .sampling = TokenSampling::kDocument,
                          .pad_id = 5,
                          .seed = 11,
                          .rank = 1,
                          .world_size = 2,
                          .epoch_end = EpochEnd::kPad,
                          .prefetch = 0});
  record_run_reader(run, "a-as-named", reader);
  record_run_reader(run, "a-as-named", reader);  // the same again: not added
  const Mixture mixture(
      {{.dataset = a, .weight = 2}, {.dataset = b, .epochs = SourceEpochs::kStop}},
      {.batch_size = 4, .seq_len = 8, .seed = 3, .world_size = 2});
  record_run_mixture(run, mixture);

  const std::vector<RunReader> readers = run_readers(run);
  ASSERT_EQ(readers.size(), 2u);
  const RunReader& r = readers[0];
  EXPECT_EQ(r.dataset, "a-as-named");
  EXPECT_EQ(r.dir, a.string());
  EXPECT_EQ(r.version, reader.manifest().version);
  EXPECT_EQ(r.options.batch_size, 3);
  EXPECT_EQ(r.options.seq_len, 8);
  EXPECT_EQ(r.options.sampling, TokenSampling::kDocument);
  EXPECT_EQ(r.options.pad_id, 5);
  EXPECT_EQ(r.options.seed, 11u);
  EXPECT_EQ(r.options.world_size, 2);
  EXPECT_EQ(r.options.epoch_end, EpochEnd::kPad);
  EXPECT_TRUE(r.mixture.empty());

  const RunReader& m = readers[1];
  EXPECT_EQ(m.dir, a.string());  // the first source's
  EXPECT_EQ(m.options.batch_size, 4);
  EXPECT_EQ(m.options.seed, 3u);
  EXPECT_EQ(m.options.world_size, 2);
  ASSERT_EQ(m.mixture.size(), 2u);
  EXPECT_EQ(m.mixture[0].dataset, a.string());
  EXPECT_EQ(m.mixture[0].dir, a.string());
  EXPECT_EQ(m.mixture[0].version, mixture.source(0).manifest().version);
  EXPECT_EQ(m.mixture[0].weight, 2);
  EXPECT_FALSE(m.mixture[0].stop);
  EXPECT_EQ(m.mixture[1].dir, b.string());
  EXPECT_EQ(m.mixture[1].weight, 1);
  EXPECT_TRUE(m.mixture[1].stop);
}

TEST(RunReaders, AMissingOrMalformedFileIsNamed) {
  TempDir dir;
  EXPECT_EQ(error_of<IoError>([&] { run_readers(dir.path()); }),
            dir.path().string() +
                " has no readers.json: it is not a run directory, or its program opened no "
                "dataset through Runtime::open_dataset");
  const fs::path file = run_readers_file(dir.path());
  util::write_file_atomic(file, "{\"not\": \"a list\"}");
  EXPECT_EQ(error_of<CorruptData>([&] { run_readers(dir.path()); }),
            file.string() + " is not a JSON array of readers");
  util::write_file_atomic(file, "[{\"dataset\": \"a\"}]");
  const std::string message = error_of<CorruptData>([&] { run_readers(dir.path()); });
  EXPECT_EQ(message.rfind(file.string() + ": reader 0 is malformed (", 0), 0u) << message;
  util::write_file_atomic(file, "[");
  const std::string truncated = error_of<CorruptData>([&] { run_readers(dir.path()); });
  EXPECT_EQ(truncated.rfind(file.string() + " is not valid JSON: ", 0), 0u) << truncated;
}

}  // namespace
}  // namespace loom::data

// The data service (loom/data/service.h): what a ServiceReader returns equals, bit for bit, what
// a data::Reader with the same options returns, at every rank, across restores and whichever
// replica answers; a replica that goes away is replaced by another without a change in the
// batches; a service that is gone for good is a named CommError within the deadline; bad
// datasets, bad positions and wrong tokens are the service's error, named.
#include "loom/data/service.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <random>

#include "data/image_codec.h"
#include "harness/harness.h"
#include "loom/data/dataset.h"
#include "loom/error.h"

namespace loom::data {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;
using testing::error_of;
using testing::TempDir;

// Every field of two batches, whole.
void expect_same_batch(const Batch& a, const Batch& b, const std::string& where) {
  ASSERT_EQ(a.tensors.size(), b.tensors.size()) << where;
  for (const auto& [name, t] : a.tensors) {
    ASSERT_TRUE(b.tensors.count(name)) << where << ": " << name;
    const at::Tensor& u = b.tensors.at(name);
    EXPECT_EQ(t.scalar_type(), u.scalar_type()) << where << ": " << name;
    EXPECT_EQ(t.sizes(), u.sizes()) << where << ": " << name;
    EXPECT_TRUE(at::equal(t, u)) << where << ": " << name;
  }
  EXPECT_EQ(a.strings, b.strings) << where;
  EXPECT_EQ(a.indices, b.indices) << where;
  EXPECT_EQ(a.num_real, b.num_real) << where;
  EXPECT_EQ(a.epoch, b.epoch) << where;
}

fs::path token_dataset(const TempDir& dir) {
  const fs::path path = dir.path() / "tokens";
  TokenDatasetWriter writer(path, {.vocab_size = 1000, .eos_id = 0, .tokens_per_shard = 300});
  std::mt19937 random(7);
  for (int d = 0; d < 40; ++d) {
    std::vector<uint32_t> doc(5 + random() % 30);
    for (uint32_t& t : doc) t = 1 + random() % 999;
    writer.add_document(doc);
  }
  writer.finish();
  return path;
}

// Records with text and a PNG image of a size of their own: strings, decoding, padding.
fs::path image_dataset(const TempDir& dir) {
  const fs::path path = dir.path() / "images";
  RecordDatasetWriter writer(path, {{.name = "caption", .type = FieldType::kText},
                                    {.name = "image", .type = FieldType::kImage},
                                    {.name = "label", .type = FieldType::kInt}});
  std::mt19937 random(11);
  for (int r = 0; r < 23; ++r) {
    const int h = 3 + r % 5, w = 2 + r % 7;
    std::vector<uint8_t> pixels(static_cast<size_t>(h * w * 3));
    for (uint8_t& p : pixels) p = static_cast<uint8_t>(random());
    writer.add(Record()
                   .text("caption " + std::to_string(r))
                   .image(image::encode_png(pixels.data(), h, w, 3))
                   .integer(r % 4));
  }
  writer.finish();
  return path;
}

ServiceReaderOptions replicas(const std::vector<const DataServer*>& servers) {
  ServiceReaderOptions o;
  for (const DataServer* s : servers) o.endpoints.push_back(s->address());
  return o;
}

TEST(DataService, BatchesEqualAReadersBitForBitAtEveryRankAcrossEpochsAndRestores) {
  TempDir dir;
  const DataServer a({.address = "127.0.0.1:0"});
  const DataServer b({.address = "127.0.0.1:0"});
  for (const bool images : {false, true}) {
    const fs::path dataset = images ? image_dataset(dir) : token_dataset(dir);
    for (int rank = 0; rank < 2; ++rank) {
      ReaderOptions options{.batch_size = 3,
                            .seq_len = images ? 0 : 8,
                            .seed = 5,
                            .rank = rank,
                            .world_size = 2,
                            .epoch_end = EpochEnd::kPad};
      Reader local(dataset, options);
      ServiceReader remote(dataset.string(), options, replicas({&a, &b}));
      EXPECT_EQ(remote.state_json(), local.state_json());
      const uint64_t steps = local.steps_per_epoch() * 2 + 1;  // into a third epoch
      std::vector<std::string> states;
      for (uint64_t s = 0; s < steps; ++s) {
        const std::string where = dataset.filename().string() + " rank " + std::to_string(rank) +
                                  " step " + std::to_string(s);
        expect_same_batch(local.next(), remote.next(), where);
        ASSERT_EQ(remote.state_json(), local.state_json()) << where;
        states.push_back(local.state_json());
      }
      // Back to an earlier position, as a resume does: the same batches again.
      remote.restore_json(states[2]);
      local.restore_json(states[2]);
      for (int s = 0; s < 4; ++s) expect_same_batch(local.next(), remote.next(), "restored");
      EXPECT_EQ(remote.stats().batches, static_cast<int64_t>(steps + 4));
      EXPECT_EQ(remote.stats().failovers, 0);
    }
  }
  // The requests went round both replicas: each opened at least one Reader per dataset and
  // rank (more when requests of one rank overlapped there: readers_per_client, 4), and
  // answered some of the batches.
  const DataServerStats sa = a.stats(), sb = b.stats();
  EXPECT_GE(sa.readers, 4);
  EXPECT_LE(sa.readers, 16);
  EXPECT_GE(sb.readers, 4);
  EXPECT_LE(sb.readers, 16);
  EXPECT_GT(sa.batches, 0);
  EXPECT_GT(sb.batches, 0);
}

TEST(DataService, AReplicaThatGoesAwayIsReplacedWithoutAChangeInTheBatches) {
  TempDir dir;
  const fs::path dataset = token_dataset(dir);
  auto a = std::make_unique<DataServer>(DataServerOptions{.address = "127.0.0.1:0"});
  const DataServer b({.address = "127.0.0.1:0"});
  const ReaderOptions options{.batch_size = 4, .seq_len = 6, .seed = 9};
  Reader local(dataset, options);
  ServiceReaderOptions service = replicas({a.get(), &b});
  service.request_timeout = milliseconds(5000);
  ServiceReader remote(dataset.string(), options, service);
  for (int s = 0; s < 3; ++s) expect_same_batch(local.next(), remote.next(), "before");
  a.reset();  // replica a is gone (its prefetched batch too)
  for (int s = 0; s < 5; ++s) expect_same_batch(local.next(), remote.next(), "after");
  EXPECT_EQ(remote.stats().replica, b.address());
  EXPECT_GE(remote.stats().failovers, 1);
  EXPECT_EQ(remote.state_json(), local.state_json());
}

TEST(DataService, AServiceGoneForGoodIsANamedErrorWithinTheDeadline) {
  TempDir dir;
  const fs::path dataset = token_dataset(dir);
  auto server = std::make_unique<DataServer>(DataServerOptions{.address = "127.0.0.1:0"});
  const std::string address = server->address();
  ServiceReaderOptions service{
      .endpoints = {address}, .service = "prep", .deadline = milliseconds(1500), .prefetch = 0};
  ServiceReader remote(dataset.string(), {.batch_size = 2, .seq_len = 4}, service);
  remote.next();
  server.reset();
  const auto start = std::chrono::steady_clock::now();
  const std::string error = error_of<CommError>([&] { remote.next(); });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 5.0);
  EXPECT_GE(seconds, 1.4);
  EXPECT_EQ(
      error.rfind("data service 'prep': no replica answered within 1500 ms; " + address + ": ", 0),
      0u)
      << error;
  EXPECT_TRUE(testing::contains(error,
                                ". Is the service running? Under `loom run`, its output is in "
                                "<run-dir>/logs/prep_<replica>.out"))
      << error;
}

TEST(DataService, BadDatasetsPositionsAndTokensAreTheServicesErrorNamed) {
  TempDir dir;
  const fs::path dataset = token_dataset(dir);
  const DataServer server({.address = "127.0.0.1:0", .token = "secret"});
  const std::string where = "data service 'data' replica " + server.address() + ": ";
  ServiceReaderOptions service{.endpoints = {server.address()}, .token = "secret"};

  // A dataset the service cannot open: the Reader's own error, at construction.
  const std::string missing = (dir.path() / "missing").string();
  const std::string error =
      error_of<IoError>([&] { ServiceReader(missing, {.batch_size = 1, .seq_len = 4}, service); });
  EXPECT_EQ(error.rfind(where, 0), 0u) << error;
  EXPECT_TRUE(testing::contains(error, missing)) << error;

  // Options the Reader refuses.
  EXPECT_EQ(error_of<InvalidArgument>([&] {
              ServiceReader(dataset.string(), {.batch_size = 0, .seq_len = 4}, service);
            }).rfind(where, 0),
            0u);

  // A position of another dataset version: the service's restore error, from next().
  ServiceReader remote(dataset.string(), {.batch_size = 1, .seq_len = 4}, service);
  SamplerState other = SamplerState::from_json(remote.state_json());
  other.dataset_version = "0123456789abcdef";
  remote.restore_json(other.to_json());
  const std::string restore = error_of<InvalidArgument>([&] { remote.next(); });
  EXPECT_EQ(restore.rfind(where, 0), 0u) << restore;
  EXPECT_TRUE(testing::contains(restore, "0123456789abcdef")) << restore;
  // Malformed JSON never leaves the trainer.
  error_of<CorruptData>([&] { remote.restore_json("{"); });

  // The wrong token.
  service.token = "guess";
  EXPECT_EQ(error_of<CommError>(
                [&] { ServiceReader(dataset.string(), {.batch_size = 1, .seq_len = 4}, service); }),
            where.substr(0, where.size() - 2) +
                " refused the job token: check LOOM_JOB_TOKEN (wrong or missing job token "
                "(loom-token))");
}

}  // namespace
}  // namespace loom::data

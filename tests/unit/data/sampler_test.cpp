// GlobalSampler: each epoch reads every sample once (less the dropped tail, or plus marked
// padding); a saved state resumes exactly, at the same or any other world size and batch
// size, including at the very end of an epoch; the state's JSON and its mismatch errors.

#include "loom/data/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "data/permutation.h"
#include "loom/error.h"

namespace loom::data {
namespace {

// All ranks of one job, stepped together as a training loop would.
class Job {
 public:
  Job(SamplerOptions options, int world_size) {
    options.world_size = world_size;
    for (int r = 0; r < world_size; ++r) {
      options.rank = r;
      ranks_.emplace_back(options);
    }
  }

  // One step on every rank; returns the ranks' batches in rank order and checks that all
  // ranks agree on where they are.
  std::vector<IndexBatch> step() {
    std::vector<IndexBatch> batches;
    for (auto& rank : ranks_) batches.push_back(rank.next_batch());
    for (const auto& rank : ranks_) EXPECT_EQ(rank.state(), ranks_[0].state());
    for (const auto& b : batches) {
      EXPECT_EQ(b.epoch, batches[0].epoch);
      EXPECT_EQ(b.position, batches[0].position);
    }
    return batches;
  }

  void restore(const SamplerState& state, RestoreOptions options = {}) {
    for (auto& rank : ranks_) rank.restore(state, options);
  }
  SamplerState state() const { return ranks_[0].state(); }
  const GlobalSampler& rank(int r) const { return ranks_[r]; }

 private:
  std::vector<GlobalSampler> ranks_;
};

// What one epoch handed out, as the global stream: real samples in the order of the
// epoch's permutation (steps in order, ranks in order within a step), padding apart.
struct EpochStream {
  std::vector<uint64_t> real;
  std::vector<uint64_t> padding;
};

// Steps job until it leaves `epoch`, appending that epoch's samples to stream.
void read_rest_of_epoch(Job& job, uint64_t epoch, EpochStream& stream) {
  while (job.state().epoch == epoch) {
    for (const IndexBatch& b : job.step()) {
      ASSERT_EQ(b.epoch, epoch);
      stream.real.insert(stream.real.end(), b.indices.begin(), b.indices.begin() + b.num_real);
      stream.padding.insert(stream.padding.end(), b.indices.begin() + b.num_real, b.indices.end());
    }
  }
}

// The first count elements of epoch's order: what a stream must equal.
std::vector<uint64_t> order_prefix(const SamplerOptions& o, uint64_t epoch, uint64_t count) {
  const Permutation order(o.num_samples, o.seed, epoch);
  std::vector<uint64_t> out;
  for (uint64_t i = 0; i < count; ++i) out.push_back(order.at(i % o.num_samples));
  return out;
}

bool all_distinct(std::vector<uint64_t> v) {
  std::sort(v.begin(), v.end());
  return std::adjacent_find(v.begin(), v.end()) == v.end();
}

SamplerOptions options(uint64_t n, uint64_t per_rank, EpochEnd end) {
  SamplerOptions o;
  o.num_samples = n;
  o.seed = 2024;
  o.per_rank_batch = per_rank;
  o.epoch_end = end;
  o.dataset_version = "corpus-v1";
  return o;
}

TEST(GlobalSamplerTest, DropLastEpochReadsEverySampleOnceExceptTheTail) {
  const SamplerOptions o = options(103, 4, EpochEnd::kDropLast);  // 3 ranks: G = 12, 8 steps
  Job job(o, 3);
  EXPECT_EQ(job.rank(0).steps_per_epoch(), 8u);
  for (uint64_t epoch = 0; epoch < 3; ++epoch) {
    EpochStream stream;
    read_rest_of_epoch(job, epoch, stream);
    EXPECT_EQ(stream.real, order_prefix(o, epoch, 96)) << "epoch " << epoch;
    EXPECT_TRUE(all_distinct(stream.real));
    EXPECT_TRUE(stream.padding.empty());
    EXPECT_EQ(job.state(), (SamplerState{"corpus-v1", 2024, epoch + 1, 0}));
  }
  // Each epoch drops different samples: the orders differ.
  EXPECT_NE(order_prefix(o, 0, 20), order_prefix(o, 1, 20));
}

TEST(GlobalSamplerTest, PadEpochReadsEverySampleOncePlusMarkedPadding) {
  const SamplerOptions o = options(103, 4, EpochEnd::kPad);  // G = 12: 9 steps, 5 padded
  Job job(o, 3);
  EXPECT_EQ(job.rank(0).steps_per_epoch(), 9u);
  for (uint64_t epoch = 0; epoch < 2; ++epoch) {
    EpochStream stream;
    read_rest_of_epoch(job, epoch, stream);
    EXPECT_EQ(stream.real, order_prefix(o, epoch, 103));
    // The padding repeats the start of the same epoch's order.
    EXPECT_EQ(stream.padding, order_prefix(o, epoch, 5));
  }
  // The last step of an epoch: rank 0 has 4 real, rank 1 has 3 real, rank 2 only padding.
  Job again(o, 3);
  for (int s = 0; s < 8; ++s) again.step();
  const std::vector<IndexBatch> last = again.step();
  EXPECT_EQ(last[0].num_real, 4u);
  EXPECT_EQ(last[1].num_real, 3u);
  EXPECT_EQ(last[2].num_real, 0u);
  EXPECT_EQ(last[2].indices.size(), 4u);
  EXPECT_EQ(last[0].position, 96u);
}

TEST(GlobalSamplerTest, PadWrapsWhenTheGlobalBatchExceedsTheDataset) {
  const SamplerOptions o = options(5, 4, EpochEnd::kPad);  // G = 12 > 5 samples
  Job job(o, 3);
  EpochStream stream;
  read_rest_of_epoch(job, 0, stream);
  EXPECT_EQ(stream.real, order_prefix(o, 0, 5));
  // Positions 5..11 wrap: the order's first five again, then its first two.
  const std::vector<uint64_t> wrapped = order_prefix(o, 0, 12);
  EXPECT_EQ(stream.padding, std::vector<uint64_t>(wrapped.begin() + 5, wrapped.end()));
  EXPECT_EQ(job.state().epoch, 1u);
}

// The worked example of docs/data-order.md, number for number.
TEST(GlobalSamplerTest, DocsWorkedExample) {
  using Indices = std::vector<uint64_t>;
  SamplerOptions o = options(10, 2, EpochEnd::kDropLast);
  o.seed = 42;
  EXPECT_EQ(order_prefix(o, 0, 10), (Indices{8, 7, 0, 1, 5, 3, 9, 2, 4, 6}));
  EXPECT_EQ(order_prefix(o, 1, 10), (Indices{4, 0, 7, 5, 2, 6, 1, 3, 9, 8}));

  for (EpochEnd end : {EpochEnd::kDropLast, EpochEnd::kPad}) {
    o.epoch_end = end;
    Job job(o, 2);
    auto step = job.step();
    EXPECT_EQ(step[0].indices, (Indices{8, 7}));
    EXPECT_EQ(step[1].indices, (Indices{0, 1}));
    const SamplerState after_step_0 = job.state();
    EXPECT_EQ(after_step_0.position, 4u);
    step = job.step();
    EXPECT_EQ(step[0].indices, (Indices{5, 3}));
    EXPECT_EQ(step[1].indices, (Indices{9, 2}));
    if (end == EpochEnd::kDropLast) {
      EXPECT_EQ(job.state(), (SamplerState{"corpus-v1", 42, 1, 0}));
    } else {
      EXPECT_EQ(job.state(), (SamplerState{"corpus-v1", 42, 0, 8}));
      step = job.step();
      EXPECT_EQ(step[0].indices, (Indices{4, 6}));
      EXPECT_EQ(step[0].num_real, 2u);
      EXPECT_EQ(step[1].indices, (Indices{8, 7}));
      EXPECT_EQ(step[1].num_real, 0u);
      EXPECT_EQ(job.state(), (SamplerState{"corpus-v1", 42, 1, 0}));
    }

    // Restart after step 0 with three ranks of one sample each.
    SamplerOptions three = o;
    three.per_rank_batch = 1;
    Job restarted(three, 3);
    restarted.restore(after_step_0);
    std::vector<Indices> got;
    for (int s = 0; s < 2; ++s) {
      Indices global;
      for (const IndexBatch& b : restarted.step()) global.push_back(b.indices[0]);
      got.push_back(global);
    }
    EXPECT_EQ(got, (std::vector<Indices>{{5, 3, 9}, {2, 4, 6}}));
    EXPECT_EQ(restarted.state(), (SamplerState{"corpus-v1", 42, 1, 0}));
  }
}

// The uninterrupted run, as each rank's batches per step.
std::vector<std::vector<IndexBatch>> run(Job& job, int steps) {
  std::vector<std::vector<IndexBatch>> out;
  for (int s = 0; s < steps; ++s) out.push_back(job.step());
  return out;
}

void expect_same(const std::vector<IndexBatch>& a, const std::vector<IndexBatch>& b, int step) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t r = 0; r < a.size(); ++r) {
    EXPECT_EQ(a[r].indices, b[r].indices) << "step " << step << " rank " << r;
    EXPECT_EQ(a[r].num_real, b[r].num_real) << "step " << step << " rank " << r;
    EXPECT_EQ(a[r].epoch, b[r].epoch) << "step " << step << " rank " << r;
  }
}

// Same world size: a state saved after any step (mid-epoch, at the last batch boundary, at
// the epoch's end) and restored through JSON in fresh samplers replays the rest exactly.
TEST(GlobalSamplerTest, ResumeAtTheSameWorldSizeReplaysExactly) {
  for (EpochEnd end : {EpochEnd::kDropLast, EpochEnd::kPad}) {
    const SamplerOptions o = options(103, 4, end);  // 8 (drop) or 9 (pad) steps per epoch
    const int total = 30;                           // a bit over three epochs
    Job reference(o, 3);
    const auto expected = run(reference, total);
    Job live(o, 3);
    for (int cut = 0; cut < total; ++cut) {
      const std::string saved = live.state().to_json();
      Job resumed(o, 3);
      resumed.restore(SamplerState::from_json(saved));
      for (int s = cut; s < std::min(total, cut + 10); ++s)
        expect_same(resumed.step(), expected[s], s);
      live.step();
    }
  }
}

// Another world size and per-rank batch after a cut: the stream of the interrupted epoch,
// before (old job) and after (new job), is exactly the epoch's order: nothing repeated,
// nothing skipped. Under drop_last only the tail the *new* global batch cannot fill is dropped.
void expect_exact_resume(const SamplerOptions& base, int world_before, uint64_t batch_before,
                         int world_after, uint64_t batch_after, int steps_before) {
  SamplerOptions before = base, after = base;
  before.per_rank_batch = batch_before;
  after.per_rank_batch = batch_after;
  Job old_job(before, world_before);
  // Move into epoch 1 first, so the interrupted epoch is not the first.
  EpochStream ignored;
  read_rest_of_epoch(old_job, 0, ignored);

  EpochStream stream;
  for (int s = 0; s < steps_before; ++s) {
    for (const IndexBatch& b : old_job.step()) {
      stream.real.insert(stream.real.end(), b.indices.begin(), b.indices.begin() + b.num_real);
    }
  }
  const SamplerState saved = old_job.state();
  ASSERT_EQ(saved.epoch, 1u);
  ASSERT_EQ(saved.position, steps_before * batch_before * world_before);

  Job new_job(after, world_after);
  new_job.restore(SamplerState::from_json(saved.to_json()));
  read_rest_of_epoch(new_job, 1, stream);

  const uint64_t n = base.num_samples;
  const uint64_t g_after = batch_after * world_after;
  const uint64_t left = n - saved.position;
  const uint64_t expected_count =
      base.epoch_end == EpochEnd::kPad ? n : saved.position + left / g_after * g_after;
  std::string what = "world " + std::to_string(world_before) + "x" + std::to_string(batch_before) +
                     " -> " + std::to_string(world_after) + "x" + std::to_string(batch_after) +
                     " after " + std::to_string(steps_before) + " steps";
  EXPECT_EQ(stream.real, order_prefix(base, 1, expected_count)) << what;
  EXPECT_TRUE(all_distinct(stream.real)) << what;
  EXPECT_EQ(new_job.state().epoch, 2u) << what;
}

TEST(GlobalSamplerTest, ResumeAtAnotherWorldSizeNeitherRepeatsNorSkips) {
  for (EpochEnd end : {EpochEnd::kDropLast, EpochEnd::kPad}) {
    const SamplerOptions o = options(1000, 1, end);
    for (int steps : {1, 5, 17}) {
      expect_exact_resume(o, 4, 8, 3, 5, steps);  // G 32 -> 15: positions not a multiple
      expect_exact_resume(o, 3, 5, 4, 8, steps);
      expect_exact_resume(o, 2, 8, 5, 8, steps);  // G 16 -> 40
      expect_exact_resume(o, 5, 8, 2, 8, steps);
      expect_exact_resume(o, 1, 7, 8, 3, steps);
    }
    // Late in the epoch (30 steps of 4 x 8 = 960; 40 left): a smaller global batch, and one
    // larger than what is left (drop_last ends the epoch at once, pad gives one padded step).
    expect_exact_resume(o, 4, 8, 2, 2, 30);
    expect_exact_resume(o, 4, 8, 5, 10, 30);
  }
}

// The end of an epoch, reached three ways, all continue with position 0 of the next epoch.
TEST(GlobalSamplerTest, ResumeAtTheEndOfAnEpoch) {
  const SamplerOptions o =
      options(100, 8, EpochEnd::kDropLast);  // 4 ranks: G 32, 3 steps, 4 dropped
  Job reference(o, 4);
  const auto expected = run(reference, 6);
  ASSERT_EQ(expected[3][0].epoch, 1u);
  ASSERT_EQ(expected[3][0].position, 0u);

  // 1. The state saved after the epoch's last batch already names the next epoch.
  Job live(o, 4);
  run(live, 3);
  EXPECT_EQ(live.state(), (SamplerState{"corpus-v1", 2024, 1, 0}));
  // 2. A state at the last batch boundary (position 96: only the dropped tail is left), as
  //    another tool or an older run may have saved it.
  // 3. A state at position == num_samples.
  for (const SamplerState& end :
       {SamplerState{"corpus-v1", 2024, 1, 0}, SamplerState{"corpus-v1", 2024, 0, 96},
        SamplerState{"corpus-v1", 2024, 0, 100}}) {
    Job resumed(o, 4);
    resumed.restore(end);
    EXPECT_EQ(resumed.state(), (SamplerState{"corpus-v1", 2024, 1, 0}));
    for (int s = 3; s < 6; ++s) expect_same(resumed.step(), expected[s], s);
  }

  // The same under padding: position 96 still has 4 real samples to give.
  SamplerOptions padded = o;
  padded.epoch_end = EpochEnd::kPad;
  Job pad_job(padded, 4);
  pad_job.restore({"corpus-v1", 2024, 0, 96});
  const auto last = pad_job.step();
  EXPECT_EQ(last[0].num_real, 4u);
  EXPECT_EQ(last[1].num_real, 0u);
  EXPECT_EQ(pad_job.state(), (SamplerState{"corpus-v1", 2024, 1, 0}));
  Job pad_end(padded, 4);
  pad_end.restore({"corpus-v1", 2024, 0, 100});
  EXPECT_EQ(pad_end.state(), (SamplerState{"corpus-v1", 2024, 1, 0}));
}

TEST(GlobalSamplerTest, StateJsonRoundTrips) {
  for (const SamplerState& s :
       {SamplerState{"corpus-v1", 0, 0, 0}, SamplerState{"", ~0ull, ~0ull, (1ull << 63)},
        SamplerState{"v \"2\" \xC3\xA9\n", 12345678901234567890ull, 3, 77}}) {
    const std::string json = s.to_json();
    EXPECT_EQ(SamplerState::from_json(json), s) << json;
  }
  EXPECT_NE(SamplerState{}.to_json().find("\"algorithm\":\"feistel8-splitmix64-v1\""),
            std::string::npos);
}

TEST(GlobalSamplerTest, BadStateJsonIsCorruptDataAndAnotherAlgorithmIsRefused) {
  // A state object with the current algorithm and the given fields.
  auto state_json = [](const std::string& fields) {
    return R"({"algorithm":"feistel8-splitmix64-v1",)" + fields + "}";
  };
  EXPECT_EQ(SamplerState::from_json(
                state_json(R"("dataset_version":"v","seed":1,"epoch":2,"position":3)")),
            (SamplerState{"v", 1, 2, 3}));
  const std::vector<std::string> bad = {
      "{not json",
      "[1, 2]",
      state_json(R"("seed":1,"epoch":2,"position":3)"),                          // no version
      state_json(R"("dataset_version":"v","seed":-1,"epoch":2,"position":3)"),   // negative
      state_json(R"("dataset_version":"v","seed":1,"epoch":2.5,"position":3)"),  // fraction
      state_json(R"("dataset_version":7,"seed":1,"epoch":2,"position":3)"),      // not a string
      state_json(R"("dataset_version":"v","seed":1,"epoch":2,"position":"3")"),  // not a number
      R"({"dataset_version":"v","seed":1,"epoch":2,"position":3})",              // no algorithm
  };
  for (const std::string& text : bad) {
    EXPECT_THROW(SamplerState::from_json(text), CorruptData) << text;
  }
  try {
    SamplerState::from_json(
        R"({"algorithm":"other-v9","dataset_version":"v","seed":1,"epoch":2,"position":3})");
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("other-v9"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("feistel8-splitmix64-v1"), std::string::npos);
  }
}

// The message of the InvalidArgument that restore throws.
std::string restore_error(GlobalSampler& sampler, const SamplerState& state,
                          RestoreOptions options = {}) {
  try {
    sampler.restore(state, options);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(GlobalSamplerTest, VersionAndSeedMismatchesAreInvalidArgumentNamingBoth) {
  GlobalSampler sampler(options(100, 4, EpochEnd::kDropLast));
  const std::string version_error = restore_error(sampler, {"corpus-v0", 2024, 3, 40});
  EXPECT_NE(version_error.find("corpus-v0"), std::string::npos) << version_error;
  EXPECT_NE(version_error.find("corpus-v1"), std::string::npos) << version_error;
  EXPECT_NE(version_error.find("allow_version_change"), std::string::npos) << version_error;

  const std::string seed_error = restore_error(sampler, {"corpus-v1", 7, 3, 40});
  EXPECT_NE(seed_error.find("7"), std::string::npos) << seed_error;
  EXPECT_NE(seed_error.find("2024"), std::string::npos) << seed_error;
  // A refused state leaves the sampler where it was.
  EXPECT_EQ(sampler.state(), (SamplerState{"corpus-v1", 2024, 0, 0}));

  EXPECT_NE(restore_error(sampler, {"corpus-v1", 2024, 3, 101}), "");  // past the end

  // Explicitly allowed: the epoch and position carry over, the version becomes the sampler's.
  EXPECT_EQ(restore_error(sampler, {"corpus-v0", 2024, 3, 40}, {true}), "");
  EXPECT_EQ(sampler.state(), (SamplerState{"corpus-v1", 2024, 3, 40}));
  // A position beyond a dataset that shrank ends that epoch.
  EXPECT_EQ(restore_error(sampler, {"corpus-v0", 2024, 3, 500}, {true}), "");
  EXPECT_EQ(sampler.state(), (SamplerState{"corpus-v1", 2024, 4, 0}));
}

TEST(GlobalSamplerTest, BadOptionsAreInvalidArgument) {
  SamplerOptions o = options(100, 4, EpochEnd::kDropLast);
  o.world_size = 4;
  o.rank = 4;
  EXPECT_THROW(GlobalSampler{o}, InvalidArgument);
  o.rank = -1;
  EXPECT_THROW(GlobalSampler{o}, InvalidArgument);
  o.rank = 0;
  o.world_size = 0;
  EXPECT_THROW(GlobalSampler{o}, InvalidArgument);
  o.world_size = 4;
  o.per_rank_batch = 0;
  EXPECT_THROW(GlobalSampler{o}, InvalidArgument);
  o.per_rank_batch = 26;  // G = 104 > 100: no full batch under drop_last
  EXPECT_THROW(GlobalSampler{o}, InvalidArgument);
  o.epoch_end = EpochEnd::kPad;  // fine with padding
  EXPECT_NO_THROW(GlobalSampler{o});
  o.num_samples = 0;
  EXPECT_THROW(GlobalSampler{o}, InvalidArgument);
  o.num_samples = (1ull << 63) + 1;
  EXPECT_THROW(GlobalSampler{o}, InvalidArgument);
  o.num_samples = 1ull << 63;
  o.per_rank_batch = 1ull << 62;  // G = 2^64 overflows
  EXPECT_THROW(GlobalSampler{o}, InvalidArgument);
}

// The largest dataset: positions near 2^63 neither overflow nor leave the range.
TEST(GlobalSamplerTest, HugeDatasetsWork) {
  SamplerOptions o = options(1ull << 63, 3, EpochEnd::kPad);
  o.world_size = 2;
  o.rank = 1;
  GlobalSampler sampler(o);
  sampler.restore({"corpus-v1", 2024, 5, (1ull << 63) - 4});
  const IndexBatch b =
      sampler.next_batch();  // global positions 2^63 - 4 .. 2^63 + 1; rank 1: last 3
  EXPECT_EQ(b.num_real, 1u);
  const Permutation order(1ull << 63, 2024, 5);
  EXPECT_EQ(b.indices[0], order.at((1ull << 63) - 1));
  EXPECT_EQ(b.indices[1], order.at(0));
  EXPECT_EQ(b.indices[2], order.at(1));
  EXPECT_EQ(sampler.state(), (SamplerState{"corpus-v1", 2024, 6, 0}));
}

}  // namespace
}  // namespace loom::data

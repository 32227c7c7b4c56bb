// The public inspection API (loom/ckpt/inspect.h) on checkpoints two ranks saved: the summary
// of a step against what was saved, field by field; verification of intact and corrupted
// steps; uncommitted directories; and the errors for steps that are not committed.
#include "loom/ckpt/inspect.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <fstream>
#include <map>

#include "harness/harness.h"
#include "loom/ckpt/checkpointer.h"
#include "loom/comm/store.h"
#include "loom/error.h"

namespace loom::ckpt {
namespace {

using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::expect_all_ok;
using loom::testing::run_threads;
using loom::testing::TempDir;

// Two ranks save `step`: a replicated fp32 [4, 3], rows of an int64 [6, 2] split 4 + 2, and a
// flat bf16 [10] split 7 + 3, plus one blob.
void save_step(const std::filesystem::path& dir, int64_t step) {
  comm::InMemoryStore store;
  expect_all_ok(run_threads(2, [&](loom::testing::Rank& r) {
    Checkpointer ckpt(store, {.dir = dir, .rank = r.rank, .world_size = 2});
    State s;
    s.add("model/rep", torch::arange(12, torch::kFloat32).reshape({4, 3}));
    const int64_t rb = r.rank == 0 ? 0 : 4, re = r.rank == 0 ? 4 : 6;
    s.add("model/rows", torch::arange(rb * 2, re * 2, torch::kInt64).reshape({re - rb, 2}),
          Sharding::rows({6, 2}, rb, re));
    const int64_t fb = r.rank == 0 ? 0 : 7, fe = r.rank == 0 ? 7 : 10;
    s.add("optim/flat", torch::arange(fb, fe, torch::kFloat32).to(torch::kBFloat16),
          Sharding::flat({10}, fb, fe));
    s.blobs["trainer"] = R"({"step":3})";
    ckpt.save_sync(step, s);
  }));
}

TEST(CheckpointInspection, DescribeStepSummarisesEveryTensorAndBlob) {
  TempDir dir;
  save_step(dir.path(), 3);
  const StepSummary s = describe_step(dir.path(), 3);
  EXPECT_EQ(s.step, 3);
  EXPECT_EQ(s.path, step_path(dir.path(), 3));
  EXPECT_EQ(s.path, dir / "step_00000003");
  EXPECT_EQ(s.world_size, 2);
  EXPECT_EQ(s.files, 2u);
  uint64_t on_disk = 0;
  for (const auto& entry : std::filesystem::directory_iterator(s.path))
    if (entry.path().extension() == ".data") on_disk += entry.file_size();
  EXPECT_EQ(s.bytes, on_disk);
  ASSERT_EQ(s.tensors.size(), 3u);
  struct Want {
    const char* name;
    const char* dtype;
    std::vector<int64_t> shape;
    const char* kind;
    size_t pieces;
    uint64_t bytes;
  };
  // The replicated tensor is written by one rank; the others by both.
  const Want want[] = {{"model/rep", "float32", {4, 3}, "replicated", 1, 48},
                       {"model/rows", "int64", {6, 2}, "rows", 2, 96},
                       {"optim/flat", "bfloat16", {10}, "flat", 2, 20}};
  for (const Want& w : want) {
    auto it = std::find_if(s.tensors.begin(), s.tensors.end(),
                           [&](const TensorSummary& t) { return t.name == w.name; });
    ASSERT_NE(it, s.tensors.end()) << w.name;
    EXPECT_EQ(it->dtype, w.dtype) << w.name;
    EXPECT_EQ(it->shape, w.shape) << w.name;
    EXPECT_EQ(it->kind, w.kind) << w.name;
    EXPECT_EQ(it->pieces, w.pieces) << w.name;
    EXPECT_EQ(it->bytes, w.bytes) << w.name;
  }
  EXPECT_EQ(s.blobs, (std::map<std::string, std::string>{{"trainer", R"({"step":3})"}}));
}

TEST(CheckpointInspection, VerifyReadsEveryByteAndNamesACorruptTensor) {
  TempDir dir;
  save_step(dir.path(), 3);
  EXPECT_EQ(verify_step(dir.path(), 3), 48u + 96u + 20u);
  // Flip the last byte of rank 1's data file: the end of its piece of the flat bf16 tensor,
  // the last one it wrote.
  const auto file = step_path(dir.path(), 3) / "rank_00001.data";
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(-1, std::ios::end);
  char byte = 0;
  f.get(byte);
  f.seekp(-1, std::ios::end);
  f.put(static_cast<char>(byte ^ 0x5a));
  f.close();
  const std::string message = error_of<CorruptData>([&] { verify_step(dir.path(), 3); });
  EXPECT_TRUE(contains(message, "rank_00001.data")) << message;
  EXPECT_TRUE(contains(message, "optim/flat")) << message;
}

TEST(CheckpointInspection, ListsCommittedStepsAndUncommittedDirectories) {
  TempDir dir;
  EXPECT_TRUE(committed_steps(dir / "missing").empty());
  save_step(dir.path(), 3);
  save_step(dir.path(), 10);
  std::filesystem::create_directories(step_path(dir.path(), 12));  // a save cut short
  EXPECT_EQ(committed_steps(dir.path()), (std::vector<int64_t>{3, 10}));
  EXPECT_EQ(uncommitted_dirs(dir.path()),
            std::vector<std::filesystem::path>{step_path(dir.path(), 12)});
}

TEST(CheckpointInspection, AStepThatIsNotCommittedIsIoErrorNamingTheManifest) {
  TempDir dir;
  std::filesystem::create_directories(step_path(dir.path(), 12));
  for (int64_t step : {12, 13}) {
    std::string message = error_of<IoError>([&] { describe_step(dir.path(), step); });
    EXPECT_TRUE(contains(message, (step_path(dir.path(), step) / "manifest.json").string()))
        << message;
    message = error_of<IoError>([&] { verify_step(dir.path(), step); });
    EXPECT_TRUE(contains(message, "manifest.json")) << message;
  }
}

TEST(CheckpointInspection, AMalformedManifestIsCorruptDataNamingIt) {
  TempDir dir;
  save_step(dir.path(), 3);
  std::ofstream(step_path(dir.path(), 3) / "manifest.json") << "{\"step\": 3,";
  const std::string message = error_of<CorruptData>([&] { describe_step(dir.path(), 3); });
  EXPECT_TRUE(contains(message, "manifest.json")) << message;
}

}  // namespace
}  // namespace loom::ckpt

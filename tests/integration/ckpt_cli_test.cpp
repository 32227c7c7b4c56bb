// The built `loom ckpt ls|verify|show` as a user runs it: listings, a verification that passes,
// one that names the corrupt tensor and file (exit 1), and bad input (exit 2).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "harness/harness.h"
#include "loom/ckpt/checkpointer.h"
#include "loom/comm/store.h"
#include "util/files.h"

namespace loom {
namespace {

using testing::contains;
using testing::run_loom;

std::filesystem::path make_checkpoints(const testing::TempDir& dir) {
  comm::InMemoryStore store;
  ckpt::Checkpointer ckpt(store, {.dir = dir / "ckpt"});
  ckpt::State s;
  s.add("model.w", torch::ones({256, 4}));
  s.add("adam.m", torch::zeros({512}), ckpt::Sharding::flat({512}, 0, 512));
  s.blobs["reader"] = R"({"epoch":2,"position":4096})";
  ckpt.save_sync(100, s);
  ckpt.save_sync(200, s);
  std::filesystem::create_directories(dir / "ckpt" / "step_00000300");  // interrupted
  return dir / "ckpt";
}

TEST(CkptCli, LsListsCommittedStepsOnly) {
  testing::TempDir dir;
  auto ckpt = make_checkpoints(dir);
  auto run = run_loom(dir, {"ckpt", "ls", ckpt.string()});
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_TRUE(contains(run.output, "step_00000100")) << run.output;
  EXPECT_TRUE(contains(run.output, "step_00000200")) << run.output;
  EXPECT_FALSE(contains(run.output, "step_00000300")) << run.output;
  EXPECT_TRUE(contains(run.output, "1 directory without a manifest")) << run.output;
}

TEST(CkptCli, ShowPrintsTensorsAndMetadata) {
  testing::TempDir dir;
  auto ckpt = make_checkpoints(dir);
  auto run = run_loom(dir, {"ckpt", "show", ckpt.string(), "100"});
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_TRUE(contains(run.output, "step 100")) << run.output;
  EXPECT_TRUE(contains(run.output, "model.w")) << run.output;
  EXPECT_TRUE(contains(run.output, "[256, 4]")) << run.output;
  EXPECT_TRUE(contains(run.output, "flat")) << run.output;
  EXPECT_TRUE(contains(run.output, R"(reader = {"epoch":2,"position":4096})")) << run.output;
}

TEST(CkptCli, VerifyPassesThenNamesTheCorruptTensorAndFile) {
  testing::TempDir dir;
  auto ckpt = make_checkpoints(dir);
  auto run = run_loom(dir, {"ckpt", "verify", ckpt.string()});
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_TRUE(contains(run.output, "step 200: 2 tensors")) << run.output;
  EXPECT_TRUE(contains(run.output, "every hash matches")) << run.output;

  const auto file = ckpt / "step_00000200" / "rank_00000.data";
  int fd = ::open(file.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  char c = 0;
  ASSERT_EQ(::pread(fd, &c, 1, 10), 1);
  c ^= 1;
  ASSERT_EQ(::pwrite(fd, &c, 1, 10), 1);
  ::close(fd);
  run = run_loom(dir, {"ckpt", "verify", ckpt.string(), "200"});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_TRUE(contains(run.output, "CORRUPT")) << run.output;
  EXPECT_TRUE(contains(run.output, "\"model.w\"")) << run.output;
  EXPECT_TRUE(contains(run.output, file.string())) << run.output;
  EXPECT_EQ(run_loom(dir, {"ckpt", "verify", ckpt.string(), "100"}).exit_code, 0);
}

TEST(CkptCli, VerifyRefusesAManifestPointingOutsideItsDirectory) {
  testing::TempDir dir;
  auto ckpt = make_checkpoints(dir);
  const auto manifest = ckpt / "step_00000200" / "manifest.json";
  auto j = nlohmann::json::parse(util::read_file(manifest));
  j["files"][0]["name"] = "../../../etc/hostname";
  for (auto& t : j["tensors"])
    for (auto& p : t["pieces"]) p["file"] = "../../../etc/hostname";
  util::write_file_atomic(manifest, j.dump(1));
  auto run = run_loom(dir, {"ckpt", "verify", ckpt.string(), "200"});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_TRUE(contains(run.output, "CORRUPT")) << run.output;
  EXPECT_TRUE(contains(run.output, manifest.string())) << run.output;
  EXPECT_TRUE(contains(run.output, "\"../../../etc/hostname\" is not a plain file name"))
      << run.output;
  EXPECT_FALSE(contains(run.output, "/etc/hostname is truncated")) << run.output;
}

TEST(CkptCli, BadInputExitsTwo) {
  testing::TempDir dir;
  auto ckpt = make_checkpoints(dir);
  EXPECT_EQ(run_loom(dir, {"ckpt", "verify", (dir / "nope").string()}).exit_code, 2);
  auto run = run_loom(dir, {"ckpt", "show", ckpt.string(), "300"});
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_TRUE(contains(run.output, "not a committed checkpoint")) << run.output;
}

}  // namespace
}  // namespace loom

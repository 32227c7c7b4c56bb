// Reading committed steps: corruption (a flipped byte, a truncated file) is CorruptData naming
// tensor and file, from verify and from load; load_latest_valid falls back past it; a rank
// reads only the byte ranges it needs.
#include "ckpt/reader.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include "faulty_storage.h"
#include "harness/harness.h"
#include "loom/ckpt/checkpointer.h"
#include "loom/comm/store.h"
#include "loom/error.h"

namespace loom::ckpt {
namespace {

using loom::testing::error_of;
using loom::testing::TempDir;

State two_tensors() {
  State s;
  s.add("model.w", torch::arange(1000, torch::kFloat32));
  s.add("model.b", torch::arange(10, torch::kFloat32));
  return s;
}

State zeros_like_two() {
  State s;
  s.add("model.w", torch::zeros({1000}));
  s.add("model.b", torch::zeros({10}));
  return s;
}

void flip_byte(const std::filesystem::path& path, off_t offset) {
  int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  char c = 0;
  ASSERT_EQ(::pread(fd, &c, 1, offset), 1);
  c ^= 0x10;
  ASSERT_EQ(::pwrite(fd, &c, 1, offset), 1);
  ::close(fd);
}

class ReaderCorruption : public ::testing::Test {
 protected:
  void SetUp() override {
    Checkpointer ckpt(store_, options());
    ckpt.save_sync(1, two_tensors());
    ckpt.save_sync(2, two_tensors());
  }
  CheckpointerOptions options() { return {.dir = dir_.path(), .hash_chunk_bytes = 256}; }
  std::filesystem::path data_file(int step) {
    return dir_ / (step_dir_name(step) + "/rank_00000.data");
  }
  // The byte offset of tensor `name`'s piece in step 2's file.
  uint64_t offset_of(const std::string& name) {
    return read_manifest(dir_ / step_dir_name(2)).find(name)->pieces[0].offset;
  }

  TempDir dir_;
  comm::InMemoryStore store_;
};

TEST_F(ReaderCorruption, FlippedByteIsCorruptDataNamingTensorAndFile) {
  flip_byte(data_file(2), static_cast<off_t>(offset_of("model.w") + 700));
  Checkpointer ckpt(store_, options());
  std::string message = error_of<CorruptData>([&] { ckpt.verify(2); });
  EXPECT_NE(message.find("\"model.w\""), std::string::npos) << message;
  EXPECT_NE(message.find(data_file(2).string()), std::string::npos) << message;

  State s = zeros_like_two();
  message = error_of<CorruptData>([&] { ckpt.load(s); });
  EXPECT_NE(message.find("\"model.w\""), std::string::npos) << message;
  EXPECT_NE(message.find("rank_00000.data"), std::string::npos) << message;

  // Without verification the bad byte is read as it is.
  ckpt.load(2, s, {.verify = false});
  // load_latest_valid falls back to step 1, and only when asked.
  EXPECT_EQ(ckpt.load_latest_valid(s), 1);
  EXPECT_TRUE(torch::equal(s.tensors[0].tensor, torch::arange(1000, torch::kFloat32)));
}

TEST_F(ReaderCorruption, TruncatedFileIsCorruptDataNamingTensorAndFile) {
  std::filesystem::resize_file(data_file(2), offset_of("model.w") + 100);
  Checkpointer ckpt(store_, options());
  std::string message = error_of<CorruptData>([&] { ckpt.verify(2); });
  EXPECT_NE(message.find("truncated"), std::string::npos) << message;
  EXPECT_NE(message.find(data_file(2).string()), std::string::npos) << message;
  EXPECT_NE(message.find("\"model."), std::string::npos) << message;
  State s = zeros_like_two();
  message = error_of<CorruptData>([&] { ckpt.load(s); });
  EXPECT_NE(message.find("truncated"), std::string::npos) << message;
  EXPECT_EQ(ckpt.load_latest_valid(s), 1);
}

TEST_F(ReaderCorruption, MissingDataFileFallsBack) {
  std::filesystem::remove(data_file(2));
  Checkpointer ckpt(store_, options());
  State s = zeros_like_two();
  EXPECT_THROW(ckpt.load(s), IoError);
  EXPECT_EQ(ckpt.load_latest_valid(s), 1);
}

TEST(Reader, ARankReadsOnlyTheBytesItNeeds) {
  TempDir dir;
  comm::InMemoryStore store;
  const int64_t n = 1 << 20;  // 4 MiB of float32
  {
    Checkpointer ckpt(store, {.dir = dir.path(), .hash_chunk_bytes = 64 << 10});
    State s;
    s.add("w", torch::randn({n}));
    ckpt.save_sync(1, s);
  }
  auto storage = std::make_shared<testing::FaultyStorage>();
  // Rank 1 of 4 at load: a quarter of the tensor, plus at most two partly wanted chunks.
  Checkpointer ckpt(store, {.dir = dir.path(), .rank = 1, .world_size = 4}, storage);
  State s;
  s.add("w", torch::zeros({n / 4}), Sharding::flat({n}, n / 4 + 10, n / 2 + 10));
  ckpt.load(s);
  EXPECT_LE(storage->bytes_read.load(), n + 2 * (64 << 10));
  EXPECT_GE(storage->bytes_read.load(), n);
  storage->bytes_read = 0;
  ckpt.load(1, s, {.verify = false});
  EXPECT_EQ(storage->bytes_read.load(), n);  // exactly the wanted bytes
}

}  // namespace
}  // namespace loom::ckpt

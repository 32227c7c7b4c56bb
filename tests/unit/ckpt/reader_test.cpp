// Reading committed steps: corruption (a flipped byte, a truncated file) is CorruptData naming
// tensor and file, from verify and from load; load_latest_valid falls back past it; a rank
// reads only the byte ranges it needs.
#include "ckpt/reader.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include "faulty_storage.h"
#include "harness/harness.h"
#include "loom/ckpt/checkpointer.h"
#include "loom/comm/store.h"
#include "loom/error.h"
#include "util/files.h"
#include "util/hash.h"

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

// A hostile or damaged manifest: step 2's manifest.json edited by `edit`, then verify and
// load must both refuse it with CorruptData naming the manifest, before opening or
// allocating anything the manifest's numbers ask for.
class HostileManifest : public ReaderCorruption {
 protected:
  // Replaces step 2's manifest by the saved one changed by `change` (each edit starts afresh).
  void edit(const std::function<void(nlohmann::json&)>& change) {
    const auto path = dir_ / step_dir_name(2) / kManifestName;
    if (original_.empty()) original_ = util::read_file(path);
    nlohmann::json j = nlohmann::json::parse(original_);
    change(j);
    util::write_file_atomic(path, j.dump(1));
  }
  // The CorruptData message of verify(2), after checking that load(2) fails the same way.
  std::string refused() {
    Checkpointer ckpt(store_, options());
    State s = zeros_like_two();
    const std::string load = error_of<CorruptData>([&] { ckpt.load(2, s); });
    EXPECT_NE(load.find("manifest.json"), std::string::npos) << load;
    return error_of<CorruptData>([&] { ckpt.verify(2); });
  }
  static nlohmann::json& piece(nlohmann::json& j, const std::string& tensor) {
    for (auto& t : j["tensors"])
      if (t["name"] == tensor) return t["pieces"][0];
    throw std::logic_error("no tensor " + tensor);
  }
  std::string original_;
};

TEST_F(HostileManifest, AFileNameOutsideTheStepDirectoryIsRefused) {
  for (const std::string& name :
       std::vector<std::string>{"../../../etc/hostname", "/etc/hostname", "..", ".hidden", "",
                                std::string("rank_00000.data\0x", 17), "a/b"}) {
    SCOPED_TRACE(name);
    edit([&](nlohmann::json& j) { piece(j, "model.w")["file"] = name; });
    std::string message = refused();
    EXPECT_NE(message.find("manifest.json"), std::string::npos) << message;
    EXPECT_NE(message.find("is not a plain file name"), std::string::npos) << message;
    if (name == "../../../etc/hostname") {
      EXPECT_NE(message.find("\"../../../etc/hostname\""), std::string::npos) << message;
    }
  }
  edit([](nlohmann::json& j) { j["files"][0]["name"] = "../../../etc/hostname"; });
  std::string message = refused();
  EXPECT_NE(message.find("\"../../../etc/hostname\" is not a plain file name"), std::string::npos)
      << message;
}

TEST_F(HostileManifest, AnOversizedPieceIsRefusedBeforeAnythingIsAllocated) {
  // 2^60 bytes in one chunk of 2^60: consistent hashes, but nothing of that size exists.
  edit([](nlohmann::json& j) {
    auto& p = piece(j, "model.w");
    p["bytes"] = uint64_t{1} << 60;
    p["chunk_bytes"] = uint64_t{1} << 60;
    p["chunk_xxh64"] = {p["chunk_xxh64"][0]};
  });
  std::string message = refused();
  EXPECT_NE(message.find("1152921504606846976 bytes"), std::string::npos) << message;
  // A chunk size of 2^60 over the right byte count: the reader must not size a buffer by it.
  edit([](nlohmann::json& j) {
    auto& p = piece(j, "model.w");
    p["chunk_bytes"] = uint64_t{1} << 60;
    p["chunk_xxh64"] = {p["chunk_xxh64"][0]};
  });
  Checkpointer ckpt(store_, options());
  State part;  // a part of the chunk: read through the reader's scratch buffer
  part.add("model.w", torch::zeros({500}), Sharding::flat({1000}, 10, 510));
  part.add("model.b", torch::zeros({10}));
  // The hashes no longer match (one chunk hash for 4000 bytes): CorruptData, not bad_alloc.
  EXPECT_NE(error_of<CorruptData>([&] { ckpt.load(2, part); }).find("\"model.w\" is corrupt"),
            std::string::npos);
  EXPECT_THROW(ckpt.verify(2), CorruptData);
}

TEST_F(HostileManifest, InconsistentNumbersAreRefused) {
  const std::vector<std::function<void(nlohmann::json&)>> edits = {
      // fewer bytes than the elements need: the reader would index past the chunk hashes
      [](nlohmann::json& j) {
        auto& p = piece(j, "model.w");
        p["bytes"] = 256;
        p["chunk_xxh64"] = {p["chunk_xxh64"][0]};
      },
      // elements past the end of the tensor
      [](nlohmann::json& j) { piece(j, "model.b")["end"] = 11; },
      // an offset that wraps around with the byte count
      [](nlohmann::json& j) { piece(j, "model.b")["offset"] = UINT64_MAX - 8; },
      // a negative dimension, a shape whose element count overflows, an unknown dtype
      [](nlohmann::json& j) { j["tensors"][0]["shape"] = {-1000}; },
      [](nlohmann::json& j) {
        j["tensors"][0]["shape"] = {INT64_MAX, 4};
      },
      [](nlohmann::json& j) { j["tensors"][0]["dtype"] = "float33"; },
      // wrong JSON types
      [](nlohmann::json& j) { piece(j, "model.w")["bytes"] = "4000"; },
      [](nlohmann::json& j) { j["tensors"][0]["shape"] = "1000"; },
      [](nlohmann::json& j) { j["files"] = 3; },
      [](nlohmann::json& j) { piece(j, "model.w")["begin"] = -1; },
  };
  for (size_t i = 0; i < edits.size(); ++i) {
    SCOPED_TRACE(i);
    edit(edits[i]);
    std::string message = refused();
    EXPECT_NE(message.find("manifest.json"), std::string::npos) << message;
  }
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
  // The manifest is read through the storage too.
  const auto manifest_bytes =
      static_cast<int64_t>(std::filesystem::file_size(dir / "step_00000001" / "manifest.json"));
  ckpt.load(s);
  EXPECT_LE(storage->bytes_read.load(), manifest_bytes + n + 2 * (64 << 10));
  EXPECT_GE(storage->bytes_read.load(), manifest_bytes + n);
  storage->bytes_read = 0;
  ckpt.load(1, s, {.verify = false});
  EXPECT_EQ(storage->bytes_read.load(), manifest_bytes + n);  // exactly the wanted bytes
}

// The read pipeline with every relation of chunk size to read size (chunks inside one read,
// a chunk spanning several reads), reads on the I/O threads (>= 256 KiB) and inline, direct and
// buffered, whole and resharded: bitwise what was saved.
TEST(Reader, PipelinedReadsReturnExactlyTheSavedBytes) {
  torch::manual_seed(3);
  const torch::Tensor big = torch::randn({(3 << 20) / 4 + 777});  // ~3 MiB, not a 4 KiB multiple
  const torch::Tensor small = torch::arange(3000, torch::kInt16);
  struct Sizes {
    size_t chunk, read;
  };
  for (const Sizes sizes : {Sizes{64 << 10, 1 << 20}, Sizes{1 << 20, 256 << 10},
                            Sizes{1000, 256 << 10}, Sizes{4 << 20, 8 << 20}}) {
    SCOPED_TRACE(::testing::Message() << "chunk " << sizes.chunk << ", read " << sizes.read);
    TempDir dir;
    comm::InMemoryStore store;
    const CheckpointerOptions options{
        .dir = dir.path(), .read_bytes = sizes.read, .hash_chunk_bytes = sizes.chunk};
    {
      Checkpointer ckpt(store, options);
      State s;
      s.add("big", big.clone());
      s.add("small", small.clone());
      ckpt.save_sync(1, s);
    }
    for (bool verify : {true, false}) {
      Checkpointer ckpt(store, options);
      State whole;
      whole.add("big", torch::zeros_like(big));
      whole.add("small", torch::zeros_like(small));
      ckpt.load(1, whole, {.verify = verify});
      EXPECT_TRUE(torch::equal(whole.tensors[0].tensor, big));
      EXPECT_TRUE(torch::equal(whole.tensors[1].tensor, small));
      // Rank 1 of 3: a slice that starts and ends inside chunks.
      const int64_t n = big.numel(), b = n / 3 + 5, e = 2 * n / 3 - 3;
      Checkpointer rank1(store, {.dir = dir.path(),
                                 .rank = 1,
                                 .world_size = 3,
                                 .read_bytes = sizes.read,
                                 .hash_chunk_bytes = sizes.chunk});
      State part;
      part.add("big", torch::zeros({e - b}), Sharding::flat({n}, b, e));
      rank1.load(1, part, {.verify = verify, .leave_out = {"small"}});
      EXPECT_TRUE(torch::equal(part.tensors[0].tensor, big.slice(0, b, e)));
    }
  }
}

// A corrupt byte is found and named the same way whether its chunk spans several reads
// (hashed by the loading thread) or lies inside one (hashed on an I/O thread).
TEST(Reader, ACorruptChunkIsCorruptDataWhereverItIsHashed) {
  struct Sizes {
    uint64_t chunk, read;
  };
  for (const Sizes sizes : {Sizes{1 << 20, 256 << 10}, Sizes{64 << 10, 256 << 10}}) {
    SCOPED_TRACE(::testing::Message() << "chunk " << sizes.chunk << ", read " << sizes.read);
    TempDir dir;
    comm::InMemoryStore store;
    const CheckpointerOptions options{
        .dir = dir.path(), .read_bytes = sizes.read, .hash_chunk_bytes = sizes.chunk};
    const torch::Tensor w = torch::arange((2 << 20) / 4, torch::kFloat32);  // 2 MiB
    {
      Checkpointer ckpt(store, options);
      State s;
      s.add("w", w);
      ckpt.save_sync(1, s);
    }
    const auto file = dir / "step_00000001" / "rank_00000.data";
    const Manifest manifest = read_manifest(dir / "step_00000001");
    const Piece& piece = manifest.find("w")->pieces[0];
    const uint64_t bad = piece.offset + (1 << 20) + 700 * 1024;
    flip_byte(file, static_cast<off_t>(bad));
    // The chunk holding the flipped byte, as it now is on disk, and its hash.
    const uint64_t c = (bad - piece.offset) / sizes.chunk;
    const uint64_t begin = piece.offset + c * sizes.chunk, end = begin + sizes.chunk;
    const std::string bytes = util::read_file(file).substr(begin, sizes.chunk);
    const std::string expected = "checkpoint step 1: tensor \"w\" is corrupt in file " +
                                 file.string() + ": bytes [" + std::to_string(begin) + ", " +
                                 std::to_string(end) + ") hash to " +
                                 util::hash_hex(util::xxh64(bytes)) + ", the manifest says " +
                                 util::hash_hex(piece.chunk_hashes[c]) +
                                 ". Load an earlier step (load_latest_valid) or restore the file.";
    Checkpointer ckpt(store, options);
    State s;
    s.add("w", torch::zeros_like(w));
    EXPECT_EQ(error_of<CorruptData>([&] { ckpt.load(s); }), expected);
    EXPECT_EQ(error_of<CorruptData>([&] { ckpt.verify(1); }), expected);
  }
}

// A read failing on an I/O thread is raised by load() as it is.
TEST(Reader, AReadFailureOnAnIoThreadIsRaisedByLoad) {
  using Op = testing::FaultyStorage::Op;
  TempDir dir;
  comm::InMemoryStore store;
  const torch::Tensor w = torch::randn({1 << 20});
  {
    Checkpointer ckpt(store, {.dir = dir.path()});
    State s;
    s.add("w", w);
    ckpt.save_sync(1, s);
  }
  auto storage = std::make_shared<testing::FaultyStorage>();
  const auto file = dir / "step_00000001" / "rank_00000.data";
  storage->fault = [&](Op op, const std::filesystem::path& path) {
    return op == Op::kRead && path == file ? EIO : 0;
  };
  Checkpointer ckpt(store, {.dir = dir.path()}, storage);
  State s;
  s.add("w", torch::zeros_like(w));
  EXPECT_EQ(error_of<IoError>([&] { ckpt.load(s); }),
            testing::FaultyStorage::injected_message(Op::kRead, file, EIO));
}

}  // namespace
}  // namespace loom::ckpt

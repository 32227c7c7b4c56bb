// Reading a committed step: element ranges of tensors from whichever pieces hold them, with
// each touched chunk's hash checked, and whole-step verification. Private to Loom.
//
// A read is planned first (which byte ranges of which files, every piece checked to lie inside
// its file before anything is allocated for it), then run as a pipeline: I/O threads read the
// next ranges (O_DIRECT where the file system allows it and the range is large and aligned)
// into a few buffers, then hash and copy them into the caller's memory, while the calling
// thread waits for them in order (and itself reads the small ranges and hashes chunks that
// span two reads).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/manifest.h"
#include "ckpt/storage.h"
#include "util/hash.h"

namespace loom::ckpt {

namespace internal {
class HostBuffer;
}

struct ReadOptions {
  int io_threads = 4;                   // reads in flight while the caller hashes and copies
  size_t read_bytes = size_t{1} << 20;  // bytes per read (a multiple of 4 KiB)
  bool direct_io = true;                // O_DIRECT for aligned reads of at least kDirectReadBytes
  // Where the read buffers live: when set, reused from read to read (grown when too small), so
  // that later loads do not touch fresh memory again; null: allocated per read. Not owned.
  internal::HostBuffer* buffers = nullptr;
};

// Reads of at least this many bytes bypass the page cache (when aligned and allowed); smaller
// ones go through it, with readahead, so that many small pieces do not each wait for the disk.
inline constexpr size_t kDirectReadBytes = size_t{256} << 10;

// Not thread-safe; one per loading thread. Files are opened once and kept open.
class StepReader {
 public:
  StepReader(std::shared_ptr<Storage> storage, std::filesystem::path step_dir, Manifest manifest,
             ReadOptions options = {});
  ~StepReader();

  const Manifest& manifest() const { return manifest_; }
  const std::filesystem::path& step_dir() const { return step_dir_; }

  // Elements [begin, end) of the flattened global tensor, copied into dest.
  struct Request {
    const TensorRecord* tensor = nullptr;
    int64_t begin = 0;
    int64_t end = 0;
    char* dest = nullptr;
  };
  // Copies every request's elements into its dest, reading only the chunks that hold them (or,
  // without verify, only the bytes). With verify, every chunk read is hashed and compared. A
  // hash mismatch, a missing piece or a file too short is CorruptData naming the tensor and the
  // file; on any failure the dests hold partial data.
  void read(const std::vector<Request>& requests, bool verify);
  void read(const TensorRecord& tensor, int64_t begin, int64_t end, char* dest, bool verify) {
    read({{&tensor, begin, end, dest}}, verify);
  }

  // Reads every piece of every tensor whole, checking chunk and piece hashes. CorruptData
  // names the first bad tensor and file. Returns the bytes checked.
  uint64_t verify_all();

 private:
  struct Op;
  struct OpenFile;

  OpenFile& file(const std::string& name);
  // The file holding piece p, checked to be long enough for it: CorruptData (truncated) if not.
  OpenFile& piece_file(const TensorRecord& tensor, const Piece& p);
  // Appends the reads of bytes [from, to) of piece p (relative to the piece) to ops; with
  // verify they cover whole chunks. dest (may be null: nothing copied) receives [from, to).
  void plan(const TensorRecord& tensor, const Piece& p, uint64_t from, uint64_t to, char* dest,
            bool verify, std::vector<Op>& ops);
  // Reads op into buffer (on an I/O thread or the calling one).
  void fetch(const Op& op, char* buffer);
  // Checks op's chunks (with verify) and copies its wanted bytes to its dest. `partial` carries
  // the hash of a chunk that started in an earlier op; ops whose chunks lie whole inside them
  // (whole_chunks) need none and may be consumed on any thread.
  void consume(const Op& op, const char* data, bool verify, std::optional<util::Hasher64>& partial);
  static bool whole_chunks(const Op& op);
  void run(const std::vector<Op>& ops, bool verify);

  std::shared_ptr<Storage> storage_;
  std::filesystem::path step_dir_;
  Manifest manifest_;
  ReadOptions options_;
  std::map<std::string, std::unique_ptr<OpenFile>> files_;
};

}  // namespace loom::ckpt

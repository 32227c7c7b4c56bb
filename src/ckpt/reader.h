// Reading a committed step: element ranges of a tensor from whichever pieces hold them, with
// each touched chunk's hash checked, and whole-step verification. Private to Loom.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ckpt/manifest.h"
#include "ckpt/storage.h"

namespace loom::ckpt {

// Not thread-safe; one per loading thread. Files are opened once and kept open.
class StepReader {
 public:
  StepReader(std::shared_ptr<Storage> storage, std::filesystem::path step_dir, Manifest manifest);

  const Manifest& manifest() const { return manifest_; }
  const std::filesystem::path& step_dir() const { return step_dir_; }

  // Copies elements [begin, end) of the flattened global tensor into dest, reading only the
  // chunks that hold them (pread). With verify, every chunk read is hashed and compared.
  // A hash mismatch or a file too short is CorruptData naming the tensor and the file.
  void read(const TensorRecord& tensor, int64_t begin, int64_t end, char* dest, bool verify);

  // Reads every piece of every tensor whole, checking chunk and piece hashes. CorruptData
  // names the first bad tensor and file. Returns the bytes checked.
  uint64_t verify_all();

 private:
  ReadableFile& file(const std::string& name);
  // The file holding piece p, checked to be long enough for it: CorruptData (truncated) if not.
  ReadableFile& piece_file(const TensorRecord& tensor, const Piece& p);
  // Bytes [from, to) of piece p (relative to the piece) into dest.
  void read_piece(const TensorRecord& tensor, const Piece& p, uint64_t from, uint64_t to,
                  char* dest, bool verify);

  std::shared_ptr<Storage> storage_;
  std::filesystem::path step_dir_;
  Manifest manifest_;
  std::map<std::string, std::unique_ptr<ReadableFile>> files_;
  std::map<std::string, uint64_t> file_sizes_;
  std::vector<char> scratch_;  // one chunk, for chunks only partly wanted
};

}  // namespace loom::ckpt

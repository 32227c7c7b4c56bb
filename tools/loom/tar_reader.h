// A streaming reader of tar files (POSIX ustar, GNU and pax), for `loom data build webdataset`:
// members are read one at a time, so a tar file of any size needs one member's memory.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

#include "util/hash.h"

namespace loom::cli {

struct TarMember {
  std::string path;  // its GNU long name or pax path when it has one, else its header's name
  std::string data;
};

// Reads the regular files ('0' and '\0') of one tar file in order, skipping directories. Knows
// ustar names with their prefix, GNU long names ('L') and pax extended headers ('x': path and
// size). Not thread-safe. Every error is InvalidArgument starting "FILE: " (the name as given)
// and naming the member, or the last one before the fault: a header whose checksum fails or
// whose size is not a number, another member type, a file that ends inside a member or before
// the end-of-archive block, data after that block.
class TarReader {
 public:
  explicit TarReader(std::string file);  // InvalidArgument when it cannot be opened
  TarReader(const TarReader&) = delete;
  TarReader& operator=(const TarReader&) = delete;

  // The next regular file into *member; false at the end of the archive.
  bool next(TarMember* member);

  uint64_t offset() const { return offset_; }  // bytes read so far
  // The whole file's size and xxHash64, once next() has returned false.
  uint64_t size() const { return offset_; }
  uint64_t xxhash64() const { return hasher_.digest(); }

 private:
  // Reads up to n bytes into out (all of them unless the file ends), hashing them.
  size_t read(char* out, size_t n);
  // Reads a member's n data bytes and the padding to the next 512-byte block.
  std::string read_data(uint64_t n, const std::string& member);
  [[noreturn]] void fail(const std::string& member, const std::string& what) const;

  std::string file_;
  uint64_t file_size_ = 0;
  std::ifstream in_;
  util::Hasher64 hasher_;
  uint64_t offset_ = 0;
  std::string last_;  // the last member returned, to say where a truncated file ends
};

}  // namespace loom::cli

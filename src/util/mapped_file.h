// A read-only memory map of a whole file. Private to Loom.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>

namespace loom::util {

// Maps `path` read-only for the object's lifetime. A missing or unreadable file is IoError
// naming it. Movable, not copyable; reading data() from several threads is safe.
class MappedFile {
 public:
  explicit MappedFile(const std::filesystem::path& path);
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  void unmap();

  std::filesystem::path path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace loom::util

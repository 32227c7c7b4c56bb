#include "util/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <utility>

#include "loom/error.h"
#include "util/fd.h"

namespace loom::util {

MappedFile::MappedFile(const std::filesystem::path& path) : path_(path) {
  UniqueFd fd(
      LOOM_CHECK_SYS(::open(path.c_str(), O_RDONLY | O_CLOEXEC), "opening ", path.string()));
  struct stat st {};
  LOOM_CHECK_SYS(::fstat(fd.get(), &st), "reading the size of ", path.string());
  size_ = static_cast<size_t>(st.st_size);
  if (size_ == 0) return;  // mmap of 0 bytes is EINVAL; an empty map needs no memory
  void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd.get(), 0);
  if (p == MAP_FAILED) {
    detail::throw_system_error(errno, "mmap", "mapping " + path.string(), __FILE__, __LINE__);
  }
  data_ = static_cast<const uint8_t*>(p);
}

MappedFile::~MappedFile() { unmap(); }

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    unmap();
    path_ = std::move(other.path_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void MappedFile::unmap() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
  data_ = nullptr;
}

}  // namespace loom::util

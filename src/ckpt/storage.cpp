// The POSIX implementation of the checkpointer's storage seam (see storage.h).
#include "ckpt/storage.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <system_error>
#include <vector>

#include "loom/error.h"
#include "util/fd.h"
#include "util/files.h"

namespace loom::ckpt {
namespace {

class PosixWritableFile final : public WritableFile {
 public:
  PosixWritableFile(const std::filesystem::path& path, bool direct)
      : path_(path), direct_(direct), fd_(open_for_writing(path, direct_)) {}

  static int open_for_writing(const std::filesystem::path& path, bool& direct) {
    const int flags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC;
    if (direct) {
      int fd = ::open(path.c_str(), flags | O_DIRECT, 0644);
      if (fd >= 0) return fd;
      if (errno != EINVAL) LOOM_CHECK_SYS(fd, "creating ", path);
      direct = false;  // the file system refuses O_DIRECT: buffered writes
    }
    return LOOM_CHECK_SYS(::open(path.c_str(), flags, 0644), "creating ", path);
  }

  size_t write_at(uint64_t offset, const void* data, size_t size) override {
    ssize_t n;
    do {
      n = ::pwrite(fd_.get(), data, size, static_cast<off_t>(offset));
    } while (n == -1 && errno == EINTR);
    LOOM_CHECK_SYS(n, "writing ", path_, " at offset ", offset);
    return static_cast<size_t>(n);
  }

  void sync() override { LOOM_CHECK_SYS(::fsync(fd_.get()), "syncing ", path_); }

  void start_writeback(uint64_t offset, uint64_t size) override {
    if (direct_) return;  // nothing in the page cache
    (void)::sync_file_range(fd_.get(), static_cast<off64_t>(offset), static_cast<off64_t>(size),
                            SYNC_FILE_RANGE_WRITE);
  }

  void truncate(uint64_t size) override {
    LOOM_CHECK_SYS(::ftruncate(fd_.get(), static_cast<off_t>(size)), "truncating ", path_);
  }

  bool direct() const override { return direct_; }

 private:
  std::filesystem::path path_;
  bool direct_;
  util::UniqueFd fd_;
};

class PosixReadableFile final : public ReadableFile {
 public:
  PosixReadableFile(const std::filesystem::path& path, bool direct)
      : path_(path), direct_(direct), fd_(open_for_reading(path, direct_)) {}

  static int open_for_reading(const std::filesystem::path& path, bool& direct) {
    const int flags = O_RDONLY | O_CLOEXEC;
    if (direct) {
      int fd = ::open(path.c_str(), flags | O_DIRECT);
      if (fd >= 0) return fd;
      if (errno != EINVAL) LOOM_CHECK_SYS(fd, "opening ", path);
      direct = false;  // the file system refuses O_DIRECT: buffered reads
    }
    return LOOM_CHECK_SYS(::open(path.c_str(), flags), "opening ", path);
  }

  size_t read_at(uint64_t offset, void* data, size_t size) override {
    ssize_t n;
    do {
      n = ::pread(fd_.get(), data, size, static_cast<off_t>(offset));
    } while (n == -1 && errno == EINTR);
    LOOM_CHECK_SYS(n, "reading ", path_, " at offset ", offset);
    return static_cast<size_t>(n);
  }

  uint64_t size() override {
    struct stat st {};
    LOOM_CHECK_SYS(::fstat(fd_.get(), &st), "stat of ", path_);
    return static_cast<uint64_t>(st.st_size);
  }

  void will_need(uint64_t offset, uint64_t size) override {
    // Only a hint: the reads that follow report any real failure.
    if (direct_) return;  // the page cache is not used
    (void)::posix_fadvise(fd_.get(), static_cast<off_t>(offset), static_cast<off_t>(size),
                          POSIX_FADV_WILLNEED);
  }

  bool direct() const override { return direct_; }

 private:
  std::filesystem::path path_;
  bool direct_;
  util::UniqueFd fd_;
};

class PosixStorage final : public Storage {
 public:
  std::unique_ptr<WritableFile> create(const std::filesystem::path& path, bool direct) override {
    return std::make_unique<PosixWritableFile>(path, direct);
  }
  std::unique_ptr<ReadableFile> open(const std::filesystem::path& path, bool direct) override {
    return std::make_unique<PosixReadableFile>(path, direct);
  }
  void rename(const std::filesystem::path& from, const std::filesystem::path& to) override {
    LOOM_CHECK_SYS(::rename(from.c_str(), to.c_str()), "renaming ", from, " to ", to);
  }
  void sync_dir(const std::filesystem::path& dir) override { util::fsync_dir(dir); }
  void create_dirs(const std::filesystem::path& dir) override {
    std::error_code error;
    std::filesystem::create_directories(dir, error);
    if (error) throw IoError(detail::concat("creating directory ", dir, ": ", error.message()));
  }
  void remove(const std::filesystem::path& path) override {
    std::error_code error;
    std::filesystem::remove(path, error);
    if (error) throw IoError(detail::concat("removing ", path, ": ", error.message()));
  }
  void remove_all(const std::filesystem::path& path) override {
    std::error_code error;
    std::filesystem::remove_all(path, error);
    if (error) throw IoError(detail::concat("removing ", path, ": ", error.message()));
  }
  bool exists(const std::filesystem::path& path) override {
    std::error_code error;
    const bool found = std::filesystem::exists(path, error);
    if (error)
      throw IoError(detail::concat("checking whether ", path, " exists: ", error.message()));
    return found;
  }
  std::vector<std::string> list(const std::filesystem::path& dir) override {
    std::vector<std::string> names;
    std::error_code error;
    std::filesystem::directory_iterator it(dir, error);
    if (error == std::errc::no_such_file_or_directory) return names;
    for (; !error && it != std::filesystem::directory_iterator(); it.increment(error))
      names.push_back(it->path().filename().string());
    if (error) throw IoError(detail::concat("listing ", dir, ": ", error.message()));
    return names;
  }
};

}  // namespace

std::shared_ptr<Storage> posix_storage() {
  static const std::shared_ptr<Storage> storage = std::make_shared<PosixStorage>();
  return storage;
}

void write_all_at(WritableFile& file, uint64_t offset, const void* data, size_t size) {
  const char* bytes = static_cast<const char*>(data);
  while (size > 0) {
    size_t n = file.write_at(offset, bytes, size);
    bytes += n;
    offset += n;
    size -= n;
  }
}

bool read_exact(ReadableFile& file, uint64_t offset, void* data, size_t size) {
  char* bytes = static_cast<char*>(data);
  while (size > 0) {
    size_t n = file.read_at(offset, bytes, size);
    if (n == 0) return false;
    bytes += n;
    offset += n;
    size -= n;
  }
  return true;
}

}  // namespace loom::ckpt

// The checkpointer's storage seam: every byte the checkpointer writes or reads, every fsync,
// rename and removal goes through a Storage, so tests can inject failures (failed fsync, short
// writes, ENOSPC) the way LevelDB's SpecialEnv does. Private to Loom.
//
// posix_storage() is the real one. Failures are IoError naming the call, the path and errno's
// text. Implementations must be safe to use from several threads at once (ranks as threads
// share one). A file object's write_at() and read_at() may be called from several threads at
// once for disjoint byte ranges (the I/O threads of one save or load); its other calls come
// from one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace loom::ckpt {

// A file being written at offsets (pwrite). Closing without sync() loses nothing on a clean
// shutdown but is not durable.
class WritableFile {
 public:
  virtual ~WritableFile() = default;
  // Writes up to size bytes at offset; returns how many were written (at least 1). A short
  // count is not an error: callers loop (write_all_at).
  virtual size_t write_at(uint64_t offset, const void* data, size_t size) = 0;
  virtual void sync() = 0;
  // Starts writing [offset, offset + size) back to the device without waiting (Linux
  // sync_file_range), so the disk works while the writer hashes the next bytes. A hint:
  // failures surface at sync().
  virtual void start_writeback(uint64_t offset, uint64_t size) = 0;
  // Sets the file's size (drops the padding of the last direct write).
  virtual void truncate(uint64_t size) = 0;
  // True when writes bypass the page cache (O_DIRECT): every write's address, length and file
  // offset must then be multiples of kDirectAlignment.
  virtual bool direct() const = 0;
};

inline constexpr size_t kDirectAlignment = 4096;

// A file read at offsets.
class ReadableFile {
 public:
  virtual ~ReadableFile() = default;
  // Reads up to size bytes at offset; returns how many were read (0 at end of file).
  virtual size_t read_at(uint64_t offset, void* data, size_t size) = 0;
  virtual uint64_t size() = 0;
  // Hints that [offset, offset + size) will be read soon (posix_fadvise WILLNEED).
  virtual void will_need(uint64_t offset, uint64_t size) = 0;
  // True when reads bypass the page cache (O_DIRECT): every read's address, length and offset
  // must then be multiples of kDirectAlignment (a read may end short at the end of the file).
  virtual bool direct() const = 0;
};

class Storage {
 public:
  virtual ~Storage() = default;
  // Creates (or truncates) path for writing. With direct, asks for O_DIRECT; a file system that
  // refuses it (tmpfs) gives a buffered file instead (see WritableFile::direct).
  virtual std::unique_ptr<WritableFile> create(const std::filesystem::path& path,
                                               bool direct = false) = 0;
  // Opens path for reading. With direct, asks for O_DIRECT; a file system that refuses it gives
  // a buffered file instead (see ReadableFile::direct).
  virtual std::unique_ptr<ReadableFile> open(const std::filesystem::path& path,
                                             bool direct = false) = 0;
  virtual void rename(const std::filesystem::path& from, const std::filesystem::path& to) = 0;
  // fsyncs a directory so that creates, renames and removals inside it are durable.
  virtual void sync_dir(const std::filesystem::path& dir) = 0;
  // mkdir -p.
  virtual void create_dirs(const std::filesystem::path& dir) = 0;
  // rm -f / rm -rf; a missing path is not an error.
  virtual void remove(const std::filesystem::path& path) = 0;
  virtual void remove_all(const std::filesystem::path& path) = 0;
  // Whether path exists (a file or a directory).
  virtual bool exists(const std::filesystem::path& path) = 0;
  // The names of the entries of dir, in no particular order; a missing dir has none.
  virtual std::vector<std::string> list(const std::filesystem::path& dir) = 0;
};

// The process-wide POSIX storage (stateless; shared).
std::shared_ptr<Storage> posix_storage();

// Writes all of [data, data + size) at offset, looping over short writes.
void write_all_at(WritableFile& file, uint64_t offset, const void* data, size_t size);
// Reads exactly size bytes at offset; returns false when the file ends first.
bool read_exact(ReadableFile& file, uint64_t offset, void* data, size_t size);

}  // namespace loom::ckpt

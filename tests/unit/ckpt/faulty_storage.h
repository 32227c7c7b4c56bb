// A storage seam for tests: POSIX storage whose failures are switched on by atomic flags,
// LevelDB SpecialEnv style. Each flag is read at the moment of the operation, so a test may
// flip one while a save is in flight. Failures raise IoError through the same path a real
// failed system call takes (throw_system_error), so messages carry errno's text.
//
// For faults aimed at one operation on one path (rank 0's manifest rename, the directory fsync
// after it), `fault` is asked before every operation; an errno it returns fails that operation
// with IoError "<op> <path>: <strerror> (injected)". Set it before the storage is used; it is
// called from several threads at once (the I/O threads, ranks as threads).
#pragma once

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ckpt/storage.h"
#include "loom/error.h"

namespace loom::ckpt::testing {

class FaultyStorage final : public Storage {
 public:
  enum class Op {
    kCreate,
    kWrite,
    kSync,
    kRename,
    kSyncDir,
    kRemove,
    kExists,
    kList,
    kOpen,
    kRead
  };
  static const char* op_name(Op op) {
    constexpr const char* kNames[] = {"create", "write",  "fsync", "rename", "fsync of directory",
                                      "remove", "exists", "list",  "open",   "read"};
    return kNames[static_cast<int>(op)];
  }

  std::atomic<bool> fail_sync{false};     // fsync of a data file fails (EIO)
  std::atomic<bool> no_space{false};      // writes fail with ENOSPC
  std::atomic<bool> short_writes{false};  // each write writes at most 1000 bytes
  std::atomic<bool> fail_rename{false};   // renames fail (EIO)
  std::atomic<int64_t> bytes_written{0};  // through every file of this storage
  std::atomic<int64_t> bytes_read{0};     // likewise
  // Asked before each operation with its path (a rename's target; a file's path for its writes,
  // syncs and reads): 0 lets it run, an errno fails it.
  std::function<int(Op, const std::filesystem::path&)> fault;

  std::unique_ptr<WritableFile> create(const std::filesystem::path& path,
                                       bool direct = false) override {
    check(Op::kCreate, path);
    return std::make_unique<File>(*this, base_->create(path, direct), path);
  }
  std::unique_ptr<ReadableFile> open(const std::filesystem::path& path,
                                     bool direct = false) override {
    check(Op::kOpen, path);
    return std::make_unique<Reader>(*this, base_->open(path, direct), path);
  }
  void rename(const std::filesystem::path& from, const std::filesystem::path& to) override {
    if (fail_rename) detail::throw_system_error(EIO, "rename", from.string(), __FILE__, __LINE__);
    check(Op::kRename, to);
    base_->rename(from, to);
  }
  void sync_dir(const std::filesystem::path& dir) override {
    check(Op::kSyncDir, dir);
    base_->sync_dir(dir);
  }
  void create_dirs(const std::filesystem::path& dir) override { base_->create_dirs(dir); }
  void remove(const std::filesystem::path& path) override {
    check(Op::kRemove, path);
    base_->remove(path);
  }
  void remove_all(const std::filesystem::path& path) override {
    check(Op::kRemove, path);
    base_->remove_all(path);
  }
  bool exists(const std::filesystem::path& path) override {
    check(Op::kExists, path);
    return base_->exists(path);
  }
  std::vector<std::string> list(const std::filesystem::path& dir) override {
    check(Op::kList, dir);
    return base_->list(dir);
  }

  // The message an injected failure of `op` on `path` with `err` raises.
  static std::string injected_message(Op op, const std::filesystem::path& path, int err) {
    return std::string(op_name(op)) + " " + path.string() + ": " + std::strerror(err) +
           " (injected)";
  }

 private:
  void check(Op op, const std::filesystem::path& path) const {
    if (!fault) return;
    if (int err = fault(op, path)) throw IoError(injected_message(op, path, err));
  }

  class Reader final : public ReadableFile {
   public:
    Reader(FaultyStorage& owner, std::unique_ptr<ReadableFile> base, std::filesystem::path path)
        : owner_(owner), base_(std::move(base)), path_(std::move(path)) {}
    size_t read_at(uint64_t offset, void* data, size_t size) override {
      owner_.check(Op::kRead, path_);
      size_t n = base_->read_at(offset, data, size);
      owner_.bytes_read += static_cast<int64_t>(n);
      return n;
    }
    uint64_t size() override { return base_->size(); }
    void will_need(uint64_t offset, uint64_t size) override { base_->will_need(offset, size); }
    bool direct() const override { return base_->direct(); }

   private:
    FaultyStorage& owner_;
    std::unique_ptr<ReadableFile> base_;
    std::filesystem::path path_;
  };

  class File final : public WritableFile {
   public:
    File(FaultyStorage& owner, std::unique_ptr<WritableFile> base, std::filesystem::path path)
        : owner_(owner), base_(std::move(base)), path_(std::move(path)) {}
    size_t write_at(uint64_t offset, const void* data, size_t size) override {
      if (owner_.no_space)
        detail::throw_system_error(ENOSPC, "write", path_.string(), __FILE__, __LINE__);
      owner_.check(Op::kWrite, path_);
      if (owner_.short_writes) size = std::min<size_t>(size, base_->direct() ? 4096 : 1000);
      size_t n = base_->write_at(offset, data, size);
      owner_.bytes_written += static_cast<int64_t>(n);
      return n;
    }
    void sync() override {
      if (owner_.fail_sync)
        detail::throw_system_error(EIO, "fsync", path_.string(), __FILE__, __LINE__);
      owner_.check(Op::kSync, path_);
      base_->sync();
    }
    void start_writeback(uint64_t offset, uint64_t size) override {
      base_->start_writeback(offset, size);
    }
    void truncate(uint64_t size) override { base_->truncate(size); }
    bool direct() const override { return base_->direct(); }

   private:
    FaultyStorage& owner_;
    std::unique_ptr<WritableFile> base_;
    std::filesystem::path path_;
  };

  std::shared_ptr<Storage> base_ = posix_storage();
};

}  // namespace loom::ckpt::testing

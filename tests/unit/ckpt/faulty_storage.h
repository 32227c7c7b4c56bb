// A storage seam for tests: POSIX storage whose failures are switched on by atomic flags,
// LevelDB SpecialEnv style. Each flag is read at the moment of the operation, so a test may
// flip one while a save is in flight. Failures raise IoError through the same path a real
// failed system call takes (throw_system_error), so messages carry errno's text.
#pragma once

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <memory>

#include "ckpt/storage.h"
#include "loom/error.h"

namespace loom::ckpt::testing {

class FaultyStorage final : public Storage {
 public:
  std::atomic<bool> fail_sync{false};     // fsync of a data file fails (EIO)
  std::atomic<bool> no_space{false};      // writes fail with ENOSPC
  std::atomic<bool> short_writes{false};  // each write writes at most 1000 bytes
  std::atomic<bool> fail_rename{false};   // renames fail (EIO)
  std::atomic<int64_t> bytes_written{0};  // through every file of this storage
  std::atomic<int64_t> bytes_read{0};     // likewise

  std::unique_ptr<WritableFile> create(const std::filesystem::path& path,
                                       bool direct = false) override {
    return std::make_unique<File>(*this, base_->create(path, direct), path);
  }
  std::unique_ptr<ReadableFile> open(const std::filesystem::path& path) override {
    return std::make_unique<Reader>(*this, base_->open(path));
  }
  void rename(const std::filesystem::path& from, const std::filesystem::path& to) override {
    if (fail_rename) detail::throw_system_error(EIO, "rename", from.string(), __FILE__, __LINE__);
    base_->rename(from, to);
  }
  void sync_dir(const std::filesystem::path& dir) override { base_->sync_dir(dir); }
  void create_dirs(const std::filesystem::path& dir) override { base_->create_dirs(dir); }
  void remove(const std::filesystem::path& path) override { base_->remove(path); }
  void remove_all(const std::filesystem::path& path) override { base_->remove_all(path); }

 private:
  class Reader final : public ReadableFile {
   public:
    Reader(FaultyStorage& owner, std::unique_ptr<ReadableFile> base)
        : owner_(owner), base_(std::move(base)) {}
    size_t read_at(uint64_t offset, void* data, size_t size) override {
      size_t n = base_->read_at(offset, data, size);
      owner_.bytes_read += static_cast<int64_t>(n);
      return n;
    }
    uint64_t size() override { return base_->size(); }
    void will_need(uint64_t offset, uint64_t size) override { base_->will_need(offset, size); }

   private:
    FaultyStorage& owner_;
    std::unique_ptr<ReadableFile> base_;
  };

  class File final : public WritableFile {
   public:
    File(FaultyStorage& owner, std::unique_ptr<WritableFile> base, std::filesystem::path path)
        : owner_(owner), base_(std::move(base)), path_(std::move(path)) {}
    size_t write(const void* data, size_t size) override {
      if (owner_.no_space)
        detail::throw_system_error(ENOSPC, "write", path_.string(), __FILE__, __LINE__);
      if (owner_.short_writes) size = std::min<size_t>(size, base_->direct() ? 4096 : 1000);
      size_t n = base_->write(data, size);
      owner_.bytes_written += static_cast<int64_t>(n);
      return n;
    }
    void sync() override {
      if (owner_.fail_sync)
        detail::throw_system_error(EIO, "fsync", path_.string(), __FILE__, __LINE__);
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

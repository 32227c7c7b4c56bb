// Rendezvous key-value stores: how ranks find each other before any collective exists.
//
// A Store is a small shared map of string keys to byte-string values with blocking reads.
// Gloo and NCCL bootstrap through it (connection addresses, NCCL unique ids); the launcher's
// gRPC coordinator provides one too. Implementations here:
//   InMemoryStore  threads as ranks in one process (tests);
//   FileStore      processes on one host sharing a directory (flock makes add and
//                  compare_set atomic across processes; set is an atomic rename).
//   PrefixStore    namespaces the keys of another store.
// All methods are safe to call concurrently from many threads (and, for FileStore, many
// processes). Every blocking call has a timeout; when it passes, loom::Timeout names the keys
// still missing.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "loom/visibility.h"

namespace loom::comm {

class LOOM_API Store {
 public:
  static constexpr std::chrono::milliseconds kDefaultTimeout{std::chrono::seconds(300)};

  virtual ~Store() = default;

  // Sets key to value, replacing any previous value; wakes waiters.
  virtual void set(const std::string& key, const std::string& value) = 0;
  // The value of key, waiting up to timeout for it to be set. Timeout names the key.
  virtual std::string get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  // Atomically adds delta to the integer stored at key (absent = 0); returns the new value.
  // A key holding something other than a decimal integer is InvalidArgument.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Atomically: if key's value equals expected (an absent key matches only an empty
  // expected), sets it to desired. Returns the value after the call either way.
  virtual std::string compare_set(const std::string& key, const std::string& expected,
                                  const std::string& desired) = 0;
  // Blocks until every key exists. Timeout names the keys still missing.
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  // True when every key exists; never blocks.
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // Deletes key; returns whether it existed.
  virtual bool remove(const std::string& key) = 0;

  std::string get(const std::string& key) { return get(key, kDefaultTimeout); }
  void wait(const std::vector<std::string>& keys) { wait(keys, kDefaultTimeout); }
};

// Threads as ranks: one instance shared by reference among the rank threads.
class LOOM_API InMemoryStore final : public Store {
 public:
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  std::string compare_set(const std::string& key, const std::string& expected,
                          const std::string& desired) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  bool remove(const std::string& key) override;
  using Store::get;
  using Store::wait;

 private:
  // State below is protected by mutex_; changed_ is notified on every write.
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, std::string> data_;
};

// Processes on one host: every process constructs a FileStore on the same directory (created
// if missing). Each key is one file, written to a temporary name and renamed into place, so a
// reader never sees a partial value. Every write (set, add, compare_set, remove) holds an
// exclusive flock on <dir>/.lock, so add and compare_set are atomic against all other writes;
// reads take no lock. Waits poll with a short backoff (1 ms growing to 20 ms). Key bytes outside
// [A-Za-z0-9_.-] are escaped into the file name; a key longer than about 250 bytes once escaped
// is InvalidArgument. System call failures are IoError.
class LOOM_API FileStore final : public Store {
 public:
  explicit FileStore(std::filesystem::path dir);

  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  std::string compare_set(const std::string& key, const std::string& expected,
                          const std::string& desired) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  bool remove(const std::string& key) override;
  using Store::get;
  using Store::wait;

  const std::filesystem::path& dir() const { return dir_; }

 private:
  std::filesystem::path path_of(const std::string& key) const;

  // Constant after construction.
  std::filesystem::path dir_;
};

// Namespaces every key of an underlying store under "<prefix>/": sub-groups and restart
// generations get fresh keys without clearing the store. Does not own the underlying store,
// which must outlive it.
class LOOM_API PrefixStore final : public Store {
 public:
  PrefixStore(std::string prefix, Store& base);

  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  std::string compare_set(const std::string& key, const std::string& expected,
                          const std::string& desired) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  bool remove(const std::string& key) override;
  using Store::get;
  using Store::wait;

 private:
  std::string full(const std::string& key) const { return prefix_ + "/" + key; }
  std::vector<std::string> full(const std::vector<std::string>& keys) const;

  // Constant after construction.
  std::string prefix_;
  Store& base_;
};

}  // namespace loom::comm

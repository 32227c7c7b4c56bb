// FileStore: a rendezvous store for processes on one host, one file per key in a shared
// directory. Readers take no lock (every value appears by an atomic rename); writers serialise
// on an exclusive flock of <dir>/.lock so add and compare_set are atomic across processes.

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <optional>
#include <thread>

#include "comm/counter.h"
#include "loom/comm/store.h"
#include "loom/error.h"
#include "util/fd.h"
#include "util/files.h"

namespace loom::comm {
namespace {

using Clock = std::chrono::steady_clock;

// Longest file name most Linux file systems accept.
constexpr size_t kMaxFileName = 255;

// Holds an exclusive flock on <dir>/.lock for its lifetime. Each instance opens its own file
// description, so the lock also excludes other threads of this process.
class DirLock {
 public:
  explicit DirLock(const std::filesystem::path& dir)
      : path_(dir / ".lock"),
        fd_(LOOM_CHECK_SYS(::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644), "opening ",
                           path_.string())) {
    while (::flock(fd_.get(), LOCK_EX) == -1) {
      if (errno != EINTR) {
        detail::throw_system_error(errno, "flock", "locking " + path_.string(), __FILE__, __LINE__);
      }
    }
  }  // Closing fd_ releases the lock.

 private:
  std::filesystem::path path_;
  util::UniqueFd fd_;
};

// Key bytes outside [A-Za-z0-9_.-] become %XX; the "k_" prefix keeps every key file apart from
// ".lock", the ".tmp" files and the names "." and "..".
std::string encode_key(const std::string& key) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string name = "k_";
  for (const char c : key) {
    const auto byte = static_cast<unsigned char>(c);
    if (std::isalnum(byte) || c == '_' || c == '.' || c == '-') {
      name += c;
    } else {
      name += '%';
      name += kHex[byte >> 4];
      name += kHex[byte & 0xF];
    }
  }
  return name;
}

// The whole file, or nullopt when it does not exist.
std::optional<std::string> read_file(const std::filesystem::path& path) {
  const int raw = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (raw == -1 && errno == ENOENT) return std::nullopt;
  util::UniqueFd fd(LOOM_CHECK_SYS(raw, "opening ", path.string()));
  std::string data;
  char buffer[4096];
  for (;;) {
    const ssize_t n = ::read(fd.get(), buffer, sizeof(buffer));
    if (n == 0) return data;
    if (n == -1 && errno == EINTR) continue;
    LOOM_CHECK_SYS(n, "reading ", path.string());
    data.append(buffer, static_cast<size_t>(n));
  }
}

// Calls ready() with a backoff of 1 ms doubling to 20 ms until it returns true (then true) or
// the deadline passes (then false, after one last call at the deadline).
template <typename Ready>
bool poll_until(Clock::time_point deadline, Ready ready) {
  std::chrono::milliseconds backoff{1};
  for (;;) {
    if (ready()) return true;
    const auto now = Clock::now();
    if (now >= deadline) return false;
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
    backoff = std::min(backoff * 2, std::chrono::milliseconds{20});
  }
}

}  // namespace

FileStore::FileStore(std::filesystem::path dir) : dir_(std::move(dir)) {
  std::error_code error;
  std::filesystem::create_directories(dir_, error);
  LOOM_CHECK(!error, IoError, "FileStore: cannot create directory ", dir_.string(), ": ",
             error.message());
}

std::filesystem::path FileStore::path_of(const std::string& key) const {
  std::string name = encode_key(key);
  LOOM_CHECK(name.size() <= kMaxFileName, InvalidArgument, "FileStore: key '", key.substr(0, 64),
             "...' is too long (", name.size(), " bytes once escaped; at most ", kMaxFileName, ")");
  return dir_ / name;
}

void FileStore::set(const std::string& key, const std::string& value) {
  const std::filesystem::path path = path_of(key);
  DirLock lock(dir_);
  // Readers see the old value or the new one; rendezvous needs no durability across a host
  // crash, so no fsync.
  util::write_file_atomic(path, value, util::Durability::kAtomicOnly);
}

std::string FileStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  const std::filesystem::path path = path_of(key);
  std::optional<std::string> value;
  const bool found = poll_until(Clock::now() + timeout, [&] {
    value = read_file(path);
    return value.has_value();
  });
  if (!found) {
    throw Timeout(detail::concat("FileStore ", dir_.string(), ": timed out after ", timeout.count(),
                                 " ms waiting for key(s) '", key, "'"));
  }
  return *std::move(value);
}

int64_t FileStore::add(const std::string& key, int64_t delta) {
  const std::filesystem::path path = path_of(key);
  DirLock lock(dir_);
  const std::optional<std::string> value = read_file(path);
  const int64_t current = value ? parse_counter("FileStore", key, *value) : 0;
  int64_t result = 0;
  LOOM_CHECK(!__builtin_add_overflow(current, delta, &result), InvalidArgument,
             "FileStore::add: key '", key, "' would overflow (", current, " + ", delta, ")");
  util::write_file_atomic(path, std::to_string(result), util::Durability::kAtomicOnly);
  return result;
}

std::string FileStore::compare_set(const std::string& key, const std::string& expected,
                                   const std::string& desired) {
  const std::filesystem::path path = path_of(key);
  DirLock lock(dir_);
  const std::optional<std::string> value = read_file(path);
  const bool matches = value ? *value == expected : expected.empty();
  if (!matches) return value.value_or(std::string());
  util::write_file_atomic(path, desired, util::Durability::kAtomicOnly);
  return desired;
}

void FileStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  if (poll_until(Clock::now() + timeout, [&] { return check(keys); })) return;
  std::string missing;
  for (const std::string& key : keys) {
    if (!check({key})) missing += (missing.empty() ? "'" : ", '") + key + "'";
  }
  throw Timeout(detail::concat("FileStore ", dir_.string(), ": timed out after ", timeout.count(),
                               " ms waiting for key(s) ", missing));
}

bool FileStore::check(const std::vector<std::string>& keys) {
  return std::all_of(keys.begin(), keys.end(), [&](const std::string& key) {
    const std::filesystem::path path = path_of(key);
    if (::access(path.c_str(), F_OK) == 0) return true;
    if (errno == ENOENT) return false;
    detail::throw_system_error(errno, "access", "checking " + path.string(), __FILE__, __LINE__);
  });
}

bool FileStore::remove(const std::string& key) {
  const std::filesystem::path path = path_of(key);
  DirLock lock(dir_);
  if (::unlink(path.c_str()) == 0) return true;
  if (errno == ENOENT) return false;
  detail::throw_system_error(errno, "unlink", "removing " + path.string(), __FILE__, __LINE__);
}

}  // namespace loom::comm

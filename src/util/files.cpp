// Durable file helpers (see files.h).
#include "util/files.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>

#include "loom/error.h"
#include "util/fd.h"

namespace loom::util {
namespace {

std::atomic<uint64_t> temp_counter{0};

// The name with control bytes (NUL, newlines) written as \xNN, for error messages.
std::string escaped(std::string_view name) {
  std::string out;
  for (unsigned char c : name) {
    if (c < 0x20 || c == 0x7f) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

}  // namespace

bool is_plain_file_name(std::string_view name) {
  return !name.empty() && name.size() <= 255 && name.front() != '.' &&
         name.find('/') == std::string_view::npos && name.find('\0') == std::string_view::npos &&
         name.find("..") == std::string_view::npos;
}

void check_plain_file_name(std::string_view name, const std::string& what, const char* role) {
  LOOM_CHECK(is_plain_file_name(name), CorruptData, what, ": ", role, " \"", escaped(name),
             "\" is not a plain file name (a name inside the directory: no '/', no '..', no NUL, "
             "not starting with '.'); the file was edited or is not what it claims to be");
}

void create_directories(const std::filesystem::path& dir, const std::string& what,
                        const std::string& remedy) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  LOOM_CHECK(!error, IoError, "cannot create ", what, " ", dir.string(), ": ", error.message(),
             "; ", remedy);
}

void fsync_dir(const std::filesystem::path& dir) {
  UniqueFd fd(
      LOOM_CHECK_SYS(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC), "opening ", dir));
  LOOM_CHECK_SYS(::fsync(fd.get()), "syncing directory ", dir);
}

void write_all(int fd, const void* data, size_t size, const std::filesystem::path& file) {
  const auto* bytes = static_cast<const char*>(data);
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, bytes + done, size - done);
    if (n == -1 && errno == EINTR) continue;
    done += static_cast<size_t>(LOOM_CHECK_SYS(n, "writing ", file));
  }
}

void write_file_atomic(const std::filesystem::path& path,
                       const std::function<void(int fd, const std::filesystem::path& temp)>& write,
                       Durability durability) {
  std::filesystem::path dir = path.parent_path().empty() ? "." : path.parent_path();
  std::filesystem::path temp = dir / detail::concat(".", path.filename().string(), ".tmp.",
                                                    ::getpid(), ".", temp_counter.fetch_add(1));
  UniqueFd fd(LOOM_CHECK_SYS(::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644),
                             "creating ", temp));
  try {
    write(fd.get(), temp);
    if (durability == Durability::kFsync) LOOM_CHECK_SYS(::fsync(fd.get()), "syncing ", temp);
    fd.reset();
    LOOM_CHECK_SYS(::rename(temp.c_str(), path.c_str()), "renaming ", temp, " to ", path);
  } catch (...) {
    ::unlink(temp.c_str());
    throw;
  }
  if (durability == Durability::kFsync) fsync_dir(dir);
}

void write_file_atomic(const std::filesystem::path& path, const std::string& contents,
                       Durability durability) {
  write_file_atomic(
      path,
      [&](int fd, const std::filesystem::path& temp) {
        write_all(fd, contents.data(), contents.size(), temp);
      },
      durability);
}

std::string read_file(const std::filesystem::path& path) {
  UniqueFd fd(LOOM_CHECK_SYS(::open(path.c_str(), O_RDONLY | O_CLOEXEC), "opening ", path));
  std::string out;
  char buffer[1 << 16];
  while (true) {
    ssize_t n = LOOM_CHECK_SYS(::read(fd.get(), buffer, sizeof(buffer)), "reading ", path);
    if (n == 0) break;
    out.append(buffer, static_cast<size_t>(n));
  }
  return out;
}

}  // namespace loom::util

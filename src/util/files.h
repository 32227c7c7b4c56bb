// Small durable-file helpers: whole-file reads and atomic, fsynced writes. Private to Loom.
#pragma once

#include <filesystem>
#include <functional>
#include <string>
#include <string_view>

namespace loom::util {

// How write_file_atomic finishes.
enum class Durability {
  kFsync,       // the file and then its directory are fsynced: the new file survives a crash
  kAtomicOnly,  // no fsync (rendezvous files, which a crashed host's job does not reread)
};

// Loom's one atomic file write: a temporary file in the same directory is written (and, with
// kFsync, fsynced), renamed over `path` (and, with kFsync, the directory fsynced). Readers see
// the old file or the new one, never a mix. Failure is IoError naming the file, and leaves no
// temporary file behind.
void write_file_atomic(const std::filesystem::path& path, const std::string& contents,
                       Durability durability = Durability::kFsync);
// The same with the contents written by `write` into the temporary file's descriptor `fd`
// (through write_all), for contents too large to hold as one string.
void write_file_atomic(const std::filesystem::path& path,
                       const std::function<void(int fd, const std::filesystem::path& temp)>& write,
                       Durability durability = Durability::kFsync);

// Writes all `size` bytes to `fd`, through short writes and EINTR; IoError naming `file`.
void write_all(int fd, const void* data, size_t size, const std::filesystem::path& file);

// The whole file. A missing or unreadable file is IoError naming the path.
std::string read_file(const std::filesystem::path& path);

// Whether `name` is a plain file name, safe to join to a directory: not empty, at most 255
// bytes, no '/', no NUL, no "..", and not starting with '.'. Every file name read from a
// file or the network (dataset and checkpoint manifests, RPCs) must pass before it becomes
// a path, so that nothing outside the directory is ever opened.
bool is_plain_file_name(std::string_view name);

// Throws CorruptData "<what>: <role> \"<name>\" is not a plain file name ..." unless
// is_plain_file_name(name); the name is quoted with control bytes escaped.
void check_plain_file_name(std::string_view name, const std::string& what, const char* role);

// fsyncs a directory so that a rename or create inside it is durable.
void fsync_dir(const std::filesystem::path& dir);

// std::filesystem::create_directories, with a failure as IoError "cannot create <what> <dir>:
// <the system's reason>; <remedy>" instead of std::filesystem::filesystem_error.
void create_directories(const std::filesystem::path& dir, const std::string& what,
                        const std::string& remedy);

}  // namespace loom::util

// Small durable-file helpers: whole-file reads and atomic, fsynced writes. Private to Loom.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

namespace loom::util {

// Writes `contents` to `path` atomically and durably: a temporary file in the same directory
// is written and fsynced, renamed over `path`, then the directory is fsynced. Readers see the
// old file or the new one, never a mix; after return the new file survives a crash.
// Failure is IoError naming the path.
void write_file_atomic(const std::filesystem::path& path, const std::string& contents);

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

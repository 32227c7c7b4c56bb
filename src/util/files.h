// Small durable-file helpers: whole-file reads and atomic, fsynced writes. Private to Loom.
#pragma once

#include <filesystem>
#include <string>

namespace loom::util {

// Writes `contents` to `path` atomically and durably: a temporary file in the same directory
// is written and fsynced, renamed over `path`, then the directory is fsynced. Readers see the
// old file or the new one, never a mix; after return the new file survives a crash.
// Failure is IoError naming the path.
void write_file_atomic(const std::filesystem::path& path, const std::string& contents);

// The whole file. A missing or unreadable file is IoError naming the path.
std::string read_file(const std::filesystem::path& path);

// fsyncs a directory so that a rename or create inside it is durable.
void fsync_dir(const std::filesystem::path& dir);

}  // namespace loom::util

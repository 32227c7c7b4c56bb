// Shared by the libFuzzer targets (tools/fuzz.sh): bytes from the fuzzer reach a parser of
// untrusted input, which may refuse them only with Loom's own errors (loom::Error and its
// subclasses, naming what is wrong). Any other exception, a crash, a leak or undefined
// behaviour (ASan + UBSan) is a finding.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "loom/error.h"

namespace loom::fuzz {

// Runs f, swallowing only Loom's errors.
template <typename F>
void refuses_cleanly(F&& f) {
  try {
    f();
  } catch (const loom::Error&) {
  }
}

// A directory of this process's own for targets that parse files (removed at exit).
inline const std::filesystem::path& scratch_dir() {
  static const struct Dir {
    std::filesystem::path path;
    Dir() {
      const char* base = std::getenv("TMPDIR");
      path = std::filesystem::path(base != nullptr ? base : "/tmp") /
             ("loom-fuzz-" + std::to_string(::getpid()));
      std::filesystem::create_directories(path);
    }
    ~Dir() {
      std::error_code ignored;
      std::filesystem::remove_all(path, ignored);
    }
  } dir;
  return dir.path;
}

inline void write_bytes(const std::filesystem::path& file, const uint8_t* data, size_t size) {
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
}

}  // namespace loom::fuzz

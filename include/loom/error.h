// Loom's exception hierarchy and the check macros that raise it.
//
// Every error that crosses the public API is a loom::Error (a std::runtime_error). Library
// code never calls exit() or abort() on bad input: it throws one of the types below with a
// message that names the thing at fault and, where there is one, what to do about it.
#pragma once

#include <cerrno>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "loom/visibility.h"

namespace loom {

// The root: catch this to handle every Loom error.
class LOOM_API Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A caller passed a value Loom cannot work with (bad option, wrong shape, wrong world size).
class LOOM_API InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A configuration problem: unknown key, wrong type, malformed or missing config file.
class LOOM_API ConfigError : public InvalidArgument {
 public:
  using InvalidArgument::InvalidArgument;
};

// A file or system call failed (open, write, fsync, rename, mmap, socket, fork...).
class LOOM_API IoError : public Error {
 public:
  using Error::Error;
};

// Bytes on disk or on the wire are not what they claim to be (checksum, magic, truncation).
class LOOM_API CorruptData : public Error {
 public:
  using Error::Error;
};

// A wait passed its deadline. The message names what was waited for.
class LOOM_API Timeout : public Error {
 public:
  using Error::Error;
};

// A collective or a peer failed: connection lost, peer died, mismatched collective.
class LOOM_API CommError : public Error {
 public:
  using Error::Error;
};

namespace detail {

template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}

// Builds the message for a failed system call from errno, names the call and the place.
[[noreturn]] LOOM_API void throw_system_error(int err, const char* call, const std::string& context,
                                              const char* file, int line);

}  // namespace detail
}  // namespace loom

// Throws ExceptionType with the streamed message when cond is false.
//   LOOM_CHECK(n > 0, loom::InvalidArgument, "batch_size must be positive, got ", n);
#define LOOM_CHECK(cond, ExceptionType, ...)                               \
  do {                                                                     \
    if (!(cond)) throw ExceptionType(::loom::detail::concat(__VA_ARGS__)); \
  } while (0)

// Checks a POSIX call that returns -1 and sets errno on failure; throws loom::IoError naming
// the call, the context (usually the path) and the source location. Yields the call's result.
//   int fd = LOOM_CHECK_SYS(::open(path.c_str(), O_RDONLY), "opening ", path);
#define LOOM_CHECK_SYS(call, ...)                                                           \
  ([&]() {                                                                                  \
    auto loom_rc_ = (call);                                                                 \
    if (loom_rc_ == -1)                                                                     \
      ::loom::detail::throw_system_error(errno, #call, ::loom::detail::concat(__VA_ARGS__), \
                                         __FILE__, __LINE__);                               \
    return loom_rc_;                                                                        \
  }())

// Out-of-line pieces of loom/error.h: the message builder behind LOOM_CHECK_SYS.

#include "loom/error.h"

#include <cstring>
#include <filesystem>

namespace loom::detail {

void throw_system_error(int err, const char* call, const std::string& context, const char* file,
                        int line) {
  // strerror_r has two incompatible signatures; std::strerror is fine here because the text
  // is copied into the message at once.
  const std::string reason = std::strerror(err);
  const std::string where = std::filesystem::path(file).filename().string();
  throw IoError(concat(context.empty() ? "" : context + ": ", call, " failed: ", reason, " (errno ",
                       err, ") [", where, ":", line, "]"));
}

}  // namespace loom::detail

// Loom's version, for logs and for programs that need to check it.
#pragma once

#include "loom/visibility.h"

namespace loom {

// "major.minor.patch" of the library the program is linked against.
LOOM_API const char* version();

}  // namespace loom

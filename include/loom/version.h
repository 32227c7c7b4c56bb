// Loom's version, for logs and for programs that need to check it.
#pragma once

namespace loom {

// "major.minor.patch" of the library the program is linked against.
const char* version();

}  // namespace loom

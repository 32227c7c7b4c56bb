// The TOML reading the config uses, for other files Loom reads (job specs): the same checks
// and error messages. Private to Loom.
#pragma once

#include <toml++/toml.h>

#include <filesystem>

namespace loom::internal {

// Parses a TOML file. ConfigError naming it as `what` ("config file", "job spec") when it is
// missing or unreadable, and the line and column of a syntax error (or of the first byte TOML
// cannot hold).
toml::table read_toml_file(const std::filesystem::path& path, const char* what);

}  // namespace loom::internal

// Parsing the decimal integers that Store::add keeps as values. Private to Loom.
#pragma once

#include <cstdint>
#include <string>

namespace loom::comm {

// The integer held by a counter key. Anything but exactly a decimal integer (strtoll alone
// would accept leading spaces and trailing bytes) is InvalidArgument naming the store and key.
int64_t parse_counter(const char* store, const std::string& key, const std::string& value);

}  // namespace loom::comm

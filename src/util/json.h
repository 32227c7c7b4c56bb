// Reading integers out of untrusted JSON. Private to Loom.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "loom/error.h"

namespace loom::util {

// `value` (field `key` of `where`; `where` may be empty) as a T when it is a JSON integer that
// fits T; anything else (a float, a string, an integer out of range) is CorruptData
// "<where>: \"<key>\" is <value>, not an integer that fits <N> bits". nlohmann's get<T>()
// converts a float or an out-of-range number without a check, which is undefined behaviour
// (found by the fuzzers in tests/fuzz/). Every integer Loom reads from JSON it did not just
// write comes through here: manifests, flight dumps, reader, mixture and trainer states,
// checkpoint blobs, the registry, goodput accounts and snapshot indexes.
template <typename T>
T integer_field(const nlohmann::json& value, const char* key, const std::string& where) {
  static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool>);
  using Limits = std::numeric_limits<T>;
  if (value.is_number_unsigned()) {
    const auto v = value.get<uint64_t>();
    if (v <= static_cast<uint64_t>(Limits::max())) return static_cast<T>(v);
  } else if (value.is_number_integer()) {  // negative
    if constexpr (std::is_signed_v<T>) {
      const auto v = value.get<int64_t>();
      if (v >= static_cast<int64_t>(Limits::min())) return static_cast<T>(v);
    }
  }
  throw CorruptData(detail::concat(where, where.empty() ? "" : ": ", "\"", key, "\" is ",
                                   value.dump(), ", not ",
                                   std::is_unsigned_v<T> ? "a non-negative integer" : "an integer",
                                   " that fits ", sizeof(T) * 8, " bits"));
}

}  // namespace loom::util

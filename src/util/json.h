// Reading integers out of untrusted JSON. Private to Loom.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>

#include <nlohmann/json.hpp>

namespace loom::util {

// `value` as a T when it is a JSON integer that fits T; nullopt for anything else (a float, a
// string, an integer out of T's range). nlohmann's get<T>() converts a float or an out-of-range
// number without a check, which is undefined behaviour (found by the fuzzers in tests/fuzz/).
// The dataset and checkpoint manifests and flight dumps read their integers through here; the
// other JSON readers (safetensors headers, states in checkpoint blobs, the registry) do not yet.
template <typename T>
std::optional<T> integer_of(const nlohmann::json& value) {
  static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool>);
  using Limits = std::numeric_limits<T>;
  if (value.is_number_unsigned()) {
    const auto v = value.get<uint64_t>();
    if (v > static_cast<uint64_t>(Limits::max())) return std::nullopt;
    return static_cast<T>(v);
  }
  if (value.is_number_integer()) {  // negative
    const auto v = value.get<int64_t>();
    if constexpr (std::is_unsigned_v<T>) {
      return std::nullopt;
    } else {
      if (v < static_cast<int64_t>(Limits::min())) return std::nullopt;
      return static_cast<T>(v);
    }
  }
  return std::nullopt;
}

}  // namespace loom::util

// Whole-string number parsing for text from users and the network. Private to Loom.
#pragma once

#include <charconv>
#include <cstdint>
#include <optional>
#include <string_view>

namespace loom::util {

// `text` as a non-negative decimal integer, all of it: digits only (no sign, no spaces), at
// most UINT64_MAX; nullopt otherwise.
inline std::optional<uint64_t> parse_unsigned(std::string_view text) {
  uint64_t value = 0;
  if (text.empty() || text[0] < '0' || text[0] > '9') return std::nullopt;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

}  // namespace loom::util

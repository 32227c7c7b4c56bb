// Tar files: a 512-byte header per member, its data padded to a multiple of 512 bytes, and a
// zero block at the end (POSIX.1-2001 ustar and pax; GNU tar's long names and base-256 sizes).
#include "tar_reader.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string_view>

#include "loom/error.h"
#include "util/number.h"

namespace loom::cli {
namespace {

constexpr size_t kBlock = 512;
constexpr uint64_t kNoSize = ~uint64_t{0};

// A header field of at most n bytes, ended by a NUL when shorter.
std::string text_field(const char* h, size_t offset, size_t n) {
  return std::string(h + offset, strnlen(h + offset, n));
}

// A numeric header field: octal digits after optional spaces, ended by a space or NUL or the
// field's end; or GNU's base-256 (first byte 0x80, then big-endian). nullopt when neither.
std::optional<uint64_t> number_field(const char* h, size_t offset, size_t n) {
  const auto* p = reinterpret_cast<const unsigned char*>(h + offset);
  uint64_t value = 0;
  if (p[0] == 0x80) {
    for (size_t i = 1; i < n; ++i) {
      if (value >> 56) return std::nullopt;
      value = value << 8 | p[i];
    }
    return value;
  }
  size_t i = 0;
  while (i < n && p[i] == ' ') ++i;
  const size_t first = i;
  for (; i < n && p[i] >= '0' && p[i] <= '7'; ++i) value = value * 8 + (p[i] - '0');
  if (i == first || (i < n && p[i] != ' ' && p[i] != '\0')) return std::nullopt;
  return value;
}

// The header's checksum as tar computes it: every byte summed, the checksum field counted as
// eight spaces; bytes as unsigned (POSIX) or, as some old tars did, signed.
uint64_t header_sum(const char* h, bool as_signed) {
  int64_t sum = 0;
  for (size_t i = 0; i < kBlock; ++i) {
    const bool checksum_field = i >= 148 && i < 156;
    sum += checksum_field ? ' '
           : as_signed    ? static_cast<signed char>(h[i])
                          : static_cast<unsigned char>(h[i]);
  }
  return static_cast<uint64_t>(sum);
}

// The path and size records of a pax extended header ("LENGTH key=value\n" each); false when it
// is malformed.
bool parse_pax(std::string_view data, std::string* path, uint64_t* size) {
  while (!data.empty()) {
    const size_t space = data.find(' ');
    const auto length = util::parse_unsigned(data.substr(0, space));
    if (space == std::string_view::npos || !length || *length <= space + 1 ||
        *length > data.size() || data[*length - 1] != '\n') {
      return false;
    }
    const std::string_view record = data.substr(space + 1, *length - space - 2);
    const size_t eq = record.find('=');
    if (eq == std::string_view::npos) return false;
    const std::string_view key = record.substr(0, eq), value = record.substr(eq + 1);
    if (key == "path") *path = std::string(value);
    if (key == "size") {
      const auto parsed = util::parse_unsigned(value);
      if (!parsed || *parsed == kNoSize) return false;
      *size = *parsed;
    }
    data.remove_prefix(*length);
  }
  return true;
}

}  // namespace

TarReader::TarReader(std::string file) : file_(std::move(file)), in_(file_, std::ios::binary) {
  std::error_code ec;
  file_size_ = std::filesystem::file_size(file_, ec);
  LOOM_CHECK(in_.good() && !ec, InvalidArgument, "cannot read tar file ", file_);
}

size_t TarReader::read(char* out, size_t n) {
  in_.read(out, static_cast<std::streamsize>(n));
  const auto got = static_cast<size_t>(in_.gcount());
  hasher_.update(out, got);
  offset_ += got;
  return got;
}

void TarReader::fail(const std::string& member, const std::string& what) const {
  throw InvalidArgument(detail::concat(file_, ": member '", member, "': ", what));
}

std::string TarReader::read_data(uint64_t n, const std::string& member) {
  const uint64_t left = file_size_ > offset_ ? file_size_ - offset_ : 0;
  if (n > left) {
    fail(member,
         detail::concat("truncated: its header says ", n, " bytes but only ", left, " follow"));
  }
  std::string data(n, '\0');
  if (read(data.data(), n) != n) fail(member, "the file shrank while it was read");
  char padding[kBlock];
  const uint64_t pad = (kBlock - n % kBlock) % kBlock;
  if (read(padding, pad) != pad) fail(member, "truncated: the file ends inside its padding");
  return data;
}

bool TarReader::next(TarMember* member) {
  std::string long_path;  // from a GNU 'L' or pax 'x' header: the next member's path
  uint64_t pax_size = kNoSize;
  for (;;) {
    const uint64_t at = offset_;
    const std::string after = last_.empty() ? "" : " after member '" + last_ + "'";
    char h[kBlock];
    const size_t got = read(h, kBlock);
    LOOM_CHECK(got != 0, InvalidArgument, file_, ": truncated: the file ends", after,
               " without the end-of-archive block");
    LOOM_CHECK(got == kBlock, InvalidArgument, file_,
               ": truncated: the file ends inside the header", " at byte ", at, after);
    if (std::all_of(h, h + kBlock, [](char c) { return c == 0; })) {
      // The end. What follows is a second zero block and padding: zeros, unless this block was
      // zeroed in the middle of an archive (or archives were concatenated).
      for (size_t n; (n = read(h, kBlock)) != 0;) {
        LOOM_CHECK(std::all_of(h, h + n, [](char c) { return c == 0; }), InvalidArgument, file_,
                   ": the zero block at byte ", at, after,
                   " ends the archive but data follows it (a corrupt or concatenated archive)");
      }
      return false;
    }
    const bool ustar = std::memcmp(h + 257, "ustar\0", 6) == 0;  // (GNU's "ustar " has no prefix)
    const std::string prefix = ustar ? text_field(h, 345, 155) : "";
    const std::string name = !long_path.empty()
                                 ? long_path
                                 : (prefix.empty() ? "" : prefix + "/") + text_field(h, 0, 100);
    const auto checksum = number_field(h, 148, 8);
    if (!checksum || (*checksum != header_sum(h, false) && *checksum != header_sum(h, true))) {
      fail(name,
           detail::concat("the header at byte ", at, " fails its checksum (it records ",
                          checksum ? std::to_string(*checksum) : "no number", ", its bytes sum to ",
                          header_sum(h, false), "): the file is corrupt"));
    }
    const char type = h[156];
    if (type != '0' && type != '\0' && type != '5' && type != 'L' && type != 'x') {
      fail(name, detail::concat("is of tar type '", std::string(1, type),
                                "'; only regular files and directories can be read (types '0' "
                                "and '5', with GNU long names and pax headers)"));
    }
    const bool extension = type == 'L' || type == 'x';  // describes the next header
    const auto size = pax_size != kNoSize && !extension ? pax_size : number_field(h, 124, 12);
    if (!size) fail(name, detail::concat("the header at byte ", at, " has no valid size"));
    std::string data = read_data(*size, name);
    if (type == 'L') {
      long_path = data.substr(0, strnlen(data.data(), data.size()));
    } else if (type == 'x') {
      if (!parse_pax(data, &long_path, &pax_size)) fail(name, "its pax header is malformed");
    } else if (type == '5') {
      long_path.clear();
      pax_size = kNoSize;
    } else {
      last_ = name;
      *member = {name, std::move(data)};
      return true;
    }
  }
}

}  // namespace loom::cli

// Reads IDX files (the format MNIST and Fashion-MNIST ship in), gzip-compressed or plain.
#pragma once

#include <cstdint>
#include <filesystem>
#include <vector>

namespace loom::cli {

struct IdxArray {
  std::vector<int64_t> shape;  // e.g. {60000, 28, 28}
  std::vector<uint8_t> data;   // row-major uint8 elements
};

// A missing file is IoError; a file that is not a uint8 IDX array of `dims` dimensions, or is
// cut short, is CorruptData naming it.
IdxArray read_idx(const std::filesystem::path& path, uint32_t dims);

}  // namespace loom::cli

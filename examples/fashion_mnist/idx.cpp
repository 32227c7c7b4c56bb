// IDX reader (big-endian header: magic, dims; then raw uint8 data), through zlib's gzread,
// which reads plain files too.
#include "idx.h"

#include <zlib.h>

#include <loom/error.h>

#include <memory>
#include <string>
#include <vector>

namespace fashion_mnist {
namespace {

struct GzCloser {
  void operator()(gzFile_s* file) const { gzclose(file); }
};

std::vector<uint8_t> read_all(const std::filesystem::path& path) {
  LOOM_CHECK(std::filesystem::exists(path), loom::IoError, "Fashion-MNIST file ", path,
             " not found: install Debian's dataset-fashion-mnist (tools/install-deps.sh) or "
             "set --data.dir");
  std::unique_ptr<gzFile_s, GzCloser> file(gzopen(path.c_str(), "rb"));
  LOOM_CHECK(file != nullptr, loom::IoError, "cannot open ", path);
  std::vector<uint8_t> bytes;
  uint8_t buffer[1 << 16];
  int n;
  while ((n = gzread(file.get(), buffer, sizeof(buffer))) > 0)
    bytes.insert(bytes.end(), buffer, buffer + n);
  LOOM_CHECK(n == 0, loom::CorruptData, "corrupt gzip stream in ", path);
  return bytes;
}

uint32_t be32(const std::vector<uint8_t>& bytes, size_t offset) {
  return (uint32_t{bytes[offset]} << 24) | (uint32_t{bytes[offset + 1]} << 16) |
         (uint32_t{bytes[offset + 2]} << 8) | uint32_t{bytes[offset + 3]};
}

// Checks the magic (0x0000080<dims>) and size; returns the dimensions.
std::vector<int64_t> parse_header(const std::vector<uint8_t>& bytes, uint32_t dims,
                                  const std::filesystem::path& path) {
  LOOM_CHECK(bytes.size() >= 4 + 4 * dims && be32(bytes, 0) == (0x800u | dims), loom::CorruptData,
             path, " is not an IDX file with ", dims, " dimension(s)");
  std::vector<int64_t> shape;
  int64_t total = 1;
  for (uint32_t d = 0; d < dims; ++d) {
    shape.push_back(be32(bytes, 4 + 4 * d));
    total *= shape.back();
  }
  LOOM_CHECK(bytes.size() == 4 + 4 * dims + static_cast<size_t>(total), loom::CorruptData, path,
             " holds ", bytes.size() - 4 - 4 * dims, " data bytes, its header promises ", total);
  return shape;
}

torch::Tensor to_tensor(std::vector<uint8_t> bytes, const std::vector<int64_t>& shape,
                        size_t header) {
  auto holder = std::make_shared<std::vector<uint8_t>>(std::move(bytes));
  return torch::from_blob(
             holder->data() + header, shape, [holder](void*) mutable { holder.reset(); },
             torch::kUInt8)
      .clone();
}

}  // namespace

torch::Tensor read_images(const std::filesystem::path& path) {
  std::vector<uint8_t> bytes = read_all(path);
  std::vector<int64_t> shape = parse_header(bytes, 3, path);
  return to_tensor(std::move(bytes), shape, 16);
}

torch::Tensor read_labels(const std::filesystem::path& path) {
  std::vector<uint8_t> bytes = read_all(path);
  std::vector<int64_t> shape = parse_header(bytes, 1, path);
  return to_tensor(std::move(bytes), shape, 8).to(torch::kInt64);
}

}  // namespace fashion_mnist

// IDX reader: a big-endian header (magic 0x00000800 | dims, then each dimension), then raw
// uint8 data; read through zlib's gzread, which reads plain files too.
#include "idx.h"

#include <zlib.h>

#include <memory>

#include "loom/error.h"

namespace loom::cli {
namespace {

struct GzCloser {
  void operator()(gzFile_s* file) const { gzclose(file); }
};

uint32_t be32(const std::vector<uint8_t>& bytes, size_t offset) {
  return (uint32_t{bytes[offset]} << 24) | (uint32_t{bytes[offset + 1]} << 16) |
         (uint32_t{bytes[offset + 2]} << 8) | uint32_t{bytes[offset + 3]};
}

}  // namespace

IdxArray read_idx(const std::filesystem::path& path, uint32_t dims) {
  LOOM_CHECK(std::filesystem::exists(path), IoError, "IDX file ", path.string(),
             " not found (Fashion-MNIST comes with Debian's dataset-fashion-mnist)");
  std::unique_ptr<gzFile_s, GzCloser> file(gzopen(path.c_str(), "rb"));
  LOOM_CHECK(file != nullptr, IoError, "cannot open ", path.string());
  std::vector<uint8_t> bytes;
  uint8_t buffer[1 << 16];
  int n;
  while ((n = gzread(file.get(), buffer, sizeof buffer)) > 0)
    bytes.insert(bytes.end(), buffer, buffer + n);
  LOOM_CHECK(n == 0, CorruptData, "corrupt gzip stream in ", path.string());
  const size_t header = 4 + 4 * size_t{dims};
  LOOM_CHECK(bytes.size() >= header && be32(bytes, 0) == (0x800u | dims), CorruptData,
             path.string(), " is not a uint8 IDX file with ", dims, " dimension(s)");
  IdxArray out;
  // The product of the dimensions is bounded by the bytes there are at every step, so that
  // 2^22 * 2^21 * 2^21 cannot wrap to 0 and "match" an empty file.
  size_t total = 1;
  const size_t data_bytes = bytes.size() - header;
  for (uint32_t d = 0; d < dims; ++d) {
    out.shape.push_back(be32(bytes, 4 + 4 * d));
    total *= static_cast<size_t>(out.shape.back());
    LOOM_CHECK(total <= data_bytes, CorruptData, path.string(), " holds ", data_bytes,
               " data bytes, its header promises more (dimension ", d, " is ", out.shape.back(),
               ")");
  }
  LOOM_CHECK(bytes.size() == header + total, CorruptData, path.string(), " holds ",
             bytes.size() - header, " data bytes, its header promises ", total);
  out.data.assign(bytes.begin() + static_cast<std::ptrdiff_t>(header), bytes.end());
  return out;
}

}  // namespace loom::cli

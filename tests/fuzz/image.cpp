// An encoded image as an image field stores it (PNG, JPEG or Loom raw), probed and decoded as
// the Reader does: the writer decoded it once, so this is what a hash collision, a writer bug
// or a hostile dataset would hand the decoders. Decoding must never crash, hang or read outside
// the input; an image that probes must decode to exactly its probed size or say why not.
#include <vector>

#include "data/image_codec.h"
#include "fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace image = loom::data::image;
  image::Info info;
  if (!image::probe(data, size, &info).empty()) return 0;
  // Headers may claim up to 2^28 pixels; the fuzzer decodes only what fits its memory limit.
  if (info.height * info.width * info.channels > (int64_t{1} << 24)) return 0;
  std::vector<uint8_t> pixels(static_cast<size_t>(info.height * info.width * info.channels));
  image::decode(data, size, info, pixels.data());
  return 0;
}

// Image decoding for the data pipeline: PNG, JPEG and Loom's raw format to 8-bit HWC pixels,
// plus the matching encoders for dataset builders and tests.
//
// Contract shared by every function here:
//  - Decoded pixels are uint8, row-major height x width x channels (HWC), channels 1 to 4.
//    PNG: gray -> 1, gray+alpha -> 2, RGB -> 3, RGBA -> 4. A palette expands to RGB, or RGBA
//    when it has tRNS; tRNS on gray or RGB adds an alpha channel; 16-bit samples keep their
//    high byte; bit depths below 8 expand to 0..255; interlaced images are de-interlaced. No
//    gamma or colour-profile conversion is applied. JPEG: grayscale -> 1, YCbCr or RGB -> 3;
//    CMYK and YCCK are refused.
//  - Raw layout: the 8 bytes "LOOMRAW1", uint32 little-endian height, width, channels, then
//    exactly height * width * channels pixel bytes.
//  - Limits: each side 1 to kMaxSide, height * width at most kMaxPixels, channels 1 to 4.
//  - probe and decode never throw, abort, print or read outside [data, data + size): any input,
//    however malformed, yields an error string. A truncated or corrupt file is an error, not a
//    partial image (JPEG warnings other than a premature end of data are tolerated).
//  - All functions are reentrant: they keep no state between calls, so any number of threads
//    may call them at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace loom::data::image {

enum class Encoding { kPng, kJpeg, kRaw };

// "png", "jpeg" or "raw".
const char* to_string(Encoding e);

inline constexpr int64_t kMaxSide = 32768;
inline constexpr int64_t kMaxPixels = int64_t{1} << 28;

// The decoded size of an image, in 8-bit HWC.
struct Info {
  Encoding encoding = Encoding::kRaw;
  int64_t height = 0;
  int64_t width = 0;
  int64_t channels = 0;
};

// Reads only the header of an encoded image (PNG by its 8-byte signature, JPEG by FF D8 FF, raw
// by "LOOMRAW1"). Returns "" and fills *info, or a one-line description of what is wrong, such as
// "PNG header is truncated" or an image beyond the limits; *info is then left unchanged.
std::string probe(const uint8_t* data, size_t size, Info* info);

// Decodes into out, which holds info.height * info.width * info.channels bytes. info is what
// probe reported for the same bytes: decode checks that the image still decodes to exactly that
// shape before writing anything. Returns "" or what is wrong, with libpng's or libjpeg's message
// where one of them found it ("PNG data is corrupt: IDAT: CRC error"). On error, out may hold
// partial pixels.
std::string decode(const uint8_t* data, size_t size, const Info& info, uint8_t* out);

// Encoders: pixels are HWC uint8 within the limits above. PNG takes 1 to 4 channels (gray,
// gray+alpha, RGB, RGBA); JPEG 1 or 3 with quality 1 to 100 (lossy: see its test for how close
// a round trip comes); raw 1 to 4. Return the encoded bytes. Bad arguments (null pixels, a shape
// beyond the limits, an unsupported channel count or quality) throw std::invalid_argument; a
// failure inside libpng or libjpeg (out of memory) throws std::runtime_error.
std::string encode_png(const uint8_t* pixels, int64_t height, int64_t width, int64_t channels);
std::string encode_jpeg(const uint8_t* pixels, int64_t height, int64_t width, int64_t channels,
                        int quality = 90);
std::string encode_raw(const uint8_t* pixels, int64_t height, int64_t width, int64_t channels);

}  // namespace loom::data::image

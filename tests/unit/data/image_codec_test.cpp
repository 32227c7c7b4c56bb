// Image codec: PNG and raw round trips are exact, JPEG's are within a stated bound, libpng-made
// variants (palette, 16-bit, low bit depth, tRNS, interlace) decode by the channel rules, and
// every malformed input (empty, random, truncated, corrupt, oversized) is an error, not a crash.

#include "data/image_codec.h"

#include <gtest/gtest.h>
#include <jpeglib.h>
#include <png.h>

#include <algorithm>
#include <csetjmp>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace loom::data::image {
namespace {

using Bytes = std::vector<uint8_t>;

Bytes random_pixels(int64_t height, int64_t width, int64_t channels, uint32_t seed) {
  std::mt19937 rng(seed);
  Bytes pixels(static_cast<size_t>(height * width * channels));
  for (uint8_t& p : pixels) p = static_cast<uint8_t>(rng());
  return pixels;
}

// A smooth image: each channel a linear ramp in a different direction, no edges.
Bytes gradient(int64_t height, int64_t width, int64_t channels) {
  Bytes pixels;
  for (int64_t y = 0; y < height; ++y) {
    for (int64_t x = 0; x < width; ++x) {
      const int64_t ramps[3] = {x * 255 / (width - 1), y * 255 / (height - 1),
                                (x + y) * 255 / (width + height - 2)};
      for (int64_t c = 0; c < channels; ++c) pixels.push_back(static_cast<uint8_t>(ramps[c]));
    }
  }
  return pixels;
}

const uint8_t* bytes_of(const std::string& s) { return reinterpret_cast<const uint8_t*>(s.data()); }

// Probes, then decodes into a buffer of the probed size. Returns the first error, or "".
std::string probe_and_decode(const std::string& encoded, Info* info, Bytes* pixels) {
  std::string error = probe(bytes_of(encoded), encoded.size(), info);
  if (!error.empty()) return error;
  pixels->assign(static_cast<size_t>(info->height * info->width * info->channels), 0);
  return decode(bytes_of(encoded), encoded.size(), *info, pixels->data());
}

void expect_info(const Info& info, Encoding encoding, int64_t height, int64_t width,
                 int64_t channels) {
  EXPECT_EQ(info.encoding, encoding);
  EXPECT_EQ(info.height, height);
  EXPECT_EQ(info.width, width);
  EXPECT_EQ(info.channels, channels);
}

// The PNG chunk CRC (ISO 3309, as in zlib's crc32), for hand-made and patched chunks.
uint32_t crc32(const uint8_t* data, size_t size) {
  uint32_t crc = 0xffffffffu;
  for (size_t i = 0; i < size; ++i) {
    crc ^= data[i];
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ (0xedb88320u & (0u - (crc & 1)));
  }
  return ~crc;
}

void append_u32be(std::string* out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) *out += static_cast<char>(v >> shift & 0xff);
}

std::string png_chunk(const char* type, const std::string& payload) {
  std::string chunk;
  append_u32be(&chunk, static_cast<uint32_t>(payload.size()));
  chunk += std::string(type, 4) + payload;
  append_u32be(&chunk, crc32(bytes_of(chunk) + 4, chunk.size() - 4));
  return chunk;
}

struct Chunk {
  size_t offset;  // of its length field
  size_t length;  // of its data
  std::string type;
};

std::vector<Chunk> png_chunks(const std::string& png) {
  std::vector<Chunk> chunks;
  for (size_t at = 8; at + 12 <= png.size();) {
    size_t length = 0;
    for (int i = 0; i < 4; ++i) length = length << 8 | bytes_of(png)[at + i];
    chunks.push_back({at, length, png.substr(at + 4, 4)});
    at += 12 + length;
  }
  return chunks;
}

std::vector<Chunk> idat_chunks(const std::string& png) {
  std::vector<Chunk> idats;
  for (const Chunk& chunk : png_chunks(png)) {
    if (chunk.type == "IDAT") idats.push_back(chunk);
  }
  return idats;
}

// A PNG written with libpng's full API, for the variants encode_png does not produce.
struct PngSpec {
  uint32_t width, height;
  int bit_depth, color_type;
  bool interlaced = false;
  std::vector<png_color> palette = {};
  Bytes palette_alpha = {};  // tRNS for a palette image
  bool has_trans_color = false;
  png_color_16 trans_color{};  // tRNS for a gray or RGB image
  Bytes rows = {};             // packed PNG rows, big-endian 16-bit samples
};

void append_to_string(png_structp png, png_bytep data, size_t size) {
  static_cast<std::string*>(png_get_io_ptr(png))->append(reinterpret_cast<char*>(data), size);
}

// Plain locals only: libpng's default error handler longjmps back here.
bool write_png_with_libpng(const PngSpec* spec, std::string* out) {
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png_create_info_struct(png);
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    return false;
  }
  png_set_write_fn(png, out, append_to_string, nullptr);
  png_set_IHDR(png, info, spec->width, spec->height, spec->bit_depth, spec->color_type,
               spec->interlaced ? PNG_INTERLACE_ADAM7 : PNG_INTERLACE_NONE,
               PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  if (!spec->palette.empty()) {
    png_set_PLTE(png, info, spec->palette.data(), static_cast<int>(spec->palette.size()));
  }
  if (!spec->palette_alpha.empty() || spec->has_trans_color) {
    png_set_tRNS(png, info, spec->palette_alpha.data(),
                 static_cast<int>(spec->palette_alpha.size()), &spec->trans_color);
  }
  png_write_info(png, info);
  const size_t stride = spec->rows.size() / spec->height;
  const int passes = png_set_interlace_handling(png);
  for (int pass = 0; pass < passes; ++pass) {
    for (uint32_t y = 0; y < spec->height; ++y) png_write_row(png, &spec->rows[y * stride]);
  }
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  return true;
}

std::string png_from_spec(const PngSpec& spec) {
  std::string out;
  EXPECT_TRUE(write_png_with_libpng(&spec, &out));
  return out;
}

TEST(ImageCodec, ToStringNamesEachEncoding) {
  EXPECT_STREQ(to_string(Encoding::kPng), "png");
  EXPECT_STREQ(to_string(Encoding::kJpeg), "jpeg");
  EXPECT_STREQ(to_string(Encoding::kRaw), "raw");
}

TEST(ImageCodec, PngRoundTripsEachChannelCountExactly) {
  for (int64_t channels = 1; channels <= 4; ++channels) {
    const Bytes pixels = random_pixels(13, 17, channels, 100 + channels);
    const std::string encoded = encode_png(pixels.data(), 13, 17, channels);
    Info info;
    Bytes decoded;
    ASSERT_EQ(probe_and_decode(encoded, &info, &decoded), "") << channels;
    expect_info(info, Encoding::kPng, 13, 17, channels);
    EXPECT_EQ(decoded, pixels) << channels << " channels";
  }
}

TEST(ImageCodec, RawRoundTripsEachChannelCountExactly) {
  for (int64_t channels = 1; channels <= 4; ++channels) {
    const Bytes pixels = random_pixels(9, 31, channels, 200 + channels);
    const std::string encoded = encode_raw(pixels.data(), 9, 31, channels);
    ASSERT_EQ(encoded.size(), 20 + pixels.size());
    EXPECT_EQ(encoded.substr(0, 12), std::string("LOOMRAW1\x09\0\0\0", 12));
    Info info;
    Bytes decoded;
    ASSERT_EQ(probe_and_decode(encoded, &info, &decoded), "") << channels;
    expect_info(info, Encoding::kRaw, 9, 31, channels);
    EXPECT_EQ(decoded, pixels) << channels << " channels";
  }
}

// How far a JPEG round trip of the smooth gradient below may stray, per sample and on average.
struct JpegTolerance {
  int max_abs;
  double mean_abs;
};
// Gray: only DCT quantization, whose steps for the lowest frequencies are 1 to 2 levels at
// quality 95, where a gradient has nearly all its energy; observed max 1, mean 0.06.
constexpr JpegTolerance kJpegGray = {2, 0.25};
// RGB adds the colour path: R, G, B -> Y, Cb, Cr rounded to 8 bits and back (up to about 2
// levels), and 4:2:0 chroma subsampling, which libjpeg's triangle upsampling undoes exactly on
// interior linear ramps but not at the image border; observed max 5, mean 0.66 (still max 4 at
// quality 100, so the colour path, not quantization, dominates). The mean bound is what catches
// a one-pixel shift or a swapped channel, which moves every sample by 2 levels or more.
constexpr JpegTolerance kJpegRgb = {6, 1.0};

void expect_jpeg_round_trip(int64_t channels, JpegTolerance tolerance) {
  const int64_t height = 48, width = 64;
  const Bytes pixels = gradient(height, width, channels);
  const std::string encoded = encode_jpeg(pixels.data(), height, width, channels, 95);
  Info info;
  Bytes decoded;
  ASSERT_EQ(probe_and_decode(encoded, &info, &decoded), "");
  expect_info(info, Encoding::kJpeg, height, width, channels);
  ASSERT_EQ(decoded.size(), pixels.size());
  int worst = 0;
  double total = 0;
  for (size_t i = 0; i < pixels.size(); ++i) {
    const int diff = std::abs(decoded[i] - pixels[i]);
    worst = std::max(worst, diff);
    total += diff;
  }
  EXPECT_LE(worst, tolerance.max_abs) << channels << " channels";
  EXPECT_LE(total / pixels.size(), tolerance.mean_abs) << channels << " channels";
}

TEST(ImageCodec, JpegGrayRoundTripIsWithinTolerance) { expect_jpeg_round_trip(1, kJpegGray); }

TEST(ImageCodec, JpegRgbRoundTripIsWithinTolerance) { expect_jpeg_round_trip(3, kJpegRgb); }

TEST(ImageCodec, CmykJpegIsRefused) {
  const Bytes pixels = random_pixels(8, 8, 4, 7);
  jpeg_compress_struct cinfo;
  jpeg_error_mgr err;
  cinfo.err = jpeg_std_error(&err);  // a failure here exits the test binary, as wanted
  jpeg_create_compress(&cinfo);
  unsigned char* buffer = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&cinfo, &buffer, &size);
  cinfo.image_width = cinfo.image_height = 8;
  cinfo.input_components = 4;
  cinfo.in_color_space = JCS_CMYK;
  jpeg_set_defaults(&cinfo);
  jpeg_start_compress(&cinfo, TRUE);
  while (cinfo.next_scanline < 8) {
    JSAMPROW row = const_cast<uint8_t*>(&pixels[cinfo.next_scanline * 32]);
    jpeg_write_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_compress(&cinfo);
  jpeg_destroy_compress(&cinfo);
  const std::string encoded(reinterpret_cast<char*>(buffer), size);
  std::free(buffer);
  Info info;
  EXPECT_EQ(probe(bytes_of(encoded), encoded.size(), &info),
            "CMYK JPEGs are not supported; convert to RGB");
}

TEST(ImageCodec, PaletteExpandsToRgb) {
  PngSpec spec{.width = 3, .height = 2, .bit_depth = 8, .color_type = PNG_COLOR_TYPE_PALETTE};
  spec.palette = {{10, 20, 30}, {40, 50, 60}, {70, 80, 90}};
  spec.rows = {0, 1, 2, 2, 1, 0};
  Info info;
  Bytes decoded;
  ASSERT_EQ(probe_and_decode(png_from_spec(spec), &info, &decoded), "");
  expect_info(info, Encoding::kPng, 2, 3, 3);
  EXPECT_EQ(decoded,
            (Bytes{10, 20, 30, 40, 50, 60, 70, 80, 90, 70, 80, 90, 40, 50, 60, 10, 20, 30}));
}

TEST(ImageCodec, TwoBitPaletteWithTransparencyExpandsToRgba) {
  PngSpec spec{.width = 4, .height = 1, .bit_depth = 2, .color_type = PNG_COLOR_TYPE_PALETTE};
  spec.palette = {{1, 2, 3}, {4, 5, 6}, {7, 8, 9}};
  spec.palette_alpha = {0, 128};  // entry 2 has no tRNS entry: opaque
  spec.rows = {0b00'01'10'01};    // indices 0, 1, 2, 1
  Info info;
  Bytes decoded;
  ASSERT_EQ(probe_and_decode(png_from_spec(spec), &info, &decoded), "");
  expect_info(info, Encoding::kPng, 1, 4, 4);
  EXPECT_EQ(decoded, (Bytes{1, 2, 3, 0, 4, 5, 6, 128, 7, 8, 9, 255, 4, 5, 6, 128}));
}

TEST(ImageCodec, SixteenBitPngKeepsTheHighByte) {
  PngSpec spec{.width = 5, .height = 3, .bit_depth = 16, .color_type = PNG_COLOR_TYPE_RGB};
  spec.rows = random_pixels(3, 5, 6, 11);  // big-endian samples: the high byte comes first
  Bytes expected;
  for (size_t i = 0; i < spec.rows.size(); i += 2) expected.push_back(spec.rows[i]);
  Info info;
  Bytes decoded;
  ASSERT_EQ(probe_and_decode(png_from_spec(spec), &info, &decoded), "");
  expect_info(info, Encoding::kPng, 3, 5, 3);
  EXPECT_EQ(decoded, expected);
}

TEST(ImageCodec, LowBitDepthGrayExpandsToFullRange) {
  PngSpec one_bit{.width = 10, .height = 1, .bit_depth = 1, .color_type = PNG_COLOR_TYPE_GRAY};
  one_bit.rows = {0b10110000, 0b01000000};
  Info info;
  Bytes decoded;
  ASSERT_EQ(probe_and_decode(png_from_spec(one_bit), &info, &decoded), "");
  expect_info(info, Encoding::kPng, 1, 10, 1);
  EXPECT_EQ(decoded, (Bytes{255, 0, 255, 255, 0, 0, 0, 0, 0, 255}));

  PngSpec four_bit{.width = 3, .height = 1, .bit_depth = 4, .color_type = PNG_COLOR_TYPE_GRAY};
  four_bit.rows = {0x0f, 0x70};
  ASSERT_EQ(probe_and_decode(png_from_spec(four_bit), &info, &decoded), "");
  EXPECT_EQ(decoded, (Bytes{0, 255, 7 * 17}));
}

TEST(ImageCodec, GrayAndRgbTransparencyAddAlpha) {
  PngSpec gray{.width = 4, .height = 1, .bit_depth = 8, .color_type = PNG_COLOR_TYPE_GRAY};
  gray.has_trans_color = true;
  gray.trans_color.gray = 7;
  gray.rows = {7, 8, 7, 0};
  Info info;
  Bytes decoded;
  ASSERT_EQ(probe_and_decode(png_from_spec(gray), &info, &decoded), "");
  expect_info(info, Encoding::kPng, 1, 4, 2);
  EXPECT_EQ(decoded, (Bytes{7, 0, 8, 255, 7, 0, 0, 255}));

  PngSpec rgb{.width = 2, .height = 1, .bit_depth = 8, .color_type = PNG_COLOR_TYPE_RGB};
  rgb.has_trans_color = true;
  rgb.trans_color.red = 1, rgb.trans_color.green = 2, rgb.trans_color.blue = 3;
  rgb.rows = {1, 2, 3, 1, 2, 4};
  ASSERT_EQ(probe_and_decode(png_from_spec(rgb), &info, &decoded), "");
  expect_info(info, Encoding::kPng, 1, 2, 4);
  EXPECT_EQ(decoded, (Bytes{1, 2, 3, 0, 1, 2, 4, 255}));
}

TEST(ImageCodec, InterlacedPngDecodesExactly) {
  PngSpec spec{.width = 23,
               .height = 19,
               .bit_depth = 8,
               .color_type = PNG_COLOR_TYPE_RGB_ALPHA,
               .interlaced = true};
  spec.rows = random_pixels(19, 23, 4, 12);
  Info info;
  Bytes decoded;
  ASSERT_EQ(probe_and_decode(png_from_spec(spec), &info, &decoded), "");
  expect_info(info, Encoding::kPng, 19, 23, 4);
  EXPECT_EQ(decoded, spec.rows);
}

TEST(ImageCodec, EmptyInputIsAnError) {
  Info info;
  const uint8_t byte = 0;
  uint8_t out[3];
  EXPECT_EQ(probe(nullptr, 0, &info), "image data is empty");
  EXPECT_EQ(probe(&byte, 0, &info), "image data is empty");
  EXPECT_EQ(decode(&byte, 0, {Encoding::kPng, 1, 1, 3}, out), "image data is empty");
}

TEST(ImageCodec, UnknownBytesAreNamedInTheError) {
  const std::string html = "<html><body>";
  Info info;
  EXPECT_EQ(probe(bytes_of(html), html.size(), &info),
            "not a PNG, JPEG or Loom raw image (first bytes 3c 68 74 6d)");
  EXPECT_EQ(probe(bytes_of(html), 2, &info),
            "not a PNG, JPEG or Loom raw image (first bytes 3c 68)");
}

// Random bytes, alone and behind each format's magic: always an error, never a crash (the
// sanitizer build checks that nothing outside the buffers is touched).
TEST(ImageCodec, RandomBytesAreAnError) {
  const std::string magics[] = {"", "\x89PNG\r\n\x1a\n", "\xff\xd8\xff", "LOOMRAW1"};
  for (uint32_t seed = 0; seed < 50; ++seed) {
    for (const std::string& magic : magics) {
      const Bytes noise = random_pixels(1, 1, 1 + seed * 40, seed);
      const std::string encoded = magic + std::string(noise.begin(), noise.end());
      Info info;
      Bytes decoded;
      EXPECT_NE(probe_and_decode(encoded, &info, &decoded), "") << "seed " << seed;
    }
  }
}

// Every proper prefix of a valid file fails in probe or decode; none reads past its end.
void expect_every_cut_fails(const std::string& encoded) {
  for (size_t cut = 1; cut < encoded.size(); ++cut) {
    const std::string prefix = encoded.substr(0, cut);
    Info info;
    Bytes decoded;
    EXPECT_NE(probe_and_decode(prefix, &info, &decoded), "") << "cut at " << cut;
  }
}

TEST(ImageCodec, TruncatedPngIsAnErrorAtEveryCut) {
  const Bytes pixels = random_pixels(16, 16, 3, 3);
  const std::string encoded = encode_png(pixels.data(), 16, 16, 3);
  expect_every_cut_fails(encoded);
  Info info;
  EXPECT_EQ(probe(bytes_of(encoded), 20, &info), "PNG header is truncated");
  Bytes out(16 * 16 * 3);
  EXPECT_EQ(
      decode(bytes_of(encoded), encoded.size() - 100, {Encoding::kPng, 16, 16, 3}, out.data()),
      "PNG data is truncated");
}

TEST(ImageCodec, TruncatedJpegIsAnErrorAtEveryCut) {
  for (int64_t channels : {1, 3}) {
    const Bytes pixels = gradient(24, 40, channels);
    const std::string encoded = encode_jpeg(pixels.data(), 24, 40, channels, 80);
    expect_every_cut_fails(encoded);
    Info info;
    EXPECT_EQ(probe(bytes_of(encoded), 20, &info), "JPEG header is truncated");
    Bytes out(24 * 40 * channels);
    EXPECT_EQ(decode(bytes_of(encoded), encoded.size() - 2, {Encoding::kJpeg, 24, 40, channels},
                     out.data()),
              "JPEG data is truncated");
  }
}

TEST(ImageCodec, TruncatedRawIsAnErrorAtEveryCut) {
  const Bytes pixels = random_pixels(4, 5, 2, 4);
  expect_every_cut_fails(encode_raw(pixels.data(), 4, 5, 2));
}

// A flipped bit in the first of several IDAT chunks: libpng's chunk CRC catches it; with the
// CRC recomputed (corruption before the file was checksummed), zlib must catch it instead.
TEST(ImageCodec, FlippedIdatByteIsAnError) {
  const Bytes pixels = random_pixels(64, 64, 3, 5);  // incompressible: 12 KB, several IDATs
  std::string corrupt = encode_png(pixels.data(), 64, 64, 3);
  const std::vector<Chunk> idats = idat_chunks(corrupt);
  ASSERT_GE(idats.size(), 2u);
  const Chunk& first = idats[0];
  corrupt[first.offset + 8 + first.length / 2] ^= 0x10;
  Info info;
  Bytes decoded;
  EXPECT_EQ(probe_and_decode(corrupt, &info, &decoded), "PNG data is corrupt: IDAT: CRC error");

  const std::string refreshed = png_chunk("IDAT", corrupt.substr(first.offset + 8, first.length));
  corrupt.replace(first.offset, refreshed.size(), refreshed);
  const std::string error = probe_and_decode(corrupt, &info, &decoded);
  EXPECT_EQ(error.rfind("PNG data is corrupt: IDAT: ", 0), 0u) << error;
  EXPECT_NE(error, "PNG data is corrupt: IDAT: CRC error");
}

// When the zlib checksum sits in an IDAT of its own, libpng checks it after the last row and by
// default only warns on a mismatch; decode must still fail.
TEST(ImageCodec, BadZlibChecksumAfterTheLastRowIsAnError) {
  const Bytes pixels = random_pixels(16, 16, 3, 9);
  const std::string encoded = encode_png(pixels.data(), 16, 16, 3);
  const Chunk last = idat_chunks(encoded).back();
  const std::string stream = encoded.substr(last.offset + 8, last.length);
  auto with_checksum_apart = [&](char flip) {
    const std::string body = stream.substr(0, stream.size() - 4);
    std::string checksum = stream.substr(stream.size() - 4);
    checksum[3] ^= flip;
    return encoded.substr(0, last.offset) + png_chunk("IDAT", body) + png_chunk("IDAT", checksum) +
           encoded.substr(last.offset + 12 + last.length);
  };
  Info info;
  Bytes decoded;
  ASSERT_EQ(probe_and_decode(with_checksum_apart(0), &info, &decoded), "");
  EXPECT_EQ(decoded, pixels);
  EXPECT_EQ(probe_and_decode(with_checksum_apart(1), &info, &decoded),
            "PNG data is corrupt: IDAT: incorrect data check");
}

TEST(ImageCodec, OversizedPngHeaderIsRefusedByProbe) {
  std::string ihdr;
  append_u32be(&ihdr, 100000);               // width
  append_u32be(&ihdr, 100000);               // height
  ihdr += std::string("\x08\x02\0\0\0", 5);  // 8-bit RGB, not interlaced
  const std::string png =
      "\x89PNG\r\n\x1a\n" + png_chunk("IHDR", ihdr) + png_chunk("IDAT", "") + png_chunk("IEND", "");
  Info info;
  EXPECT_EQ(probe(bytes_of(png), png.size(), &info),
            "image is 100000x100000 pixels; at most 2^28 pixels and 32768 per side are decoded");
}

std::string raw_header(uint32_t height, uint32_t width, uint32_t channels) {
  std::string header = "LOOMRAW1";
  for (uint32_t v : {height, width, channels}) {
    for (int shift = 0; shift < 32; shift += 8) header += static_cast<char>(v >> shift & 0xff);
  }
  return header;
}

TEST(ImageCodec, RawSizeMismatchIsAnError) {
  const Bytes pixels = random_pixels(2, 3, 1, 6);
  const std::string encoded = encode_raw(pixels.data(), 2, 3, 1);
  Info info;
  EXPECT_EQ(probe(bytes_of(encoded + "x"), encoded.size() + 1, &info),
            "Loom raw image 2x3x1 takes 26 bytes with its header, but the data holds 27");
  EXPECT_NE(probe(bytes_of(encoded), encoded.size() - 1, &info), "");
}

TEST(ImageCodec, RawHeaderBeyondTheLimitsIsRefused) {
  const std::string too_big = "at most 2^28 pixels and 32768 per side are decoded";
  const struct {
    uint32_t height, width, channels;
    std::string error;
  } cases[] = {
      {100000, 100000, 3, "image is 100000x100000 pixels; " + too_big},
      {32769, 1, 1, "image is 32769x1 pixels; " + too_big},
      {16384, 16385, 1, "image is 16384x16385 pixels; " + too_big},  // 2^28 + 2^14 pixels
      {0xffffffff, 0xffffffff, 0xffffffff, "image is 4294967295x4294967295 pixels; " + too_big},
      {0, 5, 1, "image is 0x5 pixels; each side must be at least 1"},
      {2, 2, 5, "image has 5 channels; 1 to 4 are decoded"},
      {2, 2, 0, "image has 0 channels; 1 to 4 are decoded"},
  };
  for (const auto& c : cases) {
    const std::string header = raw_header(c.height, c.width, c.channels) + std::string(64, '\0');
    Info info;
    EXPECT_EQ(probe(bytes_of(header), header.size(), &info), c.error);
  }
}

// decode refuses an Info that does not describe the data, before writing anything.
TEST(ImageCodec, DecodeChecksInfoAgainstTheData) {
  const Bytes pixels = random_pixels(6, 7, 3, 8);
  const std::string encodings[] = {encode_png(pixels.data(), 6, 7, 3),
                                   encode_jpeg(pixels.data(), 6, 7, 3),
                                   encode_raw(pixels.data(), 6, 7, 3)};
  for (const std::string& encoded : encodings) {
    Info info;
    ASSERT_EQ(probe(bytes_of(encoded), encoded.size(), &info), "");
    for (Info wrong : {Info{info.encoding, 6, 7, 4}, Info{info.encoding, 7, 6, 3},
                       Info{info.encoding, 6, 7, 1}}) {
      Bytes out(static_cast<size_t>(wrong.height * wrong.width * wrong.channels), 0xab);
      const std::string error = decode(bytes_of(encoded), encoded.size(), wrong, out.data());
      EXPECT_NE(error.find("but info says"), std::string::npos) << error;
      EXPECT_EQ(out, Bytes(out.size(), 0xab)) << "decode wrote pixels despite the mismatch";
    }
    Info other = info;
    other.encoding = info.encoding == Encoding::kPng ? Encoding::kRaw : Encoding::kPng;
    Bytes out(6 * 7 * 3);
    EXPECT_EQ(decode(bytes_of(encoded), encoded.size(), other, out.data()),
              std::string("info says ") + to_string(other.encoding) + " but the data is not a " +
                  to_string(other.encoding) + " image");
    EXPECT_NE(decode(bytes_of(encoded), encoded.size(), {info.encoding, 0, 7, 3}, out.data()), "");
    EXPECT_NE(decode(bytes_of(encoded), encoded.size(), info, nullptr), "");
  }
}

TEST(ImageCodec, EncodersRejectBadArguments) {
  const Bytes pixels(64 * 4);
  EXPECT_THROW(encode_png(nullptr, 1, 1, 1), std::invalid_argument);
  EXPECT_THROW(encode_png(pixels.data(), 0, 1, 1), std::invalid_argument);
  EXPECT_THROW(encode_png(pixels.data(), 1, 32769, 1), std::invalid_argument);
  EXPECT_THROW(encode_png(pixels.data(), 1, 1, 5), std::invalid_argument);
  EXPECT_THROW(encode_raw(pixels.data(), 1, 1, 0), std::invalid_argument);
  EXPECT_THROW(encode_raw(pixels.data(), 16384, 16385, 1), std::invalid_argument);
  EXPECT_THROW(encode_jpeg(pixels.data(), 8, 8, 2), std::invalid_argument);
  EXPECT_THROW(encode_jpeg(pixels.data(), 8, 8, 4), std::invalid_argument);
  EXPECT_THROW(encode_jpeg(pixels.data(), 8, 8, 3, 0), std::invalid_argument);
  EXPECT_THROW(encode_jpeg(pixels.data(), 8, 8, 3, 101), std::invalid_argument);
}

}  // namespace
}  // namespace loom::data::image

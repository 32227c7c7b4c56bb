// PNG (libpng), JPEG (libjpeg-turbo) and Loom raw decoding and encoding; see image_codec.h.
//
// Both C libraries report errors by longjmp. Each library run happens in one plain function
// (png_run, jpeg_run, jpeg_encode_run) whose state lives in a caller-owned struct of plain
// data, and whose frame holds nothing with a destructor: a longjmp lands back in that function,
// which frees the library's objects and returns false. Nothing throws through C frames.
#include "data/image_codec.h"

#include <jerror.h>
#include <jpeglib.h>
#include <png.h>

#include <csetjmp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

namespace loom::data::image {
namespace {

constexpr uint8_t kPngSignature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
constexpr uint8_t kJpegSignature[3] = {0xff, 0xd8, 0xff};
constexpr char kRawMagic[8] = {'L', 'O', 'O', 'M', 'R', 'A', 'W', '1'};
constexpr size_t kRawHeaderBytes = 20;
// A progressive JPEG may have any number of scans, each a full pass over the coefficients; real
// encoders write about ten. Refusing more bounds the work a small malicious file can cause.
constexpr int kMaxJpegScans = 500;

// Why a library run failed.
enum class Failure { kNone, kCorrupt, kTruncated, kMismatch, kUnsupported };

bool starts_with(const uint8_t* data, size_t size, const void* magic, size_t n) {
  return size >= n && std::memcmp(data, magic, n) == 0;
}

bool detect(const uint8_t* data, size_t size, Encoding* encoding) {
  if (starts_with(data, size, kPngSignature, sizeof kPngSignature)) {
    *encoding = Encoding::kPng;
  } else if (starts_with(data, size, kJpegSignature, sizeof kJpegSignature)) {
    *encoding = Encoding::kJpeg;
  } else if (starts_with(data, size, kRawMagic, sizeof kRawMagic)) {
    *encoding = Encoding::kRaw;
  } else {
    return false;
  }
  return true;
}

std::string shape_string(const Info& info) {
  return std::to_string(info.height) + "x" + std::to_string(info.width) + "x" +
         std::to_string(info.channels);
}

bool same_shape(const Info& a, const Info& b) {
  return a.height == b.height && a.width == b.width && a.channels == b.channels;
}

std::string mismatch_message(const Info& got, const Info& want) {
  return std::string(to_string(got.encoding)) + " image decodes to " + shape_string(got) +
         " but info says " + shape_string(want);
}

// "" when the shape is within Loom's limits, else what is wrong.
std::string check_limits(int64_t height, int64_t width, int64_t channels) {
  const std::string size = std::to_string(height) + "x" + std::to_string(width);
  if (height < 1 || width < 1) return "image is " + size + " pixels; each side must be at least 1";
  if (height > kMaxSide || width > kMaxSide || height * width > kMaxPixels) {
    return "image is " + size + " pixels; at most 2^28 pixels and 32768 per side are decoded";
  }
  if (channels < 1 || channels > 4) {
    return "image has " + std::to_string(channels) + " channels; 1 to 4 are decoded";
  }
  return "";
}

// ---- PNG ----

// One libpng read: plain data, since libpng errors longjmp across it.
struct PngRead {
  const uint8_t* data;
  size_t size;
  size_t pos;
  png_structp png;
  png_infop info;
  bool in_pixels;  // the header was read: failures are in the image data
  Failure failure;
  char message[200];  // libpng's error message
};

[[noreturn]] void png_on_error(png_structp png, png_const_charp message) {
  auto* r = static_cast<PngRead*>(png_get_error_ptr(png));
  std::snprintf(r->message, sizeof r->message, "%s", message);
  png_longjmp(png, 1);
}

void png_on_warning(png_structp, png_const_charp) {}

void png_on_read(png_structp png, png_bytep dst, size_t n) {
  auto* r = static_cast<PngRead*>(png_get_io_ptr(png));
  if (n > r->size - r->pos) {
    r->failure = Failure::kTruncated;
    png_error(png, "truncated");
  }
  std::memcpy(dst, r->data + r->pos, n);
  r->pos += n;
}

// Reads the header, sets the transforms that give 8-bit HWC under the channel rules and reports
// the decoded shape in *got. With out == nullptr it stops there (probe); otherwise it decodes
// into out, but only if *got matches *want. Returns false on failure, with r->failure set.
bool png_run(PngRead* r, Info* got, const Info* want, uint8_t* out) {
  r->failure = Failure::kCorrupt;
  r->png = png_create_read_struct(PNG_LIBPNG_VER_STRING, r, png_on_error, png_on_warning);
  r->info = r->png != nullptr ? png_create_info_struct(r->png) : nullptr;
  if (r->info == nullptr) {
    std::snprintf(r->message, sizeof r->message, "out of memory");
    png_destroy_read_struct(&r->png, &r->info, nullptr);
    return false;
  }
  if (setjmp(png_jmpbuf(r->png))) {
    png_destroy_read_struct(&r->png, &r->info, nullptr);
    return false;
  }
  png_set_read_fn(r->png, r, png_on_read);
  // libpng's own default limit (1e6 per side) would preempt the clearer message of check_limits.
  png_set_user_limits(r->png, PNG_UINT_31_MAX, PNG_UINT_31_MAX);
  png_read_info(r->png, r->info);
  const int depth = png_get_bit_depth(r->png, r->info);
  const int color = png_get_color_type(r->png, r->info);
  if (depth == 16) png_set_strip_16(r->png);
  if (color == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(r->png);
  if (color == PNG_COLOR_TYPE_GRAY && depth < 8) png_set_expand_gray_1_2_4_to_8(r->png);
  if (png_get_valid(r->png, r->info, PNG_INFO_tRNS)) png_set_tRNS_to_alpha(r->png);
  const int passes = png_set_interlace_handling(r->png);
  png_read_update_info(r->png, r->info);
  *got = {Encoding::kPng, png_get_image_height(r->png, r->info),
          png_get_image_width(r->png, r->info), png_get_channels(r->png, r->info)};
  const size_t stride = static_cast<size_t>(got->width * got->channels);
  if (out == nullptr || !same_shape(*got, *want) || png_get_rowbytes(r->png, r->info) != stride) {
    if (out != nullptr) r->failure = Failure::kMismatch;
    png_destroy_read_struct(&r->png, &r->info, nullptr);
    return out == nullptr;
  }
  r->in_pixels = true;
  // Benign errors are warnings by default; in the pixel stream they include a bad zlib checksum,
  // which must fail the decode. Ancillary chunks after the image stay lenient.
  png_set_benign_errors(r->png, 0);
  for (int pass = 0; pass < passes; ++pass) {
    for (int64_t y = 0; y < got->height; ++y) png_read_row(r->png, out + y * stride, nullptr);
  }
  png_set_benign_errors(r->png, 1);
  png_read_end(r->png, nullptr);  // reads through IEND, so a cut-off file is an error
  png_destroy_read_struct(&r->png, &r->info, nullptr);
  return true;
}

std::string png_read(const uint8_t* data, size_t size, Info* got, const Info* want, uint8_t* out) {
  PngRead r{data, size, 0, nullptr, nullptr, false, Failure::kNone, {}};
  if (png_run(&r, got, want, out)) return "";
  const std::string part = r.in_pixels ? "PNG data" : "PNG header";
  switch (r.failure) {
    case Failure::kTruncated:
      return part + " is truncated";
    case Failure::kMismatch:
      return mismatch_message(*got, *want);
    default:
      return part + " is corrupt: " + r.message;
  }
}

// ---- JPEG ----

// Where libjpeg's error handlers find their way back; cinfo.client_data points here.
struct JpegFail {
  std::jmp_buf jump;
  Failure failure;
  char message[JMSG_LENGTH_MAX];
};

[[noreturn]] void jpeg_fail(j_common_ptr cinfo, Failure failure) {
  auto* fail = static_cast<JpegFail*>(cinfo->client_data);
  fail->failure = failure;
  if (failure == Failure::kCorrupt) (*cinfo->err->format_message)(cinfo, fail->message);
  std::longjmp(fail->jump, 1);
}

[[noreturn]] void jpeg_on_error(j_common_ptr cinfo) { jpeg_fail(cinfo, Failure::kCorrupt); }

// Warnings (level -1) about corrupt data are tolerated, as most decoders do, except a premature
// end: libjpeg would pad the image with grey. Trace messages (level >= 0) are dropped.
void jpeg_on_message(j_common_ptr cinfo, int level) {
  if (level < 0 && cinfo->err->msg_code == JWRN_JPEG_EOF) jpeg_fail(cinfo, Failure::kTruncated);
}

void jpeg_on_progress(j_common_ptr cinfo) {
  auto* dinfo = reinterpret_cast<j_decompress_ptr>(cinfo);
  if (dinfo->input_scan_number > kMaxJpegScans) {
    auto* fail = static_cast<JpegFail*>(cinfo->client_data);
    std::snprintf(fail->message, sizeof fail->message, "more than %d progressive scans",
                  kMaxJpegScans);
    jpeg_fail(cinfo, Failure::kUnsupported);
  }
}

struct JpegRead {
  JpegFail fail;
  jpeg_decompress_struct cinfo;
  jpeg_error_mgr err;
  jpeg_progress_mgr progress;
  bool in_pixels;  // the header was read: failures are in the image data
};

// Same contract as png_run.
bool jpeg_run(JpegRead* r, const uint8_t* data, size_t size, Info* got, const Info* want,
              uint8_t* out) {
  j_decompress_ptr cinfo = &r->cinfo;
  cinfo->err = jpeg_std_error(&r->err);
  r->err.error_exit = jpeg_on_error;
  r->err.emit_message = jpeg_on_message;
  cinfo->client_data = &r->fail;
  if (setjmp(r->fail.jump)) {
    jpeg_destroy_decompress(cinfo);
    return false;
  }
  jpeg_create_decompress(cinfo);
  cinfo->client_data = &r->fail;
  r->progress.progress_monitor = jpeg_on_progress;
  cinfo->progress = &r->progress;
  jpeg_mem_src(cinfo, data, size);
  jpeg_read_header(cinfo, TRUE);
  if (cinfo->jpeg_color_space == JCS_GRAYSCALE) {
    cinfo->out_color_space = JCS_GRAYSCALE;
  } else if (cinfo->jpeg_color_space == JCS_YCbCr || cinfo->jpeg_color_space == JCS_RGB) {
    cinfo->out_color_space = JCS_RGB;
  } else {
    if (cinfo->jpeg_color_space == JCS_CMYK || cinfo->jpeg_color_space == JCS_YCCK) {
      std::snprintf(r->fail.message, sizeof r->fail.message,
                    "CMYK JPEGs are not supported; convert to RGB");
    } else {
      std::snprintf(r->fail.message, sizeof r->fail.message,
                    "JPEG color space %d with %d components is not supported",
                    static_cast<int>(cinfo->jpeg_color_space), cinfo->num_components);
    }
    jpeg_fail(reinterpret_cast<j_common_ptr>(cinfo), Failure::kUnsupported);
  }
  jpeg_calc_output_dimensions(cinfo);
  *got = {Encoding::kJpeg, cinfo->output_height, cinfo->output_width, cinfo->output_components};
  if (out == nullptr || !same_shape(*got, *want)) {
    if (out != nullptr) r->fail.failure = Failure::kMismatch;
    jpeg_destroy_decompress(cinfo);
    return out == nullptr;
  }
  r->in_pixels = true;
  jpeg_start_decompress(cinfo);
  const size_t stride = static_cast<size_t>(got->width * got->channels);
  while (cinfo->output_scanline < cinfo->output_height) {
    JSAMPROW row = out + cinfo->output_scanline * stride;
    if (jpeg_read_scanlines(cinfo, &row, 1) != 1) {
      jpeg_fail(reinterpret_cast<j_common_ptr>(cinfo), Failure::kTruncated);
    }
  }
  jpeg_finish_decompress(cinfo);  // reads through EOI, so a cut-off file is an error
  jpeg_destroy_decompress(cinfo);
  return true;
}

std::string jpeg_read(const uint8_t* data, size_t size, Info* got, const Info* want, uint8_t* out) {
  auto r = std::make_unique<JpegRead>();  // about 1 KB of plain data, value-initialized
  if (jpeg_run(r.get(), data, size, got, want, out)) return "";
  const std::string part = r->in_pixels ? "JPEG data" : "JPEG header";
  switch (r->fail.failure) {
    case Failure::kTruncated:
      return part + " is truncated";
    case Failure::kMismatch:
      return mismatch_message(*got, *want);
    case Failure::kUnsupported:
      return r->fail.message;
    default:
      return part + " is corrupt: " + r->fail.message;
  }
}

struct JpegWrite {
  JpegFail fail;
  jpeg_compress_struct cinfo;
  jpeg_error_mgr err;
  unsigned char* buffer;  // malloc'ed by jpeg_mem_dest; the caller frees it
  unsigned long size;
};

bool jpeg_encode_run(JpegWrite* w, const uint8_t* pixels, int64_t height, int64_t width,
                     int64_t channels, int quality) {
  j_compress_ptr cinfo = &w->cinfo;
  cinfo->err = jpeg_std_error(&w->err);
  w->err.error_exit = jpeg_on_error;
  w->err.emit_message = jpeg_on_message;
  cinfo->client_data = &w->fail;
  if (setjmp(w->fail.jump)) {
    jpeg_destroy_compress(cinfo);
    return false;
  }
  jpeg_create_compress(cinfo);
  cinfo->client_data = &w->fail;
  jpeg_mem_dest(cinfo, &w->buffer, &w->size);
  cinfo->image_height = static_cast<JDIMENSION>(height);
  cinfo->image_width = static_cast<JDIMENSION>(width);
  cinfo->input_components = static_cast<int>(channels);
  cinfo->in_color_space = channels == 1 ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_set_defaults(cinfo);
  jpeg_set_quality(cinfo, quality, TRUE);
  jpeg_start_compress(cinfo, TRUE);
  const size_t stride = static_cast<size_t>(width * channels);
  while (cinfo->next_scanline < cinfo->image_height) {
    JSAMPROW row = const_cast<uint8_t*>(pixels + cinfo->next_scanline * stride);
    jpeg_write_scanlines(cinfo, &row, 1);
  }
  jpeg_finish_compress(cinfo);
  jpeg_destroy_compress(cinfo);
  return true;
}

// ---- Raw ----

uint32_t load_u32le(const uint8_t* p) {
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
}

std::string raw_probe(const uint8_t* data, size_t size, Info* got) {
  if (size < kRawHeaderBytes) return "Loom raw header is truncated";
  *got = {Encoding::kRaw, load_u32le(data + 8), load_u32le(data + 12), load_u32le(data + 16)};
  std::string error = check_limits(got->height, got->width, got->channels);
  if (!error.empty()) return error;
  const uint64_t expected = kRawHeaderBytes + got->height * got->width * got->channels;
  if (size != expected) {
    return "Loom raw image " + shape_string(*got) + " takes " + std::to_string(expected) +
           " bytes with its header, but the data holds " + std::to_string(size);
  }
  return "";
}

void check_encode_args(const char* what, const uint8_t* pixels, int64_t height, int64_t width,
                       int64_t channels) {
  if (pixels == nullptr) throw std::invalid_argument(std::string(what) + ": pixels is null");
  const std::string error = check_limits(height, width, channels);
  if (!error.empty()) throw std::invalid_argument(std::string(what) + ": " + error);
}

}  // namespace

const char* to_string(Encoding e) {
  switch (e) {
    case Encoding::kPng:
      return "png";
    case Encoding::kJpeg:
      return "jpeg";
    case Encoding::kRaw:
      return "raw";
  }
  return "unknown";
}

std::string probe(const uint8_t* data, size_t size, Info* info) {
  if (data == nullptr || size == 0) return "image data is empty";
  Encoding encoding;
  if (!detect(data, size, &encoding)) {
    std::string hex;
    for (size_t i = 0; i < size && i < 4; ++i) {
      char byte[4];
      std::snprintf(byte, sizeof byte, i == 0 ? "%02x" : " %02x", data[i]);
      hex += byte;
    }
    return "not a PNG, JPEG or Loom raw image (first bytes " + hex + ")";
  }
  Info got;
  std::string error = encoding == Encoding::kPng    ? png_read(data, size, &got, nullptr, nullptr)
                      : encoding == Encoding::kJpeg ? jpeg_read(data, size, &got, nullptr, nullptr)
                                                    : raw_probe(data, size, &got);
  if (error.empty()) error = check_limits(got.height, got.width, got.channels);
  if (error.empty()) *info = got;
  return error;
}

std::string decode(const uint8_t* data, size_t size, const Info& info, uint8_t* out) {
  if (out == nullptr) return "decode: output buffer is null";
  const std::string bad_info = check_limits(info.height, info.width, info.channels);
  if (!bad_info.empty()) return "decode: info is not a decodable shape: " + bad_info;
  if (data == nullptr || size == 0) return "image data is empty";
  Encoding encoding;
  if (!detect(data, size, &encoding) || encoding != info.encoding) {
    return std::string("info says ") + to_string(info.encoding) + " but the data is not a " +
           to_string(info.encoding) + " image";
  }
  Info got;
  if (encoding == Encoding::kPng) return png_read(data, size, &got, &info, out);
  if (encoding == Encoding::kJpeg) return jpeg_read(data, size, &got, &info, out);
  const std::string error = raw_probe(data, size, &got);
  if (!error.empty()) return error;
  if (!same_shape(got, info)) return mismatch_message(got, info);
  std::memcpy(out, data + kRawHeaderBytes, size - kRawHeaderBytes);
  return "";
}

std::string encode_png(const uint8_t* pixels, int64_t height, int64_t width, int64_t channels) {
  check_encode_args("encode_png", pixels, height, width, channels);
  static constexpr png_uint_32 kFormats[4] = {PNG_FORMAT_GRAY, PNG_FORMAT_GA, PNG_FORMAT_RGB,
                                              PNG_FORMAT_RGBA};
  png_image image;
  std::memset(&image, 0, sizeof image);
  image.version = PNG_IMAGE_VERSION;
  image.height = static_cast<png_uint_32>(height);
  image.width = static_cast<png_uint_32>(width);
  image.format = kFormats[channels - 1];
  png_alloc_size_t bytes = PNG_IMAGE_PNG_SIZE_MAX(image);
  std::string encoded(bytes, '\0');
  if (!png_image_write_to_memory(&image, encoded.data(), &bytes, 0, pixels, 0, nullptr)) {
    throw std::runtime_error(std::string("encode_png: libpng failed: ") + image.message);
  }
  encoded.resize(bytes);
  return encoded;
}

std::string encode_jpeg(const uint8_t* pixels, int64_t height, int64_t width, int64_t channels,
                        int quality) {
  check_encode_args("encode_jpeg", pixels, height, width, channels);
  if (channels != 1 && channels != 3) {
    throw std::invalid_argument("encode_jpeg: " + std::to_string(channels) +
                                " channels; JPEG takes 1 (gray) or 3 (RGB)");
  }
  if (quality < 1 || quality > 100) {
    throw std::invalid_argument("encode_jpeg: quality " + std::to_string(quality) +
                                " is outside 1..100");
  }
  auto w = std::make_unique<JpegWrite>();
  const bool ok = jpeg_encode_run(w.get(), pixels, height, width, channels, quality);
  const std::unique_ptr<unsigned char, decltype(&std::free)> buffer(w->buffer, &std::free);
  if (!ok) throw std::runtime_error(std::string("encode_jpeg: libjpeg failed: ") + w->fail.message);
  return std::string(reinterpret_cast<const char*>(buffer.get()), w->size);
}

std::string encode_raw(const uint8_t* pixels, int64_t height, int64_t width, int64_t channels) {
  check_encode_args("encode_raw", pixels, height, width, channels);
  std::string encoded(kRawMagic, sizeof kRawMagic);
  for (const int64_t v : {height, width, channels}) {
    for (int shift = 0; shift < 32; shift += 8) encoded += static_cast<char>(v >> shift & 0xff);
  }
  encoded.append(reinterpret_cast<const char*>(pixels),
                 static_cast<size_t>(height * width * channels));
  return encoded;
}

}  // namespace loom::data::image

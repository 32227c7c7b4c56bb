// Reading and writing safetensors files (see safetensors.h).
#include "ckpt/safetensors.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "loom/error.h"
#include "util/dtype.h"
#include "util/files.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors stores little-endian bytes; this code copies them as they are");

namespace loom::ckpt {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // the reference reader's limit

struct DtypeCode {
  c10::ScalarType type;
  const char* code;
};
constexpr DtypeCode kDtypes[] = {
    {c10::ScalarType::Float, "F32"}, {c10::ScalarType::Double, "F64"},
    {c10::ScalarType::Half, "F16"},  {c10::ScalarType::BFloat16, "BF16"},
    {c10::ScalarType::Long, "I64"},  {c10::ScalarType::Int, "I32"},
    {c10::ScalarType::Short, "I16"}, {c10::ScalarType::Char, "I8"},
    {c10::ScalarType::Byte, "U8"},   {c10::ScalarType::Bool, "BOOL"},
};

const char* code_of(c10::ScalarType type, const std::string& name) {
  for (const auto& d : kDtypes)
    if (d.type == type) return d.code;
  throw InvalidArgument(detail::concat("safetensors cannot hold tensor \"", name, "\" of dtype ",
                                       util::dtype_name(type),
                                       "; it names F32, F64, F16, BF16, I64, I32, I16, I8, U8, "
                                       "BOOL"));
}

// One header entry, checked: its dtype, shape and byte range inside the data section.
struct Entry {
  std::string name;
  c10::ScalarType type;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

Entry parse_entry(const std::string& name, const json& j, uint64_t data_bytes,
                  const std::string& what) {
  auto bad = [&](const std::string& why) {
    return CorruptData(detail::concat(what, ": tensor \"", name, "\": ", why,
                                      " (not a safetensors file, or a corrupt one)"));
  };
  if (!j.is_object() || !j.contains("dtype") || !j.contains("shape") || !j.contains("data_offsets"))
    throw bad("the header entry needs dtype, shape and data_offsets");
  Entry e{name, c10::ScalarType::Undefined, {}, 0, 0};
  const json& dtype = j.at("dtype");
  if (!dtype.is_string()) throw bad("dtype is not a string");
  for (const auto& d : kDtypes)
    if (dtype.get<std::string>() == d.code) e.type = d.type;
  if (e.type == c10::ScalarType::Undefined)
    throw bad(detail::concat("unknown dtype \"", dtype.get<std::string>(),
                             "\" (Loom reads F32, F64, F16, BF16, I64, I32, I16, I8, U8, BOOL)"));
  const json& shape = j.at("shape");
  if (!shape.is_array()) throw bad("shape is not an array");
  uint64_t numel = 1;
  for (const json& d : shape) {
    if (!d.is_number_unsigned()) throw bad("shape " + shape.dump() + " has a non-integer entry");
    const uint64_t n = d.get<uint64_t>();
    if (n > static_cast<uint64_t>(INT64_MAX) || (n != 0 && numel > data_bytes / n))
      throw bad("shape " + shape.dump() + " is larger than the file");
    numel *= n;
    e.shape.push_back(static_cast<int64_t>(n));
  }
  const json& offsets = j.at("data_offsets");
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned())
    throw bad("data_offsets is not a pair of integers");
  e.begin = offsets[0].get<uint64_t>();
  e.end = offsets[1].get<uint64_t>();
  if (e.begin > e.end || e.end > data_bytes)
    throw bad(detail::concat("data_offsets [", e.begin, ", ", e.end,
                             "] lie outside the data section of ", data_bytes, " bytes"));
  const uint64_t es = c10::elementSize(e.type);
  if (numel > UINT64_MAX / es || numel * es != e.end - e.begin)
    throw bad(detail::concat("shape ", shape.dump(), " of ", dtype.get<std::string>(), " needs ",
                             numel, " elements but data_offsets [", e.begin, ", ", e.end, "] hold ",
                             e.end - e.begin, " bytes"));
  return e;
}

}  // namespace

void write_safetensors(const fs::path& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const NamedTensor& t : tensors) {
    LOOM_CHECK(t.name != "__metadata__" && names.insert(t.name).second, InvalidArgument,
               "safetensors: tensor name \"", t.name, "\" is used twice or reserved");
    const uint64_t bytes = t.tensor.numel() * t.tensor.element_size();
    header[t.name] = {{"dtype", code_of(t.tensor.scalar_type(), t.name)},
                      {"shape", t.tensor.sizes().vec()},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  util::write_file_atomic(path, [&](int fd, const fs::path& temp) {
    char length[8];
    for (int i = 0; i < 8; ++i) length[i] = static_cast<char>(uint64_t{text.size()} >> (8 * i));
    util::write_all(fd, length, 8, temp);
    util::write_all(fd, text.data(), text.size(), temp);
    for (const NamedTensor& t : tensors) {
      const at::Tensor c = t.tensor.contiguous().cpu();
      util::write_all(fd, c.data_ptr(), c.numel() * c.element_size(), temp);
    }
  });
}

std::vector<NamedTensor> read_safetensors(const fs::path& path,
                                          std::map<std::string, std::string>* metadata) {
  const std::string what = "safetensors file " + path.string();
  std::ifstream in(path, std::ios::binary);
  LOOM_CHECK(in.good(), IoError, "cannot open ", path.string());
  std::error_code ec;
  const uint64_t size = fs::file_size(path, ec);
  LOOM_CHECK(!ec, IoError, "cannot read the size of ", path.string(), ": ", ec.message());
  LOOM_CHECK(size >= 8, CorruptData, what, " is truncated: ", size,
             " bytes, shorter than the 8-byte header length");
  unsigned char length[8];
  in.read(reinterpret_cast<char*>(length), 8);
  uint64_t header_bytes = 0;
  for (int i = 0; i < 8; ++i) header_bytes |= uint64_t{length[i]} << (8 * i);
  LOOM_CHECK(header_bytes <= size - 8 && header_bytes <= kMaxHeaderBytes, CorruptData, what,
             ": the header length says ", header_bytes, " bytes but the file has ", size,
             " (truncated, or not a safetensors file)");
  std::string text(header_bytes, '\0');
  in.read(text.data(), static_cast<std::streamsize>(header_bytes));
  LOOM_CHECK(in.good(), IoError, "reading the header of ", path.string(), " failed");
  const json header = json::parse(text, nullptr, /*allow_exceptions=*/false);
  LOOM_CHECK(header.is_object(), CorruptData, what,
             ": the header is not a JSON object (truncated, or not a safetensors file)");
  const uint64_t data_start = 8 + header_bytes, data_bytes = size - data_start;
  std::vector<Entry> entries;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      LOOM_CHECK(value.is_object(), CorruptData, what, ": __metadata__ is not an object");
      for (const auto& [k, v] : value.items()) {
        LOOM_CHECK(v.is_string(), CorruptData, what, ": __metadata__ value of \"", k,
                   "\" is not a string");
        if (metadata) (*metadata)[k] = v.get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(name, value, data_bytes, what));
  }
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return a.begin < b.begin; });
  std::vector<NamedTensor> tensors;
  for (const Entry& e : entries) {
    at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.type));
    in.seekg(static_cast<std::streamoff>(data_start + e.begin));
    in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(e.end - e.begin));
    LOOM_CHECK(in.good(), CorruptData, what, ": tensor \"", e.name,
               "\" ended early while reading it (truncated)");
    tensors.push_back({e.name, std::move(t)});
  }
  return tensors;
}

}  // namespace loom::ckpt

// Encoding and checked decoding of token and record shards.
#include "data/shard_format.h"

#include <algorithm>
#include <map>

#include "loom/error.h"
#include "util/dtype.h"
#include "util/hash.h"

namespace loom::data::format {
namespace {

uint64_t load_u64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename T>
void append_pod(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof value);
}

// The mapped file at `info.file`, with the size the manifest promises.
util::MappedFile open_checked(const std::filesystem::path& dir, const ShardInfo& info) {
  const auto path = dir / info.file;
  LOOM_CHECK(std::filesystem::exists(path), IoError, "shard ", path.string(),
             " is listed in the manifest but missing; restore it or rebuild the dataset");
  util::MappedFile file(path);
  LOOM_CHECK(file.size() == info.bytes, CorruptData, "shard ", path.string(), " is ", file.size(),
             " bytes but the manifest says ", info.bytes,
             (file.size() < info.bytes ? " (truncated)" : " (replaced or appended to)"),
             "; restore it or rebuild the dataset");
  return file;
}

void check_magic(const util::MappedFile& file, const char (&magic)[8], uint32_t version,
                 const char* kind) {
  LOOM_CHECK(file.size() >= 64 && std::memcmp(file.data(), magic, 8) == 0, CorruptData,
             file.path().string(), " is not a Loom ", kind, " shard (bad magic number)");
  LOOM_CHECK(version == kShardVersion, CorruptData, file.path().string(), " has ", kind,
             " shard format version ", version, "; this Loom reads version ", kShardVersion);
}

}  // namespace

size_t dtype_size(const std::string& dtype) {
  const std::optional<c10::ScalarType> type = util::dtype_of(dtype);
  LOOM_CHECK(type.has_value(), InvalidArgument, "unknown tensor dtype '", dtype, "'; use ",
             util::dtype_names());
  return c10::elementSize(*type);
}

FieldType parse_field_type(const std::string& name) {
  for (FieldType t : {FieldType::kBytes, FieldType::kText, FieldType::kInt, FieldType::kFloat,
                      FieldType::kTensor, FieldType::kImage, FieldType::kImages}) {
    if (name == to_string(t)) return t;
  }
  throw CorruptData("unknown field type '" + name + "' in the manifest's schema");
}

RecordLayout parse_layout(const std::string& name) {
  for (RecordLayout l :
       {RecordLayout::kPlain, RecordLayout::kMultimodal, RecordLayout::kEpisodes}) {
    if (name == to_string(l)) return l;
  }
  throw CorruptData("unknown record layout '" + name +
                    "' in the manifest; this Loom reads plain, multimodal and episodes");
}

std::vector<std::pair<const uint8_t*, size_t>> list_items(const FieldView& view) {
  std::vector<std::pair<const uint8_t*, size_t>> out;
  out.reserve(static_cast<size_t>(view.integer));
  const uint8_t* p = view.data;
  for (int64_t k = 0; k < view.integer; ++k) {
    uint32_t n;
    std::memcpy(&n, p, 4);  // decode_record checked every length against the record
    out.emplace_back(p + 4, n);
    p += 4 + size_t{n};
  }
  return out;
}

void encode_record(const std::vector<Field>& schema, const Record& record, std::string& out) {
  const auto& values = record.values();
  LOOM_CHECK(values.size() == schema.size(), InvalidArgument, "record has ", values.size(),
             " fields but the schema has ", schema.size());
  for (size_t i = 0; i < schema.size(); ++i) {
    const Field& field = schema[i];
    const Record::Value& value = values[i];
    LOOM_CHECK(value.type == field.type, InvalidArgument, "field '", field.name, "' is ",
               to_string(field.type), " in the schema but the record gives ",
               to_string(value.type));
    switch (field.type) {
      case FieldType::kInt:
        append_pod(out, value.integer);
        break;
      case FieldType::kFloat:
        append_pod(out, value.real);
        break;
      case FieldType::kBytes:
      case FieldType::kText:
      case FieldType::kImage:
        LOOM_CHECK(value.bytes.size() <= UINT32_MAX, InvalidArgument, "field '", field.name,
                   "' holds ", value.bytes.size(), " bytes; at most 4 GiB per value");
        append_pod(out, static_cast<uint32_t>(value.bytes.size()));
        out += value.bytes;
        break;
      case FieldType::kImages:
        LOOM_CHECK(value.items.size() <= UINT32_MAX, InvalidArgument, "field '", field.name,
                   "' holds ", value.items.size(), " images; at most 2^32 - 1");
        append_pod(out, static_cast<uint32_t>(value.items.size()));
        for (const std::string& item : value.items) {
          LOOM_CHECK(item.size() <= UINT32_MAX, InvalidArgument, "field '", field.name,
                     "' holds an image of ", item.size(), " bytes; at most 4 GiB per image");
          append_pod(out, static_cast<uint32_t>(item.size()));
          out += item;
        }
        break;
      case FieldType::kTensor: {
        int64_t numel = 1;
        for (int64_t d : value.shape) numel *= d;
        LOOM_CHECK(field.shape.empty() || field.shape == value.shape, InvalidArgument, "field '",
                   field.name, "' has a fixed shape in the schema; the record's differs");
        LOOM_CHECK(!field.ragged || !value.shape.empty(), InvalidArgument, "field '", field.name,
                   "' is ragged but the record gives a scalar; it needs a first dimension");
        LOOM_CHECK(static_cast<size_t>(numel) * dtype_size(field.dtype) == value.bytes.size(),
                   InvalidArgument, "field '", field.name, "': ", value.bytes.size(),
                   " bytes do not hold ", numel, " ", field.dtype, " elements");
        append_pod(out, static_cast<uint32_t>(value.shape.size()));
        for (int64_t d : value.shape) append_pod(out, d);
        out += value.bytes;
        break;
      }
    }
  }
}

std::string decode_record(const std::vector<Field>& schema, const uint8_t* payload, size_t size,
                          FieldView* out) {
  size_t at = 0;
  auto take = [&](size_t n) -> const uint8_t* {
    if (n > size - at) return nullptr;
    const uint8_t* p = payload + at;
    at += n;
    return p;
  };
  for (size_t i = 0; i < schema.size(); ++i) {
    const Field& field = schema[i];
    FieldView& view = out[i];
    const uint8_t* p = nullptr;
    switch (field.type) {
      case FieldType::kInt:
      case FieldType::kFloat:
        if (!(p = take(8))) return "field '" + field.name + "' runs past the record";
        if (field.type == FieldType::kInt)
          std::memcpy(&view.integer, p, 8);
        else
          std::memcpy(&view.real, p, 8);
        break;
      case FieldType::kBytes:
      case FieldType::kText:
      case FieldType::kImage: {
        uint32_t n;
        if (!(p = take(4))) return "field '" + field.name + "' runs past the record";
        std::memcpy(&n, p, 4);
        if (!(view.data = take(n))) return "field '" + field.name + "' runs past the record";
        view.size = n;
        break;
      }
      case FieldType::kImages: {
        uint32_t count;
        if (!(p = take(4))) return "field '" + field.name + "' runs past the record";
        std::memcpy(&count, p, 4);
        view.data = payload + at;
        view.integer = count;
        for (uint32_t k = 0; k < count; ++k) {
          uint32_t n = 0;
          if ((p = take(4))) std::memcpy(&n, p, 4);
          if (!p || !take(n)) {
            return "field '" + field.name + "' image " + std::to_string(k) +
                   " runs past the record";
          }
        }
        view.size = static_cast<size_t>(payload + at - view.data);
        break;
      }
      case FieldType::kTensor: {
        uint32_t ndim;
        if (!(p = take(4))) return "field '" + field.name + "' runs past the record";
        std::memcpy(&ndim, p, 4);
        if (ndim > FieldView::kMaxDims || !(p = take(8 * size_t{ndim}))) {
          return "field '" + field.name + "' has a malformed shape";
        }
        view.ndim = ndim;
        std::memcpy(view.dims, p, 8 * size_t{ndim});
        uint64_t numel = 1;
        for (uint32_t k = 0; k < ndim; ++k) {
          const int64_t d = view.dims[k];
          if (d < 0 || d > (int64_t{1} << 40)) return "field '" + field.name + "' has a bad shape";
          numel *= static_cast<uint64_t>(d);
          // More elements than the record has bytes (this also keeps the product from wrapping).
          if (numel > size) return "field '" + field.name + "' runs past the record";
        }
        if (!field.shape.empty() &&
            !std::equal(field.shape.begin(), field.shape.end(), view.dims, view.dims + ndim)) {
          return "field '" + field.name + "' does not have the schema's shape";
        }
        if (field.ragged && ndim == 0) return "ragged field '" + field.name + "' is a scalar";
        view.size = numel * dtype_size(field.dtype);
        if (!(view.data = take(view.size)))
          return "field '" + field.name + "' runs past the record";
        break;
      }
    }
  }
  if (at != size) return "the record has " + std::to_string(size - at) + " bytes after its fields";
  return "";
}

TokenShard::TokenShard(const std::filesystem::path& dir, const ShardInfo& info,
                       uint32_t token_bytes)
    : file_(open_checked(dir, info)) {
  check_magic(file_, kTokenMagic, file_.size() >= 64 ? header().version : 0, "token");
  const TokenHeader& h = header();
  const std::string name = file_.path().string();
  LOOM_CHECK(h.token_bytes == token_bytes, CorruptData, name, " stores ", h.token_bytes,
             "-byte tokens; the manifest's vocabulary needs ", token_bytes);
  LOOM_CHECK(h.num_tokens == info.items && h.num_documents == info.documents, CorruptData, name,
             " holds ", h.num_tokens, " tokens in ", h.num_documents,
             " documents; the manifest says ", info.items, " in ", info.documents);
  // Each count is bounded by the file's size first, so that no product or sum below wraps.
  const uint64_t size = file_.size();
  LOOM_CHECK(h.num_tokens <= size / h.token_bytes && h.num_documents < size / 8 &&
                 h.index_offset <= size &&
                 h.index_offset >= sizeof(TokenHeader) + h.num_tokens * h.token_bytes &&
                 size - h.index_offset == (h.num_documents + 1) * 8,
             CorruptData, name, ": its document index does not fit the file (", h.num_tokens,
             " tokens, ", h.num_documents, " documents, index at byte ", h.index_offset, " of ",
             size, ")");
  LOOM_CHECK(doc_offset(0) == 0 && doc_offset(h.num_documents) == h.num_tokens, CorruptData, name,
             ": its document index does not span its tokens");
}

uint64_t TokenShard::doc_offset(uint64_t d) const {
  return load_u64(file_.data() + header().index_offset + 8 * d);
}

std::pair<uint64_t, uint64_t> TokenShard::document(uint64_t d) const {
  const uint64_t begin = doc_offset(d), end = doc_offset(d + 1);
  LOOM_CHECK(begin <= end && end <= num_tokens(), CorruptData, "document ", d, " of shard ",
             file_.path().string(), " spans tokens [", begin, ", ", end, ") of ", num_tokens(),
             ": its document index is corrupt; run `loom data verify` and restore or rebuild "
             "the dataset");
  return {begin, end};
}

RecordShard::RecordShard(const std::filesystem::path& dir, const ShardInfo& info)
    : file_(open_checked(dir, info)) {
  const auto* h = reinterpret_cast<const RecordHeader*>(file_.data());
  check_magic(file_, kRecordMagic, file_.size() >= 64 ? h->version : 0, "record");
  const std::string name = file_.path().string();
  num_records_ = h->num_records;
  index_offset_ = h->index_offset;
  LOOM_CHECK(num_records_ == info.items, CorruptData, name, " holds ", num_records_,
             " records; the manifest says ", info.items);
  LOOM_CHECK(num_records_ < file_.size() / 8 && index_offset_ >= sizeof(RecordHeader) &&
                 index_offset_ <= file_.size() &&
                 file_.size() - index_offset_ == (num_records_ + 1) * 8,
             CorruptData, name, ": its record index does not fit the file (", num_records_,
             " records, index at byte ", index_offset_, " of ", file_.size(), ")");
  LOOM_CHECK(offset(0) == sizeof(RecordHeader) && offset(num_records_) == index_offset_,
             CorruptData, name, ": its record index does not span its records");
}

uint64_t RecordShard::offset(uint64_t i) const {
  return load_u64(file_.data() + index_offset_ + 8 * i);
}

std::string RecordShard::check(uint64_t i, Payload* payload) const {
  const uint64_t begin = offset(i);
  const uint64_t end = offset(i + 1);
  if (begin < sizeof(RecordHeader) || end > index_offset_ || end < begin || end - begin < 8) {
    return "its index entry is corrupt";
  }
  const uint8_t* p = file_.data() + begin;
  const size_t size = end - begin - 8;
  if (util::xxh64(p, size) != load_u64(p + size)) return "it fails its checksum";
  *payload = {p, size};
  return "";
}

RecordShard::Payload RecordShard::payload(uint64_t i) const {
  Payload result;
  const std::string bad = check(i, &result);
  LOOM_CHECK(bad.empty(), CorruptData, "record ", i, " of shard ", file_.path().string(),
             " (byte offset ", offset(i), ") is corrupt: ", bad,
             "; run `loom data verify` and restore or rebuild the dataset");
  return result;
}

}  // namespace loom::data::format

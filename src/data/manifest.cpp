// Dataset manifests: the content identity and its version, writing format 2, reading formats
// 1 and 2 with every field checked (types, ranges, plain file names, both hashes).
#include "data/manifest.h"

#include <limits>
#include <nlohmann/json.hpp>
#include <type_traits>

#include "data/chunk_check.h"
#include "data/layout.h"
#include "data/shard_format.h"
#include "loom/error.h"
#include "util/files.h"
#include "util/hash.h"
#include "util/json.h"
#include "util/mapped_file.h"

namespace loom::data {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// The identity is serialized with the format 1 layout, format_version included, forever: that
// is what keeps a format 1 dataset's version when it is migrated.
constexpr int kIdentityLayout = 1;
constexpr uint64_t kMinChunkBytes = 64;
constexpr uint64_t kMaxChunkBytes = uint64_t{1} << 30;

const char* kind_name(DatasetKind kind) {
  return kind == DatasetKind::kTokens ? "tokens" : "records";
}

json file_json(const FileInfo& f) {
  return {{"file", f.file}, {"bytes", f.bytes}, {"xxhash64", util::hash_hex(f.xxhash64)}};
}

// What the version hashes: everything that names the data, nothing a migration may change.
json identity_json(const Manifest& m) {
  json j = json::object();
  j["format"] = "loom-dataset";
  j["format_version"] = kIdentityLayout;
  j["kind"] = kind_name(m.kind);
  j["description"] = m.description;
  json shards = json::array();
  for (const ShardInfo& s : m.shards) {
    json e = {{"file", s.file}, {"bytes", s.bytes}, {"xxhash64", util::hash_hex(s.xxhash64)}};
    if (m.kind == DatasetKind::kTokens) {
      e["tokens"] = s.items;
      e["documents"] = s.documents;
    } else {
      e["records"] = s.items;
    }
    shards.push_back(std::move(e));
  }
  j["shards"] = std::move(shards);
  if (m.kind == DatasetKind::kTokens) {
    j["vocab_size"] = m.vocab_size;
    j["eos_id"] = m.eos_id;
    j["tokenizer"] = m.tokenizer;
  } else {
    json schema = json::array();
    for (const Field& f : m.schema) {
      json e = {{"name", f.name}, {"type", to_string(f.type)}};
      if (f.type == FieldType::kTensor) {
        e["dtype"] = f.dtype;
        e["shape"] = f.shape;
      }
      if (!f.classes.empty()) e["classes"] = f.classes;
      if (f.ragged) e["ragged"] = true;  // written only when set: older versions stay the same
      schema.push_back(std::move(e));
    }
    j["schema"] = std::move(schema);
    if (m.layout != RecordLayout::kPlain) j["layout"] = to_string(m.layout);
  }
  if (!m.tokenizer_files.empty()) {
    json files = json::array();
    for (const FileInfo& f : m.tokenizer_files) files.push_back(file_json(f));
    j["tokenizer_files"] = std::move(files);
  }
  return j;
}

// The manifest (format 2 and later) without its own hash: the identity plus the format's
// details. Formats 2 and 3 write the same keys, so it serves both.
json manifest_json(const Manifest& m) {
  json j = identity_json(m);
  j["format_version"] = m.format_version;
  j["chunk_bytes"] = m.chunk_bytes;
  for (size_t i = 0; i < m.shards.size(); ++i) {
    json hashes = json::array();
    for (uint64_t h : m.shards[i].chunk_hashes) hashes.push_back(util::hash_hex(h));
    j["shards"][i]["chunk_xxhash64"] = std::move(hashes);
  }
  if (!j.contains("tokenizer_files")) j["tokenizer_files"] = json::array();
  if (!m.previous_version.empty()) j["previous_version"] = m.previous_version;
  j["version"] = m.version;
  return j;
}

std::string manifest_hash(const Manifest& m) {
  return util::hash_hex(util::xxh64(manifest_json(m).dump()));
}

// `value`, field `key` (or an element of it), as a T. nlohmann converts between number kinds
// silently (-5 read as uint64_t is 2^64 - 5, 2^40 read as int is 0, 1e300 as int64_t is
// undefined), so an integer must be one and fit T (util::integer_field).
template <typename T>
T get_value(const json& value, const char* key, const fs::path& file) {
  try {
    if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
      return util::integer_field<T>(value, key, file.string());
    } else {
      return value.get<T>();
    }
  } catch (const json::exception& e) {
    throw CorruptData(
        detail::concat(file.string(), ": field \"", key, "\" has the wrong type (", e.what(), ")"));
  }
}

template <typename T>
T get(const json& j, const char* key, const fs::path& file) {
  LOOM_CHECK(j.is_object() && j.contains(key), CorruptData, file.string(), ": field \"", key,
             "\" is missing or has the wrong type");
  return get_value<T>(j.at(key), key, file);
}

// The array j[key], CorruptData unless it is one.
const json& get_array(const json& j, const char* key, const fs::path& file) {
  LOOM_CHECK(j.is_object() && j.contains(key) && j.at(key).is_array(), CorruptData, file.string(),
             ": field \"", key, "\" is missing or not an array");
  return j.at(key);
}

FileInfo parse_file(const json& e, const fs::path& file, const char* role) {
  FileInfo f;
  f.file = get<std::string>(e, "file", file);
  util::check_plain_file_name(f.file, file.string(), role);
  f.bytes = get<uint64_t>(e, "bytes", file);
  f.xxhash64 = util::parse_hash_hex(get<std::string>(e, "xxhash64", file),
                                    file.string() + " " + role + " " + f.file);
  return f;
}

// Format 2's additions: chunk hashes, tokenizer files, the previous version.
void parse_format2(const json& j, const fs::path& file, Manifest& m) {
  m.chunk_bytes = get<uint64_t>(j, "chunk_bytes", file);
  LOOM_CHECK(m.chunk_bytes >= kMinChunkBytes && m.chunk_bytes <= kMaxChunkBytes, CorruptData,
             file.string(), ": chunk_bytes ", m.chunk_bytes, " is outside [", kMinChunkBytes, ", ",
             kMaxChunkBytes, "]");
  const json& shards = get_array(j, "shards", file);
  for (size_t i = 0; i < m.shards.size(); ++i) {
    ShardInfo& s = m.shards[i];
    const json& hashes = get_array(shards[i], "chunk_xxhash64", file);
    LOOM_CHECK(hashes.size() == format::chunk_count(s.bytes, m.chunk_bytes), CorruptData,
               file.string(), ": shard ", s.file, " of ", s.bytes, " bytes lists ", hashes.size(),
               " chunk hashes; chunks of ", m.chunk_bytes, " bytes make ",
               format::chunk_count(s.bytes, m.chunk_bytes));
    for (const json& h : hashes) {
      LOOM_CHECK(h.is_string(), CorruptData, file.string(), ": shard ", s.file,
                 " has a chunk hash that is not a string");
      s.chunk_hashes.push_back(
          util::parse_hash_hex(h.get<std::string>(), file.string() + " shard " + s.file));
    }
  }
  for (const json& e : get_array(j, "tokenizer_files", file)) {
    m.tokenizer_files.push_back(parse_file(e, file, "tokenizer file name"));
  }
  if (j.contains("previous_version")) {
    m.previous_version = get<std::string>(j, "previous_version", file);
  }
}

Manifest parse_manifest(const json& j, const fs::path& file) {
  LOOM_CHECK(j.is_object() && j.contains("format") && j["format"] == "loom-dataset", CorruptData,
             file.string(), " is not a Loom dataset manifest");
  Manifest m;
  m.format_version = get<int>(j, "format_version", file);
  LOOM_CHECK(m.format_version >= Manifest::kOldestFormatVersion &&
                 m.format_version <= Manifest::kFormatVersion,
             CorruptData, file.string(), " has format version ", m.format_version,
             "; this Loom reads versions ", Manifest::kOldestFormatVersion, " to ",
             Manifest::kFormatVersion, ": read it with a newer Loom, or rebuild it with this one");
  const std::string kind = get<std::string>(j, "kind", file);
  LOOM_CHECK(kind == "tokens" || kind == "records", CorruptData, file.string(), ": unknown kind '",
             kind, "'");
  m.kind = kind == "tokens" ? DatasetKind::kTokens : DatasetKind::kRecords;
  m.version = get<std::string>(j, "version", file);
  m.description = get<std::string>(j, "description", file);
  for (const json& e : get_array(j, "shards", file)) {
    ShardInfo s;
    s.file = get<std::string>(e, "file", file);
    util::check_plain_file_name(s.file, file.string(), "shard file name");
    s.bytes = get<uint64_t>(e, "bytes", file);
    s.xxhash64 = util::parse_hash_hex(get<std::string>(e, "xxhash64", file),
                                      file.string() + " shard " + s.file);
    if (m.kind == DatasetKind::kTokens) {
      s.items = get<uint64_t>(e, "tokens", file);
      s.documents = get<uint64_t>(e, "documents", file);
    } else {
      s.items = get<uint64_t>(e, "records", file);
    }
    m.shards.push_back(std::move(s));
  }
  if (m.kind == DatasetKind::kTokens) {
    m.vocab_size = get<uint64_t>(j, "vocab_size", file);
    m.eos_id = get<int64_t>(j, "eos_id", file);
    m.tokenizer = get<std::string>(j, "tokenizer", file);
    if (!m.tokenizer.empty())
      util::check_plain_file_name(m.tokenizer, file.string(), "tokenizer file name");
  } else {
    for (const json& e : get_array(j, "schema", file)) {
      Field f;
      f.name = get<std::string>(e, "name", file);
      f.type = format::parse_field_type(get<std::string>(e, "type", file));
      if (f.type == FieldType::kTensor) {
        f.dtype = get<std::string>(e, "dtype", file);
        for (const json& d : get_array(e, "shape", file))
          f.shape.push_back(get_value<int64_t>(d, "shape", file));
      }
      if (e.contains("classes")) f.classes = get<std::vector<std::string>>(e, "classes", file);
      if (e.contains("ragged")) f.ragged = get<bool>(e, "ragged", file);
      m.schema.push_back(std::move(f));
    }
    if (j.contains("layout")) m.layout = format::parse_layout(get<std::string>(j, "layout", file));
    const std::string bad = layout::check_schema(m.layout, m.schema);
    LOOM_CHECK(bad.empty(), CorruptData, file.string(), ": ", bad);
  }
  if (m.format_version >= 2) parse_format2(j, file, m);
  return m;
}

}  // namespace

namespace format {

std::string content_version(const Manifest& m) {
  return util::hash_hex(util::xxh64(identity_json(m).dump()));
}

void write_manifest(const fs::path& dir, Manifest& m) {
  util::fsync_dir(dir);
  m.format_version = Manifest::kFormatVersion;
  m.version = content_version(m);
  json j = manifest_json(m);
  j["manifest_xxhash64"] = manifest_hash(m);
  util::write_file_atomic(dir / kManifestFile, j.dump(2) + "\n");
}

FileInfo describe_file(const fs::path& dir, const std::string& name) {
  util::MappedFile file(dir / name);
  return {name, file.size(), util::xxh64(file.data(), file.size())};
}

void check_file(const fs::path& dir, const FileInfo& f, const char* role) {
  const fs::path path = dir / f.file;
  LOOM_CHECK(fs::exists(path), IoError, role, " ", path.string(),
             " is listed in the manifest but missing; restore it or rebuild the dataset");
  const FileInfo now = describe_file(dir, f.file);
  LOOM_CHECK(now.bytes == f.bytes && now.xxhash64 == f.xxhash64, CorruptData, role, " ",
             path.string(), " is ", now.bytes, " bytes with xxHash64 ",
             util::hash_hex(now.xxhash64), " but the manifest says ", f.bytes, " bytes with ",
             util::hash_hex(f.xxhash64),
             ": it changed after the build; restore it or rebuild the dataset");
}

Manifest parse_manifest_text(const std::string& text, const std::string& name) {
  const fs::path file = name;
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number too large
    throw CorruptData(detail::concat(name, " is not valid JSON: ", e.what()));
  }
  Manifest m = parse_manifest(j, file);
  const std::string expected = format::content_version(m);
  LOOM_CHECK(m.version == expected, CorruptData, file.string(),
             " was edited: its content hashes to ", expected, " but it claims version ", m.version,
             "; rebuild the dataset");
  if (m.format_version >= 2) {
    const std::string claimed = get<std::string>(j, "manifest_xxhash64", file);
    const std::string actual = manifest_hash(m);
    LOOM_CHECK(claimed == actual, CorruptData, file.string(),
               " was edited: its chunk hashes, tokenizer files or previous version hash to ",
               actual, " but it claims ", claimed, "; rebuild the dataset");
  }
  return m;
}

}  // namespace format

Manifest read_manifest(const fs::path& dir) {
  LOOM_CHECK(fs::is_directory(dir), IoError, "dataset directory ", dir.string(),
             " does not exist; build one with `loom data build`");
  const fs::path file = dir / format::kManifestFile;
  LOOM_CHECK(fs::exists(file), IoError, dir.string(),
             " has no manifest.json: it is not a dataset, or its build did not finish; rebuild it");
  return format::parse_manifest_text(util::read_file(file), file.string());
}

void check_tokenizer_files(const fs::path& dir, const Manifest& m) {
  for (const FileInfo& f : m.tokenizer_files) format::check_file(dir, f, "tokenizer file");
}

}  // namespace loom::data

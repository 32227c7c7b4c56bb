// Manifests, the token and record dataset writers, and verify_dataset.
#include "loom/data/dataset.h"

#include <fcntl.h>
#include <unistd.h>

#include <limits>
#include <nlohmann/json.hpp>
#include <type_traits>

#include "data/shard_format.h"
#include "loom/error.h"
#include "util/fd.h"
#include "util/files.h"
#include "util/hash.h"

namespace loom::data {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

const char* kind_name(DatasetKind kind) {
  return kind == DatasetKind::kTokens ? "tokens" : "records";
}

// The manifest as JSON, without "version": the bytes the version hashes.
json content_json(const Manifest& m) {
  json j = json::object();
  j["format"] = "loom-dataset";
  j["format_version"] = Manifest::kFormatVersion;
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
      json e = {{"name", f.name}, {"type", format::field_type_name(f.type)}};
      if (f.type == FieldType::kTensor) {
        e["dtype"] = f.dtype;
        e["shape"] = f.shape;
      }
      if (!f.classes.empty()) e["classes"] = f.classes;
      schema.push_back(std::move(e));
    }
    j["schema"] = std::move(schema);
  }
  return j;
}

std::string version_of(const Manifest& m) {
  return util::hash_hex(util::xxh64(content_json(m).dump()));
}

// j[key] as T. nlohmann converts between number kinds silently (-5 read as uint64_t is
// 2^64 - 5, 2^40 read as int is 0), so an integer must be one and fit T.
template <typename T>
T get(const json& j, const char* key, const fs::path& file) {
  try {
    const json& value = j.at(key);
    if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
      using Limits = std::numeric_limits<T>;
      bool fits = false;
      if (value.is_number_unsigned()) {
        fits = value.get<uint64_t>() <= static_cast<uint64_t>(Limits::max());
      } else if (value.is_number_integer()) {  // negative
        if constexpr (std::is_signed_v<T>) fits = value.get<int64_t>() >= Limits::min();
      }
      LOOM_CHECK(fits, CorruptData, file.string(), ": field \"", key, "\" is ", value.dump(),
                 ", not ", std::is_unsigned_v<T> ? "a non-negative integer" : "an integer");
    }
    return value.get<T>();
  } catch (const json::exception& e) {
    throw CorruptData(detail::concat(file.string(), ": field \"", key,
                                     "\" is missing or has the wrong type (", e.what(), ")"));
  }
}

Manifest parse_manifest(const json& j, const fs::path& file) {
  LOOM_CHECK(j.is_object() && j.contains("format") && j["format"] == "loom-dataset", CorruptData,
             file.string(), " is not a Loom dataset manifest");
  const int version = get<int>(j, "format_version", file);
  LOOM_CHECK(version == Manifest::kFormatVersion, CorruptData, file.string(),
             " has format version ", version, "; this Loom reads version ",
             Manifest::kFormatVersion, ": rebuild the dataset with this Loom's `loom data build`");
  Manifest m;
  const std::string kind = get<std::string>(j, "kind", file);
  LOOM_CHECK(kind == "tokens" || kind == "records", CorruptData, file.string(), ": unknown kind '",
             kind, "'");
  m.kind = kind == "tokens" ? DatasetKind::kTokens : DatasetKind::kRecords;
  m.version = get<std::string>(j, "version", file);
  m.description = get<std::string>(j, "description", file);
  for (const json& e : get<json>(j, "shards", file)) {
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
    for (const json& e : get<json>(j, "schema", file)) {
      Field f;
      f.name = get<std::string>(e, "name", file);
      f.type = format::parse_field_type(get<std::string>(e, "type", file));
      if (f.type == FieldType::kTensor) {
        f.dtype = get<std::string>(e, "dtype", file);
        f.shape = get<std::vector<int64_t>>(e, "shape", file);
      }
      if (e.contains("classes")) f.classes = get<std::vector<std::string>>(e, "classes", file);
      m.schema.push_back(std::move(f));
    }
  }
  return m;
}

// Prepares an output directory: created if missing; one that already holds a dataset is refused.
void prepare_output_dir(const fs::path& dir) {
  LOOM_CHECK(!fs::exists(dir / format::kManifestFile), InvalidArgument, dir.string(),
             " already holds a dataset (manifest.json); remove it or write to another directory");
  std::error_code ec;
  fs::create_directories(dir, ec);
  LOOM_CHECK(!ec, IoError, "cannot create dataset directory ", dir.string(), ": ", ec.message());
}

// One shard being written: a 64-byte header slot, buffered appends, then the header is filled
// in, the file fsynced and renamed from its temporary name. Yields its ShardInfo.
class ShardFile {
 public:
  ShardFile(fs::path dir, std::string name)
      : dir_(std::move(dir)),
        name_(std::move(name)),
        tmp_(dir_ / (name_ + ".tmp")),
        fd_(LOOM_CHECK_SYS(::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644),
                           "creating ", tmp_.string())) {
    buffer_.assign(64, '\0');
  }

  uint64_t size() const { return written_ + buffer_.size(); }
  void append(const void* data, size_t n) {
    buffer_.append(static_cast<const char*>(data), n);
    if (buffer_.size() >= (4u << 20)) flush();
  }
  void pad_to(size_t alignment) {
    const std::string zeros((alignment - size() % alignment) % alignment, '\0');
    append(zeros.data(), zeros.size());
  }

  ShardInfo finish(const void* header, size_t header_size) {
    flush();
    LOOM_CHECK_SYS(::pwrite(fd_.get(), header, header_size, 0), "writing ", tmp_.string());
    LOOM_CHECK_SYS(::fsync(fd_.get()), "fsyncing ", tmp_.string());
    const fs::path final_path = dir_ / name_;
    LOOM_CHECK_SYS(::rename(tmp_.c_str(), final_path.c_str()), "renaming ", tmp_.string());
    util::MappedFile file(final_path);
    ShardInfo info;
    info.file = name_;
    info.bytes = file.size();
    info.xxhash64 = util::xxh64(file.data(), file.size());
    return info;
  }

 private:
  void flush() {
    size_t done = 0;
    while (done < buffer_.size()) {
      done += static_cast<size_t>(
          LOOM_CHECK_SYS(::write(fd_.get(), buffer_.data() + done, buffer_.size() - done),
                         "writing ", tmp_.string()));
    }
    written_ += buffer_.size();
    buffer_.clear();
  }

  fs::path dir_;
  std::string name_;
  fs::path tmp_;
  util::UniqueFd fd_;
  std::string buffer_;
  uint64_t written_ = 0;
};

std::string shard_name(const char* prefix, size_t index) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s_%05zu.bin", prefix, index);
  return buf;
}

Manifest commit_manifest(const fs::path& dir, Manifest m) {
  util::fsync_dir(dir);
  m.version = version_of(m);
  json j = content_json(m);
  j["version"] = m.version;
  util::write_file_atomic(dir / format::kManifestFile, j.dump(2) + "\n");
  return m;
}

}  // namespace

uint64_t Manifest::total_items() const {
  uint64_t n = 0;
  for (const ShardInfo& s : shards) n += s.items;
  return n;
}

uint64_t Manifest::total_documents() const {
  uint64_t n = 0;
  for (const ShardInfo& s : shards) n += s.documents;
  return n;
}

uint64_t Manifest::total_bytes() const {
  uint64_t n = 0;
  for (const ShardInfo& s : shards) n += s.bytes;
  return n;
}

const Field& Manifest::field(const std::string& name) const {
  std::string known;
  for (const Field& f : schema) {
    if (f.name == name) return f;
    known += (known.empty() ? "" : ", ") + f.name;
  }
  throw InvalidArgument(
      detail::concat("the dataset has no field '", name, "'; its fields: ", known));
}

Manifest read_manifest(const fs::path& dir) {
  LOOM_CHECK(fs::is_directory(dir), IoError, "dataset directory ", dir.string(),
             " does not exist; build one with `loom data build`");
  const fs::path file = dir / format::kManifestFile;
  LOOM_CHECK(fs::exists(file), IoError, dir.string(),
             " has no manifest.json: it is not a dataset, or its build did not finish; rebuild it");
  json j;
  try {
    j = json::parse(util::read_file(file));
  } catch (const json::parse_error& e) {
    throw CorruptData(detail::concat(file.string(), " is not valid JSON: ", e.what()));
  }
  Manifest m = parse_manifest(j, file);
  const std::string expected = version_of(m);
  LOOM_CHECK(m.version == expected, CorruptData, file.string(),
             " was edited: its content hashes to ", expected, " but it claims version ", m.version,
             "; rebuild the dataset");
  return m;
}

// ---- Record ----

Record& Record::bytes(std::string value) {
  values_.push_back({FieldType::kBytes, std::move(value)});
  return *this;
}
Record& Record::text(std::string value) {
  values_.push_back({FieldType::kText, std::move(value)});
  return *this;
}
Record& Record::integer(int64_t value) {
  values_.push_back({FieldType::kInt, {}, value});
  return *this;
}
Record& Record::real(double value) {
  values_.push_back({FieldType::kFloat, {}, 0, value});
  return *this;
}
Record& Record::tensor(const void* data, size_t nbytes, std::vector<int64_t> shape) {
  values_.push_back({FieldType::kTensor, std::string(static_cast<const char*>(data), nbytes), 0, 0,
                     std::move(shape)});
  return *this;
}

// ---- TokenDatasetWriter ----

struct TokenDatasetWriter::Impl {
  fs::path dir;
  TokenWriterOptions options;
  uint32_t token_bytes;
  Manifest manifest;
  std::unique_ptr<ShardFile> shard;
  std::vector<uint64_t> doc_offsets{0};  // of the open shard
  uint64_t shard_tokens = 0;
  uint64_t total_tokens = 0;

  void close_shard() {
    if (!shard) return;
    shard->pad_to(8);
    format::TokenHeader h{};
    std::memcpy(h.magic, format::kTokenMagic, 8);
    h.version = format::kShardVersion;
    h.token_bytes = token_bytes;
    h.num_tokens = shard_tokens;
    h.num_documents = doc_offsets.size() - 1;
    h.index_offset = shard->size();
    shard->append(doc_offsets.data(), doc_offsets.size() * 8);
    ShardInfo info = shard->finish(&h, sizeof h);
    info.items = shard_tokens;
    info.documents = h.num_documents;
    manifest.shards.push_back(info);
    shard.reset();
    doc_offsets.assign(1, 0);
    shard_tokens = 0;
  }
};

TokenDatasetWriter::TokenDatasetWriter(fs::path dir, TokenWriterOptions options)
    : impl_(std::make_unique<Impl>()) {
  LOOM_CHECK(options.vocab_size >= 1 && options.vocab_size <= (uint64_t{1} << 32), InvalidArgument,
             "vocab_size must be in [1, 2^32], got ", options.vocab_size);
  LOOM_CHECK(options.eos_id < static_cast<int64_t>(options.vocab_size), InvalidArgument, "eos_id ",
             options.eos_id, " is not below vocab_size ", options.vocab_size);
  LOOM_CHECK(options.tokens_per_shard >= 1, InvalidArgument, "tokens_per_shard must be >= 1");
  prepare_output_dir(dir);
  impl_->dir = std::move(dir);
  impl_->token_bytes = format::token_bytes_for(options.vocab_size);
  impl_->manifest.kind = DatasetKind::kTokens;
  impl_->manifest.vocab_size = options.vocab_size;
  impl_->manifest.eos_id = options.eos_id;
  impl_->manifest.tokenizer = options.tokenizer;
  impl_->manifest.description = options.description;
  impl_->options = std::move(options);
}

TokenDatasetWriter::~TokenDatasetWriter() = default;

void TokenDatasetWriter::add_document(const uint32_t* tokens, size_t count) {
  Impl& w = *impl_;
  const size_t total = count + (w.options.eos_id >= 0 ? 1 : 0);
  if (total == 0) return;
  if (!w.shard) {
    w.shard = std::make_unique<ShardFile>(w.dir, shard_name("tokens", w.manifest.shards.size()));
  }
  auto put = [&](uint32_t t) {
    LOOM_CHECK(t < w.options.vocab_size, InvalidArgument, "token id ", t, " in document ",
               w.manifest.total_documents() + w.doc_offsets.size() - 1, " is not below vocab_size ",
               w.options.vocab_size);
    if (w.token_bytes == 2) {
      const uint16_t v = static_cast<uint16_t>(t);
      w.shard->append(&v, 2);
    } else {
      w.shard->append(&t, 4);
    }
  };
  for (size_t i = 0; i < count; ++i) put(tokens[i]);
  if (w.options.eos_id >= 0) put(static_cast<uint32_t>(w.options.eos_id));
  w.shard_tokens += total;
  w.total_tokens += total;
  w.doc_offsets.push_back(w.shard_tokens);
  if (w.shard_tokens >= w.options.tokens_per_shard) w.close_shard();
}

uint64_t TokenDatasetWriter::tokens_written() const { return impl_->total_tokens; }

Manifest TokenDatasetWriter::finish() {
  impl_->close_shard();
  LOOM_CHECK(!impl_->manifest.shards.empty(), InvalidArgument,
             "the dataset has no tokens: add at least one document before finish()");
  return commit_manifest(impl_->dir, impl_->manifest);
}

// ---- RecordDatasetWriter ----

struct RecordDatasetWriter::Impl {
  fs::path dir;
  RecordWriterOptions options;
  Manifest manifest;
  std::unique_ptr<ShardFile> shard;
  std::vector<uint64_t> offsets;
  std::string payload;
  uint64_t total = 0;

  void close_shard() {
    if (!shard) return;
    format::RecordHeader h{};
    std::memcpy(h.magic, format::kRecordMagic, 8);
    h.version = format::kShardVersion;
    h.num_records = offsets.size();
    h.index_offset = shard->size();
    offsets.push_back(h.index_offset);
    shard->append(offsets.data(), offsets.size() * 8);
    ShardInfo info = shard->finish(&h, sizeof h);
    info.items = h.num_records;
    manifest.shards.push_back(info);
    shard.reset();
    offsets.clear();
  }
};

RecordDatasetWriter::RecordDatasetWriter(fs::path dir, std::vector<Field> schema,
                                         RecordWriterOptions options)
    : impl_(std::make_unique<Impl>()) {
  LOOM_CHECK(!schema.empty(), InvalidArgument, "a record schema needs at least one field");
  for (size_t i = 0; i < schema.size(); ++i) {
    const Field& f = schema[i];
    LOOM_CHECK(!f.name.empty(), InvalidArgument, "schema field ", i, " has no name");
    for (size_t j = 0; j < i; ++j) {
      LOOM_CHECK(schema[j].name != f.name, InvalidArgument, "schema field '", f.name,
                 "' appears twice");
    }
    if (f.type == FieldType::kTensor) format::dtype_size(f.dtype);
  }
  prepare_output_dir(dir);
  impl_->dir = std::move(dir);
  impl_->manifest.kind = DatasetKind::kRecords;
  impl_->manifest.schema = std::move(schema);
  impl_->manifest.description = options.description;
  impl_->options = std::move(options);
}

RecordDatasetWriter::~RecordDatasetWriter() = default;

void RecordDatasetWriter::add(const Record& record) {
  Impl& w = *impl_;
  w.payload.clear();
  format::encode_record(w.manifest.schema, record, w.payload);
  if (!w.shard) {
    w.shard = std::make_unique<ShardFile>(w.dir, shard_name("records", w.manifest.shards.size()));
  }
  w.offsets.push_back(w.shard->size());
  const uint64_t hash = util::xxh64(w.payload);
  w.shard->append(w.payload.data(), w.payload.size());
  w.shard->append(&hash, 8);
  ++w.total;
  if (w.shard->size() >= w.options.bytes_per_shard) w.close_shard();
}

uint64_t RecordDatasetWriter::records_written() const { return impl_->total; }

Manifest RecordDatasetWriter::finish() {
  impl_->close_shard();
  LOOM_CHECK(!impl_->manifest.shards.empty(), InvalidArgument,
             "the dataset has no records: add at least one before finish()");
  return commit_manifest(impl_->dir, impl_->manifest);
}

// ---- verify ----

VerifyReport verify_dataset(const fs::path& dir, const ProgressFn& progress) {
  const Manifest m = read_manifest(dir);
  VerifyReport report;
  const uint64_t total = m.total_bytes();
  auto fail = [&](std::string file, std::string problem) {
    report.ok = false;
    report.file = std::move(file);
    report.problem = std::move(problem);
    return report;
  };
  for (const ShardInfo& info : m.shards) {
    const std::string path = (dir / info.file).string();
    try {
      std::unique_ptr<format::TokenShard> tokens;
      std::unique_ptr<format::RecordShard> records;
      const util::MappedFile* file;
      if (m.kind == DatasetKind::kTokens) {
        tokens =
            std::make_unique<format::TokenShard>(dir, info, format::token_bytes_for(m.vocab_size));
        file = &tokens->file();
      } else {
        records = std::make_unique<format::RecordShard>(dir, info);
        file = &records->file();
      }
      // Records first: a bad record is the more precise report than the shard's hash.
      if (records) {
        std::vector<format::FieldView> views(m.schema.size());
        for (uint64_t i = 0; i < records->num_records(); ++i) {
          format::RecordShard::Payload payload;
          std::string bad = records->check(i, &payload);
          if (bad.empty())
            bad = format::decode_record(m.schema, payload.first, payload.second, views.data());
          if (!bad.empty()) {
            report.record = static_cast<int64_t>(i);
            report.offset = static_cast<int64_t>(records->offset(i));
            return fail(path,
                        detail::concat("record ", i, " (byte offset ", report.offset, "): ", bad));
          }
        }
      }
      util::Hasher64 hasher;
      constexpr size_t kChunk = 64u << 20;
      for (size_t at = 0; at < file->size(); at += kChunk) {
        const size_t n = std::min(kChunk, file->size() - at);
        hasher.update(file->data() + at, n);
        report.bytes_checked += n;
        if (progress) progress(report.bytes_checked, total);
      }
      if (hasher.digest() != info.xxhash64) {
        return fail(path,
                    detail::concat("its xxHash64 is ", util::hash_hex(hasher.digest()),
                                   " but the manifest says ", util::hash_hex(info.xxhash64),
                                   ": the file changed after the build; restore or rebuild it"));
      }
    } catch (const CorruptData& e) {
      return fail(path, e.what());
    } catch (const IoError& e) {
      return fail(path, e.what());
    }
  }
  return report;
}

}  // namespace loom::data

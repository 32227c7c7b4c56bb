// Manifests, the token and record dataset writers, and verify_dataset.
#include "loom/data/dataset.h"

#include <fcntl.h>
#include <unistd.h>

#include "data/chunk_check.h"
#include "data/image_codec.h"
#include "data/layout.h"
#include "data/manifest.h"
#include "data/shard_format.h"
#include "loom/data/remote.h"
#include "loom/error.h"
#include "util/fd.h"
#include "util/files.h"
#include "util/hash.h"

namespace loom::data {
namespace {

namespace fs = std::filesystem;

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
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
// in, the file fsynced and renamed from its temporary name. Yields its ShardInfo with its
// whole-file and chunk hashes.
class ShardFile {
 public:
  ShardFile(fs::path dir, std::string name, uint64_t chunk_bytes)
      : dir_(std::move(dir)),
        name_(std::move(name)),
        chunk_bytes_(chunk_bytes),
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
    info.chunk_hashes = format::chunk_hashes(file.data(), file.size(), chunk_bytes_);
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
  uint64_t chunk_bytes_;
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
  format::write_manifest(dir, m);
  return m;
}

void check_chunk_bytes(uint64_t chunk_bytes) {
  LOOM_CHECK(chunk_bytes >= 64 && chunk_bytes <= (uint64_t{1} << 30), InvalidArgument,
             "chunk_bytes must be in [64, 2^30], got ", chunk_bytes);
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

const char* to_string(FieldType type) {
  switch (type) {
    case FieldType::kBytes:
      return "bytes";
    case FieldType::kText:
      return "text";
    case FieldType::kInt:
      return "int";
    case FieldType::kFloat:
      return "float";
    case FieldType::kTensor:
      return "tensor";
    case FieldType::kImage:
      return "image";
    case FieldType::kImages:
      return "images";
  }
  return "?";
}

const char* to_string(RecordLayout layout) {
  switch (layout) {
    case RecordLayout::kPlain:
      return "plain";
    case RecordLayout::kMultimodal:
      return "multimodal";
    case RecordLayout::kEpisodes:
      return "episodes";
  }
  return "?";
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
Record& Record::image(std::string encoded) {
  values_.push_back({FieldType::kImage, std::move(encoded)});
  return *this;
}
Record& Record::images(std::vector<std::string> encoded) {
  values_.push_back({FieldType::kImages, {}, 0, 0, {}, std::move(encoded)});
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
  check_chunk_bytes(options.chunk_bytes);
  if (options.tokenizer_files.empty() && !options.tokenizer.empty()) {
    options.tokenizer_files = {options.tokenizer};
  }
  prepare_output_dir(dir);
  impl_->dir = std::move(dir);
  impl_->token_bytes = format::token_bytes_for(options.vocab_size);
  impl_->manifest.kind = DatasetKind::kTokens;
  impl_->manifest.vocab_size = options.vocab_size;
  impl_->manifest.eos_id = options.eos_id;
  impl_->manifest.tokenizer = options.tokenizer;
  impl_->manifest.chunk_bytes = options.chunk_bytes;
  impl_->manifest.description = options.description;
  impl_->options = std::move(options);
}

TokenDatasetWriter::~TokenDatasetWriter() = default;

void TokenDatasetWriter::add_document(const uint32_t* tokens, size_t count) {
  Impl& w = *impl_;
  const size_t total = count + (w.options.eos_id >= 0 ? 1 : 0);
  if (total == 0) return;
  if (!w.shard) {
    w.shard = std::make_unique<ShardFile>(w.dir, shard_name("tokens", w.manifest.shards.size()),
                                          w.options.chunk_bytes);
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
  for (const std::string& name : impl_->options.tokenizer_files) {
    LOOM_CHECK(util::is_plain_file_name(name) && fs::exists(impl_->dir / name), InvalidArgument,
               "tokenizer file '", name, "' is not a file in ", impl_->dir.string(),
               "; copy it there before finish()");
    impl_->manifest.tokenizer_files.push_back(format::describe_file(impl_->dir, name));
  }
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
  std::vector<format::FieldView> views;        // the record being added, decoded back
  std::vector<std::vector<int64_t>> trailing;  // each ragged field's dims after the first
  std::vector<uint8_t> pixels;                 // scratch for decoding images

  // What is wrong with the record just encoded into `payload`, or "": the checks a reader
  // relies on beyond the schema's types (ragged dimensions, the layout, decodable images).
  std::string check_record() {
    const std::vector<Field>& schema = manifest.schema;
    views.assign(schema.size(), {});
    std::string bad = format::decode_record(
        schema, reinterpret_cast<const uint8_t*>(payload.data()), payload.size(), views.data());
    if (!bad.empty()) return bad;
    for (size_t i = 0; i < schema.size(); ++i) {
      const Field& f = schema[i];
      if (f.ragged) {
        std::vector<int64_t> rest(views[i].dims + 1, views[i].dims + views[i].ndim);
        if (total == 0) trailing[i] = rest;
        if (rest != trailing[i]) {
          return "ragged field '" + f.name + "' has shape " + shape_text(views[i].shape()) +
                 "; its dimensions after the first must match the first record's " +
                 shape_text(trailing[i]);
        }
      } else if (f.type == FieldType::kImage) {
        bad = check_image(views[i].data, views[i].size);
      } else if (f.type == FieldType::kImages) {
        const auto items = format::list_items(views[i]);
        for (size_t k = 0; k < items.size() && bad.empty(); ++k) {
          bad = check_image(items[k].first, items[k].second);
          if (!bad.empty()) bad = "image " + std::to_string(k) + ": " + bad;
        }
      }
      if (!bad.empty()) return "field '" + f.name + "': " + bad;
    }
    return layout::check_record(manifest.layout, schema, views.data());
  }

  std::string check_image(const uint8_t* data, size_t size) {
    image::Info info;
    std::string bad = image::probe(data, size, &info);
    if (!bad.empty()) return bad;
    pixels.resize(static_cast<size_t>(info.height * info.width * info.channels));
    return image::decode(data, size, info, pixels.data());
  }

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
  const std::string bad = layout::check_schema(options.layout, schema);
  LOOM_CHECK(bad.empty(), InvalidArgument, "record schema: ", bad);
  check_chunk_bytes(options.chunk_bytes);
  prepare_output_dir(dir);
  impl_->dir = std::move(dir);
  impl_->manifest.kind = DatasetKind::kRecords;
  impl_->manifest.schema = std::move(schema);
  impl_->manifest.chunk_bytes = options.chunk_bytes;
  impl_->manifest.description = options.description;
  impl_->manifest.layout = options.layout;
  impl_->trailing.resize(impl_->manifest.schema.size());
  impl_->options = std::move(options);
}

RecordDatasetWriter::~RecordDatasetWriter() = default;

void RecordDatasetWriter::add(const Record& record) {
  Impl& w = *impl_;
  w.payload.clear();
  try {
    format::encode_record(w.manifest.schema, record, w.payload);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(detail::concat("record ", w.total, ": ", e.what()));
  }
  const std::string bad = w.check_record();
  LOOM_CHECK(bad.empty(), InvalidArgument, "record ", w.total, ": ", bad);
  if (!w.shard) {
    w.shard = std::make_unique<ShardFile>(w.dir, shard_name("records", w.manifest.shards.size()),
                                          w.options.chunk_bytes);
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

namespace {

// Hashes `file` piece by piece: each chunk against its manifest hash (format 2), and the whole
// file against the shard's. Returns "" or the problem, setting *bad_offset to the bad chunk.
std::string hash_shard(const util::MappedFile& file, const ShardInfo& info, uint64_t chunk_bytes,
                       int64_t* bad_offset, const std::function<void(uint64_t)>& advance) {
  const bool chunked = !info.chunk_hashes.empty();
  const uint64_t piece = chunked ? chunk_bytes : (64u << 20);
  util::Hasher64 hasher;
  for (uint64_t at = 0, c = 0; at < file.size(); at += piece, ++c) {
    const uint64_t n = std::min<uint64_t>(piece, file.size() - at);
    hasher.update(file.data() + at, n);
    if (chunked) {
      const uint64_t h = util::xxh64(file.data() + at, n);
      if (h != info.chunk_hashes[c]) {
        *bad_offset = static_cast<int64_t>(at);
        return detail::concat("chunk ", c, " (bytes ", at, " to ", at + n, ") has xxHash64 ",
                              util::hash_hex(h), " but the manifest says ",
                              util::hash_hex(info.chunk_hashes[c]),
                              ": the file changed after the build; restore or rebuild it");
      }
    }
    advance(n);
  }
  if (hasher.digest() != info.xxhash64) {
    return detail::concat("its xxHash64 is ", util::hash_hex(hasher.digest()),
                          " but the manifest says ", util::hash_hex(info.xxhash64),
                          ": the file changed after the build; restore or rebuild it");
  }
  return "";
}

}  // namespace

namespace format {

VerifyReport verify_files(const fs::path& dir, const Manifest& m, const std::string& where,
                          const FetchFn& fetch, const ProgressFn& progress) {
  VerifyReport report;
  const uint64_t total = m.total_bytes();
  auto fail = [&](std::string file, std::string problem) {
    report.ok = false;
    report.file = std::move(file);
    report.problem = std::move(problem);
    return report;
  };
  // The file's local copy held while it is checked (a remote dataset's cache pin), or the
  // failure to get one.
  std::shared_ptr<void> held;
  auto get = [&](const std::string& file, uint64_t bytes, uint64_t hash) -> std::string {
    if (!fetch) return "";
    try {
      held = fetch(file, bytes, hash);
      return "";
    } catch (const CorruptData& e) {
      return e.what();
    } catch (const IoError& e) {
      return e.what();
    }
  };
  for (const FileInfo& f : m.tokenizer_files) {
    std::string bad = get(f.file, f.bytes, f.xxhash64);
    if (bad.empty()) {
      try {
        format::check_file(dir, f, "tokenizer file");
      } catch (const Error& e) {
        bad = e.what();
      }
    }
    if (!bad.empty()) return fail(join_url(where, f.file), bad);
  }
  auto advance = [&](uint64_t n) {
    report.bytes_checked += n;
    if (progress) progress(report.bytes_checked, total);
  };
  for (const ShardInfo& info : m.shards) {
    const std::string path = join_url(where, info.file);
    if (std::string bad = get(info.file, info.bytes, info.xxhash64); !bad.empty()) {
      return fail(path, bad);
    }
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
      const std::string bad = hash_shard(*file, info, m.chunk_bytes, &report.offset, advance);
      if (!bad.empty()) return fail(path, bad);
    } catch (const CorruptData& e) {
      return fail(path, e.what());
    } catch (const IoError& e) {
      return fail(path, e.what());
    }
    held.reset();
  }
  return report;
}

}  // namespace format

VerifyReport verify_dataset(const fs::path& dir, const ProgressFn& progress) {
  return format::verify_files(dir, read_manifest(dir), dir.string(), {}, progress);
}

}  // namespace loom::data

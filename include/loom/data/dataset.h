// Datasets on disk: a directory of shard files plus manifest.json, and the writers that make
// them. Two kinds:
//   - token datasets, for pretraining: documents of token ids (uint16 or uint32 on disk,
//     chosen by the vocabulary size), read through mmap;
//   - record datasets, for everything else: records of named, typed fields (bytes, tensor,
//     text, int, float), each record with its own xxHash64, with an index for O(1) access.
// The manifest lists every shard with its size and xxHash64; the dataset version is a hash
// of the manifest, so it names the content. docs/data-format.md has the byte layouts.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace loom::data {

enum class DatasetKind { kTokens, kRecords };

// The type of one field of a record dataset.
enum class FieldType {
  kBytes,   // opaque bytes
  kText,    // UTF-8 text
  kInt,     // a signed 64-bit integer
  kFloat,   // a 64-bit float
  kTensor,  // a dense tensor: dtype from the schema, shape from the schema or per record
};

struct Field {
  std::string name;
  FieldType type = FieldType::kBytes;
  std::string dtype;           // kTensor only: uint8, int32, int64, float32, float64, bfloat16
  std::vector<int64_t> shape;  // kTensor only: the shape every record has; empty = per record
  std::vector<std::string> classes;  // kInt only, optional: names of the values 0, 1, ...
};

// One shard file as the manifest records it.
struct ShardInfo {
  std::string file;        // relative to the dataset directory
  uint64_t bytes = 0;      // file size
  uint64_t xxhash64 = 0;   // of the whole file
  uint64_t items = 0;      // tokens (token shards) or records (record shards)
  uint64_t documents = 0;  // token shards: documents that start in this shard
};

struct Manifest {
  static constexpr int kFormatVersion = 1;

  DatasetKind kind = DatasetKind::kTokens;
  std::string version;  // 16 hex digits: xxHash64 of the manifest's content (all but this field)
  std::vector<ShardInfo> shards;
  // Token datasets.
  uint64_t vocab_size = 0;  // token ids are < vocab_size
  int64_t eos_id = -1;      // appended after every document, or -1 for none
  std::string tokenizer;    // file in the dataset directory (a SentencePiece model) or ""
  // Record datasets.
  std::vector<Field> schema;
  // Free-form description (source files, builder); part of the version.
  std::string description;

  uint64_t total_items() const;      // tokens or records
  uint64_t total_documents() const;  // token datasets
  uint64_t total_bytes() const;
  const Field& field(const std::string& name) const;  // InvalidArgument naming known fields
};

// Reads and checks `dir`/manifest.json: a missing directory or manifest is IoError; bad JSON,
// an unknown format version, or a version that does not match the content is CorruptData.
Manifest read_manifest(const std::filesystem::path& dir);

// One record of a record dataset, in schema order: values[i] is field i, encoded as stored
// (see encode_* below), so that writing needs no copy of big tensors twice.
class Record {
 public:
  Record& bytes(std::string value);
  Record& text(std::string value);
  Record& integer(int64_t value);
  Record& real(double value);
  // A tensor field: its raw little-endian element bytes and its shape.
  Record& tensor(const void* data, size_t nbytes, std::vector<int64_t> shape);

  struct Value {
    FieldType type;
    std::string bytes;           // kBytes, kText, kTensor: the data
    int64_t integer = 0;         // kInt
    double real = 0;             // kFloat
    std::vector<int64_t> shape;  // kTensor
  };
  const std::vector<Value>& values() const { return values_; }

 private:
  std::vector<Value> values_;
};

// Progress of long work (build, verify): done of total units, in the unit named.
using ProgressFn = std::function<void(uint64_t done, uint64_t total)>;

struct TokenWriterOptions {
  uint64_t vocab_size = 0;                  // required; > 65536 stores uint32 tokens
  int64_t eos_id = -1;                      // appended after every document when >= 0
  uint64_t tokens_per_shard = 64ull << 20;  // a shard closes once it holds this many tokens
  std::string tokenizer;                    // tokenizer file already copied into the directory
  std::string description;
};

// Writes a token dataset into an empty or new directory. Not thread-safe. Each shard is
// written to a temporary name, fsynced and renamed; the manifest is written last (atomically),
// so a directory without manifest.json is an unfinished build. Errors are IoError naming the
// file; a token id >= vocab_size is InvalidArgument.
class TokenDatasetWriter {
 public:
  TokenDatasetWriter(std::filesystem::path dir, TokenWriterOptions options);
  ~TokenDatasetWriter();
  TokenDatasetWriter(const TokenDatasetWriter&) = delete;
  TokenDatasetWriter& operator=(const TokenDatasetWriter&) = delete;

  void add_document(const uint32_t* tokens, size_t count);
  void add_document(const std::vector<uint32_t>& tokens) {
    add_document(tokens.data(), tokens.size());
  }
  uint64_t tokens_written() const;
  // Closes the last shard and writes manifest.json; returns the manifest.
  Manifest finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct RecordWriterOptions {
  uint64_t bytes_per_shard = 256ull << 20;  // a shard closes once its records reach this size
  std::string description;
};

// Writes a record dataset; same guarantees and errors as TokenDatasetWriter. A record whose
// values do not match the schema (count, types, a fixed tensor shape) is InvalidArgument.
class RecordDatasetWriter {
 public:
  RecordDatasetWriter(std::filesystem::path dir, std::vector<Field> schema,
                      RecordWriterOptions options = {});
  ~RecordDatasetWriter();
  RecordDatasetWriter(const RecordDatasetWriter&) = delete;
  RecordDatasetWriter& operator=(const RecordDatasetWriter&) = delete;

  void add(const Record& record);
  uint64_t records_written() const;
  Manifest finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The result of verify_dataset: ok, or the first problem found.
struct VerifyReport {
  bool ok = true;
  std::string problem;  // what is wrong and what to do, when !ok
  std::string file;     // the shard at fault
  int64_t record = -1;  // the bad record (record shards), or -1
  int64_t offset = -1;  // its byte offset in the file, or -1
  uint64_t bytes_checked = 0;
};

// Checks everything: the manifest, every shard's size, header and xxHash64, and every
// record's checksum. Reports the first problem instead of throwing; an unreadable manifest
// still throws as read_manifest does.
VerifyReport verify_dataset(const std::filesystem::path& dir, const ProgressFn& progress = {});

}  // namespace loom::data

// Datasets on disk: a directory of shard files plus manifest.json, and the writers that make
// them. Two kinds:
//   - token datasets, for pretraining: documents of token ids (uint16 or uint32 on disk,
//     chosen by the vocabulary size), read through mmap;
//   - record datasets, for everything else: records of named, typed fields (bytes, tensor,
//     text, int, float, images), each record with its own xxHash64, with an index for O(1)
//     access. A record dataset may declare a layout that gives its fields a meaning the
//     viewers and the Reader use: multimodal sequences (tokens with images in place) or RL
//     episodes (observation, action, reward, done per step).
// The manifest lists every shard with its size, xxHash64 and per-chunk xxHash64s, and the
// tokenizer files with their sizes and hashes; the dataset version is a hash of the content
// the manifest describes, so it names the content. docs/data-format.md has the byte layouts,
// docs/datasets.md the integrity checks and the format versions.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/visibility.h"

namespace loom::data {

enum class DatasetKind { kTokens, kRecords };

// The type of one field of a record dataset.
enum class FieldType {
  kBytes,   // opaque bytes
  kText,    // UTF-8 text
  kInt,     // a signed 64-bit integer
  kFloat,   // a 64-bit float
  kTensor,  // a dense tensor: dtype from the schema, shape from the schema or per record
  kImage,   // one image, stored encoded (PNG, JPEG or Loom raw), read as uint8 [H, W, C]
  kImages,  // a list of zero or more such images (the images of a multimodal sequence)
};
// "bytes", "text", "int", "float", "tensor", "image", "images": the names the manifest uses.
LOOM_API const char* to_string(FieldType type);

struct Field {
  std::string name;
  FieldType type = FieldType::kBytes;
  std::string dtype;           // kTensor only: uint8, int32, int64, float32, float64, bfloat16
  std::vector<int64_t> shape;  // kTensor only: the shape every record has; empty = per record
  std::vector<std::string> classes;  // kInt only, optional: names of the values 0, 1, ...
  // kTensor with a per-record shape only: records differ in their first dimension (a sequence
  // length; the other dimensions are the same in every record). A batch pads the first
  // dimension to the batch's longest with zeros and adds "<name>_mask", bool [B, L].
  bool ragged = false;
};

// What a record dataset's fields mean beyond their types (docs/data-format.md).
enum class RecordLayout {
  kPlain,  // no convention
  // Interleaved text and images: "tokens" (ragged int32 or int64 [L]), "images" (kImages) and
  // "image_positions" (ragged int64 [N]): image k sits before token image_positions[k]
  // (non-decreasing, at most L), one position per image.
  kMultimodal,
  // One RL episode per record, every step's values along the first dimension of ragged
  // tensors of equal length T >= 1: "observation" [T, ...], "action" [T, ...], "reward"
  // float32 [T], "done" uint8 or bool [T], and optionally "log_prob" and "value" float32 [T].
  kEpisodes,
};
// "plain", "multimodal", "episodes".
LOOM_API const char* to_string(RecordLayout layout);

// One shard file as the manifest records it.
struct ShardInfo {
  std::string file;        // relative to the dataset directory
  uint64_t bytes = 0;      // file size
  uint64_t xxhash64 = 0;   // of the whole file
  uint64_t items = 0;      // tokens (token shards) or records (record shards)
  uint64_t documents = 0;  // token shards: documents that start in this shard
  // xxHash64 of each Manifest::chunk_bytes piece of the file, in order (the last may be
  // shorter); empty in format 1.
  std::vector<uint64_t> chunk_hashes;
};

// A file beside the shards that the dataset needs (a tokenizer file), with its size and hash.
struct FileInfo {
  std::string file;  // relative to the dataset directory
  uint64_t bytes = 0;
  uint64_t xxhash64 = 0;
};

struct LOOM_API Manifest {
  // The manifest format this Loom writes; it reads every version from kOldestFormatVersion.
  // 1: shards with whole-file hashes. 2: adds per-chunk hashes, tokenizer files and a hash of
  // the whole manifest. 3: adds image fields, ragged tensors and record layouts. Shard files
  // are format 1 in all.
  static constexpr int kFormatVersion = 3;
  static constexpr int kOldestFormatVersion = 1;
  static constexpr uint64_t kDefaultChunkBytes = uint64_t{1} << 20;

  int format_version = kFormatVersion;  // as read; writers write kFormatVersion
  DatasetKind kind = DatasetKind::kTokens;
  // 16 hex digits naming the content: xxHash64 of the content identity (docs/datasets.md),
  // which leaves out what a migration may change (format version, chunk hashes).
  std::string version;
  // The version the same shards had under format 1, when a migration changed it (a format 1
  // version did not cover the tokenizer files); "" otherwise. A reader state of this version
  // resumes on this dataset as if it were of `version`.
  std::string previous_version;
  std::vector<ShardInfo> shards;
  uint64_t chunk_bytes = 0;  // the size of the hashed chunks; 0 in format 1 (no chunk hashes)
  // Token datasets.
  uint64_t vocab_size = 0;  // token ids are < vocab_size
  int64_t eos_id = -1;      // appended after every document, or -1 for none
  std::string tokenizer;    // the vocabulary file (data::Vocabulary) in the directory, or ""
  // Every tokenizer file (tokenizer.model, tokenizer.vocab), checked at every open; empty in
  // format 1 and for datasets without a tokenizer.
  std::vector<FileInfo> tokenizer_files;
  // Record datasets.
  std::vector<Field> schema;
  RecordLayout layout = RecordLayout::kPlain;
  // Free-form description (source files, builder); part of the version.
  std::string description;

  uint64_t total_items() const;      // tokens or records
  uint64_t total_documents() const;  // token datasets
  uint64_t total_bytes() const;
  const Field& field(const std::string& name) const;  // InvalidArgument naming known fields
};

// Reads and checks `dir`/manifest.json, of any format version this Loom reads: a missing
// directory or manifest is IoError; bad JSON, an unknown format version, or a manifest that
// does not hash to its recorded hashes is CorruptData.
LOOM_API Manifest read_manifest(const std::filesystem::path& dir);

// Checks that every tokenizer file of `m` exists with its recorded size and xxHash64: IoError
// when one is missing, CorruptData naming it otherwise. Reader and Vocabulary::of_dataset call
// it at open.
LOOM_API void check_tokenizer_files(const std::filesystem::path& dir, const Manifest& m);

// One record of a record dataset, in schema order: values[i] is field i, encoded as stored
// (see encode_* below), so that writing needs no copy of big tensors twice.
class LOOM_API Record {
 public:
  Record& bytes(std::string value);
  Record& text(std::string value);
  Record& integer(int64_t value);
  Record& real(double value);
  // A tensor field: its raw little-endian element bytes and its shape.
  Record& tensor(const void* data, size_t nbytes, std::vector<int64_t> shape);
  // An image field: the bytes of a PNG, JPEG or Loom raw image (data/image_codec.h), stored
  // as given; the writer decodes it once to check it.
  Record& image(std::string encoded);
  // An images field: each element as for image().
  Record& images(std::vector<std::string> encoded);

  struct Value {
    FieldType type;
    std::string bytes;               // kBytes, kText, kTensor, kImage: the data
    int64_t integer = 0;             // kInt
    double real = 0;                 // kFloat
    std::vector<int64_t> shape;      // kTensor
    std::vector<std::string> items;  // kImages: each image's bytes
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
  std::string tokenizer;                    // vocabulary file already copied into the directory
  // Every tokenizer file already in the directory (e.g. tokenizer.model, tokenizer.vocab);
  // hashed into the manifest. Empty: just `tokenizer`, when it is set.
  std::vector<std::string> tokenizer_files;
  uint64_t chunk_bytes = Manifest::kDefaultChunkBytes;  // hashed chunk size, >= 64
  std::string description;
};

// Writes a token dataset into an empty or new directory. Not thread-safe. Each shard is
// written to a temporary name, fsynced and renamed; the manifest is written last (atomically),
// so a directory without manifest.json is an unfinished build. Errors are IoError naming the
// file; a token id >= vocab_size is InvalidArgument.
class LOOM_API TokenDatasetWriter {
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
  struct LOOM_HIDDEN Impl;
  std::unique_ptr<Impl> impl_;
};

struct RecordWriterOptions {
  uint64_t bytes_per_shard = 256ull << 20;  // a shard closes once its records reach this size
  uint64_t chunk_bytes = Manifest::kDefaultChunkBytes;  // hashed chunk size, >= 64
  std::string description;
  RecordLayout layout = RecordLayout::kPlain;  // its field rules are checked on every record
};

// Writes a record dataset; same guarantees and errors as TokenDatasetWriter. A schema that
// does not fit options.layout is InvalidArgument naming the field and the rule; so is a record
// whose values do not match the schema (count, types, a fixed tensor shape, a ragged field's
// trailing dimensions) or the layout (episode fields of different lengths, image positions
// that do not match the images), and an image that does not decode, each naming the record
// (its number, from 0) and the field.
class LOOM_API RecordDatasetWriter {
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
  struct LOOM_HIDDEN Impl;
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

// Checks everything: the manifest, the tokenizer files, every shard's size, header, chunk
// hashes and xxHash64, and every record's checksum. Reports the first problem instead of
// throwing (`offset` is the bad chunk's first byte for a chunk hash); an unreadable manifest
// still throws as read_manifest does.
LOOM_API VerifyReport verify_dataset(const std::filesystem::path& dir,
                                     const ProgressFn& progress = {});

// What migrate_dataset did.
struct MigrateReport {
  int from_format = 0;
  int to_format = 0;
  std::string old_version;
  std::string new_version;  // equal to old_version unless the old format left content out
  bool rewritten = false;   // false when the dataset was already current
};

// Rewrites `dir` to the current format version (Manifest::kFormatVersion) in place: every
// shard is hashed first and must match its manifest (CorruptData naming it otherwise, and
// nothing is changed), then manifest.json is replaced atomically. Shard files are not
// rewritten (their format is unchanged). The content version is kept when the identity is
// unchanged; see docs/datasets.md for the one case where it moves. Not safe to run while
// another process migrates the same directory.
LOOM_API MigrateReport migrate_dataset(const std::filesystem::path& dir,
                                       const ProgressFn& progress = {});

}  // namespace loom::data

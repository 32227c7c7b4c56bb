// The byte layout of token and record shards (docs/data-format.md) and the checks that
// guard every read of them. Private to Loom: data::Reader, the writers and verify use it.
#pragma once

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/data/dataset.h"
#include "util/mapped_file.h"

namespace loom::data::format {

// Called by verify_files before it checks each file (tokenizer files, then shards, in the
// manifest's order) with the file's name, size and xxHash64; returns what keeps the file at
// dir/name while it is checked (a remote dataset's cache pin). Its CorruptData or IoError is
// reported as that file's problem.
using FetchFn = std::function<std::shared_ptr<void>(const std::string& file, uint64_t bytes,
                                                    uint64_t xxhash64)>;

// verify_dataset's checks over the files of `m` in `dir`, each first handed to `fetch` (if
// set). Reports the first problem, naming the file as `where`/file (`where`: the dataset's
// directory or URL).
VerifyReport verify_files(const std::filesystem::path& dir, const Manifest& m,
                          const std::string& where, const FetchFn& fetch,
                          const ProgressFn& progress);

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "shards are little-endian on disk");

inline constexpr char kTokenMagic[8] = {'L', 'O', 'O', 'M', 'T', 'O', 'K', 'S'};
inline constexpr char kRecordMagic[8] = {'L', 'O', 'O', 'M', 'R', 'E', 'C', 'S'};
inline constexpr uint32_t kShardVersion = 1;
inline constexpr char kManifestFile[] = "manifest.json";

// Token shard: this header, the tokens (token_bytes each), zero padding to a multiple of 8,
// then the document index: num_documents + 1 uint64 token offsets within the shard.
struct TokenHeader {
  char magic[8];
  uint32_t version;
  uint32_t token_bytes;  // 2 or 4
  uint64_t num_tokens;
  uint64_t num_documents;
  uint64_t index_offset;  // byte offset of the document index
  uint8_t reserved[24];
};
static_assert(sizeof(TokenHeader) == 64);

// Record shard: this header, the records (each its payload then the payload's xxHash64),
// then the record index: num_records + 1 uint64 byte offsets of the records in the file.
struct RecordHeader {
  char magic[8];
  uint32_t version;
  uint32_t reserved0;
  uint64_t num_records;
  uint64_t index_offset;  // byte offset of the record index
  uint8_t reserved[32];
};
static_assert(sizeof(RecordHeader) == 64);

// Token width on disk for a vocabulary: 2 bytes up to 65536 ids, else 4.
inline uint32_t token_bytes_for(uint64_t vocab_size) { return vocab_size <= 65536 ? 2 : 4; }

// Bytes per element of a tensor field's dtype name; InvalidArgument for an unknown name.
size_t dtype_size(const std::string& dtype);
FieldType parse_field_type(const std::string& name);  // CorruptData when unknown
RecordLayout parse_layout(const std::string& name);   // CorruptData when unknown

// Appends the payload of `record` (without its checksum) to `out`. InvalidArgument when the
// record does not match the schema.
void encode_record(const std::vector<Field>& schema, const Record& record, std::string& out);

// One decoded field of a stored record; points into the mapped shard. A plain value (no heap
// memory), so a batch decodes without allocating per record.
struct FieldView {
  static constexpr uint32_t kMaxDims = 8;
  const uint8_t* data = nullptr;  // kBytes, kText, kTensor, kImage; kImages: the encoded list
  size_t size = 0;
  int64_t integer = 0;  // kInt; kImages: how many images
  double real = 0;
  uint32_t ndim = 0;         // kTensor
  int64_t dims[kMaxDims]{};  // kTensor: the first ndim are the shape
  std::vector<int64_t> shape() const { return {dims, dims + ndim}; }
  bool same_shape(const FieldView& o) const {
    return ndim == o.ndim && std::memcmp(dims, o.dims, ndim * sizeof(int64_t)) == 0;
  }
};

// The images of a kImages view, each as its encoded bytes.
std::vector<std::pair<const uint8_t*, size_t>> list_items(const FieldView& view);

// Decodes a payload into views out[0, schema.size()). Returns "" or what is malformed.
std::string decode_record(const std::vector<Field>& schema, const uint8_t* payload, size_t size,
                          FieldView* out);

// A mapped shard whose header has been checked against its manifest entry.
class TokenShard {
 public:
  // IoError if the file is missing; CorruptData naming the file if its size differs from the
  // manifest (truncated or replaced) or its header is not a token shard of this dataset.
  TokenShard(const std::filesystem::path& dir, const ShardInfo& info, uint32_t token_bytes);
  uint64_t num_tokens() const { return header().num_tokens; }
  uint64_t num_documents() const { return header().num_documents; }
  uint32_t token_bytes() const { return header().token_bytes; }
  const uint8_t* tokens() const { return file_.data() + sizeof(TokenHeader); }
  // Document d (< num_documents()) as the token range [first, second) of the shard. Only the
  // index's first and last entries are checked at open; an entry read here that goes backwards
  // or past the tokens is CorruptData naming the shard and the document.
  std::pair<uint64_t, uint64_t> document(uint64_t d) const;
  // Byte offset of the document index in the file.
  uint64_t index_offset() const { return header().index_offset; }
  const util::MappedFile& file() const { return file_; }

 private:
  const TokenHeader& header() const { return *reinterpret_cast<const TokenHeader*>(file_.data()); }
  // Entry d of the document index (d <= num_documents()), unchecked.
  uint64_t doc_offset(uint64_t d) const;
  util::MappedFile file_;
};

class RecordShard {
 public:
  // Same errors as TokenShard, for record shards.
  RecordShard(const std::filesystem::path& dir, const ShardInfo& info);
  uint64_t num_records() const { return num_records_; }
  using Payload = std::pair<const uint8_t*, size_t>;
  // Record i's payload after checking its xxHash64 and bounds; CorruptData naming the shard,
  // the record and its byte offset otherwise.
  Payload payload(uint64_t i) const;
  // The same check without throwing: what is wrong with record i, or "" and its payload.
  std::string check(uint64_t i, Payload* payload) const;
  // Byte offset of record i in the file.
  uint64_t offset(uint64_t i) const;
  const util::MappedFile& file() const { return file_; }

 private:
  util::MappedFile file_;
  uint64_t num_records_ = 0;
  uint64_t index_offset_ = 0;
};

}  // namespace loom::data::format

// The checkpoint manifest: what a committed step holds and where each byte lives, plus the
// naming of step directories and data files. Private to Loom.
//
//   ckpt_dir/step_00001000/rank_00000.data   this rank's pieces, aligned raw bytes
//   ckpt_dir/step_00001000/manifest.json     written last, by rank 0: the commit point
//
// Every piece is an element range [begin, end) of the flattened global tensor (a kRows piece
// is stored as the elements of its rows; a replicated tensor is one piece covering it all),
// so any saved sharding can be read back as any other. Each piece's bytes are hashed in chunks
// of chunk_bytes (the last may be short), an xxHash64 per chunk, so that a partial read can
// verify what it reads; the piece's own xxHash64 is that of its chunk hashes (piece_hash),
// which costs no second pass over the bytes and still pins every byte of the piece.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "loom/ckpt/inspect.h"

namespace loom::ckpt {

inline constexpr int kManifestVersion = 1;
inline constexpr const char* kManifestName = "manifest.json";

// "step_00001000" (at least 8 digits); parse gives nullopt for any other name.
std::string step_dir_name(int64_t step);
std::optional<int64_t> parse_step_dir_name(const std::string& name);
// "rank_00003.data".
std::string data_file_name(int rank);

// "float32", "bfloat16", "int64"... (PyTorch's names); parse is CorruptData for unknown ones.
std::string dtype_name(c10::ScalarType type);
c10::ScalarType parse_dtype(const std::string& name);

struct Piece {
  std::string file;                    // data file name inside the step directory
  int64_t begin = 0;                   // first element of the flattened global tensor
  int64_t end = 0;                     // one past the last
  uint64_t offset = 0;                 // byte offset in the file
  uint64_t bytes = 0;                  // (end - begin) * element size
  uint64_t hash = 0;                   // piece_hash(chunk_hashes)
  uint64_t chunk_bytes = 0;            // size of the hashed chunks (a multiple of the element size)
  std::vector<uint64_t> chunk_hashes;  // xxHash64 of each chunk, in order
};

// xxHash64 of the chunk hashes as 8-byte little-endian words, in order.
uint64_t piece_hash(const std::vector<uint64_t>& chunk_hashes);

struct TensorRecord {
  std::string name;
  std::string dtype;           // dtype_name
  std::vector<int64_t> shape;  // the global shape
  std::string kind;            // how it was saved: "replicated", "rows", "flat" (informative)
  std::vector<Piece> pieces;   // sorted by begin once committed

  int64_t numel() const;
};

struct FileRecord {
  std::string name;
  int rank = 0;
  uint64_t bytes = 0;
};

// A committed step, or (during a save) one rank's report of what it wrote.
struct Manifest {
  int64_t step = 0;
  int world_size = 0;
  std::vector<FileRecord> files;
  std::vector<TensorRecord> tensors;
  std::map<std::string, std::string> blobs;  // name -> JSON text

  const TensorRecord* find(const std::string& name) const;
  uint64_t data_bytes() const;  // the sum of the files' sizes
};

std::string to_json(const Manifest& manifest);
// Parses to_json's form; anything else is CorruptData naming `what` (usually the path).
Manifest parse_manifest(const std::string& text, const std::string& what);
class Storage;

// Reads <step_dir>/manifest.json: IoError when missing, CorruptData when malformed. Without a
// storage, through posix_storage().
Manifest read_manifest(Storage& storage, const std::filesystem::path& step_dir);
Manifest read_manifest(const std::filesystem::path& step_dir);

// Merges the ranks' reports into one manifest: pieces of the same tensor joined and sorted,
// dtypes, shapes and kinds checked to agree, and every element of every tensor covered by
// some piece. Disagreement is InvalidArgument naming the tensor and the ranks.
Manifest merge_reports(int64_t step, const std::vector<Manifest>& reports);

// committed_steps and uncommitted_dirs (loom/ckpt/inspect.h) through a storage, so that its
// faults reach the listing and existence checks; the public ones use posix_storage().
std::vector<int64_t> committed_steps(Storage& storage, const std::filesystem::path& dir);
std::vector<std::filesystem::path> uncommitted_dirs(Storage& storage,
                                                    const std::filesystem::path& dir);

}  // namespace loom::ckpt

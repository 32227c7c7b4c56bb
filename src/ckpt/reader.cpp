// Reading pieces of a committed step (see reader.h).
#include "ckpt/reader.h"

#include <algorithm>
#include <cstring>

#include "loom/error.h"
#include "util/hash.h"

namespace loom::ckpt {

StepReader::StepReader(std::shared_ptr<Storage> storage, std::filesystem::path step_dir,
                       Manifest manifest)
    : storage_(std::move(storage)),
      step_dir_(std::move(step_dir)),
      manifest_(std::move(manifest)) {}

ReadableFile& StepReader::file(const std::string& name) {
  auto it = files_.find(name);
  if (it == files_.end()) {
    it = files_.emplace(name, storage_->open(step_dir_ / name)).first;
    file_sizes_[name] = it->second->size();
  }
  return *it->second;
}

ReadableFile& StepReader::piece_file(const TensorRecord& tensor, const Piece& p) {
  ReadableFile& f = file(p.file);
  const uint64_t size = file_sizes_[p.file];
  // The manifest checked that offset + bytes does not overflow.
  LOOM_CHECK(p.offset + p.bytes <= size, CorruptData, "checkpoint step ", manifest_.step,
             ": tensor \"", tensor.name, "\": file ", (step_dir_ / p.file).string(),
             " is truncated (", size, " bytes; the tensor's piece ends at byte ",
             p.offset + p.bytes,
             "). Load an earlier step (load_latest_valid) or restore the file.");
  return f;
}

void StepReader::read_piece(const TensorRecord& tensor, const Piece& p, uint64_t from, uint64_t to,
                            char* dest, bool verify) {
  if (from >= to) return;
  ReadableFile& f = piece_file(tensor, p);
  const auto path = step_dir_ / p.file;
  auto truncated = [&] {
    return CorruptData(detail::concat("checkpoint step ", manifest_.step, ": tensor \"",
                                      tensor.name, "\": file ", path.string(),
                                      " ended early while reading it (truncated)"));
  };
  if (!verify) {
    f.will_need(p.offset + from, to - from);
    if (!read_exact(f, p.offset + from, dest, to - from)) throw truncated();
    return;
  }
  const uint64_t cb = p.chunk_bytes;
  const uint64_t first = from / cb, last = (to - 1) / cb;
  f.will_need(p.offset + first * cb, std::min(p.bytes, (last + 1) * cb) - first * cb);
  for (uint64_t c = first; c <= last; ++c) {
    const uint64_t cs = c * cb, ce = std::min(p.bytes, cs + cb);
    const bool whole = from <= cs && ce <= to;
    char* target = dest + (cs - from);  // only used when whole
    if (!whole) {
      scratch_.resize(std::min(cb, p.bytes));  // bounded by the file's size (piece_file)
      target = scratch_.data();
    }
    if (!read_exact(f, p.offset + cs, target, ce - cs)) throw truncated();
    const uint64_t hash = util::xxh64(target, ce - cs);
    LOOM_CHECK(hash == p.chunk_hashes[c], CorruptData, "checkpoint step ", manifest_.step,
               ": tensor \"", tensor.name, "\" is corrupt in file ", path.string(), ": bytes [",
               p.offset + cs, ", ", p.offset + ce, ") hash to ", util::hash_hex(hash),
               ", the manifest says ", util::hash_hex(p.chunk_hashes[c]),
               ". Load an earlier step (load_latest_valid) or restore the file.");
    if (!whole) {
      const uint64_t lo = std::max(from, cs), hi = std::min(to, ce);
      std::memcpy(dest + (lo - from), scratch_.data() + (lo - cs), hi - lo);
    }
  }
}

void StepReader::read(const TensorRecord& tensor, int64_t begin, int64_t end, char* dest,
                      bool verify) {
  const uint64_t es = c10::elementSize(parse_dtype(tensor.dtype));
  int64_t covered = begin;
  for (const Piece& p : tensor.pieces) {
    if (covered >= end) break;
    if (p.end <= covered || p.begin >= p.end) continue;
    LOOM_CHECK(p.begin <= covered, CorruptData, "checkpoint step ", manifest_.step,
               ": no piece of tensor \"", tensor.name, "\" holds element ", covered);
    const int64_t hi = std::min(p.end, end);
    read_piece(tensor, p, (covered - p.begin) * es, (hi - p.begin) * es,
               dest + (covered - begin) * es, verify);
    covered = hi;
  }
  LOOM_CHECK(covered >= end, CorruptData, "checkpoint step ", manifest_.step,
             ": no piece of tensor \"", tensor.name, "\" holds element ", covered);
}

uint64_t StepReader::verify_all() {
  uint64_t checked = 0;
  std::vector<char> buffer;
  for (const TensorRecord& t : manifest_.tensors) {
    for (const Piece& p : t.pieces) {
      // The manifest's own consistency first, then every chunk, one at a time.
      const uint64_t hash = piece_hash(p.chunk_hashes);
      LOOM_CHECK(hash == p.hash, CorruptData, "checkpoint step ", manifest_.step, ": tensor \"",
                 t.name, "\" of file ", (step_dir_ / p.file).string(),
                 ": the manifest's chunk hashes hash to ", util::hash_hex(hash),
                 ", its piece hash is ", util::hash_hex(p.hash), " (the manifest is corrupt)");
      piece_file(t, p);  // the piece is inside its file before anything is allocated for it
      buffer.resize(std::min(p.bytes, p.chunk_bytes));
      for (uint64_t cs = 0; cs < p.bytes; cs += p.chunk_bytes)
        read_piece(t, p, cs, std::min(p.bytes, cs + p.chunk_bytes), buffer.data(), true);
      checked += p.bytes;
    }
  }
  return checked;
}

}  // namespace loom::ckpt

// Reading pieces of a committed step (see reader.h).
#include "ckpt/reader.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "ckpt/device_copy.h"
#include "ckpt/io_queue.h"
#include "loom/error.h"
#include "util/hash.h"

namespace loom::ckpt {
namespace {

uint64_t align_up(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

}  // namespace

struct StepReader::OpenFile {
  std::filesystem::path path;
  std::unique_ptr<ReadableFile> buffered;
  std::unique_ptr<ReadableFile> direct;  // opened when a read can use it; may be buffered (tmpfs)
  uint64_t size = 0;
};

// One read: bytes [from, to) of a piece (relative to the piece), of which [want_from, want_to)
// go to dest.
struct StepReader::Op {
  const TensorRecord* tensor = nullptr;
  const Piece* piece = nullptr;
  OpenFile* file = nullptr;
  uint64_t from = 0, to = 0;
  uint64_t want_from = 0, want_to = 0;
  char* dest = nullptr;  // null: nothing is copied (verification only)
  bool direct = false;   // through file->direct, aligned

  uint64_t bytes() const { return to - from; }
};

StepReader::StepReader(std::shared_ptr<Storage> storage, std::filesystem::path step_dir,
                       Manifest manifest, ReadOptions options)
    : storage_(std::move(storage)),
      step_dir_(std::move(step_dir)),
      manifest_(std::move(manifest)),
      options_(options) {
  LOOM_CHECK(options_.io_threads > 0 && options_.read_bytes > 0 &&
                 options_.read_bytes % kDirectAlignment == 0,
             InvalidArgument,
             "ReadOptions: io_threads must be positive and read_bytes a positive multiple of 4096");
}

StepReader::~StepReader() = default;

StepReader::OpenFile& StepReader::file(const std::string& name) {
  auto it = files_.find(name);
  if (it == files_.end()) {
    auto f = std::make_unique<OpenFile>();
    f->path = step_dir_ / name;
    f->buffered = storage_->open(f->path);
    f->size = f->buffered->size();
    it = files_.emplace(name, std::move(f)).first;
  }
  return *it->second;
}

StepReader::OpenFile& StepReader::piece_file(const TensorRecord& tensor, const Piece& p) {
  OpenFile& f = file(p.file);
  // The manifest checked that offset + bytes does not overflow.
  LOOM_CHECK(p.offset + p.bytes <= f.size, CorruptData, "checkpoint step ", manifest_.step,
             ": tensor \"", tensor.name, "\": file ", f.path.string(), " is truncated (", f.size,
             " bytes; the tensor's piece ends at byte ", p.offset + p.bytes,
             "). Load an earlier step (load_latest_valid) or restore the file.");
  return f;
}

void StepReader::plan(const TensorRecord& tensor, const Piece& p, uint64_t from, uint64_t to,
                      char* dest, bool verify, std::vector<Op>& ops) {
  if (from >= to) return;
  OpenFile& f = piece_file(tensor, p);
  uint64_t lo = from, hi = to;
  if (verify) {  // whole chunks, to hash them
    lo = from / p.chunk_bytes * p.chunk_bytes;
    hi = std::min(p.bytes, align_up(to, p.chunk_bytes));
  }
  for (uint64_t rs = lo; rs < hi; rs += options_.read_bytes) {
    Op op;
    op.tensor = &tensor;
    op.piece = &p;
    op.file = &f;
    op.from = rs;
    op.to = std::min(hi, rs + options_.read_bytes);
    op.want_from = std::max(from, op.from);
    op.want_to = std::min(to, op.to);
    op.dest = dest == nullptr ? nullptr : dest + (op.want_from - from);
    op.direct = options_.direct_io && op.bytes() >= kDirectReadBytes &&
                (p.offset + op.from) % kDirectAlignment == 0;
    if (op.direct && !f.direct) f.direct = storage_->open(f.path, /*direct=*/true);
    ops.push_back(op);
  }
}

void StepReader::fetch(const Op& op, char* buffer) {
  const uint64_t offset = op.piece->offset + op.from;
  const uint64_t n = op.bytes();
  uint64_t got = 0;
  if (op.direct && op.file->direct->direct()) {
    // Whole 4 KiB blocks into the aligned buffer; the file may end inside the last one.
    const uint64_t length = align_up(n, kDirectAlignment);
    while (got < n) {
      const size_t r = op.file->direct->read_at(offset + got, buffer + got, length - got);
      got += r;
      if (r == 0 || got % kDirectAlignment != 0) break;  // the end of the file
    }
  } else {
    ReadableFile& f = op.direct ? *op.file->direct : *op.file->buffered;
    f.will_need(offset, n);
    if (read_exact(f, offset, buffer, n)) got = n;
  }
  LOOM_CHECK(got >= n, CorruptData, "checkpoint step ", manifest_.step, ": tensor \"",
             op.tensor->name, "\": file ", op.file->path.string(),
             " ended early while reading it (truncated)");
}

bool StepReader::whole_chunks(const Op& op) {
  const Piece& p = *op.piece;
  return op.from % p.chunk_bytes == 0 && (op.to % p.chunk_bytes == 0 || op.to == p.bytes);
}

void StepReader::consume(const Op& op, const char* data, bool verify,
                         std::optional<util::Hasher64>& partial) {
  if (verify) {
    const Piece& p = *op.piece;
    for (uint64_t pos = op.from; pos < op.to;) {
      const uint64_t c = pos / p.chunk_bytes, cs = c * p.chunk_bytes;
      const uint64_t ce = std::min(p.bytes, cs + p.chunk_bytes);
      const uint64_t n = std::min(op.to, ce) - pos;
      const char* bytes = data + (pos - op.from);
      const bool whole = pos == cs && pos + n == ce;
      if (!whole) {
        if (pos == cs) partial.emplace();
        partial->update(bytes, n);
      }
      pos += n;
      if (pos != ce) continue;
      const uint64_t hash = whole ? util::xxh64(bytes, n) : partial->digest();
      LOOM_CHECK(hash == p.chunk_hashes[c], CorruptData, "checkpoint step ", manifest_.step,
                 ": tensor \"", op.tensor->name, "\" is corrupt in file ", op.file->path.string(),
                 ": bytes [", p.offset + cs, ", ", p.offset + ce, ") hash to ",
                 util::hash_hex(hash), ", the manifest says ", util::hash_hex(p.chunk_hashes[c]),
                 ". Load an earlier step (load_latest_valid) or restore the file.");
    }
  }
  if (op.dest != nullptr && op.want_from < op.want_to)
    std::memcpy(op.dest, data + (op.want_from - op.from), op.want_to - op.want_from);
}

void StepReader::run(const std::vector<Op>& ops, bool verify) {
  if (ops.empty()) return;
  // Buffer i % slots holds op i from its read until it is hashed and copied: the I/O threads
  // work on up to `threads` ops ahead of the one the calling thread waits for.
  const size_t slots = static_cast<size_t>(options_.io_threads) + 1;
  uint64_t slot_bytes = 0;
  for (const Op& op : ops)
    slot_bytes = std::max(slot_bytes, align_up(op.bytes(), kDirectAlignment));
  internal::HostBuffer local;
  internal::HostBuffer& buffers = options_.buffers != nullptr ? *options_.buffers : local;
  if (buffers.size() < slots * slot_bytes) {
    buffers = internal::HostBuffer();
    buffers = internal::HostBuffer(slots * slot_bytes, /*pinned=*/false);
  }
  auto buffer = [&](size_t i) { return buffers.data() + (i % slots) * slot_bytes; };
  IoQueue io(options_.io_threads);  // after buffers: joined (reads finished) before they go
  // An op on an I/O thread whose chunks lie whole inside it is also verified and copied there,
  // so that hashing and copying use every core; the calling thread does the rest, in order
  // (a chunk that spans reads is hashed across them).
  std::vector<std::optional<IoQueue::Ticket>> tickets(ops.size());
  std::vector<bool> done_there(ops.size(), false);
  std::optional<util::Hasher64> partial;
  size_t submitted = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    for (; submitted < ops.size() && submitted < i + slots; ++submitted) {
      const Op& op = ops[submitted];
      // Small reads come from the page cache (readahead): a thread hop would cost more.
      if (op.bytes() < kDirectReadBytes) continue;
      char* into = buffer(submitted);
      const bool consume_there = !verify || whole_chunks(op);
      done_there[submitted] = consume_there;
      tickets[submitted] = io.submit([this, &op, into, verify, consume_there] {
        fetch(op, into);
        if (!consume_there) return;
        std::optional<util::Hasher64> unused;
        consume(op, into, verify, unused);
      });
    }
    const Op& op = ops[i];
    char* data = buffer(i);
    if (tickets[i]) {
      io.wait(*tickets[i]);
    } else {
      fetch(op, data);
    }
    if (!done_there[i]) consume(op, data, verify, partial);
  }
  io.drain();
}

void StepReader::read(const std::vector<Request>& requests, bool verify) {
  std::vector<Op> ops;
  for (const Request& r : requests) {
    const TensorRecord& tensor = *r.tensor;
    const uint64_t es = c10::elementSize(parse_dtype(tensor.dtype));
    int64_t covered = r.begin;
    for (const Piece& p : tensor.pieces) {
      if (covered >= r.end) break;
      if (p.end <= covered || p.begin >= p.end) continue;
      LOOM_CHECK(p.begin <= covered, CorruptData, "checkpoint step ", manifest_.step,
                 ": no piece of tensor \"", tensor.name, "\" holds element ", covered);
      const int64_t hi = std::min(p.end, r.end);
      plan(tensor, p, (covered - p.begin) * es, (hi - p.begin) * es,
           r.dest + (covered - r.begin) * es, verify, ops);
      covered = hi;
    }
    LOOM_CHECK(covered >= r.end, CorruptData, "checkpoint step ", manifest_.step,
               ": no piece of tensor \"", tensor.name, "\" holds element ", covered);
  }
  run(ops, verify);
}

uint64_t StepReader::verify_all() {
  uint64_t checked = 0;
  std::vector<Op> ops;
  for (const TensorRecord& t : manifest_.tensors) {
    for (const Piece& p : t.pieces) {
      // The manifest's own consistency first, then every chunk.
      const uint64_t hash = piece_hash(p.chunk_hashes);
      LOOM_CHECK(hash == p.hash, CorruptData, "checkpoint step ", manifest_.step, ": tensor \"",
                 t.name, "\" of file ", (step_dir_ / p.file).string(),
                 ": the manifest's chunk hashes hash to ", util::hash_hex(hash),
                 ", its piece hash is ", util::hash_hex(p.hash), " (the manifest is corrupt)");
      plan(t, p, 0, p.bytes, nullptr, /*verify=*/true, ops);
      checked += p.bytes;
    }
  }
  run(ops, /*verify=*/true);
  return checked;
}

}  // namespace loom::ckpt

// The bytes of weight snapshots (loom/control/weights.h): the shared-memory segment's header
// and slots, the layout (names, dtypes, shapes, offsets) both transports describe a version
// with, and the TCP protocol's request and reply header lines. Pure functions and plain structs:
// no file, socket or thread, so every check is unit-tested without a publisher. Private to Loom.
//
// Segment /dev/shm/loom-weights-<name>:
//   [0, kHeaderRegion)          SegmentHeader (below), slots' sequence locks included
//   [layout_offset, +layout_bytes)  the layout as JSON (layout_json)
//   [data_offset + i * slot_stride, +data_bytes)  slot i's version: the tensors' bytes back to
//                                   back in name order (C-contiguous, host byte order)
// A version's xxHash64 is over those data_bytes.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "util/hash.h"

namespace loom::control::weights {

constexpr uint64_t kMagic = 0x31544847574d4f4cull;  // "LOMWGHT1"
constexpr uint32_t kFormatVersion = 1;
constexpr int kMinSlots = 3;
constexpr int kMaxSlots = 64;
constexpr const char* kSegmentPrefix = "loom-weights-";
// Bounds on what a reader accepts before it maps or allocates anything.
constexpr uint64_t kMaxLayoutBytes = uint64_t{64} << 20;
constexpr uint64_t kMaxDataBytes = uint64_t{1} << 46;
constexpr int kMaxDims = 16;

// One slot's sequence lock: odd while the publisher writes the slot. version and checksum are
// read between two loads of seq and count only when both loads are equal and even.
struct alignas(64) SlotHeader {
  std::atomic<uint64_t> seq{0};
  std::atomic<int64_t> version{-1};
  std::atomic<uint64_t> checksum{0};
};

struct SegmentHeader {
  std::atomic<uint64_t> magic{0};  // written last, with release: the rest is valid once it is
  uint32_t format_version = 0;
  uint32_t slot_count = 0;
  int32_t pid = 0;  // the publisher's, for messages (liveness is its flock on the segment)
  uint32_t reserved = 0;
  uint64_t layout_offset = 0;
  uint64_t layout_bytes = 0;
  uint64_t data_offset = 0;
  uint64_t slot_stride = 0;
  uint64_t data_bytes = 0;
  uint64_t segment_bytes = 0;
  std::atomic<uint32_t> closed{0};     // 1: the publisher closed it on purpose
  std::atomic<uint32_t> publishes{0};  // futex word: bumped (and woken) by every publish
  std::atomic<int32_t> latest_slot{-1};
  std::atomic<int64_t> latest_version{-1};
  alignas(64) SlotHeader slots[kMaxSlots];
};

constexpr uint64_t round_up(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }
constexpr uint64_t kPage = 4096;
constexpr uint64_t kHeaderRegion = round_up(sizeof(SegmentHeader), kPage);

// One tensor of a version.
struct TensorSpec {
  std::string name;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // within the version's bytes
  uint64_t bytes = 0;

  bool operator==(const TensorSpec& other) const;
};

struct Layout {
  std::vector<TensorSpec> tensors;  // in name order, back to back
  uint64_t total_bytes = 0;
};

// The layout of `tensors` (a std::map: in name order). InvalidArgument naming a tensor that is
// undefined or whose dtype has no name in util/dtype.h.
Layout layout_of(const std::map<std::string, at::Tensor>& tensors);
// "" when equal, else what differs, naming the tensor: "tensor \"w\" is float32 [2, 3] in the
// published layout and float64 [2, 3] here", "tensor \"x\" is not in the published layout".
std::string layout_difference(const Layout& published, const Layout& given);

nlohmann::json layout_json(const Layout& layout);
// Checks everything (CorruptData naming `where`): an array of objects with name (non-empty,
// strictly increasing), a named dtype, at most kMaxDims dims each in [0, 2^48], bytes equal to
// the elements times the element size without overflow, offsets back to back, the total at
// most kMaxDataBytes.
Layout parse_layout(const nlohmann::json& value, const std::string& where);

// Where everything sits in a segment for `slots` versions of `data_bytes` and a layout JSON of
// `layout_bytes`.
struct Geometry {
  uint64_t layout_offset = 0;
  uint64_t data_offset = 0;
  uint64_t slot_stride = 0;
  uint64_t segment_bytes = 0;
};
Geometry geometry(int slots, uint64_t layout_bytes, uint64_t data_bytes);
// Checks a mapped header against the segment file's size (CorruptData naming `where`): magic,
// format version, slot count, geometry, bounds. The layout is checked by parse_layout.
void check_header(const SegmentHeader& header, uint64_t file_bytes, const std::string& where);

// The segment's name ("loom-weights-<name>") and path ("/dev/shm/loom-weights-<name>").
std::string segment_name(const std::string& name);
std::string segment_path(const std::string& name);
// InvalidArgument unless `name` is 1 to 200 of [A-Za-z0-9._-] not starting with '.'.
void check_name(const std::string& name);

// Copies n bytes from src to dst and hashes them (the destination, chunk by chunk while it is
// in cache): one pass over memory for both.
void copy_and_hash(void* dst, const void* src, size_t n, util::Hasher64& hasher);

// The sequence lock, publisher's side: begin_write makes `slot`'s seq odd (readers of it
// retry); end_write stores the version and checksum, makes seq even, makes the slot the latest
// and bumps `publishes` (the caller wakes its futex waiters).
void begin_write(SegmentHeader& header, int slot);
void end_write(SegmentHeader& header, int slot, int64_t version, uint64_t checksum);

// The reader's side: copies the newest version, when it is newer than `newer_than`, into
// `spans` (the tensors' bytes in layout order; their sizes must sum to data_bytes) and hashes
// it. kTorn: the publisher wrote that slot meanwhile (retry). `during_copy`, for tests, runs
// between the copy and the check. CorruptData naming `where` for a latest slot outside the
// segment.
struct Span {
  void* data;
  uint64_t bytes;
};
enum class ReadStatus { kOk, kNothingNewer, kTorn };
struct ReadResult {
  ReadStatus status = ReadStatus::kNothingNewer;
  int64_t version = -1;   // kOk: the version read; kNothingNewer: the newest (-1: none)
  uint64_t checksum = 0;  // the slot's
  uint64_t computed = 0;  // of the bytes copied
};
ReadResult read_newest(const SegmentHeader& header, const uint8_t* base, int64_t newer_than,
                       const std::vector<Span>& spans, const std::string& where,
                       const std::function<void()>& during_copy = nullptr);

// TCP: a subscriber's request line, {"newer_than": N, "timeout_ms": T}.
struct Request {
  int64_t newer_than = -1;
  int64_t timeout_ms = 0;  // clamped to [0, 10 min]
};
std::string request_line(const Request& request);
// CorruptData naming `where` for anything but that object.
Request parse_request(const std::string& line, const std::string& where);

// TCP: the reply header line. status "ok": version, checksum, bytes and layout follow; "none":
// no version newer than asked within the timeout (latest says the newest, -1 for none);
// "closed": the publisher is shutting down; "busy": too many connections.
struct Reply {
  std::string status;
  int64_t version = -1;
  int64_t latest = -1;
  uint64_t checksum = 0;
  Layout layout;
  std::string message;  // for people: what happened and what to do
};
std::string reply_line(const Reply& reply);
// CorruptData naming `where` for anything Loom does not write; an "ok" reply's layout is checked
// by parse_layout and its bytes bounded by max_bytes (before anything is allocated for them).
Reply parse_reply(const std::string& line, uint64_t max_bytes, const std::string& where);

}  // namespace loom::control::weights

// The flight recorder: each group's ring buffer of its last N collectives, dumped on a
// timeout so that tooling can name the collective where ranks diverged (the top cause of hangs
// in large jobs: ranks issuing collectives in different orders). docs/flight-recorder.md has
// the dump format and how to read `loom flight diff`.
//
// Thread safety: every FlightRecorder method may be called from any thread (a mutex guards the
// buffer).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

#include "loom/visibility.h"

namespace loom::comm {

// An op's life: enqueued by the caller, started by the group's worker, then completed or
// failed. An op still enqueued or started when the dump is taken is "in flight".
enum class OpState { kEnqueued, kStarted, kCompleted, kFailed };
// "enqueued", "started", "completed", "failed".
LOOM_API const char* to_string(OpState state);

struct FlightEntry {
  uint64_t sequence = 0;  // position in the group's issue order, from 1
  std::string op;         // "all_reduce", "broadcast", ...
  std::string dtype;      // "float32", ... ("" for barrier)
  int64_t numel = 0;
  std::vector<int> peers;  // the root, the destination or source; empty for all-rank ops
  int64_t enqueue_us = 0;  // microseconds since the Unix epoch; 0 = not reached yet
  int64_t start_us = 0;
  int64_t end_us = 0;
  OpState state = OpState::kEnqueued;
};

class LOOM_API FlightRecorder {
 public:
  // Keeps the last `capacity` ops; the oldest is dropped when a new one arrives at capacity.
  // capacity 0 is InvalidArgument.
  explicit FlightRecorder(size_t capacity = 2048);

  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;

  // Records a new op, enqueued now; returns its sequence number (1, 2, ...).
  uint64_t enqueue(const std::string& op, const std::string& dtype, int64_t numel,
                   std::vector<int> peers);
  // Marks the op started now. For an op already dropped from the buffer, a no-op; for a
  // sequence number never returned by enqueue, InvalidArgument.
  void start(uint64_t sequence);
  // Marks the op ended now with `state` (kCompleted or kFailed, else InvalidArgument).
  // Dropped and unknown sequence numbers as for start().
  void finish(uint64_t sequence, OpState state);

  size_t capacity() const { return capacity_; }
  // The entries still in the buffer, oldest first; their sequence numbers are consecutive.
  std::vector<FlightEntry> snapshot() const;
  // {"version": 1, "rank": r, "group": name, "capacity": N, "dumped_us": t, "entries": [...]};
  // docs/flight-recorder.md describes each field.
  std::string to_json(int rank, const std::string& group) const;
  // Writes to_json atomically to `file` (directories created). Failure is IoError naming the
  // file. Use flight_dump_file() for the name so that read_flight_dumps finds it.
  void dump(const std::filesystem::path& file, int rank, const std::string& group) const;

 private:
  FlightEntry* find(uint64_t sequence);  // requires mutex_; null when dropped

  // Constant after construction.
  const size_t capacity_;
  // State below is protected by mutex_.
  mutable std::mutex mutex_;
  std::deque<FlightEntry> entries_;
  uint64_t next_sequence_ = 1;
};

// <dir>/rank_<rank>.json: where rank `rank` dumps its recorder, the name read_flight_dumps reads.
LOOM_API std::filesystem::path flight_dump_file(const std::filesystem::path& dir, int rank);

// One rank's dump as read back.
struct FlightDump {
  int rank = 0;                      // from the file name, checked against the dump's "rank"
  std::filesystem::path file;        // <dir>/rank_<rank>.json
  std::string group;                 // the group the recorder belongs to
  std::vector<FlightEntry> entries;  // oldest first, consecutive sequence numbers
};

// Reads every <dir>/rank_<r>.json (other files are ignored), ascending by rank: what `loom
// flight diff` compares. A directory without dumps is IoError; a malformed dump (bad JSON, a
// missing field, non-consecutive sequence numbers, a "rank" that does not match the file name)
// is CorruptData naming the file; dumps of different groups are InvalidArgument.
LOOM_API std::vector<FlightDump> read_flight_dumps(const std::filesystem::path& dir);

}  // namespace loom::comm

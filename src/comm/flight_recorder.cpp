// The flight recorder's ring buffer, its JSON dump, and reading dumps back (which `loom flight
// diff` compares across ranks).
#include "loom/comm/flight_recorder.h"

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>
#include <optional>
#include <system_error>
#include <utility>

#include "loom/error.h"
#include "util/files.h"
#include "util/json.h"

namespace loom::comm {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

constexpr int kDumpVersion = 1;

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::optional<OpState> parse_state(const std::string& name) {
  for (OpState state :
       {OpState::kEnqueued, OpState::kStarted, OpState::kCompleted, OpState::kFailed}) {
    if (name == to_string(state)) return state;
  }
  return std::nullopt;
}

// Keys in a reading order (sequence first), not alphabetical.
nlohmann::ordered_json entry_to_json(const FlightEntry& entry) {
  nlohmann::ordered_json j;
  j["sequence"] = entry.sequence;
  j["op"] = entry.op;
  j["dtype"] = entry.dtype;
  j["numel"] = entry.numel;
  j["peers"] = entry.peers;
  j["state"] = to_string(entry.state);
  j["enqueue_us"] = entry.enqueue_us;
  j["start_us"] = entry.start_us;
  j["end_us"] = entry.end_us;
  return j;
}

}  // namespace

const char* to_string(OpState state) {
  switch (state) {
    case OpState::kEnqueued:
      return "enqueued";
    case OpState::kStarted:
      return "started";
    case OpState::kCompleted:
      return "completed";
    case OpState::kFailed:
      return "failed";
  }
  return "unknown";
}

// ---- The recorder -------------------------------------------------------------------------

FlightRecorder::FlightRecorder(size_t capacity) : capacity_(capacity) {
  LOOM_CHECK(capacity > 0, InvalidArgument, "FlightRecorder capacity must be positive");
}

uint64_t FlightRecorder::enqueue(const std::string& op, const std::string& dtype, int64_t numel,
                                 std::vector<int> peers) {
  FlightEntry entry;
  entry.op = op;
  entry.dtype = dtype;
  entry.numel = numel;
  entry.peers = std::move(peers);
  entry.enqueue_us = now_us();
  std::lock_guard<std::mutex> lock(mutex_);
  entry.sequence = next_sequence_++;
  if (entries_.size() == capacity_) entries_.pop_front();
  entries_.push_back(std::move(entry));
  return entries_.back().sequence;
}

FlightEntry* FlightRecorder::find(uint64_t sequence) {
  LOOM_CHECK(sequence >= 1 && sequence < next_sequence_, InvalidArgument,
             "flight recorder: no op #", sequence, " was enqueued (the last is #",
             next_sequence_ - 1, ")");
  if (entries_.empty() || sequence < entries_.front().sequence) return nullptr;  // dropped
  return &entries_[sequence - entries_.front().sequence];
}

void FlightRecorder::start(uint64_t sequence) {
  int64_t now = now_us();
  std::lock_guard<std::mutex> lock(mutex_);
  if (FlightEntry* entry = find(sequence)) {
    entry->start_us = now;
    entry->state = OpState::kStarted;
  }
}

void FlightRecorder::finish(uint64_t sequence, OpState state) {
  LOOM_CHECK(state == OpState::kCompleted || state == OpState::kFailed, InvalidArgument,
             "flight recorder: op #", sequence, " cannot finish as ", to_string(state),
             "; use completed or failed");
  int64_t now = now_us();
  std::lock_guard<std::mutex> lock(mutex_);
  if (FlightEntry* entry = find(sequence)) {
    entry->end_us = now;
    entry->state = state;
  }
}

std::vector<FlightEntry> FlightRecorder::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {entries_.begin(), entries_.end()};
}

std::string FlightRecorder::to_json(int rank, const std::string& group) const {
  std::vector<FlightEntry> entries = snapshot();
  // One entry per line: readable with less and grep, and still plain JSON.
  std::string out = "{\n";
  out += "  \"version\": " + std::to_string(kDumpVersion) + ",\n";
  out += "  \"rank\": " + std::to_string(rank) + ",\n";
  out += "  \"group\": " + json(group).dump() + ",\n";
  out += "  \"capacity\": " + std::to_string(capacity_) + ",\n";
  out += "  \"dumped_us\": " + std::to_string(now_us()) + ",\n";
  out += "  \"entries\": [";
  for (size_t i = 0; i < entries.size(); ++i) {
    out += (i == 0 ? "\n    " : ",\n    ") + entry_to_json(entries[i]).dump();
  }
  out += entries.empty() ? "]\n}\n" : "\n  ]\n}\n";
  return out;
}

void FlightRecorder::dump(const fs::path& file, int rank, const std::string& group) const {
  if (file.has_parent_path()) {
    std::error_code error;
    fs::create_directories(file.parent_path(), error);
    LOOM_CHECK(!error, IoError, "creating the flight dump directory ", file.parent_path(), ": ",
               error.message());
  }
  util::write_file_atomic(file, to_json(rank, group));
}

fs::path flight_dump_file(const fs::path& dir, int rank) {
  return dir / ("rank_" + std::to_string(rank) + ".json");
}

// ---- Reading dumps ------------------------------------------------------------------------

namespace {

// The rank in a file name rank_<r>.json, or nullopt for any other name.
std::optional<int> rank_of_file_name(const std::string& name) {
  const std::string prefix = "rank_", suffix = ".json";
  if (name.size() <= prefix.size() + suffix.size() || name.compare(0, prefix.size(), prefix) != 0 ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return std::nullopt;
  }
  std::string digits = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (digits.size() > 9 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::nullopt;
  }
  return std::stoi(digits);
}

template <typename T>
T integer(const json& value, const char* key) {
  return util::integer_field<T>(value, key, "");
}

FlightEntry entry_from_json(const json& j) {
  FlightEntry entry;
  entry.sequence = integer<uint64_t>(j.at("sequence"), "sequence");
  entry.op = j.at("op").get<std::string>();
  entry.dtype = j.at("dtype").get<std::string>();
  entry.numel = integer<int64_t>(j.at("numel"), "numel");
  const json& peers = j.at("peers");
  LOOM_CHECK(peers.is_array(), CorruptData, "\"peers\" is not an array");
  for (const json& peer : peers) entry.peers.push_back(integer<int>(peer, "peers"));
  entry.enqueue_us = integer<int64_t>(j.at("enqueue_us"), "enqueue_us");
  entry.start_us = integer<int64_t>(j.at("start_us"), "start_us");
  entry.end_us = integer<int64_t>(j.at("end_us"), "end_us");
  std::string state = j.at("state").get<std::string>();
  std::optional<OpState> parsed = parse_state(state);
  LOOM_CHECK(parsed, CorruptData, "unknown state \"", state,
             "\" (expected enqueued, started, completed or failed)");
  entry.state = *parsed;
  return entry;
}

FlightDump read_dump(const fs::path& file, int rank) {
  FlightDump dump;
  dump.rank = rank;
  dump.file = file;
  std::string text = util::read_file(file);
  std::string where;  // the part being parsed, for the error message
  try {
    json j = json::parse(text);
    int version = integer<int>(j.at("version"), "version");
    LOOM_CHECK(version == kDumpVersion, CorruptData, "format version ", version,
               " is not supported (this build reads version ", kDumpVersion, ")");
    int recorded_rank = integer<int>(j.at("rank"), "rank");
    LOOM_CHECK(recorded_rank == rank, CorruptData, "the dump says rank ", recorded_rank,
               " but the file is named for rank ", rank);
    dump.group = j.at("group").get<std::string>();
    const json& entries = j.at("entries");
    LOOM_CHECK(entries.is_array(), CorruptData, "\"entries\" is not an array");
    for (size_t i = 0; i < entries.size(); ++i) {
      where = "entry " + std::to_string(i) + ": ";
      dump.entries.push_back(entry_from_json(entries[i]));
      uint64_t sequence = dump.entries.back().sequence;
      LOOM_CHECK(sequence >= 1 && (i == 0 || sequence == dump.entries[i - 1].sequence + 1),
                 CorruptData, "sequence ", sequence, " does not follow ",
                 i == 0 ? uint64_t{0} : dump.entries[i - 1].sequence,
                 " (a ring buffer holds consecutive sequence numbers from 1)");
    }
  } catch (const json::exception& e) {
    throw CorruptData(
        detail::concat("malformed flight dump ", file.string(), ": ", where, e.what()));
  } catch (const CorruptData& e) {
    throw CorruptData(
        detail::concat("malformed flight dump ", file.string(), ": ", where, e.what()));
  }
  return dump;
}

}  // namespace

std::vector<FlightDump> read_flight_dumps(const fs::path& dir) {
  std::error_code error;
  LOOM_CHECK(fs::is_directory(dir, error), IoError, "flight dump directory ", dir,
             " does not exist or is not a directory");
  std::vector<FlightDump> dumps;
  for (fs::directory_iterator it(dir, error), end; !error && it != end; it.increment(error)) {
    std::optional<int> rank = rank_of_file_name(it->path().filename().string());
    if (rank) dumps.push_back(read_dump(it->path(), *rank));
  }
  LOOM_CHECK(!error, IoError, "listing flight dump directory ", dir, ": ", error.message());
  LOOM_CHECK(!dumps.empty(), IoError, "no flight dumps (rank_<r>.json) in ", dir);
  std::sort(dumps.begin(), dumps.end(),
            [](const FlightDump& a, const FlightDump& b) { return a.rank < b.rank; });
  for (const FlightDump& dump : dumps) {
    LOOM_CHECK(dump.group == dumps.front().group, InvalidArgument, "the dumps in ", dir,
               " are of different groups: ", dumps.front().file.filename().string(), " of \"",
               dumps.front().group, "\", ", dump.file.filename().string(), " of \"", dump.group,
               "\"; compare one group's dumps at a time");
  }
  return dumps;
}

}  // namespace loom::comm

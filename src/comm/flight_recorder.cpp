// The flight recorder's ring buffer and JSON dump, and the cross-rank comparison of dumps
// behind `loom flight diff`.
#include "loom/comm/flight_recorder.h"

#include <algorithm>
#include <chrono>
#include <map>
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

struct RankDump {
  int rank = 0;
  fs::path file;
  std::string group;
  std::vector<FlightEntry> entries;  // consecutive sequence numbers

  bool empty() const { return entries.empty(); }
  uint64_t first() const { return empty() ? 0 : entries.front().sequence; }
  uint64_t last() const { return empty() ? 0 : entries.back().sequence; }
  bool holds(uint64_t sequence) const {
    return !empty() && sequence >= first() && sequence <= last();
  }
  const FlightEntry& at(uint64_t sequence) const { return entries[sequence - first()]; }
};

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

RankDump read_dump(const fs::path& file, int rank) {
  RankDump dump;
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

std::vector<RankDump> read_dumps(const fs::path& dir) {
  std::error_code error;
  LOOM_CHECK(fs::is_directory(dir, error), IoError, "flight dump directory ", dir,
             " does not exist or is not a directory");
  std::vector<RankDump> dumps;
  for (fs::directory_iterator it(dir, error), end; !error && it != end; it.increment(error)) {
    std::optional<int> rank = rank_of_file_name(it->path().filename().string());
    if (rank) dumps.push_back(read_dump(it->path(), *rank));
  }
  LOOM_CHECK(!error, IoError, "listing flight dump directory ", dir, ": ", error.message());
  LOOM_CHECK(!dumps.empty(), IoError, "no flight dumps (rank_<r>.json) in ", dir);
  std::sort(dumps.begin(), dumps.end(),
            [](const RankDump& a, const RankDump& b) { return a.rank < b.rank; });
  for (const RankDump& dump : dumps) {
    LOOM_CHECK(dump.group == dumps.front().group, InvalidArgument, "the dumps in ", dir,
               " are of different groups: ", dumps.front().file.filename().string(), " of \"",
               dumps.front().group, "\", ", dump.file.filename().string(), " of \"", dump.group,
               "\"; compare one group's dumps at a time");
  }
  return dumps;
}

// ---- Describing ops and ranks ---------------------------------------------------------------

// "0, 2-5, 7" for ascending ranks.
std::string rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += std::to_string(ranks[i]);
    if (j > i) out += (j == i + 1 ? ", " : "-") + std::to_string(ranks[j]);
    i = j + 1;
  }
  return out;
}

// "rank 1" or "ranks 0, 2".
std::string ranks_phrase(const std::vector<int>& ranks) {
  return (ranks.size() == 1 ? "rank " : "ranks ") + rank_list(ranks);
}

std::string join_ints(const std::vector<int>& values) {
  std::string out;
  for (int value : values) out += (out.empty() ? "" : ",") + std::to_string(value);
  return out;
}

// "all_reduce float32[1024]", "broadcast float32[16] root 0", "send int64[4] to 3", "barrier".
std::string describe_op(const FlightEntry& entry) {
  std::string out = entry.op;
  if (!entry.dtype.empty() || entry.numel != 0) {
    out += " " + entry.dtype + "[" + std::to_string(entry.numel) + "]";
  }
  if (entry.peers.empty()) return out;
  const std::string& op = entry.op;
  if (op == "send") return out + " to " + join_ints(entry.peers);
  if (op == "recv") return out + " from " + join_ints(entry.peers);
  if (op == "broadcast" || op == "reduce" || op == "gather" || op == "scatter") {
    return out + " root " + join_ints(entry.peers);
  }
  return out + " peers " + join_ints(entry.peers);
}

// Ranks grouped by a label, in order of each label's first rank.
using Grouped = std::vector<std::pair<std::string, std::vector<int>>>;

void add_to_group(Grouped& groups, const std::string& label, int rank) {
  for (auto& [existing, ranks] : groups) {
    if (existing == label) {
      ranks.push_back(rank);
      return;
    }
  }
  groups.push_back({label, {rank}});
}

// "rank 0: all_reduce float32[1024]; ranks 1, 2: broadcast float32[16] root 0".
std::string describe_groups(const Grouped& groups) {
  std::string out;
  for (const auto& [label, ranks] : groups) {
    out += (out.empty() ? "" : "; ") + ranks_phrase(ranks) + ": " + label;
  }
  return out;
}

// "started", or "rank 0: started; rank 2: enqueued" when the ranks' states differ.
std::string describe_states(const std::vector<const RankDump*>& dumps, uint64_t sequence) {
  Grouped states;
  for (const RankDump* dump : dumps) {
    add_to_group(states, to_string(dump->at(sequence).state), dump->rank);
  }
  return states.size() == 1 ? states.front().first : describe_groups(states);
}

bool is_p2p(const FlightEntry& entry) {
  return (entry.op == "send" || entry.op == "recv") && entry.peers.size() == 1;
}

// A send and a recv match when each names the other and they move the same elements.
bool p2p_consistent(const std::vector<const RankDump*>& dumps, uint64_t sequence) {
  std::map<int, const FlightEntry*> by_rank;
  for (const RankDump* dump : dumps) {
    const FlightEntry& entry = dump->at(sequence);
    if (!is_p2p(entry)) return false;
    by_rank[dump->rank] = &entry;
  }
  for (const auto& [rank, entry] : by_rank) {
    auto peer = by_rank.find(entry->peers[0]);
    if (peer == by_rank.end()) continue;  // no dump from the peer: nothing to check against
    const FlightEntry& other = *peer->second;
    if (other.op == entry->op || other.peers[0] != rank || other.dtype != entry->dtype ||
        other.numel != entry->numel) {
      return false;
    }
  }
  return true;
}

FlightDiff diverged_at(uint64_t sequence, std::string description) {
  FlightDiff diff;
  diff.diverged = true;
  diff.sequence = sequence;
  diff.description = std::move(description);
  return diff;
}

// (a) Different ops at `sequence`, every rank having issued one.
std::optional<FlightDiff> compare_calls(const std::vector<const RankDump*>& dumps,
                                        uint64_t sequence) {
  Grouped calls;
  for (const RankDump* dump : dumps) {
    add_to_group(calls, describe_op(dump->at(sequence)), dump->rank);
  }
  if (calls.size() == 1 || p2p_consistent(dumps, sequence)) return std::nullopt;
  return diverged_at(sequence, "ranks issued different collectives as #" +
                                   std::to_string(sequence) + ": " + describe_groups(calls));
}

enum class Outcome { kInFlight, kFailed, kCompleted };

Outcome outcome_of(OpState state) {
  if (state == OpState::kCompleted) return Outcome::kCompleted;
  if (state == OpState::kFailed) return Outcome::kFailed;
  return Outcome::kInFlight;
}

// (c) The same op at `sequence` everywhere, but completed on some ranks and not on others.
std::optional<FlightDiff> compare_outcomes(const std::vector<const RankDump*>& dumps,
                                           uint64_t sequence) {
  std::map<Outcome, std::vector<const RankDump*>> by_outcome;
  for (const RankDump* dump : dumps) {
    by_outcome[outcome_of(dump->at(sequence).state)].push_back(dump);
  }
  if (by_outcome.size() == 1) return std::nullopt;
  auto ranks_of = [](const std::vector<const RankDump*>& group) {
    std::vector<int> ranks;
    for (const RankDump* dump : group) ranks.push_back(dump->rank);
    return ranks;
  };
  std::string out = "ranks disagree on the outcome of collective #" + std::to_string(sequence) +
                    " (" + describe_op(dumps.front()->at(sequence)) + "): ";
  std::string parts;
  for (const auto& [outcome, group] : by_outcome) {
    std::vector<int> ranks = ranks_of(group);
    bool one = ranks.size() == 1;
    parts += parts.empty() ? "" : "; ";
    if (outcome == Outcome::kInFlight) {
      parts += ranks_phrase(ranks) + (one ? " is" : " are") + " stuck in it (" +
               describe_states(group, sequence) + ")";
    } else {
      parts += ranks_phrase(ranks) + (outcome == Outcome::kFailed ? " failed it" : " completed it");
    }
  }
  return diverged_at(sequence, out + parts);
}

// (b) Some ranks' last op is sequence - 1; the others issued `sequence`.
FlightDiff never_issued(const std::vector<RankDump>& dumps, uint64_t sequence) {
  std::vector<int> missing, issuers;
  std::vector<const RankDump*> holders, missing_dumps;
  Grouped calls;
  for (const RankDump& dump : dumps) {
    if (dump.last() < sequence) {
      missing.push_back(dump.rank);
      missing_dumps.push_back(&dump);
      continue;
    }
    issuers.push_back(dump.rank);
    if (dump.holds(sequence)) {
      holders.push_back(&dump);
      add_to_group(calls, describe_op(dump.at(sequence)), dump.rank);
    }
  }
  std::string what = calls.empty()       ? "no longer in the other ranks' ring buffers"
                     : calls.size() == 1 ? calls.front().first
                                         : "issued differently: " + describe_groups(calls);
  bool one = missing.size() == 1;
  std::string out = ranks_phrase(missing) + " never issued collective #" +
                    std::to_string(sequence) + " (" + what + "); ";
  uint64_t last = sequence - 1;
  if (last == 0) {
    out += one ? "it issued no collective at all" : "they issued no collective at all";
  } else {
    out += std::string(one ? "its" : "their") + " last op was #" + std::to_string(last) + " (" +
           describe_op(missing_dumps.front()->at(last)) + ", " +
           describe_states(missing_dumps, last) + ")";
  }
  out += "; " + ranks_phrase(issuers) + " issued it";
  if (!holders.empty()) out += " (" + describe_states(holders, sequence) + ")";
  return diverged_at(sequence, out);
}

// Nothing differs from `first` to `last`.
FlightDiff agreement(const std::vector<RankDump>& dumps, uint64_t first, uint64_t last,
                     std::optional<uint64_t> first_in_flight) {
  FlightDiff diff;
  diff.sequence = last;
  const RankDump& any = dumps.front();
  if (last == 0) {
    diff.description =
        dumps.size() == 1
            ? "rank " + std::to_string(any.rank) + " (the only dump) issued no collective"
            : "all " + std::to_string(dumps.size()) + " ranks agree: none issued a collective";
    return diff;
  }
  std::string out = dumps.size() == 1
                        ? "only rank " + std::to_string(any.rank) +
                              " has a dump, so there is nothing to compare; it issued up to "
                              "collective #" +
                              std::to_string(last)
                        : "all " + std::to_string(dumps.size()) +
                              " ranks agree up to collective #" + std::to_string(last);
  if (first > 1) {
    out += " (compared #" + std::to_string(first) + "..#" + std::to_string(last) +
           "; older entries were dropped from the ring buffers)";
  }
  std::vector<const RankDump*> all;
  for (const RankDump& dump : dumps) all.push_back(&dump);
  if (first_in_flight) {
    uint64_t s = *first_in_flight;
    out += "; #" + std::to_string(s) + " (" + describe_op(any.at(s)) +
           ") is in flight on every rank (" + describe_states(all, s) + ")";
    if (dumps.size() > 1) {
      out += ", so the ranks are not out of step: suspect a dead or slow peer or the network";
    }
  } else {
    out += "; the last, #" + std::to_string(last) + " (" + describe_op(any.at(last)) + "), " +
           describe_states(all, last) + (dumps.size() > 1 ? " on every rank" : "");
  }
  diff.description = out;
  return diff;
}

// "; no dump from ranks 1, 3, which were not compared" for gaps in the rank numbers.
std::string missing_ranks_note(const std::vector<RankDump>& dumps) {
  std::vector<int> absent;
  for (size_t i = 1; i < dumps.size(); ++i) {
    for (int r = dumps[i - 1].rank + 1; r < dumps[i].rank; ++r) absent.push_back(r);
  }
  for (int r = 0; r < dumps.front().rank; ++r) absent.push_back(r);
  std::sort(absent.begin(), absent.end());
  if (absent.empty()) return "";
  return "; no dump from " + ranks_phrase(absent) +
         (absent.size() == 1 ? ", which was not compared" : ", which were not compared");
}

FlightDiff compare(const std::vector<RankDump>& dumps) {
  uint64_t lo = 1, hi_min = UINT64_MAX, hi_max = 0;
  for (const RankDump& dump : dumps) {
    if (!dump.empty()) lo = std::max(lo, dump.first());
    hi_min = std::min(hi_min, dump.last());
    hi_max = std::max(hi_max, dump.last());
  }
  std::vector<const RankDump*> all;
  for (const RankDump& dump : dumps) all.push_back(&dump);
  std::optional<uint64_t> first_in_flight;
  for (uint64_t s = lo; s <= hi_min; ++s) {
    if (auto diff = compare_calls(all, s)) return *diff;
    if (auto diff = compare_outcomes(all, s)) return *diff;
    if (!first_in_flight && outcome_of(all.front()->at(s).state) == Outcome::kInFlight) {
      first_in_flight = s;
    }
  }
  if (hi_min < hi_max) return never_issued(dumps, hi_min + 1);
  return agreement(dumps, lo, hi_max, first_in_flight);
}

}  // namespace

FlightDiff diff_flight_dumps(const fs::path& dir) {
  std::vector<RankDump> dumps = read_dumps(dir);
  FlightDiff diff = compare(dumps);
  diff.description += missing_ranks_note(dumps);
  diff.group = dumps.front().group;
  for (const RankDump& dump : dumps) diff.ranks.push_back(dump.rank);
  return diff;
}

}  // namespace loom::comm

// `loom flight diff`'s comparison of the ranks' flight-recorder dumps (flight_diff.h).
#include "flight_diff.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <utility>

#include "loom/comm/flight_recorder.h"

namespace loom::cli {

namespace fs = std::filesystem;
using comm::FlightEntry;
using comm::OpState;

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

namespace {

// A rank's dump with its sequence range.
struct RankDump : comm::FlightDump {
  bool empty() const { return entries.empty(); }
  uint64_t first() const { return empty() ? 0 : entries.front().sequence; }
  uint64_t last() const { return empty() ? 0 : entries.back().sequence; }
  bool holds(uint64_t sequence) const {
    return !empty() && sequence >= first() && sequence <= last();
  }
  const FlightEntry& at(uint64_t sequence) const { return entries[sequence - first()]; }
};

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
    add_to_group(states, comm::to_string(dump->at(sequence).state), dump->rank);
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
  std::vector<RankDump> dumps;
  for (comm::FlightDump& dump : comm::read_flight_dumps(dir)) dumps.push_back({std::move(dump)});
  FlightDiff diff = compare(dumps);
  diff.description += missing_ranks_note(dumps);
  diff.group = dumps.front().group;
  for (const RankDump& dump : dumps) diff.ranks.push_back(dump.rank);
  return diff;
}

}  // namespace loom::cli

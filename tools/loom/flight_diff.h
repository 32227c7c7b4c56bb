// The cross-rank comparison behind `loom flight diff`: every rank's flight-recorder dump
// (loom/comm/flight_recorder.h) aligned by sequence number, and the first collective where the
// ranks disagree named. It lives in the tool, not in the library every training process loads.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace loom::cli {

// The verdict of comparing every rank's dump (rank_<r>.json files in one directory).
struct FlightDiff {
  bool diverged = false;
  // The first sequence number where ranks disagree; when they agree, the last one every rank
  // issued (0 when none issued any).
  uint64_t sequence = 0;
  // What differs: the op each rank issued there, the ranks that never issued it, or the ranks
  // stuck in it; when nothing differs, the range that agrees. One line, for a human.
  std::string description;
  std::vector<int> ranks;  // the ranks whose dumps were compared, ascending
  std::string group;       // the group the dumps are of
};

// Reads the dumps with comm::read_flight_dumps (its errors: IoError without dumps, CorruptData
// for a malformed one, InvalidArgument for mixed groups) and compares them. Only the sequence
// range every buffer still holds is compared op by op; a rank whose last op precedes another's
// is reported as never having issued the next one.
FlightDiff diff_flight_dumps(const std::filesystem::path& dir);

// "0, 2-5, 7" for ascending ranks.
std::string rank_list(const std::vector<int>& ranks);

}  // namespace loom::cli

// `loom trace`'s merge of the ranks' traces (<run_dir>/traces/rank_<r>.json, written by
// metrics::StepTracer) into one Chrome trace-event file for Perfetto: each rank a process,
// its spans moved onto rank 0's clock by the offset it measured, every time relative to the
// earliest span. A library of its own so that its tests link it without the tool.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace loom::cli {

struct MergedTrace {
  std::string json;                      // the merged file's text
  std::vector<int> ranks;                // the ranks found, ascending
  size_t spans = 0;                      // "X" events, all ranks
  std::vector<int64_t> steps;            // the traced steps (every rank's, merged)
  double duration_ms = 0;                // first span's start to last span's end
  std::vector<double> clock_offsets_us;  // per rank, as applied
  std::vector<double> clock_uncertainties_us;
  // Each traced step's wall time per rank, in ms (the "step" spans).
  std::map<int64_t, std::map<int, double>> step_ms;
};

// Reads every rank_<r>.json in `dir` (other files are ignored). No such file is IoError naming
// the directory and the config key that makes traces; a file that is not a Loom trace (bad
// JSON, another format, a "rank" that does not match its name, a span without its fields) is
// CorruptData naming it.
MergedTrace merge_traces(const std::filesystem::path& dir);

}  // namespace loom::cli

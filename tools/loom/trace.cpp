// `loom trace RUN_DIR`: merges the ranks' traces of a run (metrics.trace_steps) into one
// Chrome trace-event file for Perfetto, clocks aligned, and prints each traced step's time per
// rank (trace_merge.h).
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>

#include "commands.h"
#include "loom/error.h"
#include "trace_merge.h"
#include "util/files.h"

namespace loom::cli {
namespace {

namespace fs = std::filesystem;

struct TraceArgs {
  std::string dir;
  std::string output;
};

int run_trace(const TraceArgs& args) {
  try {
    const fs::path dir = fs::is_directory(fs::path(args.dir) / "traces")
                             ? fs::path(args.dir) / "traces"
                             : fs::path(args.dir);
    const MergedTrace merged = merge_traces(dir);
    const fs::path output = args.output.empty() ? dir / "job.json" : fs::path(args.output);
    util::write_file_atomic(output, merged.json);
    std::printf("merged %zu rank%s, %zu spans over %.1f ms into %s\n", merged.ranks.size(),
                merged.ranks.size() == 1 ? "" : "s", merged.spans, merged.duration_ms,
                output.c_str());
    for (size_t i = 0; i < merged.ranks.size(); ++i) {
      if (merged.ranks[i] == 0) continue;
      std::printf("  rank %d's clock: %+.1f us to rank 0's (within %.1f us)\n", merged.ranks[i],
                  merged.clock_offsets_us[i], merged.clock_uncertainties_us[i]);
    }
    if (!merged.step_ms.empty()) {
      std::printf("\n%-8s", "step");
      for (int r : merged.ranks) std::printf("%12s", ("rank " + std::to_string(r)).c_str());
      std::printf("   (step time, ms)\n");
      for (const auto& [step, per_rank] : merged.step_ms) {
        std::printf("%-8lld", static_cast<long long>(step));
        for (int r : merged.ranks) {
          const auto it = per_rank.find(r);
          if (it == per_rank.end()) {
            std::printf("%12s", "-");
          } else {
            std::printf("%12.2f", it->second);
          }
        }
        std::printf("\n");
      }
    }
    std::printf(
        "\nOpen it at https://ui.perfetto.dev (\"Open trace file\") or chrome://tracing.\n");
    return kExitOk;
  } catch (const Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return kExitBadInput;
  }
}

}  // namespace

void register_trace(CLI::App& app, Action& action) {
  auto args = std::make_shared<TraceArgs>();
  CLI::App* cmd = app.add_subcommand(
      "trace", "Merge a run's per-rank traces (metrics.trace_steps) into one Perfetto file.");
  cmd->footer(
      "Each rank writes <run_dir>/traces/rank_<r>.json for the steps named by\n"
      "metrics.trace_steps (e.g. --metrics.trace_steps=10-12): the step's phases, forward and\n"
      "backward, every collective (op, group, sequence number, bytes), checkpoint copy, write\n"
      "and commit, each on the thread that did it. The merge puts every rank on rank 0's\n"
      "clock (offsets measured through the store at start-up) and prints each step's time\n"
      "per rank.\n\n"
      "Example: loom trace runs/gpt  ->  runs/gpt/traces/job.json");
  cmd->add_option("run_dir", args->dir, "the run directory (or its traces/ directory)")->required();
  cmd->add_option("-o,--output", args->output,
                  "where to write the merged trace (default <run_dir>/traces/job.json)");
  cmd->callback([args, &action] { action = [args] { return run_trace(*args); }; });
}

}  // namespace loom::cli

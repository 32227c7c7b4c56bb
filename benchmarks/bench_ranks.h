// A benchmark's worker processes, one per rank (bench_comm, bench_train): rank 0's output
// inherited, the others' appended to dir/rank_<r>.log. Uses Loom's private util/subprocess.h.
#pragma once

#include <chrono>
#include <filesystem>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "loom/error.h"
#include "util/subprocess.h"

namespace loom::bench {

// Runs `ranks` processes, rank r's command line argv_for(r), and returns whether all of them
// succeeded, having named each one that did not on stderr as `bench`. A rank that fails
// leaves the others in a collective: they get a minute, not their own deadline.
inline bool run_worker_ranks(const char* bench, int ranks, const std::filesystem::path& dir,
                             const std::function<std::vector<std::string>(int rank)>& argv_for) {
  const auto statuses =
      util::run_rank_processes(ranks,
                               [&](int r) {
                                 util::SubprocessOptions options{.argv = argv_for(r)};
                                 if (r != 0)
                                   options.output = dir / detail::concat("rank_", r, ".log");
                                 return options;
                               },
                               {.after_failure = std::chrono::minutes(1)});
  bool ok = true;
  for (int r = 0; r < ranks; ++r) {
    if (statuses[r] && statuses[r]->ok()) continue;
    std::cerr << bench << ": rank " << r << " "
              << (statuses[r] ? statuses[r]->describe() : "was killed after another failed")
              << std::endl;
    ok = false;
  }
  return ok;
}

}  // namespace loom::bench

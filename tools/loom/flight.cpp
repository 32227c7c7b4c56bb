// `loom flight diff <dir>`: compares every rank's flight-recorder dump and names the first
// collective where the ranks diverged.
#include <iostream>
#include <memory>
#include <string>

#include "commands.h"
#include "flight_diff.h"
#include "loom/error.h"

namespace loom::cli {
namespace {

struct DiffArgs {
  std::string dir;
};

int run_diff(const DiffArgs& args) {
  FlightDiff diff;
  try {
    diff = diff_flight_dumps(args.dir);
  } catch (const Error& e) {  // a missing directory, a malformed dump, mixed groups
    std::cerr << "error: " << e.what() << "\n";
    return kExitBadInput;
  }
  std::cout << "compared " << diff.ranks.size() << " flight dump"
            << (diff.ranks.size() == 1 ? "" : "s") << " of group \"" << diff.group << "\" (ranks "
            << rank_list(diff.ranks) << ") in " << args.dir << "\n";
  if (!diff.diverged) {
    std::cout << "no divergence: " << diff.description << "\n";
    return kExitOk;
  }
  std::cout << "DIVERGED: " << diff.description << "\n";
  return kExitFailed;
}

}  // namespace

void register_flight(CLI::App& app, Action& action) {
  CLI::App* flight = app.add_subcommand(
      "flight", "Read the collectives' flight-recorder dumps to find why a job hung.");
  flight->require_subcommand(1);
  flight->footer(
      "On a collective timeout every rank writes its last collectives to\n"
      "<run_dir>/flight/rank_<r>.json; see docs/flight-recorder.md.");

  auto args = std::make_shared<DiffArgs>();
  CLI::App* diff =
      flight->add_subcommand("diff", "Name the first collective where the ranks' dumps disagree.");
  diff->add_option("dir", args->dir, "the directory of dumps, usually <run_dir>/flight")
      ->required();
  diff->footer(
      "Reads every rank_<r>.json in <dir>, aligns the ranks' collectives by sequence number\n"
      "and reports the first one where they disagree: ranks that issued different ops (or\n"
      "dtypes, sizes, roots), ranks that never issued it, or ranks stuck in it while others\n"
      "completed it. Only the sequence range every ring buffer still holds is compared.\n\n"
      "Exit codes: 0 the ranks agree, 1 they diverged, 2 no dumps or a malformed dump.");
  diff->callback([args, &action] { action = [args] { return run_diff(*args); }; });
}

}  // namespace loom::cli

// `loom top ADDRESS|RUN_DIR`: the live job view in a terminal, from the coordinator's metrics
// endpoint (`loom run --metrics-address`), or a run's saved view: the job, every rank's step
// breakdown, the stragglers, a hang.
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <thread>

#include "commands.h"
#include "loom/data/remote.h"
#include "loom/error.h"
#include "top_view.h"
#include "util/files.h"

namespace loom::cli {
namespace {

struct TopArgs {
  std::string address;
  bool once = false;
  double interval_s = 1;
};

// A run directory's <run_dir>/job_metrics.json, which `loom run` saves on the node hosting
// the coordinator every 5 s and at the end: the view of a finished (or running) job, once.
int show_run_dir(const std::filesystem::path& dir) {
  const std::filesystem::path file = dir / "job_metrics.json";
  try {
    LOOM_CHECK(std::filesystem::exists(file), IoError, "no job_metrics.json in ", dir.string(),
               ": `loom run` writes it there on the node hosting the coordinator (its --run-dir)");
    std::cout << render_top(util::read_file(file));
    return kExitOk;
  } catch (const Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return kExitBadInput;
  }
}

int run_top(const TopArgs& args) {
  if (std::filesystem::is_directory(args.address)) return show_run_dir(args.address);
  data::RemoteOptions remote;
  remote.attempts = 1;
  remote.connect_timeout_s = 2;
  remote.stall_timeout_s = 5;
  if (const char* token = std::getenv("LOOM_JOB_TOKEN"); token != nullptr && *token != 0)
    remote.headers.push_back(std::string("Authorization: Bearer ") + token);
  data::RemoteClient client(remote);
  const std::string url =
      (args.address.rfind("http", 0) == 0 ? "" : "http://") + args.address + "/api/metrics";
  const bool tty = ::isatty(STDOUT_FILENO) == 1;
  for (;;) {
    std::string view;
    try {
      view = render_top(client.get(url));
    } catch (const Error& e) {
      if (args.once) {
        std::cerr << "error: " << e.what()
                  << "\n(is the job running, started with `loom run --metrics-address "
                  << args.address << "`?)\n";
        return kExitFailed;
      }
      view = std::string("cannot read ") + url + ": " + e.what() + " (retrying)\n";
    }
    if (tty && !args.once) std::cout << "\x1b[H\x1b[2J";  // home, clear: redraw in place
    std::cout << view << std::flush;
    if (args.once) return kExitOk;
    std::this_thread::sleep_for(std::chrono::duration<double>(args.interval_s));
  }
}

}  // namespace

void register_top(CLI::App& app, Action& action) {
  auto args = std::make_shared<TopArgs>();
  CLI::App* top = app.add_subcommand(
      "top", "Watch a running job: throughput, each rank's step breakdown, stragglers.");
  top->add_option("address", args->address,
                  "host:port of the job's metrics endpoint (loom run --metrics-address), or a "
                  "run directory (its job_metrics.json, printed once)")
      ->required();
  top->add_flag("--once", args->once, "print the view once and exit (for scripts)");
  top->add_option("--interval", args->interval_s, "seconds between redraws")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  top->footer(
      "A job started with `loom run --metrics-address 127.0.0.1:9400 ...` is watched with\n"
      "`loom top 127.0.0.1:9400`; after the job, `loom top RUN_DIR` shows the view saved at\n"
      "its end. An endpoint beyond loopback needs the job token: set\n"
      "LOOM_JOB_TOKEN. Columns are means per step over each rank's newest heartbeat (about a\n"
      "second); busy_s is the step outside collective waits. docs/observability.md.");
  top->callback([args, &action] { action = [args] { return run_top(*args); }; });
}

}  // namespace loom::cli

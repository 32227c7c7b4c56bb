// `loom dash RUN_DIR`: the job dashboard of a run directory, after the job (or while it runs,
// from the view `loom run` saves every 5 s): the same page the coordinator serves at its
// metrics address, read from <run_dir>/job_metrics.json, with links to the run's traces and
// flight dumps (control/dashboard.h).
#include <httplib.h>

#include <filesystem>
#include <iostream>
#include <memory>
#include <string>

#include "commands.h"
#include "control/dashboard.h"
#include "http_serve.h"
#include "loom/error.h"
#include "util/files.h"

namespace loom::cli {
namespace {

namespace fs = std::filesystem;

struct DashArgs {
  std::string run_dir;
  std::string address = "127.0.0.1:8470";
  bool public_address = false;
};

int run_dash(const DashArgs& args) {
  try {
    const fs::path dir = args.run_dir;
    LOOM_CHECK(fs::is_directory(dir), IoError, "no run directory ", dir.string());
    LOOM_CHECK(fs::exists(dir / "job_metrics.json"), IoError, "no job_metrics.json in ",
               dir.string(),
               ": `loom run` writes it there on the node hosting the coordinator (its --run-dir)");
    httplib::Server server;
    control::add_dashboard_routes(
        server, {.metrics_json = [dir] { return util::read_file(dir / "job_metrics.json"); },
                 .run_dir = dir});
    serve_until_stopped(server, args.address, args.public_address, "the dashboard",
                        "dashboard of " + dir.string());
    return kExitOk;
  } catch (const Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return kExitBadInput;
  }
}

}  // namespace

void register_dash(CLI::App& app, Action& action) {
  auto args = std::make_shared<DashArgs>();
  CLI::App* cmd =
      app.add_subcommand("dash", "Serve the job dashboard of a run directory in a browser.");
  cmd->footer(
      "The dashboard shows tokens/s, MFU, step time, memory and goodput over time per rank, "
      "with\nrestarts marked; where each rank's step goes; the stragglers; and links to the "
      "run's\ntraces (loom trace) and flight dumps. A running job's dashboard is served by "
      "its\ncoordinator at `loom run --metrics-address`; this serves a run directory's saved "
      "view\n(<run_dir>/job_metrics.json), during the job or after it.\n\n"
      "Example: loom dash runs/gpt   then open http://127.0.0.1:8470/");
  cmd->add_option("run_dir", args->run_dir, "the run directory (loom run --run-dir)")->required();
  cmd->add_option("--address", args->address, "host:port to listen on (port 0: any free port)")
      ->capture_default_str();
  cmd->add_flag("--public", args->public_address,
                "allow an address beyond loopback; requests must then carry the token in "
                "LOOM_JOB_TOKEN as 'Authorization: Bearer <token>'");
  cmd->callback([args, &action] { action = [args] { return run_dash(*args); }; });
}

}  // namespace loom::cli

// `loom dash RUN_DIR`: the job dashboard of a run directory, after the job (or while it runs,
// from the view `loom run` saves every 5 s): the same page the coordinator serves at its
// metrics address, read from <run_dir>/job_metrics.json, with links to the run's traces and
// flight dumps (control/dashboard.h).
#include <httplib.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <thread>

#include "commands.h"
#include "control/dashboard.h"
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

volatile std::sig_atomic_t g_stop = 0;
void on_stop_signal(int) { g_stop = 1; }

bool loopback_host(const std::string& host) {
  return host == "127.0.0.1" || host == "localhost" || host == "::1" || host == "[::1]";
}

int run_dash(const DashArgs& args) {
  try {
    const fs::path dir = args.run_dir;
    LOOM_CHECK(fs::is_directory(dir), IoError, "no run directory ", dir.string());
    LOOM_CHECK(fs::exists(dir / "job_metrics.json"), IoError, "no job_metrics.json in ",
               dir.string(),
               ": `loom run` writes it there on the node hosting the coordinator (its --run-dir)");
    const size_t colon = args.address.rfind(':');
    LOOM_CHECK(colon != std::string::npos && colon > 0, InvalidArgument,
               "--address must be host:port, got '", args.address, "'");
    std::string host = args.address.substr(0, colon);
    int port = -1;
    try {
      port = std::stoi(args.address.substr(colon + 1));
    } catch (const std::exception&) {
    }
    LOOM_CHECK(port >= 0 && port <= 65535, InvalidArgument,
               "--address must be host:port with a port in [0, 65535], got '", args.address, "'");
    const char* token = std::getenv("LOOM_JOB_TOKEN");
    const bool loopback = loopback_host(host);
    if (!loopback) {
      LOOM_CHECK(args.public_address && token != nullptr && *token != 0, InvalidArgument,
                 "the dashboard would listen on ", args.address,
                 ", beyond loopback: that needs --public and a token in LOOM_JOB_TOKEN, which "
                 "the browser then sends as 'Authorization: Bearer <token>'");
    }
    if (host.size() > 2 && host.front() == '[') host = host.substr(1, host.size() - 2);

    httplib::Server server;
    if (!loopback) {
      const std::string expected = std::string("Bearer ") + token;
      server.set_pre_routing_handler(
          [expected](const httplib::Request& req, httplib::Response& res) {
            if (req.get_header_value("Authorization") == expected) {
              return httplib::Server::HandlerResponse::Unhandled;
            }
            res.status = 401;
            res.set_content("wrong or missing token (Authorization: Bearer <LOOM_JOB_TOKEN>)\n",
                            "text/plain");
            return httplib::Server::HandlerResponse::Handled;
          });
    }
    control::add_dashboard_routes(
        server, {.metrics_json = [dir] { return util::read_file(dir / "job_metrics.json"); },
                 .run_dir = dir});
    const int bound =
        port == 0 ? server.bind_to_any_port(host) : (server.bind_to_port(host, port) ? port : -1);
    LOOM_CHECK(bound > 0, IoError, "cannot listen on ", args.address,
               " (address in use or not local?)");
    // SIGINT and SIGTERM set a flag; a thread of its own stops the server (not the handler).
    std::signal(SIGINT, on_stop_signal);
    std::signal(SIGTERM, on_stop_signal);
    std::thread stopper([&server] {
      while (g_stop == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      server.stop();
    });
    std::cout << "dashboard of " << dir.string() << " at http://"
              << args.address.substr(0, colon + 1) << bound << "/ (Ctrl-C stops it)" << std::endl;
    server.listen_after_bind();
    stopper.join();
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

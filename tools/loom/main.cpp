// The `loom` command-line tool: builds the app, lets each subcommand register itself, parses
// the command line and runs the selected subcommand's action.
#include <exception>
#include <iostream>
#include <string>

#include "commands.h"
#include "loom/error.h"
#include "loom/version.h"

namespace {

// "loom flight diff": the subcommands the command line selected, for the usage hint.
std::string command_path(const CLI::App& app) {
  std::string path = app.get_name();
  for (const CLI::App* current = &app; !current->get_subcommands().empty();) {
    current = current->get_subcommands().front();
    path += " " + current->get_name();
  }
  return path;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"loom: tools for Loom distributed-training runs.", "loom"};
  app.set_version_flag("--version", std::string("loom ") + loom::version());
  app.require_subcommand(1);
  app.footer(
      "Exit codes: 0 success, 1 the command found a problem (or failed), 2 bad arguments or "
      "unreadable input.\nRun 'loom <command> --help' for a command's usage.");

  loom::cli::Action action;
  loom::cli::register_run(app, action);
  loom::cli::register_data(app, action);
  loom::cli::register_service(app, action);
  loom::cli::register_flight(app, action);
  loom::cli::register_ckpt(app, action);
  loom::cli::register_top(app, action);
  loom::cli::register_trace(app, action);
  loom::cli::register_dash(app, action);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    std::cerr << "error: " << e.what() << "\nRun '" << command_path(app) << " --help' for usage.\n";
    return loom::cli::kExitBadInput;
  }
  try {
    return action ? action() : loom::cli::kExitBadInput;
  } catch (const loom::InvalidArgument& e) {
    std::cerr << "error: " << e.what() << "\n";
    return loom::cli::kExitBadInput;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return loom::cli::kExitFailed;
  }
}

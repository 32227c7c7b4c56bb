// The `loom` tool's subcommands. Each lives in its own file and registers itself on the app;
// main.cpp parses the command line and runs the action the parsed subcommand selected.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace loom::cli {

// The exit codes every subcommand follows.
inline constexpr int kExitOk = 0;      // success; for a check, "nothing wrong found"
inline constexpr int kExitFailed = 1;  // the command ran and found a problem, or failed
inline constexpr int kExitBadInput =
    2;  // bad arguments or unreadable input ("error: ..." on stderr)

// What the parsed command line asked for; main runs it after parsing and exits with its code.
using Action = std::function<int()>;

// `loom data build|verify|show`: datasets (data.cpp, data_build.cpp).
void register_data(CLI::App& app, Action& action);

// `loom run`: the launcher (run.cpp), present when built with gRPC.
void register_run(CLI::App& app, Action& action);

// `loom service start|ls|logs|stop`: long-lived services (service.cpp).
void register_service(CLI::App& app, Action& action);

// `loom flight ...`: read the collectives' flight-recorder dumps (flight.cpp).
void register_flight(CLI::App& app, Action& action);

// `loom top ADDRESS`: the live view of a job's metrics endpoint (top.cpp, top_view.cpp).
void register_top(CLI::App& app, Action& action);

// `loom dash RUN_DIR`: the job dashboard of a run directory (dash.cpp).
void register_dash(CLI::App& app, Action& action);

// `loom trace RUN_DIR`: merge the ranks' traces into one Perfetto file (trace.cpp).
void register_trace(CLI::App& app, Action& action);

// `loom ckpt ls|verify|show`: list, verify and inspect checkpoints (ckpt.cpp).
void register_ckpt(CLI::App& app, Action& action);

}  // namespace loom::cli

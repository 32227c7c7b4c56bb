// `loom data service`: serves datasets' batches to trainers (loom/data/service.h).
#include <CLI/CLI.hpp>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <thread>

#include "data_commands.h"
#include "loom/data/service.h"

namespace loom::cli {
namespace {

volatile std::sig_atomic_t g_stop = 0;
void on_stop_signal(int) { g_stop = 1; }

struct ServiceArgs {
  std::string host = "0.0.0.0";
  int port = 7100;
  int readers_per_client = 4;
  int max_readers = 256;
};

int run_service(const ServiceArgs& args) {
  const char* token = std::getenv("LOOM_JOB_TOKEN");
  data::DataServer server({.address = args.host + ":" + std::to_string(args.port),
                           .token = token != nullptr ? token : "",
                           .readers_per_client = args.readers_per_client,
                           .max_readers = args.max_readers});
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGTERM, on_stop_signal);
  std::cout << "loom data service: serving at " << server.address()
            << (token != nullptr ? " (job token required)" : "") << " (Ctrl-C stops it)"
            << std::endl;
  auto last = std::chrono::steady_clock::now();
  data::DataServerStats said;
  const auto report = [&server, &said] {
    const data::DataServerStats s = server.stats();
    if (s.batches == said.batches && s.readers == said.readers) return;
    std::cout << "loom data service: " << s.batches << " batches (" << s.bytes / 1e6 << " MB) from "
              << s.readers << " reader(s), " << s.restores << " restore(s)" << std::endl;
    said = s;
  };
  while (g_stop == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (std::chrono::steady_clock::now() - last > std::chrono::seconds(30)) {
      report();
      last = std::chrono::steady_clock::now();
    }
  }
  server.shutdown();
  report();
  std::cout << "loom data service: stopped" << std::endl;
  return 0;
}

}  // namespace

void register_data_service(CLI::App& data, Action& action) {
  auto args = std::make_shared<ServiceArgs>();
  CLI::App* s = data.add_subcommand(
      "service", "Serve datasets' batches to trainers (read, decoded and collated here).");
  s->add_option("--host", args->host, "address to listen on")->capture_default_str();
  s->add_option("--port", args->port, "port to listen on (0: any free port)")
      ->capture_default_str();
  s->add_option("--readers-per-client", args->readers_per_client,
                "readers of one (dataset, options, rank): its requests read at once")
      ->capture_default_str();
  s->add_option("--max-readers", args->max_readers,
                "readers kept open in all; the least recently used idle ones are closed")
      ->capture_default_str();
  s->footer(
      "A trainer asks for the batch after a position of a dataset read with given options\n"
      "(data::ServiceReader; Runtime::open_data_service; data.service in the GPT example), and\n"
      "gets the batch a data::Reader with those options would give, bit for bit. Any replica\n"
      "answers the same, so a trainer moves to another replica when one fails, and resumes\n"
      "exactly after a restart. Every request must carry $LOOM_JOB_TOKEN when it is set.\n"
      "In a job spec (docs/launcher.md):\n"
      "  [group.data]\n"
      "  command = [\"loom\", \"data\", \"service\", \"--port\", \"{port}\"]\n"
      "  placement = \"spread\"\n"
      "  replicas = 2\n"
      "  health = { tcp = 7100 }");
  s->callback([args, &action] { action = [args] { return run_service(*args); }; });
}

}  // namespace loom::cli

// Built with LOOM_WITH_GRPC=OFF: `loom run` explains why it is missing.
#include <iostream>

#include "commands.h"

namespace loom::cli {

void register_run(CLI::App& app, Action& action) {
  CLI::App* run =
      app.add_subcommand("run", "Launch a training program (needs the gRPC control plane).");
  run->allow_extras();
  run->callback([&action] {
    action = [] {
      std::cerr
          << "error: this loom was built without the gRPC control plane (LOOM_WITH_GRPC=OFF)\n";
      return kExitBadInput;
    };
  });
}

}  // namespace loom::cli

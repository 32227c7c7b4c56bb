// The parts of `loom data` that live in their own files.
#pragma once

#include "commands.h"

namespace loom::cli {

// `loom data build text|fashion-mnist|jsonl` (data_build.cpp), added under `data`.
void register_data_build(CLI::App& data, Action& action);

// `loom data register|ls|info|tag|diff|migrate` (data_registry.cpp), added under `data`.
void register_data_registry(CLI::App& data, Action& action);

}  // namespace loom::cli

// Logging: one spdlog logger per Runtime, every line tagged with the rank.
//
//   [2026-12-02 14:40:01.123] [rank 1/4] [info] step 100 loss 2.31
//
// The level comes from the config key log.level (env LOOM_LOG_LEVEL, --log.level=debug):
// trace, debug, info, warn, error, off. Loggers are spdlog loggers and so thread-safe.
#pragma once

#include <spdlog/spdlog.h>

#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "loom/visibility.h"

namespace loom::log {

// "info" -> spdlog::level::info. An unknown name is InvalidArgument listing the valid ones.
LOOM_API spdlog::level::level_enum parse_level(const std::string& name);

// A logger writing to stderr (and to `file` when given, appending), tagged "rank r/w".
LOOM_API std::shared_ptr<spdlog::logger> make_logger(
    int rank, int world_size, const std::string& level,
    const std::optional<std::filesystem::path>& file);

}  // namespace loom::log

// Per-Runtime spdlog loggers tagged with the rank.
#include "loom/log.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <vector>

#include "loom/error.h"
#include "util/files.h"

namespace loom::log {

spdlog::level::level_enum parse_level(const std::string& name) {
  static const std::pair<const char*, spdlog::level::level_enum> kLevels[] = {
      {"trace", spdlog::level::trace}, {"debug", spdlog::level::debug},
      {"info", spdlog::level::info},   {"warn", spdlog::level::warn},
      {"error", spdlog::level::err},   {"off", spdlog::level::off}};
  for (const auto& [level_name, level] : kLevels) {
    if (name == level_name) return level;
  }
  throw InvalidArgument(detail::concat("unknown log level '", name,
                                       "': use one of trace, debug, info, warn, error, off"));
}

std::shared_ptr<spdlog::logger> make_logger(int rank, int world_size, const std::string& level,
                                            const std::optional<std::filesystem::path>& file) {
  std::vector<spdlog::sink_ptr> sinks;
  sinks.push_back(std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
  if (file) {
    util::create_directories(file->parent_path(), "the log directory",
                             "make it writable or set log.to_file = false");
    try {
      sinks.push_back(std::make_shared<spdlog::sinks::basic_file_sink_mt>(file->string()));
    } catch (const spdlog::spdlog_ex& e) {
      throw IoError(detail::concat("cannot open the log file ", file->string(), ": ", e.what(),
                                   "; make it writable or set log.to_file = false"));
    }
  }
  auto logger = std::make_shared<spdlog::logger>(detail::concat("loom.rank", rank), sinks.begin(),
                                                 sinks.end());
  logger->set_pattern(
      detail::concat("[%Y-%m-%d %H:%M:%S.%e] [rank ", rank, "/", world_size, "] [%^%l%$] %v"));
  logger->set_level(parse_level(level));
  logger->flush_on(spdlog::level::warn);
  return logger;
}

}  // namespace loom::log

// Logging: level names, rank tags, file output.
#include "loom/log.h"

#include <gtest/gtest.h>

#include "harness/harness.h"
#include "loom/error.h"
#include "util/files.h"

namespace loom::log {
namespace {

TEST(Log, ParsesLevels) {
  EXPECT_EQ(parse_level("debug"), spdlog::level::debug);
  EXPECT_EQ(parse_level("error"), spdlog::level::err);
  EXPECT_THROW(parse_level("loud"), InvalidArgument);
}

TEST(Log, TagsEveryLineWithRankAndHonoursLevel) {
  testing::TempDir dir;
  auto logger = make_logger(2, 4, "info", dir / "rank_2.log");
  logger->debug("hidden");
  logger->info("shown {}", 42);
  logger->flush();
  std::string text = util::read_file(dir / "rank_2.log");
  EXPECT_NE(text.find("[rank 2/4]"), std::string::npos) << text;
  EXPECT_NE(text.find("shown 42"), std::string::npos) << text;
  EXPECT_EQ(text.find("hidden"), std::string::npos) << text;
}

}  // namespace
}  // namespace loom::log

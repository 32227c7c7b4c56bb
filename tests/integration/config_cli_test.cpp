// A real program's exit codes and messages for each kind of configuration error.
#include <gtest/gtest.h>

#include <fstream>

#include "harness/harness.h"

namespace loom {
namespace {

testing::ProgramResult run_probe(const testing::TempDir& dir, std::vector<std::string> args) {
  std::vector<std::string> argv = {LOOM_BINARY_DIR "/tests/loom_config_probe",
                                   "--run.dir=" + (dir / "run").string(), "--log.to_file=false"};
  argv.insert(argv.end(), args.begin(), args.end());
  return testing::run_program(argv, dir.path());
}

void write(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path) << text;
}

TEST(ConfigCli, ValidFileAndOverrideRun) {
  testing::TempDir dir;
  write(dir / "ok.toml", "[train]\nsteps = 20\nlr = 0.5\n");
  testing::ProgramResult run =
      run_probe(dir, {"--config=" + (dir / "ok.toml").string(), "--train.steps=30"});
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("steps=30 lr=0.5"), std::string::npos) << run.output;
}

TEST(ConfigCli, UnknownKeyNamesNearestKey) {
  testing::TempDir dir;
  testing::ProgramResult run = run_probe(dir, {"--train.stpes=3"});
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_NE(run.output.find("train.stpes"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("train.steps"), std::string::npos) << run.output;
}

TEST(ConfigCli, BadTypeNamesKeyAndTypes) {
  testing::TempDir dir;
  write(dir / "bad.toml", "[train]\nsteps = \"ten\"\n");
  testing::ProgramResult run = run_probe(dir, {"--config=" + (dir / "bad.toml").string()});
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_NE(run.output.find("train.steps"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("integer"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("string"), std::string::npos) << run.output;
}

TEST(ConfigCli, MissingFileIsNamed) {
  testing::TempDir dir;
  testing::ProgramResult run = run_probe(dir, {"--config=" + (dir / "nope.toml").string()});
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_NE(run.output.find("nope.toml"), std::string::npos) << run.output;
}

TEST(ConfigCli, MalformedTomlGivesLine) {
  testing::TempDir dir;
  write(dir / "broken.toml", "[train]\nsteps = 3\nlr = = 2\n");
  testing::ProgramResult run = run_probe(dir, {"--config=" + (dir / "broken.toml").string()});
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_NE(run.output.find("broken.toml:3"), std::string::npos) << run.output;
}

TEST(ConfigCli, HelpListsKeysAndExitsZero) {
  testing::TempDir dir;
  testing::ProgramResult run = run_probe(dir, {"--help"});
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("--train.lr"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("--run.dir"), std::string::npos) << run.output;
}

}  // namespace
}  // namespace loom

// Atomic durable writes and whole-file reads.
#include "util/files.h"

#include <gtest/gtest.h>

#include "harness/harness.h"
#include "loom/error.h"

namespace loom::util {
namespace {

TEST(Files, AtomicWriteReplacesAndLeavesNoTemporaries) {
  testing::TempDir dir;
  write_file_atomic(dir / "a.json", "first");
  write_file_atomic(dir / "a.json", std::string("second\0with nul", 15));
  EXPECT_EQ(read_file(dir / "a.json"), std::string("second\0with nul", 15));
  int files = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir.path()))
    ++files;
  EXPECT_EQ(files, 1);
}

TEST(Files, ErrorsNameThePath) {
  testing::TempDir dir;
  try {
    read_file(dir / "missing.txt");
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("missing.txt"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("No such file"), std::string::npos) << e.what();
  }
  EXPECT_THROW(write_file_atomic(dir / "no" / "such" / "dir.txt", "x"), IoError);
}

}  // namespace
}  // namespace loom::util

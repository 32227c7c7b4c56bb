// Tokenizer vocabularies as untrusted input: malformed lines, an empty file, a size that
// disagrees with the dataset, out-of-range ids. Each error names the file (and the line).
#include "loom/data/vocabulary.h"

#include <gtest/gtest.h>

#include <fstream>

#include "harness/harness.h"
#include "loom/data/dataset.h"
#include "loom/error.h"

namespace loom::data {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::TempDir;

void write(const fs::path& file, const std::string& text) {
  std::ofstream(file, std::ios::binary) << text;
}

TEST(Vocabulary, MalformedFilesAreCorruptDataNamingFileAndLine) {
  TempDir dir;
  write(dir / "good.vocab", "<unk>\t0\n\xe2\x96\x81the\t-1.5\n");
  const Vocabulary v = Vocabulary::load(dir / "good.vocab");
  EXPECT_EQ(v.size(), 2u);
  EXPECT_EQ(v.text(1), " the");

  write(dir / "bad.vocab", "<unk>\t0\nno tab here\n");
  std::string message = error_of<CorruptData>([&] { Vocabulary::load(dir / "bad.vocab"); });
  EXPECT_NE(message.find((dir / "bad.vocab").string() + ":2:"), std::string::npos) << message;
  write(dir / "empty_piece.vocab", "\t0\n");
  message = error_of<CorruptData>([&] { Vocabulary::load(dir / "empty_piece.vocab"); });
  EXPECT_NE(message.find(":1:"), std::string::npos) << message;
  write(dir / "empty.vocab", "");
  message = error_of<CorruptData>([&] { Vocabulary::load(dir / "empty.vocab"); });
  EXPECT_NE(message.find("holds no pieces"), std::string::npos) << message;
  message = error_of<IoError>([&] { Vocabulary::load(dir / "missing.vocab"); });
  EXPECT_NE(message.find("missing.vocab"), std::string::npos) << message;

  EXPECT_THROW(v.piece(2), InvalidArgument);
  EXPECT_THROW(v.piece(-1), InvalidArgument);
  EXPECT_THROW(v.decode({0, 1 << 30}), InvalidArgument);
}

TEST(Vocabulary, ADatasetsVocabularyMustHaveItsVocabSize) {
  TempDir dir;
  const fs::path ds = dir / "ds";
  {
    TokenDatasetWriter writer(ds, {.vocab_size = 100, .tokenizer = "tokenizer.vocab"});
    writer.add_document({1, 2, 3});
    // The tokenizer files are in the directory before finish(), which hashes them.
    write(ds / "tokenizer.vocab", "a\t0\nb\t0\nc\t0\n");
    writer.finish();
  }
  const std::string message = error_of<CorruptData>([&] { Vocabulary::of_dataset(ds); });
  EXPECT_NE(message.find("holds 3 pieces but the dataset's vocab_size is 100"), std::string::npos)
      << message;
}

}  // namespace
}  // namespace loom::data

// The vocabulary of a token dataset: the text piece of every token id, for showing samples
// and generated text. `loom data build text` writes it as tokenizer.vocab (one
// "piece<TAB>score" line per id, the format of SentencePiece's spm_export_vocab) beside
// tokenizer.model, and names it in the manifest's "tokenizer" field.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <unordered_map>
#include <vector>

#include "loom/visibility.h"

namespace loom::data {

// An immutable list of pieces; safe to share between threads.
class LOOM_API Vocabulary {
 public:
  // Reads a vocabulary file. Missing is IoError, malformed is CorruptData, naming the file.
  static Vocabulary load(const std::filesystem::path& file);
  // The vocabulary a token dataset (a directory, a registry name resolved through
  // $LOOM_DATA_REGISTRY, or the URL of a remote dataset, whose tokenizer files are fetched
  // through the node cache with the default options: loom/data/cache.h) names in its manifest,
  // after checking the tokenizer files against the manifest; InvalidArgument when it names
  // none.
  static Vocabulary of_dataset(const std::filesystem::path& dataset);

  size_t size() const { return pieces_.size(); }
  // The piece of `id` as stored (SentencePiece marks a word start with U+2581);
  // InvalidArgument when id is out of range.
  const std::string& piece(int64_t id) const;
  // The piece as text: U+2581 becomes a space; control pieces (<unk>, <s>, </s>, <pad>) stay
  // as written.
  std::string text(int64_t id) const;
  bool is_control(int64_t id) const;
  // The id of a piece, or -1.
  int64_t id_of(const std::string& piece) const;
  // Text of a sequence of ids: pieces joined, word marks as spaces, control pieces dropped
  // except </s>, which becomes a newline; the leading space is trimmed.
  std::string decode(const std::vector<int64_t>& ids) const;

 private:
  std::vector<std::string> pieces_;
  std::unordered_map<std::string, int64_t> ids_;
};

}  // namespace loom::data

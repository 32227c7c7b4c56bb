#include "loom/data/vocabulary.h"

#include <fstream>

#include "loom/data/dataset.h"
#include "loom/data/registry.h"
#include "loom/error.h"

namespace loom::data {
namespace {

constexpr char kWordMark[] = "\u2581";  // SentencePiece's word-start mark, 3 bytes in UTF-8

bool is_control_piece(const std::string& p) {
  return p == "<unk>" || p == "<s>" || p == "</s>" || p == "<pad>";
}

}  // namespace

Vocabulary Vocabulary::load(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  LOOM_CHECK(in.good(), IoError, "cannot read vocabulary ", file.string());
  Vocabulary v;
  for (std::string line; std::getline(in, line);) {
    const auto tab = line.find('\t');
    LOOM_CHECK(tab != std::string::npos && tab > 0, CorruptData, file.string(), ":",
               v.pieces_.size() + 1, ": expected \"piece<TAB>score\"");
    v.ids_.emplace(line.substr(0, tab), static_cast<int64_t>(v.pieces_.size()));
    v.pieces_.push_back(line.substr(0, tab));
  }
  LOOM_CHECK(!v.pieces_.empty(), CorruptData, file.string(), " holds no pieces");
  return v;
}

Vocabulary Vocabulary::of_dataset(const std::filesystem::path& dataset) {
  const std::filesystem::path dataset_dir = resolve_dataset(dataset.string()).dir;
  const Manifest m = read_manifest(dataset_dir);
  LOOM_CHECK(m.kind == DatasetKind::kTokens && !m.tokenizer.empty(), InvalidArgument,
             dataset_dir.string(), " names no tokenizer vocabulary in its manifest");
  check_tokenizer_files(dataset_dir, m);
  Vocabulary v = load(dataset_dir / m.tokenizer);
  LOOM_CHECK(v.size() == m.vocab_size, CorruptData, (dataset_dir / m.tokenizer).string(), " holds ",
             v.size(), " pieces but the dataset's vocab_size is ", m.vocab_size);
  return v;
}

const std::string& Vocabulary::piece(int64_t id) const {
  LOOM_CHECK(id >= 0 && id < static_cast<int64_t>(pieces_.size()), InvalidArgument, "token id ", id,
             " is outside the vocabulary of ", pieces_.size(), " pieces");
  return pieces_[static_cast<size_t>(id)];
}

std::string Vocabulary::text(int64_t id) const {
  std::string p = piece(id);
  for (size_t at; (at = p.find(kWordMark)) != std::string::npos;) p.replace(at, 3, " ");
  return p;
}

bool Vocabulary::is_control(int64_t id) const { return is_control_piece(piece(id)); }

int64_t Vocabulary::id_of(const std::string& p) const {
  auto it = ids_.find(p);
  return it == ids_.end() ? -1 : it->second;
}

std::string Vocabulary::decode(const std::vector<int64_t>& ids) const {
  std::string out;
  for (int64_t id : ids) {
    if (piece(id) == "</s>") {
      out += "\n";
    } else if (!is_control(id)) {
      out += text(id);
    }
  }
  if (!out.empty() && out[0] == ' ') out.erase(0, 1);
  return out;
}

}  // namespace loom::data

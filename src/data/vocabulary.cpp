#include "loom/data/vocabulary.h"

#include <fstream>
#include <memory>

#include "loom/data/cache.h"
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
  const std::string location = resolve_dataset(dataset.string()).dir.string();
  const Manifest m = read_manifest(location, RemoteOptions{});
  LOOM_CHECK(m.kind == DatasetKind::kTokens && !m.tokenizer.empty(), InvalidArgument, location,
             " names no tokenizer vocabulary in its manifest");
  // A remote dataset's tokenizer files, hash-checked, in the node cache; pinned while read.
  std::filesystem::path dir = location;
  std::unique_ptr<NodeCache> cache;
  std::vector<NodeCache::Pin> pins;
  if (is_remote(location)) {
    cache = std::make_unique<NodeCache>(CacheOptions{}, RemoteOptions{});
    for (const FileInfo& f : m.tokenizer_files) {
      pins.push_back(
          cache->acquire({join_url(location, f.file), m.version, f.file, f.bytes, f.xxhash64}));
    }
    dir = cache->version_dir(m.version);
    LOOM_CHECK(!pins.empty(), InvalidArgument, location, " is format ", m.format_version,
               ", whose manifest does not list its tokenizer files, so they cannot be fetched; "
               "run `loom data migrate` on the dataset's directory and upload it again");
  }
  check_tokenizer_files(dir, m);
  Vocabulary v = load(dir / m.tokenizer);
  LOOM_CHECK(v.size() == m.vocab_size, CorruptData, join_url(location, m.tokenizer), " holds ",
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

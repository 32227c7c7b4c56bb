// migrate_dataset: rewrites a dataset of an older format version to the current one, one
// step per version, after checking every shard against its manifest.
#include <functional>

#include "data/chunk_check.h"
#include "data/manifest.h"
#include "data/shard_format.h"
#include "loom/data/dataset.h"
#include "loom/error.h"
#include "util/hash.h"
#include "util/mapped_file.h"

namespace loom::data {
namespace {

namespace fs = std::filesystem;

// Format 1 -> 2: chunk hashes for every shard (computed while the whole file is checked
// against the format 1 hash, so a corrupt shard is never blessed with fresh hashes) and the
// tokenizer files (the vocabulary the manifest names, and tokenizer.model when it is there).
void format1_to_2(const fs::path& dir, Manifest& m, const ProgressFn& progress) {
  m.chunk_bytes = Manifest::kDefaultChunkBytes;
  const uint64_t total = m.total_bytes();
  uint64_t done = 0;
  for (ShardInfo& s : m.shards) {
    const fs::path path = dir / s.file;
    LOOM_CHECK(fs::exists(path), IoError, "cannot migrate ", dir.string(), ": shard ",
               path.string(), " is missing; restore it first");
    util::MappedFile file(path);
    const uint64_t hash = util::xxh64(file.data(), file.size());
    LOOM_CHECK(file.size() == s.bytes && hash == s.xxhash64, CorruptData, "cannot migrate ",
               dir.string(), ": shard ", path.string(), " is ", file.size(),
               " bytes with xxHash64 ", util::hash_hex(hash), " but the manifest says ", s.bytes,
               " bytes with ", util::hash_hex(s.xxhash64), "; restore it (nothing was changed)");
    s.chunk_hashes = format::chunk_hashes(file.data(), file.size(), m.chunk_bytes);
    done += file.size();
    if (progress) progress(done, total);
  }
  if (m.kind == DatasetKind::kTokens) {
    std::vector<std::string> names;
    if (!m.tokenizer.empty()) names.push_back(m.tokenizer);
    if (m.tokenizer != "tokenizer.model" && fs::exists(dir / "tokenizer.model")) {
      names.insert(names.begin(), "tokenizer.model");
    }
    for (const std::string& name : names) {
      LOOM_CHECK(fs::exists(dir / name), IoError, "cannot migrate ", dir.string(),
                 ": its tokenizer file ", (dir / name).string(), " is missing; restore it first");
      m.tokenizer_files.push_back(format::describe_file(dir, name));
    }
  }
}

// Format 2 -> 3: nothing to add. Format 3 only allows what format 2 could not describe
// (image fields, ragged tensors, record layouts); the new number keeps older Looms, which
// would misread such a manifest, from opening it.
void format2_to_3(const fs::path&, Manifest&, const ProgressFn&) {}

using Step = std::function<void(const fs::path&, Manifest&, const ProgressFn&)>;

// steps[v - 1] takes a manifest of format v to format v + 1.
const std::vector<Step>& steps() {
  static const std::vector<Step> all = {format1_to_2, format2_to_3};
  static_assert(Manifest::kFormatVersion == 3, "add the migration step of the new format");
  return all;
}

}  // namespace

MigrateReport migrate_dataset(const fs::path& dir, const ProgressFn& progress) {
  Manifest m = read_manifest(dir);
  MigrateReport report;
  report.from_format = m.format_version;
  report.to_format = Manifest::kFormatVersion;
  report.old_version = m.version;
  report.new_version = m.version;
  if (m.format_version == Manifest::kFormatVersion) return report;
  const std::string old_previous = m.previous_version;
  while (m.format_version < Manifest::kFormatVersion) {
    steps()[static_cast<size_t>(m.format_version - 1)](dir, m, progress);
    ++m.format_version;
  }
  // A version that moves (format 1 did not cover the tokenizer files) keeps the old one as
  // previous_version, so that reader states and registry entries of it still apply.
  const std::string new_version = format::content_version(m);
  m.previous_version = new_version == report.old_version ? old_previous : report.old_version;
  format::write_manifest(dir, m);
  report.new_version = m.version;
  report.rewritten = true;
  return report;
}

}  // namespace loom::data

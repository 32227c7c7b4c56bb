// The dataset registry: named, numbered, immutable versions of datasets, with lineage and tags.
//
// `kjv@3` is version 3 of the dataset named kjv; `kjv@latest` (or just `kjv`) its newest
// version; `kjv@stable` the version the tag "stable" points to. A version binds a name and a
// number to a dataset directory and its content version (Manifest::version), with the lineage
// that built it; it never changes once recorded. Tags move.
//
// Registry is the interface; DirectoryRegistry keeps the catalog as a directory tree (shareable
// over a network file system), and a service can implement the same interface later. Readers
// resolve names with resolve_dataset(). A version's dataset is a local directory or the URL of
// a remote one (http(s)://, s3://; loom/data/remote.h). docs/datasets.md has the layout and
// the commands.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "loom/data/dataset.h"
#include "loom/data/remote.h"
#include "loom/visibility.h"

namespace loom::data {

// A source file of a build, as hashed when the dataset was built.
struct SourceFile {
  std::string path;  // as given to the build, made absolute
  uint64_t bytes = 0;
  uint64_t xxhash64 = 0;
};

// How a dataset version came to be. `loom data build` writes it into the dataset directory as
// build.json; register copies it into the version's record.
struct Lineage {
  std::vector<SourceFile> sources;  // the build's inputs
  std::string command;              // the command line that built it
  std::string tokenizer;            // how the tokenizer was made (trained, or copied from where)
  std::string parent;               // "name@N" this version follows or derives from, or ""
};

// One registered version.
struct DatasetVersion {
  std::string name;
  uint64_t number = 0;          // 1, 2, 3, ... per name
  std::string content_version;  // the dataset's Manifest::version when it was registered
  std::filesystem::path dir;    // the dataset directory (absolute) or its URL
  DatasetKind kind = DatasetKind::kTokens;
  uint64_t bytes = 0;         // the shards' total size
  uint64_t items = 0;         // tokens or records
  std::string registered_at;  // UTC, ISO 8601
  Lineage lineage;
  std::vector<std::string> tags;  // the tags that point here now

  std::string ref() const { return name + "@" + std::to_string(number); }
};

struct RegisterOptions {
  // The parent version ("name@N", any name); empty: the name's latest version, if any.
  std::string parent;
  // How a remote dataset's manifest and build.json are fetched (credentials, retries).
  RemoteOptions remote;
};

// A catalog of dataset versions. Implementations are safe to use from several processes at
// once (DirectoryRegistry: see its comment); one object is not to be shared between threads.
// Errors: a name, version or tag that does not exist is InvalidArgument naming it (and what
// exists); a malformed catalog entry is CorruptData naming its file; storage failures IoError.
class LOOM_API Registry {
 public:
  virtual ~Registry() = default;

  // Records the dataset at `location` (a directory, or the URL of a remote dataset) as the
  // next version of `name`, bound to its content version, with the lineage of its build.json
  // (if any). If the name's latest version already holds this content at this location,
  // returns it instead of adding a copy. `location` must hold a readable dataset
  // (read_manifest's errors, or RemoteError for a URL, otherwise).
  virtual DatasetVersion add(const std::string& name, const std::string& location,
                             const RegisterOptions& options = {}) = 0;
  // Resolves "name@N", "name@latest", "name@TAG" or "name" (= latest).
  virtual DatasetVersion get(const std::string& ref) const = 0;
  // Registered names, sorted.
  virtual std::vector<std::string> names() const = 0;
  // The versions of `name`, oldest first.
  virtual std::vector<DatasetVersion> versions(const std::string& name) const = 0;
  // Points `tag` of the version's name at the version `ref` resolves to (moving it if it
  // pointed elsewhere). A tag is not "latest" and not a number.
  virtual void tag(const std::string& ref, const std::string& tag) = 0;
  // Where the catalog is, for messages.
  virtual std::string location() const = 0;
};

// The catalog as a directory tree:
//   ROOT/NAME/versions/N.json   one immutable record per version (never rewritten)
//   ROOT/NAME/tags/TAG          the version number a tag points to
//   ROOT/NAME/.lock             serializes add() between processes
// add() takes an exclusive flock on .lock and creates N.json with link(2), which fails rather
// than overwrite when another writer (one without working locks, e.g. on some network file
// systems) took N first; it then takes N + 1. Tags are replaced by atomic rename.
class LOOM_API DirectoryRegistry final : public Registry {
 public:
  explicit DirectoryRegistry(std::filesystem::path root);

  DatasetVersion add(const std::string& name, const std::string& location,
                     const RegisterOptions& options = {}) override;
  DatasetVersion get(const std::string& ref) const override;
  std::vector<std::string> names() const override;
  std::vector<DatasetVersion> versions(const std::string& name) const override;
  void tag(const std::string& ref, const std::string& tag) override;
  std::string location() const override { return root_.string(); }

 private:
  DatasetVersion read_version(const std::string& name, uint64_t number) const;
  std::vector<uint64_t> numbers(const std::string& name) const;

  std::filesystem::path root_;  // constant after construction
};

// The registry at `root`, or at $LOOM_DATA_REGISTRY when root is empty. InvalidArgument when
// neither names one, saying how to set it.
LOOM_API std::unique_ptr<Registry> open_registry(const std::filesystem::path& root = {});

// The lineage file `loom data build` writes into a dataset directory.
inline constexpr char kBuildLineageFile[] = "build.json";
// Reads `location`/build.json (a directory, or a URL fetched with `remote`); an empty Lineage
// when there is none, CorruptData when malformed.
LOOM_API Lineage read_build_lineage(const std::string& location, const RemoteOptions& remote = {});
// Writes `dir`/build.json atomically.
LOOM_API void write_build_lineage(const std::filesystem::path& dir, const Lineage& lineage);
// `path`'s size and xxHash64, the path made absolute; IoError when unreadable.
LOOM_API SourceFile describe_source(const std::filesystem::path& path);

// A dataset as a reader opens it: its directory or URL and, for a registry name, the version.
struct ResolvedDataset {
  std::filesystem::path dir;    // a directory, or the URL of a remote dataset
  std::string ref;              // "kjv@3", or "" when `spec` was a path
  std::string content_version;  // the registered content version, or "" for a path
};

// True when `spec` is a registry name rather than a path: it has no '/', is not empty, and no
// file or directory of that name exists.
LOOM_API bool is_registry_name(const std::string& spec);

// `spec` as a location: a path or URL is returned as it is; a registry name is resolved through
// open_registry(registry_root) and its dataset checked: a directory that is gone is IoError, a
// URL whose manifest cannot be fetched RemoteError naming the version, and a dataset whose
// manifest no longer holds the registered content version CorruptData naming the version, both
// content versions and the location ("its files changed since registration"). Remote
// manifests are fetched with `remote`.
LOOM_API ResolvedDataset resolve_dataset(const std::string& spec,
                                         const std::filesystem::path& registry_root = {},
                                         const RemoteOptions& remote = {});

}  // namespace loom::data

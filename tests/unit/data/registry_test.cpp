// The dataset registry: versions, tags, lineage, resolution for readers, the errors for every
// name that resolves nowhere, and concurrent registration.
#include "loom/data/registry.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <thread>

#include "harness/harness.h"
#include "loom/data/reader.h"
#include "loom/error.h"
#include "util/files.h"

namespace loom::data {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::TempDir;

// A small token dataset whose tokens start at `first`: different `first`, different content.
fs::path tokens_at(const fs::path& dir, uint32_t first) {
  TokenDatasetWriter writer(dir, {.vocab_size = 1000});
  std::vector<uint32_t> doc;
  for (uint32_t t = 0; t < 50; ++t) doc.push_back(first + t);
  writer.add_document(doc);
  writer.finish();
  return dir;
}

TEST(Registry, VersionsAreNumberedAndResolveByNumberLatestAndTag) {
  TempDir dir;
  DirectoryRegistry registry(dir / "registry");
  const fs::path a = tokens_at(dir / "a", 0), b = tokens_at(dir / "b", 100);
  const DatasetVersion v1 = registry.add("kjv", a);
  const DatasetVersion v2 = registry.add("kjv", b);
  EXPECT_EQ(v1.ref(), "kjv@1");
  EXPECT_EQ(v2.ref(), "kjv@2");
  EXPECT_EQ(v1.content_version, read_manifest(a).version);
  EXPECT_EQ(v2.content_version, read_manifest(b).version);
  EXPECT_EQ(v1.dir, a);
  EXPECT_EQ(v1.lineage.parent, "");
  EXPECT_EQ(v2.lineage.parent, "kjv@1");  // the previous latest, by default
  EXPECT_EQ(v1.items, 50u);

  EXPECT_EQ(registry.get("kjv@1").content_version, v1.content_version);
  EXPECT_EQ(registry.get("kjv@latest").number, 2u);
  EXPECT_EQ(registry.get("kjv").number, 2u);
  registry.tag("kjv@1", "stable");
  EXPECT_EQ(registry.get("kjv@stable").number, 1u);
  EXPECT_EQ(registry.get("kjv@1").tags, (std::vector<std::string>{"stable"}));
  registry.tag("kjv@2", "stable");  // tags move; versions do not
  EXPECT_EQ(registry.get("kjv@stable").number, 2u);
  EXPECT_TRUE(registry.get("kjv@1").tags.empty());

  // Registering the latest content again returns it rather than adding a copy.
  EXPECT_EQ(registry.add("kjv", b).number, 2u);
  EXPECT_EQ(registry.versions("kjv").size(), 2u);
  // The same content may be registered again after other content, as a new version.
  EXPECT_EQ(registry.add("kjv", a, {.parent = "kjv@stable"}).ref(), "kjv@3");
  EXPECT_EQ(registry.get("kjv@3").lineage.parent, "kjv@2");

  registry.add("fashion", a);
  EXPECT_EQ(registry.names(), (std::vector<std::string>{"fashion", "kjv"}));
}

TEST(Registry, LineageComesFromTheBuildFile) {
  TempDir dir;
  const fs::path ds = tokens_at(dir / "ds", 0);
  std::ofstream(dir / "input.txt") << "In the beginning";
  const Lineage written{.sources = {describe_source(dir / "input.txt")},
                        .command = "loom data build text --input input.txt --out ds",
                        .tokenizer = "trained here: spm_train BPE, 600 pieces",
                        .parent = ""};
  write_build_lineage(ds, written);
  EXPECT_EQ(written.sources[0].path, (dir / "input.txt").string());
  EXPECT_EQ(written.sources[0].bytes, 16u);
  DirectoryRegistry registry(dir / "registry");
  const DatasetVersion v = registry.add("kjv", ds);
  const DatasetVersion read = registry.get("kjv@1");
  for (const DatasetVersion* x : {&v, &read}) {
    EXPECT_EQ(x->lineage.command, written.command);
    EXPECT_EQ(x->lineage.tokenizer, written.tokenizer);
    ASSERT_EQ(x->lineage.sources.size(), 1u);
    EXPECT_EQ(x->lineage.sources[0].path, written.sources[0].path);
    EXPECT_EQ(x->lineage.sources[0].xxhash64, written.sources[0].xxhash64);
  }
}

TEST(Registry, NamesThatResolveNowhereAreClearErrors) {
  TempDir dir;
  const std::string root = (dir / "registry").string();
  DirectoryRegistry registry(root);
  EXPECT_EQ(error_of<InvalidArgument>([&] { registry.get("kjv@1"); }),
            "no dataset named \"kjv\" in the registry " + root +
                " (it is empty). Register one with `loom data register kjv DIR`");
  registry.add("kjv", tokens_at(dir / "a", 0));
  registry.add("kjv", tokens_at(dir / "b", 100));
  EXPECT_EQ(error_of<InvalidArgument>([&] { registry.get("bible@1"); }),
            "no dataset named \"bible\" in the registry " + root +
                "; it has: kjv. Register one with `loom data register bible DIR`");
  EXPECT_EQ(error_of<InvalidArgument>([&] { registry.get("kjv@3"); }),
            "dataset kjv@3 does not exist: kjv has versions 1 to 2 in the registry " + root);
  EXPECT_EQ(error_of<InvalidArgument>([&] { registry.get("kjv@stable"); }),
            "dataset kjv has no version or tag \"stable\" (kjv has versions 1 to 2); tag one "
            "with `loom data tag kjv@N stable`");
  util::write_file_atomic(dir / "registry" / "kjv" / "tags" / "old", "7\n");
  EXPECT_EQ(error_of<InvalidArgument>([&] { registry.get("kjv@old"); }),
            "tag kjv@old points nowhere: it names version \"7\" but kjv has versions 1 to 2 (" +
                (dir / "registry" / "kjv" / "tags" / "old").string() +
                "); move it with `loom data tag kjv@N old`");
  EXPECT_THROW(registry.tag("kjv@1", "latest"), InvalidArgument);
  EXPECT_THROW(registry.tag("kjv@1", "12"), InvalidArgument);
  EXPECT_THROW(registry.add("../kjv", dir / "a"), InvalidArgument);
}

TEST(Registry, ReadersOpenNamesAndTheirStatesSayWhichVersion) {
  TempDir dir;
  DirectoryRegistry registry(dir / "registry");
  registry.add("kjv", tokens_at(dir / "a", 0));
  registry.add("kjv", tokens_at(dir / "b", 100));
  const ReaderOptions options{
      .batch_size = 2, .seq_len = 4, .prefetch = 0, .registry = dir / "registry"};
  Reader one("kjv@1", options);
  EXPECT_EQ(one.dataset().dir, dir / "a");
  EXPECT_EQ(one.dataset().ref, "kjv@1");
  EXPECT_EQ(one.read({0})["tokens"][0][0].item<int64_t>(), 0);
  Reader latest("kjv", options);
  EXPECT_EQ(latest.dataset().ref, "kjv@2");
  EXPECT_EQ(latest.read({0})["tokens"][0][0].item<int64_t>(), 100);

  one.next();
  const SamplerState state = one.state();
  EXPECT_EQ(state.dataset, "kjv@1");
  EXPECT_EQ(SamplerState::from_json(state.to_json()).dataset, "kjv@1");
  EXPECT_NE(state.to_json().find("\"dataset\":\"kjv@1\""), std::string::npos) << state.to_json();
  // Resuming against another version stays the named error, now with the names too.
  auto message = error_of<InvalidArgument>([&] { latest.restore(state); });
  EXPECT_EQ(message, "reader state is for dataset version \"" + state.dataset_version +
                         "\" (kjv@1) but this sampler reads version \"" +
                         latest.manifest().version +
                         "\" (kjv@2); pass allow_version_change to resume across a dataset "
                         "change");
  // A path still opens as a path, and its state has no name.
  Reader by_path(dir / "a", {.seq_len = 4});
  EXPECT_EQ(by_path.dataset().ref, "");
  EXPECT_EQ(by_path.state().to_json().find("\"dataset\""), std::string::npos);
}

TEST(Registry, AnEntryWhoseFilesChangedIsANamedError) {
  TempDir dir;
  DirectoryRegistry registry(dir / "registry");
  registry.add("kjv", tokens_at(dir / "a", 0));
  fs::remove_all(dir / "a");
  tokens_at(dir / "a", 7);  // rebuilt in place with other content
  const DatasetVersion v = registry.get("kjv@1");
  auto message = error_of<CorruptData>([&] { resolve_dataset("kjv@1", dir / "registry"); });
  EXPECT_EQ(message, "dataset kjv@1 was registered with content version " + v.content_version +
                         " but " + (dir / "a").string() + " now holds version " +
                         read_manifest(dir / "a").version +
                         ": its files changed since registration. Restore them, or register "
                         "the new content as a new version (`loom data register kjv " +
                         (dir / "a").string() + "`)");
  EXPECT_THROW(Reader("kjv@1", {.seq_len = 4, .registry = dir / "registry"}), CorruptData);
  fs::remove_all(dir / "a");
  message = error_of<IoError>([&] { resolve_dataset("kjv@1", dir / "registry"); });
  EXPECT_EQ(message, "dataset kjv@1 is registered at " + (dir / "a").string() +
                         ", which no longer exists; restore it, or register its new place as a "
                         "new version");
}

TEST(Registry, ANameWithoutARegistrySaysHowToSetOne) {
  ::unsetenv("LOOM_DATA_REGISTRY");
  auto message = error_of<InvalidArgument>([] { resolve_dataset("kjv@3"); });
  EXPECT_EQ(message,
            "dataset \"kjv@3\" is not a directory, and it cannot be looked up as a registry "
            "name: no dataset registry is set: set LOOM_DATA_REGISTRY to its directory (or pass "
            "--registry DIR)");
  TempDir dir;
  DirectoryRegistry(dir / "registry").add("kjv", tokens_at(dir / "a", 0));
  ::setenv("LOOM_DATA_REGISTRY", (dir / "registry").c_str(), 1);
  EXPECT_EQ(resolve_dataset("kjv@1").dir, dir / "a");
  ::unsetenv("LOOM_DATA_REGISTRY");
  // Not names: a path with '/', an existing relative path.
  EXPECT_FALSE(is_registry_name("data/kjv"));
  EXPECT_FALSE(is_registry_name("."));
  EXPECT_TRUE(is_registry_name("kjv@3"));
}

// Writers in threads, each with its own registry object (its own lock file descriptor, as a
// process has): every version number is taken exactly once.
TEST(Registry, ConcurrentRegistrationsTakeDistinctNumbers) {
  TempDir dir;
  constexpr int kWriters = 8;
  std::vector<fs::path> datasets;
  for (int i = 0; i < kWriters; ++i) {
    datasets.push_back(tokens_at(dir / ("ds" + std::to_string(i)), static_cast<uint32_t>(i)));
  }
  std::vector<uint64_t> numbers(kWriters);
  std::vector<std::thread> threads;
  for (int i = 0; i < kWriters; ++i) {
    threads.emplace_back([&, i] {
      DirectoryRegistry registry(dir / "registry");
      numbers[static_cast<size_t>(i)] =
          registry.add("kjv", datasets[static_cast<size_t>(i)]).number;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(std::set<uint64_t>(numbers.begin(), numbers.end()),
            (std::set<uint64_t>{1, 2, 3, 4, 5, 6, 7, 8}));
  DirectoryRegistry registry(dir / "registry");
  for (int i = 0; i < kWriters; ++i) {
    const DatasetVersion v = registry.get("kjv@" + std::to_string(numbers[static_cast<size_t>(i)]));
    EXPECT_EQ(v.dir, datasets[static_cast<size_t>(i)]);
  }
}

}  // namespace
}  // namespace loom::data

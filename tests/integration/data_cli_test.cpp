// `loom data build|verify|show` end to end on the real data of Debian packages: the KJV text
// (bible-kjv) and Fashion-MNIST (dataset-fashion-mnist), read back through data::Reader.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>

#include "data/image_codec.h"
#include "harness/harness.h"
#include "harness/servers.h"
#include "loom/ckpt/inspect.h"
#include "loom/config.h"
#include "loom/data/dataset.h"
#include "loom/data/mixture.h"
#include "loom/data/reader.h"
#include "loom/data/registry.h"
#include "loom/data/vocabulary.h"
#include "loom/runtime.h"
#include "util/files.h"
#include "util/hash.h"
#include "util/subprocess.h"

namespace loom::data {
namespace {

namespace fs = std::filesystem;
using testing::ProgramResult;
using testing::TempDir;

ProgramResult loom(std::vector<std::string> args, const TempDir& dir) {
  args.insert(args.begin(), LOOM_BINARY_DIR "/tools/loom/loom");
  return testing::run_program(args, dir.path());
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(DataCli, KjvTextBecomesATokenDatasetThatReadsBack) {
  TempDir dir;
  const fs::path text = dir / "genesis.txt";
  auto bible = util::Subprocess::spawn({.argv = {"bible", "gen1:1-gen50:26"}, .output = text});
  ASSERT_TRUE(bible.wait().ok());
  ASSERT_GT(fs::file_size(text), 100000u);

  const fs::path ds = dir / "kjv";
  ProgramResult built = loom({"data", "build", "text", "--input", text.string(), "--vocab-size",
                              "600", "--out", ds.string(), "--shard-tokens", "20000"},
                             dir);
  ASSERT_EQ(built.exit_code, 0) << built.output;
  EXPECT_TRUE(contains(built.output, "tokenizing")) << built.output;

  const Manifest m = read_manifest(ds);
  EXPECT_EQ(m.vocab_size, 600u);
  EXPECT_GT(m.shards.size(), 1u);
  const Vocabulary vocab = Vocabulary::of_dataset(ds);
  EXPECT_EQ(vocab.piece(m.eos_id), "</s>");

  // Every document decodes back to the source text, words intact.
  Reader reader(ds, {.batch_size = 2, .seq_len = 64, .sampling = TokenSampling::kDocument});
  Batch first = reader.read({0, 1});
  std::vector<int64_t> ids;
  const auto row = first["tokens"][1];
  for (int64_t k = 0; k < first["mask"][1].sum().item<int64_t>(); ++k)
    ids.push_back(row[k].item<int64_t>());
  EXPECT_TRUE(contains(vocab.decode(ids), "In the beginning God created the heaven and the earth"))
      << vocab.decode(ids);

  ProgramResult verified = loom({"data", "verify", ds.string()}, dir);
  EXPECT_EQ(verified.exit_code, 0) << verified.output;
  ProgramResult shown =
      loom({"data", "show", ds.string(), "--seq-len", "16", "--batch", "2", "--world", "2",
            "--rank", "1", "--step", "3", "--color", "never", "--ids"},
           dir);
  ASSERT_EQ(shown.exit_code, 0) << shown.output;
  EXPECT_TRUE(contains(shown.output, "rank 1 of 2, step 3")) << shown.output;
  EXPECT_TRUE(contains(shown.output, "|")) << shown.output;

  // show prints exactly what the reader gives that rank at that step: every sample's dataset
  // index and every token id, in order.
  Reader rank1(ds, {.batch_size = 2, .seq_len = 16, .rank = 1, .world_size = 2});
  for (int s = 0; s < 3; ++s) rank1.next();
  const Batch step3 = rank1.next();
  std::vector<std::string> expected, printed;
  for (int64_t k = 0; k < 2; ++k) {
    expected.push_back("sample " + std::to_string(k) + ": dataset index " +
                       std::to_string(step3.indices[k]));
    std::string ids = "ids:";
    const at::Tensor row = step3["tokens"][k];
    for (int64_t t = 0; t < row.numel(); ++t) ids += " " + std::to_string(row[t].item<int64_t>());
    expected.push_back(ids);
  }
  std::istringstream lines(shown.output);
  for (std::string line; std::getline(lines, line);) {
    line.erase(0, line.find_first_not_of(' '));
    if (line.rfind("sample ", 0) == 0 || line.rfind("ids:", 0) == 0) printed.push_back(line);
  }
  EXPECT_EQ(printed, expected) << shown.output;
}

TEST(DataCli, FashionMnistBecomesARecordDatasetThatReadsBack) {
  TempDir dir;
  const fs::path ds = dir / "fm";
  ProgramResult built =
      loom({"data", "build", "fashion-mnist", "--split", "test", "--out", ds.string()}, dir);
  ASSERT_EQ(built.exit_code, 0) << built.output;
  const Manifest m = read_manifest(ds);
  EXPECT_EQ(m.total_items(), 10000u);
  EXPECT_EQ(m.field("label").classes.at(9), "Ankle boot");

  Reader reader(ds, {.batch_size = 100, .seed = 5});
  at::Tensor counts = at::zeros({10}, at::kLong);
  for (int s = 0; s < 100; ++s) {
    const Batch b = reader.next();
    EXPECT_EQ(b["image"].sizes(), (std::vector<int64_t>{100, 28, 28}));
    counts += at::bincount(b["label"], {}, 10);
  }
  EXPECT_TRUE(counts.eq(1000).all().item<bool>()) << counts;  // the test split is balanced

  ProgramResult shown =
      loom({"data", "show", ds.string(), "--batch", "1", "--color", "never"}, dir);
  ASSERT_EQ(shown.exit_code, 0) << shown.output;
  EXPECT_TRUE(contains(shown.output, "label: ")) << shown.output;
  EXPECT_TRUE(contains(shown.output, "#")) << shown.output;  // the image as terminal art

  // A flipped byte: verify names the file and the record and exits 1.
  {
    std::fstream f(ds / "records_00000.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(64 + 5000 * 820 + 400);
    f.put('\x55');
  }
  ProgramResult verified = loom({"data", "verify", ds.string()}, dir);
  EXPECT_EQ(verified.exit_code, 1) << verified.output;
  EXPECT_TRUE(contains(verified.output, "records_00000.bin record 5000")) << verified.output;
  ProgramResult missing = loom({"data", "verify", (dir / "nothing").string()}, dir);
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  EXPECT_TRUE(contains(missing.output, "does not exist")) << missing.output;
}

// An IDX header is a length field: three dimensions of 2^22, 2^21, 2^21 multiply to 2^64,
// which wraps to 0 and would "match" a file with no data (then be read as 2^22 images).
TEST(DataCli, IdxHeadersPromisingMoreThanTheFileAreCorrupt) {
  TempDir dir;
  auto write_idx = [&](const std::string& name, uint32_t magic, std::vector<uint32_t> dims,
                       size_t data_bytes) {
    std::string bytes;
    auto be32 = [&](uint32_t v) {
      for (int s = 24; s >= 0; s -= 8) bytes.push_back(static_cast<char>((v >> s) & 0xff));
    };
    be32(magic);
    for (uint32_t d : dims) be32(d);
    bytes.append(data_bytes, '\0');
    std::ofstream(dir / name, std::ios::binary) << bytes;
    return (dir / name).string();
  };
  const std::string labels = write_idx("labels", 0x801, {2}, 2);
  for (const auto& dims :
       std::vector<std::vector<uint32_t>>{{1u << 22, 1u << 21, 1u << 21}, {2, 28, 28}}) {
    const std::string images = write_idx("images", 0x803, dims, 0);
    ProgramResult r = loom({"data", "build", "fashion-mnist", "--images", images, "--labels",
                            labels, "--out", (dir / "out").string()},
                           dir);
    EXPECT_EQ(r.exit_code, 1) << r.output;  // CorruptData: the command failed on its input
    EXPECT_NE(r.output.find(images + " holds 0 data bytes, its header promises"), std::string::npos)
        << r.output;
  }
}

TEST(DataCli, JsonlBecomesARecordDataset) {
  TempDir dir;
  {
    std::ofstream f(dir / "episodes.jsonl");
    f << R"({"prompt": "2+2", "reward": 1.5, "steps": 3, "obs": [[1, 2], [3, 4]], "meta": {"a": 1}})"
      << "\n"
      << R"({"prompt": "3+3", "reward": 2, "steps": 4, "obs": [[5, 6]], "meta": null})"
      << "\n";
  }
  const fs::path ds = dir / "rl";
  ProgramResult built = loom({"data", "build", "jsonl", "--input",
                              (dir / "episodes.jsonl").string(), "--out", ds.string()},
                             dir);
  ASSERT_EQ(built.exit_code, 0) << built.output;
  Reader reader(ds, {});
  const Batch b = reader.read({1});
  EXPECT_EQ(b.strings.at("prompt")[0], "3+3");
  EXPECT_DOUBLE_EQ(b["reward"][0].item<double>(), 2.0);
  EXPECT_EQ(b["steps"][0].item<int64_t>(), 4);
  EXPECT_TRUE(b["obs"][0].equal(at::tensor({5, 6}, at::kLong).view({1, 2})));
  EXPECT_EQ(b.strings.at("meta")[0], "null");

  {
    std::ofstream f(dir / "bad.jsonl");
    f << R"({"a": 1})"
      << "\n"
      << R"({"a": "x"})"
      << "\n";
  }
  ProgramResult bad = loom({"data", "build", "jsonl", "--input", (dir / "bad.jsonl").string(),
                            "--out", (dir / "bad").string()},
                           dir);
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_TRUE(contains(bad.output, "bad.jsonl:2")) << bad.output;
}

// nlohmann parses integers above INT64_MAX as uint64; stored as int64 they would wrap into
// negative numbers, so they are refused, as scalars and inside tensors.
TEST(DataCli, JsonlIntegersBeyondInt64AreRefusedNotWrapped) {
  TempDir dir;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"steps", R"({"steps": 9223372036854775808})"},
      {"obs", R"({"obs": [1, 18446744073709551615]})"}};
  for (const auto& [key, line] : cases) {
    const fs::path input = dir / (key + ".jsonl");
    std::ofstream(input) << R"({")" << key << R"(": )" << (key == "obs" ? "[1, 2]" : "7") << "}\n"
                         << line << "\n";
    ProgramResult r = loom(
        {"data", "build", "jsonl", "--input", input.string(), "--out", (dir / key).string()}, dir);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    // The last line (a progress line may come before it).
    const std::string last = r.output.substr(r.output.rfind('\n', r.output.size() - 2) + 1);
    EXPECT_EQ(last, "error: " + input.string() + ":2: key \"" + key +
                        "\" holds an integer beyond int64's range (at most "
                        "9223372036854775807); store it as a string or a float\n");
    EXPECT_FALSE(fs::exists(dir / key / "manifest.json"));
  }
  // INT64_MAX itself fits and reads back exactly.
  std::ofstream(dir / "max.jsonl") << R"({"steps": 9223372036854775807})"
                                   << "\n";
  ProgramResult ok = loom({"data", "build", "jsonl", "--input", (dir / "max.jsonl").string(),
                           "--out", (dir / "max").string()},
                          dir);
  ASSERT_EQ(ok.exit_code, 0) << ok.output;
  Reader reader(dir / "max", {});
  EXPECT_EQ(reader.read({0})["steps"][0].item<int64_t>(), std::numeric_limits<int64_t>::max());
}

// `loom` run in `cwd` with extra environment.
ProgramResult loom_in(std::vector<std::string> args, const fs::path& cwd,
                      std::map<std::string, std::string> env = {}) {
  args.insert(args.begin(), LOOM_BINARY_DIR "/tools/loom/loom");
  const fs::path out = cwd / "program_output.txt";
  fs::remove(out);  // the output is appended to
  auto status =
      util::Subprocess::spawn({.argv = args, .env = std::move(env), .output = out, .cwd = cwd})
          .wait();
  return {status.code, status.signal, util::read_file(out)};
}

const fs::path kFormat1 = fs::path(LOOM_SOURCE_DIR) / "tests" / "data" / "format-v1";

fs::path build_episodes(const TempDir& dir, const std::string& name, int lines) {
  const fs::path input = dir / (name + ".jsonl");
  {
    std::ofstream out(input);
    for (int i = 0; i < lines; ++i)
      out << R"({"id": )" << i << R"(, "text": "line )" << i << "\"}\n";
  }
  ProgramResult r = loom(
      {"data", "build", "jsonl", "--input", input.string(), "--out", (dir / name).string()}, dir);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return dir / name;
}

TEST(DataCli, RegisterLsInfoTagDiffAndNamesInShow) {
  TempDir dir;
  const fs::path a = build_episodes(dir, "a", 3), b = build_episodes(dir, "b", 5);
  // The build wrote its lineage beside the manifest.
  const Lineage lineage = read_build_lineage(a);
  EXPECT_EQ(lineage.command,
            "loom data build jsonl --input " + (dir / "a.jsonl").string() + " --out " + a.string());
  ASSERT_EQ(lineage.sources.size(), 1u);
  EXPECT_EQ(lineage.sources[0].path, (dir / "a.jsonl").string());
  EXPECT_EQ(lineage.sources[0].bytes, fs::file_size(dir / "a.jsonl"));

  const std::string registry = (dir / "registry").string();
  const std::string va = read_manifest(a).version, vb = read_manifest(b).version;
  ProgramResult r = loom({"data", "register", "episodes", a.string(), "--registry", registry}, dir);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output, "registered episodes@1: " + a.string() + " (content version " + va +
                          ", records, 3 items, " + std::to_string(read_manifest(a).total_bytes()) +
                          " bytes)\n");
  r = loom({"data", "register", "episodes", b.string(), "--registry", registry}, dir);
  EXPECT_TRUE(contains(r.output, "registered episodes@2: ")) << r.output;
  EXPECT_TRUE(contains(r.output, ", parent episodes@1)")) << r.output;
  r = loom({"data", "register", "episodes", b.string(), "--registry", registry}, dir);
  EXPECT_TRUE(contains(r.output, "already registered as episodes@2: ")) << r.output;

  r = loom({"data", "tag", "episodes@1", "stable", "--registry", registry}, dir);
  EXPECT_EQ(r.output, "episodes@stable -> episodes@1\n");
  r = loom({"data", "ls", "--registry", registry}, dir);
  EXPECT_EQ(r.output, "episodes  latest episodes@2  (2 versions)  tags: stable=1\n");
  r = loom({"data", "ls", "episodes", "--registry", registry}, dir);
  EXPECT_TRUE(contains(r.output, "episodes@1  " + va + "  records  3 items  ")) << r.output;
  EXPECT_TRUE(contains(r.output, a.string() + " [stable]\n")) << r.output;

  r = loom({"data", "info", "episodes@stable", "--registry", registry}, dir);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "episodes@1 [stable]\ncontent version: " + va + "\n")) << r.output;
  EXPECT_TRUE(contains(r.output, "  command: " + lineage.command + "\n")) << r.output;
  EXPECT_TRUE(contains(r.output, "  source: " + (dir / "a.jsonl").string())) << r.output;
  EXPECT_TRUE(contains(r.output, "files: the directory holds the registered content\n"))
      << r.output;

  r = loom({"data", "diff", "episodes@1", "episodes@2", "--registry", registry}, dir);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "  ~ items: 3 -> 5\n")) << r.output;
  EXPECT_TRUE(contains(r.output, "  - source " + (dir / "a.jsonl").string())) << r.output;
  EXPECT_TRUE(contains(r.output, "  + source " + (dir / "b.jsonl").string())) << r.output;
  EXPECT_TRUE(contains(r.output, "  ~ shard records_00000.bin 3 items ")) << r.output;

  // Names work wherever a dataset is read, through $LOOM_DATA_REGISTRY.
  r = loom_in({"data", "show", "episodes@stable", "--batch", "1", "--color", "never"}, dir.path(),
              {{"LOOM_DATA_REGISTRY", registry}});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "dataset episodes@stable (version " + va + ", 3 samples)"))
      << r.output;
  r = loom_in({"data", "verify", "episodes@2"}, dir.path(), {{"LOOM_DATA_REGISTRY", registry}});
  EXPECT_EQ(r.exit_code, 0) << r.output;

  // Bad names exit 2 naming them; changed files exit 1.
  r = loom({"data", "info", "episodes@9", "--registry", registry}, dir);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.output,
            "error: dataset episodes@9 does not exist: episodes has versions 1 to 2 in "
            "the registry " +
                registry + "\n");
  r = loom({"data", "info", "bible", "--registry", registry}, dir);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.output, "no dataset named \"bible\"")) << r.output;
  fs::remove_all(a);
  build_episodes(dir, "a", 4);
  r = loom({"data", "info", "episodes@1", "--registry", registry}, dir);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(contains(r.output,
                       "files: CHANGED: dataset episodes@1 was registered with content "
                       "version " +
                           va))
      << r.output;
}

// The last line of a command's output (after any progress lines).
std::string last_line(const std::string& output) {
  const size_t end = output.empty() ? 0 : output.size() - 1;
  const size_t begin = output.rfind('\n', end == 0 ? 0 : end - 1);
  return begin == std::string::npos ? output : output.substr(begin + 1);
}

// A dataset served by nginx: registered by its URL, verified, shown and diffed like a
// directory, every file through the node cache.
TEST(DataCli, RemoteDatasetsAreRegisteredVerifiedAndShownByURL) {
  TempDir dir;
  const fs::path a = build_episodes(dir, "a", 5);
  testing::Nginx nginx(dir.path());
  const std::string url = nginx.url() + "/a";
  const std::string registry = (dir / "registry").string();
  const std::map<std::string, std::string> env = {{"LOOM_DATA_CACHE", (dir / "cache").string()},
                                                  {"LOOM_DATA_REGISTRY", registry}};
  const Manifest m = read_manifest(a);

  ProgramResult r = loom_in({"data", "register", "episodes", url}, dir.path(), env);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output, "registered episodes@1: " + url + " (content version " + m.version +
                          ", records, 5 items, " + std::to_string(m.total_bytes()) + " bytes)\n");
  const DatasetVersion v = DirectoryRegistry(registry).get("episodes@1");
  EXPECT_EQ(v.lineage.command, read_build_lineage(a).command);  // build.json came over HTTP

  r = loom_in({"data", "info", "episodes"}, dir.path(), env);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::string lineage;
  for (const SourceFile& f : v.lineage.sources) {
    lineage += "  source: " + f.path + " (" + std::to_string(f.bytes) + " bytes, xxHash64 " +
               util::hash_hex(f.xxhash64) + ")\n";
  }
  EXPECT_EQ(r.output, "episodes@1\ncontent version: " + m.version + "\nurl: " + url +
                          "\nkind: records, 5 items, " + std::to_string(m.total_bytes()) +
                          " bytes\nregistered: " + v.registered_at + "\nlineage:\n  command: " +
                          v.lineage.command + "\n  tokenizer: (none)\n  parent: (none)\n" +
                          lineage + "files: the URL holds the registered content\n");

  for (const std::string& spec : {url, std::string("episodes@1")}) {
    r = loom_in({"data", "verify", spec}, dir.path(), env);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(last_line(r.output), "ok: " + url + ": 1 shards, " + std::to_string(m.total_bytes()) +
                                       " bytes, every shard hash and record checksum matches; "
                                       "version " +
                                       m.version + "\n");
  }

  // What `show` prints of the URL is what it prints of the directory, but for the name.
  const std::vector<std::string> show = {"--step", "1", "--batch", "2", "--color", "never"};
  auto shown = [&](const std::string& spec) {
    std::vector<std::string> args = {"data", "show", spec};
    args.insert(args.end(), show.begin(), show.end());
    ProgramResult p = loom_in(args, dir.path(), env);
    EXPECT_EQ(p.exit_code, 0) << p.output;
    const std::string head = "dataset " + spec + " ";
    EXPECT_EQ(p.output.substr(0, head.size()), head);
    return p.output.substr(std::min(head.size(), p.output.size()));
  };
  const std::string local = shown(a.string());
  EXPECT_EQ(shown(url), local);
  EXPECT_EQ(shown("episodes@1"), local);

  r = loom_in({"data", "migrate", url}, dir.path(), env);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.output, "error: `loom data migrate` rewrites a local dataset directory, and " + url +
                          " is a URL: download the dataset, migrate the copy, and upload it "
                          "again\n");

  // A shard changed on the server: verify names it by URL and exits 1.
  const std::string shard = m.shards[0].file;
  {
    std::fstream f(a / shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(80);
    f.put('\x01');
  }
  r = loom_in({"data", "verify", url}, dir.path(),
              {{"LOOM_DATA_CACHE", (dir / "cache2").string()}});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  const std::string body = util::read_file(a / shard);
  EXPECT_EQ(last_line(r.output),
            "CORRUPT: " + url + "/" + shard + ": " + url + "/" + shard +
                " was downloaded twice with xxHash64 " + util::hash_hex(util::xxh64(body)) +
                " but the manifest says " + util::hash_hex(m.shards[0].xxhash64) +
                ": the remote copy differs from the dataset its manifest describes; upload the "
                "dataset again\n")
      << r.output;
}

// Real processes registering at once: each takes its own version number.
TEST(DataCli, ConcurrentRegisterFromProcesses) {
  TempDir dir;
  constexpr int kProcesses = 6;
  std::vector<fs::path> datasets;
  for (int i = 0; i < kProcesses; ++i)
    datasets.push_back(build_episodes(dir, "d" + std::to_string(i), i + 1));
  std::vector<util::Subprocess> children;
  for (int i = 0; i < kProcesses; ++i) {
    children.push_back(
        util::Subprocess::spawn({.argv = {LOOM_BINARY_DIR "/tools/loom/loom", "data", "register",
                                          "episodes", datasets[static_cast<size_t>(i)].string(),
                                          "--registry", (dir / "registry").string()},
                                 .output = dir / ("register" + std::to_string(i) + ".txt")}));
  }
  for (auto& c : children) EXPECT_TRUE(c.wait().ok());
  DirectoryRegistry registry(dir / "registry");
  const auto versions = registry.versions("episodes");
  ASSERT_EQ(versions.size(), static_cast<size_t>(kProcesses));
  std::set<std::string> dirs;
  for (size_t n = 0; n < versions.size(); ++n) {
    EXPECT_EQ(versions[n].number, n + 1);
    dirs.insert(versions[n].dir.string());
  }
  std::set<std::string> expected;
  for (const auto& d : datasets) expected.insert(d.string());
  EXPECT_EQ(dirs, expected);
}

// The tokenizer model is part of the content version, and spm_train records its options in
// it: two builds of the same text into different directories still get the same version.
TEST(DataCli, TextBuildsOfTheSameInputHaveTheSameVersionAnywhere) {
  TempDir dir;
  const fs::path text = dir / "genesis.txt";
  ASSERT_TRUE(
      util::Subprocess::spawn({.argv = {"bible", "gen1:1-gen2:25"}, .output = text}).wait().ok());
  fs::create_directories(dir / "elsewhere");
  for (const fs::path& out : {dir / "a", dir / "elsewhere" / "b"}) {
    ProgramResult r = loom({"data", "build", "text", "--input", text.string(), "--vocab-size",
                            "120", "--out", out.string()},
                           dir);
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  const Manifest a = read_manifest(dir / "a"), b = read_manifest(dir / "elsewhere" / "b");
  EXPECT_EQ(a.version, b.version);
  ASSERT_EQ(a.tokenizer_files.size(), 2u);
  EXPECT_EQ(a.tokenizer_files[0].file, "tokenizer.model");
  EXPECT_EQ(a.tokenizer_files[0].xxhash64, b.tokenizer_files[0].xxhash64);
  EXPECT_EQ(a.tokenizer_files[1].file, "tokenizer.vocab");
  // The lineage says how the tokenizer was made.
  EXPECT_EQ(
      read_build_lineage(dir / "a").tokenizer.rfind("trained here: spm_train BPE, 120 pieces; "
                                                    "tokenizer.model xxHash64 ",
                                                    0),
      0u);
}

// The kept format 1 datasets: shown as they were when written, migrated, shown the same.
TEST(DataCli, MigrateKeepsFormat1DatasetsReadingTheSame) {
  TempDir dir;
  for (const char* name : {"tokens", "records"}) {
    fs::copy(kFormat1 / name, dir / name, fs::copy_options::recursive);
  }
  const std::string tokens_shown = util::read_file(kFormat1 / "tokens.show.txt");
  const std::string records_shown = util::read_file(kFormat1 / "records.show.txt");
  const std::vector<std::string> show_tokens = {"data", "show",    "tokens",  "--seq-len",
                                                "8",    "--batch", "2",       "--step",
                                                "1",    "--ids",   "--color", "never"};
  const std::vector<std::string> show_records = {"data",   "show", "records", "--batch", "2",
                                                 "--step", "1",    "--color", "never"};
  EXPECT_EQ(loom_in(show_tokens, dir.path()).output, tokens_shown);
  EXPECT_EQ(loom_in(show_records, dir.path()).output, records_shown);

  ProgramResult r = loom_in({"data", "migrate", "records"}, dir.path());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "migrated records from format 1 to 3; content version "
                       "f9b2ba64c56eac6c kept\n"))
      << r.output;
  EXPECT_EQ(loom_in(show_records, dir.path()).output, records_shown);
  r = loom_in({"data", "migrate", "records"}, dir.path());
  EXPECT_TRUE(contains(r.output,
                       "records is already format 3; nothing to do (version "
                       "f9b2ba64c56eac6c)\n"))
      << r.output;

  r = loom_in({"data", "migrate", "tokens"}, dir.path());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const std::string version = read_manifest(dir / "tokens").version;
  EXPECT_TRUE(contains(r.output,
                       "migrated tokens from format 1 to 3; content version "
                       "5418a01a453035ea -> " +
                           version))
      << r.output;
  std::string expected = tokens_shown;
  expected.replace(expected.find("5418a01a453035ea"), 16, version);
  EXPECT_EQ(loom_in(show_tokens, dir.path()).output, expected);
  EXPECT_EQ(loom_in({"data", "verify", "tokens"}, dir.path()).exit_code, 0);

  // The same JSON lines built by this Loom give the same content version as format 1 did.
  fs::copy(kFormat1 / "episodes.jsonl", dir / "episodes.jsonl");
  r = loom_in({"data", "build", "jsonl", "--input", "episodes.jsonl", "--out", "rebuilt"},
              dir.path());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(read_manifest(dir / "rebuilt").version, "f9b2ba64c56eac6c");
}

// A tmux server of its own: a session running `argv` in a 200 x 50 pane.
class Tmux {
 public:
  explicit Tmux(const std::vector<std::string>& argv)
      : socket_("loom-test-" + std::to_string(::getpid()) + "-" + std::to_string(next_++)) {
    std::string command;
    for (const std::string& a : argv) command += (command.empty() ? "" : " ") + a;
    run({"new-session", "-d", "-s", "main", "-x", "200", "-y", "50", command});
  }
  ~Tmux() { run({"kill-server"}, /*check=*/false); }  // gone already after q
  std::string capture() { return run({"capture-pane", "-p", "-t", "main"}); }
  void keys(const std::vector<std::string>& keys) {
    std::vector<std::string> args = {"send-keys", "-t", "main"};
    args.insert(args.end(), keys.begin(), keys.end());
    run(args);
  }
  bool alive() { return run({"has-session", "-t", "main"}, /*check=*/false) == "ok"; }

 private:
  std::string run(std::vector<std::string> args, bool check = true) {
    args.insert(args.begin(), {"tmux", "-L", socket_});
    TempDir scratch;
    const ProgramResult r = testing::run_program(args, scratch.path());
    if (!check) return r.exit_code == 0 ? "ok" : "no";
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return r.output;
  }
  static inline int next_ = 0;
  std::string socket_;
};

// The lines of `text` up to (not including) the first empty line.
std::string first_block(const std::string& text) {
  const size_t end = text.find("\n\n");
  return text.substr(0, end == std::string::npos ? text.size() : end + 1);
}

TEST(DataCli, InteractiveShowStepsThroughStepsAndRanksInTmux) {
  if (std::system("command -v tmux >/dev/null") != 0) GTEST_SKIP() << "needs tmux";
  TempDir dir;
  const fs::path ds = dir / "tokens";
  {
    TokenDatasetWriter writer(ds, {.vocab_size = 300});
    for (int d = 0; d < 30; ++d) {
      std::vector<uint32_t> doc(40);
      for (size_t i = 0; i < doc.size(); ++i)
        doc[i] = static_cast<uint32_t>((d * 41 + i * 7) % 300);
      writer.add_document(doc);
    }
    writer.finish();
  }
  const std::vector<std::string> position = {"--world", "2",      "--batch", "2",       "--seq-len",
                                             "9",       "--seed", "4",       "--color", "never"};
  std::vector<std::string> argv = {LOOM_BINARY_DIR "/tools/loom/loom", "data", "show", ds.string(),
                                   "--interactive"};
  argv.insert(argv.end(), position.begin(), position.end());
  Tmux tmux(argv);
  // After each key, the pane shows exactly what `loom data show` prints for that rank and
  // step, and the dataset indices the Reader yields there.
  const std::vector<std::tuple<std::vector<std::string>, int, uint64_t>> script = {
      {{}, 0, 0},       {{"Right"}, 0, 1}, {{"n", "n"}, 0, 3},
      {{"Down"}, 1, 3}, {{"Left"}, 1, 2},  {{"g", "1", "7", "Enter"}, 1, 17},
      {{"k"}, 0, 17},   {{"Up"}, 0, 17}};
  for (const auto& [keys, rank, step] : script) {
    if (!keys.empty()) tmux.keys(keys);
    std::vector<std::string> show = {"data",
                                     "show",
                                     ds.string(),
                                     "--rank",
                                     std::to_string(rank),
                                     "--step",
                                     std::to_string(step)};
    show.insert(show.end(), position.begin(), position.end());
    const ProgramResult expected = loom(show, dir);
    ASSERT_EQ(expected.exit_code, 0) << expected.output;
    std::string pane;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(15);
    while ((pane = first_block(tmux.capture())) != expected.output &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    EXPECT_EQ(pane, expected.output) << "rank " << rank << " step " << step;
    Reader reader(
        ds,
        {.batch_size = 2, .seq_len = 9, .seed = 4, .rank = rank, .world_size = 2, .prefetch = 0});
    const uint64_t steps = reader.steps_per_epoch();
    reader.restore({reader.manifest().version, 4, step / steps, step % steps * 4});
    const Batch batch = reader.next();
    for (size_t r = 0; r < batch.indices.size(); ++r) {
      EXPECT_TRUE(contains(pane, "sample " + std::to_string(r) + ": dataset index " +
                                     std::to_string(batch.indices[r]) + "\n"))
          << pane;
    }
  }
  EXPECT_TRUE(contains(tmux.capture(), "rank 0/2 step 17  ")) << "the status line";
  tmux.keys({"q"});
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (tmux.alive() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_FALSE(tmux.alive()) << "q quits";

  // Without a terminal it says what to do instead.
  std::vector<std::string> piped = {"data", "show", ds.string(), "--interactive"};
  const ProgramResult no_tty = loom(piped, dir);
  EXPECT_EQ(no_tty.exit_code, 2) << no_tty.output;
  EXPECT_TRUE(contains(no_tty.output, "--interactive needs a terminal")) << no_tty.output;
}

}  // namespace
}  // namespace loom::data

namespace loom::data {
namespace {

// `loom data show` on the new record kinds: an episode (sparklines, the first steps with their
// returns), a transition, and a multimodal sequence with its images marked in place and drawn.
// The values are small and exact in binary, so the whole output is compared.
// What `loom data show` printed from its first sample on (the whole output when it has none).
std::string from_sample(const std::string& output) {
  const size_t at = output.find("sample 0");
  return at == std::string::npos ? output : output.substr(at);
}

TEST(DataCli, ShowPrintsEpisodesTransitionsAndSequencesWithImages) {
  TempDir dir;
  {
    RecordDatasetWriter writer(dir / "episodes",
                               {{"observation", FieldType::kTensor, "float32", {}, {}, true},
                                {"action", FieldType::kTensor, "int64", {}, {}, true},
                                {"reward", FieldType::kTensor, "float32", {}, {}, true},
                                {"done", FieldType::kTensor, "uint8", {}, {}, true}},
                               {.layout = RecordLayout::kEpisodes});
    const std::vector<float> obs = {0.5, 1, 1.5, 2, 2.5, 3}, reward = {1, 0, 2};
    const std::vector<int64_t> action = {2, 0, 1};
    const std::vector<uint8_t> done = {0, 0, 1};
    writer.add(Record()
                   .tensor(obs.data(), 24, {3, 2})
                   .tensor(action.data(), 24, {3})
                   .tensor(reward.data(), 12, {3})
                   .tensor(done.data(), 3, {3}));
    writer.finish();
  }
  const std::string episodes = (dir / "episodes").string();
  ProgramResult r = loom({"data", "show", episodes, "--batch", "1", "--color", "never"}, dir);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(from_sample(r.output),
            "sample 0: dataset index 0\n"
            "  episode: 3 steps, total reward 3, return 2.9602\n"
            "    reward \u2585\u2581\u2588\n"
            "    return \u2588\u2581\u2581\n"
            "    step  action  reward  done  return\n"
            "    0  2  1  0  2.9602\n"
            "    1  0  0  0  1.98\n"
            "    2  1  2  1  2\n"
            "  observation: float32 [3, 2]\n"
            "    0.5 1 1.5 2 2.5 3 \n"
            "  action: int64 [3]\n"
            "    2 0 1 \n"
            "  reward: float32 [3]\n"
            "    1 0 2 \n"
            "  done: uint8 [3]\n"
            "    0 0 1 \n");
  r = loom({"data", "show", episodes, "--batch", "1", "--step", "1", "--sampling", "transition",
            "--color", "never"},
           dir);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(from_sample(r.output),
            "sample 0: dataset index 1\n"
            "  episode 0, step 1: return 1.98\n"
            "  observation: float32 [2]\n"
            "    1.5 2 \n"
            "  action: int64 []\n"
            "    0 \n"
            "  reward: float32 []\n"
            "    0 \n"
            "  done: uint8 []\n"
            "    0 \n");

  // A sequence of 3 tokens with a 2x3 image (raw: exact pixels) before its second token.
  {
    RecordDatasetWriter writer(dir / "multimodal",
                               {{"tokens", FieldType::kTensor, "int64", {}, {}, true},
                                {"images", FieldType::kImages},
                                {"image_positions", FieldType::kTensor, "int64", {}, {}, true}},
                               {.layout = RecordLayout::kMultimodal});
    const std::vector<int64_t> tokens = {5, 6, 7}, positions = {1};
    const uint8_t pixels[] = {0,   0, 0, 255, 255, 255, 128, 128, 128,
                              255, 0, 0, 0,   255, 0,   0,   0,   255};
    writer.add(Record()
                   .tensor(tokens.data(), 24, {3})
                   .images({image::encode_raw(pixels, 2, 3, 3)})
                   .tensor(positions.data(), 8, {1}));
    writer.finish();
  }
  r = loom({"data", "show", (dir / "multimodal").string(), "--batch", "1", "--color", "never"},
           dir);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  // The image's two rows share one line: luma of black over red ".", white over green "#",
  // gray over blue ":".
  EXPECT_EQ(from_sample(r.output),
            "sample 0: dataset index 0\n"
            "  sequence: 3 tokens, 1 image\n"
            "    5 <image 0 2x3> 6 7 \n"
            "    image 0 [2, 3, 3]\n"
            "    .#:\n");
}

}  // namespace
}  // namespace loom::data

namespace loom::data {
namespace {

// The sample indices `loom data show` printed, in order.
std::vector<uint64_t> shown_indices(const std::string& output) {
  std::vector<uint64_t> out;
  const std::string key = ": dataset index ";
  for (size_t at = output.find(key); at != std::string::npos; at = output.find(key, at + 1)) {
    out.push_back(std::stoull(output.substr(at + key.size())));
  }
  return out;
}

// A real run (the train probe under `loom run`, 2 ranks, checkpoints every 4 steps) is shown
// from its run directory alone: the dataset and reader options it recorded, starting at the
// step its newest checkpoint resumes at. The samples are those a Reader restored from that
// checkpoint's reader state yields, rank by rank.
TEST(DataCli, ShowAndServeARunDirectoryFromItsNewestCheckpoint) {
  if (!LOOM_WITH_GRPC) GTEST_SKIP() << "needs `loom run` (LOOM_WITH_GRPC=ON)";
  TempDir dir;
  {
    TokenDatasetWriter writer(dir / "data", {.vocab_size = 64});
    for (int d = 0; d < 60; ++d) {
      std::vector<uint32_t> doc;
      for (int i = 0; i < 50; ++i) doc.push_back(static_cast<uint32_t>((i * 5 + d) % 64));
      writer.add_document(doc);
    }
    writer.finish();
  }
  const std::string run = (dir / "run").string();
  ProgramResult r = testing::run_program(
      {LOOM_BINARY_DIR "/tools/loom/loom", "run", "--nproc-per-node", "2", "--run-dir", run, "--",
       LOOM_BINARY_DIR "/tests/loom_train_probe", "--probe.data=" + (dir / "data").string(),
       "--probe.batch=3", "--probe.seq_len=8", "--run.threads=1", "--train.steps=10",
       "--train.checkpoint_every=4", "--train.log_every=100"},
      dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.output;

  // The newest checkpoint (the last step's, 10) and where its reader stands: what a resume
  // reads next.
  const fs::path ckpt_dir = dir / "run" / "ckpt";
  ASSERT_EQ(ckpt::committed_steps(ckpt_dir), (std::vector<int64_t>{4, 8, 10}));
  const std::string blob = ckpt::describe_step(ckpt_dir, 10).blobs.at("reader");
  for (int rank = 0; rank < 2; ++rank) {
    Reader reader(dir / "data", {.batch_size = 3,
                                 .seq_len = 8,
                                 .seed = 1234,  // the probe's rt.seed(): run.seed's default
                                 .rank = rank,
                                 .world_size = 2,
                                 .prefetch = 0});
    reader.restore_json(blob);
    const Batch next = reader.next();
    r = loom({"data", "show", run, "--rank", std::to_string(rank), "--color", "never"}, dir);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(r.output.substr(0, r.output.find('\n')),
              "run " + run + ": reader 0; its newest checkpoint resumes at step 10")
        << r.output;
    EXPECT_EQ(shown_indices(r.output), next.indices) << r.output;
    EXPECT_NE(r.output.find("rank " + std::to_string(rank) + " of 2, step 10 = epoch 0 step 10"),
              std::string::npos)
        << r.output;
  }
  // Another step of the same run: the Reader at that position.
  r = loom({"data", "show", run, "--rank", "1", "--step", "3", "--color", "never"}, dir);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  Reader reader(dir / "data", {.batch_size = 3,
                               .seq_len = 8,
                               .seed = 1234,  // the probe's rt.seed(): run.seed's default
                               .rank = 1,
                               .world_size = 2,
                               .prefetch = 0});
  for (int s = 0; s < 3; ++s) reader.next();
  EXPECT_EQ(shown_indices(r.output), reader.next().indices);

  // The run's options are the run's: one given again is refused, as is a reader it lacks.
  r = loom({"data", "show", run, "--batch", "4"}, dir);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.output, "error: --batch does not apply to a run directory: " + run +
                          " shows the samples with the run's own reader options (readers.json)\n");
  r = loom({"data", "show", run, "--reader", "1"}, dir);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.output, "error: --reader 1: " + run +
                          " opened 1 dataset (0: " + (dir / "data").string() + ")\n");

  // The browser view's dataset summary says the same.
  const testing::DataServer served(dir, {run});
  const auto answer = served.get("/api/dataset");
  ASSERT_TRUE(answer);
  const nlohmann::json info = nlohmann::json::parse(answer->body);
  EXPECT_EQ(info["run"], run);
  EXPECT_EQ(info["resume_step"], 10);
  EXPECT_EQ(info["world"], 2);
  EXPECT_EQ(info["batch"], 3);
  EXPECT_EQ(info["seq_len"], 8);
}

// A run that reads a mixture (Runtime::open_mixture) is shown from its run directory as well:
// each sample names its source, and the statistics view gives each source's realised share of
// the samples drawn up to a step beside its configured weight. Both are compared with a Mixture
// of the same sources stepped with next().
TEST(DataCli, ShowAndServeARunsMixtureWithItsRealisedWeights) {
  TempDir dir;
  std::vector<fs::path> datasets;
  for (int d = 0; d < 2; ++d) {
    datasets.push_back(dir / ("source" + std::to_string(d)));
    TokenDatasetWriter writer(datasets.back(), {.vocab_size = 64});
    for (int doc = 0; doc < 20 + 20 * d; ++doc) {
      writer.add_document(std::vector<uint32_t>(30, static_cast<uint32_t>(doc % 64)));
    }
    writer.finish();
  }
  const std::vector<MixtureSource> sources = {
      {.dataset = datasets[0], .weight = 3, .epochs = SourceEpochs::kStop},
      {.dataset = datasets[1], .weight = 1}};
  const MixtureOptions options{.batch_size = 3, .seq_len = 8, .seed = 4};
  const fs::path run = dir / "run";
  {
    const std::vector<std::string> args = {"prog", "--run.dir=" + run.string(), "--log.level=warn"};
    std::vector<const char*> argv;
    for (const auto& a : args) argv.push_back(a.c_str());
    Runtime rt = Runtime::init(
        Config::from_args(Runtime::schema(), static_cast<int>(argv.size()), argv.data()),
        Topology{}, /*configure_process=*/false);
    rt.open_mixture(sources, options);
  }

  // Step 3: the batch a Mixture gives after 3 next() calls, source by source.
  Mixture expected(sources, options);
  for (int s = 0; s < 3; ++s) expected.next();
  const Batch batch = expected.next();
  ProgramResult r = loom({"data", "show", run.string(), "--step", "3", "--color", "never"}, dir);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.substr(0, r.output.find('\n')),
            "run " + run.string() + ": reader 0; no checkpoint yet, so from step 0");
  std::string want = "mixture of 2 datasets: 0: " + datasets[0].string() +
                     " (weight 3, one epoch), 1: " + datasets[1].string() +
                     " (weight 1)\nrank 0 of 1, step 3, seed 4, 3 samples per rank\n";
  for (size_t k = 0; k < 3; ++k) {
    want += "sample " + std::to_string(k) + ": source " + std::to_string(batch.sources[k]) +
            ", dataset index " + std::to_string(batch.indices[k]) + "\n";
  }
  std::string shown;  // the header and each sample's line, without the tokens
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("mixture", 0) == 0 || line.rfind("rank", 0) == 0 ||
        line.rfind("sample", 0) == 0) {
      shown += line + "\n";
    }
  }
  EXPECT_EQ(shown, want) << r.output;

  // The browser view: the batch's sources, and the realised weights up to step 5 (6 steps).
  {
    const testing::DataServer served(dir, {run.string()});
    const auto answer = served.get("/api/batch?rank=0&step=3");
    ASSERT_TRUE(answer);
    const nlohmann::json b = nlohmann::json::parse(answer->body);
    for (size_t k = 0; k < 3; ++k) {
      EXPECT_EQ(b["samples"][k]["source"], batch.sources[k]) << k;
      EXPECT_EQ(b["samples"][k]["source_name"], datasets[batch.sources[k]].string()) << k;
      EXPECT_EQ(b["samples"][k]["index"], batch.indices[k]) << k;
    }
    const auto res = served.get("/api/stats?step=5");
    ASSERT_TRUE(res);
    Mixture six(sources, options);
    for (int s = 0; s < 6; ++s) six.next();
    const MixtureState state = six.state();
    nlohmann::json weights = nlohmann::json::array();
    for (size_t k = 0; k < 2; ++k) {
      weights.push_back({{"dataset", datasets[k].string()},
                         {"weight", sources[k].weight},
                         {"one_epoch", k == 0},
                         {"share", sources[k].weight / 4.0},
                         {"drawn", state.sources[k].drawn},
                         {"realised", static_cast<double>(state.sources[k].drawn) / 18.0}});
    }
    EXPECT_EQ(nlohmann::json::parse(res->body),
              (nlohmann::json{{"steps", 6}, {"samples", 18}, {"mixture", weights}}));
    if (testing::Browser::available()) {
      testing::Browser browser;
      browser.open(served.url("/?view=stats&step=5"));
      ASSERT_TRUE(
          browser.wait_for("document.body.dataset.ready === '1'", std::chrono::seconds(20)));
      browser.screenshot(fs::path(LOOM_BINARY_DIR "/test-artifacts/data_serve") /
                         "mixture_stats.png");
      const nlohmann::json rows = nlohmann::json::parse(browser.run(R"JS(
      return [...document.querySelectorAll('.stat[data-field=mixture] .row')].map(
          r => [r.dataset.key, Number(r.dataset.count)]);)JS"));
      EXPECT_EQ(rows, nlohmann::json::parse("[[\"" + datasets[0].string() + "\", " +
                                            std::to_string(state.sources[0].drawn) + "], [\"" +
                                            datasets[1].string() + "\", " +
                                            std::to_string(state.sources[1].drawn) + "]]"));
    }
  }

  // A source rebuilt since the run: its samples are not the run's any more, and both viewers
  // say so, naming the two versions.
  const std::string before = Reader(datasets[1], {.seq_len = 8}).manifest().version;
  fs::remove_all(datasets[1]);
  {
    TokenDatasetWriter writer(datasets[1], {.vocab_size = 64});
    writer.add_document(std::vector<uint32_t>(100, 1));
    writer.finish();
  }
  const std::string after = Reader(datasets[1], {.seq_len = 8}).manifest().version;
  for (const char* command : {"show", "serve"}) {
    r = loom({"data", command, run.string()}, dir);
    EXPECT_EQ(r.exit_code, 2) << command;
    EXPECT_EQ(r.output, "error: " + datasets[1].string() + " is now version " + after +
                            " but the run read version " + before +
                            "; the run's samples are not there any more\n")
        << command;
  }
}

}  // namespace
}  // namespace loom::data

// `loom data build images|webdataset|jsonl --layout` end to end: inputs made here (PNG and JPEG
// files from the image codec, tar files from a small ustar writer), built by the `loom` tool and
// read back whole through data::Reader, against the sources; and each importer's errors, exactly.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "data/image_codec.h"
#include "harness/harness.h"
#include "loom/data/dataset.h"
#include "loom/data/reader.h"
#include "loom/data/registry.h"
#include "util/files.h"
#include "util/hash.h"
#include "util/subprocess.h"

namespace loom::data {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::ProgramResult;
using testing::TempDir;

// `loom` run in `cwd`.
ProgramResult loom_in(std::vector<std::string> args, const fs::path& cwd) {
  args.insert(args.begin(), LOOM_BINARY_DIR "/tools/loom/loom");
  const fs::path out = cwd / "program_output.txt";
  fs::remove(out);  // the output is appended to
  auto status = util::Subprocess::spawn({.argv = args, .output = out, .cwd = cwd}).wait();
  return {status.code, status.signal, util::read_file(out)};
}

// The last line of a program's output: its error, after any progress lines.
std::string last_line(const std::string& output) {
  const size_t end = output.size() - (output.empty() || output.back() != '\n' ? 0 : 1);
  const size_t start = output.rfind('\n', end == 0 ? 0 : end - 1);
  return output.substr(start == std::string::npos ? 0 : start + 1, end - start - 1);
}

void write(const fs::path& path, const std::string& bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
}

// An image of a pattern that differs with `seed`, encoded.
std::string png(int64_t h, int64_t w, int64_t c, int seed) {
  std::vector<uint8_t> pixels(static_cast<size_t>(h * w * c));
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<uint8_t>(i * 37 + seed * 11);
  return image::encode_png(pixels.data(), h, w, c);
}
std::string jpeg(int64_t h, int64_t w, int seed) {
  std::vector<uint8_t> pixels(static_cast<size_t>(h * w * 3));
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<uint8_t>(i * 5 + seed * 50);
  return image::encode_jpeg(pixels.data(), h, w, 3);
}

// The pixels the Reader must give for an encoded image: uint8 [H, W, C].
at::Tensor decoded(const std::string& encoded) {
  const auto* data = reinterpret_cast<const uint8_t*>(encoded.data());
  image::Info info;
  EXPECT_EQ(image::probe(data, encoded.size(), &info), "");
  at::Tensor t = at::empty({info.height, info.width, info.channels}, at::kByte);
  EXPECT_EQ(image::decode(data, encoded.size(), info, t.data_ptr<uint8_t>()), "");
  return t;
}

// Images padded as a batch holds them: zeros [rows, slots, H, W, C] (or [rows, H, W, C] when
// slots < 0) with each image at the top left of its place, and its [h, w] in the sizes.
struct PaddedImages {
  at::Tensor pixels, sizes, mask;
};
PaddedImages padded(const std::vector<std::vector<std::string>>& rows, bool list) {
  int64_t slots = 0, h = 0, w = 0, c = 0;
  for (const auto& row : rows) {
    slots = std::max<int64_t>(slots, static_cast<int64_t>(row.size()));
    for (const std::string& e : row) {
      const at::Tensor t = decoded(e);
      h = std::max(h, t.size(0));
      w = std::max(w, t.size(1));
      c = t.size(2);
    }
  }
  const auto n = static_cast<int64_t>(rows.size());
  PaddedImages p{at::zeros({n, slots, h, w, c}, at::kByte), at::zeros({n, slots, 2}, at::kLong),
                 at::zeros({n, slots}, at::kBool)};
  for (int64_t r = 0; r < n; ++r) {
    for (size_t k = 0; k < rows[static_cast<size_t>(r)].size(); ++k) {
      const at::Tensor t = decoded(rows[static_cast<size_t>(r)][k]);
      const auto s = static_cast<int64_t>(k);
      p.pixels[r][s].slice(0, 0, t.size(0)).slice(1, 0, t.size(1)).copy_(t);
      p.sizes[r][s][0] = t.size(0);
      p.sizes[r][s][1] = t.size(1);
      p.mask[r][s] = true;
    }
  }
  if (!list) {
    p.pixels = p.pixels.squeeze(1);
    p.sizes = p.sizes.squeeze(1);
  }
  return p;
}

std::vector<uint64_t> all_indices(uint64_t n) {
  std::vector<uint64_t> indices(n);
  for (uint64_t i = 0; i < n; ++i) indices[i] = i;
  return indices;
}

// ---- images ----

TEST(DataImport, ImageFolderRoundTrips) {
  TempDir dir;
  // Classes "bird", "cat", "dog" (created out of order); a nested folder in "dog"; PNG and JPEG
  // files, upper-case extensions included.
  const std::vector<std::pair<std::string, std::string>> files = {
      {"dog/b.png", png(5, 4, 3, 1)},
      {"cat/z.jpeg", jpeg(8, 6, 2)},
      {"cat/a.png", png(3, 7, 3, 3)},
      {"bird/1.JPG", jpeg(4, 4, 4)},
      {"dog/puppies/a.PNG", png(2, 2, 3, 5)}};
  for (const auto& [path, bytes] : files) write(dir / "photos" / path, bytes);
  // In sorted path order, classes sorted by name.
  const std::vector<std::tuple<std::string, int64_t>> expected = {{"bird/1.JPG", 0},
                                                                  {"cat/a.png", 1},
                                                                  {"cat/z.jpeg", 1},
                                                                  {"dog/b.png", 2},
                                                                  {"dog/puppies/a.PNG", 2}};

  ProgramResult built = loom_in({"data", "build", "images", "photos", "--out", "ds"}, dir.path());
  ASSERT_EQ(built.exit_code, 0) << built.output;
  EXPECT_TRUE(testing::contains(built.output, "writing records: 5/5 images")) << built.output;
  const Manifest m = read_manifest(dir / "ds");
  ASSERT_EQ(m.schema.size(), 3u);
  EXPECT_EQ(m.schema[0].name, "image");
  EXPECT_EQ(m.schema[0].type, FieldType::kImage);
  EXPECT_EQ(m.schema[1].name, "label");
  EXPECT_EQ(m.schema[1].classes, (std::vector<std::string>{"bird", "cat", "dog"}));
  EXPECT_EQ(m.schema[2].name, "path");
  EXPECT_EQ(m.schema[2].type, FieldType::kText);

  Reader reader(dir / "ds", {});
  ASSERT_EQ(reader.num_samples(), expected.size());
  const Batch b = reader.read(all_indices(expected.size()));
  std::vector<std::vector<std::string>> sources;
  std::vector<int64_t> labels;
  std::vector<std::string> paths;
  for (const auto& [path, label] : expected) {
    sources.push_back({util::read_file(dir / "photos" / path)});
    labels.push_back(label);
    paths.push_back(path);
  }
  const PaddedImages want = padded(sources, false);
  EXPECT_TRUE(b["image"].equal(want.pixels));
  EXPECT_TRUE(b["image_size"].equal(want.sizes)) << b["image_size"];
  EXPECT_TRUE(b["label"].equal(at::tensor(labels, at::kLong))) << b["label"];
  EXPECT_EQ(b.strings.at("path"), paths);
  EXPECT_TRUE(verify_dataset(dir / "ds").ok);

  // The lineage: every image file read, with its hash.
  const Lineage lineage = read_build_lineage((dir / "ds").string());
  EXPECT_EQ(lineage.command, "loom data build images photos --out ds");
  ASSERT_EQ(lineage.sources.size(), expected.size());
  EXPECT_EQ(lineage.sources[4].path, (dir / "photos/dog/puppies/a.PNG").string());
  EXPECT_EQ(lineage.sources[4].xxhash64, util::xxh64(sources[4][0]));
}

TEST(DataImport, ImageFolderErrorsNameTheFile) {
  TempDir dir;
  write(dir / "photos/cat/a.png", png(2, 2, 1, 0));
  auto error = [&](const std::string& out) {
    ProgramResult r = loom_in({"data", "build", "images", "photos", "--out", out}, dir.path());
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_FALSE(fs::exists(dir / out / "manifest.json"));
    return last_line(r.output);
  };
  const std::string expected =
      "; expected photos/<class>/<image>.png, .jpg or .jpeg, a folder per class";
  write(dir / "photos/notes.txt", "x");
  EXPECT_EQ(error("a"), "error: photos/notes.txt is not in a class folder" + expected);
  fs::remove(dir / "photos/notes.txt");
  write(dir / "photos/cat/b.gif", "GIF89a");
  EXPECT_EQ(error("b"), "error: photos/cat/b.gif is not a .png, .jpg or .jpeg file" + expected);
  fs::remove(dir / "photos/cat/b.gif");
  write(dir / "photos/cat/b.png", "not an image");
  EXPECT_EQ(error("c"),
            "error: photos/cat/b.png: record 1: field 'image': not a PNG, JPEG or Loom raw image "
            "(first bytes 6e 6f 74 20)");
}

// ---- webdataset ----

// Tar files as GNU tar writes them: a ustar header per member, a GNU long-name member ('L')
// before one whose path is over 100 bytes, data padded to 512 bytes, two zero blocks at the end;
// or with a pax header ('x') that gives the path, as POSIX tar writes one.
class TarWriter {
 public:
  // Adds a regular file; returns the byte offset of its header.
  size_t add(const std::string& path, const std::string& data) {
    if (path.size() > 100) {
      header("././@LongLink", path.size() + 1, 'L');
      append(path + '\0');
    }
    const size_t at = bytes_.size();
    header(path.substr(0, 100), data.size(), '0');
    append(data);
    return at;
  }
  // A regular file whose header's name is wrong, and right in the pax header before it.
  void add_pax(const std::string& path, const std::string& data) {
    const std::string record = " path=" + path + "\n";  // "LENGTH path=...\n", LENGTH counting all
    size_t length = record.size() + 1;
    while (std::to_string(length).size() + record.size() != length) ++length;
    const std::string pax = std::to_string(length) + record;
    header("PaxHeaders/wrong", pax.size(), 'x');
    append(pax);
    header("wrong", data.size(), '0');
    append(data);
  }
  void directory(const std::string& path) { header(path, 0, '5'); }
  std::string finish() const { return bytes_ + std::string(1024, '\0'); }

 private:
  void header(const std::string& name, size_t size, char type) {
    char h[512] = {};
    std::memcpy(h, name.data(), name.size());
    std::snprintf(h + 100, 8, "%07o", 0644u);
    std::snprintf(h + 108, 8, "%07o", 0u);
    std::snprintf(h + 116, 8, "%07o", 0u);
    std::snprintf(h + 124, 12, "%011zo", size);
    std::snprintf(h + 136, 12, "%011o", 0u);
    std::memset(h + 148, ' ', 8);
    h[156] = type;
    std::memcpy(h + 257,
                "ustar\0"
                "00",
                8);
    unsigned sum = 0;
    for (char c : h) sum += static_cast<unsigned char>(c);
    std::snprintf(h + 148, 7, "%06o", sum);  // six digits and a NUL; the space stays
    bytes_.append(h, 512);
  }
  void append(const std::string& data) {
    bytes_ += data;
    bytes_.append((512 - data.size() % 512) % 512, '\0');
  }
  std::string bytes_;
};

struct WdsSample {
  std::string key, jpg, cls, txt, json;
};

std::vector<WdsSample> samples(const std::string& prefix, int n, int seed) {
  std::vector<WdsSample> out;
  for (int i = 0; i < n; ++i) {
    char key[16];
    std::snprintf(key, sizeof key, "%04d", i);
    out.push_back({prefix + key, jpeg(3 + i, 5 + seed, seed * 10 + i),
                   " " + std::to_string(seed * 10 + i) + "\n", "caption " + std::to_string(i),
                   json{{"seed", seed}, {"i", i}}.dump()});
  }
  return out;
}

// Members in the order jpg, cls, txt, json (not sorted: the order within a sample is free);
// with `pax`, each txt member's path is in a pax header.
std::string tar_of(const std::vector<WdsSample>& samples, bool pax = false) {
  TarWriter tar;
  tar.directory("d/");
  for (const WdsSample& s : samples) {
    tar.add(s.key + ".jpg", s.jpg);
    tar.add(s.key + ".cls", s.cls);
    if (pax) {
      tar.add_pax(s.key + ".txt", s.txt);
    } else {
      tar.add(s.key + ".txt", s.txt);
    }
    tar.add(s.key + ".json", s.json);
  }
  return tar.finish();
}

TEST(DataImport, WebDatasetRoundTrips) {
  TempDir dir;
  std::vector<WdsSample> a = samples("d/", 3, 1), b = samples("e/", 2, 2);
  a[1].key = "d/" + std::string(120, 'k') + "/0001";  // a GNU long name
  write(dir / "shards/a.tar", tar_of(a));
  write(dir / "shards/b.tar", tar_of(b, true));
  ProgramResult built = loom_in({"data", "build", "webdataset", "--input", "shards/a.tar",
                                 "--input", "shards/b.tar", "--out", "ds"},
                                dir.path());
  ASSERT_EQ(built.exit_code, 0) << built.output;

  const Manifest m = read_manifest(dir / "ds");
  std::vector<std::pair<std::string, FieldType>> schema;
  for (const Field& f : m.schema) schema.emplace_back(f.name, f.type);
  EXPECT_EQ(schema, (std::vector<std::pair<std::string, FieldType>>{{"cls", FieldType::kInt},
                                                                    {"jpg", FieldType::kImage},
                                                                    {"json", FieldType::kText},
                                                                    {"txt", FieldType::kText}}));
  std::vector<WdsSample> all = a;
  all.insert(all.end(), b.begin(), b.end());
  Reader reader(dir / "ds", {});
  ASSERT_EQ(reader.num_samples(), all.size());
  const Batch batch = reader.read(all_indices(all.size()));
  std::vector<std::vector<std::string>> jpgs;
  std::vector<int64_t> classes;
  std::vector<std::string> txts, jsons;
  for (const WdsSample& s : all) {
    jpgs.push_back({s.jpg});
    classes.push_back(std::stoll(s.cls));
    txts.push_back(s.txt);
    jsons.push_back(s.json);
  }
  const PaddedImages want = padded(jpgs, false);
  EXPECT_TRUE(batch["jpg"].equal(want.pixels));
  EXPECT_TRUE(batch["jpg_size"].equal(want.sizes)) << batch["jpg_size"];
  EXPECT_TRUE(batch["cls"].equal(at::tensor(classes, at::kLong))) << batch["cls"];
  EXPECT_EQ(batch.strings.at("txt"), txts);
  EXPECT_EQ(batch.strings.at("json"), jsons);
  EXPECT_TRUE(verify_dataset(dir / "ds").ok);

  // The lineage hashes each tar file as it streams by.
  const Lineage lineage = read_build_lineage((dir / "ds").string());
  ASSERT_EQ(lineage.sources.size(), 2u);
  EXPECT_EQ(lineage.sources[1].path, (dir / "shards/b.tar").string());
  EXPECT_EQ(lineage.sources[1].bytes, fs::file_size(dir / "shards/b.tar"));
  EXPECT_EQ(lineage.sources[1].xxhash64, util::xxh64(util::read_file(dir / "shards/b.tar")));
}

TEST(DataImport, WebDatasetErrorsNameTheTarAndTheMember) {
  TempDir dir;
  auto error = [&](const std::string& tar) {
    ProgramResult r =
        loom_in({"data", "build", "webdataset", "--input", "shards/" + tar, "--out", tar + ".ds"},
                dir.path());
    EXPECT_EQ(r.exit_code, 2) << r.output;
    return last_line(r.output);
  };
  const std::vector<WdsSample> good = samples("d/", 4, 1);

  // A sample without its label; a sample with a member the first lacks.
  TarWriter unlabelled;
  for (const WdsSample& s : good) {
    unlabelled.add(s.key + ".jpg", s.jpg);
    if (s.key != "d/0003") unlabelled.add(s.key + ".cls", s.cls);
  }
  write(dir / "shards/unlabelled.tar", unlabelled.finish());
  EXPECT_EQ(error("unlabelled.tar"),
            "error: shards/unlabelled.tar: sample 'd/0003' has jpg but no cls; every sample needs "
            "the members of the first: cls, jpg");
  TarWriter extra;
  for (const WdsSample& s : good) {
    extra.add(s.key + ".jpg", s.jpg);
    extra.add(s.key + ".cls", s.cls);
    if (s.key == "d/0002") extra.add(s.key + ".seg.png", png(2, 2, 1, 0));
  }
  write(dir / "shards/extra.tar", extra.finish());
  EXPECT_EQ(error("extra.tar"),
            "error: shards/extra.tar: sample 'd/0002' has cls, jpg, seg.png but the first sample "
            "has no seg.png; every sample needs the members of the first: cls, jpg");

  // A header that fails its checksum: one byte of member d/0001.cls's mtime changed.
  TarWriter corrupt;
  size_t header = 0;
  for (const WdsSample& s : good) {
    corrupt.add(s.key + ".jpg", s.jpg);
    const size_t at = corrupt.add(s.key + ".cls", s.cls);
    if (s.key == "d/0001") header = at;
  }
  std::string bytes = corrupt.finish();
  const unsigned recorded = std::stoul(bytes.substr(header + 148, 6), nullptr, 8);
  bytes[header + 140] = '1';  // was '0'
  write(dir / "shards/corrupt.tar", bytes);
  EXPECT_EQ(error("corrupt.tar"),
            "error: shards/corrupt.tar: member 'd/0001.cls': the header at byte " +
                std::to_string(header) + " fails its checksum (it records " +
                std::to_string(recorded) + ", its bytes sum to " + std::to_string(recorded + 1) +
                "): the file is corrupt");

  // A truncated tar: it ends inside a member's data.
  const std::string whole = tar_of(good);
  write(dir / "shards/cut.tar", whole.substr(0, 512 * 2 + 100));  // d/ and 100 bytes of a jpg
  EXPECT_EQ(error("cut.tar"),
            "error: shards/cut.tar: member 'd/0000.jpg': truncated: its header "
            "says " +
                std::to_string(good[0].jpg.size()) + " bytes but only 100 follow");

  // A .cls that is not a number; a PNG that does not decode.
  TarWriter named;
  named.add("d/0000.png", png(2, 3, 3, 0));
  named.add("d/0000.cls", "cat");
  write(dir / "shards/named.tar", named.finish());
  EXPECT_EQ(error("named.tar"),
            "error: shards/named.tar: member 'd/0000.cls' is not an integer; a .cls member holds a "
            "class number in decimal");
  TarWriter broken;
  const std::string image = png(4, 4, 3, 0);
  broken.add("d/0000.png", image);
  broken.add("d/0000.cls", "0");
  broken.add("d/0001.png", image.substr(0, image.size() - 20));
  broken.add("d/0001.cls", "1");
  write(dir / "shards/broken.tar", broken.finish());
  const std::string message = error("broken.tar");
  EXPECT_EQ(
      message.rfind("error: shards/broken.tar: member 'd/0001.png': record 1: field 'png': ", 0),
      0u)
      << message;
}

// ---- jsonl --layout episodes ----

// A JSON value as a tensor of `dtype` (booleans as 0 and 1), for comparison with a batch's.
at::Tensor tensor_of(const json& value, at::ScalarType dtype) {
  std::vector<int64_t> shape;
  for (const json* v = &value; v->is_array(); v = &v->at(0)) {
    shape.push_back(static_cast<int64_t>(v->size()));
    if (v->empty()) break;
  }
  std::vector<double> flat;
  std::function<void(const json&)> add = [&](const json& v) {
    if (v.is_array()) {
      for (const json& e : v) add(e);
    } else {
      flat.push_back(v.is_boolean() ? (v.get<bool>() ? 1.0 : 0.0) : v.get<double>());
    }
  };
  add(value);
  return at::tensor(flat, at::kDouble).view(shape).to(dtype);
}

TEST(DataImport, JsonlEpisodesReadBackAsEpisodesAndTransitions) {
  TempDir dir;
  const std::vector<std::string> lines = {
      R"({"id": "ep0", "observation": [[0.5, 1], [1.5, 2], [2.5, 3]], "action": [0, 1, 0],)"
      R"( "reward": [1.0, 0, 2.5], "done": [false, false, true], "value": [0.1, 0.2, 0.3],)"
      R"( "log_prob": [-0.1, -0.2, -0.3]})",
      R"({"id": "ep1", "observation": [[3, 4]], "action": [1], "reward": [5], "done": [1],)"
      R"( "value": [0.5], "log_prob": [-1]})",
      R"({"id": "ep2", "observation": [[-1, 0.25], [7, 8]], "action": [2, 2], "reward": [0.5, 0.25],)"
      R"( "done": [0, 1], "value": [1, 2], "log_prob": [0, 0]})"};
  {
    std::ofstream f(dir / "episodes.jsonl");
    for (const std::string& line : lines) f << line << "\n";
  }
  ProgramResult built = loom_in({"data", "build", "jsonl", "--input", "episodes.jsonl", "--layout",
                                 "episodes", "--out", "ds"},
                                dir.path());
  ASSERT_EQ(built.exit_code, 0) << built.output;
  const Manifest m = read_manifest(dir / "ds");
  EXPECT_EQ(m.layout, RecordLayout::kEpisodes);
  const std::map<std::string, std::string> dtypes = {
      {"observation", "float32"}, {"action", "int64"},  {"reward", "float32"},
      {"done", "uint8"},          {"value", "float32"}, {"log_prob", "float32"}};
  for (const auto& [name, dtype] : dtypes) {
    EXPECT_TRUE(m.field(name).ragged) << name;
    EXPECT_EQ(m.field(name).dtype, dtype) << name;
    EXPECT_TRUE(m.field(name).shape.empty()) << name;
  }
  EXPECT_EQ(m.field("id").type, FieldType::kText);
  const Lineage lineage = read_build_lineage((dir / "ds").string());
  EXPECT_EQ(lineage.command,
            "loom data build jsonl --input episodes.jsonl --layout episodes --out ds");

  auto dtype_of = [](const std::string& dtype) {
    return dtype == "int64" ? at::kLong : dtype == "uint8" ? at::kByte : at::kFloat;
  };
  // Whole episodes: each record's per-step fields, [T, ...] (one row: no padding).
  Reader episodes(dir / "ds", {});
  ASSERT_EQ(episodes.num_samples(), lines.size());
  for (size_t e = 0; e < lines.size(); ++e) {
    const json j = json::parse(lines[e]);
    const Batch b = episodes.read({e});
    for (const auto& [name, dtype] : dtypes) {
      EXPECT_TRUE(b[name][0].equal(tensor_of(j[name], dtype_of(dtype))))
          << "episode " << e << " field " << name << ": " << b[name][0];
      EXPECT_TRUE(b[name + "_mask"][0].all().item<bool>());
    }
    EXPECT_EQ(b.strings.at("id")[0], j["id"].get<std::string>());
  }
  // Transitions: every step of every episode once, each field's value at that step.
  Reader transitions(dir / "ds", {.episode_sampling = EpisodeSampling::kTransition});
  ASSERT_EQ(transitions.num_samples(), 6u);
  std::set<std::pair<int64_t, int64_t>> seen;
  for (uint64_t i = 0; i < 6; ++i) {
    const Batch b = transitions.read({i});
    const int64_t e = b["episode"][0].item<int64_t>(), t = b["step"][0].item<int64_t>();
    seen.emplace(e, t);
    const json j = json::parse(lines.at(static_cast<size_t>(e)));
    for (const auto& [name, dtype] : dtypes) {
      EXPECT_TRUE(b[name][0].equal(tensor_of(j[name][t], dtype_of(dtype))))
          << "episode " << e << " step " << t << " field " << name << ": " << b[name][0];
    }
    EXPECT_EQ(b.strings.at("id")[0], j["id"].get<std::string>());
  }
  EXPECT_EQ(seen, (std::set<std::pair<int64_t, int64_t>>{
                      {0, 0}, {0, 1}, {0, 2}, {1, 0}, {2, 0}, {2, 1}}));

  // Fields of different lengths: the writer's error, on the line of the file (after a blank
  // line, so the third).
  std::ofstream(dir / "bad.jsonl")
      << lines[0] << "\n\n"
      << R"({"id": "x", "observation": [[1, 2], [3, 4], [5, 6]], "action": [0, 1],)"
      << R"( "reward": [1, 2, 3], "done": [0, 0, 1], "value": [0, 0, 0], "log_prob": [0, 0, 0]})"
      << "\n";
  ProgramResult bad = loom_in(
      {"data", "build", "jsonl", "--input", "bad.jsonl", "--layout", "episodes", "--out", "bad"},
      dir.path());
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_EQ(last_line(bad.output),
            "error: bad.jsonl:3: record 1: field 'action' has 2 steps but field 'reward' has 3; "
            "every per-step field of an episode has one entry per step");
  // A line without a required key.
  std::ofstream(dir / "nodone.jsonl") << R"({"observation": [1], "action": [1], "reward": [1]})"
                                      << "\n";
  bad = loom_in({"data", "build", "jsonl", "--input", "nodone.jsonl", "--layout", "episodes",
                 "--out", "nodone"},
                dir.path());
  EXPECT_EQ(last_line(bad.output),
            "error: nodone.jsonl:1: the episodes layout needs the keys observation, action, "
            "reward, done; this line has no \"done\"");
}

// ---- jsonl --layout multimodal ----

TEST(DataImport, JsonlMultimodalReadsBackWithItsImages) {
  TempDir dir;
  const std::string a = png(5, 4, 3, 7), b = jpeg(6, 9, 3);
  write(dir / "data/img/a.png", a);
  write(dir / "data/img/b.jpg", b);
  const fs::path input = dir / "data/mm.jsonl";
  std::ofstream(input)
      << R"({"tokens": [5, 6, 7, 8], "images": ["img/a.png"], "image_positions": [1], "caption": "one"})"
      << "\n"
      << R"({"tokens": [9, 10], "images": ["img/a.png", "img/b.jpg"], "image_positions": [0, 2], "caption": "two"})"
      << "\n"
      << R"({"tokens": [11, 12, 13], "images": [], "image_positions": [], "caption": "none"})"
      << "\n";
  ProgramResult built = loom_in({"data", "build", "jsonl", "--input", input.string(), "--layout",
                                 "multimodal", "--out", "ds"},
                                dir.path());
  ASSERT_EQ(built.exit_code, 0) << built.output;
  const Manifest m = read_manifest(dir / "ds");
  EXPECT_EQ(m.layout, RecordLayout::kMultimodal);
  EXPECT_EQ(m.field("images").type, FieldType::kImages);
  EXPECT_TRUE(m.field("tokens").ragged);
  EXPECT_EQ(m.field("tokens").dtype, "int64");
  EXPECT_TRUE(m.field("image_positions").ragged);

  Reader reader(dir / "ds", {});
  const Batch batch = reader.read({0, 1, 2});
  const PaddedImages want = padded({{a}, {a, b}, {}}, true);
  EXPECT_TRUE(batch["images"].equal(want.pixels));
  EXPECT_TRUE(batch["images_size"].equal(want.sizes)) << batch["images_size"];
  EXPECT_TRUE(batch["images_mask"].equal(want.mask)) << batch["images_mask"];
  EXPECT_TRUE(batch["tokens"].equal(
      at::tensor(std::vector<int64_t>{5, 6, 7, 8, 9, 10, 0, 0, 11, 12, 13, 0}).view({3, 4})))
      << batch["tokens"];
  EXPECT_TRUE(batch["tokens_mask"].equal(
      at::tensor(std::vector<int64_t>{1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 0})
          .view({3, 4})
          .to(at::kBool)));
  EXPECT_TRUE(batch["image_positions"].equal(
      at::tensor(std::vector<int64_t>{1, 0, 0, 2, 0, 0}).view({3, 2})))
      << batch["image_positions"];
  EXPECT_TRUE(batch["image_positions_mask"].equal(
      at::tensor(std::vector<int64_t>{1, 0, 1, 1, 0, 0}).view({3, 2}).to(at::kBool)));
  EXPECT_EQ(batch.strings.at("caption"), (std::vector<std::string>{"one", "two", "none"}));
  // The lineage: the JSONL file and each image once.
  const Lineage lineage = read_build_lineage((dir / "ds").string());
  ASSERT_EQ(lineage.sources.size(), 3u);
  EXPECT_EQ(lineage.sources[2].path, (dir / "data/img/b.jpg").string());
  EXPECT_EQ(lineage.sources[2].xxhash64, util::xxh64(b));

  // An image file that is not there.
  const fs::path missing = dir / "data/missing.jsonl";
  std::ofstream(missing) << R"({"tokens": [1], "images": ["img/a.png"], "image_positions": [0]})"
                         << "\n"
                         << R"({"tokens": [1], "images": ["img/c.png"], "image_positions": [0]})"
                         << "\n";
  ProgramResult bad = loom_in({"data", "build", "jsonl", "--input", missing.string(), "--layout",
                               "multimodal", "--out", "bad"},
                              dir.path());
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_EQ(last_line(bad.output), "error: " + missing.string() +
                                       ":2: key \"images\" names img/c.png, but " +
                                       (dir / "data/img/c.png").string() + " is not a file");
}

}  // namespace
}  // namespace loom::data

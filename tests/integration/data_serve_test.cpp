// `loom data serve` in a real browser: headless Chromium over WebDriver loads the page for a
// rank and step and the DOM must hold exactly the samples data::Reader yields there (token
// ids, image pixels, labels, text), stepping with the page's own button too; the server refuses
// other paths, bad ranks and, when public, a missing token. Screenshots go to
// build/test-artifacts/data_serve/.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "data/image_codec.h"
#include "harness/harness.h"
#include "harness/servers.h"
#include "loom/data/dataset.h"
#include "loom/data/reader.h"

namespace loom::data {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::TempDir;

const std::string kLoom = LOOM_BINARY_DIR "/tools/loom/loom";
const fs::path kScreenshots = LOOM_BINARY_DIR "/test-artifacts/data_serve";

// The batch rank `rank` of `world` reads at `step`: the Trainer's position, computed here
// independently of the tool.
Batch batch_at(const fs::path& ds, ReaderOptions options, uint64_t step) {
  Reader reader(ds, options);
  const uint64_t steps = reader.steps_per_epoch();
  const uint64_t global = static_cast<uint64_t>(options.batch_size * options.world_size);
  reader.restore({reader.manifest().version, options.seed, step / steps, step % steps * global});
  return reader.next();
}

// What the page shows, from its DOM: per sample its dataset index, token ids, and each
// field's text, with images as their pixels read back from the canvas.
constexpr const char* kReadSamples = R"JS(
  return [...document.querySelectorAll('.sample')].map(s => {
    const fields = {};
    for (const td of s.querySelectorAll('td[data-field]')) {
      const canvas = td.querySelector('canvas');
      if (canvas) {
        const d = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
        fields[td.dataset.field] = [...d].filter((_, i) => i % 4 === 0);
      } else {
        fields[td.dataset.field] = td.textContent;
      }
    }
    return {index: Number(s.dataset.index),
            ids: [...s.querySelectorAll('.tok')].map(t => Number(t.dataset.id)),
            fields};
  });
)JS";

// The statistics view, from its DOM: the summary line, and per field its rows as [key, count].
constexpr const char* kReadStats = R"JS(
  const out = {summary: document.querySelector('#stats-summary h3').textContent};
  for (const div of document.querySelectorAll('.stat[data-field]')) {
    out[div.dataset.field] = [...div.querySelectorAll('.row')]
        .map(r => [r.dataset.key, Number(r.dataset.count)]);
  }
  return out;
)JS";

TEST(DataServe, TheBrowserShowsExactlyTheTokensEachRankReadsAtAStep) {
  if (!testing::Browser::available()) GTEST_SKIP() << "needs chromium and chromium-driver";
  TempDir dir;
  const fs::path ds = dir / "tokens";
  std::vector<int64_t> lengths;  // of the documents, in tokens
  {
    TokenDatasetWriter writer(ds, {.vocab_size = 500, .tokens_per_shard = 300});
    std::mt19937 rng(3);
    for (int d = 0; d < 40; ++d) {
      std::vector<uint32_t> doc(20 + rng() % 40);
      for (auto& t : doc) t = rng() % 500;
      writer.add_document(doc);
      lengths.push_back(static_cast<int64_t>(doc.size()));
    }
    writer.finish();
  }
  testing::DataServer served(
      dir, {ds.string(), "--world", "2", "--batch", "3", "--seq-len", "7", "--seed", "5"});
  testing::Browser browser;
  browser.open(served.url("/?rank=1&step=4"));
  const ReaderOptions options{
      .batch_size = 3, .seq_len = 7, .seed = 5, .rank = 1, .world_size = 2, .prefetch = 0};
  for (const uint64_t step : {4, 5}) {
    ASSERT_TRUE(browser.wait_for("document.body.dataset.ready === '1'", std::chrono::seconds(20)));
    const json shown = json::parse(browser.run(kReadSamples));
    const Batch expected = batch_at(ds, options, step);
    ASSERT_EQ(shown.size(), expected.indices.size()) << step;
    for (size_t r = 0; r < shown.size(); ++r) {
      EXPECT_EQ(shown[r]["index"], expected.indices[r]) << step << " " << r;
      const at::Tensor row = expected["tokens"][static_cast<int64_t>(r)].to(at::kLong);
      const std::vector<int64_t> ids(row.data_ptr<int64_t>(),
                                     row.data_ptr<int64_t>() + row.numel());
      EXPECT_EQ(shown[r]["ids"].get<std::vector<int64_t>>(), ids) << step << " " << r;
    }
    EXPECT_EQ(json::parse(browser.run("return document.getElementById('where').textContent;")),
              "rank 1 of 2, step " + std::to_string(step) + " = epoch 0 step " +
                  std::to_string(step) + " of " +
                  std::to_string(Reader(ds, options).steps_per_epoch()) + "; seed 5, 3 per rank");
    if (step == 4) {
      browser.screenshot(kScreenshots / "tokens_rank1_step4.png");
      browser.run("document.getElementById('next').click();");  // the page's own step button
    }
  }
  // Only the page and its two API routes exist; a bad rank or step is a clear 400.
  for (const char* path :
       {"/manifest.json", "/../manifest.json", "/tokens/manifest.json", "/api/../manifest.json"}) {
    const auto res = served.get(path);
    ASSERT_TRUE(res) << path;
    EXPECT_EQ(res->status, 404) << path;
  }
  const auto bad_rank = served.get("/api/batch?rank=2&step=0");
  ASSERT_TRUE(bad_rank);
  EXPECT_EQ(bad_rank->status, 400);
  EXPECT_EQ(bad_rank->body, "rank 2 is not a rank of a world of 2\n");
  const auto bad_step = served.get("/api/batch?rank=0&step=-1");
  ASSERT_TRUE(bad_step);
  EXPECT_EQ(bad_step->status, 400);
  EXPECT_EQ(bad_step->body, "the parameter step must be a non-negative integer, got '-1'\n");

  // The statistics view: the documents' length histogram, 10 equal bins from the shortest to
  // the longest, each document counted in the bin its length falls in (the last bin closed).
  browser.open(served.url("/?view=stats"));
  ASSERT_TRUE(browser.wait_for("document.body.dataset.ready === '1'", std::chrono::seconds(20)));
  browser.screenshot(kScreenshots / "tokens_stats.png");
  const json stats = json::parse(browser.run(kReadStats));
  const auto [lo, hi] = std::minmax_element(lengths.begin(), lengths.end());
  json bins = json::array();
  for (int b = 0; b < 10; ++b) {
    const double from = *lo + (*hi - *lo) * b / 10.0, to = *lo + (*hi - *lo) * (b + 1) / 10.0;
    int64_t count = 0;
    for (const int64_t n : lengths) {
      count += std::min(9, static_cast<int>(static_cast<double>(n - *lo) / (*hi - *lo) * 10)) == b;
    }
    std::ostringstream key;  // as the page prints the bounds: at most 2 decimals
    key << std::round(from * 100) / 100 << " – " << std::round(to * 100) / 100;
    bins.push_back({key.str(), count});
  }
  int64_t tokens = 0;
  for (const int64_t n : lengths) tokens += n;
  EXPECT_EQ(stats["summary"],
            "40 of 40 documents counted · " + std::to_string(tokens) + " tokens, " +
                std::to_string(Reader(ds, options).manifest().shards.size()) + " shards");
  EXPECT_EQ(stats["documents"], bins);
}

TEST(DataServe, TheBrowserShowsRecordsImagesLabelsAndText) {
  if (!testing::Browser::available()) GTEST_SKIP() << "needs chromium and chromium-driver";
  TempDir dir;
  const fs::path ds = dir / "records";
  {
    RecordDatasetWriter writer(ds, {{"image", FieldType::kTensor, "uint8", {4, 5}},
                                    {"label", FieldType::kInt, "", {}, {"cat", "dog", "bird"}},
                                    {"caption", FieldType::kText},
                                    {"source", FieldType::kText}});
    for (int i = 0; i < 30; ++i) {
      uint8_t pixels[20];
      for (int k = 0; k < 20; ++k) pixels[k] = static_cast<uint8_t>((i * 37 + k * 11) % 256);
      writer.add(Record()
                     .tensor(pixels, 20, {4, 5})
                     .integer(i % 3)
                     .text("photo " + std::to_string(i))
                     .text(i % 4 == 0 ? "web" : "books"));
    }
    writer.finish();
  }
  testing::DataServer served(dir, {ds.string(), "--batch", "4", "--seed", "9"});
  testing::Browser browser;
  browser.open(served.url("/?rank=0&step=2"));
  ASSERT_TRUE(browser.wait_for("document.body.dataset.ready === '1'", std::chrono::seconds(20)));
  const json shown = json::parse(browser.run(kReadSamples));
  browser.screenshot(kScreenshots / "records_rank0_step2.png");
  const Batch expected =
      batch_at(ds, {.batch_size = 4, .seed = 9, .rank = 0, .world_size = 1, .prefetch = 0}, 2);
  const std::vector<std::string> classes = {"cat", "dog", "bird"};
  ASSERT_EQ(shown.size(), 4u);
  for (int64_t r = 0; r < 4; ++r) {
    EXPECT_EQ(shown[r]["index"], expected.indices[r]);
    const int64_t label = expected["label"][r].item<int64_t>();
    EXPECT_EQ(shown[r]["fields"]["label"],
              std::to_string(label) + " (" + classes[static_cast<size_t>(label)] + ")");
    EXPECT_EQ(shown[r]["fields"]["caption"], json(expected.strings.at("caption")[r]).dump());
    const at::Tensor image = expected["image"][r].flatten().to(at::kLong);
    const std::vector<int64_t> pixels(image.data_ptr<int64_t>(),
                                      image.data_ptr<int64_t>() + image.numel());
    EXPECT_EQ(shown[r]["fields"]["image"].get<std::vector<int64_t>>(), pixels) << r;
  }

  // The statistics view: each field's counts or histogram over all 30 records. Labels are
  // i % 3; captions "photo 0" .. "photo 29" are 7 bytes (10 of them) or 8 (20).
  browser.open(served.url("/?view=stats"));
  ASSERT_TRUE(browser.wait_for("document.body.dataset.ready === '1'", std::chrono::seconds(20)));
  browser.screenshot(kScreenshots / "records_stats.png");
  const json stats = json::parse(browser.run(kReadStats));
  EXPECT_EQ(stats["summary"], "30 of 30 samples counted");
  EXPECT_EQ(stats["label"],
            json::parse(R"J([["0 (cat)", 10], ["1 (dog)", 10], ["2 (bird)", 10]])J"));
  EXPECT_EQ(stats["image"], json::parse(R"J([["4x5", 30]])J"));
  ASSERT_EQ(stats["caption"].size(), 10u) << stats;
  EXPECT_EQ(stats["caption"][0], json::parse(R"J(["7 – 7.1", 10])J"));
  EXPECT_EQ(stats["caption"][9], json::parse(R"J(["7.9 – 8", 20])J"));
  for (int b = 1; b < 9; ++b) EXPECT_EQ(stats["caption"][b][1], 0) << b;
  // A text field of few values is counted per value too (30 distinct captions are not).
  EXPECT_EQ(stats["source:values"], json::parse(R"J([["books", 22], ["web", 8]])J"));
  ASSERT_EQ(stats["source"].size(), 10u) << stats;  // and its lengths: "web" 3, "books" 5
  EXPECT_EQ(stats["source"][0], json::parse(R"J(["3 – 3.2", 8])J"));
  EXPECT_EQ(stats["source"][9], json::parse(R"J(["4.8 – 5", 22])J"));
  EXPECT_EQ(stats.count("caption:values"), 0u);
}

// Every canvas pixel of a sample, as RGBA, and the tokens and images of a multimodal sequence
// in the order the page shows them ("t<id>" for a token, "i<k>" for image k).
constexpr const char* kReadLayouts = R"JS(
  const pixels = c => [...c.getContext('2d').getImageData(0, 0, c.width, c.height).data];
  return [...document.querySelectorAll('.sample')].map(s => {
    const seq = s.querySelector('.sequence');
    return {
      index: Number(s.dataset.index),
      order: seq ? [...seq.children].map(e => e.tagName === 'CANVAS' ? 'i' + e.dataset.image
                                                                     : 't' + e.dataset.id) : [],
      images: seq ? [...seq.querySelectorAll('canvas')].map(pixels) : [],
      series: Object.fromEntries([...s.querySelectorAll('polyline')].map(
          l => [l.dataset.series, JSON.parse(l.dataset.values)])),
      fields: Object.fromEntries([...s.querySelectorAll('td[data-field]')].map(
          td => [td.dataset.field, td.querySelector('canvas') ? pixels(td.querySelector('canvas'))
                                                              : td.textContent])),
    };
  });
)JS";

std::vector<double> doubles(const at::Tensor& t) {
  const at::Tensor d = t.to(at::kDouble).contiguous();
  return {d.data_ptr<double>(), d.data_ptr<double>() + d.numel()};
}

// An [H, W, C] image as the RGBA a canvas holds.
std::vector<int> rgba(const at::Tensor& image) {
  const at::Tensor hwc = image.contiguous();
  const int64_t c = hwc.size(2);
  const uint8_t* p = hwc.data_ptr<uint8_t>();
  std::vector<int> out;
  for (int64_t i = 0; i < hwc.size(0) * hwc.size(1); ++i, p += c) {
    for (int k = 0; k < 3; ++k) out.push_back(c >= 3 ? p[k] : p[0]);
    out.push_back(c == 2 || c == 4 ? p[c - 1] : 255);
  }
  return out;
}

at::Tensor crop(const Batch& b, const std::string& name, int64_t r, int64_t k) {
  const at::Tensor size = b[name + "_size"][r][k];
  return b[name][r][k].narrow(0, 0, size[0].item<int64_t>()).narrow(1, 0, size[1].item<int64_t>());
}

int64_t real_length(const Batch& b, const std::string& name, int64_t r) {
  return b[name + "_mask"][r].sum().item<int64_t>();
}

TEST(DataServe, TheBrowserShowsEpisodePlotsAndSequencesWithImagesInPlace) {
  if (!testing::Browser::available()) GTEST_SKIP() << "needs chromium and chromium-driver";
  TempDir dir;
  // Episodes: observation [T, 2], action [T], reward, done, value [T].
  const fs::path episodes = dir / "episodes";
  {
    RecordDatasetWriter writer(episodes,
                               {{"observation", FieldType::kTensor, "float32", {}, {}, true},
                                {"action", FieldType::kTensor, "int64", {}, {}, true},
                                {"reward", FieldType::kTensor, "float32", {}, {}, true},
                                {"done", FieldType::kTensor, "uint8", {}, {}, true},
                                {"value", FieldType::kTensor, "float32", {}, {}, true}},
                               {.layout = RecordLayout::kEpisodes});
    std::mt19937 rng(4);
    for (int e = 0; e < 12; ++e) {
      const int64_t t = 3 + static_cast<int64_t>(rng() % 12);
      std::vector<float> obs(static_cast<size_t>(2 * t)), reward(static_cast<size_t>(t)),
          value(static_cast<size_t>(t));
      std::vector<int64_t> action(static_cast<size_t>(t));
      std::vector<uint8_t> done(static_cast<size_t>(t), 0);
      done.back() = 1;
      for (auto& v : obs) v = static_cast<float>(rng() % 100) / 10;
      for (auto& v : reward) v = static_cast<float>(static_cast<int>(rng() % 21) - 10) / 4;
      for (auto& v : value) v = static_cast<float>(rng() % 50) / 8;
      for (auto& v : action) v = static_cast<int64_t>(rng() % 3);
      writer.add(Record()
                     .tensor(obs.data(), obs.size() * 4, {t, 2})
                     .tensor(action.data(), action.size() * 8, {t})
                     .tensor(reward.data(), reward.size() * 4, {t})
                     .tensor(done.data(), done.size(), {t})
                     .tensor(value.data(), value.size() * 4, {t}));
    }
    writer.finish();
  }
  {
    testing::DataServer served(dir, {episodes.string(), "--batch", "3", "--seed", "2"});
    testing::Browser browser;
    browser.open(served.url("/?rank=0&step=1"));
    ASSERT_TRUE(browser.wait_for("document.body.dataset.ready === '1'", std::chrono::seconds(20)));
    browser.screenshot(kScreenshots / "episodes_rank0_step1.png");
    const json shown = json::parse(browser.run(kReadLayouts));
    const Batch expected =
        batch_at(episodes, {.batch_size = 3, .seed = 2, .world_size = 1, .prefetch = 0}, 1);
    ASSERT_EQ(shown.size(), 3u);
    for (int64_t r = 0; r < 3; ++r) {
      EXPECT_EQ(shown[r]["index"], expected.indices[r]);
      const int64_t n = real_length(expected, "reward", r);
      for (const char* name : {"reward", "return", "advantage"}) {
        EXPECT_EQ(shown[r]["series"][name].get<std::vector<double>>(),
                  doubles(expected[name][r].narrow(0, 0, n)))
            << name << " of sample " << r;
      }
    }
  }
  {  // Transitions: where each comes from, and its return.
    testing::DataServer served(dir,
                               {episodes.string(), "--batch", "4", "--sampling", "transition"});
    testing::Browser browser;
    browser.open(served.url("/?rank=0&step=3"));
    ASSERT_TRUE(browser.wait_for("document.body.dataset.ready === '1'", std::chrono::seconds(20)));
    const json shown = json::parse(browser.run(R"JS(
      return [...document.querySelectorAll('.transition')].map(t => t.textContent);)JS"));
    const Batch expected = batch_at(episodes,
                                    {.batch_size = 4,
                                     .world_size = 1,
                                     .episode_sampling = EpisodeSampling::kTransition,
                                     .prefetch = 0},
                                    3);
    ASSERT_EQ(shown.size(), 4u);
    for (int64_t r = 0; r < 4; ++r) {
      std::ostringstream want;  // as JavaScript prints numbers: the shortest round trip
      want << "episode " << expected["episode"][r].item<int64_t>() << ", step "
           << expected["step"][r].item<int64_t>() << ": return "
           << json(expected["return"][r].item<double>()).dump() << ", advantage "
           << json(expected["advantage"][r].item<double>()).dump();
      EXPECT_EQ(shown[r], want.str()) << r;
    }
  }

  // Multimodal sequences: tokens with PNG, JPEG and raw images of different sizes in place.
  const fs::path mm = dir / "multimodal";
  {
    RecordDatasetWriter writer(mm,
                               {{"tokens", FieldType::kTensor, "int32", {}, {}, true},
                                {"images", FieldType::kImages},
                                {"image_positions", FieldType::kTensor, "int64", {}, {}, true},
                                {"caption", FieldType::kText}},
                               {.layout = RecordLayout::kMultimodal});
    std::mt19937 rng(6);
    for (int i = 0; i < 8; ++i) {
      std::vector<int32_t> tokens(2 + rng() % 6);
      for (auto& t : tokens) t = static_cast<int32_t>(rng() % 1000);
      std::vector<std::string> images;
      std::vector<int64_t> positions;
      const int count = i == 0 ? 3 : static_cast<int>(rng() % 4);
      for (int k = 0; k < count; ++k) {
        const int64_t h = 3 + static_cast<int64_t>(rng() % 6),
                      w = 3 + static_cast<int64_t>(rng() % 6);
        std::vector<uint8_t> pixels(static_cast<size_t>(h * w * 3));
        for (auto& p : pixels) p = static_cast<uint8_t>(rng());
        images.push_back(k % 3 == 0   ? image::encode_png(pixels.data(), h, w, 3)
                         : k % 3 == 1 ? image::encode_jpeg(pixels.data(), h, w, 3, 90)
                                      : image::encode_raw(pixels.data(), h, w, 3));
        positions.push_back(static_cast<int64_t>(rng() % (tokens.size() + 1)));
      }
      std::sort(positions.begin(), positions.end());
      writer.add(
          Record()
              .tensor(tokens.data(), tokens.size() * 4, {static_cast<int64_t>(tokens.size())})
              .images(images)
              .tensor(positions.data(), positions.size() * 8,
                      {static_cast<int64_t>(positions.size())})
              .text("sequence " + std::to_string(i)));
    }
    writer.finish();
  }
  testing::DataServer served(dir, {mm.string(), "--batch", "4", "--seed", "1"});
  testing::Browser browser;
  browser.open(served.url("/?rank=0&step=1"));
  ASSERT_TRUE(browser.wait_for("document.body.dataset.ready === '1'", std::chrono::seconds(20)));
  browser.screenshot(kScreenshots / "multimodal_rank0_step1.png");
  const json shown = json::parse(browser.run(kReadLayouts));
  const Batch expected =
      batch_at(mm, {.batch_size = 4, .seed = 1, .world_size = 1, .prefetch = 0}, 1);
  ASSERT_EQ(shown.size(), 4u);
  for (int64_t r = 0; r < 4; ++r) {
    EXPECT_EQ(shown[r]["index"], expected.indices[r]);
    const int64_t tokens = real_length(expected, "tokens", r);
    const int64_t images = real_length(expected, "images", r);
    std::vector<std::string> order;
    std::vector<std::vector<int>> pixels;
    int64_t k = 0;
    for (int64_t t = 0; t <= tokens; ++t) {
      for (; k < images && expected["image_positions"][r][k].item<int64_t>() == t; ++k) {
        order.push_back("i" + std::to_string(k));
        pixels.push_back(rgba(crop(expected, "images", r, k)));
      }
      if (t < tokens) order.push_back("t" + std::to_string(expected["tokens"][r][t].item<int>()));
    }
    EXPECT_EQ(shown[r]["order"].get<std::vector<std::string>>(), order) << r;
    EXPECT_EQ(shown[r]["images"].get<std::vector<std::vector<int>>>(), pixels) << r;
    EXPECT_EQ(shown[r]["fields"]["caption"], json(expected.strings.at("caption")[r]).dump());
  }

  // Its statistics: the sequences' lengths in tokens (a ragged field) as a histogram from the
  // shortest to the longest, every sequence counted once.
  const auto res = served.get("/api/stats");
  ASSERT_TRUE(res);
  const json stats = json::parse(res->body);
  const Batch all = Reader(mm, {.batch_size = 1, .prefetch = 0}).read({0, 1, 2, 3, 4, 5, 6, 7});
  std::vector<int64_t> lengths;
  for (int64_t r = 0; r < 8; ++r) lengths.push_back(real_length(all, "tokens", r));
  const auto [lo, hi] = std::minmax_element(lengths.begin(), lengths.end());
  const json& tokens = stats["fields"][0];
  EXPECT_EQ(tokens["name"], "tokens");
  EXPECT_EQ(tokens["of"], "its length (first dimension)");
  ASSERT_EQ(tokens["histogram"].size(), 10u) << stats;
  EXPECT_EQ(tokens["histogram"][0]["from"], *lo);
  EXPECT_EQ(tokens["histogram"][9]["to"], *hi);
  for (int b = 0; b < 10; ++b) {
    int64_t count = 0;
    for (const int64_t n : lengths) {
      count += std::min(9, static_cast<int>(static_cast<double>(n - *lo) / (*hi - *lo) * 10)) == b;
    }
    EXPECT_EQ(tokens["histogram"][b]["count"], count) << b;
  }
}

// The diff view (--against) of two versions of a record dataset: version 2 drops records 3 and
// 7, changes record 10's caption, repeats record 0 and adds two. The page counts what the two
// share and shows exactly the records removed (from the old version) and added (from the new),
// compared by content wherever they sit. Then the same for token datasets of different token
// widths, through the JSON route, and the error for datasets of two kinds.
TEST(DataServe, TheDiffViewShowsTheRecordsRemovedAndAddedBetweenVersions) {
  if (!testing::Browser::available()) GTEST_SKIP() << "needs chromium and chromium-driver";
  TempDir dir;
  const std::vector<Field> schema = {
      {.name = "label", .type = FieldType::kInt, .classes = {"cat", "dog", "bird"}},
      {.name = "caption", .type = FieldType::kText}};
  using Row = std::pair<int64_t, std::string>;
  auto write = [&](const fs::path& path, const std::vector<Row>& rows) {
    RecordDatasetWriter writer(path, schema);
    for (const auto& [label, caption] : rows) writer.add(Record().integer(label).text(caption));
    writer.finish();
  };
  std::vector<Row> v1, v2;
  for (int i = 0; i < 30; ++i) v1.emplace_back(i % 3, "photo " + std::to_string(i));
  for (int i = 0; i < 30; ++i) {
    if (i == 3 || i == 7) continue;
    v2.push_back(i == 10 ? Row{1, "photo ten"} : v1[static_cast<size_t>(i)]);
  }
  v2.push_back(v1[0]);
  v2.emplace_back(2, "new photo A");
  v2.emplace_back(0, "new photo B");
  write(dir / "v1", v1);
  write(dir / "v2", v2);

  testing::DataServer served(dir, {(dir / "v2").string(), "--against", (dir / "v1").string()});
  testing::Browser browser;
  browser.open(served.url("/?view=diff"));
  ASSERT_TRUE(browser.wait_for("document.body.dataset.ready === '1'", std::chrono::seconds(20)));
  browser.screenshot(kScreenshots / "records_diff.png");
  const json shown = json::parse(browser.run(R"JS(
    const side = id => [...document.querySelectorAll(`#${id} .sample`)].map(s => ({
      index: Number(s.dataset.index),
      title: s.querySelector('h3').textContent,
      label: s.querySelector('td[data-field=label]').textContent,
      caption: s.querySelector('td[data-field=caption]').textContent}));
    return {summary: document.querySelector('#diff-summary h3').textContent,
            schema: document.querySelectorAll('#diff-schema').length,
            removed: side('diff-removed'), added: side('diff-added'),
            link: document.getElementById('diff-link').textContent};)JS"));
  EXPECT_EQ(shown["summary"], "27 records in both, 3 removed, 4 added");
  EXPECT_EQ(shown["schema"], 0);
  EXPECT_EQ(shown["link"], "samples");
  const std::vector<std::string> classes = {"cat", "dog", "bird"};
  auto expect_side = [&](const json& got, const std::vector<Row>& rows,
                         const std::vector<uint64_t>& indices, const std::string& version) {
    ASSERT_EQ(got.size(), indices.size()) << got;
    for (size_t k = 0; k < indices.size(); ++k) {
      const auto& [label, caption] = rows[indices[k]];
      EXPECT_EQ(got[k]["index"], indices[k]);
      EXPECT_EQ(got[k]["label"], std::to_string(label) + " (" + classes[label] + ")");
      EXPECT_EQ(got[k]["caption"], json(caption).dump());
      const uint64_t bytes = Reader(dir / version, {.prefetch = 0}).entry(indices[k]).size;
      EXPECT_EQ(got[k]["title"], "record " + std::to_string(indices[k]) + " of the " +
                                     (version == "v1" ? "old" : "new") + " version (" +
                                     std::to_string(bytes) + " bytes)");
    }
  };
  expect_side(shown["removed"], v1, {3, 7, 10}, "v1");
  expect_side(shown["added"], v2, {8, 28, 29, 30}, "v2");

  // Token datasets, 2-byte tokens against 4-byte ones: document 4 removed, one added at the end.
  std::mt19937 rng(8);
  std::vector<std::vector<uint32_t>> docs(10);
  for (auto& d : docs) {
    d.resize(5 + rng() % 20);
    for (auto& t : d) t = rng() % 500;
  }
  auto write_tokens = [&](const fs::path& path, uint64_t vocab,
                          const std::vector<std::vector<uint32_t>>& of) {
    TokenDatasetWriter writer(path, {.vocab_size = vocab});
    for (const auto& d : of) writer.add_document(d);
    writer.finish();
  };
  write_tokens(dir / "t1", 500, docs);
  std::vector<std::vector<uint32_t>> docs2 = docs;
  docs2.erase(docs2.begin() + 4);
  docs2.push_back({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12});
  write_tokens(dir / "t2", 1u << 20, docs2);
  testing::DataServer tokens(
      dir, {(dir / "t2").string(), "--against", (dir / "t1").string(), "--seq-len", "7"});
  const auto res = tokens.get("/api/diff");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const json diff = json::parse(res->body);
  EXPECT_EQ(diff["unit"], "documents");
  EXPECT_EQ(diff["same"], 9);
  EXPECT_EQ(diff["removed"], 1);
  EXPECT_EQ(diff["added"], 1);
  EXPECT_EQ(diff["old"]["entries"], 10);
  EXPECT_EQ(diff["new"]["entries"], 10);
  auto ids = [](const json& sample) {
    std::vector<uint32_t> out;
    for (const json& t : sample["tokens"]) out.push_back(t["id"].get<uint32_t>());
    return out;
  };
  ASSERT_EQ(diff["removed_samples"].size(), 1u);
  EXPECT_EQ(diff["removed_samples"][0]["index"], 4);
  EXPECT_EQ(diff["removed_samples"][0]["size"], docs[4].size());
  const size_t cut = std::min<size_t>(8, docs[4].size());  // seq_len + 1 tokens at most
  EXPECT_EQ(ids(diff["removed_samples"][0]),
            std::vector<uint32_t>(docs[4].begin(), docs[4].begin() + cut));
  ASSERT_EQ(diff["added_samples"].size(), 1u);
  EXPECT_EQ(diff["added_samples"][0]["index"], 9);
  EXPECT_EQ(diff["added_samples"][0]["size"], 12);
  EXPECT_EQ(ids(diff["added_samples"][0]), (std::vector<uint32_t>{1, 2, 3, 4, 5, 6, 7, 8}));

  // A field added: every record differs, and the page names the field.
  {
    RecordDatasetWriter writer(
        dir / "v3", {schema[0], schema[1], {.name = "score", .type = FieldType::kFloat}});
    for (const auto& [label, caption] : v1)
      writer.add(Record().integer(label).text(caption).real(0.5));
    writer.finish();
  }
  testing::DataServer scored(dir, {(dir / "v3").string(), "--against", (dir / "v1").string()});
  const auto scored_res = scored.get("/api/diff");
  ASSERT_TRUE(scored_res);
  const json scored_diff = json::parse(scored_res->body);
  EXPECT_EQ(scored_diff["schema"],
            json::parse(R"J([{"name": "score", "old": "", "new": "float"}])J"));
  EXPECT_EQ(scored_diff["same"], 0);
  EXPECT_EQ(scored_diff["removed"], 30);
  EXPECT_EQ(scored_diff["added"], 30);
  EXPECT_EQ(scored_diff["removed_samples"].size(), 20u);  // the first 20 of each side are shown

  // Two kinds of dataset cannot be compared: refused before the server starts.
  const testing::ProgramResult r =
      testing::run_program({kLoom, "data", "serve", (dir / "t2").string(), "--seq-len", "7",
                            "--against", (dir / "v1").string()},
                           dir.path());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.output, "error: --against " + (dir / "v1").string() +
                          ": it is a record dataset and " + (dir / "t2").string() +
                          " a token dataset; only two versions of one kind of dataset can be "
                          "compared\n");
}

TEST(DataServe, BeyondLoopbackItNeedsPublicAndEveryRequestTheToken) {
  TempDir dir;
  const fs::path ds = dir / "tokens";
  {
    TokenDatasetWriter writer(ds, {.vocab_size = 50});
    writer.add_document(std::vector<uint32_t>(1000, 7));
    writer.finish();
  }
  const auto refused = testing::run_program(
      {kLoom, "data", "serve", ds.string(), "--address", "0.0.0.0:0"}, dir.path());
  EXPECT_EQ(refused.exit_code, 2) << refused.output;
  EXPECT_TRUE(testing::contains(
      refused.output, "beyond loopback: that needs --public and a token in LOOM_JOB_TOKEN"))
      << refused.output;
  testing::DataServer served(dir, {ds.string(), "--public"}, {{"LOOM_JOB_TOKEN", "s3cret"}},
                             "0.0.0.0");
  const auto missing = served.get("/api/dataset");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 401);
  EXPECT_EQ(served.get("/", {{"Authorization", "Bearer nope"}})->status, 401);
  const auto ok = served.get("/api/dataset", {{"Authorization", "Bearer s3cret"}});
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200);
  EXPECT_EQ(json::parse(ok->body)["samples"],
            Reader(ds, {.batch_size = 4, .seq_len = 64}).num_samples());
}

}  // namespace
}  // namespace loom::data

// `loom data serve` in a real browser: headless Chromium over WebDriver loads the page for a
// rank and step and the DOM must hold exactly the samples data::Reader yields there (token
// ids, image pixels, labels, text), stepping with the page's own button too; the server refuses
// other paths, bad ranks and, when public, a missing token. Screenshots go to
// build/test-artifacts/data_serve/.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <csignal>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "harness/harness.h"
#include "harness/servers.h"
#include "loom/data/dataset.h"
#include "loom/data/reader.h"
#include "util/files.h"
#include "util/subprocess.h"

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

// `loom data serve` on a free loopback port, stopped (SIGTERM) at the end.
class Served {
 public:
  Served(const TempDir& dir, std::vector<std::string> args,
         std::map<std::string, std::string> env = {}, const std::string& host = "127.0.0.1")
      : port_(testing::free_port()) {
    args.insert(args.begin(), {kLoom, "data", "serve"});
    args.push_back("--address");
    args.push_back(host + ":" + std::to_string(port_));
    log_ = dir / ("serve_" + std::to_string(port_) + ".out");
    process_ = std::make_unique<util::Subprocess>(
        util::Subprocess::spawn({.argv = args, .env = env, .output = log_}));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!get("/api/dataset")) {
      if (std::chrono::steady_clock::now() > deadline) {
        ADD_FAILURE() << "loom data serve did not start:\n" << util::read_file(log_);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  ~Served() {
    process_->signal(SIGTERM);
    process_->wait();
  }
  std::string url(const std::string& path) const {
    return "http://127.0.0.1:" + std::to_string(port_) + path;
  }
  httplib::Result get(const std::string& path, const httplib::Headers& headers = {}) const {
    httplib::Client client("127.0.0.1", port_);
    client.set_connection_timeout(std::chrono::seconds(2));
    return client.Get(path, headers);
  }

 private:
  int port_;
  fs::path log_;
  std::unique_ptr<util::Subprocess> process_;
};

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

TEST(DataServe, TheBrowserShowsExactlyTheTokensEachRankReadsAtAStep) {
  if (!testing::Browser::available()) GTEST_SKIP() << "needs chromium and chromium-driver";
  TempDir dir;
  const fs::path ds = dir / "tokens";
  {
    TokenDatasetWriter writer(ds, {.vocab_size = 500, .tokens_per_shard = 300});
    std::mt19937 rng(3);
    for (int d = 0; d < 40; ++d) {
      std::vector<uint32_t> doc(20 + rng() % 40);
      for (auto& t : doc) t = rng() % 500;
      writer.add_document(doc);
    }
    writer.finish();
  }
  Served served(dir,
                {ds.string(), "--world", "2", "--batch", "3", "--seq-len", "7", "--seed", "5"});
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
}

TEST(DataServe, TheBrowserShowsRecordsImagesLabelsAndText) {
  if (!testing::Browser::available()) GTEST_SKIP() << "needs chromium and chromium-driver";
  TempDir dir;
  const fs::path ds = dir / "records";
  {
    RecordDatasetWriter writer(ds, {{"image", FieldType::kTensor, "uint8", {4, 5}},
                                    {"label", FieldType::kInt, "", {}, {"cat", "dog", "bird"}},
                                    {"caption", FieldType::kText}});
    for (int i = 0; i < 30; ++i) {
      uint8_t pixels[20];
      for (int k = 0; k < 20; ++k) pixels[k] = static_cast<uint8_t>((i * 37 + k * 11) % 256);
      writer.add(
          Record().tensor(pixels, 20, {4, 5}).integer(i % 3).text("photo " + std::to_string(i)));
    }
    writer.finish();
  }
  Served served(dir, {ds.string(), "--batch", "4", "--seed", "9"});
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
  const json stats = json::parse(browser.run(R"JS(
    const out = {summary: document.querySelector('#stats-summary h3').textContent};
    for (const div of document.querySelectorAll('.stat[data-field]')) {
      out[div.dataset.field] = [...div.querySelectorAll('.row')]
          .map(r => [r.dataset.key, Number(r.dataset.count)]);
    }
    return out;)JS"));
  EXPECT_EQ(stats["summary"], "30 of 30 samples counted");
  EXPECT_EQ(stats["label"],
            json::parse(R"J([["0 (cat)", 10], ["1 (dog)", 10], ["2 (bird)", 10]])J"));
  EXPECT_EQ(stats["image"], json::parse(R"J([["4x5", 30]])J"));
  ASSERT_EQ(stats["caption"].size(), 10u) << stats;
  EXPECT_EQ(stats["caption"][0], json::parse(R"J(["7 – 7.1", 10])J"));
  EXPECT_EQ(stats["caption"][9], json::parse(R"J(["7.9 – 8", 20])J"));
  for (int b = 1; b < 9; ++b) EXPECT_EQ(stats["caption"][b][1], 0) << b;
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
  Served served(dir, {ds.string(), "--public"}, {{"LOOM_JOB_TOKEN", "s3cret"}}, "0.0.0.0");
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

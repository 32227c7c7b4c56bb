// bench_data: samples and tokens per second delivered by data::Reader (prefetching, world
// size 1 and 2) beside (a) the limit, a tight single-threaded loop gathering the same samples
// in the same order straight from the mmap, and (b) PyTorch's Python DataLoader over a numpy
// memmap of the same bytes (num_workers 0 and 2); and the cost of the per-chunk hash checks of
// token shards (each 1 MiB chunk hashed the first time a read touches it) against the same
// reads unchecked. Data: the KJV text tokenized by `loom data build text`, and Fashion-MNIST
// by `loom data build fashion-mnist`.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <fstream>
#include <iostream>
#include <thread>

#include "bench_report.h"
#include "bench_weights.h"
#ifdef LOOM_BENCH_REMOTE
#include "harness/servers.h"
#endif
#include "data/image_codec.h"
#include "data/shard_format.h"
#include "loom/data/dataset.h"
#include "loom/data/reader.h"
#include "loom/data/remote.h"
#include "loom/data/service.h"
#include "loom/error.h"
#include "util/mapped_file.h"
#include "util/subprocess.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using loom::bench::Row;

struct Settings {
  int64_t seq_len = 512;
  int64_t token_batch = 16;
  int64_t record_batch = 256;
  double seconds = 2.0;
  std::string python = "/usr/bin/python3";
  std::string work_dir;
  std::string mode = "local";
  int rounds = 5;
  double compute_ms = 40;
  std::string rate = "8m";
  int64_t image_side = 256;
  bool json = false;
};

// Keeps the compiler from dropping the copies a limit loop makes into `data`.
inline void keep(const void* data) { asm volatile("" : : "g"(data) : "memory"); }

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

void run_or_throw(const std::vector<std::string>& argv, const fs::path& log) {
  auto status = loom::util::Subprocess::spawn({.argv = argv, .output = log}).wait();
  LOOM_CHECK(status.ok(), loom::Error, argv[0], " ", status.describe(), "; see ", log.string());
}

// Builds the two datasets once into the work directory (kept between runs).
void prepare(const Settings& s, const fs::path& work) {
  fs::create_directories(work);
  const std::string loom_tool = LOOM_BINARY_DIR "/tools/loom/loom";
  if (!fs::exists(work / "kjv" / "manifest.json")) {
    fs::remove_all(work / "kjv");
    run_or_throw({"bible", "gen1:1-rev22:21"}, work / "kjv.txt");
    run_or_throw({loom_tool, "data", "build", "text", "--input", (work / "kjv.txt").string(),
                  "--vocab-size", "4096", "--out", (work / "kjv").string()},
                 work / "build.log");
  }
  if (!fs::exists(work / "fashion" / "manifest.json")) {
    fs::remove_all(work / "fashion");
    run_or_throw(
        {loom_tool, "data", "build", "fashion-mnist", "--out", (work / "fashion").string()},
        work / "build.log");
  }
  for (const char* name : {"kjv", "fashion"}) {  // datasets kept from before format 2
    if (loom::data::read_manifest(work / name).format_version <
        loom::data::Manifest::kFormatVersion)
      loom::data::migrate_dataset(work / name);
  }
  if (!fs::exists(work / "fashion-images.u8")) {  // the same images as raw arrays for numpy
    loom::data::Reader reader(work / "fashion", {});
    std::vector<uint64_t> all(reader.num_samples());
    for (uint64_t i = 0; i < all.size(); ++i) all[i] = i;
    const loom::data::Batch b = reader.read(all);
    std::ofstream(work / "fashion-images.u8", std::ios::binary)
        .write(static_cast<const char*>(b["image"].data_ptr()), b["image"].numel());
    const at::Tensor labels = b["label"].to(at::kByte);
    std::ofstream(work / "fashion-labels.u8", std::ios::binary)
        .write(static_cast<const char*>(labels.data_ptr()), labels.numel());
  }
}

// Samples per second of `world` readers (one thread each, as ranks), each with prefetch.
double reader_rate(const fs::path& ds, loom::data::ReaderOptions options, int world,
                   double seconds) {
  std::atomic<uint64_t> samples{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> ranks;
  const auto start = Clock::now();
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back([&, r, options]() mutable {
      options.rank = r;
      options.world_size = world;
      loom::data::Reader reader(ds, options);
      uint64_t n = 0;
      while (!stop.load(std::memory_order_relaxed))
        n += static_cast<uint64_t>(reader.next().num_real);
      samples += n;
    });
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  stop = true;
  for (auto& t : ranks) t.join();
  return static_cast<double>(samples.load()) / seconds_since(start);
}

// The limit for tokens: the sampler's order, windows widened from the mmap into one reused
// buffer; one thread, no tensors, no queue.
double token_limit_rate(const fs::path& ds, const Settings& s) {
  const loom::data::Manifest m = loom::data::read_manifest(ds);
  LOOM_CHECK(m.shards.size() == 1, loom::Error, "bench_data expects a one-shard token dataset");
  loom::util::MappedFile file(ds / m.shards[0].file);
  const auto* tokens = reinterpret_cast<const uint16_t*>(file.data() + 64);
  const uint64_t n = (m.shards[0].items - 1) / static_cast<uint64_t>(s.seq_len);
  loom::data::GlobalSampler sampler(
      {.num_samples = n, .per_rank_batch = static_cast<uint64_t>(s.token_batch)});
  std::vector<int64_t> out(static_cast<size_t>(s.token_batch * (s.seq_len + 1)));
  uint64_t samples = 0;
  const auto start = Clock::now();
  while (seconds_since(start) < s.seconds) {
    const auto batch = sampler.next_batch();
    for (size_t r = 0; r < batch.indices.size(); ++r) {
      const uint16_t* src = tokens + batch.indices[r] * static_cast<uint64_t>(s.seq_len);
      int64_t* dst = out.data() + r * static_cast<size_t>(s.seq_len + 1);
      for (int64_t k = 0; k <= s.seq_len; ++k) dst[k] = src[k];
    }
    keep(out.data());
    samples += batch.indices.size();
  }
  return static_cast<double>(samples) / seconds_since(start);
}

// The limit for records: the same records located through the index and copied (image bytes
// and label) into reused buffers; one thread, no checksum, no tensors.
double record_limit_rate(const fs::path& ds, const Settings& s) {
  const loom::data::Manifest m = loom::data::read_manifest(ds);
  loom::data::format::RecordShard shard(ds, m.shards.at(0));
  loom::data::GlobalSampler sampler({.num_samples = shard.num_records(),
                                     .per_rank_batch = static_cast<uint64_t>(s.record_batch)});
  std::vector<uint8_t> images(static_cast<size_t>(s.record_batch) * 784);
  std::vector<int64_t> labels(static_cast<size_t>(s.record_batch));
  uint64_t samples = 0;
  const auto start = Clock::now();
  while (seconds_since(start) < s.seconds) {
    const auto batch = sampler.next_batch();
    for (size_t r = 0; r < batch.indices.size(); ++r) {
      const uint8_t* p = shard.file().data() + shard.offset(batch.indices[r]);
      std::memcpy(images.data() + r * 784, p + 4 + 16, 784);  // ndim, shape, pixels
      std::memcpy(&labels[r], p + 4 + 16 + 784, 8);
    }
    keep(images.data());
    keep(labels.data());
    samples += batch.indices.size();
  }
  return static_cast<double>(samples) / seconds_since(start);
}

const char* kPythonLoader = R"PY(
import sys, time, numpy as np, torch
from torch.utils.data import Dataset, DataLoader, RandomSampler
kind, path, workers, batch, seq, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
torch.set_num_threads(1)
class Tokens(Dataset):
    def __init__(self):
        self.count = (np.memmap(path, dtype=np.uint16, mode='r', offset=64).shape[0])
        self.arr = None
    def __len__(self):
        return (self.count - 1) // seq
    def __getitem__(self, i):
        if self.arr is None:
            self.arr = np.memmap(path, dtype=np.uint16, mode='r', offset=64)
        return torch.from_numpy(self.arr[i * seq:i * seq + seq + 1].astype(np.int64))
class Images(Dataset):
    def __init__(self):
        self.images = np.memmap(path + '-images.u8', dtype=np.uint8, mode='r').reshape(-1, 28, 28)
        self.labels = np.memmap(path + '-labels.u8', dtype=np.uint8, mode='r')
    def __len__(self):
        return self.labels.shape[0]
    def __getitem__(self, i):
        return torch.from_numpy(np.array(self.images[i])), int(self.labels[i])
ds = Tokens() if kind == 'tokens' else Images()
loader = DataLoader(ds, batch_size=batch, sampler=RandomSampler(ds), num_workers=workers,
                    persistent_workers=workers > 0, drop_last=True)
samples, start, warm = 0, None, 0
while True:
    for b in loader:
        warm += 1
        if warm == 3:
            start = time.perf_counter()
        elif start is not None:
            samples += batch
        if start is not None and time.perf_counter() - start > seconds:
            print(samples / (time.perf_counter() - start))
            sys.exit(0)
)PY";

// Samples per second of the Python DataLoader, or 0 when Python or torch is missing.
double dataloader_rate(const Settings& s, const fs::path& work, const std::string& kind,
                       const std::string& path, int workers, int64_t batch) {
  const fs::path script = work / "loader.py";
  std::ofstream(script) << kPythonLoader;
  const fs::path out = work / "loader.out";
  fs::remove(out);
  auto status =
      loom::util::Subprocess::spawn(
          {.argv = {s.python, script.string(), kind, path, std::to_string(workers),
                    std::to_string(batch), std::to_string(s.seq_len), std::to_string(s.seconds)},
           .output = out})
          .wait();
  std::ifstream in(out);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  if (!status.ok()) {
    std::cerr << "bench_data: the Python DataLoader run failed (" << status.describe()
              << "): " << text << "\n";
    return 0;
  }
  return std::stod(text);
}

void report(const Settings& s, Row row) {
  if (s.json) {
    loom::bench::print_json(row);
  } else {
    std::printf("%-30s %14.0f %14.0f  %-34s %6.2fx  %s\n", row.case_name.c_str(), row.loom,
                row.baseline, row.baseline_name.c_str(), row.ratio, row.unit.c_str());
  }
  std::fflush(stdout);
}

// One kind of data, and how to read it the three ways.
struct Kind {
  std::string label;   // "tokens": the case names start with it
  std::string suffix;  // after the world size in the case name, e.g. "/T512"
  std::string unit;
  fs::path dataset;
  loom::data::ReaderOptions options;
  double limit_samples_per_second = 0;
  double per_sample = 1;    // units per sample (tokens per window)
  std::string python_kind;  // the DataLoader script's dataset: "tokens" or "images"
  std::string python_path;
};

// A kind's rows: Loom at W = 1 and 2 beside the limit, and at W = 1 beside the better of the
// DataLoader's num_workers 0 and 2.
void compare(const Settings& s, const fs::path& work, const Kind& kind) {
  const double limit = kind.limit_samples_per_second * kind.per_sample;
  double w1 = 0;
  for (int world : {1, 2}) {
    const double rate = reader_rate(kind.dataset, kind.options, world, s.seconds) * kind.per_sample;
    if (world == 1) w1 = rate;
    report(s, {"data", kind.label + "/W" + std::to_string(world) + kind.suffix, rate, limit,
               "limit: 1-thread gather from mmap", kind.unit, rate / limit});
  }
  const int64_t batch = kind.options.batch_size;
  const double dl0 =
      dataloader_rate(s, work, kind.python_kind, kind.python_path, 0, batch) * kind.per_sample;
  const double dl2 =
      dataloader_rate(s, work, kind.python_kind, kind.python_path, 2, batch) * kind.per_sample;
  const double best = std::max(dl0, dl2);
  report(s, {"data",
             kind.label + "/W1/vs-dataloader",
             w1,
             best,
             dl2 >= dl0 ? "DataLoader num_workers=2" : "DataLoader num_workers=0",
             kind.unit,
             best > 0 ? w1 / best : 0,
             {{"dataloader_w0", dl0}, {"dataloader_w2", dl2}}});
}

// Tokens per second of one pass over a whole epoch by a fresh reader (no prefetch), which
// hashes every chunk of the dataset on the way when verify_chunks is on.
double first_pass_rate(const fs::path& ds, const Settings& s, bool verify_chunks) {
  const auto start = Clock::now();
  loom::data::Reader reader(ds, {.batch_size = s.token_batch,
                                 .seq_len = s.seq_len,
                                 .prefetch = 0,
                                 .verify_chunks = verify_chunks});
  const uint64_t steps = reader.steps_per_epoch();
  for (uint64_t i = 0; i < steps; ++i) reader.next();
  const double tokens = static_cast<double>(steps * static_cast<uint64_t>(s.token_batch) *
                                            static_cast<uint64_t>(s.seq_len));
  LOOM_CHECK(!verify_chunks || reader.chunks_verified() > 0, loom::Error,
             "bench_data: the reader checked no chunk; is ", ds.string(), " format 2?");
  return tokens / seconds_since(start);
}

// The cost of chunk checks: steady state (chunks verified early, then a flag load per touch)
// and the first pass over an epoch (every chunk hashed once).
void chunk_check_cost(const Settings& s, const fs::path& kjv) {
  loom::data::ReaderOptions options{
      .batch_size = s.token_batch, .seq_len = s.seq_len, .prefetch = 4};
  const double checked = reader_rate(kjv, options, 1, s.seconds) * static_cast<double>(s.seq_len);
  options.verify_chunks = false;
  const double unchecked = reader_rate(kjv, options, 1, s.seconds) * static_cast<double>(s.seq_len);
  report(s, {"data", "tokens/W1/chunk-checks", checked, unchecked, "the same, verify_chunks off",
             "tokens/s", checked / unchecked});
  // Checked and unchecked passes alternate, so that drifting load hits both; the best of 20.
  double first = 0, first_unchecked = 0;
  for (int run = 0; run < 20; ++run) {
    first = std::max(first, first_pass_rate(kjv, s, true));
    first_unchecked = std::max(first_unchecked, first_pass_rate(kjv, s, false));
  }
  report(s, {"data", "tokens/first-epoch/chunk-checks", first, first_unchecked,
             "the same, verify_chunks off", "tokens/s", first / first_unchecked});
}

// Seconds for restore() then the first next() at `position` of an epoch.
double restore_seconds(loom::data::Reader& reader, uint64_t position) {
  const auto state = reader.state();
  const auto start = Clock::now();
  reader.restore({state.dataset_version, state.seed, 0, position});
  reader.next();
  return seconds_since(start);
}

// The median and the spread (max - min) of `v`.
std::pair<double, double> median_spread(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v.back() - v.front()};
}

#ifdef LOOM_BENCH_REMOTE

// Milliseconds for a fresh reader with a cold cache to deliver `steps` steps of one sample each,
// the trainer's compute taking compute_ms per step, with or without the lookahead.
double cold_read_seconds(const std::string& url, const fs::path& cache, const Settings& s,
                         uint64_t steps, bool lookahead) {
  fs::remove_all(cache);
  loom::data::ReaderOptions o{.batch_size = 1, .seq_len = s.seq_len, .prefetch = 2};
  o.cache.dir = cache;
  o.lookahead_steps = lookahead ? 256 : 0;
  o.remote.backoff_s = 0.005;  // the one-connection server answers 503 to a second request
  o.remote.backoff_max_s = 0.02;
  o.remote.attempts = 1000;
  const auto start = Clock::now();
  loom::data::Reader reader(url, o);
  for (uint64_t i = 0; i < steps; ++i) {
    reader.next();
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(s.compute_ms));
  }
  return seconds_since(start) * 1e3;
}

// The least time a cold start of `steps` one-sample steps can take on a server sending `rate`
// bytes per second: step k cannot start before the shards steps 0..k read have all arrived,
// however well they are ordered, and every step after it takes compute_ms.
double cold_order_bound_ms(const fs::path& ds, const Settings& s, uint64_t steps, double rate) {
  const loom::data::Manifest m = loom::data::read_manifest(ds);
  std::vector<uint64_t> begins{0};
  for (const auto& shard : m.shards) begins.push_back(begins.back() + shard.items);
  const uint64_t samples = (m.total_items() - 1) / static_cast<uint64_t>(s.seq_len);
  loom::data::GlobalSampler sampler({.num_samples = samples, .seed = 0, .per_rank_batch = 1});
  std::vector<bool> have(m.shards.size());
  double bytes = 0, bound = 0;
  for (uint64_t k = 0; k < steps; ++k) {
    const uint64_t i = sampler.next_batch().indices[0];
    for (uint64_t t : {i * s.seq_len, i * s.seq_len + s.seq_len}) {
      const size_t shard = std::upper_bound(begins.begin(), begins.end(), t) - begins.begin() - 1;
      if (!have[shard]) bytes += static_cast<double>(m.shards[shard].bytes);
      have[shard] = true;
    }
    bound = std::max(bound, bytes / rate * 1e3 + static_cast<double>(steps - k) * s.compute_ms);
  }
  return bound;
}

// Remote datasets: through a warm node cache beside the local directory (both read by the
// same Reader code; the remote one from the cache's copies), and a cold start on a server
// throttled to a fixed bandwidth, with the lookahead beside without it.
void remote_cases(const Settings& s, const fs::path& work) {
  const fs::path kjv = work / "kjv";
  {
    loom::testing::Nginx nginx(work);
    loom::data::ReaderOptions o{.batch_size = s.token_batch, .seq_len = s.seq_len, .prefetch = 4};
    o.cache.dir = work / "cache-warm";
    loom::data::Reader(nginx.url() + "/kjv", o).next();  // warms the cache
    std::vector<double> remote, local, ratio;
    for (int round = 0; round < s.rounds; ++round) {
      remote.push_back(reader_rate(nginx.url() + "/kjv", o, 1, s.seconds) * s.seq_len);
      local.push_back(reader_rate(kjv, o, 1, s.seconds) * s.seq_len);
      ratio.push_back(remote.back() / local.back());
    }
    const auto [r, r_spread] = median_spread(remote);
    const auto [l, l_spread] = median_spread(local);
    report(s, {"data",
               "remote/warm-cache/W1/T" + std::to_string(s.seq_len),
               r,
               l,
               "the same reader on the local directory",
               "tokens/s",
               median_spread(ratio).first,
               {{"rounds", static_cast<double>(s.rounds)},
                {"loom_spread", r_spread},
                {"baseline_spread", l_spread}}});
  }
  // 16 shards of 1 MiB on a server that sends one response at a time at s.rate.
  const fs::path many = work / "many";
  if (!fs::exists(many / "manifest.json")) {
    fs::remove_all(many);
    loom::data::TokenDatasetWriter writer(many, {.vocab_size = 50000, .tokens_per_shard = 1 << 19});
    std::vector<uint32_t> doc(1000);
    for (uint32_t i = 0; writer.tokens_written() < (16u << 19) - 1000; ++i) {
      for (uint32_t& t : doc) t = (t * 31 + i) % 50000;
      writer.add_document(doc);
    }
    writer.finish();
  }
  loom::testing::Nginx nginx(work, {.limit_rate = s.rate, .max_connections = 1});
  const uint64_t steps = 64;
  // The server's bandwidth as a download sees it: two shards, one after the other.
  double rate = 0;
  {
    const loom::data::Manifest m = loom::data::read_manifest(many);
    loom::data::RemoteClient client;
    const auto start = Clock::now();
    for (int i = 0; i < 2; ++i) {
      fs::remove(work / "rate.part");
      client.download(nginx.url() + "/many/" + m.shards[i].file, work / "rate.part",
                      m.shards[i].bytes);
      rate += static_cast<double>(m.shards[i].bytes);
    }
    rate /= seconds_since(start);
  }
  const double bound = cold_order_bound_ms(many, s, steps, rate);
  std::vector<double> with, without, ratio;
  for (int round = 0; round < s.rounds; ++round) {
    without.push_back(
        cold_read_seconds(nginx.url() + "/many", work / "cache-cold", s, steps, false));
    with.push_back(cold_read_seconds(nginx.url() + "/many", work / "cache-cold", s, steps, true));
    ratio.push_back(without.back() / with.back());
  }
  const auto [w, w_spread] = median_spread(with);
  const auto [wo, wo_spread] = median_spread(without);
  report(s, {"data",
             "remote/cold/lookahead/" + s.rate + "/" + std::to_string(steps) + "steps",
             w,
             wo,
             "the same without the lookahead",
             "ms",
             median_spread(ratio).first,
             {{"rounds", static_cast<double>(s.rounds)},
              {"loom_spread", w_spread},
              {"baseline_spread", wo_spread},
              {"compute_ms", s.compute_ms},
              {"order_bound_ms", bound},
              {"bandwidth_bytes_per_s", rate}}});
  if (!s.json) {
    std::printf(
        "  the order's bound for that cold start at the measured %.1f MiB/s: %.0f ms "
        "(the lookahead at %.2fx of it)\n",
        rate / (1 << 20), bound, bound / w);
  }
}
#endif

// ---- --mode=service: the data service beside the in-process reader ----

// A preprocessing-heavy dataset: JPEG photos-like images (smooth gradients and noise) that every
// read decodes, with a caption and a label. Built once into the work directory.
fs::path jpeg_dataset(const fs::path& work, int64_t side) {
  const fs::path dir = work / ("jpeg" + std::to_string(side));
  if (fs::exists(dir / "manifest.json")) return dir;
  fs::remove_all(dir);
  loom::data::RecordDatasetWriter writer(dir,
                                         {{.name = "image", .type = loom::data::FieldType::kImage},
                                          {.name = "label", .type = loom::data::FieldType::kInt}});
  uint32_t random = 12345;
  std::vector<uint8_t> pixels(static_cast<size_t>(side * side * 3));
  for (int r = 0; r < 2048; ++r) {
    for (int64_t y = 0; y < side; ++y) {
      for (int64_t x = 0; x < side; ++x) {
        for (int64_t c = 0; c < 3; ++c) {
          random = random * 1664525u + 1013904223u;
          pixels[static_cast<size_t>((y * side + x) * 3 + c)] =
              static_cast<uint8_t>((x * (c + 1) + y * (3 - c) + r * 7) / 2 + (random >> 29));
        }
      }
    }
    writer.add(loom::data::Record()
                   .image(loom::data::image::encode_jpeg(pixels.data(), side, side, 3, 90))
                   .integer(r % 10));
  }
  writer.finish();
  return dir;
}

// A `loom data service` process on loopback; stopped (SIGTERM) when destroyed.
struct ServiceProcess {
  loom::util::Subprocess process;
  std::string endpoint;
  explicit ServiceProcess(const fs::path& log)
      : process(loom::util::Subprocess::spawn(
            {.argv = {LOOM_BINARY_DIR "/tools/loom/loom", "data", "service", "--host", "127.0.0.1",
                      "--port", "0"},
             .env = {{"OMP_NUM_THREADS", "1"}},
             .output = log})) {
    const auto deadline = Clock::now() + std::chrono::seconds(30);
    const std::string mark = "serving at ";
    while (endpoint.empty()) {
      LOOM_CHECK(Clock::now() < deadline, loom::Error, "loom data service did not start; see ",
                 log.string());
      std::ifstream in(log);
      const std::string text((std::istreambuf_iterator<char>(in)), {});
      const size_t at = text.find(mark);
      if (at != std::string::npos && text.find(' ', at + mark.size()) != std::string::npos) {
        endpoint =
            text.substr(at + mark.size(), text.find(' ', at + mark.size()) - at - mark.size());
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  ~ServiceProcess() {
    process.signal(SIGTERM);
    process.wait();
  }
};

// The trainer's compute for one step: matrix products on its one thread for about `ms`.
void compute_for(double ms, const at::Tensor& a) {
  const auto start = Clock::now();
  while (seconds_since(start) * 1e3 < ms) keep(at::mm(a, a).data_ptr());
}

// Samples per second one trainer gets from `source` over `seconds`, computing `compute_ms` per
// step (after 3 warm-up steps, not counted).
double trainer_rate(loom::data::BatchSource& source, double seconds, double compute_ms) {
  const at::Tensor a = at::rand({128, 128});
  for (int i = 0; i < 3; ++i) source.next();
  uint64_t samples = 0;
  const auto start = Clock::now();
  while (seconds_since(start) < seconds) {
    samples += static_cast<uint64_t>(source.next().num_real);
    if (compute_ms > 0) compute_for(compute_ms, a);
  }
  return static_cast<double>(samples) / seconds_since(start);
}

void service_cases(const Settings& s, const fs::path& work) {
  at::set_num_threads(1);  // the trainer: one thread, as each rank of a 2-rank job here
  const int64_t side = s.image_side;
  const fs::path ds = jpeg_dataset(work, side);
  const loom::data::ReaderOptions options{.batch_size = 32, .seed = 1, .prefetch = 4};
  std::vector<std::unique_ptr<ServiceProcess>> services;
  for (int i = 0; i < 2; ++i) {
    services.push_back(
        std::make_unique<ServiceProcess>(work / ("service" + std::to_string(i) + ".log")));
  }
  for (const double compute : {0.0, s.compute_ms}) {
    // Rounds interleaved: each round measures the in-process reader, then 1 and 2 replicas.
    std::vector<double> local, one, two;
    for (int round = 0; round < s.rounds; ++round) {
      {
        loom::data::Reader reader(ds, options);
        local.push_back(trainer_rate(reader, s.seconds, compute));
      }
      for (const int replicas : {1, 2}) {
        loom::data::ServiceReaderOptions service;
        for (int i = 0; i < replicas; ++i) service.endpoints.push_back(services[i]->endpoint);
        service.prefetch = 4;
        loom::data::ServiceReader reader(ds.string(), options, service);
        (replicas == 1 ? one : two).push_back(trainer_rate(reader, s.seconds, compute));
      }
    }
    const auto [l, l_spread] = median_spread(local);
    for (const int replicas : {1, 2}) {
      const std::vector<double>& got = replicas == 1 ? one : two;
      std::vector<double> ratio;
      for (size_t i = 0; i < got.size(); ++i) ratio.push_back(got[i] / local[i]);
      const auto [g, g_spread] = median_spread(got);
      report(s, {"data",
                 "service/jpeg" + std::to_string(side) + "/" + std::to_string(replicas) +
                     "replica" + (replicas > 1 ? "s" : "") + "/compute" +
                     std::to_string(static_cast<int>(compute)) + "ms",
                 g,
                 l,
                 "the in-process Reader (prefetch 4)",
                 "samples/s",
                 median_spread(ratio).first,
                 {{"rounds", static_cast<double>(s.rounds)},
                  {"loom_spread", g_spread},
                  {"baseline_spread", l_spread},
                  {"compute_ms", compute},
                  {"batch", 32}}});
    }
  }
}

int run(const Settings& s) {
  const fs::path work =
      s.work_dir.empty() ? fs::temp_directory_path() / "loom-bench-data" : fs::path(s.work_dir);
  if (!s.json) {
    std::printf("%-30s %14s %14s  %-34s %7s  %s\n", "case", "loom", "baseline", "baseline", "ratio",
                "unit");
  }
  if (s.mode == "service") {
    fs::create_directories(work);
    service_cases(s, work);
    return 0;
  }
  prepare(s, work);
  if (s.mode == "remote") {
#ifdef LOOM_BENCH_REMOTE
    remote_cases(s, work);
    return 0;
#else
    throw loom::Error(
        "--mode=remote needs the test harness's servers: build with LOOM_BUILD_TESTS=ON");
#endif
  }
  const fs::path kjv = work / "kjv";
  compare(s, work,
          {.label = "tokens",
           .suffix = "/T" + std::to_string(s.seq_len),
           .unit = "tokens/s",
           .dataset = kjv,
           .options = {.batch_size = s.token_batch, .seq_len = s.seq_len, .prefetch = 4},
           .limit_samples_per_second = token_limit_rate(kjv, s),
           .per_sample = static_cast<double>(s.seq_len),
           .python_kind = "tokens",
           .python_path = (kjv / "tokens_00000.bin").string()});
  chunk_check_cost(s, kjv);
  const fs::path fashion = work / "fashion";
  compare(s, work,
          {.label = "fashion-mnist",
           .unit = "samples/s",
           .dataset = fashion,
           .options = {.batch_size = s.record_batch, .prefetch = 4},
           .limit_samples_per_second = record_limit_rate(fashion, s),
           .python_kind = "images",
           .python_path = fashion.string()});

  // restore() is O(1): the same cost at the start of an epoch and deep into one. The second
  // case uses a sampler over 2^40 samples (no dataset here is that big) at position 10^9.
  loom::data::Reader reader(kjv,
                            {.batch_size = s.token_batch, .seq_len = s.seq_len, .prefetch = 0});
  double at0 = 1e9, at_end = 1e9;
  const uint64_t last = (reader.num_samples() / static_cast<uint64_t>(s.token_batch) - 1) *
                        static_cast<uint64_t>(s.token_batch);
  for (int i = 0; i < 50; ++i) {
    at0 = std::min(at0, restore_seconds(reader, 0));
    at_end = std::min(at_end, restore_seconds(reader, last));
  }
  report(s, {"data", "restore+next/kjv/end-of-epoch", at_end * 1e6, at0 * 1e6,
             "the same at position 0", "us", at0 / at_end});
  loom::data::GlobalSampler big(
      {.num_samples = uint64_t{1} << 40, .per_rank_batch = static_cast<uint64_t>(s.token_batch)});
  double big0 = 1e9, big9 = 1e9;
  for (int i = 0; i < 50; ++i) {
    for (uint64_t position : {uint64_t{0}, uint64_t{1000000000}}) {
      const auto start = Clock::now();
      big.restore({"", 0, 0, position});
      big.next_batch();
      (position == 0 ? big0 : big9) = std::min(position == 0 ? big0 : big9, seconds_since(start));
    }
  }
  report(s, {"data", "restore+next/2^40-samples/at-1e9", big9 * 1e6, big0 * 1e6,
             "the same at position 0", "us", big0 / big9});
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{"bench_data: data::Reader beside a raw mmap gather loop and PyTorch's DataLoader"};
  app.add_option("--seq-len", s.seq_len, "tokens per sample (T)")->capture_default_str();
  app.add_option("--token-batch", s.token_batch, "token samples per rank per step")
      ->capture_default_str();
  app.add_option("--record-batch", s.record_batch, "Fashion-MNIST samples per rank per step")
      ->capture_default_str();
  app.add_option("--seconds", s.seconds, "seconds per measurement")->capture_default_str();
  app.add_option("--python", s.python, "the Python with torch for the DataLoader peer")
      ->capture_default_str();
  app.add_option("--work-dir", s.work_dir,
                 "where the datasets are built (kept; default $TMPDIR/loom-bench-data)");
  app.add_option("--mode", s.mode,
                 "local: the Reader beside the limit and the DataLoader; remote: through nginx "
                 "on loopback (warm cache beside local, cold start with and without lookahead); "
                 "weights: weight snapshots beside memcpy and raw TCP (weights-peer: its "
                 "subscriber process); service: JPEG images decoded by `loom data service` "
                 "processes (1 and 2 replicas) beside the in-process Reader, for one trainer")
      ->check(CLI::IsMember({"local", "remote", "weights", "weights-peer", "service"}))
      ->capture_default_str();
  loom::bench::WeightsSettings w;
  app.add_option("--weights-mib", w.mib, "weights: MiB per version")->capture_default_str();
  app.add_option("--weights-source", w.peer_source, "weights-peer: the subscriber's source");
  app.add_option("--weights-raw", w.peer_raw, "weights-peer: the raw TCP baseline's address");
  app.add_option("--rounds", s.rounds, "remote, weights, service: rounds, the sides interleaved")
      ->capture_default_str();
  app.add_option("--compute-ms", s.compute_ms,
                 "remote cold start, service: the trainer's compute per step")
      ->capture_default_str();
  app.add_option("--rate", s.rate, "remote cold start: the server's bandwidth (nginx limit_rate)")
      ->capture_default_str();
  app.add_option("--image-side", s.image_side, "service: the JPEG images' height and width")
      ->capture_default_str();
  app.add_flag("--json", s.json, "print one JSON object per row");
  CLI11_PARSE(app, argc, argv);
  w.rounds = s.rounds;
  w.json = s.json;
  try {
    if (s.mode == "weights") return loom::bench::run_weights(w);
    if (s.mode == "weights-peer") return loom::bench::run_weights_peer(w);
    return run(s);
  } catch (const std::exception& e) {
    std::cerr << "bench_data: error: " << e.what() << std::endl;
    return 1;
  }
}

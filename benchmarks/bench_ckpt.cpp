// bench_ckpt: Loom's asynchronous checkpointer beside the limit and the peer, in one run on
// the same disk, one rank:
//   stall_cold  how long the first save() of a new Checkpointer blocks training (the copy into
//               staging memory it allocates), beside the peer's whole torch::save + fsync;
//   stall       the same for a later save(), which reuses the staging memory (warm);
//   save        save() to wait() (copy, hash, write, fsync, commit) beside a raw O_DIRECT write +
//               fsync of the same bytes from one aligned buffer: the disk's limit (save_background:
//               the part after save() returned; save_vs_buffered: beside a buffered write + fsync);
//   torch       the same Loom save beside torch::save + fsync of the same tensors;
//   load        load() with hash verification, from a cold page cache (posix_fadvise DONTNEED),
//               beside a raw O_DIRECT pread of the same bytes (the disk's limit);
//   *_vs_parallel  the same save and load beside raw O_DIRECT transfers in Loom's pattern: as
//               many 8 MiB writes in flight as Loom has I/O threads (--io-threads), as many reads
//               of --read-bytes in flight as Loom has at load (--reads-in-flight): one pwrite or
//               pread at a time is not the disk's limit when several in flight are faster.
//   step_*      a training step's stand-in: save(defer_copy) after the optimizer step, then
//               --step-compute seconds of matmuls over torch's threads (forward and backward),
//               then before_optimizer_step(). Loom's copy thread copying during the compute
//               (background_copy) beside the whole copy at before_optimizer_step() on the
//               training thread over torch's threads (the copy Loom made before): the step's
//               time from save() to the optimizer step (step_time), the stall alone (save()
//               plus before_optimizer_step(): step_stall), the same for the first save of a
//               new Checkpointer, which allocates its staging memory (step_stall_cold), and the
//               step beside the same compute without a save (step_vs_no_save: the limit).
// Every round measures every case once, Loom and its baseline next to each other (the one that
// goes first alternating), so that the disk's drift hits both. Reported per case: the median over
// the rounds of each side, its spread ((max - min) / median), the ratio of the medians and the
// median of the per-round ratios with their range. Ratios above 1 mean Loom is better.
// Targets: stall ratio >= 10; save, load >= 0.9.
//
//   bench_ckpt                      1 GiB in 16 float32 tensors, table
//   bench_ckpt --size=64M --json    JSON rows
#include <fcntl.h>
#include <sys/mman.h>
#include <torch/torch.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <thread>
#include <vector>

#include "bench_report.h"
#include "loom/ckpt/checkpointer.h"
#include "loom/comm/store.h"
#include "loom/error.h"
#include "util/fd.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Settings {
  std::string size = "1G";  // bytes of state, with an optional K/M/G suffix
  int tensors = 16;
  int rounds = 5;   // each case measured this many times; medians count
  std::string dir;  // default: $TMPDIR/loom-bench-ckpt-<pid>
  bool json = false;
  bool verbose = false;  // the checkpointer's debug log: time per phase of each save
  int io_threads = loom::ckpt::CheckpointerOptions{}.io_threads;     // Loom's writes in flight
  size_t read_bytes = loom::ckpt::CheckpointerOptions{}.read_bytes;  // Loom's bytes per read
  int reads_in_flight = loom::ckpt::CheckpointerOptions{}.reads_in_flight;
  double step_compute = 0.5;  // seconds of matmuls standing in for a step's forward and backward
};

int64_t parse_size(const std::string& text) {
  size_t used = 0;
  double value = std::stod(text, &used);
  std::string suffix = text.substr(used);
  double scale = 1;
  if (suffix == "K" || suffix == "KiB") scale = 1024.0;
  if (suffix == "M" || suffix == "MiB") scale = 1024.0 * 1024;
  if (suffix == "G" || suffix == "GiB") scale = 1024.0 * 1024 * 1024;
  LOOM_CHECK(suffix.empty() || scale > 1, loom::InvalidArgument, "--size: unknown suffix \"",
             suffix, "\" (use K, M or G)");
  return static_cast<int64_t>(value * scale);
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

void fsync_path(const std::filesystem::path& path) {
  loom::util::UniqueFd fd(LOOM_CHECK_SYS(::open(path.c_str(), O_RDONLY), "opening ", path));
  LOOM_CHECK_SYS(::fsync(fd.get()), "syncing ", path);
}

// Drops the file's clean pages from the page cache so that the next read comes from disk.
void drop_cache(const std::filesystem::path& path) {
  loom::util::UniqueFd fd(LOOM_CHECK_SYS(::open(path.c_str(), O_RDONLY), "opening ", path));
  ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_DONTNEED);
}

void drop_cache_dir(const std::filesystem::path& dir) {
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir))
    if (entry.is_regular_file()) drop_cache(entry.path());
}

constexpr size_t kIoBytes = size_t{8} << 20;

// Writes [data, data + size) to a new file in 8 MiB writes, then fsyncs. With direct, O_DIRECT
// (data must be 4 KiB aligned, size a multiple of 4 KiB): what the disk itself can do.
double raw_write(const char* data, size_t size, const std::filesystem::path& path, bool direct) {
  auto start = Clock::now();
  loom::util::UniqueFd fd(LOOM_CHECK_SYS(
      ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | (direct ? O_DIRECT : 0), 0644),
      "creating ", path));
  while (size > 0) {
    ssize_t n = LOOM_CHECK_SYS(::write(fd.get(), data, std::min(size, kIoBytes)), "writing ", path);
    data += n;
    size -= static_cast<size_t>(n);
  }
  LOOM_CHECK_SYS(::fsync(fd.get()), "syncing ", path);
  return seconds_since(start);
}

double raw_read(const std::filesystem::path& path, char* buffer, size_t size) {
  auto start = Clock::now();
  // O_DIRECT: the disk's own speed, not the page cache's readahead policy (buffer and size are
  // 4 KiB aligned).
  loom::util::UniqueFd fd(
      LOOM_CHECK_SYS(::open(path.c_str(), O_RDONLY | O_DIRECT), "opening ", path));
  size_t done = 0;
  while (done < size) {
    ssize_t n = LOOM_CHECK_SYS(
        ::pread(fd.get(), buffer + done, std::min(size - done, kIoBytes), static_cast<off_t>(done)),
        "reading ", path);
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  return seconds_since(start);
}

// The same O_DIRECT transfer of [0, size) in blocks of `block` bytes, with `threads` blocks in
// flight (one pwrite or pread per thread at a time, blocks taken in order): the disk's limit at
// the block size and queue depth Loom uses. Writes end with an fsync.
double raw_parallel(char* data, size_t size, const std::filesystem::path& path, int threads,
                    size_t block, bool write) {
  auto start = Clock::now();
  const int flags = write ? O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT : O_RDONLY | O_DIRECT;
  loom::util::UniqueFd fd(LOOM_CHECK_SYS(::open(path.c_str(), flags, 0644), "opening ", path));
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&] {
      for (size_t at; (at = next.fetch_add(block)) < size;) {
        const size_t n = std::min(block, size - at);
        const ssize_t done = write ? ::pwrite(fd.get(), data + at, n, static_cast<off_t>(at))
                                   : ::pread(fd.get(), data + at, n, static_cast<off_t>(at));
        if (done != static_cast<ssize_t>(n)) failed = true;
      }
    });
  }
  for (auto& w : workers) w.join();
  LOOM_CHECK(!failed, loom::IoError, "bench_ckpt: a parallel ", write ? "write to " : "read of ",
             path, " came up short");
  if (write) LOOM_CHECK_SYS(::fsync(fd.get()), "syncing ", path);
  return seconds_since(start);
}

struct FreeDeleter {
  void operator()(char* p) const { std::free(p); }
};

// One side of one case: a time per round.
struct Samples {
  std::vector<double> s;
  double median() const { return median_of(s); }
  double min() const { return *std::min_element(s.begin(), s.end()); }
  double max() const { return *std::max_element(s.begin(), s.end()); }
  double spread_pct() const { return (max() - min()) / median() * 100; }

  static double median_of(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  }
};

struct Case {
  const char* name;
  const Samples& loom;
  const Samples& baseline;
  const char* baseline_name;
  double bytes;  // for throughput columns; 0 when not a transfer
  const char* target;
};

// Calls first() then second() on even rounds and the other way round on odd ones.
template <typename A, typename B>
void in_turn(int round, A&& first, B&& second) {
  if (round % 2 == 0) {
    first();
    second();
  } else {
    second();
    first();
  }
}

int run(const Settings& s) {
  const int64_t bytes = parse_size(s.size);
  LOOM_CHECK(bytes >= 4 * s.tensors && s.tensors > 0, loom::InvalidArgument,
             "--size must hold at least one float per tensor");
  const std::filesystem::path dir = s.dir.empty()
                                        ? std::filesystem::temp_directory_path() /
                                              loom::detail::concat("loom-bench-ckpt-", ::getpid())
                                        : std::filesystem::path(s.dir);
  std::filesystem::create_directories(dir);
  torch::manual_seed(1);

  // The state: `tensors` float32 tensors of equal size, model-like 2-D shapes.
  const int64_t per_tensor = bytes / 4 / s.tensors;
  const int64_t cols = per_tensor >= 1024 ? 1024 : 1;
  std::vector<torch::Tensor> tensors;
  loom::ckpt::State state;
  for (int i = 0; i < s.tensors; ++i) {
    tensors.push_back(torch::randn({per_tensor / cols, cols}));
    state.add(loom::detail::concat("layer", i, ".weight"), tensors.back());
  }
  state.blobs["trainer"] = R"({"step":1})";
  double total = 0;
  for (const auto& t : tensors) total += static_cast<double>(t.nbytes());

  loom::ckpt::State target;
  for (int i = 0; i < s.tensors; ++i)
    target.add(state.tensors[i].name, torch::zeros_like(tensors[i]));
  target.blobs["trainer"] = "";  // read back like a trainer does (a strict load)
  // The raw baselines' buffer: the same bytes, padded to 4 KiB (for O_DIRECT), in 2 MiB pages
  // like Loom's staging memory: O_DIRECT pins the buffer's pages, and pinning 2 MiB pages is
  // cheaper, so a baseline in 4 KiB pages would not be the limit.
  const size_t padded = (static_cast<size_t>(total) + 4095) / 4096 * 4096;
  const size_t huge = size_t{2} << 20, allocated = (padded + huge - 1) / huge * huge;
  std::unique_ptr<char, FreeDeleter> buffer(
      static_cast<char*>(std::aligned_alloc(huge, allocated)));
  ::madvise(buffer.get(), allocated, MADV_HUGEPAGE);
  std::memset(buffer.get(), 0, padded);
  size_t at = 0;
  for (const auto& t : tensors) {
    std::memcpy(buffer.get() + at, t.data_ptr(), t.nbytes());
    at += t.nbytes();
  }

  // The step's compute: a fixed number of 512 x 512 matmuls, as many as take --step-compute
  // seconds here (counted once, then the same work in every round).
  const torch::Tensor a = torch::randn({512, 512}), b = torch::randn({512, 512});
  torch::Tensor product = torch::empty({512, 512});
  auto start = Clock::now();
  for (int i = 0; i < 20; ++i) torch::mm_out(product, a, b);
  const int matmuls = std::max(1, static_cast<int>(s.step_compute / (seconds_since(start) / 20)));
  auto compute = [&] {
    for (int i = 0; i < matmuls; ++i) torch::mm_out(product, a, b);
  };

  Samples raw_write_s, parallel_write_s, buffered_write_s, cold_stall_s, stall_s, background_s,
      save_s, torch_s, load_s, raw_read_s, parallel_read_s, step_s, step_inline_s, step_stall_s,
      step_stall_inline_s, step_cold_s, step_cold_inline_s, compute_s;
  loom::comm::InMemoryStore store;
  int64_t step = 0;
  for (int round = 0; round < s.rounds; ++round) {
    // Every write goes to a new file while the previous one still exists, as Loom's does
    // (retention removes the old step only after the new one is committed).
    const auto raw = dir / loom::detail::concat("raw_", round, ".bin");
    // A new Checkpointer each round: its first save allocates and touches the staging memory
    // (cold); the second is the steady state a training loop sees on every later save (warm).
    loom::ckpt::Checkpointer ckpt(store, {.dir = dir / "loom",
                                          .keep_last = 1,
                                          .io_threads = s.io_threads,
                                          .read_bytes = s.read_bytes,
                                          .reads_in_flight = s.reads_in_flight});
    start = Clock::now();
    auto first = ckpt.save(++step, state);
    cold_stall_s.s.push_back(seconds_since(start));
    first.wait(std::chrono::minutes(30));
    in_turn(
        round, [&] { raw_write_s.s.push_back(raw_write(buffer.get(), padded, raw, true)); },
        [&] {
          start = Clock::now();
          auto handle = ckpt.save(++step, state);
          const double stall = seconds_since(start);
          stall_s.s.push_back(stall);
          handle.wait(std::chrono::minutes(30));
          save_s.s.push_back(seconds_since(start));
          background_s.s.push_back(save_s.s.back() - stall);
        });
    // The step: save() with the copy deferred, the compute, before_optimizer_step().
    auto training_step = [&](loom::ckpt::Checkpointer& checkpointer, bool background, Samples* time,
                             Samples& stall) {
      const auto begin = Clock::now();
      auto handle =
          checkpointer.save(++step, state, {.defer_copy = true, .background_copy = background});
      const double in_save = seconds_since(begin);
      compute();
      const auto optimizer_step = Clock::now();
      checkpointer.before_optimizer_step();
      stall.s.push_back(in_save + seconds_since(optimizer_step));
      if (time) time->s.push_back(seconds_since(begin));
      handle.wait(std::chrono::minutes(30));
    };
    in_turn(
        round, [&] { training_step(ckpt, true, &step_s, step_stall_s); },
        [&] { training_step(ckpt, false, &step_inline_s, step_stall_inline_s); });
    start = Clock::now();
    compute();
    compute_s.s.push_back(seconds_since(start));
    // The first new 1 GiB of a round comes from reclaiming the page cache the writes filled,
    // which takes seconds here: an untimed save takes that, so that both sides' first saves
    // pay the same (new staging memory, its page faults and the copy).
    {
      loom::ckpt::Checkpointer primer(store, {.dir = dir / "cold", .keep_last = 1});
      primer.save(++step, state).wait(std::chrono::minutes(30));
    }
    in_turn(
        round,
        [&] {
          loom::ckpt::Checkpointer cold(store, {.dir = dir / "cold", .keep_last = 1});
          training_step(cold, true, nullptr, step_cold_s);
        },
        [&] {
          loom::ckpt::Checkpointer cold(store, {.dir = dir / "cold", .keep_last = 1});
          training_step(cold, false, nullptr, step_cold_inline_s);
        });

    const auto parallel = dir / loom::detail::concat("parallel_", round, ".bin");
    parallel_write_s.s.push_back(
        raw_parallel(buffer.get(), padded, parallel, s.io_threads, kIoBytes, /*write=*/true));
    const auto buffered = dir / loom::detail::concat("buffered_", round, ".bin");
    buffered_write_s.s.push_back(raw_write(buffer.get(), padded, buffered, false));
    std::filesystem::remove(buffered);

    const auto torch_file = dir / loom::detail::concat("torch_", round, ".pt");
    start = Clock::now();
    torch::save(tensors, torch_file.string());
    fsync_path(torch_file);
    torch_s.s.push_back(seconds_since(start));
    std::filesystem::remove(torch_file);

    drop_cache_dir(dir / "loom");
    drop_cache(raw);
    in_turn(
        round,
        [&] {
          start = Clock::now();
          ckpt.load(target);
          load_s.s.push_back(seconds_since(start));
        },
        [&] {
          raw_read_s.s.push_back(raw_read(raw, buffer.get(), padded));
          drop_cache(parallel);
          parallel_read_s.s.push_back(raw_parallel(buffer.get(), padded, parallel,
                                                   s.reads_in_flight, s.read_bytes,
                                                   /*write=*/false));
        });
    std::filesystem::remove(parallel);
    for (int i = 0; i < s.tensors; ++i)
      LOOM_CHECK(torch::equal(target.tensors[i].tensor, tensors[i]), loom::CorruptData,
                 "bench_ckpt: loaded tensor ", i, " differs from what was saved");
    for (auto& t : target.tensors) t.tensor.zero_();
    std::filesystem::remove(dir / loom::detail::concat("raw_", round - 1, ".bin"));
  }

  const std::string size_text = loom::bench::format_bytes(total);
  const Case cases[] = {
      {"stall_cold", cold_stall_s, torch_s, "torch::save + fsync (the peer's stall)", 0, ">= 10"},
      {"stall", stall_s, torch_s, "torch::save + fsync (the peer's stall)", 0, ">= 10"},
      {"save", save_s, raw_write_s, "raw O_DIRECT write + fsync (the limit)", total, ">= 0.9"},
      {"save_background", background_s, raw_write_s, "raw O_DIRECT write + fsync (the limit)",
       total, "-"},
      {"save_vs_parallel", save_s, parallel_write_s, "the same, io-threads writes in flight", total,
       "-"},
      {"save_vs_buffered", save_s, buffered_write_s, "raw buffered write + fsync", total, "-"},
      {"save_vs_torch", save_s, torch_s, "torch::save + fsync", total, "> 1"},
      {"load", load_s, raw_read_s, "raw O_DIRECT pread (the limit)", total, ">= 0.9"},
      {"load_vs_parallel", load_s, parallel_read_s, "raw reads in Loom's size and number", total,
       "-"},
      {"step_time", step_s, step_inline_s, "the copy at the optimizer step, all threads", 0, "> 1"},
      {"step_stall", step_stall_s, step_stall_inline_s, "the copy at the optimizer step", 0, "> 1"},
      {"step_stall_cold", step_cold_s, step_cold_inline_s, "the copy at the optimizer step", 0,
       "> 1"},
      {"step_vs_no_save", step_s, compute_s, "the same compute, no save (the limit)", 0, "~ 1"},
  };
  if (!s.json) {
    std::printf(
        "bench_ckpt: %s in %d float32 tensors, 1 rank, %d I/O threads (save), %d reads of %zu KiB "
        "in flight (load), dir %s, %d rounds; s = "
        "median over rounds, spread = (max - min) / median, ratio = median baseline / median "
        "loom, paired = median [min, max] of the rounds' own ratios; step compute: %d 512x512 "
        "matmuls on %d threads (median %.3f s)\n",
        size_text.c_str(), s.tensors, s.io_threads, s.reads_in_flight, s.read_bytes >> 10,
        dir.c_str(), s.rounds, matmuls, at::get_num_threads(), compute_s.median());
    std::printf("%-16s %9s %7s %7s | %9s %7s %7s  %-39s | %6s %20s %7s\n", "case", "loom s",
                "spread", "GB/s", "base s", "spread", "GB/s", "baseline is", "ratio", "paired",
                "target");
  }
  for (const Case& c : cases) {
    std::vector<double> paired;
    for (size_t i = 0; i < c.loom.s.size(); ++i) paired.push_back(c.baseline.s[i] / c.loom.s[i]);
    const double paired_median = Samples::median_of(paired);
    const double paired_min = *std::min_element(paired.begin(), paired.end());
    const double paired_max = *std::max_element(paired.begin(), paired.end());
    loom::bench::Row row{"ckpt",
                         loom::detail::concat(c.name, "/", size_text),
                         c.loom.median(),
                         c.baseline.median(),
                         c.baseline_name,
                         "s",
                         c.baseline.median() / c.loom.median(),
                         {{"bytes", total},
                          {"rounds", static_cast<double>(s.rounds)},
                          {"loom_spread_pct", c.loom.spread_pct()},
                          {"baseline_spread_pct", c.baseline.spread_pct()},
                          {"paired_ratio_median", paired_median},
                          {"paired_ratio_min", paired_min},
                          {"paired_ratio_max", paired_max}}};
    if (c.bytes > 0) {
      row.extra["loom_gbps"] = c.bytes / row.loom / 1e9;
      row.extra["baseline_gbps"] = c.bytes / row.baseline / 1e9;
    }
    if (s.json) {
      loom::bench::print_json(row);
      continue;
    }
    char loom_rate[16], base_rate[16], paired_text[32];
    std::snprintf(loom_rate, sizeof(loom_rate), c.bytes > 0 ? "%.3f" : "-",
                  c.bytes / row.loom / 1e9);
    std::snprintf(base_rate, sizeof(base_rate), c.bytes > 0 ? "%.3f" : "-",
                  c.bytes / row.baseline / 1e9);
    std::snprintf(paired_text, sizeof(paired_text), "%.2f [%.2f, %.2f]", paired_median, paired_min,
                  paired_max);
    std::printf("%-16s %8.3fs %6.0f%% %7s | %8.3fs %6.0f%% %7s  %-39s | %6.2f %20s %7s\n", c.name,
                row.loom, c.loom.spread_pct(), loom_rate, row.baseline, c.baseline.spread_pct(),
                base_rate, c.baseline_name, row.ratio, paired_text, c.target);
  }
  std::filesystem::remove_all(dir);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{"bench_ckpt: Loom's async checkpointer beside raw I/O and torch::save"};
  app.add_option("--size", s.size, "bytes of state, e.g. 1G, 64M, 4096");
  app.add_option("--tensors", s.tensors, "number of tensors the state is split into");
  app.add_option("--rounds", s.rounds, "rounds; the median of each case counts")
      ->check(CLI::Range(1, 100));
  app.add_option("--dir", s.dir, "directory on the disk to measure (default: under $TMPDIR)");
  app.add_option("--io-threads", s.io_threads, "Loom's I/O threads at save (writes in flight)")
      ->check(CLI::Range(1, 64));
  app.add_option("--read-bytes", s.read_bytes, "Loom's bytes per read at load (multiple of 4096)")
      ->check(CLI::Range(size_t{4096}, size_t{1} << 30));
  app.add_option("--reads-in-flight", s.reads_in_flight, "Loom's reads in flight at load")
      ->check(CLI::Range(1, 64));
  app.add_option("--step-compute", s.step_compute,
                 "seconds of matmuls standing in for a training step's forward and backward")
      ->check(CLI::Range(0.0, 60.0));
  app.add_flag("--json", s.json, "print one JSON object per row");
  app.add_flag("--verbose", s.verbose, "log the time of each save's phases (stderr)");
  CLI11_PARSE(app, argc, argv);
  if (s.verbose) spdlog::set_level(spdlog::level::debug);
  try {
    return run(s);
  } catch (const std::exception& e) {
    std::cerr << "bench_ckpt: error: " << e.what() << std::endl;
    return 1;
  }
}

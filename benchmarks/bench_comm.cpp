// bench_comm: Loom's CPU collectives beside libtorch's own c10d ProcessGroupGloo, measured in
// the same run by the same processes (N ranks as processes on this machine), in the style of
// nccl-tests: size, time, algorithm and bus bandwidth, and the ratio c10d time / Loom time
// (above 1: Loom is faster). c10d runs Gloo over loopback TCP; Loom runs its shared-memory
// path (the default for ranks on one host) or, with --transport=tcp, the same Gloo over TCP,
// where all_reduce, all_gather and broadcast are the same gloo calls on both sides and the
// ratio measures each one's own overhead. Rounds interleave the two sides; the median over
// rounds, the spread and the cold call are reported (docs/benchmarks.md, "Method").
//
//   bench_comm                       2 ranks, 8 B .. 256 MiB, all four ops, table
//   bench_comm --ranks=4 --json      JSON rows
#include <torch/torch.h>
#include <CLI/CLI.hpp>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <iostream>

#include "bench_ranks.h"
#include "bench_report.h"
#include "loom/comm/gloo.h"
#include "loom/error.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Settings {
  int ranks = 2;
  int64_t min_bytes = 8;
  int64_t max_bytes = int64_t{256} << 20;
  int step = 4;  // size multiplier between cases
  std::vector<std::string> ops = {"all_reduce", "reduce_scatter", "all_gather", "broadcast"};
  double seconds = 0.1;                     // target time of the slower side's block
  int rounds = 7;                           // measured rounds per side
  std::string transport = "auto";           // Loom's side: auto (shared memory on one host) or tcp
  int64_t slot_bytes = int64_t{256} << 10;  // GlooOptions::shared_memory_slot_bytes
  bool json = false;
  // Worker mode (set by the parent when it re-executes itself).
  int worker_rank = -1;
  std::string store_dir;
};

// nccl-tests' bus-bandwidth factors: what each rank's link carries relative to the data size.
double bus_factor(const std::string& op, int n) {
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  if (op == "broadcast") return 1.0;
  return static_cast<double>(n - 1) / n;  // reduce_scatter, all_gather
}

// One op of one implementation on preallocated buffers; returns after completion.
using OpFn = std::function<void()>;

struct Buffers {
  torch::Tensor full;                // the whole buffer: size bytes
  torch::Tensor part;                // one rank's share: size / ranks bytes
  std::vector<torch::Tensor> parts;  // ranks views of `full`
};

OpFn loom_op(loom::comm::Group& g, const std::string& op, Buffers& b) {
  if (op == "all_reduce") return [&] { g.all_reduce(b.full)->wait(); };
  if (op == "reduce_scatter") return [&] { g.reduce_scatter(b.part, b.full)->wait(); };
  if (op == "all_gather") return [&] { g.all_gather(b.parts, b.part)->wait(); };
  return [&] { g.broadcast(b.full)->wait(); };
}

OpFn c10d_op(c10d::ProcessGroupGloo& pg, const std::string& op, Buffers& b) {
  if (op == "all_reduce") {
    return [&] {
      std::vector<torch::Tensor> t{b.full};
      pg.allreduce(t)->wait();
    };
  }
  if (op == "reduce_scatter") {
    // libtorch 1.13's Gloo group has no reduce_scatter ("ProcessGroupGloo does not support
    // reduce_scatter"): its users all-reduce a copy and keep their slice, as here.
    return [&] {
      std::vector<torch::Tensor> t{b.full.clone()};
      pg.allreduce(t)->wait();
      b.part.copy_(t[0].chunk(pg.getSize())[pg.getRank()]);
    };
  }
  if (op == "all_gather") {
    return [&] {
      std::vector<std::vector<torch::Tensor>> out{b.parts};
      std::vector<torch::Tensor> in{b.part};
      pg.allgather(out, in)->wait();
    };
  }
  return [&] {
    std::vector<torch::Tensor> t{b.full};
    pg.broadcast(t)->wait();
  };
}

// Mean seconds per op over `iters` runs, after a barrier so that ranks start together.
double time_block(loom::comm::Group& sync, const OpFn& fn, int iters) {
  sync.barrier()->wait();
  auto start = Clock::now();
  for (int i = 0; i < iters; ++i) fn();
  return std::chrono::duration<double>(Clock::now() - start).count() / iters;
}

// One call, after a barrier: the first at a size is the cold figure (fresh buffers, first touch
// of this size's slots and scratch).
double time_once(loom::comm::Group& sync, const OpFn& fn) { return time_block(sync, fn, 1); }

// Calls per round, from one warm call of each side: the slower side's block lasts about
// `seconds`, but the faster side's at least 10 ms (a block of a few fast calls is all noise), and
// the slower side's at most 1 s. The largest over the ranks, so that every rank runs as many.
int calls_per_round(loom::comm::Group& group, double loom_s, double c10d_s, double seconds) {
  const double slow = std::max(loom_s, c10d_s), fast = std::min(loom_s, c10d_s);
  double calls = std::max(seconds / slow, 0.01 / fast);
  calls = std::clamp(std::min(calls, 1.0 / slow), 3.0, 100000.0);
  at::Tensor agreed = at::full({1}, std::ceil(calls), at::kDouble);
  group.all_reduce(agreed, {.op = loom::comm::ReduceOp::kMax})->wait();
  return static_cast<int>(agreed.item<double>());
}

// One side's figures at one size: the cold call and the per-op mean of each measured round.
struct Side {
  double cold_s = 0;
  std::vector<double> rounds_s;
  double median() const {
    std::vector<double> v = rounds_s;
    std::sort(v.begin(), v.end());
    size_t n = v.size();
    return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  }
  double min() const { return *std::min_element(rounds_s.begin(), rounds_s.end()); }
  double max() const { return *std::max_element(rounds_s.begin(), rounds_s.end()); }
  // (max - min) / median over the rounds, in percent.
  double spread_pct() const { return (max() - min()) / median() * 100; }
};

// Whether both sides run the same algorithm, so that the ratio measures overhead alone: over TCP
// Loom calls the same gloo::allreduce / allgather / broadcast as c10d; its reduce_scatter is a
// ring where c10d (libtorch 1.13) all-reduces and slices; through shared memory every op is
// Loom's own.
bool same_algorithm(const Settings& s, const std::string& op) {
  return s.transport == "tcp" && op != "reduce_scatter";
}

// Geometric mean of c10d/Loom over the cases of one size range.
struct Geomean {
  const char* name;  // "[64KiB,1MiB)"
  double lo, hi;     // bytes, lo <= size < hi
  double log_sum = 0;
  int cases = 0;
};

void run_worker(const Settings& s) {
  const int rank = s.worker_rank;
  const int n = s.ranks;
  torch::set_num_threads(1);
  loom::comm::FileStore loom_store(std::filesystem::path(s.store_dir) / "loom");
  auto group =
      loom::comm::new_gloo_group(loom_store, rank, n,
                                 {.name = "bench",
                                  .shared_memory = s.transport == "auto",
                                  .shared_memory_slot_bytes = static_cast<size_t>(s.slot_bytes)});

  auto c10d_store = c10::make_intrusive<c10d::FileStore>(s.store_dir + "/c10d", n);
  auto options = c10d::ProcessGroupGloo::Options::create();
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  c10d::ProcessGroupGloo c10d_group(c10d_store, rank, n, options);

  if (rank == 0 && !s.json) {
    std::printf(
        "bench_comm: %d ranks as processes on one host, float32, 1 torch thread per rank; Loom "
        "%s, c10d Gloo over loopback TCP\n",
        n,
        s.transport == "auto"
            ? loom::detail::concat("through shared memory (", s.slot_bytes >> 10, " KiB slots)")
                  .c_str()
            : "Gloo over loopback TCP");
    std::printf(
        "each case: 1 cold call per side, then %d interleaved rounds (the side that goes first "
        "alternates), each round the mean of a block of calls (as many on both sides); us = median "
        "over rounds, spread = "
        "(max - min) / median; ratio = median c10d / median loom; algo: same = both sides run "
        "the same gloo algorithm, so the ratio is overhead alone\n",
        s.rounds);
    std::printf("%-15s %9s %5s | %10s %6s %9s %10s | %10s %6s %9s %10s | %6s %4s\n", "op", "size",
                "calls", "loom us", "spread", "busbw", "cold us", "c10d us", "spread", "busbw",
                "cold us", "ratio", "algo");
  }
  std::vector<int64_t> sizes;  // min, min*step, ... below max, then max itself
  for (int64_t bytes = s.min_bytes; bytes < s.max_bytes; bytes *= s.step) sizes.push_back(bytes);
  sizes.push_back(s.max_bytes);
  for (const std::string& op : s.ops) {
    const bool same = same_algorithm(s, op);
    const std::string baseline_name =
        op == "reduce_scatter" ? "c10d ProcessGroupGloo allreduce + slice (libtorch 1.13)"
                               : "c10d ProcessGroupGloo (libtorch 1.13)";
    std::vector<Geomean> ranges = {{"[64KiB,1MiB)", 64 * 1024, 1024 * 1024},
                                   {">=1MiB", 1024 * 1024, 1e300}};
    for (int64_t bytes : sizes) {
      int64_t numel = std::max<int64_t>(n, bytes / 4 / n * n);  // divisible by the ranks
      Buffers b;
      b.full = torch::rand({numel});
      b.part = torch::rand({numel / n});
      b.parts = b.full.chunk(n);
      OpFn loom_fn = loom_op(*group, op, b);
      OpFn c10d_fn = c10d_op(c10d_group, op, b);
      Side loom, c10d;
      loom.cold_s = time_once(*group, loom_fn);
      c10d.cold_s = time_once(*group, c10d_fn);
      const int iters = calls_per_round(*group, time_once(*group, loom_fn),
                                        time_once(*group, c10d_fn), s.seconds);
      for (int round = 0; round < s.rounds; ++round) {
        if (round % 2 == 0) loom.rounds_s.push_back(time_block(*group, loom_fn, iters));
        c10d.rounds_s.push_back(time_block(*group, c10d_fn, iters));
        if (round % 2 == 1) loom.rounds_s.push_back(time_block(*group, loom_fn, iters));
      }
      if (rank != 0) continue;
      const double size = static_cast<double>(numel * 4);
      const double ratio = c10d.median() / loom.median();
      for (Geomean& range : ranges) {
        if (size >= range.lo && size < range.hi) {
          range.log_sum += std::log(ratio);
          ++range.cases;
        }
      }
      const double loom_bus = size / loom.median() / 1e9 * bus_factor(op, n);
      const double c10d_bus = size / c10d.median() / 1e9 * bus_factor(op, n);
      loom::bench::Row row{"comm",
                           loom::detail::concat(op, "/", numel * 4, "B/", n, "ranks"),
                           loom.median() * 1e6,
                           c10d.median() * 1e6,
                           baseline_name,
                           "us",
                           ratio,
                           {{"bytes", size},
                            {"ranks", n},
                            {"rounds", s.rounds},
                            {"calls_per_round", iters},
                            {"loom_min_us", loom.min() * 1e6},
                            {"loom_max_us", loom.max() * 1e6},
                            {"loom_cold_us", loom.cold_s * 1e6},
                            {"baseline_min_us", c10d.min() * 1e6},
                            {"baseline_max_us", c10d.max() * 1e6},
                            {"baseline_cold_us", c10d.cold_s * 1e6},
                            {"cold_ratio", c10d.cold_s / loom.cold_s},
                            {"same_algorithm", same ? 1 : 0},
                            {"busbw_loom_gbps", loom_bus},
                            {"busbw_baseline_gbps", c10d_bus}}};
      if (s.json) {
        loom::bench::print_json(row);
      } else {
        std::printf(
            "%-15s %9s %5d | %10.1f %5.1f%% %9.3f %10.1f | %10.1f %5.1f%% %9.3f %10.1f | %6.2f "
            "%4s\n",
            op.c_str(), loom::bench::format_bytes(size).c_str(), iters, loom.median() * 1e6,
            loom.spread_pct(), loom_bus, loom.cold_s * 1e6, c10d.median() * 1e6, c10d.spread_pct(),
            c10d_bus, c10d.cold_s * 1e6, ratio, same ? "same" : "diff");
        std::fflush(stdout);
      }
    }
    if (rank != 0) continue;
    for (const Geomean& range : ranges) {
      if (range.cases == 0) continue;
      const double geomean = std::exp(range.log_sum / range.cases);
      if (s.json) {
        loom::bench::print_json({"comm",
                                 loom::detail::concat(op, "/geomean", range.name, "/", n, "ranks"),
                                 0,
                                 0,
                                 baseline_name,
                                 "ratio",
                                 geomean,
                                 {{"cases", range.cases}, {"same_algorithm", same ? 1 : 0}}});
      } else {
        std::printf("%-15s geometric mean of c10d/loom over sizes %s: %.2f (%d sizes)\n",
                    op.c_str(), range.name, geomean, range.cases);
      }
    }
  }
  group->barrier()->wait();
}

int run_parent(const Settings& s, const std::string& self) {
  std::filesystem::path dir =
      std::filesystem::temp_directory_path() / loom::detail::concat("loom-bench-comm-", ::getpid());
  std::filesystem::create_directories(dir);
  const auto worker_argv = [&](int r) {
    std::vector<std::string> argv = {self,
                                     "--worker-rank=" + std::to_string(r),
                                     "--store-dir=" + dir.string(),
                                     "--ranks=" + std::to_string(s.ranks),
                                     "--min-bytes=" + std::to_string(s.min_bytes),
                                     "--max-bytes=" + std::to_string(s.max_bytes),
                                     "--step=" + std::to_string(s.step),
                                     "--seconds=" + std::to_string(s.seconds),
                                     "--rounds=" + std::to_string(s.rounds),
                                     "--transport=" + s.transport,
                                     "--shm-slot-bytes=" + std::to_string(s.slot_bytes)};
    std::string ops;
    for (const auto& op : s.ops) ops += (ops.empty() ? "" : ",") + op;
    argv.push_back("--ops=" + ops);
    if (s.json) argv.push_back("--json");
    return argv;
  };
  if (!loom::bench::run_worker_ranks("bench_comm", s.ranks, dir, worker_argv)) {
    std::cerr << "bench_comm: rank logs kept in " << dir << std::endl;
    return 1;
  }
  std::filesystem::remove_all(dir);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{"bench_comm: Loom's Gloo collectives beside c10d ProcessGroupGloo"};
  app.add_option("--ranks", s.ranks, "ranks (processes)")->check(CLI::Range(2, 64));
  app.add_option("--min-bytes", s.min_bytes, "smallest buffer");
  app.add_option("--max-bytes", s.max_bytes, "largest buffer");
  app.add_option("--step", s.step, "size multiplier between cases")->check(CLI::Range(2, 64));
  app.add_option("--ops", s.ops, "ops to measure")
      ->delimiter(',')
      ->check(CLI::IsMember({"all_reduce", "reduce_scatter", "all_gather", "broadcast"}));
  app.add_option("--seconds", s.seconds,
                 "target seconds of the slower side's block of calls in a round (the faster side's "
                 "lasts at least 10 ms)");
  app.add_option("--rounds", s.rounds,
                 "measured rounds per side, interleaved; median and spread over them")
      ->check(CLI::Range(1, 1000));
  app.add_option("--transport", s.transport,
                 "Loom's path: auto (shared memory between ranks on one host) or tcp (Gloo over "
                 "loopback TCP, the same algorithm and transport as c10d for all_reduce)")
      ->check(CLI::IsMember({"auto", "tcp"}));
  app.add_option("--shm-slot-bytes", s.slot_bytes, "bytes each rank moves per shared-memory step")
      ->check(CLI::Range(int64_t{4096}, int64_t{1} << 30));
  app.add_flag("--json", s.json, "print one JSON object per row");
  app.add_option("--worker-rank", s.worker_rank, "internal: run as this rank")->group("");
  app.add_option("--store-dir", s.store_dir, "internal: rendezvous directory")->group("");
  CLI11_PARSE(app, argc, argv);
  try {
    if (s.worker_rank >= 0) {
      run_worker(s);
      return 0;
    }
    return run_parent(s, "/proc/self/exe");
  } catch (const std::exception& e) {
    std::cerr << "bench_comm: error: " << e.what() << std::endl;
    return 1;
  }
}

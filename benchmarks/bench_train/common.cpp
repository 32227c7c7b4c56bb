// bench_train's shared pieces (bench_train.h): the small GPT's loss, statistics, rows and the
// worker processes.
#include "bench_train.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iostream>

#include "bench_ranks.h"
#include "loom/error.h"

namespace bench_train {

int64_t parameter_count(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

torch::Tensor loss_on(Gpt& model, const Settings& s, const torch::Tensor& tokens) {
  auto logits = model.forward(tokens.narrow(1, 0, s.seq));
  return torch::cross_entropy_loss(logits.reshape({-1, s.vocab}),
                                   tokens.narrow(1, 1, s.seq).reshape(-1));
}

torch::Tensor loss_of(Gpt& model, const Settings& s, int rank, int step) {
  torch::manual_seed(1000 * step + rank);  // this rank's batch of this step
  return loss_on(model, s, torch::randint(s.vocab, {s.batch, s.seq + 1}, torch::kLong));
}

std::shared_ptr<Gpt> make_model(const Settings& s) {
  torch::manual_seed(7);
  return std::make_shared<Gpt>(s);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

void emit(const Settings& s, loom::bench::Row row) {
  if (s.json) {
    loom::bench::print_json(row);
    return;
  }
  std::printf("%-30s %12.1f %12.1f  %-36s %-6s %7.2fx", row.case_name.c_str(), row.loom,
              row.baseline, row.baseline_name.c_str(), row.unit.c_str(), row.ratio);
  for (const auto& [key, value] : row.extra) std::printf("  %s=%.4g", key.c_str(), value);
  std::printf("\n");
  std::fflush(stdout);
}

void emit_columns() {
  std::printf("%-30s %12s %12s  %-36s %-6s %8s\n", "case", "loom", "baseline", "baseline_name",
              "unit", "ratio");
}

PeakBytes peak_bytes_since(const loom::metrics::CpuAllocations& before) {
  const loom::metrics::CpuAllocations now = loom::metrics::cpu_allocations();
  PeakBytes peak{};
  for (size_t k = 0; k < peak.size(); ++k) {
    peak[k] = now.by_category[k].peak_bytes - before.by_category[k].live_bytes;
  }
  return peak;
}

// The command line of rank r's worker process.
std::vector<std::string> worker_argv(const Settings& s, const std::string& self, int rank,
                                     const std::filesystem::path& dir) {
  std::vector<std::string> argv = {self,
                                   "--mode=" + s.mode,
                                   "--worker-rank=" + std::to_string(rank),
                                   "--store-dir=" + dir.string(),
                                   "--ranks=" + std::to_string(s.ranks),
                                   "--vocab=" + std::to_string(s.vocab),
                                   "--dim=" + std::to_string(s.dim),
                                   "--layers=" + std::to_string(s.layers),
                                   "--heads=" + std::to_string(s.heads),
                                   "--seq=" + std::to_string(s.seq),
                                   "--batch=" + std::to_string(s.batch),
                                   "--steps=" + std::to_string(s.steps),
                                   "--warmup=" + std::to_string(s.warmup),
                                   "--threads=" + std::to_string(s.threads),
                                   "--bucket-mib=" + std::to_string(s.bucket_mib),
                                   "--zero2-bucket-mib=" + std::to_string(s.zero2_bucket_mib),
                                   "--micro-batches=" + std::to_string(s.micro_batches)};
  // An empty "--dataset=" would make CLI11 take the next argument as its value.
  if (!s.dataset.empty()) argv.push_back("--dataset=" + s.dataset);
  if (!s.baton.empty()) argv.push_back("--baton=" + s.baton);
  if (s.json) argv.push_back("--json");
  return argv;
}

// Runs s.ranks worker processes rendezvousing in `dir` (rank 0's output inherited, the others'
// in dir/rank_<r>.log); returns whether all of them succeeded.
bool run_ranks(const Settings& s, const std::string& self, const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  return loom::bench::run_worker_ranks("bench_train", s.ranks, dir,
                                       [&](int r) { return worker_argv(s, self, r, dir); });
}

std::filesystem::path scratch_dir() {
  return std::filesystem::temp_directory_path() /
         loom::detail::concat("loom-bench-train-", ::getpid());
}

int run_parent(const Settings& s, const std::string& self) {
  const std::filesystem::path dir = scratch_dir();
  if (!run_ranks(s, self, dir)) {
    std::cerr << "bench_train: rank logs kept in " << dir << std::endl;
    return 1;
  }
  std::filesystem::remove_all(dir);
  return 0;
}

}  // namespace bench_train

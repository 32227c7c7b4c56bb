// What bench_train's modes share (main.cpp says what each mode measures): the settings from
// the command line, a small GPT, worker processes one per rank, and the rows it prints.
// Each mode is a file: ddp.cpp, trainer.cpp, sharding.cpp, pipeline.cpp, model_parallel.cpp.
#pragma once

#include <torch/torch.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "bench_report.h"
#include "loom/metrics/allocations.h"

namespace bench_train {

using Clock = std::chrono::steady_clock;

struct Settings {
  std::string mode = "ddp";
  int ranks = 2;
  int64_t vocab = 8192;
  int64_t dim = 384;
  int64_t layers = 8;
  int64_t heads = 6;
  int64_t seq = 64;
  int64_t batch = 4;  // sequences per rank per step
  int steps = 6;      // measured rounds (one step of every case each)
  int warmup = 1;
  int threads = 1;  // intra-op threads per rank (2 cores, 2 ranks: 1)
  double bucket_mib = 25;
  double zero2_bucket_mib = 1;  // --mode=sharding: ZeRO-2's buckets (its staging is what it
                                // holds beyond 1/W of the gradients)
  bool json = false;
  std::string python =
      "/usr/bin/python3";  // --mode=trainer: the Python with torch for the DDP peer
  int worker_rank = -1;
  std::string store_dir;
  std::string dataset;     // --mode=trainer workers: the token dataset
  std::string baton;       // --mode=trainer workers: turn-taking directory shared with Python DDP
  int micro_batches = 8;   // --mode=pipeline: m
  double forward_ms = 10;  // --mode=pipeline: a stage's forward of one micro-batch
};

// --- a small GPT (--mode=ddp and --mode=trainer) ---------------------------------------------

struct Block : torch::nn::Module {
  Block(int64_t dim, int64_t heads) : heads(heads) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    qkv = register_module("qkv", torch::nn::Linear(dim, 3 * dim));
    proj = register_module("proj", torch::nn::Linear(dim, dim));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    fc1 = register_module("fc1", torch::nn::Linear(dim, 4 * dim));
    fc2 = register_module("fc2", torch::nn::Linear(4 * dim, dim));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& causal_mask) {
    const int64_t b = x.size(0), t = x.size(1), d = x.size(2), hd = d / heads;
    auto parts = qkv(ln1(x)).view({b, t, 3, heads, hd}).permute({2, 0, 3, 1, 4});
    auto att = torch::matmul(parts[0], parts[1].transpose(-2, -1)) / std::sqrt(double(hd));
    att = torch::softmax(att.masked_fill(causal_mask, -1e9), -1);
    auto y = torch::matmul(att, parts[2]).transpose(1, 2).reshape({b, t, d});
    auto h = x + proj(y);
    return h + fc2(torch::gelu(fc1(ln2(h))));
  }
  int64_t heads;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
};

struct Gpt : torch::nn::Module {
  explicit Gpt(const Settings& s) {
    tok = register_module("tok", torch::nn::Embedding(s.vocab, s.dim));
    pos = register_module("pos", torch::nn::Embedding(s.seq, s.dim));
    for (int64_t i = 0; i < s.layers; ++i) {
      blocks.push_back(
          register_module("block" + std::to_string(i), std::make_shared<Block>(s.dim, s.heads)));
    }
    lnf = register_module("lnf", torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.dim})));
    head = register_module("head",
                           torch::nn::Linear(torch::nn::LinearOptions(s.dim, s.vocab).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& tokens) {
    const int64_t t = tokens.size(1);
    const auto mask = torch::ones({t, t}, torch::kBool).triu(1);
    auto x = tok(tokens) + pos(torch::arange(t, torch::kLong));
    for (auto& block : blocks) x = block->forward(x, mask);
    return head(lnf(x));
  }
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  std::vector<std::shared_ptr<Block>> blocks;
  torch::nn::LayerNorm lnf{nullptr};
  torch::nn::Linear head{nullptr};
};

int64_t parameter_count(torch::nn::Module& m);
// Mean next-token loss on tokens [B, T+1].
torch::Tensor loss_on(Gpt& model, const Settings& s, const torch::Tensor& tokens);
// The loss of rank `rank`'s random batch of step `step`.
torch::Tensor loss_of(Gpt& model, const Settings& s, int rank, int step);
// The model every rank and case starts from (seed 7).
std::shared_ptr<Gpt> make_model(const Settings& s);

double median(std::vector<double> v);
double ms_since(Clock::time_point start);
// One row: a line of the table, or a JSON object with --json.
void emit(const Settings& s, loom::bench::Row row);
// The table's column names, under its title (without --json).
void emit_columns();

// Bytes by memory category (metrics/allocations.h), indexed by MemoryCategory.
using PeakBytes = std::array<int64_t, loom::metrics::kMemoryCategories>;
// Each category's peak since the last reset_cpu_allocation_peaks(), above what was live at
// `before`.
PeakBytes peak_bytes_since(const loom::metrics::CpuAllocations& before);
inline int64_t bytes_of(const PeakBytes& bytes, loom::metrics::MemoryCategory category) {
  return bytes[static_cast<size_t>(category)];
}

// --- worker processes ----------------------------------------------------------------------------

// The command line of rank r's worker process.
std::vector<std::string> worker_argv(const Settings& s, const std::string& self, int rank,
                                     const std::filesystem::path& dir);
// Runs s.ranks worker processes rendezvousing in `dir` (rank 0's output inherited, the others'
// in dir/rank_<r>.log); returns whether all of them succeeded.
bool run_ranks(const Settings& s, const std::string& self, const std::filesystem::path& dir);
// A fresh directory under /tmp for one run's rendezvous and logs.
std::filesystem::path scratch_dir();
// run_ranks in scratch_dir(), removed after success, kept (and named) after a failure.
int run_parent(const Settings& s, const std::string& self);

// --- the modes (each rank's worker; the parent that starts them) ---------------------------------

void run_ddp_worker(const Settings& s);
void run_trainer_worker(const Settings& s);
int run_trainer_parent(Settings s, const std::string& self);
void run_trace_worker(const Settings& s);
int run_trace_parent(Settings s, const std::string& self);
void run_sharding_worker(const Settings& s);
int run_sharding_parent(Settings s, const std::string& self, const std::vector<int>& worlds);
int run_pipeline(const Settings& s);
void run_model_parallel_worker(const Settings& s);
int run_model_parallel_parent(Settings s, const std::string& self);

}  // namespace bench_train

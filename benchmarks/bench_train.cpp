// bench_train: training steps of a decoder-only transformer, Loom beside the plain way.
//
// --mode=ddp: one training step of a ~20M-parameter model on N ranks as processes (Gloo over
// a FileStore, loopback TCP), for
//   baseline   the plain way of libtorch C++ examples: backward, then one all-reduce per
//              parameter gradient, then torch::optim::AdamW;
//   ddp        Loom's DataParallel: bucketed all-reduce overlapped with backward, torch AdamW;
//   zero1/2    DataParallel with ZeRO-1 / ZeRO-2 and Loom's sharded AdamW;
// plus the share of communication that overlap hides and the optimizer-state bytes per rank.
//
// --mode=trainer: train::Trainer's step time (a ~3M-parameter model, 1 and 2 ranks) beside
//   hand_dp      a hand-written loop over the same DataParallel and Loom AdamW: what the
//                Trainer adds on top (its target: at most 3% slower);
//   hand_plain   the plain libtorch loop: torch AdamW, clip_grad_norm_, and at 2 ranks one
//                all-reduce per gradient after backward;
//   python_ddp   the same model in Python, torch.nn.parallel.DistributedDataParallel (gloo),
//                2 processes (skipped with a note when python3 or torch is missing).
// Every loop reads the same token batches (one data::Reader each, same dataset and options),
// clips the gradient norm to 1 and takes the loss with .item().
//
// --mode=sharding: the GPT example's model (~20M parameters) on W = 2 and 4 ranks as processes,
// under DDP, ZeRO-1, ZeRO-2, FSDP (each block a unit) and FSDP with activation checkpointing:
// step time beside DDP's (cold and warm; FSDP without prefetch too, to show what prefetch
// hides), and each case's peak bytes per rank of parameters, gradients, optimizer state and
// activations, counted from the CPU allocator (metrics/allocations.h), each case alone.
//
// --mode=pipeline: parallel::Pipeline's bubble under GPipe, 1F1B and interleaved 1F1B (p = 4
// stages, m = 8 micro-batches by default) beside the theoretical (p - 1) / (m + p - 1), with
// timed-wait stages so the 2-core machine measures the schedule rather than its cores.
//
// ratio = baseline / Loom for times (above 1: Loom is faster), replicated / Loom for bytes.
//
//   bench_train --mode=ddp               2 ranks, the 20M model, table
//   bench_train --mode=trainer           1 and 2 ranks, the 3M model, table
//   bench_train --mode=sharding          2 and 4 ranks, the 20M GPT, table
//   bench_train --mode=pipeline          4 stages, 8 micro-batches, the three schedules
//   bench_train --mode=... --json        JSON rows
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <unistd.h>
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "bench_report.h"
#include "loom/comm/gloo.h"
#include "loom/comm/store.h"
#include "loom/config.h"
#include "loom/data/dataset.h"
#include "loom/data/reader.h"
#include "loom/error.h"
#include "loom/metrics/allocations.h"
#include "loom/parallel/activation_checkpoint.h"
#include "loom/parallel/data_parallel.h"
#include "loom/parallel/fsdp.h"
#include "loom/parallel/pipeline.h"
#include "loom/parallel/strategy.h"
#include "loom/runtime.h"
#include "loom/train/trainer.h"
#include "model.h"  // the GPT example's model, for --mode=sharding
#include "util/subprocess.h"

namespace {

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

// --mode=trainer's model: a step of ~50-200 ms on one core of the 2-core benchmark machine.
void use_trainer_defaults(Settings& s, const CLI::App& app) {
  auto fallback = [&](const char* option, auto& field, auto value) {
    if (app.count(option) == 0) field = value;
  };
  fallback("--vocab", s.vocab, int64_t{2048});
  fallback("--dim", s.dim, int64_t{256});
  fallback("--layers", s.layers, int64_t{3});
  fallback("--heads", s.heads, int64_t{4});
  fallback("--seq", s.seq, int64_t{64});
  fallback("--batch", s.batch, int64_t{4});
  fallback("--steps", s.steps, 30);
  fallback("--warmup", s.warmup, 3);
}

// --- a small GPT -----------------------------------------------------------------------------

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

int64_t parameter_count(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

// --- the cases -------------------------------------------------------------------------------

struct CaseResult {
  double step_ms = 0;               // median
  double comm_exposed_ms = 0;       // median time blocked on gradient communication
  int64_t state_bytes = 0;          // optimizer state (+ masters) on this rank
  int buckets = 0;                  // DataParallel buckets
  int buckets_during_backward = 0;  // of them, reduced while backward still ran (last step)
};

// Mean next-token loss on tokens [B, T+1].
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

int64_t adamw_state_bytes(torch::optim::AdamW& opt) {
  int64_t bytes = 0;
  for (const auto& [key, state] : opt.state()) {
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*state);
    bytes += s.exp_avg().numel() * 4 + s.exp_avg_sq().numel() * 4;
  }
  return bytes;
}

// One way of training; step() runs one full step and returns {step ms, communication ms}.
class Case {
 public:
  virtual ~Case() = default;
  virtual std::pair<double, double> step(int index) = 0;
  virtual CaseResult result() const = 0;

  void record(std::pair<double, double> times) {
    steps_.push_back(times.first);
    comm_.push_back(times.second);
  }
  CaseResult medians() const { return {median(steps_), median(comm_)}; }

 private:
  std::vector<double> steps_, comm_;
};

// The plain way: backward, then all-reduce every gradient (sum, then divide), then step.
class BaselineCase final : public Case {
 public:
  BaselineCase(loom::comm::Group& group, const Settings& s)
      : group_(group),
        s_(s),
        model_(make_model(s)),
        opt_(model_->parameters(), torch::optim::AdamWOptions(1e-4)) {}
  std::pair<double, double> step(int index) override {
    const auto start = Clock::now();
    opt_.zero_grad();
    loss_of(*model_, s_, group_.rank(), index).backward();
    const auto comm_start = Clock::now();
    for (auto& p : model_->parameters()) {
      at::Tensor grad = p.grad();
      group_.all_reduce(grad)->wait();
      grad.div_(group_.size());
    }
    const double comm_ms = ms_since(comm_start);
    opt_.step();
    return {ms_since(start), comm_ms};
  }
  CaseResult result() const override {
    CaseResult r = medians();
    r.state_bytes = adamw_state_bytes(const_cast<torch::optim::AdamW&>(opt_));
    return r;
  }

 private:
  loom::comm::Group& group_;
  const Settings& s_;
  std::shared_ptr<Gpt> model_;
  torch::optim::AdamW opt_;
};

class LoomCase final : public Case {
 public:
  LoomCase(loom::comm::Group& group, const Settings& s, loom::parallel::ZeroStage stage,
           bool overlap)
      : group_(group),
        s_(s),
        model_(make_model(s)),
        dp_(model_, group, options(s, stage, overlap)) {
    if (stage == loom::parallel::ZeroStage::kNone) {
      torch_opt_ = std::make_unique<torch::optim::AdamW>(model_->parameters(),
                                                         torch::optim::AdamWOptions(1e-4));
    } else {
      dp_.set_optimizer(
          std::make_unique<loom::optim::AdamW>(loom::optim::AdamWOptions{.lr = 1e-4}));
    }
  }
  std::pair<double, double> step(int index) override {
    const auto start = Clock::now();
    dp_.zero_grad();
    loss_of(*model_, s_, group_.rank(), index).backward();
    dp_.finish_gradient_sync();
    if (torch_opt_) {
      torch_opt_->step();
    } else {
      dp_.step();
    }
    return {ms_since(start), dp_.last_sync_stats().wait_seconds * 1e3};
  }
  CaseResult result() const override {
    CaseResult r = medians();
    r.state_bytes = torch_opt_ ? adamw_state_bytes(*torch_opt_) : dp_.optimizer_state_bytes();
    r.buckets = dp_.last_sync_stats().buckets;
    r.buckets_during_backward = dp_.last_sync_stats().buckets_launched_during_backward;
    return r;
  }

 private:
  static loom::parallel::DataParallelOptions options(const Settings& s,
                                                     loom::parallel::ZeroStage stage,
                                                     bool overlap) {
    loom::parallel::DataParallelOptions o;
    o.bucket_bytes = static_cast<size_t>(s.bucket_mib * (1 << 20));
    o.zero_stage = stage;
    o.overlap = overlap;
    return o;
  }
  loom::comm::Group& group_;
  const Settings& s_;
  std::shared_ptr<Gpt> model_;
  loom::parallel::DataParallel dp_;
  std::unique_ptr<torch::optim::AdamW> torch_opt_;
};

// Rounds of one step of every case in turn, so that load from other processes on this shared
// machine falls on all cases alike; the median over the measured rounds.
std::vector<CaseResult> measure(std::vector<std::unique_ptr<Case>>& cases, loom::comm::Group& group,
                                const Settings& s) {
  for (int round = 0; round < s.warmup + s.steps; ++round) {
    for (auto& c : cases) {
      group.barrier()->wait();
      const auto times = c->step(round);
      if (round >= s.warmup) c->record(times);
    }
  }
  std::vector<CaseResult> results;
  for (auto& c : cases) results.push_back(c->result());
  return results;
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

void run_worker(const Settings& s) {
  torch::set_num_threads(s.threads);
  loom::comm::FileStore store(std::filesystem::path(s.store_dir) / "loom");
  auto group = loom::comm::new_gloo_group(store, s.worker_rank, s.ranks);
  const bool print = group->rank() == 0;
  const std::string suffix = "/" + std::to_string(s.ranks) + "ranks";
  using loom::parallel::ZeroStage;

  std::vector<std::unique_ptr<Case>> cases;
  cases.push_back(std::make_unique<BaselineCase>(*group, s));
  cases.push_back(std::make_unique<LoomCase>(*group, s, ZeroStage::kNone, false));
  cases.push_back(std::make_unique<LoomCase>(*group, s, ZeroStage::kNone, true));
  cases.push_back(std::make_unique<LoomCase>(*group, s, ZeroStage::kOne, true));
  cases.push_back(std::make_unique<LoomCase>(*group, s, ZeroStage::kTwo, true));
  const std::vector<CaseResult> results = measure(cases, *group, s);
  const CaseResult& base = results[0];
  const CaseResult& no_overlap = results[1];
  const CaseResult& ddp = results[2];
  const CaseResult& zero1 = results[3];
  const CaseResult& zero2 = results[4];
  if (!print) return;

  auto model = make_model(s);
  const double params_m = parameter_count(*model) / 1e6;
  if (!s.json) {
    std::printf(
        "bench_train --mode=ddp: %.1fM-parameter transformer (%lld layers, dim %lld, "
        "vocab %lld), %lld x %lld tokens per rank, %d ranks, %d thread(s) each, "
        "buckets of %.3g MiB, median of %d interleaved rounds\n",
        params_m, (long long)s.layers, (long long)s.dim, (long long)s.vocab, (long long)s.batch,
        (long long)s.seq, s.ranks, s.threads, s.bucket_mib, s.steps);
    std::printf("%-30s %12s %12s  %-36s %-6s %8s\n", "case", "loom", "baseline", "baseline_name",
                "unit", "ratio");
  }
  const std::string baseline_name = "allreduce_after_backward";
  auto time_row = [&](const std::string& name, const CaseResult& r) {
    loom::bench::Row row{"train",
                         name + suffix,
                         r.step_ms,
                         base.step_ms,
                         baseline_name,
                         "ms",
                         base.step_ms / r.step_ms,
                         {}};
    row.extra["comm_exposed_ms"] = r.comm_exposed_ms;
    row.extra["baseline_comm_ms"] = base.comm_exposed_ms;
    row.extra["params_m"] = params_m;
    if (r.buckets > 0) {
      row.extra["buckets"] = r.buckets;
      row.extra["buckets_during_backward"] = r.buckets_during_backward;
    }
    return row;
  };
  emit(s, time_row("step/ddp_no_overlap", no_overlap));
  loom::bench::Row ddp_row = time_row("step/ddp_overlap", ddp);
  // Communication hidden by overlap: 1 - (exposed with overlap) / (exposed without overlap).
  const double hidden =
      no_overlap.comm_exposed_ms > 0 ? 1.0 - ddp.comm_exposed_ms / no_overlap.comm_exposed_ms : 0;
  ddp_row.extra["comm_hidden_share"] = hidden;
  emit(s, ddp_row);
  emit(s, time_row("step/zero1", zero1));
  emit(s, time_row("step/zero2", zero2));
  loom::bench::Row hidden_row{
      "train",
      "comm_hidden_by_overlap" + suffix,
      ddp.comm_exposed_ms,
      no_overlap.comm_exposed_ms,
      "ddp_no_overlap",
      "ms",
      ddp.comm_exposed_ms > 0 ? no_overlap.comm_exposed_ms / ddp.comm_exposed_ms : 0,
      {{"hidden_share", hidden}}};
  emit(s, hidden_row);
  for (const auto& [name, r] :
       {std::pair{"state_bytes/zero1", zero1}, std::pair{"state_bytes/zero2", zero2}}) {
    loom::bench::Row row{"train",
                         std::string(name) + suffix,
                         double(r.state_bytes),
                         double(base.state_bytes),
                         "replicated_torch_adamw",
                         "bytes",
                         double(base.state_bytes) / double(r.state_bytes),
                         {}};
    emit(s, row);
  }
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
                                   "--bucket-mib=" + std::to_string(s.bucket_mib)};
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
  const auto worker = [&](int r) {
    loom::util::SubprocessOptions options{.argv = worker_argv(s, self, r, dir)};
    if (r != 0) options.output = dir / loom::detail::concat("rank_", r, ".log");
    return options;
  };
  // A rank that fails leaves the others in a collective: they get a minute, not their deadline.
  const auto statuses =
      loom::util::run_rank_processes(s.ranks, worker, {.after_failure = std::chrono::minutes(1)});
  bool ok = true;
  for (int r = 0; r < s.ranks; ++r) {
    if (!statuses[r] || !statuses[r]->ok()) {
      std::cerr << "bench_train: rank " << r << " "
                << (statuses[r] ? statuses[r]->describe() : "was killed after another failed")
                << std::endl;
      ok = false;
    }
  }
  return ok;
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

// --- --mode=trainer ---------------------------------------------------------------------------

// A token dataset of random documents, enough for every reader of a run without wrapping.
void write_token_dataset(const Settings& s, const std::filesystem::path& dir) {
  const int64_t rounds = s.warmup + s.steps;
  const int64_t tokens = std::max<int64_t>(1 << 16, 2 * rounds * s.batch * 2 * (s.seq + 1));
  loom::data::TokenDatasetWriter writer(
      dir, {.vocab_size = static_cast<uint64_t>(s.vocab), .description = "bench_train tokens"});
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> token(0, static_cast<uint32_t>(s.vocab - 1));
  std::vector<uint32_t> document(1024);
  for (int64_t written = 0; written < tokens; written += static_cast<int64_t>(document.size())) {
    for (auto& t : document) t = token(rng);
    writer.add_document(document);
  }
  writer.finish();
}

// Rank 0's step times in ms, one per measured round, written by its worker for the parent.
struct TrainerTimes {
  std::vector<double> trainer, hand_dp, hand_plain;
};

// The median over rounds of num[i] / den[i]: a paired figure, steadier than the ratio of
// medians when the load of the machine drifts.
double median_ratio(const std::vector<double>& num, const std::vector<double>& den) {
  std::vector<double> ratios;
  for (size_t i = 0; i < num.size() && i < den.size(); ++i) ratios.push_back(num[i] / den[i]);
  return median(ratios);
}

// Turn-taking with the Python DDP peer (run_trainer_parent starts both at once), through files
// in one directory, so that the two alternate round by round and load on the machine falls on
// both alike: after Loom's round i (the Trainer step and the hand loops), Loom's rank 0 creates
// python_<i> and waits for loom_<i>, which Python's rank 0 creates after its own round i. The
// wait is outside every timed region. When the Python side fails (it creates "failed") or takes
// longer than a deadline, Loom goes on alone and the Python row is skipped.
class PythonBaton {
 public:
  explicit PythonBaton(std::string dir) : dir_(std::move(dir)) {}

  // Each rank's batches, in the order its Trainer reads them, for Python to train on the same
  // tokens: rounds x [batch, seq + 1] int64, written before the first round.
  void write_batches(loom::Runtime& rt, const Settings& s,
                     const loom::data::ReaderOptions& reader_options) {
    if (dir_.empty()) return;
    auto reader = rt.open_dataset(s.dataset, reader_options);
    const std::filesystem::path path =
        std::filesystem::path(dir_) / loom::detail::concat("tokens_rank", s.worker_rank, ".bin");
    const std::filesystem::path part = path.string() + ".part";
    {
      std::ofstream out(part, std::ios::binary);
      for (int i = 0; i < s.warmup + s.steps; ++i) {
        const at::Tensor tokens = reader->next()["tokens"].to(torch::kLong).contiguous();
        out.write(static_cast<const char*>(tokens.data_ptr()),
                  static_cast<std::streamsize>(tokens.numel() * sizeof(int64_t)));
      }
      LOOM_CHECK(out.good(), loom::Error, "bench_train: cannot write ", part);
    }
    std::filesystem::rename(part, path);
  }

  // Rank 0: hands round `round` to Python and waits until it is done.
  void pass(int round) {
    if (dir_.empty() || gone_) return;
    const std::filesystem::path dir(dir_);
    std::ofstream(dir / loom::detail::concat("python_", round)).put('1');
    const std::filesystem::path back = dir / loom::detail::concat("loom_", round);
    const auto deadline = Clock::now() + std::chrono::minutes(5);
    while (!std::filesystem::exists(back)) {
      if (std::filesystem::exists(dir / "failed") || Clock::now() > deadline) {
        gone_ = true;
        return;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

 private:
  std::string dir_;
  bool gone_ = false;
};

loom::Runtime trainer_runtime(const Settings& s) {
  const std::string run_dir = (std::filesystem::path(s.store_dir) / "run").string();
  const std::vector<std::string> args = {"bench_train", "--run.dir=" + run_dir,
                                         "--run.threads=" + std::to_string(s.threads),
                                         "--log.level=warn", "--log.to_file=false"};
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  const loom::Config config =
      loom::Config::from_args(loom::Runtime::schema(), static_cast<int>(argv.size()), argv.data());
  return loom::Runtime::init(config, {.rank = s.worker_rank,
                                      .world_size = s.ranks,
                                      .local_rank = s.worker_rank,
                                      .local_world_size = s.ranks,
                                      .store_dir = std::filesystem::path(s.store_dir) / "store"});
}

std::unique_ptr<loom::parallel::DataParallel> make_data_parallel(std::shared_ptr<Gpt> model,
                                                                 loom::comm::Group& group,
                                                                 const Settings& s) {
  auto dp = std::make_unique<loom::parallel::DataParallel>(
      model, group,
      loom::parallel::DataParallelOptions{.bucket_bytes =
                                              static_cast<size_t>(s.bucket_mib * (1 << 20))});
  dp->set_optimizer(std::make_unique<loom::optim::AdamW>(loom::optim::AdamWOptions{.lr = 1e-4}));
  return dp;
}

// Trainer steps with one step of each hand-written loop between them (run from the Trainer's
// on_step_end), so that load from other processes falls on all loops alike. Every timed step
// runs from one barrier to the next, so it is the slowest rank's. A Trainer step runs from the
// end of the previous callback to the start of the next one: the whole of fit()'s loop. The
// first `warmup` rounds are not recorded.
TrainerTimes measure_trainer(const Settings& s) {
  loom::Runtime rt = trainer_runtime(s);
  loom::comm::Group& group = rt.world_group();
  const loom::data::ReaderOptions reader_options{.batch_size = s.batch, .seq_len = s.seq};

  auto trainer_model = make_model(s);
  auto trainer_dp = make_data_parallel(trainer_model, group, s);
  auto trainer_reader = rt.open_dataset(s.dataset, reader_options);

  auto dp_model = make_model(s);
  auto hand_dp = make_data_parallel(dp_model, group, s);
  auto dp_reader = rt.open_dataset(s.dataset, reader_options);

  auto plain_model = make_model(s);
  torch::optim::AdamW plain_opt(plain_model->parameters(), torch::optim::AdamWOptions(1e-4));
  auto plain_reader = rt.open_dataset(s.dataset, reader_options);

  PythonBaton python(s.baton);
  python.write_batches(rt, s, reader_options);

  // What people write over DataParallel by hand: the Trainer's work without its bookkeeping.
  auto hand_dp_step = [&] {
    const loom::data::Batch batch = dp_reader->next();
    hand_dp->zero_grad();
    auto loss = loss_on(*dp_model, s, batch["tokens"]);
    loss.backward();
    hand_dp->finish_gradient_sync();
    hand_dp->clip_grad_norm(1.0);
    hand_dp->step();
    (void)loss.item<double>();
  };
  // The plain libtorch loop: gradients all-reduced after backward (sum, then divide).
  auto hand_plain_step = [&] {
    const loom::data::Batch batch = plain_reader->next();
    plain_opt.zero_grad();
    auto loss = loss_on(*plain_model, s, batch["tokens"]);
    loss.backward();
    if (group.size() > 1) {
      for (auto& p : plain_model->parameters()) {
        at::Tensor grad = p.grad();
        group.all_reduce(grad)->wait();
        grad.div_(group.size());
      }
    }
    torch::nn::utils::clip_grad_norm_(plain_model->parameters(), 1.0);
    plain_opt.step();
    (void)loss.item<double>();
  };

  // During Python's turn the ranks sleep for a step; the first step after that runs up to 10%
  // slower (measured: whichever loop came first paid it), so each side's turn starts with an
  // untimed forward and backward of a model of its own (Python's script does the same).
  const at::Tensor warm_tokens = torch::randint(s.vocab, {s.batch, s.seq + 1}, torch::kLong);
  auto warm_up = [&] {
    loss_on(*plain_model, s, warm_tokens).backward();
    plain_opt.zero_grad();
    group.barrier()->wait();
  };
  std::vector<double> trainer_ms, hand_dp_ms, hand_plain_ms;
  auto timed = [&](auto&& step, std::vector<double>& out, bool record) {
    group.barrier()->wait();
    const auto start = Clock::now();
    step();
    group.barrier()->wait();
    if (record) out.push_back(ms_since(start));
  };
  loom::train::TrainOptions options;
  options.steps = s.warmup + s.steps;
  options.grad_clip = 1.0;
  options.schedule = loom::train::Schedule::constant(1e-4);
  options.resume = false;
  auto trainer_start = Clock::now();
  loom::train::Callbacks callbacks;
  callbacks.on_step_end = [&](const loom::train::StepInfo& info) {
    const bool record = info.step >= s.warmup;
    group.barrier()->wait();
    if (record) trainer_ms.push_back(ms_since(trainer_start));
    timed(hand_dp_step, hand_dp_ms, record);
    timed(hand_plain_step, hand_plain_ms, record);
    if (group.rank() == 0) python.pass(static_cast<int>(info.step));
    group.barrier()->wait();
    if (!s.baton.empty()) warm_up();
    trainer_start = Clock::now();
  };
  loom::train::Trainer trainer(
      rt, *trainer_dp, *trainer_reader, options,
      [&](const loom::data::Batch& batch) {
        const at::Tensor& tokens = batch["tokens"];
        return loom::train::MicroStep{.loss = loss_on(*trainer_model, s, tokens),
                                      .tokens = tokens.size(0) * s.seq,
                                      .samples = tokens.size(0)};
      },
      callbacks);
  group.barrier()->wait();
  trainer_start = Clock::now();
  trainer.fit();
  return {trainer_ms, hand_dp_ms, hand_plain_ms};
}

void write_line(std::ostream& out, const std::vector<double>& values) {
  for (size_t i = 0; i < values.size(); ++i) out << (i == 0 ? "" : " ") << values[i];
  out << "\n";
}

std::vector<double> read_line(std::istream& in) {
  std::string line;
  std::getline(in, line);
  std::istringstream fields(line);
  std::vector<double> values;
  for (double v; fields >> v;) values.push_back(v);
  return values;
}

void run_trainer_worker(const Settings& s) {
  const TrainerTimes t = measure_trainer(s);
  if (s.worker_rank != 0) return;
  std::ofstream out(std::filesystem::path(s.store_dir) / "times.txt");
  write_line(out, t.trainer);
  write_line(out, t.hand_dp);
  write_line(out, t.hand_plain);
}

// The peer: the same model, batches (the tokens each Loom rank's Trainer reads, from the baton
// directory), optimizer, clipping and thread count in PyTorch's Python DDP (gloo, 2 processes
// by torch.multiprocessing, rendezvous through a file), taking turns with Loom round by round
// (PythonBaton). Every step runs from one barrier to the next, as in measure_trainer; rank 0
// prints the step time of every measured round.
constexpr const char* kPythonDdp = R"PY(
import math, os, sys, time

a = dict(arg.split("=", 1) for arg in sys.argv[1:])
baton = a["baton"]


def wait_for(name):
    deadline = time.monotonic() + 300
    path = os.path.join(baton, name)
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError("Loom did not create " + path + " within 300 s")
        time.sleep(0.0002)


try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    import torch.nn as nn
    import torch.nn.functional as F
except BaseException:
    open(os.path.join(baton, "failed"), "w").close()
    raise


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x, mask):
        b, t, d = x.shape
        hd = d // self.heads
        parts = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
        att = torch.matmul(parts[0], parts[1].transpose(-2, -1)) / math.sqrt(hd)
        att = torch.softmax(att.masked_fill(mask, -1e9), -1)
        y = torch.matmul(att, parts[2]).transpose(1, 2).reshape(b, t, d)
        h = x + self.proj(y)
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


class Gpt(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tok, self.pos = nn.Embedding(a["vocab"], a["dim"]), nn.Embedding(a["seq"], a["dim"])
        self.blocks = nn.ModuleList([Block(a["dim"], a["heads"]) for _ in range(a["layers"])])
        self.lnf = nn.LayerNorm(a["dim"])
        self.head = nn.Linear(a["dim"], a["vocab"], bias=False)

    def forward(self, tokens):
        t = tokens.size(1)
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        x = self.tok(tokens) + self.pos(torch.arange(t))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.lnf(x))


def worker(rank, a):
    torch.set_num_threads(a["threads"])
    dist.init_process_group("gloo", init_method="file://" + a["init"], rank=rank, world_size=a["ranks"])
    torch.manual_seed(7)
    model = nn.parallel.DistributedDataParallel(Gpt(a), bucket_cap_mb=a["bucket_mib"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rounds = a["warmup"] + a["steps"]
    batches, times = None, []
    for i in range(rounds):
        if rank == 0:
            wait_for("python_%d" % i)
        dist.barrier()
        if batches is None:  # written by Loom's rank before its first round
            with open(os.path.join(baton, "tokens_rank%d.bin" % rank), "rb") as f:
                data = bytearray(f.read())
            batches = torch.frombuffer(data, dtype=torch.int64).view(rounds, a["batch"], a["seq"] + 1)
            dist.barrier()
        tokens = batches[i]
        with model.no_sync():  # untimed, as Loom's turn starts (see measure_trainer)
            F.cross_entropy(model(tokens[:, :-1]).reshape(-1, a["vocab"]), tokens[:, 1:].reshape(-1)).backward()
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, a["vocab"]), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss.item()
        dist.barrier()
        if i >= a["warmup"]:
            times.append((time.perf_counter() - start) * 1e3)
        if rank == 0:
            open(os.path.join(baton, "loom_%d" % i), "w").close()
    if rank == 0:
        print("step_ms", " ".join("%.6g" % t for t in times), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        for key in a:
            if key not in ("init", "bucket_mib", "baton"):
                a[key] = int(a[key])
        a["bucket_mib"] = float(a["bucket_mib"])
        mp.spawn(worker, args=(a,), nprocs=a["ranks"])
    except BaseException:
        open(os.path.join(baton, "failed"), "w").close()
        raise
)PY";

// Starts the Python DDP peer taking turns through `baton`; nothing (with a note on stderr)
// when it cannot start.
std::optional<loom::util::Subprocess> start_python_ddp(const Settings& s,
                                                       const std::filesystem::path& dir,
                                                       const std::filesystem::path& baton) {
  const std::filesystem::path script = dir / "python_ddp.py";
  std::ofstream(script) << kPythonDdp;
  std::vector<std::string> argv = {s.python, script.string()};
  const std::pair<const char*, std::string> args[] = {{"ranks", "2"},
                                                      {"vocab", std::to_string(s.vocab)},
                                                      {"dim", std::to_string(s.dim)},
                                                      {"layers", std::to_string(s.layers)},
                                                      {"heads", std::to_string(s.heads)},
                                                      {"seq", std::to_string(s.seq)},
                                                      {"batch", std::to_string(s.batch)},
                                                      {"steps", std::to_string(s.steps)},
                                                      {"warmup", std::to_string(s.warmup)},
                                                      {"threads", std::to_string(s.threads)},
                                                      {"bucket_mib", std::to_string(s.bucket_mib)},
                                                      {"init", (dir / "python_ddp.init").string()},
                                                      {"baton", baton.string()}};
  for (const auto& [key, value] : args) argv.push_back(std::string(key) + "=" + value);
  try {
    return loom::util::Subprocess::spawn({.argv = argv, .output = dir / "python_ddp.out"});
  } catch (const std::exception& e) {
    std::cerr << "bench_train: note: Python DDP rows skipped: " << e.what() << "\n";
    return std::nullopt;
  }
}

// The Python DDP step of every measured round in ms, or nothing (with a note on stderr) when
// it did not run to the end.
std::vector<double> finish_python_ddp(const Settings& s, const std::filesystem::path& dir,
                                      loom::util::Subprocess& python) {
  const loom::util::ExitStatus status = python.wait();
  std::ifstream in(dir / "python_ddp.out");
  const std::string text((std::istreambuf_iterator<char>(in)), {});
  const size_t at = text.rfind("step_ms ");
  if (!status.ok() || at == std::string::npos) {
    std::cerr << "bench_train: note: Python DDP rows skipped: " << s.python << " "
              << status.describe() << " (python3 with torch needed; --python to choose):\n"
              << text.substr(text.size() > 2000 ? text.size() - 2000 : 0) << "\n";
    return {};
  }
  std::istringstream line(text.substr(at + 8));
  return read_line(line);
}

int run_trainer_parent(Settings s, const std::string& self) {
  const std::filesystem::path dir = scratch_dir();
  s.dataset = (dir / "tokens").string();
  write_token_dataset(s, s.dataset);
  const double params_m = parameter_count(*make_model(s)) / 1e6;
  if (!s.json) {
    std::printf(
        "bench_train --mode=trainer: %.2fM-parameter transformer (%lld layers, dim %lld, "
        "vocab %lld), %lld x %lld tokens per rank, %d thread(s) per rank, AdamW, clip 1.0, "
        "median of %d rounds after %d warmup; every round runs one step of each loop, and at 2 "
        "ranks one of Python DDP, in turn, on the same batches\n",
        params_m, (long long)s.layers, (long long)s.dim, (long long)s.vocab, (long long)s.batch,
        (long long)s.seq, s.threads, s.steps, s.warmup);
    std::printf("%-30s %12s %12s  %-36s %-6s %8s\n", "case", "loom", "baseline", "baseline_name",
                "unit", "ratio");
  }
  // ratio: the baseline's median step / the Trainer's; median_round_ratio: the median of the
  // same ratio taken round by round; spread: (max - min) / median over the rounds.
  auto emit_row = [&](const std::string& name, const std::vector<double>& loom_ms,
                      const std::vector<double>& base_ms, const std::string& base_name) {
    auto spread_pct = [](const std::vector<double>& v) {
      return (*std::max_element(v.begin(), v.end()) - *std::min_element(v.begin(), v.end())) /
             median(v) * 100;
    };
    emit(s, {"train",
             name,
             median(loom_ms),
             median(base_ms),
             base_name,
             "ms",
             median(base_ms) / median(loom_ms),
             {{"params_m", params_m},
              {"rounds", static_cast<double>(loom_ms.size())},
              {"median_round_ratio", median_ratio(base_ms, loom_ms)},
              {"loom_spread_pct", spread_pct(loom_ms)},
              {"baseline_spread_pct", spread_pct(base_ms)}}});
  };
  for (int ranks : {1, 2}) {
    s.ranks = ranks;
    const std::filesystem::path run = dir / loom::detail::concat("w", ranks);
    // At 2 ranks Python DDP runs at the same time, taking turns with Loom round by round.
    std::optional<loom::util::Subprocess> python;
    s.baton.clear();
    if (ranks == 2) {
      const std::filesystem::path baton = dir / "baton";
      std::filesystem::create_directories(baton);
      python = start_python_ddp(s, dir, baton);
      if (python) s.baton = baton.string();
    }
    if (!run_ranks(s, self, run)) {
      std::cerr << "bench_train: rank logs kept in " << dir << std::endl;
      return 1;
    }
    std::ifstream in(run / "times.txt");
    TrainerTimes t{read_line(in), read_line(in), read_line(in)};
    LOOM_CHECK(!t.trainer.empty() && t.trainer.size() == t.hand_dp.size() &&
                   t.trainer.size() == t.hand_plain.size(),
               loom::Error, "no times from the ", ranks, "-rank run");
    const std::string suffix = ranks == 1 ? "/1rank" : "/2ranks";
    emit_row("trainer_overhead" + suffix, t.trainer, t.hand_dp, "hand_loop_dataparallel");
    emit_row("trainer_vs_plain" + suffix, t.trainer, t.hand_plain,
             ranks == 1 ? "hand_loop_libtorch" : "hand_loop_allreduce_after_backward");
    if (python) {
      const std::vector<double> python_ms = finish_python_ddp(s, dir, *python);
      if (python_ms.size() == t.trainer.size()) {
        emit_row("trainer_vs_python_ddp/2ranks", t.trainer, python_ms, "pytorch_python_ddp_gloo");
      } else if (!python_ms.empty()) {
        std::cerr << "bench_train: note: Python DDP rows skipped: " << python_ms.size()
                  << " rounds from Python, " << t.trainer.size() << " from Loom\n";
      }
    }
  }
  std::filesystem::remove_all(dir);
  return 0;
}
// --- --mode=sharding --------------------------------------------------------------------------

// One way of holding the training state; every case trains the GPT example's model
// (examples/gpt/model.h) with Loom's AdamW, clipping to norm 1.
struct ShardingCase {
  std::string name;
  loom::parallel::Mode mode;
  bool checkpointing = false;  // each block's activations recomputed in backward
  bool prefetch = true;        // FSDP: the next unit's gather launched early
};

std::vector<ShardingCase> sharding_cases(bool timing) {
  using loom::parallel::Mode;
  std::vector<ShardingCase> cases = {{"ddp", Mode::kDdp},
                                     {"zero1", Mode::kZero1},
                                     {"zero2", Mode::kZero2},
                                     {"fsdp", Mode::kFsdp},
                                     {"fsdp_ac", Mode::kFsdp, true}};
  if (timing) cases.push_back({"fsdp_no_prefetch", Mode::kFsdp, false, false});
  return cases;
}

struct ShardedModel {
  std::shared_ptr<gpt::GptImpl> model;
  std::unique_ptr<loom::parallel::Strategy> strategy;
};

ShardedModel make_sharded(const Settings& s, const ShardingCase& c, loom::comm::Group& group) {
  using loom::metrics::MemoryCategory;
  using loom::parallel::Mode;
  torch::manual_seed(7);
  ShardedModel m;
  {
    loom::metrics::MemoryCategoryScope parameters(MemoryCategory::kParameters);
    m.model = std::make_shared<gpt::GptImpl>(gpt::GptConfig{.vocab_size = s.vocab,
                                                            .seq_len = s.seq,
                                                            .n_layer = s.layers,
                                                            .n_head = s.heads,
                                                            .n_embd = s.dim});
  }
  if (c.checkpointing) {
    loom::parallel::checkpoint_modules_of_type<gpt::BlockImpl>(*m.model, m.model->blocks);
  }
  if (c.mode == Mode::kFsdp) {
    loom::parallel::wrap_modules<torch::nn::Module>(m.model->blocks);  // each block a unit
    loom::parallel::FsdpOptions options;
    options.prefetch = c.prefetch;
    m.strategy =
        std::make_unique<loom::parallel::FullyShardedDataParallel>(m.model, group, options);
  } else {
    loom::parallel::DataParallelOptions options;
    options.bucket_bytes = static_cast<size_t>(s.bucket_mib * (1 << 20));
    options.zero_stage = c.mode == Mode::kDdp     ? loom::parallel::ZeroStage::kNone
                         : c.mode == Mode::kZero1 ? loom::parallel::ZeroStage::kOne
                                                  : loom::parallel::ZeroStage::kTwo;
    m.strategy = std::make_unique<loom::parallel::DataParallel>(m.model, group, options);
  }
  m.strategy->set_optimizer(
      std::make_unique<loom::optim::AdamW>(loom::optim::AdamWOptions{.lr = 1e-4}));
  return m;
}

// One step; what the model's forward and backward allocate counts as activations (saved
// activations and backward temporaries), what the strategies allocate as their own categories.
double sharded_step(ShardedModel& m, const Settings& s, int rank, int index) {
  const auto start = Clock::now();
  m.strategy->zero_grad();
  torch::manual_seed(1000 * index + rank);  // this rank's batch of this step
  const at::Tensor tokens = torch::randint(s.vocab, {s.batch, s.seq + 1}, torch::kLong);
  {
    loom::metrics::MemoryCategoryScope activations(loom::metrics::MemoryCategory::kActivations);
    m.model->loss(tokens.narrow(1, 0, s.seq), tokens.narrow(1, 1, s.seq)).backward();
  }
  m.strategy->finish_gradient_sync();
  m.strategy->clip_grad_norm(1.0);
  m.strategy->step();
  return ms_since(start);
}

struct ShardingTimes {
  double cold_ms = 0;  // the first step (allocations, first gathers)
  std::vector<double> warm_ms;
};

// Peak bytes by category above what was live before, counted from the allocations: over the
// construction and wrapping of the model (`built`), and over two steps after it (`steps`, the
// steady state: what training needs once the model is sharded).
using PeakBytes = std::array<int64_t, loom::metrics::kMemoryCategories>;
struct Peaks {
  PeakBytes built{};
  PeakBytes steps{};
};

Peaks measure_peak_bytes(const Settings& s, const ShardingCase& c, loom::comm::Group& group) {
  const loom::metrics::CpuAllocations before = loom::metrics::cpu_allocations();
  auto peaks_since_reset = [&] {
    const loom::metrics::CpuAllocations now = loom::metrics::cpu_allocations();
    PeakBytes peak{};
    for (int k = 0; k < loom::metrics::kMemoryCategories; ++k) {
      peak[k] = now.by_category[k].peak_bytes - before.by_category[k].live_bytes;
    }
    return peak;
  };
  Peaks peaks;
  loom::metrics::reset_cpu_allocation_peaks();
  {
    ShardedModel m = make_sharded(s, c, group);
    peaks.built = peaks_since_reset();
    loom::metrics::reset_cpu_allocation_peaks();
    for (int i = 0; i < 2; ++i) sharded_step(m, s, group.rank(), i);
    peaks.steps = peaks_since_reset();
    group.barrier()->wait();
  }
  return peaks;
}

void run_sharding_worker(const Settings& s) {
  using loom::metrics::MemoryCategory;
  torch::set_num_threads(s.threads);
  loom::comm::FileStore store(std::filesystem::path(s.store_dir) / "loom");
  auto group = loom::comm::new_gloo_group(store, s.worker_rank, s.ranks);
  const std::string suffix = "/" + std::to_string(s.ranks) + "ranks";

  // Step times first, with the allocator not counting: rounds of one step of every case.
  const std::vector<ShardingCase> timed = sharding_cases(true);
  std::vector<ShardedModel> models;
  for (const ShardingCase& c : timed) models.push_back(make_sharded(s, c, *group));
  std::vector<ShardingTimes> times(timed.size());
  for (int round = 0; round < 1 + s.warmup + s.steps; ++round) {
    for (size_t i = 0; i < timed.size(); ++i) {
      group->barrier()->wait();
      const double ms = sharded_step(models[i], s, group->rank(), round);
      if (round == 0) times[i].cold_ms = ms;
      if (round > s.warmup) times[i].warm_ms.push_back(ms);
    }
  }
  models.clear();
  const int64_t params = make_sharded(s, timed[0], *group).model->num_params();

  // Then memory, each case alone: built, two steps, destroyed.
  loom::metrics::count_cpu_allocations();
  const std::vector<ShardingCase> measured = sharding_cases(false);
  std::vector<Peaks> peaks;
  for (const ShardingCase& c : measured) peaks.push_back(measure_peak_bytes(s, c, *group));
  if (group->rank() != 0) return;

  if (!s.json) {
    std::printf(
        "bench_train --mode=sharding: %.1fM-parameter GPT (examples/gpt; %lld layers, dim %lld, "
        "vocab %lld), %lld x %lld tokens per rank, %d ranks, %d thread(s) each; step: median "
        "of %d interleaved rounds after %d warm-up (cold = the first); bytes: rank 0's peak by "
        "category over two steps after construction (peak_bytes_building: over building and "
        "wrapping the model), from its allocations\n",
        params / 1e6, (long long)s.layers, (long long)s.dim, (long long)s.vocab, (long long)s.batch,
        (long long)s.seq, s.ranks, s.threads, s.steps, s.warmup);
    std::printf("%-30s %12s %12s  %-36s %-6s %8s\n", "case", "loom", "baseline", "baseline_name",
                "unit", "ratio");
  }
  const double ddp_ms = median(times[0].warm_ms);
  for (size_t i = 0; i < timed.size(); ++i) {
    const std::vector<double>& warm = times[i].warm_ms;
    const double ms = median(warm);
    loom::bench::Row row{
        "train", "step/" + timed[i].name + suffix, ms, ddp_ms, "loom_ddp", "ms", ddp_ms / ms, {}};
    row.extra["cold_ms"] = times[i].cold_ms;
    row.extra["min_ms"] = *std::min_element(warm.begin(), warm.end());
    row.extra["max_ms"] = *std::max_element(warm.begin(), warm.end());
    row.extra["params_m"] = params / 1e6;
    emit(s, row);
  }
  auto median_of = [&](const std::string& name) {
    for (size_t i = 0; i < timed.size(); ++i) {
      if (timed[i].name == name) return median(times[i].warm_ms);
    }
    throw loom::InvalidArgument("bench_train: no case " + name);
  };
  const double fsdp_ms = median_of("fsdp");
  const double no_prefetch_ms = median_of("fsdp_no_prefetch");
  emit(s, {"train",
           "fsdp_prefetch" + suffix,
           fsdp_ms,
           no_prefetch_ms,
           "fsdp_no_prefetch",
           "ms",
           no_prefetch_ms / fsdp_ms,
           {}});

  // model_state: the sum of the parameter, gradient and optimizer-state peaks (an upper bound
  // of their joint peak).
  auto model_state = [](const PeakBytes& p) {
    return p[static_cast<int>(MemoryCategory::kParameters)] +
           p[static_cast<int>(MemoryCategory::kGradients)] +
           p[static_cast<int>(MemoryCategory::kOptimizerState)];
  };
  for (size_t i = 0; i < measured.size(); ++i) {
    auto bytes_row = [&](const std::string& what, int64_t loom, int64_t baseline) {
      emit(s, {"train",
               what + "/" + measured[i].name + suffix,
               double(loom),
               double(baseline),
               "loom_ddp",
               "bytes",
               loom > 0 ? double(baseline) / double(loom) : 0,
               {}});
    };
    const PeakBytes& p = peaks[i].steps;
    const PeakBytes& ddp = peaks[0].steps;
    for (MemoryCategory k : {MemoryCategory::kParameters, MemoryCategory::kGradients,
                             MemoryCategory::kOptimizerState, MemoryCategory::kActivations}) {
      bytes_row(std::string("peak_bytes/") + loom::metrics::to_string(k), p[static_cast<int>(k)],
                ddp[static_cast<int>(k)]);
    }
    bytes_row("peak_bytes/model_state", model_state(p), model_state(ddp));
    bytes_row("peak_bytes_building/model_state", model_state(peaks[i].built),
              model_state(peaks[0].built));
  }
}

int run_sharding_parent(Settings s, const std::string& self, const std::vector<int>& worlds) {
  for (int world : worlds) {
    s.ranks = world;
    if (run_parent(s, self) != 0) return 1;
  }
  return 0;
}

}  // namespace

// --- --mode=pipeline --------------------------------------------------------------------------
// The schedules' bubble as parallel::Pipeline runs them: p ranks (threads over Gloo and
// loopback TCP), m micro-batches, every stage a timed wait of forward_ms per micro-batch
// forward and twice that backward (an autograd function that sleeps), so that the stages
// truly run at once on this 2-core machine and what is measured is the schedule and its
// transfers, not the cores. Interleaved 1F1B runs 2 chunks per rank, each half the time.

struct TimedStage : torch::autograd::Function<TimedStage> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            double forward_ms, double backward_ms) {
    ctx->saved_data["backward_ms"] = backward_ms;
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(forward_ms));
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    std::this_thread::sleep_for(
        std::chrono::duration<double, std::milli>(ctx->saved_data["backward_ms"].toDouble()));
    return {grad[0], at::Tensor(), at::Tensor()};
  }
};

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 == 1 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

int run_pipeline(const Settings& s) {
  using loom::parallel::Schedule;
  struct Case {
    Schedule schedule;
    int chunks;
  };
  const std::vector<Case> cases = {
      {Schedule::kGPipe, 1}, {Schedule::k1F1B, 1}, {Schedule::kInterleaved1F1B, 2}};
  const int p = s.ranks, m = s.micro_batches;
  // bubbles[case][round] = the mean over ranks of the step's idle share; steps likewise.
  std::vector<std::vector<double>> bubbles(cases.size()), steps(cases.size());
  std::vector<double> cold(cases.size(), 0);
  std::mutex mutex;
  loom::comm::InMemoryStore store;
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<size_t>(p));
  for (int rank = 0; rank < p; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        auto group = loom::comm::new_gloo_group(store, rank, p, {});
        at::Tensor weight = torch::ones({1}, torch::requires_grad());
        std::vector<std::unique_ptr<loom::parallel::Pipeline>> pipes;
        for (const Case& c : cases) {
          std::vector<loom::parallel::StageFn> chunks;
          for (int j = 0; j < c.chunks; ++j) {
            const double f = s.forward_ms / c.chunks;
            chunks.push_back([&weight, f](const at::Tensor& x) {
              return TimedStage::apply(x * weight, f, 2 * f);
            });
          }
          pipes.push_back(std::make_unique<loom::parallel::Pipeline>(
              *group, std::move(chunks),
              loom::parallel::PipelineOptions{.schedule = c.schedule, .micro_batches = m}));
        }
        const at::Tensor batch = torch::ones({m, 64});
        auto loss = [](const at::Tensor& out, const at::Tensor&) { return out.mean(); };
        for (int round = 0; round < s.warmup + s.steps; ++round) {
          for (size_t c = 0; c < cases.size(); ++c) {  // the cases interleaved, round by round
            group->barrier()->wait();
            pipes[c]->step(batch, batch, loss);
            const auto& stats = pipes[c]->stats();
            std::lock_guard<std::mutex> lock(mutex);
            if (round == 0) cold[c] = std::max(cold[c], stats.step_seconds);
            if (round < s.warmup) continue;
            const size_t r = static_cast<size_t>(round - s.warmup);
            if (bubbles[c].size() <= r) {
              bubbles[c].push_back(0);
              steps[c].push_back(0);
            }
            bubbles[c][r] += stats.bubble() / p;
            steps[c][r] = std::max(steps[c][r], stats.step_seconds);
          }
        }
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(rank)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int rank = 0; rank < p; ++rank) {
    if (!errors[static_cast<size_t>(rank)].empty()) {
      throw loom::Error("rank " + std::to_string(rank) + ": " + errors[static_cast<size_t>(rank)]);
    }
  }
  if (!s.json) {
    std::printf(
        "bench_train --mode=pipeline: %d stages (threads, Gloo over loopback TCP), %d "
        "micro-batches, a stage's forward %.1f ms and backward %.1f ms per micro-batch (timed "
        "waits), %d measured rounds after %d warm-up, cases interleaved; bubble: the mean over "
        "ranks of 1 - compute / step, median of the rounds\n",
        p, m, s.forward_ms, 2 * s.forward_ms, s.steps, s.warmup);
    std::printf("%-30s %12s %12s  %-36s %-6s %8s\n", "case", "loom", "baseline", "baseline_name",
                "unit", "ratio");
  }
  std::vector<double> measured(cases.size());
  for (size_t c = 0; c < cases.size(); ++c) {
    const std::string name = loom::parallel::to_string(cases[c].schedule);
    const double theory =
        loom::parallel::theoretical_bubble(cases[c].schedule, p, m, cases[c].chunks);
    measured[c] = median_of(bubbles[c]);
    const auto [lo, hi] = std::minmax_element(bubbles[c].begin(), bubbles[c].end());
    const std::string shape = "/p" + std::to_string(p) + "_m" + std::to_string(m) +
                              (cases[c].chunks > 1 ? "_v" + std::to_string(cases[c].chunks) : "");
    emit(s,
         {"train",
          "bubble/" + name + shape,
          100 * measured[c],
          100 * theory,
          cases[c].chunks > 1 ? "theory (p-1)/(vm+p-1)" : "theory (p-1)/(m+p-1)",
          "%",
          theory / measured[c],
          {{"min_pct", 100 * *lo}, {"max_pct", 100 * *hi}, {"rounds", double(bubbles[c].size())}}});
    const double ideal = m * 3 * s.forward_ms / 1e3;  // forward + backward of every micro-batch
    emit(s, {"train",
             "step/" + name + shape,
             1e3 * median_of(steps[c]),
             1e3 * ideal,
             "compute alone m(f+b)",
             "ms",
             ideal / median_of(steps[c]),
             {{"cold_ms", 1e3 * cold[c]}}});
  }
  emit(s, {"train",
           "bubble/interleaved_vs_1f1b/p" + std::to_string(p) + "_m" + std::to_string(m),
           100 * measured[2],
           100 * measured[1],
           "loom_1f1b",
           "%",
           measured[1] / measured[2],
           {}});
  return 0;
}

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{"bench_train: data-parallel training steps, Loom beside the plain way"};
  app.add_option("--mode", s.mode, "what to measure: ddp, trainer, sharding or pipeline")
      ->check(CLI::IsMember({"ddp", "trainer", "sharding", "pipeline"}));
  app.add_option("--ranks", s.ranks, "ranks (processes)")->check(CLI::Range(1, 64));
  app.add_option("--vocab", s.vocab, "vocabulary size");
  app.add_option("--dim", s.dim, "model width");
  app.add_option("--layers", s.layers, "transformer blocks");
  app.add_option("--heads", s.heads, "attention heads");
  app.add_option("--seq", s.seq, "tokens per sequence");
  app.add_option("--batch", s.batch, "sequences per rank per step");
  app.add_option("--steps", s.steps, "measured steps per case")->check(CLI::Range(1, 100000));
  app.add_option("--warmup", s.warmup, "unmeasured steps per case");
  app.add_option("--threads", s.threads, "intra-op threads per rank");
  app.add_option("--bucket-mib", s.bucket_mib, "DataParallel bucket size in MiB");
  app.add_option("--micro-batches", s.micro_batches, "--mode=pipeline: micro-batches per step")
      ->check(CLI::Range(1, 1024));
  app.add_option("--forward-ms", s.forward_ms,
                 "--mode=pipeline: a stage's forward per micro-batch (backward: twice)");
  app.add_flag("--json", s.json, "print one JSON object per row");
  app.add_option("--python", s.python, "--mode=trainer: the Python with torch for the DDP peer")
      ->capture_default_str();
  app.add_option("--worker-rank", s.worker_rank, "internal: run as this rank")->group("");
  app.add_option("--store-dir", s.store_dir, "internal: rendezvous directory")->group("");
  app.add_option("--dataset", s.dataset, "internal: the token dataset")->group("");
  app.add_option("--baton", s.baton, "internal: turn-taking directory with Python DDP")->group("");
  CLI11_PARSE(app, argc, argv);
  const bool trainer = s.mode == "trainer";
  const bool sharding = s.mode == "sharding";
  if (trainer) use_trainer_defaults(s, app);
  // --mode=sharding: ~20M parameters with the tied head; W = 2 and 4 unless --ranks is given.
  if (sharding && app.count("--vocab") == 0) s.vocab = 16384;
  const std::vector<int> sharding_worlds =
      app.count("--ranks") > 0 ? std::vector<int>{s.ranks} : std::vector<int>{2, 4};
  try {
    if (s.mode == "pipeline") {
      if (app.count("--ranks") == 0) s.ranks = 4;
      if (app.count("--steps") == 0) s.steps = 5;
      return run_pipeline(s);
    }
    if (s.worker_rank >= 0) {
      if (trainer) {
        run_trainer_worker(s);
      } else if (sharding) {
        run_sharding_worker(s);
      } else {
        run_worker(s);
      }
      return 0;
    }
    if (sharding) return run_sharding_parent(s, "/proc/self/exe", sharding_worlds);
    return trainer ? run_trainer_parent(s, "/proc/self/exe") : run_parent(s, "/proc/self/exe");
  } catch (const std::exception& e) {
    std::cerr << "bench_train: error: " << e.what() << std::endl;
    return 1;
  }
}

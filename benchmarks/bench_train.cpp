// bench_train --mode=ddp: one training step of a ~20M-parameter decoder-only transformer on N
// ranks as processes (Gloo over a FileStore, loopback TCP), for
//   baseline   the plain way of libtorch C++ examples: backward, then one all-reduce per
//              parameter gradient, then torch::optim::AdamW;
//   ddp        Loom's DataParallel: bucketed all-reduce overlapped with backward, torch AdamW;
//   zero1/2    DataParallel with ZeRO-1 / ZeRO-2 and Loom's sharded AdamW;
// plus the share of communication that overlap hides and the optimizer-state bytes per rank.
// ratio = baseline / Loom for times (above 1: Loom is faster), replicated / Loom for bytes.
//
//   bench_train --mode=ddp               2 ranks, the 20M model, table
//   bench_train --mode=ddp --json        JSON rows
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "bench_report.h"
#include "loom/comm/gloo.h"
#include "loom/comm/store.h"
#include "loom/error.h"
#include "loom/parallel/data_parallel.h"
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
  int worker_rank = -1;
  std::string store_dir;
};

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

torch::Tensor loss_of(Gpt& model, const Settings& s, int rank, int step) {
  torch::manual_seed(1000 * step + rank);  // this rank's batch of this step
  auto tokens = torch::randint(s.vocab, {s.batch, s.seq + 1}, torch::kLong);
  auto logits = model.forward(tokens.narrow(1, 0, s.seq));
  return torch::cross_entropy_loss(logits.reshape({-1, s.vocab}),
                                   tokens.narrow(1, 1, s.seq).reshape(-1));
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
  std::printf("%-22s %12.1f %12.1f  %-26s %-6s %7.2fx", row.case_name.c_str(), row.loom,
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
    std::printf("%-22s %12s %12s  %-26s %-6s %8s\n", "case", "loom", "baseline", "baseline_name",
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

int run_parent(const Settings& s, const std::string& self) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    loom::detail::concat("loom-bench-train-", ::getpid());
  std::filesystem::create_directories(dir);
  std::vector<loom::util::Subprocess> children;
  for (int r = 0; r < s.ranks; ++r) {
    std::vector<std::string> argv = {self,
                                     "--mode=" + s.mode,
                                     "--worker-rank=" + std::to_string(r),
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
    if (s.json) argv.push_back("--json");
    loom::util::SubprocessOptions options{.argv = argv};
    if (r != 0) options.output = dir / loom::detail::concat("rank_", r, ".log");
    children.push_back(loom::util::Subprocess::spawn(options));
  }
  int status = 0;
  for (int r = 0; r < s.ranks; ++r) {
    const loom::util::ExitStatus exit = children[r].wait();
    if (!exit.ok()) {
      std::cerr << "bench_train: rank " << r << " " << exit.describe() << std::endl;
      status = 1;
    }
  }
  if (status == 0) {
    std::filesystem::remove_all(dir);
  } else {
    std::cerr << "bench_train: rank logs kept in " << dir << std::endl;
  }
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{"bench_train: data-parallel training steps, Loom beside the plain way"};
  app.add_option("--mode", s.mode, "what to measure")->check(CLI::IsMember({"ddp"}));
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
    std::cerr << "bench_train: error: " << e.what() << std::endl;
    return 1;
  }
}

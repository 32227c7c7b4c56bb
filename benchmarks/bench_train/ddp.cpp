// bench_train --mode=ddp: one training step of the small GPT on N ranks as processes, the
// plain libtorch way (all-reduce after backward) beside Loom's DataParallel with and without
// overlap, ZeRO-1 and ZeRO-2; also the communication that overlap hides and the optimizer
// state per rank.
#include <algorithm>
#include <cstdio>

#include "bench_train.h"
#include "loom/comm/gloo.h"
#include "loom/comm/store.h"
#include "loom/parallel/data_parallel.h"

namespace bench_train {
namespace {

struct CaseResult {
  double step_ms = 0;               // median
  double comm_exposed_ms = 0;       // median time blocked on gradient communication
  int64_t state_bytes = 0;          // optimizer state (+ masters) on this rank
  int buckets = 0;                  // DataParallel buckets
  int buckets_during_backward = 0;  // of them, reduced while backward still ran (last step)
};

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

}  // namespace

void run_ddp_worker(const Settings& s) {
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
    emit_columns();
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

}  // namespace bench_train

// bench_train --mode=sharding: the GPT example's model under DDP, ZeRO-1, ZeRO-2, FSDP and FSDP
// with activation checkpointing: step times beside DDP's and each case's peak bytes per rank.
#include <algorithm>
#include <cstdio>
#include <map>

#include "bench_train.h"
#include "loom/comm/gloo.h"
#include "loom/comm/store.h"
#include "loom/metrics/allocations.h"
#include "loom/parallel/activation_checkpoint.h"
#include "loom/parallel/data_parallel.h"
#include "loom/parallel/fsdp.h"
#include "loom/parallel/strategy.h"
#include "model.h"  // the GPT example's model

namespace bench_train {
namespace {

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
    options.bucket_bytes = static_cast<size_t>(
        (c.mode == Mode::kZero2 ? s.zero2_bucket_mib : s.bucket_mib) * (1 << 20));
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
  std::vector<double> gather_wait_ms;  // FSDP: blocked on parameter gathers, per warm step
  std::vector<double> reduce_wait_ms;  // FSDP: blocked on gradient reduce-scatters
};

const loom::parallel::FsdpStats* fsdp_stats(const ShardedModel& m) {
  const auto* fsdp =
      dynamic_cast<const loom::parallel::FullyShardedDataParallel*>(m.strategy.get());
  return fsdp != nullptr ? &fsdp->stats() : nullptr;
}

// Peak bytes by category above what was live before, counted from the allocations: over the
// construction and wrapping of the model (`built`), and over two steps after it (`steps`, the
// steady state: what training needs once the model is sharded).
struct Peaks {
  PeakBytes built{};
  PeakBytes steps{};
};

Peaks measure_peak_bytes(const Settings& s, const ShardingCase& c, loom::comm::Group& group) {
  const loom::metrics::CpuAllocations before = loom::metrics::cpu_allocations();
  Peaks peaks;
  loom::metrics::reset_cpu_allocation_peaks();
  {
    ShardedModel m = make_sharded(s, c, group);
    peaks.built = peak_bytes_since(before);
    loom::metrics::reset_cpu_allocation_peaks();
    for (int i = 0; i < 2; ++i) sharded_step(m, s, group.rank(), i);
    peaks.steps = peak_bytes_since(before);
    group.barrier()->wait();
  }
  return peaks;
}

}  // namespace

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
      const loom::parallel::FsdpStats* stats = fsdp_stats(models[i]);
      const loom::parallel::FsdpStats before = stats ? *stats : loom::parallel::FsdpStats{};
      const double ms = sharded_step(models[i], s, group->rank(), round);
      if (round == 0) times[i].cold_ms = ms;
      if (round > s.warmup) {
        times[i].warm_ms.push_back(ms);
        if (stats != nullptr) {
          times[i].gather_wait_ms.push_back(
              1e3 * (stats->gather_wait_seconds - before.gather_wait_seconds));
          times[i].reduce_wait_ms.push_back(
              1e3 * (stats->reduce_wait_seconds - before.reduce_wait_seconds));
        }
      }
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
        "vocab %lld), %lld x %lld tokens per rank, %d ranks, %d thread(s) each; buckets: "
        "%g MiB (ddp, zero1), %g MiB (zero2); step: median "
        "of %d interleaved rounds after %d warm-up (cold = the first); bytes: rank 0's peak by "
        "category over two steps after construction (peak_bytes_building: over building and "
        "wrapping the model), from its allocations\n",
        params / 1e6, (long long)s.layers, (long long)s.dim, (long long)s.vocab, (long long)s.batch,
        (long long)s.seq, s.ranks, s.threads, s.bucket_mib, s.zero2_bucket_mib, s.steps, s.warmup);
    emit_columns();
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
  auto times_of = [&](const std::string& name) -> const ShardingTimes& {
    for (size_t i = 0; i < timed.size(); ++i) {
      if (timed[i].name == name) return times[i];
    }
    throw loom::InvalidArgument("bench_train: no case " + name);
  };
  const ShardingTimes& fsdp = times_of("fsdp");
  const ShardingTimes& no_prefetch = times_of("fsdp_no_prefetch");
  const double fsdp_ms = median(fsdp.warm_ms);
  const double no_prefetch_ms = median(no_prefetch.warm_ms);
  emit(s, {"train",
           "fsdp_prefetch" + suffix,
           fsdp_ms,
           no_prefetch_ms,
           "fsdp_no_prefetch",
           "ms",
           no_prefetch_ms / fsdp_ms,
           {}});
  // What prefetch hides: the time the training thread waited for gathers, with and without it.
  const double wait_ms = median(fsdp.gather_wait_ms);
  const double unhidden_ms = median(no_prefetch.gather_wait_ms);
  loom::bench::Row waits{"train",
                         "fsdp_gather_wait" + suffix,
                         wait_ms,
                         unhidden_ms,
                         "fsdp_no_prefetch",
                         "ms",
                         wait_ms > 0 ? unhidden_ms / wait_ms : 0,
                         {}};
  waits.extra["hidden_pct"] = unhidden_ms > 0 ? 100 * (1 - wait_ms / unhidden_ms) : 0;
  waits.extra["reduce_wait_ms"] = median(fsdp.reduce_wait_ms);
  emit(s, waits);

  // model_state: the sum of the parameter, gradient and optimizer-state peaks (an upper bound
  // of their joint peak).
  auto model_state = [](const PeakBytes& p) {
    return bytes_of(p, MemoryCategory::kParameters) + bytes_of(p, MemoryCategory::kGradients) +
           bytes_of(p, MemoryCategory::kOptimizerState);
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
      bytes_row(std::string("peak_bytes/") + loom::metrics::to_string(k), bytes_of(p, k),
                bytes_of(ddp, k));
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

}  // namespace bench_train

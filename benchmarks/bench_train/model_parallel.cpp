// bench_train --mode=model-parallel: the GPT example's model split by tensor parallelism, into
// pipeline stages under each schedule, and over pp x dp x tp, ranks as processes, beside the
// same model and batch trained unsplit in one process: step time, bytes per rank, the bubble.
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <thread>

#include "bench_train.h"
#include "loom/comm/gloo.h"
#include "loom/comm/store.h"
#include "loom/error.h"
#include "loom/optim/flat_optimizer.h"
#include "loom/parallel/data_parallel.h"
#include "loom/parallel/mesh.h"
#include "loom/parallel/pipeline.h"
#include "model.h"  // the GPT example's model

namespace bench_train {
namespace {

using loom::metrics::MemoryCategory;
using loom::parallel::Schedule;

// One way of splitting the model: pp x dp x tp ranks, the first pp * dp * tp processes of the
// run, arranged by a DeviceMesh in that order (tp innermost).
struct Split {
  std::string name;
  int pp = 1, dp = 1, tp = 1;
  bool sequence_parallel = false;       // tp > 1: activations outside attention and MLP split too
  Schedule schedule = Schedule::k1F1B;  // pp > 1
  int chunks = 1;                       // model chunks per pipeline rank (interleaved: 2)
  bool unsplit = false;                 // the baseline: the plain model, no group at all
  int ranks() const { return pp * dp * tp; }
};

// The baseline first; pp x dp x tp last, with the most ranks.
std::vector<Split> splits() {
  std::vector<Split> out = {{.name = "unsplit", .unsplit = true},
                            {.name = "tp1"},
                            {.name = "tp2", .tp = 2},
                            {.name = "tp4", .tp = 4},
                            {.name = "tp2_sp", .tp = 2, .sequence_parallel = true},
                            {.name = "tp4_sp", .tp = 4, .sequence_parallel = true}};
  for (int pp : {2, 4}) {
    for (Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B, Schedule::kInterleaved1F1B}) {
      const int chunks = schedule == Schedule::kInterleaved1F1B ? 2 : 1;
      out.push_back({.name = "pp" + std::to_string(pp) + "_" + loom::parallel::to_string(schedule) +
                             (chunks > 1 ? "_v" + std::to_string(chunks) : ""),
                     .pp = pp,
                     .schedule = schedule,
                     .chunks = chunks});
    }
  }
  out.push_back({.name = "pp2_dp2_tp2", .pp = 2, .dp = 2, .tp = 2});
  return out;
}

// A replica's pipeline cuts its batch / dp rows into micro_batches / dp micro-batches, so that a
// micro-batch has batch / micro_batches rows in every split.
int micro_batches_of(const Settings& s, const Split& split) { return s.micro_batches / split.dp; }

// The rows of step `index`'s batch that replica `replica` of `dp` trains on: inputs and
// targets, [batch / dp, seq] each. Every split reads the same global batch.
std::pair<at::Tensor, at::Tensor> replica_batch(const Settings& s, int dp, int replica, int index) {
  torch::manual_seed(1000 + index);
  const at::Tensor tokens = torch::randint(s.vocab, {s.batch, s.seq + 1}, torch::kLong);
  const int64_t rows = s.batch / dp;
  const at::Tensor mine = tokens.narrow(0, rows * replica, rows);
  return {mine.narrow(1, 0, s.seq), mine.narrow(1, 1, s.seq)};
}

// This rank's part of a split, trained with SGD (no optimizer state: the bytes are parameters,
// gradients and activations). Every rank builds the whole model from seed 7 (the GPT example
// has no meta-device construction), then keeps its stages' parameters only (keep_layers), as the
// GPT example's program does, under Loom's DataParallel over the dp group with
// parallel::ModelParallel: the pipeline's micro-batches accumulate under no_sync, then
// reduce_accumulated_gradients sums the tied embedding between the first and the last stage and
// reduces over dp. The unsplit baseline is the plain libtorch loop: backward, torch SGD.
// Construction is collective over `ranks` (the split's processes; null when unsplit). Not
// copyable or movable: the stage functions hold the model.
class SplitRank {
 public:
  SplitRank(const Settings& s, const Split& split, loom::comm::Group* ranks);
  SplitRank(const SplitRank&) = delete;
  SplitRank& operator=(const SplitRank&) = delete;

  // One step on batch `index`: forward and backward, the tied embedding's gradient summed
  // between the first and last stage, the gradients averaged over dp, the SGD step. In ms.
  double step(const Settings& s, int index);
  // The last step's pipeline times; null without a pipeline (pp = 1).
  const loom::parallel::PipelineStats* pipeline_stats() const {
    return pipeline_ != nullptr ? &pipeline_->stats() : nullptr;
  }
  // The parameters this rank trains (the whole model's when unsplit).
  int64_t parameter_count() const;

 private:
  Split split_;
  std::unique_ptr<loom::parallel::DeviceMesh> mesh_;  // null when unsplit
  gpt::Gpt model_{nullptr};
  std::vector<at::Tensor> params_;                      // this rank's stages' parameters, once each
  std::unique_ptr<loom::parallel::Pipeline> pipeline_;  // pp > 1
  std::unique_ptr<loom::comm::Group> tied_;  // the first and last stage: the tied embedding
  std::unique_ptr<loom::parallel::DataParallel> data_parallel_;  // split
  std::unique_ptr<torch::optim::SGD> optimizer_;                 // unsplit
};

SplitRank::SplitRank(const Settings& s, const Split& split, loom::comm::Group* ranks)
    : split_(split) {
  gpt::GptParallel parallel;
  if (!split.unsplit) {
    mesh_ = std::make_unique<loom::parallel::DeviceMesh>(
        *ranks,
        std::vector<loom::parallel::MeshDim>{{"pp", split.pp}, {"dp", split.dp}, {"tp", split.tp}});
    parallel.tp = &mesh_->group("tp");
    parallel.sequence_parallel = split.sequence_parallel;
  }
  const gpt::GptConfig config{.vocab_size = s.vocab,
                              .seq_len = s.seq,
                              .n_layer = s.layers,
                              .n_head = s.heads,
                              .n_embd = s.dim};
  torch::manual_seed(7);
  {
    loom::metrics::MemoryCategoryScope parameters(MemoryCategory::kParameters);
    model_ = gpt::Gpt(config, parallel);
  }
  if (split.unsplit) {
    params_ = model_->parameters();
    {
      loom::metrics::MemoryCategoryScope gradients(MemoryCategory::kGradients);
      for (at::Tensor& t : params_) t.mutable_grad() = torch::zeros_like(t);
    }
    optimizer_ = std::make_unique<torch::optim::SGD>(params_, torch::optim::SGDOptions(1e-3));
    return;
  }
  // Chunk j of pipeline rank `stage` is virtual stage j * pp + stage (pipeline.h).
  const int pp = split.pp, stage = mesh_->coordinate("pp");
  std::vector<loom::parallel::StageFn> chunks;
  std::vector<std::pair<int64_t, int64_t>> layers;
  for (int j = 0; j < split.chunks; ++j) {
    const auto [begin, end] = gpt::GptImpl::stage_layers(config, j * pp + stage, pp * split.chunks);
    layers.emplace_back(begin, end);
    chunks.push_back([model = model_.ptr(), begin = begin, end = end](const at::Tensor& input) {
      return model->forward_stage(input, begin, end);
    });
  }
  loom::parallel::ModelParallel model_parallel{.tp = &mesh_->group("tp"),
                                               .pp = &mesh_->group("pp")};
  for (const std::string& name : model_->keep_layers(layers)) {
    if (tied_ == nullptr) tied_ = mesh_->group("pp").new_subgroup({0, pp - 1});
    model_parallel.tied.push_back({name, tied_.get()});
  }
  params_ = model_->parameters();
  if (pp > 1) {
    pipeline_ = std::make_unique<loom::parallel::Pipeline>(
        mesh_->group("pp"), std::move(chunks),
        loom::parallel::PipelineOptions{.schedule = split.schedule,
                                        .micro_batches = micro_batches_of(s, split)});
  }
  data_parallel_ = std::make_unique<loom::parallel::DataParallel>(
      model_.ptr(), mesh_->group("dp"),
      loom::parallel::DataParallelOptions{.model_parallel = model_parallel});
  data_parallel_->set_optimizer(
      std::make_unique<loom::optim::Sgd>(loom::optim::SgdOptions{.lr = 1e-3}));
}

double SplitRank::step(const Settings& s, int index) {
  const auto start = Clock::now();
  if (data_parallel_ != nullptr) {
    data_parallel_->zero_grad();
    data_parallel_->set_sync(pipeline_ == nullptr);
  } else {
    for (at::Tensor& t : params_) t.mutable_grad().zero_();
  }
  const int replica = mesh_ != nullptr ? mesh_->coordinate("dp") : 0;
  const auto [inputs, targets] = replica_batch(s, split_.dp, replica, index);
  {
    // Saved activations, backward's temporaries and, between stages, the activations and
    // their gradients in transit.
    loom::metrics::MemoryCategoryScope activations(MemoryCategory::kActivations);
    if (pipeline_ != nullptr) {
      pipeline_->step(inputs, targets, [this](const at::Tensor& logits, const at::Tensor& y) {
        return model_->loss_from_logits(logits, y);
      });
    } else {
      model_->loss(inputs, targets).backward();
    }
  }
  if (data_parallel_ == nullptr) {
    optimizer_->step();
    return ms_since(start);
  }
  if (pipeline_ != nullptr) data_parallel_->reduce_accumulated_gradients();
  data_parallel_->finish_gradient_sync();
  data_parallel_->step();
  return ms_since(start);
}

int64_t SplitRank::parameter_count() const {
  int64_t n = 0;
  for (const at::Tensor& t : params_) n += t.numel();
  return n;
}

// This rank's peak bytes over two steps after building its part of `split`, above what was
// live before: {parameters + gradients, activations}.
std::pair<int64_t, int64_t> measure_bytes(const Settings& s, const Split& split,
                                          loom::comm::Group* ranks) {
  const loom::metrics::CpuAllocations before = loom::metrics::cpu_allocations();
  SplitRank part(s, split, ranks);
  loom::metrics::reset_cpu_allocation_peaks();
  for (int i = 0; i < 2; ++i) part.step(s, i);
  const PeakBytes peak = peak_bytes_since(before);
  if (ranks != nullptr) ranks->barrier()->wait();  // no peer still sending when it is destroyed
  return {bytes_of(peak, MemoryCategory::kParameters) + bytes_of(peak, MemoryCategory::kGradients),
          bytes_of(peak, MemoryCategory::kActivations)};
}

// Every rank's `mine` in rank order, [world size, mine's shape...], on every rank.
at::Tensor gather(loom::comm::Group& world, const at::Tensor& mine) {
  at::Tensor all = torch::empty({world.size() * mine.numel()}, mine.options());
  world.all_gather(all, mine.contiguous())->wait();
  std::vector<int64_t> shape = {world.size()};
  for (int64_t d : mine.sizes()) shape.push_back(d);
  return all.view(shape);
}

// What rank 0 reports of one split, from every rank's measurements.
struct SplitResult {
  double cold_ms = 0;            // the first step
  std::vector<double> step_ms;   // the measured rounds: the slowest rank's step
  std::vector<double> bubble;    // the measured rounds: the mean over ranks (pp > 1)
  int64_t max_params_grads = 0;  // bytes, the most on any rank
  int64_t min_params_grads = 0;  // and the least
  int64_t max_activations = 0;
  int64_t min_activations = 0;
};

// ms and bubble: [world, splits, rounds]; bytes: [world, splits, 2].
std::vector<SplitResult> results(const Settings& s, const std::vector<Split>& all,
                                 const at::Tensor& ms, const at::Tensor& bubble,
                                 const at::Tensor& bytes) {
  std::vector<SplitResult> out(all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    const int64_t c = static_cast<int64_t>(i), ranks = all[i].ranks();
    const at::Tensor step = ms.narrow(0, 0, ranks).select(1, c).amax(0);
    const at::Tensor idle = bubble.narrow(0, 0, ranks).select(1, c).mean(0);
    out[i].cold_ms = step[0].item<double>();
    for (int64_t round = 1 + s.warmup; round < step.size(0); ++round) {
      out[i].step_ms.push_back(step[round].item<double>());
      out[i].bubble.push_back(idle[round].item<double>());
    }
    const at::Tensor b = bytes.narrow(0, 0, ranks).select(1, c);
    out[i].max_params_grads = b.select(1, 0).max().item<int64_t>();
    out[i].min_params_grads = b.select(1, 0).min().item<int64_t>();
    out[i].max_activations = b.select(1, 1).max().item<int64_t>();
    out[i].min_activations = b.select(1, 1).min().item<int64_t>();
  }
  return out;
}

void print_rows(const Settings& s, const std::vector<Split>& all,
                const std::vector<SplitResult>& r) {
  const double unsplit_ms = median(r[0].step_ms);
  for (size_t i = 0; i < all.size(); ++i) {
    const double ms = median(r[i].step_ms);
    const auto [lo, hi] = std::minmax_element(r[i].step_ms.begin(), r[i].step_ms.end());
    emit(s, {"train",
             "step/" + all[i].name,
             ms,
             unsplit_ms,
             "unsplit_1process",
             "ms",
             unsplit_ms / ms,
             {{"cold_ms", r[i].cold_ms},
              {"min_ms", *lo},
              {"max_ms", *hi},
              {"ranks", double(all[i].ranks())}}});
  }
  auto bytes_row = [&](const std::string& what, const Split& split, int64_t most, int64_t least,
                       int64_t unsplit) {
    emit(s, {"train",
             "peak_bytes/" + what + "/" + split.name,
             double(most),
             double(unsplit),
             "unsplit_1process",
             "bytes",
             most > 0 ? double(unsplit) / double(most) : 0,
             {{"min_rank_bytes", double(least)}}});
  };
  for (size_t i = 0; i < all.size(); ++i) {
    bytes_row("params_grads", all[i], r[i].max_params_grads, r[i].min_params_grads,
              r[0].max_params_grads);
    bytes_row("activations", all[i], r[i].max_activations, r[i].min_activations,
              r[0].max_activations);
  }
  for (size_t i = 0; i < all.size(); ++i) {
    const Split& split = all[i];
    if (split.pp == 1) continue;
    const int m = micro_batches_of(s, split);
    const double theory =
        loom::parallel::theoretical_bubble(split.schedule, split.pp, m, split.chunks);
    const double measured = median(r[i].bubble);
    const auto [lo, hi] = std::minmax_element(r[i].bubble.begin(), r[i].bubble.end());
    emit(s, {"train",
             "bubble/" + split.name,
             100 * measured,
             100 * theory,
             split.chunks > 1 ? "theory (p-1)/(vm+p-1)" : "theory (p-1)/(m+p-1)",
             "%",
             measured > 0 ? theory / measured : 0,
             {{"min_pct", 100 * *lo}, {"max_pct", 100 * *hi}, {"m", double(m)}}});
  }
}

}  // namespace

void run_model_parallel_worker(const Settings& s) {
  torch::set_num_threads(s.threads);
  loom::comm::FileStore store(std::filesystem::path(s.store_dir) / "loom");
  auto world = loom::comm::new_gloo_group(store, s.worker_rank, s.ranks);
  const std::vector<Split> all = splits();
  const int64_t n = static_cast<int64_t>(all.size());
  // Each split runs on the first split.ranks() processes; the others wait in a barrier.
  std::vector<std::unique_ptr<loom::comm::Group>> groups(all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i].unsplit || world->rank() >= all[i].ranks()) continue;
    std::vector<int> ranks(static_cast<size_t>(all[i].ranks()));
    std::iota(ranks.begin(), ranks.end(), 0);
    groups[i] = world->new_subgroup(ranks);
  }
  auto takes_part = [&](size_t i) { return world->rank() < all[i].ranks(); };

  // Step times first, with the allocator not counting: rounds of one step of every split.
  const int64_t rounds = 1 + s.warmup + s.steps;
  at::Tensor ms = torch::zeros({n, rounds}, torch::kDouble);  // this rank's; 0 outside a split
  at::Tensor bubble = torch::zeros({n, rounds}, torch::kDouble);
  int64_t parameters = 0;
  {
    std::vector<std::unique_ptr<SplitRank>> parts(all.size());
    for (size_t i = 0; i < all.size(); ++i) {
      if (takes_part(i)) parts[i] = std::make_unique<SplitRank>(s, all[i], groups[i].get());
    }
    if (world->rank() == 0) parameters = parts[0]->parameter_count();
    auto ms_of = ms.accessor<double, 2>();
    auto bubble_of = bubble.accessor<double, 2>();
    // Each round starts one split later, so that no split always follows the 8-process one.
    for (int64_t round = 0; round < rounds; ++round) {
      for (int64_t k = 0; k < n; ++k) {
        const int64_t c = (round + k) % n;
        world->barrier()->wait();
        if (parts[static_cast<size_t>(c)] == nullptr) continue;
        SplitRank& part = *parts[static_cast<size_t>(c)];
        ms_of[c][round] = part.step(s, static_cast<int>(round));
        if (const auto* stats = part.pipeline_stats()) bubble_of[c][round] = stats->bubble();
      }
    }
    world->barrier()->wait();
  }

  // Then bytes, each split alone: built, two steps, destroyed.
  loom::metrics::count_cpu_allocations();
  at::Tensor bytes = torch::zeros({n, 2}, torch::kLong);  // {parameters + gradients, activations}
  auto bytes_of_split = bytes.accessor<int64_t, 2>();
  for (size_t i = 0; i < all.size(); ++i) {
    world->barrier()->wait();
    if (!takes_part(i)) continue;
    const auto [params_grads, activations] = measure_bytes(s, all[i], groups[i].get());
    bytes_of_split[static_cast<int64_t>(i)][0] = params_grads;
    bytes_of_split[static_cast<int64_t>(i)][1] = activations;
  }
  const at::Tensor all_ms = gather(*world, ms), all_bubble = gather(*world, bubble),
                   all_bytes = gather(*world, bytes);
  if (world->rank() != 0) return;

  if (!s.json) {
    std::printf(
        "bench_train --mode=model-parallel: %.2fM-parameter GPT (examples/gpt; %lld layers, dim "
        "%lld, %lld heads, vocab %lld), a global batch of %lld x %lld tokens, %d micro-batches "
        "(m / dp per replica); ranks as processes (Gloo over a FileStore), %d thread(s) each, on "
        "%u cores: up to %d processes share them, so times show overhead, not speedup; SGD; "
        "step: the slowest rank's, median of %d interleaved rounds after %d warm-up (cold = the "
        "first); bytes: the most on any rank, peaks over two steps from the allocations (every "
        "rank builds the whole model, then keeps its stages' parameters); bubble: mean over "
        "ranks, median of the rounds\n",
        parameters / 1e6, (long long)s.layers, (long long)s.dim, (long long)s.heads,
        (long long)s.vocab, (long long)s.batch, (long long)s.seq, s.micro_batches, s.threads,
        std::thread::hardware_concurrency(), s.ranks, s.steps, s.warmup);
    emit_columns();
  }
  print_rows(s, all, results(s, all, all_ms, all_bubble, all_bytes));
}

int run_model_parallel_parent(Settings s, const std::string& self) {
  // A replica of pp2_dp2_tp2 runs half the batch in half the micro-batches.
  LOOM_CHECK(s.micro_batches % 2 == 0 && s.batch % s.micro_batches == 0, loom::InvalidArgument,
             "bench_train --mode=model-parallel: --micro-batches (", s.micro_batches,
             ") must be even and divide --batch (", s.batch, ")");
  s.ranks = 0;
  for (const Split& split : splits()) s.ranks = std::max(s.ranks, split.ranks());
  return run_parent(s, self);
}

}  // namespace bench_train

// bench_train --mode=pipeline: parallel::Pipeline's bubble under GPipe, 1F1B and interleaved
// 1F1B beside the theoretical one.
#include <algorithm>
#include <cstdio>
#include <thread>

#include "bench_train.h"
#include "loom/comm/gloo.h"
#include "loom/comm/store.h"
#include "loom/error.h"
#include "loom/parallel/pipeline.h"

namespace bench_train {
namespace {

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

}  // namespace

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
    emit_columns();
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

}  // namespace bench_train

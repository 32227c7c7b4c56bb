// Pipeline parallelism: each schedule's action lists (every micro-batch's forward before its
// backward, the activations each keeps alive, and, simulated with fixed stage times, the bubble
// of the formula), training through a pipeline of ranks as threads against one process on the
// whole batch (GPipe, 1F1B, interleaved 1F1B; p = 2, 4), a dead peer stage named within the
// deadline, and bad shapes.

#include "loom/parallel/pipeline.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <map>
#include <set>
#include <thread>

#include <signal.h>
#include <unistd.h>

#include "harness/harness.h"
#include "loom/comm/gloo.h"
#include "loom/error.h"
#include "unit/parallel/equivalence.h"

namespace loom::parallel {
namespace {

using loom::testing::expect_all_ok;
using loom::testing::Rank;
using loom::testing::run_threads;
using loom::testing::parallel::expect_close_per_element;

// Runs every rank's list with forward time f and backward time b per chunk, each action as
// soon as its input is there, and returns each rank's busy time and the makespan. A schedule
// that deadlocks leaves actions unrun: ASSERTed.
struct Simulated {
  double makespan = 0;
  std::vector<double> busy;
};
Simulated simulate(Schedule schedule, int p, int m, int v, double f, double b) {
  std::vector<std::vector<PipelineAction>> lists;
  for (int s = 0; s < p; ++s) lists.push_back(pipeline_schedule(schedule, s, p, m, v));
  const int last = p * v - 1;
  std::map<std::tuple<int, int, int>, double> done;  // (kind, micro-batch, virtual stage) -> end
  std::vector<size_t> next(static_cast<size_t>(p), 0);
  std::vector<double> clock(static_cast<size_t>(p), 0.0);
  Simulated out;
  out.busy.assign(static_cast<size_t>(p), 0.0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < p; ++s) {
      auto& i = next[static_cast<size_t>(s)];
      if (i == lists[static_cast<size_t>(s)].size()) continue;
      const PipelineAction& a = lists[static_cast<size_t>(s)][i];
      const int stage = a.chunk * p + s;
      const bool forward = a.kind == PipelineAction::kForward;
      std::tuple<int, int, int> dependency =
          forward ? std::make_tuple(0, a.micro_batch, stage - 1)
                  : (stage == last ? std::make_tuple(0, a.micro_batch, stage)
                                   : std::make_tuple(1, a.micro_batch, stage + 1));
      const bool first_forward = forward && stage == 0;
      if (!first_forward && done.count(dependency) == 0) continue;
      const double ready = first_forward ? 0.0 : done[dependency];
      const double cost = forward ? f : b;
      double& now = clock[static_cast<size_t>(s)];
      now = std::max(now, ready) + cost;
      out.busy[static_cast<size_t>(s)] += cost;
      done[{forward ? 0 : 1, a.micro_batch, stage}] = now;
      ++i;
      progress = true;
    }
  }
  for (int s = 0; s < p; ++s) {
    EXPECT_EQ(next[static_cast<size_t>(s)], lists[static_cast<size_t>(s)].size())
        << to_string(schedule) << " deadlocks at rank " << s;
    out.makespan = std::max(out.makespan, clock[static_cast<size_t>(s)]);
  }
  return out;
}

TEST(PipelineSchedule, EachForwardPrecedesItsBackwardAndTheBubbleIsTheFormulas) {
  for (const Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B, Schedule::kInterleaved1F1B}) {
    for (const int p : {1, 2, 4}) {
      for (const int m : {4, 8, 12}) {
        for (const int v : schedule == Schedule::kInterleaved1F1B ? std::vector<int>{2, 3}
                                                                  : std::vector<int>{1}) {
          const std::string what = std::string(to_string(schedule)) + " p=" + std::to_string(p) +
                                   " m=" + std::to_string(m) + " v=" + std::to_string(v);
          for (int s = 0; s < p; ++s) {
            std::set<std::pair<int, int>> forwarded, backwarded;
            size_t alive = 0, most_alive = 0;
            for (const PipelineAction& a : pipeline_schedule(schedule, s, p, m, v)) {
              const std::pair<int, int> key{a.micro_batch, a.chunk};
              if (a.kind == PipelineAction::kForward) {
                EXPECT_TRUE(forwarded.insert(key).second) << what;
                most_alive = std::max(most_alive, ++alive);
              } else {
                EXPECT_TRUE(forwarded.count(key)) << what << ": backward before forward";
                EXPECT_TRUE(backwarded.insert(key).second) << what;
                --alive;
              }
            }
            EXPECT_EQ(forwarded.size(), static_cast<size_t>(m * v)) << what;
            EXPECT_EQ(backwarded.size(), static_cast<size_t>(m * v)) << what;
            // What 1F1B is for: at most p - s activations alive, against GPipe's m.
            if (schedule == Schedule::k1F1B) {
              EXPECT_LE(most_alive, static_cast<size_t>(p - s));
            }
            if (schedule == Schedule::kGPipe) {
              EXPECT_EQ(most_alive, static_cast<size_t>(m));
            }
          }
          // Forward 1, backward 2 per stage's share (1/v of a stage per chunk).
          const Simulated sim = simulate(schedule, p, m, v, 1.0 / v, 2.0 / v);
          for (int s = 0; s < p; ++s) {
            const double bubble = 1.0 - sim.busy[static_cast<size_t>(s)] / sim.makespan;
            EXPECT_NEAR(bubble, theoretical_bubble(schedule, p, m, v), 1e-12)
                << what << " rank " << s;
          }
        }
      }
    }
  }
}

TEST(PipelineSchedule, BadShapesAreNamed) {
  EXPECT_THAT([] { pipeline_schedule(Schedule::kInterleaved1F1B, 0, 4, 6, 2); },
              ::testing::ThrowsMessage<InvalidArgument>(
                  "the interleaved-1f1b schedule needs the micro-batches (6) to be a multiple of "
                  "the pipeline stages (4)"));
  EXPECT_THAT([] { pipeline_schedule(Schedule::k1F1B, 0, 4, 8, 2); },
              ::testing::ThrowsMessage<InvalidArgument>(
                  "the 1f1b schedule runs one chunk per rank, got 2; use interleaved-1f1b for "
                  "more"));
  EXPECT_THAT([] { pipeline_schedule(Schedule::kGPipe, 4, 4, 8); },
              ::testing::ThrowsMessage<InvalidArgument>(
                  "pipeline schedule: rank 4 of 4 stages, 8 micro-batches, 1 chunks per rank; "
                  "need 0 <= rank < stages and at least one of each"));
}

// Eight tanh layers of width 16; virtual stage k of n holds layers [8k / n, 8(k + 1) / n).
constexpr int kLayers = 8;
std::vector<torch::nn::Linear> make_layers() {
  std::vector<torch::nn::Linear> layers;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(77);
  torch::NoGradGuard no_grad;
  for (int i = 0; i < kLayers; ++i) {
    torch::nn::Linear layer(16, 16);
    layer->weight.copy_(at::randn({16, 16}, gen) * 0.4);
    layer->bias.copy_(at::randn({16}, gen) * 0.1);
    layers.push_back(layer);
  }
  return layers;
}
at::Tensor run_layers(std::vector<torch::nn::Linear>& layers, at::Tensor x, int begin, int end) {
  for (int i = begin; i < end; ++i) x = torch::tanh(layers[static_cast<size_t>(i)](x));
  return x;
}
at::Tensor mse(const at::Tensor& out, const at::Tensor& target) {
  return (out - target).square().mean();
}

struct PipelineCase {
  Schedule schedule;
  int stages;
  int chunks;
};

class PipelineTraining : public ::testing::TestWithParam<PipelineCase> {
 protected:
  void SetUp() override { torch::set_num_threads(1); }  // process-wide: ranks are threads
};

TEST_P(PipelineTraining, GradientsAndLossEqualOneProcessOnTheWholeBatch) {
  const PipelineCase c = GetParam();
  const int m = 8;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(78);
  const at::Tensor x = at::randn({32, 16}, gen), y = at::randn({32, 16}, gen);
  auto plain = make_layers();
  const at::Tensor expected_loss = mse(run_layers(plain, x, 0, kLayers), y);
  expected_loss.backward();
  expect_all_ok(run_threads(c.stages, [&](Rank& r) {
    comm::GlooOptions options;
    options.connect_timeout = std::chrono::seconds(20);
    auto group = comm::new_gloo_group(r.store, r.rank, r.world, options);
    auto layers = make_layers();
    const int n = c.stages * c.chunks;
    std::vector<StageFn> chunks;
    std::vector<int> mine;  // the layers of this rank's chunks
    for (int j = 0; j < c.chunks; ++j) {
      const int stage = j * c.stages + r.rank;
      const int begin = kLayers * stage / n, end = kLayers * (stage + 1) / n;
      for (int i = begin; i < end; ++i) mine.push_back(i);
      chunks.push_back([&layers, begin, end](const at::Tensor& in) {
        return run_layers(layers, in, begin, end);
      });
    }
    Pipeline pipe(*group, std::move(chunks), {.schedule = c.schedule, .micro_batches = m});
    for (int round = 0; round < 2; ++round) {  // twice: nothing is left over from a step
      for (auto& layer : layers) layer->zero_grad();
      const double loss = pipe.step(x, y, mse);
      // The mean of 8 micro-batch means in another order than one mean of the batch.
      expect_close_per_element(torch::tensor({loss}, torch::kDouble),
                               expected_loss.detach().to(torch::kDouble).reshape({1}), "loss");
      for (const int i : mine) {
        const std::string what = std::string(to_string(c.schedule)) + " layer " +
                                 std::to_string(i) + " at rank " + std::to_string(r.rank);
        expect_close_per_element(layers[static_cast<size_t>(i)]->weight.grad(),
                                 plain[static_cast<size_t>(i)]->weight.grad(), what + " weight");
        expect_close_per_element(layers[static_cast<size_t>(i)]->bias.grad(),
                                 plain[static_cast<size_t>(i)]->bias.grad(), what + " bias");
      }
    }
    EXPECT_GT(pipe.stats().step_seconds, 0);
    EXPECT_GT(pipe.stats().compute_seconds, 0);
  }));
}

INSTANTIATE_TEST_SUITE_P(Threads, PipelineTraining,
                         ::testing::Values(PipelineCase{Schedule::kGPipe, 2, 1},
                                           PipelineCase{Schedule::kGPipe, 4, 1},
                                           PipelineCase{Schedule::k1F1B, 1, 1},
                                           PipelineCase{Schedule::k1F1B, 2, 1},
                                           PipelineCase{Schedule::k1F1B, 4, 1},
                                           PipelineCase{Schedule::kInterleaved1F1B, 2, 2},
                                           PipelineCase{Schedule::kInterleaved1F1B, 4, 2}),
                         [](const ::testing::TestParamInfo<PipelineCase>& info) {
                           std::string name = to_string(info.param.schedule);
                           for (char& ch : name) {
                             if (ch == '-') ch = '_';
                           }
                           return name + "_p" + std::to_string(info.param.stages) + "_v" +
                                  std::to_string(info.param.chunks);
                         });

// The first stage's first send times out (nobody receives it) and breaks the group, so its
// wait for the gradient ends with that error: a Timeout, or a CommError saying the group broke
// on the send's timeout, depending on which the waits see first.
TEST(PipelineFailures, APeerStageThatNeverRunsIsAnErrorNamingItWithinTheDeadline) {
  expect_all_ok(run_threads(2, [](Rank& r) {
    comm::GlooOptions options;
    options.connect_timeout = std::chrono::seconds(20);
    auto group = comm::new_gloo_group(r.store, r.rank, r.world, options);
    if (r.rank == 1) {  // the second stage never takes part, its group alive but idle
      r.store.wait({"stage0_done"}, std::chrono::seconds(30));
      return;
    }
    Pipeline pipe(*group, {[](const at::Tensor& in) { return in * 2; }},
                  {.micro_batches = 2, .timeout = std::chrono::milliseconds(300)});
    const auto start = std::chrono::steady_clock::now();
    try {
      pipe.step(torch::ones({4, 3}), torch::ones({4, 3}), mse);
      ADD_FAILURE() << "the step ended without its peer stage";
    } catch (const Error& e) {
      EXPECT_TRUE(dynamic_cast<const Timeout*>(&e) != nullptr ||
                  dynamic_cast<const CommError*>(&e) != nullptr)
          << e.what();
      EXPECT_THAT(e.what(), ::testing::StartsWith("Pipeline (1f1b): stage 0 waiting for the "
                                                  "gradient of micro-batch 0 from stage 1 "
                                                  "(pipeline rank 1): "));
      EXPECT_THAT(e.what(), ::testing::AnyOf(::testing::HasSubstr("timeout"),
                                             ::testing::HasSubstr("Timed out"),
                                             ::testing::HasSubstr("did not complete within")));
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
    r.store.set("stage0_done", "1");
  }));
}

// Real processes: the last stage dies (SIGKILL) while the first is in its step. The first
// stage's wait for that micro-batch's gradient ends with an error naming the dead stage long
// before the 60 s deadline: the connection's end is seen at once.
TEST(PipelineFailures, AStageProcessThatDiesIsAnErrorNamingItNotAHang) {
  using loom::testing::run_processes;
  const auto outcomes = run_processes(2, [](Rank& r) {
    comm::GlooOptions options;
    options.connect_timeout = std::chrono::seconds(20);
    auto group = comm::new_gloo_group(r.store, r.rank, r.world, options);
    if (r.rank == 1) {  // dies once the first stage is in its step
      r.store.wait({"stepping"}, std::chrono::seconds(20));
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      ::kill(::getpid(), SIGKILL);
    }
    Pipeline pipe(*group, {[](const at::Tensor& in) { return in * 2; }},
                  {.micro_batches = 4, .timeout = std::chrono::seconds(60)});
    const at::Tensor batch = torch::ones({4, 3}, torch::requires_grad());
    const auto start = std::chrono::steady_clock::now();
    r.store.set("stepping", "1");
    try {
      pipe.step(batch, batch, mse);
      ADD_FAILURE() << "the step ended without its peer stage";
    } catch (const CommError& e) {
      EXPECT_THAT(e.what(), ::testing::StartsWith("Pipeline (1f1b): stage 0 waiting for the "
                                                  "gradient of micro-batch 0 from stage 1 "
                                                  "(pipeline rank 1): "));
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15));
  });
  ASSERT_EQ(outcomes.size(), 2u);
  EXPECT_TRUE(outcomes[0].ok) << outcomes[0].error;
  EXPECT_FALSE(outcomes[1].ok);  // killed
}

TEST(PipelineFailures, MicroBatchesOfOneStepWithTwoShapesAreNamed) {
  expect_all_ok(run_threads(2, [](Rank& r) {
    comm::GlooOptions options;
    options.connect_timeout = std::chrono::seconds(20);
    auto group = comm::new_gloo_group(r.store, r.rank, r.world, options);
    int calls = 0;  // the first stage narrows its second micro-batch's output
    const StageFn stage = [&](const at::Tensor& in) {
      return r.rank == 0 && calls++ == 1 ? (in * 2).narrow(1, 0, 2) : in * 2;
    };
    Pipeline pipe(*group, {stage},
                  {.schedule = Schedule::kGPipe,
                   .micro_batches = 2,
                   .timeout = std::chrono::milliseconds(500)});
    const at::Tensor batch = torch::ones({4, 3}, torch::requires_grad());
    if (r.rank == 0) {
      EXPECT_THAT([&] { pipe.step(batch, batch, mse); },
                  ::testing::ThrowsMessage<InvalidArgument>(
                      "Pipeline: stage 0 sends [2, 2] float32 for micro-batch 1 but [2, 3] float32 "
                      "for the first of the step; every micro-batch of a step must have one "
                      "shape"));
    } else {  // the second stage waits for a micro-batch that never comes
      EXPECT_THROW(pipe.step(batch, batch, mse), Error);
    }
  }));
}

}  // namespace
}  // namespace loom::parallel

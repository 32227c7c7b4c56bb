// The Trainer's loop end to end against the same training written as a plain libtorch loop:
// two ranks (threads) each split their batch into micro-batches, the learning rate follows a
// warmup-cosine schedule into its floor, gradients are clipped, and an evaluation runs every
// few steps. The reference reads the same batches with one data::Reader per rank, averages
// the ranks' accumulated gradients, clips with torch::nn::utils::clip_grad_norm_, sets the
// schedule's rate (written out here from its formula) on torch::optim::AdamW and steps.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "harness/harness.h"
#include "loom/data/dataset.h"
#include "loom/data/reader.h"
#include "loom/parallel/data_parallel.h"
#include "loom/runtime.h"
#include "loom/train/trainer.h"
#include "unit/parallel/equivalence.h"

namespace loom::train {
namespace {

constexpr int kWorld = 2;
constexpr int64_t kVocab = 32;
constexpr int64_t kBatch = 4;  // samples per rank per step
constexpr int64_t kSeq = 8;
constexpr int64_t kMicro = 2;
constexpr int64_t kSteps = 7;
constexpr int64_t kEvalEvery = 3;
constexpr double kClip = 0.05;  // below every step's norm here: clipping scales each step

// lr 1e-2 after a warmup of 2 steps, cosine down to 1e-3 at step 6, then 1e-3: the 7 steps
// see warmup, decay and the floor.
constexpr double kPeak = 1e-2, kFloor = 1e-3;
constexpr int64_t kWarmup = 2, kTotal = 6;
double expected_lr(int64_t step) {
  if (step < kWarmup) return kPeak * static_cast<double>(step + 1) / kWarmup;
  if (step >= kTotal) return kFloor;
  const double progress = static_cast<double>(step - kWarmup) / (kTotal - kWarmup);
  return kFloor + (kPeak - kFloor) * (1 + std::cos(M_PI * progress)) / 2;
}

struct TinyLm : torch::nn::Module {
  TinyLm() {
    embed = register_module("embed", torch::nn::Embedding(kVocab, 8));
    fc = register_module("fc", torch::nn::Linear(8, 16));
    out = register_module("out", torch::nn::Linear(16, kVocab));
  }
  at::Tensor forward(const at::Tensor& tokens) { return out(torch::tanh(fc(embed(tokens)))); }
  torch::nn::Embedding embed{nullptr};
  torch::nn::Linear fc{nullptr}, out{nullptr};
};

// Next-token cross entropy of a [B, T + 1] token batch.
at::Tensor loss_of(TinyLm& model, const at::Tensor& tokens) {
  const at::Tensor logits = model.forward(tokens.slice(1, 0, -1));
  return torch::cross_entropy_loss(logits.reshape({-1, kVocab}), tokens.slice(1, 1).reshape({-1}));
}

// The same initial weights everywhere: seeded construction.
std::shared_ptr<TinyLm> make_model() {
  torch::manual_seed(11);
  return std::make_shared<TinyLm>();
}

// A fixed held-out batch that no training batch has to be.
at::Tensor held_out() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(77);
  return at::randint(kVocab, {6, kSeq + 1}, gen, at::kLong);
}

double eval_loss(TinyLm& model) {
  torch::NoGradGuard no_grad;
  return loss_of(model, held_out()).item<double>();
}

struct Trace {
  std::vector<StepInfo> steps;               // every step's StepInfo
  std::map<int64_t, double> evaluations;     // step -> held-out loss
  std::map<std::string, at::Tensor> params;  // after the last step
};

class TrainerLoop : public ::testing::Test {
 protected:
  void SetUp() override {
    data::TokenDatasetWriter writer(dir_ / "data", {.vocab_size = kVocab});
    std::mt19937 rng(5);
    for (int d = 0; d < 40; ++d) {
      std::vector<uint32_t> doc;
      for (int i = 0; i < 40; ++i) doc.push_back(static_cast<uint32_t>(rng() % kVocab));
      writer.add_document(doc);
    }
    writer.finish();
  }

  // The plain loop: every rank's batch from its own Reader, each split in kMicro row blocks.
  Trace reference() const {
    std::shared_ptr<TinyLm> model = make_model();
    std::vector<at::Tensor> params = model->parameters();
    torch::optim::AdamW opt(params, torch::optim::AdamWOptions(kPeak));
    std::vector<std::unique_ptr<data::Reader>> readers;
    for (int r = 0; r < kWorld; ++r) {
      readers.push_back(
          std::make_unique<data::Reader>(dir_ / "data", data::ReaderOptions{.batch_size = kBatch,
                                                                            .seq_len = kSeq,
                                                                            .seed = 9,
                                                                            .rank = r,
                                                                            .world_size = kWorld,
                                                                            .prefetch = 0}));
    }
    Trace trace;
    for (int64_t step = 0; step < kSteps; ++step) {
      std::vector<at::Tensor> sums(params.size());
      double loss_sum = 0;
      for (int r = 0; r < kWorld; ++r) {
        const at::Tensor tokens = readers[r]->next()["tokens"];
        for (at::Tensor& p : params) p.mutable_grad() = at::Tensor();
        double rank_loss = 0;
        for (int64_t m = 0; m < kMicro; ++m) {
          const int64_t rows = kBatch / kMicro;
          const at::Tensor loss = loss_of(*model, tokens.slice(0, m * rows, (m + 1) * rows));
          (loss / static_cast<double>(kMicro)).backward();
          rank_loss += loss.item<double>();
        }
        loss_sum += rank_loss / kMicro;
        for (size_t i = 0; i < params.size(); ++i) {
          sums[i] = sums[i].defined() ? sums[i] + params[i].grad() : params[i].grad().clone();
        }
      }
      for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = sums[i] / kWorld;
      StepInfo info;
      info.step = step;
      info.loss = loss_sum / kWorld;
      info.grad_norm = torch::nn::utils::clip_grad_norm_(params, kClip);
      info.lr = expected_lr(step);
      static_cast<torch::optim::AdamWOptions&>(opt.param_groups()[0].options()).lr(info.lr);
      opt.step();
      trace.steps.push_back(info);
      if ((step + 1) % kEvalEvery == 0) trace.evaluations[step] = eval_loss(*model);
    }
    for (const auto& item : model->named_parameters()) {
      trace.params[item.key()] = item.value().detach().clone();
    }
    return trace;
  }

  // fit() at W = 2, ranks as threads; rank r's trace in traces[r].
  std::vector<Trace> fit() const {
    std::vector<Trace> traces(kWorld);
    std::mutex init_mutex;
    testing::expect_all_ok(testing::run_threads(kWorld, [&](testing::Rank& r) {
      ConfigSchema keys = Runtime::schema();
      keys.merge(TrainOptions::schema());
      const Config config =
          Config::load(keys, {.read_env = false,
                              .overrides = {"run.dir=" + (dir_ / "run").string(), "run.device=cpu",
                                            "log.level=warn", "log.to_file=false"}});
      Runtime rt = Runtime::init(config, Topology{r.rank, r.world, r.rank, r.world},
                                 /*configure_process=*/false, {.store = &r.store});
      std::shared_ptr<TinyLm> model;
      {
        // The ranks share libtorch's default generator: seed and draw under one lock.
        std::lock_guard<std::mutex> lock(init_mutex);
        model = make_model();
      }
      parallel::DataParallel dp(model, rt.world_group(), rt.control_group(), {.bucket_bytes = 512});
      dp.set_optimizer(std::make_unique<optim::AdamW>(optim::AdamWOptions{.lr = kPeak}));
      auto reader =
          rt.open_dataset(dir_ / "data", {.batch_size = kBatch, .seq_len = kSeq, .seed = 9});
      TrainOptions options;
      options.steps = kSteps;
      options.micro_batches = kMicro;
      options.grad_clip = kClip;
      options.schedule = Schedule::warmup_cosine(
          {.lr = kPeak, .min_lr = kFloor, .warmup_steps = kWarmup, .total_steps = kTotal});
      options.eval_every = kEvalEvery;
      options.log_every = 1000;
      Trace& trace = traces[r.rank];
      std::vector<int64_t> micro_rows;
      Trainer trainer(
          rt, dp, *reader, options,
          [&](const data::Batch& b) {
            micro_rows.push_back(b["tokens"].size(0));
            return MicroStep{loss_of(*model, b["tokens"]), b["tokens"].numel(),
                             b["tokens"].size(0)};
          },
          {.on_eval = [&](int64_t step) { trace.evaluations[step] = eval_loss(*model); },
           .on_step_end = [&](const StepInfo& info) { trace.steps.push_back(info); }});
      const FitResult result = trainer.fit();
      EXPECT_EQ(result.start_step, 0);
      EXPECT_EQ(result.steps_done, kSteps);
      EXPECT_EQ(micro_rows, std::vector<int64_t>(kSteps * kMicro, kBatch / kMicro));
      for (const auto& item : model->named_parameters()) {
        trace.params[item.key()] = item.value().detach().clone();
      }
    }));
    return traces;
  }

  testing::TempDir dir_;
};

TEST_F(TrainerLoop, MicroBatchesScheduleClippingAndEvaluationMatchAPlainLibtorchLoop) {
  const Trace expected = reference();
  const std::vector<Trace> traces = fit();
  // What the ranks share is bitwise the same on both: the loss (one all-reduce), the norm
  // (one all-reduce), the rate, the evaluations and the weights (DataParallel).
  for (int r = 1; r < kWorld; ++r) {
    ASSERT_EQ(traces[r].steps.size(), traces[0].steps.size());
    for (size_t s = 0; s < traces[0].steps.size(); ++s) {
      EXPECT_EQ(traces[r].steps[s].loss, traces[0].steps[s].loss) << "step " << s;
      EXPECT_EQ(traces[r].steps[s].grad_norm, traces[0].steps[s].grad_norm) << "step " << s;
    }
    EXPECT_EQ(traces[r].evaluations, traces[0].evaluations);
    for (const auto& [name, p] : traces[0].params) {
      EXPECT_TRUE(torch::equal(traces[r].params.at(name), p)) << name << " on rank " << r;
    }
  }

  const Trace& actual = traces[0];
  ASSERT_EQ(actual.steps.size(), static_cast<size_t>(kSteps));
  for (int64_t s = 0; s < kSteps; ++s) {
    const StepInfo& got = actual.steps[s];
    const StepInfo& want = expected.steps[s];
    EXPECT_EQ(got.step, s);
    EXPECT_FALSE(got.skipped) << "step " << s;
    // The schedule's rate against its formula: the same operations, in another order in the
    // cosine's argument at most, so a few ulps.
    EXPECT_DOUBLE_EQ(got.lr, want.lr) << "step " << s;
    EXPECT_GT(got.grad_norm, kClip) << "step " << s << ": clipping must act";
    // Step 0 precedes any update: the same losses summed in the same order, bitwise. Later
    // steps start from weights that differ in the last bits (below), and so do their losses.
    if (s == 0) {
      EXPECT_EQ(got.loss, want.loss);
    } else {
      EXPECT_NEAR(got.loss, want.loss, 1e-6 * std::abs(want.loss)) << "step " << s;
    }
    // torch's norm is the float norm of per-parameter float norms; DataParallel's the square
    // root of a double sum of per-bucket float norms: the last float bit (~1e-7 relative).
    EXPECT_NEAR(got.grad_norm, want.grad_norm, 1e-6 * want.grad_norm) << "step " << s;
  }

  // Evaluations after steps 2 and 5 (every third step, 0-based), of the weights at that step.
  ASSERT_EQ(actual.evaluations.size(), expected.evaluations.size());
  for (const auto& [step, loss] : expected.evaluations) {
    ASSERT_EQ(actual.evaluations.count(step), 1u) << "no evaluation after step " << step;
    EXPECT_NEAR(actual.evaluations.at(step), loss, 1e-6 * loss) << "step " << step;
  }
  EXPECT_EQ(expected.evaluations.size(), 2u);

  // The weights, per element. The differences are the norm's last float bit, scaling every
  // gradient through the clip coefficient each step, and loom::optim::AdamW against
  // torch::optim::AdamW (the same formula, see optim_test); 1e-5 of (|w| + rms) covers seven
  // steps of it. Training moved every parameter, so the comparison is not vacuous.
  const std::shared_ptr<TinyLm> initial = make_model();
  for (const auto& item : initial->named_parameters()) {
    const at::Tensor& got = actual.params.at(item.key());
    testing::parallel::expect_close_per_element(got, expected.params.at(item.key()), item.key(),
                                                1e-5);
    EXPECT_GT((got - item.value()).abs().max().item<double>(), 1e-3) << item.key();
  }
}

}  // namespace
}  // namespace loom::train

// The Trainer's dynamic loss scaling (TrainOptions::loss_scaling): a forced overflow skips the
// step (parameters unchanged) and halves the scale, a run of good steps doubles it, scaled
// training equals unscaled training bitwise while nothing overflows, and a resumed run
// continues the scale and its count from the checkpoint.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <random>
#include <vector>

#include "harness/harness.h"
#include "loom/data/dataset.h"
#include "loom/data/reader.h"
#include "loom/parallel/data_parallel.h"
#include "loom/runtime.h"
#include "loom/train/trainer.h"

namespace loom::train {
namespace {

constexpr int64_t kVocab = 16;

struct Lm : torch::nn::Module {
  Lm() {
    embed = register_module("embed", torch::nn::Embedding(kVocab, 8));
    out = register_module("out", torch::nn::Linear(8, kVocab));
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::Linear out{nullptr};
};

struct TrainRun {
  std::vector<double> losses;
  std::vector<double> scales;
  std::vector<bool> skipped;
  std::vector<at::Tensor> weights;  // out.weight after each step
  FitResult result;
};

class LossScalingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    data::TokenDatasetWriter writer(dir_ / "data", {.vocab_size = kVocab});
    std::mt19937 rng(5);
    for (int d = 0; d < 30; ++d) {
      std::vector<uint32_t> doc;
      for (int i = 0; i < 30; ++i) doc.push_back(static_cast<uint32_t>(rng() % kVocab));
      writer.add_document(doc);
    }
    writer.finish();
  }

  // Trains `steps` steps in run directory `name`; the loss of step `overflow_at` is multiplied
  // by 1e36, whose gradients overflow fp32 once scaled by the loss scale.
  TrainRun train(const std::string& name, int64_t steps, LossScaling scaling,
                 int64_t overflow_at = -1) {
    const Config config = Config::load(
        Runtime::schema(), {.read_env = false,
                            .overrides = {"run.dir=" + (dir_ / name).string(), "run.device=cpu",
                                          "log.level=error", "log.to_file=false"}});
    Runtime rt = Runtime::init(config, Topology{}, /*configure_process=*/false);
    at::manual_seed(11);
    auto model = std::make_shared<Lm>();
    parallel::DataParallel dp(model, rt.world_group(), rt.control_group());
    dp.set_optimizer(std::make_unique<optim::Sgd>(optim::SgdOptions{.lr = 0.5}));
    auto reader = rt.open_dataset(dir_ / "data", {.batch_size = 4, .seq_len = 6, .seed = 3});
    TrainOptions options;
    options.steps = steps;
    options.grad_clip = 0;
    options.log_every = 1000;
    options.loss_scaling = scaling;
    TrainRun run;
    int64_t step = 0;
    Trainer trainer(rt, dp, *reader, options,
                    [&](const data::Batch& b) {
                      const at::Tensor tokens = b["tokens"];
                      const at::Tensor logits = model->out(model->embed(tokens.slice(1, 0, -1)));
                      at::Tensor loss = torch::cross_entropy_loss(logits.reshape({-1, kVocab}),
                                                                  tokens.slice(1, 1).reshape({-1}));
                      if (step == overflow_at) loss = loss * 1e36;
                      return MicroStep{loss, tokens.numel(), tokens.size(0)};
                    },
                    {.on_step_end = [&](const StepInfo& info) {
                      run.losses.push_back(info.local_loss);
                      run.scales.push_back(info.loss_scale);
                      run.skipped.push_back(info.skipped);
                      run.weights.push_back(model->out->weight.detach().clone());
                      step = info.step + 1;
                    }});
    run.result = trainer.fit();
    return run;
  }

  testing::TempDir dir_;
};

constexpr LossScaling kScaling{
    .enabled = true, .init_scale = 1024, .growth = 2, .backoff = 0.5, .growth_interval = 3};

TEST_F(LossScalingTest, OverflowSkipsTheStepAndHalvesTheScaleGoodStepsGrowIt) {
  const TrainRun run = train("overflow", 8, kScaling, /*overflow_at=*/4);
  EXPECT_EQ(run.scales, (std::vector<double>{1024, 1024, 1024, 2048, 2048, 1024, 1024, 1024}));
  EXPECT_EQ(run.skipped,
            (std::vector<bool>{false, false, false, false, true, false, false, false}));
  EXPECT_EQ(run.result.skipped_steps, 1);
  EXPECT_TRUE(at::equal(run.weights[4], run.weights[3])) << "the skipped step changed nothing";
  EXPECT_FALSE(at::equal(run.weights[5], run.weights[4]));
}

TEST_F(LossScalingTest, WithoutOverflowScaledTrainingIsBitwiseUnscaledTraining) {
  const TrainRun plain = train("plain", 6, LossScaling{});
  const TrainRun scaled = train("scaled", 6, kScaling);
  EXPECT_EQ(plain.scales, std::vector<double>(6, 1.0));
  EXPECT_EQ(scaled.scales, (std::vector<double>{1024, 1024, 1024, 2048, 2048, 2048}));
  EXPECT_EQ(scaled.losses, plain.losses);
  for (size_t s = 0; s < plain.weights.size(); ++s) {
    EXPECT_TRUE(at::equal(scaled.weights[s], plain.weights[s])) << "step " << s;
  }
}

TEST_F(LossScalingTest, ResumeContinuesTheScaleAndItsCount) {
  // 7 steps: 1024 x3, 2048, overflow at 4 -> 1024, two good steps (count 2 of 3).
  const TrainRun first = train("resume", 7, kScaling, /*overflow_at=*/4);
  ASSERT_EQ(first.scales.back(), 1024);
  const TrainRun second = train("resume", 9, kScaling);
  EXPECT_EQ(second.result.start_step, 7);
  // Step 7 completes the count (the scale doubles after it); a restarted count would not.
  EXPECT_EQ(second.scales, (std::vector<double>{1024, 2048}));
}

TEST_F(LossScalingTest, BadOptionsAreInvalidArgument) {
  LossScaling bad = kScaling;
  bad.backoff = 1.5;
  EXPECT_THROW(train("bad", 1, bad), InvalidArgument);
}

}  // namespace
}  // namespace loom::train

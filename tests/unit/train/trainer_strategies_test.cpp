// The Trainer over every parallel::Strategy: FSDP (each block a unit) trains as DataParallel
// does, with gradient accumulation, clipping and checkpoints, at W = 2 (ranks as threads); its
// checkpoint resumes under DataParallel and its weights initialise another FSDP run
// (train.init_from), bitwise.
#include <gtest/gtest.h>
#include <torch/torch.h>

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
#include "loom/parallel/fsdp.h"
#include "loom/parallel/strategy.h"
#include "loom/runtime.h"
#include "loom/train/trainer.h"

namespace loom::train {
namespace {

constexpr int kWorld = 2;
constexpr int64_t kVocab = 32;
constexpr int64_t kDim = 8;

struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    fc = register_module("fc", torch::nn::Linear(kDim, 2 * kDim));
    proj = register_module("proj", torch::nn::Linear(2 * kDim, kDim));
  }
  at::Tensor forward(const at::Tensor& x) { return x + proj(torch::tanh(fc(x))); }
  torch::nn::Linear fc{nullptr}, proj{nullptr};
};
TORCH_MODULE(Block);

// Embedding, two blocks (a Sequential, so FSDP units run unchanged), head.
struct BlockLm : torch::nn::Module {
  BlockLm() {
    embed = register_module("embed", torch::nn::Embedding(kVocab, kDim));
    blocks = register_module("blocks", torch::nn::Sequential(Block(), Block()));
    out = register_module("out", torch::nn::Linear(kDim, kVocab));
  }
  at::Tensor forward(const at::Tensor& tokens) { return out(blocks->forward(embed(tokens))); }
  torch::nn::Embedding embed{nullptr};
  torch::nn::Sequential blocks{nullptr};
  torch::nn::Linear out{nullptr};
};

class TrainerStrategies : public ::testing::Test {
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

  struct Run {
    std::vector<double> losses;                 // rank 0's StepInfo::loss per step
    std::map<std::string, at::Tensor> weights;  // the full parameters after fit
    FitResult result;
  };

  // One fit() at W = 2 under parallel.mode `mode`, in run directory `name`.
  Run fit(const std::string& mode, const std::string& name, int64_t steps,
          const std::string& init_from = "") {
    Run run;
    std::mutex init_mutex;
    testing::expect_all_ok(testing::run_threads(kWorld, [&](testing::Rank& r) {
      ConfigSchema keys = Runtime::schema();
      keys.merge(TrainOptions::schema());
      keys.merge(parallel::strategy_schema());
      const Config config =
          Config::load(keys, {.read_env = false,
                              .overrides = {"run.dir=" + (dir_ / name).string(), "run.device=cpu",
                                            "log.level=warn", "log.to_file=false",
                                            "parallel.mode=" + mode, "parallel.bucket_mb=0.001"}});
      Runtime rt = Runtime::init(config, Topology{r.rank, r.world, r.rank, r.world},
                                 /*configure_process=*/false, {.store = &r.store});
      // The same initial model on every rank and in every run: the ranks are threads sharing
      // libtorch's default generator, so seeding and drawing happen under one lock.
      std::shared_ptr<BlockLm> model;
      {
        std::lock_guard<std::mutex> lock(init_mutex);
        torch::manual_seed(11);
        model = std::make_shared<BlockLm>();
      }
      if (mode == "fsdp") parallel::wrap_modules<BlockImpl>(model->blocks);
      const std::unique_ptr<parallel::Strategy> strategy =
          parallel::make_strategy(model, rt.world_group(), rt.control_group(), config);
      strategy->set_optimizer(std::make_unique<optim::AdamW>(optim::AdamWOptions{.lr = 1e-2}));
      auto reader = rt.open_dataset(dir_ / "data", {.batch_size = 4, .seq_len = 8, .seed = 9});
      TrainOptions options;
      options.steps = steps;
      options.micro_batches = 2;
      options.grad_clip = 0.05;  // below the norms here, so clipping scales every step
      options.checkpoint_every = 2;
      options.log_every = 1000;
      options.init_from = init_from;
      Trainer trainer(rt, *strategy, *reader, options,
                      [&](const data::Batch& b) {
                        const at::Tensor tokens = b["tokens"];
                        const at::Tensor logits = model->forward(tokens.slice(1, 0, -1));
                        return MicroStep{
                            torch::cross_entropy_loss(logits.reshape({-1, kVocab}),
                                                      tokens.slice(1, 1).reshape({-1})),
                            tokens.numel(), tokens.size(0)};
                      },
                      {.on_step_end = [&](const StepInfo& info) {
                        if (r.rank == 0) run.losses.push_back(info.loss);
                      }});
      const FitResult result = trainer.fit();
      std::map<std::string, at::Tensor> weights;
      if (auto* fsdp = dynamic_cast<parallel::FullyShardedDataParallel*>(strategy.get())) {
        weights = fsdp->gather_full_parameters();
      } else {
        for (const auto& p : model->named_parameters()) weights[p.key()] = p.value().clone();
      }
      if (r.rank == 0) {
        run.result = result;
        run.weights = weights;
      }
    }));
    return run;
  }

  testing::TempDir dir_;
};

void expect_bitwise_equal(const std::map<std::string, at::Tensor>& a,
                          const std::map<std::string, at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, tensor] : a) {
    ASSERT_EQ(b.count(name), 1u) << name;
    EXPECT_TRUE(torch::equal(tensor, b.at(name))) << name;
  }
}

TEST_F(TrainerStrategies, FsdpTrainsAsDataParallelAndItsCheckpointsLoadUnderEither) {
  const Run ddp = fit("ddp", "ddp", 4);
  const Run fsdp = fit("fsdp", "fsdp", 4);
  ASSERT_EQ(ddp.losses.size(), 4u);
  ASSERT_EQ(fsdp.losses.size(), 4u);
  // The same fp32 arithmetic per element except the order of the gradient sums (DataParallel
  // all-reduces buckets, FSDP reduce-scatters units) and of the norm's sum of squares: a few
  // ulps per step, far below 1e-5 relative after four steps of lr 1e-2.
  EXPECT_EQ(ddp.losses[0], fsdp.losses[0]) << "step 0 precedes any update";
  for (size_t s = 0; s < 4; ++s) {
    EXPECT_NEAR(fsdp.losses[s], ddp.losses[s], 1e-5 * std::abs(ddp.losses[s])) << "step " << s;
  }
  ASSERT_EQ(ddp.weights.size(), fsdp.weights.size());
  for (const auto& [name, weight] : ddp.weights) {
    ASSERT_EQ(fsdp.weights.count(name), 1u) << name;
    const at::Tensor diff = (fsdp.weights.at(name) - weight).abs();
    EXPECT_TRUE((diff <= 1e-5 * weight.abs() + 1e-7).all().item<bool>())
        << name << ": max difference " << diff.max().item<double>();
  }

  // FSDP's final checkpoint (step 4) resumes under DataParallel: fit() at steps = 4 loads it
  // and trains nothing, so the module holds exactly what FSDP saved.
  const Run resumed = fit("ddp", "fsdp", 4);
  EXPECT_EQ(resumed.result.start_step, 4);
  EXPECT_EQ(resumed.result.steps_done, 4);
  expect_bitwise_equal(resumed.weights, fsdp.weights);

  // train.init_from: a fresh FSDP run takes the weights (and nothing else) from that step.
  const Run initialised = fit("fsdp", "init", 0, (dir_ / "fsdp" / "ckpt").string());
  EXPECT_EQ(initialised.result.start_step, 0);
  expect_bitwise_equal(initialised.weights, fsdp.weights);
}

}  // namespace
}  // namespace loom::train

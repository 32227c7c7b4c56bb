// Fashion-MNIST: a small CNN trained with data parallelism through loom::train::Trainer, on
// the images Debian's dataset-fashion-mnist ships, read through loom::data::Reader from the
// record datasets `loom data build fashion-mnist` makes. tools/run-example.sh builds the data
// and runs it on 2 ranks:
//
//   loom run --nproc-per-node 2 -- fashion_mnist --config=examples/fashion_mnist/config.toml
//
// Any number of ranks gives the same global batch (train.batch_size is split across them).
#include <loom/loom.h>
#include <torch/torch.h>

#include <chrono>
#include <fstream>

namespace {

// Two 5x5 convolutions with pooling, a hidden layer with dropout, a linear classifier: the
// published 2-conv baseline's shape (0.916 test accuracy).
struct NetImpl : torch::nn::Module {
  NetImpl(int64_t width, int64_t hidden, double dropout)
      : conv1(register_module("conv1",
                              torch::nn::Conv2d(torch::nn::Conv2dOptions(1, width, 5).padding(2)))),
        conv2(register_module(
            "conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(width, 2 * width, 5).padding(2)))),
        fc1(register_module("fc1", torch::nn::Linear(2 * width * 7 * 7, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, 10))),
        dropout(dropout) {}

  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv1->forward(x)), 2);
    x = torch::max_pool2d(torch::relu(conv2->forward(x)), 2);
    x = torch::dropout(torch::relu(fc1->forward(x.flatten(1))), dropout, is_training());
    return fc2->forward(x);
  }

  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc1, fc2;
  double dropout;
};
TORCH_MODULE(Net);

loom::ConfigSchema keys() {
  loom::ConfigSchema s = loom::train::TrainOptions::schema();
  s.add("data.train", "data/fashion-mnist-train",
        "training set: a directory (loom data build fashion-mnist) or a registry name");
  s.add("data.test", "data/fashion-mnist-test",
        "test set (loom data build fashion-mnist --split test)");
  s.add("model.width", 16, "channels of the first convolution; the second has twice as many");
  s.add("model.hidden", 128, "units of the hidden layer");
  s.add("model.dropout", 0.25, "dropout before the classifier");
  s.add("train.epochs", 4, "passes over the 60,000 training images (sets train.steps)");
  s.add("train.batch_size", 64, "images per optimizer step, over all ranks");
  s.add("eval.batch_size", 1000, "images per evaluation batch");
  return s;
}

// uint8 [N, 28, 28] -> float [N, 1, 28, 28], normalised with the training set's statistics.
torch::Tensor normalise(const torch::Tensor& images) {
  return ((images.to(torch::kFloat32) / 255.0f - 0.2860f) / 0.3530f).unsqueeze(1);
}

// Test accuracy over every image: each rank evaluates its share, the counts are summed.
double accuracy(loom::Runtime& rt, Net& net, const loom::data::Reader& test, int64_t batch_size) {
  torch::NoGradGuard no_grad;
  net->eval();
  const int64_t n = static_cast<int64_t>(test.num_samples());
  const int64_t begin = n * rt.rank() / rt.world_size(),
                end = n * (rt.rank() + 1) / rt.world_size();
  int64_t correct = 0;
  for (int64_t at = begin; at < end; at += batch_size) {
    std::vector<uint64_t> indices;
    for (int64_t i = at; i < std::min(at + batch_size, end); ++i)
      indices.push_back(static_cast<uint64_t>(i));
    const loom::data::Batch batch = test.read(indices);
    correct +=
        net->forward(normalise(batch["image"])).argmax(1).eq(batch["label"]).sum().item<int64_t>();
  }
  net->train();
  torch::Tensor total = torch::tensor({static_cast<double>(correct)}, torch::kDouble);
  rt.control_group().all_reduce(total)->wait();  // host counts: the control group
  return total.item<double>() / static_cast<double>(n);
}

void train(loom::Runtime& rt) {
  const loom::Config& cfg = rt.config();
  const int64_t global_batch = cfg.get<int64_t>("train.batch_size");
  LOOM_CHECK(global_batch > 0 && global_batch % rt.world_size() == 0, loom::ConfigError,
             "train.batch_size (", global_batch,
             ") must be a positive multiple of the world size (", rt.world_size(), ")");
  auto train_set =
      rt.open_dataset(cfg.get<std::string>("data.train"),
                      {.batch_size = global_batch / rt.world_size(), .seed = rt.seed()});
  const loom::data::Reader test_set(cfg.get<std::string>("data.test"), {});
  rt.log().info(
      "Fashion-MNIST: {} training images (dataset {}), {} test images, {} per step on {} rank(s)",
      train_set->num_samples(), train_set->manifest().version, test_set.num_samples(), global_batch,
      rt.world_size());

  Net net(cfg.get<int>("model.width"), cfg.get<int>("model.hidden"),
          cfg.get<double>("model.dropout"));
  loom::parallel::DataParallel dp(net.ptr(), rt.world_group(), rt.control_group());
  dp.set_optimizer(std::make_unique<loom::optim::AdamW>(
      loom::optim::AdamWOptions{.lr = cfg.get<double>("train.lr"), .weight_decay = 1e-4}));
  at::manual_seed(rt.rank_seed());  // dropout and flips differ per rank, reproducibly

  loom::train::TrainOptions options = loom::train::TrainOptions::from(cfg);
  options.steps =
      cfg.get<int64_t>("train.epochs") * static_cast<int64_t>(train_set->steps_per_epoch());
  options.schedule =
      loom::train::Schedule::warmup_cosine({.lr = cfg.get<double>("train.lr"),
                                            .min_lr = cfg.get<double>("train.min_lr"),
                                            .warmup_steps = cfg.get<int64_t>("train.warmup_steps"),
                                            .total_steps = options.steps});
  if (options.eval_every == 0)
    options.eval_every = static_cast<int64_t>(train_set->steps_per_epoch());
  const int64_t eval_batch = cfg.get<int64_t>("eval.batch_size");

  loom::train::Trainer trainer(
      rt, dp, *train_set, options,
      [&](const loom::data::Batch& b) {
        torch::Tensor images = normalise(b["image"]);
        // Random horizontal flips: clothes look the same mirrored.
        const torch::Tensor flip = torch::rand({images.size(0)}) < 0.5;
        images = torch::where(flip.view({-1, 1, 1, 1}), images.flip({3}), images);
        torch::Tensor loss = torch::cross_entropy_loss(net->forward(images), b["label"]);
        return loom::train::MicroStep{loss, 0, images.size(0)};
      },
      {.on_eval = [&](int64_t step) {
        const double acc = accuracy(rt, net, test_set, eval_batch);  // collective: every rank
        if (rt.is_main()) rt.log().info("step {}: test accuracy {:.4f}", step + 1, acc);
      }});
  const auto start = std::chrono::steady_clock::now();
  const loom::train::FitResult result = trainer.fit();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double test_accuracy = accuracy(rt, net, test_set, eval_batch);
  if (rt.is_main())
    rt.log().info(
        "result: test accuracy {:.4f} after {} steps ({} to {}) in {:.1f} s on {} rank(s) "
        "(published 2-conv baseline 0.916)",
        test_accuracy, result.steps_done, result.start_step, result.steps_done, seconds,
        rt.world_size());
  if (rt.is_main()) {
    std::ofstream(rt.run_dir() / "result.json")
        << "{\"test_accuracy\": " << test_accuracy << ", \"steps\": " << result.steps_done
        << ", \"train_seconds\": " << seconds << ", \"world_size\": " << rt.world_size() << "}\n";
  }
}

}  // namespace

int main(int argc, char** argv) { return loom::run_main(argc, argv, keys(), train); }

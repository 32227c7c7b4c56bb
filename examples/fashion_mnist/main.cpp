// Fashion-MNIST: a small CNN trained through loom::Runtime on the images Debian's
// dataset-fashion-mnist ships, read through loom::data::Reader from record datasets that
// `loom data build fashion-mnist` makes (tools/run-example.sh builds them). Single process
// for now; the trainer issue makes it DDP.
//
//   fashion_mnist --config=examples/fashion_mnist/config.toml --train.epochs=2
#include <loom/loom.h>
#include <torch/torch.h>

#include <chrono>
#include <fstream>

namespace {

// Two 5x5 convolutions with pooling, then a linear classifier: the published 2-conv
// baseline shape (0.916 test accuracy).
struct NetImpl : torch::nn::Module {
  explicit NetImpl(int64_t width)
      : conv1(register_module("conv1",
                              torch::nn::Conv2d(torch::nn::Conv2dOptions(1, width, 5).padding(2)))),
        conv2(register_module(
            "conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(width, 2 * width, 5).padding(2)))),
        fc(register_module("fc", torch::nn::Linear(2 * width * 7 * 7, 10))) {}

  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv1->forward(x)), 2);
    x = torch::max_pool2d(torch::relu(conv2->forward(x)), 2);
    return fc->forward(x.flatten(1));
  }

  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc;
};
TORCH_MODULE(Net);

loom::ConfigSchema keys() {
  loom::ConfigSchema s;
  s.add("data.train", "data/fashion-mnist-train", "training set (loom data build fashion-mnist)");
  s.add("data.test", "data/fashion-mnist-test", "test set (loom data build fashion-mnist --split test)");
  s.add("model.width", 8, "channels of the first convolution; the second has twice as many");
  s.add("train.epochs", 1, "passes over the 60,000 training images");
  s.add("train.batch_size", 64, "images per optimizer step");
  s.add("train.lr", 1e-3, "Adam learning rate");
  s.add("train.max_steps", 0, "stop after this many steps; 0 = run every epoch");
  s.add("train.log_every", 100, "steps between progress lines");
  s.add("eval.batch_size", 1000, "images per evaluation batch");
  return s;
}

// uint8 [N, 28, 28] -> float [N, 1, 28, 28], normalised with the training set's statistics.
torch::Tensor normalise(const torch::Tensor& images) {
  return ((images.to(torch::kFloat32) / 255.0f - 0.2860f) / 0.3530f).unsqueeze(1);
}

// Accuracy over every image of the test set, read in order.
double accuracy(Net& net, const loom::data::Reader& test, int64_t batch_size) {
  torch::NoGradGuard no_grad;
  net->eval();
  int64_t correct = 0;
  const int64_t n = static_cast<int64_t>(test.num_samples());
  for (int64_t begin = 0; begin < n; begin += batch_size) {
    std::vector<uint64_t> indices;
    for (int64_t i = begin; i < std::min(begin + batch_size, n); ++i) indices.push_back(i);
    const loom::data::Batch batch = test.read(indices);
    auto predicted = net->forward(normalise(batch["image"])).argmax(1);
    correct += predicted.eq(batch["label"]).sum().item<int64_t>();
  }
  net->train();
  return static_cast<double>(correct) / static_cast<double>(n);
}

void train(loom::Runtime& rt) {
  const loom::Config& cfg = rt.config();
  const int64_t batch = cfg.get<int64_t>("train.batch_size");
  const int64_t max_steps = cfg.get<int64_t>("train.max_steps");
  const int64_t log_every = cfg.get<int64_t>("train.log_every");
  LOOM_CHECK(batch > 0, loom::ConfigError, "train.batch_size must be positive, got ", batch);
  auto train_set = rt.open_dataset(cfg.get<std::string>("data.train"),
                                   {.batch_size = batch, .seed = rt.seed()});
  const loom::data::Reader test_set(cfg.get<std::string>("data.test"), {});
  rt.log().info("Fashion-MNIST: {} training images (dataset {}), {} test images",
                train_set->num_samples(), train_set->manifest().version, test_set.num_samples());

  Net net(cfg.get<int64_t>("model.width"));
  torch::optim::Adam optimizer(net->parameters(),
                               torch::optim::AdamOptions(cfg.get<double>("train.lr")));

  auto start = std::chrono::steady_clock::now();
  auto window_start = start;
  int64_t step = 0;
  double window_loss = 0;
  bool done = false;
  for (int64_t epoch = 0; epoch < cfg.get<int64_t>("train.epochs") && !done; ++epoch) {
    for (uint64_t i = 0; i < train_set->steps_per_epoch(); ++i, ++step) {
      if (max_steps > 0 && step >= max_steps) {
        done = true;
        break;
      }
      const loom::data::Batch b = train_set->next();
      auto loss = torch::cross_entropy_loss(net->forward(normalise(b["image"])), b["label"]);
      optimizer.zero_grad();
      loss.backward();
      optimizer.step();
      window_loss += loss.item<double>();
      if ((step + 1) % log_every == 0) {
        auto now = std::chrono::steady_clock::now();
        double seconds = std::chrono::duration<double>(now - window_start).count();
        rt.log().info("epoch {} step {:5d}  loss {:.4f}  {:.0f} img/s", epoch, step + 1,
                      window_loss / log_every, log_every * batch / seconds);
        window_loss = 0;
        window_start = now;
      }
    }
  }
  double train_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  double test_accuracy = accuracy(net, test_set, cfg.get<int64_t>("eval.batch_size"));
  rt.log().info(
      "result: test accuracy {:.4f} after {} steps in {:.1f} s (published 2-conv baseline 0.916)",
      test_accuracy, step, train_seconds);
  std::ofstream(rt.run_dir() / "result.json")
      << "{\"test_accuracy\": " << test_accuracy << ", \"steps\": " << step
      << ", \"train_seconds\": " << train_seconds << "}\n";
}

}  // namespace

int main(int argc, char** argv) { return loom::run_main(argc, argv, keys(), train); }

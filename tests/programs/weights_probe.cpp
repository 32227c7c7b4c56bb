// Both ends of a weight-snapshot test as real processes. The publisher trains a small MLP with
// SGD on data drawn from a seed (one torch thread: bitwise reproducible) and publishes its
// parameters after every step (version = steps done; version 0 is the initialisation). The
// subscriber receives versions as fast as it can and checks each against its own replay of the
// same training to that step, bitwise.
//
//   loom_weights_probe publish NAME STEPS LISTEN ENDPOINT_FILE REPORTS
//       LISTEN "" for shared memory only. Publishes version 0, writes ENDPOINT_FILE (endpoint()
//       or "-"), waits for every subscriber's REPORT.ready (REPORTS: comma-separated report
//       files), trains and publishes versions 1 to STEPS, then waits for every REPORT before it
//       exits (60 s at most for each wait).
//   loom_weights_probe subscribe SOURCE STEPS REPORT
//       SOURCE a name (shared memory) or HOST:PORT; writes REPORT.ready after its first version,
//       receives until version STEPS, writes REPORT = {"checked": N, "first": V, "last": V,
//       "torn_reads": T, "mismatches": M, "versions": [...]} and exits 0 when every version
//       matched, 1 otherwise.
#include <torch/torch.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "loom/control/weights.h"

namespace {

// The trainer both ends run: the same seed, the same draws, the same arithmetic.
class Replay {
 public:
  Replay()
      : model_(make_model()), optimizer_(model_->parameters(), torch::optim::SGDOptions(0.05)) {}

  int64_t steps() const { return steps_; }

  void step() {
    torch::manual_seed(1000 + steps_);
    const torch::Tensor x = torch::randn({16, 32});
    const torch::Tensor y = torch::randn({16, 8});
    optimizer_.zero_grad();
    torch::mse_loss(model_->forward(x), y).backward();
    optimizer_.step();
    ++steps_;
  }

  std::map<std::string, at::Tensor> parameters() const {
    std::map<std::string, at::Tensor> out;
    for (const auto& item : model_->named_parameters()) out.emplace(item.key(), item.value());
    return out;
  }

 private:
  static torch::nn::Sequential make_model() {
    torch::manual_seed(7);
    return torch::nn::Sequential(torch::nn::Linear(32, 128), torch::nn::Tanh(),
                                 torch::nn::Linear(128, 128), torch::nn::Tanh(),
                                 torch::nn::Linear(128, 8));
  }

  torch::nn::Sequential model_;
  torch::optim::SGD optimizer_;
  int64_t steps_ = 0;
};

bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

// Waits up to 60 s for every file of `paths`; false when one is still missing.
bool wait_for_files(const std::vector<std::string>& paths) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (const std::string& path : paths) {
    while (!std::filesystem::exists(path)) {
      if (std::chrono::steady_clock::now() > until) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  return true;
}

std::vector<std::string> split(const std::string& list, const std::string& suffix) {
  std::vector<std::string> out;
  std::stringstream in(list);
  for (std::string item; std::getline(in, item, ',');) out.push_back(item + suffix);
  return out;
}

int publish(const std::string& name, int64_t steps, const std::string& listen,
            const std::string& endpoint_file, const std::string& reports) {
  loom::control::WeightPublisher publisher(name, {.listen = listen});
  Replay trainer;
  publisher.publish(0, trainer.parameters());  // version 0: the initialisation
  {
    std::ofstream out(endpoint_file + ".tmp");
    out << (listen.empty() ? "-" : publisher.endpoint()) << "\n";
  }
  std::filesystem::rename(endpoint_file + ".tmp", endpoint_file);
  if (!wait_for_files(split(reports, ".ready"))) {
    std::cerr << "error: the subscribers did not start within 60 s\n";
    return 1;
  }
  for (int64_t v = 1; v <= steps; ++v) {
    trainer.step();
    publisher.publish(v, trainer.parameters());
  }
  if (!wait_for_files(split(reports, ""))) {
    std::cerr << "error: the subscribers did not finish within 60 s\n";
    return 1;
  }
  std::cout << "published " << steps + 1 << " versions\n";
  return 0;
}

int subscribe(const std::string& source, int64_t steps, const std::string& report_file) {
  loom::control::WeightSubscriber subscriber(source);
  Replay replay;
  loom::control::WeightVersion received;
  std::vector<int64_t> versions;
  int64_t mismatches = 0;
  while (received.version < steps) {
    subscriber.latest_into(received, received.version, std::chrono::seconds(30));
    while (replay.steps() < received.version) replay.step();
    const auto expected = replay.parameters();
    bool same = expected.size() == received.tensors.size();
    for (const auto& [name, tensor] : expected) {
      const auto it = received.tensors.find(name);
      same = same && it != received.tensors.end() && bitwise_equal(it->second, tensor);
    }
    if (!same) {
      ++mismatches;
      std::cerr << "version " << received.version << " differs from the replay\n";
    }
    if (versions.empty()) std::ofstream(report_file + ".ready") << "\n";
    versions.push_back(received.version);
  }
  std::ofstream out(report_file + ".tmp");
  out << "{\"checked\": " << versions.size() << ", \"first\": " << versions.front()
      << ", \"last\": " << versions.back() << ", \"torn_reads\": " << subscriber.torn_reads()
      << ", \"mismatches\": " << mismatches << ", \"versions\": [";
  for (size_t i = 0; i < versions.size(); ++i) out << (i ? ", " : "") << versions[i];
  out << "]}\n";
  out.close();
  std::filesystem::rename(report_file + ".tmp", report_file);
  std::cout << "checked " << versions.size() << " versions, " << subscriber.torn_reads()
            << " torn reads retried\n";
  return mismatches == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  torch::set_num_threads(1);
  const std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.size() == 6 && args[0] == "publish") {
      return publish(args[1], std::stoll(args[2]), args[3], args[4], args[5]);
    }
    if (args.size() == 4 && args[0] == "subscribe") {
      return subscribe(args[1], std::stoll(args[2]), args[3]);
    }
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  std::cerr << "usage: loom_weights_probe publish NAME STEPS LISTEN ENDPOINT_FILE REPORTS\n"
               "       loom_weights_probe subscribe SOURCE STEPS REPORT_FILE\n";
  return 2;
}

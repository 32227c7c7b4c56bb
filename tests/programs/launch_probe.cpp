// A worker for the launcher tests: joins the world group through Runtime (the coordinator's
// store under `loom run`), all-reduces its rank and a tensor of random floats (every rank draws
// every rank's, so it can compare the group's sum with the exact one in double), records what
// it saw (sums, the largest error, the world group's transport) in
// <run_dir>/probe/gen<g>_rank<r>.json, then runs `probe.steps` steps of `probe.step_ms`,
// reporting progress through the heartbeat. The record also holds the LOOM_SERVICE_* variables
// a job spec's services gave it, and with probe.service what rt.service() found for that name
// (or its error). With probe.kill_pid it then SIGKILLs that process
// (a test's way to take the coordinator away at a known moment) before exiting.
#include <loom/loom.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <fstream>
#include <thread>

int main(int argc, char** argv) {
  loom::ConfigSchema keys;
  keys.add("probe.steps", 0, "steps after the all-reduce");
  keys.add("probe.step_ms", 100, "milliseconds per step");
  keys.add("probe.exit_code", 0, "exit with this code after the steps");
  keys.add("probe.kill_pid", 0, "SIGKILL this process after the steps (0: none)");
  keys.add("probe.service", "", "look this service up with rt.service() (empty: none)");
  return loom::run_main(argc, argv, keys, [](loom::Runtime& rt) {
    const auto now_ms = [] {
      return std::chrono::duration_cast<std::chrono::milliseconds>(
                 std::chrono::system_clock::now().time_since_epoch())
          .count();
    };
    loom::comm::Group& group = rt.world_group();
    at::Tensor t = at::full({4}, static_cast<float>(rt.rank() + 1));
    group.all_reduce(t)->wait();
    std::vector<at::Tensor> inputs;
    for (int r = 0; r < rt.world_size(); ++r) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + r);
      inputs.push_back(at::rand({4096}, gen));
    }
    at::Tensor exact = at::zeros({4096}, at::kDouble);
    for (const at::Tensor& x : inputs) exact += x.to(at::kDouble);
    at::Tensor random = inputs[rt.rank()].clone();
    group.all_reduce(random)->wait();
    const double max_error = (random.to(at::kDouble) - exact).abs().max().item<double>();
    const int64_t ready_ms = now_ms();
    const int64_t generation = rt.topology().generation;
    // The job spec services' endpoints the agent gave it: "NAME=host:port;..." (sorted).
    std::string services;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string var = *e;
      if (var.rfind("LOOM_SERVICE_", 0) == 0) services += (services.empty() ? "" : ";") + var;
    }
    // rt.service(probe.service): "host:port,host:port", or "error: ..." (quotes made single).
    std::string found;
    if (const auto name = rt.config().get<std::string>("probe.service"); !name.empty()) {
      try {
        for (const std::string& e : rt.service(name, std::chrono::seconds(5)))
          found += (found.empty() ? "" : ",") + e;
      } catch (const loom::Error& e) {
        found = std::string("error: ") + e.what();
        std::replace(found.begin(), found.end(), '"', '\'');
      }
    }
    const auto dir = rt.run_dir() / "probe";
    std::filesystem::create_directories(dir);
    {
      const auto file = dir / ("gen" + std::to_string(generation) + "_rank" +
                               std::to_string(rt.rank()) + ".json");
      std::ofstream(file.string() + ".tmp")
          << "{\"rank\": " << rt.rank() << ", \"world\": " << rt.world_size()
          << ", \"generation\": " << generation << ", \"sum\": " << t[0].item<float>()
          << ", \"max_error\": " << max_error << ", \"transport\": \""
          << loom::comm::gloo_transport(group) << "\""
          << ", \"pid\": " << ::getpid() << ", \"ready_ms\": " << ready_ms << ", \"services\": \""
          << services << "\", \"service\": \"" << found << "\"}\n";
      std::filesystem::rename(file.string() + ".tmp", file);
    }
    for (int64_t step = 0; step < rt.config().get<int64_t>("probe.steps"); ++step) {
      rt.report_progress(step, 1.0);
      std::this_thread::sleep_for(
          std::chrono::milliseconds(rt.config().get<int64_t>("probe.step_ms")));
    }
    const int code = static_cast<int>(rt.config().get<int64_t>("probe.exit_code"));
    if (const auto pid = rt.config().get<int64_t>("probe.kill_pid"); pid > 0) {
      ::kill(static_cast<pid_t>(pid), SIGKILL);
      // Fail at once, as a crash right after the kill would: std::exit's static destructors
      // can take longer than the agent's heartbeat interval, and the test wants the agent to
      // see this exit before its next heartbeat finds the coordinator gone.
      if (code != 0) std::_Exit(code);
    }
    if (code != 0) std::exit(code);
  });
}

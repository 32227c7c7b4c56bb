// A training-like process that saves checkpoints back to back, for the crash tests that
// SIGKILL it at random moments. Each step's tensors are a function of the step, so a reader
// can tell whether what it loaded is exactly the step the manifest names.
//
//   loom_ckpt_writer <ckpt_dir> <store_dir> <rank> <world> <saves>
//
// Continues after the newest committed step; prints "saving <step>" before each save() and
// "committed <step>" once its wait() returned, so that a test that kills it can tell whether
// the kill landed inside a save and which step was last reported committed.
#include <torch/torch.h>

#include <cstdio>
#include <iostream>

#include "loom/ckpt/checkpointer.h"
#include "loom/comm/store.h"

namespace {

constexpr int64_t kRows = 64;
constexpr int64_t kCols = 16 * 1024;  // 4 MiB of float32 in all, split by rows

// The global "rows" tensor of `step`; "scalar" is step itself.
torch::Tensor rows_for(int64_t step) {
  return torch::arange(kRows * kCols, torch::kFloat32).reshape({kRows, kCols}).add_(step);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::cerr << "usage: loom_ckpt_writer <ckpt_dir> <store_dir> <rank> <world> <saves>\n";
    return 2;
  }
  try {
    const int rank = std::stoi(argv[3]), world = std::stoi(argv[4]);
    const int saves = std::stoi(argv[5]);
    torch::set_num_threads(1);
    loom::comm::FileStore store(argv[2]);
    loom::ckpt::Checkpointer ckpt(store, {.dir = argv[1],
                                          .rank = rank,
                                          .world_size = world,
                                          .keep_last = 3,
                                          .keep_every = 10,
                                          .timeout = std::chrono::seconds(30),
                                          .write_bytes = 256 << 10,
                                          .hash_chunk_bytes = 64 << 10});
    int64_t step = ckpt.latest().value_or(0);
    const int64_t begin = kRows * rank / world, end = kRows * (rank + 1) / world;
    for (int i = 0; i < saves; ++i) {
      ++step;
      loom::ckpt::State state;
      state.add("rows", rows_for(step).slice(0, begin, end).contiguous(),
                loom::ckpt::Sharding::rows({kRows, kCols}, begin, end));
      state.add("scalar", torch::full({1}, step, torch::kInt64));
      state.blobs["trainer"] = "{\"step\":" + std::to_string(step) + "}";
      std::printf("saving %lld\n", static_cast<long long>(step));
      std::fflush(stdout);
      auto handle = ckpt.save(step, state, {.defer_copy = step % 2 == 0});
      ckpt.before_optimizer_step();
      handle.wait(std::chrono::seconds(60));
      std::printf("committed %lld\n", static_cast<long long>(step));
      std::fflush(stdout);
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "loom_ckpt_writer: " << e.what() << "\n";
    return 1;
  }
}

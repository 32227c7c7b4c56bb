// A small language model trained through train::Trainer, for the trainer's end-to-end tests:
// DDP or ZeRO from the config, async checkpoints, resume. Every step's rank-local loss is
// appended to <run_dir>/losses_rank<r>.txt as "<step> <loss in hexfloat>", so that tests can
// compare runs bit for bit, and the final parameters go to <run_dir>/params_rank<r>.bin as raw
// bytes; probe.kill_at_step makes rank 1 SIGKILL itself in generation 1;
// probe.hidden_bias=false changes the model, probe.optimizer_lr the optimizer's own rate;
// probe.straggler_ms makes rank 1 slower than the others, probe.hang_in_data_at_step makes it
// hang in its data source.
#include <loom/loom.h>
#include <torch/torch.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <thread>

namespace {

// The reader, except that rank 1 blocks for good when asked for batch `hang_at`.
class HangingSource : public loom::data::BatchSource {
 public:
  HangingSource(loom::data::BatchSource& inner, bool hangs, int64_t hang_at)
      : inner_(inner), hang_at_(hangs ? hang_at : -1) {}
  loom::data::Batch next() override {
    if (calls_++ == hang_at_) {
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    return inner_.next();
  }
  int64_t batch_size() const override { return inner_.batch_size(); }
  std::string state_json() const override { return inner_.state_json(); }
  void restore_json(const std::string& json) override { inner_.restore_json(json); }

 private:
  loom::data::BatchSource& inner_;
  int64_t hang_at_;
  int64_t calls_ = 0;
};

struct TinyLmImpl : torch::nn::Module {
  TinyLmImpl(int64_t vocab, int64_t dim, bool hidden_bias)
      : embed(register_module("embed", torch::nn::Embedding(vocab, dim))),
        hidden(register_module(
            "hidden", torch::nn::Linear(torch::nn::LinearOptions(dim, dim).bias(hidden_bias)))),
        out(register_module("out", torch::nn::Linear(dim, vocab))) {}
  torch::Tensor forward(const torch::Tensor& tokens) {
    return out(torch::dropout(torch::tanh(hidden(embed(tokens))), 0.1, is_training()));
  }
  torch::nn::Embedding embed;
  torch::nn::Linear hidden, out;
};
TORCH_MODULE(TinyLm);

loom::parallel::ZeroStage stage_of(const std::string& name) {
  if (name == "ddp") return loom::parallel::ZeroStage::kNone;
  if (name == "zero1") return loom::parallel::ZeroStage::kOne;
  LOOM_CHECK(name == "zero2", loom::ConfigError, "probe.mode must be ddp, zero1 or zero2, got ",
             name);
  return loom::parallel::ZeroStage::kTwo;
}

}  // namespace

int main(int argc, char** argv) {
  loom::ConfigSchema keys = loom::train::TrainOptions::schema();
  keys.add("probe.data", "", "token dataset");
  keys.add("probe.mode", "ddp", "ddp, zero1 or zero2");
  keys.add("probe.batch", int64_t{8}, "samples per rank per step");
  keys.add("probe.seq_len", int64_t{16}, "tokens per sample");
  keys.add("probe.kill_at_step", int64_t{-1},
           "rank 1 SIGKILLs itself before this step in generation 1");
  keys.add("probe.hidden_bias", true, "the hidden layer has a bias (false: a changed model)");
  keys.add("probe.optimizer_lr", 1e-3, "the AdamW optimizer's own learning rate");
  keys.add("probe.step_ms", int64_t{0},
           "each step's loss waits this long first (a stand-in for a larger model's compute)");
  keys.add("probe.straggler_ms", int64_t{0},
           "rank 1's loss waits this much longer each step (a straggler)");
  keys.add("probe.hang_in_data_at_step", int64_t{-1},
           "rank 1's data source blocks for good when asked for this step's batch (a hang "
           "outside collectives)");
  return loom::run_main(argc, argv, keys, [](loom::Runtime& rt) {
    const loom::Config& cfg = rt.config();
    auto reader = rt.open_dataset(cfg.get<std::string>("probe.data"),
                                  {.batch_size = cfg.get<int64_t>("probe.batch"),
                                   .seq_len = cfg.get<int64_t>("probe.seq_len"),
                                   .seed = rt.seed()});
    TinyLm model(static_cast<int64_t>(reader->manifest().vocab_size), 32,
                 cfg.get<bool>("probe.hidden_bias"));
    loom::parallel::DataParallel dp(
        model.ptr(), rt.world_group(), rt.control_group(),
        {.bucket_bytes = 4096, .zero_stage = stage_of(cfg.get<std::string>("probe.mode"))});
    dp.set_optimizer(std::make_unique<loom::optim::AdamW>(
        loom::optim::AdamWOptions{.lr = cfg.get<double>("probe.optimizer_lr")}));
    at::manual_seed(rt.rank_seed());  // dropout differs per rank, reproducibly
    const int64_t kill_at = cfg.get<int64_t>("probe.kill_at_step");
    const auto step_time =
        std::chrono::milliseconds(cfg.get<int64_t>("probe.step_ms") +
                                  (rt.rank() == 1 ? cfg.get<int64_t>("probe.straggler_ms") : 0));
    std::FILE* losses = std::fopen(
        (rt.run_dir() / ("losses_rank" + std::to_string(rt.rank()) + ".txt")).c_str(), "a");
    HangingSource source(*reader, rt.rank() == 1, cfg.get<int64_t>("probe.hang_in_data_at_step"));
    loom::train::Trainer trainer(
        rt, dp, source, loom::train::TrainOptions::from(cfg),
        [&](const loom::data::Batch& b) {
          std::this_thread::sleep_for(step_time);
          if (kill_at >= 0 && rt.rank() == 1 && rt.topology().generation == 1) {
            // Counted by the calls: each step runs the loss once (one micro-batch).
            static int64_t calls = 0;
            if (calls++ == kill_at) std::raise(SIGKILL);
          }
          const at::Tensor tokens = b["tokens"];
          const at::Tensor logits = model->forward(tokens.slice(1, 0, -1));
          const at::Tensor loss = torch::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}),
                                                            tokens.slice(1, 1).reshape({-1}));
          return loom::train::MicroStep{loss, tokens.numel(), tokens.size(0)};
        },
        {.on_step_end = [&](const loom::train::StepInfo& info) {
          std::fprintf(losses, "%lld %a\n", static_cast<long long>(info.step), info.local_loss);
          std::fflush(losses);
        }});
    const auto result = trainer.fit();
    rt.log().info("probe: steps {}..{} done, last loss {}", result.start_step, result.steps_done,
                  result.last_loss);
    std::fclose(losses);
    // The final parameters, raw bytes in named order, for bitwise comparisons between runs.
    std::FILE* params = std::fopen(
        (rt.run_dir() / ("params_rank" + std::to_string(rt.rank()) + ".bin")).c_str(), "wb");
    for (const auto& p : model->named_parameters()) {
      const at::Tensor t = p.value().detach().contiguous();
      std::fwrite(t.data_ptr(), 1, t.nbytes(), params);
    }
    std::fclose(params);
  });
}

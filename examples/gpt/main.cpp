// GPT on the King James Bible: a decoder-only transformer (model.h) trained through
// loom::Runtime on a BPE token dataset read by loom::data::Reader, with AdamW, a warmup +
// cosine learning rate (loom/train/schedule.h), gradient clipping, and Loom's metrics
// (metrics.jsonl, live progress, MFU, goodput), through loom::train::Trainer with data
// parallelism, async checkpoints and auto-resume. Every train.eval_every steps it measures the
// loss on held-out text (a second dataset: chapters the training set does not have) and
// samples text from a prompt.
//
//   loom run --nproc-per-node 2 -- gpt --config=examples/gpt/configs/tiny.toml --train.steps=600
// tools/run-gpt.sh builds the datasets and runs the tiny config.
#include <loom/loom.h>
#include <torch/torch.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "config.h"
#include "model.h"

namespace {

// Prompt text -> ids by greedy longest match against the vocabulary's pieces (SentencePiece
// marks a word start with U+2581). Encoding exactly needs the SentencePiece library, which
// cannot share a process with libtorch (docs/data-format.md); for a prompt this is enough.
std::vector<int64_t> encode_prompt(const loom::data::Vocabulary& vocab, const std::string& text) {
  std::vector<int64_t> ids;
  std::istringstream words(text);
  std::string word;
  while (words >> word) {
    const std::string s = "\xe2\x96\x81" + word;
    size_t pos = 0;
    while (pos < s.size()) {
      size_t len = s.size() - pos;
      for (; len > 0; --len) {
        const int64_t id = vocab.id_of(s.substr(pos, len));
        if (id >= 0) {
          ids.push_back(id);
          break;
        }
      }
      pos += std::max<size_t>(len, 1);  // a byte no piece starts with is dropped
    }
  }
  return ids;
}

// Mean loss over the first `batches` batches of the held-out set, read in order.
double held_out_loss(gpt::Gpt& model, const loom::data::Reader& val, int64_t batch_size,
                     int64_t batches) {
  torch::NoGradGuard no_grad;
  model->eval();
  double total = 0;
  int64_t counted = 0;
  const auto n = static_cast<int64_t>(val.num_samples());
  for (int64_t b = 0; b < batches && b * batch_size < n; ++b) {
    std::vector<uint64_t> indices;
    for (int64_t i = b * batch_size; i < std::min((b + 1) * batch_size, n); ++i) {
      indices.push_back(static_cast<uint64_t>(i));
    }
    const at::Tensor tokens = val.read(indices)["tokens"];
    total += model->loss(tokens.slice(1, 0, -1), tokens.slice(1, 1)).item<double>();
    ++counted;
  }
  model->train();
  return total / static_cast<double>(std::max<int64_t>(counted, 1));
}

void train(loom::Runtime& rt) {
  const loom::Config& cfg = rt.config();
  const int64_t global_batch = cfg.get<int64_t>("train.batch_size");
  LOOM_CHECK(global_batch > 0 && global_batch % rt.world_size() == 0, loom::ConfigError,
             "train.batch_size (", global_batch,
             ") must be a positive multiple of the world size (", rt.world_size(), ")");
  const int64_t batch = global_batch / rt.world_size();
  const int64_t eval_batches = cfg.get<int64_t>("eval.batches");
  gpt::GptConfig model_cfg{.seq_len = cfg.get<int64_t>("model.seq_len"),
                           .n_layer = cfg.get<int64_t>("model.n_layer"),
                           .n_head = cfg.get<int64_t>("model.n_head"),
                           .n_embd = cfg.get<int64_t>("model.n_embd")};

  const std::string train_dir = cfg.get<std::string>("data.train");
  auto reader = rt.open_dataset(
      train_dir, {.batch_size = batch, .seq_len = model_cfg.seq_len, .seed = rt.seed()});
  const loom::data::Reader val(cfg.get<std::string>("data.val"),
                               {.seq_len = model_cfg.seq_len, .prefetch = 0});
  LOOM_CHECK(val.manifest().vocab_size == reader->manifest().vocab_size, loom::ConfigError,
             "data.val has vocabulary size ", val.manifest().vocab_size, " but data.train ",
             reader->manifest().vocab_size, ": build it with --tokenizer of the training set");
  model_cfg.vocab_size = static_cast<int64_t>(reader->manifest().vocab_size);
  const auto vocab = loom::data::Vocabulary::of_dataset(train_dir);

  gpt::Gpt model(model_cfg);
  const int64_t num_params = model->num_params();  // before FSDP empties the unit parameters
  const double flops_per_token = model->flops_per_token();
  // bfloat16: bf16 parameters and compute; DataParallel keeps fp32 master weights and AdamW
  // state (docs/parallel.md), and on CUDA steps them with the fused AdamW kernel.
  model->to(rt.device(), gpt::parameter_dtype(cfg));
  rt.log().info(
      "GPT: {} layers, {} heads, width {}, context {}, vocab {}: {:.2f}M parameters, "
      "{:.2f} MFLOP/token; train {} ({} tokens, {} sequences), held out {} ({} sequences); "
      "{} sequences per step on {} rank(s)",
      model_cfg.n_layer, model_cfg.n_head, model_cfg.n_embd, model_cfg.seq_len,
      model_cfg.vocab_size, num_params / 1e6, flops_per_token / 1e6, train_dir,
      reader->manifest().total_items(), reader->num_samples(), cfg.get<std::string>("data.val"),
      val.num_samples(), global_batch, rt.world_size());

  // Data parallelism (parallel.mode: DDP, ZeRO-1, ZeRO-2, or FSDP with each block a unit and
  // the embeddings and final LayerNorm in the root unit) with Loom's AdamW (betas 0.9/0.95,
  // GPT-2/nanoGPT practice). Its weight decay applies to every parameter, LayerNorms and biases
  // included.
  // train.activation_checkpointing: each block's activations recomputed in backward (inside its
  // FSDP unit under fsdp).
  if (cfg.get<bool>("train.activation_checkpointing")) {
    loom::parallel::checkpoint_modules_of_type<gpt::BlockImpl>(*model, model->blocks);
  }
  const loom::parallel::Mode mode = loom::parallel::mode_from(cfg);
  if (mode == loom::parallel::Mode::kFsdp) {
    loom::parallel::wrap_modules<torch::nn::Module>(model->blocks);
  }
  const std::unique_ptr<loom::parallel::Strategy> strategy =
      loom::parallel::make_strategy(model.ptr(), rt.world_group(), rt.control_group(), cfg);
  strategy->set_optimizer(std::make_unique<loom::optim::AdamW>(
      loom::optim::AdamWOptions{.lr = cfg.get<double>("train.lr"),
                                .beta2 = 0.95,
                                .weight_decay = cfg.get<double>("train.weight_decay")}));
  at::manual_seed(rt.rank_seed());

  loom::train::TrainOptions options = loom::train::TrainOptions::from(cfg);
  options.flops_per_token = flops_per_token;
  if (options.eval_every == 0) options.eval_every = options.steps;

  std::mt19937_64 sample_rng(rt.seed());
  const std::vector<int64_t> prompt = encode_prompt(vocab, cfg.get<std::string>("sample.prompt"));
  nlohmann::json curve = nlohmann::json::array();
  // Held-out loss and a sample, on rank 0 (the others go on to the next step's collectives);
  // under FSDP on every rank, since each forward gathers parameters from all of them.
  const bool evaluates = rt.is_main() || mode == loom::parallel::Mode::kFsdp;
  auto evaluate = [&](int64_t steps_done) {
    if (!evaluates) return;
    const double loss = held_out_loss(model, val, batch, eval_batches);
    curve.push_back({{"step", steps_done}, {"val_loss", loss}});
    if (rt.is_main()) {
      rt.log().info("step {}: held-out loss {:.4f}{}", steps_done, loss,
                    steps_done == 0
                        ? fmt::format(" (untrained; ln(vocab) = {:.4f})",
                                      std::log(static_cast<double>(model_cfg.vocab_size)))
                        : "");
    }
    if (!prompt.empty()) {
      torch::NoGradGuard no_grad;
      model->eval();
      auto ids = model->generate(prompt, cfg.get<int64_t>("sample.tokens"),
                                 cfg.get<int64_t>("sample.top_k"),
                                 cfg.get<double>("sample.temperature"), sample_rng);
      model->train();
      if (rt.is_main()) rt.log().info("sample: {}", vocab.decode(ids));
    }
  };

  loom::train::Trainer trainer(
      rt, *strategy, *reader, options,
      [&](const loom::data::Batch& b) {
        const at::Tensor tokens = b["tokens"].to(rt.device());
        const at::Tensor loss = model->loss(tokens.slice(1, 0, -1), tokens.slice(1, 1));
        return loom::train::MicroStep{loss, tokens.size(0) * model_cfg.seq_len, tokens.size(0)};
      },
      // The untrained model's held-out loss, once: not again after a restart resumes.
      {.on_start =
           [&](int64_t step) {
             if (step == 0) evaluate(0);
           },
       .on_eval = [&](int64_t step) { evaluate(step + 1); }});
  const auto start = std::chrono::steady_clock::now();
  const loom::train::FitResult result = trainer.fit();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // The result is the held-out loss of the trained model: evaluate at the end unless the last
  // evaluation was at the last step (train.steps not a multiple of eval.every).
  if (evaluates && (curve.empty() || curve.back()["step"].get<int64_t>() != result.steps_done)) {
    evaluate(result.steps_done);
  }
  if (rt.is_main() && !curve.empty()) {
    rt.log().info("result: held-out loss {:.4f} after steps {}..{} in {:.1f} s on {} rank(s)",
                  curve.back()["val_loss"].get<double>(), result.start_step, result.steps_done,
                  seconds, rt.world_size());
    const nlohmann::json out = {{"steps", result.steps_done},         {"train_seconds", seconds},
                                {"world_size", rt.world_size()},      {"params", num_params},
                                {"flops_per_token", flops_per_token}, {"curve", curve}};
    std::ofstream(rt.run_dir() / "result.json") << out.dump(1) << "\n";
  }
}

}  // namespace

int main(int argc, char** argv) { return loom::run_main(argc, argv, gpt::config_schema(), train); }

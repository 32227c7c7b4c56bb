// GPT on the King James Bible: a decoder-only transformer (model.h) trained through
// loom::Runtime on a BPE token dataset read by loom::data::Reader, with AdamW, a warmup +
// cosine learning rate (loom/train/schedule.h), gradient clipping, and Loom's metrics
// (metrics.jsonl, live progress, MFU, goodput). Every eval.every steps it measures the loss on
// held-out text (a second dataset: chapters the training set does not have) and samples text
// from a prompt. Single process for now: the Trainer issue makes it data-parallel.
//
//   gpt --config=examples/gpt/configs/tiny.toml --train.steps=600
// tools/run-gpt.sh builds the datasets and runs the tiny config.
#include <loom/loom.h>
#include <torch/torch.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "model.h"

namespace {

loom::ConfigSchema keys() {
  loom::ConfigSchema s;
  s.add("data.train", "data/kjv-train-bpe", "training token dataset (loom data build text)");
  s.add("data.val", "data/kjv-val-bpe", "held-out token dataset, same tokenizer");
  s.add("model.n_layer", 4, "transformer blocks (L)");
  s.add("model.n_head", 4, "attention heads per block (H)");
  s.add("model.n_embd", 128, "model width C = H * head dim");
  s.add("model.seq_len", 128, "context length T in tokens");
  s.add("train.batch_size", 16, "sequences per step");
  s.add("train.steps", 400, "optimizer steps");
  s.add("train.lr", 1e-3, "peak learning rate (AdamW)");
  s.add("train.min_lr", 1e-4, "learning rate at the end of the cosine decay");
  s.add("train.warmup_steps", 40, "linear warmup steps");
  s.add("train.weight_decay", 0.1, "AdamW weight decay on matrices (not biases, LayerNorms)");
  s.add("train.grad_clip", 1.0, "clip the global gradient norm to this; 0 = no clipping");
  s.add("train.log_every", 20, "steps between progress log lines (when not on a terminal)");
  s.add("eval.every", 100,
        "steps between held-out evaluations and samples; 0 = only at the start and the end");
  s.add("eval.batches", 8, "held-out batches of train.batch_size sequences per evaluation");
  s.add("sample.prompt", "And God said", "text the samples start from");
  s.add("sample.tokens", 48, "tokens to generate per sample");
  s.add("sample.top_k", 20, "sample from the k most likely tokens (1 = greedy)");
  s.add("sample.temperature", 0.8, "softmax temperature of sampling");
  return s;
}

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

void set_lr(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  }
}

void train(loom::Runtime& rt) {
  namespace metrics = loom::metrics;
  const loom::Config& cfg = rt.config();
  LOOM_CHECK(rt.world_size() == 1, loom::InvalidArgument,
             "the gpt example is single-process until the Trainer (DDP) lands; world size is ",
             rt.world_size());
  const int64_t batch = cfg.get<int64_t>("train.batch_size");
  const int64_t steps = cfg.get<int64_t>("train.steps");
  const int64_t eval_every = cfg.get<int64_t>("eval.every");
  const int64_t eval_batches = cfg.get<int64_t>("eval.batches");
  gpt::GptConfig model_cfg{.seq_len = cfg.get<int64_t>("model.seq_len"),
                           .n_layer = cfg.get<int64_t>("model.n_layer"),
                           .n_head = cfg.get<int64_t>("model.n_head"),
                           .n_embd = cfg.get<int64_t>("model.n_embd")};
  LOOM_CHECK(batch > 0 && steps > 0, loom::ConfigError,
             "train.batch_size and train.steps must be positive");

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
  model->to(rt.device());
  rt.log().info(
      "GPT: {} layers, {} heads, width {}, context {}, vocab {}: {:.2f}M parameters, "
      "{:.2f} MFLOP/token; train {} ({} tokens, {} sequences), held out {} ({} sequences)",
      model_cfg.n_layer, model_cfg.n_head, model_cfg.n_embd, model_cfg.seq_len,
      model_cfg.vocab_size, model->num_params() / 1e6, model->flops_per_token() / 1e6, train_dir,
      reader->manifest().total_items(), reader->num_samples(), cfg.get<std::string>("data.val"),
      val.num_samples());

  // AdamW: weight decay on matrices only (GPT-2/nanoGPT practice).
  std::vector<torch::Tensor> decay, no_decay;
  for (const auto& p : model->parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  const double weight_decay = cfg.get<double>("train.weight_decay");
  auto options = [&](double wd) {
    return std::make_unique<torch::optim::AdamWOptions>(
        torch::optim::AdamWOptions(cfg.get<double>("train.lr"))
            .betas({0.9, 0.95})
            .weight_decay(wd));
  };
  torch::optim::AdamW optimizer({torch::optim::OptimizerParamGroup(decay, options(weight_decay)),
                                 torch::optim::OptimizerParamGroup(no_decay, options(0.0))});
  const auto schedule = loom::train::Schedule::warmup_cosine(
      {.lr = cfg.get<double>("train.lr"),
       .min_lr = cfg.get<double>("train.min_lr"),
       .warmup_steps = std::min(cfg.get<int64_t>("train.warmup_steps"), steps),
       .total_steps = steps});
  const double grad_clip = cfg.get<double>("train.grad_clip");

  const metrics::PeakFlops peak = metrics::peak_flops(rt.device());
  rt.log().info("lr {}; peak {:.1f} GFLOP/s ({}, {} threads)", schedule.describe(),
                peak.flops_per_second / 1e9, peak.source, rt.threads());
  metrics::MetricsLogger log(rt, {.flops_per_token = model->flops_per_token(),
                                  .peak = peak,
                                  .log_every = cfg.get<int64_t>("train.log_every")});
  log.on_resume(0);

  std::mt19937_64 sample_rng(rt.seed());
  const std::vector<int64_t> prompt = encode_prompt(vocab, cfg.get<std::string>("sample.prompt"));
  nlohmann::json curve = nlohmann::json::array();
  auto evaluate = [&](int64_t step, double train_loss) {
    log.clear_progress_line();
    const double loss = held_out_loss(model, val, batch, eval_batches);
    if (step == 0) {
      rt.log().info("step 0: held-out loss {:.4f} (untrained; ln(vocab) = {:.4f})", loss,
                    std::log(static_cast<double>(model_cfg.vocab_size)));
      curve.push_back({{"step", 0}, {"val_loss", loss}, {"train_loss", nullptr}});
    } else {
      rt.log().info("step {}: held-out loss {:.4f} (train loss, smoothed {:.4f})", step, loss,
                    train_loss);
      curve.push_back({{"step", step}, {"val_loss", loss}, {"train_loss", train_loss}});
    }
    if (!prompt.empty()) {
      auto ids = model->generate(prompt, cfg.get<int64_t>("sample.tokens"),
                                 cfg.get<int64_t>("sample.top_k"),
                                 cfg.get<double>("sample.temperature"), sample_rng);
      rt.log().info("sample: {}", vocab.decode(ids));
    }
  };

  const auto start = std::chrono::steady_clock::now();
  double smoothed_loss = 0;
  for (int64_t step = 0; step < steps; ++step) {
    if (step == 0 || (eval_every > 0 && step % eval_every == 0)) evaluate(step, smoothed_loss);
    metrics::StepTimer& timer = log.timer();
    timer.begin_step();
    at::Tensor tokens;
    uint64_t epoch = 0;
    {
      auto phase = timer.phase(metrics::Phase::kDataWait);
      loom::data::Batch b = reader->next();
      tokens = b["tokens"].to(rt.device());
      epoch = b.epoch;
    }
    at::Tensor loss;
    {
      auto phase = timer.phase(metrics::Phase::kForwardBackward);
      loss = model->loss(tokens.slice(1, 0, -1), tokens.slice(1, 1));
      optimizer.zero_grad();
      loss.backward();
    }
    std::optional<double> grad_norm;
    const double lr = schedule(step);
    {
      auto phase = timer.phase(metrics::Phase::kOptimizer);
      if (grad_clip > 0)
        grad_norm = torch::nn::utils::clip_grad_norm_(model->parameters(), grad_clip);
      set_lr(optimizer, lr);
      optimizer.step();
    }
    const double loss_value = loss.item<double>();
    smoothed_loss = step == 0 ? loss_value : 0.95 * smoothed_loss + 0.05 * loss_value;
    log.log_step({.step = step,
                  .epoch = static_cast<int64_t>(epoch),
                  .loss = loss_value,
                  .lr = lr,
                  .grad_norm = grad_norm,
                  .tokens = batch * model_cfg.seq_len,
                  .samples = batch});
  }
  evaluate(steps, smoothed_loss);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const metrics::GoodputReport goodput = log.goodput().report();
  rt.log().info("result: held-out loss {:.4f} after {} steps in {:.1f} s (goodput {:.1f}%)",
                curve.back()["val_loss"].get<double>(), steps, seconds, 100 * goodput.goodput);
  if (rt.is_main()) {
    const nlohmann::json result = {{"steps", steps},
                                   {"train_seconds", seconds},
                                   {"params", model->num_params()},
                                   {"flops_per_token", model->flops_per_token()},
                                   {"peak_flops", peak.flops_per_second},
                                   {"peak_source", peak.source},
                                   {"curve", curve}};
    std::ofstream(rt.run_dir() / "result.json") << result.dump(1) << "\n";
  }
}

}  // namespace

int main(int argc, char** argv) { return loom::run_main(argc, argv, keys(), train); }

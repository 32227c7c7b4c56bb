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

// The whole model's training FLOPs per token (TorchTitan's formula) when `model` holds this
// rank's tensor-parallel shards.
double whole_model_flops_per_token(gpt::Gpt& model, loom::comm::Group* tp) {
  int64_t params = 0;
  for (const auto& p : loom::parallel::tp::sharded_parameters(*model)) {
    int64_t n = 1;
    for (int64_t d : loom::parallel::tp::full_shape(p.tensor, p.spec, tp)) n *= d;
    params += n;
  }
  loom::metrics::TransformerShape shape = model->shape();
  shape.params = params;
  return loom::metrics::flops_per_token(shape);
}

void train(loom::Runtime& rt) {
  const loom::Config& cfg = rt.config();
  // Model parallelism (parallel.tp, parallel.pp; docs/parallel.md): the mesh's tp group splits
  // heads, MLP features and vocabulary; each pipeline rank keeps its stages' blocks; the data
  // is sharded over the dp dimension (rt.open_dataset), the strategy runs over the dp group.
  const bool model_parallel =
      cfg.get<int64_t>("parallel.tp") > 1 || cfg.get<int64_t>("parallel.pp") > 1;
  loom::parallel::DeviceMesh* mesh = model_parallel ? &rt.mesh() : nullptr;
  loom::comm::Group* tp = mesh != nullptr ? &mesh->group("tp") : nullptr;
  loom::comm::Group* pp = mesh != nullptr && mesh->size("pp") > 1 ? &mesh->group("pp") : nullptr;
  const int replicas = mesh != nullptr ? mesh->size("dp") : rt.world_size();
  const int64_t global_batch = cfg.get<int64_t>("train.batch_size");
  LOOM_CHECK(global_batch > 0 && global_batch % replicas == 0, loom::ConfigError,
             "train.batch_size (", global_batch,
             ") must be a positive multiple of the data-parallel replicas (", replicas, ")");
  const int64_t batch = global_batch / replicas;
  const int64_t eval_batches = cfg.get<int64_t>("eval.batches");
  gpt::GptConfig model_cfg{.seq_len = cfg.get<int64_t>("model.seq_len"),
                           .n_layer = cfg.get<int64_t>("model.n_layer"),
                           .n_head = cfg.get<int64_t>("model.n_head"),
                           .n_embd = cfg.get<int64_t>("model.n_embd")};

  const std::string train_dir = cfg.get<std::string>("data.train");
  const std::string service = cfg.get<std::string>("data.service");
  // With a data service the training batches come from its processes, the same bit for bit;
  // the dataset is still opened here, for its vocabulary and sizes (and for `loom data show`).
  loom::data::ReaderOptions train_options{.batch_size = batch,
                                          .seq_len = model_cfg.seq_len,
                                          .seed = rt.seed(),
                                          .prefetch = service.empty() ? 2 : 0};
  auto reader = rt.open_dataset(train_dir, train_options);
  std::unique_ptr<loom::data::ServiceReader> served;
  if (!service.empty()) served = rt.open_data_service(service, train_dir, train_options);
  loom::data::BatchSource& batches =
      served != nullptr ? static_cast<loom::data::BatchSource&>(*served) : *reader;
  const loom::data::Reader val(cfg.get<std::string>("data.val"),
                               {.seq_len = model_cfg.seq_len, .prefetch = 0});
  LOOM_CHECK(val.manifest().vocab_size == reader->manifest().vocab_size, loom::ConfigError,
             "data.val has vocabulary size ", val.manifest().vocab_size, " but data.train ",
             reader->manifest().vocab_size, ": build it with --tokenizer of the training set");
  model_cfg.vocab_size = static_cast<int64_t>(reader->manifest().vocab_size);
  const auto vocab = loom::data::Vocabulary::of_dataset(train_dir);

  gpt::Gpt model(
      model_cfg,
      gpt::GptParallel{.tp = tp, .sequence_parallel = cfg.get<bool>("parallel.sequence_parallel")});
  const int64_t num_params = model->num_params();  // before FSDP empties the unit parameters
  // Per rank: a replica's tp x pp ranks share each token's FLOPs.
  const double flops_per_token =
      whole_model_flops_per_token(model, tp) /
      static_cast<double>(mesh != nullptr ? rt.world_size() / replicas : 1);
  // Pipeline stages: this rank's chunks of blocks, the rest of the model dropped.
  loom::parallel::ModelParallel model_parallelism{.tp = tp, .pp = pp};
  std::vector<std::pair<int64_t, int64_t>> chunks;
  std::unique_ptr<loom::comm::Group> tied;  // the first and the last stage's ranks
  if (pp != nullptr) {
    const int p = pp->size(), v = loom::parallel::pipeline_chunks_from(cfg);
    for (int j = 0; j < v; ++j)
      chunks.push_back(gpt::GptImpl::stage_layers(model_cfg, j * p + pp->rank(), p * v));
    for (const std::string& name : model->keep_layers(chunks)) {
      if (tied == nullptr) tied = pp->new_subgroup({0, p - 1});
      model_parallelism.tied.push_back({name, tied.get()});
    }
  }
  // bfloat16: bf16 parameters and compute; DataParallel keeps fp32 master weights and AdamW
  // state (docs/parallel.md), and on CUDA steps them with the fused AdamW kernel.
  model->to(rt.device(), gpt::parameter_dtype(cfg));
  rt.log().info(
      "GPT: {} layers, {} heads, width {}, context {}, vocab {}: {:.2f}M parameters (this rank's), "
      "{:.2f} MFLOP/token (this rank's share); train {} ({} tokens, {} sequences), held out {} "
      "({} sequences); {} sequences per step on {} rank(s){}",
      model_cfg.n_layer, model_cfg.n_head, model_cfg.n_embd, model_cfg.seq_len,
      model_cfg.vocab_size, num_params / 1e6, flops_per_token / 1e6, train_dir,
      reader->manifest().total_items(), reader->num_samples(), cfg.get<std::string>("data.val"),
      val.num_samples(), global_batch, rt.world_size(),
      mesh != nullptr ? " as " + mesh->describe() : std::string());

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
  // Under model parallelism the strategy spans the dp group, whose construction checks travel
  // over the group itself.
  loom::comm::Group& dp = mesh != nullptr ? mesh->group("dp") : rt.world_group();
  const std::unique_ptr<loom::parallel::Strategy> strategy = loom::parallel::make_strategy(
      model.ptr(), dp, mesh != nullptr ? dp : rt.control_group(), cfg, model_parallelism);
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
  // under FSDP and tensor parallelism on every rank, since each forward is collective. A
  // pipeline rank holds part of the model only: no evaluation there (noted once).
  const bool evaluates =
      pp == nullptr && (rt.is_main() || mode == loom::parallel::Mode::kFsdp || tp != nullptr);
  if (pp != nullptr && rt.is_main()) {
    rt.log().info(
        "parallel.pp = {}: held-out evaluation and samples need the whole model on a "
        "rank and are not run; the training loss is logged",
        pp->size());
  }
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

  // The untrained model's held-out loss, once: not again after a restart resumes.
  const loom::train::Callbacks callbacks{.on_start =
                                             [&](int64_t step) {
                                               if (step == 0) evaluate(0);
                                             },
                                         .on_eval = [&](int64_t step) { evaluate(step + 1); }};
  std::unique_ptr<loom::parallel::Pipeline> pipeline;
  std::unique_ptr<loom::train::Trainer> trainer;
  if (pp != nullptr) {
    std::vector<loom::parallel::StageFn> stages;
    for (const auto& [begin, end] : chunks) {
      stages.push_back([&model, begin = begin, end = end](const at::Tensor& input) {
        return model->forward_stage(input, begin, end);
      });
    }
    const loom::parallel::PipelineOptions pipe_options = loom::parallel::pipeline_options_from(cfg);
    LOOM_CHECK(batch % pipe_options.micro_batches == 0, loom::ConfigError, "train.batch_size (",
               global_batch, ") over ", replicas, " data-parallel replica(s) is ", batch,
               " sequences per pipeline step, which does not split into "
               "parallel.pp_micro_batches = ",
               pipe_options.micro_batches, " micro-batches; choose a batch size that does");
    pipeline = std::make_unique<loom::parallel::Pipeline>(*pp, std::move(stages), pipe_options);
    trainer = std::make_unique<loom::train::Trainer>(
        rt, *strategy, batches, options, loom::train::BatchStep{[&](const loom::data::Batch& b) {
          const at::Tensor tokens = b["tokens"].to(rt.device());
          const double loss =
              pipeline->step(tokens.slice(1, 0, -1), tokens.slice(1, 1),
                             [&](const at::Tensor& logits, const at::Tensor& targets) {
                               return model->loss_from_logits(logits, targets);
                             });
          return loom::train::MicroStep{at::scalar_tensor(loss, at::kDouble),
                                        tokens.size(0) * model_cfg.seq_len, tokens.size(0)};
        }},
        callbacks);
  } else {
    trainer = std::make_unique<loom::train::Trainer>(
        rt, *strategy, batches, options,
        [&](const loom::data::Batch& b) {
          const at::Tensor tokens = b["tokens"].to(rt.device());
          const at::Tensor loss = model->loss(tokens.slice(1, 0, -1), tokens.slice(1, 1));
          return loom::train::MicroStep{loss, tokens.size(0) * model_cfg.seq_len, tokens.size(0)};
        },
        callbacks);
  }
  const auto start = std::chrono::steady_clock::now();
  const loom::train::FitResult result = trainer->fit();
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

// The GPT example's configuration keys (config.h).
#include "config.h"

#include <loom/error.h>
#include <loom/parallel/strategy.h>
#include <loom/train/trainer.h>

#include <string>

namespace gpt {

loom::ConfigSchema config_schema() {
  loom::ConfigSchema s = loom::train::TrainOptions::schema();  // train.steps, train.lr, ...
  s.merge(loom::parallel::strategy_schema());                  // parallel.mode, ...
  s.add("data.train", "data/kjv-train-bpe",
        "training token dataset: a directory (loom data build text) or a registry name (kjv@3)");
  s.add("data.service", "",
        "read the training batches from this data service of the job spec (loom data service; "
        "the same batches, read and decoded in its processes); empty: in this process");
  s.add("data.val", "data/kjv-val-bpe",
        "held-out token dataset (directory or registry name), same tokenizer");
  s.add("model.n_layer", 4, "transformer blocks (L)");
  s.add("model.n_head", 4, "attention heads per block (H)");
  s.add("model.n_embd", 128, "model width C = H * head dim");
  s.add("model.seq_len", 128, "context length T in tokens");
  s.add("model.dtype", "float32",
        "parameter and compute dtype: float32, or bfloat16 (fp32 master weights and AdamW state)");
  s.add("train.batch_size", 16, "sequences per step, over all ranks");
  s.add("train.weight_decay", 0.1, "AdamW weight decay");
  s.add("parallel.sequence_parallel", false,
        "under parallel.tp > 1: split the LayerNorm, residual and embedding activations along "
        "the sequence too (model.seq_len must divide by parallel.tp)");
  s.add("train.activation_checkpointing", false,
        "recompute each block's activations in backward instead of keeping them");
  s.add("eval.batches", 8, "held-out batches of train.batch_size sequences per evaluation");
  s.add("sample.prompt", "And God said", "text the samples start from");
  s.add("sample.tokens", 48, "tokens to generate per sample");
  s.add("sample.top_k", 20, "sample from the k most likely tokens (1 = greedy)");
  s.add("sample.temperature", 0.8, "softmax temperature of sampling");
  return s;
}

c10::ScalarType parameter_dtype(const loom::Config& config) {
  const std::string dtype = config.get<std::string>("model.dtype");
  if (dtype == "float32") return c10::kFloat;
  if (dtype == "bfloat16") return c10::kBFloat16;
  throw loom::ConfigError("model.dtype is \"" + dtype + "\"; use float32 or bfloat16");
}

}  // namespace gpt

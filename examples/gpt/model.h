// A GPT-2-style decoder-only transformer in libtorch: token and learned position embeddings,
// pre-LayerNorm blocks of causal self-attention and a 4x GELU MLP, a final LayerNorm, and an
// output head tied to the token embedding. Shared by the gpt example, and meant for the
// Trainer and benchmarks/bench_train to reuse.
//
// Attention is written with torch ops (matmul, masked_fill, softmax): libtorch 1.13 has no
// scaled_dot_product_attention. Not thread-safe (a torch module); one training thread uses it.
#pragma once

#include <loom/comm/group.h>
#include <loom/metrics/flops.h>
#include <loom/parallel/tensor_parallel.h>
#include <torch/torch.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace gpt {

struct GptConfig {
  int64_t vocab_size = 4096;  // from the dataset
  int64_t seq_len = 128;      // the longest context (position embeddings), T
  int64_t n_layer = 4;        // L
  int64_t n_head = 4;         // H; n_embd must be a multiple of it
  int64_t n_embd = 128;       // C = H * Q
};

// Tensor parallelism (Megatron's layout, loom/parallel/tensor_parallel.h): each of the tp
// group's ranks holds 1/tp of the vocabulary (the embedding and the tied head), of the heads
// (qkv column-parallel by head, proj row-parallel) and of the MLP's hidden features (fc
// column-, fc_proj row-parallel); LayerNorms and position embeddings are replicated.
// sequence_parallel also splits the activations outside attention and the MLP along the
// sequence (T must be divisible by tp). Null: the plain model. Parameter names and, for one
// seed, the initial weights (each rank's shard of them) are the same at every tp size.
struct GptParallel {
  loom::comm::Group* tp = nullptr;  // must outlive the model
  bool sequence_parallel = false;
};

class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  CausalSelfAttentionImpl(const GptConfig& config, const GptParallel& parallel);
  // [B, T, C] -> [B, T, C] (sequence parallel: [B, T / tp, C] both).
  torch::Tensor forward(const torch::Tensor& x);

  loom::parallel::tp::ColumnParallelLinear qkv{nullptr};  // [q; k; v], this rank's heads of each
  loom::parallel::tp::RowParallelLinear proj{nullptr};

 private:
  int64_t n_head_;        // this rank's heads
  torch::Tensor future_;  // [T, T] bool, true above the diagonal (positions not to attend)
};
TORCH_MODULE(CausalSelfAttention);

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(const GptConfig& config, const GptParallel& parallel);
  torch::Tensor forward(torch::Tensor x);

  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  CausalSelfAttention attn{nullptr};
  loom::parallel::tp::ColumnParallelLinear fc{nullptr};
  loom::parallel::tp::RowParallelLinear fc_proj{nullptr};

 private:
  GptParallel parallel_;
};
TORCH_MODULE(Block);

class GptImpl : public torch::nn::Module {
 public:
  // Weights are initialised as GPT-2's: N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)),
  // biases 0, from torch's global generator (Runtime seeds it).
  // Under tensor parallelism every rank of the tp group builds it with the same generator
  // state. ConfigError naming the sizes when heads, vocabulary or MLP width do not divide by tp.
  explicit GptImpl(const GptConfig& config, const GptParallel& parallel = {});

  // Token ids [B, T] (T <= seq_len) -> logits [B, T, vocab] (gathered under tensor
  // parallelism: for generation and evaluation, not for the training loss).
  torch::Tensor forward(const torch::Tensor& idx);
  // Mean cross-entropy of predicting `targets` [B, T] from `idx` [B, T]; under tensor
  // parallelism from vocabulary-split logits, never gathered (the same value on every rank).
  torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets);

  // The cross-entropy of `targets` from this rank's logits (local_logits' [B, T, V / tp]).
  torch::Tensor loss_from_logits(const torch::Tensor& logits, const torch::Tensor& targets);

  // Pipeline stages (loom/parallel/pipeline.h): blocks [begin, end), with the embeddings
  // before them when begin is 0 (token ids [B, T] in) and the final LayerNorm and the tied
  // head after them when end is n_layer (this rank's logits [B, T, V / tp] out, for
  // loss_from_logits); hidden states [B, T, C] in and out otherwise.
  torch::Tensor forward_stage(const torch::Tensor& input, int64_t begin, int64_t end);
  // The parameters forward_stage(., begin, end) uses (the token embedding on the first and on
  // the last stage: its gradients there must be summed between them).
  std::vector<torch::Tensor> stage_parameters(int64_t begin, int64_t end);
  // Keeps only the parameters of the blocks in `chunks` (this pipeline rank's [begin, end)
  // ranges) and of the embeddings and final LayerNorm those chunks use: the other blocks
  // become empty modules and the rest is unregistered, its memory freed, so that
  // named_parameters() lists this rank's parameters under the whole model's names (what a
  // data-parallel strategy over a stage shards and checkpoints). Returns the parameters another
  // pipeline rank also holds: the token embedding, when this rank has exactly one of the first
  // and the last stage (its gradients are summed between them; parallel::ModelParallel::tied).
  std::vector<std::string> keep_layers(const std::vector<std::pair<int64_t, int64_t>>& chunks);
  // Virtual stage `stage` of `stages`' blocks, [begin, end): n_layer / stages each; ConfigError
  // naming both numbers when they do not divide.
  static std::pair<int64_t, int64_t> stage_layers(const GptConfig& config, int stage, int stages);

  // This rank's parameters, the tied embedding/head counted once.
  int64_t num_params() const;
  // The shape for MFU: N = num_params(), N_emb = the position embeddings (the token embedding
  // is also the head, a matmul; see loom/metrics/flops.h), T = seq_len.
  loom::metrics::TransformerShape shape() const;
  // Training FLOPs per token, TorchTitan's formula: 6 (N - N_emb) + 12 L H Q T.
  double flops_per_token() const;

  // Continues `prompt` by `new_tokens` ids, sampling each from the top_k most likely (top_k 1 =
  // greedy) at `temperature`, with `rng`. The context is cut to the last seq_len tokens.
  std::vector<int64_t> generate(std::vector<int64_t> prompt, int64_t new_tokens, int64_t top_k,
                                double temperature, std::mt19937_64& rng);

  const GptConfig& config() const { return config_; }

  loom::parallel::tp::VocabParallelEmbedding wte{nullptr};  // also the head
  torch::nn::Embedding wpe{nullptr};
  // A Sequential, so that wrapped blocks (FSDP units, activation checkpointing) run unchanged.
  torch::nn::Sequential blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};

 private:
  // This rank's vocabulary columns of the logits, [B, T, V / tp], from hidden states.
  torch::Tensor local_logits(const torch::Tensor& hidden);

  GptConfig config_;
  GptParallel parallel_;
};
TORCH_MODULE(Gpt);

}  // namespace gpt

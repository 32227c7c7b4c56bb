// A GPT-2-style decoder-only transformer in libtorch: token and learned position embeddings,
// pre-LayerNorm blocks of causal self-attention and a 4x GELU MLP, a final LayerNorm, and an
// output head tied to the token embedding. Shared by the gpt example, and meant for the
// Trainer and benchmarks/bench_train to reuse.
//
// Attention is written with torch ops (matmul, masked_fill, softmax): libtorch 1.13 has no
// scaled_dot_product_attention. Not thread-safe (a torch module); one training thread uses it.
#pragma once

#include <loom/metrics/flops.h>
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

class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  explicit CausalSelfAttentionImpl(const GptConfig& config);
  torch::Tensor forward(const torch::Tensor& x);  // [B, T, C] -> [B, T, C]

  torch::nn::Linear qkv{nullptr}, proj{nullptr};

 private:
  int64_t n_head_;
  torch::Tensor future_;  // [T, T] bool, true above the diagonal (positions not to attend)
};
TORCH_MODULE(CausalSelfAttention);

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const GptConfig& config);
  torch::Tensor forward(torch::Tensor x);

  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  CausalSelfAttention attn{nullptr};
  torch::nn::Linear fc{nullptr}, fc_proj{nullptr};
};
TORCH_MODULE(Block);

class GptImpl : public torch::nn::Module {
 public:
  // Weights are initialised as GPT-2's: N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)),
  // biases 0, from torch's global generator (Runtime seeds it).
  explicit GptImpl(const GptConfig& config);

  // Token ids [B, T] (T <= seq_len) -> logits [B, T, vocab].
  torch::Tensor forward(const torch::Tensor& idx);
  // Mean cross-entropy of predicting `targets` [B, T] from `idx` [B, T].
  torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets);

  // Parameters, the tied embedding/head counted once.
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

  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  // A Sequential, so that wrapped blocks (FSDP units, activation checkpointing) run unchanged.
  torch::nn::Sequential blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};

 private:
  GptConfig config_;
};
TORCH_MODULE(Gpt);

}  // namespace gpt

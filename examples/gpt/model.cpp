// The GPT model (see model.h).
#include "model.h"

#include <loom/error.h>

#include <cmath>

namespace gpt {

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GptConfig& c) : n_head_(c.n_head) {
  LOOM_CHECK(c.n_head > 0 && c.n_embd % c.n_head == 0, loom::ConfigError, "model.n_embd (",
             c.n_embd, ") must be a multiple of model.n_head (", c.n_head, ")");
  qkv = register_module("qkv", torch::nn::Linear(c.n_embd, 3 * c.n_embd));
  proj = register_module("proj", torch::nn::Linear(c.n_embd, c.n_embd));
  future_ = register_buffer("future",
                            torch::ones({c.seq_len, c.seq_len}, torch::kBool).triu(/*diagonal=*/1));
}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), Q = C / n_head_;
  // [B, T, 3C] -> three [B, H, T, Q]
  auto qkv_out = qkv->forward(x).view({B, T, 3, n_head_, Q}).permute({2, 0, 3, 1, 4});
  auto q = qkv_out[0], k = qkv_out[1], v = qkv_out[2];
  auto scores = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(Q)));
  using torch::indexing::Slice;
  scores = scores.masked_fill(future_.index({Slice(0, T), Slice(0, T)}),
                              -std::numeric_limits<float>::infinity());
  auto y = torch::matmul(torch::softmax(scores, -1), v);  // [B, H, T, Q]
  return proj->forward(y.transpose(1, 2).reshape({B, T, C}));
}

BlockImpl::BlockImpl(const GptConfig& c) {
  ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})));
  attn = register_module("attn", CausalSelfAttention(c));
  ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})));
  fc = register_module("fc", torch::nn::Linear(c.n_embd, 4 * c.n_embd));
  fc_proj = register_module("fc_proj", torch::nn::Linear(4 * c.n_embd, c.n_embd));
}

torch::Tensor BlockImpl::forward(torch::Tensor x) {
  x = x + attn->forward(ln1->forward(x));
  return x + fc_proj->forward(torch::gelu(fc->forward(ln2->forward(x))));
}

GptImpl::GptImpl(const GptConfig& c) : config_(c) {
  LOOM_CHECK(c.vocab_size > 0 && c.seq_len > 0 && c.n_layer > 0 && c.n_embd > 0, loom::ConfigError,
             "GPT config needs positive vocab_size, seq_len, n_layer, n_embd");
  wte = register_module("wte", torch::nn::Embedding(c.vocab_size, c.n_embd));
  wpe = register_module("wpe", torch::nn::Embedding(c.seq_len, c.n_embd));
  blocks = register_module("blocks", torch::nn::Sequential());
  for (int64_t i = 0; i < c.n_layer; ++i) blocks->push_back(Block(c));
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})));

  torch::NoGradGuard no_grad;
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(c.n_layer));
  for (auto& item : named_parameters()) {
    const std::string& name = item.key();
    torch::Tensor& p = item.value();
    if (name.find("ln") != std::string::npos) continue;  // LayerNorm keeps weight 1, bias 0
    if (p.dim() == 1) {
      p.zero_();
    } else if (name.find("proj.weight") != std::string::npos) {  // attn.proj and fc_proj
      p.normal_(0.0, residual_std);
    } else {
      p.normal_(0.0, 0.02);
    }
  }
}

torch::Tensor GptImpl::forward(const torch::Tensor& idx) {
  const int64_t T = idx.size(1);
  LOOM_CHECK(T <= config_.seq_len, loom::InvalidArgument, "GPT input of ", T,
             " tokens is longer than model.seq_len ", config_.seq_len);
  auto positions = torch::arange(T, idx.options().dtype(torch::kLong));
  auto x = wte->forward(idx) + wpe->forward(positions);
  x = blocks->forward(x);
  return torch::matmul(ln_f->forward(x), wte->weight.t());  // head tied to the embedding
}

torch::Tensor GptImpl::loss(const torch::Tensor& idx, const torch::Tensor& targets) {
  // The log-softmax in fp32 whatever the parameters' dtype (a no-op for fp32 models).
  auto logits = forward(idx).to(torch::kFloat);
  return torch::cross_entropy_loss(logits.view({-1, logits.size(-1)}), targets.reshape({-1}));
}

int64_t GptImpl::num_params() const {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

loom::metrics::TransformerShape GptImpl::shape() const {
  return {.params = num_params(),
          .embedding_params = wpe->weight.numel(),
          .layers = config_.n_layer,
          .heads = config_.n_head,
          .head_dim = config_.n_embd / config_.n_head,
          .seq_len = config_.seq_len};
}

double GptImpl::flops_per_token() const { return loom::metrics::flops_per_token(shape()); }

std::vector<int64_t> GptImpl::generate(std::vector<int64_t> ids, int64_t new_tokens, int64_t top_k,
                                       double temperature, std::mt19937_64& rng) {
  LOOM_CHECK(!ids.empty() && top_k > 0 && temperature > 0, loom::InvalidArgument,
             "generate needs a prompt, top_k > 0 and temperature > 0");
  torch::NoGradGuard no_grad;
  const bool was_training = is_training();
  eval();
  for (int64_t i = 0; i < new_tokens; ++i) {
    const size_t start = ids.size() > static_cast<size_t>(config_.seq_len)
                             ? ids.size() - static_cast<size_t>(config_.seq_len)
                             : 0;
    std::vector<int64_t> context(ids.begin() + static_cast<std::ptrdiff_t>(start), ids.end());
    auto input = torch::tensor(context, torch::kLong).unsqueeze(0);
    auto logits = forward(input)[0][-1] / temperature;  // the last position's [vocab]
    auto [values, indices] = logits.topk(std::min(top_k, logits.size(0)));
    auto probs = torch::softmax(values.to(torch::kDouble), 0).contiguous();
    const double* p = probs.data_ptr<double>();
    std::discrete_distribution<int64_t> pick(p, p + probs.numel());
    ids.push_back(indices[pick(rng)].item<int64_t>());
  }
  train(was_training);
  return ids;
}

}  // namespace gpt

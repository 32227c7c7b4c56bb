// The GPT model (see model.h).
#include "model.h"

#include <loom/error.h>

#include <cmath>

namespace gpt {

namespace tp = loom::parallel::tp;

namespace {

int64_t tp_size(const GptParallel& p) { return p.tp == nullptr ? 1 : p.tp->size(); }

// A LayerNorm on sequence-split activations: its parameters enter through copy_to_region, so
// their gradients (of this rank's positions only) are summed over the tp ranks in backward.
torch::Tensor norm(torch::nn::LayerNorm& ln, const torch::Tensor& x, const GptParallel& p) {
  if (!p.sequence_parallel || tp_size(p) == 1) return ln->forward(x);
  return torch::layer_norm(x, ln->options.normalized_shape(), tp::copy_to_region(ln->weight, p.tp),
                           tp::copy_to_region(ln->bias, p.tp), ln->options.eps());
}

}  // namespace

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GptConfig& c, const GptParallel& p) {
  LOOM_CHECK(c.n_head > 0 && c.n_embd % c.n_head == 0, loom::ConfigError, "model.n_embd (",
             c.n_embd, ") must be a multiple of model.n_head (", c.n_head, ")");
  LOOM_CHECK(c.n_head % tp_size(p) == 0, loom::ConfigError, "model.n_head (", c.n_head,
             ") must be a multiple of parallel.tp (", tp_size(p),
             "): each tensor-parallel rank computes whole heads");
  n_head_ = c.n_head / tp_size(p);
  qkv = register_module("qkv", tp::ColumnParallelLinear(
                                   c.n_embd, 3 * c.n_embd, p.tp,
                                   tp::ColumnParallelOptions{
                                       .sequence_parallel = p.sequence_parallel, .partitions = 3}));
  proj = register_module(
      "proj",
      tp::RowParallelLinear(c.n_embd, c.n_embd, p.tp,
                            tp::RowParallelOptions{.sequence_parallel = p.sequence_parallel}));
  future_ = register_buffer("future",
                            torch::ones({c.seq_len, c.seq_len}, torch::kBool).triu(/*diagonal=*/1));
}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x) {
  // [B, T, 3C'] (C' = this rank's heads x Q; sequence parallel: the whole T, gathered by qkv)
  // -> three [B, H', T, Q]
  const torch::Tensor qkv_out_flat = qkv->forward(x);
  const int64_t B = qkv_out_flat.size(0), T = qkv_out_flat.size(1);
  const int64_t C = qkv_out_flat.size(2) / 3, Q = C / n_head_;
  auto qkv_out = qkv_out_flat.view({B, T, 3, n_head_, Q}).permute({2, 0, 3, 1, 4});
  auto q = qkv_out[0], k = qkv_out[1], v = qkv_out[2];
  auto scores = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(Q)));
  using torch::indexing::Slice;
  scores = scores.masked_fill(future_.index({Slice(0, T), Slice(0, T)}),
                              -std::numeric_limits<float>::infinity());
  auto y = torch::matmul(torch::softmax(scores, -1), v);  // [B, H', T, Q]
  return proj->forward(y.transpose(1, 2).reshape({B, T, C}));
}

BlockImpl::BlockImpl(const GptConfig& c, const GptParallel& p) : parallel_(p) {
  ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})));
  attn = register_module("attn", CausalSelfAttention(c, p));
  ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})));
  fc = register_module("fc",
                       tp::ColumnParallelLinear(
                           c.n_embd, 4 * c.n_embd, p.tp,
                           tp::ColumnParallelOptions{.sequence_parallel = p.sequence_parallel}));
  fc_proj = register_module(
      "fc_proj",
      tp::RowParallelLinear(4 * c.n_embd, c.n_embd, p.tp,
                            tp::RowParallelOptions{.sequence_parallel = p.sequence_parallel}));
}

torch::Tensor BlockImpl::forward(torch::Tensor x) {
  x = x + attn->forward(norm(ln1, x, parallel_));
  return x + fc_proj->forward(torch::gelu(fc->forward(norm(ln2, x, parallel_))));
}

GptImpl::GptImpl(const GptConfig& c, const GptParallel& p) : config_(c), parallel_(p) {
  LOOM_CHECK(c.vocab_size > 0 && c.seq_len > 0 && c.n_layer > 0 && c.n_embd > 0, loom::ConfigError,
             "GPT config needs positive vocab_size, seq_len, n_layer, n_embd");
  LOOM_CHECK(c.vocab_size % tp_size(p) == 0, loom::ConfigError, "the vocabulary size (",
             c.vocab_size, ") must be a multiple of parallel.tp (", tp_size(p),
             "): each tensor-parallel rank holds an equal share of the embedding");
  wte = register_module(
      "wte", tp::VocabParallelEmbedding(c.vocab_size, c.n_embd, p.tp, p.sequence_parallel));
  wpe = register_module("wpe", torch::nn::Embedding(c.seq_len, c.n_embd));
  blocks = register_module("blocks", torch::nn::Sequential());
  for (int64_t i = 0; i < c.n_layer; ++i) blocks->push_back(Block(c, p));
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})));

  // Each parameter's whole tensor is drawn, in named_parameters() order, and this rank keeps
  // its shard: the same weights at every tp size.
  torch::NoGradGuard no_grad;
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(c.n_layer));
  for (tp::ShardedParameter& param : tp::sharded_parameters(*this)) {
    const std::string& name = param.name;
    if (name.find("ln") != std::string::npos) continue;  // LayerNorm keeps weight 1, bias 0
    torch::Tensor full =
        torch::empty(tp::full_shape(param.tensor, param.spec, p.tp), param.tensor.options());
    if (full.dim() == 1) {
      full.zero_();
    } else if (name.find("proj.weight") != std::string::npos) {  // attn.proj and fc_proj
      full.normal_(0.0, residual_std);
    } else {
      full.normal_(0.0, 0.02);
    }
    param.tensor.copy_(param.spec.replicated()
                           ? full
                           : tp::shard(full, param.spec.dim, p.tp, param.spec.partitions));
  }
}

torch::Tensor GptImpl::forward_stage(const torch::Tensor& input, int64_t begin, int64_t end) {
  torch::Tensor x = input;
  if (begin == 0) {
    const int64_t T = input.size(1);
    LOOM_CHECK(T <= config_.seq_len, loom::InvalidArgument, "GPT input of ", T,
               " tokens is longer than model.seq_len ", config_.seq_len);
    auto positions = torch::arange(T, input.options().dtype(torch::kLong));
    if (parallel_.sequence_parallel && tp_size(parallel_) > 1) {
      // wte reduce-scatters its rows along the sequence; this rank's positions of wpe, whose
      // gradient copy_to_region sums over the ranks.
      LOOM_CHECK(T % tp_size(parallel_) == 0, loom::InvalidArgument, "GPT input of ", T,
                 " tokens under sequence parallelism over ", tp_size(parallel_),
                 " ranks: the length must be a multiple of parallel.tp");
      const int64_t piece = T / tp_size(parallel_);
      x = wte->forward(input) +
          torch::embedding(tp::copy_to_region(wpe->weight, parallel_.tp),
                           positions.narrow(0, piece * parallel_.tp->rank(), piece));
    } else {
      x = wte->forward(input) + wpe->forward(positions);
    }
  }
  // The blocks through the Sequential's modules (what blocks->forward does), so wrapped blocks
  // (FSDP units, activation checkpointing) run as they do there.
  for (auto it = blocks->begin() + begin; it != blocks->begin() + end; ++it) x = it->forward(x);
  if (end == config_.n_layer) x = local_logits(norm(ln_f, x, parallel_));
  return x;
}

std::vector<torch::Tensor> GptImpl::stage_parameters(int64_t begin, int64_t end) {
  std::vector<torch::Tensor> out;
  if (begin == 0 || end == config_.n_layer) out.push_back(wte->weight);
  if (begin == 0) out.push_back(wpe->weight);
  for (int64_t i = begin; i < end; ++i) {
    for (const auto& p : blocks[static_cast<size_t>(i)]->parameters()) out.push_back(p);
  }
  if (end == config_.n_layer) {
    for (const auto& p : ln_f->parameters()) out.push_back(p);
  }
  return out;
}

std::vector<std::string> GptImpl::keep_layers(
    const std::vector<std::pair<int64_t, int64_t>>& chunks) {
  std::vector<bool> kept(static_cast<size_t>(config_.n_layer), false);
  bool first = false, last = false;
  for (const auto& [begin, end] : chunks) {
    for (int64_t i = begin; i < end; ++i) kept[static_cast<size_t>(i)] = true;
    first = first || begin == 0;
    last = last || end == config_.n_layer;
  }
  auto free = [](torch::nn::Module& module) {  // its memory, now that no forward uses it
    for (at::Tensor& t : module.parameters()) t.set_data(torch::empty({0}, t.options()));
  };
  auto drop = [&](torch::nn::Module& module, const std::string& name) {
    free(module);
    unregister_module(name);
  };
  const auto children = blocks->named_children();
  auto element = blocks->begin();
  for (size_t i = 0; i < kept.size(); ++i, ++element) {
    if (kept[i]) continue;
    free(*element->ptr());
    torch::nn::Identity empty;
    *element = torch::nn::AnyModule(empty);
    blocks->replace_module(children[i].key(), empty.ptr());
  }
  if (!first) drop(*wpe, "wpe");
  if (!last) drop(*ln_f, "ln_f");
  if (!first && !last) drop(*wte, "wte");
  if (first != last) return {"wte.weight"};
  return {};
}

std::pair<int64_t, int64_t> GptImpl::stage_layers(const GptConfig& c, int stage, int stages) {
  LOOM_CHECK(stages >= 1 && c.n_layer % stages == 0, loom::ConfigError, "model.n_layer (",
             c.n_layer, ") does not divide into ", stages,
             " pipeline stages; choose a layer count that is a multiple of the stages");
  LOOM_CHECK(stage >= 0 && stage < stages, loom::InvalidArgument, "pipeline stage ", stage, " of ",
             stages);
  const int64_t per = c.n_layer / stages;
  return {per * stage, per * (stage + 1)};
}

torch::Tensor GptImpl::local_logits(const torch::Tensor& h) {
  // The head tied to the embedding: this rank's vocabulary rows; its input replicated (or
  // gathered along the sequence) with the gradient summed over the ranks.
  const torch::Tensor input = parallel_.sequence_parallel ? tp::gather_sequence(h, 1, parallel_.tp)
                                                          : tp::copy_to_region(h, parallel_.tp);
  return torch::matmul(input, wte->weight.t());
}

torch::Tensor GptImpl::forward(const torch::Tensor& idx) {
  return tp::gather_from_region(forward_stage(idx, 0, config_.n_layer), -1, parallel_.tp);
}

torch::Tensor GptImpl::loss_from_logits(const torch::Tensor& local, const torch::Tensor& targets) {
  // The log-softmax in fp32 whatever the parameters' dtype (a no-op for fp32 models).
  auto logits = local.to(torch::kFloat);
  if (tp_size(parallel_) == 1) {
    return torch::cross_entropy_loss(logits.view({-1, logits.size(-1)}), targets.reshape({-1}));
  }
  return tp::vocab_parallel_cross_entropy(logits, targets, wte->vocab_begin(), parallel_.tp).mean();
}

torch::Tensor GptImpl::loss(const torch::Tensor& idx, const torch::Tensor& targets) {
  return loss_from_logits(forward_stage(idx, 0, config_.n_layer), targets);
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
    // Sequence parallelism splits the positions over the tp ranks: pad the context on the right
    // to a multiple of them. Attention is causal, so the real positions do not see the padding.
    const auto length = static_cast<int64_t>(context.size());
    if (parallel_.sequence_parallel && tp_size(parallel_) > 1 && length % tp_size(parallel_) != 0) {
      input = torch::constant_pad_nd(input, {0, tp_size(parallel_) - length % tp_size(parallel_)});
    }
    auto logits = forward(input)[0][length - 1] / temperature;  // the last real position's
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

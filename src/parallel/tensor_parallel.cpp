// Tensor and sequence parallelism: the region autograd functions over a comm::Group, the
// sharded layers and the vocabulary-parallel cross-entropy.
#include "loom/parallel/tensor_parallel.h"

#include <torch/autograd.h>

#include <cmath>

#include "loom/error.h"

namespace loom::parallel::tp {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool parallel(const comm::Group* group) { return group != nullptr && group->size() > 1; }

// A group pointer and a timeout through AutogradContext::saved_data.
void save(AutogradContext* ctx, comm::Group* group, milliseconds timeout, int64_t dim = 0) {
  ctx->saved_data["group"] = reinterpret_cast<int64_t>(group);
  ctx->saved_data["timeout"] = static_cast<int64_t>(timeout.count());
  ctx->saved_data["dim"] = dim;
}
comm::Group& group_of(AutogradContext* ctx) {
  return *reinterpret_cast<comm::Group*>(ctx->saved_data["group"].toInt());
}
milliseconds timeout_of(AutogradContext* ctx) {
  return milliseconds(ctx->saved_data["timeout"].toInt());
}
int64_t dim_of(AutogradContext* ctx) { return ctx->saved_data["dim"].toInt(); }

// The blocking collectives, on copies: a region never changes its input in place.
at::Tensor all_reduce_sum(const at::Tensor& x, comm::Group& group, milliseconds timeout) {
  at::Tensor out = x.contiguous().clone();
  group.all_reduce(out)->wait(timeout);
  return out;
}

at::Tensor all_gather_along(const at::Tensor& x, int64_t dim, comm::Group& group,
                            milliseconds timeout) {
  const at::Tensor front = x.movedim(dim, 0).contiguous();
  std::vector<int64_t> sizes = front.sizes().vec();
  sizes[0] *= group.size();
  at::Tensor out = at::empty(sizes, front.options());
  group.all_gather(out, front)->wait(timeout);
  return out.movedim(0, dim).contiguous();
}

at::Tensor reduce_scatter_along(const at::Tensor& x, int64_t dim, comm::Group& group,
                                milliseconds timeout) {
  LOOM_CHECK(x.size(dim) % group.size() == 0, InvalidArgument, "reduce-scatter along dim ", dim,
             " of size ", x.size(dim), " over ", group.size(), " ranks of group ", group.name(),
             ": the size must be divisible by the group size");
  const at::Tensor front = x.movedim(dim, 0).contiguous();
  std::vector<int64_t> sizes = front.sizes().vec();
  sizes[0] /= group.size();
  at::Tensor out = at::empty(sizes, front.options());
  group.reduce_scatter(out, front)->wait(timeout);
  return out.movedim(0, dim).contiguous();
}

at::Tensor piece_along(const at::Tensor& x, int64_t dim, comm::Group& group) {
  LOOM_CHECK(x.size(dim) % group.size() == 0, InvalidArgument, "splitting dim ", dim, " of size ",
             x.size(dim), " over ", group.size(), " ranks of group ", group.name(),
             ": the size must be divisible by the group size");
  return x.chunk(group.size(), dim)[group.rank()].contiguous();
}

struct CopyToRegion : torch::autograd::Function<CopyToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, comm::Group* group,
                            milliseconds timeout) {
    save(ctx, group, timeout);
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {all_reduce_sum(grad[0], group_of(ctx), timeout_of(ctx)), at::Tensor(), at::Tensor()};
  }
};

struct ReduceFromRegion : torch::autograd::Function<ReduceFromRegion> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, comm::Group* group,
                            milliseconds timeout) {
    return all_reduce_sum(x, *group, timeout);
  }
  static variable_list backward(AutogradContext*, variable_list grad) {
    return {grad[0], at::Tensor(), at::Tensor()};
  }
};

struct GatherFromRegion : torch::autograd::Function<GatherFromRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim,
                            comm::Group* group, milliseconds timeout) {
    save(ctx, group, timeout, dim);
    return all_gather_along(x, dim, *group, timeout);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {piece_along(grad[0], dim_of(ctx), group_of(ctx)), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

struct ScatterToRegion : torch::autograd::Function<ScatterToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim,
                            comm::Group* group, milliseconds timeout) {
    save(ctx, group, timeout, dim);
    return piece_along(x, dim, *group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {all_gather_along(grad[0], dim_of(ctx), group_of(ctx), timeout_of(ctx)), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

struct GatherSequence : torch::autograd::Function<GatherSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim,
                            comm::Group* group, milliseconds timeout) {
    save(ctx, group, timeout, dim);
    return all_gather_along(x, dim, *group, timeout);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {reduce_scatter_along(grad[0], dim_of(ctx), group_of(ctx), timeout_of(ctx)),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct ReduceScatterSequence : torch::autograd::Function<ReduceScatterSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim,
                            comm::Group* group, milliseconds timeout) {
    save(ctx, group, timeout, dim);
    return reduce_scatter_along(x, dim, *group, timeout);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {all_gather_along(grad[0], dim_of(ctx), group_of(ctx), timeout_of(ctx)), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

int64_t size_of(const comm::Group* group) { return group == nullptr ? 1 : group->size(); }
int64_t rank_of(const comm::Group* group) { return group == nullptr ? 0 : group->rank(); }

void check_divisible(const std::string& layer, const std::string& what, int64_t n, int64_t divisor,
                     const comm::Group* group) {
  LOOM_CHECK(n % divisor == 0, InvalidArgument, layer, ": ", what, " ", n, " is not divisible by ",
             divisor, " (the tensor-parallel size ", size_of(group),
             divisor == size_of(group) ? "" : " times the partitions", "); choose a multiple");
}

}  // namespace

at::Tensor copy_to_region(const at::Tensor& x, comm::Group* group, milliseconds timeout) {
  if (!parallel(group)) return x;
  return CopyToRegion::apply(x, group, timeout);
}

at::Tensor reduce_from_region(const at::Tensor& x, comm::Group* group, milliseconds timeout) {
  if (!parallel(group)) return x;
  return ReduceFromRegion::apply(x, group, timeout);
}

at::Tensor gather_from_region(const at::Tensor& x, int64_t dim, comm::Group* group,
                              milliseconds timeout) {
  if (!parallel(group)) return x;
  return GatherFromRegion::apply(x, dim < 0 ? dim + x.dim() : dim, group, timeout);
}

at::Tensor scatter_to_region(const at::Tensor& x, int64_t dim, comm::Group* group,
                             milliseconds timeout) {
  if (!parallel(group)) return x;
  return ScatterToRegion::apply(x, dim < 0 ? dim + x.dim() : dim, group, timeout);
}

at::Tensor gather_sequence(const at::Tensor& x, int64_t dim, comm::Group* group,
                           milliseconds timeout) {
  if (!parallel(group)) return x;
  return GatherSequence::apply(x, dim < 0 ? dim + x.dim() : dim, group, timeout);
}

at::Tensor reduce_scatter_sequence(const at::Tensor& x, int64_t dim, comm::Group* group,
                                   milliseconds timeout) {
  if (!parallel(group)) return x;
  return ReduceScatterSequence::apply(x, dim < 0 ? dim + x.dim() : dim, group, timeout);
}

at::Tensor shard(const at::Tensor& full, int64_t dim, const comm::Group* group, int64_t partitions,
                 const std::string& what) {
  const int64_t n = size_of(group);
  if (dim < 0) dim += full.dim();
  LOOM_CHECK(dim >= 0 && dim < full.dim(), InvalidArgument, what, ": dim ", dim,
             " is outside a tensor of ", full.dim(), " dims");
  check_divisible(what, "dim " + std::to_string(dim) + " of size", full.size(dim), partitions * n,
                  group);
  if (n == 1) return full.contiguous();
  std::vector<at::Tensor> pieces;
  for (const at::Tensor& section : full.chunk(partitions, dim)) {
    pieces.push_back(section.chunk(n, dim)[rank_of(group)]);
  }
  return at::cat(pieces, dim).contiguous();
}

ShardSpec shard_spec(const torch::nn::Module& module, const std::string& name) {
  if (const auto* column = dynamic_cast<const ColumnParallelLinearImpl*>(&module)) {
    return {.dim = 0, .partitions = column->options().partitions};
  }
  if (dynamic_cast<const RowParallelLinearImpl*>(&module) != nullptr) {
    return name == "weight" ? ShardSpec{.dim = 1} : ShardSpec{};
  }
  if (dynamic_cast<const VocabParallelEmbeddingImpl*>(&module) != nullptr) return {.dim = 0};
  return {};
}

std::vector<ShardedParameter> sharded_parameters(const torch::nn::Module& root) {
  std::vector<ShardedParameter> out;
  auto add_own = [&](const std::string& prefix, const torch::nn::Module& module) {
    for (const auto& item : module.named_parameters(/*recurse=*/false)) {
      out.push_back({prefix.empty() ? item.key() : prefix + "." + item.key(), item.value(),
                     shard_spec(module, item.key())});
    }
  };
  add_own("", root);
  // Pre-order, as named_parameters() visits them; without the root (not yet in a shared_ptr
  // while it is being constructed).
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    add_own(item.key(), *item.value());
  }
  return out;
}

std::vector<int64_t> full_shape(const at::Tensor& local, const ShardSpec& spec,
                                const comm::Group* group) {
  std::vector<int64_t> shape = local.sizes().vec();
  if (!spec.replicated()) shape[static_cast<size_t>(spec.dim)] *= size_of(group);
  return shape;
}

ckpt::Sharding checkpoint_piece(const at::Tensor& local, const ShardSpec& spec,
                                const comm::Group* group) {
  const std::vector<int64_t> whole = full_shape(local, spec, group);
  if (spec.replicated() || size_of(group) == 1) {
    return ckpt::Sharding::block(whole, std::vector<int64_t>(whole.size(), 0), whole);
  }
  // The view splits dim d into [partitions, section]; this rank's rows of every section.
  const auto d = static_cast<size_t>(spec.dim);
  std::vector<int64_t> view, offsets, sizes;
  for (size_t i = 0; i < whole.size(); ++i) {
    if (i != d) {
      view.push_back(whole[i]);
      offsets.push_back(0);
      sizes.push_back(whole[i]);
      continue;
    }
    const int64_t piece = local.size(spec.dim) / spec.partitions;
    view.insert(view.end(), {spec.partitions, whole[i] / spec.partitions});
    offsets.insert(offsets.end(), {0, piece * group->rank()});
    sizes.insert(sizes.end(), {spec.partitions, piece});
  }
  return ckpt::Sharding::block(whole, std::move(offsets), std::move(sizes), std::move(view));
}

double grad_norm(const std::vector<ShardedParameter>& params, comm::Group* tp, comm::Group* pp,
                 milliseconds timeout) {
  // [sharded, replicated] sums of squares, in double, on the gradients' device (a device
  // group takes device tensors).
  at::Device device = at::kCPU;
  for (const ShardedParameter& p : params) {
    if (p.tensor.grad().defined()) device = p.tensor.grad().device();
  }
  at::Tensor sums = torch::zeros({2}, torch::dtype(torch::kDouble).device(device));
  for (const ShardedParameter& p : params) {
    const at::Tensor& g = p.tensor.grad();
    if (!g.defined()) continue;
    sums[p.spec.replicated() ? 1 : 0] += g.detach().to(torch::kDouble).square().sum();
  }
  at::Tensor sharded = sums.narrow(0, 0, 1).contiguous();
  if (parallel(tp)) tp->all_reduce(sharded)->wait(timeout);
  at::Tensor total = sharded + sums.narrow(0, 1, 1);
  if (parallel(pp)) pp->all_reduce(total)->wait(timeout);
  return std::sqrt(total.item<double>());
}

double clip_grad_norm(const std::vector<ShardedParameter>& params, double max_norm, comm::Group* tp,
                      comm::Group* pp, milliseconds timeout) {
  const double norm = grad_norm(params, tp, pp, timeout);
  const double coefficient = max_norm / (norm + 1e-6);
  if (coefficient < 1) {
    torch::NoGradGuard no_grad;
    for (const ShardedParameter& p : params) {
      if (p.tensor.grad().defined()) p.tensor.mutable_grad().mul_(coefficient);
    }
  }
  return norm;
}

// ---- ColumnParallelLinear ----

ColumnParallelLinearImpl::ColumnParallelLinearImpl(int64_t in, int64_t out, comm::Group* group,
                                                   ColumnParallelOptions options)
    : in_features(in), out_features(out), group_(group), options_(options) {
  check_divisible("ColumnParallelLinear(" + std::to_string(in) + ", " + std::to_string(out) + ")",
                  "out_features", out, options.partitions * size_of(group), group);
  weight = register_parameter("weight", torch::empty({out / size_of(group), in}));
  if (options.bias) bias = register_parameter("bias", torch::empty({out / size_of(group)}));
  // torch::nn::Linear's initialisation of the full layer, then this rank's shard: the same
  // weights at any tensor-parallel size for the same generator state.
  torch::nn::Linear full(torch::nn::LinearOptions(in, out).bias(options.bias));
  reset_from_full(full->weight, options.bias ? full->bias : at::Tensor());
}

void ColumnParallelLinearImpl::reset_from_full(const at::Tensor& w, const at::Tensor& b) {
  torch::NoGradGuard no_grad;
  const std::string what = "ColumnParallelLinear weight";
  LOOM_CHECK(w.dim() == 2 && w.size(0) == out_features && w.size(1) == in_features, InvalidArgument,
             what, ": the full weight must be [", out_features, ", ", in_features, "], got ",
             w.sizes());
  weight.copy_(shard(w, 0, group_, options_.partitions, what));
  if (bias.defined()) {
    LOOM_CHECK(b.defined() && b.dim() == 1 && b.size(0) == out_features, InvalidArgument,
               "ColumnParallelLinear bias: the full bias must be [", out_features, "]");
    bias.copy_(shard(b, 0, group_, options_.partitions, "ColumnParallelLinear bias"));
  }
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  const at::Tensor input = options_.sequence_parallel
                               ? gather_sequence(x, options_.sequence_dim, group_, options_.timeout)
                               : copy_to_region(x, group_, options_.timeout);
  at::Tensor y = torch::linear(input, weight, bias);
  if (options_.gather_output) {
    LOOM_CHECK(options_.partitions == 1, InvalidArgument,
               "ColumnParallelLinear: gather_output with ", options_.partitions,
               " partitions would interleave them; gather each partition instead");
    y = gather_from_region(y, -1, group_, options_.timeout);
  }
  return y;
}

// ---- RowParallelLinear ----

RowParallelLinearImpl::RowParallelLinearImpl(int64_t in, int64_t out, comm::Group* group,
                                             RowParallelOptions options)
    : in_features(in), out_features(out), group_(group), options_(options) {
  check_divisible("RowParallelLinear(" + std::to_string(in) + ", " + std::to_string(out) + ")",
                  "in_features", in, size_of(group), group);
  weight = register_parameter("weight", torch::empty({out, in / size_of(group)}));
  if (options.bias) bias = register_parameter("bias", torch::empty({out}));
  torch::nn::Linear full(torch::nn::LinearOptions(in, out).bias(options.bias));
  reset_from_full(full->weight, options.bias ? full->bias : at::Tensor());
}

void RowParallelLinearImpl::reset_from_full(const at::Tensor& w, const at::Tensor& b) {
  torch::NoGradGuard no_grad;
  const std::string what = "RowParallelLinear weight";
  LOOM_CHECK(w.dim() == 2 && w.size(0) == out_features && w.size(1) == in_features, InvalidArgument,
             what, ": the full weight must be [", out_features, ", ", in_features, "], got ",
             w.sizes());
  weight.copy_(shard(w, 1, group_, 1, what));
  if (bias.defined()) {
    LOOM_CHECK(b.defined() && b.dim() == 1 && b.size(0) == out_features, InvalidArgument,
               "RowParallelLinear bias: the full bias must be [", out_features, "]");
    bias.copy_(b);
  }
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& x) {
  if (!parallel(group_)) return torch::linear(x, weight, bias);
  const at::Tensor input =
      options_.input_is_parallel ? x : scatter_to_region(x, -1, group_, options_.timeout);
  const at::Tensor partial = torch::linear(input, weight);
  at::Tensor y =
      options_.sequence_parallel
          ? reduce_scatter_sequence(partial, options_.sequence_dim, group_, options_.timeout)
          : reduce_from_region(partial, group_, options_.timeout);
  if (!bias.defined()) return y;
  // Sequence parallel: the bias meets this rank's positions only; copy_to_region sums its
  // gradient over the ranks (every position's).
  return y + (options_.sequence_parallel ? copy_to_region(bias, group_, options_.timeout) : bias);
}

// ---- VocabParallelEmbedding ----

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(int64_t num, int64_t dim, comm::Group* group,
                                                       bool sequence_parallel, int64_t sequence_dim,
                                                       milliseconds timeout)
    : num_embeddings(num),
      embedding_dim(dim),
      group_(group),
      vocab_begin_(0),
      sequence_parallel_(sequence_parallel),
      sequence_dim_(sequence_dim),
      timeout_(timeout) {
  check_divisible(
      "VocabParallelEmbedding(" + std::to_string(num) + ", " + std::to_string(dim) + ")",
      "the vocabulary size", num, size_of(group), group);
  const int64_t local = num / size_of(group);
  vocab_begin_ = local * rank_of(group);
  weight = register_parameter("weight", torch::empty({local, dim}));
  torch::nn::Embedding full(num, dim);
  reset_from_full(full->weight);
}

void VocabParallelEmbeddingImpl::reset_from_full(const at::Tensor& w) {
  torch::NoGradGuard no_grad;
  LOOM_CHECK(w.dim() == 2 && w.size(0) == num_embeddings && w.size(1) == embedding_dim,
             InvalidArgument, "VocabParallelEmbedding weight: the full weight must be [",
             num_embeddings, ", ", embedding_dim, "], got ", w.sizes());
  weight.copy_(shard(w, 0, group_, 1, "VocabParallelEmbedding weight"));
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  if (!parallel(group_)) return torch::embedding(weight, ids);
  const at::Tensor outside = (ids < vocab_begin_) | (ids >= vocab_end());
  const at::Tensor local = (ids - vocab_begin_).masked_fill(outside, 0);
  const at::Tensor rows = torch::embedding(weight, local).masked_fill(outside.unsqueeze(-1), 0);
  return sequence_parallel_ ? reduce_scatter_sequence(rows, sequence_dim_, group_, timeout_)
                            : reduce_from_region(rows, group_, timeout_);
}

// ---- vocab_parallel_cross_entropy ----

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                        int64_t vocab_begin, comm::Group* group,
                                        milliseconds timeout) {
  LOOM_CHECK(logits.dim() == targets.dim() + 1 &&
                 logits.sizes().slice(0, targets.dim()) == targets.sizes(),
             InvalidArgument, "vocab_parallel_cross_entropy: logits ", logits.sizes(),
             " must be targets' shape ", targets.sizes(), " plus the vocabulary dim");
  const int64_t local = logits.size(-1);
  // The max over the whole vocabulary, for a stable exponential; its gradient cancels exactly
  // (log-sum-exp minus the target's logit does not depend on it), so it is a constant here.
  at::Tensor max = logits.detach().amax(-1, /*keepdim=*/true).contiguous();
  if (parallel(group)) {
    group->all_reduce(max, {.op = comm::ReduceOp::kMax})->wait(timeout);
  }
  const at::Tensor shifted = logits - max;
  const at::Tensor outside = (targets < vocab_begin) | (targets >= vocab_begin + local);
  const at::Tensor index = (targets - vocab_begin).masked_fill(outside, 0).unsqueeze(-1);
  const at::Tensor target_logit = shifted.gather(-1, index).squeeze(-1).masked_fill(outside, 0);
  // One all-reduce for both sums: [sum of exp, the target's logit] over the ranks.
  const at::Tensor both =
      reduce_from_region(at::stack({shifted.exp().sum(-1), target_logit}), group, timeout);
  return both[0].log() - both[1];
}

}  // namespace loom::parallel::tp

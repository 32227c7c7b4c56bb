// Tensor and sequence parallelism, Megatron's scheme: layers whose weights are split over the
// ranks of a tensor-parallel group, and the communication "regions" between them.
//
//   comm::Group& tp = mesh.group("tp");
//   ColumnParallelLinear fc(384, 1536, &tp);  // weight [1536 / tp, 384]; output split on the
//   RowParallelLinear proj(1536, 384, &tp);   // last dim; proj's input is split the same way
//   at::Tensor y = proj(torch::gelu(fc(x)));  // one all-reduce in forward, one in backward
//
// A column-parallel linear splits its output features (weight rows) over the ranks, a
// row-parallel one its input features (weight columns); a column-parallel layer followed by a
// row-parallel one needs one all-reduce in forward (after the row-parallel matmul) and one in
// backward (of the column-parallel layer's input gradient). The vocabulary-parallel embedding
// splits the vocabulary rows; vocab_parallel_cross_entropy takes logits split over the
// vocabulary and never gathers them. With sequence parallelism the activations between those
// pairs (LayerNorm, dropout, residual) are split along the sequence instead of replicated: the
// all-reduce becomes a reduce-scatter along the sequence and the entry an all-gather, the same
// bytes moved and 1/tp of the activation memory (Korthikanti et al., 2022).
//
// Every layer takes a `comm::Group*`: null (or a group of one rank) is the plain layer, bitwise
// torch::nn::Linear / Embedding. Parameter names are those of torch::nn::Linear and Embedding
// ("weight", "bias"), so a model keeps its names under any tensor-parallel size. A layer is
// initialised as torch's layer of the whole size would be (drawing the same numbers from torch's
// generator, which every rank seeds alike) and keeps its shard; reset_from_full(weight, bias)
// sets it from whole tensors that are the same on every rank. All communication is blocking (each
// call waits for its collective, up to `timeout`) and runs in the autograd order of backward, which
// is the same on every rank of a group for the same graph. The group must outlive the layers; a
// layer is used from one thread at a time.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <cstdint>

#include "loom/ckpt/state.h"
#include "loom/comm/group.h"
#include "loom/visibility.h"

namespace loom::parallel::tp {

using std::chrono::milliseconds;

// The regions, each an autograd function over `group` (null: the identity both ways).
// Forward identity, backward all-reduce of the gradient: where a replicated input enters
// column-parallel layers.
LOOM_API at::Tensor copy_to_region(const at::Tensor& x, comm::Group* group,
                                   milliseconds timeout = comm::kDefaultCollectiveTimeout);
// Forward all-reduce (sum), backward identity: after row-parallel layers.
LOOM_API at::Tensor reduce_from_region(const at::Tensor& x, comm::Group* group,
                                       milliseconds timeout = comm::kDefaultCollectiveTimeout);
// Forward all-gather along `dim` (every rank's piece, in rank order), backward this rank's
// piece of the gradient.
LOOM_API at::Tensor gather_from_region(const at::Tensor& x, int64_t dim, comm::Group* group,
                                       milliseconds timeout = comm::kDefaultCollectiveTimeout);
// Forward this rank's piece along `dim`, backward all-gather of the gradient.
LOOM_API at::Tensor scatter_to_region(const at::Tensor& x, int64_t dim, comm::Group* group,
                                      milliseconds timeout = comm::kDefaultCollectiveTimeout);
// Sequence parallelism: forward all-gather along `dim`, backward reduce-scatter of the
// gradient along it (where sequence-split activations enter column-parallel layers).
LOOM_API at::Tensor gather_sequence(const at::Tensor& x, int64_t dim, comm::Group* group,
                                    milliseconds timeout = comm::kDefaultCollectiveTimeout);
// Forward reduce-scatter (sum) along `dim`, backward all-gather (after row-parallel layers).
LOOM_API at::Tensor reduce_scatter_sequence(const at::Tensor& x, int64_t dim, comm::Group* group,
                                            milliseconds timeout = comm::kDefaultCollectiveTimeout);

// This rank's piece along `dim` of a tensor that is the same on every rank: the dim is cut
// into `partitions` equal sections and the rank takes its 1/size of each, concatenated (a
// fused [q; k; v] weight keeps each rank's heads of all three with partitions = 3).
// InvalidArgument naming `what`, the dim's size and the group's size when it does not divide.
LOOM_API at::Tensor shard(const at::Tensor& full, int64_t dim, const comm::Group* group,
                          int64_t partitions = 1, const std::string& what = "tensor");

// How a parameter is split over the ranks: along `dim`, in `partitions` sections each cut into
// group-size pieces (shard()'s arguments); dim -1: replicated.
struct ShardSpec {
  int64_t dim = -1;
  int64_t partitions = 1;
  bool replicated() const { return dim < 0; }
};
// The split of `module`'s own parameter `name` ("weight", "bias"): the rules of the layers
// below for them, replicated for every other module.
LOOM_API ShardSpec shard_spec(const torch::nn::Module& module, const std::string& name);
// A parameter of a module tree with its dotted name and split.
struct ShardedParameter {
  std::string name;  // as named_parameters() names it
  at::Tensor tensor;
  ShardSpec spec;
};
// Every parameter of `root`, in named_parameters() order, with its split. Usable inside the
// root's constructor (it does not need the root in a shared_ptr).
LOOM_API std::vector<ShardedParameter> sharded_parameters(const torch::nn::Module& root);
// The shape of the whole tensor of which `local` is this rank's piece under `spec`.
LOOM_API std::vector<int64_t> full_shape(const at::Tensor& local, const ShardSpec& spec,
                                         const comm::Group* group);

// This rank's `local` piece under `spec` as a checkpoint piece of the whole tensor
// (loom/ckpt/state.h): a block along spec.dim, each partition's section separated by the view,
// or the whole tensor when replicated (Sharding::block either way; `written` left true).
LOOM_API ckpt::Sharding checkpoint_piece(const at::Tensor& local, const ShardSpec& spec,
                                         const comm::Group* group);

// The 2-norm of the gradients of a model split by tensor parallelism over `tp` and, with `pp`,
// into pipeline stages: the squares of sharded parameters' gradients summed over tp, those of
// replicated ones counted once, every stage's summed over pp. `params` are this rank's
// parameters with their splits (sharded_parameters(), or a stage's part of them); across a
// pipeline each parameter must be listed on one stage only (a tied embedding on the first,
// not again on the last). Parameters without a gradient count 0. Collective over tp and pp; the
// same value on every rank.
LOOM_API double grad_norm(const std::vector<ShardedParameter>& params, comm::Group* tp,
                          comm::Group* pp = nullptr,
                          milliseconds timeout = comm::kDefaultCollectiveTimeout);
// torch::nn::utils::clip_grad_norm_'s rule on that norm: every gradient in `params` is scaled by
// min(1, max_norm / (norm + 1e-6)). Returns the norm before clipping.
LOOM_API double clip_grad_norm(const std::vector<ShardedParameter>& params, double max_norm,
                               comm::Group* tp, comm::Group* pp = nullptr,
                               milliseconds timeout = comm::kDefaultCollectiveTimeout);

struct ColumnParallelOptions {
  bool bias = true;
  // Gather the output along its last dim so every rank has all features (the usual last
  // layer); false keeps each rank's features for a following row-parallel layer.
  bool gather_output = false;
  // The input is split along `sequence_dim` (sequence parallelism) and is all-gathered first.
  bool sequence_parallel = false;
  int64_t sequence_dim = 1;  // [batch, sequence, features]
  // Sections of the output features sharded separately (3 for a fused q, k, v projection).
  int64_t partitions = 1;
  milliseconds timeout = comm::kDefaultCollectiveTimeout;
};

// y = x W^T + b with W [out / size, in] on each rank: this rank's output features.
class LOOM_API ColumnParallelLinearImpl : public torch::nn::Module {
 public:
  // InvalidArgument naming the layer's sizes when out_features is not divisible by
  // partitions * group size.
  ColumnParallelLinearImpl(int64_t in_features, int64_t out_features, comm::Group* group,
                           ColumnParallelOptions options = {});
  at::Tensor forward(const at::Tensor& x);
  // Sets the weight [out, in] and bias [out] from the full tensors (the same on every rank).
  void reset_from_full(const at::Tensor& weight, const at::Tensor& bias);
  const ColumnParallelOptions& options() const { return options_; }

  at::Tensor weight, bias;  // [out / size, in], [out / size] (undefined without bias)
  int64_t in_features, out_features;

 private:
  comm::Group* group_;
  ColumnParallelOptions options_;
};
TORCH_MODULE(ColumnParallelLinear);

struct RowParallelOptions {
  bool bias = true;  // added once, after the reduction (replicated)
  // The input is already split along its last dim (a column-parallel layer's output); false
  // scatters a replicated input first.
  bool input_is_parallel = true;
  // Reduce-scatter the output along `sequence_dim` instead of all-reducing it.
  bool sequence_parallel = false;
  int64_t sequence_dim = 1;
  milliseconds timeout = comm::kDefaultCollectiveTimeout;
};

// y = sum over ranks of x_r W_r^T, + b, with W_r [out, in / size]: every rank gets all output
// features (or, sequence parallel, its piece of the sequence).
class LOOM_API RowParallelLinearImpl : public torch::nn::Module {
 public:
  RowParallelLinearImpl(int64_t in_features, int64_t out_features, comm::Group* group,
                        RowParallelOptions options = {});
  at::Tensor forward(const at::Tensor& x);
  void reset_from_full(const at::Tensor& weight, const at::Tensor& bias);

  at::Tensor weight, bias;  // [out, in / size], [out] (undefined without bias)
  int64_t in_features, out_features;

 private:
  comm::Group* group_;
  RowParallelOptions options_;
};
TORCH_MODULE(RowParallelLinear);

// An embedding whose rows (the vocabulary) are split over the ranks: rank r holds ids
// [r * V / size, (r + 1) * V / size); each rank looks up the ids it holds, zeros elsewhere,
// and one all-reduce (or, sequence parallel, a reduce-scatter along the sequence) sums them.
class LOOM_API VocabParallelEmbeddingImpl : public torch::nn::Module {
 public:
  VocabParallelEmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim, comm::Group* group,
                             bool sequence_parallel = false, int64_t sequence_dim = 1,
                             milliseconds timeout = comm::kDefaultCollectiveTimeout);
  at::Tensor forward(const at::Tensor& ids);
  void reset_from_full(const at::Tensor& weight);
  // [first, end) of the vocabulary this rank holds.
  int64_t vocab_begin() const { return vocab_begin_; }
  int64_t vocab_end() const { return vocab_begin_ + weight.size(0); }

  at::Tensor weight;  // [V / size, dim]
  int64_t num_embeddings, embedding_dim;

 private:
  comm::Group* group_;
  int64_t vocab_begin_;
  bool sequence_parallel_;
  int64_t sequence_dim_;
  milliseconds timeout_;
};
TORCH_MODULE(VocabParallelEmbedding);

// The cross-entropy of every position from logits split over the vocabulary: `logits` [..., V
// / size] holds this rank's vocabulary range [vocab_begin, vocab_begin + V / size), `targets`
// [...] global ids. Returns the per-position loss [...] (not reduced), the same on every rank,
// in logits' dtype. Two all-reduces (the max, then the sum of exponentials with the target's
// logit); the full logits are never gathered. Gradients flow to `logits` (softmax minus the
// one-hot target, this rank's columns).
LOOM_API at::Tensor vocab_parallel_cross_entropy(
    const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_begin, comm::Group* group,
    milliseconds timeout = comm::kDefaultCollectiveTimeout);

}  // namespace loom::parallel::tp

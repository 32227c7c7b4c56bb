// Tensor and sequence parallelism with ranks as threads, W = 1, 2, 4: each region's forward and
// backward on integer-valued floats (exact, so bitwise), the column- then row-parallel MLP and
// its sequence-parallel form against the unsharded torch layers per element, the
// vocabulary-parallel embedding (bitwise) and cross-entropy against torch's, and bad sizes.

#include "loom/parallel/tensor_parallel.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include "harness/harness.h"
#include "loom/comm/gloo.h"
#include "loom/error.h"
#include "unit/parallel/equivalence.h"

namespace loom::parallel::tp {
namespace {

using loom::testing::expect_all_ok;
using loom::testing::Rank;
using loom::testing::run_threads;
using loom::testing::parallel::expect_close_per_element;

std::unique_ptr<comm::Group> make_group(Rank& r) {
  comm::GlooOptions options;
  options.connect_timeout = std::chrono::seconds(20);
  return comm::new_gloo_group(r.store, r.rank, r.world, options);
}

at::Tensor randn(std::vector<int64_t> shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen);
}

class TensorParallel : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { torch::set_num_threads(1); }  // process-wide: ranks are threads
};

TEST_P(TensorParallel, RegionsMoveWhatTheirDefinitionsSay) {
  const int world = GetParam();
  expect_all_ok(run_threads(world, [&](Rank& r) {
    auto group = make_group(r);
    comm::Group* g = group.get();
    const int64_t W = world, R = r.rank;
    // Rank r's tensor: [2, 4W] of integers (exact in fp32 through sums of a few of them).
    auto of_rank = [&](int64_t rank) {
      return torch::arange(8 * W, torch::kFloat).view({2, 4 * W}) +
             100.0 * static_cast<double>(rank);
    };
    auto coefficient = [&](int64_t rank) { return static_cast<double>(rank + 1); };
    at::Tensor sum_of_all = torch::zeros({2, 4 * W});
    std::vector<at::Tensor> every;
    for (int64_t k = 0; k < W; ++k) {
      sum_of_all += of_rank(k);
      every.push_back(of_rank(k));
    }
    double sum_of_coefficients = 0;
    for (int64_t k = 0; k < W; ++k) sum_of_coefficients += coefficient(k);
    auto input = [&] { return of_rank(R).requires_grad_(true); };

    {  // copy_to_region: identity forward; the gradients of every rank summed in backward.
      at::Tensor x = input();
      at::Tensor y = copy_to_region(x, g);
      EXPECT_TRUE(y.equal(of_rank(R)));
      (y * coefficient(R)).sum().backward();
      EXPECT_TRUE(x.grad().equal(torch::full({2, 4 * W}, sum_of_coefficients)));
    }
    {  // reduce_from_region: the sum forward; identity backward.
      at::Tensor x = input();
      at::Tensor y = reduce_from_region(x, g);
      EXPECT_TRUE(y.equal(sum_of_all));
      (y * coefficient(R)).sum().backward();
      EXPECT_TRUE(x.grad().equal(torch::full({2, 4 * W}, coefficient(R))));
    }
    {  // gather_from_region along dim 1: every rank's piece in rank order; backward the piece.
      at::Tensor x = input();
      at::Tensor y = gather_from_region(x, 1, g);
      EXPECT_TRUE(y.equal(at::cat(every, 1)));
      (y * torch::arange(y.numel(), torch::kFloat).view(y.sizes())).sum().backward();
      EXPECT_TRUE(
          x.grad().equal(torch::arange(y.numel(), torch::kFloat).view(y.sizes()).chunk(W, 1)[R]));
    }
    {  // scatter_to_region: this rank's piece; backward every rank's gradient gathered.
      at::Tensor x = input();
      at::Tensor y = scatter_to_region(x, -1, g);
      EXPECT_TRUE(y.equal(of_rank(R).chunk(W, 1)[R]));
      (y * coefficient(R)).sum().backward();
      std::vector<at::Tensor> pieces;
      for (int64_t k = 0; k < W; ++k) pieces.push_back(torch::full({2, 4}, coefficient(k)));
      EXPECT_TRUE(x.grad().equal(at::cat(pieces, 1)));
    }
    {  // gather_sequence along dim 1: the gather forward; the gradients reduce-scattered.
      at::Tensor x = input();
      at::Tensor y = gather_sequence(x, 1, g);
      EXPECT_TRUE(y.equal(at::cat(every, 1)));
      (y * coefficient(R)).sum().backward();
      EXPECT_TRUE(x.grad().equal(torch::full({2, 4 * W}, sum_of_coefficients)));
    }
    {  // reduce_scatter_sequence along dim 1: this rank's piece of the sum; backward gathered.
      at::Tensor x = input();
      at::Tensor y = reduce_scatter_sequence(x, 1, g);
      EXPECT_TRUE(y.equal(sum_of_all.chunk(W, 1)[R]));
      (y * coefficient(R)).sum().backward();
      std::vector<at::Tensor> pieces;
      for (int64_t k = 0; k < W; ++k) pieces.push_back(torch::full({2, 4}, coefficient(k)));
      EXPECT_TRUE(x.grad().equal(at::cat(pieces, 1)));
    }
  }));
}

// The unsharded block the tensor-parallel one must match: LayerNorm, Linear(C, 4C), GELU,
// Linear(4C, C), on [B, T, C].
struct PlainMlp {
  torch::nn::LayerNorm ln{torch::nn::LayerNormOptions({16})};
  torch::nn::Linear fc{16, 64}, proj{64, 16};
  PlainMlp() {
    // From fixed seeds (torch's global generator is shared by the rank threads). Not the
    // default LayerNorm: weight 1 and bias 0 would hide a wrong reduction of their gradients.
    torch::NoGradGuard no_grad;
    ln->weight.copy_(1.0 + 0.1 * randn({16}, 11));
    ln->bias.copy_(0.1 * randn({16}, 12));
    fc->weight.copy_(0.25 * randn({64, 16}, 13));
    fc->bias.copy_(0.1 * randn({64}, 14));
    proj->weight.copy_(0.125 * randn({16, 64}, 15));
    proj->bias.copy_(0.1 * randn({16}, 16));
  }
  at::Tensor forward(const at::Tensor& x) { return proj(torch::gelu(fc(ln(x)))); }
};

TEST_P(TensorParallel, ColumnThenRowParallelMlpMatchesTheUnshardedLayers) {
  const int world = GetParam();
  expect_all_ok(run_threads(world, [&](Rank& r) {
    auto group = make_group(r);
    comm::Group* g = group.get();
    for (const bool sequence_parallel : {false, true}) {
      const std::string what = sequence_parallel ? "sequence parallel" : "tensor parallel";
      PlainMlp plain;
      const at::Tensor x = randn({2, 8, 16}, 21), target = randn({2, 8, 16}, 22);
      at::Tensor x_plain = x.clone().requires_grad_(true);
      const at::Tensor y_plain = plain.forward(x_plain);
      (y_plain * target).sum().backward();

      torch::nn::LayerNorm ln(torch::nn::LayerNormOptions({16}));
      ColumnParallelLinear fc(16, 64, g,
                              ColumnParallelOptions{.sequence_parallel = sequence_parallel});
      RowParallelLinear proj(64, 16, g, RowParallelOptions{.sequence_parallel = sequence_parallel});
      {
        torch::NoGradGuard no_grad;
        ln->weight.copy_(plain.ln->weight);
        ln->bias.copy_(plain.ln->bias);
      }
      fc->reset_from_full(plain.fc->weight, plain.fc->bias);
      proj->reset_from_full(plain.proj->weight, plain.proj->bias);
      // Sequence parallel: this rank's quarter of the sequence, and the LayerNorm's parameters
      // through copy_to_region, so that their gradients (of this rank's positions) are summed.
      at::Tensor x_tp = (sequence_parallel ? x.chunk(world, 1)[r.rank] : x).clone();
      x_tp.requires_grad_(true);
      const at::Tensor normed = sequence_parallel
                                    ? torch::layer_norm(x_tp, {16}, copy_to_region(ln->weight, g),
                                                        copy_to_region(ln->bias, g))
                                    : ln(x_tp);
      const at::Tensor y_tp = proj(torch::gelu(fc(normed)));
      const at::Tensor target_tp = sequence_parallel ? target.chunk(world, 1)[r.rank] : target;
      (y_tp * target_tp).sum().backward();

      const auto piece = [&](const at::Tensor& t) {
        return sequence_parallel ? t.chunk(world, 1)[r.rank] : t;
      };
      // fp32 sums in another order (the row-parallel matmul summed over ranks, the column
      // gradients of x summed over ranks): a few float roundings of the terms' magnitude.
      expect_close_per_element(y_tp, piece(y_plain.detach()), what + ": output");
      expect_close_per_element(x_tp.grad(), piece(x_plain.grad()), what + ": input gradient");
      expect_close_per_element(fc->weight.grad(), shard(plain.fc->weight.grad(), 0, g),
                               what + ": fc.weight gradient");
      expect_close_per_element(fc->bias.grad(), shard(plain.fc->bias.grad(), 0, g),
                               what + ": fc.bias gradient");
      expect_close_per_element(proj->weight.grad(), shard(plain.proj->weight.grad(), 1, g),
                               what + ": proj.weight gradient");
      expect_close_per_element(proj->bias.grad(), plain.proj->bias.grad(),
                               what + ": proj.bias gradient");
      expect_close_per_element(ln->weight.grad(), plain.ln->weight.grad(),
                               what + ": ln.weight gradient");
      expect_close_per_element(ln->bias.grad(), plain.ln->bias.grad(), what + ": ln.bias gradient");
    }
  }));
}

TEST_P(TensorParallel, VocabularyParallelEmbeddingAndCrossEntropyMatchTorch) {
  const int world = GetParam();
  const int64_t V = 40, C = 8;
  expect_all_ok(run_threads(world, [&](Rank& r) {
    auto group = make_group(r);
    comm::Group* g = group.get();
    torch::nn::Embedding plain(V, C);
    {
      torch::NoGradGuard no_grad;
      plain->weight.copy_(randn({V, C}, 31));
    }
    const at::Tensor ids = torch::randint(V, {3, 5}, at::make_generator<at::CPUGeneratorImpl>(32));
    VocabParallelEmbedding embedding(V, C, g);
    embedding->reset_from_full(plain->weight);
    EXPECT_EQ(embedding->vocab_begin(), r.rank * V / world);
    EXPECT_EQ(embedding->vocab_end(), (r.rank + 1) * V / world);

    // The embedding: a sum of one row and zeros, so bitwise; and its gradient rows likewise.
    const at::Tensor weights = randn({3, 5, C}, 33);
    const at::Tensor e_plain = plain(ids);
    (e_plain * weights).sum().backward();
    const at::Tensor e_tp = embedding(ids);
    (e_tp * weights).sum().backward();
    EXPECT_TRUE(e_tp.equal(e_plain.detach()));
    EXPECT_TRUE(embedding->weight.grad().equal(shard(plain->weight.grad(), 0, g)));

    // The cross-entropy of vocabulary-split logits: per position, and the logits' gradient.
    const at::Tensor logits = 3.0 * randn({3, 5, V}, 34);
    at::Tensor full = logits.clone().requires_grad_(true);
    const at::Tensor loss_plain = torch::nn::functional::cross_entropy(
        full.view({-1, V}), ids.view({-1}),
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
    loss_plain.mean().backward();
    at::Tensor mine = shard(logits, -1, g).requires_grad_(true);
    const at::Tensor loss_tp = vocab_parallel_cross_entropy(mine, ids, embedding->vocab_begin(), g);
    EXPECT_EQ(loss_tp.sizes(), ids.sizes());
    loss_tp.mean().backward();
    // log-sum-exp in another order (the per-rank sums of exponentials, then their sum).
    expect_close_per_element(loss_tp.view({-1}), loss_plain.detach(), "cross-entropy");
    expect_close_per_element(mine.grad(), shard(full.grad(), -1, g), "cross-entropy gradient");
  }));
}

INSTANTIATE_TEST_SUITE_P(Threads, TensorParallel, ::testing::Values(1, 2, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "W" + std::to_string(info.param);
                         });

TEST(TensorParallelErrors, SizesThatDoNotDivideNameTheLayerAndTheNumbers) {
  expect_all_ok(run_threads(4, [](Rank& r) {
    auto group = make_group(r);
    comm::Group* g = group.get();
    EXPECT_THAT([&] { ColumnParallelLinear(16, 10, g); },
                ::testing::ThrowsMessage<InvalidArgument>(
                    "ColumnParallelLinear(16, 10): out_features 10 is not divisible by 4 (the "
                    "tensor-parallel size 4); choose a multiple"));
    EXPECT_THAT([&] { ColumnParallelLinear(16, 40, g, ColumnParallelOptions{.partitions = 3}); },
                ::testing::ThrowsMessage<InvalidArgument>(
                    "ColumnParallelLinear(16, 40): out_features 40 is not divisible by 12 (the "
                    "tensor-parallel size 4 times the partitions); choose a multiple"));
    EXPECT_THAT([&] { RowParallelLinear(6, 16, g); },
                ::testing::ThrowsMessage<InvalidArgument>(
                    "RowParallelLinear(6, 16): in_features 6 is not divisible by 4 (the "
                    "tensor-parallel size 4); choose a multiple"));
    EXPECT_THAT([&] { VocabParallelEmbedding(50, 8, g); },
                ::testing::ThrowsMessage<InvalidArgument>(
                    "VocabParallelEmbedding(50, 8): the vocabulary size 50 is not divisible by 4 "
                    "(the tensor-parallel size 4); choose a multiple"));
    ColumnParallelLinear fc(16, 32, g);
    EXPECT_THAT(
        [&] {
          fc->reset_from_full(torch::zeros({16, 16}), torch::zeros({32}));
        },
        ::testing::ThrowsMessage<InvalidArgument>(
            "ColumnParallelLinear weight: the full weight must be [32, 16], got [16, 16]"));
  }));
}

}  // namespace
}  // namespace loom::parallel::tp

// The GPT model: causal attention, tied head, parameter and FLOPs counts by hand.
#include "model.h"

#include <gtest/gtest.h>

namespace gpt {
namespace {

GptConfig tiny() {
  return {.vocab_size = 50, .seq_len = 8, .n_layer = 2, .n_head = 2, .n_embd = 16};
}

TEST(GptModel, ParametersAndFlopsPerTokenByHand) {
  torch::manual_seed(0);
  Gpt model(tiny());
  const int64_t V = 50, T = 8, L = 2, C = 16;
  const int64_t per_layer = 12 * C * C + 13 * C;  // qkv, proj, fc, fc_proj (+ biases), 2 LNs
  const int64_t n = V * C + T * C + L * per_layer + 2 * C;
  EXPECT_EQ(model->num_params(), n);
  // 6 (N - N_emb) + 12 L H Q T, N_emb = the position embeddings (the token table is the head).
  EXPECT_DOUBLE_EQ(model->flops_per_token(), 6.0 * (n - T * C) + 12.0 * L * 2 * 8 * T);
}

TEST(GptModel, AttentionIsCausal) {
  torch::manual_seed(0);
  Gpt model(tiny());
  model->eval();
  auto a = torch::randint(0, 50, {1, 8}, torch::kLong);
  auto b = a.clone();
  b.index_put_({0, 5}, (a.index({0, 5}).item<int64_t>() + 1) % 50);  // change token 5 only
  auto la = model->forward(a), lb = model->forward(b);
  EXPECT_TRUE(torch::allclose(la.slice(1, 0, 5), lb.slice(1, 0, 5)));  // positions 0-4 blind to it
  EXPECT_FALSE(torch::allclose(la.slice(1, 5), lb.slice(1, 5)));
}

TEST(GptModel, HeadIsTiedToTheEmbeddingAndLossStartsNearLnVocab) {
  torch::manual_seed(0);
  Gpt model(tiny());
  auto idx = torch::randint(0, 50, {4, 8}, torch::kLong);
  auto loss = model->loss(idx, torch::randint(0, 50, {4, 8}, torch::kLong));
  EXPECT_NEAR(loss.item<double>(), std::log(50.0), 0.3);
  loss.backward();
  // The embedding gets gradient from both its look-up and the head.
  EXPECT_GT(model->wte->weight.grad().abs().sum().item<double>(), 0);
}

TEST(GptModel, GenerateAppendsTokensDeterministically) {
  torch::manual_seed(0);
  Gpt model(tiny());
  std::mt19937_64 r1(7), r2(7);
  auto a = model->generate({1, 2, 3}, 12, 5, 1.0, r1);  // longer than seq_len: context is cut
  auto b = model->generate({1, 2, 3}, 12, 5, 1.0, r2);
  EXPECT_EQ(a.size(), 15u);
  EXPECT_EQ(a, b);
  EXPECT_TRUE(model->is_training());  // generate restores the mode
  std::mt19937_64 r3(1);
  auto greedy1 = model->generate({4}, 4, 1, 1.0, r3);
  auto greedy2 = model->generate({4}, 4, 1, 1.0, r3);
  EXPECT_EQ(greedy1, greedy2);
}

}  // namespace
}  // namespace gpt

// The NCCL backend at world size 1 on one GPU: every op against the plain libtorch result.
// Skipped where libtorch has no CUDA or no GPU is visible.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "loom/comm/flight_recorder.h"
#include "loom/comm/nccl.h"
#include "loom/error.h"

namespace loom::comm {
namespace {

class NcclGroupTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible to libtorch";
    group_ = new_nccl_group(store_, 0, 1, {.device = 0, .name = "gpu-test"});
  }
  torch::Tensor cuda(torch::Tensor t) { return t.to(torch::kCUDA); }

  InMemoryStore store_;
  std::unique_ptr<Group> group_;
};

TEST_F(NcclGroupTest, AllReduceKeepsValuesAtWorldOne) {
  for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kInt64}) {
    auto t = cuda(torch::arange(1000).to(dtype));
    auto expected = t.clone();
    group_->all_reduce(t)->wait();
    EXPECT_TRUE(torch::equal(t.cpu(), expected.cpu())) << dtype;
  }
  auto avg = cuda(torch::ones({17}));
  group_->all_reduce(avg, {.op = ReduceOp::kAvg})->wait();
  EXPECT_TRUE(torch::equal(avg.cpu(), torch::ones({17})));
}

TEST_F(NcclGroupTest, GatherScatterBroadcastBarrier) {
  auto input = cuda(torch::arange(7, torch::kFloat32));
  auto gathered = cuda(torch::zeros({7}));
  group_->all_gather(gathered, input)->wait();
  EXPECT_TRUE(torch::equal(gathered.cpu(), input.cpu()));

  auto out = cuda(torch::zeros({7}));
  group_->reduce_scatter(out, input)->wait();
  EXPECT_TRUE(torch::equal(out.cpu(), input.cpu()));

  std::vector<torch::Tensor> flat = {cuda(torch::ones({3})), cuda(torch::full({2}, 2.0f))};
  group_->all_reduce_coalesced(flat)->wait();
  EXPECT_TRUE(torch::equal(flat[1].cpu(), torch::full({2}, 2.0f)));

  group_->broadcast(input, {.root = 0})->wait();
  group_->barrier()->wait();
  EXPECT_GE(group_->flight_recorder().snapshot().size(), 5u);
}

TEST_F(NcclGroupTest, RejectsCpuTensors) {
  auto t = torch::ones({4});
  EXPECT_THROW(group_->all_reduce(t), InvalidArgument);
}

}  // namespace
}  // namespace loom::comm

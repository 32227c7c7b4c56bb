// The single-process libtorch reference for collectives, and one sweep that checks every op of
// a Group against it. Shared by the thread tests (unit/comm/gloo_group_test.cpp,
// unit/comm/shm_collectives_test.cpp) and the process tests
// (integration/gloo_group_process_test.cpp).
//
// check_ops' inputs are small integers (|x| <= 8), exact in every dtype and in every summation
// order, so every comparison is bitwise: kAvg divides the same exact sum by the same size on
// both sides. check_random_floats_in_rank_order takes random floats of many magnitudes, for
// the paths whose reductions run in rank order.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <chrono>
#include <string>
#include <vector>

#include "loom/comm/group.h"
#include "loom/error.h"

namespace loom::testing::collectives {

inline const std::vector<at::ScalarType> kAllDtypes = {
    at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kInt, at::kLong, at::kByte};

inline bool is_integral(at::ScalarType dtype) { return at::isIntegralType(dtype, false); }

// Rank `rank`'s input for case `salt`: n elements in [-8, 8] ([0, 16] for uint8).
inline at::Tensor make_input(at::ScalarType dtype, int64_t n, int rank, int salt) {
  const at::Tensor i = at::arange(n, at::kLong);
  at::Tensor values = (i * 7 + rank * 13 + salt * 5).remainder(17);
  if (dtype != at::kByte) values = values - 8;
  return values.to(dtype);
}

inline std::vector<at::Tensor> inputs_of_all_ranks(at::ScalarType dtype, int64_t n, int world,
                                                   int salt) {
  std::vector<at::Tensor> inputs;
  for (int r = 0; r < world; ++r) inputs.push_back(make_input(dtype, n, r, salt));
  return inputs;
}

// op over the ranks' inputs, computed as the contract says: bf16/fp16 in fp32, avg = sum / size.
inline at::Tensor reference_reduce(const std::vector<at::Tensor>& inputs, comm::ReduceOp op) {
  const at::ScalarType dtype = inputs[0].scalar_type();
  const bool low_precision = dtype == at::kBFloat16 || dtype == at::kHalf;
  const at::Tensor stacked = at::stack(inputs);
  const at::Tensor wide = low_precision ? stacked.to(at::kFloat) : stacked;
  at::Tensor result;
  switch (op) {
    case comm::ReduceOp::kSum:
      result = wide.sum(0);
      break;
    case comm::ReduceOp::kAvg:
      result = wide.sum(0).div(static_cast<int64_t>(inputs.size()));
      break;
    case comm::ReduceOp::kMin:
      result = wide.amin(0);
      break;
    case comm::ReduceOp::kMax:
      result = wide.amax(0);
      break;
  }
  return result.to(dtype);
}

inline std::string describe(const char* op, at::ScalarType dtype, int64_t n) {
  return std::string(op) + " " + c10::toString(dtype) + " n=" + std::to_string(n);
}

// Bitwise: same dtype, same shape, same values.
inline void expect_same(const at::Tensor& actual, const at::Tensor& expected,
                        const std::string& what) {
  ASSERT_EQ(actual.scalar_type(), expected.scalar_type()) << what;
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  EXPECT_TRUE(actual.equal(expected)) << what << "\nactual:   " << actual.view(-1).slice(0, 0, 16)
                                      << "\nexpected: " << expected.view(-1).slice(0, 0, 16);
}

// Every op of `group` for one dtype and one element count n, against the reference; every rank
// of the group calls it with the same arguments. Ops are issued and waited one at a time, except
// send/recv, which every rank posts as an exchange (send, then recv) to its ring neighbours.
inline void check_ops(comm::Group& group, at::ScalarType dtype, int64_t n, int salt,
                      std::chrono::milliseconds timeout) {
  using comm::ReduceOp;
  const int rank = group.rank();
  const int world = group.size();
  const std::vector<at::Tensor> inputs = inputs_of_all_ranks(dtype, n, world, salt);

  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax}) {
    const std::string what = describe("all_reduce", dtype, n) + " op=" + comm::to_string(op);
    at::Tensor tensor = inputs[rank].clone();
    if (op == ReduceOp::kAvg && is_integral(dtype)) {
      EXPECT_THROW(group.all_reduce(tensor, {.op = op, .timeout = timeout}), InvalidArgument)
          << what;
      continue;
    }
    group.all_reduce(tensor, {.op = op, .timeout = timeout})->wait();
    expect_same(tensor, reference_reduce(inputs, op), what);
  }

  {  // coalesced: the n-element tensor, a 2-D one, an empty one and a scalar
    const std::vector<int64_t> numels = {n, 6, 0, 1};
    std::vector<at::Tensor> tensors;
    std::vector<at::Tensor> expected;
    for (size_t k = 0; k < numels.size(); ++k) {
      std::vector<at::Tensor> all = inputs_of_all_ranks(dtype, numels[k], world, salt + 1 + k);
      at::Tensor mine = all[rank].clone();
      at::Tensor want = reference_reduce(all, ReduceOp::kSum);
      if (k == 1) {
        mine = mine.view({2, 3});
        want = want.view({2, 3});
      } else if (k == 3) {
        mine = mine.view(at::IntArrayRef{});  // 0-dim (plain {} picks view(ScalarType))
        want = want.view(at::IntArrayRef{});
      }
      tensors.push_back(mine);
      expected.push_back(want);
    }
    group.all_reduce_coalesced(tensors, {.timeout = timeout})->wait();
    for (size_t k = 0; k < tensors.size(); ++k) {
      expect_same(tensors[k], expected[k],
                  describe("all_reduce_coalesced", dtype, n) + " tensor " + std::to_string(k));
    }
  }

  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
    const comm::ShardRange shard = comm::shard_range(n, world, rank);
    at::Tensor output = at::full({shard.size()}, 99, inputs[rank].options());
    group.reduce_scatter(output, inputs[rank], {.op = op, .timeout = timeout})->wait();
    expect_same(output, reference_reduce(inputs, op).narrow(0, shard.begin, shard.size()),
                describe("reduce_scatter", dtype, n) + " op=" + comm::to_string(op));
  }

  {
    at::Tensor flat = at::zeros({world * n}, inputs[rank].options());
    group.all_gather(flat, inputs[rank], {.timeout = timeout})->wait();
    expect_same(flat, at::cat(inputs), describe("all_gather(flat)", dtype, n));

    std::vector<at::Tensor> outputs;
    for (int r = 0; r < world; ++r) outputs.push_back(at::zeros({n}, inputs[rank].options()));
    group.all_gather(outputs, inputs[rank], {.timeout = timeout})->wait();
    for (int r = 0; r < world; ++r) {
      expect_same(outputs[r], inputs[r],
                  describe("all_gather(list)", dtype, n) + " from rank " + std::to_string(r));
    }
  }

  for (int root = 0; root < world; ++root) {
    at::Tensor tensor = inputs[rank].clone();
    group.broadcast(tensor, {.root = root, .timeout = timeout})->wait();
    expect_same(tensor, inputs[root],
                describe("broadcast", dtype, n) + " root=" + std::to_string(root));
  }

  if (world > 1) {  // a ring exchange: every rank sends to the next and receives from the last
    const int next = (rank + 1) % world;
    const int prev = (rank + world - 1) % world;
    at::Tensor received = at::zeros({n}, inputs[rank].options());
    comm::WorkPtr sent = group.send(inputs[rank], next, {.tag = salt, .timeout = timeout});
    comm::WorkPtr got = group.recv(received, prev, {.tag = salt, .timeout = timeout});
    got->wait();
    sent->wait();
    expect_same(received, inputs[prev], describe("send/recv", dtype, n));
  }

  group.barrier({.timeout = timeout})->wait();
}

// --- random floats ------------------------------------------------------------------------

inline void expect_bitwise(const at::Tensor& actual, const at::Tensor& expected,
                           const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  ASSERT_EQ(actual.scalar_type(), expected.scalar_type()) << what;
  const at::Tensor differs = actual.ne(expected);
  EXPECT_EQ(differs.sum().item<int64_t>(), 0)
      << what << ": " << differs.sum().item<int64_t>() << " of " << actual.numel()
      << " elements differ, the first at " << differs.nonzero().slice(0, 0, 1);
}

// Rank r's random input: normal floats of several magnitudes, so sums round.
inline at::Tensor random_input(at::ScalarType dtype, int64_t n, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + rank);
  return (at::randn({n}, gen, at::kDouble) * at::exp(at::randn({n}, gen, at::kDouble) * 3))
      .to(dtype);
}

// The reduction as one process computes it: ((x0 op x1) op x2) ..., in the input dtype.
inline at::Tensor in_rank_order(const std::vector<at::Tensor>& inputs, comm::ReduceOp op) {
  at::Tensor acc = inputs[0].clone();
  for (size_t r = 1; r < inputs.size(); ++r) {
    if (op == comm::ReduceOp::kMax) {
      acc = at::maximum(acc, inputs[r]);
    } else if (op == comm::ReduceOp::kMin) {
      acc = at::minimum(acc, inputs[r]);
    } else {
      acc = acc + inputs[r];
    }
  }
  if (op == comm::ReduceOp::kAvg) acc.div_(static_cast<int64_t>(inputs.size()));
  return acc;
}

// Every collective of `group` on random floats (float and double, n elements; the shards uneven
// unless W divides n), bitwise against the reduction in rank order: for a group whose every
// element is reduced by one rank in rank order (the shared-memory path). Every rank calls it.
inline void check_random_floats_in_rank_order(comm::Group& group, int64_t n,
                                              std::chrono::milliseconds timeout) {
  using comm::ReduceOp;
  const int world = group.size();
  const int rank = group.rank();
  for (at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    const std::string type = c10::toString(dtype);
    std::vector<at::Tensor> inputs;
    for (int k = 0; k < world; ++k) inputs.push_back(random_input(dtype, n, k));
    const at::Tensor& mine = inputs[rank];
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax}) {
      at::Tensor tensor = mine.clone();
      group.all_reduce(tensor, {.op = op, .timeout = timeout})->wait();
      expect_bitwise(tensor, in_rank_order(inputs, op), "all_reduce " + type + " " + to_string(op));
    }
    const comm::ShardRange shard = comm::shard_range(n, world, rank);
    const at::Tensor expected_shard =
        in_rank_order(inputs, ReduceOp::kSum).narrow(0, shard.begin, shard.size());
    at::Tensor output = at::full({shard.size()}, 99, mine.options());
    group.reduce_scatter(output, mine, {.timeout = timeout})->wait();
    expect_bitwise(output, expected_shard, "reduce_scatter " + type);
    // The output a view of the input, as ZeRO's shard of its bucket is.
    at::Tensor bucket = mine.clone();
    at::Tensor view = bucket.narrow(0, shard.begin, shard.size());
    group.reduce_scatter(view, bucket.clone(), {.timeout = timeout})->wait();
    expect_bitwise(view, expected_shard, "reduce_scatter into a view of another tensor " + type);
    at::Tensor in_place = mine.clone();
    at::Tensor in_place_view = in_place.narrow(0, shard.begin, shard.size());
    group.reduce_scatter(in_place_view, in_place, {.timeout = timeout})->wait();
    expect_bitwise(in_place_view, expected_shard,
                   "reduce_scatter into a view of its input " + type);

    at::Tensor flat = at::zeros({world * n}, mine.options());
    group.all_gather(flat, mine, {.timeout = timeout})->wait();
    expect_bitwise(flat, at::cat(inputs), "all_gather " + type);
    std::vector<at::Tensor> outputs;
    for (int k = 0; k < world; ++k) outputs.push_back(at::zeros({n}, mine.options()));
    group.all_gather(outputs, mine, {.timeout = timeout})->wait();
    for (int k = 0; k < world; ++k) {
      expect_bitwise(outputs[k], inputs[k],
                     "all_gather list " + type + " from " + std::to_string(k));
    }
    at::Tensor broadcast = mine.clone();
    group.broadcast(broadcast, {.root = world - 1, .timeout = timeout})->wait();
    expect_bitwise(broadcast, inputs[world - 1], "broadcast " + type);
  }
  group.barrier({.timeout = timeout})->wait();
}

}  // namespace loom::testing::collectives

// The backend-independent parts of comm::Group: shard_range, ReduceOp names, and the shared
// argument checks, store prefixes and broken state every backend (Gloo, NCCL) uses.

#include "loom/comm/group.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <fstream>
#include <thread>
#include <vector>

#include "comm/group_internal.h"
#include "harness/harness.h"
#include "loom/error.h"

namespace loom::comm {
namespace {

std::vector<int64_t> shard_sizes(int64_t n, int size) {
  std::vector<int64_t> sizes;
  for (int rank = 0; rank < size; ++rank) sizes.push_back(shard_range(n, size, rank).size());
  return sizes;
}

TEST(ShardRange, ChunksOfCeilingSizeWithTheRemainderLast) {
  EXPECT_EQ(shard_sizes(10, 4), (std::vector<int64_t>{3, 3, 3, 1}));
  EXPECT_EQ(shard_sizes(7, 3), (std::vector<int64_t>{3, 3, 1}));
  EXPECT_EQ(shard_sizes(12, 4), (std::vector<int64_t>{3, 3, 3, 3}));
  EXPECT_EQ(shard_sizes(1000003, 2), (std::vector<int64_t>{500002, 500001}));
  EXPECT_EQ(shard_range(10, 4, 3).begin, 9);
  EXPECT_EQ(shard_range(10, 4, 3).end, 10);
}

TEST(ShardRange, LastRanksMayGetNothing) {
  EXPECT_EQ(shard_sizes(1, 4), (std::vector<int64_t>{1, 0, 0, 0}));
  EXPECT_EQ(shard_sizes(5, 4), (std::vector<int64_t>{2, 2, 1, 0}));
  EXPECT_EQ(shard_sizes(0, 3), (std::vector<int64_t>{0, 0, 0}));
  // An empty shard is the empty range at the end, never past it.
  EXPECT_EQ(shard_range(1, 4, 3).begin, 1);
  EXPECT_EQ(shard_range(1, 4, 3).end, 1);
}

TEST(ShardRange, ShardsTileTheRangeInRankOrder) {
  for (int64_t n = 0; n <= 40; ++n) {
    for (int size = 1; size <= 9; ++size) {
      int64_t next = 0;
      for (int rank = 0; rank < size; ++rank) {
        const ShardRange shard = shard_range(n, size, rank);
        ASSERT_EQ(shard.begin, next) << "n=" << n << " size=" << size << " rank=" << rank;
        ASSERT_LE(shard.begin, shard.end);
        ASSERT_LE(shard.size(), (n + size - 1) / size);
        next = shard.end;
      }
      ASSERT_EQ(next, n) << "n=" << n << " size=" << size;
    }
  }
}

TEST(ShardRange, RejectsBadArguments) {
  EXPECT_THROW(shard_range(-1, 2, 0), InvalidArgument);
  EXPECT_THROW(shard_range(4, 0, 0), InvalidArgument);
  EXPECT_THROW(shard_range(4, 2, 2), InvalidArgument);
  EXPECT_THROW(shard_range(4, 2, -1), InvalidArgument);
}

TEST(ReduceOpNames, AreLowerCaseWords) {
  EXPECT_STREQ(to_string(ReduceOp::kSum), "sum");
  EXPECT_STREQ(to_string(ReduceOp::kAvg), "avg");
  EXPECT_STREQ(to_string(ReduceOp::kMin), "min");
  EXPECT_STREQ(to_string(ReduceOp::kMax), "max");
}

// --- the shared checks, as NCCL runs them (tensors on cuda:0); no GPU is needed to reject ----

using internal::OpPlace;

const OpPlace kCuda{.rank = 1, .size = 4, .device = at::Device(at::kCUDA, 0)};
const OpPlace kCpu{.rank = 1, .size = 4, .device = at::Device(at::kCPU)};

template <typename Fn>
void expect_invalid(Fn fn, const std::vector<std::string>& words) {
  const std::string message = loom::testing::error_of<InvalidArgument>(fn);
  for (const std::string& word : words) {
    EXPECT_NE(message.find(word), std::string::npos) << "'" << word << "' not in: " << message;
  }
}

TEST(GroupChecks, TensorsMustBeOnTheBackendsDevice) {
  const at::Tensor cpu = at::zeros({3});
  expect_invalid([&] { internal::check_all_reduce(kCuda, cpu, ReduceOp::kSum); },
                 {"all_reduce", "tensor", "device cpu", "expected a defined, cuda:0, contiguous"});
  EXPECT_NO_THROW(internal::check_all_reduce(kCpu, cpu, ReduceOp::kSum));
  expect_invalid([&] { internal::check_broadcast(kCuda, cpu, 0); }, {"broadcast", "cuda:0"});
  expect_invalid([&] { internal::check_send_recv(kCuda, "send", cpu, 2, 0); }, {"send", "cuda:0"});
  std::vector<at::Tensor> outputs(4, at::zeros({3}));
  expect_invalid([&] { internal::check_all_gather(kCuda, outputs, cpu); },
                 {"all_gather", "input", "cuda:0"});
  const at::Tensor undefined;
  expect_invalid([&] { internal::check_all_reduce(kCpu, undefined, ReduceOp::kSum); },
                 {"all_reduce", "undefined", "CPU"});
}

TEST(GroupChecks, AvgOfIntegersIsRejectedByEveryReducingOp) {
  const at::Tensor ints = at::zeros({8}, at::kLong);
  expect_invalid([&] { internal::check_all_reduce(kCpu, ints, ReduceOp::kAvg); },
                 {"all_reduce", "avg", "int64"});
  std::vector<at::Tensor> list = {ints, ints};
  expect_invalid([&] { internal::check_all_reduce_coalesced(kCpu, list, ReduceOp::kAvg); },
                 {"all_reduce_coalesced", "avg", "int64"});
  const at::Tensor out = at::zeros({2}, at::kLong);
  expect_invalid([&] { internal::check_reduce_scatter(kCpu, out, ints, ReduceOp::kAvg); },
                 {"reduce_scatter", "avg", "int64"});
  EXPECT_NO_THROW(internal::check_reduce_scatter(kCpu, out, ints, ReduceOp::kSum));
  EXPECT_NO_THROW(internal::check_all_reduce(kCpu, at::zeros({8}), ReduceOp::kAvg));
}

TEST(GroupChecks, SizesDtypesAndRanksNameWhatIsWrong) {
  // 10 elements over 4 ranks: rank 1 owns 3.
  const at::Tensor input = at::zeros({10});
  expect_invalid(
      [&] { internal::check_reduce_scatter(kCpu, at::zeros({2}), input, ReduceOp::kSum); },
      {"reduce_scatter", "output", "2 elements", "expected 3"});
  expect_invalid(
      [&] {
        internal::check_reduce_scatter(kCpu, at::zeros({3}, at::kDouble), input, ReduceOp::kSum);
      },
      {"reduce_scatter", "float64", "float32"});
  expect_invalid([&] { internal::check_all_gather(kCpu, at::zeros({30}), input); },
                 {"all_gather", "expected 40"});
  std::vector<at::Tensor> three(3, at::zeros({10}));
  expect_invalid([&] { internal::check_all_gather(kCpu, three, input); },
                 {"all_gather", "3 tensors", "one per rank (4)"});
  expect_invalid([&] { internal::check_broadcast(kCpu, input, 4); }, {"broadcast", "root 4"});
  expect_invalid([&] { internal::check_send_recv(kCpu, "recv", input, 1, 0); },
                 {"recv", "src 1", "this rank"});
  expect_invalid([&] { internal::check_send_recv(kCpu, "send", input, 0, -1); },
                 {"send", "tag must be >= 0"});
  EXPECT_NO_THROW(internal::check_send_recv(kCpu, "send", input, 3, 5));
}

TEST(GroupChecks, SubgroupRanksAreSortedAndChecked) {
  EXPECT_EQ(internal::check_subgroup_ranks(kCpu, {3, 1}), (std::vector<int>{1, 3}));
  expect_invalid([&] { internal::check_subgroup_ranks(kCpu, {1, 1}); }, {"listed twice", "[1,1]"});
  expect_invalid([&] { internal::check_subgroup_ranks(kCpu, {1, 4}); }, {"listed rank 4"});
  expect_invalid(
      [&] {
        internal::check_subgroup_ranks(kCpu, {0, 2});
      },
      {"this rank (1)", "not among", "[0,2]"});
  expect_invalid(
      [&] { internal::check_new_group("new_nccl_group", 0, 0, "w", std::chrono::seconds(1)); },
      {"new_nccl_group", "size must be positive"});
  expect_invalid(
      [&] { internal::check_new_group("new_nccl_group", 2, 2, "w", std::chrono::seconds(1)); },
      {"new_nccl_group", "rank 2"});
  expect_invalid(
      [&] { internal::check_new_group("new_nccl_group", 0, 1, "", std::chrono::seconds(1)); },
      {"options.name is empty"});
  expect_invalid(
      [&] { internal::check_new_group("new_nccl_group", 0, 1, "w", std::chrono::seconds(0)); },
      {"connect_timeout must be positive"});
}

TEST(GroupStorePrefix, EachCreationOfANameGetsAFreshPrefixPerRank) {
  InMemoryStore store;
  EXPECT_EQ(internal::fresh_store_prefix(store, "nccl/world", 0), "nccl/world#1");
  EXPECT_EQ(internal::fresh_store_prefix(store, "nccl/world", 1), "nccl/world#1");
  EXPECT_EQ(internal::fresh_store_prefix(store, "nccl/world", 0), "nccl/world#2");
  EXPECT_EQ(internal::fresh_store_prefix(store, "nccl/other", 0), "nccl/other#1");
  EXPECT_EQ(internal::fresh_store_prefix(store, "nccl/world", 1), "nccl/world#2");
}

TEST(GroupState, TheFirstReasonWinsAndReadersNeverSeeATornOne) {
  internal::GroupState state(1, 4, "world", {}, 16);
  EXPECT_EQ(state.description, "'world' (rank 1 of 4)");
  EXPECT_FALSE(state.is_broken());
  const std::string first(4096, 'a');
  const std::string second(4096, 'b');
  std::atomic<bool> stop{false};
  std::atomic<int> bad{0};
  std::thread reader([&] {
    while (!stop) {
      const std::string seen = state.broken_reason();
      if (!seen.empty() && seen != first && seen != second) ++bad;
    }
  });
  std::thread a([&] { state.mark_broken(first); });
  std::thread b([&] { state.mark_broken(second); });
  a.join();
  b.join();
  stop = true;
  reader.join();
  EXPECT_EQ(bad, 0);
  const std::string kept = state.broken_reason();
  EXPECT_TRUE(kept == first || kept == second);
  EXPECT_FALSE(state.mark_broken("later"));
  EXPECT_EQ(state.broken_reason(), kept);
  EXPECT_EQ(state.dump_flight(), "");  // no dump directory
}

TEST(GroupState, DumpsTheFlightRecorderIntoItsDirectory) {
  loom::testing::TempDir dir;
  internal::GroupState state(2, 3, "world", dir.path(), 16);
  state.recorder.enqueue("all_reduce", "float32", 7, {});
  const std::string note = state.dump_flight();
  EXPECT_NE(note.find("rank_2.json"), std::string::npos) << note;
  std::ifstream in(dir.path() / "rank_2.json");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("all_reduce"), std::string::npos) << text;
}

}  // namespace
}  // namespace loom::comm

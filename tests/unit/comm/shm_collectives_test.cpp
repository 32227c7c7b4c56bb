// The intra-node fast path (src/comm/shm_collectives.h) through the Gloo group, ranks as
// threads: random floats against the single-process reduction in rank order (bitwise: each
// element is reduced by one rank, in rank order, with the same IEEE operations), tensors of
// many slots with uneven shards, bf16 accumulated in fp32, diverged ranks, a peer that leaves,
// and the segments in /dev/shm.

#include "comm/shm_collectives.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <ATen/CPUGeneratorImpl.h>

#include <fcntl.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "harness/harness.h"
#include "loom/comm/gloo.h"
#include "loom/error.h"
#include "unit/comm/collective_reference.h"

namespace loom::comm {
namespace {

using loom::testing::expect_all_ok;
using loom::testing::Rank;
using loom::testing::run_threads;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;
namespace ref = loom::testing::collectives;
using ref::expect_bitwise;
using ref::in_rank_order;
using ref::random_input;

constexpr milliseconds kOpTimeout{20000};

GlooOptions small_slots(size_t slot_bytes = 4096) {
  GlooOptions options;
  options.connect_timeout = std::chrono::seconds(20);
  options.shared_memory_slot_bytes = slot_bytes;
  return options;
}

class SharedMemoryWorld : public ::testing::TestWithParam<int> {};

// 10007 elements through 4 KiB slots: each op takes dozens of pieces, and the shards are uneven.
TEST_P(SharedMemoryWorld, RandomFloatsEqualTheReductionInRankOrderBitwise) {
  expect_all_ok(run_threads(GetParam(), [&](Rank& r) {
    auto group = new_gloo_group(r.store, r.rank, r.world, small_slots());
    ASSERT_EQ(gloo_transport(*group), "shared memory");
    ref::check_random_floats_in_rank_order(*group, 10007, kOpTimeout);
  }));
}

INSTANTIATE_TEST_SUITE_P(Shm, SharedMemoryWorld, ::testing::Values(2, 3, 4));

// Groups whose ranks span hosts (laid out through GlooOptions::host), some hosts holding
// several ranks: all_reduce is hierarchical. Its sum is in host order: each host's ranks in rank
// order (bitwise, through the host's segment), then the hosts' sums over TCP. With 2 hosts that
// last sum is one IEEE addition, commutative, so the result is bitwise the reference; with 3
// gloo's ring adds the host sums in a rotation that depends on the element, so the result is
// within 2(m - 1)u * sum |x_r| of the reference, m the number of ranks and u the dtype's unit
// roundoff (any order of m summands is within (m - 1)u * sum |x_r| of the exact sum), plus 2u
// of the result for kAvg's division. Every other op runs over TCP (reduce_scatter's ring adds
// in its own order: the same tolerance).
struct HostLayout {
  std::vector<std::string> hosts;  // rank r's host
  std::string name;
};

class SharedMemoryHosts : public ::testing::TestWithParam<HostLayout> {};

// Each host's ranks in rank order, then the host sums in the order of their lowest rank.
at::Tensor in_host_order(const std::vector<at::Tensor>& inputs,
                         const std::vector<std::string>& hosts, ReduceOp op) {
  std::vector<std::string> seen;
  std::vector<at::Tensor> host_sums;
  for (size_t r = 0; r < hosts.size(); ++r) {
    if (std::find(seen.begin(), seen.end(), hosts[r]) != seen.end()) continue;
    seen.push_back(hosts[r]);
    std::vector<at::Tensor> mine;
    for (size_t k = r; k < hosts.size(); ++k) {
      if (hosts[k] == hosts[r]) mine.push_back(inputs[k]);
    }
    host_sums.push_back(in_rank_order(mine, op == ReduceOp::kAvg ? ReduceOp::kSum : op));
  }
  at::Tensor total = in_rank_order(host_sums, op == ReduceOp::kAvg ? ReduceOp::kSum : op);
  if (op == ReduceOp::kAvg) total.div_(static_cast<int64_t>(inputs.size()));
  return total;
}

void expect_within_reordering(const at::Tensor& actual, const at::Tensor& expected,
                              const std::vector<at::Tensor>& inputs, ReduceOp op,
                              const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  const double u =
      actual.scalar_type() == at::kDouble ? std::ldexp(1.0, -53) : std::ldexp(1.0, -24);
  at::Tensor magnitude = at::zeros_like(inputs[0], at::kDouble);
  for (const at::Tensor& x : inputs) magnitude += x.to(at::kDouble).abs();
  if (op == ReduceOp::kAvg) magnitude /= static_cast<double>(inputs.size());
  const double m = static_cast<double>(inputs.size());
  const at::Tensor error = (actual.to(at::kDouble) - expected.to(at::kDouble)).abs();
  const at::Tensor bound = magnitude * (2 * (m - 1) * u) + expected.to(at::kDouble).abs() * (2 * u);
  const at::Tensor over = error.gt(bound);
  EXPECT_EQ(over.sum().item<int64_t>(), 0)
      << what << ": " << over.sum().item<int64_t>() << " elements beyond the reordering bound";
}

TEST_P(SharedMemoryHosts, AllReduceIsHierarchicalAndEveryOpMatchesTheReference) {
  const std::vector<std::string>& hosts = GetParam().hosts;
  const int world = static_cast<int>(hosts.size());
  const size_t distinct = std::set<std::string>(hosts.begin(), hosts.end()).size();
  constexpr int64_t n = 10007;
  expect_all_ok(run_threads(world, [&](Rank& r) {
    GlooOptions options = small_slots();
    options.host = hosts[r.rank];
    auto group = new_gloo_group(r.store, r.rank, r.world, options);
    ASSERT_EQ(gloo_transport(*group), "hierarchical");
    for (at::ScalarType dtype : {at::kFloat, at::kDouble}) {
      const std::string type = c10::toString(dtype);
      std::vector<at::Tensor> inputs;
      for (int k = 0; k < world; ++k) inputs.push_back(random_input(dtype, n, k));
      const at::Tensor& mine = inputs[r.rank];
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax}) {
        const std::string what = "all_reduce " + type + " " + to_string(op);
        at::Tensor tensor = mine.clone();
        group->all_reduce(tensor, {.op = op, .timeout = kOpTimeout})->wait();
        const at::Tensor expected = in_host_order(inputs, hosts, op);
        if (distinct == 2 || op == ReduceOp::kMin || op == ReduceOp::kMax) {
          expect_bitwise(tensor, expected, what);
        } else {
          expect_within_reordering(tensor, expected, inputs, op, what);
        }
      }
      std::vector<at::Tensor> pieces = {mine.narrow(0, 0, 7).clone(),
                                        mine.narrow(0, 7, n - 7).clone()};
      group->all_reduce_coalesced(pieces, {.timeout = kOpTimeout})->wait();
      const at::Tensor sum = in_host_order(inputs, hosts, ReduceOp::kSum);
      if (distinct == 2) {
        expect_bitwise(at::cat(pieces), sum, "all_reduce_coalesced " + type);
      } else {
        expect_within_reordering(at::cat(pieces), sum, inputs, ReduceOp::kSum,
                                 "all_reduce_coalesced " + type);
      }

      const ShardRange shard = shard_range(n, world, r.rank);
      at::Tensor output = at::full({shard.size()}, 99, mine.options());
      group->reduce_scatter(output, mine, {.timeout = kOpTimeout})->wait();
      std::vector<at::Tensor> shards;
      for (const at::Tensor& x : inputs) shards.push_back(x.narrow(0, shard.begin, shard.size()));
      expect_within_reordering(output, sum.narrow(0, shard.begin, shard.size()), shards,
                               ReduceOp::kSum, "reduce_scatter " + type);
      at::Tensor flat = at::zeros({world * n}, mine.options());
      group->all_gather(flat, mine, {.timeout = kOpTimeout})->wait();
      expect_bitwise(flat, at::cat(inputs), "all_gather " + type);
      at::Tensor broadcast = mine.clone();
      group->broadcast(broadcast, {.root = world - 1, .timeout = kOpTimeout})->wait();
      expect_bitwise(broadcast, inputs[world - 1], "broadcast " + type);
    }
    // bf16 accumulates in fp32 on this path too (see Bf16SumsAccumulateInFp32).
    at::Tensor tensor = at::full({3000}, r.rank == 0 ? 1.0 : 1.0 / 256, at::kBFloat16);
    at::Tensor expected = at::full({3000}, 1.0 + (world - 1) / 256.0, at::kFloat).to(at::kBFloat16);
    group->all_reduce(tensor, {.timeout = kOpTimeout})->wait();
    expect_bitwise(tensor, expected, "all_reduce bf16");
    group->barrier({.timeout = kOpTimeout})->wait();
    // Connected, the host segments are unlinked too.
    EXPECT_EQ(internal::shared_memory_segments(::getpid()), std::vector<std::string>{});
  }));
}

INSTANTIATE_TEST_SUITE_P(Shm, SharedMemoryHosts,
                         ::testing::Values(HostLayout{{"a", "a", "b"}, "AAB"},
                                           HostLayout{{"a", "a", "b", "b"}, "AABB"},
                                           HostLayout{{"a", "b", "b", "a"}, "ABBA"},
                                           HostLayout{{"a", "b", "c", "c"}, "ABCC"}),
                         [](const ::testing::TestParamInfo<HostLayout>& info) {
                           return info.param.name;
                         });

// Returns once every rank has its group. A rank's constructor may return while a peer is still
// finishing its side of the connection (gloo's full mesh between host leaders), so a rank that
// leaves at once could fail that peer's constructor instead of its first collective.
void wait_until_every_rank_has_its_group(Rank& r) {
  r.store.set("constructed/" + std::to_string(r.rank), "1");
  for (int peer = 0; peer < r.world; ++peer) {
    r.store.get("constructed/" + std::to_string(peer), kOpTimeout);
  }
}

// Hosts {0, 1} and {2}: rank 2 leaves. Rank 0, the leader of the first host, fails in the step
// between hosts and breaks its host's segment, so rank 1, waiting in the broadcast inside the
// host, fails at once too (a CommError quoting the leader's failure) instead of at its deadline.
// After a peer left: this rank's all_reduce fails with a CommError that says each of `said`,
// at once rather than at the op's 20 s deadline.
void expect_all_reduce_fails_at_once(Group& group, const std::vector<std::string>& said) {
  at::Tensor tensor = at::ones({100});
  const Clock::time_point start = Clock::now();
  try {
    group.all_reduce(tensor, {.timeout = kOpTimeout})->wait();
    ADD_FAILURE() << "an all_reduce without a peer that left succeeded";
  } catch (const CommError& e) {
    const std::string what = e.what();
    for (const std::string& part : said) EXPECT_NE(what.find(part), std::string::npos) << what;
  }
  EXPECT_LT(Clock::now() - start, milliseconds(5000));
}

TEST(SharedMemory, AHostThatLeavesFailsEveryRankOfTheOtherHostAtOnce) {
  const std::vector<std::string> hosts = {"a", "a", "b"};
  expect_all_ok(run_threads(3, [&](Rank& r) {
    GlooOptions options = small_slots();
    options.host = hosts[r.rank];
    auto group = new_gloo_group(r.store, r.rank, r.world, options);
    wait_until_every_rank_has_its_group(r);
    if (r.rank == 2) {
      group.reset();
      r.store.set("left", "1");
      return;
    }
    r.store.get("left", kOpTimeout);
    // Rank 0's own error is gloo's, from the step between hosts.
    expect_all_reduce_fails_at_once(
        *group, r.rank == 1 ? std::vector<std::string>{"the host leader's all_reduce between hosts "
                                                       "failed"}
                            : std::vector<std::string>{});
  }));
}

// Hosts {0, 2} and {1}: rank 2, the second rank of the first host, leaves. Rank 0 fails in the
// step inside its host, and the error names rank 2 by its rank in the group, not by its place
// on the host.
TEST(SharedMemory, ARankThatLeavesItsHostIsNamedByItsGroupRank) {
  const std::vector<std::string> hosts = {"a", "b", "a"};
  expect_all_ok(run_threads(3, [&](Rank& r) {
    GlooOptions options = small_slots();
    options.host = hosts[r.rank];
    auto group = new_gloo_group(r.store, r.rank, r.world, options);
    ASSERT_EQ(gloo_transport(*group), "hierarchical");
    wait_until_every_rank_has_its_group(r);
    if (r.rank == 2) {
      group.reset();
      r.store.set("left", "1");
      return;
    }
    if (r.rank == 1) {  // the other host: waits until rank 0 has seen the failure
      r.store.get("seen", kOpTimeout);
      return;
    }
    r.store.get("left", kOpTimeout);
    expect_all_reduce_fails_at_once(*group, {"rank 2 (pid ", "left the group"});
    r.store.set("seen", "1");
  }));
}

// 1 + 2^-8 + 2^-8: in bf16 each partial sum is a tie that rounds to even (1.0, then 1.0 again);
// accumulated in fp32 the sum is 1 + 2^-7, which bf16 holds exactly.
TEST(SharedMemory, Bf16SumsAccumulateInFp32) {
  expect_all_ok(run_threads(3, [](Rank& r) {
    auto group = new_gloo_group(r.store, r.rank, r.world, small_slots());
    const double mine = r.rank == 0 ? 1.0 : 1.0 / 256;
    at::Tensor tensor = at::full({3000}, mine, at::kBFloat16);
    group->all_reduce(tensor, {.timeout = kOpTimeout})->wait();
    expect_bitwise(tensor, at::full({3000}, 1.0 + 1.0 / 128, at::kBFloat16), "all_reduce");
    at::Tensor input = at::full({3000}, mine, at::kBFloat16);
    at::Tensor output = at::zeros({1000}, at::kBFloat16);
    group->reduce_scatter(output, input, {.timeout = kOpTimeout})->wait();
    expect_bitwise(output, at::full({1000}, 1.0 + 1.0 / 128, at::kBFloat16), "reduce_scatter");
    // The same numbers summed in bf16 at every step would give 1.0.
    const at::Tensor one = at::full({1}, 1.0, at::kBFloat16);
    const at::Tensor step = at::full({1}, 1.0 / 256, at::kBFloat16);
    EXPECT_EQ(((one + step) + step).item<float>(), 1.0f);
  }));
}

TEST(SharedMemory, GroupsOnOneHostUseItTheOptionTurnsItOffAndNoSegmentIsLeft) {
  expect_all_ok(run_threads(2, [](Rank& r) {
    auto shm = new_gloo_group(r.store, r.rank, r.world, small_slots());
    GlooOptions tcp_options = small_slots();
    tcp_options.shared_memory = false;
    tcp_options.name = "tcp";
    auto tcp = new_gloo_group(r.store, r.rank, r.world, tcp_options);
    EXPECT_EQ(gloo_transport(*shm), "shared memory");
    EXPECT_EQ(gloo_transport(*tcp), "tcp");
    auto sub = shm->new_subgroup({0, 1});
    EXPECT_EQ(gloo_transport(*sub), "shared memory");
    // Connected groups have unlinked their segments: the mappings alone hold the memory.
    EXPECT_EQ(internal::shared_memory_segments(::getpid()), std::vector<std::string>{});
    at::Tensor a = at::full({5}, r.rank + 1.0);
    at::Tensor b = a.clone();
    shm->all_reduce(a, {.timeout = kOpTimeout})->wait();
    tcp->all_reduce(b, {.timeout = kOpTimeout})->wait();
    expect_bitwise(a, b, "both paths");
  }));
}

// Ranks that issue different collectives meet in the segment: both fail at once, well inside
// the op's 20 s timeout, instead of mixing their data.
TEST(SharedMemory, DivergedRanksFailAtOnceAndTheGroupStaysBroken) {
  expect_all_ok(run_threads(2, [](Rank& r) {
    auto group = new_gloo_group(r.store, r.rank, r.world, small_slots());
    at::Tensor tensor = at::ones({r.rank == 0 ? 7 : 8});
    const Clock::time_point start = Clock::now();
    try {
      group->all_reduce(tensor, {.timeout = kOpTimeout})->wait();
      ADD_FAILURE() << "diverged all_reduce succeeded";
    } catch (const CommError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("all_reduce #1"), std::string::npos) << what;
      EXPECT_NE(what.find("issued a different collective"), std::string::npos) << what;
      EXPECT_NE(what.find("rank " + std::to_string(1 - r.rank)), std::string::npos) << what;
    }
    EXPECT_LT(Clock::now() - start, milliseconds(5000));
    try {
      group->barrier({.timeout = kOpTimeout})->wait();
      ADD_FAILURE() << "an op after the divergence succeeded";
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find("broken"), std::string::npos) << e.what();
    }
  }));
}

// A rank that destroys its group while a peer waits for it: the peer's op is a CommError
// naming it, at once rather than at the deadline.
TEST(SharedMemory, APeerThatLeavesFailsTheWaitingRankNamingIt) {
  expect_all_ok(run_threads(2, [](Rank& r) {
    auto group = new_gloo_group(r.store, r.rank, r.world, small_slots());
    wait_until_every_rank_has_its_group(r);
    if (r.rank == 1) {
      group.reset();
      r.store.set("left", "1");
      return;
    }
    r.store.get("left", kOpTimeout);
    expect_all_reduce_fails_at_once(*group, {"rank 1 (pid ", "left the group"});
  }));
}

// A creator killed between creating its segment and unlinking it leaves the segment behind;
// the next group created on the host removes it, and leaves a live process's segment alone.
TEST(SharedMemory, TheNextGroupRemovesTheSegmentOfADeadCreator) {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);  // a pid that no process holds now
  const std::string stale = "loom-shm-" + std::to_string(child) + "-stale";
  const std::string live = "loom-shm-" + std::to_string(::getpid()) + "-live";
  for (const std::string& name : {stale, live}) {
    const int fd = ::shm_open(("/" + name).c_str(), O_CREAT | O_RDWR, 0600);
    ASSERT_GE(fd, 0) << name;
    ::close(fd);
  }
  ASSERT_EQ(internal::shared_memory_segments(child), std::vector<std::string>{stale});
  expect_all_ok(
      run_threads(2, [](Rank& r) { new_gloo_group(r.store, r.rank, r.world, small_slots()); }));
  EXPECT_EQ(internal::shared_memory_segments(child), std::vector<std::string>{});
  EXPECT_EQ(internal::shared_memory_segments(::getpid()), std::vector<std::string>{live});
  ::shm_unlink(("/" + live).c_str());
}

}  // namespace
}  // namespace loom::comm

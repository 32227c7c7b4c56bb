// The Gloo backend with ranks as threads: every op x dtype x world size against the libtorch
// reference, subgroups, ordering, argument checks, and the timeout and flight-dump paths.

#include "loom/comm/gloo.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "harness/harness.h"
#include "loom/comm/flight_recorder.h"
#include "loom/error.h"
#include "unit/comm/collective_reference.h"

namespace loom::comm {
namespace {

using loom::testing::expect_all_ok;
using loom::testing::Rank;
using loom::testing::run_threads;
using std::chrono::milliseconds;
namespace ref = loom::testing::collectives;

// Generous: a healthy op takes microseconds; this only bounds a broken test.
constexpr milliseconds kOpTimeout{20000};

GlooOptions quick_options(const std::string& name = "world", bool shared_memory = true) {
  GlooOptions options;
  options.name = name;
  options.shared_memory = shared_memory;
  options.connect_timeout = std::chrono::seconds(20);
  return options;
}

// Expects `call` to throw E with a message containing every one of `parts`.
template <typename E, typename F>
void expect_throw_naming(F&& call, const std::vector<std::string>& parts) {
  try {
    call();
    ADD_FAILURE() << "expected an exception naming " << ::testing::PrintToString(parts);
  } catch (const E& e) {
    for (const std::string& part : parts) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
          << "'" << part << "' missing from: " << e.what();
    }
  }
}

// (world size, shared memory): both paths of the backend, since ranks as threads share a host.
class GlooGroupWorld : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(GlooGroupWorld, EveryOpAndDtypeMatchesReference) {
  const auto [world, shared_memory] = GetParam();
  expect_all_ok(run_threads(world, [shared_memory = shared_memory](Rank& r) {
    GlooOptions options = quick_options();
    options.shared_memory = shared_memory;
    auto group = new_gloo_group(r.store, r.rank, r.world, options);
    ASSERT_EQ(gloo_transport(*group), shared_memory ? "shared memory" : "tcp");
    int salt = 0;
    for (at::ScalarType dtype : ref::kAllDtypes) {
      for (int64_t n : {0, 1, 7, 33}) ref::check_ops(*group, dtype, n, ++salt, kOpTimeout);
    }
  }));
}

INSTANTIATE_TEST_SUITE_P(Gloo, GlooGroupWorld,
                         ::testing::Combine(::testing::Values(2, 3, 4), ::testing::Bool()));

TEST(GlooGroup, LargeUnevenSumUsesManySegments) {
  // 1000003 floats are 4 MB: several of gloo's 1 MB segments (and of the shared-memory
  // path's slots), and not divisible by 3. Both paths.
  for (bool shared_memory : {false, true}) {
    expect_all_ok(run_threads(3, [shared_memory](Rank& r) {
      auto group = new_gloo_group(r.store, r.rank, r.world, quick_options("world", shared_memory));
      const int64_t n = 1000003;
      const std::vector<at::Tensor> inputs = ref::inputs_of_all_ranks(at::kFloat, n, r.world, 5);
      const at::Tensor expected = ref::reference_reduce(inputs, ReduceOp::kSum);
      at::Tensor tensor = inputs[r.rank].clone();
      group->all_reduce(tensor, {.timeout = kOpTimeout})->wait();
      EXPECT_TRUE(tensor.equal(expected));

      const ShardRange shard = shard_range(n, r.world, r.rank);
      at::Tensor shard_out = at::empty({shard.size()}, at::kFloat);
      group->reduce_scatter(shard_out, inputs[r.rank], {.timeout = kOpTimeout})->wait();
      EXPECT_TRUE(shard_out.equal(expected.narrow(0, shard.begin, shard.size())));
    }));
  }
}

// The ring reduce-scatter on random floats, against an fp64 sum of the ranks' inputs: the
// ring adds the W inputs of a chunk in ring order, so each element is a float sum of W terms,
// within W float roundings of the exact sum: |error| <= W * 2^-24 * sum |x_r| per element.
// Uneven sizes (n not a multiple of W, n < W: empty chunks) and W = 2..4. Over TCP: the ring
// is the path groups that span hosts take (shm_collectives_test.cpp checks the other one).
TEST(GlooGroup, RingReduceScatterOfRandomFloatsIsWithinRoundingOfTheExactSum) {
  for (int world : {2, 3, 4}) {
    expect_all_ok(run_threads(world, [](Rank& r) {
      auto group = new_gloo_group(r.store, r.rank, r.world, quick_options("world", false));
      for (int64_t n : {int64_t{1}, int64_t{3}, int64_t{1001}, int64_t{262147}}) {
        std::vector<at::Tensor> inputs;
        for (int q = 0; q < r.world; ++q) {
          auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * n + q);
          inputs.push_back(at::randn({n}, gen));
        }
        at::Tensor exact = at::zeros({n}, at::kDouble);
        at::Tensor magnitude = at::zeros({n}, at::kDouble);
        for (const at::Tensor& x : inputs) {
          exact += x.to(at::kDouble);
          magnitude += x.to(at::kDouble).abs();
        }
        const ShardRange shard = shard_range(n, r.world, r.rank);
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
          at::Tensor out = at::empty({shard.size()}, at::kFloat);
          group->reduce_scatter(out, inputs[r.rank], {.op = op, .timeout = kOpTimeout})->wait();
          const double divisor = op == ReduceOp::kAvg ? r.world : 1.0;
          const at::Tensor want = exact.narrow(0, shard.begin, shard.size()) / divisor;
          const at::Tensor bound =
              magnitude.narrow(0, shard.begin, shard.size()) / divisor * (r.world + 1) * 0x1p-24;
          EXPECT_TRUE((out.to(at::kDouble) - want).abs().le(bound).all().item<bool>())
              << "n=" << n << " W=" << r.world << " op=" << to_string(op);
        }
      }
    }));
  }
}

// bf16 reduce-scatter accumulates in fp32 and rounds once: 1 + 3 * 2^-8 summed in bf16 one
// term at a time stays 1 (each 1 + 2^-8 rounds back to 1), in fp32 it is exact and rounds to
// 1 + 2^-6 (a tie between 1 + 2^-7 and 1 + 2^-6, to even). Over TCP (the ring).
TEST(GlooGroup, Bf16ReduceScatterAccumulatesInFp32) {
  expect_all_ok(run_threads(4, [](Rank& r) {
    auto group = new_gloo_group(r.store, r.rank, r.world, quick_options("world", false));
    const double value = r.rank == 0 ? 1.0 : 0x1p-8;
    const at::Tensor input = at::full({8}, value, at::kBFloat16);
    at::Tensor out = at::empty({2}, at::kBFloat16);
    group->reduce_scatter(out, input, {.timeout = kOpTimeout})->wait();
    EXPECT_TRUE(out.equal(at::full({2}, 1.0 + 0x1p-6, at::kBFloat16))) << out;
    at::Tensor sequential = at::full({1}, 1.0, at::kBFloat16);
    for (int q = 1; q < 4; ++q) sequential += at::full({1}, 0x1p-8, at::kBFloat16);
    EXPECT_EQ(sequential.item<float>(), 1.0f);  // what bf16 accumulation would have given
  }));
}

TEST(GlooGroup, OpsCompleteInIssueOrderWithConsecutiveSequences) {
  expect_all_ok(run_threads(3, [](Rank& r) {
    auto group = new_gloo_group(r.store, r.rank, r.world, quick_options());
    std::vector<at::Tensor> tensors;
    std::vector<WorkPtr> works;
    for (int i = 0; i < 40; ++i) {
      tensors.push_back(at::full({5}, r.rank + i, at::kLong));
      works.push_back(group->all_reduce(tensors.back(), {.timeout = kOpTimeout}));
    }
    for (int i = 39; i >= 0; --i) {
      works[i]->wait();
      EXPECT_EQ(works[i]->sequence(), static_cast<uint64_t>(i + 1));
      EXPECT_TRUE(tensors[i].equal(at::full({5}, 0 + 1 + 2 + 3 * i, at::kLong))) << i;
    }
    const std::vector<FlightEntry> entries = group->flight_recorder().snapshot();
    ASSERT_EQ(entries.size(), 40u);
    EXPECT_EQ(entries.back().op, "all_reduce");
    EXPECT_EQ(entries.back().dtype, "int64");
    EXPECT_EQ(entries.back().state, OpState::kCompleted);
  }));
}

TEST(GlooGroup, SendRecvMatchByTagWhateverThePostingOrder) {
  expect_all_ok(run_threads(2, [](Rank& r) {
    auto group = new_gloo_group(r.store, r.rank, r.world, quick_options());
    if (r.rank == 0) {
      const at::Tensor one = at::full({3}, 1.0f);
      const at::Tensor two = at::full({1000}, 2.0f);
      WorkPtr first = group->send(one, 1, {.tag = 1, .timeout = kOpTimeout});
      WorkPtr second = group->send(two, 1, {.tag = 2, .timeout = kOpTimeout});
      first->wait();
      second->wait();
    } else {
      at::Tensor two = at::zeros({1000});
      at::Tensor one = at::zeros({3});
      WorkPtr second = group->recv(two, 0, {.tag = 2, .timeout = kOpTimeout});
      WorkPtr first = group->recv(one, 0, {.tag = 1, .timeout = kOpTimeout});
      second->wait();
      first->wait();
      EXPECT_TRUE(one.equal(at::full({3}, 1.0f)));
      EXPECT_TRUE(two.equal(at::full({1000}, 2.0f)));
    }
    group->barrier({.timeout = kOpTimeout})->wait();
  }));
}

// A transfer completes when it is done, not after the ones posted before it: rank 0's send
// of `a` can only complete once rank 1 posts its recv, which rank 1 does only after rank 0 has
// seen its recv of `b` complete (a pipeline's activations one way and gradients the other).
// Collectives after unequal numbers of transfers still match (their tags count collectives).
TEST(GlooGroup, TransfersCompleteInAnyOrderAndCollectivesMatchAfterUnequalTransfers) {
  expect_all_ok(run_threads(2, [](Rank& r) {
    auto group = new_gloo_group(r.store, r.rank, r.world, quick_options());
    if (r.rank == 0) {
      const at::Tensor a = at::full({1000}, 1.0f);
      at::Tensor b = at::zeros({10});
      WorkPtr sent = group->send(a, 1, {.tag = 1, .timeout = kOpTimeout});
      group->recv(b, 1, {.tag = 2, .timeout = kOpTimeout})->wait();
      EXPECT_FALSE(sent->is_completed());  // rank 1 has not posted its recv of a yet
      r.store.set("b_received", "1");
      sent->wait();
      EXPECT_TRUE(b.equal(at::full({10}, 2.0f)));
      group->send(a, 1, {.tag = 3, .timeout = kOpTimeout})->wait();
      // An empty send moves nothing and needs no recv, but takes a sequence number: rank 0
      // has now issued one op more than rank 1.
      group->send(at::zeros({0}), 1, {.tag = 4, .timeout = kOpTimeout})->wait();
    } else {
      group->send(at::full({10}, 2.0f), 0, {.tag = 2, .timeout = kOpTimeout})->wait();
      r.store.wait({"b_received"}, kOpTimeout);
      at::Tensor a = at::zeros({1000});
      group->recv(a, 0, {.tag = 1, .timeout = kOpTimeout})->wait();
      EXPECT_TRUE(a.equal(at::full({1000}, 1.0f)));
      at::Tensor again = at::zeros({1000});
      group->recv(again, 0, {.tag = 3, .timeout = kOpTimeout})->wait();
    }
    at::Tensor sum = at::full({2}, static_cast<float>(r.rank + 1));
    group->all_reduce(sum, {.timeout = kOpTimeout})->wait();
    EXPECT_TRUE(sum.equal(at::full({2}, 3.0f)));
  }));
}

TEST(GlooGroup, SubgroupsReduceIndependently) {
  expect_all_ok(run_threads(4, [](Rank& r) {
    auto world = new_gloo_group(r.store, r.rank, r.world, quick_options());
    const std::vector<int> members = r.rank % 2 == 0 ? std::vector<int>{2, 0}  // any order
                                                     : std::vector<int>{1, 3};
    for (int generation = 0; generation < 2; ++generation) {  // a second one gets fresh keys
      auto sub = world->new_subgroup(members);
      EXPECT_EQ(sub->size(), 2);
      EXPECT_EQ(sub->rank(), r.rank / 2);
      EXPECT_EQ(sub->name(), r.rank % 2 == 0 ? "world/sub[0,2]" : "world/sub[1,3]");
      at::Tensor tensor = at::full({4}, r.rank, at::kInt);
      sub->all_reduce(tensor, {.timeout = kOpTimeout})->wait();
      EXPECT_TRUE(tensor.equal(at::full({4}, r.rank % 2 == 0 ? 0 + 2 : 1 + 3, at::kInt)));
    }
    at::Tensor all = at::ones({2});
    world->all_reduce(all, {.timeout = kOpTimeout})->wait();
    EXPECT_TRUE(all.equal(at::full({2}, 4.0f)));
  }));
}

TEST(GlooGroup, SameNameTwiceInOneStoreConnectsAfresh) {
  expect_all_ok(run_threads(2, [](Rank& r) {
    for (int i = 0; i < 2; ++i) {
      auto group = new_gloo_group(r.store, r.rank, r.world, quick_options());
      at::Tensor tensor = at::ones({3});
      group->all_reduce(tensor, {.timeout = kOpTimeout})->wait();
      EXPECT_TRUE(tensor.equal(at::full({3}, 2.0f)));
    }
  }));
}

TEST(GlooGroup, BadArgumentsAreInvalidArgumentNamingOpDtypeAndShape) {
  InMemoryStore store;
  auto group = new_gloo_group(store, 0, 1, quick_options());
  at::Tensor bools = at::zeros({2, 3}, at::kBool);
  expect_throw_naming<InvalidArgument>([&] { group->all_reduce(bools); },
                                       {"all_reduce", "bool", "[2, 3]", "float32"});
  at::Tensor strided = at::zeros({4, 4}).t();
  expect_throw_naming<InvalidArgument>([&] { group->broadcast(strided); },
                                       {"broadcast", "non-contiguous", "[4, 4]"});
  at::Tensor ints = at::zeros({3}, at::kInt);
  expect_throw_naming<InvalidArgument>([&] { group->all_reduce(ints, {.op = ReduceOp::kAvg}); },
                                       {"all_reduce", "avg", "int32"});
  std::vector<at::Tensor> mixed = {at::zeros({2}), at::zeros({2}, at::kDouble)};
  expect_throw_naming<InvalidArgument>([&] { group->all_reduce_coalesced(mixed); },
                                       {"all_reduce_coalesced", "tensors[1]", "float64"});
  at::Tensor input = at::zeros({5});
  at::Tensor wrong = at::zeros({4});
  expect_throw_naming<InvalidArgument>([&] { group->all_gather(wrong, input); },
                                       {"all_gather", "output", "4 elements", "expected 5"});
  expect_throw_naming<InvalidArgument>([&] { group->reduce_scatter(wrong, input); },
                                       {"reduce_scatter", "output", "expected 5"});
  at::Tensor tensor = at::zeros({2});
  expect_throw_naming<InvalidArgument>([&] { group->broadcast(tensor, {.root = 1}); },
                                       {"broadcast", "root 1"});
  expect_throw_naming<InvalidArgument>([&] { group->send(tensor, 0); }, {"send", "this rank"});
  expect_throw_naming<InvalidArgument>([&] { group->new_subgroup({0, 0}); }, {"twice"});
  // Nothing was enqueued: the next op is #1 and the group still works.
  at::Tensor ok = at::full({2}, 3.0f);
  WorkPtr work = group->all_reduce(ok, {.op = ReduceOp::kAvg});
  work->wait();
  EXPECT_EQ(work->sequence(), 1u);
  EXPECT_TRUE(ok.equal(at::full({2}, 3.0f)));
}

TEST(GlooGroup, ConnectTimeoutNamesTheMissingRanks) {
  InMemoryStore store;
  GlooOptions options = quick_options("lonely");
  options.connect_timeout = milliseconds(300);
  expect_throw_naming<Timeout>([&] { new_gloo_group(store, 0, 3, options); },
                               {"'lonely'", "rank(s) [1, 2]", "300 ms"});
}

TEST(GlooGroup, WaitTimeoutNamesOpDumpsFlightAndBreaksTheGroup) {
  loom::testing::TempDir dumps("loom-flight");
  expect_all_ok(run_threads(2, [&](Rank& r) {
    GlooOptions options = quick_options();
    options.flight_dump_dir = dumps.path();
    auto group = new_gloo_group(r.store, r.rank, r.world, options);
    at::Tensor tensor = at::ones({3});
    group->all_reduce(tensor, {.timeout = kOpTimeout})->wait();  // #1, both ranks
    if (r.rank == 1) {
      // Never issues #2; leaves once rank 0 has seen its timeout (closing the connection).
      r.store.get("rank0_done", kOpTimeout);
      return;
    }
    WorkPtr stuck = group->all_reduce(tensor, {.timeout = kOpTimeout});
    expect_throw_naming<Timeout>([&] { stuck->wait(milliseconds(200)); },
                                 {"all_reduce #2", "'world'", "200 ms"});
    EXPECT_TRUE(std::filesystem::exists(dumps.path() / "rank_0.json"));
    r.store.set("rank0_done", "1");
    // The group is broken: the next op fails fast (once #2 has ended) and says why.
    expect_throw_naming<CommError>([&] { group->barrier({.timeout = kOpTimeout})->wait(); },
                                   {"barrier #3", "broken", "all_reduce #2 timed out"});
  }));
}

// An op that outlives its own timeout inside gloo, before anyone waits on it, is a Timeout
// too (not a CommError): gloo's deadline and the wait's race when both are the op's timeout.
TEST(GlooGroup, AnOpPastItsTimeoutBeforeTheWaitIsATimeout) {
  expect_all_ok(run_threads(2, [&](Rank& r) {
    auto group = new_gloo_group(r.store, r.rank, r.world, quick_options());
    if (r.rank == 1) {  // never issues the all-reduce; stays until rank 0 has seen the error
      r.store.get("rank0_done", kOpTimeout);
      return;
    }
    at::Tensor tensor = at::ones({3});
    WorkPtr stuck = group->all_reduce(tensor, {.timeout = milliseconds(200)});
    std::this_thread::sleep_for(milliseconds(800));  // gloo's 200 ms pass before the wait
    EXPECT_TRUE(stuck->is_completed());
    expect_throw_naming<Timeout>([&] { stuck->wait(milliseconds(5000)); },
                                 {"all_reduce #1", "timed out", "Timed out waiting"});
    r.store.set("rank0_done", "1");
  }));
}

}  // namespace
}  // namespace loom::comm

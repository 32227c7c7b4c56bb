// The Store contract, checked against every backend (InMemoryStore, FileStore, PrefixStore
// over each, and the coordinator's CoordinatorStore), plus what is particular to PrefixStore
// and FileStore.

#include "loom/comm/store.h"

#include <gtest/gtest.h>

#include <atomic>
#include <fstream>
#include <memory>
#include <thread>
#include <vector>

#include "harness/harness.h"
#include "loom/control/coordinator.h"
#include "loom/control/store.h"
#include "loom/error.h"

namespace loom::comm {
namespace {

using std::chrono::milliseconds;

// Short enough to keep the suite fast, long enough that a blocked get really waits.
constexpr milliseconds kShort{100};
constexpr milliseconds kLong{5000};

// Each fixture owns its store (and, for FileStore, the directory behind it).
struct InMemoryBackend {
  InMemoryStore store;
};

struct FileBackend {
  loom::testing::TempDir dir{"loom-store-test"};
  FileStore store{dir / "store"};
};

// The coordinator's gRPC key-value service (control/), which must keep the same contract.
struct CoordinatorBackend {
  control::Coordinator coordinator{{.token = "job-token"}};
  control::CoordinatorStore store{coordinator.address(), "job-token"};
};

template <typename Base>
struct PrefixBackend {
  Base base;
  PrefixStore store{"generation-1", base.store};
};

template <typename Backend>
class StoreTest : public ::testing::Test {
 protected:
  Store& store() { return backend_.store; }

 private:
  Backend backend_;
};

#if LOOM_WITH_GRPC
using Backends = ::testing::Types<InMemoryBackend, FileBackend, PrefixBackend<InMemoryBackend>,
                                  PrefixBackend<FileBackend>, CoordinatorBackend>;
#else
using Backends = ::testing::Types<InMemoryBackend, FileBackend, PrefixBackend<InMemoryBackend>,
                                  PrefixBackend<FileBackend> >;
#endif
TYPED_TEST_SUITE(StoreTest, Backends);

TYPED_TEST(StoreTest, SetThenGetReturnsTheValue) {
  this->store().set("answer", "42");
  EXPECT_EQ(this->store().get("answer", kShort), "42");
  this->store().set("answer", "43");
  EXPECT_EQ(this->store().get("answer", kShort), "43");
}

TYPED_TEST(StoreTest, GetBlocksUntilAnotherThreadSets) {
  std::thread setter([&] {
    std::this_thread::sleep_for(milliseconds(50));
    this->store().set("late", "value");
  });
  EXPECT_EQ(this->store().get("late", kLong), "value");
  setter.join();
}

TYPED_TEST(StoreTest, GetTimeoutNamesTheKey) {
  const auto start = std::chrono::steady_clock::now();
  try {
    this->store().get("never-set", milliseconds(50));
    FAIL() << "get of a missing key returned";
  } catch (const Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("never-set"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("50 ms"), std::string::npos) << e.what();
  }
  EXPECT_GE(std::chrono::steady_clock::now() - start, milliseconds(50));
}

TYPED_TEST(StoreTest, WaitTimeoutNamesOnlyTheMissingKeys) {
  this->store().set("present", "1");
  try {
    this->store().wait({"present", "absent-a", "absent-b"}, milliseconds(50));
    FAIL() << "wait for missing keys returned";
  } catch (const Timeout& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("absent-a"), std::string::npos) << message;
    EXPECT_NE(message.find("absent-b"), std::string::npos) << message;
    EXPECT_EQ(message.find("'present'"), std::string::npos) << message;
  }
}

TYPED_TEST(StoreTest, WaitReturnsOnceEveryKeyIsSet) {
  std::thread setter([&] {
    this->store().set("a", "");
    std::this_thread::sleep_for(milliseconds(30));
    this->store().set("b", "");
  });
  this->store().wait({"a", "b"}, kLong);
  EXPECT_TRUE(this->store().check({"a", "b"}));
  setter.join();
}

TYPED_TEST(StoreTest, AddFromManyThreadsSumsExactly) {
  constexpr int kThreads = 8;
  constexpr int kAddsPerThread = 100;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kAddsPerThread; ++i) this->store().add("counter", 1);
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(this->store().add("counter", 0), kThreads * kAddsPerThread);
  EXPECT_EQ(this->store().get("counter", kShort), std::to_string(kThreads * kAddsPerThread));
}

TYPED_TEST(StoreTest, AddStartsFromZeroAndReturnsTheNewValue) {
  EXPECT_EQ(this->store().add("n", 5), 5);
  EXPECT_EQ(this->store().add("n", -7), -2);
  EXPECT_EQ(this->store().get("n", kShort), "-2");
}

TYPED_TEST(StoreTest, AddOnANonIntegerIsInvalidArgument) {
  this->store().set("text", "12abc");
  EXPECT_THROW(this->store().add("text", 1), InvalidArgument);
  this->store().set("spaced", " 12");
  EXPECT_THROW(this->store().add("spaced", 1), InvalidArgument);
  EXPECT_EQ(this->store().get("text", kShort), "12abc");
}

TYPED_TEST(StoreTest, CompareSetReplacesOnlyOnAMatch) {
  // An absent key matches only an empty expected value.
  EXPECT_EQ(this->store().compare_set("leader", "someone", "rank0"), "");
  EXPECT_FALSE(this->store().check({"leader"}));
  EXPECT_EQ(this->store().compare_set("leader", "", "rank0"), "rank0");
  // A present key that does not match is left alone and returned.
  EXPECT_EQ(this->store().compare_set("leader", "", "rank1"), "rank0");
  EXPECT_EQ(this->store().compare_set("leader", "rank1", "rank2"), "rank0");
  EXPECT_EQ(this->store().compare_set("leader", "rank0", "rank1"), "rank1");
  EXPECT_EQ(this->store().get("leader", kShort), "rank1");
}

TYPED_TEST(StoreTest, CompareSetElectsExactlyOneWinner) {
  constexpr int kThreads = 8;
  std::atomic<int> winners{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const std::string me = "rank" + std::to_string(t);
      if (this->store().compare_set("leader", "", me) == me) ++winners;
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(winners.load(), 1);
}

TYPED_TEST(StoreTest, RemoveReportsWhetherTheKeyExisted) {
  this->store().set("gone", "soon");
  EXPECT_TRUE(this->store().remove("gone"));
  EXPECT_FALSE(this->store().remove("gone"));
  EXPECT_FALSE(this->store().check({"gone"}));
  EXPECT_THROW(this->store().get("gone", milliseconds(20)), Timeout);
}

TYPED_TEST(StoreTest, CheckNeverBlocks) {
  EXPECT_TRUE(this->store().check({}));
  EXPECT_FALSE(this->store().check({"x"}));
  this->store().set("x", "1");
  EXPECT_TRUE(this->store().check({"x"}));
  EXPECT_FALSE(this->store().check({"x", "y"}));
}

TYPED_TEST(StoreTest, ValuesAreBinarySafeAndKeysMayHoldSlashes) {
  const std::string binary("a\0b\xff\n\0", 6);
  const std::vector<std::string> keys = {
      "a/b/c", "/lead", "trail/", "..", ".lock", "sp ace", "a%2Fb%2Fc", std::string("nul\0key", 7)};
  for (const std::string& key : keys) this->store().set(key, binary + key);
  for (const std::string& key : keys) EXPECT_EQ(this->store().get(key, kShort), binary + key);
  EXPECT_FALSE(this->store().check({"a"}));
  EXPECT_FALSE(this->store().check({"a/b"}));
}

TEST(PrefixStore, NamespacesKeysInTheBaseStore) {
  InMemoryStore base;
  PrefixStore first("gen1", base);
  PrefixStore second("gen2", base);
  first.set("k", "one");
  second.set("k", "two");
  EXPECT_EQ(base.get("gen1/k", kShort), "one");
  EXPECT_EQ(base.get("gen2/k", kShort), "two");
  EXPECT_EQ(first.add("n", 3), 3);
  EXPECT_EQ(base.get("gen1/n", kShort), "3");
  EXPECT_FALSE(second.check({"n"}));
  try {
    second.wait({"n"}, milliseconds(20));
    FAIL() << "wait returned";
  } catch (const Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("gen2/n"), std::string::npos) << e.what();
  }
}

TEST(FileStore, ProcessesShareTheDirectoryThroughSeparateInstances) {
  loom::testing::TempDir dir;
  FileStore writer(dir / "store");
  FileStore reader(dir / "store");
  writer.set("k", "v");
  EXPECT_EQ(reader.get("k", kShort), "v");
  EXPECT_EQ(writer.add("n", 2), 2);
  EXPECT_EQ(reader.add("n", 2), 4);
}

TEST(FileStore, AKeyTooLongForAFileNameIsInvalidArgument) {
  loom::testing::TempDir dir;
  FileStore store(dir / "store");
  EXPECT_THROW(store.set(std::string(300, 'k'), "v"), InvalidArgument);
  store.set(std::string(200, 'k'), "v");
  EXPECT_EQ(store.get(std::string(200, 'k'), kShort), "v");
}

TEST(FileStore, AnUnusableDirectoryIsIoError) {
  loom::testing::TempDir dir;
  { std::ofstream(dir / "file") << "not a directory"; }
  EXPECT_THROW(FileStore(dir / "file" / "store"), IoError);
}

}  // namespace
}  // namespace loom::comm

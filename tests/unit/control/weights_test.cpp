// WeightPublisher and WeightSubscriber in one process: real segments in /dev/shm, real sockets
// on loopback. The processes, the 1,000-publish runs and the namespaces are in
// tests/integration/weights_test.cpp.
#include "loom/control/weights.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <torch/nn/modules/linear.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <thread>

#include "harness/harness.h"
#include "loom/comm/gloo.h"
#include "loom/error.h"
#include "loom/parallel/data_parallel.h"
#include "loom/parallel/fsdp.h"

namespace loom::control {
namespace {

using std::chrono::milliseconds;
using testing::contains;
using testing::error_of;

// A name no other test process uses.
std::string unique_name(const std::string& what) {
  return "test-" + what + "-" + std::to_string(::getpid());
}

std::map<std::string, at::Tensor> weights_of(int64_t version) {
  return {{"bias", at::full({3}, static_cast<double>(version), at::kDouble)},
          {"weight", at::arange(12, at::kFloat).reshape({3, 4}).add(version)},
          {"steps", at::full({}, version, at::kLong)}};
}

void expect_bitwise(const WeightVersion& got, int64_t version) {
  EXPECT_EQ(got.version, version);
  const auto expected = weights_of(version);
  ASSERT_EQ(got.tensors.size(), expected.size());
  for (const auto& [name, tensor] : expected) {
    const at::Tensor& t = got.tensors.at(name);
    EXPECT_EQ(t.scalar_type(), tensor.scalar_type()) << name;
    EXPECT_EQ(t.sizes(), tensor.sizes()) << name;
    EXPECT_EQ(std::memcmp(t.data_ptr(), tensor.data_ptr(), tensor.nbytes()), 0) << name;
  }
}

TEST(Weights, SubscribersReceiveTheNewestVersionOverSharedMemory) {
  WeightPublisher publisher(unique_name("shm"));
  EXPECT_EQ(publisher.segment_path(), "/dev/shm/loom-weights-" + unique_name("shm"));
  EXPECT_EQ(publisher.endpoint(), "");
  EXPECT_EQ(publisher.latest_version(), -1);
  WeightSubscriber first(unique_name("shm"));
  WeightSubscriber second(unique_name("shm"));
  publisher.publish(0, weights_of(0));
  publisher.publish(3, weights_of(3));
  EXPECT_TRUE(std::filesystem::exists(publisher.segment_path()));
  EXPECT_EQ(publisher.latest_version(), 3);
  expect_bitwise(first.latest(), 3);
  expect_bitwise(second.latest(-1), 3);
  EXPECT_EQ(error_of<Timeout>([&] { first.latest(3, milliseconds(50)); }),
            "weights \"" + unique_name("shm") +
                "\": no version newer than 3 within 50 ms (the newest is 3); is the trainer "
                "still publishing?");
  // A waiting subscriber wakes up for the next publish.
  std::thread later([&] {
    std::this_thread::sleep_for(milliseconds(50));
    publisher.publish(4, weights_of(4));
  });
  expect_bitwise(first.latest(3, milliseconds(10000)), 4);
  later.join();
}

TEST(Weights, LatestIntoReusesTensorsOfTheSameLayout) {
  WeightPublisher publisher(unique_name("into"));
  WeightSubscriber subscriber(unique_name("into"));
  publisher.publish(1, weights_of(1));
  WeightVersion version = subscriber.latest();
  const void* weight = version.tensors.at("weight").data_ptr();
  publisher.publish(2, weights_of(2));
  subscriber.latest_into(version, version.version);
  expect_bitwise(version, 2);
  EXPECT_EQ(version.tensors.at("weight").data_ptr(), weight);
  // A model's own parameters: the bytes land in them.
  std::map<std::string, at::Tensor> model = {{"bias", at::zeros({3}, at::kDouble)},
                                             {"weight", at::zeros({3, 4}, at::kFloat)},
                                             {"steps", at::zeros({}, at::kLong)}};
  WeightVersion into{.tensors = model};
  subscriber.latest_into(into);
  EXPECT_EQ(into.tensors.at("bias").data_ptr(), model.at("bias").data_ptr());
  EXPECT_EQ(model.at("steps").item<int64_t>(), 2);
}

TEST(Weights, TheLayoutIsFixedByTheFirstPublishAndVersionsIncrease) {
  const std::string name = unique_name("layout");
  WeightPublisher publisher(name);
  publisher.publish(1, weights_of(1));
  auto changed = weights_of(2);
  changed["weight"] = at::zeros({4, 3}, at::kFloat);
  EXPECT_EQ(error_of<InvalidArgument>([&] { publisher.publish(2, changed); }),
            "weights \"" + name +
                "\": tensor \"weight\" is float32 [3, 4] in the published layout and float32 "
                "[4, 3] here; the layout is fixed by the first publish: publish the same tensors, "
                "or another model under another name");
  EXPECT_EQ(error_of<InvalidArgument>([&] { publisher.publish(1, weights_of(1)); }),
            "weights \"" + name +
                "\": version 1 must be at least 0 and greater than the last one published (1)");
  // A non-contiguous view is published as its values.
  auto strided = weights_of(2);
  strided["weight"] = at::arange(12, at::kFloat).reshape({4, 3}).add(2).t();
  ASSERT_FALSE(strided["weight"].is_contiguous());
  publisher.publish(2, strided);
  WeightSubscriber subscriber(name);
  EXPECT_TRUE(at::equal(subscriber.latest().tensors.at("weight"), strided["weight"]));
}

TEST(Weights, BadNamesAndOptionsAreInvalidArguments) {
  EXPECT_TRUE(contains(error_of<InvalidArgument>([] { WeightPublisher("a/b"); }),
                       "weights name \"a/b\" must be 1 to 200 characters"));
  EXPECT_TRUE(contains(error_of<InvalidArgument>([] { WeightSubscriber("../x"); }),
                       "weights name \"../x\" must be 1 to 200 characters"));
  EXPECT_EQ(error_of<InvalidArgument>([] { WeightPublisher("ok", {.slots = 2}); }),
            "weights \"ok\": WeightPublisherOptions::slots is 2; it must be in [3, 64]");
  EXPECT_EQ(error_of<InvalidArgument>([] { WeightSubscriber("host:port"); }),
            "weights source \"host:port\" is not HOST:PORT with a port in [0, 65535]");
  EXPECT_TRUE(contains(
      error_of<IoError>([] { WeightPublisher(unique_name("bind"), {.listen = "10.255.255.1:1"}); }),
      "listen address 10.255.255.1:1 cannot be bound"));
}

TEST(Weights, AMissingPublisherIsATimeoutSayingWhatToDo) {
  WeightSubscriber subscriber(unique_name("missing"));
  EXPECT_EQ(error_of<Timeout>([&] { subscriber.latest(-1, milliseconds(30)); }),
            "weights \"" + unique_name("missing") +
                "\": no publisher within 30 ms: there is no /dev/shm/loom-weights-" +
                unique_name("missing") +
                " (a publisher creates it at its first publish). Start the publisher on this host "
                "under that name (a publisher on another host "
                "is reached as HOST:PORT, its endpoint())");
}

TEST(Weights, AClosedPublisherIsNamedAndItsSegmentRemoved) {
  const std::string name = unique_name("closed");
  auto publisher = std::make_unique<WeightPublisher>(name);
  const std::string path = publisher->segment_path();
  WeightSubscriber subscriber(name);
  publisher->publish(1, weights_of(1));
  expect_bitwise(subscriber.latest(), 1);
  publisher.reset();
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_EQ(error_of<Timeout>([&] { subscriber.latest(1, milliseconds(30)); }),
            "weights \"" + name + "\": no publisher within 30 ms: its publisher (pid " +
                std::to_string(::getpid()) +
                ") closed it. Start the publisher on this host under that name (a publisher on "
                "another host is reached as HOST:PORT, its endpoint())");
  // A new publisher under the name: the subscriber follows it.
  WeightPublisher again(name);
  again.publish(7, weights_of(7));
  expect_bitwise(subscriber.latest(1, milliseconds(5000)), 7);
}

TEST(Weights, ALiveNameIsRefusedNamingItsPid) {
  const std::string name = unique_name("live");
  WeightPublisher publisher(name);
  publisher.publish(0, weights_of(0));
  EXPECT_EQ(error_of<InvalidArgument>([&] { WeightPublisher second(name); }),
            "weights \"" + name + "\": /dev/shm/loom-weights-" + name +
                " belongs to a live publisher (pid " + std::to_string(::getpid()) +
                "); stop it, or give this publisher another name (WeightPublisher's name)");
}

// The publisher overwrites slots while a subscriber copies them: every version returned is
// whole (each tensor's values are its version), the torn ones retried.
TEST(Weights, TornReadsAreRetriedNeverReturned) {
  const std::string name = unique_name("torn");
  constexpr int64_t kVersions = 3000;
  constexpr int64_t kElements = 1 << 16;
  WeightPublisher publisher(name, {.slots = 3});
  WeightSubscriber subscriber(name);
  publisher.publish(0, {{"x", at::zeros({kElements}, at::kLong)}});
  std::thread writer([&] {
    at::Tensor x = at::empty({kElements}, at::kLong);
    for (int64_t v = 1; v <= kVersions; ++v) publisher.publish(v, {{"x", x.fill_(v)}});
  });
  WeightVersion got;
  int64_t received = 0;
  while (got.version < kVersions) {
    subscriber.latest_into(got, got.version, milliseconds(10000));
    const at::Tensor& x = got.tensors.at("x");
    ASSERT_EQ(x.min().item<int64_t>(), got.version);
    ASSERT_EQ(x.max().item<int64_t>(), got.version);
    ++received;
  }
  writer.join();
  EXPECT_GT(received, 1);
  std::printf("received %lld of %lld versions, %lld torn reads retried\n",
              static_cast<long long>(received), static_cast<long long>(kVersions),
              static_cast<long long>(subscriber.torn_reads()));
}

TEST(Weights, TcpSubscribersReceiveTheSameBytes) {
  const std::string name = unique_name("tcp");
  auto publisher =
      std::make_unique<WeightPublisher>(name, WeightPublisherOptions{.listen = "127.0.0.1:0"});
  const std::string endpoint = publisher->endpoint();
  EXPECT_EQ(endpoint.rfind("127.0.0.1:", 0), 0u) << endpoint;
  WeightSubscriber subscriber(endpoint);
  WeightSubscriber local(name);
  publisher->publish(5, weights_of(5));
  const WeightVersion over_tcp = subscriber.latest();
  expect_bitwise(over_tcp, 5);
  EXPECT_EQ(over_tcp.checksum, local.latest().checksum);
  EXPECT_EQ(error_of<Timeout>([&] { subscriber.latest(5, milliseconds(50)); }),
            "weights at " + endpoint +
                ": no version newer than 5 within 50 ms (the newest is 5); is the trainer still "
                "publishing?");
  std::thread later([&] {
    std::this_thread::sleep_for(milliseconds(50));
    publisher->publish(6, weights_of(6));
  });
  expect_bitwise(subscriber.latest(5, milliseconds(10000)), 6);
  later.join();
  publisher.reset();
  EXPECT_TRUE(contains(error_of<Timeout>([&] { subscriber.latest(6, milliseconds(100)); }),
                       "weights at " + endpoint + ": no publisher answered within 100 ms ("));
}

// Subscribers beyond max_connections are told so, and served once a connection closes.
TEST(Weights, SubscribersBeyondMaxConnectionsAreToldSo) {
  WeightPublisher publisher(unique_name("busy"), {.listen = "127.0.0.1:0", .max_connections = 1});
  publisher.publish(1, weights_of(1));
  auto first = std::make_unique<WeightSubscriber>(publisher.endpoint());
  expect_bitwise(first->latest(), 1);  // its connection stays open
  WeightSubscriber second(publisher.endpoint());
  EXPECT_EQ(error_of<Timeout>([&] { second.latest(-1, milliseconds(200)); }),
            "weights at " + publisher.endpoint() +
                ": no publisher answered within 200 ms (this publisher serves at most 1 "
                "subscribers at once (WeightPublisherOptions::max_connections); try again later). "
                "Is the publisher running with WeightPublisherOptions::listen, and is this its "
                "endpoint(), reachable from this host?");
  first.reset();
  expect_bitwise(second.latest(-1, milliseconds(10000)), 1);
}

// Under model parallelism a rank holds pieces: publishing them as the whole model is refused.
TEST(Weights, PublishParametersRefusesPiecesOfAModelParallelModel) {
  testing::expect_all_ok(testing::run_threads(1, [&](testing::Rank& r) {
    auto group = comm::new_gloo_group(r.store, r.rank, r.world);
    torch::nn::Sequential model(torch::nn::Linear(4, 8));
    parallel::DataParallelOptions options;
    options.model_parallel.tied = {{"0.weight", group.get()}};
    parallel::DataParallel dp(model.ptr(), *group, options);
    WeightPublisher publisher(unique_name("mp"));
    EXPECT_EQ(error_of<InvalidArgument>([&] { publish_parameters(dp, &publisher, 1); }),
              "publish_parameters gathers data-parallel shards only; under tensor or pipeline "
              "parallelism publish each model-parallel rank's own parameters (strategy.module()) "
              "under a name of its own");
  }));
}

// A listener that answers every connection with `reply` and closes.
class FakePeer {
 public:
  explicit FakePeer(std::string reply) : reply_(std::move(reply)) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd_, reinterpret_cast<sockaddr*>(&address), sizeof address);
    ::listen(fd_, 4);
    socklen_t length = sizeof address;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &length);
    port_ = ntohs(address.sin_port);
    thread_ = std::thread([this] {
      const int client = ::accept(fd_, nullptr, nullptr);
      if (client < 0) return;
      char buffer[256];
      (void)::recv(client, buffer, sizeof buffer, 0);
      (void)::send(client, reply_.data(), reply_.size(), MSG_NOSIGNAL);
      ::shutdown(client, SHUT_RDWR);
      ::close(client);
    });
  }
  ~FakePeer() {
    ::shutdown(fd_, SHUT_RDWR);
    ::close(fd_);
    thread_.join();
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }

 private:
  std::string reply_;
  int fd_ = -1;
  int port_ = 0;
  std::thread thread_;
};

TEST(Weights, HostileTcpRepliesAreCorruptDataBeforeAnythingIsAllocated) {
  {
    FakePeer peer("HTTP/1.1 200 OK\r\n\r\n");
    EXPECT_EQ(error_of<CorruptData>([&] { WeightSubscriber(peer.address()).latest(); }),
              "weights at " + peer.address() +
                  " did not answer with a Loom weights header (is it a Loom publisher?)");
  }
  {
    // 2^40 floats claimed: refused by max_bytes, not allocated.
    FakePeer peer(
        R"({"format": "loom-weights", "format_version": 1, "status": "ok", "latest": 1, )"
        R"("version": 1, "xxhash64": "0000000000000000", "bytes": 4398046511104, "tensors": )"
        R"([{"name": "w", "dtype": "float32", "shape": [1099511627776], "offset": 0, )"
        R"("bytes": 4398046511104}]})"
        "\n");
    EXPECT_EQ(error_of<CorruptData>(
                  [&] { WeightSubscriber(peer.address(), {.max_bytes = 1 << 20}).latest(); }),
              "weights at " + peer.address() +
                  ": version 1 has 4398046511104 bytes, more than "
                  "WeightSubscriberOptions::max_bytes (1048576)");
  }
  {
    // The right header, then bytes that are not the ones it hashed.
    FakePeer peer(R"({"format": "loom-weights", "format_version": 1, "status": "ok", "latest": 1, )"
                  R"("version": 1, "xxhash64": "0123456789abcdef", "bytes": 4, "tensors": )"
                  R"([{"name": "w", "dtype": "float32", "shape": [1], "offset": 0, "bytes": 4}]})"
                  "\nabcd");
    EXPECT_TRUE(contains(error_of<CorruptData>([&] { WeightSubscriber(peer.address()).latest(); }),
                         ": version 1 arrived with xxHash64 "));
  }
  {
    // The peer stops mid-version.
    FakePeer peer(R"({"format": "loom-weights", "format_version": 1, "status": "ok", "latest": 1, )"
                  R"("version": 1, "xxhash64": "0123456789abcdef", "bytes": 8, "tensors": )"
                  R"([{"name": "w", "dtype": "float32", "shape": [2], "offset": 0, "bytes": 8}]})"
                  "\nabcd");
    EXPECT_EQ(error_of<CommError>([&] { WeightSubscriber(peer.address()).latest(); }),
              "weights at " + peer.address() +
                  ": the publisher closed the connection after 4 of 8 bytes of version 1 (did it "
                  "stop?); ask again for the newest version");
  }
}

// FSDP's parameters are shards outside forward: publish_parameters gathers them (every rank
// calls it) and rank 0 publishes the whole model under the module's names; DataParallel's are
// whole on every rank.
TEST(Weights, PublishParametersSendsAStrategysWholeParameters) {
  at::set_num_threads(1);  // process-wide: ranks are threads
  for (const bool fsdp : {true, false}) {
    const std::string name = unique_name(fsdp ? "fsdp" : "ddp");
    testing::expect_all_ok(testing::run_threads(2, [&](testing::Rank& r) {
      comm::GlooOptions options;
      options.connect_timeout = std::chrono::seconds(20);
      auto group = comm::new_gloo_group(r.store, r.rank, r.world, options);
      options.name = "control";
      auto control = comm::new_gloo_group(r.store, r.rank, r.world, options);
      at::manual_seed(3);
      torch::nn::Sequential model(torch::nn::Linear(4, 8), torch::nn::Linear(8, 3));
      std::map<std::string, at::Tensor> expected;
      for (const auto& item : model->named_parameters()) {
        expected.emplace(item.key(), item.value().detach().clone());
      }
      std::unique_ptr<parallel::Strategy> strategy;
      if (fsdp) {
        EXPECT_EQ(parallel::wrap_modules<torch::nn::LinearImpl>(model), 2);
        strategy = std::make_unique<parallel::FullyShardedDataParallel>(model.ptr(), *group);
      } else {
        strategy = std::make_unique<parallel::DataParallel>(model.ptr(), *group, *control);
      }
      std::unique_ptr<WeightPublisher> publisher;
      if (r.rank == 0) publisher = std::make_unique<WeightPublisher>(name);
      publish_parameters(*strategy, publisher.get(), 1);
      if (r.rank != 0) return;
      const WeightVersion got = WeightSubscriber(name).latest();
      EXPECT_EQ(got.version, 1);
      ASSERT_EQ(got.tensors.size(), 4u);
      for (const auto& [key, tensor] : expected) {
        EXPECT_TRUE(at::equal(got.tensors.at(key), tensor)) << key;
      }
    }));
  }
}

}  // namespace
}  // namespace loom::control
